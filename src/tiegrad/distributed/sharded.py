"""``ShardedOptimizer``: one rank's share of an optimizer's state and update (ZeRO 1, 2).

The user's optimizer (the *full* one) keeps its parameter groups, hyperparameters
(schedules write them there), counters and kind; it holds no state while sharded.
This rank's partition (``ShardPlan.pieces``) becomes flat 1-D parameters, one per
piece, stepped by an *inner* optimizer of the same class, each piece in its storage's
group with that group's current hyperparameters. Every supported optimizer is
elementwise, so updating the pieces is updating the storages: the same bits.

A step (``step``), from the pieces' mean gradients: each piece reads its storage's
current value (C3); one small all-gather gives every rank the global gradient norm
(each storage once, C4: a tied storage is one range) and the first canonical slot
whose gradient is not finite, so that all ranks clip, skip or raise alike (C6: a
refused step writes nothing anywhere); the inner optimizer steps; the updated pieces
are all-gathered and each trained storage is written once, through its host update
(copy-on-write under a live tape, C2; a device mirror released, C7).

State moves between layouts and files by canonical slot: ``gathered_state`` (a
collective) assembles the full ``{slot: {"step", name: array}}`` an unsharded optimizer
would hold, and ``install`` slices such a state into the pieces (local, no
communication), so checkpoints are the unsharded ones (C9) and a layout change
(a freeze toggled) re-partitions the state by storage.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from ..checkpoint.saving import check_optimizer_params
from ..errors import CheckpointError, DistributedError
from ..optim.clip import clip_coefficient
from ..optim.norms import all_finite, sum_of_squares
from ..params import Param, ParameterStorage, ParamList
from .group import all_gather_array, all_gather_objects
from .sharding import ShardPlan

State = Mapping[int, Mapping[str, Any]]


class ShardedOptimizer:
    """``optimizer``'s update of this rank's partition of ``plan``; see the module docstring.

    ``plist`` is the list the plan was made from; ``optimizer.params`` must hold the
    same storages at the same slots (checked, a ``DistributedError`` naming the slot).
    """

    def __init__(self, optimizer: Any, plan: ShardPlan, plist: ParamList) -> None:
        _check_same_slots(optimizer, plist)
        optimizer.state_tensor_specs()  # every group's hyperparameters checked (C6)
        self.optimizer = optimizer
        self.plan = plan
        self.plist = plist
        slot_group = {s: gi for gi, g in enumerate(optimizer.param_groups) for s in g["slots"]}
        self.pieces = [Param(np.zeros(p.size, r.dtype)) for r, p in plan.pieces]
        members: dict[int, list[int]] = {}
        for k, (_, p) in enumerate(plan.pieces):
            members.setdefault(slot_group[p.slot], []).append(k)
        self.groups = sorted(members)
        self.order = [k for gi in self.groups for k in members[gi]]  # inner slot -> piece
        self._buffers: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        self.loads = optimizer.loads  # the full optimizer's loads that the pieces reflect
        self.inner: Any = None
        if self.order:
            hp = {k: optimizer.defaults[k] for k in optimizer.hyperparameters}
            self.inner = type(optimizer)(
                [
                    {"params": [self.pieces[k] for k in members[gi]]} | self._hyper(gi)
                    for gi in self.groups
                ],
                **hp,
                nonfinite="raise",
            )

    def superseded(self) -> bool:
        """Whether the full optimizer holds a state the pieces have not taken over: one it
        reached unsharded, or a state dict loaded since they took over (an empty one too)."""
        return bool(self.optimizer.state) or self.optimizer.loads != self.loads

    def _hyper(self, gi: int) -> dict[str, Any]:
        group = self.optimizer.param_groups[gi]
        return {k: group[k] for k in self.optimizer.hyperparameters}

    # -- the step --------------------------------------------------------------------------
    def step(self, gradients: Sequence[np.ndarray], clip_norm: float | None) -> float | None:
        """One update from this rank's pieces' mean ``gradients`` (``plan.pieces`` order);
        returns the global gradient norm before clipping when ``clip_norm`` is given.

        Collective. A non-finite gradient on any rank stops the step on every rank before
        any write: ``NonFiniteError`` naming the first such slot, or, with the
        optimizer's ``nonfinite="skip"``, a skipped step counted in ``skipped_steps``.
        """
        opt = self.optimizer
        opt.state_tensor_specs()  # every rank refuses bad hyperparameters alike, first (C6)
        if len(gradients) != len(self.pieces):
            raise DistributedError(
                f"sharded step: {len(gradients)} piece gradients, this rank's partition has "
                f"{len(self.pieces)} pieces"
            )
        if self.inner is not None:
            for j, gi in enumerate(self.groups):
                self.inner.param_groups[j].update(self._hyper(gi))
        if self.superseded():  # adopt the full optimizer's state (empty: start afresh)
            self.install(opt.state)
            _clear_state(opt)
            self.loads = opt.loads
        sums = np.zeros(2, np.float64)
        bad = [p.slot for (_, p), g in zip(self.plan.pieces, gradients) if not all_finite(g)]
        sums[1] = min(bad, default=math.inf)
        if clip_norm is not None:
            sums[0] = math.fsum(sum_of_squares(g) for g in gradients)
        every = np.empty(2 * self.plan.world_size, np.float64)
        all_gather_array(every, sums, "the gradient norm all-gather")
        norm = math.sqrt(math.fsum(every[0::2].tolist())) if clip_norm is not None else None
        first_bad = float(every[1::2].min())
        if first_bad != math.inf:
            opt.refuse_nonfinite(int(first_bad))
            return norm
        finite = norm is not None and math.isfinite(norm)
        coef = clip_coefficient(clip_norm, norm) if finite else None
        if coef is not None:  # clip_grad_norm's rule
            gradients = [g * coef for g in gradients]
        if self.inner is not None:
            self._read_values()
            self.inner.step([gradients[k] for k in self.order])
        self._write_values()
        opt.step_count += 1
        return norm

    def _read_values(self) -> None:
        """Each piece holds its storage's current value (C3, C7)."""
        storages = self.plan.storages
        for (_, p), piece in zip(self.plan.pieces, self.pieces):
            source = storages[p.slot].current_host_value().reshape(-1)[p.start : p.stop]
            _write(piece.storage, source)

    def _write_values(self) -> None:
        """Every rank's updated pieces all-gathered; each trained storage written once."""
        storages = self.plan.storages
        for r in self.plan.ranges:
            lo = r.bounds(self.plan.rank)[0]
            mine, flat = self._gather_buffers(r)
            for (rr, p), piece in zip(self.plan.pieces, self.pieces):
                if rr is r:
                    mine[p.offset - lo : p.offset - lo + p.size] = piece.storage.host
            all_gather_array(flat, mine, "the parameter all-gather")
            for slot, a, b in zip(r.slots, r.offsets[:-1], r.offsets[1:]):
                st = storages[slot]
                _write(st, flat[a:b].reshape(st.shape))

    def _gather_buffers(self, r: Any) -> tuple[np.ndarray, np.ndarray]:
        """This rank's range and the whole of ``r``, allocated once, reused every step."""
        buffers = self._buffers.get(id(r))
        if buffers is None:
            mine = np.zeros(r.chunk, r.dtype)  # the padding past the end stays 0
            buffers = self._buffers[id(r)] = (mine, np.empty(r.chunk * r.world_size, r.dtype))
        return buffers

    # -- state -----------------------------------------------------------------------------
    @property
    def state_nbytes(self) -> int:
        """The bytes of optimizer state this rank holds (its pieces')."""
        return 0 if self.inner is None else state_nbytes(self.inner)

    def gathered_state(self) -> dict[int, dict[str, Any]]:
        """The full state by canonical slot, as the unsharded optimizer would hold it:
        each tensor the concatenation of its pieces over the ranks. Collective."""
        local = self.inner.state if self.inner is not None else {}
        meta = [
            (self.plan.pieces[self.order[j]][1].slot, int(e["step"]), [n for n in e if n != "step"])
            for j, e in local.items()
        ]
        entries: dict[int, dict[str, Any]] = {}
        names: dict[int, list[str]] = {}
        for rank_meta in all_gather_objects(meta, "the optimizer state gather"):
            for slot, step, tensors in rank_meta:
                entries[slot] = {"step": step}
                names[slot] = tensors
        by_piece = {self.order[j]: e for j, e in local.items()}
        for r in self.plan.ranges:
            lo = r.bounds(self.plan.rank)[0]
            wanted = list(dict.fromkeys(n for s in r.slots for n in names.get(s, ())))
            for name in wanted:
                mine = np.zeros(r.chunk, r.dtype)
                for k, (rr, p) in enumerate(self.plan.pieces):
                    e = by_piece.get(k)
                    if rr is r and e is not None and name in e:
                        mine[p.offset - lo : p.offset - lo + p.size] = e[name]
                flat = np.empty(r.chunk * r.world_size, r.dtype)
                all_gather_array(flat, mine, "the optimizer state gather")
                for slot, a, b in zip(r.slots, r.offsets[:-1], r.offsets[1:]):
                    if name in names.get(slot, ()):
                        entries[slot][name] = flat[a:b].reshape(self.plan.shapes[slot])
        return entries

    def install(self, state: State) -> None:
        """Adopt a full state by canonical slot (``gathered_state``'s form): each piece
        gets its slice, a slot without an entry starts fresh. Local; validated by the
        inner optimizer before anything changes (C6)."""
        if self.inner is None:
            return
        sd = self.inner.state_dict()
        sd["state"] = {}
        for j, k in enumerate(self.order):
            p = self.plan.pieces[k][1]
            e = state.get(p.slot)
            if e is not None:
                sd["state"][j] = {
                    n: v if n == "step" else np.asarray(v).reshape(-1)[p.start : p.stop]
                    for n, v in e.items()
                }
        self.inner.load_state_dict(sd)

    def state_by_storage(self) -> dict[int, dict[str, Any]]:
        """``gathered_state`` keyed by ``id`` of each storage, to key it by another
        layout's canonical slots. Collective."""
        return {id(self.plan.storages[s]): e for s, e in self.gathered_state().items()}


