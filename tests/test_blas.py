"""The host backend's MKL path for matrix products (``tiegrad.backend.blas``).

Each layout MKL is handed must give ``np.matmul``'s shape, dtype and values (float64 to
1e-12) without calling NumPy; each layout it cannot read must go to NumPy unchanged.
"""

from __future__ import annotations

import ctypes
import itertools
import mmap
import os
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest

from tiegrad.backend import NUMPY, Backend, blas
from tiegrad.backend import numpy_backend as nb
from tiegrad.backend.base import scale_into
from tiegrad.errors import ShapeError

needs_mkl = pytest.mark.skipif(blas.LIBRARY is None, reason=str(blas.unused_reason()))
rng = np.random.default_rng(7)


def _operand(shape: tuple[int, ...], layout: str, dtype: type) -> np.ndarray:
    """An operand of ``shape`` stored as ``layout``: c, t (transposed), pad, step or neg."""
    *lead, r, c = shape
    lead = tuple(lead)
    if layout == "t":
        return np.swapaxes(rng.standard_normal(lead + (c, r)).astype(dtype), -1, -2)
    if layout == "pad":
        return rng.standard_normal(lead + (r, c + 3)).astype(dtype)[..., :c]
    if layout == "step":
        return rng.standard_normal(lead + (r, 2 * c)).astype(dtype)[..., ::2]
    if layout == "neg":
        return rng.standard_normal(lead + (r, c)).astype(dtype)[..., ::-1, :]
    return rng.standard_normal(shape).astype(dtype)


class _Spy:
    """Counts calls of ``np.matmul`` while delegating to it."""

    def __init__(self, real):
        self.real, self.calls = real, 0

    def __call__(self, a, b):
        self.calls += 1
        return self.real(a, b)


@pytest.fixture
def numpy_calls(monkeypatch):
    spy = _Spy(np.matmul)
    monkeypatch.setattr(np, "matmul", spy)
    return spy


BATCHES = [
    ((), ()),
    ((3,), ()),
    ((), (3,)),
    ((4,), (4,)),
    ((2, 3), (2, 3)),
    ((2, 3), ()),
    ((2, 3), (3,)),  # b repeats along the outer axis: matrices given by address
    ((2, 1), (1, 4)),  # an outer product of batches
]
SIZES = [(5, 7, 3), (1, 4, 6), (6, 4, 1), (1, 1, 1), (8, 1, 5)]


@needs_mkl
@pytest.mark.parametrize("la,lb", list(itertools.product(["c", "t", "pad"], repeat=2)))
@pytest.mark.parametrize("lead", BATCHES)
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_readable_layouts_go_to_mkl_and_match_numpy(la, lb, lead, dtype, numpy_calls):
    for m, k, n in SIZES:
        a = _operand(lead[0] + (m, k), la, dtype)
        b = _operand(lead[1] + (k, n), lb, dtype)
        got = blas.matmul(a, b)
        want = numpy_calls.real(a, b)
        assert got.shape == want.shape and got.dtype == want.dtype
        assert got.flags.c_contiguous
        tol = 1e-12 if dtype == np.float64 else 1e-5
        np.testing.assert_allclose(got, want, rtol=tol, atol=tol)
    assert numpy_calls.calls == 0


@needs_mkl
def test_broadcast_operand_with_zero_stride_goes_to_mkl(numpy_calls):
    a = np.broadcast_to(rng.standard_normal((5, 7)), (4, 5, 7))
    b = rng.standard_normal((4, 7, 3))
    np.testing.assert_allclose(blas.matmul(a, b), numpy_calls.real(a, b), rtol=1e-12)
    assert numpy_calls.calls == 0


@needs_mkl
@pytest.mark.parametrize("layout", ["c", "t", "pad"])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_vector_products_go_to_mkl_and_match_numpy(layout, dtype, numpy_calls):
    tol = 1e-12 if dtype == np.float64 else 1e-5
    for rows, cols in [(5, 7), (1, 4), (6, 1)]:
        mat = _operand((rows, cols), layout, dtype)
        right = rng.standard_normal(2 * cols).astype(dtype)[::2]
        left = rng.standard_normal(rows).astype(dtype)
        for a, b in [(mat, right), (left, mat), (right, right)]:
            got = blas.matmul(a, b)
            want = numpy_calls.real(a, b)
            assert np.shape(got) == np.shape(want) and got.dtype == want.dtype
            np.testing.assert_allclose(got, want, rtol=tol, atol=tol)
    assert numpy_calls.calls == 0


