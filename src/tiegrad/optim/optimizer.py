"""``Optimizer``: the base of tiegrad's optimizers, keyed by canonical slot (C3-C6).

An optimizer concatenates its parameter groups into one ``ParamList`` (``opt.params``,
slot order = group order) and keeps its state by canonical slot of that list (C5):
each storage, however many slots hold it, has one gradient (the sum of its uses, C4),
one state entry and one update per step. Frozen slots own no state.

``step(gradients)`` takes the gradients in one of three forms and resolves them to
one array per canonical slot; from then on there is a single code path:

1. ``tiegrad.Gradients`` from ``EagerSession.backward``: the session's uses are
   grouped by storage (``parameter_groups``, ``dense_group_gradient``) and each
   group is mapped to the canonical slot holding its storage. Groups of storages
   the optimizer does not hold are ignored.
2. A list as returned by ``opt.params.canonical_gradients(slots, grads)``: one entry
   per slot, None at frozen and alias slots.
3. ``None``: ``tiegrad.latest_gradients()``, the result of the latest ``backward``
   run by the calling thread (its session held weakly).

State belongs to the storage; the canonical slot is only its key. When the layout
changes (a freeze, an unfreeze, a tie, an untie, a new storage at a slot) each entry
moves to the canonical slot of its storage, so a storage keeps one history however its
uses are frozen; a storage no longer trained at any slot loses its state at the next
write, and a new one starts fresh; ``state_dict`` (and so a checkpoint) holds the state
of the storages trained now, so one taken while a storage is frozen at every slot has
none for it, as the next step would drop it (C5). A storage whose use was recorded as
trainable but that is frozen at every slot now is refused (the layout changed since
``backward``).

Every step validates everything before its first write (C6): each group's
hyperparameters, storages shared across groups having equal hyperparameters, every
gradient (present for each trainable storage, shape, dtype), every state tensor
against its slot, and finiteness (``nonfinite="raise"``: ``NonFiniteError``;
``"skip"``: the step is skipped and counted in ``skipped_steps``). Then each
storage is updated once, from its current value (C3): ``host_for_update`` (in place
when no live tape pins the array, a copy otherwise) and ``commit_host``.

Updates run through the subclass's ``rule``: a small function over arrays that
writes the new parameter and state values into the buffers it is given, using only
NumPy-named functions with ``out=`` from an array namespace ``xp`` and in-place
operators, so the same rule runs on torch tensors (``xp=torch``). The host driver
feeds it cache-sized chunks: a large parameter in slices of ``CHUNK`` elements,
consecutive small parameters gathered into one buffer (their state is contiguous in
``FlatState``), with reused work buffers, so a step allocates no temporaries.

When numba is installed (``tiegrad.optim.fused``), a subclass's ``fused_rule`` replaces
``rule`` for float32 and float64 parameters: all canonical slots sharing coefficients
are updated by one compiled kernel that reads and writes each element once, with the
same arithmetic, bit for bit. The finiteness check is then one compiled read of the
gradients.

The work that depends only on the layout (alias map, the gradients' expected dtypes and
shapes, state layout, runs, fused tables) is cached in a ``StepPlan``
(``tiegrad.optim.plan``) and redone when anything it depends on changes; values are
read and checked on every step, so the cache changes neither results nor errors.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from operator import attrgetter
from typing import Any, ClassVar

import numpy as np

from ..errors import (
    AliasError,
    CheckpointError,
    DTypeError,
    HyperparameterError,
    MissingGradientError,
    NonFiniteError,
    ShapeError,
    SlotError,
)
from ..params import Param, ParamList, dense_group_gradient
from ..params.storage import ParameterStorage, check_host_array
from ..session import Gradients, latest_gradients
from . import fused
from .device import device_step, is_device_step, release_state, sync_state
from .fused import FusedRule
from .hyperparams import Checker, check_eps_in, count, plain
from .norms import all_finite
from .plan import CHUNK, Program, Run, StepPlan
from .state import FlatState, SlotSpec
from .state_values import check_state_values

NONFINITE_MODES = ("raise", "skip")
STATE_DICT_KEYS = (
    "kind",
    "defaults",
    "param_groups",
    "layout",
    "state",
    "step_count",
    "skipped_steps",
)

ParamsArg = ParamList | Param | Iterable[Param] | Iterable[Mapping[str, Any]]
GradientsArg = Gradients | Sequence[Any] | None

_dtype_of = attrgetter("dtype")
_shape_of = attrgetter("shape")


def l2_gradient(xp: Any, p: Any, g: Any, out: Any, weight_decay: float, maximize: bool) -> Any:
    """torch.optim's gradient preamble: ``-g`` when maximizing, then ``+ weight_decay * p``.

    Returns ``g`` itself when neither applies (no copy), else the result in ``out``.
    """
    if weight_decay:
        xp.multiply(p, weight_decay, out=out)
        (xp.subtract if maximize else xp.add)(out, g, out=out)
        return out
    if maximize:
        xp.negative(g, out=out)
        return out
    return g


class Optimizer:
    """Base class: parameter groups, gradient resolution, validation, state, the driver.

    Subclasses set ``kind`` (the name in ``state_dict``), ``hyperparameters`` (name ->
    checker, in torch.optim's order), ``work_buffers`` (scratch arrays ``rule`` needs)
    and ``rule``, and implement ``_state_names`` and ``_coefficients``; ``fused_rule``
    optionally names the compiled kernel of the same rule (``tiegrad.optim.fused``).
    """

    kind: ClassVar[str] = "Optimizer"
    hyperparameters: ClassVar[Mapping[str, Checker]] = {}
    work_buffers: ClassVar[int] = 0
    rule: ClassVar[Callable[..., None]]
    fused_rule: ClassVar[FusedRule | None] = None

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
        self._state = FlatState()
        self._state_owners: dict[int, ParameterStorage] = {}  # the storage of each entry
        self._keyed_by: StepPlan | None = None  # the plan the state is keyed by (_rekey_state)
        self._device_state: Any = None  # a DeviceState mirror after device steps (optim.device)
        self._work: dict[np.dtype, list[np.ndarray]] = {}
        self._step_plan: StepPlan | None = None  # the cached layout work (optim.plan)
        self.step_count = 0
        self.skipped_steps = 0
        hps = self._checked_groups(groups, self._plan())
        for group, hp in zip(groups, hps):
            group.update(hp)

    # -- subclass hooks ------------------------------------------------------------------
    def _check_group(self, owner: str, hp: dict[str, Any], dtypes: set[np.dtype]) -> None:
        """Checks across hyperparameters of one group (dtypes: its trainable parameters').

        By default: an ``eps`` hyperparameter must not round to 0 in those dtypes.
        """
        if "eps" in hp:
            check_eps_in(owner, hp["eps"], dtypes)

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
        sync_state(self)
        return self._state.read_only(self._trained_state_slots(self._plan()))

    def zero_grad(self, set_to_none: bool = True) -> None:
        """A no-op, kept for familiarity with torch.optim.

        tiegrad keeps no gradients on parameters: they live in the result of
        ``EagerSession.backward`` (and ``reset`` discards the tape), so there is
        nothing to clear between steps.
        """

    def canonical_gradients(
        self, gradients: GradientsArg = None, *, allow_missing: bool = False
    ) -> list[np.ndarray | None]:
        """The validated gradient of every canonical slot, None at the other slots.

        ``gradients`` takes the forms ``step`` takes. The result is the list form
        ``step`` and ``clip_grad_norm`` accept; with ``Gradients`` a storage used once
        gets the very array ``backward`` produced (C4). Nothing is written.
        ``allow_missing`` leaves None at a trainable slot whose storage the gradients
        do not reach (a micro-batch or a rank that did not use it) instead of raising:
        the caller sums such parts, and ``step`` checks the sum.
        """
        return self._resolve(gradients, self._plan(), allow_missing)

    def step(self, gradients: GradientsArg = None) -> None:
        """One update of every trainable storage (C3-C6); see the module docstring.

        Device gradients (a device session's, or a list of device tensors) take the
        device path of ``tiegrad.optim.device``: mirrors and state updated on the
        device (C7, C8). A host step first syncs and releases a device state.
        """
        if is_device_step(gradients):
            device_step(self, gradients)
            return
        plan = self._plan()
        grads = self._resolve(gradients, plan)
        hps = self._checked_groups(self.param_groups, plan)
        program = self._program(plan, hps)
        tables = {
            dtype: fused.GradientTable(layout, [grads[s] for s in layout.slots])
            for dtype, layout in program.fused.items()
        }
        bad = self._first_nonfinite(grads, program, tables)
        if bad is not None:
            self._refuse_nonfinite(bad)
            return
        release_state(self)
        self._apply(grads, hps, program, tables)
        self.step_count += 1

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
        sync_state(self)
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
            "state": self._state.snapshot(self._trained_state_slots(plan)),
            "step_count": self.step_count,
            "skipped_steps": self.skipped_steps,
        }

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Adopt a ``state_dict``, validated completely before anything changes (C6).

        Checked: the keys and ``kind``; every hyperparameter; that group ``i``'s
        ``slots`` is a list of integers, the slots of group ``i`` here; that the alias
        layout is this optimizer's (trainability, canonical and storage slot of every
        slot, compared as checkpoint loading does and shown side by side, C6, C9), and
        that no saved path names another slot here (reordered parameters), so state
        never moves to another storage or parameter; that state is only at canonical slots
        (C5); each entry's ``step`` and exactly the tensors the loaded hyperparameters
        need, with this slot's shape and dtype; the counters. The arrays are copied, so
        the dict may be reused.
        """
        where = f"{self.kind}.load_state_dict"
        sd = _mapping(where, "the state dict", state_dict)
        _exact_keys(where, "the state dict", sd, STATE_DICT_KEYS)
        if sd["kind"] != self.kind:
            raise CheckpointError(
                f"{where}: the state is for a {sd['kind']!r} optimizer, this one is {self.kind!r}"
            )
        raw_defaults = _mapping(where, "defaults", sd["defaults"])
        _exact_keys(where, "defaults", raw_defaults, tuple(self.hyperparameters))
        defaults = self._checked_hyper(raw_defaults, f"{where}: defaults", ())
        groups = sd["param_groups"]
        if not isinstance(groups, (list, tuple)) or len(groups) != len(self.param_groups):
            size = len(groups) if isinstance(groups, (list, tuple)) else type(groups).__name__
            raise CheckpointError(
                f"{where}: param_groups must be a list of {len(self.param_groups)} groups, "
                f"got {size}"
            )
        for gi, (group, mine) in enumerate(zip(groups, self.param_groups)):
            group = _mapping(where, f"param_groups[{gi}]", group)
            _exact_keys(where, f"param_groups[{gi}]", group, ("slots", *self.hyperparameters))
            slots = _slot_list(where, f'param_groups[{gi}]["slots"]', group["slots"])
            if slots != list(mine["slots"]):
                raise CheckpointError(
                    f"{where}: param_groups[{gi}] holds slots {slots}, this "
                    f"optimizer's group {gi} holds slots {list(mine['slots'])}"
                )
        self._check_layout(where, sd["layout"])
        plan = self._plan()
        hps = self._checked_groups(groups, plan)
        required = self._required_specs(plan, hps)
        specs, entries = self._checked_state(where, sd["state"], plan.slots, required)
        check_state_values(where, entries)
        step_count = _counter(where, "step_count", sd["step_count"])
        skipped = _counter(where, "skipped_steps", sd["skipped_steps"])
        self.defaults = defaults
        for group, hp in zip(self.param_groups, hps):
            group.update(hp)
        self._device_state = None  # replaced, not synced: the loaded state wins
        plan.program = None  # it holds the replaced state buffers
        self._state.install(specs, entries)
        self._state_owners = {slot: plan.storages[slot] for slot in specs}
        self._keyed_by = plan
        self.step_count = step_count
        self.skipped_steps = skipped

    def __repr__(self) -> str:
        lines = [f"{self.kind} ({len(self.params)} slots, nonfinite={self.nonfinite!r})"]
        for gi, group in enumerate(self.param_groups):
            hp = ", ".join(f"{k}={group.get(k)!r}" for k in self.hyperparameters)
            lines.append(f"  group {gi}: slots {list(group['slots'])}: {hp}")
        return "\n".join(lines)

    def _layout(self) -> list[Any]:
        """The alias layout of ``params`` as checkpoint slot records (C5, C9)."""
        from ..checkpoint.schema import slot_records

        return slot_records(self.params)

    def _check_layout(self, where: str, raw: Any) -> None:
        """``CheckpointError`` unless ``raw`` (a state dict's ``layout``) is this layout.

        Parsed and compared by the checkpoint's own code (the slot records, the strict
        layout check and its side-by-side table), so both loads agree (C6, C9). A saved
        path found at another slot here is refused too: the parameters were reordered,
        and positional state would move to another parameter (pytorch#1489). Paths that
        are new here (renamed, or unnamed ``slot{i}``) are matched by position.
        """
        from ..checkpoint.loading import check_strict_layout
        from ..checkpoint.schema import check_layout, layout_table, parse_slots

        saved = parse_slots(raw, f"{where}: layout")
        check_layout(saved, f"{where}: layout")
        mine = self._layout()
        pairs = list(zip(saved, mine))
        if len(saved) != len(mine):
            raise CheckpointError(
                f"{where}: the state is for {len(saved)} slots, this optimizer has "
                f"{len(mine)}\n{layout_table(pairs, ('state dict', 'optimizer'))}"
            )
        check_strict_layout(pairs, where, ("state dict", "optimizer"))
        here = {m.path: j for j, m in enumerate(mine)}
        for i, s in enumerate(saved):
            j = here.get(s.path, i)
            if j != i:
                raise CheckpointError(
                    f"{where}: the state dict's slot {i} is {s.path!r}, which is slot {j} "
                    f"here: the parameters come in another order, and state is kept by slot, "
                    f"so it would go to another parameter; build the optimizer over the "
                    f"parameters in the saved order\n"
                    f"{layout_table(pairs, ('state dict', 'optimizer'))}"
                )

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
            owner = f"{self.kind} group {gi}"
            if "params" not in g:
                raise SlotError(f"{owner}: a parameter group needs a 'params' entry")
            unknown = sorted(set(g) - {"params"} - set(self.hyperparameters))
            if unknown:
                raise HyperparameterError(
                    f"{owner}: unknown hyperparameter(s) {unknown}; {self.kind} takes "
                    f"{list(self.hyperparameters)}"
                )
            members = [g["params"]] if isinstance(g["params"], Param) else list(g["params"])
            for j, p in enumerate(members):
                if not isinstance(p, Param):
                    raise SlotError(
                        f"{owner}: params[{j}] must be a tiegrad.Param, got {type(p).__name__}"
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
    def _label(self, slot: int) -> str:
        name = self.params[slot].name
        return f"slot {slot} ({name!r})" if name else f"slot {slot}"

    def _checked_hyper(
        self, values: Mapping[str, Any], owner: str, dtypes: Iterable[np.dtype]
    ) -> dict[str, Any]:
        hp = {}
        for name, check in self.hyperparameters.items():
            if name not in values:
                raise HyperparameterError(f"{owner}: missing hyperparameter {name!r}")
            hp[name] = check(owner, name, values[name])
        self._check_group(owner, hp, set(dtypes))
        return hp

    def _plan(self) -> StepPlan:
        """The step plan of the current layout (``tiegrad.optim.plan``).

        The cached one while every slot holds the same storage object with the same
        trainability (compared by identity, C1, C5), else a new one.
        """
        storages = self.params.optimizer_storage()
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
                diff = ", ".join(f"{k} {a[k]!r} vs {b[k]!r}" for k in a if a[k] != b[k])
                raise AliasError(
                    f"{self.kind}: {self._label(c)} in group {sg[c]} and {self._label(i)} in "
                    f"group {sg[i]} hold the same storage with different hyperparameters "
                    f"({diff}); a storage is updated once, with one set of hyperparameters"
                )
        return hps

    def _required_specs(
        self, plan: StepPlan, hps: Sequence[Mapping[str, Any]]
    ) -> dict[int, SlotSpec]:
        return plan.specs(self._slot_group, [self._state_names(hp) for hp in hps])

    def _state_specs(self, plan: StepPlan, hps: Sequence[Mapping[str, Any]]) -> dict[int, SlotSpec]:
        """The state layout this step needs, the existing state re-keyed to it first.

        State belongs to a storage; its canonical slot is only its key. After a layout
        change (a freeze, an unfreeze, a tie, an untie, a new storage at a slot) each
        entry moves to the canonical slot of its storage (``_rekey_state``), so it
        always fits its slot's shape and dtype. State of a storage no longer trained at
        any slot is dropped at the write; a new storage starts a new history.
        """
        self._rekey_state(plan)
        return self._required_specs(plan, hps)

    def _rekey_state(self, plan: StepPlan) -> None:
        """Key the state by ``plan``'s canonical slots: each entry moves with its storage.

        ``_state_owners`` names the storage of every entry. An entry whose storage
        ``plan`` trains moves to that storage's canonical slot, with its step count and
        tensors: one history per storage however its slots are frozen, tied or untied
        (C1, C5). An entry of a storage ``plan`` no longer trains stays where no
        canonical slot is, until the next write drops it (so a refused step loses
        nothing, C6), and is dropped now otherwise. A newer device state is synced first.
        """
        if self._keyed_by is plan:
            return
        owners = self._state_owners
        moves: dict[int, int] = {}
        kept: dict[int, ParameterStorage] = {}
        for slot, storage in owners.items():
            new = plan.index.get(id(storage))
            if new is not None:
                moves[slot] = new
                kept[new] = storage
        for slot, storage in owners.items():
            if slot not in moves and plan.slots[slot] != slot:
                moves[slot] = slot
                kept[slot] = storage
        if len(moves) < len(owners) or any(old != new for old, new in moves.items()):
            release_state(self)
            self._state.rekey(moves)
        self._state_owners = kept
        self._keyed_by = plan

    def _trained_state_slots(self, plan: StepPlan) -> list[int]:
        """The slots of the state entries of storages ``plan`` trains (canonical slots)."""
        self._rekey_state(plan)
        return [slot for slot in self._state.slots() if plan.slots[slot] == slot]

    def _checked_state(
        self,
        where: str,
        state: Any,
        slots: Sequence[int | None],
        required: Mapping[int, SlotSpec],
    ) -> tuple[dict[int, SlotSpec], dict[int, Mapping[str, Any]]]:
        state = _mapping(where, "state", state)
        specs: dict[int, SlotSpec] = {}
        entries: dict[int, Mapping[str, Any]] = {}
        for key, entry in state.items():
            if isinstance(key, (bool, np.bool_)) or not isinstance(key, (int, np.integer)):
                raise CheckpointError(f"{where}: state key {key!r} is not a slot index")
            slot = int(key)
            if not 0 <= slot < len(slots):
                raise CheckpointError(f"{where}: state for slot {slot}, outside [0, {len(slots)})")
            if slot not in required:
                c = slots[slot]
                what = "is frozen" if c is None else f"shares the storage of slot {c}"
                raise AliasError(
                    f"{where}: state for slot {slot}, which {what} in this parameter list; "
                    f"state belongs to canonical slots only (C5)"
                )
            entry = _mapping(where, f"state of slot {slot}", entry)
            shape, dtype, names = required[slot]
            _exact_keys(where, f"state of slot {slot}", entry, ("step", *names))
            _counter(where, f"step of slot {slot}", entry["step"], 1)  # state exists after a step
            for name in names:
                arr = entry[name]
                if not isinstance(arr, np.ndarray):
                    raise CheckpointError(
                        f"{where}: state {name!r} of slot {slot} is a {type(arr).__name__}, "
                        f"expected a NumPy array"
                    )
                what = f"{where}: state {name!r} of slot {slot}"
                _check_state_tensor(what, arr, shape, dtype, "expected")
            specs[slot] = required[slot]
            entries[slot] = entry
        return specs, entries

    # -- gradients -----------------------------------------------------------------------
    def _resolve(
        self, gradients: GradientsArg, plan: StepPlan, allow_missing: bool = False
    ) -> list[np.ndarray | None]:
        """The validated gradient of each canonical slot of ``plan``, None elsewhere (C4-C6);
        ``allow_missing``: None, too, at a canonical slot without one."""
        if gradients is None:
            gradients = latest_gradients()
            if gradients is None:
                raise MissingGradientError(
                    f"{self.kind}.step: no gradients given and no backward has run"
                )
        if isinstance(gradients, Gradients):
            raw = self._session_gradients(gradients, plan)
            hint = " (no trainable use of its storage was recorded before that backward)"
        elif isinstance(gradients, (list, tuple)):
            raw = self._list_gradients(gradients, plan)
            hint = ""
        else:
            raise SlotError(
                f"{self.kind}.step: expected tiegrad.Gradients, a per-slot list or None, got "
                f"{type(gradients).__name__}"
            )
        given = [raw[i] for i in plan.canonical] if plan.spare else raw
        if (
            list(map(type, given)) == plan.types
            and list(map(_dtype_of, given)) == plan.dtypes
            and list(map(_shape_of, given)) == plan.shapes
        ):
            return raw  # every gradient an ndarray of its slot's dtype and shape
        for i, g in zip(plan.canonical, given):
            p = plan.storages[i]
            if g is None and allow_missing:
                continue
            if g is None:
                raise MissingGradientError(
                    f"{self.kind}.step: {self._label(i)} is trainable but has no gradient{hint}"
                )
            raw[i] = check_host_array(
                f"{self.kind}.step: gradient of {self._label(i)}", g, p.shape, p.dtype
            )
        return raw

    def _session_gradients(self, gradients: Gradients, plan: StepPlan) -> list[Any]:
        """The session's group gradients at the canonical slots of their storages (C1)."""
        session = gradients.session
        index = plan.index
        groups = gradients.parameter_groups()
        self._check_recorded(groups, plan)
        raw: list[Any] = [None] * len(plan.slots)
        for group in groups:
            i = None if group.storage is None else index.get(id(group.storage))
            if i is not None:
                raw[i] = session.backend.to_numpy(dense_group_gradient(group, gradients))
        return raw

    def _check_recorded(self, groups: Sequence[Any], plan: StepPlan) -> None:
        """``AliasError`` if a recorded group's storage is held here but trained at no slot.

        Its use was trainable when recorded and is frozen at every slot now: stepping
        would silently drop that recorded gradient (the layout changed since backward).
        Groups of storages this optimizer does not hold are another optimizer's.
        """
        held: dict[int, int] | None = None
        for group in groups:
            if group.storage is None or id(group.storage) in plan.index:
                continue
            if held is None:
                held = {id(p.storage): slot for slot, p in reversed(list(enumerate(self.params)))}
            if id(group.storage) in held:
                raise AliasError(
                    f"{self.kind}.step: the layout changed since backward: leaf "
                    f"{group.id} recorded a trainable use of the storage of "
                    f"{self._label(held[id(group.storage)])}, which is frozen at every slot "
                    f"now; its recorded gradient would be dropped (record again, or restore "
                    f"the trainability before stepping)"
                )

    def _list_gradients(self, gradients: Sequence[Any], plan: StepPlan) -> list[Any]:
        """A copy of a per-slot list, checked to hold None at frozen and alias slots (C5)."""
        slots = plan.slots
        if len(gradients) != len(slots):
            raise SlotError(
                f"{self.kind}.step: {len(gradients)} gradients for {len(slots)} slots; "
                f"expected one entry per slot (None at frozen and alias slots)"
            )
        for i in plan.spare:
            if gradients[i] is not None:
                c = slots[i]
                what = "frozen" if c is None else f"an alias of slot {c}"
                raise SlotError(
                    f"{self.kind}.step: slot {i} is {what} and its entry must be None; sum "
                    f"per-slot gradients with opt.params.canonical_gradients(slots, grads)"
                )
        return list(gradients)

    # -- the update ----------------------------------------------------------------------
    def _program(self, plan: StepPlan, hps: Sequence[Mapping[str, Any]]) -> Program:
        """``plan``'s cached ``Program`` while it holds, else a new one (``optim.plan``).

        A new program's state layout is checked against the existing state first (C6).
        """
        names = tuple(self._state_names(hp) for hp in hps)
        rule = self.fused_rule
        fusable = frozenset(d for d in plan.dtype_set if rule is not None and fused.supports(d))
        key = (names, fusable)
        program = plan.program
        if program is None or not program.current(key, self._state):
            specs = self._state_specs(plan, hps)
            program = Program(key, specs, self._state, self._slot_group, plan.storages, fusable)
            plan.program = program
        return program

    def _refuse_nonfinite(self, bad: int) -> None:
        """Stop a step at slot ``bad``'s non-finite gradient, before any write (C6).

        ``nonfinite="skip"`` counts the step in ``skipped_steps``; ``"raise"`` raises.
        """
        if self.nonfinite == "skip":
            self.skipped_steps += 1
            return
        raise NonFiniteError(
            f"{self.kind}.step: the gradient of {self._label(bad)} holds NaN or "
            f"infinity; nothing was updated (nonfinite='skip' skips such steps)"
        )

    def _first_nonfinite(
        self,
        grads: Sequence[np.ndarray | None],
        program: Program,
        tables: Mapping[np.dtype, fused.GradientTable],
    ) -> int | None:
        """The first canonical slot whose gradient holds NaN or infinity, or None (C6)."""
        bad = [table.first_nonfinite() for table in tables.values()]
        bad += [s for s in program.rest if not all_finite(grads[s])]
        return min((slot for slot in bad if slot is not None), default=None)

    def _arrange_state(
        self, specs: Mapping[int, SlotSpec], hps: Sequence[Mapping[str, Any]]
    ) -> set[tuple[int, str]]:
        """``FlatState.arrange`` for ``specs``, new tensors at their group's initial value."""
        sg = self._slot_group
        created = self._state.arrange(specs, lambda s, name: self._initial_value(name, hps[sg[s]]))
        storages = self._plan().storages
        self._state_owners = {slot: storages[slot] for slot in specs}
        return created

    def _apply(
        self,
        grads: Sequence[np.ndarray | None],
        hps: Sequence[Mapping[str, Any]],
        program: Program,
        tables: Mapping[np.dtype, fused.GradientTable],
    ) -> None:
        """The update after validation: state arranged on a program's first step, then
        one rule call per run, each storage from its current value (C3, C4).

        A square of a finite gradient may overflow to +inf (``optim.state_values``): the
        NumPy rules do not warn of it, as the kernels and PyTorch do not."""
        if not program.arranged:
            self._arrange_state(program.specs, hps)
        with np.errstate(over="ignore"):
            for i, run in enumerate(program.runs):
                gi, step, fresh, dtype = run.key
                names = program.specs[run.slots[0]][2]
                c = self._coefficients(hps[gi], step, fresh)
                if dtype in tables and self.fused_rule is not None:
                    batch = program.batches.get(i)
                    if batch is None:
                        batch = self._batch(self.fused_rule, program, i, names)
                        program.batches[i] = batch
                    self._update_fused(batch, run, tables[dtype], c)
                elif len(run.slots) == 1:
                    self._update_one(run, grads[run.slots[0]], names, c)
                else:
                    self._update_many(run, grads, names, c)
                self._state.set_steps(run.slots, step)
        program.advance()

    def _work_rows(self, dtype: np.dtype) -> list[np.ndarray]:
        """``work_buffers`` scratch rows plus two gather rows of ``CHUNK`` elements, reused."""
        rows = self._work.get(dtype)
        if rows is None:
            rows = list(np.empty((self.work_buffers + 2, CHUNK), dtype))
            self._work[dtype] = rows
        return rows

    def _update_one(self, run: Run, g: np.ndarray, names: tuple[str, ...], c: Any) -> None:
        """The one slot of ``run`` updated by ``rule`` in slices of ``CHUNK`` elements."""
        slot, storage = run.slots[0], run.storages[0]
        arr = _contiguous(storage.host_for_update())
        p = arr.reshape(-1)
        gf = g.reshape(-1)
        state = {name: self._state.span(slot, slot, name) for name in names}
        if any(np.may_share_memory(gf, a) for a in (p, *state.values())):
            gf = gf.copy()  # the rule writes the parameter and its state before it reads g
        work = self._work_rows(arr.dtype)[: self.work_buffers]
        rule = type(self).rule
        for s in range(0, p.size, CHUNK):
            e = min(s + CHUNK, p.size)
            n = e - s
            rule(
                np, p[s:e], gf[s:e], {k: v[s:e] for k, v in state.items()}, [w[:n] for w in work], c
            )
        storage.commit_host(arr)

    def _batch(
        self, rule: FusedRule, program: Program, i: int, names: tuple[str, ...]
    ) -> fused.Batch:
        """The ``fused.Batch`` of ``program``'s run ``i`` on the arranged state."""
        run = program.runs[i]
        rows = np.array(run.slots, np.intp)
        state = {name: self._state.offsets(rows, name) for name in names}
        return fused.Batch(rule, program.fused[run.key[3]], i, run.rows, state)

    def _update_fused(
        self, batch: fused.Batch, run: Run, grads: fused.GradientTable, c: Any
    ) -> None:
        """The slots of ``run`` updated by ``batch``'s kernel calls, in place."""
        storages = run.storages
        arrs = [_contiguous(storage.host_for_update()) for storage in storages]
        fused.run(batch, c, arrs, grads)
        for storage, arr in zip(storages, arrs):
            storage.commit_host(arr)

    def _update_many(self, run: Run, grads: Sequence[Any], names: tuple[str, ...], c: Any) -> None:
        """The small slots of ``run`` gathered into one buffer, updated by one ``rule`` call."""
        arrs = [storage.host_for_update() for storage in run.storages]
        n = sum(a.size for a in arrs)
        rows = self._work_rows(arrs[0].dtype)
        p, g = rows[-2][:n], rows[-1][:n]
        np.concatenate([a.reshape(-1) for a in arrs], out=p)
        np.concatenate([grads[slot].reshape(-1) for slot in run.slots], out=g)
        state = {name: self._state.span(run.slots[0], run.slots[-1], name) for name in names}
        type(self).rule(np, p, g, state, [w[:n] for w in rows[: self.work_buffers]], c)
        start = 0
        for storage, a in zip(run.storages, arrs):
            a[...] = p[start : start + a.size].reshape(a.shape)
            start += a.size
            storage.commit_host(a)


def _contiguous(arr: np.ndarray) -> np.ndarray:
    """``arr`` itself when C-contiguous, else a C-contiguous copy of the same shape."""
    return arr if arr.flags.c_contiguous else np.ascontiguousarray(arr)


def _check_state_tensor(
    what: str, arr: np.ndarray, shape: tuple[int, ...], dtype: np.dtype, expected: str
) -> None:
    """``ShapeError`` / ``DTypeError`` unless the state tensor ``arr`` has ``shape`` and
    ``dtype`` (in either byte order: the state is copied into native arrays)."""
    if arr.shape != shape:
        raise ShapeError(f"{what} has shape {arr.shape}, {expected} {shape}")
    if arr.dtype.newbyteorder("=") != dtype:
        raise DTypeError(f"{what} has dtype {arr.dtype.name}, {expected} {dtype.name}")


def _mapping(where: str, what: str, value: Any) -> Mapping[str, Any]:
    if not isinstance(value, Mapping):
        raise CheckpointError(f"{where}: {what} must be a mapping, got {type(value).__name__}")
    return value


def _exact_keys(where: str, what: str, value: Mapping[str, Any], keys: Sequence[str]) -> None:
    missing = [k for k in keys if k not in value]
    unexpected = sorted(str(k) for k in value if k not in keys)
    if missing or unexpected:
        raise CheckpointError(
            f"{where}: {what} has keys {sorted(map(str, value))}, expected {list(keys)} "
            f"(missing {missing}, unexpected {unexpected})"
        )


def _slot_list(where: str, what: str, value: Any) -> list[Any]:
    """``value`` (a state dict's list of slot indices) as a list, or a ``CheckpointError``
    naming ``what`` and, for a bad entry, its position, type and value."""
    if not isinstance(value, (list, tuple)):
        raise CheckpointError(
            f"{where}: {what} must be a list of slot indices, got {type(value).__name__}"
        )
    for j, s in enumerate(value):
        if isinstance(s, bool) or not isinstance(s, (int, np.integer)):
            raise CheckpointError(
                f"{where}: {what}[{j}] must be a slot index (an integer), got "
                f"{type(s).__name__} {s!r}"
            )
    return list(value)


def _counter(where: str, what: str, value: Any, minimum: int = 0) -> int:
    """An integer >= ``minimum`` from a state dict, or a ``CheckpointError``."""
    try:
        return count(where, what, value, minimum)
    except HyperparameterError as e:
        raise CheckpointError(str(e)) from None
