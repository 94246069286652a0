"""NumPy's indexing on torch tensors, for ``TorchBackend``'s indexing methods.

torch reads some indexes differently from NumPy: a ``uint8`` tensor as a mask, a nested
list as a tuple of indices, a negative index in ``index_select`` as an error, and it
has no view for a slice of negative step. ``torch_index`` translates an index so that
torch reads it as NumPy would; ``add_at`` is ``np.add.at`` (repeated indices
accumulate) with torch's ``index_add_``.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from ..errors import IndexRangeError
from .base import Backend


def torch_index(bk: Backend, index: Any) -> Any:
    """NumPy's index as torch reads it: every array-like component a tensor on the
    device of ``bk`` (a ``TorchBackend``), int64 for integers, bool for masks; other
    element types, and slices of negative step, are an ``IndexRangeError``."""
    if isinstance(index, tuple):
        return tuple(torch_index(bk, i) for i in index)
    if isinstance(index, slice) and index.step is not None and index.step < 0:
        raise IndexRangeError(
            f"{index!r}: a slice of negative step has no view on the torch backend; "
            "index with an integer array instead (np.arange(n - 1, -1, -1) reverses)"
        )
    if isinstance(index, (np.ndarray, list)):
        arr = np.asarray(index)
        if not arr.size and isinstance(index, list):
            arr = arr.astype(np.int64)  # NumPy's reading of x[[]]: no position
        if arr.dtype.kind not in "biu":
            raise IndexRangeError(
                f"an index array must hold integers or bools, got dtype {arr.dtype}"
            )
        return bk.asarray(arr if arr.dtype.kind == "b" else arr.astype(np.int64))
    if isinstance(index, torch.Tensor):
        if not bk._on_device(index):
            index = index.to(bk.torch_device)
        if index.dtype == torch.uint8:
            index = index.to(torch.int64)
    return index


def wrap_negative(idx: torch.Tensor, n: int) -> torch.Tensor:
    """Integer positions into an axis of ``n`` with NumPy's negative ones counted from
    the end (torch's ``index_select`` and ``take_along_dim`` refuse them)."""
    return torch.where(idx < 0, idx + n, idx)


def add_at(out: torch.Tensor, index: Any, values: torch.Tensor) -> None:
    """``out[index] += values`` with repeated indices accumulated, like ``np.add.at``;
    ``index`` already translated (``torch_index``), ``values`` of ``out``'s dtype."""
    parts = index if isinstance(index, tuple) else (index,)
    arrays = [p for p in parts if isinstance(p, torch.Tensor)]
    if not arrays:  # basic indexing selects each element at most once
        out[index] += values
        return
    if len(parts) == 1 and not arrays[0].dtype.is_floating_point and arrays[0].dtype != torch.bool:
        idx = wrap_negative(arrays[0].to(torch.int64), out.shape[0]).reshape(-1)
        rows = torch.broadcast_to(values, tuple(arrays[0].shape) + tuple(out.shape[1:]))
        out.index_add_(0, idx, rows.reshape((-1,) + tuple(out.shape[1:])))
        return
    positions = torch.arange(out.numel(), device=out.device).reshape(out.shape)[index]
    flat = torch.broadcast_to(values, tuple(positions.shape)).reshape(-1)
    out.view(-1).index_add_(0, positions.reshape(-1), flat)
