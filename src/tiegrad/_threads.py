"""Work shared between threads: the host kernels and the fused optimizer.

``share(run, n, threads)`` calls ``run(i)`` for every ``i`` in ``range(n)``. Up to
``threads`` threads, the caller among them, claim the items one at a time; the kernels
they run release the GIL (numba ``nogil``, NumPy's loops and BLAS), so items run at the
same time. The other threads are those of one ``concurrent.futures.ThreadPoolExecutor``
for the whole process, started on first use (never at import), and anew in a forked
child, where the parent's threads do not exist (told by the process id: this module
registers no fork hook). The caller works too and then waits only for items a pool
thread has claimed: a pool thread the OS has not scheduled yet delays nothing, so on a
loaded machine the work degrades to the caller's thread instead of waiting for a time
slice. The first error of any thread stops the handing out of items and is raised in
the caller once every claimed item has finished.

``count(default)`` is how many threads to use, read at every call (module ``count``).
"""

from __future__ import annotations

import functools
import os
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

ENV_THREADS = "TIEGRAD_NUM_THREADS"
_POOL_THREADS = 32  # enough for several callers sharing at once
_pool: ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()
_pool_pid = os.getpid()  # the process the pool's threads run in


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


def count(default: int = 1) -> int:
    """Threads for tiegrad's kernels, read at every call.

    ``TIEGRAD_NUM_THREADS`` when it is a positive integer; else ``default``, capped by
    the current thread count of every BLAS library ``threadpoolctl`` sees in this
    process (so ``threadpoolctl.threadpool_limits(1)`` and ``MKL_NUM_THREADS=1`` put
    tiegrad's own kernels on one thread too). Reading a count is a call into each
    library (about a microsecond); the libraries are looked up once, and again after
    ``rescan`` (``tiegrad.backend.blas`` calls it when it loads oneMKL).
    """
    value = os.environ.get(ENV_THREADS, "")
    if value.isdigit() and int(value) > 0:
        return int(value)
    for library in _blas_libraries():
        default = min(default, library.get_num_threads() or default)
    return max(1, default)


@functools.cache
def _blas_libraries() -> tuple[Any, ...]:
    """``threadpoolctl``'s controllers of the BLAS libraries loaded now (none without it)."""
    try:
        from threadpoolctl import ThreadpoolController
    except ImportError:
        return ()
    return tuple(ThreadpoolController().select(user_api="blas").lib_controllers)


def rescan() -> None:
    """Look the BLAS libraries up again at the next ``count`` (one was loaded since)."""
    _blas_libraries.cache_clear()


def share(run: Callable[[int], None], n: int, threads: int) -> None:
    """``run(i)`` for every ``i`` in ``range(n)`` on up to ``threads`` threads, the caller's too.

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
    """The pool, started on first use, and anew in a forked child (whose lock is new too)."""
    global _pool, _pool_lock, _pool_pid
    if _pool_pid != os.getpid():  # the parent's threads do not exist here
        _pool, _pool_lock, _pool_pid = None, threading.Lock(), os.getpid()
    with _pool_lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(_POOL_THREADS, thread_name_prefix="tiegrad")
        return _pool
