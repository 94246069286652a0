"""``Optimizer``: the base of tiegrad's optimizers, keyed by canonical slot (C3-C6).

An optimizer concatenates its parameter groups into one ``ParamList`` (``opt.params``,
slot order = group order) and keeps its state by canonical slot of that list (C5):
each storage, however many slots hold it, has one gradient (the sum of its uses, C4),
one state entry and one update per step. Frozen slots own no state.

A step goes down the layers once (``optim.update``):

1. The executor of the gradients' backend is chosen: ``optim.host`` for NumPy arrays,
   ``optim.device`` for the tensors of a device session (``step``'s gradient forms:
   ``optim.gradients``).
2. It resolves the gradients to one per canonical slot and checks them; the
   hyperparameters of every group are checked, and a storage shared across groups must
   have equal ones.
3. It checks what is left (mirrors, finiteness: ``nonfinite="raise"`` raises a
   ``NonFiniteError``, ``"skip"`` skips the step and counts it in ``skipped_steps``),
   then updates each storage once, from its current value (C3).

Nothing is written before everything is checked (C6). The update itself is the
subclass's ``UpdateRule`` (``optim.rule``), written once for both executors.

State belongs to the storage; the canonical slot is only its key (``KeyedState``).
When the layout changes (a freeze, an unfreeze, a tie, an untie, a new storage at a
slot) each entry moves to the canonical slot of its storage; a storage no longer trained
at any slot loses its state at the next write, and a new one starts fresh.
``state_dict`` (and so a checkpoint) holds the state of the storages trained now (C5). A
storage whose use was recorded as trainable but that is frozen at every slot now is
refused (the layout changed since ``backward``).

The work that depends only on the layout is cached in a ``StepPlan`` (``optim.plan``)
and redone when the storage or trainability of any slot changes; values are read and
checked on every step, so the cache changes neither results nor errors.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, ClassVar

import numpy as np

from ..checkpoint.schema import SlotRecord, slot_records
from ..errors import AliasError, HyperparameterError, NonFiniteError, SlotError
from ..params import Param, ParamList
from ..params.rows import optimizer_cells
from ..session import Gradients, forget_latest_gradients, note_step
from .device import DeviceExecutor, gradients_backend
from .fused import FusedRule
from .gradients import given, resolve
from .host import HostExecutor
from .hyperparams import Checker, check_eps_in, plain
from .keyed_state import KeyedState
from .plan import StepPlan
from .rule import UpdateRule
from .state import SlotSpec
from .state_dict import check_layout, check_structure, checked_state, counter
from .state_values import check_state_values
from .update import Executor, Labeler, Update

NONFINITE_MODES = ("raise", "skip")

ParamsArg = ParamList | Param | Iterable[Param] | Iterable[Mapping[str, Any]]
GradientsArg = Gradients | Sequence[Any] | None


class Optimizer:
    """Base class: parameter groups, hyperparameter checks, state, and the step.

    Subclasses set ``kind`` (the name in ``state_dict``), ``hyperparameters`` (name ->
    checker, in torch.optim's order), ``work_buffers`` (scratch arrays ``rule`` needs)
    and ``rule`` (``optim.rule``), and implement ``_state_names`` and ``_coefficients``;
    ``fused_rule`` optionally names the compiled kernel of the same rule
    (``optim.fused``) and ``device_kernel`` torch's (``optim.foreach``).

    Counters: ``step_count`` (steps taken), ``skipped_steps`` (steps refused under
    ``nonfinite="skip"``), both restored by ``load_state_dict``; ``loads``, the state
    dicts adopted since construction, so that whoever holds this optimizer's state
    elsewhere (a sharded step, ``tiegrad.distributed``) notices a load, an empty one too.
    """

    kind: ClassVar[str] = "Optimizer"
    hyperparameters: ClassVar[Mapping[str, Checker]] = {}
    work_buffers: ClassVar[int] = 0
    rule: ClassVar[Callable[..., None]]
    fused_rule: ClassVar[FusedRule | None] = None
    device_kernel: ClassVar[Callable[..., bool] | None] = None

    def __init__(
        self, params: ParamsArg, defaults: Mapping[str, Any], *, nonfinite: str = "raise"
    ) -> None:
        if nonfinite not in NONFINITE_MODES:
            raise HyperparameterError(
                f"{self.kind}: nonfinite must be one of {NONFINITE_MODES}, got {nonfinite!r}"
            )
        self.nonfinite = nonfinite
        self.defaults: dict[str, Any] = self._checked_hyper(defaults, f"{self.kind} defaults", ())
        plist, groups, slot_group = self._parse_groups(params)
        self.params: ParamList = plist
        self.param_groups: list[dict[str, Any]] = groups
        self._slot_group = slot_group
        self._labeler = Labeler(self.kind, plist)
        self._state = KeyedState()
        self._host = HostExecutor()
        self._devices: dict[Any, DeviceExecutor] = {}  # backend -> its executor
        self._step_plan: StepPlan | None = None  # the cached layout work (optim.plan)
        self.step_count = 0
        self.skipped_steps = 0
        self.loads = 0
        hps = self._checked_groups(groups, self._plan())
        for group, hp in zip(groups, hps):
            group.update(hp)

    # -- subclass hooks ------------------------------------------------------------------
    def _check_group(self, label: str, hp: dict[str, Any], dtypes: set[np.dtype]) -> None:
        """Checks across hyperparameters of one group (dtypes: its trainable parameters').

        By default: an ``eps`` hyperparameter must not round to 0 in those dtypes.
        """
        if "eps" in hp:
            check_eps_in(label, hp["eps"], dtypes)

    def _state_names(self, hp: Mapping[str, Any]) -> tuple[str, ...]:
        """The state tensors a slot of a group with hyperparameters ``hp`` holds."""
        raise NotImplementedError

    def _initial_value(self, name: str, hp: Mapping[str, Any]) -> float:
        """The value a new state tensor ``name`` starts from."""
        return 0.0

    def _coefficients(self, hp: Mapping[str, Any], step: int, fresh: frozenset[str]) -> Any:
        """The scalars ``rule`` needs for a slot's ``step``-th update (``fresh``: new tensors)."""
        raise NotImplementedError

    # -- public API ----------------------------------------------------------------------
    @property
    def state(self) -> Mapping[int, Mapping[str, Any]]:
        """``{canonical slot: {"step": int, name: read-only array}}`` (C5), synced (C7)."""
        self._state.sync()
        return self._state.flat.read_only(self._state.trained_slots(self._plan()))

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Forget the calling thread's latest gradients, as torch.optim clears ``.grad``.

        tiegrad keeps no gradients on parameters: they live in the result of
        ``EagerSession.backward``. After this, ``Param.grad`` is None and ``step()``
        without gradients raises until the next backward; gradients passed to ``step``
        explicitly are unaffected. ``set_to_none`` is accepted for familiarity (there
        are no buffers to zero).
        """
        forget_latest_gradients()

    def canonical_gradients(
        self, gradients: GradientsArg = None, *, allow_missing: bool = False
    ) -> list[np.ndarray | None]:
        """The checked host gradient of every canonical slot, None at the other slots.

        ``gradients`` takes the forms ``step`` takes (``optim.gradients``). The result is
        the list form ``step`` and ``clip_grad_norm`` accept; with ``Gradients`` a storage
        used once gets the very array ``backward`` produced (C4). Nothing is written.
        ``allow_missing`` leaves None at a trainable slot whose storage the gradients
        do not reach (a micro-batch or a rank that did not use it) instead of raising:
        the caller sums such parts, and ``step`` checks the sum.
        """
        return resolve(self._labeler, self._plan(), gradients, allow_missing)

    def step(self, gradients: GradientsArg = None) -> None:
        """One update of every trainable storage (C3-C6); see the module docstring.

        Device gradients (a device session's, or a list of device tensors) are run by the
        device executor: mirrors and state updated on the device (C7, C8). A host step
        first syncs and releases a device state.
        """
        gradients = given(self._labeler, gradients)
        executor = self._executor(gradients)
        plan = self._plan()
        with executor.gradients(self._labeler, plan, gradients) as grads:
            hps = self._checked_groups(self.param_groups, plan)
            names = tuple(self._state_names(hp) for hp in hps)
            update = Update(plan, hps, names, self._slot_group, self._state, self._rule())
            bad = executor.first_nonfinite(update, grads)
            if bad is not None:
                self.refuse_nonfinite(bad)
                return
            executor.apply(update, grads)
        self.step_count += 1
        note_step()

    def state_tensor_specs(self) -> dict[int, dict[str, tuple[tuple[int, ...], str]]]:
        """``{canonical slot: {name: (shape, dtype name)}}`` that ``load_state_dict`` accepts.

        For every canonical slot of the current alias map under the current
        hyperparameters. A state dict may hold any subset of these slots (a slot
        that has not stepped yet has no state), each with exactly these tensors.
        """
        plan = self._plan()
        hps = self._checked_groups(self.param_groups, plan)
        return {
            slot: {name: (shape, dtype.name) for name in names}
            for slot, (shape, dtype, names) in self._required_specs(plan, hps).items()
        }

    def state_dict(self) -> dict[str, Any]:
        """Hyperparameters, counters and state by canonical slot; arrays are owned copies.

        ``{"kind", "defaults", "param_groups": [{"slots": [...], hyperparameters}],
        "layout", "state": {slot: {"step": int, name: ndarray}}, "step_count",
        "skipped_steps"}``; everything but the arrays is JSON-serializable. ``layout``
        is the alias layout the state is keyed by, one checkpoint slot record per slot
        (path, shape, dtype, trainability, canonical slot, storage slot; C5, C9). The
        state is keyed by the current layout (after a freeze or a re-tie, by the new
        canonical slot of each trained storage). A newer device state is synced first (C7).
        """
        self._state.sync()
        plan = self._plan()
        hps = self._checked_groups(self.param_groups, plan)
        return {
            "kind": self.kind,
            "defaults": plain(self.defaults),
            "param_groups": [
                {"slots": list(group["slots"])} | plain(hp)
                for group, hp in zip(self.param_groups, hps)
            ],
            "layout": [record.to_json() for record in self._layout()],
            "state": self._state.flat.snapshot(self._state.trained_slots(plan)),
            "step_count": self.step_count,
            "skipped_steps": self.skipped_steps,
        }

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Adopt a ``state_dict``, validated completely before anything changes (C6).

        Checked (``optim.state_dict``): the keys and ``kind``; every hyperparameter; that
        group ``i``'s ``slots`` is a list of integers, the slots of group ``i`` here; that
        the alias layout is this optimizer's (trainability, canonical and storage slot of
        every slot, compared as checkpoint loading does and shown side by side, C6, C9),
        and that no saved path names another slot here (reordered parameters), so state
        never moves to another storage or parameter; that state is only at canonical
        slots (C5); each entry's ``step`` and exactly the tensors the loaded
        hyperparameters need, with this slot's shape and dtype; the counters. The arrays
        are copied, so the dict may be reused.
        """
        where = f"{self.kind}.load_state_dict"
        raw_defaults, groups = check_structure(
            where,
            state_dict,
            self.kind,
            tuple(self.hyperparameters),
            [group["slots"] for group in self.param_groups],
        )
        defaults = self._checked_hyper(raw_defaults, f"{where}: defaults", ())
        check_layout(where, state_dict["layout"], self._layout())
        plan = self._plan()
        hps = self._checked_groups(groups, plan)
        required = self._required_specs(plan, hps)
        specs, entries = checked_state(where, state_dict["state"], plan.slots, required)
        check_state_values(where, entries)
        step_count = counter(where, "step_count", state_dict["step_count"])
        skipped = counter(where, "skipped_steps", state_dict["skipped_steps"])
        self.defaults = defaults
        for group, hp in zip(self.param_groups, hps):
            group.update(hp)
        self._state.install(plan, specs, entries)
        self.step_count = step_count
        self.skipped_steps = skipped
        self.loads += 1

    def __repr__(self) -> str:
        lines = [f"{self.kind} ({len(self.params)} slots, nonfinite={self.nonfinite!r})"]
        for gi, group in enumerate(self.param_groups):
            hp = ", ".join(f"{k}={group.get(k)!r}" for k in self.hyperparameters)
            lines.append(f"  group {gi}: slots {list(group['slots'])}: {hp}")
        return "\n".join(lines)

    def _layout(self) -> list[SlotRecord]:
        """The alias layout of ``params`` as checkpoint slot records (C5, C9)."""
        return slot_records(self.params)

    def _rule(self) -> UpdateRule:
        """This optimizer's arithmetic, as the executors take it (``optim.rule``)."""
        cls = type(self)
        return UpdateRule(
            cls.rule,
            self.work_buffers,
            self._coefficients,
            self._initial_value,
            self.fused_rule,
            cls.device_kernel,
        )

    def _executor(self, gradients: Any) -> Executor:
        """The executor of ``gradients``' backend: the host's, or one per device backend."""
        backend = gradients_backend(gradients)
        if backend is None:
            return self._host
        executor = self._devices.get(backend)
        if executor is None:
            executor = self._devices[backend] = DeviceExecutor(backend)
        return executor

    # -- construction --------------------------------------------------------------------
    def _parse_groups(self, params: ParamsArg) -> tuple[ParamList, list[dict[str, Any]], list[int]]:
        if isinstance(params, (ParamList, Param)):
            raw: list[Any] = [{"params": params}]
        elif isinstance(params, (str, bytes, Mapping)) or not isinstance(params, Iterable):
            raise SlotError(
                f"{self.kind}: params must be a ParamList, a Param or an iterable of Params or "
                f"of parameter groups, got {type(params).__name__}"
            )
        else:
            items = list(params)
            if items and all(isinstance(x, Mapping) for x in items):
                raw = items
            else:
                raw = [{"params": items}]
        handles: list[Param] = []
        groups: list[dict[str, Any]] = []
        slot_group: list[int] = []
        for gi, g in enumerate(raw):
            label = f"{self.kind} group {gi}"
            if "params" not in g:
                raise SlotError(f"{label}: a parameter group needs a 'params' entry")
            unknown = sorted(set(g) - {"params"} - set(self.hyperparameters))
            if unknown:
                raise HyperparameterError(
                    f"{label}: unknown hyperparameter(s) {unknown}; {self.kind} takes "
                    f"{list(self.hyperparameters)}"
                )
            members = [g["params"]] if isinstance(g["params"], Param) else list(g["params"])
            for j, p in enumerate(members):
                if not isinstance(p, Param):
                    raise SlotError(
                        f"{label}: params[{j}] must be a tiegrad.Param, got {type(p).__name__}"
                    )
            start = len(handles)
            handles.extend(members)
            group = {"params": tuple(members), "slots": tuple(range(start, len(handles)))}
            group.update({k: g.get(k, self.defaults[k]) for k in self.hyperparameters})
            groups.append(group)
            slot_group.extend([gi] * len(members))
        if not handles:
            raise SlotError(f"{self.kind}: got an empty parameter list")
        return ParamList(handles), groups, slot_group

    # -- validation ----------------------------------------------------------------------
    def _checked_hyper(
        self, values: Mapping[str, Any], label: str, dtypes: Iterable[np.dtype]
    ) -> dict[str, Any]:
        hp = {}
        for name, check in self.hyperparameters.items():
            if name not in values:
                raise HyperparameterError(f"{label}: missing hyperparameter {name!r}")
            hp[name] = check(label, name, values[name])
        self._check_group(label, hp, set(dtypes))
        return hp

    def _plan(self) -> StepPlan:
        """The step plan of the current layout (``tiegrad.optim.plan``).

        The cached one while every slot holds the same storage object with the same
        trainability and row mask (compared by identity, C1, C5), else a new one. A
        storage with a row mask is stepped through its ``TrainedRows`` (``params.rows``).
        """
        storages = optimizer_cells(self.params.optimizer_storage())
        plan = self._step_plan
        if plan is None or plan.storages != storages:  # element by element: identity
            plan = StepPlan(storages, self._slot_group, len(self.param_groups))
            self._step_plan = plan
        return plan

    def _checked_groups(
        self, groups: Sequence[Mapping[str, Any]], plan: StepPlan
    ) -> list[dict[str, Any]]:
        """Every group's hyperparameters, normalized; raises on the first invalid one."""
        hps = [
            self._checked_hyper(group, f"{self.kind} group {gi}", plan.group_dtypes[gi])
            for gi, group in enumerate(groups)
        ]
        sg = self._slot_group
        for i, c in plan.aliases:
            if hps[sg[i]] != hps[sg[c]]:
                a, b = hps[sg[c]], hps[sg[i]]
                label = self._labeler.label
                diff = ", ".join(f"{k} {a[k]!r} vs {b[k]!r}" for k in a if a[k] != b[k])
                raise AliasError(
                    f"{self.kind}: {label(c)} in group {sg[c]} and {label(i)} in "
                    f"group {sg[i]} hold the same storage with different hyperparameters "
                    f"({diff}); a storage is updated once, with one set of hyperparameters"
                )
        return hps

    def _required_specs(
        self, plan: StepPlan, hps: Sequence[Mapping[str, Any]]
    ) -> dict[int, SlotSpec]:
        return plan.specs(self._slot_group, [self._state_names(hp) for hp in hps])

    def refuse_nonfinite(self, bad: int) -> None:
        """Stop a step at canonical slot ``bad``'s non-finite gradient, before any write (C6).

        ``nonfinite="skip"`` counts the step in ``skipped_steps``; ``"raise"`` raises a
        ``NonFiniteError`` naming the slot. A step that runs its own update (a sharded
        one, ``tiegrad.distributed``) calls it, so that it refuses as ``step`` does.
        """
        if self.nonfinite == "skip":
            self.skipped_steps += 1
            note_step()  # the gradients were read: the step happened, as a skip
            return
        raise NonFiniteError(
            f"{self.kind}.step: the gradient of {self._labeler.label(bad)} holds NaN or "
            f"infinity; nothing was updated (nonfinite='skip' skips such steps)"
        )
