"""Fused optimizer kernels compiled by numba: one pass per element, state and parameter together.

Imported only through ``tiegrad.optim.fused``, which decides whether to use them; this
module needs numba. Why numba: an Adam step on the host moves every parameter,
gradient and state element through memory, and NumPy, whose ufuncs take two inputs,
needs a dozen passes where one suffices. numba compiles a plain Python loop into a
vectorized machine loop that reads and writes each element once, caches the machine
code on disk (``cache=True``: next to this file, or in the user's cache directory when
that is not writable, numba's own fallback) and releases the GIL, so ``fused`` runs
kernels on several threads. It is a well-kept, widely installed library; numexpr
evaluates one expression into one output (an Adam step updates three arrays), and a
C extension would need a compiler at install time.

Arguments. An update kernel updates a few parameters per call (a call costs
microseconds): ``p`` and ``g``, tuples of as many 1-D arrays (the parameters, and their
gradients, only read), then the rule's state tensors, each one 1-D array over the
parameters' concatenation, then the rule's coefficients by name, in the order of the
fields of its ``Coefficients`` tuple: ``kernel(p, g, *state, *coefficients)``. A size
that differs raises ``ValueError`` before any write (a state tensor the coefficients do
not need is not read: pass it empty); another dtype or dimension is refused when the
call compiles (numba's ``TypingError``). The scalars are rounded to the arrays' dtype
once, so float32 arrays are computed in float32 and the loop vectorizes. ``fused``
always passes tuples of ``fused.GROUP`` arrays (empty ones last), writable parameters
and state and read-only gradients: one specialisation per dtype. The caller guarantees
that no ``g[r]`` shares memory with what a kernel writes (``fused`` checks and copies).

Arithmetic. Each kernel performs, per element, exactly the operations of its NumPy
rule (``adam_rule``, ``sgd_rule``, ``rmsprop_rule``, ``adagrad_rule``) in the same order,
each correctly rounded, without fast-math: no contraction into FMAs and no
reassociation. The fused step therefore reproduces the NumPy step bit for bit.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from numba import prange, types
from numba.core.errors import TypingError
from numba.extending import overload

from .. import _numba

_jit = _numba.jit(nogil=True, error_model="numpy")  # "numpy": no zero-division branch
_parallel = _numba.jit(nogil=True, error_model="numpy", parallel=True)
_inline = _numba.jit(inline="always", error_model="numpy")


@_jit
def _direction(p: Any, g: Any, l2: Any, use_l2: bool, maximize: bool) -> Any:
    """``l2_gradient``: ``p * l2 -+ g`` with weight decay, else ``-+g``."""
    if use_l2:
        return p * l2 - g if maximize else p * l2 + g
    return -g if maximize else g


def _rows(p: tuple, g: tuple) -> int:
    """The total size of the arrays ``p``; ``ValueError`` unless each ``g[r]`` has ``p[r]``'s
    size. Compiled only for equally long tuples of 1-D arrays of one dtype."""


def _check(p: tuple, other: np.ndarray, needed: bool, n: int) -> None:
    """``ValueError`` where ``needed`` and ``other`` is not of size ``n``. Compiled only for a
    1-D array ``other`` of ``p``'s dtype."""


def _one_d(t: Any, like: Any) -> bool:
    """Whether the numba type ``t`` is a 1-D array of the array type ``like``'s dtype."""
    return isinstance(t, types.Array) and t.ndim == 1 and t.dtype == like.dtype


@overload(_rows)
def _rows_typed(p: Any, g: Any) -> Any:
    tuples = all(isinstance(t, types.UniTuple) for t in (p, g)) and len(p) == len(g)
    if not (tuples and _one_d(p.dtype, p.dtype) and _one_d(g.dtype, p.dtype)):
        raise TypingError(f"optimizer kernel: parameters {p} and gradients {g} do not match")

    def rows(p: Any, g: Any) -> int:
        n = 0
        for r in range(len(p)):
            if g[r].size != p[r].size:
                raise ValueError("optimizer kernel: a gradient's size differs from its parameter's")
            n += p[r].size
        return n

    return rows


