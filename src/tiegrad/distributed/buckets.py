"""Gradient buckets: the canonical gradients of a step packed into flat buffers.

One gradient per trainable storage (its canonical slot, C5) goes into a bucket, so a
tied weight is reduced once and a frozen storage not at all. Buckets hold one dtype
each, fill in slot order up to ``bucket_bytes`` (a larger gradient gets a bucket of
its own) and are allocated once, on the first step of their kind, then reused: host
buffers are NumPy arrays reduced through zero-copy ``torch.from_numpy`` views, device
buffers torch tensors on the gradients' device. ``average`` copies each gradient in,
all-reduces every bucket once (sum) and divides by the world size; the result hands
out views of the buffers, valid until the next ``average``.
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
    """Slots, their element offsets and the flat buffer (host and device kinds)."""

    def __init__(self, dtype: np.dtype, slots: list[int], shapes: list[tuple[int, ...]]) -> None:
        self.dtype = dtype
        self.slots = slots
        self.shapes = shapes
        sizes = [math.prod(s) for s in shapes]
        self.offsets = [0, *np.cumsum(sizes).tolist()]
        self.host: tuple[Any, list[np.ndarray]] | None = None
        self.device: tuple[Any, list[Any]] | None = None

    @property
    def nbytes(self) -> int:
        return self.offsets[-1] * self.dtype.itemsize

    def host_views(self) -> tuple[Any, list[np.ndarray]]:
        if self.host is None:
            import torch

            buf = np.empty(self.offsets[-1], self.dtype)
            self.host = (torch.from_numpy(buf), self._views(buf))
        return self.host

    def device_views(self, like: Any) -> tuple[Any, list[Any]]:
        if self.device is None or self.device[0].device != like.device:
            import torch

            flat = torch.empty(self.offsets[-1], dtype=like.dtype, device=like.device)
            self.device = (flat, self._views(flat))
        return self.device

    def _views(self, flat: Any) -> list[Any]:
        return [
            flat[a:b].reshape(shape)
            for a, b, shape in zip(self.offsets[:-1], self.offsets[1:], self.shapes)
        ]


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

    def average(self, gradients: Sequence[Any], world_size: int) -> list[Any]:
        """The mean over the ranks of every canonical gradient; None at the other slots.

        ``gradients`` is the list form of ``Optimizer.canonical_gradients``: an array
        (or device tensor) at each canonical slot. A canonical slot without a gradient
        (a storage this rank did not use) contributes zeros. Shapes are checked before
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
            first = next((gradients[i] for i in b.slots if gradients[i] is not None), None)
            on_device = first is not None and not isinstance(first, np.ndarray)
            flat, views = b.device_views(first) if on_device else b.host_views()
            for i, view in zip(b.slots, views):
                g = gradients[i]
                if g is None:
                    view[...] = 0
                elif on_device:
                    view.copy_(g)
                else:
                    np.copyto(view, g)
            with collective("the gradient all-reduce"):
                dist.all_reduce(flat)
            flat.mul_(scale)
            self.bytes_reduced += b.nbytes
            for i, view in zip(b.slots, views):
                out[i] = view
        return out
