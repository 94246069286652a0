"""Bad device input: clear DeviceError/ShapeError/DTypeError, and nothing changes (C6, C7)."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

import tiegrad
from tiegrad import EagerSession, Param, ParamList, ops
from tiegrad.backend import device_backend

torch = pytest.importorskip("torch")

DEVICE = os.environ.get("TIEGRAD_TEST_DEVICE", "torch:cpu")


def _state(p: Param):
    st = p.storage
    mirror = None if st.mirror is None else st.mirror.detach().clone()
    return (p.value.copy(), st.mirror, mirror, st.host_current, st.uploads, st.downloads)


def _same(p: Param, before) -> bool:
    host, mirror_obj, mirror_copy, current, ups, downs = before
    st = p.storage
    return (
        np.array_equal(p.value, host)
        and st.mirror is mirror_obj
        and (mirror_obj is None or torch.equal(st.mirror, mirror_copy))
        and (st.host_current, st.uploads, st.downloads) == (current, ups, downs)
    )


@pytest.mark.parametrize("device", ["tpu", "cuda:x", "torch:gpu", "", "CPU"])
def test_unknown_device_is_a_device_error(device):
    with pytest.raises(tiegrad.DeviceError, match="unknown device|expected 'cuda'"):
        EagerSession(device=device)


def test_unknown_device_moves_nothing():  # C6
    p, q = Param([1.0]), Param([2.0])
    q.to(DEVICE)
    pl = ParamList([p, q])
    before = [_state(p), _state(q)]
    with pytest.raises(tiegrad.DeviceError, match="unknown device 'tpu'"):
        pl.to("tpu")
    with pytest.raises(tiegrad.DeviceError, match="unknown device 'tpu'"):
        p.to("tpu")
    assert _same(p, before[0]) and _same(q, before[1])


@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is available here")
def test_unavailable_cuda_is_a_device_error():
    with pytest.raises(tiegrad.DeviceError, match="CUDA is not available"):
        EagerSession(device="cuda")
    p = Param([1.0])
    with pytest.raises(tiegrad.DeviceError, match="CUDA is not available"):
        p.to("cuda")
    assert p.storage.mirror is None and p.storage.uploads == 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_index_out_of_range_is_a_device_error():
    with pytest.raises(tiegrad.DeviceError, match="cuda:N"):
        EagerSession(device=f"cuda:{torch.cuda.device_count()}")


def test_mixing_refs_of_host_and_device_sessions_is_a_device_error():  # C7
    host, dev = EagerSession(), EagerSession(device=DEVICE)
    a = host.leaf(np.ones(2, np.float32))
    b = dev.leaf(np.ones(2, np.float32))
    for fn in (lambda: a + b, lambda: b * a, lambda: ops.concat([b, a])):
        with pytest.raises(tiegrad.DeviceError, match="host and device values do not mix"):
            fn()
    assert (len(host), len(dev)) == (1, 1)


def test_two_device_sessions_still_report_a_foreign_ref_as_a_tape_error():
    s, t = EagerSession(device=DEVICE), EagerSession(device=DEVICE)
    with pytest.raises(tiegrad.TapeError, match="belongs to another session"):
        s.leaf([1.0]) + t.leaf([1.0])


def test_mirror_of_the_wrong_shape_or_dtype_changes_nothing():  # C6, C7
    p = Param([1.0, 2.0])
    p.to(DEVICE)
    before = _state(p)
    bk = device_backend(DEVICE)
    with pytest.raises(tiegrad.ShapeError, match=r"shape \(3,\), expected \(2,\)"):
        p.set_device_value(bk.asarray(np.zeros(3, np.float32)))
    with pytest.raises(tiegrad.DTypeError, match="dtype float64, expected float32"):
        p.set_device_value(bk.asarray(np.zeros(2, np.float64)))
    with pytest.raises(tiegrad.DeviceError, match="got a host array"):
        p.set_device_value(np.zeros(2, np.float32))
    assert _same(p, before)


def test_a_corrupt_mirror_is_reported_on_use_and_on_sync():  # C7 (reference error 8, 9)
    p = Param([1.0, 2.0])
    p.to(DEVICE)
    p.storage._mirror = device_backend(DEVICE).asarray(np.zeros(3, np.float32))
    s = EagerSession(device=DEVICE)
    with pytest.raises(tiegrad.ShapeError, match=r"shape \(3,\), expected \(2,\)"):
        s.use(p)
    p.storage._host_current = False
    with pytest.raises(tiegrad.ShapeError, match="sync: the device mirror has shape"):
        p.storage.sync()
    assert len(s) == 0 and p.value.tolist() == [1.0, 2.0]


def test_device_sgd_step_validates_everything_before_writing():  # C6
    p, q = Param([1.0, 2.0]), Param([3.0])
    s = EagerSession(device=DEVICE)
    grads = s.backward((s.use(p) * s.use(q)).sum())
    before = [_state(p), _state(q)]
    for lr in (-0.1, float("nan"), float("inf")):
        with pytest.raises(tiegrad.HyperparameterError, match="lr"):
            s.sgd_step(lr)
    host_grads = {i: g.cpu().numpy() for i, g in grads.items()}
    with pytest.raises(tiegrad.DeviceError, match="host array"):
        s.sgd_step(0.1, host_grads)
    partial = {i: g for i, g in grads.items() if i != max(grads)}
    with pytest.raises(tiegrad.MissingGradientError):
        s.sgd_step(0.1, partial)
    assert _same(p, before[0]) and _same(q, before[1])


def test_import_tiegrad_does_not_import_torch():
    code = "import sys, tiegrad, tiegrad.optim, tiegrad.models; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
