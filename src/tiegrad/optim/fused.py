"""The fused host step: one pass over memory per optimizer step, when numba is installed.

``Optimizer.step`` uses it for every parameter of a dtype in ``DTYPES`` where
``tiegrad._numba`` has the kernels (its ``ENABLED`` switch, ``TIEGRAD_NO_NUMBA``). Both
paths compute the same values bit for bit (see ``kernels``); only the speed differs.
numba is the optional extra ``tiegrad[fast]``; ``kernels`` says why this dependency.

A step locates its gradients once per dtype (``GradientTable``), checks them all for
NaN and infinity before any write (C6, one read), then hands ``run`` each batch of
canonical slots (C5) that share coefficients: their parameter arrays, gradients and
a ``Batch``, the addresses of their state (``FlatState`` keeps it in one flat buffer
per name and dtype), made once per state layout. ``run`` completes the table with the
parameters' and gradients' addresses and the rule's kernel updates every element once.

Threads. A batch of at least ``2 * CHUNK_MIN`` elements is cut into ``CHUNKS`` chunks
per thread, claimed in turn by up to ``tiegrad._threads.count(CORES)`` threads (read at
every step: ``TIEGRAD_NUM_THREADS``, MKL's team, else the cores), the caller's among them (the
kernels release the GIL), through ``tiegrad._threads.share``: on MKL's OpenMP team
where MKL lends it, else on the process's pool, where the caller waits only for chunks
a pool thread has claimed (on a loaded machine the step degrades to one thread instead
of waiting a time slice).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from types import ModuleType
from typing import Any, NamedTuple

import numpy as np

from .. import _numba, _threads
from ..backend.blas import address_of

DTYPES = frozenset({np.dtype(np.float32), np.dtype(np.float64)})
CORES: int = min(
    8, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
)
CHUNK_MIN = 1 << 16  # elements; a batch under two of these runs on the calling thread
CHUNKS = 4  # chunks per thread: the granularity of the sharing
_UNSIGNED = {4: (np.uint32, 0x7F800000), 8: (np.uint64, 0x7FF0000000000000)}  # exponent bits


class FusedRule(NamedTuple):
    """How an optimizer's rule runs fused: a kernel of ``kernels`` and its operands.

    ``kernel`` names the function ``kernels.<kernel>``; ``state`` lists the state
    tensors in table column order (a tensor the hyperparameters do not need is absent,
    address 0); ``pack`` maps the rule's coefficients to ``(scalars, flags)``, the
    kernel's ``coef`` and ``flags`` in its documented order.
    """

    kernel: str
    state: tuple[str, ...]
    pack: Callable[[Any], tuple[Sequence[float], Sequence[bool]]]


def _kernels() -> ModuleType | None:
    """``tiegrad.optim.kernels`` (importing numba), or None (``tiegrad._numba.kernels``)."""
    return _numba.kernels("tiegrad.optim.kernels")


def supports(dtype: np.dtype) -> bool:
    """Whether steps over parameters of ``dtype`` run fused (the switch, numba, ``DTYPES``)."""
    return dtype in DTYPES and _kernels() is not None


class GradientTable:
    """The gradients of one step's fused slots of one dtype, located once.

    ``arrays`` (C-contiguous: a strided gradient is copied), their data ``addresses``
    and ``starts`` (``starts[k]``: where row ``k`` begins in the batch; given by a caller
    that knows the sizes, ``batch_starts`` of the array sizes otherwise). The
    finiteness check (C6) and the update of any subset of the slots (``select``) use
    them.
    """

    def __init__(
        self,
        slots: Sequence[int],
        arrays: Sequence[np.ndarray],
        starts: np.ndarray | None = None,
    ) -> None:
        self.slots = list(slots)
        self.arrays = [a if a.flags.c_contiguous else np.ascontiguousarray(a) for a in arrays]
        self.dtype = self.arrays[0].dtype
        self.addresses = addresses(self.arrays)
        self.starts = batch_starts([a.size for a in self.arrays]) if starts is None else starts

    def first_nonfinite(self) -> int | None:
        """The first slot whose gradient holds a NaN or an infinity, or None.

        One read of every gradient, as unsigned integers of its width: not finite
        means all exponent bits set.
        """
        unsigned, exponent = _UNSIGNED[self.dtype.itemsize]
        out = np.zeros(len(self.slots), np.uint8)
        bits, top = np.zeros(1, unsigned), np.array([exponent], unsigned)
        table = self.addresses.reshape(-1, 1)
        _launch(_kernels().nonfinite_rows, table, self.starts, bits, top, out, keep=self.arrays)
        hits = np.flatnonzero(out)
        return self.slots[hits[0]] if hits.size else None

    def select(self, rows: np.ndarray | None) -> tuple[list[np.ndarray], np.ndarray, np.ndarray]:
        """``(arrays, addresses, starts)`` of the rows ``rows`` in order (None: all rows)."""
        if rows is None:
            return list(self.arrays), self.addresses, self.starts
        starts = batch_starts(np.diff(self.starts)[rows])
        return [self.arrays[k] for k in rows], self.addresses[rows], starts


class Batch:
    """The fixed operands of ``rule``'s kernel over one run of slots, reused across steps.

    From the sizes of the run's parameters and the state ``{name: (flat buffer, element
    offset of each parameter's tensor)}`` for the names the coefficients need: the
    table's state columns (address 0 for a tensor that is absent) and the byte ranges
    the kernel writes into the state buffers. Valid for as long as those buffers and
    offsets are, which is the life of a step plan's program (``optim.plan``).
    ``disjoint``: the gradient and parameter addresses of the latest call that found no
    gradient overlapping what the kernel writes (the same addresses: the same answer).
    """

    def __init__(
        self,
        rule: FusedRule,
        sizes: np.ndarray,
        dtype: np.dtype,
        state: Mapping[str, tuple[np.ndarray, np.ndarray]],
    ) -> None:
        self.rule = rule
        self.kernel = getattr(_kernels(), rule.kernel)
        self.nbytes = sizes * dtype.itemsize  # of each parameter and its gradient
        self.buffers = [buf for buf, _ in state.values()]
        self.buffer_at = addresses(self.buffers)
        self.buffer_nbytes = np.array([buf.nbytes for buf in self.buffers], np.intp)
        self.table = np.zeros((len(sizes), 2 + len(rule.state)), np.intp)
        buffer_at = dict(zip(state, self.buffer_at.tolist()))
        for column, name in enumerate(rule.state, start=2):
            if name in state:
                self.table[:, column] = buffer_at[name] + state[name][1] * dtype.itemsize
        self.disjoint: tuple[np.ndarray, np.ndarray] | None = None


def run(
    batch: Batch,
    coefficients: Any,
    params: Sequence[np.ndarray],
    grads: tuple[list[np.ndarray], np.ndarray, np.ndarray],
) -> None:
    """Update ``params`` and their state in place with ``batch``'s kernel, one pass.

    ``params``: writable C-contiguous arrays of one dtype in ``DTYPES``, of the sizes
    ``batch`` was built for; ``grads``: their validated gradients as
    ``GradientTable.select`` gives them. A gradient that shares memory with anything
    written is copied first.
    """
    scalars, flags = batch.rule.pack(coefficients)
    arrays, at, starts = grads
    table = batch.table.copy()  # a table of its own: a late pool thread never sees the next
    params_at = addresses(params)
    table[:, 0] = params_at
    last = batch.disjoint
    if last is not None and np.array_equal(last[0], at) and np.array_equal(last[1], params_at):
        table[:, 1] = at
    else:
        written = np.concatenate([params_at, batch.buffer_at])
        written_nbytes = np.concatenate([batch.nbytes, batch.buffer_nbytes])
        checked = _disjoint(arrays, at, batch.nbytes, written, written_nbytes)
        table[:, 1] = checked
        batch.disjoint = (at, params_at) if checked is at else None
    coef = np.array(scalars, arrays[0].dtype)
    keep = (params, arrays, batch.buffers)
    _launch(batch.kernel, table, starts, coef, np.array(flags, np.int64), keep=keep)


def addresses(arrays: Sequence[np.ndarray]) -> np.ndarray:
    """The data addresses of ``arrays`` (live ndarrays), as ``np.intp``.

    Each is NumPy's own data pointer, read through numba's array unboxing where numba
    loads (``tiegrad.backend.blas.address_of``: about 0.17 us an array, against 1 us
    for ``__array_interface__``).
    """
    return np.fromiter(map(address_of(), arrays), np.intp, len(arrays))


def batch_starts(sizes: Sequence[int]) -> np.ndarray:
    """Prefix sums of ``sizes``: ``starts[k]`` is where item ``k`` begins in the batch."""
    starts = np.zeros(len(sizes) + 1, np.intp)
    np.cumsum(np.asarray(sizes, np.intp), out=starts[1:])
    return starts


def _disjoint(
    grads: list[np.ndarray],
    at: np.ndarray,
    nbytes: np.ndarray,
    written: np.ndarray,
    written_nbytes: np.ndarray,
) -> np.ndarray:
    """The addresses ``at`` of ``grads`` after copying each one that overlaps a written range.

    ``written`` and ``written_nbytes`` describe the memory the kernel writes: pairwise
    disjoint ranges (distinct storages, state buffers), so sorted by address a gradient
    can only overlap the last range starting before its end. Empty gradients overlap
    nothing.
    """
    order = np.argsort(written)
    lo, hi = written[order], written[order] + written_nbytes[order]
    end = at + nbytes
    last = np.searchsorted(lo, end, side="left") - 1
    clash = (last >= 0) & (hi[np.maximum(last, 0)] > at) & (end > at)
    if not clash.any():
        return at
    at = at.copy()
    for i in np.flatnonzero(clash):
        grads[i] = grads[i].copy()
        at[i] = addresses([grads[i]])[0]
    return at


def _launch(
    kernel: Callable[..., None], table: np.ndarray, starts: np.ndarray, *args: Any, keep: Any
) -> None:
    """``kernel`` over all elements of the batch, shared by up to ``_threads.count`` threads.

    ``keep``: the arrays ``table`` points into, held for as long as a pool thread may
    still run a chunk, whatever happens to the caller.
    """
    total = int(starts[-1])
    threads = min(_threads.count(CORES), total // CHUNK_MIN)
    if threads <= 1:
        kernel(table, starts, *args, 0, total)
        return
    n = threads * CHUNKS
    bounds = [total * i // n for i in range(n + 1)]

    def chunk(i: int, _held: Any = keep) -> None:
        kernel(table, starts, *args, bounds[i], bounds[i + 1])

    _threads.share(chunk, n, threads)
