"""How a host kernel call runs: which kernels, in which blocks, on which threads.

``_fused_kernels`` gives the compiled kernels (``host_kernels``) where
``tiegrad._numba`` has them and every operand is C-contiguous float32, else None (the
NumPy backend's own code runs). ``_rows_parallel`` cuts a call into cache-sized blocks;
a call of at least ``2 * _SHARE_MIN`` elements shares them among ``_kernel_threads``.
Where oneMKL runs its products on GNU OpenMP and numba's threading layer is ``omp``,
those are numba's threads, which are that same OpenMP team (``host_blocks``), on
``tiegrad._threads.count`` of the cores. Elsewhere one thread (the caller) runs them
unless ``TIEGRAD_NUM_THREADS`` asks for more, which then share the blocks through
``tiegrad._threads.share``'s pool: a second pool competes for the cores with BLAS's
spinning threads, so it is not the default. A kernel's results do not depend on the
threads or the blocks. Like MKL's products, the kernels do not report overflow or
invalid operations to ``np.errstate``.

``team`` also tells the fused optimizer (``tiegrad.optim.fused``) where its parallel
kernels run; the other names are private to ``tiegrad.backend``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from .. import _numba, _threads
from . import blas


def _block() -> int:
    """Elements per block of ``blockwise``: a block's temporaries stay in L2 cache. With
    MKL, fewer and larger blocks: its batched GEMM pays a fixed cost per call and splits a
    batch across its threads. Loads nothing (MKL loads at the first product)."""
    return 1 << 19 if blas.MAY_LOAD else 32768


_SHARES = 2  # blocks per thread when a kernel call is shared
# Elements of the smallest shared block: about three times what handing a block to a
# pool thread costs (``_threads.share``).
_SHARE_MIN = 1 << 16


def _parallel(run: Callable[[int, int], None], n_blocks: int, threads: int) -> None:
    """Run ``run(b, b + 1)`` for every block ``b`` of ``range(n_blocks)`` on ``threads``.

    The threads claim blocks in turn (``tiegrad._threads.share``). A single block, or
    one thread, is one call ``run(0, n_blocks)`` on the caller.
    """
    if threads <= 1 or n_blocks <= 1:
        if n_blocks:
            run(0, n_blocks)
        return
    _threads.share(lambda b: run(b, b + 1), n_blocks, threads)


def _fused_kernels(*arrays: Any, written: Any = None) -> Any:
    """The host kernels when ``tiegrad._numba`` has them and every array is C-contiguous float32.

    ``written``, an array the kernel writes in place, must also be writable (the
    kernels would write into a read-only array; NumPy's path raises its error).
    """
    if written is not None and not written.flags.writeable:
        return None
    for a in (*arrays, written):
        if a is not None and (a.dtype != np.float32 or not a.flags.c_contiguous):
            return None
    return _numba.kernels("tiegrad.backend.host_kernels")


_PAGE = 4096
# Elements from which an output is placed apart (``_outputs_apart``): 1 MiB of float32,
# where the allocator maps arrays of their own and hands them out 2 MiB apart.
_PLACE_MIN = 1 << 18


def _outputs_apart(x: np.ndarray, count: int) -> list[np.ndarray]:
    """``count`` fresh float32 arrays of ``x.size`` elements for one kernel reading ``x``.

    From ``_PLACE_MIN`` elements on, each is placed in its own allocation (so each is
    freed on its own) at an offset such that the addresses of ``x`` and of every output
    differ modulo 4 KiB by at least ``4 KiB / (count + 1)``. Arrays of one size that the
    allocator maps back to back tend to lie a multiple of 2 MiB apart, and a loop
    streaming through several of them at the same index then runs several times slower
    (their cache lines compete for the same cache sets); the placement rules that out.
    Smaller arrays come from the heap, where that pattern does not arise and the
    placement (reading two addresses) would cost more than the kernel's pass.
    """
    n = x.size
    if n < _PLACE_MIN:
        return [np.empty(n, np.float32) for _ in range(count)]
    home = x.__array_interface__["data"][0]
    outs = []
    for k in range(1, count + 1):
        buf = np.empty(n + _PAGE // 4, np.float32)
        want = (home + k * (_PAGE // (count + 1))) & ~63
        start = (want - buf.__array_interface__["data"][0]) % _PAGE // 4
        outs.append(buf[start : start + n])
    return outs


def _shared_elementwise(a: np.ndarray, b: np.ndarray) -> Any:
    """The host kernels for an elementwise op of ``a`` and ``b`` worth sharing, else None.

    Both float32, C-contiguous, of one shape, large enough for two threads, and more
    than one thread asked for: NumPy's one loop computes the same bits as fast on one
    thread, and a kernel never called is never compiled (a shorter cold start).
    """
    if a.shape != b.shape or not _worth_sharing(a):
        return None
    return _fused_kernels(a, b)


def _worth_sharing(a: np.ndarray) -> bool:
    """Whether an elementwise call over ``a`` is large enough for two threads, and more
    than one thread is asked for."""
    return a.size >= 2 * _SHARE_MIN and _kernel_threads()[1] >= 2


def _kernel_threads() -> tuple[Any, int]:
    """``host_blocks`` (or None) and the threads for a kernel call worth sharing.

    ``host_blocks`` where it runs on oneMKL's team (``team``), with
    ``tiegrad._threads.count`` of numba's threads; else None and
    ``tiegrad._threads.count()`` (one unless asked).
    """
    blocks = team()
    if blocks is None:
        return None, _threads.count()
    return blocks, _threads.count(blocks.TEAM)


def team() -> Any:
    """``host_blocks`` where oneMKL runs on GNU OpenMP and numba's parallel loops share its
    team (``host_blocks.shares_the_team``), else None: whether parallel kernels (the host
    kernels' blocks, the fused optimizer's) run on the threads that ran the products."""
    blocks = _numba.kernels("tiegrad.backend.host_blocks") if blas.on_gnu_openmp() else None
    return blocks if blocks is not None and blocks.shares_the_team() else None


def _elementwise(kernels: Any, name: str, *inputs: np.ndarray, outputs: int = 1) -> Any:
    """``kernels.<name>(*inputs, *outs)`` over the flat elements of equal-shape ``inputs``.

    The ``outputs`` new arrays (shaped as the inputs) lie apart from the first input
    (``_outputs_apart``); one is returned as itself, several as a tuple.
    """
    x = inputs[0]
    outs = _outputs_apart(x, outputs)
    _rows_parallel(kernels, name, x.size, 1, *[a.reshape(-1) for a in inputs], *outs)
    if outputs == 1:
        return outs[0].reshape(x.shape)
    return tuple(o.reshape(x.shape) for o in outs)


def _rows_per_block(row_size: int) -> int:
    """Rows of ``row_size`` elements in one cache-sized block (``_block()`` elements), >= 1."""
    return max(1, _block() // max(1, row_size))


def _ranges_parallel(
    kernel: Callable[..., None], n: int, step: int, threads: int, *args: Any
) -> None:
    """``kernel(*args, lo, hi)`` over ``range(n)`` in blocks of ``step`` items on ``threads``."""

    def run(first: int, last: int) -> None:
        kernel(*args, first * step, min(n, last * step))

    _parallel(run, -(-n // step), threads)


def _rows_parallel(
    kernels: Any, name: str, rows: int, row_size: int, *args: Any, align: int = 1
) -> None:
    """``kernels.<name>(*args, lo, hi)`` over ``range(rows)`` in cache-sized blocks on the threads.

    A call of under ``2 * _SHARE_MIN`` elements runs on the caller, as one kernel call. On
    several threads (``_kernel_threads``: numba's where they are MKL's team, else the
    pool's) the blocks are also small enough for ``_SHARES`` of them per thread, and
    never under ``_SHARE_MIN`` elements. A block holds a multiple of ``align`` rows.
    """
    if rows * row_size < 2 * _SHARE_MIN:  # one thread: its blocks make one call
        if rows:
            getattr(kernels, name)(*args, 0, rows)
        return
    team, threads = _kernel_threads()
    per_block = _rows_per_block(row_size)
    if threads > 1:
        least = -(-_SHARE_MIN // max(1, row_size))
        per_block = min(per_block, max(least, -(-rows // (threads * _SHARES))))
    per_block = -(-per_block // align) * align
    if team is not None and threads > 1 and rows > per_block:
        team.run(threads, getattr(team, f"{name}_blocks"), rows, per_block, args)
    else:
        _ranges_parallel(getattr(kernels, name), rows, per_block, threads, *args)
