"""Shared plumbing of the ops: operand checking, lifting, broadcasting reversal.

Ops validate every operand before recording anything, so an op that raises leaves
the tape as it was (C6): arrays are converted with ``value_of`` first and recorded
as constants (``lift``) only after the checks pass.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from numbers import Integral, Real
from typing import Any

import numpy as np

from ..backend import Array, Backend
from ..errors import DTypeError, HyperparameterError, IndexRangeError, ShapeError, TapeError
from ..tape import Tape, TensorRef

# -- operands ------------------------------------------------------------------------------


def session_of(*xs: Any) -> Tape:
    """The session of the TensorRefs among ``xs``, checking each is live and local."""
    s = None
    for x in xs:
        if isinstance(x, TensorRef):
            if s is None:
                s = x.session
            if x.session is not s or x._gen != s._generation:  # else live and local
                s.check(x)
    if s is None:
        raise TapeError("an op needs at least one TensorRef operand to know its session")
    return s


def ref_pair(a: Any, b: Any) -> Tape | None:
    """The session of ``a`` and ``b`` when both are refs (checked live and local), else None.

    The fast path of binary ops: a few attribute compares instead of ``session_of``
    and two ``lift`` calls (docs/design.md: performance).
    """
    if type(a) is not TensorRef or type(b) is not TensorRef:
        return None
    s = a.session
    gen = s._generation
    if b.session is not s or a._gen != gen or b._gen != gen:
        s.check(a)
        s.check(b)
    return s


def value_of(s: Tape, x: Any) -> Array:
    """The array of operand ``x``: a ref's value, or ``x`` converted; records nothing.

    ``x`` must have been checked by ``session_of`` when it is a ref.
    """
    return x.value if isinstance(x, TensorRef) else s._array(x)


def lift(s: Tape, x: Any, value: Array | None = None) -> TensorRef:
    """``x`` as a ref of ``s``: refs are checked, arrays and lists become constants.

    ``value`` is ``x`` already converted by ``value_of`` (saves converting twice).
    """
    if isinstance(x, TensorRef):
        if x.session is not s or x._gen != s._generation:  # else live and local
            s.check(x)
        return x
    return s.constant(x if value is None else value)


def operands(
    op: str, a: Any, b: Any, check: Callable[[str, Array, Array], None]
) -> tuple[Tape, TensorRef, TensorRef]:
    """Session and refs of two operands, at least one a ref.

    ``check(op, a_value, b_value)`` runs before an array operand is recorded as a
    constant, so a failing op records nothing (C6).
    """
    s = session_of(a, b)
    av, bv = value_of(s, a), value_of(s, b)
    check(op, av, bv)
    return s, lift(s, a, av), lift(s, b, bv)


def vector_value(s: Tape, op: str, name: str, x: Any, n: int, of: str, shape: Any) -> Array:
    """The value of operand ``x``, which must have shape ``(n,)`` (fixed by the ``of``
    operand, of shape ``shape``: named in the error only, made only then)."""
    xv = value_of(s, x)
    if tuple(xv.shape) != (n,):
        raise ShapeError(
            f"{op}: {name} has shape {tuple(xv.shape)}, expected ({n},) for {of} of shape "
            f"{tuple(shape)}"
        )
    return xv


def affine_operands(
    s: Tape, op: str, x: Any, xv: Array, weight: Any, wv: Array, bias: Any, n_out: int
) -> tuple[list[TensorRef], Array | None]:
    """Refs of ``x``, ``weight`` and, if given, ``bias`` (in that order), and the bias value.

    ``xv`` and ``wv`` are the operands' values (``value_of``). The bias must have shape
    ``(n_out,)``; it is checked before an array operand is recorded as a constant, so a
    failing op records nothing (C6).
    """
    bv = None
    if bias is not None:
        bv = vector_value(s, op, "bias", bias, n_out, "weight", wv.shape)
    refs = [lift(s, x, xv), lift(s, weight, wv)]
    if bias is not None:
        refs.append(lift(s, bias, bv))
    return refs, bv


def scalar_value(x: Any) -> int | float | None:
    """A non-bool real number operand as a Python int or float, else None.

    NumPy scalars become Python numbers so they never promote the array's dtype. A
    complex number is None: as an array operand it is then a ``DTypeError``.
    """
    tx = type(x)
    if tx is float or tx is int:
        return x
    if isinstance(x, Real) and not isinstance(x, bool):
        return int(x) if isinstance(x, Integral) else float(x)
    return None


# -- shapes --------------------------------------------------------------------------------


def broadcast_error(op: str, a: Array, b: Array) -> ShapeError:
    """The ``ShapeError`` of an op whose operand shapes do not broadcast."""
    return ShapeError(f"{op}: shapes {tuple(a.shape)} and {tuple(b.shape)} do not broadcast")


def check_broadcast(op: str, a: Array, b: Array) -> None:
    """Raise ``broadcast_error`` unless the shapes of ``a`` and ``b`` broadcast (NumPy rules)."""
    for m, n in zip(reversed(tuple(a.shape)), reversed(tuple(b.shape))):
        if m != n and m != 1 and n != 1:
            raise broadcast_error(op, a, b)


def unbroadcast(bk: Backend, g: Array, shape: tuple[int, ...]) -> Array:
    """Sum ``g`` over the axes that broadcasting added or stretched to reach ``shape``."""
    gshape = tuple(g.shape)
    if gshape == shape:
        return g
    lead = len(gshape) - len(shape)
    axes = tuple(range(lead)) + tuple(
        lead + i for i, n in enumerate(shape) if n == 1 and gshape[lead + i] != 1
    )
    if axes:
        g = bk.sum(g, axis=axes, keepdims=True)
    return bk.reshape(g, shape)


def normalize_axes(axis: Any, ndim: int, op: str) -> tuple[int, ...]:
    """Axes as a sorted tuple of non-negative ints (``None`` means all)."""
    if axis is None:
        return tuple(range(ndim))
    if isinstance(axis, Integral):
        axis = (axis,)
    out = []
    for a in axis:
        if not -ndim <= a < ndim:
            raise ShapeError(f"{op}: axis {a} is out of range for an array of rank {ndim}")
        out.append(int(a) % ndim)
    return tuple(sorted(set(out)))


def one_axis(axis: Any, ndim: int, op: str) -> int:
    """One axis as a non-negative int; None, a list or a bool is a ``ShapeError``."""
    if isinstance(axis, bool) or not isinstance(axis, Integral):
        raise ShapeError(f"{op}: axis must be one integer, got {axis!r}")
    return normalize_axes(axis, ndim, op)[0]


def sum_last(bk: Backend, x: Array) -> Array:
    """Sums of ``x`` over its last axis, keepdims.

    With ``slow_row_reductions`` (NumPy) one matrix-vector product: BLAS sums many
    short rows several times faster than a ufunc reduction (docs/design.md: performance); ``x``
    should then be contiguous (else ``reshape`` copies it). Elsewhere (PyTorch) the
    backend's own reduction, one kernel.
    """
    shape = tuple(x.shape)
    n = shape[-1]
    if not bk.slow_row_reductions or n == 0 or math.prod(shape) == 0:
        return bk.sum(x, axis=-1, keepdims=True)
    rows = bk.matmul(bk.reshape(x, (-1, n)), _ones(n, x.dtype))
    return bk.reshape(rows, shape[:-1] + (1,))


def sum_rows(bk: Backend, x2: Array) -> Array:
    """The sum of the rows of a 2-D ``x2`` (``(n, k) -> (k,)``); a vector-matrix product
    with ``slow_row_reductions``, else the backend's reduction."""
    n = x2.shape[0]
    if not bk.slow_row_reductions or n == 0:
        return bk.sum(x2, axis=0)
    return bk.matmul(_ones(n, x2.dtype), x2)


