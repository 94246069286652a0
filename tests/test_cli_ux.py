"""The ``tiegrad`` command as people expect it: resume that says what it does, a stable
run handle, signals, the help, typo hints and logging flags (issues 20 and 22)."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from test_cli import TEXT, TINY, assert_one_line_error, tiegrad_cli

import tiegrad
from tiegrad.train import RunDir, read_metrics

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    """A finished 12-step run in ``runs/`` (so ``runs/latest`` names it)."""
    root = tmp_path_factory.mktemp("ux")
    (root / "text.txt").write_text(TEXT)
    args = ["train", "--text", "text.txt", "--steps", 12, "--eval-every", 6]
    args += ["--checkpoint-every", 6, "--sample-every", 6, *TINY]
    proc = tiegrad_cli(*args, cwd=root, check_rc=0)
    return root, proc


def test_a_new_run_is_runs_latest_and_sample_takes_it(finished):
    root, proc = finished
    latest = root / "runs" / "latest"
    assert latest.is_symlink() and (latest / "config.json").is_file()
    assert f"checkpoint: runs/{os.readlink(latest)}/" in proc.stdout
    assert proc.stdout.count("sample at step") == 2  # --sample-every 6 over 12 steps
    assert "ppl " in proc.stdout
    out = tiegrad_cli("sample", "--prompt", "def ", "--tokens", 10, cwd=root, check_rc=0)
    assert out.stdout.startswith("def ")
    greedy = [
        tiegrad_cli("sample", "--temperature", 0, "--seed", s, "--tokens", 12, cwd=root).stdout
        for s in (1, 2)
    ]
    assert greedy[0] == greedy[1]  # temperature 0 is greedy: the seed does not matter
    shown = tiegrad_cli("inspect", "runs/latest/checkpoints/best.safetensors", cwd=root)
    assert "1 tied slot," in shown.stdout


def test_resume_of_a_finished_run_says_so_and_how_to_extend_it(finished, tmp_path):
    root, _ = finished
    shutil.copytree(root / "runs", tmp_path / "runs", symlinks=True)
    shutil.copy(root / "text.txt", tmp_path)
    proc = tiegrad_cli("resume", "runs/latest", cwd=tmp_path, check_rc=0)
    assert "is finished: it reached step 12 of 12" in proc.stdout
    assert "--steps" in proc.stdout and "resolved configuration" not in proc.stdout
    assert_one_line_error(
        tiegrad_cli("resume", "runs/latest", "--steps", 5, cwd=tmp_path),
        "--steps 5 is below the step",
        "(12)",
    )
    proc = tiegrad_cli("resume", "--steps", 15, cwd=tmp_path, check_rc=0)  # the newest run
    assert proc.stdout.startswith("tiegrad resume: resolved configuration")
    assert "steps=15" in proc.stdout and "resumed from step 12" in proc.stdout
    assert (
        "done: 15 steps in " in proc.stdout and "(this process: 3 steps from step 12" in proc.stdout
    )
    steps = [r["step"] for r in read_metrics(tmp_path / "runs/latest/metrics.jsonl")]
    assert [s for s in steps if s > 12] == [13, 14, 15, 15]  # three steps and the final eval


def test_resume_of_an_early_stopped_run_says_so_and_how_to_continue_it(tmp_path):
    (tmp_path / "text.txt").write_text(TEXT)
    args = ["train", "--text", "text.txt", "--steps", 40, "--eval-every", 2, "--patience", 1]
    args += ["--lr", 5, "--min-lr", 5, "--clip-norm", 0, "--checkpoint-every", 40]  # diverges
    args += ["--sample-every", 0, "--run", "run", *TINY]
    proc = tiegrad_cli(*args, cwd=tmp_path, check_rc=0)
    assert "stopped early: 4 steps" in proc.stdout
    before = {p: p.read_bytes() for p in (tmp_path / "run").rglob("*") if p.is_file()}
    proc = tiegrad_cli("resume", "run", cwd=tmp_path, check_rc=0)
    assert "run run stopped early at step 4: no improvement in 1 evaluations" in proc.stdout
    assert "'tiegrad resume run --patience 2'" in proc.stdout
    assert "resolved configuration" not in proc.stdout
    assert {p: p.read_bytes() for p in (tmp_path / "run").rglob("*") if p.is_file()} == before
    proc = tiegrad_cli("resume", "run", "--patience", 2, cwd=tmp_path, check_rc=0)
    assert "resumed from step 4" in proc.stdout and "patience=2" in proc.stdout


def test_a_text_without_newlines_trains_and_samples(tmp_path):
    (tmp_path / "flat.txt").write_text("the quick brown fox jumps over the lazy dog " * 40)
    args = ["train", "--text", "flat.txt", "--steps", 4, "--eval-every", 2]
    args += ["--sample-every", 2, "--run", "run", *TINY]
    proc = tiegrad_cli(*args, cwd=tmp_path, check_rc=0)
    assert proc.stdout.count("sample at step") == 2
    out = tiegrad_cli("sample", "--run", "run", "--tokens", 5, cwd=tmp_path, check_rc=0)
    assert len(out.stdout.rstrip("\n")) == 5  # the default prompt left out
    assert_one_line_error(
        tiegrad_cli("sample", "--run", "run", "--prompt", "Quick", cwd=tmp_path),
        "--prompt 'Quick'",
        "character 'Q' is not in",
    )


@pytest.mark.parametrize("sig, code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_a_signal_checkpoints_and_the_summary_names_the_losses_steps(tmp_path, sig, code):
    (tmp_path / "text.txt").write_text(TEXT)
    args = ["train", "--text", "text.txt", "--steps", 100000, "--eval-every", 2]
    args += ["--checkpoint-every", 1000, "--run", "run", "--sample-every", 0, *TINY]
    proc = subprocess.Popen(
        [sys.executable, "-m", "tiegrad.cli", *map(str, args)],
        cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env=dict(os.environ, PYTHONUNBUFFERED="1"),
    )  # fmt: skip
    metrics = tmp_path / "run" / "metrics.jsonl"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and proc.poll() is None:
        if metrics.exists() and metrics.read_text().count("val_loss") >= 2:
            break
        time.sleep(0.05)
    proc.send_signal(sig)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == code, out + err
    assert "Traceback" not in err and f"{signal.Signals(sig).name}: finishing" in err
    latest = RunDir(tmp_path / "run").latest()
    step = int(latest.stem.split("_")[1])
    assert f"interrupted at step {step};" in out
    assert "last train loss: " in out and f"(step {step})" in out
    if step % 2:  # the last evaluation ran at an even step: the summary says which
        assert "final validation loss: " in out and f"at step {step - 1}" in out


INTERRUPTED_IMPORT = """
import signal, sys

