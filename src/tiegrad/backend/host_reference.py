"""The host kernels' bits computed with NumPy: a stand-in for ``host_kernels`` that
needs no compiling.

Each kernel function here has the name, the arguments and the results of the kernel of
``host_kernels`` it stands for, and repeats its operations in their order and rounding
(those kernels are compiled without fast-math, so that their bits follow from their
source): the same values bit for bit, NaN where the kernel gives NaN (its payload
aside; ``test_host_reference`` compares them). ``tiegrad train`` runs its first steps
on this module while a child process compiles the kernels into numba's cache, and
switches to the kernels once it has (``tiegrad.train.precompile``,
``tiegrad._numba.defer``): a run's results do not depend on when that happens. It is
much slower than the kernels (a fused multiply-add costs a dozen passes here), and
imports numba only for the kernels' constants, not to compile anything.

Like the kernels, the kernel functions do not report overflow or invalid operations
to ``np.errstate``; unlike them, they leave the checking of sizes to NumPy.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from . import host_kernels as hk

COLUMN_CHUNK = hk.COLUMN_CHUNK
_F = np.float32
_LANES = 8  # the width of ``host_kernels._lanes``' sums
_BELOW_FLOAT32 = (1 << 29) - 1  # float64's mantissa bits below float32's last one
_HALF_FLOAT32 = 1 << 28  # those bits of a number halfway between two float32 numbers
_TINY = float(np.finfo(np.float32).tiny)
_PIECE = 16384  # elements at a time: their float64 temporaries stay in cache


def _quiet(kernel: Callable[..., None]) -> Callable[..., None]:
    """``kernel`` with NumPy's floating-point warnings off, as the compiled kernels run."""

    @functools.wraps(kernel)
    def run(*args: Any) -> None:
        with np.errstate(all="ignore"):
            kernel(*args)

    return run


def fma(a: Any, b: Any, c: Any) -> np.ndarray:
    """``a * b + c`` of float32 operands rounded once to float32 (``host_kernels._fma``).

    In float64 the product is exact and the sum ``s`` is rounded once more; rounding
    ``s`` to float32 then gives the single correct rounding unless ``s`` fell exactly
    halfway between two float32 numbers (the 29 bits below float32's last are then
    ``100...0``) or below float32's normal range (where its spacing is coarser). Those
    sums are rounded to odd (where inexact and even, one unit towards the exact value,
    told by the sum's error), which makes the rounding to float32 correct too: an odd
    float64 number is never halfway. Operands of any shape that broadcast, scalars
    included; NumPy's floating-point warnings as the caller set them.
    """
    p = np.multiply(a, b, dtype=np.float64)
    c = np.asarray(c, np.float64)
    s = np.asarray(p + c)  # an array even of scalars: bumped in place
    flat = s.reshape(-1)
    halfway = (flat.view(np.int64) & _BELOW_FLOAT32) == _HALF_FLOAT32
    near = np.flatnonzero(halfway | (np.abs(flat) < _TINY))
    if near.size:
        pn = np.broadcast_to(p, s.shape).reshape(-1)[near]
        cn = np.broadcast_to(c, s.shape).reshape(-1)[near]
        sn = flat[near]
        z = sn - pn
        err = (pn - (sn - z)) + (cn - z)  # (p + c) - s exactly (Knuth's two-sum)
        even = (sn.view(np.int64) & 1) == 0
        bump = (err != 0) & even & np.isfinite(sn)
        flat.view(np.int64)[near] += bump * np.where((err > 0) == (sn > 0), 1, -1)
    return s.astype(np.float32)


def exp_neg(z: np.ndarray) -> np.ndarray:
    """``host_kernels.exp_neg`` of every element of the float32 array ``z``."""
    zc = np.where(z >= hk._EXP_MIN, z, hk._EXP_MIN)  # NaN too gives _EXP_MIN
    k = np.floor(fma(zc, hk._LOG2E, _F(0.5)))
    r = fma(-k, hk._LN2_HI, zc)
    r = fma(-k, hk._LN2_LO, r)
    p = fma(hk._EXP_P[0], r, hk._EXP_P[1])
    for coefficient in hk._EXP_P[2:]:
        p = fma(p, r, coefficient)
    p = fma(p, r * r, r) + _F(1.0)
    e = p * ((k.astype(np.int32) + np.int32(127)) << np.int32(23)).view(np.float32)
    return np.where(z >= hk._EXP_MIN, e, np.where(z < hk._EXP_MIN, _F(0.0), z))


