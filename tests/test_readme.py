"""Every Python example in the README runs as written and prints what the README shows;
its links lead to files of the repository."""

import re

import pytest
from readme_sections import README, ROOT, code_blocks, output_matches, run_block

BLOCKS = [b for b in code_blocks(README) if b.lang == "python"]


@pytest.mark.parametrize("block", BLOCKS, ids=[f"block{i}" for i in range(len(BLOCKS))])
def test_readme_example_runs(block, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    printed = run_block(block, {"__name__": "__readme__"}, str(README))
    if block.output is not None:
        assert output_matches(printed, block.output), printed


def test_the_readme_examples_show_their_output_and_stay_short():
    assert BLOCKS
    for example in BLOCKS:
        assert example.output is not None, example.line
        assert len(example.code.splitlines()) <= 30, example.line
    assert len(README.read_text().splitlines()) <= 250


def test_the_readme_links_lead_to_files_of_the_repository():
    links = re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", README.read_text())
    assert links
    missing = [link for link in links if not (ROOT / link).is_file()]
    assert not missing, missing
