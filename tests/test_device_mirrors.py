"""The host/device mirror protocol (C7), one rule per test, with transfer counters.

Reference cases 16-18 are named as such. Runs on ``TIEGRAD_TEST_DEVICE`` (default
``torch:cpu``, so CI needs no GPU).
"""

from __future__ import annotations

import os

import numpy as np
import pytest

import tiegrad
from tiegrad import EagerSession, Param, ParamList
from tiegrad.backend import device_backend

torch = pytest.importorskip("torch")

DEVICE = os.environ.get("TIEGRAD_TEST_DEVICE", "torch:cpu")


def _t(values) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32, device=device_backend(DEVICE).torch_device)


def _np(t) -> np.ndarray:
    return t.detach().cpu().numpy()


def test_device_write_marks_the_host_stale():  # C7
    p = Param([1.0, 2.0])
    p.set_device_value(_t([5.0, 6.0]))
    st = p.storage
    assert not st.host_current
    assert p.value.tolist() == [1.0, 2.0]
    assert _np(st.mirror).tolist() == [5.0, 6.0]
    assert (st.uploads, st.downloads) == (0, 0)
    assert st.device == device_backend(DEVICE).device


def test_set_device_value_copies_its_argument():  # C1, C7
    p = Param([1.0, 2.0])
    src = _t([5.0, 6.0])
    p.set_device_value(src)
    src += 100.0
    assert _np(p.storage.mirror).tolist() == [5.0, 6.0]


def test_case_16_values_do_not_sync_values_synced_does_and_keeps_the_mirror():  # C7
    p = Param([1.0, 2.0])
    pl = ParamList([p, p.alias()])
    p.set_device_value(_t([5.0, 6.0]))
    mirror = p.storage.mirror
    assert [v.tolist() for v in pl.values()] == [[1.0, 2.0], [1.0, 2.0]]
    assert p.storage.downloads == 0 and not p.storage.host_current
    assert [v.tolist() for v in pl.values_synced()] == [[5.0, 6.0], [5.0, 6.0]]
    assert p.storage.downloads == 1  # one storage at two slots: one download
    assert p.storage.host_current
    assert p.storage.mirror is mirror
    pl.values_synced()
    assert p.storage.downloads == 1


def test_case_17_use_reuses_the_mirror_and_uploads_only_when_there_is_none():  # C7
    p = Param([1.0, 2.0])
    s = EagerSession(device=DEVICE)
    a, b = s.use(p), s.use(p)
    assert a.value is b.value is p.storage.mirror
    assert p.storage.uploads == 1
    s.reset()
    assert s.use(p).value is p.storage.mirror
    assert p.storage.uploads == 1


def test_case_17_stale_host_without_a_mirror_raises():  # C7
    p = Param([1.0, 2.0])
    p.set_device_value(_t([5.0, 6.0]))
    p.storage._release_mirror()  # only a bug could get here: stale host, no mirror
    s = EagerSession(device=DEVICE)
    with pytest.raises(tiegrad.DeviceError, match="stale and there is no mirror"):
        s.use(p)
    assert len(s) == 0 and p.storage.uploads == 0


def test_case_18_host_write_releases_the_mirror_and_old_leaves_stay_readable():  # C2, C7
    p = Param([1.0, 2.0])
    s = EagerSession(device=DEVICE)
    leaf = s.use(p)
    mirror = p.storage.mirror
    p.set_value(np.array([7.0, 8.0], dtype=np.float32))
    assert p.storage.mirror is None and p.storage.host_current
    assert _np(leaf.value).tolist() == [1.0, 2.0]
    assert leaf.value is mirror  # dereferenced, never freed or overwritten
    assert _np(s.use(p).value).tolist() == [7.0, 8.0]
    assert p.storage.uploads == 2


