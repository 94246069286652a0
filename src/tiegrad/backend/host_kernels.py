"""Fused float32 kernels of the NumPy backend, compiled by numba: GELU, ReLU and its VJP,
products and sums, a scatter-add of rows, layer norm, softmax, cross-entropy.

Imported through ``tiegrad._numba.kernels``, by ``host_dispatch``, which decides when to
use the kernels (float32, C-contiguous operands, ``tiegrad._numba.ENABLED``), and by
``host_blocks`` (their drivers on numba's threads) and ``host_reference`` (the kernels'
constants). numba compiles each kernel on its first call, so a kernel a process never
calls costs it no compile time. Every kernel takes arrays and scalars, and the
elementwise and row kernels the range ``lo .. hi`` of elements or rows they handle; they
release the GIL, so ``host_dispatch`` runs the blocks of one call on several threads.
A kernel raises ``ValueError`` before it writes anything where its operands' sizes or
its range disagree (numba checks no index): a mismatch never reads or writes outside an
array. Each one reads its inputs once and writes its outputs once, where NumPy needs a
pass over memory per ufunc; numba turns the loops into 8-wide vector loops. ``exp_neg``
is a vectorizable exponential (libm's ``expf`` is a call per element that stops the
vectorizer).

Every vector loop indexes from 0 (a slice ``x[lo:hi]`` or a row view ``x[r]``): an
index that may be negative (``range(lo, hi)``) makes numba wrap it around, and LLVM
then turns each load and store into a gather or scatter, several times slower.

Accuracy and bits: float32 throughout, compiled without fast-math, so every operation
rounds as written. The fused multiply-adds are explicit (``_fma``: one rounding each,
and faster than a product and a sum), and a row's sums run
in the order ``_lanes`` writes out. A kernel's bits thus follow from its source alone:
they are the same in every process however the kernel was compiled, ``host_reference``
computes them with NumPy (while a ``tiegrad train`` child compiles the kernels), and
they can differ in the last bits from the NumPy backend's own code for the same op.
``exp_neg`` is within 1 ulp (reassociated, as fast-math would allow, its range
reduction lost ~60 ulp). NaN propagates through every kernel.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import numpy as np
from llvmlite import ir
from numba import types
from numba.extending import intrinsic

from .. import _numba

# No fast-math: every operation rounds as written (the fused multiply-adds are ``_fma``),
# so the kernels' bits follow from their source, as ``host_reference``'s do.
_kernel = _numba.jit(nogil=True, error_model="numpy")
_inline = _numba.jit(inline="always")

_F = np.float32
_LOG2E = _F(1.4426950408889634)
_LN2_HI = _F(0.693359375)  # ln 2 = _LN2_HI + _LN2_LO, _LN2_HI exact in 9 bits
_LN2_LO = _F(-2.12194440e-4)
_EXP_MIN = _F(-87.33654)  # below this exp underflows float32's normal range: 0
# exp(r) = 1 + r + r^2 * P(r) on |r| <= ln(2)/2 (Cephes expf, relative error ~1 ulp)
_EXP_P = (
    _F(1.9875691500e-4),
    _F(1.3981999507e-3),
    _F(8.3334519073e-3),
    _F(4.1665795894e-2),
    _F(1.6666665459e-1),
    _F(5.0000001201e-1),
)
# The upper normal tail Phi(-a) = t * P(t) * exp(-a*a/2), t = 1 / (1 + p * a), a >= 0,
# absolute error below 4e-9 (the NumPy backend's ``_normal_tail`` uses the same fit).
_TAIL_P = _F(0.2759956359010431)
_TAIL_C = (
    _F(-0.11345756156690588),
    _F(0.44086028893966595),
    _F(-0.3139303774906198),
    _F(0.32219998220208323),
    _F(0.04670261267675377),
    _F(0.11762505136854265),
)
_INV_SQRT_2PI = _F(1.0 / math.sqrt(2.0 * math.pi))
_F32_MAX = _F(np.finfo(np.float32).max)


@intrinsic
def _fma(typingctx: Any, a: Any, b: Any, c: Any) -> Any:
    """``a * b + c`` of float32 values with one rounding (``llvm.fma``: one instruction
    where the CPU has it, vectorized with the loop; the correctly rounded result
    everywhere)."""
    f32 = types.float32
    if not (a == f32 and b == f32 and c == f32):
        return None

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        return builder.fma(*args)

    return f32(f32, f32, f32), codegen


@intrinsic
def float_from_bits(typingctx: Any, bits: Any) -> Any:
    """The float32 whose IEEE bit pattern is the int32 ``bits``."""
    sig = types.float32(types.int32)

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        return builder.bitcast(args[0], ir.FloatType())

    return sig, codegen


@_inline
def exp_neg(z: Any) -> Any:
    """``exp(z)`` of a float32 ``z <= 0``: 0 below ``_EXP_MIN``, NaN for NaN.

    ``z = k ln 2 + r`` with ``|r| <= ln(2) / 2``; ``2**k`` is built from its exponent bits.
    """
    zc = z if z >= _EXP_MIN else _EXP_MIN
    k = np.floor(_fma(zc, _LOG2E, _F(0.5)))
    r = _fma(-k, _LN2_HI, zc)
    r = _fma(-k, _LN2_LO, r)
    p = _fma(_EXP_P[0], r, _EXP_P[1])
    p = _fma(p, r, _EXP_P[2])
    p = _fma(p, r, _EXP_P[3])
    p = _fma(p, r, _EXP_P[4])
    p = _fma(p, r, _EXP_P[5])
    p = _fma(p, r * r, r) + _F(1.0)
    e = p * float_from_bits((np.int32(k) + np.int32(127)) << np.int32(23))
    if z >= _EXP_MIN:
        return e
    return _F(0.0) if z < _EXP_MIN else z


@_inline
def _sum(x: Any) -> Any:
    """The sum of the float32 vector ``x`` in a fixed order (``_lanes``)."""
    return _lanes(x, x, False)


@_inline
def _dot(a: Any, b: Any) -> Any:
    """``sum(a * b)`` of float32 vectors in ``_lanes``' order."""
    return _lanes(a, b, True)


