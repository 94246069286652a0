"""Gradients resolved to one array per canonical slot, checked before any write (C4-C6).

``Optimizer.step`` takes gradients in three forms:

1. ``tiegrad.Gradients`` from ``EagerSession.backward``: the session's uses are grouped
   by storage (``parameter_groups``) and each group's summed gradient goes to the
   canonical slot holding its storage. Groups of storages the optimizer does not hold
   are another optimizer's and are ignored.
2. A per-slot list, as ``opt.params.canonical_gradients(slots, grads)`` returns: one
   entry per slot, None at frozen and alias slots.
3. ``None``: ``tiegrad.latest_gradients()``, the result of the latest ``backward`` run by
   the calling thread.

``resolve`` gives the host form (NumPy arrays); the device executor (``optim.device``)
shares ``given``, ``list_gradients``, ``check_recorded`` and ``check_complete``.
"""

from __future__ import annotations

from collections.abc import Sequence
from operator import attrgetter
from typing import Any

import numpy as np

from ..errors import AliasError, MissingGradientError, SlotError
from ..params import dense_group_gradient
from ..params.storage import check_host_array
from ..session import Gradients, latest_gradients
from .plan import StepPlan
from .update import Labeler

_dtype_of = attrgetter("dtype")
_shape_of = attrgetter("shape")
_SESSION_HINT = " (no trainable use of its storage was recorded before that backward)"


def given(labeler: Labeler, gradients: Any) -> Any:
    """``gradients``, or for None the latest ``backward``'s result of this thread."""
    if gradients is None:
        gradients = latest_gradients()
        if gradients is None:
            raise MissingGradientError(
                f"{labeler.kind}.step: no gradients given, and no backward has run in this "
                "thread since the last zero_grad()"
            )
    return gradients


def resolve(
    labeler: Labeler, plan: StepPlan, gradients: Any, allow_missing: bool = False
) -> list[np.ndarray | None]:
    """The checked host gradient of each canonical slot of ``plan``, None elsewhere.

    A storage used once gets the very array ``backward`` produced (C4); one with a row
    mask, the rows it trains (``params.rows``: a whole-storage gradient is gathered).
    ``allow_missing``: None, too, at a canonical slot that the gradients do not reach.
    """
    gradients = given(labeler, gradients)
    if isinstance(gradients, Gradients):
        raw = _session_gradients(labeler, gradients, plan)
        hint = _SESSION_HINT
    elif isinstance(gradients, (list, tuple)):
        raw = list_gradients(labeler, gradients, plan)
        hint = ""
    else:
        raise SlotError(
            f"{labeler.kind}.step: expected tiegrad.Gradients, a per-slot list or None, got "
            f"{type(gradients).__name__}"
        )
    for i, cell in plan.masked:  # a row mask: the gradient of the trained rows
        raw[i] = None if raw[i] is None else cell.trained_part(raw[i])
    present = [raw[i] for i in plan.canonical] if plan.spare else raw
    if (
        list(map(type, present)) == plan.types
        and list(map(_dtype_of, present)) == plan.dtypes
        and list(map(_shape_of, present)) == plan.shapes
    ):
        return raw  # every gradient an ndarray of its slot's dtype and shape
    for i, g in zip(plan.canonical, present):
        p = plan.storages[i]
        if g is None and allow_missing:
            continue
        if g is None:
            raise _missing(labeler, i, hint)
        raw[i] = check_host_array(
            f"{labeler.kind}.step: gradient of {labeler.label(i)}", g, p.shape, p.dtype
        )
    return raw


def _session_gradients(labeler: Labeler, gradients: Gradients, plan: StepPlan) -> list[Any]:
    """The session's group gradients at the canonical slots of their storages (C1)."""
    to_numpy = gradients.session.backend.to_numpy
    index = plan.index
    groups = gradients.parameter_groups()
    check_recorded(labeler, groups, plan)
    raw: list[Any] = [None] * len(plan.slots)
    for group in groups:
        i = None if group.storage is None else index.get(id(group.storage))
        if i is not None:
            raw[i] = to_numpy(dense_group_gradient(group, gradients))
    return raw


def check_recorded(labeler: Labeler, groups: Sequence[Any], plan: StepPlan) -> None:
    """``AliasError`` if a recorded group's storage is held here but trained at no slot.

    Its use was trainable when recorded and is frozen at every slot now: stepping
    would silently drop that recorded gradient (the layout changed since backward).
    """
    held: dict[int, int] | None = None
    for group in groups:
        if group.storage is None or id(group.storage) in plan.index:
            continue
        if held is None:
            held = {id(p.storage): slot for slot, p in reversed(list(enumerate(labeler.params)))}
        if id(group.storage) in held:
            raise AliasError(
                f"{labeler.kind}.step: the layout changed since backward: leaf "
                f"{group.id} recorded a trainable use of the storage of "
                f"{labeler.label(held[id(group.storage)])}, which is frozen at every slot "
                f"now; its recorded gradient would be dropped (record again, or restore "
                f"the trainability before stepping)"
            )


def list_gradients(labeler: Labeler, gradients: Sequence[Any], plan: StepPlan) -> list[Any]:
    """A copy of a per-slot list, checked to hold None at frozen and alias slots (C5)."""
    slots = plan.slots
    if len(gradients) != len(slots):
        raise SlotError(
            f"{labeler.kind}.step: {len(gradients)} gradients for {len(slots)} slots; "
            f"expected one entry per slot (None at frozen and alias slots)"
        )
    for i in plan.spare:
        if gradients[i] is not None:
            c = slots[i]
            what = "frozen" if c is None else f"an alias of slot {c}"
            raise SlotError(
                f"{labeler.kind}.step: slot {i} is {what} and its entry must be None; sum "
                f"per-slot gradients with opt.params.canonical_gradients(slots, grads)"
            )
    return list(gradients)


def check_complete(labeler: Labeler, plan: StepPlan, have: set[int], hint: str = "") -> None:
    """``MissingGradientError`` naming the first canonical slot not in ``have``."""
    for i in plan.canonical:
        if i not in have:
            raise _missing(labeler, i, hint)


def _missing(labeler: Labeler, slot: int, hint: str) -> MissingGradientError:
    return MissingGradientError(
        f"{labeler.kind}.step: {labeler.label(slot)} is trainable but has no gradient{hint}"
    )
