"""The device executor: mirrors and optimizer state updated on the device (C3-C8).

``Optimizer.step`` hands its ``Update`` here (``optim.update``) when its gradients are
device tensors (the ``Gradients`` of a device session, or a per-slot list of tensors).
The step keeps the host executor's contract and arithmetic:

- Validation first (C6): every hyperparameter, every canonical slot's gradient
  (present, shape, dtype, on the session's device), the state layout, then
  finiteness; nothing changes before all of it passes.
- Each storage is updated once, from its current device value: the mirror, uploaded
  only when there is none (C3, C7). The new value is committed as the mirror, so the
  host becomes stale until a sync (C7).
- The summed gradient of a storage used several times is an owned temporary,
  released whether the step succeeds or raises (C8). A storage with a row mask is
  updated through its ``TrainedRows`` (``params.rows``): its gradient's trained rows
  are gathered (a temporary too) and only those rows of the mirror are written.
- One update per run of slots sharing hyperparameters and step count. An optimizer
  class with a ``device_kernel`` (``SGD``, ``Adam``, ``AdamW``: torch's fused kernels,
  ``tiegrad.optim.foreach``) runs it: one call updates every parameter and its state,
  one pass each, within ``OPTIMIZER_ULPS`` of the host's update (other roundings).
  Otherwise, or where the kernel does not take the run (its dtypes, its device), the
  optimizer's own rule (``UpdateRule.rule``: ``adam_rule``, ``sgd_rule``...) runs with ``xp`` the
  ``ForeachOps`` of ``tiegrad.optim.foreach``: each operation is one PyTorch
  ``foreach`` call over the run's parameters, gradients and state (docs/design.md:
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
canonical slots (C5), and is the ``KeyedState``'s ``mirror``. A device step starts from
it, uploading the host state only when there is no mirror (or the layout changed);
``KeyedState.sync`` downloads a newer device state (``state``, ``state_dict`` and
checkpoints call it), and a host step or ``load_state_dict`` syncs and then releases it.
Nothing here imports torch until a device step runs.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any, NamedTuple

import numpy as np

from ..backend import NUMPY, Backend, backend_of, dtype_name
from ..errors import DeviceError, DTypeError, ShapeError
from ..params.device import check_device_gradient_groups, checked_device_sums
from ..session import Gradients
from .foreach import ForeachOps
from .gradients import check_complete, check_recorded, list_gradients
from .plan import StepPlan
from .state import FlatState, SlotSpec
from .update import Labeler, Update

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


def gradients_backend(gradients: Any) -> Backend | None:
    """The device backend of ``Optimizer.step``'s gradients (after ``gradients.given``);
    None where they are host arrays."""
    if isinstance(gradients, Gradients):
        bk = gradients.session.backend
        return None if bk is NUMPY else bk
    if isinstance(gradients, (list, tuple)):
        for kind in set(map(type, gradients)):  # a few types, however many slots
            g = next(g for g in gradients if type(g) is kind)
            if _is_tensor(g):
                return backend_of(g)
    return None


def _is_tensor(x: Any) -> bool:
    return type(x).__module__.partition(".")[0] == "torch"


class DeviceExecutor:
    """``Executor`` of the gradients of one device backend (``optim.update``).

    Remembers the groups of the last recording whose uses repeat (a training loop
    records the same uses every step), so that they are grouped and checked once.
    """

    def __init__(self, backend: Backend) -> None:
        self.backend = backend
        self._recorded: tuple[Any, ...] | None = None  # (plan, registrations, groups, slots)

    @contextmanager
    def gradients(self, labeler: Labeler, plan: StepPlan, given: Any) -> Iterator[list[Any]]:
        bk = self.backend
        grads: list[Any] = [None] * len(plan.slots)
        if isinstance(given, Gradients):
            groups, order = self._groups(labeler, plan, given)
            check_device_gradient_groups(groups, given, bk)
            with checked_device_sums(groups, given, bk) as sums:
                for i, total in zip(order, sums):
                    grads[i] = total
                for i, cell in plan.masked:  # a row mask: the trained rows (params.rows)
                    grads[i] = cell.gather(grads[i])
                try:
                    yield grads
                finally:
                    grads.clear()
            return
        raw = list_gradients(labeler, given, plan)
        check_complete(labeler, plan, {i for i in plan.canonical if raw[i] is not None})
        for i in plan.canonical:
            grads[i] = self._checked(labeler, plan, i, raw[i])
        yield grads

    def _groups(
        self, labeler: Labeler, plan: StepPlan, gradients: Gradients
    ) -> tuple[list[Any], list[int]]:
        """The recorded groups of storages ``plan`` trains and the canonical slot of each.

        Grouped and checked afresh, except when the plan and the registrations (leaf ->
        handle, leaf -> storage, trainable leaves: equal mappings of the same objects) are
        those of the last step whose groups were all this optimizer's (C4, C5).
        """
        registrations = (gradients._params, gradients._storages, gradients._trainable)
        hit = self._recorded
        if hit is not None and hit[0] is plan and hit[1] == registrations:
            return hit[2], hit[3]
        index = plan.index
        recorded = gradients.parameter_groups()
        check_recorded(labeler, recorded, plan)
        groups = [g for g in recorded if g.storage is not None and id(g.storage) in index]
        order = [index[id(g.storage)] for g in groups]
        check_complete(labeler, plan, set(order), " (no trainable use of its storage on the tape)")
        self._recorded = (
            (plan, registrations, groups, order) if len(groups) == len(recorded) else None
        )
        return groups, order

    def _checked(self, labeler: Labeler, plan: StepPlan, slot: int, g: Any) -> Any:
        """A per-slot list's device gradient checked; of a row-masked storage, its
        trained rows (given whole or already gathered, ``params.rows``)."""
        what = f"{labeler.kind}.step: gradient of {labeler.label(slot)}"
        where = backend_of(g) if _is_tensor(g) or isinstance(g, np.ndarray) else None
        if where is None or where is NUMPY:
            raise DeviceError(f"{what} is a {type(g).__name__}, expected a device tensor")
        if where is not self.backend:
            raise DeviceError(f"{what} is on {where.device!r}, expected {self.backend.device!r}")
        cell = plan.storages[slot]
        if dtype_name(g) != cell.dtype.name:
            raise DTypeError(f"{what}: expected dtype {cell.dtype.name}, got {dtype_name(g)}")
        if cell is not labeler.params[slot].storage:
            g = cell.trained_part(g)
        if tuple(g.shape) != cell.shape:
            raise ShapeError(f"{what}: expected shape {cell.shape}, got {tuple(g.shape)}")
        return g

    def first_nonfinite(self, update: Update, grads: list[Any]) -> int | None:
        """Every mirror readable (C7), then one finiteness verdict for the whole step.

        One synchronisation: the sum of the gradients' norms is finite unless some entry
        is not (or the norms overflow, when each gradient is checked entry by entry, as
        the host does).
        """
        bk, state, plan = self.backend, update.state, update.plan
        ds = state.mirror
        program = None if ds is None or ds.backend is not bk else ds.program
        if program is not None and program.current(plan, update.names, state.flat):
            order, storages, specs = program.order, program.storages, None
        else:
            program = None
            specs = update.specs()
            order = sorted(specs)
            storages = [plan.storages[i] for i in order]
        for st in storages:
            st.device_value(bk)  # every mirror readable (C7) before any write
        update.prepared = program, specs
        xp = bk.xp
        norms = xp._foreach_norm([grads[i] for i in order])
        if not norms or math.isfinite(float(xp.stack(norms).sum())):
            return None
        return next((i for i in order if not bool(xp.isfinite(grads[i]).all())), None)

    def apply(self, update: Update, grads: list[Any]) -> None:
        program, specs = update.prepared
        update.plan.program = None  # the host program's state buffers may be replaced here
        if program is None:
            program = self._program(update, specs)
        ds = update.state.mirror
        flat = update.state.flat
        for run in program.runs:
            _update(update, ds, run, [grads[i] for i in run.slots])
            flat.set_steps(run.slots, run.step)
        if ds.views:
            ds.host_current = False
        if ds.program is program:
            program.advance(flat)

    def _program(self, update: Update, specs: Mapping[int, SlotSpec]) -> DeviceProgram:
        """A program of this step's runs (slots of one group, step count, state names and
        new state tensors update together), on a device state laid out as ``specs``. The
        state keeps it for the next steps unless this step creates state tensors."""
        ds, created = self._device_state(update, specs)
        flat, plan = update.state.flat, update.plan
        keyed: dict[tuple[Any, ...], list[int]] = {}
        for i in sorted(specs):
            slot_names = specs[i][2]
            fresh = (
                frozenset(n for n in slot_names if (i, n) in created) if created else _NONE_FRESH
            )
            keyed.setdefault(
                (update.slot_group[i], flat.step(i) + 1, slot_names, fresh), []
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
        program = DeviceProgram(plan, update.names, runs)
        ds.program = None if created else program
        return program

    def _device_state(
        self, update: Update, specs: Mapping[int, SlotSpec]
    ) -> tuple[DeviceState, set[tuple[int, str]]]:
        """The device state for ``specs`` and the ``(slot, name)`` entries created for it.

        The mirror when it is on this backend with this layout; otherwise the host state
        is synced, re-arranged (new entries start from their initial value) and uploaded.
        """
        state = update.state
        ds = state.mirror
        if ds is not None and (ds.backend is not self.backend or not state.flat.matches(specs)):
            state.release()
            ds = None
        created = update.arrange(dict(specs))
        if ds is None:
            ds = state.mirror = DeviceState(state.flat, self.backend)
        return ds, created


def _update(update: Update, ds: DeviceState, run: DeviceRun, grads: list[Any]) -> None:
    """One update of the slots of ``run``: the rule's ``device_kernel`` (torch's fused
    kernel) where it applies, else the rule through foreach kernels (see the module).

    Each parameter starts from its current mirror (C3) and is written in place unless a
    live device tape holds it (then a copy, C2); the results become the mirrors (C7). A
    gradient that shares memory with its parameter (a list the caller built) is
    copied first, since the update reads it after writing the parameter.
    """
    bk, ops, rule = ds.backend, ds.ops, update.rule
    storages = run.storages
    params = [st.device_for_update(bk) for st in storages]
    for k, (p, gk) in enumerate(zip(params, grads)):
        if p.untyped_storage().data_ptr() == gk.untyped_storage().data_ptr():
            grads[k] = gk.clone()
    state, step, fresh = run.state, run.step, run.fresh
    hp = update.hps[run.group]
    kernel = rule.device_kernel
    if kernel is None or not kernel(bk.xp, params, grads, state, hp, step, fresh):
        work = [ops.scratch() for _ in range(rule.work_buffers)]
        lists = {name: ops.tensors(views) for name, views in state.items()}
        c = update.coefficients(run.group, step, fresh)
        rule.rule(ops, ops.tensors(params), ops.tensors(grads), lists, work, c)
    for st, p in zip(storages, params):
        st.commit_device(p)