def test_host_use_of_a_stale_storage_syncs_first():  # C7
    p = Param([1.0, 2.0])
    p.set_device_value(_t([5.0, 6.0]))
    s = EagerSession()
    assert s.use(p).value.tolist() == [5.0, 6.0]
    assert p.storage.downloads == 1 and p.storage.host_current
    assert p.storage.mirror is not None


def test_host_update_syncs_a_newer_mirror_first():  # C3, C7
    p, q = Param([1.0, 2.0]), Param([3.0])
    pl = ParamList([p, q, p])
    p.set_device_value(_t([5.0, 6.0]))
    grads = [np.array([1.0, 1.0], np.float32), np.array([1.0], np.float32)] * 2
    pl.sgd_step(0.5, grads[:3])
    assert p.storage.downloads == 1
    assert p.value.tolist() == [4.0, 5.0]  # (5, 6) - 0.5 * (1 + 1)
    assert p.storage.mirror is None and p.storage.host_current  # a host write


def test_device_update_starts_from_the_current_mirror():  # C3, C7
    p = Param([1.0, 2.0])
    s = EagerSession(device=DEVICE)
    loss = (s.use(p) * 3.0).sum()
    s.backward(loss)
    p.set_device_value(_t([10.0, 20.0]))  # newer than the leaf snapshot
    s.sgd_step(0.5)
    assert _np(p.storage.mirror).tolist() == [8.5, 18.5]
    assert p.value.tolist() == [1.0, 2.0] and not p.storage.host_current
    assert (p.storage.uploads, p.storage.downloads) == (1, 0)


def test_device_update_uploads_only_when_there_is_no_mirror():  # C3, C7
    p = Param([1.0, 2.0])
    s = EagerSession(device=DEVICE)
    s.backward((s.use(p) * 3.0).sum())
    assert p.storage.uploads == 1
    p.set_value(np.array([4.0, 4.0], np.float32))  # releases the mirror
    s.sgd_step(1.0)
    assert p.storage.uploads == 2  # the update uploaded the fresh host value
    assert _np(p.storage.mirror).tolist() == [1.0, 1.0]
    s.reset()
    s.backward((s.use(p) * 1.0).sum())
    s.sgd_step(1.0)
    assert p.storage.uploads == 2
    assert _np(p.storage.mirror).tolist() == [0.0, 0.0]


def test_device_update_never_writes_into_a_leaf_snapshot():  # C2, C7
    p = Param([1.0, 2.0])
    s = EagerSession(device=DEVICE)
    leaf = s.use(p)
    s.backward((leaf * 1.0).sum(), retain_graph=True)
    s.sgd_step(1.0)
    assert _np(leaf.value).tolist() == [1.0, 2.0]
    assert p.storage.mirror is not leaf.value


def test_device_update_is_in_place_only_when_no_tape_holds_the_mirror():  # C2, C7
    p = Param([1.0, 2.0])
    bk = device_backend(DEVICE)
    s = EagerSession(device=DEVICE)
    mirror = s.use(p).value
    assert p.storage.device_for_update(bk) is not mirror  # pinned: copy-on-write
    s.reset()
    assert p.storage.device_for_update(bk) is mirror


def test_device_update_of_a_tied_storage_happens_once_with_the_sum():  # C4, C7
    p, q = Param([1.0, 1.0]), Param([2.0])
    s = EagerSession(device=DEVICE)
    a, b, c = s.use(p), s.use(q), s.use(p)
    s.backward((a * 1.0).sum() + (b * 2.0).sum() + (c * 3.0).sum())
    s.sgd_step(0.25)
    assert _np(p.storage.mirror).tolist() == [0.0, 0.0]  # 1 - 0.25 * (1 + 3)
    assert _np(q.storage.mirror).tolist() == [1.5]
    assert p.storage.uploads == 1