@intrinsic
def _lanes(typingctx: Any, a: Any, b: Any, products: Any) -> Any:
    """The sum of ``a`` (or of ``a * b`` with ``products``) in a fixed order.

    ``a`` and ``b``: contiguous float32 vectors, read-only or not, ``b`` at least as long
    as ``a`` (any other types do not compile). Lane ``k`` adds elements ``k, k + 8, ...`` in order
    (the tail after the last whole group of eight goes to lane 0), and the lanes
    combine as ``((0+1)+(2+3))+((4+5)+(6+7))`` (``_fold_lanes``). The order is written
    out in the machine code, one 8-wide vector add per group, not licensed by
    fast-math: under ``reassoc`` the compiler chooses it, and a kernel compiled in the
    running process summed in another order than the same kernel loaded from numba's
    cache (a resumed run then missed a straight one's bits). The same loop written with
    eight scalar accumulators gives these bits, several times slower (LLVM keeps it
    scalar).
    """
    if not (_f32_vector(a) and _f32_vector(b) and isinstance(products, types.Boolean)):
        return None
    sig = types.float32(a, b, products)

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        def add(acc: Any, x: Any, y: Any) -> Any:
            return builder.fadd(acc, builder.select(args[2], builder.fmul(x, y), x))

        return _fold_lanes(context, builder, (a, b), args[:2], 0.0, add, builder.fadd)

    return sig, codegen