class SigintOnNumpy:
    def find_spec(self, name, path=None, target=None):
        if name == "numpy":
            signal.raise_signal(signal.SIGINT)
        return None

sys.meta_path.insert(0, SigintOnNumpy())
import _tiegrad_launcher
sys.exit(_tiegrad_launcher.main())
"""


def _sigint(disposition):
    """A ``preexec_fn`` starting a child with SIGINT's ``disposition``, whatever this
    process's own is (a child inherits an ignored SIGINT, as under ``nohup pytest &``)."""
    return lambda: signal.signal(signal.SIGINT, disposition)


def test_ctrl_c_during_the_imports_exits_quietly_with_130(tmp_path):
    # SIGINT at its default, as a terminal starts the command: Python's own handler.
    proc = subprocess.run(
        [sys.executable, "-c", INTERRUPTED_IMPORT, "--version"],
        cwd=tmp_path, capture_output=True, text=True, timeout=60,
        preexec_fn=_sigint(signal.SIG_DFL),
    )  # fmt: skip
    assert proc.returncode == 130, proc.stderr
    assert proc.stderr == "tiegrad: aborted\n"


# The tests that send or raise SIGINT, each setting the dispositions it needs.
SIGINT_TESTS = [
    "tests/test_cli_ux.py::test_ctrl_c_during_the_imports_exits_quietly_with_130",
    "tests/test_cli_ux.py::test_a_signal_checkpoints_and_the_summary_names_the_losses_steps"
    f"[{int(signal.SIGINT)}-130]",
    "tests/test_trainer.py::test_sigint_finishes_the_step_and_checkpoints",
]


def test_the_sigint_tests_pass_in_a_suite_started_with_sigint_ignored(tmp_path):
    # ``nohup pytest &`` (or ``pytest &`` from a script) starts the suite with SIGINT
    # ignored, which its children inherit.
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-o", "addopts=", "-q", "-p", "no:cacheprovider",
         "--basetemp", str(tmp_path / "tmp"), *SIGINT_TESTS],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
        preexec_fn=_sigint(signal.SIG_IGN),
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"{len(SIGINT_TESTS)} passed" in proc.stdout, proc.stdout


def test_version_help_defaults_and_typo_hints(tmp_path):
    proc = tiegrad_cli("--version", cwd=tmp_path, check_rc=0)
    assert proc.stdout.strip() == f"tiegrad {tiegrad.__version__}"
    help_text = tiegrad_cli("train", "--help", cwd=tmp_path, check_rc=0).stdout
    assert "(default: -)" not in help_text and "(default: 1000)" in help_text
    assert "(default: 0.8)" in tiegrad_cli("sample", "--help", cwd=tmp_path).stdout
    assert_one_line_error(
        tiegrad_cli("train", "--stpes", 3, cwd=tmp_path),
        "unrecognized arguments: --stpes 3",
        "did you mean --steps?",
        "(see 'tiegrad train --help')",
    )
    (tmp_path / "job.toml").write_text('steps = "ten"\n')
    assert_one_line_error(
        tiegrad_cli("train", "--config", "job.toml", cwd=tmp_path), "expected an int", "steps"
    )


def test_an_unwritable_run_folder_names_the_folder_and_why(tmp_path):
    (tmp_path / "text.txt").write_text(TEXT)
    (tmp_path / "file").write_text("not a folder")
    assert_one_line_error(
        tiegrad_cli("train", "--text", "text.txt", "--run", "file/run", *TINY, cwd=tmp_path),
        "run folder 'file/run' cannot be created: Not a directory",
    )


def test_log_tensorboard_writes_event_files_beside_the_metrics(tmp_path):
    pytest.importorskip("tensorboardX")
    (tmp_path / "text.txt").write_text(TEXT)
    args = ["train", "--text", "text.txt", "--steps", 4, "--eval-every", 2]
    proc = tiegrad_cli(*args, "--log", "tensorboard", "--run", "run", *TINY, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert list((tmp_path / "run" / "tensorboard").glob("events.out.tfevents.*"))
    assert "tensorboard --logdir run/tensorboard" in proc.stdout


def test_a_short_run_warms_up_for_a_fraction_of_its_steps(tmp_path):
    (tmp_path / "text.txt").write_text(TEXT)
    tiny = [a for a in TINY if a not in ("--warmup-steps", "5")]
    proc = tiegrad_cli("train", "--text", "text.txt", "--steps", 30, *tiny, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert " warmup=2 " in proc.stdout  # 5% of 30 steps, not all of them
