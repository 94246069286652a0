"""Fused optimizer kernels compiled by numba: one pass per element, state and parameter together.

Imported only through ``tiegrad.optim.fused``, which decides whether to use them; this
module needs numba. Why numba: an Adam step on the host moves every parameter,
gradient and state element through memory, and NumPy, whose ufuncs take two inputs,
needs a dozen passes where one suffices. numba compiles a plain Python loop into a
vectorized machine loop that reads and writes each element once, caches the machine
code on disk (``cache=True``: next to this file, or in the user's cache directory when
that is not writable, numba's own fallback) and releases the GIL, so ``fused`` runs a
kernel on several threads. It is a well-kept, widely installed library; numexpr
evaluates one expression into one output (an Adam step updates three arrays), and a
C extension would need a compiler at install time.

Layout. A kernel updates a batch of segments, one per canonical slot (C5), described
by a table of addresses: row ``k`` holds the data addresses of the slot's parameter,
gradient and state tensors (``table[k, 0]``, ``table[k, 1]``, ``table[k, 2:]``, 0 for a
tensor the flags say is absent), and ``starts`` (length ``rows + 1``) the prefix sums of
the segment sizes. ``kernel(table, starts, coef, flags, lo, hi)`` updates the elements
``lo`` .. ``hi`` of the concatenation, so ``fused`` splits any batch into equal chunks
for its threads whatever the tensor sizes (the kernels release the GIL). ``coef`` holds
the rule's scalars in the parameters' dtype (so float32 arrays are computed in float32
and the loop vectorizes), ``flags`` its switches. The caller guarantees that every
address is live, C-contiguous, of ``coef``'s dtype and of the segment's size, and that
gradients share no memory with what a kernel writes (``fused.run`` checks and copies).

Arithmetic. Each kernel performs, per element, exactly the operations of its NumPy
rule (``adam_rule``, ``sgd_rule``, ``rmsprop_rule``, ``adagrad_rule``) in the same order,
each correctly rounded, without fast-math: no contraction into FMAs and no
reassociation. The fused step therefore reproduces the NumPy step bit for bit.
"""

from __future__ import annotations

from typing import Any

import numba
import numpy as np
from numba import types
from numba.extending import intrinsic

from .. import _numba

_jit = _numba.jit(nogil=True, error_model="numpy")  # "numpy": no zero-division branch


@intrinsic
def _pointer(typingctx: Any, address: Any, like: Any) -> Any:
    """The integer ``address`` as a pointer to ``like``'s element type."""
    sig = types.CPointer(like.dtype)(types.intp, like)

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        return builder.inttoptr(args[0], context.get_value_type(signature.return_type))

    return sig, codegen


@_jit
def _segment(starts: np.ndarray, lo: int) -> int:
    """The row whose segment holds element ``lo`` (empty segments skipped)."""
    return np.searchsorted(starts, lo, side="right") - 1


@_jit
def _view(table: np.ndarray, k: int, column: int, offset: int, n: int, like: np.ndarray) -> Any:
    """``n`` elements of row ``k``'s tensor ``column`` from element ``offset`` on."""
    return numba.carray(_pointer(table[k, column] + offset * like.itemsize, like), n)


@_jit
def _direction(p: Any, g: Any, l2: Any, use_l2: bool, maximize: bool) -> Any:
    """``l2_gradient``: ``p * l2 -+ g`` with weight decay, else ``-+g``."""
    if use_l2:
        return p * l2 - g if maximize else p * l2 + g
    return -g if maximize else g


