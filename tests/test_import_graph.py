"""No import circles in ``src/tiegrad``: each layer imports only the layers below it.

The layers of docs/design.md form an order; a circle between two modules means neither can be read,
tested or moved without the other. The graph is built from the source with ``ast``: every
import counts, at module level, inside functions and under ``if TYPE_CHECKING:``, relative
or absolute, since a lazy or typing-only import is still a dependency of the reader.
``from pkg import name`` is an import of ``pkg.name`` where that is a module, of ``pkg``
otherwise; an import of a module's own ancestor package (``from .. import ops`` resolving
to ``tiegrad`` itself, say) does not count, since a package is entered before its modules.
"""

from __future__ import annotations

import ast
from collections.abc import Iterable, Mapping
from pathlib import Path

SRC = Path(__file__).resolve().parent.parent / "src"


def module_names(root: Path, package: str) -> dict[str, Path]:
    """``{dotted module name: file}`` of every ``.py`` file of ``root / package``."""
    names = {}
    for path in sorted((root / package).rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        names[".".join(parts)] = path
    return names


def _imported(node: ast.AST, module: str, is_package: bool, known: set[str]) -> Iterable[str]:
    """The known modules one import statement names, resolved from ``module``."""
    if isinstance(node, ast.Import):
        for alias in node.names:
            yield alias.name
        return
    if not isinstance(node, ast.ImportFrom):
        return
    if node.level:
        here = module.split(".") if is_package else module.split(".")[:-1]
        base_parts = here[: len(here) - (node.level - 1)]
        base = ".".join(base_parts + ([node.module] if node.module else []))
    else:
        base = node.module or ""
    for alias in node.names:
        full = f"{base}.{alias.name}"
        yield full if full in known else base


def import_graph(root: Path, package: str) -> dict[str, set[str]]:
    """``{module: modules of ``package`` it imports}``, ancestors and itself left out."""
    files = module_names(root, package)
    known = set(files)
    graph: dict[str, set[str]] = {}
    for module, path in files.items():
        is_package = path.name == "__init__.py"
        ancestors = {".".join(module.split(".")[:i]) for i in range(1, module.count(".") + 1)}
        edges = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
            for target in _imported(node, module, is_package, known):
                if target in known and target != module and target not in ancestors:
                    edges.add(target)
        graph[module] = edges
    return graph


def find_circles(graph: Mapping[str, Iterable[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted,
    sorted by their first module."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    circles: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                circles.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(circles)


def describe(circles: list[list[str]], graph: Mapping[str, Iterable[str]]) -> str:
    """One line per circle: its modules, then the imports between them."""
    lines = []
    for circle in circles:
        members = set(circle)
        edges = [f"{a} -> {b}" for a in circle for b in sorted(graph[a]) if b in members]
        lines.append(f"circle {' <-> '.join(circle)}: {'; '.join(edges)}")
    return "\n".join(lines)


def test_src_has_no_import_circles():
    graph = import_graph(SRC, "tiegrad")
    assert len(graph) > 50 and "tiegrad.nn.module" in graph  # the walk found the package
    circles = find_circles(graph)
    assert not circles, "import circles in src/tiegrad:\n" + describe(circles, graph)


def test_find_circles_names_every_module_of_a_circle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a", "e"}, "e": set(), "f": {"f"}}
    assert find_circles(graph) == [["a", "b", "c"]]
    assert find_circles({"a": {"b"}, "b": set(), "c": {"d"}, "d": {"c"}}) == [["c", "d"]]
    assert find_circles({"x": {"y"}, "y": {"z"}, "z": set()}) == []
    assert describe([["c", "d"]], {"c": {"d"}, "d": {"c"}}) == "circle c <-> d: c -> d; d -> c"


def _write(root: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")


def test_import_graph_resolves_every_import_form(tmp_path):
    _write(
        tmp_path,
        {
            "pkg/__init__.py": "from .low import f\n",
            "pkg/low.py": "import os\nfrom pkg import high\n",  # absolute, a module
            "pkg/high.py": (
                "from typing import TYPE_CHECKING\n"
                "if TYPE_CHECKING:\n    from .sub.leaf import T\n"
                "def g():\n    from . import low\n"  # function level, a module
            ),
            "pkg/sub/__init__.py": "from .leaf import T\nfrom .. import f\n",  # ancestor
            "pkg/sub/leaf.py": "from ..low import f\nfrom . import T2\nimport pkg.high\n",
        },
    )
    graph = import_graph(tmp_path, "pkg")
    assert graph == {
        "pkg": {"pkg.low"},
        "pkg.low": {"pkg.high"},
        "pkg.high": {"pkg.sub.leaf", "pkg.low"},
        "pkg.sub": {"pkg.sub.leaf"},
        "pkg.sub.leaf": {"pkg.low", "pkg.high"},
    }
    assert find_circles(graph) == [["pkg.high", "pkg.low", "pkg.sub.leaf"]]


def test_a_typing_only_or_lazy_import_back_is_a_circle(tmp_path):
    _write(
        tmp_path,
        {
            "pkg/__init__.py": "",
            "pkg/a.py": "from .b import B\n",
            "pkg/b.py": "def f():\n    from .a import A\n",
            "pkg/c.py": (
                "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .a import A\n"
            ),
        },
    )
    graph = import_graph(tmp_path, "pkg")
    assert find_circles(graph) == [["pkg.a", "pkg.b"]]
    assert "pkg.a -> pkg.b; pkg.b -> pkg.a" in describe(find_circles(graph), graph)