@pytest.fixture
def spread_vector() -> np.ndarray:
    """Two float32 elements 2**31 + 1 elements apart (8 GiB of address space, never touched)."""
    stride = 2**31 + 1
    if sys.maxsize < 2**40 or sys.platform != "linux":
        pytest.skip("needs Linux's anonymous mappings in a 64-bit address space")
    flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | getattr(mmap, "MAP_NORESERVE", 0x4000)
    try:
        region = mmap.mmap(-1, 4 * (stride + 1), flags=flags)
    except (OSError, OverflowError) as error:
        pytest.skip(f"cannot map 8 GiB of address space: {error}")
    vector = np.frombuffer(region, np.float32)[::stride]  # unmapped with its last view
    vector[...] = [2.0, 3.0]
    return vector


def test_vectors_strided_beyond_32_bit_integers_match_numpy(spread_vector):
    other = np.array([10.0, 100.0], np.float32)
    mat = np.array([[1.0, 5.0, 7.0], [2.0, 0.5, -1.0]], np.float32)
    for a, b in [(spread_vector, other), (other, spread_vector), (spread_vector, mat)]:
        assert np.array_equal(blas.matmul(a, b), np.matmul(a, b))
    assert np.array_equal(blas.matmul(mat.T, spread_vector), np.matmul(mat.T, spread_vector))


@needs_mkl
def test_head_views_and_reversed_batches_go_to_mkl(numpy_calls):
    qkv = rng.standard_normal((3, 7, 3 * 4 * 5)).astype(np.float32)  # (B, T, 3 * H * D)
    heads = qkv.reshape(3, 7, 3, 4, 5)
    q = heads[:, :, 0].transpose(0, 2, 1, 3)  # (B, H, T, D): batch strides do not collapse
    kt = heads[:, :, 1].transpose(0, 2, 3, 1)
    stepped = _operand((2, 3, 4, 5), "c", np.float32)[:, ::2]
    for a, b in [(q, kt), (q[::-1], kt), (q, kt[:, ::-1]), (stepped, kt[:2, :2, :5, :2])]:
        np.testing.assert_allclose(blas.matmul(a, b), numpy_calls.real(a, b), rtol=1e-5)
    assert numpy_calls.calls == 0


@pytest.mark.parametrize(
    "a,b",
    [
        (_operand((4, 5), "step", np.float32), _operand((5, 3), "c", np.float32)),
        (_operand((4, 5), "c", np.float64), _operand((5, 3), "neg", np.float64)),
        (np.ones((2, 3), np.float32), np.ones((3, 2), np.float64)),
        (np.ones((2, 3), np.int64), np.ones((3, 2), np.int64)),
        (np.ones((2, 3), np.float16), np.ones((3, 2), np.float16)),
        (np.ones((0, 3), np.float32), np.ones((3, 2), np.float32)),
        (np.ones((2, 0), np.float32), np.ones((0, 2), np.float32)),
        (np.ones(3, np.float32)[::-1], np.ones((3, 2), np.float32)),
        (_operand((2, 4, 3), "c", np.float32), np.ones(3, np.float32)),
    ],
    ids=[
        "strided",
        "negative",
        "mixed-dtype",
        "int",
        "float16",
        "empty",
        "k=0",
        "negative-vector",
        "batch-vector",
    ],
)
def test_other_layouts_go_to_numpy_unchanged(a, b, numpy_calls):
    got = blas.matmul(a, b)
    assert numpy_calls.calls == 1
    want = numpy_calls.real(a, b)
    assert got.dtype == want.dtype and np.array_equal(got, want)


def _np_matrix(rows: int, cols: int) -> np.matrix:
    with pytest.warns(PendingDeprecationWarning):
        return np.matrix(np.ones((rows, cols), np.float32))


