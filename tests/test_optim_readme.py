"""The optimizer README example runs and prints exactly what the README shows."""

from __future__ import annotations

import contextlib
import io
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SECTION = "## Optimizers"


def section_text() -> str:
    """The section of README.md that starts at ``SECTION``."""
    text = (ROOT / "README.md").read_text()
    assert SECTION in text, f"no {SECTION!r} section in README.md"
    start = text.index(SECTION)
    end = text.find("\n## ", start + len(SECTION))
    return text[start : end if end != -1 else len(text)]


def test_readme_optimizer_example_runs_and_its_output_matches():
    text = section_text()
    code = re.search(r"```python\n(.*?)```", text, re.S).group(1)
    shown = re.search(r"```text\n(.*?)```", text, re.S).group(1)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(code, "readme_optim", "exec"), {})
    assert out.getvalue() == shown
