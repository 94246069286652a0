"""Shared helpers for the tests that run the examples of README.md and of the docs pages.

A page's fenced blocks are read in order. A ```text block that follows a ```python
block with nothing but blank lines between is that block's output; a line ``...`` in
it stands for any number of printed lines. A block preceded by the line
``<!-- docs-test: REASON -->`` is not run by the docs test (REASON says why, e.g.
``run by tests/test_x.py``).
"""

from __future__ import annotations

import contextlib
import io
import re
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = ROOT / "docs"

_FENCE = re.compile(
    r"(?:^<!-- docs-test: (?P<marker>[^\n]+?) -->\n)?^```(?P<lang>\w*)\n(?P<body>.*?)^```$",
    re.S | re.M,
)


@dataclass(frozen=True)
class Block:
    """One fenced block: its language, its text, the page line of its first line of code,
    the text block that shows its output (or None) and its ``docs-test`` marker (or None)."""

    lang: str
    code: str
    line: int
    output: str | None
    marker: str | None


def page_path(path: str | Path) -> Path:
    """``path`` as given, or relative to the repository root."""
    path = Path(path)
    return path if path.is_absolute() else ROOT / path


def section_text(section: str, path: str | Path | None = None) -> str:
    """The section of ``path`` that starts at ``section``; without ``path``, of the one
    page among README.md and the docs pages that holds it."""
    if path is None:
        holders = [p for p in [README, *docs_pages()] if section in p.read_text()]
        assert len(holders) == 1, f"{section!r} is in {[p.name for p in holders]}, not one page"
        path = holders[0]
    path = page_path(path)
    text = path.read_text()
    assert section in text, f"no {section!r} section in {path.name}"
    start = text.index(section)
    end = text.find("\n## ", start + len(section))
    return text[start : end if end != -1 else len(text)]


def run_example(text: str, filename: str) -> tuple[str, str]:
    """Run the section's Python block; return (what it printed, the text block shown)."""
    code = re.search(r"```python\n(.*?)```", text, re.S).group(1)
    shown = re.search(r"```text\n(.*?)```", text, re.S).group(1)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(code, filename, "exec"), {})
    return out.getvalue(), shown


def code_blocks(path: str | Path) -> list[Block]:
    """Every fenced block of the page at ``path``, in order."""
    text = page_path(path).read_text()
    found = list(_FENCE.finditer(text))
    blocks = []
    for i, m in enumerate(found):
        following = found[i + 1] if i + 1 < len(found) else None
        shows_output = (
            m["lang"] == "python"
            and following is not None
            and following["lang"] == "text"
            and following["marker"] is None
            and not text[m.end() : following.start()].strip()
        )
        blocks.append(
            Block(
                lang=m["lang"],
                code=m["body"],
                line=text.count("\n", 0, m.start("body")) + 1,
                output=following["body"] if shows_output else None,
                marker=m["marker"],
            )
        )
    return blocks


def docs_pages() -> list[Path]:
    """The pages of the docs site in the order of ``mkdocs.yml``'s navigation."""
    config = (ROOT / "mkdocs.yml").read_text()
    nav = config[config.index("\nnav:") :]
    return [DOCS / name for name in re.findall(r"^\s*- .*?(\S+\.md)\s*$", nav, re.M)]


def output_matches(printed: str, shown: str) -> bool:
    """Whether ``printed`` is ``shown``, a line ``...`` of it matching any lines."""
    parts = [
        "(?:.*\n)*?" if line == "..." else re.escape(line) + "\n" for line in shown.splitlines()
    ]
    return re.fullmatch("".join(parts), printed) is not None


def run_block(block: Block, namespace: dict, filename: str) -> str:
    """Run ``block`` in ``namespace``; return what it printed. Tracebacks give the page's
    own line numbers."""
    out = io.StringIO()
    code = "\n" * (block.line - 1) + block.code
    with contextlib.redirect_stdout(out):
        exec(compile(code, filename, "exec"), namespace)
    return out.getvalue()