class GatheredOptimizer:
    """What ``checkpoint.save`` reads of a sharded optimizer: its parameter list and the
    ``state_dict`` an unsharded one would give (C9)."""

    def __init__(self, optimizer: Any, state: State) -> None:
        self.params = optimizer.params
        self._state_dict = optimizer.state_dict() | {"state": dict(state)}

    def state_dict(self) -> dict[str, Any]:
        return self._state_dict


def state_nbytes(optimizer: Any) -> int:
    """The bytes of ``optimizer``'s state tensors (its step counts aside)."""
    return sum(a.nbytes for e in optimizer.state.values() for n, a in e.items() if n != "step")


def _write(storage: ParameterStorage, value: np.ndarray) -> None:
    """``value`` into ``storage`` through its host update (copy-on-write, C2, C7)."""
    arr = storage.host_for_update()
    arr[...] = value
    storage.commit_host(arr)


def _clear_state(optimizer: Any) -> None:
    """Drop the full optimizer's state (its counters and settings kept): the pieces hold it."""
    sd = optimizer.state_dict()
    sd["state"] = {}
    optimizer.load_state_dict(sd)


def _check_same_slots(optimizer: Any, plist: ParamList) -> None:
    """``DistributedError`` unless ``optimizer.params`` holds ``plist``'s storages and
    trainability at every slot (``checkpoint.saving.check_optimizer_params``)."""
    if not isinstance(getattr(optimizer, "params", None), ParamList):
        raise DistributedError(
            f"sharded step: expected a tiegrad optimizer, got {type(optimizer).__name__}"
        )
    try:
        check_optimizer_params(optimizer, plist, "sharded step")
    except CheckpointError as e:
        raise DistributedError(str(e)) from None
