"""Optimizer, schedule and RNG state in checkpoints (C5, C6, C9), against the optimizer
``state_dict`` interface: tensors by canonical slot, counters and hyperparameters as JSON.

``StubOptimizer`` follows that interface exactly so these tests pin the checkpoint side
independently of any one update rule; the reference optimizers are exercised end to end
in ``test_checkpoint_resume.py``.
"""

from __future__ import annotations

import copy

import numpy as np
import pytest
import safetensors.numpy
from test_checkpoint_file import expect_rejected, mixed_list, read_doc, snapshot, write_doc

import tiegrad
from tiegrad import CheckpointError, HyperparameterError, ParamList

F32 = np.float32


class StubOptimizer:
    """A momentum-like optimizer with the documented ``state_dict`` layout (C5)."""

    def __init__(self, params: ParamList, kind: str = "AdamW", lr: float = 0.1) -> None:
        self.params = params
        self.kind = kind
        self.lr = lr
        self.state: dict[int, dict] = {}
        self.step_count = 0

    def step(self, grads: list[np.ndarray]) -> None:
        slots = self.params.canonical_slot_indices()
        sums = self.params.canonical_gradients(slots, grads)
        for i, c in enumerate(slots):
            if c == i:
                st = self.state.setdefault(i, {"step": 0, "exp_avg": np.zeros_like(sums[i])})
                st["step"] += 1
                st["exp_avg"] = 0.9 * st["exp_avg"] + sums[i]
                self.params[i].set_value(self.params[i].value - self.lr * st["exp_avg"])
        self.step_count += 1

    def state_tensor_specs(self) -> dict:
        slots = self.params.canonical_slot_indices()
        return {
            i: {"exp_avg": (p.shape, p.dtype.name)}
            for i, p in enumerate(self.params)
            if slots[i] == i
        }

    def state_dict(self) -> dict:
        return {
            "kind": self.kind,
            "defaults": {"lr": self.lr, "betas": [0.9, 0.999]},
            "param_groups": [{"slots": [0, 1, 2, 3], "lr": self.lr}],
            "state": {c: {k: copy.copy(v) for k, v in st.items()} for c, st in self.state.items()},
            "step_count": self.step_count,
            "skipped_steps": 0,
        }

    def load_state_dict(self, sd: dict) -> None:
        if sd["kind"] != self.kind:
            raise tiegrad.TiegradError(f"kind {sd['kind']} != {self.kind}")
        lr = sd["defaults"]["lr"]
        if not lr >= 0:
            raise HyperparameterError(f"lr: expected >= 0, got {lr}")
        self.lr = lr
        self.state = {c: dict(st) for c, st in sd["state"].items()}
        self.step_count = sd["step_count"]


class StubSchedule:
    def __init__(self) -> None:
        self.epoch = 0

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "base_lr": 0.1}

    def load_state_dict(self, sd: dict) -> None:
        if sd["epoch"] < 0:
            raise HyperparameterError(f"epoch: expected >= 0, got {sd['epoch']}")
        self.epoch = sd["epoch"]


def trained(seed: int = 0, steps: int = 3) -> tuple[ParamList, StubOptimizer]:
    plist = mixed_list(seed)
    opt = StubOptimizer(plist)
    g = np.random.default_rng(seed + 100)
    for _ in range(steps):
        opt.step([g.standard_normal(p.shape).astype(F32) for p in plist])
    return plist, opt


def opt_snapshot(opt: StubOptimizer) -> tuple:
    state = {
        c: {k: (v.tobytes() if isinstance(v, np.ndarray) else v) for k, v in st.items()}
        for c, st in opt.state.items()
    }
    return opt.kind, opt.lr, opt.step_count, state


@pytest.fixture
def saved(tmp_path):
    plist, opt = trained()
    sched = StubSchedule()
    sched.epoch = 4
    path = tmp_path / "opt.safetensors"
    tiegrad.save(path, plist, optimizer=opt, schedule=sched)
    return path


def test_optimizer_state_round_trip_by_canonical_slot(saved):  # C5, C9
    plist, opt = trained()
    tensors, doc = read_doc(saved)
    assert sorted(tensors) == [
        "optim/1/exp_avg",
        "optim/2/exp_avg",
        "param/block.bias",
        "param/frozen.embed",
    ]
    assert doc["optimizer"]["state"]["1"] == {
        "scalars": {"step": 3},
        "tensors": {"exp_avg": "optim/1/exp_avg"},
    }
    target = mixed_list(seed=5)
    target_opt = StubOptimizer(target, lr=0.5)
    sched = StubSchedule()
    result = tiegrad.load(saved, target, optimizer=target_opt, schedule=sched)
    assert result.step == 3
    assert opt_snapshot(target_opt) == opt_snapshot(opt)
    assert [p.value.tobytes() for p in target] == [p.value.tobytes() for p in plist]
    assert sched.epoch == 4
    assert "optimizer: AdamW, step_count 3, skipped_steps 0" in tiegrad.inspect(saved)