@overload(_check)
def _check_typed(p: Any, other: Any, needed: Any, n: Any) -> Any:
    if not _one_d(other, p.dtype):
        raise TypingError(f"optimizer kernel: {other} given where {p.dtype} is needed")

    def check(p: Any, other: Any, needed: Any, n: Any) -> None:
        if needed and other.size != n:
            raise ValueError("optimizer kernel: a state tensor's size differs from the parameters'")

    return check


@_jit
def _ends(p: tuple) -> np.ndarray:
    """The end of each row of ``p`` in the rows' concatenation."""
    ends = np.empty(len(p), np.int64)
    n = 0
    for r in range(len(p)):
        n += p[r].size
        ends[r] = n
    return ends


@_inline
def _part(p: tuple, ends: np.ndarray, r: int, lo: int, hi: int) -> tuple[int, int, int]:
    """``(i, j, start)``: elements ``lo .. hi`` of the rows' concatenation hold elements
    ``i .. j`` of row ``r`` (none where ``i >= j``), which starts at ``start``."""
    start = ends[r] - p[r].size
    return max(lo, start) - start, min(hi, ends[r]) - start, start


# -- Adam / AdamW -------------------------------------------------------------------------
@_inline
def _adam_span(pr, gr, m, v, vmax, t, decay, l2, maximize, beta1, beta2, omb1, omb2, eps_hat,
               step_hat, amsgrad):  # fmt: skip
    """``adam_rule`` on the 1-D spans ``pr``, ``gr``, ``m``, ``v`` (and ``vmax`` with amsgrad)."""
    decoupled, use_l2, dec, l2_ = decay != 1.0, l2 != 0.0, t(decay), t(l2)
    b1, b2, omb1_, omb2_ = t(beta1), t(beta2), t(omb1), t(omb2)
    eps, step = t(eps_hat), t(step_hat)
    if amsgrad:
        for j in range(pr.size):
            pj = pr[j] * dec if decoupled else pr[j]
            d = _direction(pj, gr[j], l2_, use_l2, maximize)
            mj = m[j] * b1 + d * omb1_
            vj = v[j] * b2 + (d * d) * omb2_
            wj = np.maximum(vmax[j], vj)
            m[j], v[j], vmax[j] = mj, vj, wj
            pr[j] = pj + (mj / (np.sqrt(wj) + eps)) * step
    else:
        for j in range(pr.size):
            pj = pr[j] * dec if decoupled else pr[j]
            d = _direction(pj, gr[j], l2_, use_l2, maximize)
            mj = m[j] * b1 + d * omb1_
            vj = v[j] * b2 + (d * d) * omb2_
            m[j], v[j] = mj, vj
            pr[j] = pj + (mj / (np.sqrt(vj) + eps)) * step


@_inline
def _adam_size(p: tuple, g: tuple, exp_avg: Any, exp_avg_sq: Any, max_exp_avg_sq: Any,
               amsgrad: bool) -> int:  # fmt: skip
    """The parameters' total size; ``ValueError`` where an operand's size differs."""
    n = _rows(p, g)
    _check(p, exp_avg, True, n)
    _check(p, exp_avg_sq, True, n)
    _check(p, max_exp_avg_sq, amsgrad, n)
    return n


@_jit
def adam(
    p: tuple,
    g: tuple,
    exp_avg: np.ndarray,
    exp_avg_sq: np.ndarray,
    max_exp_avg_sq: np.ndarray,
    decay: float,
    l2: float,
    maximize: bool,
    beta1: float,
    beta2: float,
    one_minus_beta1: float,
    one_minus_beta2: float,
    eps_hat: float,
    step_hat: float,
    amsgrad: bool,
) -> None:
    """``adam_rule`` (``AdamCoefficients``); ``max_exp_avg_sq`` is read with amsgrad only."""
    _adam_size(p, g, exp_avg, exp_avg_sq, max_exp_avg_sq, amsgrad)
    start = 0
    for r in range(len(p)):
        stop = start + p[r].size
        _adam_span(p[r], g[r], exp_avg[start:stop], exp_avg_sq[start:stop],
                   max_exp_avg_sq[start:stop], p[0].dtype.type, decay, l2, maximize, beta1,
                   beta2, one_minus_beta1, one_minus_beta2, eps_hat, step_hat, amsgrad)  # fmt: skip
        start = stop


