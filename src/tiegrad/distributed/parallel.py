"""``DataParallel``: one model replicated on every rank of the group, kept identical.

- Wrapping checks that every rank holds the same slot layout (paths, shapes, dtypes,
  trainability, ties: the checkpoint schema's ``SlotRecord``, C5, C9) and shows both
  layouts when one differs.
- ``start`` broadcasts every storage from rank 0 and checks that the ranks agree on the
  trainer's position and data generator, so all ranks draw the same global batches.
- Each step, ``backward`` (or ``average`` after a plain backward) gives the mean over
  the ranks of the canonical gradients, one per trainable storage (C4, C5;
  ``GradientBuckets``). With ``overlap`` each bucket's all-reduce starts during the
  backward sweep, with the same bits as averaging afterwards.
- ``shard`` splits the optimizer step over the ranks by storage (ZeRO, ``ShardPlan``):
  ``"optimizer"`` (stage 1) keeps optimizer state only for this rank's partition of the
  trained elements; ``"gradients"`` (stage 2) also reduce-scatters the gradients, so a
  rank holds the mean gradient of its partition only. ``backward`` and ``average`` then
  give ``PartitionGradients`` and ``step`` updates from them: the numbers of one
  process (to rounding where clipping sums the norm in another order), state gathered
  for checkpoints (``checkpoint_optimizer``, C9).
- ``end_step`` averages the loss, sums the items and stops every rank when any was
  signalled; every ``check_every`` steps a checksum of every storage (Adler-32 of its
  bytes) is compared across ranks, and a mismatch is a ``DistributedError`` naming the
  first rank and slot that differ from rank 0.
"""

from __future__ import annotations

import zlib
from itertools import zip_longest
from typing import Any

import numpy as np

from .._checks import at_least_zero
from ..checkpoint.saving import as_param_list
from ..checkpoint.schema import layout_table, slot_records
from ..errors import DistributedError
from ..optim.clip import clip_grad_norm
from ..params import ParamList
from .buckets import DEFAULT_BUCKET_MB, GradientBuckets
from .group import all_gather_objects, collective, group, is_initialized, report_failure, staged
from .scatter import GradientScatter
from .sharded import GatheredOptimizer, ShardedOptimizer, state_nbytes
from .sharding import ShardPlan, check_plans

DEFAULT_CHECK_EVERY = 100
DEFAULT_OVERLAP = True
SHARD_MODES = ("optimizer", "gradients")


class PartitionGradients:
    """The mean gradients of this rank's pieces of ``plan`` (``ShardPlan.pieces`` order),
    as ``DataParallel.backward`` and ``average`` give them in a sharded run."""

    __slots__ = ("plan", "pieces")

    def __init__(self, plan: ShardPlan, pieces: list[np.ndarray]) -> None:
        self.plan = plan
        self.pieces = pieces


def _positive(what: str, value: Any) -> Any:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise DistributedError(f"DataParallel: {what} must be a positive number, got {value!r}")
    return value