def test_param_to_device_and_back():  # C7
    p = Param([1.0, 2.0])
    assert p.to(DEVICE) is p
    assert p.storage.uploads == 1 and p.storage.device == device_backend(DEVICE).device
    p.to(DEVICE)
    assert p.storage.uploads == 1
    p.set_device_value(_t([3.0, 4.0]))
    p.to("cpu")
    assert p.storage.mirror is None and p.storage.host_current
    assert p.value.tolist() == [3.0, 4.0] and p.storage.downloads == 1


def test_paramlist_to_uploads_each_storage_once_and_sync_downloads_once():  # C5, C7
    p, q = Param([1.0]), Param([2.0])
    pl = ParamList([p, q.alias(requires_grad=False), p])
    assert pl.to(DEVICE) is pl
    assert (p.storage.uploads, q.storage.uploads) == (1, 1)
    p.set_device_value(_t([9.0]))
    pl.sync()
    pl.sync()
    assert (p.storage.downloads, q.storage.downloads) == (1, 0)
    assert p.value.tolist() == [9.0] and p.storage.mirror is not None


def test_sync_without_a_newer_mirror_transfers_nothing():  # C7
    p = Param([1.0])
    p.to(DEVICE)
    p.storage.sync()
    assert p.storage.downloads == 0 and p.storage.host_current


def test_group_current_device_value_reuses_the_mirror():  # C3, C7
    p = Param([1.0, 2.0])
    s = EagerSession(device=DEVICE)
    s.use(p)
    (group,) = s.parameter_groups()
    assert group.current_device_value() is p.storage.mirror
    assert group.current_device_value(DEVICE) is p.storage.mirror
    assert p.storage.uploads == 1
    fresh = Param([0.5])
    h = EagerSession()
    h.use(fresh)
    (host_group,) = h.parameter_groups()
    with pytest.raises(tiegrad.DeviceError, match="no device mirror"):
        host_group.current_device_value()
    assert fresh.storage.uploads == 0
    assert _np(host_group.current_device_value(DEVICE)).tolist() == [0.5]
    assert fresh.storage.uploads == 1


class _Handle:
    """A parameter without a storage descriptor: only get/set (never grouped, C1)."""

    def __init__(self, value):
        self.value = np.array(value, np.float32)
        self.shape, self.dtype, self.requires_grad = self.value.shape, self.value.dtype, True

    def get(self):
        return self.value

    def set(self, value):
        self.value = np.array(value, np.float32)


def test_device_sgd_updates_a_storage_less_handle_through_set():  # C1, C3
    h = _Handle([1.0, 2.0])
    s = EagerSession(device=DEVICE)
    a, b = s.use(h), s.use(h)
    s.backward((a * 1.0 + b * 2.0).sum())
    groups = s.parameter_groups()
    assert [g.leaves for g in groups] == [(a.id,), (b.id,)]  # never merged
    assert _np(groups[0].current_device_value(DEVICE)).tolist() == [1.0, 2.0]
    s.sgd_step(0.5)
    assert isinstance(h.value, np.ndarray)
    assert h.value.tolist() == [-0.5, 0.5]  # both groups wrote through set, in order


def test_numpy_of_a_device_use_is_a_copy_whose_writes_change_nothing():  # C7, issue 16 item 6
    p = Param([1.0, 2.0])
    host = EagerSession()
    with pytest.raises(ValueError, match="read-only"):
        host.use(p).numpy()[0] = 5.0  # the host refuses: its array is the read-only value
    s = EagerSession(device=DEVICE)
    ref = s.use(p)
    out = ref * 2.0
    for r in (ref, out):
        view = r.numpy()
        view[...] = 99.0
        assert r.numpy().tolist() != [99.0, 99.0]
    assert _np(p.storage.mirror).tolist() == [1.0, 2.0] and p.storage.host_current
    assert out.numpy().tolist() == [2.0, 4.0]
    s.backward(out.sum())
    s.sgd_step(0.5)
    assert _np(p.storage.mirror).tolist() == [0.0, 1.0]
    assert p.value_synced().tolist() == [0.0, 1.0]