def test_resume_after_load_matches_continuing(saved):
    plist, opt = trained()
    target = mixed_list(seed=5)
    target_opt = StubOptimizer(target)
    tiegrad.load(saved, target, optimizer=target_opt)
    g = np.random.default_rng(9)
    grads = [g.standard_normal(p.shape).astype(F32) for p in plist]
    opt.step(grads)
    target_opt.step(grads)
    assert [p.value.tobytes() for p in target] == [p.value.tobytes() for p in plist]
    assert opt_snapshot(target_opt) == opt_snapshot(opt)


def expect_all_unchanged(path, target, opt, fragments, **kwargs):
    before = opt_snapshot(opt)
    expect_rejected(path, target, *fragments, optimizer=opt, **kwargs)
    assert opt_snapshot(opt) == before


def test_optimizer_of_another_kind(saved):
    target = mixed_list(seed=5)
    expect_all_unchanged(saved, target, StubOptimizer(target, kind="SGD"), ["kind mismatch"])


def test_optimizer_state_of_the_wrong_shape(saved):
    tensors, doc = read_doc(saved)
    tensors["optim/2/exp_avg"] = np.zeros(4, F32)
    write_doc(saved, tensors, doc)
    target = mixed_list(seed=5)
    expect_all_unchanged(
        saved, target, StubOptimizer(target), ["slot 2 ('block.bias')", "shape (4,)"]
    )


def test_optimizer_state_of_the_wrong_dtype(saved):
    tensors, doc = read_doc(saved)
    tensors["optim/2/exp_avg"] = tensors["optim/2/exp_avg"].astype(np.float64)
    write_doc(saved, tensors, doc)
    target = mixed_list(seed=5)
    expect_all_unchanged(
        saved, target, StubOptimizer(target), ["slot 2 ('block.bias')", "float64", "float32"]
    )


def test_optimizer_state_at_a_non_canonical_slot(saved):
    tensors, doc = read_doc(saved)
    doc["optimizer"]["state"]["3"] = doc["optimizer"]["state"]["1"]
    write_doc(saved, tensors, doc)
    target = mixed_list(seed=5)
    expect_all_unchanged(saved, target, StubOptimizer(target), ["slot 3 ('head.weight')"])


def test_optimizer_given_but_file_has_none(tmp_path):
    path = tmp_path / "plain.safetensors"
    tiegrad.save(path, mixed_list())
    target = mixed_list(seed=5)
    expect_all_unchanged(path, target, StubOptimizer(target), ["holds no optimizer"])


def test_optimizer_over_other_parameters(saved):
    target = mixed_list(seed=5)
    expect_all_unchanged(saved, target, StubOptimizer(mixed_list(seed=6)), ["not the model's"])


def test_optimizer_rejecting_its_state_changes_nothing(saved):
    tensors, doc = read_doc(saved)
    doc["optimizer"]["defaults"]["lr"] = -1.0
    write_doc(saved, tensors, doc)
    target = mixed_list(seed=5)
    expect_all_unchanged(saved, target, StubOptimizer(target), ["the optimizer rejected", "lr"])


def test_schedule_rejecting_its_state_restores_the_optimizer(saved):
    tensors, doc = read_doc(saved)
    doc["schedule"]["epoch"] = -2
    write_doc(saved, tensors, doc)
    target, opt = trained(seed=5)
    sched = StubSchedule()
    expect_all_unchanged(saved, target, opt, ["the schedule rejected"], schedule=sched)
    assert sched.epoch == 0


def test_optimizer_with_non_strict_partial_match_is_refused(saved):
    target = mixed_list(seed=5)
    partial = ParamList(list(target)[:3])
    expect_all_unchanged(saved, partial, StubOptimizer(partial), ["needs every slot"], strict=False)


def test_save_refuses_state_at_a_non_canonical_slot(tmp_path):
    plist, opt = trained()
    opt.state[3] = opt.state[1]
    path = tmp_path / "bad.safetensors"
    with pytest.raises(CheckpointError, match="slot 3 .*not a canonical slot"):
        tiegrad.save(path, plist, optimizer=opt)
    assert not path.exists()


def test_save_refuses_a_non_json_schedule(tmp_path):
    class BadSchedule:
        def state_dict(self):
            return {"fn": print}

    path = tmp_path / "bad.safetensors"
    with pytest.raises(CheckpointError, match="schedule state is not JSON"):
        tiegrad.save(path, mixed_list(), schedule=BadSchedule())
    assert not path.exists()


def test_session_rng_round_trip(tmp_path):
    session = tiegrad.EagerSession(seed=11)
    session.rng.random(5)
    path = tmp_path / "rng.safetensors"
    tiegrad.save(path, mixed_list(), rng=session)
    expected = session.rng.random(3)
    other = tiegrad.EagerSession(seed=0)
    tiegrad.load(path, mixed_list(seed=2), rng=other)
    assert other.rng.random(3).tobytes() == expected.tobytes()
    assert safetensors.numpy.load_file(str(path)).keys() == {
        "param/frozen.embed",
        "param/block.bias",
    }


def test_optimizer_snapshot_helper_sees_changes():
    _, opt = trained()
    before = opt_snapshot(opt)
    opt.state[1]["exp_avg"] = opt.state[1]["exp_avg"] + 1
    assert opt_snapshot(opt) != before
    assert snapshot(mixed_list(0)) != snapshot(mixed_list(1))
