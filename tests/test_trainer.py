"""tiegrad.train: the Trainer loop, run folders, metrics, plots, resume and interrupts."""

import json
import math
import signal
import sys

import numpy as np
import pytest

import tiegrad
from tiegrad import CheckpointError, ConfigError
from tiegrad.data import ArrayDataset, DataLoader, TextDataset
from tiegrad.models import MLPClassifier, TiedLM
from tiegrad.optim import SGD, AdamW, total_norm
from tiegrad.optim.schedules import CosineWarmup
from tiegrad.train import MetricsWriter, RunDir, Trainer, plot_losses, read_metrics
from tiegrad.train import plot as plot_module

TEXT = "".join(f"def f{i}(x):\n    return x * {i % 7} + {i % 5}\n" for i in range(120))


def text_job(tmp_path=None, dropout=0.1, seed=0, lr=3e-3, total=12, **kw):
    data = TextDataset(TEXT, block_size=12)
    model = TiedLM(
        data.vocab_size,
        d_model=16,
        n_layers=1,
        n_heads=2,
        max_seq_len=12,
        dropout=dropout,
        seed=seed,
    )
    opt = AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    schedule = CosineWarmup(opt, warmup_steps=2, total_steps=total)
    kw.setdefault("max_steps", 12)
    trainer = Trainer(
        model,
        opt,
        None,
        data.loader("train", 4),
        data.eval_batches("val", 4, 2),
        schedule,
        progress=False,
        seed=seed,
        run_dir=tmp_path,
        out=sys.stdout,
        **kw,
    )
    return trainer, model, opt


def digits_like(n=48, seed=0):
    rng = np.random.default_rng(seed)
    y = rng.integers(0, 3, size=n)
    x = (rng.normal(size=(n, 5)) + y[:, None]).astype(np.float32)
    return ArrayDataset(x, y)


def mlp_job(tmp_path=None, opt_cls=AdamW, batch=8, **kw):
    model = MLPClassifier(5, 8, 3, dropout=0.2, seed=1)
    opt = opt_cls(model.parameters(), lr=0.05)
    data = digits_like()
    trainer = Trainer(
        model,
        opt,
        None,
        DataLoader(data, batch),
        DataLoader(data, 16, shuffle=False),
        progress=False,
        run_dir=tmp_path,
        out=sys.stdout,
        **kw,
    )
    return trainer, model, opt


def values(model):
    return [v.copy() for v in model.param_list().values()]


def assert_same(a, b):
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert np.array_equal(x, y)


# -- the loop ----------------------------------------------------------------------------
def test_training_lowers_the_loss_and_keeps_the_tie(tmp_path):
    trainer, model, _ = text_job(
        tmp_path, dropout=0.0, max_steps=30, eval_every=10, lr=1e-2, total=30
    )
    first = trainer.evaluate()
    result = trainer.fit()
    assert result.status == "completed" and result.step == 30
    assert result.val_loss < first - 0.5
    assert model.lm_head.weight.storage is model.embed.weight.storage  # C1 tie kept


def test_one_seed_makes_runs_reproducible():
    a_tr, a_model, _ = text_job(seed=3)
    b_tr, b_model, _ = text_job(seed=3)
    a, b = a_tr.fit(), b_tr.fit()
    assert a.train_loss == b.train_loss and a.val_loss == b.val_loss
    assert_same(values(a_model), values(b_model))
    c_tr, c_model, _ = text_job(seed=4)
    c_tr.fit()
    assert not np.array_equal(values(a_model)[0], values(c_model)[0])


def test_epochs_count_steps_from_the_loader():
    trainer, _, opt = mlp_job(epochs=2)
    assert trainer.max_steps == 12  # 48 samples / batch 8 = 6 batches per epoch
    trainer.fit()
    assert opt.step_count == 12 and trainer.epoch == 2


def test_gradient_accumulation_equals_one_large_batch():
    big, big_model, _ = mlp_job(opt_cls=SGD, batch=16, max_steps=3, grad_accum=1)
    acc, acc_model, _ = mlp_job(opt_cls=SGD, batch=8, max_steps=3, grad_accum=2)
    for t in (big, acc):
        t.model.mlp.drop.p = 0.0
        t.train_data.shuffle = False
    big.fit()
    acc.fit()
    for x, y in zip(values(big_model), values(acc_model)):
        np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-6)


def test_clipping_bounds_the_update_and_records_the_norm(tmp_path):
    trainer, model, opt = mlp_job(tmp_path, opt_cls=SGD, max_steps=1, clip_norm=1e-3)
    trainer.model.mlp.drop.p = 0.0
    before = values(model)
    trainer.fit()
    step = [np.asarray(a, np.float64) - b for a, b in zip(values(model), before)]
    assert total_norm(step) <= 0.05 * 1e-3 * (1 + 1e-4)
    record = read_metrics(tmp_path / "metrics.jsonl")[0]
    assert record["grad_norm"] > 1e-3