class DataParallel:
    """Data-parallel training of ``model`` (a module or ``ParamList``) over the group.

    ``bucket_mb`` is the bucket size (about 25 MB, like DDP; the first bucket at most
    1 MB); ``check_every`` the steps between parameter checksums; ``overlap`` whether
    ``backward`` starts each bucket's all-reduce during the sweep; ``shard`` None (every
    rank steps everything), ``"optimizer"`` or ``"gradients"`` (see the module
    docstring). Construction is a collective: every rank must wrap the same layout,
    else each raises a ``DistributedError`` with both layouts.
    """

    def __init__(
        self,
        model: Any,
        *,
        bucket_mb: float = DEFAULT_BUCKET_MB,
        check_every: int = DEFAULT_CHECK_EVERY,
        overlap: bool = DEFAULT_OVERLAP,
        shard: str | None = None,
    ) -> None:
        _positive("bucket_mb", bucket_mb)
        if shard is not None and shard not in SHARD_MODES:
            raise DistributedError(
                f"DataParallel: shard must be None, 'optimizer' or 'gradients', got {shard!r}"
            )
        if not isinstance(overlap, bool):
            raise DistributedError(f"DataParallel: overlap must be True or False, got {overlap!r}")
        if isinstance(check_every, bool) or not isinstance(check_every, int) or check_every < 1:
            raise DistributedError(
                f"DataParallel: check_every must be an integer >= 1, got {check_every!r}"
            )
        self.group = group()
        self.plist: ParamList = as_param_list(model, "DataParallel")
        self.records = slot_records(self.plist)
        self._check_layouts()
        self.bucket_bytes = int(bucket_mb * 2**20)
        self.check_every = check_every
        self.overlap = overlap
        self.shard = shard
        self._sharded: ShardedOptimizer | None = None
        self._follow_layout(force=True)

    def _follow_layout(self, force: bool = False) -> None:
        """Rebuild the buckets and the partition plan when the alias layout changed since
        (a freeze toggled, a re-tie, C5); every rank changes alike, as it runs the same code."""
        if not force and self.plan.current(self.plist.optimizer_storage()):
            return
        self.records = slot_records(self.plist)
        self._storages = list(
            {id(p.storage): (i, p.storage) for i, p in enumerate(self.plist)}.values()
        )
        self.plan = ShardPlan(self.plist, self.world_size, self.rank)
        self.buckets = GradientBuckets(self.plist, self.bucket_bytes)
        self.scatter = (
            GradientScatter(self.plan, self.bucket_bytes) if self.shard == "gradients" else None
        )

    @property
    def rank(self) -> int:
        return self.group.rank

    @property
    def world_size(self) -> int:
        return self.group.world_size

    @property
    def is_main(self) -> bool:
        return self.group.rank == 0

    def _check_layouts(self) -> None:
        layouts = all_gather_objects(self.records, "the layout check")
        for r, other in enumerate(layouts):
            if other != layouts[0]:
                table = layout_table(list(zip_longest(layouts[0], other)), ("rank 0", f"rank {r}"))
                raise DistributedError(
                    f"DataParallel: rank {r} holds another parameter layout than rank 0 "
                    f"(slots, shapes, dtypes, trainability or ties differ)\n{table}"
                )

    # -- start ---------------------------------------------------------------------------
    def broadcast_parameters(self) -> None:
        """Overwrite every storage with rank 0's value (one broadcast per dtype)."""
        import torch
        import torch.distributed as dist

        by_dtype: dict[np.dtype, list[tuple[int, np.ndarray]]] = {}
        for _, st in self._storages:
            value = st.current_host_value()
            by_dtype.setdefault(value.dtype, []).append((id(st), value))
        received: dict[int, np.ndarray] = {}
        for items in by_dtype.values():
            flat = np.concatenate([v.ravel() for _, v in items])
            sent = staged(torch.from_numpy(flat))
            with collective("the parameter broadcast"):
                dist.broadcast(sent, src=0)
            flat = sent.cpu().numpy()
            offset = 0
            for key, v in items:
                received[key] = flat[offset : offset + v.size].reshape(v.shape)
                offset += v.size
        if not self.is_main:
            self.plist.set_values([received[id(p.storage)] for p in self.plist])

    def start(self, state: dict[str, Any] | None = None) -> None:
        """Broadcast the parameters, then check that every rank's trainer ``state`` (its
        position, data generator, data length, run length and optimizer settings) is
        rank 0's: ranks started with another seed, checkpoint, data or learning rate
        would train on other batches or step otherwise."""
        self.broadcast_parameters()
        states = all_gather_objects((state or {}) | {"shard": self.shard}, "the start check")
        for r, other in enumerate(states):
            if other != states[0]:
                keys = sorted(
                    k for k in set(other) | set(states[0]) if other.get(k) != states[0].get(k)
                )
                raise DistributedError(
                    f"DataParallel: rank {r} starts from another trainer state than rank 0 "
                    f"(differs in {', '.join(keys)}): start every rank with the same seed, "
                    "checkpoint, data and optimizer settings"
                )
        if self.shard is not None:
            self._check_plans()

    def _check_plans(self) -> None:
        """Every rank's partition plan is rank 0's, else a ``DistributedError`` naming the
        first piece that differs."""
        check_plans(all_gather_objects(self.plan.rows(), "the partition plan check"))

    def mean(self, value: float, what: str) -> float:
        """The mean of every rank's ``value`` (one float64 all-reduce named ``what``)."""
        import torch
        import torch.distributed as dist

        t = staged(torch.tensor([value], dtype=torch.float64))
        with collective(what):
            dist.all_reduce(t)
        return float(t.cpu()[0]) / self.world_size

    # -- each step -----------------------------------------------------------------------
    def average(self, gradients: list[Any]) -> Any:
        """The canonical gradients averaged over the ranks (see ``GradientBuckets``); in a
        sharded run the ``PartitionGradients`` of this rank (stage 2: reduce-scattered,
        ``GradientScatter``)."""
        self._follow_layout()
        if self.scatter is not None:
            self.buckets.check(gradients)
            return PartitionGradients(self.plan, self.scatter.reduce(gradients))
        return self._partition(self.buckets.average(gradients, self.world_size, self._on_gpu))

    def _partition(self, averaged: list[Any]) -> Any:
        """``averaged`` itself unsharded, else this rank's pieces of it."""
        if self.shard is None:
            return averaged
        return PartitionGradients(
            self.plan,
            [averaged[p.slot].reshape(-1)[p.start : p.stop] for _, p in self.plan.pieces],
        )

    def step(self, optimizer: Any, gradients: Any, clip_norm: float | None = None) -> float | None:
        """Update with ``optimizer`` from what ``backward`` or ``average`` returned,
        clipping the global norm to ``clip_norm`` first (each storage counted once, C4);
        returns that norm before clipping, or None without ``clip_norm``.

        ``clip_norm`` is checked first, as ``clip_grad_norm`` checks ``max_norm`` (C6).
        Unsharded: ``clip_grad_norm`` and ``optimizer.step``. Sharded: a collective
        (``ShardedOptimizer.step``) with the same numbers (to rounding where clipping
        sums the norm in another order); ``optimizer`` keeps its
        groups, hyperparameters and counters, and its state is sharded over the ranks
        (a state dict loaded into it, from a checkpoint, replaces the sharded state at
        the next step; an empty one too).
        """
        if clip_norm is not None:
            at_least_zero("DataParallel.step", "clip_norm", clip_norm)
        if self.shard is None:
            norm = None if clip_norm is None else clip_grad_norm(gradients, clip_norm)
            optimizer.step(gradients)
            return norm
        if not isinstance(gradients, PartitionGradients) or gradients.plan is not self.plan:
            raise DistributedError(
                "DataParallel.step: a sharded step takes the PartitionGradients that "
                "backward or average returned for the current layout, got "
                f"{type(gradients).__name__}"
            )
        return self._sharded_optimizer(optimizer).step(gradients.pieces, clip_norm)

    def _sharded_optimizer(self, optimizer: Any) -> ShardedOptimizer:
        """The ``ShardedOptimizer`` of ``optimizer`` over the current plan; after a layout
        change its state moves over by storage (a collective)."""
        old = self._sharded
        if old is not None and old.optimizer is optimizer and old.plan is self.plan:
            return old
        new = ShardedOptimizer(optimizer, self.plan, self.plist)
        if old is not None and old.optimizer is optimizer and not old.superseded():
            new.install(self._current_slots(old))
        self._sharded = new
        return new

    def _current_slots(self, sharded: ShardedOptimizer) -> dict[int, Any]:
        """``sharded``'s state gathered (a collective) and keyed by the current canonical
        slot of each storage; a storage trained at no slot now has none (C5)."""
        by_storage = sharded.state_by_storage()
        storages = self.plan.storages
        return {
            s: by_storage[id(storages[s])]
            for s in self.plan.shapes
            if id(storages[s]) in by_storage
        }

    def checkpoint_optimizer(self, optimizer: Any) -> Any:
        """What ``tiegrad.save`` should take as ``optimizer``: itself unsharded (or holding a
        state loaded since the last step), else an object whose ``state_dict`` is the
        unsharded one, the state gathered from every rank and keyed by the current
        layout (a collective: call it on every rank)."""
        sharded = self._sharded
        if self.shard is None or sharded is None or sharded.optimizer is not optimizer:
            return optimizer
        if sharded.superseded():  # loaded since the last step: not taken over yet
            return optimizer
        self._follow_layout()
        return GatheredOptimizer(optimizer, self._current_slots(sharded))

    def memory(self, optimizer: Any) -> dict[str, int]:
        """The bytes this rank holds between steps of optimizer state and of averaged
        gradients, and the most bytes of scratch a step adds to the gradients (stage 2's
        packing, ``GradientScatter``; 0 otherwise)."""
        if self.shard is None or self._sharded is None:
            state = state_nbytes(optimizer)
        else:
            state = self._sharded.state_nbytes
        if self.scatter is None:
            gradients, scratch = self.buckets.allocated_bytes, 0
        else:
            gradients, scratch = self.scatter.nbytes, self.scatter.scratch_bytes
        return {"optimizer_state": state, "gradients": gradients, "scratch": scratch}

    def backward(self, session: Any, loss: Any, optimizer: Any) -> Any:
        """The averaged canonical gradients of ``loss`` (sharded: this rank's
        ``PartitionGradients``, for ``step``).

        Without ``overlap``, and with ``shard="gradients"``:
        ``average(optimizer.canonical_gradients(session.backward(loss),
        allow_missing=True))``. With it, each bucket is packed and its all-reduce launched
        during the sweep, with the same bits; the gradients are validated as ``optimizer``
        does (C6). A storage this rank did not use contributes zeros (another rank may
        have used it).
        """
        self._follow_layout()
        if not self.overlap or self.scatter is not None:
            grads = optimizer.canonical_gradients(session.backward(loss), allow_missing=True)
            return self.average(grads)
        hooks = self.buckets.overlap_hooks(session, self.world_size, self._on_gpu)
        optimizer.canonical_gradients(session.backward(loss, on_final=hooks), allow_missing=True)
        return self._partition(self.buckets.finish(self._on_gpu))

    @property
    def _on_gpu(self) -> bool:
        return self.group.backend == "nccl"

    def end_step(
        self, step: int, loss: float, items: int, signum: int | None
    ) -> tuple[float, int, int | None]:
        """The mean loss over the ranks, the items of all ranks and the signal that asked
        a rank to stop (the lowest rank's; ``None``: none did), in one small all-reduce
        with a slot per rank; every ``check_every`` steps, the parameter checksum."""
        import torch
        import torch.distributed as dist

        t = torch.zeros(2 + self.world_size, dtype=torch.float64)
        t[0], t[1], t[2 + self.rank] = loss, float(items), float(signum or 0)
        t = staged(t)
        with collective("the step's loss all-reduce"):
            dist.all_reduce(t)
        t = t.cpu()
        if step % self.check_every == 0:
            self.check_parameters(step)
        signals = [int(x) for x in t[2:] if x]
        return float(t[0]) / self.world_size, int(t[1]), signals[0] if signals else None

    def checksums(self) -> list[int]:
        """The Adler-32 checksum of every storage's bytes, in order of first slot."""
        return [
            zlib.adler32(np.ascontiguousarray(st.current_host_value()).data)
            for _, st in self._storages
        ]

    def check_parameters(self, step: int | None = None) -> None:
        """Compare every storage's checksum with rank 0's; a difference is a
        ``DistributedError`` naming the first rank and slot that differ."""
        sums = all_gather_objects(self.checksums(), "the parameter checksum")
        at = "" if step is None else f" at step {step}"
        for r, other in enumerate(sums):
            for (slot, _), a, b in zip(self._storages, sums[0], other):
                if a != b:
                    raise DistributedError(
                        f"DataParallel: the parameters diverged{at}: rank {r} differs from "
                        f"rank 0 first at slot {slot} ({self.records[slot].path!r}; "
                        f"checksum {b:#010x}, rank 0 {a:#010x})"
                    )

    def fail(self, error: BaseException, step: int | None = None) -> None:
        """Report this rank's ``error`` to the others and leave the group (see
        ``group.report_failure``); a failure reported by another rank is not re-reported."""
        report_failure(error, step)


def default_parallel(model: Any) -> DataParallel | None:
    """A ``DataParallel`` of ``model`` when a process group is initialised, else None."""
    return DataParallel(model) if is_initialized() else None