# -- Adam / AdamW -------------------------------------------------------------------------
@_jit
def adam(
    table: np.ndarray, starts: np.ndarray, coef: np.ndarray, flags: np.ndarray, lo: int, hi: int
) -> None:
    """``adam_rule`` over elements ``lo`` .. ``hi``; columns p, g, exp_avg, exp_avg_sq, max.

    ``coef``: decay, l2, beta1, beta2, 1 - beta1, 1 - beta2, eps_hat, step_hat;
    ``flags``: decay != 1, l2 != 0, maximize, amsgrad.
    """
    decay, l2, b1, b2 = coef[0], coef[1], coef[2], coef[3]
    omb1, omb2, eps_hat, step_hat = coef[4], coef[5], coef[6], coef[7]
    decoupled, use_l2, maximize, amsgrad = flags[0] != 0, flags[1] != 0, flags[2] != 0, flags[3]
    k = _segment(starts, lo)
    while lo < hi:
        stop = min(hi, starts[k + 1])
        n, off = stop - lo, lo - starts[k]
        p = _view(table, k, 0, off, n, coef)
        g = _view(table, k, 1, off, n, coef)
        m = _view(table, k, 2, off, n, coef)
        v = _view(table, k, 3, off, n, coef)
        if amsgrad:
            vmax = _view(table, k, 4, off, n, coef)
            for j in range(n):
                pj = p[j] * decay if decoupled else p[j]
                d = _direction(pj, g[j], l2, use_l2, maximize)
                mj = m[j] * b1 + d * omb1
                vj = v[j] * b2 + (d * d) * omb2
                wj = np.maximum(vmax[j], vj)
                m[j], v[j], vmax[j] = mj, vj, wj
                p[j] = pj + (mj / (np.sqrt(wj) + eps_hat)) * step_hat
        else:
            for j in range(n):
                pj = p[j] * decay if decoupled else p[j]
                d = _direction(pj, g[j], l2, use_l2, maximize)
                mj = m[j] * b1 + d * omb1
                vj = v[j] * b2 + (d * d) * omb2
                m[j], v[j] = mj, vj
                p[j] = pj + (mj / (np.sqrt(vj) + eps_hat)) * step_hat
        lo = stop
        k += 1


# -- SGD ----------------------------------------------------------------------------------
@_jit
def sgd(
    table: np.ndarray, starts: np.ndarray, coef: np.ndarray, flags: np.ndarray, lo: int, hi: int
) -> None:
    """``sgd_rule`` over elements ``lo`` .. ``hi``; columns p, g, momentum_buffer.

    ``coef``: -lr, momentum, 1 - dampening, weight_decay; ``flags``: weight_decay != 0,
    maximize, momentum != 0, first step of the buffer, dampening != 0, nesterov.
    """
    neg_lr, mom, undamped, l2 = coef[0], coef[1], coef[2], coef[3]
    use_l2, maximize, momentum = flags[0] != 0, flags[1] != 0, flags[2]
    first, dampen, nesterov = flags[3] != 0, flags[4] != 0, flags[5] != 0
    k = _segment(starts, lo)
    while lo < hi:
        stop = min(hi, starts[k + 1])
        n, off = stop - lo, lo - starts[k]
        p = _view(table, k, 0, off, n, coef)
        g = _view(table, k, 1, off, n, coef)
        if momentum:
            b = _view(table, k, 2, off, n, coef)
            for j in range(n):
                d = _direction(p[j], g[j], l2, use_l2, maximize)
                bj = b[j] * mom
                bj = d if first else (bj + d * undamped if dampen else bj + d)
                b[j] = bj
                u = bj * mom + d if nesterov else bj
                p[j] = p[j] + u * neg_lr
        else:
            for j in range(n):
                p[j] = p[j] + _direction(p[j], g[j], l2, use_l2, maximize) * neg_lr
        lo = stop
        k += 1


# -- RMSprop ------------------------------------------------------------------------------
@_jit
def _rmsprop_element(
    pj: Any, gj: Any, sj: Any, aj: Any, bj: Any, coef: np.ndarray, flags: np.ndarray
) -> tuple[Any, Any, Any, Any]:
    """One element of ``rmsprop_rule``: new (p, square_avg, grad_avg, momentum_buffer)."""
    neg_lr, alpha, oma, eps, l2, mom = coef[0], coef[1], coef[2], coef[3], coef[4], coef[5]
    d = _direction(pj, gj, l2, flags[0] != 0, flags[1] != 0)
    sj = sj * alpha + (d * d) * oma
    if flags[3]:
        aj = aj * alpha + d * oma
        w = np.sqrt(sj - aj * aj)
    else:
        w = np.sqrt(sj)
    w = d / (w + eps)
    if flags[2]:
        bj = bj * mom + w
        w = bj
    return pj + w * neg_lr, sj, aj, bj