# -- run folder ----------------------------------------------------------------------------
def test_run_folder_holds_checkpoints_metrics_and_plot(tmp_path):
    trainer, model, _ = text_job(
        tmp_path, max_steps=12, eval_every=4, checkpoint_every=3, keep_last=2, extra={"note": "x"}
    )
    result = trainer.fit()
    run = RunDir(tmp_path)
    assert [s for s, _ in run.step_checkpoints()] == [9, 12]
    assert result.checkpoint == run.step_path(12) and result.best_checkpoint == run.best_path
    records = read_metrics(run.metrics_path)
    assert [r["step"] for r in records if "train_loss" in r] == list(range(1, 13))
    assert [r["step"] for r in records if "val_loss" in r] == [4, 8, 12]
    best = min(r["val_loss"] for r in records if "val_loss" in r)
    assert result.best_val_loss == best
    rows = run.csv_path.read_text().splitlines()
    assert rows[0] == "step,train_loss,val_loss,lr,grad_norm,throughput,elapsed,val_ppl," + (
        "peak_rss_mb,device_peak_mb"
    )
    assert len(rows) == 1 + len(records)
    assert result.plot == run.plot_path and run.plot_path.read_bytes()[:4] == b"\x89PNG"
    info = tiegrad.load(run.latest(), TiedLM(**model.config))
    assert info.extra["note"] == "x" and info.extra["trainer"]["step"] == 12


def test_a_run_folder_is_never_overwritten(tmp_path):
    text_job(tmp_path, max_steps=2)[0].fit()
    with pytest.raises(ConfigError, match="already holds checkpoints"):
        text_job(tmp_path, max_steps=2)


def test_resume_into_another_model_changes_nothing(tmp_path):
    text_job(tmp_path, max_steps=2)[0].fit()
    data = TextDataset(TEXT, block_size=12)
    other = TiedLM(data.vocab_size, d_model=8, n_layers=1, n_heads=2, max_seq_len=12)
    before = values(other)
    opt = AdamW(other.parameters())
    trainer = Trainer(
        other,
        opt,
        None,
        data.loader("train", 4),
        max_steps=4,
        run_dir=tmp_path,
        resume=True,
        progress=False,
    )
    with pytest.raises(CheckpointError):
        trainer.fit()
    assert_same(values(other), before)


@pytest.mark.parametrize("job", ["text", "mlp"])
def test_resume_continues_exactly(tmp_path, job):
    make = text_job if job == "text" else mlp_job
    full, full_model, full_opt = make(tmp_path / "full", max_steps=10)
    full.fit()
    part, _, _ = make(tmp_path / "part", max_steps=4, checkpoint_every=2)
    part.fit()
    again, model, opt = make(tmp_path / "part", max_steps=10, resume=True)
    result = again.fit()
    assert result.resumed_from == 4 and result.step == 10
    assert_same(values(model), values(full_model))
    sa, sb = opt.state_dict(), full_opt.state_dict()
    for slot in sb["state"]:
        for name, v in sb["state"][slot].items():
            assert np.array_equal(sa["state"][slot][name], v)
    steps = [r["step"] for r in read_metrics(tmp_path / "part" / "metrics.jsonl")]
    assert [s for s in steps if s] == sorted(steps)  # no duplicated steps after resume


def test_resuming_a_finished_run_takes_no_step_and_evaluates_nothing(tmp_path):
    first, trained, _ = text_job(tmp_path, max_steps=5, eval_every=3)
    done = first.fit()
    records = read_metrics(tmp_path / "metrics.jsonl")
    again, model, _ = text_job(tmp_path, max_steps=5, eval_every=3, resume=True)
    evaluations = []
    again.evaluate = lambda: evaluations.append(1)
    result = again.fit()
    assert evaluations == [] and result.process_steps == 0 and result.step == 5
    assert result.best_val_loss == done.best_val_loss
    assert_same(values(model), values(trained))
    assert read_metrics(tmp_path / "metrics.jsonl") == records  # nothing written twice


def test_early_stopping_after_patience(tmp_path):
    trainer, _, opt = mlp_job(tmp_path, max_steps=100, eval_every=2, patience=2)
    opt.param_groups[0]["lr"] = 0.0  # the validation loss can never improve
    result = trainer.fit()
    assert result.status == "early_stopped" and result.step == 6
    assert RunDir(tmp_path).latest() == RunDir(tmp_path).step_path(6)


