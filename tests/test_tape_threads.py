"""``opt.step()`` without gradients, sessions and threads (issue 16).

``latest_gradients()`` is the latest backward of the calling thread, its session held
weakly; a session records in one thread at a time (``TapeError`` otherwise).
"""

from __future__ import annotations

import gc
import threading

import numpy as np
import pytest

from tiegrad import EagerSession, MissingGradientError, Param, TapeError, latest_gradients
from tiegrad.optim import SGD


def run_in_threads(target, n: int) -> list:
    results: list = [None] * n
    barrier = threading.Barrier(n, timeout=60)

    def run(i):
        try:
            results[i] = target(i, barrier)
        except BaseException as e:  # reported by the main thread
            results[i] = e

    threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results


def test_step_without_gradients_takes_the_latest_backward_of_its_own_thread():
    def train(i, barrier):
        p = Param(np.zeros(3))
        opt = SGD([p], lr=1.0)
        s = EagerSession()
        for _ in range(20):
            s.reset()
            loss = (s.use(p) * float(i + 1)).sum()
            s.backward(loss)
            barrier.wait()  # every thread has run its backward before any steps
            opt.step()
            barrier.wait()
        return p.value.copy()

    results = run_in_threads(train, 4)
    for i, value in enumerate(results):
        assert not isinstance(value, BaseException), value
        np.testing.assert_array_equal(value, np.full(3, -20.0 * (i + 1)))


def test_a_backward_in_another_thread_is_not_seen():
    s = EagerSession()
    s.backward((s.use(Param(np.ones(2))) * 2.0).sum())
    seen = run_in_threads(lambda i, b: latest_gradients(), 1)
    assert seen == [None] and latest_gradients() is s.last_gradients


def test_the_latest_gradients_do_not_keep_a_session_or_its_tape_alive():
    p = Param(np.ones(2))
    s = EagerSession()
    s.backward((s.use(p) * 2.0).sum())
    host = p.storage.host
    del s
    gc.collect()
    assert latest_gradients() is None
    arr = p.storage.host_for_update()  # no tape pins the array: an in-place update
    assert np.shares_memory(arr, host)  # the same memory: no copy
    p.storage.commit_host(arr)
    with pytest.raises(MissingGradientError, match="no backward has run"):
        SGD([p], lr=0.1).step()


def test_a_session_refuses_a_second_recording_thread_until_reset():
    s = EagerSession()
    p = Param(np.ones(2))
    s.use(p)
    errors = run_in_threads(lambda i, b: s.use(p), 1)
    assert isinstance(errors[0], TapeError) and "single-threaded" in str(errors[0])
    errors = run_in_threads(lambda i, b: s.backward(s.leaf(np.ones(1)).sum()), 1)
    assert isinstance(errors[0], TapeError)
    assert len(s) == 1  # nothing was recorded by the other thread
    s.reset()
    (ref,) = run_in_threads(lambda i, b: s.use(p), 1)  # handed over after a reset
    assert not isinstance(ref, BaseException) and ref.id == 0
