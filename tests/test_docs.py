"""The docs site builds in strict mode, its API reference covers every public name, and
every Python example of the guides runs and prints what its page shows.

The blocks of one page run in order in one namespace, in a temporary working folder.
A block marked ``<!-- docs-test: REASON -->`` is not run here; ``NOT_RUN`` lists every
such block, so that a new one is a decision of the test, not of the page.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import re
import subprocess
import sys

import pytest
from readme_sections import DOCS, ROOT, code_blocks, docs_pages, output_matches, run_block

PAGES = docs_pages()
GUIDES = [page for page in PAGES if page.parent == DOCS]
REFERENCE = DOCS / "reference"

#: (page, marker) of every block the guides test does not run, with the reason.
NOT_RUN = {
    # 4 s of transformers and GPT-2: the test named runs this section and compares its output.
    ("pytorch-and-hugging-face.md", "run by tests/test_gpt2_hf.py"),
}


def _missing_docs_tools() -> str | None:
    """Why the site cannot be built here, or None (the ``test`` extra installs both)."""
    for module in ("mkdocs", "mkdocstrings_handlers.python"):
        try:
            found = importlib.util.find_spec(module) is not None
        except ModuleNotFoundError:
            found = False
        if not found:
            return f"{module} is not installed: pip install '.[docs]' (or '.[test]')"
    return None


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    """The site as ``mkdocs build --strict`` writes it (a warning fails the build)."""
    reason = _missing_docs_tools()
    if reason:
        pytest.skip(reason)
    out = tmp_path_factory.mktemp("site")
    proc = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return out


def test_every_page_is_in_the_navigation():
    on_disk = sorted(p.relative_to(DOCS) for p in DOCS.rglob("*.md"))
    assert sorted(p.relative_to(DOCS) for p in PAGES) == on_disk


def test_the_site_builds_in_strict_mode(site):
    for page in PAGES:
        built = page.relative_to(DOCS).with_suffix("")
        built = built.parent if built.name == "index" else built
        assert (site / built / "index.html").is_file(), built


def _documented_modules() -> list[str]:
    """The modules the reference pages render (``::: name`` lines)."""
    return [
        name
        for page in sorted(REFERENCE.glob("*.md"))
        for name in re.findall(r"^::: (\S+)$", page.read_text(), re.M)
    ]


def _module(name: str):
    """The module ``name``, or None where the reference renders an object of that path."""
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError:
        return None


def _public_names(module) -> list[str]:
    """``__all__``, or else the classes and functions the module defines without ``_``."""
    if hasattr(module, "__all__"):
        return list(module.__all__)
    return [
        name
        for name, obj in vars(module).items()
        if not name.startswith("_")
        and (inspect.isclass(obj) or inspect.isfunction(obj))
        and obj.__module__ == module.__name__
    ]


def test_the_reference_documents_every_public_name(site):
    documented = _documented_modules()
    packages = [
        "tiegrad",
        "tiegrad.nn",
        "tiegrad.optim",
        "tiegrad.checkpoint",
        "tiegrad.train",
        "tiegrad.data",
        "tiegrad.models",
        "tiegrad.ops",
        "tiegrad.interop",
        "tiegrad.distributed",
        "tiegrad.errors",
    ]
    assert set(packages) <= set(documented)
    html = "".join(p.read_text() for p in (site / "reference").rglob("index.html"))
    anchors = set(re.findall(r'id="(tiegrad[\w.]*)"', html))
    modules = {name: _module(name) for name in documented}
    modules = {name: module for name, module in modules.items() if module is not None}
    missing = []
    for name, module in modules.items():
        for public in _public_names(module):
            obj = getattr(module, public)
            if inspect.ismodule(obj):
                found = obj.__name__ in modules
            else:
                # Under a documented package, or where it is defined (a function that
                # shares its module's name, see reference/ops.md).
                found = f"{getattr(obj, '__module__', '')}.{getattr(obj, '__qualname__', '')}" in (
                    anchors
                ) or any(
                    f"{where}.{public}" in anchors and getattr(package, public, None) is obj
                    for where, package in modules.items()
                )
            if not found:
                missing.append(f"{name}.{public}")
    assert not missing, f"public names the API reference does not render: {missing}"


def test_the_blocks_not_run_here_are_the_listed_ones():
    marked = {
        (page.name, block.marker) for page in GUIDES for block in code_blocks(page) if block.marker
    }
    assert marked == NOT_RUN
    for page, marker in marked:
        test_file = re.fullmatch(r"run by (tests/\w+\.py)", marker)
        assert test_file, f"{page}: {marker!r} names no test that runs the block"
        text = (DOCS / page).read_text()
        (block,) = [b for b in code_blocks(DOCS / page) if b.marker == marker]
        heading = re.findall(r"^## .+$", text[: text.index(block.code)], re.M)[-1]
        # The named test reads the block's section (readme_sections.section_text).
        assert f'section_text("{heading}"' in (ROOT / test_file[1]).read_text(), heading


@pytest.mark.parametrize("page", GUIDES, ids=[p.stem for p in GUIDES])
def test_guide_examples_run_and_print_what_they_show(page, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    namespace = {"__name__": f"__docs_{page.stem.replace('-', '_')}__"}
    for block in code_blocks(page):
        if block.lang != "python" or block.marker:
            continue
        printed = run_block(block, namespace, str(page))
        if block.output is not None:
            assert output_matches(printed, block.output), (
                f"{page.name}, the block at line {block.line}, printed\n{printed}"
                f"where the page shows\n{block.output}"
            )