@intrinsic
def _row_max(typingctx: Any, a: Any) -> Any:
    """The largest element of the contiguous float32 vector ``a`` that is not NaN
    (``-inf`` when there is none): ``m = v if v > m else m`` over the elements, eight
    lanes at a time (``_fold_lanes``), where one running maximum waits for each compare
    in turn (4-5 cycles an element). Only the sign of a zero maximum may depend on the
    order, and ``x - m`` is the same for both zeros but at ``x = 0``, whose exponential
    is 1 either way.
    """
    if not _f32_vector(a):
        return None
    sig = types.float32(a)

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        def larger(acc: Any, x: Any) -> Any:
            return builder.select(builder.fcmp_ordered(">", x, acc), x, acc)

        def step(acc: Any, x: Any, y: Any) -> Any:
            return larger(acc, x)

        return _fold_lanes(context, builder, (a, a), (args[0], args[0]), -math.inf, step, larger)

    return sig, codegen


def _f32_vector(t: Any) -> bool:
    """Whether numba type ``t`` is a contiguous 1-D float32 array (read-only or not)."""
    return (
        isinstance(t, types.Array) and t.dtype == types.float32 and t.ndim == 1 and t.layout == "C"
    )


def _fold_lanes(
    context: Any,
    builder: Any,
    vectors: tuple[Any, Any],
    arrays: tuple[Any, Any],
    start: float,
    step: Callable[[Any, Any, Any], Any],
    join: Callable[[Any, Any], Any],
) -> Any:
    """The machine code of a fixed-order reduction of two float32 vectors (``_lanes``,
    ``_row_max``): ``acc = step(acc, x, y)`` from ``start`` over elements ``k, k + 8,
    ...`` in lane ``k`` (8-wide vector steps), the tail after the last whole group of
    eight in lane 0, then the lanes as ``join(join(join(0, 1), join(2, 3)), join(join(4,
    5), join(6, 7)))``. ``vectors`` are the numba types of ``arrays``; the length is the
    first array's."""
    f32, i64 = ir.FloatType(), ir.IntType(64)
    v8 = ir.VectorType(f32, 8)
    made = [context.make_array(t)(context, builder, x) for t, x in zip(vectors, arrays)]
    pa, pb = (builder.bitcast(x.data, f32.as_pointer()) for x in made)
    n = builder.extract_value(made[0].shape, 0)
    whole = builder.udiv(n, ir.Constant(i64, 8))

    def loop(name: str, first: Any, stop: Any, init: Any, body_step: Callable) -> Any:
        before = builder.block
        head = builder.append_basic_block(f"lanes.{name}")
        body = builder.append_basic_block(f"lanes.{name}.body")
        done = builder.append_basic_block(f"lanes.{name}.done")
        builder.branch(head)
        builder.position_at_end(head)
        i, acc = builder.phi(i64), builder.phi(init.type)
        i.add_incoming(first, before)
        acc.add_incoming(init, before)
        builder.cbranch(builder.icmp_unsigned("<", i, stop), body, done)
        builder.position_at_end(body)
        i.add_incoming(builder.add(i, ir.Constant(i64, 1)), body)
        acc.add_incoming(body_step(i, acc), body)
        builder.branch(head)
        builder.position_at_end(done)
        return acc

    def group(i: Any, acc: Any) -> Any:
        at = builder.mul(i, ir.Constant(i64, 8))
        x, y = (builder.load(builder.bitcast(builder.gep(p, [at]), v8.as_pointer()), align=4)
                for p in (pa, pb))  # fmt: skip
        return step(acc, x, y)

    def element(j: Any, acc: Any) -> Any:
        return step(acc, builder.load(builder.gep(pa, [j])), builder.load(builder.gep(pb, [j])))

    acc = loop("groups", ir.Constant(i64, 0), whole, ir.Constant(v8, [start] * 8), group)
    lane = [builder.extract_element(acc, ir.Constant(ir.IntType(32), k)) for k in range(8)]
    lane[0] = loop("tail", builder.mul(whole, ir.Constant(i64, 8)), n, lane[0], element)

    left = join(join(lane[0], lane[1]), join(lane[2], lane[3]))
    return join(left, join(join(lane[4], lane[5]), join(lane[6], lane[7])))


@_inline
def _row_shift(row: Any) -> Any:
    """The softmax shift of a row: its largest element not NaN (``_row_max``), 0 for a
    row of only ``-inf``, and +0 for a zero maximum, whose sign ``_row_max`` leaves to
    the order of its lanes (``x + 0`` is ``x`` but for -0)."""
    m = _row_max(row)
    return _F(0.0) if m == -np.inf else m + _F(0.0)


