"""The Trainer refuses bad arguments in its constructor, before any step or file (C6),
and a loss or a data source that breaks its contract with a ConfigError, not a hang or
a raw Python error."""

from __future__ import annotations

import math
import threading

import numpy as np
import pytest
from test_trainer import digits_like, values

from tiegrad import ConfigError, MissingGradientError, Param, ops
from tiegrad.data import ArrayDataset, DataLoader
from tiegrad.models import MLPClassifier
from tiegrad.nn import Module
from tiegrad.optim import SGD, AdamW
from tiegrad.train import Trainer
from tiegrad.train.callbacks import perplexity


def build(tmp_path=None, **kw):
    model = MLPClassifier(5, 8, 3, seed=1)
    opt = kw.pop("optimizer", AdamW(model.parameters(), lr=0.05))
    kw.setdefault("max_steps", 3)
    trainer = Trainer(
        model,
        opt,
        kw.pop("loss_fn", None),
        kw.pop("train_data", DataLoader(digits_like(), 8)),
        kw.pop("val_data", None),
        progress=False,
        plot=False,
        run_dir=tmp_path,
        **kw,
    )
    return trainer, model


x, y = digits_like().arrays


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"val_data": (x, y)}, r"val_data\[0\] is a ndarray, expected a batch .*pass \[\(x, y\)\]"),
        ({"val_data": []}, "val_data is an empty list"),
        ({"clip_norm": math.inf}, "clip_norm must be a finite number > 0"),
        ({"clip_norm": True}, "clip_norm must be a finite number > 0"),
        ({"extra": {"x": np.zeros(3)}}, "extra is not JSON-serializable"),
        ({"extra": [1, 2]}, "extra must be a dict or None, got list"),
        ({"extra": {"trainer": 1}}, r"extra\['trainer'\] is reserved"),
        ({"callbacks": None}, "callbacks must be a list of Callbacks, got NoneType"),
        ({"optimizer": None}, "must be a tiegrad optimizer"),
    ],
)
def test_bad_arguments_are_refused_before_anything_runs(tmp_path, kwargs, message):  # C6
    folder = tmp_path / "run"
    with pytest.raises(ConfigError, match=message):
        build(folder, **kwargs)
    assert not folder.exists()


def test_a_run_dir_of_another_type_is_refused():
    with pytest.raises(ConfigError, match="run_dir must be a str, os.PathLike or None, got int"):
        build(123)


@pytest.mark.parametrize(
    "loss_fn, message",
    [
        (lambda s, b: 1.0, "loss_fn must return the loss as a TensorRef of the session, got float"),
        (
            lambda s, b: s.constant(np.ones(4, np.float32)) * 2.0,
            r"loss_fn must return one number, got shape \(4,\)",
        ),
    ],
)
def test_a_loss_that_is_not_one_recorded_number_is_named(loss_fn, message):
    trainer, model = build(loss_fn=loss_fn)
    before = values(model)
    with pytest.raises(ConfigError, match=message):
        trainer.fit()
    assert all(np.array_equal(a, b) for a, b in zip(values(model), before))


class OneShot:
    """A batch source whose ``epoch`` hands out the same iterator each time: the second
    epoch yields nothing."""

    unit = "samples"

    def __init__(self) -> None:
        self.batches = DataLoader(digits_like(), 16).epoch(np.random.default_rng(0))

    def __len__(self) -> int:
        return 3

    def epoch(self, rng):
        return self.batches

    def count(self, batch):
        return len(batch[0])


def test_an_epoch_that_yields_no_batch_is_an_error_not_a_hang():
    trainer, _ = build(train_data=OneShot(), max_steps=5)
    done = []
    worker = threading.Thread(target=lambda: done.append(_error(trainer.fit)), daemon=True)
    worker.start()
    worker.join(60)
    assert done, "fit did not return"
    assert isinstance(done[0], ConfigError)
    assert "train_data's epoch 1 yielded no batch (its len() is 3)" in str(done[0])
    assert trainer.step == 3


def _error(fn):
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - the test inspects it
        return e
    return None


def test_the_perplexity_of_a_nan_loss_is_nan():
    assert math.isnan(perplexity(math.nan))
    assert perplexity(1000.0) == math.inf and perplexity(0.0) == 1.0


class Partly(Module):
    """``a`` in every batch, ``b`` only in batches whose first sample is positive."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = Param(np.ones(1)), Param(np.full(1, 2.0))

    def loss(self, s, x):
        loss = ops.sum(s.use(self.a) * x)
        return loss + ops.sum(s.use(self.b) * x) if x[0, 0] > 0 else loss


def test_a_storage_some_micro_batches_do_not_use_gets_the_others_gradient():
    model = Partly()
    x = np.array([[1.0], [-1.0], [1.0], [-1.0]])  # batches of one: b in every other
    trainer = Trainer(
        model,
        SGD(model.parameters(), lr=0.1),
        train_data=DataLoader(ArrayDataset(x), 1, shuffle=False),
        max_steps=2,
        grad_accum=2,
        progress=False,
        plot=False,
    )
    trainer.fit()  # each step: a's gradient (1 - 1) / 2, b's 1 / 2 (its one batch)
    np.testing.assert_allclose(model.a.value, [1.0])
    np.testing.assert_allclose(model.b.value, [2.0 - 2 * 0.1 * 0.5])
    never = Partly()
    trainer = Trainer(
        never,
        SGD(never.parameters(), lr=0.1),
        train_data=DataLoader(ArrayDataset(-np.abs(x)), 1, shuffle=False),
        max_steps=1,
        grad_accum=2,
        progress=False,
        plot=False,
    )
    with pytest.raises(MissingGradientError, match="slot 1 .* is trainable but has no gradient"):
        trainer.fit()
    assert never.a.value == 1.0 and never.b.value == 2.0


def test_without_accumulation_a_missing_gradient_keeps_the_optimizers_hint():
    model = Partly()
    trainer = Trainer(
        model,
        SGD(model.parameters(), lr=0.1),
        train_data=DataLoader(ArrayDataset(-np.ones((2, 1))), 1, shuffle=False),
        max_steps=1,
        progress=False,
        plot=False,
    )
    with pytest.raises(MissingGradientError, match="no trainable use of its storage was recorded"):
        trainer.fit()
