"""The host backend: NumPy arrays (the default; float32 unless asked otherwise).

Memory (docs/design.md: memory is reused): ``tiegrad.backend.tune_process``
keeps the memory a step frees in the process (glibc); importing this module does not.

Fused kernels: with numba installed, float32 GELU and its VJP, ReLU and its VJP, large
sums (``add``, ``add_``), the embedding's scatter-add (``index_add``), layer norm, the
attention softmax and cross-entropy run as single-pass kernels (``host_kernels``);
``host_dispatch`` decides when, in which blocks and on how many threads. Without them,
``gelu`` of a float32 array runs block by block with a mask-free formula accurate to
float32 precision; other dtypes always take the exact path through the float64 Cephes
``erf`` (both ``host_special``). ``blockwise`` cuts an op's rows into cache-sized
blocks, run one after the other (they call BLAS). Matrix products go to oneMKL where
``tiegrad[mkl]`` is installed (``blas``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from . import blas
from .base import Array, Backend, DType, Shape, scale_into, smoothed_loss
from .host_dispatch import (
    _elementwise,
    _fused_kernels,
    _outputs_apart,
    _rows_parallel,
    _rows_per_block,
    _shared_elementwise,
    team,
)
from .host_special import _erf, _gelu32

__all__ = ["NUMPY", "NumpyBackend", "team"]  # ``team`` is re-exported for ``tiegrad.optim``

_add_reduce = np.add.reduce
_max_reduce = np.maximum.reduce
_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1  # the kernels' targets and ignore_index


def _scaled_matmul(a: Array, b: Array, scale: float, out: Array | None = None) -> Array:
    """``Backend.scaled_matmul`` with its bits in fewer passes (NumPy's BLAS): the product
    is written into ``out`` itself where BLAS can (``_into``), and scaled in place.
    Multiplying in place rounds as multiplying into a new array, and BLAS writes the same
    product into any rows it is given."""
    if out is None:
        product = np.matmul(a, b)
        if type(product) is not np.ndarray:  # a subclass, or a scalar: NumPy's own rules
            return scale_into(product, scale)
        if scale != 1.0:
            product *= scale
        return product
    if not _into(a, b, out):
        return scale_into(np.matmul(a, b), scale, out)
    np.matmul(a, b, out=out)
    if scale != 1.0:
        out *= scale
    return out


def _into(a: Any, b: Any, out: Any) -> bool:
    """Whether NumPy's BLAS writes ``a @ b`` into ``out`` as into a new array: ``out``
    writable in place (``blas.writable_out``), of the operands' floating dtype and the
    product's shape (no broadcast batch axes), each of its matrices with rows of unit
    stride that do not overlap (NumPy's own test for handing an output to BLAS; any
    batch strides: a view into a larger array works). NumPy then makes the same BLAS
    call as for a new array, with only the output's row stride changed, which changes
    no value."""
    if type(a) is not np.ndarray or type(b) is not np.ndarray or not blas.writable_out(out, a, b):
        return False
    size = out.itemsize
    return (
        a.dtype == b.dtype
        and a.dtype.kind == "f"
        and a.ndim == b.ndim == out.ndim >= 2
        and a.shape[:-2] == b.shape[:-2] == out.shape[:-2]
        and a.shape[-1] == b.shape[-2]
        and out.shape[-2:] == (a.shape[-2], b.shape[-1])
        and out.strides[-1] == size
        and out.strides[-2] % size == 0
        and out.strides[-2] >= out.shape[-1] * size
    )


def _cross_entropy_kernels(logits: Array, ignore_index: int, written: Any = None) -> Any:
    """The host kernels for ``cross_entropy`` over the rows of ``logits``: 2-D, not
    empty, C-contiguous float32 (``_fused_kernels``) with an int64 ``ignore_index``;
    else None."""
    kernels = _fused_kernels(logits, written=written)
    if (
        kernels is None
        or logits.ndim != 2
        or not logits.size
        or not _INT64_MIN <= ignore_index <= _INT64_MAX
    ):
        return None
    return kernels


def _cross_entropy_forward(
    kernels: Any, logits: Array, t: Array, ignore_index: int, label_smoothing: float, p: Array
) -> Array:
    """Each row's loss by the kernel ``cross_entropy``, its softmax written into ``p``
    (which may be ``logits`` itself)."""
    rows, c = logits.shape
    den, picked, total = np.empty((3, rows), np.float32)
    smooth = bool(label_smoothing)
    args = (logits, t, ignore_index, smooth, p, den, picked, total)
    _rows_parallel(kernels, "cross_entropy", rows, c, *args)
    log_den = np.log(den)
    loss = log_den - picked
    if smooth:
        loss = smoothed_loss(loss, total, log_den, c, label_smoothing)
    return loss


def _cross_entropy_backward(
    kernels: Any,
    p: Array,
    t: Array,
    ignore_index: int,
    label_smoothing: float,
    weights: Any,
    out: Array,
) -> None:
    """The gradient of ``sum(weights * loss)`` written into ``out`` (which may be ``p``)
    from the softmax ``p`` by the kernel ``cross_entropy_backward``; ``weights`` holds
    one per row, or one for every row."""
    rows, c = p.shape
    w = np.ascontiguousarray(weights, np.float32).reshape(-1)
    hit, spread = 1.0 - label_smoothing, label_smoothing / c
    args = (p, t, ignore_index, w, hit, spread, out)
    _rows_parallel(kernels, "cross_entropy_backward", rows, c, *args)


def _is_basic_index(index: Any) -> bool:
    """Whether ``index`` uses basic indexing only (no integer or boolean arrays)."""
    parts = index if isinstance(index, tuple) else (index,)
    return all(
        p is None
        or p is Ellipsis
        or (isinstance(p, (slice, int, np.integer)) and not isinstance(p, bool))
        for p in parts
    )


class NumpyBackend(Backend):
    """NumPy on the host. Stateless; use the module-level ``NUMPY`` instance."""

    name = "numpy"
    device = "cpu"
    slow_row_reductions = True  # BLAS sums short rows several times faster than a ufunc
    float32 = np.dtype(np.float32)
    float64 = np.dtype(np.float64)
    int64 = np.dtype(np.int64)
    bool_ = np.dtype(np.bool_)

    def asarray(self, x: Any, dtype: DType | None = None) -> Array:
        return np.asarray(x, dtype=dtype)

    def copy(self, x: Array) -> Array:
        return np.array(x, copy=True)

    def memory_owner(self, x: Array) -> Any:
        base = getattr(x, "base", None)  # a NumPy scalar has no memory to share: its own
        return x if base is None else base

    def to_numpy(self, x: Array) -> np.ndarray:
        return np.asarray(x)

    def is_array(self, x: Any) -> bool:
        return isinstance(x, np.ndarray)

    def zeros(self, shape: Shape, dtype: DType) -> Array:
        return np.zeros(shape, dtype=dtype)

    def ones(self, shape: Shape, dtype: DType) -> Array:
        return np.ones(shape, dtype=dtype)

    def empty(self, shape: Shape, dtype: DType) -> Array:
        return np.empty(shape, dtype=dtype)

    def arange(self, n: int, dtype: DType) -> Array:
        return np.arange(n, dtype=dtype)

    def astype(self, x: Array, dtype: DType) -> Array:
        return x.astype(dtype, copy=False)

    def dtype_name(self, dtype: DType) -> str:
        return np.dtype(dtype).name

    def dtype_of(self, name: str) -> DType:
        return np.dtype(name)

    def is_floating(self, dtype: DType) -> bool:
        return np.dtype(dtype).kind == "f"

    def is_integer(self, dtype: DType) -> bool:
        return np.dtype(dtype).kind in "iu"

    exp = staticmethod(np.exp)
    log = staticmethod(np.log)
    sqrt = staticmethod(np.sqrt)
    tanh = staticmethod(np.tanh)
    cos = staticmethod(np.cos)
    sin = staticmethod(np.sin)
    maximum = staticmethod(np.maximum)
    where = staticmethod(np.where)
    matmul = staticmethod(blas.matmul if blas.MAY_LOAD else np.matmul)
    scaled_matmul = staticmethod(blas.scaled_matmul if blas.MAY_LOAD else _scaled_matmul)
    einsum = staticmethod(np.einsum)
    broadcast_to = staticmethod(np.broadcast_to)
    expand_dims = staticmethod(np.expand_dims)

    def erf(self, x: Array) -> Array:
        return _erf(x)

    def exp_(self, x: Array) -> Array:
        return np.exp(x, out=x)

    def gelu(self, x: Array) -> tuple[Array, Array]:
        if x.dtype != np.float32:
            return super().gelu(x)
        kernels = _fused_kernels(x)
        if kernels is None:
            return _gelu32(x)
        return _elementwise(kernels, "gelu", x, outputs=2)

    def add(self, a: Array, b: Array) -> Array:
        kernels = _shared_elementwise(a, b)
        return a + b if kernels is None else _elementwise(kernels, "add", a, b)

    def add_(self, x: Array, b: Array) -> Array:
        n = x.shape[-1] if x.ndim else 0
        if n and b.ndim == 1 and b.shape[0] == n:  # the kernel at every size: NumPy's
            kernels = _fused_kernels(x, b, written=x)  # broadcast loop is slower
            if kernels is not None:
                _rows_parallel(kernels, "add_row_vector", x.size // n, n, x.reshape(-1, n), b)
                return x
        x += b
        return x

    def gelu_vjp(self, g: Array, saved: Array) -> Array:
        kernels = _shared_elementwise(g, saved)
        if kernels is None:
            return super().gelu_vjp(g, saved)
        return _elementwise(kernels, "multiply", g, saved)

    def relu(self, x: Array) -> Array:
        # the kernel at every size: ``np.maximum``'s NaN-aware loop is several times slower
        kernels = _fused_kernels(x)
        return np.maximum(x, 0.0) if kernels is None else _elementwise(kernels, "relu", x)

    def relu_vjp(self, g: Array, out: Array) -> Array:
        kernels = _fused_kernels(g, out) if g.shape == out.shape else None
        if kernels is None:
            return super().relu_vjp(g, out)
        return _elementwise(kernels, "relu_vjp", g, out)

    def layer_norm_rows(
        self, x: Array, w: Array | None, b: Array | None, eps: float
    ) -> tuple[Array, Array, Array] | None:
        kernels = _fused_kernels(x, w, b)
        if kernels is None:
            return None
        rows, d = x.shape
        plain = w is None and b is None
        outs = [o.reshape(rows, d) for o in _outputs_apart(x, 1 if plain else 2)]
        xhat, out = outs[0], outs[-1]
        rstd = np.empty((rows, 1), np.float32)
        w = np.ones(d, np.float32) if w is None else w
        b = np.zeros(d, np.float32) if b is None else b
        _rows_parallel(kernels, "layer_norm", rows, d, x, w, b, eps, xhat, rstd, out)
        return out, xhat, rstd

    def layer_norm_backward_rows(
        self, g: Array, w: Array | None, xhat: Array, rstd: Array, wants: tuple[bool, bool, bool]
    ) -> tuple[Array | None, Array | None, Array | None] | None:
        kernels = _fused_kernels(g, w, xhat, rstd)
        if kernels is None or not wants[0]:
            return None
        rows, d = g.shape
        gx = _outputs_apart(g, 1)[0].reshape(rows, d)
        w = np.ones(d, np.float32) if w is None else w
        chunk = kernels.COLUMN_CHUNK
        pw, pb = np.zeros((2, -(-rows // chunk), d), np.float32)
        args = (g, w, xhat, rstd, gx, pw, pb)
        _rows_parallel(kernels, "layer_norm_backward", rows, d, *args, align=chunk)
        gw = _add_reduce(pw, axis=0) if wants[1] else None
        gb = _add_reduce(pb, axis=0) if wants[2] else None
        return gx, gw, gb

    def softmax_rows_(self, x: Array) -> bool:
        kernels = _fused_kernels(written=x)
        if kernels is None or x.ndim == 0:
            return False
        n = x.shape[-1]
        rows = x.size // n if n else 0
        _rows_parallel(kernels, "softmax", rows, n, x.reshape(rows, n))
        return True

    def softmax_backward_rows_(self, gp: Array, p: Array) -> bool:
        kernels = _fused_kernels(p, written=gp)
        if kernels is None or gp.ndim == 0 or gp.shape != p.shape:
            return False
        n = gp.shape[-1]
        rows = gp.size // n if n else 0
        _rows_parallel(
            kernels, "softmax_backward", rows, n, gp.reshape(rows, n), p.reshape(rows, n)
        )
        return True

    def cross_entropy_rows(
        self,
        logits: Array,
        targets: Array,
        ignore_index: int,
        label_smoothing: float,
        want: bool,
        reduction: str = "none",
        count: int | None = None,
    ) -> tuple[Array, Any] | None:
        """The kernels ``cross_entropy`` and its backward for C-contiguous float32 logits.

        Each row is shifted by its own maximum; the log of its sum of exponentials is
        NumPy's, outside the kernel (so the stand-in gives the same bits). A row's loss
        is ``log(den) - picked`` (with smoothing, ``smoothed_loss``); a reduced loss is
        NumPy's sum of the rows, times ``1 / count`` for a mean.
        """
        kernels = _cross_entropy_kernels(logits, ignore_index)
        if kernels is None:
            return None
        rows, c = logits.shape
        t = np.ascontiguousarray(targets, dtype=np.int64)
        p = _outputs_apart(logits, 1)[0].reshape(rows, c)
        loss = _cross_entropy_forward(kernels, logits, t, ignore_index, label_smoothing, p)
        divisor = count if reduction == "mean" else 1
        if reduction != "none":
            loss = _add_reduce(loss)
            if reduction == "mean":
                loss = loss * (1.0 / divisor)
        if not want:
            return loss, None

        def vjp(g: Array) -> Array:
            w = g if divisor == 1 else g / divisor
            out = _outputs_apart(p, 1)[0].reshape(rows, c)
            _cross_entropy_backward(kernels, p, t, ignore_index, label_smoothing, w, out)
            return out

        return loss, vjp

    def cross_entropy_tile_(
        self,
        logits: Array,
        targets: Array,
        ignore_index: int,
        label_smoothing: float,
        weights: Array | None,
    ) -> Array | None:
        """The kernels of ``cross_entropy_rows`` writing over ``logits`` itself: the softmax
        replaces each row once its shift, target logit and sums are read, then the
        backward replaces the softmax element by element (both kernels read a row's
        element before they write it). The same bits as ``cross_entropy_rows``."""
        kernels = _cross_entropy_kernels(logits, ignore_index, written=logits)
        if kernels is None:
            return None
        t = np.ascontiguousarray(targets, dtype=np.int64)
        loss = _cross_entropy_forward(kernels, logits, t, ignore_index, label_smoothing, logits)
        if weights is not None:
            _cross_entropy_backward(
                kernels, logits, t, ignore_index, label_smoothing, weights, logits
            )
        return loss

    def blockwise(self, kernel: Callable[[int, int], None], n: int, item_size: int) -> None:
        """Cache-sized blocks, one after the other on the calling thread.

        The blocks of ``layer_norm`` and attention call BLAS, and BLAS called from two
        threads at once runs each small product several times slower than from one,
        which eats the gain of running blocks side by side.
        """
        rows = _rows_per_block(item_size)
        for lo in range(0, n, rows):
            kernel(lo, min(n, lo + rows))

    def isfinite_all(self, x: Array) -> bool:
        return bool(np.isfinite(x).all())

    # The ufunc reductions that np.sum / np.max call, minus their Python wrappers.
    def sum(self, x: Array, axis: Any = None, keepdims: bool = False) -> Array:
        return _add_reduce(x, axis=axis, keepdims=keepdims)

    def max(self, x: Array, axis: Any = None, keepdims: bool = False) -> Array:
        return _max_reduce(x, axis=axis, keepdims=keepdims)

    def argmax(self, x: Array, axis: int) -> Array:
        return np.argmax(x, axis=axis)

    def reshape(self, x: Array, shape: Shape) -> Array:
        return x.reshape(shape)  # the method: np.reshape adds a Python wrapper per call

    def transpose(self, x: Array, axes: Shape) -> Array:
        return x.transpose(axes)

    def concat(self, xs: list[Array], axis: int) -> Array:
        return np.concatenate(xs, axis=axis)

    def stack(self, xs: list[Array], axis: int) -> Array:
        return np.stack(xs, axis=axis)

    def pad(self, x: Array, widths: list[tuple[int, int]]) -> Array:
        return np.pad(x, widths)

    def take(self, x: Array, indices: Array, axis: int = 0) -> Array:
        return np.take(x, indices, axis=axis)

    def take_along_axis(self, x: Array, indices: Array, axis: int) -> Array:
        if x.ndim == 2 == indices.ndim and axis in (1, -1):
            # the index np.take_along_axis builds, without its Python-level checks
            return x[np.arange(x.shape[0])[:, None], indices]
        return np.take_along_axis(x, indices, axis=axis)

    def accumulate_at(self, out: Array, index: Any, values: Array) -> None:
        if _is_basic_index(index):
            out[index] += values  # a basic index selects each element at most once
        else:
            np.add.at(out, index, values)

    def index_add(self, out: Array, indices: Array, values: Array) -> None:
        kernels = _fused_kernels(values, written=out) if out.ndim == 2 == values.ndim else None
        if (
            kernels is not None
            and indices.ndim == 1
            and indices.dtype.kind == "i"
            and len(indices) == len(values)
            and values.shape[1] == out.shape[1]
            and len(indices)
            and 0 <= indices.min()
            and indices.max() < len(out)
        ):
            kernels.index_add_rows(out, indices, values)
            return
        if len(indices) <= len(out):
            np.add.at(out, indices, values)
            return
        # Many repeats: sort once and add each run of equal ids with one reduceat.
        order = np.argsort(indices, kind="stable")
        ids = indices[order]
        starts = np.concatenate(([0], np.flatnonzero(ids[1:] != ids[:-1]) + 1))
        out[ids[starts]] += np.add.reduceat(values[order], starts, axis=0)

    def sliding_windows(self, x: Array, kh: int, kw: int, stride: int) -> Array:
        win = np.lib.stride_tricks.sliding_window_view(x, (kh, kw), axis=(2, 3))
        return win[:, :, ::stride, ::stride]

    def random_uniform(self, generator: Any, shape: Shape, dtype: DType) -> Array:
        return generator.random(shape, dtype=dtype)


NUMPY = NumpyBackend()