@_inline
def _targets_fit(t: Any, ignore: int, n: int, lo: int, hi: int) -> bool:
    """Whether each target of rows ``lo .. hi`` is ``ignore`` or lies in ``[0, n)``."""
    for r in range(lo, hi):
        if t[r] != ignore and not 0 <= t[r] < n:
            return False
    return True


@_kernel
def relu(x: np.ndarray, out: np.ndarray, lo: int, hi: int) -> None:
    """``out = max(x, 0)`` on flat elements ``lo .. hi``, as ``np.maximum(x, 0)``.

    NaN stays NaN and ``-0.0`` becomes ``0.0`` (NumPy's answer on a tie is its second
    operand).
    """
    if x.ndim != 1 or out.ndim != 1 or x.size != out.size:
        raise ValueError("relu: x and out are not 1-D arrays of one size")
    if not 0 <= lo <= hi <= out.size:
        raise ValueError("relu: lo .. hi is not a range of the elements")
    x, out = x[lo:hi], out[lo:hi]  # indices from 0: plain vector loads
    for i in range(out.size):
        v = x[i]
        out[i] = v if (v > _F(0.0) or v != v) else _F(0.0)


@_kernel
def relu_vjp(g: np.ndarray, y: np.ndarray, out: np.ndarray, lo: int, hi: int) -> None:
    """``out = g * (y > 0)`` on flat elements ``lo .. hi`` (one pass, no mask array).

    A product with 0 or 1, as NumPy's ``g * (y > 0)``: NaN or infinite ``g`` gives NaN
    where ``y`` is not positive.
    """
    if g.ndim != 1 or y.ndim != 1 or out.ndim != 1 or g.size != out.size or y.size != out.size:
        raise ValueError("relu_vjp: g, y and out are not 1-D arrays of one size")
    if not 0 <= lo <= hi <= out.size:
        raise ValueError("relu_vjp: lo .. hi is not a range of the elements")
    g, y, out = g[lo:hi], y[lo:hi], out[lo:hi]  # indices from 0: plain vector loads
    for i in range(out.size):
        out[i] = g[i] * (_F(1.0) if y[i] > _F(0.0) else _F(0.0))


@_kernel
def multiply(a: np.ndarray, b: np.ndarray, out: np.ndarray, lo: int, hi: int) -> None:
    """``out = a * b`` on flat elements ``lo .. hi``."""
    if a.ndim != 1 or b.ndim != 1 or out.ndim != 1 or a.size != out.size or b.size != out.size:
        raise ValueError("multiply: a, b and out are not 1-D arrays of one size")
    if not 0 <= lo <= hi <= out.size:
        raise ValueError("multiply: lo .. hi is not a range of the elements")
    a, b, out = a[lo:hi], b[lo:hi], out[lo:hi]  # indices from 0: plain vector loads
    for i in range(out.size):
        out[i] = a[i] * b[i]


@_kernel
def add(a: np.ndarray, b: np.ndarray, out: np.ndarray, lo: int, hi: int) -> None:
    """``out = a + b`` on flat elements ``lo .. hi`` (``out`` may be ``a``)."""
    if a.ndim != 1 or b.ndim != 1 or out.ndim != 1 or a.size != out.size or b.size != out.size:
        raise ValueError("add: a, b and out are not 1-D arrays of one size")
    if not 0 <= lo <= hi <= out.size:
        raise ValueError("add: lo .. hi is not a range of the elements")
    a, b, out = a[lo:hi], b[lo:hi], out[lo:hi]  # indices from 0: plain vector loads
    for i in range(out.size):
        out[i] = a[i] + b[i]


