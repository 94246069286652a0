"""How close two implementations of the same arithmetic must agree.

Bit identity is promised only where the same code path runs in the same installed
environment (the same process, or a new process on the same machine). Different
implementations of one rule (PyTorch's CPU kernels against tiegrad's host rules, MKL
against OpenBLAS, a compiled kernel against NumPy) may order or fuse their operations
differently, and PyTorch's CPU kernels pick their vector code by the CPU's vector
width, so their last bits differ between machines of one kind. Tests that compare
such implementations use :func:`assert_close_ulps` with the bound stated here, once.
"""

from __future__ import annotations

import numpy as np

#: Units in the last place allowed between two implementations of an optimizer's rule
#: after a few steps. Each step is a handful of correctly rounded operations; another
#: order or grouping (``a * b / c`` against ``a * (b / c)``, a fused multiply-add)
#: costs at most an ulp or two per operation, and the errors of several steps add up.
#: Measured: 6 steps of Adagrad differ by up to 5 ulps and RMSprop by 4 between
#: PyTorch's CPU kernels (AVX-512) and the host rules; the other rules agree exactly.
#: 16 ulps is a relative error of about 1e-6 in float32: far below any real defect
#: (a wrong sign, a missed bias correction or a step applied twice is off by percent).
OPTIMIZER_ULPS = 16


def ulp_distance(actual: np.ndarray, desired: np.ndarray) -> np.ndarray:
    """Elementwise count of representable floats between ``actual`` and ``desired``."""
    actual, desired = np.asarray(actual), np.asarray(desired)
    assert actual.dtype == desired.dtype, f"dtype {actual.dtype} against {desired.dtype}"
    assert actual.shape == desired.shape, f"shape {actual.shape} against {desired.shape}"
    uints = {2: np.uint16, 4: np.uint32, 8: np.uint64}[actual.dtype.itemsize]
    sign = uints(1) << uints(8 * actual.dtype.itemsize - 1)

    def ordered(x: np.ndarray) -> np.ndarray:
        # Floats are sign and magnitude: place a value of magnitude m at sign - m when
        # negative and sign + m otherwise, unsigned integers in the order of the values
        # (-0.0 and 0.0 coincide).
        bits = x.view(uints)
        return np.where(bits & sign, sign - (bits & ~sign), bits | sign).astype(np.uint64)

    a, d = ordered(actual), ordered(desired)
    return np.maximum(a, d) - np.minimum(a, d)


def assert_close_ulps(actual, desired, ulps: int, *, what: str = "values") -> None:
    """Fail unless every element is within ``ulps`` units in the last place.

    NaNs must sit at the same positions; infinities must be equal. Elements near zero
    are compared against the array's scale: a difference of ``ulps`` ulps of the
    largest magnitude in ``desired`` passes, since a rule's rounding error scales with
    its operands, not with a result that happens to cancel to almost nothing.
    """
    actual, desired = np.asarray(actual), np.asarray(desired)
    assert actual.dtype == desired.dtype and actual.shape == desired.shape, (
        f"{what}: {actual.dtype}{actual.shape} against {desired.dtype}{desired.shape}"
    )
    nan = np.isnan(desired)
    assert np.array_equal(np.isnan(actual), nan), f"{what}: NaNs at other positions"
    finite = np.isfinite(desired)
    assert np.array_equal(actual[~finite & ~nan], desired[~finite & ~nan]), (
        f"{what}: infinities differ"
    )
    a, d = actual[finite], desired[finite]
    if a.size == 0:
        return
    distance = ulp_distance(a, d)
    scale = np.spacing(np.max(np.abs(d)).astype(d.dtype)) * ulps
    ok = (distance <= ulps) | (np.abs(a.astype(np.float64) - d) <= scale)
    worst = int(np.argmax(np.where(ok, 0, distance)))
    assert ok.all(), (
        f"{what}: {int((~ok).sum())} of {a.size} elements differ by more than {ulps} ulps "
        f"(worst {int(distance[worst])} ulps: {a[worst]!r} against {d[worst]!r})"
    )
