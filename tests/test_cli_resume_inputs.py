"""``tiegrad resume`` and ``tiegrad train`` on run folders a crash or a hand left behind:
a damaged ``steps`` in ``config.json``, a folder holding only ``best.safetensors``, and
the configuration printed when ``--steps`` extends a run past its schedule."""

from __future__ import annotations

import json
import shutil

import pytest
from test_cli import TEXT, files_of
from test_untrusted_input import assert_one_line_error, cli

from tiegrad.cli import main
from tiegrad.train import read_metrics

#: a 4-step run, checkpointed at steps 2 and 4, warming up for half its steps (2)
TRAIN = [
    "train", "--text", "text.txt", "--steps", "4", "--checkpoint-every", "2",
    "--warmup-steps", "-1", "--warmup-ratio", "0.5", "--sample-every", "0",
    "--d-model", "8", "--layers", "1", "--heads", "2", "--seq-len", "8",
    "--batch-size", "2", "--eval-batches", "1", "--no-progress",
]  # fmt: skip


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A finished 4-step run ``rs`` (and its text) in a folder of its own."""
    root = tmp_path_factory.mktemp("resume_inputs")
    (root / "text.txt").write_text(TEXT)
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(root)
        assert main([*TRAIN, "--run", "rs"]) == 0
    return root


@pytest.fixture
def work(trained, tmp_path, monkeypatch):
    """A copy of the trained run folder, the current directory."""
    shutil.copytree(trained, tmp_path, dirs_exist_ok=True)
    monkeypatch.chdir(tmp_path)
    return tmp_path


@pytest.mark.parametrize("steps", ["ten", None, 2.5, True, -3])
def test_a_damaged_steps_in_config_json_is_an_error_naming_file_and_key(work, capsys, steps):
    config = work / "rs" / "config.json"
    config.write_text(json.dumps(dict(json.loads(config.read_text()), steps=steps)))
    before = files_of(work)
    for args in ([], ["--steps", 8]):  # the stored value is refused even when overridden
        err = assert_one_line_error(cli(capsys, "resume", "rs", *args), "'steps'")
        assert "rs/config.json" in err and repr(steps) in err
    assert files_of(work) == before


def test_a_run_folder_with_only_best_is_neither_resumed_nor_reused(work, capsys):
    for step in (work / "rs" / "checkpoints").glob("step_*.safetensors"):
        step.unlink()  # a crash before the first periodic checkpoint
    before = files_of(work)
    err = assert_one_line_error(
        cli(capsys, "resume", "rs"), "best.safetensors", "no periodic checkpoint", "move"
    )
    err = assert_one_line_error(
        cli(capsys, *TRAIN, "--run", "rs"), "best.safetensors", "no periodic checkpoint", "move"
    )
    assert "tiegrad resume" not in err  # not the circle back to 'resume'
    assert files_of(work) == before


def test_resume_with_more_steps_prints_the_schedule_the_run_keeps(work, capsys):
    code, out, err = cli(capsys, "resume", "rs", "--steps", 8)
    assert code == 0, err
    optim = next(line for line in out.splitlines() if line.startswith("  optim "))
    assert " warmup=2 " in optim  # the stored schedule's, not half of the new 8 steps
    assert "keeps its schedule of 4 steps (steps 5-8 at min_lr)" in optim
    assert "steps=8 " in out
    lrs = {r["step"]: r["lr"] for r in read_metrics(work / "rs" / "metrics.jsonl") if "lr" in r}
    assert [lrs[s] for s in range(5, 9)] == [0.0003] * 4  # what the line says
    code, out, err = cli(capsys, "resume", "rs", "--steps", 10)  # config.json says 8 now
    assert code == 0, err
    assert "keeps its schedule of 4 steps (steps 5-10 at min_lr)" in out


def test_resume_at_the_schedule_length_prints_no_note(work, capsys):
    (work / "rs" / "checkpoints" / "step_0000004.safetensors").unlink()  # back to step 2
    code, out, err = cli(capsys, "resume", "rs")
    assert code == 0, err
    assert " warmup=2 " in out and "keeps its schedule" not in out
