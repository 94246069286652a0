"""The optimizer README example runs and prints exactly what the README shows."""

from __future__ import annotations

from readme_sections import run_example, section_text

SECTION = "## Optimizers"


def test_readme_optimizer_example_runs_and_its_output_matches():
    text = section_text(SECTION)
    printed, shown = run_example(text, "readme_optim")
    assert printed == shown
