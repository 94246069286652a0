"""The ``tiegrad`` command end to end, in subprocesses, plus its configuration layer."""

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import tiegrad
from tiegrad import ConfigError
from tiegrad.models import TiedLM
from tiegrad.train import RunDir, read_metrics
from tiegrad.train.config import DEFAULTS, parse_flat_toml, read_toml, resolve

TINY = [
    "--d-model", "16", "--layers", "1", "--heads", "2", "--seq-len", "16",
    "--batch-size", "4", "--eval-batches", "2", "--warmup-steps", "5", "--no-progress",
]  # fmt: skip
TEXT = "".join(f"def f{i}(x):\n    return x * {i % 7} + {i % 5}\n" for i in range(150))


def tiegrad_cli(*args, cwd, check_rc=None, **kw):
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    proc = subprocess.run(
        [sys.executable, "-m", "tiegrad.cli", *map(str, args)],
        cwd=cwd, capture_output=True, text=True, env=env, timeout=120, **kw,
    )  # fmt: skip
    if check_rc is not None:
        assert proc.returncode == check_rc, proc.stdout + proc.stderr
    return proc


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """One 30-step run shared by the tests that read its output."""
    root = tmp_path_factory.mktemp("cli")
    (root / "text.txt").write_text(TEXT)
    args = ["train", "--text", "text.txt", "--steps", 30, "--eval-every", 10]
    args += ["--checkpoint-every", 10, "--keep-last", 2, "--run", "run", *TINY]
    proc = tiegrad_cli(*args, cwd=root, check_rc=0)
    return root, proc


def assert_one_line_error(proc, *fragments):
    assert proc.returncode == 2, proc.stdout + proc.stderr
    err = proc.stderr.strip()
    assert "Traceback" not in proc.stderr
    assert len(err.splitlines()) == 1 and err.startswith("tiegrad: error: "), err
    for fragment in fragments:
        assert fragment in err


# -- train, sample, inspect, resume --------------------------------------------------------
def test_train_writes_checkpoints_metrics_and_plot(trained):
    root, proc = trained
    out = proc.stdout
    assert out.startswith("tiegrad train: resolved configuration")
    assert "TiedLM d_model=16 n_layers=1" in out and "steps=30" in out
    assert "final validation loss:" in out and "nats/char" in out
    assert "done: 30 steps" in out
    run = RunDir(root / "run")
    assert [s for s, _ in run.step_checkpoints()] == [20, 30]
    assert run.best_path.is_file()
    records = read_metrics(run.metrics_path)
    assert max(r["step"] for r in records) == 30
    assert [r["step"] for r in records if "val_loss" in r] == [10, 20, 30]
    assert run.csv_path.read_text().startswith("step,train_loss,val_loss")
    assert run.plot_path.read_bytes()[:4] == b"\x89PNG"
    config = json.loads(run.config_path.read_text())
    assert config["steps"] == 30 and config["vocab_table"]["kind"] == "char"


def test_sample_continues_the_prompt(trained):
    root, _ = trained
    proc = tiegrad_cli(
        "sample", "--run", "run", "--prompt", "def f", "--tokens", 25, cwd=root, check_rc=0
    )
    text = proc.stdout.rstrip("\n")
    assert text.startswith("def f") and len(text) == len("def f") + 25
    assert set(text) <= set(TEXT)
    again = tiegrad_cli(
        "sample", "--run", "run", "--prompt", "def f", "--tokens", 25, cwd=root, check_rc=0
    )
    assert again.stdout == proc.stdout  # the sampling seed fixes the text


def test_inspect_shows_the_tie(trained):
    root, _ = trained
    proc = tiegrad_cli("inspect", "run/checkpoints/best.safetensors", cwd=root, check_rc=0)
    assert "tie: embed.weight = lm_head.weight" in proc.stdout
    assert "AdamW" in proc.stdout


def test_resume_continues_the_step_count(trained, tmp_path):
    root, _ = trained
    copy = tmp_path / "run"
    shutil.copytree(root / "run", copy)
    (tmp_path / "text.txt").write_text(TEXT)
    proc = tiegrad_cli("resume", "run", "--steps", 40, cwd=tmp_path, check_rc=0)
    assert "resumed from step 30" in proc.stdout and "done: 40 steps" in proc.stdout
    steps = [r["step"] for r in read_metrics(copy / "metrics.jsonl") if "train_loss" in r]
    assert steps == list(range(1, 41))
    assert RunDir(copy).latest() == RunDir(copy).step_path(40)


def test_sigint_leaves_a_loadable_checkpoint_and_a_resume_hint(tmp_path):
    (tmp_path / "text.txt").write_text(TEXT)
    args = ["train", "--text", "text.txt", "--steps", 100000, "--eval-every", 1000]
    args += ["--checkpoint-every", 1000, "--run", "run", *TINY]
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    proc = subprocess.Popen(
        [sys.executable, "-m", "tiegrad.cli", *map(str, args)],
        cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
    )  # fmt: skip
    metrics = tmp_path / "run" / "metrics.jsonl"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and proc.poll() is None:
        if metrics.exists() and len(metrics.read_text().splitlines()) >= 3:
            break
        time.sleep(0.05)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, out + err
    assert "Traceback" not in err
    assert "resume with: tiegrad resume run" in out
    latest = RunDir(tmp_path / "run").latest()
    assert latest is not None
    config = json.loads((tmp_path / "run" / "config.json").read_text())
    model = TiedLM(len(config["vocab_table"]["chars"]), 16, 1, 2, 16)
    info = tiegrad.load(latest, model)
    step = info.extra["trainer"]["step"]
    assert step >= 3 and latest.name == f"step_{step:07d}.safetensors"