@pytest.mark.parametrize(
    "operands",
    [
        lambda: ([[1.0, 2.0]], [[3.0], [4.0]]),
        lambda: ([[1.0, 2.0]], np.ones((2, 1), np.float32)),
        lambda: (_np_matrix(2, 3), _np_matrix(3, 2)),
        lambda: (np.ones((2, 3), np.float32), _np_matrix(3, 2)),
        lambda: (np.ma.array(np.ones((2, 2)), mask=[[0, 1], [0, 0]]), np.ones((2, 2))),
    ],
    ids=["lists", "list-and-array", "matrix", "array-and-matrix", "masked"],
)
def test_non_arrays_and_subclasses_go_to_numpy_unchanged(operands, numpy_calls):
    a, b = operands()
    got = blas.matmul(a, b)
    assert numpy_calls.calls == 1
    want = numpy_calls.real(a, b)
    assert type(got) is type(want) and got.dtype == want.dtype and got.shape == want.shape
    assert np.array_equal(np.ma.getdata(got), np.ma.getdata(want))
    assert np.array_equal(np.ma.getmaskarray(got), np.ma.getmaskarray(want))


@pytest.mark.parametrize("shapes", [((), (3, 2)), ((2, 3), ()), ((), (3,)), ((3,), ()), ((), ())])
@pytest.mark.parametrize("scalar", [np.float32, np.array], ids=["numpy-scalar", "0-d-array"])
def test_zero_dimensional_operands_raise_numpy_errors(shapes, scalar):
    a, b = (np.ones(s, np.float32) if s else scalar(np.float32(2.0)) for s in shapes)
    with pytest.raises(ValueError, match="enough dimensions"):
        blas.matmul(a, b)


def test_mismatched_operands_raise_numpy_errors():
    with pytest.raises(ValueError):
        blas.matmul(np.ones((2, 3), np.float32), np.ones((4, 2), np.float32))
    with pytest.raises(ValueError):
        blas.matmul(np.ones((2, 3, 4), np.float32), np.ones((3, 4, 5), np.float32))


@needs_mkl
def test_products_repeat_bit_for_bit_whatever_the_alignment():
    a = rng.standard_normal((300, 129)).astype(np.float32)
    b = rng.standard_normal((129, 77)).astype(np.float32)
    first = blas.matmul(a, b)
    for offset in range(1, 16):
        aa = np.empty(a.size + offset, np.float32)[offset:].reshape(a.shape)
        bb = np.empty(b.size + offset, np.float32)[offset:].reshape(b.shape)
        aa[...], bb[...] = a, b
        assert np.array_equal(blas.matmul(aa, bb), first)


def test_the_host_backend_multiplies_through_this_module():
    expected = blas.matmul if blas.MAY_LOAD else np.matmul
    assert NUMPY.matmul is expected


def _import_in_child(env_value: str, code: str, **extra: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, TIEGRAD_BLAS=env_value, **extra)
    return subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120
    )


def test_environment_switch_numpy_turns_mkl_off():
    run = _import_in_child("numpy", "from tiegrad.backend import blas; print(blas.LIBRARY)")
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == "None"


def test_environment_switch_rejects_unknown_values():
    run = _import_in_child("openblas", "import tiegrad")
    assert run.returncode != 0
    assert "ConfigError" in run.stderr and "TIEGRAD_BLAS='openblas'" in run.stderr


@pytest.mark.parametrize(
    ("choice", "intel", "tried"),
    [("auto", True, True), ("auto", False, False), ("mkl", False, True), ("numpy", True, False)],
)
def test_auto_tries_mkl_on_intel_cpus_only_and_mkl_insists(monkeypatch, choice, intel, tried):
    monkeypatch.setenv(blas.ENV_SWITCH, choice)
    monkeypatch.setattr(blas, "_intel_cpu", lambda: intel)
    monkeypatch.setattr(blas, "_installed", lambda: [Path("libmkl_rt.so.3")])
    assert blas._candidates() == ([Path("libmkl_rt.so.3")] if tried else [])


@pytest.mark.parametrize(
    ("installed", "may_load", "choice", "says"),
    [
        (False, False, "auto", "oneMKL is not installed"),
        (True, False, "auto", "installed but not chosen on this CPU (not Intel's)"),
        (True, False, "numpy", "installed but not chosen by TIEGRAD_BLAS=numpy"),
        (True, False, "", "installed but not chosen on this CPU"),
    ],
)
def test_the_reason_mkl_is_unused_says_whether_it_is_installed(
    monkeypatch, installed, may_load, choice, says
):
    # A skip reason of the tests of MKL's route: installed but not chosen is not missing.
    monkeypatch.setenv(blas.ENV_SWITCH, choice)
    monkeypatch.setattr(blas, "INSTALLED", installed)
    monkeypatch.setattr(blas, "MAY_LOAD", may_load)
    reason = blas.unused_reason()
    assert says in reason
    assert ("TIEGRAD_BLAS=mkl chooses it" in reason) is installed
    assert ("pip install 'tiegrad[mkl]'" in reason) is not installed


