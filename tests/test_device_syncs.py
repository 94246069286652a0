"""A device training step waits for the device only where a value must reach the host.

``SyncRecorder`` records every tensor call that brings a value to the host (``item``,
``float()``, ``bool()``, ``int()``, ``tolist``, ``cpu``; a ``torch.overrides``
function mode) and every ``download`` of the device backend: on a GPU each is a
synchronisation with the device. ``numpy`` is left out: it takes only CPU tensors, so a
device value reaches it through one of the others. Recording, backward and reset make
none; an optimizer step makes exactly one, its finiteness verdict over every gradient
(C6), whatever the number of parameter groups; reading the loss for logging makes one.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np
import pytest

from tiegrad import EagerSession
from tiegrad.backend import device_backend
from tiegrad.models import MLPClassifier, TiedLM
from tiegrad.optim import SGD, AdamW

torch = pytest.importorskip("torch")
from torch.overrides import TorchFunctionMode  # noqa: E402

DEVICE = os.environ.get("TIEGRAD_TEST_DEVICE", "torch:cpu")
TO_HOST = frozenset({"item", "__float__", "__int__", "__bool__", "__index__", "tolist", "cpu"})


class SyncRecorder(TorchFunctionMode):
    """Records the name of every call that brings a device value to the host."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[str] = []
        self.backend = device_backend(DEVICE)

    def __enter__(self) -> SyncRecorder:
        download = type(self.backend).download

        def recorded(x: Any) -> np.ndarray:
            self.calls.append("download")
            return download(self.backend, x)

        self.backend.download = recorded
        return super().__enter__()

    def __exit__(self, *exc: Any) -> None:
        del self.backend.download  # the class's method again
        super().__exit__(*exc)

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        name = getattr(func, "__name__", "")
        if name in TO_HOST:
            self.calls.append(name)
        return func(*args, **(kwargs or {}))


def _syncs(fn: Any, *args: Any) -> list[str]:
    with SyncRecorder() as rec:
        fn(*args)
    return rec.calls


def _steps(model: Any, opt: Any, batches: list[tuple[np.ndarray, np.ndarray]]) -> None:
    """Train on ``batches``; every part of every step makes the syncs it is allowed."""
    s = EagerSession(device=DEVICE)
    for x, y in batches:
        with SyncRecorder() as rec:
            loss = model.loss(s, x, y)
            grads = s.backward(loss)
            s.reset()
        assert rec.calls == []
        assert _syncs(opt.step, grads) == ["__float__"]
        assert _syncs(loss.item) == ["download"]
    assert opt.step_count == len(batches)


def test_a_mlp_step_with_sgd_momentum_synchronises_once():
    rng = np.random.default_rng(0)
    model = MLPClassifier(8, [16, 16], 4, activation="relu")
    opt = SGD(model.parameters(), lr=0.1, momentum=0.9)
    batches = [
        (rng.standard_normal((6, 8), dtype=np.float32), rng.integers(0, 4, 6)) for _ in range(3)
    ]
    _steps(model, opt, batches)


def test_a_tied_lm_step_with_adamw_in_two_groups_synchronises_once():
    model = TiedLM(16, 16, 1, 2, 8, seed=0)
    named = list(model.named_parameters())
    norms = [p for name, p in named if name.split(".")[-2].startswith("ln")]
    rest = [p for name, p in named if not name.split(".")[-2].startswith("ln")]  # embed: tied
    opt = AdamW([{"params": rest}, {"params": norms, "lr": 1e-2}], lr=3e-3, weight_decay=0.01)
    ids = np.random.default_rng(1).integers(0, 16, (3, 4, 9))
    _steps(model, opt, [(b[:, :-1], b[:, 1:]) for b in ids])


def test_a_tied_lm_step_over_64_positions_synchronises_once():
    """64 keys: attention as batched products on torch's CPU, no synchronisation either."""
    model = TiedLM(16, 16, 1, 2, 64, seed=0)
    opt = AdamW(model.parameters(), lr=3e-3)
    ids = np.random.default_rng(2).integers(0, 16, (2, 2, 65))
    _steps(model, opt, [(b[:, :-1], b[:, 1:]) for b in ids])


def test_a_refused_step_finds_the_slot_after_its_one_verdict():
    model = MLPClassifier(4, [4], 2)
    opt = SGD(model.parameters(), lr=0.1, nonfinite="skip")
    s = EagerSession(device=DEVICE)
    x = np.full((2, 4), np.inf, np.float32)
    grads = s.backward(model.loss(s, x, np.array([0, 1])))
    calls = _syncs(opt.step, grads)
    assert calls[0] == "__float__" and set(calls[1:]) == {"__bool__"}
    assert opt.skipped_steps == 1 and opt.step_count == 0
