"""The host backend: NumPy arrays (the default; float32 unless asked otherwise)."""

from __future__ import annotations

from typing import Any

import numpy as np

from .base import Array, Backend, DType, Shape

# Cephes rational approximations of erf and erfc (relative error ~1e-16 in float64).
_ERF_T = (
    9.60497373987051638749e0,
    9.00260197203842689217e1,
    2.23200534594684319226e3,
    7.00332514112805075473e3,
    5.55923013010394962768e4,
)
_ERF_U = (
    1.0,
    3.35617141647503099647e1,
    5.21357949780152679795e2,
    4.59432382970980127987e3,
    2.26290000613890934246e4,
    4.92673942608635921086e4,
)
_ERFC_P = (
    2.46196981473530512524e-10,
    5.64189564831068821977e-1,
    7.46321056442269912687e0,
    4.86371970985681366614e1,
    1.96520832956077098242e2,
    5.26445194995477358631e2,
    9.34528527171957607540e2,
    1.02755188689515710272e3,
    5.57535335369399327526e2,
)
_ERFC_Q = (
    1.0,
    1.32281951154744992508e1,
    8.67072140885989742329e1,
    3.54937778887819891062e2,
    9.75708501743205489753e2,
    1.82390916687909736289e3,
    2.24633760818710981792e3,
    1.65666309194161350182e3,
    5.57535340817727675546e2,
)
_ERFC_R = (
    5.64189583547755073984e-1,
    1.27536670759978104416e0,
    5.01905042251180477414e0,
    6.16021097993053585195e0,
    7.40974269950448939160e0,
    2.97886665372100240670e0,
)
_ERFC_S = (
    1.0,
    2.26052863220117276590e0,
    9.39603524938001434673e0,
    1.20489539808096656605e1,
    1.70814450747565897222e1,
    9.60896809063285878198e0,
    3.36907645100081516050e0,
)


def _poly(coeffs: tuple[float, ...], x: np.ndarray) -> np.ndarray:
    out = np.full_like(x, coeffs[0])
    for c in coeffs[1:]:
        out *= x
        out += c
    return out


def _erf(x: np.ndarray) -> np.ndarray:
    z = np.asarray(x, dtype=np.float64)
    a = np.abs(z)
    small = a < 1.0
    out = np.empty_like(z)
    zs = z[small]
    zz = zs * zs
    out[small] = zs * _poly(_ERF_T, zz) / _poly(_ERF_U, zz)
    ab = a[~small]
    mid = ab < 8.0
    erfc = np.empty_like(ab)
    am, ar = ab[mid], ab[~mid]
    erfc[mid] = np.exp(-am * am) * _poly(_ERFC_P, am) / _poly(_ERFC_Q, am)
    erfc[~mid] = np.exp(-ar * ar) * _poly(_ERFC_R, ar) / _poly(_ERFC_S, ar)
    out[~small] = np.copysign(1.0 - erfc, z[~small])
    return out.astype(x.dtype, copy=False)


_add_reduce = np.add.reduce
_max_reduce = np.maximum.reduce


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
    float32 = np.dtype(np.float32)
    float64 = np.dtype(np.float64)
    int64 = np.dtype(np.int64)
    bool_ = np.dtype(np.bool_)

    def asarray(self, x: Any, dtype: DType | None = None) -> Array:
        return np.asarray(x, dtype=dtype)

    def copy(self, x: Array) -> Array:
        return np.array(x, copy=True)

    def to_numpy(self, x: Array) -> np.ndarray:
        return np.asarray(x)

    def is_array(self, x: Any) -> bool:
        return isinstance(x, np.ndarray)

    def zeros(self, shape: Shape, dtype: DType) -> Array:
        return np.zeros(shape, dtype=dtype)

    def ones(self, shape: Shape, dtype: DType) -> Array:
        return np.ones(shape, dtype=dtype)

    def full(self, shape: Shape, value: float, dtype: DType) -> Array:
        return np.full(shape, value, dtype=dtype)

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

    exp = staticmethod(np.exp)
    log = staticmethod(np.log)
    sqrt = staticmethod(np.sqrt)
    tanh = staticmethod(np.tanh)
    abs = staticmethod(np.abs)
    maximum = staticmethod(np.maximum)
    where = staticmethod(np.where)
    matmul = staticmethod(np.matmul)
    einsum = staticmethod(np.einsum)
    broadcast_to = staticmethod(np.broadcast_to)
    expand_dims = staticmethod(np.expand_dims)

    def erf(self, x: Array) -> Array:
        return _erf(x)

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
        return np.take_along_axis(x, indices, axis=axis)

    def accumulate_at(self, out: Array, index: Any, values: Array) -> None:
        if _is_basic_index(index):
            out[index] += values  # a basic index selects each element at most once
        else:
            np.add.at(out, index, values)

    def index_add(self, out: Array, indices: Array, values: Array) -> None:
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
