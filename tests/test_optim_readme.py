"""The optimizer guide's example runs and prints exactly what the page shows."""

from __future__ import annotations

from readme_sections import run_example, section_text

PAGE = "docs/optimizers.md"
SECTION = "## Tied weights, clipping and schedules"


def test_readme_optimizer_example_runs_and_its_output_matches():
    text = section_text(SECTION, PAGE)
    printed, shown = run_example(text, "readme_optim")
    assert printed == shown
