"""The host kernels' NumPy stand-in (``tiegrad.backend.host_reference``) gives their bits.

``tiegrad train`` steps on the stand-in until a child has compiled the kernels, then
switches (``tiegrad.train.precompile``): every function must give the bits of its
kernel for every input, NaN where it gives NaN, whatever blocks the rows come in. The
fused multiply-add by way of float64 is checked against the compiled one and against
exact arithmetic, halfway cases included.
"""

from __future__ import annotations

from fractions import Fraction

import numpy as np
import pytest

numba = pytest.importorskip("numba")

from test_host_kernels import _exp_all  # noqa: E402

from tiegrad.backend import host_kernels as hk  # noqa: E402
from tiegrad.backend import host_reference as ref  # noqa: E402

SPECIAL = np.array(
    [0, -0.0, np.inf, -np.inf, np.nan, 1e-40, -1e-40, 3.4e38, -3.4e38, 88, -88, 1e19, -1e19],
    np.float32,
)


def same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    """NaN at the same places, the same bits elsewhere (-0.0 is not 0.0)."""
    nan = np.isnan(a)
    return np.array_equal(nan, np.isnan(b)) and np.array_equal(
        a.view(np.uint32)[~nan], b.view(np.uint32)[~nan]
    )


def values(rng: np.random.Generator, shape: tuple[int, ...], special: bool = True) -> np.ndarray:
    """float32 values over many scales, with special values at random places."""
    n = int(np.prod(shape))
    x = rng.standard_normal(n) * rng.choice([1e-3, 0.1, 1.0, 3.0, 10.0, 100.0], n)
    x = x.astype(np.float32)
    if special and n:
        x[rng.integers(0, n, max(1, n // 10))] = rng.choice(SPECIAL, max(1, n // 10))
    return x.reshape(shape)


@numba.njit
def _fma_all(a, b, c, out):
    for i in range(out.size):
        out[i] = hk._fma(a[i], b[i], c[i])


def test_fma_rounds_once_where_float64_rounds_halfway():
    # (1 + 2^-23) * -(1 - 2^-23) 2^-24 + (1 + 2^-23) = 1 + 2^-24 + 2^-70: float64 rounds
    # the sum to 1 + 2^-24, halfway between two float32 numbers, and float32's ties to
    # even would then give 1; the exact sum rounds up to 1 + 2^-23.
    a, b, c = np.float32(1 + 2**-23), np.float32(-(1 - 2**-23) * 2**-24), np.float32(1 + 2**-23)
    exact = Fraction(float(a)) * Fraction(float(b)) + Fraction(float(c))
    assert exact == 1 + Fraction(1, 2**24) + Fraction(1, 2**70)
    want = np.float32(1 + 2**-23)
    assert np.float32(np.float64(a) * np.float64(b) + np.float64(c)) != want  # double rounding
    assert ref.fma(np.array([a]), b, c)[0] == want
    assert ref.fma(a, b, c) == want  # scalars too
    out = np.empty(1, np.float32)
    _fma_all(np.array([a]), np.array([b]), np.array([c]), out)
    assert out[0] == want


def _halfway_triples(rng: np.random.Generator, n: int) -> tuple[np.ndarray, ...]:
    """Triples whose float64 sum lands halfway between float32 numbers (or close to it
    below float32's normal range), above or below the exact one, for ``c`` in every
    binade from the subnormal ones to the largest: ``a * b`` is ``±(1 - 2^-46)`` times
    half the spacing of float32 numbers at ``c``."""
    exponent = rng.integers(-149, 128, n)  # c's binade: 2^exponent <= |c| < 2^(exponent+1)
    spacing = 2.0 ** np.maximum(exponent - 23, -149)
    mantissa = np.where(exponent >= -126, rng.integers(2**23, 2**24, n), rng.integers(1, 2**23, n))
    c = rng.choice([-1.0, 1.0], n) * mantissa * np.where(exponent >= -126, spacing, 2.0**-149)
    c[:2] = [np.finfo(np.float32).max, -np.finfo(np.float32).max]
    half = np.log2(spacing).astype(np.int64) - 1
    a = np.float32(1 + 2**-23) * 2.0 ** (half // 2)
    b = rng.choice([-1.0, 1.0], n) * (1 - 2**-23) * 2.0 ** (half - half // 2)
    return a.astype(np.float32), b.astype(np.float32), c.astype(np.float32)


@pytest.mark.parametrize("kind", ["random", "halfway", "special"])
def test_fma_is_the_compiled_fma_bit_for_bit(kind):
    rng = np.random.default_rng(7)
    n = 400_000
    if kind == "random":
        a, b, c = (values(rng, (n,), special=False) for _ in range(3))
        c *= np.float32(2.0) ** rng.integers(-40, 40, n).astype(np.float32)
    elif kind == "halfway":
        a, b, c = _halfway_triples(rng, n)
    else:
        a, b, c = (
            rng.choice(np.concatenate([SPECIAL, [1.0, -2.5]]), n).astype(np.float32)
            for _ in range(3)
        )
    out = np.empty(n, np.float32)
    with np.errstate(all="ignore"):
        _fma_all(a, b, c, out)
        assert same_bits(ref.fma(a, b, c), out)
    for i in range(0, n, n // 200) if kind == "halfway" else ():  # exact arithmetic
        exact = Fraction(float(a[i])) * Fraction(float(b[i])) + Fraction(float(c[i]))
        nearest = np.float32(float(exact))
        with np.errstate(over="ignore"):  # the neighbours of the largest float32
            below, above = np.nextafter(nearest, -np.inf), np.nextafter(nearest, np.inf)
        err = abs(exact - Fraction(float(out[i])))
        neighbours = [x for x in (nearest, below, above) if np.isfinite(x)]
        assert all(abs(exact - Fraction(float(x))) >= err for x in neighbours)


def test_exp_neg_is_the_kernels_bit_for_bit():
    rng = np.random.default_rng(3)
    with np.errstate(all="ignore"):
        z = -np.abs(values(rng, (300_000,))) * np.float32(30)
        z = np.concatenate([z, -np.linspace(0, 90, 100_001, dtype=np.float32), SPECIAL])
        out = np.empty_like(z)
        _exp_all(z, out)
        assert same_bits(ref.exp_neg(z), out)


SIZES = [1, 7, 8, 9, 17, 63, 64, 65, 100, 128, 1000, 40_000]


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("name", ["relu", "gelu"])
def test_one_input_elementwise_kernels(name, n):
    rng = np.random.default_rng(n)
    x = values(rng, (n,))
    outputs = 2 if name == "gelu" else 1
    got = [np.empty(n, np.float32) for _ in range(outputs)]
    want = [np.empty(n, np.float32) for _ in range(outputs)]
    getattr(hk, name)(x, *want, 0, n)
    half = n // 3
    for lo, hi in ((0, half), (half, n)):  # in blocks
        getattr(ref, name)(x, *got, lo, hi)
    assert all(same_bits(g, w) for g, w in zip(got, want))


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("name", ["relu_vjp", "multiply", "add"])
def test_two_input_elementwise_kernels(name, n):
    rng = np.random.default_rng(n)
    a, b = values(rng, (n,)), values(rng, (n,))
    got, want = np.empty(n, np.float32), np.empty(n, np.float32)
    getattr(hk, name)(a, b, want, 0, n)
    getattr(ref, name)(a, b, got, 0, n)
    assert same_bits(got, want)


SHAPES = [(1, 1), (3, 7), (5, 8), (7, 9), (70, 64), (130, 100), (200, 128), (33, 17), (2, 300)]


def _row_blocks(rows: int, align: int = 1) -> list[tuple[int, int]]:
    """Rows cut into two blocks, the first a multiple of ``align`` rows."""
    cut = (rows // 2) // align * align
    return [(0, cut), (cut, rows)]


@pytest.mark.parametrize("shape", SHAPES)
def test_softmax_and_its_backward(shape):
    rng = np.random.default_rng(shape[0] * 1000 + shape[1])
    rows = shape[0]
    for x in (values(rng, shape), values(rng, shape, special=False) * np.float32(5)):
        x[0] = -np.inf  # a query that sees no key
        x[-1, 0] = np.nan
        want, got = x.copy(), x.copy()
        hk.softmax(want, 0, rows)
        for lo, hi in _row_blocks(rows):
            ref.softmax(got, lo, hi)
        assert same_bits(got, want)
    p = x.copy()
    hk.softmax(p, 0, rows)
    gp = values(rng, shape, special=False)
    want, got = gp.copy(), gp.copy()
    hk.softmax_backward(want, p, 0, rows)
    for lo, hi in _row_blocks(rows):
        ref.softmax_backward(got, p, lo, hi)
    assert same_bits(got, want)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("smooth", [False, True])
def test_cross_entropy_and_its_backward(shape, smooth):
    rng = np.random.default_rng(shape[0] * 1000 + shape[1] + smooth)
    rows, n = shape
    ignore = -100
    t = rng.integers(0, n, rows)
    t[rng.random(rows) < 0.2] = ignore
    results = []
    for x in (values(rng, shape), values(rng, shape, special=False) * np.float32(5)):
        x[0] = -np.inf  # no finite logit: NaN, unless the row is ignored
        x[-1, 0] = np.nan
        outs = []
        for kernel, blocks in (
            (hk.cross_entropy, [(0, rows)]),
            (ref.cross_entropy, _row_blocks(rows)),
        ):
            p = np.full(shape, 7, np.float32)
            den, picked, total = np.full((3, rows), 7, np.float32)
            for lo, hi in blocks:
                kernel(x, t, ignore, smooth, p, den, picked, total, lo, hi)
            outs.append([p, den, picked] + ([total] if smooth else []))
        for want, got in zip(*outs):
            assert same_bits(got, want)
        results.append(outs[0][0])
    p = results[1]
    spread = 0.1 / n if smooth else 0.0
    for w in (values(rng, (rows,), special=False), np.float32([-0.37])):
        want, got = np.full((2, *shape), 7, np.float32)
        hk.cross_entropy_backward(p, t, ignore, w, 1.0 - 0.1 * smooth, spread, want, 0, rows)
        for lo, hi in _row_blocks(rows):
            ref.cross_entropy_backward(p, t, ignore, w, 1.0 - 0.1 * smooth, spread, got, lo, hi)
        assert same_bits(got, want)
        assert not want[t == ignore].any()


@pytest.mark.parametrize("smooth", [False, True])
def test_cross_entropy_in_place_gives_the_bits_of_separate_arrays(smooth):
    # ops.linear_cross_entropy runs both kernels over one chunk of logits: p is x, out is p
    rng = np.random.default_rng(9 + smooth)
    rows, n = shape = (37, 203)
    t = rng.integers(0, n, rows)
    t[::5] = -100
    x = values(rng, shape, special=False) * np.float32(5)
    w = values(rng, (rows,), special=False)
    hit, spread = 1.0 - 0.1 * smooth, 0.1 / n if smooth else 0.0
    for kernel, backward, blocks in (
        (hk.cross_entropy, hk.cross_entropy_backward, [(0, rows)]),
        (ref.cross_entropy, ref.cross_entropy_backward, _row_blocks(rows)),
    ):
        p, out = np.empty(shape, np.float32), np.empty(shape, np.float32)
        stats, stats_inplace = np.zeros((2, 3, rows), np.float32)  # total: with smoothing
        inplace = x.copy()
        for lo, hi in blocks:
            kernel(x, t, -100, smooth, p, *stats, lo, hi)
            kernel(inplace, t, -100, smooth, inplace, *stats_inplace, lo, hi)
        assert same_bits(inplace, p) and same_bits(stats_inplace, stats)
        for lo, hi in blocks:
            backward(p, t, -100, w, hit, spread, out, lo, hi)
            backward(inplace, t, -100, w, hit, spread, inplace, lo, hi)
        assert same_bits(inplace, out)


def test_a_zero_maximum_shifts_by_plus_zero_in_either():
    # +0 and -0 in different lanes of a row: the kernel's lanes and NumPy's order would
    # pick maxima of either sign; both shift by +0, so the targets' shifted logits match.
    rows, n = 16, 19
    x = np.full((rows, n), -1.0, np.float32)
    for r in range(rows):
        x[r, r % 8], x[r, r % 8 + 8] = (0.0, -0.0) if r % 2 else (-0.0, 0.0)
    t = np.array([r % 8 + 8 * (r // 8) for r in range(rows)])
    outs = []
    for kernel in (hk.cross_entropy, ref.cross_entropy):
        p, den, picked, total = np.zeros((rows, n), np.float32), *np.zeros((3, rows), np.float32)
        kernel(x, t, -100, True, p, den, picked, total, 0, rows)
        outs.append([p, den, picked, total])
    for want, got in zip(*outs):
        assert same_bits(got, want)
    # x - (+0) keeps the sign of x: -0 at a target that is -0
    assert np.array_equal(np.signbit(outs[0][2]), np.signbit(x[np.arange(rows), t]))


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("eps", [1e-5, 0.1])
def test_layer_norm_and_its_backward(shape, eps):
    rng = np.random.default_rng(shape[0] * 1000 + shape[1])
    rows, n = shape
    x = values(rng, shape, special=False)
    x[-1] = values(rng, (n,))  # one row of special values
    w, b = values(rng, (n,), special=False), values(rng, (n,), special=False)
    want = [
        np.empty(shape, np.float32),
        np.empty((rows, 1), np.float32),
        np.empty(shape, np.float32),
    ]
    got = [
        np.empty(shape, np.float32),
        np.empty((rows, 1), np.float32),
        np.empty(shape, np.float32),
    ]
    hk.layer_norm(x, w, b, eps, *want, 0, rows)
    for lo, hi in _row_blocks(rows):
        ref.layer_norm(x, w, b, eps, *got, lo, hi)
    assert all(same_bits(g, k) for g, k in zip(got, want))
    xhat, rstd = want[0], want[1]
    g = values(rng, shape, special=False)
    chunks = -(-rows // hk.COLUMN_CHUNK)

    def outputs():
        return [np.empty(shape, np.float32), *np.zeros((2, chunks, n), np.float32)]

    want, got = outputs(), outputs()
    hk.layer_norm_backward(g, w, xhat, rstd, *want, 0, rows)
    for lo, hi in _row_blocks(rows, hk.COLUMN_CHUNK):
        ref.layer_norm_backward(g, w, xhat, rstd, *got, lo, hi)
    assert all(same_bits(a, k) for a, k in zip(got, want))


def test_rows_plus_a_vector_and_the_scatter_add_of_rows():
    rng = np.random.default_rng(5)
    x, v = values(rng, (50, 24)), values(rng, (24,))
    want, got = x.copy(), x.copy()
    hk.add_row_vector(want, v, 0, 50)
    ref.add_row_vector(got, v, 0, 20)
    ref.add_row_vector(got, v, 20, 50)
    assert same_bits(got, want)
    ids = rng.integers(0, 10, 300)  # many repeats: the order of the sums shows
    rows = values(rng, (300, 24), special=False)
    want, got = values(rng, (10, 24), special=False), None
    got = want.copy()
    hk.index_add_rows(want, ids, rows)
    ref.index_add_rows(got, ids, rows)
    assert same_bits(got, want)
