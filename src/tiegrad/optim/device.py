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
- One update per run of slots sharing hyperparameters and step count. An optimizer
  class with a ``device_kernel`` (``SGD``, ``Adam``, ``AdamW``: torch's fused kernels,
  ``tiegrad.optim.foreach``) runs it: one call updates every parameter and its state,
  one pass each, within ``OPTIMIZER_ULPS`` of the host's update (other roundings).
  Otherwise, or where the kernel does not take the run (its dtypes, its device), the
  optimizer's own rule (``adam_rule``, ``sgd_rule``...) runs with ``xp`` the
  ``ForeachOps`` of ``tiegrad.optim.foreach``: each operation is one PyTorch
  ``foreach`` call over the run's parameters, gradients and state (DESIGN:
  optimizers), nothing gathered or scattered, each the host's correctly rounded
  operation. A subclass that replaces ``rule`` sets ``device_kernel = None``.
- Each parameter is updated in place in its mirror when no live device tape holds it,
  in a copy otherwise (copy-on-write, C2), as the host path does with host arrays.
- What depends only on the layout is worked out once and kept by the device state
  while the layout holds: the groups of a recording that repeats the last one's uses,
  the runs and their state views (``DeviceProgram``). Values never are: hyperparameters,
  gradients and mirrors are checked every step.
- The device is synchronised once per step, for the finiteness verdict of every
  gradient together (one flag brought to the host, C6); nothing else waits for it.

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
from typing import Any, NamedTuple

import numpy as np

from ..backend import NUMPY, Backend, backend_of, dtype_name
from ..errors import DeviceError, DTypeError, MissingGradientError, ShapeError
from ..params.device import check_device_gradient_groups, with_checked_device_sums
from ..session import Gradients, latest_gradients
from .foreach import ForeachOps
from .plan import StepPlan
from .state import FlatState, SlotSpec

_NONE_FRESH: frozenset[str] = frozenset()  # no state entry made this step (all but the first)


class DeviceState:
    """Optimizer state mirrored on one device: a device copy of each flat host buffer.

    ``views[slot, name]`` is the device tensor of one state entry; ``ops`` runs the
    optimizer rules over lists of them (``tiegrad.optim.foreach``). ``host_current`` is
    False while the device state is newer than the host ``FlatState``.
    """

    def __init__(self, state: FlatState, backend: Backend) -> None:
        self.backend = backend
        self.host_current = True
        self.ops = ForeachOps(backend.xp)
        self.program: DeviceProgram | None = None
        self.recorded: tuple[Any, ...] | None = None  # (plan, registrations, groups, slots)
        self.views: dict[tuple[int, str], Any] = {}
        pairs: dict[int, tuple[np.ndarray, Any]] = {}
        for (slot, name), (buf, start, stop) in state.layout().items():
            if id(buf) not in pairs:
                pairs[id(buf)] = (buf, backend.upload(buf))
            dev = pairs[id(buf)][1]
            self.views[slot, name] = dev[start:stop].view(state.tensors(slot)[name].shape)
        self.pairs = list(pairs.values())

    def sync(self) -> None:
        """Download a newer device state into the host buffers (the mirror is kept)."""
        if self.host_current:
            return
        for host, dev in self.pairs:
            host[...] = self.backend.download(dev)
        self.host_current = True


class DeviceRun(NamedTuple):
    """One update of a ``DeviceProgram``: slots sharing group, step count and state names."""

    group: int
    step: int
    names: tuple[str, ...]
    slots: list[int]
    storages: list[Any]
    state: dict[str, list[Any]]
    fresh: frozenset[str]  # the state tensors this step creates (its first)


class DeviceProgram:
    """What device steps over one layout repeat, the device twin of ``optim.plan.Program``.

    ``order``: the canonical slots, ascending, and ``storages`` theirs; ``runs``: the
    updates in order, with their state views. Made by a step that created no state
    tensor, it holds while the plan, the state names of every group and the state
    (its ``revision``) are those its last step left; each step counts every run one
    further. It belongs to one ``DeviceState``: a released state drops it.
    """

    __slots__ = ("plan", "names", "revision", "order", "storages", "runs")

    def __init__(
        self, plan: StepPlan, names: tuple[tuple[str, ...], ...], runs: list[DeviceRun]
    ) -> None:
        self.plan = plan
        self.names = names
        self.revision: int | None = None
        self.runs = runs
        self.order = sorted(i for run in runs for i in run.slots)
        self.storages = [plan.storages[i] for i in self.order]

    def current(self, plan: StepPlan, names: tuple[tuple[str, ...], ...], state: FlatState) -> bool:
        return self.plan is plan and self.names == names and self.revision == state.revision

    def advance(self, state: FlatState) -> None:
        """After a step of this program: the next one counts each run one step further."""
        self.runs = [run._replace(step=run.step + 1) for run in self.runs]
        self.revision = state.revision


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
        bk = gradients.session.backend
        groups, order = _recorded_groups(opt, plan, gradients)
        check_device_gradient_groups(groups, gradients, bk)
        with_checked_device_sums(
            groups, gradients, bk, lambda sums: _step(opt, bk, plan, dict(zip(order, sums)))
        )
        return
    raw = opt._list_gradients(gradients, plan)
    _check_complete(opt, slots, {i for i, c in enumerate(slots) if c == i and raw[i] is not None})
    grads = {i: raw[i] for i, c in enumerate(slots) if c == i}
    bk = None
    for i, g in grads.items():
        bk = _check_gradient(opt, i, g, bk)
    _step(opt, bk, plan, grads)