def test_the_reason_mkl_is_unused_is_none_where_it_is_used():
    assert (blas.unused_reason() is None) is (blas.LIBRARY is not None)


def test_a_cpu_of_unknown_vendor_counts_as_intel(monkeypatch, tmp_path):
    real_open = open
    cpuinfo = tmp_path / "cpuinfo"
    monkeypatch.setattr("builtins.open", lambda f, *a: real_open(cpuinfo, *a))
    for text, intel in [
        ("", True),
        ("vendor_id\t: AuthenticAMD\n", False),
        ("vendor_id\t: GenuineIntel\n", True),
    ]:
        cpuinfo.write_text(text)
        assert blas._intel_cpu() is intel


def test_required_mkl_that_is_missing_is_an_error_naming_the_folder():
    code = "import sys; sys.prefix = sys.prefix + '/no-such-env'; import tiegrad"
    run = _import_in_child("mkl", code)
    assert run.returncode != 0
    assert "ConfigError" in run.stderr and "no-such-env" in run.stderr


_PRODUCTS_MATCH = """
import numpy as np
from tiegrad.backend import blas
rng = np.random.default_rng(0)
q = rng.standard_normal((2, 5, 3, 4)).transpose(0, 2, 1, 3)
pairs = [((5, 7), (7, 3)), ((4, 5, 7), (4, 7, 3)), ((7,), (7, 3)), ((5, 7), (7,)), ((7,), (7,))]
pairs = [(rng.standard_normal(x), rng.standard_normal(y)) for x, y in pairs]
pairs.append((q, rng.standard_normal((2, 3, 4, 6))))
assert all(np.allclose(blas.matmul(a, b), np.matmul(a, b)) for a, b in pairs)
print(blas.LIBRARY)
"""


@needs_mkl
@pytest.mark.parametrize("layer", ["ILP64", "ILP64,GNU", "LP64"])
def test_products_use_32_bit_integers_whatever_mkl_interface_layer_says(layer):
    run = _import_in_child("mkl", _PRODUCTS_MATCH, MKL_INTERFACE_LAYER=layer)
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == blas.LIBRARY


_EARLIER_ILP64 = f"""
import ctypes, sys
from pathlib import Path
ctypes.CDLL(str(Path(sys.prefix) / "lib" / {blas.LIBRARY!r})).MKL_Set_Interface_Layer(1)
"""


@needs_mkl
def test_mkl_fixed_to_ilp64_by_an_earlier_caller_is_left_unused():
    run = _import_in_child("auto", _EARLIER_ILP64 + _PRODUCTS_MATCH)
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == "None"
    run = _import_in_child("mkl", _EARLIER_ILP64 + "from tiegrad.backend import blas\nblas.LIBRARY")
    assert run.returncode != 0
    assert "ConfigError" in run.stderr and "ILP64" in run.stderr


_FORK_AFTER_PRODUCT = """
import os, time
import numpy as np
{first}
from tiegrad.backend import blas
a = np.ones((256, 256), np.float32)
blas.matmul(a, a)  # the parent's threads have run a product
pid = os.fork()
if pid == 0:
    os._exit(0 if blas.matmul(a, a)[0, 0] == 256 else 3)
deadline = time.monotonic() + 30
while os.waitpid(pid, os.WNOHANG) == (0, 0):
    if time.monotonic() > deadline:
        os.kill(pid, 9)
        raise SystemExit("the forked child hung in its first product")
    time.sleep(0.01)
print("ok")
"""


@needs_mkl
@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
@pytest.mark.parametrize("first", ["", "import torch  # loads GNU OpenMP before MKL"])
def test_a_forked_child_multiplies_after_its_parent_did(first):
    if first:
        pytest.importorskip("torch")
    run = _import_in_child("mkl", _FORK_AFTER_PRODUCT.format(first=first))
    assert run.returncode == 0 and run.stdout.strip() == "ok", run.stderr


@needs_mkl
def test_products_are_right_where_gnu_openmp_was_loaded_first():
    pytest.importorskip("torch")
    code = "import torch\n" + _PRODUCTS_MATCH
    run = _import_in_child("mkl", code)
    assert run.returncode == 0 and run.stdout.strip() == blas.LIBRARY, run.stderr


