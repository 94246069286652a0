"""The host backend: NumPy arrays (the default; float32 unless asked otherwise).

Memory (DESIGN: memory is reused, not re-faulted): ``tiegrad.backend.tune_process``
keeps the memory a step frees in the process (glibc); importing this module does not.

Fused kernels: ``gelu`` of a float32 array runs block by block (every temporary stays
in cache) with a mask-free formula accurate to float32 precision; other dtypes take
the exact path through the float64 Cephes ``erf`` (gradient checks). ``blockwise``
cuts an op's rows into cache-sized blocks, run one after the other (they call BLAS).
With numba installed, float32 GELU and its VJP, ReLU and its VJP, large sums (``add``,
``add_``), the embedding's scatter-add (``index_add``), layer norm and the attention
softmax run as single-pass kernels (``host_kernels``) instead; all but the scatter-add
run their blocks on ``_kernel_threads`` threads, read at every call of at least
``2 * _SHARE_MIN`` elements (``_rows_parallel``). Where oneMKL runs its products on GNU
OpenMP and numba's threading layer is ``omp``, the blocks go to numba's threads, which
are that same OpenMP team (``host_blocks``), on ``tiegrad._threads.count`` of the cores:
W1 0.93 against 1.11 on one thread (ratio to PyTorch, Intel Xeon, 2 cores). Elsewhere
one thread (the caller) runs them unless ``TIEGRAD_NUM_THREADS`` asks for more, which
then share the blocks through ``tiegrad._threads.share``'s pool: a pool beside BLAS's
spinning threads made W1 and W3 10-15% slower (1.09-1.11 and 1.18-1.19 against 1.04
and 1.13 on one thread, AMD EPYC, 2 cores).
Like MKL's products, the kernels do not report overflow or invalid operations to
``np.errstate``.
Matrix products go to oneMKL where ``tiegrad[mkl]`` is installed (``blas``).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import numpy as np

from .. import _numba, _threads
from . import blas
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
# The cap on |x| in erfc's tail: erf is already 1 in float64 (from |x| of about 6 on),
# and a huge |x| (1e62, inf) would overflow the rational polynomials to inf / inf (NaN).
_ERF_ONE = 27.0


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
    am, ar = ab[mid], np.minimum(ab[~mid], _ERF_ONE)
    erfc[mid] = np.exp(-am * am) * _poly(_ERFC_P, am) / _poly(_ERFC_Q, am)
    erfc[~mid] = np.exp(-ar * ar) * _poly(_ERFC_R, ar) / _poly(_ERFC_S, ar)
    out[~small] = np.copysign(1.0 - erfc, z[~small])
    return out.astype(x.dtype, copy=False)


# The upper normal tail Phi(-a) = t * P(t) * exp(-a*a/2), t = 1 / (1 + p * a), for a >= 0:
# a least-squares minimax fit with absolute error below 4e-9 for every a (float32
# rounding dominates). Coefficients of t**6 down to t**1.
_TAIL_P = 0.2759956359010431
_TAIL_C = (
    -0.11345756156690588,
    0.44086028893966595,
    -0.3139303774906198,
    0.32219998220208323,
    0.04670261267675377,
    0.11762505136854265,
)
_INV_SQRT_2PI = 1.0 / math.sqrt(2.0 * math.pi)
_F32_MAX = float(np.finfo(np.float32).max)


# Elements per block of ``blockwise``: a block's temporaries stay in L2 cache. With MKL,
# whose batched GEMM pays a fixed cost per call and splits a batch across its threads,
# fewer, larger blocks won (W1: 60.4 against 64.3 ms per step at 32768).
def _block() -> int:
    """Elements per block (above); loads nothing (MKL loads at the first product)."""
    return 1 << 19 if blas.MAY_LOAD else 32768


_GELU_BLOCK = 65536  # the GELU kernel's block: six float32 buffers of it fit in L2 cache


def _normal_tail(a: np.ndarray, t: np.ndarray, e: np.ndarray, out: np.ndarray) -> None:
    """``out = Phi(-a)`` for ``a >= 0`` and ``e = exp(-a*a/2)``; ``t`` is scratch.

    Mask-free: every step is one in-place ufunc pass over equal-sized float32 blocks.
    """
    np.multiply(a, _TAIL_P, out=t)
    t += 1.0
    np.reciprocal(t, out=t)
    np.multiply(a, a, out=e)
    e *= -0.5
    np.exp(e, out=e)
    np.multiply(t, _TAIL_C[0], out=out)
    for c in _TAIL_C[1:]:
        out += c
        out *= t
    out *= e


_SHARES = 2  # blocks per thread when a kernel call is shared
# Elements of the smallest shared block: about 30 us of GELU, three times what handing
# blocks to a pool thread costs (``_threads.share`` of 2 items on 2 threads: 6 us at
# best, 10 us median, 2 cores under load).
_SHARE_MIN = 1 << 16


def _parallel(run: Callable[[int, int], None], n_blocks: int, threads: int) -> None:
    """Run ``run(b, b + 1)`` for every block ``b`` of ``range(n_blocks)`` on ``threads``.

    The threads claim blocks in turn (``tiegrad._threads.share``). A single block, or
    one thread, is one call ``run(0, n_blocks)`` on the caller.
    """
    if threads <= 1 or n_blocks <= 1:
        if n_blocks:
            run(0, n_blocks)
        return
    _threads.share(lambda b: run(b, b + 1), n_blocks, threads)


def _gelu32(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(x * Phi(x), Phi(x) + x * phi(x))`` of a float32 array, block by block.

    ``x * Phi(x) = max(x, 0) - |x| * Phi(-|x|)`` has no ``1 + erf`` cancellation: the
    error is below ``2e-7 * max(1, |x|)`` everywhere, and relative to ``y`` below
    ``5e-6`` down to ``x = -3`` and ``3e-3`` down to ``x = -10`` (where ``y`` is
    ``-8e-23``). ``|x|`` is capped at the largest float32, so ``inf`` gives ``inf``.
    """
    xf = np.ascontiguousarray(x).reshape(-1)
    n = xf.size
    y = np.empty(n, np.float32)
    d = np.empty(n, np.float32)
    _ranges_parallel(_gelu_range, n, _GELU_BLOCK, _threads.count(), xf, y, d)
    return y.reshape(x.shape), d.reshape(x.shape)