@_jit
def rmsprop(
    table: np.ndarray, starts: np.ndarray, coef: np.ndarray, flags: np.ndarray, lo: int, hi: int
) -> None:
    """``rmsprop_rule`` over ``lo`` .. ``hi``; columns p, g, square_avg, momentum_buffer, grad_avg.

    ``coef``: -lr, alpha, 1 - alpha, eps, weight_decay, momentum; ``flags``:
    weight_decay != 0, maximize, momentum > 0, centered.
    """
    momentum, centered = flags[2], flags[3]
    k = _segment(starts, lo)
    while lo < hi:
        stop = min(hi, starts[k + 1])
        n, off = stop - lo, lo - starts[k]
        p = _view(table, k, 0, off, n, coef)
        g = _view(table, k, 1, off, n, coef)
        s = _view(table, k, 2, off, n, coef)
        if momentum and centered:
            b = _view(table, k, 3, off, n, coef)
            a = _view(table, k, 4, off, n, coef)
            for j in range(n):
                p[j], s[j], a[j], b[j] = _rmsprop_element(p[j], g[j], s[j], a[j], b[j], coef, flags)
        elif momentum:
            b = _view(table, k, 3, off, n, coef)
            for j in range(n):
                p[j], s[j], _, b[j] = _rmsprop_element(p[j], g[j], s[j], s[j], b[j], coef, flags)
        elif centered:
            a = _view(table, k, 4, off, n, coef)
            for j in range(n):
                p[j], s[j], a[j], _ = _rmsprop_element(p[j], g[j], s[j], a[j], s[j], coef, flags)
        else:
            for j in range(n):
                p[j], s[j], _, _ = _rmsprop_element(p[j], g[j], s[j], s[j], s[j], coef, flags)
        lo = stop
        k += 1


# -- Adagrad ------------------------------------------------------------------------------
@_jit
def adagrad(
    table: np.ndarray, starts: np.ndarray, coef: np.ndarray, flags: np.ndarray, lo: int, hi: int
) -> None:
    """``adagrad_rule`` over elements ``lo`` .. ``hi``; columns p, g, sum.

    ``coef``: -clr, eps, weight_decay; ``flags``: weight_decay != 0, maximize.
    """
    neg_clr, eps, l2 = coef[0], coef[1], coef[2]
    use_l2, maximize = flags[0] != 0, flags[1] != 0
    k = _segment(starts, lo)
    while lo < hi:
        stop = min(hi, starts[k + 1])
        n, off = stop - lo, lo - starts[k]
        p = _view(table, k, 0, off, n, coef)
        g = _view(table, k, 1, off, n, coef)
        s = _view(table, k, 2, off, n, coef)
        for j in range(n):
            d = _direction(p[j], g[j], l2, use_l2, maximize)
            sj = s[j] + d * d
            s[j] = sj
            p[j] = p[j] + (d / (np.sqrt(sj) + eps)) * neg_clr
        lo = stop
        k += 1


# -- finiteness ---------------------------------------------------------------------------
@_jit
def nonfinite_rows(
    table: np.ndarray,
    starts: np.ndarray,
    bits: np.ndarray,
    exponent: np.ndarray,
    out: np.ndarray,
    lo: int,
    hi: int,
) -> None:
    """Set ``out[k] = 1`` for each row whose column-0 tensor has a NaN or infinity in ``lo..hi``.

    The tensors are read as unsigned integers of their width (``bits``, a zero of that
    type): an element is not finite exactly when all of ``exponent``'s bits are set. An
    integer maximum vectorizes where a float comparison chain would not, and each
    segment is read as four interleaved streams: one stream per thread leaves memory
    bandwidth unused.
    """
    e = exponent[0]
    k = _segment(starts, lo)
    while lo < hi:
        stop = min(hi, starts[k + 1])
        n, off = stop - lo, lo - starts[k]
        q = n // 4
        x0 = _view(table, k, 0, off, q, bits)
        x1 = _view(table, k, 0, off + q, q, bits)
        x2 = _view(table, k, 0, off + 2 * q, q, bits)
        x3 = _view(table, k, 0, off + 3 * q, n - 3 * q, bits)
        worst = bits[0]
        for j in range(q):
            worst = max(worst, x0[j] & e, x1[j] & e, x2[j] & e, x3[j] & e)
        for j in range(q, n - 3 * q):
            worst = max(worst, x3[j] & e)
        if worst == e:
            out[k] = 1
        lo = stop
        k += 1
