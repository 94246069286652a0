"""Optimizer steps on a device: mirrors and state updated on the device (C3-C8).

``Optimizer.step`` dispatches here when its gradients are device tensors (the
``Gradients`` of a device session, or a per-slot list of tensors). The step keeps
the host path's contract and arithmetic:

- Validation first (C6): every hyperparameter, every canonical slot's gradient
  (present, shape, dtype, on the session's device), the state layout, then
  finiteness; nothing changes before all of it passes.
- Each storage is updated once, from its current device value: the mirror, uploaded
  only when there is none (C3, C7). The new value is committed as the mirror, so the
  host becomes stale until a sync (C7).
- The summed gradient of a storage used several times is an owned temporary,
  released whether the step succeeds or raises (C8).
- The optimizer's own rule (``adam_rule``, ``sgd_rule``...) runs with ``xp=torch`` once
  per run of slots sharing hyperparameters and step count, over flat tensors: the
  run's parameters and gradients gathered into one tensor each and its state, which
  is contiguous by canonical slot (DESIGN: optimizers). One vectorized kernel per
  operation covers every storage, and the operations are the host's, each correctly
  rounded, so a device step reproduces the host step bit for bit on equal gradients.

Optimizer state mirrors the host ``FlatState`` the way a parameter mirrors its host
value (C7): ``DeviceState`` holds one device buffer per host buffer, keyed by the same
canonical slots (C5). A device step starts from it, uploading the host state only
when there is no mirror (or the layout changed); ``sync_state`` downloads a newer
device state (``state``, ``state_dict`` and checkpoints call it), and a host step or
``load_state_dict`` syncs and then releases it. Nothing here imports torch until a
device step runs.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from ..backend import NUMPY, Backend, backend_of, dtype_name
from ..errors import DeviceError, DTypeError, MissingGradientError, ShapeError
from ..params.device import check_device_gradients, with_checked_device_sums
from ..session import Gradients, latest_gradients
from .plan import StepPlan
from .state import FlatState, SlotSpec


class DeviceState:
    """Optimizer state mirrored on one device: a device copy of each flat host buffer.

    ``views[slot, name]`` is the device tensor of one state entry. ``host_current`` is
    False while the device state is newer than the host ``FlatState``.
    """

    def __init__(self, state: FlatState, backend: Backend) -> None:
        self.backend = backend
        self.host_current = True
        self.views: dict[tuple[int, str], Any] = {}
        self.spans: dict[tuple[int, str], tuple[Any, int, int]] = {}
        self.work: dict[tuple[Any, ...], list[Any]] = {}
        pairs: dict[int, tuple[np.ndarray, Any]] = {}
        for (slot, name), (buf, start, stop) in state.layout().items():
            if id(buf) not in pairs:
                pairs[id(buf)] = (buf, backend.upload(buf))
            dev = pairs[id(buf)][1]
            self.spans[slot, name] = (dev, start, stop)
            self.views[slot, name] = dev[start:stop].view(state.tensors(slot)[name].shape)
        self.pairs = list(pairs.values())

    def span(self, slots: Sequence[int], name: str) -> Any:
        """The flat device view of ``name`` over ``slots`` if they are contiguous, else None."""
        dev, start, stop = self.spans[slots[0], name]
        for slot in slots[1:]:
            nxt, lo, hi = self.spans[slot, name]
            if nxt is not dev or lo != stop:
                return None
            stop = hi
        return dev[start:stop]

    def sync(self) -> None:
        """Download a newer device state into the host buffers (the mirror is kept)."""
        if self.host_current:
            return
        for host, dev in self.pairs:
            host[...] = self.backend.download(dev)
        self.host_current = True


def sync_state(opt: Any) -> None:
    """Make ``opt``'s host state current: download a newer device state (C7)."""
    if opt._device_state is not None:
        opt._device_state.sync()


def release_state(opt: Any) -> None:
    """Sync, then drop the device state: the host state is about to be written (C7)."""
    sync_state(opt)
    opt._device_state = None


def is_device_step(gradients: Any) -> bool:
    """Whether ``Optimizer.step(gradients)`` takes the device path."""
    if gradients is None:
        gradients = latest_gradients()
    if isinstance(gradients, Gradients):
        return gradients.session.backend is not NUMPY
    if isinstance(gradients, (list, tuple)):
        kinds = set(map(type, gradients))  # a few types, however many slots
        return any(not issubclass(t, np.ndarray) and _is_tensor_type(t) for t in kinds)
    return False


def _is_tensor(x: Any) -> bool:
    return _is_tensor_type(type(x))


def _is_tensor_type(t: type) -> bool:
    return t.__module__.partition(".")[0] == "torch"


def device_step(opt: Any, gradients: Any) -> None:
    """One update of every trainable storage of ``opt`` on the gradients' device."""
    if gradients is None:
        gradients = latest_gradients()
    plan = opt._plan()
    slots = plan.slots
    if isinstance(gradients, Gradients):
        session = gradients.session
        index = plan.index
        recorded = gradients.parameter_groups()
        opt._check_recorded(recorded, plan)
        groups = [g for g in recorded if g.storage is not None and id(g.storage) in index]
        order = [index[id(g.storage)] for g in groups]
        for group in groups:
            check_device_gradients(group, gradients, session.backend)
        _check_complete(opt, slots, set(order), " (no trainable use of its storage on the tape)")
        with_checked_device_sums(
            groups,
            gradients,
            session.backend,
            lambda sums: _step(opt, session.backend, plan, dict(zip(order, sums))),
        )
        return
    raw = opt._list_gradients(gradients, plan)
    _check_complete(opt, slots, {i for i, c in enumerate(slots) if c == i and raw[i] is not None})
    grads = {i: raw[i] for i, c in enumerate(slots) if c == i}
    bk = None
    for i, g in grads.items():
        bk = _check_gradient(opt, i, g, bk)
    _step(opt, bk, plan, grads)