def _gelu_range(xf: np.ndarray, y: np.ndarray, d: np.ndarray, lo: int, hi: int) -> None:
    """The GELU kernel on flat elements ``lo..hi-1``, ``_GELU_BLOCK`` at a time.

    The signature of ``host_kernels.gelu``; the scratch is allocated once per call.
    """
    m = min(hi - lo, _GELU_BLOCK)
    a, t, e = np.empty(m, np.float32), np.empty(m, np.float32), np.empty(m, np.float32)
    with np.errstate(over="ignore"):  # a*a of |x| > 1.8e19 overflows to inf: exp(-inf) = 0
        for start in range(lo, hi, _GELU_BLOCK):
            stop = min(hi, start + _GELU_BLOCK)
            k = stop - start
            xb, yb, db, ab, eb = xf[start:stop], y[start:stop], d[start:stop], a[:k], e[:k]
            np.abs(xb, out=ab)
            np.minimum(ab, _F32_MAX, out=ab)
            _normal_tail(ab, t[:k], eb, db)
            ab *= db
            np.maximum(xb, 0.0, out=yb)
            yb -= ab
            np.subtract(0.5, db, out=db)
            np.copysign(db, xb, out=db)
            db += 0.5
            eb *= xb
            eb *= _INV_SQRT_2PI
            db += eb


def _fused_kernels(*arrays: Any, written: Any = None) -> Any:
    """The host kernels when ``tiegrad._numba`` has them and every array is C-contiguous float32.

    ``written``, an array the kernel writes in place, must also be writable (the
    kernels would write into a read-only array; NumPy's path raises its error).
    """
    if written is not None and not written.flags.writeable:
        return None
    for a in (*arrays, written):
        if a is not None and (a.dtype != np.float32 or not a.flags.c_contiguous):
            return None
    return _numba.kernels("tiegrad.backend.host_kernels")


_PAGE = 4096


