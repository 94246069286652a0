"""``torch.nn.Module`` parameters in and out of tiegrad, ties kept (C1).

A tie in PyTorch is two parameter paths over one view of one storage (usually one
``Parameter`` object on two modules). Here a tie is detected by storage identity, never
by object identity: two paths are tied when their tensors have the same untyped
storage, storage offset, shape and strides. Two parameters whose byte ranges in one
storage overlap without being the same view cannot be expressed as tiegrad storages
and are refused (``AliasError`` naming both paths). torch is imported inside the
functions: tiegrad imports and runs without it.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..errors import AliasError, DTypeError, ShapeError, SlotError
from ..params import Param

_NUMPY_DTYPES = ("float16", "float32", "float64")


def _view_key(t: Any) -> tuple:
    """What makes two tensors the same view: storage, offset, shape, strides.

    Every storage of no bytes reports address 0, so a tensor with no element is its own
    view: the same Parameter under two paths is tied, two empty ones are not (C1).
    """
    if t.numel() == 0:
        return ("empty", id(t))
    storage = t.untyped_storage()
    return (storage.data_ptr(), storage.nbytes(), t.storage_offset(), tuple(t.shape), t.stride())


def _byte_range(t: Any) -> tuple[int, int]:
    """The bytes of its storage a tensor can reach: ``[first, last + 1)`` (empty: 0, 0)."""
    if t.numel() == 0:
        return 0, 0
    size = t.element_size()
    span = sum((n - 1) * abs(s) for n, s in zip(t.shape, t.stride()))
    return t.storage_offset() * size, (t.storage_offset() + span + 1) * size


def _groups(module: Any) -> list[tuple[str, Any, int]]:
    """``(path, tensor, group)`` for every parameter path, ``group`` the index of its view
    in first-appearance order; overlapping distinct views, and a view that repeats its
    elements (stride 0), are an ``AliasError``."""
    named = list(module.named_parameters(remove_duplicate=False))
    views: dict[tuple, int] = {}
    first: list[tuple[str, Any]] = []
    out = []
    for path, t in named:
        spread = [axis for axis, (n, st) in enumerate(zip(t.shape, t.stride())) if n > 1 and not st]
        if spread:
            raise AliasError(
                f"{path!r} {tuple(t.shape)} repeats its elements along axis {spread[0]} "
                "(stride 0, an expanded view): a parameter's elements must be distinct "
                "(make it a copy, e.g. .contiguous())"
            )
        key = _view_key(t)
        if key not in views:
            lo, hi = _byte_range(t)
            for other, u in first:
                same_storage = _view_key(u)[:2] == key[:2]
                ulo, uhi = _byte_range(u)
                if same_storage and lo < uhi and ulo < hi:
                    raise AliasError(
                        f"from_torch: {other!r} {tuple(u.shape)} and {path!r} {tuple(t.shape)} "
                        "overlap in one storage without being the same view; tiegrad ties "
                        "whole storages only (make one a copy or tie the same Parameter)"
                    )
            views[key] = len(first)
            first.append((path, t))
        out.append((path, t, views[key]))
    return out


def _numpy_dtype(path: str, t: Any) -> np.dtype:
    name = str(t.dtype).replace("torch.", "")
    if name not in _NUMPY_DTYPES:
        raise DTypeError(
            f"{path!r}: torch dtype {name} has no NumPy float type (expected one of "
            f"{', '.join(_NUMPY_DTYPES)}; convert the module first, e.g. module.float())"
        )
    return np.dtype(name)


def from_torch(module: Any) -> dict[str, Param]:
    """``{path: Param}`` for every parameter path of ``module``, in its order.

    Paths are those of ``named_parameters(remove_duplicate=False)``; values are copied
    to NumPy (float16, float32 or float64). Tied paths (one view, see the module
    docstring) become handles on one storage, each with its own flag and name; a tensor
    with ``requires_grad=False`` gives frozen handles. Buffers are not parameters: see
    ``torch_buffers``.
    """
    out: dict[str, Param] = {}
    first_of_group: dict[int, Param] = {}
    for path, t, group in _groups(module):
        dtype = _numpy_dtype(path, t)
        if group in first_of_group:
            out[path] = first_of_group[group].alias(requires_grad=t.requires_grad, name=path)
        else:
            value = t.detach().cpu().numpy()
            first_of_group[group] = out[path] = Param(value, t.requires_grad, path, dtype)
    return out


def torch_buffers(module: Any) -> dict[str, np.ndarray]:
    """``{path: array}`` of the module's buffers (running statistics, counters): read-only
    copies, constants to tiegrad; ``to_torch(..., buffers=...)`` writes them back."""
    out = {}
    for path, b in module.named_buffers(remove_duplicate=False):
        arr = np.array(b.detach().cpu().numpy(), copy=True)
        arr.flags.writeable = False
        out[path] = arr
    return out


def _layout_table(theirs: list[tuple[str, Any, int]], ours: dict[str, Param]) -> str:
    """Both layouts side by side: per path, the tie group and shape of each side."""
    rows = [("path", "torch", "tiegrad")]
    their = {p: (g, tuple(t.shape)) for p, t, g in theirs}
    index: dict[int, int] = {}
    mine = {}
    for p, param in ours.items():
        mine[p] = (index.setdefault(id(param.storage), len(index)), param.shape)
    for p in list(their) + [p for p in mine if p not in their]:
        cells = []
        for side in (their, mine):
            g = side.get(p)
            cells.append("-" if g is None else f"storage {g[0]} {g[1]}")
        rows.append((p, *cells))
    widths = [max(len(r[i]) for r in rows) for i in range(3)]
    return "\n".join("  " + "  ".join(c.ljust(w) for c, w in zip(r, widths)) for r in rows)


def to_torch(params: dict[str, Param], module: Any, buffers: dict[str, Any] | None = None) -> None:
    """Write ``params`` (``{path: Param}``, e.g. from ``from_torch``) into ``module``.

    The tie layout must match: the same paths, grouped into the same storages (by view
    identity on the torch side, storage identity here), with equal shapes and dtypes;
    otherwise an ``AliasError`` shows both layouts side by side. ``buffers`` (``{path:
    array}``) must name buffers of ``module`` with their shapes and a dtype the buffer's
    holds without rounding (no floats into an integer counter). Everything is checked
    before anything is written (C6); then each torch view is written once, in place, so
    tied torch Parameters stay one Parameter. ``requires_grad`` flags stay torch's.
    """
    import torch

    theirs = _groups(module)
    ours = dict(params)
    for path, p in ours.items():
        if not isinstance(p, Param):
            raise SlotError(f"to_torch: {path!r} holds a {type(p).__name__}, expected a Param")
    their_groups: dict[int, list[str]] = {}
    for path, _, g in theirs:
        their_groups.setdefault(g, []).append(path)
    our_groups: dict[int, list[str]] = {}
    for path, p in ours.items():
        our_groups.setdefault(id(p.storage), []).append(path)
    same = {tuple(sorted(v)) for v in their_groups.values()} == {
        tuple(sorted(v)) for v in our_groups.values()
    } and all(tuple(t.shape) == ours[p].shape for p, t, _ in theirs)
    if not same:
        raise AliasError(
            "to_torch: the tie layout of the parameters does not match the module's; "
            f"nothing was written\n{_layout_table(theirs, ours)}"
        )
    for path, t, _ in theirs:
        if _numpy_dtype(path, t) != ours[path].dtype:
            raise DTypeError(
                f"to_torch: {path!r} is {ours[path].dtype.name} here but {t.dtype} in the module"
            )
    own_buffers = dict(module.named_buffers(remove_duplicate=False))
    new_buffers: dict[str, Any] = {}
    for path, value in (buffers or {}).items():
        if path not in own_buffers:
            raise SlotError(
                f"to_torch: the module has no buffer {path!r} (buffers: {sorted(own_buffers)})"
            )
        if tuple(np.shape(value)) != tuple(own_buffers[path].shape):
            raise ShapeError(
                f"to_torch: buffer {path!r} has shape {tuple(np.shape(value))}, the module's "
                f"{tuple(own_buffers[path].shape)}"
            )
        new_buffers[path] = _buffer_tensor(path, value, own_buffers[path])
    written: set[int] = set()
    with torch.no_grad():
        for path, t, g in theirs:
            if g not in written:
                written.add(g)
                value = ours[path].storage.current_host_value()
                t.copy_(torch.tensor(value))
        for path, tensor in new_buffers.items():
            own_buffers[path].copy_(tensor)


def _buffer_tensor(path: str, value: Any, target: Any) -> Any:
    """``value`` as a tensor of buffer ``target``'s dtype, or a ``DTypeError`` where that
    would change a value.

    A NumPy array or scalar (either byte order) must keep every value in the buffer's
    dtype: ints into a float buffer while they fit its significand, float64 into float32
    only where exact. Lists and Python numbers are converted to it, floats into floating
    buffers only. Nothing puts a float into an integer counter or an integer out of its
    range (a uint64 above 2**63 into int64, a Python int of 2**70).
    """
    import torch

    arr = np.asarray(value)
    held = "b" if target.dtype == torch.bool else "biuf" if target.is_floating_point() else "biu"
    exact = arr.dtype.kind in held
    try:
        want = np.dtype(str(target.dtype).replace("torch.", ""))
    except TypeError:  # bfloat16: NumPy has no such type; the kinds decide
        want = None
    if exact and want is not None and arr.size:
        if isinstance(value, (np.ndarray, np.generic)) and not np.can_cast(arr.dtype, want):
            back = arr.astype(want).astype(arr.dtype)
            exact = np.array_equal(back, arr, equal_nan=arr.dtype.kind == "f")
        if want.kind in "iu" and arr.dtype.kind in "iu":
            info = np.iinfo(want)
            exact = exact and info.min <= int(arr.min()) and int(arr.max()) <= info.max
    if not exact:
        raise DTypeError(
            f"to_torch: buffer {path!r} is {arr.dtype.name} here but {target.dtype} in the "
            "module; its values would be cast (convert them first)"
        )
    if not arr.dtype.isnative:
        arr = arr.astype(arr.dtype.newbyteorder("="))
    return torch.tensor(arr).to(dtype=target.dtype)
