"""Gradient buckets: the canonical gradients of a step packed into flat buffers.

One gradient per trainable storage (its canonical slot, C5) goes into a bucket, so a
tied weight is reduced once and a frozen storage not at all. Buckets hold one dtype
each, fill in slot order up to ``bucket_bytes`` (a larger gradient gets a bucket of
its own) and are allocated once, on the first step, then reused: NumPy arrays reduced
through zero-copy ``torch.from_numpy`` views (the canonical gradients are host arrays,
a device session's included). With NCCL each bucket also has a GPU twin, allocated
once, that the all-reduce runs on. ``average`` copies each gradient in, all-reduces
every bucket once (sum) and divides by the world size; the result hands out views of
the buffers, valid until the next ``average``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from ..errors import ShapeError
from ..params import ParamList
from .group import collective

DEFAULT_BUCKET_MB = 25.0


class _Bucket:
    """Slots, their element offsets and the flat host buffer (with a GPU twin for NCCL)."""

    def __init__(self, dtype: np.dtype, slots: list[int], shapes: list[tuple[int, ...]]) -> None:
        self.dtype = dtype
        self.slots = slots
        self.shapes = shapes
        sizes = [math.prod(s) for s in shapes]
        self.offsets = [0, *np.cumsum(sizes).tolist()]
        self.buffers: tuple[Any, Any, list[np.ndarray]] | None = None

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

    ``bytes_reduced`` counts the bytes all-reduced so far (every bucket, every step).
    """

    def __init__(self, plist: ParamList, bucket_bytes: int) -> None:
        canonical = plist.canonical_slot_indices()
        by_dtype: dict[np.dtype, list[int]] = {}
        for i, c in enumerate(canonical):
            if c == i:
                by_dtype.setdefault(np.dtype(plist[i].dtype), []).append(i)
        self.n_slots = len(plist)
        self.buckets: list[_Bucket] = []
        for dtype, slots in by_dtype.items():
            current: list[int] = []
            used = 0
            for i in slots:
                size = math.prod(plist[i].shape) * dtype.itemsize
                if current and used + size > bucket_bytes:
                    self._add(plist, dtype, current)
                    current, used = [], 0
                current.append(i)
                used += size
            if current:
                self._add(plist, dtype, current)
        self.bytes_reduced = 0

    def _add(self, plist: ParamList, dtype: np.dtype, slots: list[int]) -> None:
        self.buckets.append(_Bucket(dtype, slots, [tuple(plist[i].shape) for i in slots]))

    @property
    def nbytes(self) -> int:
        """The bytes one ``average`` all-reduces: the trainable storages', each once."""
        return sum(b.nbytes for b in self.buckets)

    def average(self, gradients: Sequence[Any], world_size: int, on_gpu: bool = False) -> list[Any]:
        """The mean over the ranks of every canonical gradient; None at the other slots.

        ``gradients`` is the list form of ``Optimizer.canonical_gradients``: an array at
        each canonical slot; ``on_gpu`` reduces on the buckets' GPU twins (NCCL). A
        canonical slot without a gradient (a storage this rank did not use) contributes
        zeros. Shapes are checked before
        anything is sent (C6).
        """
        import torch.distributed as dist

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
        out: list[Any] = [None] * self.n_slots
        scale = 1.0 / world_size
        for b in self.buckets:
            flat, reduced, views = b.views(on_gpu)
            for i, view in zip(b.slots, views):
                g = gradients[i]
                if g is None:
                    view[...] = 0
                else:
                    np.copyto(view, g)
            if reduced is not flat:
                reduced.copy_(flat)
            with collective("the gradient all-reduce"):
                dist.all_reduce(reduced)
            if reduced is not flat:
                flat.copy_(reduced)
            flat.mul_(scale)
            self.bytes_reduced += b.nbytes
            for i, view in zip(b.slots, views):
                out[i] = view
        return out