def _lanes(a: np.ndarray, b: np.ndarray | None = None) -> np.ndarray:
    """Each row's sum of the float32 ``(rows, n)`` array ``a`` (or of ``a * b``) in the
    order of ``host_kernels._lanes``: lane ``k`` adds elements ``k, k + 8, ...``, lane 0
    then the tail, and the lanes combine as ``((0+1)+(2+3))+((4+5)+(6+7))``."""
    x = a if b is None else a * b
    rows, n = x.shape
    whole = n // _LANES
    acc = np.zeros((rows, _LANES), np.float32)
    for i in range(whole):
        acc += x[:, i * _LANES : (i + 1) * _LANES]
    for j in range(whole * _LANES, n):
        acc[:, 0] += x[:, j]
    lane = acc.T
    return ((lane[0] + lane[1]) + (lane[2] + lane[3])) + ((lane[4] + lane[5]) + (lane[6] + lane[7]))


def _pieces(lo: int, hi: int, row_size: int) -> Iterator[tuple[int, int]]:
    """Rows ``lo .. hi`` (of ``row_size`` elements each) as ranges of at most ``_PIECE``
    elements, at least one row: a stand-in's float64 temporaries stay in cache."""
    step = max(1, _PIECE // max(1, row_size))
    return ((first, min(hi, first + step)) for first in range(lo, hi, step))


def _row_shift(rows: np.ndarray) -> np.ndarray:
    """``host_kernels._row_shift`` of each row of the float32 ``(rows, n)`` array."""
    m = np.fmax.reduce(rows, axis=1, initial=-np.inf)  # the largest element not NaN
    m[m == -np.inf] = 0.0
    return m + _F(0.0)


@_quiet
def relu(x: np.ndarray, out: np.ndarray, lo: int, hi: int) -> None:
    """``host_kernels.relu``'s bits."""
    np.maximum(x[lo:hi], _F(0.0), out=out[lo:hi])


@_quiet
def relu_vjp(g: np.ndarray, y: np.ndarray, out: np.ndarray, lo: int, hi: int) -> None:
    """``host_kernels.relu_vjp``'s bits."""
    np.multiply(g[lo:hi], y[lo:hi] > 0, out=out[lo:hi])


@_quiet
def multiply(a: np.ndarray, b: np.ndarray, out: np.ndarray, lo: int, hi: int) -> None:
    """``host_kernels.multiply``'s bits."""
    np.multiply(a[lo:hi], b[lo:hi], out=out[lo:hi])


@_quiet
def add(a: np.ndarray, b: np.ndarray, out: np.ndarray, lo: int, hi: int) -> None:
    """``host_kernels.add``'s bits."""
    np.add(a[lo:hi], b[lo:hi], out=out[lo:hi])


@_quiet
def add_row_vector(x: np.ndarray, v: np.ndarray, lo: int, hi: int) -> None:
    """``host_kernels.add_row_vector``'s bits."""
    x[lo:hi] += v


@_quiet
def index_add_rows(out: np.ndarray, ids: np.ndarray, values: np.ndarray) -> None:
    """``host_kernels.index_add_rows``'s bits."""
    np.add.at(out, ids, values)  # row by row in the order of ids, as the kernel


@_quiet
def gelu(x: np.ndarray, y: np.ndarray, d: np.ndarray, lo: int, hi: int) -> None:
    """``host_kernels.gelu``'s bits."""
    for first, last in _pieces(lo, hi, 1):
        _gelu(x, y, d, first, last)


def _gelu(x: np.ndarray, y: np.ndarray, d: np.ndarray, lo: int, hi: int) -> None:
    """``gelu`` on one piece."""
    v = x[lo:hi]
    a = np.minimum(np.abs(v), hk._F32_MAX)  # inf: the largest float32; NaN stays NaN
    t = _F(1.0) / fma(hk._TAIL_P, a, _F(1.0))
    e = exp_neg(_F(-0.5) * (a * a))
    tail = fma(t, hk._TAIL_C[0], hk._TAIL_C[1])
    for coefficient in hk._TAIL_C[2:]:
        tail = fma(tail, t, coefficient)
    tail = tail * t * e
    y[lo:hi] = fma(-a, tail, np.where(v > 0, v, _F(0.0)))
    half = _F(0.5) - tail
    d[lo:hi] = fma(v * e, hk._INV_SQRT_2PI, np.where(v >= 0, half, -half) + _F(0.5))


@_quiet
def layer_norm(
    x: np.ndarray,
    w: np.ndarray,
    b: np.ndarray,
    eps: float,
    xhat: np.ndarray,
    rstd: np.ndarray,
    out: np.ndarray,
    lo: int,
    hi: int,
) -> None:
    """``host_kernels.layer_norm``'s bits."""
    inv_n = _F(1.0) / _F(x.shape[1])
    xr = x[lo:hi]
    h = xr - xr[:, :1]
    h -= (_lanes(h) * inv_n)[:, None]
    rs = _F(1.0) / np.sqrt(_lanes(h, h) * inv_n + _F(eps))
    rstd[lo:hi, 0] = rs
    h *= rs[:, None]
    xhat[lo:hi] = h
    out[lo:hi] = h * w + b


@_quiet
def layer_norm_backward(
    g: np.ndarray,
    w: np.ndarray,
    xhat: np.ndarray,
    rstd: np.ndarray,
    gx: np.ndarray,
    pw: np.ndarray,
    pb: np.ndarray,
    lo: int,
    hi: int,
) -> None:
    """``host_kernels.layer_norm_backward``'s bits."""
    inv_n = _F(1.0) / _F(g.shape[1])
    gr, hr = g[lo:hi], xhat[lo:hi]
    gh = gr * w
    m1 = _lanes(gh) * inv_n
    m2 = _lanes(gh, hr) * inv_n
    gx[lo:hi] = ((gh - m1[:, None]) - hr * m2[:, None]) * rstd[lo:hi]
    gxh = gr * hr
    # Each row into its chunk's partial sums, a chunk's rows in order as in the kernel:
    # offset k of every chunk at once, k = 0, 1, ...
    for k in range(COLUMN_CHUNK):
        first = lo + (k - lo) % COLUMN_CHUNK
        rows = slice(first - lo, hi - lo, COLUMN_CHUNK)
        chunk = first // COLUMN_CHUNK
        count = len(range(first, hi, COLUMN_CHUNK))
        pw[chunk : chunk + count] += gxh[rows]
        pb[chunk : chunk + count] += gr[rows]


@_quiet
def softmax(x: np.ndarray, lo: int, hi: int) -> None:
    """``host_kernels.softmax``'s bits."""
    for first, last in _pieces(lo, hi, x.shape[1]):
        rows = x[first:last]
        e = exp_neg(rows - _row_shift(rows)[:, None])
        s = _lanes(e)
        e *= (_F(1.0) / np.where(s != 0, s, _F(1.0)))[:, None]
        rows[...] = e


@_quiet
def softmax_backward(gp: np.ndarray, p: np.ndarray, lo: int, hi: int) -> None:
    """``host_kernels.softmax_backward``'s bits."""
    gr, pr = gp[lo:hi], p[lo:hi]
    dot = _lanes(gr, pr)
    gr[...] = pr * (gr - dot[:, None])


@_quiet
def cross_entropy(
    x: np.ndarray,
    t: np.ndarray,
    ignore: int,
    smooth: bool,
    p: np.ndarray,
    den: np.ndarray,
    picked: np.ndarray,
    total: np.ndarray,
    lo: int,
    hi: int,
) -> None:
    """``host_kernels.cross_entropy``'s bits (its targets unchecked)."""
    for first, last in _pieces(lo, hi, x.shape[1]):
        xr, tr = x[first:last], t[first:last]
        skip = tr == ignore
        s = xr - _row_shift(xr)[:, None]
        if smooth:
            total[first:last] = np.where(skip, _F(0.0), _lanes(s))
        rows = np.arange(last - first)
        picked[first:last] = np.where(skip, _F(0.0), s[rows, np.where(skip, 0, tr)])
        e = exp_neg(s)
        d = _lanes(e)
        den[first:last] = np.where(skip, _F(1.0), d)
        e *= (_F(1.0) / d)[:, None]
        e[skip] = 0.0
        p[first:last] = e


@_quiet
def cross_entropy_backward(
    p: np.ndarray,
    t: np.ndarray,
    ignore: int,
    w: np.ndarray,
    hit: float,
    spread: float,
    out: np.ndarray,
    lo: int,
    hi: int,
) -> None:
    """``host_kernels.cross_entropy_backward``'s bits (its targets unchecked)."""
    pr, tr = p[lo:hi], t[lo:hi]
    wr = np.broadcast_to(w[lo:hi] if w.shape[0] != 1 else w[:1], (hi - lo,))[:, None]
    g = pr * wr
    if _F(spread) != 0:
        g -= wr * _F(spread)
    keep = np.flatnonzero(tr != ignore)
    g[keep, tr[keep]] -= wr[keep, 0] * _F(hit)
    g[tr == ignore] = 0.0
    out[lo:hi] = g
