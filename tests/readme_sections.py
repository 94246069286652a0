"""Shared helper for tests that run one README section's example."""

from __future__ import annotations

import contextlib
import io
import re
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"


def section_text(section: str) -> str:
    """The section of README.md that starts at ``section``."""
    text = README.read_text()
    assert section in text, f"no {section!r} section in README.md"
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
