"""The tying-and-freezing guide's examples run and print exactly what the page shows."""

from __future__ import annotations

from readme_sections import run_example, section_text

PAGE = "docs/tying-and-freezing.md"
SECTION = "## Ties and per-use freezing"


def test_readme_tying_example_runs_and_its_output_matches():
    text = section_text(SECTION, PAGE).split("\n### ")[0]
    assert len(text.strip().splitlines()) < 30
    printed, shown = run_example(text, "readme_params")
    assert printed == shown


def test_readme_freeze_then_unfreeze_schedule_runs_and_its_output_matches():  # issue 16
    text = section_text("### Freezing during training", PAGE)
    printed, shown = run_example(text, "readme_freezing")
    assert printed == shown
