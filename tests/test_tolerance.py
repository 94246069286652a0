"""The tolerance helper that compares different implementations can fail."""

from __future__ import annotations

import numpy as np
import pytest
from tolerance import assert_close_ulps, ulp_distance


def test_ulp_distance_counts_representable_floats_across_zero():
    x = np.array([1.0, -1.0, 0.0, -0.0], np.float32)
    up = np.nextafter(x, np.float32(np.inf))
    assert ulp_distance(up, x).tolist() == [1, 1, 1, 1]
    assert ulp_distance(np.array([-0.0], np.float32), np.array([0.0], np.float32)) == 0
    tiny = np.array([np.float32(1e-45)], np.float32)  # the smallest subnormal
    assert ulp_distance(tiny, -tiny) == 2


@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
def test_within_the_bound_passes_and_beyond_it_fails(dtype):
    desired = np.linspace(-3, 5, 7).astype(dtype)
    step = desired.copy()
    for _ in range(3):
        step = np.nextafter(step, dtype(np.inf))
    assert_close_ulps(step, desired, 3)
    with pytest.raises(AssertionError, match="differ by more than 2 ulps"):
        assert_close_ulps(step, desired, 2)


def test_near_zero_elements_are_judged_against_the_arrays_scale():
    desired = np.array([100.0, 1e-30], np.float32)
    actual = np.array([100.0, 2e-30], np.float32)  # far apart in ulps, tiny in scale
    assert_close_ulps(actual, desired, 1)
    with pytest.raises(AssertionError):
        assert_close_ulps(np.array([100.0, 1e-3], np.float32), desired, 16)


def test_nans_must_match_and_infinities_must_be_equal():
    nan = np.array([np.nan, 1.0], np.float32)
    assert_close_ulps(nan, nan.copy(), 0)
    with pytest.raises(AssertionError, match="NaNs"):
        assert_close_ulps(np.array([1.0, 1.0], np.float32), nan, 16)
    with pytest.raises(AssertionError, match="infinities"):
        assert_close_ulps(np.array([np.inf], np.float32), np.array([-np.inf], np.float32), 16)
    with pytest.raises(AssertionError, match="float64"):
        assert_close_ulps(np.ones(2), np.ones(2, np.float32), 16)