def _check_complete(opt: Any, slots: Sequence[int | None], have: set[int], hint: str = "") -> None:
    for i, c in enumerate(slots):
        if c == i and i not in have:
            raise MissingGradientError(
                f"{opt.kind}.step: {opt._label(i)} is trainable but has no gradient{hint}"
            )


def _check_gradient(opt: Any, slot: int, g: Any, bk: Backend | None) -> Backend:
    what = f"{opt.kind}.step: gradient of {opt._label(slot)}"
    where = backend_of(g) if _is_tensor(g) or isinstance(g, np.ndarray) else None
    if where is None or where is NUMPY:
        raise DeviceError(f"{what} is a {type(g).__name__}, expected a device tensor")
    if bk is not None and where is not bk:
        raise DeviceError(f"{what} is on {where.device!r}, expected {bk.device!r}")
    p = opt.params[slot]
    if tuple(g.shape) != p.shape:
        raise ShapeError(f"{what}: expected shape {p.shape}, got {tuple(g.shape)}")
    if dtype_name(g) != p.dtype.name:
        raise DTypeError(f"{what}: expected dtype {p.dtype.name}, got {dtype_name(g)}")
    return where


def _step(opt: Any, bk: Backend, plan: StepPlan, grads: Mapping[int, Any]) -> None:
    xp = bk.xp
    hps = opt._checked_groups(opt.param_groups, plan)
    specs = opt._state_specs(plan, hps)
    order = sorted(specs)
    for i in order:
        opt.params[i].storage.device_value(bk)  # every mirror readable (C7) before any write
    runs: dict[tuple[Any, ...], list[int]] = {}
    for i in order:
        runs.setdefault((opt._slot_group[i], opt._state.step(i) + 1, specs[i][1]), []).append(i)
    flat = {key: _flat(xp, [grads[i] for i in run]) for key, run in runs.items()}
    for key, run in runs.items():
        if not _finite(xp, flat[key]):
            opt._refuse_nonfinite(next(i for i in run if not _finite(xp, grads[i])))
            return
    plan.program = None  # the host program's state buffers may be replaced here
    ds, created = _device_state(opt, bk, specs, hps)
    for key, run in runs.items():
        gi, step, _ = key
        parts: dict[frozenset[str], list[int]] = {}
        for i in run:
            parts.setdefault(frozenset(n for n in specs[i][2] if (i, n) in created), []).append(i)
        for fresh, part in parts.items():
            g = flat[key] if len(part) == len(run) else _flat(xp, [grads[i] for i in part])
            c = opt._coefficients(hps[gi], step, fresh)
            _update(opt, ds, part, g, specs[part[0]][2], c)
            opt._state.set_steps(part, step)
    if ds.spans:
        ds.host_current = False
    opt.step_count += 1


def _finite(xp: Any, g: Any) -> bool:
    """Whether ``g`` holds only finite values: one BLAS dot, exact on overflow (as the host)."""
    f = g.reshape(-1)
    return math.isfinite(float(xp.dot(f, f))) or bool(xp.isfinite(f).all())


def _flat(xp: Any, tensors: list[Any]) -> Any:
    """A new 1-D tensor holding ``tensors`` one after another."""
    return xp.cat([t.reshape(-1) for t in tensors])


def _update(
    opt: Any, ds: DeviceState, run: list[int], g: Any, names: tuple[str, ...], c: Any
) -> None:
    """One rule call over the flat values of ``run``; the results become the new mirrors.

    The parameters are gathered into a new flat tensor (the current mirrors, C3), so no
    array a tape holds is written (C2); each storage then gets a view of it as its
    mirror (C7). State spans that are contiguous in the device buffers are updated in
    place, others through a gathered copy written back.
    """
    xp = ds.backend.xp
    storages = [opt.params[i].storage for i in run]
    p = _flat(xp, [st.mirror for st in storages])
    state, scattered = {}, []
    for name in names:
        span = ds.span(run, name)
        if span is None:
            views = [ds.views[i, name] for i in run]
            span = _flat(xp, views)
            scattered.append((views, span))
        state[name] = span
    work = ds.work.get((p.dtype, p.numel()))
    if work is None:
        work = ds.work[p.dtype, p.numel()] = [p.new_empty(p.shape) for _ in range(opt.work_buffers)]
    type(opt).rule(xp, p, g, state, work, c)
    for views, span in scattered:
        start = 0
        for v in views:
            v.view(-1).copy_(span[start : start + v.numel()])
            start += v.numel()
    start = 0
    for st in storages:
        n = math.prod(st.shape)
        st.commit_device(p[start : start + n].view(st.shape))
        start += n


def _device_state(
    opt: Any, bk: Backend, specs: Mapping[int, SlotSpec], hps: Any
) -> tuple[DeviceState, set[tuple[int, str]]]:
    """The device state for ``specs`` and the ``(slot, name)`` entries created for it.

    The mirror when it is on ``bk`` with this layout; otherwise the host state is
    synced, re-arranged (new entries start from their initial value) and uploaded.
    """
    ds = opt._device_state
    if ds is not None and (ds.backend is not bk or not opt._state.matches(specs)):
        release_state(opt)
        ds = None
    created = opt._arrange_state(specs, hps)
    if ds is None:
        ds = opt._device_state = DeviceState(opt._state, bk)
    return ds, created
