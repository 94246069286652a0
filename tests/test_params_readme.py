"""The tying-and-freezing README example runs and prints exactly what the README shows."""

from __future__ import annotations

from readme_sections import run_example, section_text

SECTION = "## Tying and freezing"


def test_readme_tying_example_runs_and_its_output_matches():
    text = section_text(SECTION).split("\n### ")[0]
    assert len(text.strip().splitlines()) < 30
    printed, shown = run_example(text, "readme_params")
    assert printed == shown


def test_readme_freeze_then_unfreeze_schedule_runs_and_its_output_matches():  # issue 16
    text = section_text("### Freezing during training")
    printed, shown = run_example(text, "readme_freezing")
    assert printed == shown
