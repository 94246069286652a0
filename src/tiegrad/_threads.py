"""Work shared between the calling thread and a pool: the host kernels and the fused optimizer.

``share(run, n, threads)`` calls ``run(i)`` for every ``i`` in ``range(n)``. The caller
and up to ``threads - 1`` pool threads claim the items one at a time; the kernels they
run release the GIL (numba ``nogil``, NumPy's loops and BLAS), so items run at the same
time. The caller works too and then waits only for items a pool thread has claimed: a
pool thread the OS has not scheduled yet delays nothing, so on a loaded machine the
work degrades to the caller's thread instead of waiting for a time slice.

The first error of any thread stops the handing out of items and is raised in the
caller once every claimed item has finished. One pool serves the whole process; it
starts on first use, and a forked child starts its own (the parent's threads do not
exist there).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

_POOL_THREADS = 32  # enough for several callers sharing at once
_pool: ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()


class _Claims:
    """Items ``0 .. n-1`` handed out one at a time to whichever thread asks next."""

    def __init__(self, run: Callable[[int], None], n: int) -> None:
        self.run, self.n = run, n
        self.next = 0  # the next item to hand out
        self.active = 0  # items handed out and not finished
        self.error: BaseException | None = None
        self.cond = threading.Condition()

    def work(self) -> None:
        """Claim and run items until none is left (or an error stopped the handing out)."""
        while True:
            with self.cond:
                i = self.next
                if i >= self.n or self.error is not None:
                    return
                self.next, self.active = i + 1, self.active + 1
            try:
                self.run(i)
            except BaseException as e:  # re-raised by the waiting caller
                with self.cond:
                    self.error = self.error or e
            finally:
                with self.cond:
                    self.active -= 1
                    self.cond.notify_all()

    def wait(self) -> None:
        """Return when every claimed item has finished; raise the first error."""
        with self.cond:
            self.cond.wait_for(lambda: self.active == 0)
        if self.error is not None:
            raise self.error


def share(run: Callable[[int], None], n: int, threads: int) -> None:
    """``run(i)`` for every ``i`` in ``range(n)`` on the caller and ``threads - 1`` pool threads.

    With one thread or one item everything runs on the caller, in order.
    """
    if threads <= 1 or n <= 1:
        for i in range(n):
            run(i)
        return
    claims = _Claims(run, n)
    pool = _executor()
    for _ in range(min(threads, n) - 1):
        pool.submit(claims.work)
    claims.work()
    claims.wait()


def _executor() -> ThreadPoolExecutor:
    """The pool, started on first use."""
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(_POOL_THREADS, thread_name_prefix="tiegrad")
        return _pool


def _forget_pool() -> None:
    """In a forked child: the parent's pool threads do not exist here; start anew."""
    global _pool, _pool_lock
    _pool, _pool_lock = None, threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_pool)