_KEPT_ONES = 1 << 16  # the longest vector of ones kept: 64 of them hold at most 32 MiB


def _ones(n: int, dtype: Any) -> np.ndarray:
    """A read-only NumPy vector of ``n`` ones (the host's row sums), kept for the next
    step up to ``_KEPT_ONES`` elements: making it costs more than a short sum."""
    return _kept_ones(n, np.dtype(dtype)) if n <= _KEPT_ONES else np.ones(n, dtype)


@functools.lru_cache(maxsize=64)
def _kept_ones(n: int, dtype: np.dtype) -> np.ndarray:
    ones = np.ones(n, dtype)
    ones.flags.writeable = False
    return ones


SOFTMAX_MIN_SUM = 1e-20
"""A softmax row whose shifted exponentials sum below this is recomputed with its own max."""


def _block_shift(bk: Backend, x: Array) -> Array:
    """The softmax shift of ``x``: the maximum of each block of its last two axes (keepdims).

    One fast reduction over contiguous memory instead of a slow per-row maximum; it is at
    least each row's maximum, so no exponential overflows. A block of only ``-inf``
    gets 0, and so does an array without elements (a maximum of nothing has no value).
    """
    shape = tuple(x.shape)
    axes = (-2, -1) if len(shape) > 1 else (-1,)
    if not math.prod(shape):
        return bk.zeros(shape[: -len(axes)] + (1,) * len(axes), x.dtype)
    c = bk.max(x, axis=axes, keepdims=True)
    return bk.where(c == -math.inf, 0.0, c)