@_kernel
def add_row_vector(x: np.ndarray, v: np.ndarray, lo: int, hi: int) -> None:
    """Rows ``lo .. hi`` of ``(rows, n)`` ``x`` plus the vector ``v`` of ``n``, in place."""
    n = x.shape[1]
    if v.size != n or not 0 <= lo <= hi <= x.shape[0]:
        raise ValueError("add_row_vector: v is not a row of x, or lo .. hi not rows of x")
    for r in range(lo, hi):
        row = x[r]  # a row view: the inner loop indexes from 0
        for j in range(n):
            row[j] += v[j]


@_kernel
def index_add_rows(out: np.ndarray, ids: np.ndarray, values: np.ndarray) -> None:
    """``out[ids[i]] += values[i]`` for every row ``i``, in order (``np.add.at``'s sums).

    Raises ``ValueError`` before any write where an id is not a row of ``out`` or the
    shapes disagree.
    """
    d = out.shape[1]
    if values.shape[0] != ids.size or values.shape[1] != d:
        raise ValueError("index_add_rows: values is not one row of out per id")
    for i in range(ids.size):
        if not 0 <= ids[i] < out.shape[0]:
            raise ValueError("index_add_rows: an id is not a row of out")
    for i in range(ids.size):
        row, add_row = out[ids[i]], values[i]  # row views: the inner loop indexes from 0
        for j in range(d):
            row[j] += add_row[j]


@_kernel
def gelu(x: np.ndarray, y: np.ndarray, d: np.ndarray, lo: int, hi: int) -> None:
    """``y = x Phi(x)`` and ``d = Phi(x) + x phi(x)`` on flat elements ``lo .. hi``.

    ``x Phi(x) = max(x, 0) - |x| Phi(-|x|)``: no ``1 + erf`` cancellation for negative
    ``x`` (the NumPy backend's ``_gelu32`` formula, one pass instead of a dozen).
    """
    if x.ndim != 1 or y.ndim != 1 or d.ndim != 1 or x.size != y.size or d.size != y.size:
        raise ValueError("gelu: x, y and d are not 1-D arrays of one size")
    if not 0 <= lo <= hi <= y.size:
        raise ValueError("gelu: lo .. hi is not a range of the elements")
    x, y, d = x[lo:hi], y[lo:hi], d[lo:hi]  # indices from 0: plain vector loads
    for i in range(y.size):
        v = x[i]
        a = abs(v)
        a = _F32_MAX if a > _F32_MAX else a
        t = _F(1.0) / _fma(_TAIL_P, a, _F(1.0))
        e = exp_neg(_F(-0.5) * (a * a))
        tail = _fma(t, _TAIL_C[0], _TAIL_C[1])
        tail = _fma(tail, t, _TAIL_C[2])
        tail = _fma(tail, t, _TAIL_C[3])
        tail = _fma(tail, t, _TAIL_C[4])
        tail = _fma(tail, t, _TAIL_C[5])
        tail = tail * t * e
        y[i] = _fma(-a, tail, v if v > _F(0.0) else _F(0.0))
        half = _F(0.5) - tail
        d[i] = _fma(v * e, _INV_SQRT_2PI, (half if v >= _F(0.0) else -half) + _F(0.5))


@_kernel
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
    """Rows ``lo .. hi`` of ``(rows, d)`` ``x``: ``xhat``, ``rstd`` (rows, 1) and ``out``.

    ``xhat = (x - mean) * rstd``, ``rstd = 1 / sqrt(var + eps)`` (biased variance, three
    passes over the row), ``out = xhat * w + b``; ``out`` may be ``xhat`` itself. The
    mean is taken of the row shifted by its first element, so a constant row has
    ``x - mean`` exactly 0 (``xhat`` 0, as in PyTorch) rather than its rounding error
    over ``sqrt(eps)``.
    """
    rows, n = x.shape
    if (
        w.size != n
        or b.size != n
        or xhat.shape != x.shape
        or out.shape != x.shape
        or rstd.shape != (rows, 1)
        or not 0 <= lo <= hi <= rows
    ):
        raise ValueError("layer_norm: operand shapes differ from x's, or lo .. hi not rows of x")
    inv_n = _F(1.0) / _F(n)
    epsf = _F(eps)
    for r in range(lo, hi):
        xr, hr, outr = x[r], xhat[r], out[r]  # row views: the inner loops index from 0
        shift = xr[0] if n else _F(0.0)
        for j in range(n):
            hr[j] = xr[j] - shift
        mean = _sum(hr) * inv_n
        for j in range(n):
            hr[j] -= mean
        rs = _F(1.0) / np.sqrt(_dot(hr, hr) * inv_n + epsf)
        rstd[r, 0] = rs
        for j in range(n):
            h = hr[j] * rs
            hr[j] = h
            outr[j] = h * w[j] + b[j]