def _destination(shape: tuple[int, ...], layout: str, dtype: type) -> np.ndarray:
    """A writable ``out`` of ``shape``: c, pad (longer rows), heads (a packed-qkv view)."""
    *lead, r, c = shape
    if layout == "pad":
        return np.full(tuple(lead) + (r, c + 3), np.nan, dtype)[..., :c]
    if layout == "heads":  # (..., r, c) matrices interleaved with two others along rows
        full = np.full(tuple(lead[:-1]) + (r, 3) + tuple(lead[-1:]) + (c,), np.nan, dtype)
        return np.moveaxis(full[..., 1, :, :], -2, -3) if lead else full[:, 1, :]
    return np.full(shape, np.nan, dtype)


@needs_mkl
@pytest.mark.parametrize("layout", ["c", "pad", "heads"])
@pytest.mark.parametrize("lead", [*BATCHES, ((1,), (1,)), ((1, 1), ())])
@pytest.mark.parametrize("alpha", [1.0, 0.125])
def test_products_written_into_a_destination_go_to_mkl(layout, lead, alpha, numpy_calls):
    for m, k, n in SIZES:
        a = _operand(lead[0] + (m, k), "t", np.float64)
        b = _operand(lead[1] + (k, n), "c", np.float64)
        want = alpha * numpy_calls.real(a, b)
        out = _destination(want.shape, layout, np.float64)
        assert blas.scaled_matmul(a, b, alpha, out) is out
        np.testing.assert_allclose(out, want, rtol=1e-12, atol=1e-12)
        fresh = blas.scaled_matmul(a, b, alpha)
        assert fresh.flags.c_contiguous and fresh.dtype == want.dtype
        np.testing.assert_allclose(fresh, want, rtol=1e-12, atol=1e-12)
    assert numpy_calls.calls == 0


@pytest.mark.parametrize(
    "case", ["strided rows", "other dtype", "overlap", "read-only", "vectors", "list"]
)
def test_destinations_mkl_cannot_write_are_assigned(case):
    a = rng.standard_normal((4, 5)).astype(np.float32)
    b = rng.standard_normal((5, 3)).astype(np.float32)
    want = 0.5 * np.matmul(a, b)
    if case == "strided rows":
        out = np.zeros((4, 6), np.float32)[:, ::2]
    elif case == "other dtype":
        out = np.zeros((4, 3), np.float64)
    elif case == "overlap":
        a = rng.standard_normal((4, 4)).astype(np.float32)
        b = rng.standard_normal((4, 4)).astype(np.float32)
        want, out = 0.5 * np.matmul(a, b), a
    elif case == "read-only":
        out = np.zeros((4, 3), np.float32)
        out.flags.writeable = False
        with pytest.raises(ValueError):
            blas.scaled_matmul(a, b, 0.5, out)
        return
    elif case == "vectors":
        a, b, out = a[0], b[:, 0], np.zeros((), np.float32)
        want = 0.5 * np.matmul(a, b)
    else:
        a, out = a.tolist(), np.zeros((4, 3), np.float32)
    np.testing.assert_allclose(blas.scaled_matmul(a, b, 0.5), want, rtol=1e-6)
    assert blas.scaled_matmul(a, b, 0.5, out) is out
    np.testing.assert_allclose(out, want, rtol=1e-6)


def test_a_destination_of_the_wrong_shape_is_numpys_error():
    a, b = np.ones((4, 5), np.float32), np.ones((5, 3), np.float32)
    with pytest.raises(ValueError):
        blas.scaled_matmul(a, b, 1.0, np.zeros((3, 4), np.float32))


@needs_mkl
@pytest.mark.parametrize("lead", [(), (3,)])
def test_a_call_mkl_refuses_is_computed_by_numpy_with_a_warning(monkeypatch, lead):
    real = blas._matrix
    monkeypatch.setattr(blas, "_matrix", lambda r, c, s0, s1: (real(r, c, s0, s1)[0], 1))
    a = rng.standard_normal(lead + (4, 5)).astype(np.float32)
    b = rng.standard_normal((5, 3)).astype(np.float32)
    with pytest.warns(RuntimeWarning, match="MKL refused argument"):
        got = blas.matmul(a, b)
    np.testing.assert_allclose(got, np.matmul(a, b), rtol=1e-6)
    out = np.full(lead + (4, 3), np.nan, np.float32)
    with pytest.warns(RuntimeWarning, match="MKL refused argument"):
        blas.scaled_matmul(a, b, 2.0, out)
    np.testing.assert_allclose(out, 2 * np.matmul(a, b), rtol=1e-6)
    assert not getattr(blas._refusals, "calls", [])