def _row_shift(bk: Backend, x: Array) -> Array:
    """Each row's own maximum (keepdims), 0 for a row of only ``-inf`` or of no element."""
    shape = tuple(x.shape)
    if not shape[-1]:
        return bk.zeros(shape[:-1] + (1,), x.dtype)
    m = bk.max(x, axis=-1, keepdims=True)
    return bk.where(m == -math.inf, 0.0, m)


def _shift(bk: Backend, x: Array) -> Array:
    """The softmax shift: the block maximum with ``slow_row_reductions``, else each row's."""
    return _block_shift(bk, x) if bk.slow_row_reductions else _row_shift(bk, x)


def _underflowed(bk: Backend, den: Array) -> bool:
    """Whether some sum of shifted exponentials is below ``SOFTMAX_MIN_SUM`` (or NaN).

    A row whose own maximum lies far below the block shift loses precision to
    underflow; such inputs are shifted row by row instead.
    """
    return bool(math.prod(tuple(den.shape))) and not float(-bk.max(-den)) >= SOFTMAX_MIN_SUM


def shifted_exp(bk: Backend, x: Array) -> tuple[Array, Array, Array]:
    """``(s, e, den)``: ``s = x - c``, ``e = exp(s)``, ``den`` = sums of ``e`` over the last axis.

    The softmax of ``x`` over its last axis is ``e / den``, its log ``s - log(den)``;
    ``s`` and ``e`` are fresh arrays the caller owns. The shift ``c`` is each row's own
    maximum, except with ``slow_row_reductions`` (NumPy): there the block maximum of
    ``_block_shift``, or each row's own maximum when that underflows (``_underflowed``).
    A row of only ``-inf`` has a zero sum.
    """
    s = x - _shift(bk, x)
    e = bk.exp(s)
    den = sum_last(bk, e)
    if bk.slow_row_reductions and _underflowed(bk, den):
        s = x - _row_shift(bk, x)
        e = bk.exp(s)
        den = sum_last(bk, e)
    return s, e, den


def softmax_(bk: Backend, x: Array, remake: Callable[[], Array]) -> Array:
    """The softmax of ``x`` over its last axis, computed in place in ``x`` and returned.

    ``x`` is a temporary of the caller. The backend's fused kernel shifts each row by
    its own maximum (``Backend.softmax_rows_``); without one, ``x`` is shifted like
    ``shifted_exp``, and when that underflows, ``remake()`` builds ``x`` afresh and each
    row is shifted by its own maximum. A row of only ``-inf`` (a query that sees no key)
    becomes zeros.
    """
    if bk.softmax_rows_(x):
        return x
    x -= _shift(bk, x)
    e = bk.exp_(x)
    den = sum_last(bk, e)
    if bk.slow_row_reductions and _underflowed(bk, den):
        e = remake()
        e -= _row_shift(bk, e)
        e = bk.exp_(e)
        den = sum_last(bk, e)
    e *= 1.0 / bk.where(den == 0, 1.0, den)
    return e


