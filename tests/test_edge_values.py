"""Edge values users hit (issue 16): empty means, torch tensors that require grad and the
one dtype rule of ``Param`` (byte order: ``test_byte_order``)."""

from __future__ import annotations

import numpy as np
import pytest

from tiegrad import DTypeError, EagerSession, Param

torch = pytest.importorskip("torch")


@pytest.mark.parametrize(("shape", "axis"), [((0,), None), ((3, 0), 1), ((0, 2), 0)])
def test_the_mean_over_no_elements_is_nan_like_pytorch(shape, axis):
    s = EagerSession()
    x = s.leaf(np.ones(shape))
    out = x.mean(axis=axis)
    expected = torch.ones(shape, dtype=torch.float64).mean(*(() if axis is None else (axis,)))
    np.testing.assert_array_equal(out.numpy(), expected.numpy())  # NaN where torch has NaN
    seed = None if out.size == 1 else np.ones(out.shape)
    assert s.backward(out, seed=seed)[x].shape == shape


def test_a_param_from_a_torch_tensor_that_requires_grad_is_a_copy():
    t = torch.arange(3.0, requires_grad=True)
    p = Param(t)
    assert p.dtype == np.float32 and p.value.tolist() == [0.0, 1.0, 2.0]
    assert Param(torch.ones(2, dtype=torch.float64)).dtype == np.float64


def test_one_dtype_rule_a_value_with_a_dtype_keeps_it_python_numbers_are_float32():
    assert Param(np.float64(1.5)).dtype == Param(np.array(1.5)).dtype == np.float64
    assert Param(1.5).dtype == Param([1, 2]).dtype == np.float32
    with pytest.raises(DTypeError, match="needs a floating dtype, got int64"):
        Param(np.int64(3))
