"""``tiegrad._threads``: the pool behind the host kernels and the fused optimizer, and the
thread count, read at every call (``TIEGRAD_NUM_THREADS``, ``threadpoolctl`` limits).
"""

from __future__ import annotations

import os
import threading
import time
from types import SimpleNamespace

import numpy as np
import pytest

from tiegrad import _numba, _threads
from tiegrad.backend import NUMPY, blas, host_dispatch


@pytest.mark.parametrize("threads", [1, 2, 4])
@pytest.mark.parametrize("n", [0, 1, 2, 7, 64])
def test_every_item_runs_exactly_once(threads, n):
    seen = []
    lock = threading.Lock()

    def run(i):
        time.sleep(0.0005)  # lets pool threads claim items too
        with lock:
            seen.append(i)

    _threads.share(run, n, threads)
    assert sorted(seen) == list(range(n))


def test_one_thread_runs_in_order_on_the_caller():
    order, callers = [], set()
    _threads.share(lambda i: (order.append(i), callers.add(threading.get_ident())), 5, 1)
    assert order == [0, 1, 2, 3, 4] and callers == {threading.get_ident()}


def test_pool_threads_share_the_work():
    callers = set()
    barrier = threading.Barrier(2, timeout=10)

    def run(i):
        callers.add(threading.get_ident())
        if i < 2:
            barrier.wait()  # only returns once two threads run items at the same time

    _threads.share(run, 8, 2)
    assert len(callers) == 2


def test_an_error_stops_the_handing_out_and_is_raised_in_the_caller():
    ran = []

    def run(i):
        ran.append(i)
        if i == 0:
            raise ValueError("item 0")

    with pytest.raises(ValueError, match="item 0"):
        _threads.share(run, 1000, 2)
    assert len(ran) < 1000


def test_an_item_may_share_again():
    seen = []
    lock = threading.Lock()

    def inner(i):
        with lock:
            seen.append(i)

    _threads.share(lambda i: _threads.share(lambda j: inner(10 * i + j), 3, 2), 4, 2)
    assert sorted(seen) == sorted(10 * i + j for i in range(4) for j in range(3))


def test_callers_on_several_threads_at_once():
    results, errors = {}, []

    def caller(k):
        try:
            out = [0] * 50
            for _ in range(20):
                _threads.share(lambda i: out.__setitem__(i, out[i] + k), 50, 2)
            results[k] = out
        except BaseException as e:  # reported below
            errors.append(e)

    workers = [threading.Thread(target=caller, args=(k,)) for k in (1, 2, 3)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    assert not errors and results == {k: [20 * k] * 50 for k in (1, 2, 3)}


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_a_forked_child_gets_threads_of_its_own():
    _threads.share(lambda i: time.sleep(0.001), 4, 2)  # the parent's pool exists
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            seen = []
            _threads.share(lambda i: seen.append(i), 6, 2)
            os.write(write, b"ok" if sorted(seen) == list(range(6)) else b"bad")
        finally:
            os._exit(0)
    os.close(write)
    _, status = os.waitpid(pid, 0)
    assert status == 0 and os.read(read, 8) == b"ok"
    os.close(read)


def test_the_environment_sets_the_count_and_a_bad_value_is_ignored(monkeypatch):
    monkeypatch.setattr(_threads, "_blas_libraries", lambda: ())
    monkeypatch.setenv("TIEGRAD_NUM_THREADS", "3")
    assert _threads.count() == 3 and _threads.count(8) == 3
    monkeypatch.setenv("OMP_NUM_THREADS", "5")  # not tiegrad's variable
    for unset in ("", "0", "many", "-2"):
        monkeypatch.setenv("TIEGRAD_NUM_THREADS", unset)
        assert _threads.count() == 1 and _threads.count(6) == 6  # the caller's default


def test_the_blas_libraries_cap_the_default(monkeypatch):
    monkeypatch.delenv("TIEGRAD_NUM_THREADS", raising=False)
    libraries = [SimpleNamespace(get_num_threads=lambda: 4)]
    monkeypatch.setattr(_threads, "_blas_libraries", lambda: tuple(libraries))
    assert _threads.count(8) == 4 and _threads.count(2) == 2
    libraries.append(SimpleNamespace(get_num_threads=lambda: 3))
    assert _threads.count(8) == 3  # the smallest count, read at this call
    libraries.append(SimpleNamespace(get_num_threads=lambda: None))  # a count it cannot read
    assert _threads.count(8) == 3
    monkeypatch.setenv("TIEGRAD_NUM_THREADS", "6")
    assert _threads.count(8) == 6  # the environment decides over the libraries


def test_threadpoolctl_limits_apply_at_once(monkeypatch):
    threadpoolctl = pytest.importorskip("threadpoolctl")
    monkeypatch.delenv("TIEGRAD_NUM_THREADS", raising=False)
    with threadpoolctl.threadpool_limits(1):
        assert _threads.count(8) == 1
        monkeypatch.setenv("TIEGRAD_NUM_THREADS", "2")
        assert _threads.count(8) == 2
    monkeypatch.delenv("TIEGRAD_NUM_THREADS")
    with threadpoolctl.threadpool_limits(1, user_api="blas"):
        assert _threads.count(8) == 1
    if blas.LIBRARY:  # loads MKL: the products' library, looked up as it loads
        with threadpoolctl.threadpool_limits({"libmkl_rt": 1}):
            assert _threads.count(8) == 1


@pytest.mark.skipif(_numba.kernels("tiegrad.backend.host_kernels") is None, reason="no kernels")
def test_the_host_kernels_share_their_blocks_where_asked_or_on_mkls_team(monkeypatch):
    # Shared on the pool where the environment asks for threads; on numba's threads
    # instead where they are oneMKL's OpenMP team, by default too; never past a limit.
    threadpoolctl = pytest.importorskip("threadpoolctl")
    asked = []
    share = _threads.share
    monkeypatch.setattr(_threads, "share", lambda run, n, t: (asked.append(t), share(run, n, t)))
    x = np.random.default_rng(0).standard_normal((512, 1024)).astype(np.float32)
    NUMPY.gelu(x)  # the team is known after a first large call
    team = host_dispatch.team()
    if team is not None:
        run = team.run
        monkeypatch.setattr(team, "run", lambda t, k, *a: (asked.append(t), run(t, k, *a))[1])
    monkeypatch.setenv("TIEGRAD_NUM_THREADS", "2")
    del asked[:]
    want = NUMPY.gelu(x)
    assert asked == [2]  # shared between two threads
    monkeypatch.delenv("TIEGRAD_NUM_THREADS")
    default = [] if team is None else [_threads.count(team.TEAM)]
    for limit, expected in ((None, default), (1, [])):
        del asked[:]
        with threadpoolctl.threadpool_limits(limit):
            got = NUMPY.gelu(x)
        assert asked == [t for t in expected if t > 1]  # else the caller runs every block
        for a, b in zip(want, got):
            np.testing.assert_array_equal(a, b)
