"""Gradient buckets: the canonical gradients of a step packed into flat buffers.

One gradient per trainable storage (its canonical slot, C5) goes into a bucket, so a
tied weight is reduced once and a frozen storage not at all. Buckets hold one dtype
each and fill in reverse slot order, as DDP's: a model's last layers come first in
the backward sweep. The first bucket holds up to ``first_bucket_bytes`` (1 MB, like
DDP's), the others up to ``bucket_bytes``; a larger gradient gets a bucket of its
own. Buffers are allocated once, on the first step, then reused: NumPy arrays
reduced through zero-copy ``torch.from_numpy`` views (the canonical gradients are
host arrays, a device session's included). With NCCL each bucket also has a GPU
twin, allocated once, that the all-reduce runs on.

A step packs every bucket (each gradient divided by the world size on the way in,
as DDP's default hook does), all-reduces each once (sum), in bucket order on every
rank, and hands out views of the buffers, valid until the next step. ``average``
does it after backward; ``overlap_hooks`` lets ``EagerSession.backward`` pack and
launch each bucket as soon as its gradients are final (``async_op=True``). Both pack
the same values into the same buckets and reduce them in the same order, so their
results are equal bit for bit.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from ..errors import ShapeError
from ..params import ParamList
from ..params.groups import dense_group_gradient
from .group import collective

DEFAULT_BUCKET_MB = 25.0
FIRST_BUCKET_BYTES = 2**20


class _Bucket:
    """Slots, their element offsets and the flat host buffer (with a GPU twin for NCCL)."""

    def __init__(self, dtype: np.dtype, slots: list[int], shapes: list[tuple[int, ...]]) -> None:
        self.dtype = dtype
        self.slots = slots
        self.shapes = shapes
        sizes = [math.prod(s) for s in shapes]
        self.offsets = [0, *np.cumsum(sizes).tolist()]
        self.buffers: tuple[Any, Any, list[np.ndarray]] | None = None
        self.work: Any = None  # the all-reduce in flight

    @property
    def nbytes(self) -> int:
        return self.offsets[-1] * self.dtype.itemsize

    def views(self, on_gpu: bool) -> tuple[Any, Any, list[np.ndarray]]:
        """The flat tensor over the host buffer, the tensor reduced (the same, or its GPU
        twin) and one view of the host buffer per slot; allocated on the first call."""
        if self.buffers is None:
            import torch

            buf = np.empty(self.offsets[-1], self.dtype)
            flat = torch.from_numpy(buf)
            reduced = torch.empty_like(flat, device="cuda") if on_gpu else flat
            views = [
                buf[a:b].reshape(shape)
                for a, b, shape in zip(self.offsets[:-1], self.offsets[1:], self.shapes)
            ]
            self.buffers = (flat, reduced, views)
        return self.buffers


class GradientBuckets:
    """The buckets of one parameter list's trainable storages; see the module docstring.

    ``bytes_reduced`` counts the bytes all-reduced so far (every bucket, every step);
    ``launched_early`` the buckets whose all-reduce started before the end of the
    backward sweep.
    """

    def __init__(
        self, plist: ParamList, bucket_bytes: int, first_bucket_bytes: int = FIRST_BUCKET_BYTES
    ) -> None:
        canonical = plist.canonical_slot_indices()
        by_dtype: dict[np.dtype, list[int]] = {}
        for i in reversed(range(len(canonical))):
            if canonical[i] == i:
                by_dtype.setdefault(np.dtype(plist[i].dtype), []).append(i)
        self.n_slots = len(plist)
        self.storages = [p.storage for p in plist]
        self.buckets: list[_Bucket] = []
        for dtype, slots in by_dtype.items():
            current: list[int] = []
            used = 0
            for i in slots:
                size = math.prod(plist[i].shape) * dtype.itemsize
                cap = bucket_bytes if self.buckets else min(bucket_bytes, first_bucket_bytes)
                if current and used + size > cap:
                    self._add(plist, dtype, current)
                    current, used = [], 0
                current.append(i)
                used += size
            if current:
                self._add(plist, dtype, current)
        self.bytes_reduced = 0
        self.launched_early = 0

    def _add(self, plist: ParamList, dtype: np.dtype, slots: list[int]) -> None:
        self.buckets.append(_Bucket(dtype, slots, [tuple(plist[i].shape) for i in slots]))

    @property
    def nbytes(self) -> int:
        """The bytes one step all-reduces: the trainable storages', each once."""
        return sum(b.nbytes for b in self.buckets)

    @property
    def allocated_bytes(self) -> int:
        """The bytes of the host buffers allocated so far (none before the first step)."""
        return sum(b.nbytes for b in self.buckets if b.buffers is not None)

    def check(self, gradients: Sequence[Any]) -> None:
        """``ShapeError`` unless ``gradients`` has one entry per slot and each trainable
        storage's gradient (or None) its shape: checked before anything is sent (C6)."""
        if len(gradients) != self.n_slots:
            raise ShapeError(
                f"gradient averaging: expected {self.n_slots} slots, got {len(gradients)}"
            )
        for b in self.buckets:
            for i, shape in zip(b.slots, b.shapes):
                g = gradients[i]
                if g is not None and tuple(g.shape) != shape:
                    raise ShapeError(
                        f"gradient averaging: slot {i} has a gradient of shape "
                        f"{tuple(g.shape)}, expected {shape}"
                    )

    def average(self, gradients: Sequence[Any], world_size: int, on_gpu: bool = False) -> list[Any]:
        """The mean over the ranks of every canonical gradient; None at the other slots.

        ``gradients`` is the list form of ``Optimizer.canonical_gradients``: an array at
        each canonical slot; ``on_gpu`` reduces on the buckets' GPU twins (NCCL). A
        canonical slot without a gradient (a storage this rank did not use) contributes
        zeros. Shapes are checked before anything is sent (C6).
        """
        self.check(gradients)
        for b in self.buckets:
            self._pack(b, [gradients[i] for i in b.slots], world_size, on_gpu)
            self._launch(b, on_gpu)
        return self.finish(on_gpu)

    def overlap_hooks(
        self, session: Any, world_size: int, on_gpu: bool = False
    ) -> list[tuple[int, Callable[[Mapping[int, Any]], None]]]:
        """The ``on_final`` hooks of ``session.backward`` that pack each bucket from the
        session's gradient groups (C4) as soon as the sweep has passed the first use of
        each of its storages, and launch the all-reduces in bucket order; call
        ``finish`` after the sweep. The tape must hold the step's uses."""
        bk = session.backend
        groups = {id(g.storage): g for g in session.parameter_groups() if g.storage is not None}
        ready = [False] * len(self.buckets)
        launched = 0
        swept = False

        def hook(k: int, members: list[Any]) -> Callable[[Mapping[int, Any]], None]:
            def pack_and_launch(result: Mapping[int, Any]) -> None:
                nonlocal launched
                grads = [None if g is None else _group_gradient(g, result, bk) for g in members]
                self._pack(self.buckets[k], grads, world_size, on_gpu)
                ready[k] = True
                while launched < len(ready) and ready[launched]:
                    self._launch(self.buckets[launched], on_gpu)
                    self.launched_early += not swept
                    launched += 1

            return pack_and_launch

        def sweep_done(result: Mapping[int, Any]) -> None:
            nonlocal swept
            swept = True

        hooks: list[tuple[int, Callable[[Mapping[int, Any]], None]]] = [(0, sweep_done)]
        for k, b in enumerate(self.buckets):
            members = [groups.get(id(self.storages[i])) for i in b.slots]
            firsts = [min(g.leaves) for g in members if g is not None]
            hooks.append((min(firsts) if firsts else len(session) + 1, hook(k, members)))
        return hooks

    def finish(self, on_gpu: bool = False) -> list[Any]:
        """Wait for every bucket's all-reduce; the averaged gradients (views of the
        buffers) at the canonical slots, None at the other slots."""
        out: list[Any] = [None] * self.n_slots
        for b in self.buckets:
            flat, reduced, views = b.views(on_gpu)
            work, b.work = b.work, None
            with collective("the gradient all-reduce"):
                work.wait()
            if reduced is not flat:
                flat.copy_(reduced)
            self.bytes_reduced += b.nbytes
            for i, view in zip(b.slots, views):
                out[i] = view
        return out

    def _pack(self, b: _Bucket, grads: list[Any], world_size: int, on_gpu: bool) -> None:
        _, _, views = b.views(on_gpu)
        scale = 1.0 / world_size
        for view, g in zip(views, grads):
            if g is None:
                view[...] = 0
            elif world_size == 1:
                np.copyto(view, g)
            else:
                np.multiply(g, view.dtype.type(scale), out=view)

    def _launch(self, b: _Bucket, on_gpu: bool) -> None:
        import torch.distributed as dist

        flat, reduced, _ = b.views(on_gpu)
        if reduced is not flat:
            reduced.copy_(flat)
        with collective("the gradient all-reduce"):
            b.work = dist.all_reduce(reduced, async_op=True)


def _group_gradient(group: Any, result: Mapping[int, Any], backend: Any) -> np.ndarray:
    """The summed gradient of ``group`` from the sweep's gradients so far, a leaf not
    reached counted as zeros: what ``Optimizer.canonical_gradients`` computes from the
    finished sweep (C4), bit for bit."""
    leaves = {
        leaf: result[leaf] if leaf in result else backend.zeros(group.shape, group.parameter.dtype)
        for leaf in group.leaves
    }
    return backend.to_numpy(dense_group_gradient(group, leaves))