COLUMN_CHUNK = 64
"""Rows per partial column sum of ``layer_norm_backward`` (a block holds whole chunks)."""


@_kernel
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
    """Rows ``lo .. hi`` of the input cotangent of ``layer_norm``, and partial column sums.

    ``gx = rstd * (gh - mean(gh) - xhat * mean(gh * xhat))`` with ``gh = g * w``. Row
    ``r`` adds ``g * xhat`` and ``g`` into row ``r // COLUMN_CHUNK`` of ``pw`` and ``pb``
    (zeros on entry), in row order: the weight's and the bias's cotangents are the sums
    of those rows, the same bits however the rows are cut into blocks, as long as
    ``lo`` is a multiple of ``COLUMN_CHUNK``.
    """
    rows, n = g.shape
    chunks = (rows + COLUMN_CHUNK - 1) // COLUMN_CHUNK
    if (
        w.size != n
        or xhat.shape != g.shape
        or gx.shape != g.shape
        or rstd.shape != (rows, 1)
        or pw.shape != (chunks, n)
        or pb.shape != (chunks, n)
        or not 0 <= lo <= hi <= rows
    ):
        raise ValueError(
            "layer_norm_backward: operand shapes differ from g's, or lo .. hi not rows of g"
        )
    inv_n = _F(1.0) / _F(n)
    for r in range(lo, hi):
        gr, hr, gxr = g[r], xhat[r], gx[r]  # row views: the inner loops index from 0
        pwr, pbr = pw[r // COLUMN_CHUNK], pb[r // COLUMN_CHUNK]
        for j in range(n):
            gxr[j] = gr[j] * w[j]  # gh
        m1 = _sum(gxr) * inv_n
        m2 = _dot(gxr, hr) * inv_n
        rs = rstd[r, 0]
        for j in range(n):
            gxr[j] = (gxr[j] - m1 - hr[j] * m2) * rs
            pwr[j] += gr[j] * hr[j]
            pbr[j] += gr[j]


@_kernel
def softmax(x: np.ndarray, lo: int, hi: int) -> None:
    """Rows ``lo .. hi`` of ``(rows, n)`` ``x`` replaced by their softmax.

    Each row is shifted by its own maximum (``_row_shift``); a row of only ``-inf`` (a
    query that sees no key) becomes zeros, a row with a NaN becomes NaN; the row sum is
    ``_sum``'s.
    """
    n = x.shape[1]
    if not 0 <= lo <= hi <= x.shape[0]:
        raise ValueError("softmax: lo .. hi are not rows of x")
    for r in range(lo, hi):
        row = x[r]
        m = _row_shift(row)
        for j in range(n):
            row[j] = exp_neg(row[j] - m)
        s = _sum(row)
        scale = _F(1.0) / (s if s != _F(0.0) else _F(1.0))
        for j in range(n):
            row[j] *= scale


@_kernel
def softmax_backward(gp: np.ndarray, p: np.ndarray, lo: int, hi: int) -> None:
    """Rows ``lo .. hi``: ``gp`` (the cotangent of ``p = softmax(s)``) becomes that of ``s``.

    ``gs = p * (gp - sum(gp * p))`` row by row, in place.
    """
    n = p.shape[1]
    if gp.shape != p.shape or not 0 <= lo <= hi <= p.shape[0]:
        raise ValueError("softmax_backward: gp and p differ in shape, or lo .. hi not rows")
    for r in range(lo, hi):
        gr, pr = gp[r], p[r]  # row views: the inner loops index from 0
        dot = _dot(gr, pr)
        for j in range(n):
            gr[j] = pr[j] * (gr[j] - dot)


@_kernel
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
    """Rows ``lo .. hi`` of the ``(rows, n)`` logits ``x`` against the int64 targets ``t``.

    Row ``r`` is shifted by its own maximum (``_row_shift``): ``picked[r]`` becomes its
    target's shifted logit, ``den[r]`` the sum of its shifted exponentials, ``p[r]``
    those exponentials over ``den[r]`` (NaN where that sum is 0, a row of only ``-inf``)
    and, with ``smooth``, ``total[r]`` the sum of its shifted logits. A row whose target
    is ``ignore`` gets ``p`` 0, ``den`` 1, ``picked`` and ``total`` 0: loss and gradient
    0. A target that is neither ``ignore`` nor in ``[0, n)`` raises before anything is
    written. ``p`` may be ``x`` itself: a row is read before it is written.
    """
    rows, n = x.shape
    if (
        p.shape != x.shape
        or t.shape[0] != rows
        or den.shape[0] != rows
        or picked.shape[0] != rows
        or (smooth and total.shape[0] != rows)
        or not 0 <= lo <= hi <= rows
    ):
        raise ValueError("cross_entropy: operands of other sizes than x, or lo .. hi not rows")
    if not _targets_fit(t, ignore, n, lo, hi):
        raise ValueError("cross_entropy: a target outside [0, n) that is not ignore")
    for r in range(lo, hi):
        xr, pr = x[r], p[r]  # row views: the inner loops index from 0
        k = t[r]
        if k == ignore:
            for j in range(n):
                pr[j] = _F(0.0)
            den[r], picked[r] = _F(1.0), _F(0.0)
            if smooth:
                total[r] = _F(0.0)
            continue
        m = _row_shift(xr)
        picked[r] = xr[k] - m
        if smooth:  # the shifted logits first, for their sum
            for j in range(n):
                pr[j] = xr[j] - m
            total[r] = _sum(pr)
            for j in range(n):
                pr[j] = exp_neg(pr[j])
        else:
            for j in range(n):
                pr[j] = exp_neg(xr[j] - m)
        s = _sum(pr)
        den[r] = s
        scale = _F(1.0) / s
        for j in range(n):
            pr[j] *= scale


@_kernel
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
    """Rows ``lo .. hi`` of the logits' gradient ``out`` from the softmax ``p`` of
    ``cross_entropy`` and the weight ``w[r]`` of each row (or ``w[0]`` of every row).

    ``out[r] = p[r] * w[r] - w[r] * spread`` (no subtraction where ``float32(spread)`` is
    0), and ``w[r] * hit`` less at the row's target; 0 in a row whose target is
    ``ignore``, whatever ``p`` holds there. A target that is neither ``ignore`` nor in
    ``[0, n)`` raises before anything is written. ``out`` may be ``p`` itself: each
    element is read before it is written.
    """
    rows, n = p.shape
    if (
        out.shape != p.shape
        or t.shape[0] != rows
        or not (w.shape[0] == rows or w.shape[0] == 1)
        or not 0 <= lo <= hi <= rows
    ):
        raise ValueError(
            "cross_entropy_backward: operands of other sizes than p, or lo .. hi not rows"
        )
    if not _targets_fit(t, ignore, n, lo, hi):
        raise ValueError("cross_entropy_backward: a target outside [0, n) that is not ignore")
    f_hit, f_spread = _F(hit), _F(spread)
    for r in range(lo, hi):
        pr, orow = p[r], out[r]
        k = t[r]
        if k == ignore:
            for j in range(n):
                orow[j] = _F(0.0)
            continue
        wr = w[r] if w.shape[0] != 1 else w[0]
        if f_spread != _F(0.0):
            c = wr * f_spread
            for j in range(n):
                orow[j] = pr[j] * wr - c
        else:
            for j in range(n):
                orow[j] = pr[j] * wr
        orow[k] -= wr * f_hit