def test_a_nan_validation_loss_is_never_the_best(tmp_path):
    trainer, _, _ = mlp_job(tmp_path, max_steps=4, eval_every=1, checkpoint_every=1, patience=2)
    losses = iter([math.nan, 1.0, math.nan, 0.5])
    trainer.evaluate = lambda: next(losses)
    result = trainer.fit()
    assert result.status == "completed" and result.step == 4 and result.best_val_loss == 0.5
    stored = [
        tiegrad.load(path, MLPClassifier(5, 8, 3)).extra["trainer"]["best_val"]
        for _, path in RunDir(tmp_path).step_checkpoints()
    ]
    assert stored == [1.0, 1.0, 0.5]  # steps 2 to 4 (keep_last 3), all loadable
    again, _, _ = mlp_job(tmp_path, max_steps=5, eval_every=1, patience=2, resume=True)
    again.evaluate = lambda: 0.25
    assert again.fit().best_val_loss == 0.25


@pytest.mark.parametrize("bad", [math.nan, math.inf])
def test_non_finite_validation_losses_count_towards_patience_and_resume(tmp_path, bad):
    trainer, _, _ = mlp_job(tmp_path, max_steps=10, eval_every=1, patience=2)
    trainer.evaluate = lambda: bad
    result = trainer.fit()
    assert result.status == "early_stopped" and result.step == 2
    assert result.best_val_loss is None and not RunDir(tmp_path).best_path.exists()
    again, _, _ = mlp_job(tmp_path, max_steps=4, eval_every=1, patience=5, resume=True)
    again.evaluate = lambda: 1.0
    result = again.fit()  # the checkpoint's state (best_val null) loads
    assert result.resumed_from == 2 and result.step == 4 and result.best_val_loss == 1.0


def test_a_second_fit_appends_to_the_metrics_and_goes_on_counting_time(tmp_path):
    trainer, _, _ = mlp_job(tmp_path, max_steps=5, eval_every=5)
    trainer.fit()
    first = read_metrics(tmp_path / "metrics.jsonl")
    trainer.max_steps = 8
    result = trainer.fit()
    records = read_metrics(tmp_path / "metrics.jsonl")
    assert records[: len(first)] == first and result.process_steps == 3
    assert [r["step"] for r in records if "train_loss" in r] == list(range(1, 9))
    elapsed = [r["elapsed"] for r in records]
    assert elapsed == sorted(elapsed) and result.elapsed >= first[-1]["elapsed"]
    rows = (tmp_path / "metrics.csv").read_text().splitlines()
    assert rows[0].startswith("step,") and len(rows) == 1 + len(records)


@pytest.mark.parametrize("resume", [False, True])
def test_a_folder_holding_only_best_is_neither_overwritten_nor_restarted(tmp_path, resume):
    mlp_job(tmp_path, max_steps=2, eval_every=1)[0].fit()
    run = RunDir(tmp_path)
    for _, path in run.step_checkpoints():  # killed before its first periodic checkpoint
        path.unlink()
    best = run.best_path.read_bytes()
    with pytest.raises(ConfigError, match="best.safetensors"):
        mlp_job(tmp_path, max_steps=2, eval_every=1, resume=resume)
    assert run.best_path.read_bytes() == best and run.latest() is None


def test_an_early_stopped_run_is_finished_unless_patience_is_raised(tmp_path, capsys):
    trainer, _, opt = mlp_job(tmp_path, max_steps=100, eval_every=2, patience=2)
    opt.param_groups[0]["lr"] = 0.0  # the validation loss can never improve
    assert trainer.fit().step == 6
    again, _, _ = mlp_job(tmp_path, max_steps=100, eval_every=2, patience=2, resume=True)
    again.evaluate = lambda: 10.0
    result = again.fit()
    assert result.status == "early_stopped" and result.step == 6 and result.process_steps == 0
    assert "stopped early at step 6" in capsys.readouterr().out
    assert RunDir(tmp_path).latest() == RunDir(tmp_path).step_path(6)
    raised, _, _ = mlp_job(tmp_path, max_steps=100, eval_every=2, patience=3, resume=True)
    raised.evaluate = lambda: 10.0
    result = raised.fit()  # one more evaluation without improvement is allowed
    assert result.status == "early_stopped" and result.step == 8 and result.resumed_from == 6


