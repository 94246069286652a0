"""The host kernels' blocks on numba's threads: ``<kernel>_blocks(n, step, args)`` runs
``host_kernels.<kernel>(*args, lo, hi)`` for every block ``lo .. hi`` of ``step`` items of
``range(n)``, the blocks shared among numba's threads (``parallel=True``, ``prange``).

Why numba's threads. oneMKL runs its products on a GNU OpenMP team, and after each
product that team's workers keep spinning on the other cores for a while. A second pool
of threads (``tiegrad._threads``, or numba's own ``workqueue`` pool) competes with them
for those cores, and a kernel shared with it runs no faster than on one thread; numba's
``omp`` threading layer runs its parallel loops on the same GNU OpenMP runtime, so the
kernels' blocks go to the team that just ran the product.
``host_dispatch`` therefore uses these drivers only where oneMKL runs on GNU OpenMP
and numba's threading layer is ``omp`` (``shares_the_team``); everywhere else the blocks
run on the caller's thread or ``tiegrad._threads``' pool. A block is computed by the same
kernel on the same items whichever thread runs it, and the kernels' results do not
depend on how the items are cut into blocks (``test_kernel_threads``), so the bits are
those of the calling thread's route.

Imported only through ``tiegrad._numba.kernels``; the drivers are compiled on their first
use and cached like the kernels. Each driver is written out:
numba caches only functions defined in a module, and one made by a factory (a closure
over its kernel) or taking its kernel as an argument would compile in every process.
numba keys a cached driver on this file alone, although the kernel is compiled into it:
in a source checkout, an edit of ``host_kernels`` needs this file touched (or its
``__pycache__`` entries removed), else the drivers keep the old kernel. An install
writes every file anew, so it always recompiles.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import numba
import numpy as np
from numba import prange

from .. import _numba
from . import host_kernels as hk

_blocks = _numba.jit(parallel=True, nogil=True)


@_blocks
def relu_blocks(n: int, step: int, args: tuple) -> None:
    for b in prange(-(-n // step)):
        hk.relu(*args, b * step, min(n, b * step + step))


@_blocks
def relu_vjp_blocks(n: int, step: int, args: tuple) -> None:
    for b in prange(-(-n // step)):
        hk.relu_vjp(*args, b * step, min(n, b * step + step))


@_blocks
def multiply_blocks(n: int, step: int, args: tuple) -> None:
    for b in prange(-(-n // step)):
        hk.multiply(*args, b * step, min(n, b * step + step))


@_blocks
def add_blocks(n: int, step: int, args: tuple) -> None:
    for b in prange(-(-n // step)):
        hk.add(*args, b * step, min(n, b * step + step))


@_blocks
def add_row_vector_blocks(n: int, step: int, args: tuple) -> None:
    for b in prange(-(-n // step)):
        hk.add_row_vector(*args, b * step, min(n, b * step + step))


@_blocks
def gelu_blocks(n: int, step: int, args: tuple) -> None:
    for b in prange(-(-n // step)):
        hk.gelu(*args, b * step, min(n, b * step + step))


@_blocks
def layer_norm_blocks(n: int, step: int, args: tuple) -> None:
    for b in prange(-(-n // step)):
        hk.layer_norm(*args, b * step, min(n, b * step + step))


@_blocks
def layer_norm_backward_blocks(n: int, step: int, args: tuple) -> None:
    for b in prange(-(-n // step)):
        hk.layer_norm_backward(*args, b * step, min(n, b * step + step))


@_blocks
def softmax_blocks(n: int, step: int, args: tuple) -> None:
    for b in prange(-(-n // step)):
        hk.softmax(*args, b * step, min(n, b * step + step))


@_blocks
def softmax_backward_blocks(n: int, step: int, args: tuple) -> None:
    for b in prange(-(-n // step)):
        hk.softmax_backward(*args, b * step, min(n, b * step + step))


@_blocks
def cross_entropy_blocks(n: int, step: int, args: tuple) -> None:
    for b in prange(-(-n // step)):
        hk.cross_entropy(*args, b * step, min(n, b * step + step))


@_blocks
def cross_entropy_backward_blocks(n: int, step: int, args: tuple) -> None:
    for b in prange(-(-n // step)):
        hk.cross_entropy_backward(*args, b * step, min(n, b * step + step))


TEAM: int = numba.config.NUMBA_NUM_THREADS  # numba's threads: the cores, or NUMBA_NUM_THREADS


def run(threads: int, kernel: Callable[..., Any], *args: Any) -> Any:
    """``kernel(*args)``, a parallel kernel (these drivers, or the optimizer's
    ``<rule>_blocks``), on ``threads`` of numba's threads (at most ``TEAM``); the calling
    thread's numba thread count is restored afterwards."""
    before = numba.get_num_threads()
    threads = min(threads, TEAM)
    if threads != before:
        numba.set_num_threads(threads)
    try:
        return kernel(*args)
    finally:
        if threads != before:
            numba.set_num_threads(before)


_verdict: tuple[int, bool] | None = None  # (pid, whether the team is shared)


def shares_the_team() -> bool:
    """Whether numba's parallel loops run on the GNU OpenMP runtime (its ``omp`` threading
    layer), known after a first parallel launch (made here once per process), and this
    process is the one that launched it (a forked child's OpenMP runtime is unusable).
    False where numba can load no threading layer."""
    global _verdict
    if _verdict is None or _verdict[0] != os.getpid():
        if _verdict is not None:  # a forked child: never parallel here
            _verdict = (os.getpid(), False)
            return False
        x = np.zeros(2, np.float32)
        try:
            relu_blocks(2, 1, (x, x))
            shared = numba.threading_layer() == "omp"
        except ValueError:  # numba could load no threading layer
            shared = False
        _verdict = (os.getpid(), shared)
    return _verdict[1]