def _recorded_groups(opt: Any, plan: StepPlan, gradients: Gradients) -> tuple[list[Any], list[int]]:
    """The recorded groups ``opt`` steps and the canonical slot of each (C4, C5).

    Grouped and checked afresh, except when the plan and the registrations (leaf ->
    handle, leaf -> storage, trainable leaves: equal mappings of the same objects) are
    those of the device state's last step whose groups were all this optimizer's: a
    training loop records the same uses every step.
    """
    registrations = (gradients._params, gradients._storages, gradients._trainable)
    ds = opt._device_state
    hit = None if ds is None else ds.recorded
    if hit is not None and hit[0] is plan and hit[1] == registrations:
        return hit[2], hit[3]
    index = plan.index
    recorded = gradients.parameter_groups()
    opt._check_recorded(recorded, plan)
    groups = [g for g in recorded if g.storage is not None and id(g.storage) in index]
    order = [index[id(g.storage)] for g in groups]
    hint = " (no trainable use of its storage on the tape)"
    _check_complete(opt, plan.slots, set(order), hint)
    if ds is not None and len(groups) == len(recorded):
        ds.recorded = (plan, registrations, groups, order)
    return groups, order


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
    hps = opt._checked_groups(opt.param_groups, plan)
    names = tuple(opt._state_names(hp) for hp in hps)
    ds = opt._device_state
    program = None if ds is None or ds.backend is not bk else ds.program
    if program is not None and program.current(plan, names, opt._state):
        order, storages = program.order, program.storages
    else:
        program = None
        specs = opt._state_specs(plan, hps)
        order = sorted(specs)
        storages = [opt.params[i].storage for i in order]
    for st in storages:
        st.device_value(bk)  # every mirror readable (C7) before any write
    bad = _first_nonfinite(bk.xp, order, grads)
    if bad is not None:
        opt._refuse_nonfinite(bad)
        return
    plan.program = None  # the host program's state buffers may be replaced here
    if program is None:
        ds, program = _program(opt, bk, plan, names, specs, hps)
    for run in program.runs:
        _update(opt, ds, run, [grads[i] for i in run.slots], hps[run.group])
        opt._state.set_steps(run.slots, run.step)
    if ds.views:
        ds.host_current = False
    opt.step_count += 1
    if ds.program is program:
        program.advance(opt._state)


def _program(
    opt: Any,
    bk: Backend,
    plan: StepPlan,
    names: tuple[tuple[str, ...], ...],
    specs: Mapping[int, SlotSpec],
    hps: Sequence[Mapping[str, Any]],
) -> tuple[DeviceState, DeviceProgram]:
    """The device state for ``specs`` and a program of this step's runs: slots of one group,
    step count, state names and new state tensors (``fresh``) update together. The
    state keeps it for the next steps unless this step creates state tensors."""
    ds, created = _device_state(opt, bk, specs, hps)
    keyed: dict[tuple[Any, ...], list[int]] = {}
    for i in sorted(specs):
        slot_names = specs[i][2]
        fresh = frozenset(n for n in slot_names if (i, n) in created) if created else _NONE_FRESH
        keyed.setdefault(
            (opt._slot_group[i], opt._state.step(i) + 1, slot_names, fresh), []
        ).append(i)
    runs = [
        DeviceRun(
            gi,
            step,
            run_names,
            run,
            [plan.storages[i] for i in run],
            {name: [ds.views[i, name] for i in run] for name in run_names},
            fresh,
        )
        for (gi, step, run_names, fresh), run in keyed.items()
    ]
    program = DeviceProgram(plan, names, runs)
    ds.program = None if created else program
    return ds, program


def _first_nonfinite(xp: Any, order: list[int], grads: Mapping[int, Any]) -> int | None:
    """The first slot of ``order`` whose gradient holds NaN or infinity, or None (C6).

    One verdict for the whole step, one synchronisation: the sum of the gradients'
    norms is finite unless some entry is not (or the norms overflow, when each
    gradient is checked entry by entry, as the host does).
    """
    norms = xp._foreach_norm([grads[i] for i in order])
    if not norms or math.isfinite(float(xp.stack(norms).sum())):
        return None
    return next((i for i in order if not bool(xp.isfinite(grads[i]).all())), None)


def _update(
    opt: Any, ds: DeviceState, run: DeviceRun, grads: list[Any], hp: Mapping[str, Any]
) -> None:
    """One update of the slots of ``run``: the optimizer's ``device_kernel`` (torch's fused
    kernel) where it applies, else its rule through foreach kernels (see the module).

    Each parameter starts from its current mirror (C3) and is written in place unless a
    live device tape holds it (then a copy, C2); the results become the mirrors (C7). A
    gradient that shares memory with its parameter (a list the caller built) is
    copied first, since the update reads it after writing the parameter.
    """
    bk, ops = ds.backend, ds.ops
    storages = run.storages
    params = [st.device_for_update(bk) for st in storages]
    for k, (p, gk) in enumerate(zip(params, grads)):
        if p.untyped_storage().data_ptr() == gk.untyped_storage().data_ptr():
            grads[k] = gk.clone()
    state, step, fresh = run.state, run.step, run.fresh
    kernel = getattr(type(opt), "device_kernel", None)
    if kernel is None or not kernel(bk.xp, params, grads, state, hp, step, fresh):
        work = [ops.scratch() for _ in range(opt.work_buffers)]
        lists = {name: ops.tensors(views) for name, views in state.items()}
        c = opt._coefficients(hp, step, fresh)
        type(opt).rule(ops, ops.tensors(params), ops.tensors(grads), lists, work, c)
    for st, p in zip(storages, params):
        st.commit_device(p)


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