def _outputs_apart(x: np.ndarray, count: int) -> list[np.ndarray]:
    """``count`` fresh float32 arrays of ``x.size`` elements for one kernel reading ``x``.

    Each is placed in its own allocation (so each is freed on its own) at an offset
    such that the addresses of ``x`` and of every output differ modulo 4 KiB by at
    least ``4 KiB / (count + 1)``. Arrays of one size that the allocator hands out back
    to back tend to lie a multiple of 2 MiB apart, and a loop streaming through several
    of them at the same index then runs several times slower (their cache lines
    compete for the same cache sets); the placement rules that out.
    """
    n = x.size
    home = x.__array_interface__["data"][0]
    outs = []
    for k in range(1, count + 1):
        buf = np.empty(n + _PAGE // 4, np.float32)
        want = (home + k * (_PAGE // (count + 1))) & ~63
        start = (want - buf.__array_interface__["data"][0]) % _PAGE // 4
        outs.append(buf[start : start + n])
    return outs


def _shared_elementwise(a: np.ndarray, b: np.ndarray) -> Any:
    """The host kernels for an elementwise op of ``a`` and ``b`` worth sharing, else None.

    Both float32, C-contiguous, of one shape, large enough for two threads, and more
    than one thread asked for: NumPy's one loop computes the same bits as fast on one
    thread, and a kernel never called is never compiled (a shorter cold start).
    """
    if a.shape != b.shape or not _worth_sharing(a):
        return None
    return _fused_kernels(a, b)


def _worth_sharing(a: np.ndarray) -> bool:
    """Whether an elementwise call over ``a`` is large enough for two threads, and more
    than one thread is asked for."""
    return a.size >= 2 * _SHARE_MIN and _kernel_threads()[1] >= 2


def _kernel_threads() -> tuple[Any, int]:
    """``host_blocks`` (or None) and the threads for a kernel call worth sharing.

    ``host_blocks`` where it runs on oneMKL's team (``team``), with
    ``tiegrad._threads.count`` of numba's threads; else None and
    ``tiegrad._threads.count()`` (one unless asked).
    """
    blocks = team()
    if blocks is None:
        return None, _threads.count()
    return blocks, _threads.count(blocks.TEAM)


def team() -> Any:
    """``host_blocks`` where oneMKL runs on GNU OpenMP and numba's parallel loops share its
    team (``host_blocks.shares_the_team``), else None: whether parallel kernels (the host
    kernels' blocks, the fused optimizer's) run on the threads that ran the products."""
    blocks = _numba.kernels("tiegrad.backend.host_blocks") if blas.on_gnu_openmp() else None
    return blocks if blocks is not None and blocks.shares_the_team() else None


def _elementwise(kernels: Any, name: str, *inputs: np.ndarray, outputs: int = 1) -> Any:
    """``kernels.<name>(*inputs, *outs)`` over the flat elements of equal-shape ``inputs``.

    The ``outputs`` new arrays (shaped as the inputs) lie apart from the first input
    (``_outputs_apart``); one is returned as itself, several as a tuple.
    """
    x = inputs[0]
    outs = _outputs_apart(x, outputs)
    _rows_parallel(kernels, name, x.size, 1, *(a.reshape(-1) for a in inputs), *outs)
    shaped = tuple(o.reshape(x.shape) for o in outs)
    return shaped[0] if outputs == 1 else shaped


def _rows_per_block(row_size: int) -> int:
    """Rows of ``row_size`` elements in one cache-sized block (``_block()`` elements), >= 1."""
    return max(1, _block() // max(1, row_size))


def _ranges_parallel(
    kernel: Callable[..., None], n: int, step: int, threads: int, *args: Any
) -> None:
    """``kernel(*args, lo, hi)`` over ``range(n)`` in blocks of ``step`` items on ``threads``."""

    def run(first: int, last: int) -> None:
        kernel(*args, first * step, min(n, last * step))

    _parallel(run, -(-n // step), threads)


def _rows_parallel(
    kernels: Any, name: str, rows: int, row_size: int, *args: Any, align: int = 1
) -> None:
    """``kernels.<name>(*args, lo, hi)`` over ``range(rows)`` in cache-sized blocks on the threads.

    A call of under ``2 * _SHARE_MIN`` elements runs on the caller. On several threads
    (``_kernel_threads``: numba's where they are MKL's team, else the pool's) the blocks
    are also small enough for ``_SHARES`` of them per thread, and never under
    ``_SHARE_MIN`` elements. A block holds a multiple of ``align`` rows.
    """
    team, threads = _kernel_threads() if rows * row_size >= 2 * _SHARE_MIN else (None, 1)
    per_block = _rows_per_block(row_size)
    if threads > 1:
        least = -(-_SHARE_MIN // max(1, row_size))
        per_block = min(per_block, max(least, -(-rows // (threads * _SHARES))))
    per_block = -(-per_block // align) * align
    if team is not None and threads > 1 and rows > per_block:
        team.run(threads, getattr(team, f"{name}_blocks"), rows, per_block, args)
    else:
        _ranges_parallel(getattr(kernels, name), rows, per_block, threads, *args)


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
    maximum = staticmethod(np.maximum)
    where = staticmethod(np.where)
    matmul = staticmethod(blas.matmul if blas.MAY_LOAD else np.matmul)
    if blas.MAY_LOAD:
        scaled_matmul = staticmethod(blas.scaled_matmul)
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
        if b.ndim == 1 and b.shape[0] == n and _worth_sharing(x):
            kernels = _fused_kernels(x, b, written=x)
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
        kernels = _shared_elementwise(x, x)
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

    def blockwise(self, kernel: Callable[[int, int], None], n: int, item_size: int) -> None:
        """Cache-sized blocks, one after the other on the calling thread.

        The blocks of ``layer_norm`` and attention call BLAS, and BLAS called from two
        threads at once runs each small product several times slower than from one
        (W1 attention: 120 against 37 us per batch of 64x64 products), which eats the
        gain of running blocks side by side: whole W1 and W3 steps were no faster.
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
