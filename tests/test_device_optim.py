"""Optimizers on a device: mirrors and state updated on the device (C3-C8).

The device path runs each optimizer's own update rule through torch's foreach
kernels. Fed the same gradients it follows the host trajectory within
``tolerance.OPTIMIZER_ULPS`` (PyTorch's CPU kernels are another implementation, whose
last bits depend on the CPU's vector width); a device run resumed from a checkpoint
repeats the uninterrupted device run bit for bit.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
from tolerance import OPTIMIZER_ULPS, assert_close_ulps

import tiegrad
from tiegrad import EagerSession, Param, ParamList
from tiegrad.backend import device_backend
from tiegrad.optim import SGD, Adagrad, Adam, AdamW, RMSprop

torch = pytest.importorskip("torch")
from torch.overrides import TorchFunctionMode  # noqa: E402

DEVICE = os.environ.get("TIEGRAD_TEST_DEVICE", "torch:cpu")
BK = device_backend(DEVICE)

CONFIGS = {
    "sgd": (SGD, dict(lr=0.1)),
    "sgd-momentum": (SGD, dict(lr=0.1, momentum=0.9, dampening=0.1, weight_decay=0.01)),
    "sgd-nesterov": (SGD, dict(lr=0.1, momentum=0.9, nesterov=True, maximize=True)),
    "adam": (Adam, dict(lr=0.01, weight_decay=0.1)),
    "adam-amsgrad": (Adam, dict(lr=0.01, amsgrad=True, maximize=True)),
    "adamw": (AdamW, dict(lr=0.01, weight_decay=0.1)),
    "rmsprop": (RMSprop, dict(lr=0.01, momentum=0.5, centered=True)),
    "adagrad": (Adagrad, dict(lr=0.1, lr_decay=0.01)),
}


def _plist() -> ParamList:
    """[p, q, p, frozen r]: a tie and a frozen slot (C4, C5)."""
    rng = np.random.default_rng(0)
    p = Param(rng.standard_normal((3, 2)).astype(np.float32), name="p")
    q = Param(rng.standard_normal(4).astype(np.float32), name="q")
    r = Param(np.ones(2, np.float32), requires_grad=False, name="r")
    return ParamList([p, q, p, r])


def _grads(step: int) -> list[np.ndarray]:
    rng = np.random.default_rng(100 + step)
    return [
        rng.standard_normal((3, 2)).astype(np.float32),
        rng.standard_normal(4).astype(np.float32),
        rng.standard_normal((3, 2)).astype(np.float32),
        rng.standard_normal(2).astype(np.float32),
    ]


def _dev(arrays):
    return [None if a is None else BK.asarray(np.array(a)) for a in arrays]


def _run(config: str, device: bool, steps: int = 6):
    cls, kw = CONFIGS[config]
    pl = _plist()
    opt = cls(pl, **kw)
    slots = pl.canonical_slot_indices()
    for k in range(steps):
        sums = pl.canonical_gradients(slots, _grads(k))
        opt.step(_dev(sums) if device else sums)
    return pl, opt


def _state_equal(a: dict, b: dict) -> bool:
    if a.keys() != b.keys():
        return False
    for slot in a:
        if a[slot].keys() != b[slot].keys():
            return False
        for name, value in a[slot].items():
            if not np.array_equal(value, b[slot][name]):
                return False
    return True


def _assert_close_to_host(device_values, host_values) -> None:
    for slot, (d, h) in enumerate(zip(device_values, host_values)):
        assert_close_ulps(d, h, OPTIMIZER_ULPS, what=f"slot {slot}")


def _assert_state_close_to_host(device: dict, host: dict) -> None:
    assert device.keys() == host.keys()
    for slot in host:
        assert device[slot].keys() == host[slot].keys()
        for name, value in host[slot].items():
            if isinstance(value, np.ndarray) and value.dtype.kind == "f":
                assert_close_ulps(device[slot][name], value, OPTIMIZER_ULPS, what=f"{slot}/{name}")
            else:
                assert device[slot][name] == value, f"{slot}/{name}"


@pytest.mark.parametrize("config", sorted(CONFIGS))
def test_device_step_follows_the_host_trajectory(config):  # C3, C4, C5
    host_pl, host_opt = _run(config, device=False)
    dev_pl, dev_opt = _run(config, device=True)
    _assert_close_to_host(dev_pl.values_synced(), host_pl.values())
    _assert_state_close_to_host(dev_opt.state_dict()["state"], host_opt.state_dict()["state"])


def test_device_step_updates_mirrors_and_leaves_the_host_stale():  # C7
    pl, opt = _run("adamw", device=True)
    p, q, _, r = pl
    initial = _plist()
    assert not p.storage.host_current and not q.storage.host_current
    np.testing.assert_array_equal(p.value, initial[0].value)  # values() does not sync
    assert (p.storage.uploads, q.storage.uploads, r.storage.uploads) == (1, 1, 0)
    assert p.storage.downloads == 0
    assert r.storage.mirror is None  # frozen: never touched
    pl.values_synced()
    assert (p.storage.downloads, q.storage.downloads) == (1, 1)


def test_device_state_is_keyed_by_canonical_slot_and_synced_by_state_dict():  # C5, C7
    pl, opt = _run("adam", device=True)
    assert opt._state.mirror is not None and not opt._state.mirror.host_current
    sd = opt.state_dict()
    assert sorted(sd["state"]) == [0, 1]  # slot 2 aliases slot 0, slot 3 is frozen
    assert sd["state"][0]["step"] == 6
    assert opt._state.mirror.host_current
    view = opt._state.mirror.views[0, "exp_avg"]
    assert BK.is_array(view)
    np.testing.assert_array_equal(BK.to_numpy(view), sd["state"][0]["exp_avg"])


def test_tied_device_step_equals_independent_storages_fed_the_sum():  # reference case 23
    p, q = Param(np.arange(3, dtype=np.float32)), Param(np.ones(2, np.float32))
    big_p, big_q = Param(np.arange(3, dtype=np.float32)), Param(np.ones(2, np.float32))
    tied, free = AdamW(ParamList([p, q, p]), lr=0.01), AdamW(ParamList([big_p, big_q]), lr=0.01)
    for k in range(6):
        s = EagerSession(device=DEVICE)
        a, b, c = s.use(p), s.use(q), s.use(p)
        w = [float(k + 1), float(k + 3), float(k + 5)]
        grads = s.backward((a * w[0]).sum() + (b * w[1]).sum() + (c * w[2] * a).sum())
        tied.step(grads)
        ids = [a.id, b.id, c.id]
        free.step([grads[ids[0]] + grads[ids[2]], grads[ids[1]]])
    np.testing.assert_array_equal(p.value_synced(), big_p.value_synced())
    np.testing.assert_array_equal(q.value_synced(), big_q.value_synced())
    assert _state_equal(tied.state_dict()["state"], free.state_dict()["state"])
    assert [e["step"] for e in tied.state_dict()["state"].values()] == [6, 6]


def test_host_step_after_device_steps_syncs_first_and_continues():  # C7
    host_pl, host_opt = _run("adam", device=False, steps=6)
    pl, opt = _run("adam", device=True, steps=3)
    slots = pl.canonical_slot_indices()
    for k in range(3, 6):
        opt.step(pl.canonical_gradients(slots, _grads(k)))  # host gradients: a host step
    assert opt._state.mirror is None
    assert pl[0].storage.mirror is None and pl[0].storage.host_current
    _assert_close_to_host(pl.values(), host_pl.values())
    _assert_state_close_to_host(opt.state_dict()["state"], host_opt.state_dict()["state"])


def test_load_state_dict_replaces_the_device_state():  # C6, C7
    host_pl, host_opt = _run("adamw", device=False, steps=3)
    pl, opt = _run("adamw", device=True, steps=1)
    pl.set_values(host_pl.values())
    opt.load_state_dict(host_opt.state_dict())
    assert opt._state.mirror is None
    slots = pl.canonical_slot_indices()
    for k in range(3, 6):
        host_opt.step(host_pl.canonical_gradients(slots, _grads(k)))
        opt.step(_dev(pl.canonical_gradients(slots, _grads(k))))
    _assert_close_to_host(pl.values_synced(), host_pl.values())


def _snapshot(pl: ParamList, opt) -> tuple:
    return (
        [v.copy() for v in pl.values_synced()],
        opt.state_dict()["state"],
        opt.step_count,
        [st.mirror for st in pl.storages()],
    )


def _unchanged(pl: ParamList, opt, snap) -> bool:
    values, state, count, mirrors = snap
    return (
        all(np.array_equal(a, b) for a, b in zip(pl.values_synced(), values))
        and _state_equal(opt.state_dict()["state"], state)
        and opt.step_count == count
        and all(st.mirror is m for st, m in zip(pl.storages(), mirrors))
    )


def test_bad_device_steps_change_nothing():  # C6
    pl, opt = _run("adam", device=True, steps=2)
    slots = pl.canonical_slot_indices()
    good = _dev(pl.canonical_gradients(slots, _grads(7)))
    snap = _snapshot(pl, opt)
    wrong_shape = list(good)
    wrong_shape[1] = BK.asarray(np.zeros(5, np.float32))
    with pytest.raises(tiegrad.ShapeError, match=r"expected shape \(4,\), got \(5,\)"):
        opt.step(wrong_shape)
    wrong_dtype = list(good)
    wrong_dtype[1] = BK.asarray(np.zeros(4, np.float64))
    with pytest.raises(tiegrad.DTypeError, match="expected dtype float32, got float64"):
        opt.step(wrong_dtype)
    mixed = list(good)
    mixed[1] = np.zeros(4, np.float32)
    with pytest.raises(tiegrad.DeviceError, match="expected a device tensor"):
        opt.step(mixed)
    missing = list(good)
    missing[1] = None
    with pytest.raises(tiegrad.MissingGradientError, match="slot 1 .* no gradient"):
        opt.step(missing)
    nonfinite = list(good)
    nonfinite[0] = BK.asarray(np.full((3, 2), np.nan, np.float32))
    with pytest.raises(tiegrad.NonFiniteError, match="slot 0"):
        opt.step(nonfinite)
    opt.param_groups[0]["lr"] = -1.0
    with pytest.raises(tiegrad.HyperparameterError, match="lr"):
        opt.step(good)
    opt.param_groups[0]["lr"] = 0.01
    assert _unchanged(pl, opt, snap)
    opt.nonfinite = "skip"
    opt.step(nonfinite)
    assert opt.skipped_steps == 1 and _unchanged(pl, opt, snap)


def test_retie_after_device_steps_keeps_the_trained_storages_history():  # C5 (issue 16)
    p, q = Param(np.ones(2, np.float32)), Param(np.zeros(2, np.float32))
    opt = AdamW(ParamList([p, q]), lr=0.01)
    opt.step(_dev([np.ones(2, np.float32), np.ones(2, np.float32)]))
    q.storage = p.storage  # re-tie: slot 1 now shares slot 0's storage, whose history goes on
    opt.step(_dev([np.ones(2, np.float32), None]))
    assert {slot: e["step"] for slot, e in opt.state_dict()["state"].items()} == {0: 2}


def test_session_step_releases_group_sums_on_success_and_failure():  # C8
    p, q = Param(np.ones(3, np.float32)), Param(np.ones(2, np.float32))
    opt = Adam(ParamList([p, q]), lr=0.01)
    tracker = BK.temporaries
    start, total = tracker.live, tracker.total
    s = EagerSession(device=DEVICE)
    grads = s.backward((s.use(p) * s.use(p)).sum() + s.use(q).sum())
    opt.step(grads)
    assert tracker.live == start and tracker.total == total + 1
    s.reset()
    bad = s.backward((s.use(p) * s.use(p) * float("inf")).sum() + s.use(q).sum())
    before = p.value_synced().copy()
    with pytest.raises(tiegrad.NonFiniteError):
        opt.step(bad)
    assert tracker.live == start
    np.testing.assert_array_equal(p.value_synced(), before)


def test_a_storage_the_session_did_not_use_is_a_missing_gradient():  # C4, C6
    p, q = Param(np.ones(3, np.float32)), Param(np.ones(2, np.float32))
    opt = SGD(ParamList([p, q]), lr=0.1)
    s = EagerSession(device=DEVICE)
    grads = s.backward(s.use(p).sum())
    with pytest.raises(tiegrad.MissingGradientError, match="slot 1 .*no trainable use"):
        opt.step(grads)
    assert q.storage.mirror is None and p.storage.host_current


def test_checkpoint_of_device_training_syncs_and_resumes_bitwise(tmp_path):  # C7, C9
    straight_pl, _ = _run("adamw", device=True, steps=6)
    pl, opt = _run("adamw", device=True, steps=3)
    path = tmp_path / "device.safetensors"
    tiegrad.save(path, pl, opt)
    assert pl[0].storage.host_current and opt._state.mirror.host_current
    fresh = _plist()
    fresh_opt = AdamW(fresh, **CONFIGS["adamw"][1])
    tiegrad.load(path, fresh, fresh_opt)
    slots = pl.canonical_slot_indices()
    for k in range(3, 6):
        opt.step(_dev(pl.canonical_gradients(slots, _grads(k))))
        fresh_opt.step(_dev(fresh.canonical_gradients(slots, _grads(k))))
    for a, b, s in zip(pl.values_synced(), fresh.values_synced(), straight_pl.values_synced()):
        np.testing.assert_array_equal(a, s)  # the same device path: bit for bit
        np.testing.assert_array_equal(b, s)


def test_device_step_after_reset_uses_the_recordings_groups():  # C2, C4
    p = Param(np.ones(3, np.float32))
    opt = SGD(ParamList([p]), lr=0.5)
    s = EagerSession(device=DEVICE)
    a, b = s.use(p), s.use(p)
    grads = s.backward((a * 1.0).sum() + (b * 3.0).sum())
    s.reset()  # nothing pins the mirror any more
    opt.step(grads)
    np.testing.assert_array_equal(p.value_synced(), np.full(3, -1.0, np.float32))
    assert p.storage.uploads == 1


def test_device_step_writes_a_mirror_in_place_only_when_no_tape_holds_it():  # C2, C7
    p = Param(np.array([1.0, 2.0], np.float32))
    opt = SGD([p], lr=0.5, momentum=0.9)
    s = EagerSession(device=DEVICE)
    leaf = s.use(p)
    grads = s.backward((leaf * 1.0).sum(), retain_graph=True)
    opt.step(grads)  # the tape is live: the leaf's snapshot is not written
    assert BK.to_numpy(leaf.value).tolist() == [1.0, 2.0]
    assert BK.to_numpy(p.storage.mirror).tolist() == [0.5, 1.5]
    s.reset()
    mirror = p.storage.mirror
    opt.step(grads)  # nothing holds the mirror now: updated in place
    assert p.storage.mirror is mirror
    np.testing.assert_allclose(BK.to_numpy(mirror), [1.0 - 0.5 - 0.95, 2.0 - 0.5 - 0.95])


def test_device_step_reads_a_gradient_that_is_its_parameters_mirror_before_writing():  # C3
    p = Param(np.array([1.0, 2.0], np.float32))
    opt = AdamW([p], lr=0.1, weight_decay=0.5, eps=1.0)
    want = Param(np.array([1.0, 2.0], np.float32))
    AdamW([want], lr=0.1, weight_decay=0.5, eps=1.0).step([np.array([1.0, 2.0], np.float32)])
    p.to(DEVICE)
    opt.step([p.storage.mirror])  # AdamW decays p before it reads g
    np.testing.assert_allclose(p.value_synced(), want.value, rtol=1e-6)


class _TorchCalls(TorchFunctionMode):
    """The names of the torch functions called inside the block."""

    def __init__(self) -> None:
        super().__init__()
        self.names: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.names.append(getattr(func, "__name__", ""))
        return func(*args, **(kwargs or {}))


FUSED = {"sgd-momentum": "_fused_sgd_", "sgd-nesterov": "_fused_sgd_", "adam": "_fused_adam_"}
FUSED |= {"adam-amsgrad": "_fused_adam_", "adamw": "_fused_adamw_"}


@pytest.mark.parametrize("config", sorted(FUSED))
def test_device_step_is_one_fused_kernel_that_leaves_the_gradients_alone(config):  # C4, C6
    cls, kw = CONFIGS[config]
    pl = _plist()
    opt = cls(pl, **kw)
    slots = pl.canonical_slot_indices()
    for k in range(2):  # the first step (new state) and a later one
        grads = _dev(pl.canonical_gradients(slots, _grads(k)))
        before = [None if g is None else g.clone() for g in grads]
        with _TorchCalls() as calls:
            opt.step(grads)
        assert calls.names.count(FUSED[config]) == 1
        assert [n for n in calls.names if n.startswith("_foreach_")] == ["_foreach_norm"]
        for g, b in zip(grads, before):
            assert (g is None) == (b is None) and (g is None or torch.equal(g, b))


def test_a_run_of_two_dtypes_takes_the_foreach_rule_and_follows_the_host():  # C3
    values = [np.arange(3, dtype=np.float32), np.ones(2, np.float64)]
    grads = [np.full(3, 0.5, np.float32), np.full(2, -0.25, np.float64)]
    results = []
    for device in (False, True):
        pl = ParamList([Param(v.copy()) for v in values])
        opt = SGD(pl, lr=0.1, momentum=0.9)
        with _TorchCalls() as calls:
            for _ in range(3):
                opt.step(_dev(grads) if device else [g.copy() for g in grads])
        if device:
            assert "_fused_sgd_" not in calls.names and "_foreach_add_" in calls.names
        results.append(pl.values_synced())
    for d, h in zip(*results):
        assert_close_ulps(d, h, OPTIMIZER_ULPS)


@pytest.mark.parametrize("config", ["sgd-momentum", "adamw"])
def test_strided_device_gradients_and_mirrors_step_like_the_host(config):  # C3, C7
    """A strided gradient of a contiguous mirror, and a contiguous one of a strided mirror."""
    cls, kw = CONFIGS[config]
    base = np.arange(12, dtype=np.float32).reshape(4, 3)
    results = []
    for device in (False, True):
        pl = ParamList([Param(base.T.copy()), Param(base.T + 1.0)])
        if device:  # the second parameter's mirror is a transpose
            pl[1].set_device_value(BK.asarray(base + 1.0).T)
            assert not pl[1].storage.mirror.is_contiguous()
        opt = cls(pl, **kw)
        for k in range(3):
            g = np.sin(base * (k + 1)).astype(np.float32)  # mixed signs and sizes
            if device:
                opt.step([BK.asarray(g).T, BK.asarray(g.T.copy())])
                continue
            opt.step([g.T.copy(), g.T.copy()])
        results.append(pl.values_synced())
    for d, h in zip(*results):
        assert_close_ulps(d, h, OPTIMIZER_ULPS)


def _recorded_run(device: bool) -> list[np.ndarray]:
    """SGD steps from recorded uses, the setup changed between steps: a new learning rate,
    the momentum switched off (no state any more), the bias frozen, then trained again."""
    from tiegrad import ops

    rng = np.random.default_rng(3)
    w = Param(rng.standard_normal((2, 3)).astype(np.float32), name="w")
    b = Param(rng.standard_normal(2).astype(np.float32), name="b")
    x = rng.standard_normal((4, 3)).astype(np.float32)
    target = rng.standard_normal((4, 2)).astype(np.float32)
    opt = SGD([w, b], lr=0.1, momentum=0.9)
    group = opt.param_groups[0]
    changes = {
        2: lambda: group.update(lr=0.05),
        4: lambda: group.update(momentum=0.0),
        5: lambda: setattr(b, "requires_grad", False),
        7: lambda: setattr(b, "requires_grad", True),
    }
    s = EagerSession(device=DEVICE if device else None)
    for k in range(9):
        if k in changes:
            changes[k]()
        loss = ops.mse_loss(ops.linear(s.constant(x), s.use(w), s.use(b)), target)
        opt.step(s.backward(loss))
    return [w.value_synced(), b.value_synced()]


def test_device_steps_follow_changes_between_steps():  # C3, C5, C6: nothing kept goes stale
    for d, h in zip(_recorded_run(device=True), _recorded_run(device=False)):
        np.testing.assert_allclose(d, h, rtol=1e-5, atol=1e-6)