def files_of(folder):
    return {p: p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def test_a_refused_resume_changes_nothing(trained, tmp_path):
    root, _ = trained
    (tmp_path / "text.txt").write_text(TEXT)
    cut = tmp_path / "cut"  # the latest checkpoint lost its last bytes
    shutil.copytree(root / "run", cut)
    latest = RunDir(cut).latest()
    os.truncate(latest, latest.stat().st_size - 10)
    other = tmp_path / "other"  # the checkpoints are not of the configured model
    shutil.copytree(root / "run", other)
    config = json.loads((other / "config.json").read_text())
    (other / "config.json").write_text(json.dumps(dict(config, d_model=8)))
    for run, fragment in ((cut, latest.name), (other, "step_0000030")):
        before = files_of(run)
        proc = tiegrad_cli("resume", run.name, "--steps", 40, cwd=tmp_path)
        assert_one_line_error(proc, fragment)
        assert files_of(run) == before  # config.json included


# -- bad input: one line, exit code 2 ------------------------------------------------------
def test_missing_and_empty_text_files(tmp_path):
    assert_one_line_error(
        tiegrad_cli("train", "--text", "nope.txt", cwd=tmp_path), "nope.txt", "does not exist"
    )
    (tmp_path / "empty.txt").write_text("")
    assert_one_line_error(tiegrad_cli("train", "--text", "empty.txt", cwd=tmp_path), "is empty")


def test_unknown_config_key_and_negative_steps(tmp_path):
    (tmp_path / "bad.toml").write_text("steps = 10\nlearning_rate = 0.1\n")
    assert_one_line_error(
        tiegrad_cli("train", "--config", "bad.toml", cwd=tmp_path),
        "unknown config key 'learning_rate'",
        "bad.toml",
    )
    assert_one_line_error(tiegrad_cli("train", "--steps", "-3", cwd=tmp_path), "--steps", "-3")
    assert not (tmp_path / "runs").exists()


def test_run_folder_with_another_model(trained, tmp_path):
    root, _ = trained
    proc = tiegrad_cli(
        "train", "--text", "text.txt", "--steps", 5, "--run", "run",
        *TINY[:-1], "--d-model", "8", cwd=root,
    )  # fmt: skip
    assert_one_line_error(proc, "holds a checkpoint of another model", "d_model=16", "d_model=8")
    assert [s for s, _ in RunDir(root / "run").step_checkpoints()] == [20, 30]


def test_another_model_names_the_keys_that_differ_with_both_values(trained):
    root, _ = trained
    proc = tiegrad_cli(
        "train", "--text", "text.txt", "--steps", 5, "--run", "run", *TINY, "--dropout", "0.1",
        cwd=root,
    )  # fmt: skip
    assert_one_line_error(proc, "another model", "dropout=0.0", "dropout=0.1")
    assert "d_model" not in proc.stderr  # only the keys that differ


def test_bad_sample_and_inspect_arguments(trained, tmp_path):
    root, _ = trained
    assert_one_line_error(tiegrad_cli("sample", "--run", "nowhere", cwd=root), "no checkpoint")
    assert_one_line_error(
        tiegrad_cli("sample", "--run", "run", "--temperature", "-1", cwd=root), "--temperature"
    )
    junk = tmp_path / "junk.safetensors"
    junk.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json at all}")
    assert_one_line_error(tiegrad_cli("inspect", str(junk), cwd=root), "junk.safetensors")
    folder = tiegrad_cli("sample", "--checkpoint", "run", cwd=root)  # a folder, not a file
    assert_one_line_error(folder, "'run' does not exist or is not a file")


# -- configuration ------------------------------------------------------------------------
def test_resolve_layers_defaults_file_and_flags(tmp_path):
    cfg = tmp_path / "job.toml"
    cfg.write_text('steps = 50  # short\nlr = 1e-3\ntext = "data/input.txt"\n')
    config = resolve(cfg, {"steps": 70})
    assert config["steps"] == 70 and config["lr"] == 1e-3
    assert config["text"] == os.path.normpath(tmp_path / "data" / "input.txt")
    assert {k: v for k, v in config.items() if k not in ("steps", "lr", "text")} == {
        k: v for k, v in DEFAULTS.items() if k not in ("steps", "lr", "text")
    }


@pytest.mark.parametrize(
    "text, match",
    [
        ("steps = 0\n", "'steps'.*>= 1"),
        ("lr = 'fast'\n", "'lr'.*float"),
        ("vocab = 'word'\n", "one of"),
        ("d_model = 30\nn_heads = 4\n", "must divide"),
        ("[model]\nd_model = 8\n", "model"),
    ],
)
def test_bad_config_values(tmp_path, text, match):
    cfg = tmp_path / "c.toml"
    cfg.write_text(text)
    with pytest.raises(ConfigError, match=match):
        resolve(cfg)


def test_flat_toml_fallback_parser():
    raw = "# run\nsteps = 1_000\nlr = 3e-4\nprogress = false\nrun = 'runs/a#1'  # note\n"
    raw += 'text = "in\\"put.txt"\n'
    assert parse_flat_toml(raw, "x.toml") == {
        "steps": 1000, "lr": 3e-4, "progress": False, "run": "runs/a#1", "text": 'in"put.txt',
    }  # fmt: skip
    with pytest.raises(ConfigError, match="line 1"):
        parse_flat_toml("[model]\n", "x.toml")
    with pytest.raises(ConfigError, match="set twice"):
        parse_flat_toml("a = 1\na = 2\n", "x.toml")
    with pytest.raises(ConfigError, match="cannot read"):
        parse_flat_toml("a = [1, 2]\n", "x.toml")


def test_missing_config_file(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        read_toml(Path(tmp_path) / "none.toml")
