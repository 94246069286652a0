"""Special functions on the host in NumPy: ``erf`` and the float32 GELU.

``_erf`` is Cephes' float64 ``erf`` (rational approximations, relative error about
1e-16): the exact path of GELU for every dtype but float32 (gradient checks).
``_gelu32`` is the float32 GELU and its derivative where the compiled kernel is not
used, block by block (every temporary stays in cache), with a mask-free formula
accurate to float32 precision.

The names are private to ``tiegrad.backend``.
"""

from __future__ import annotations

import math

import numpy as np

from .. import _threads
from .host_dispatch import _ranges_parallel

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
