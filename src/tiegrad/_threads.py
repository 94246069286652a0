"""Work shared between threads: the host kernels and the fused optimizer.

``share(run, n, threads)`` calls ``run(i)`` for every ``i`` in ``range(n)``. Up to
``threads`` threads, the caller among them, claim the items one at a time; the kernels
they run release the GIL (numba ``nogil``, NumPy's loops and BLAS), so items run at the
same time. The first error of any thread stops the handing out of items and is raised
in the caller once every claimed item has finished.

Which threads. Where the host's matrix products run on an OpenMP runtime (oneMKL on
Intel or GNU OpenMP, ``tiegrad.backend.blas``), that runtime lends its team (``lend_team``):
the caller's BLAS workers, which keep spinning for a while after each product, take the
items at once. A pool of our own would compete with those spinning workers for the
cores and gain nothing (2 cores, W1/W3/W5 steps alternating 1 and 2 pool threads: no
difference), where the team runs a float32 GELU of 1M elements in 0.65 against 1.1 ms
on one thread (through the kernel's C entry point, ``launch``). Intel OpenMP survives
``fork`` (its own handlers); a forked child gives GNU OpenMP's team up for the pool
(``team``). ``share`` returns when the whole team has finished.

Without a team, one pool of Python threads serves the whole process; it starts on first
use, and a forked child starts its own (the parent's threads do not exist there). A
child is told by its process id: this module registers no fork hook. The
caller works too and then waits only for items a pool thread has claimed: a pool thread
the OS has not scheduled yet delays nothing, so on a loaded machine the work degrades
to the caller's thread instead of waiting for a time slice.
"""

from __future__ import annotations

import ctypes
import itertools
import os
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

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


class _TeamJob:
    """Items ``0 .. n-1`` for the threads of an OpenMP team, claimed without a lock.

    Taking the next item of one range iterator is atomic under the GIL, and the team's
    barrier is the wait, so a claim costs no lock and no condition.
    """

    def __init__(self, run: Callable[[int], None], n: int) -> None:
        self.run, self.items = run, iter(range(n))
        self.errors: list[BaseException] = []

    def work(self) -> None:
        """Claim and run items until none is left or one has raised."""
        for i in self.items:
            if self.errors:
                return
            try:
                self.run(i)
            except BaseException as e:  # re-raised by the caller after the team's barrier
                self.errors.append(e)


_MEMBER_TYPE = ctypes.CFUNCTYPE(None, ctypes.c_void_p)
_jobs: dict[int, _TeamJob] = {}  # the job of each running ``Team.run``, by key
_keys = itertools.count(1)


@_MEMBER_TYPE
def _member(key: int) -> None:
    """What each thread of an OpenMP team runs: items of job ``key`` until none is left."""
    _jobs[key].work()


_MEMBER = ctypes.cast(_member, ctypes.c_void_p).value


class Team:
    """An OpenMP runtime's team of the calling thread, entered through ``GOMP_parallel``.

    ``size()`` is the number of threads the runtime's owner (MKL) runs its products on
    now (``threadpoolctl`` limits included);
    ``survives_fork`` tells whether the runtime starts a forked child's threads anew
    (Intel OpenMP does, GNU OpenMP does not: a child waiting for them would hang).
    ``launch`` runs a C function on the team (no Python in its threads: a few
    microseconds per call); ``run`` runs Python items, each thread of the team taking
    the GIL to claim one (tens of microseconds per call).
    """

    def __init__(self, runtime: ctypes.CDLL, size: Callable[[], int], survives_fork: bool) -> None:
        self.size, self.survives_fork = size, survives_fork
        self.pid = os.getpid()
        self._parallel = runtime.GOMP_parallel
        self._parallel.argtypes = (ctypes.c_void_p, ctypes.c_void_p, ctypes.c_uint, ctypes.c_uint)
        self._parallel.restype = None

    def launch(self, entry: int, data: int, threads: int) -> None:
        """``entry(data)`` on ``threads`` threads of the team: C functions at these addresses.

        Returns when every thread has returned; the GIL is released meanwhile.
        """
        self._parallel(entry, data, threads, 0)

    def run(self, run: Callable[[int], None], n: int, threads: int) -> None:
        """``run(i)`` for every ``i`` in ``range(n)`` on ``threads`` threads of the team."""
        key, job = next(_keys), _TeamJob(run, n)
        _jobs[key] = job
        try:
            self.launch(_MEMBER, key, threads)
        finally:
            del _jobs[key]
        if job.errors:
            raise job.errors[0]


TEAM: Team | None = None
"""The OpenMP team lent (``lend_team``), or None; ``team`` says whether it runs here."""


def team() -> Team | None:
    """The team ``share`` and ``launch`` run on in this process, or None for the pool.

    None in a forked child of the lender where the team does not survive ``fork``.
    """
    lent = TEAM
    if lent is None or lent.survives_fork or lent.pid == os.getpid():
        return lent
    return None


def lend_team(runtime: ctypes.CDLL, size: Callable[[], int], survives_fork: bool) -> None:
    """Run ``share`` on ``runtime``'s OpenMP team of ``size()`` threads from now on.

    A forked child of this process keeps the team only if ``survives_fork``, and uses
    the pool otherwise.
    """
    global TEAM
    TEAM = Team(runtime, size, survives_fork)


def count(default: int = 1) -> int:
    """Threads for tiegrad's kernels, read at every call: ``TIEGRAD_NUM_THREADS`` when it is
    a positive integer, else the current size of the team where one runs here, else
    ``default``."""
    value = os.environ.get("TIEGRAD_NUM_THREADS", "")
    if value.isdigit() and int(value) > 0:
        return int(value)
    lent = team()
    return max(1, lent.size()) if lent is not None else default


def launch(entry: int, data: int, threads: int) -> None:
    """The C function at ``entry`` called with ``data``: on ``threads`` threads of the team,
    or once on the caller where no team is lent (the function claims all the work then)."""
    lent = team()
    if lent is not None:
        lent.launch(entry, data, threads)
    else:
        _MEMBER_TYPE(entry)(data)


def share(run: Callable[[int], None], n: int, threads: int) -> None:
    """``run(i)`` for every ``i`` in ``range(n)`` on up to ``threads`` threads, the caller's too.

    With one thread or one item everything runs on the caller, in order.
    """
    if threads <= 1 or n <= 1:
        for i in range(n):
            run(i)
        return
    lent = team()
    if lent is not None:
        lent.run(run, n, min(threads, n))
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
