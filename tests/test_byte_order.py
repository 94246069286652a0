"""Arrays in non-native byte order (``'>f4'`` on a little-endian machine), and other
array types that are not plain ndarrays, in and out of tiegrad.

Parameters and every array tiegrad computes are native; a big-endian value is read as
the same numbers: a parameter built from one, a gradient, token ids, a state dict. A
torch dtype NumPy lacks is a ``DTypeError``.
"""

from __future__ import annotations

import numpy as np
import pytest

from tiegrad import DTypeError, EagerSession, Param, ParamList, load, save
from tiegrad.models import TiedLM
from tiegrad.optim import SGD, Adam
from tiegrad.params import ParameterStorage

OTHER = ">" if np.little_endian else "<"  # the byte order this machine does not use


def other_order(a: np.ndarray) -> np.ndarray:
    out = np.asarray(a).astype(np.asarray(a).dtype.newbyteorder(OTHER))
    assert not out.dtype.isnative
    return out


def test_a_param_from_another_byte_order_is_native_with_the_same_values():
    values = np.linspace(-2.0, 2.0, 6, dtype=np.float32).reshape(2, 3)
    for p in (Param(other_order(values)), Param.of_storage(ParameterStorage(other_order(values)))):
        assert p.dtype == np.float32 and p.dtype.isnative and p.value.dtype.isnative
        np.testing.assert_array_equal(p.value, values)
        p.set_value(p.value * 2)  # its own arrays fit it


def test_a_big_endian_param_trains_checkpoints_and_resumes(tmp_path):
    def run(make):
        p = Param(make(np.linspace(-1.0, 1.0, 5, dtype=np.float32)), name="w")
        opt = Adam([p], lr=0.1)
        s = EagerSession()
        opt.step(s.backward((s.use(p) * s.use(p)).sum()))
        return p, opt

    p, opt = run(other_order)
    want, want_opt = run(np.asarray)
    np.testing.assert_array_equal(p.value, want.value)
    save(tmp_path / "ck.safetensors", ParamList([p]), optimizer=opt)
    q = Param(other_order(np.zeros(5, np.float32)), name="w")
    q_opt = Adam([q], lr=0.1)
    load(tmp_path / "ck.safetensors", ParamList([q]), optimizer=q_opt)
    np.testing.assert_array_equal(q.value, want.value)
    np.testing.assert_array_equal(q_opt.state[0]["exp_avg"], want_opt.state[0]["exp_avg"])


def test_a_gradient_in_the_other_byte_order_is_read_as_its_values():
    grads = np.array([0.5, -1.25, 3.0], np.float32)
    p, q = Param(np.zeros(3, np.float32)), Param(np.zeros(3, np.float32))
    SGD([p], lr=0.1).step([other_order(grads)])
    SGD([q], lr=0.1).step([grads])
    np.testing.assert_array_equal(p.value, q.value)
    with pytest.raises(DTypeError, match="expected dtype float32, got float64"):
        SGD([p], lr=0.1).step([other_order(grads.astype(np.float64))])


def test_a_state_dict_in_the_other_byte_order_loads_as_its_values():
    p = Param(np.ones(4, np.float32))
    opt = Adam([p], lr=0.1)
    opt.step([np.full(4, 0.5, np.float32)])
    sd = opt.state_dict()
    swapped = {
        **sd,
        "state": {
            k: {n: other_order(v) if isinstance(v, np.ndarray) else v for n, v in e.items()}
            for k, e in sd["state"].items()
        },
    }
    other = Adam([Param(np.ones(4, np.float32))], lr=0.1)
    other.load_state_dict(swapped)
    for name in ("exp_avg", "exp_avg_sq"):
        got = other.state[0][name]
        assert got.dtype.isnative
        np.testing.assert_array_equal(got, opt.state[0][name])


@pytest.mark.parametrize("numba_on", [True, False], ids=["numba", "numpy"])
def test_big_endian_token_ids_give_the_loss_and_gradients_of_native_ones(monkeypatch, numba_on):
    from tiegrad import _numba

    monkeypatch.setattr(_numba, "ENABLED", numba_on and _numba.ENABLED)
    model = TiedLM(20, d_model=16, n_layers=1, n_heads=2, max_seq_len=8)
    ids = (np.arange(18).reshape(2, 9) * 7) % 20
    results = []
    for x in (ids, other_order(ids)):
        s = EagerSession()
        loss = model.loss(s, x[:, :-1], x[:, 1:])
        grads = s.backward(loss)
        results.append((float(loss.value), [grads[k].copy() for k in sorted(grads)]))
    assert results[0][0] == results[1][0]
    for a, b in zip(results[0][1], results[1][1]):
        np.testing.assert_array_equal(a, b)


def test_a_matrix_gradient_is_read_as_a_plain_array():
    p, q = Param(np.zeros((2, 3), np.float32)), Param(np.zeros((2, 3), np.float32))
    g = np.arange(6, dtype=np.float32).reshape(2, 3)
    with pytest.warns(PendingDeprecationWarning):
        matrix = np.matrix(g)
    SGD([p], lr=0.5).step([matrix])
    SGD([q], lr=0.5).step([g])
    np.testing.assert_array_equal(p.value, q.value)
    assert type(p.value) is np.ndarray


def test_torch_tensors_of_a_dtype_numpy_lacks_are_named():
    torch = pytest.importorskip("torch")
    with pytest.raises(DTypeError, match="torch dtype torch.bfloat16 has no NumPy type"):
        Param(torch.ones(3, dtype=torch.bfloat16), name="w")


def test_a_big_endian_param_goes_to_torch_and_to_a_device():
    torch = pytest.importorskip("torch")
    from tiegrad.interop import from_torch, to_torch

    module = torch.nn.Linear(3, 1, bias=False)
    params = from_torch(module)
    params["weight"] = Param(other_order(np.full((1, 3), 2.5, np.float32)), name="weight")
    to_torch(params, module)
    assert torch.equal(module.weight, torch.full((1, 3), 2.5))
    p = Param(other_order(np.arange(3.0, dtype=np.float32)))
    s = EagerSession(device="torch:cpu")
    assert s.use(p).sum().item() == 3.0
