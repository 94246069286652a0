"""Trainer callbacks, TensorBoard event files, perplexity and plain progress lines."""

from __future__ import annotations

import io
import math

import pytest
from test_trainer import text_job

from tiegrad import ConfigError
from tiegrad.train import Callback, TensorBoardLogger, TextSample, read_metrics
from tiegrad.train.progress import Progress


class Recorder(Callback):
    def __init__(self, events: list, name: str = "cb") -> None:
        self.events = events
        self.name = name

    def on_train_begin(self, trainer):
        self.events.append((self.name, "begin", trainer.step))

    def on_step_end(self, trainer, logs):
        self.events.append((self.name, "step", logs["step"]))

    def on_eval(self, trainer, logs):
        self.events.append((self.name, "eval", logs["step"]))
        assert logs["val_ppl"] == pytest.approx(math.exp(logs["val_loss"]))

    def on_checkpoint(self, trainer, path):
        self.events.append((self.name, "checkpoint", path.name))

    def on_train_end(self, trainer, result):
        self.events.append((self.name, "end", result.step))


def test_callbacks_fire_in_order(tmp_path):
    events: list = []
    cbs = [Recorder(events, "a"), Recorder(events, "b")]
    trainer, _, _ = text_job(tmp_path, max_steps=4, eval_every=2, checkpoint_every=4, callbacks=cbs)
    result = trainer.fit()
    a = [e[1:] for e in events if e[0] == "a"]
    assert a == [
        ("begin", 0),
        ("step", 1),
        ("step", 2),
        ("eval", 2),
        ("checkpoint", "best.safetensors"),
        ("step", 3),
        ("step", 4),
        ("eval", 4),
        ("checkpoint", "best.safetensors"),
        ("checkpoint", "step_0000004.safetensors"),
        ("end", 4),
    ]
    assert [e[1:] for e in events if e[0] == "b"] == a
    assert events[:2] == [("a", "begin", 0), ("b", "begin", 0)]  # list order, hook by hook
    # the built-in metrics writer and plot are callbacks too: they ran around the user's
    assert result.metrics is not None and result.plot is not None
    records = read_metrics(result.metrics)
    assert [r["step"] for r in records if "val_ppl" in r] == [2, 4]


def test_a_callback_must_be_a_callback():
    with pytest.raises(ConfigError, match=r"callbacks\[0\] is a function"):
        text_job(callbacks=[lambda *a: None])


def test_text_sample_prints_at_its_steps(capsys):
    texts = []

    def generate(step):
        texts.append(step)
        return f"text {step}"

    trainer, _, _ = text_job(max_steps=4, eval_every=1, callbacks=[TextSample(generate, 2)])
    trainer.fit()
    assert texts == [2, 4]
    assert "sample at step 4: 'text 4'" in capsys.readouterr().out


def test_tensorboard_events_are_readable_by_tensorboard(tmp_path):
    pytest.importorskip("tensorboardX")
    event_accumulator = pytest.importorskip(
        "tensorboard.backend.event_processing.event_accumulator"
    )
    log_dir = tmp_path / "tb"
    trainer, _, _ = text_job(
        tmp_path / "run", max_steps=4, eval_every=2, callbacks=[TensorBoardLogger(log_dir)]
    )
    trainer.fit()
    acc = event_accumulator.EventAccumulator(str(log_dir))
    acc.Reload()
    tags = acc.Tags()["scalars"]
    assert {"train/loss", "train/lr", "val/loss", "val/perplexity"} <= set(tags)
    assert [e.step for e in acc.Scalars("train/loss")] == [1, 2, 3, 4]
    records = read_metrics(tmp_path / "run" / "metrics.jsonl")
    val = [r["val_loss"] for r in records if "val_loss" in r]
    assert [e.value for e in acc.Scalars("val/loss")] == pytest.approx(val, rel=1e-6)


def test_progress_off_a_terminal_is_plain_lines_every_n_steps():
    out = io.StringIO()
    progress = Progress(30, 0, "tokens", file=out)
    assert not progress.tty and progress.every == 3
    for _ in range(30):
        progress.update(2.5, 1e-3, 1000.0)
    progress.close()
    text = out.getvalue()
    assert "\r" not in text
    lines = text.splitlines()
    assert len(lines) == 10
    assert lines[0].startswith("step 3/30  loss 2.5000  lr 1.00e-03  1,000 tokens/s  eta ")
    assert lines[-1].startswith("step 30/30")


def test_progress_bar_says_the_first_step_compiles_and_estimates_after_it():
    out = io.StringIO()
    progress = Progress(10, 0, "tokens", file=out, tty=True)
    assert "compiling kernels (first run only)" in progress.bar.desc
    progress.update(2.5, 1e-3, 10.0)
    assert "compiling" not in progress.bar.desc and progress.bar.initial == 1
    progress.close()
