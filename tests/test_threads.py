"""``tiegrad._threads.share``: the threads behind the host kernels and the fused optimizer.

Every test runs on both routes: MKL's OpenMP team (where MKL is loaded) and the pool.
"""

from __future__ import annotations

import os
import threading
import time

import pytest

from tiegrad import _threads
from tiegrad.backend import blas

_LENT = _threads.TEAM if blas.LIBRARY else None  # the team MKL lent as it loaded, or None


@pytest.fixture(autouse=True, params=["team", "pool"])
def route(request, monkeypatch):
    if request.param == "team" and _LENT is None:
        pytest.skip("no OpenMP team: oneMKL is not loaded")
    monkeypatch.setattr(_threads, "TEAM", _LENT if request.param == "team" else None)
    return request.param


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
