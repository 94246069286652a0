"""What ``Optimizer.step`` hands an executor, and the interface every executor implements.

A step goes down the layers once: ``Optimizer.step`` (``optim.optimizer``) picks the
executor of the gradients' backend, has it resolve and check the gradients, checks the
hyperparameters, and hands it one ``Update``: the layout (``StepPlan``), the checked
hyperparameters and state names of every group, the ``KeyedState`` and the
``UpdateRule``. The host executor (``optim.host``: NumPy, numba) and the device executor
(``optim.device``: torch foreach and fused kernels) implement ``Executor`` and call
nothing in ``optim.optimizer``.
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import AbstractContextManager
from typing import Any, NamedTuple, Protocol

from ..params import ParamList
from .keyed_state import KeyedState
from .plan import StepPlan
from .rule import Hyper, UpdateRule
from .state import SlotSpec


class Labeler(NamedTuple):
    """How a step's messages name its optimizer (``kind``) and its slots (``label``)."""

    kind: str
    params: ParamList

    def label(self, slot: int) -> str:
        name = self.params[slot].name
        return f"slot {slot} ({name!r})" if name else f"slot {slot}"


class Update:
    """One checked step: everything an executor needs, nothing it must ask back for.

    ``hps`` and ``names``: per group, the checked hyperparameters and the state tensor
    names; ``slot_group``: the group of every slot; ``prepared``: what the executor's
    ``first_nonfinite`` worked out for its ``apply`` (the executor's own business).
    """

    __slots__ = ("plan", "hps", "names", "slot_group", "state", "rule", "prepared")

    def __init__(
        self,
        plan: StepPlan,
        hps: Sequence[Hyper],
        names: tuple[tuple[str, ...], ...],
        slot_group: Sequence[int],
        state: KeyedState,
        rule: UpdateRule,
    ) -> None:
        self.plan = plan
        self.hps = hps
        self.names = names
        self.slot_group = slot_group
        self.state = state
        self.rule = rule
        self.prepared: Any = None

    def specs(self) -> dict[int, SlotSpec]:
        """The state layout this step needs, the existing state re-keyed to it first (C5)."""
        self.state.rekey(self.plan)
        return self.plan.specs(self.slot_group, self.names)

    def arrange(self, specs: dict[int, SlotSpec]) -> set[tuple[int, str]]:
        """The state arranged to ``specs``, new tensors at their group's initial value;
        returns the ``(slot, name)`` pairs created."""
        hps, sg, initial = self.hps, self.slot_group, self.rule.initial
        return self.state.arrange(self.plan, specs, lambda s, name: initial(name, hps[sg[s]]))

    def coefficients(self, group: int, step: int, fresh: frozenset[str]) -> Any:
        """The rule's scalars for the ``step``-th update of a slot of ``group``."""
        return self.rule.coefficients(self.hps[group], step, fresh)


class Executor(Protocol):
    """Runs checked updates on one backend's arrays (C3-C8).

    ``gradients`` resolves ``given`` (``Gradients`` or a per-slot list) to one gradient
    per canonical slot of ``plan``, None at the others, checked (presence, shape, dtype,
    device; C4-C6); it is a context because a summed device gradient is a temporary
    released when the step ends, whether it succeeds or raises (C8). ``first_nonfinite``
    checks what is left (mirrors readable, finiteness) and returns the first canonical
    slot whose gradient holds NaN or infinity, or None; nothing is written until
    ``apply``, which updates each trainable storage once from its current value (C3).
    """

    def gradients(
        self, labeler: Labeler, plan: StepPlan, given: Any
    ) -> AbstractContextManager[list[Any]]: ...

    def first_nonfinite(self, update: Update, grads: list[Any]) -> int | None: ...

    def apply(self, update: Update, grads: list[Any]) -> None: ...
