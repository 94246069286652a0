"""``tiegrad resume`` and ``tiegrad train`` on run folders a crash or a hand left behind:
a damaged ``steps`` in ``config.json``, a folder holding only ``best.safetensors``, and
the configuration printed when ``--steps`` extends a run past its schedule; and (issue
52) a ``config.json`` edited to another model, another run's checkpoint, a crafted model
configuration in a checkpoint and damaged metrics files, each refused with the run
folder unchanged."""

from __future__ import annotations

import json
import shutil
import time

import pytest
from test_checkpoint_file import read_doc, write_doc
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


# -- issue 52: resume continues only the run it belongs to ----------------------------------
def edit_config(run, **changes):
    path = run / "config.json"
    path.write_text(json.dumps(dict(json.loads(path.read_text()), **changes)))


def run_ids(run) -> set:
    """The run ids of every checkpoint of ``run`` (``None`` for one without)."""
    return {read_doc(p)[1]["extra"].get("run_id") for p in (run / "checkpoints").iterdir()}


@pytest.fixture(scope="module")
def more_runs(tmp_path_factory):
    """Beside ``rs``'s kind of run: ``other``, a run of the same model and text (another
    run id); ``old`` and ``old_other``, runs made before run ids (none stored), the second
    on a text of as many symbols but another vocabulary."""
    root = tmp_path_factory.mktemp("resume_runs")
    (root / "text.txt").write_text(TEXT)
    (root / "other.txt").write_text(TEXT.replace("x", "Q"))  # 'Q' is not in TEXT
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(root)
        assert main([*TRAIN, "--run", "other", "--seed", "1"]) == 0
        mp.setattr("tiegrad.train.rundir.new_run_id", lambda: None)
        assert main([*TRAIN, "--run", "old"]) == 0
        assert main([*TRAIN, "--run", "old_other", "--text", "other.txt"]) == 0
    return root


@pytest.fixture
def runs(more_runs, work):
    """``work`` with the runs of ``more_runs`` beside ``rs``."""
    for name in ("other", "old", "old_other"):
        shutil.copytree(more_runs / name, work / name)
    return work


def test_a_new_run_stores_its_id_in_config_json_and_every_checkpoint(runs, capsys):
    run_id = json.loads((runs / "rs" / "config.json").read_text())["run_id"]
    assert len(run_id) == 32 and run_ids(runs / "rs") == {run_id}
    assert run_id != json.loads((runs / "other" / "config.json").read_text())["run_id"]
    code, out, err = cli(capsys, "resume", "rs", "--steps", 6)
    assert code == 0, err
    assert "note:" not in out
    assert json.loads((runs / "rs" / "config.json").read_text())["run_id"] == run_id
    assert run_ids(runs / "rs") == {run_id}  # step 6 and the new best keep it


@pytest.mark.parametrize(
    "key, value, named",
    [
        ("n_heads", 4, "n_heads (--heads) is 4 in config.json, 2 in the checkpoint"),
        ("d_model", 16, "d_model (--d-model) is 16 in config.json, 8 in the checkpoint"),
        ("seq_len", 16, "seq_len (--seq-len) is 16 in config.json, 8 in the checkpoint"),
        ("seed", 7, "seed (--seed) is 7 in config.json, 0 in the checkpoint"),
        ("dropout", 0.1, "dropout (--dropout) is 0.1 in config.json, 0.0 in the checkpoint"),
    ],
)
def test_a_config_json_edited_to_another_model_is_refused(runs, capsys, key, value, named):
    edit_config(runs / "rs", **{key: value})
    before = files_of(runs)
    assert_one_line_error(
        cli(capsys, "resume", "rs", "--steps", 6), "rs/config.json", "step_0000004", named
    )
    assert files_of(runs) == before


def test_the_differing_keys_are_named_up_to_three_then_counted(runs, capsys):
    edit_config(runs / "rs", n_heads=4, seed=3, mlp_ratio=2, dropout=0.2)
    err = assert_one_line_error(cli(capsys, "resume", "rs", "--steps", 6), "; and 1 more")
    assert err.count(" in config.json, ") == 3


def test_another_runs_checkpoint_of_the_same_shapes_is_refused(runs, capsys):
    latest = runs / "rs" / "checkpoints" / "step_0000004.safetensors"
    shutil.copy(runs / "other" / "checkpoints" / "step_0000004.safetensors", latest)
    ours = json.loads((runs / "rs" / "config.json").read_text())["run_id"]
    (theirs,) = run_ids(runs / "other")
    before = files_of(runs)
    assert_one_line_error(
        cli(capsys, "resume", "rs", "--steps", 6),
        "step_0000004.safetensors is another run's checkpoint",
        f"run_id is {theirs!r}",
        f"rs/config.json has {ours!r}",
    )
    assert files_of(runs) == before


@pytest.mark.parametrize("run_id", [None, "0" * 32, 17])
def test_a_config_json_without_its_run_id_or_with_another_is_refused(runs, capsys, run_id):
    config = runs / "rs" / "config.json"
    config.write_text(
        json.dumps({k: v for k, v in json.loads(config.read_text()).items() if k != "run_id"})
        if run_id is None
        else json.dumps(dict(json.loads(config.read_text()), run_id=run_id))
    )
    before = files_of(runs)
    assert_one_line_error(cli(capsys, "resume", "rs", "--steps", 6), "rs/config.json", "run_id")
    assert files_of(runs) == before