@needs_mkl
def test_a_refusal_is_reported_on_the_thread_that_made_the_call():
    position = ctypes.c_int(9)
    seen = []

    def other_thread():
        blas._record_refusal(b"cblas_sgemm", ctypes.byref(position), 11)
        with pytest.warns(RuntimeWarning, match="argument 9 of cblas_sgemm"):
            seen.append(blas._refused())

    worker = threading.Thread(target=other_thread)
    worker.start()
    worker.join()
    assert seen == [True] and not blas._refused()  # nothing recorded for this thread


@pytest.mark.parametrize("scale", [0.0, float("inf")])
def test_a_zero_or_infinite_scale_keeps_numpys_nan(scale):
    a = rng.standard_normal((4, 5)).astype(np.float32)
    a[1, 2] = np.nan
    b = rng.standard_normal((5, 3)).astype(np.float32)
    with np.errstate(invalid="ignore"):
        want = np.matmul(a, b) * np.float32(scale)
        np.testing.assert_array_equal(blas.scaled_matmul(a, b, scale), want)


def test_an_out_the_product_would_broadcast_to_is_refused():
    a, b = np.ones((4, 5), np.float32), np.ones((5, 3), np.float32)
    out = np.zeros((2, 4, 3), np.float32)
    with pytest.raises(ShapeError, match="out has shape"):
        blas.scaled_matmul(a, b, 1.0, out)
    with pytest.raises(ShapeError, match="out has shape"):
        Backend.scaled_matmul(NUMPY, a, b, 1.0, out)  # the generic version
    assert not out.any()


def test_an_out_the_product_would_broadcast_to_is_refused_by_numpys_own_version():
    a, b = np.ones((4, 5), np.float32), np.ones((5, 3), np.float32)
    out = np.zeros((2, 4, 3), np.float32)
    with pytest.raises(ShapeError, match="out has shape"):
        nb._scaled_matmul(a, b, 1.0, out)
    assert not out.any()


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("scale", [1.0, 0.1767767, 2.0, 0.0, float("inf"), float("nan")])
def test_numpys_scaled_product_has_the_generic_versions_bits(dtype, scale):
    # NumPy's own version writes into ``out`` (contiguous, or rows with a gap between
    # them) and scales in place; the generic one scales a new product and assigns it:
    # the same bits, NaN included
    cases = [
        (rng.standard_normal((64, 32)), rng.standard_normal((32, 48))),
        (rng.standard_normal((4, 16, 8)), rng.standard_normal((4, 8, 16))),
        (rng.standard_normal((2, 3, 9, 5)), rng.standard_normal((2, 3, 5, 7))),
        (rng.standard_normal((24, 32)).T, rng.standard_normal((24, 8))),  # a transposed view
    ]
    for a, b in cases:
        a, b = a.astype(dtype), b.astype(dtype)
        if scale == 2.0:
            a[(0,) * a.ndim] = np.nan
        p = b.shape[-1]
        with np.errstate(invalid="ignore", over="ignore"):
            want = scale_into(np.matmul(a, b), scale)  # NumPy's product on every route
            rows = np.zeros((3,) + want.shape, dtype)  # out: one block of a larger array
            wide = np.zeros(want.shape[:-1] + (3 * p,), dtype)  # out: rows with a gap
            got_new = nb._scaled_matmul(a, b, scale)
            for big, out in ((rows, rows[1]), (wide, wide[..., p : 2 * p])):
                assert nb._scaled_matmul(a, b, scale, out) is out
                np.testing.assert_array_equal(out, want)
                assert np.count_nonzero(big) == np.count_nonzero(out)  # nothing else written
        np.testing.assert_array_equal(got_new, want)
        assert got_new.dtype == want.dtype


@needs_mkl
def test_products_without_numba_take_addresses_from_numpy():
    run = _import_in_child("mkl", _PRODUCTS_MATCH, TIEGRAD_NO_NUMBA="1")
    assert run.returncode == 0 and run.stdout.strip() == blas.LIBRARY, run.stderr