@_parallel
def adam_blocks(
    p: tuple,
    g: tuple,
    exp_avg: np.ndarray,
    exp_avg_sq: np.ndarray,
    max_exp_avg_sq: np.ndarray,
    decay: float,
    l2: float,
    maximize: bool,
    beta1: float,
    beta2: float,
    one_minus_beta1: float,
    one_minus_beta2: float,
    eps_hat: float,
    step_hat: float,
    amsgrad: bool,
    block: int,
) -> None:
    """``adam`` with the rows' concatenation cut into blocks of ``block`` elements, the
    blocks shared among numba's threads (``fused``): the same arithmetic per element."""
    if block < 1:
        raise ValueError("adam_blocks: block must be at least one element")
    n = _adam_size(p, g, exp_avg, exp_avg_sq, max_exp_avg_sq, amsgrad)
    ends = _ends(p)
    for b in prange(-(-n // block)):
        lo, hi = b * block, min(n, b * block + block)
        for r in range(len(p)):
            i, j, start = _part(p, ends, r, lo, hi)
            if i < j:
                a, z = start + i, start + j
                w = max_exp_avg_sq[a:z] if amsgrad else max_exp_avg_sq
                _adam_span(p[r][i:j], g[r][i:j], exp_avg[a:z], exp_avg_sq[a:z], w,
                           p[0].dtype.type, decay, l2, maximize, beta1, beta2, one_minus_beta1,
                           one_minus_beta2, eps_hat, step_hat, amsgrad)  # fmt: skip


# -- SGD ----------------------------------------------------------------------------------
@_jit
def sgd(
    p: tuple,
    g: tuple,
    momentum_buffer: np.ndarray,
    lr: float,
    momentum: float,
    dampening: float,
    weight_decay: float,
    nesterov: bool,
    maximize: bool,
    first: bool,
) -> None:
    """``sgd_rule`` (``SGDCoefficients``); ``momentum_buffer`` is read with momentum only."""
    n = _rows(p, g)
    _check(p, momentum_buffer, momentum != 0.0, n)
    t = p[0].dtype.type
    neg_lr, mom, undamped, l2 = t(-lr), t(momentum), t(1.0 - dampening), t(weight_decay)
    use_l2, dampen = weight_decay != 0.0, dampening != 0.0
    start = 0
    for r in range(len(p)):
        pr, gr, stop = p[r], g[r], start + p[r].size
        b = momentum_buffer[start:stop]
        start = stop
        if momentum != 0.0:
            for j in range(pr.size):
                d = _direction(pr[j], gr[j], l2, use_l2, maximize)
                bj = b[j] * mom
                bj = d if first else (bj + d * undamped if dampen else bj + d)
                b[j] = bj
                u = bj * mom + d if nesterov else bj
                pr[j] = pr[j] + u * neg_lr
        else:
            for j in range(pr.size):
                pr[j] = pr[j] + _direction(pr[j], gr[j], l2, use_l2, maximize) * neg_lr


# -- RMSprop ------------------------------------------------------------------------------
@_jit
def rmsprop(
    p: tuple,
    g: tuple,
    square_avg: np.ndarray,
    momentum_buffer: np.ndarray,
    grad_avg: np.ndarray,
    lr: float,
    alpha: float,
    one_minus_alpha: float,
    eps: float,
    weight_decay: float,
    momentum: float,
    centered: bool,
    maximize: bool,
) -> None:
    """``rmsprop_rule`` (``RMSpropCoefficients``); ``momentum_buffer`` is read with momentum
    > 0 only, ``grad_avg`` when centered only."""
    use_momentum = momentum > 0.0
    n = _rows(p, g)
    _check(p, square_avg, True, n)
    _check(p, momentum_buffer, use_momentum, n)
    _check(p, grad_avg, centered, n)
    t = p[0].dtype.type
    neg_lr, a, oma, e = t(-lr), t(alpha), t(one_minus_alpha), t(eps)
    l2, mom, use_l2 = t(weight_decay), t(momentum), weight_decay != 0.0
    start = 0
    for r in range(len(p)):
        pr, gr, stop = p[r], g[r], start + p[r].size
        s, b, ga = square_avg[start:stop], momentum_buffer[start:stop], grad_avg[start:stop]
        start = stop
        for j in range(pr.size):
            d = _direction(pr[j], gr[j], l2, use_l2, maximize)
            sj = s[j] * a + (d * d) * oma
            s[j] = sj
            if centered:
                aj = ga[j] * a + d * oma
                ga[j] = aj
                w = sj - aj * aj
                if w < 0:  # rounding (``rmsprop_rule``); NaN stays NaN, as np.maximum's
                    w = t(0.0)
                w = np.sqrt(w)
            else:
                w = np.sqrt(sj)
            w = d / (w + e)
            if use_momentum:
                bj = b[j] * mom + w
                b[j] = bj
                w = bj
            pr[j] = pr[j] + w * neg_lr


# -- Adagrad ------------------------------------------------------------------------------
@_jit
def adagrad(
    p: tuple,
    g: tuple,
    sum: np.ndarray,  # noqa: A002  (the state tensor's name)
    clr: float,
    eps: float,
    weight_decay: float,
    maximize: bool,
) -> None:
    """``adagrad_rule`` (``AdagradCoefficients``)."""
    n = _rows(p, g)
    _check(p, sum, True, n)
    t = p[0].dtype.type
    neg_clr, e, l2, use_l2 = t(-clr), t(eps), t(weight_decay), weight_decay != 0.0
    start = 0
    for r in range(len(p)):
        pr, gr, stop = p[r], g[r], start + p[r].size
        s = sum[start:stop]
        start = stop
        for j in range(pr.size):
            d = _direction(pr[j], gr[j], l2, use_l2, maximize)
            sj = s[j] + d * d
            s[j] = sj
            pr[j] = pr[j] + (d / (np.sqrt(sj) + e)) * neg_clr


# -- finiteness ---------------------------------------------------------------------------
@_inline
def _any_nonfinite(x: Any) -> bool:
    """Whether the 1-D array ``x`` holds a NaN or an infinity.

    An element is finite exactly when its magnitude compares below infinity (a NaN
    compares false), in the array's own dtype: an or-reduction of that comparison
    vectorizes at full width, where a maximum over the bits would widen to 64-bit lanes.
    The loop reads the four quarters of ``x`` side by side: four streams keep more
    reads from memory in flight than one, as an update kernel's operands do
    (docs/performance.md: measurements behind the code).
    """
    inf = x.dtype.type(np.inf)
    q = x.size // 4
    bad = False
    for j in range(q):
        bad |= not (abs(x[j]) < inf)
        bad |= not (abs(x[j + q]) < inf)
        bad |= not (abs(x[j + 2 * q]) < inf)
        bad |= not (abs(x[j + 3 * q]) < inf)
    for j in range(4 * q, x.size):
        bad |= not (abs(x[j]) < inf)
    return bad


@_jit
def nonfinite(x: tuple) -> int:
    """The first ``r`` whose float32 or float64 1-D array ``x[r]`` holds a NaN or an
    infinity, or -1."""
    for r in range(len(x)):
        if _any_nonfinite(x[r]):
            return r
    return -1


@_parallel
def nonfinite_blocks(x: tuple, block: int) -> int:
    """``nonfinite`` with the rows' concatenation cut into blocks of ``block`` elements,
    the blocks read on numba's threads: each block's first row holding a NaN or an
    infinity, and of the first block with one, that row (the rows lie in order)."""
    if block < 1:
        raise ValueError("nonfinite_blocks: block must be at least one element")
    ends = _ends(x)
    n = ends[-1] if len(x) else 0
    hits = np.full(-(-n // block), -1, np.int64)
    for b in prange(hits.size):
        lo, hi = b * block, min(n, b * block + block)
        for r in range(len(x)):
            i, j, _ = _part(x, ends, r, lo, hi)
            if i < j and _any_nonfinite(x[r][i:j]):
                hits[b] = r
                break
    for hit in hits:
        if hit >= 0:
            return hit
    return -1