def test_a_run_made_before_run_ids_resumes_with_a_notice(runs, capsys):
    assert "run_id" not in json.loads((runs / "old" / "config.json").read_text())
    code, out, err = cli(capsys, "resume", "old", "--steps", 6)
    assert code == 0, err
    assert "note: run old has no run_id (it was made before run ids)" in out
    assert run_ids(runs / "old") == {None}  # it gets none: its older checkpoints have none
    assert [r["step"] for r in read_metrics(runs / "old" / "metrics.jsonl")][-1] == 6


def test_a_checkpoint_whose_vocabulary_is_another_runs_is_refused(runs, capsys):
    """Runs without ids: the vocabulary tells them apart (same symbol count, same shapes)."""
    latest = runs / "old" / "checkpoints" / "step_0000004.safetensors"
    shutil.copy(runs / "old_other" / "checkpoints" / "step_0000004.safetensors", latest)
    before = files_of(runs)
    assert_one_line_error(
        cli(capsys, "resume", "old", "--steps", 6),
        "old/config.json: vocab_table (the run's vocabulary, --vocab)",
        "is a 'char' vocabulary of 25 symbols, but the checkpoint "
        "old/checkpoints/step_0000004.safetensors was trained with a 'char' vocabulary of 25 "
        "symbols (they differ first at symbol 17: 'd' here, 'Q' in the checkpoint)",
    )
    assert files_of(runs) == before


def test_an_edited_vocab_kind_is_refused(runs, capsys):
    edit_config(runs / "rs", vocab="byte")
    before = files_of(runs)
    assert_one_line_error(
        cli(capsys, "resume", "rs", "--steps", 6),
        "vocab (--vocab) is 'byte'",
        "trained with a 'char' vocabulary",
    )
    assert files_of(runs) == before


@pytest.mark.parametrize(
    "change, named",
    [
        ({"n_layers": 10**9}, "implies 12000000005 slots"),
        ({"d_model": 4096, "n_heads": 2}, "parameters"),
        ({"vocab_size": 10**12}, "parameters"),
    ],
)
def test_a_crafted_model_config_in_the_checkpoint_is_refused_before_building(
    runs, capsys, monkeypatch, change, named
):
    """The stored model configuration is checked against the file's tensors (the header
    alone) before anything is built: a huge size is a quick, bounded error."""
    latest = runs / "rs" / "checkpoints" / "step_0000004.safetensors"
    tensors, doc = read_doc(latest)
    doc["extra"]["model"]["config"].update(change)
    write_doc(latest, tensors, doc)
    edit_config(runs / "rs", **{k: v for k, v in change.items() if k != "vocab_size"})
    built = []
    monkeypatch.setattr("tiegrad.train.job.build_model", lambda *a: built.append(a))
    before = files_of(runs)
    started = time.perf_counter()
    assert_one_line_error(cli(capsys, "resume", "rs", "--steps", 6), "step_0000004", named)
    assert time.perf_counter() - started < 5 and built == []
    assert files_of(runs) == before


def test_an_edited_schedule_is_the_checkpoints_with_a_notice(runs, capsys):
    """The checkpoint restores the schedule and the optimizer's settings: an edit of them
    in config.json is named with both values, and the printout and config.json say what
    the run does."""
    edit_config(runs / "rs", lr=0.5, min_lr=0.1, weight_decay=0.5)
    code, out, err = cli(capsys, "resume", "rs", "--steps", 6)
    assert code == 0, err
    assert (
        "note: a resumed run keeps the learning-rate schedule and optimizer settings of its "
        "checkpoint: lr 0.003 (0.5 in config.json), min_lr 0.0003 (0.1 in config.json), "
        "weight_decay 0.01 (0.5 in config.json)"
    ) in out
    assert " lr=0.003 min_lr=0.0003 warmup=2 weight_decay=0.01 " in out
    config = json.loads((runs / "rs" / "config.json").read_text())
    assert (config["lr"], config["min_lr"], config["weight_decay"]) == (0.003, 0.0003, 0.01)
    lrs = [r["lr"] for r in read_metrics(runs / "rs" / "metrics.jsonl") if "lr" in r]
    assert lrs[-2:] == [0.0003, 0.0003]


# -- issue 52: the metrics files lose nothing ------------------------------------------------
def test_a_damaged_early_csv_row_is_refused_with_its_line_and_nothing_is_cut(runs, capsys):
    csv = runs / "rs" / "metrics.csv"
    lines = csv.read_text().splitlines(keepends=True)
    csv.write_text(lines[0] + "1,0.5,oops\n" + "".join(lines[2:]))
    before = files_of(runs)
    assert_one_line_error(
        cli(capsys, "resume", "rs", "--steps", 6), "rs/metrics.csv: line 2 has 3 cells"
    )
    assert files_of(runs) == before  # steps 1-4 kept, metrics.jsonl not cut either


@pytest.mark.parametrize("step", ["1", None, 1.5, True, -1])
def test_a_wrong_typed_step_in_metrics_jsonl_is_refused_with_its_line(runs, capsys, step):
    jsonl = runs / "rs" / "metrics.jsonl"
    lines = jsonl.read_text().splitlines(keepends=True)
    lines[0] = json.dumps(dict(json.loads(lines[0]), step=step)) + "\n"
    jsonl.write_text("".join(lines))
    before = files_of(runs)
    assert_one_line_error(
        cli(capsys, "resume", "rs", "--steps", 6),
        f"rs/metrics.jsonl: line 1 has step {step!r}, expected an integer >= 0",
    )
    assert files_of(runs) == before