def swap_last(bk: Backend, x: Array) -> Array:
    """``x`` with its last two axes swapped (a view where the backend allows)."""
    nd = len(x.shape)
    return bk.transpose(x, tuple(range(nd - 2)) + (nd - 1, nd - 2))


# -- gradients, losses, indices ------------------------------------------------------------


def needs_grad(s: Tape, ref: TensorRef) -> bool:
    """Whether the node of ``ref`` takes a cotangent (VJPs skip the others' work).

    A VJP runs only for nodes recorded with gradients enabled, so the flag suffices.
    """
    return s._rg[ref.id]


def check_reduction(op: str, reduction: str) -> None:
    """Loss reductions are ``"mean"``, ``"sum"`` or ``"none"``."""
    if reduction not in ("mean", "sum", "none"):
        raise HyperparameterError(
            f"{op}: reduction must be 'mean', 'sum' or 'none', got {reduction!r}"
        )


def int_array(s: Tape, op: str, x: Any) -> Array:
    """Integer index data (targets, token ids) as a backend array: refs give their value."""
    bk = s.backend
    if isinstance(x, TensorRef):
        s.check(x)
    try:
        arr = value_of(s, x)
    except DTypeError:  # not numbers at all
        arr = None
    if arr is None or not bk.is_integer(arr.dtype):
        got = getattr(arr if arr is not None else x, "dtype", type(x).__name__)
        raise DTypeError(f"{op}: indices must have an integer dtype, got {got}")
    return arr


def host_indices(x: Any) -> np.ndarray | None:
    """Index data the caller gave as a NumPy array, as that array; None for anything else.

    Checks and counts on it run on the host: on a device session they then need no
    device-to-host synchronisation.
    """
    return x if isinstance(x, np.ndarray) else None


def host_targets(op: str, x: Any, ignore_index: int, n: int, extra: str = "") -> int | None:
    """For targets given as a NumPy array: how many are not ``ignore_index``, after
    checking on the host that the others lie in ``[0, n)`` (``check_index_range``'s
    error); None for anything else (see ``host_indices``).

    Targets whose range excludes ``ignore_index`` (the common case) cost two
    reductions: no mask and no masked copy.
    """
    host = host_indices(x)
    if host is None:
        return None
    if not host.size:
        return 0
    lo, hi = int(host.min()), int(host.max())
    count = host.size
    if lo <= ignore_index <= hi:
        valid = host != ignore_index
        safe = np.where(valid, host, 0)
        count = int(np.count_nonzero(valid))
        lo, hi = int(safe.min()), int(safe.max())
    _check_bounds(op, "targets", n, extra, lo, hi)
    return count


def check_index_range(
    s: Tape, op: str, what: str, idx: Array, n: int, extra: str = "", host: Any = None
) -> None:
    """Raise ``IndexRangeError`` unless every integer of ``idx`` lies in ``[0, n)``.

    ``host`` is the same integers as a NumPy array when the caller has them (checked
    there instead, no device synchronisation).
    """
    if math.prod(tuple(idx.shape)) == 0:
        return
    if host is not None:
        hi, lo = int(host.max()), int(host.min())
    else:
        bk = s.backend
        wide = bk.astype(idx, bk.int64)  # negating unsigned data would wrap around
        hi = int(bk.max(wide))
        lo = -int(bk.max(-wide))
    _check_bounds(op, what, n, extra, lo, hi)


def _check_bounds(op: str, what: str, n: int, extra: str, lo: int, hi: int) -> None:
    if lo < 0 or hi >= n:
        raise IndexRangeError(
            f"{op}: {what} must lie in [0, {n}){extra}, got values in [{lo}, {hi}]"
        )