@pytest.fixture
def python_sigint():
    """SIGINT with Python's own handler (``KeyboardInterrupt``) during the test, however
    the suite was started (``nohup pytest &`` starts it with SIGINT ignored); the
    disposition it had is restored after."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


def test_sigint_finishes_the_step_and_checkpoints(tmp_path, capsys, python_sigint):
    data = TextDataset(TEXT, block_size=12)
    model = TiedLM(data.vocab_size, d_model=16, n_layers=1, n_heads=2, max_seq_len=12)
    opt = AdamW(model.parameters())
    calls = []

    def loss_fn(session, batch):
        calls.append(1)
        if len(calls) == 3:
            signal.raise_signal(signal.SIGINT)
        return model.loss(session, *batch)

    trainer = Trainer(
        model,
        opt,
        loss_fn,
        data.loader("train", 4),
        max_steps=50,
        run_dir=tmp_path,
        progress=False,
        resume_hint="run it again",
    )
    result = trainer.fit()
    assert result.status == "interrupted" and result.step == 3 and opt.step_count == 3
    assert result.checkpoint == RunDir(tmp_path).step_path(3)
    assert tiegrad.load(result.checkpoint, TiedLM(**model.config)).extra["trainer"]["step"] == 3
    assert "resume with: run it again" in capsys.readouterr().out
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    assert result.signal == signal.SIGINT


def test_sigterm_finishes_the_step_and_checkpoints_like_ctrl_c(tmp_path):
    before = signal.getsignal(signal.SIGTERM)
    calls = []
    trainer, model, opt = text_job(tmp_path, max_steps=50)
    loss_fn = trainer.loss_fn

    def terminating_loss(session, batch):
        calls.append(1)
        if len(calls) == 2:
            signal.raise_signal(signal.SIGTERM)
        return loss_fn(session, batch)

    trainer.loss_fn = terminating_loss
    result = trainer.fit()
    assert result.status == "interrupted" and result.signal == signal.SIGTERM
    assert result.step == 2 and result.checkpoint == RunDir(tmp_path).step_path(2)
    assert signal.getsignal(signal.SIGTERM) is before


# -- settings ----------------------------------------------------------------------------
@pytest.mark.parametrize(
    "kw, match",
    [
        ({"max_steps": 3, "epochs": 1}, "exactly one"),
        ({}, "exactly one"),
        ({"max_steps": -1}, "max_steps"),
        ({"max_steps": 3, "grad_accum": 0}, "grad_accum"),
        ({"max_steps": 3, "clip_norm": -1.0}, "clip_norm"),
        ({"max_steps": 3, "eval_every": 0}, "eval_every"),
    ],
)
def test_bad_settings_are_config_errors(kw, match):
    model = MLPClassifier(5, 8, 3)
    with pytest.raises(ConfigError, match=match):
        Trainer(model, SGD(model.parameters(), lr=0.1), None, DataLoader(digits_like(), 8), **kw)


def test_train_data_must_be_a_batch_source_and_patience_needs_val():
    model = MLPClassifier(5, 8, 3)
    opt = SGD(model.parameters(), lr=0.1)
    with pytest.raises(ConfigError, match="batch source"):
        Trainer(model, opt, None, [(np.zeros((2, 5)), np.zeros(2))], max_steps=1)
    with pytest.raises(ConfigError, match="val_data"):
        Trainer(model, opt, None, DataLoader(digits_like(), 8), max_steps=1, patience=2)


# -- metrics and plot ------------------------------------------------------------------------
def test_metrics_writer_drops_records_past_the_resumed_step(tmp_path):
    with MetricsWriter(tmp_path) as w:
        for step in range(1, 6):
            w.write({"step": step, "train_loss": float(step)})
        w.write({"step": 5, "val_loss": 0.5})
    with MetricsWriter(tmp_path, resume_step=3) as w:
        w.write({"step": 4, "train_loss": 9.0})
    records = read_metrics(tmp_path / "metrics.jsonl")
    assert [(r["step"], r["train_loss"]) for r in records] == [
        (1, 1.0),
        (2, 2.0),
        (3, 3.0),
        (4, 9.0),
    ]
    assert (tmp_path / "metrics.csv").read_text().splitlines()[-1].startswith("4,9.0,")
    assert json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[0])["step"] == 1


def test_without_matplotlib_the_plot_is_skipped_with_one_notice(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    monkeypatch.setattr(plot_module, "_notified", [False])
    notes = []
    records = [{"step": 1, "train_loss": 2.0}, {"step": 1, "val_loss": 2.5}]
    assert plot_losses(records, tmp_path / "a.png", notify=notes.append) is None
    assert plot_losses(records, tmp_path / "b.png", notify=notes.append) is None
    assert len(notes) == 1 and "matplotlib" in notes[0]
    assert not list(tmp_path.iterdir())


# -- the digits example ------------------------------------------------------------------------
def test_digits_example_reaches_95_percent(capsys):
    pytest.importorskip("sklearn")
    import runpy
    from pathlib import Path

    example = Path(__file__).resolve().parents[1] / "examples" / "digits.py"
    main = runpy.run_path(str(example))["main"]
    assert main(epochs=15, seed=0, progress=False) >= 0.95
    assert "test accuracy" in capsys.readouterr().out
