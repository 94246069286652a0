"""``tiegrad._threads.share``: the threads behind the host kernels and the fused optimizer.

Every test runs on both routes: MKL's OpenMP team (where MKL is loaded) and the pool.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import threading
import time

import pytest

from tiegrad import _threads
from tiegrad.backend import blas

_LENT = _threads.TEAM  # the team the import lent, or None


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


def _lent_in_a_fresh_process(first="", **env):
    code = "\n".join(
        [first, "from tiegrad import _threads", "import tiegrad.backend", "print(_threads.TEAM)"]
    )
    out = subprocess.run(
        [sys.executable, "-c", code], env={**os.environ, **env}, capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr
    return out.stdout.strip() != "None"


@pytest.mark.skipif(blas.LIBRARY is None, reason="needs oneMKL (tiegrad[mkl])")
def test_mkl_lends_its_team_unless_it_runs_another_threading_layer(route):
    if route == "pool":
        pytest.skip("one check is enough")
    assert _lent_in_a_fresh_process(MKL_THREADING_LAYER="intel")
    assert _lent_in_a_fresh_process(MKL_THREADING_LAYER="GNU")
    assert not _lent_in_a_fresh_process(MKL_THREADING_LAYER="SEQUENTIAL")
    assert not _lent_in_a_fresh_process(TIEGRAD_BLAS="numpy")


_GNU_TEAM_IN_A_CHILD = """
import os, torch  # GNU OpenMP first: MKL takes its GNU layer
import numpy as np
from tiegrad import _threads
from tiegrad.backend import NUMPY
team = _threads.TEAM
assert team is not None and not team.survives_fork, team
seen = []
_threads.share(seen.append, 8, 2)
x = np.random.default_rng(0).standard_normal((1000, 96)).astype(np.float32)
w, b = np.ones(96, np.float32), np.zeros(96, np.float32)
rows = NUMPY.layer_norm_rows(x, w, b, 1e-5)  # None without numba
pid = os.fork()
if pid == 0:
    child = []
    _threads.share(child.append, 8, 2)
    again = NUMPY.layer_norm_rows(x, w, b, 1e-5)
    same = rows is None or all(np.array_equal(p, c) for p, c in zip(rows, again))
    os._exit(0 if _threads.TEAM is None and sorted(child) == list(range(8)) and same else 3)
_, status = os.waitpid(pid, 0)
assert status == 0 and _threads.TEAM is team and sorted(seen) == list(range(8))
print("ok")
"""


@pytest.mark.skipif(blas.LIBRARY is None, reason="needs oneMKL (tiegrad[mkl])")
@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
@pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="needs torch")
def test_a_forked_child_gives_a_gnu_openmp_team_up_for_the_pool(route):
    if route == "pool":
        pytest.skip("one check is enough")
    out = subprocess.run(
        [sys.executable, "-c", _GNU_TEAM_IN_A_CHILD], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr
