"""The fused host step: one pass over memory per optimizer step, when numba is installed.

The host executor (``optim.host``) uses it for every parameter of a dtype in ``DTYPES`` where
``tiegrad._numba`` has the kernels (its ``ENABLED`` switch, ``TIEGRAD_NO_NUMBA``). Both
paths compute the same values bit for bit (see ``kernels``); only the speed differs.
numba is a default dependency where it has wheels; ``kernels`` says why this dependency.

Work. A step plan's program (``optim.plan``) gives each fused dtype a ``Layout``: its
canonical slots (C5) in order, cut into ``Piece``s of up to ``GROUP`` consecutive slots of
one run (a slot larger than ``4 * CHUNK_MIN`` elements is cut into parts), one kernel
call each, since a call costs microseconds. A step flattens its gradients once per
dtype (``GradientTable``), checks them all for NaN and infinity before any write (C6, one
read), then hands ``run`` each run of slots that share coefficients with its
``RunOperands``: the run's pieces with their views of the state (``FlatState`` keeps it in
one flat buffer per name and dtype), made once per program.

Threads. A run or check of at least ``2 * CHUNK_MIN`` elements is shared among up to
``tiegrad._threads.count(CORES)`` threads (read at every step: ``TIEGRAD_NUM_THREADS``,
else the cores capped by the BLAS libraries' current thread counts, ``threadpoolctl``
limits included). Where numba's threads are oneMKL's OpenMP team
(``numpy_backend.team``), each piece of at least ``2 * CHUNK_MIN`` elements runs on them
(``kernels.adam_blocks``, ``kernels.nonfinite_blocks``: blocks of ``CHUNK_MIN``) and the
smaller ones on the caller; elsewhere, and for the rules without such a kernel, the
pieces go to ``tiegrad._threads.share``'s pool, the caller's thread among them (the
kernels release the GIL).
"""

from __future__ import annotations

import os
import weakref
from collections.abc import Callable, Mapping, Sequence
from operator import is_ as _same
from types import ModuleType
from typing import NamedTuple

import numpy as np

from .. import _numba, _threads
from ..backend.numpy_backend import team as _team

Owners = dict[int, list[np.ndarray]] | None  # id of an array owning memory -> arrays in it
DTYPES = frozenset({np.dtype(np.float32), np.dtype(np.float64)})
CORES: int = min(
    8, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
)
CHUNK_MIN = 1 << 16  # elements; work under two of these runs on the calling thread
GROUP = 8  # parameters per kernel call


class FusedRule(NamedTuple):
    """How an optimizer's rule runs fused: ``kernels.<kernel>(p, g, *state, *coefficients)``.

    ``state`` names the state tensors the kernel takes, in its argument order (one the
    hyperparameters do not need is passed empty); the coefficients are the rule's
    ``Coefficients`` tuple, whose fields are the kernel's remaining arguments.
    """

    kernel: str
    state: tuple[str, ...]


class Piece(NamedTuple):
    """One kernel call of a ``Layout``: rows ``first`` .. ``stop`` of the dtype's slots.

    Elements ``lo`` .. ``hi`` of the rows' concatenation: all of them, or part of one row.
    """

    first: int
    stop: int
    lo: int
    hi: int


def _kernels() -> ModuleType | None:
    """``tiegrad.optim.kernels`` (importing numba), or None (``tiegrad._numba.kernels``)."""
    return _numba.kernels("tiegrad.optim.kernels")


def supports(dtype: np.dtype) -> bool:
    """Whether steps over parameters of ``dtype`` run fused (the switch, numba, ``DTYPES``)."""
    return dtype in DTYPES and _kernels() is not None


class Layout:
    """The fused canonical ``slots`` of one dtype in a program, cut into ``pieces``.

    ``sizes``: each slot's elements; ``runs``: the run each slot belongs to (pieces never
    mix runs: ``of_run`` lists each run's pieces). ``pad[k]``: the ``k`` empty writable
    and read-only arrays that fill a tuple of ``GROUP - k`` rows. ``views``: per slot,
    a weak reference to the latest step's writable C-contiguous gradient array, its
    strides and, once the same array came a second time, its read-only flat view
    (``GradientTable``); or None.
    """

    def __init__(
        self, slots: Sequence[int], sizes: Sequence[int], runs: Sequence[int], dtype: np.dtype
    ) -> None:
        self.slots = list(slots)
        self.sizes = list(sizes)
        self.size = int(sum(sizes))
        self.pieces: list[Piece] = []
        most, k = 4 * CHUNK_MIN, 0
        while k < len(sizes):
            n, stop = sizes[k], k + 1
            if n > most:
                parts = -(-n // most)
                self.pieces += [
                    Piece(k, stop, n * i // parts, n * (i + 1) // parts) for i in range(parts)
                ]
            else:
                while (
                    stop < len(sizes)
                    and stop - k < GROUP
                    and runs[stop] == runs[k]
                    and n + sizes[stop] <= most
                ):
                    n, stop = n + sizes[stop], stop + 1
                if n:
                    self.pieces.append(Piece(k, stop, 0, n))
            k = stop
        self.of_run: dict[int, list[Piece]] = {}
        for piece in self.pieces:
            self.of_run.setdefault(runs[piece.first], []).append(piece)
        empty = np.empty(0, dtype)
        self.pad = [((empty,) * k, (_read_only(empty),) * k) for k in range(GROUP + 1)]
        self.views: list[tuple[weakref.ref, tuple[int, ...], np.ndarray | None] | None] = [
            None
        ] * len(self.slots)


class GradientTable:
    """The validated gradients of one step's fused slots of one dtype, in ``layout``'s order.

    ``flat``: each as a read-only C-contiguous 1-D array (a strided one copied). A caller
    that passes the same writable C-contiguous arrays step after step (its own gradient
    buffers) gets the view made for the second of them from then on (``layout.views``):
    an array object's memory never moves while a view of it lives (NumPy refuses
    ``resize``), its shape was checked and its strides are compared. Arrays new at
    every step (tiegrad's gradients, a clipped copy) are only referenced weakly, so a
    step keeps none of them alive.
    """

    def __init__(self, layout: Layout, arrays: list[np.ndarray]) -> None:
        self.layout = layout
        views = layout.views
        flat = []
        for i, a in enumerate(arrays):
            kept = views[i]
            if kept is not None and kept[0]() is a and kept[1] == a.strides:
                view = kept[2]
                if view is None:  # the same array again: the caller's own buffer
                    view = _read_only(a)
                    views[i] = (kept[0], kept[1], view)
                flat.append(view)
                continue
            view, of_writable = _read_only_view(a)
            views[i] = (weakref.ref(a), a.strides, None) if of_writable else None
            flat.append(view)
        self.flat = flat

    def first_nonfinite(self) -> int | None:
        """The first slot whose gradient holds a NaN or an infinity, or None (C6).

        One read of every gradient (``kernels.nonfinite``), the pieces from last to first:
        the update that follows runs from first to last and finds the gradients it reads
        first among those the check read last, still in the CPU's last-level cache.
        """
        layout, flat = self.layout, self.flat
        pieces, nonfinite, pad = layout.pieces, _kernels().nonfinite, layout.pad
        hits = [-1] * len(pieces)

        def check(i: int, blocks: Callable[..., int] | None = None) -> None:
            first, stop, lo, hi = pieces[i]
            rows = _rows(flat, first, stop, lo, hi, layout.sizes[first])
            rows += pad[GROUP - len(rows)][1]
            if blocks is None:
                hits[i] = nonfinite(rows)
            else:
                hits[i] = team.run(threads, blocks, rows, CHUNK_MIN)

        threads, team = _threads_and_team(layout.size)
        if team is None:
            last = len(pieces) - 1
            _threads.share(lambda i: check(last - i), len(pieces), threads)
        else:
            blocks = _kernels().nonfinite_blocks
            for i in reversed(range(len(pieces))):
                _, _, lo, hi = pieces[i]
                check(i, blocks if hi - lo >= 2 * CHUNK_MIN else None)
        for piece, hit in zip(pieces, hits):
            if hit >= 0:
                return layout.slots[piece.first + hit]
        return None


class RunOperands:
    """The fixed operands of ``rule``'s kernel over the run ``run`` of ``layout``, per program.

    ``rows``: the run's rows in the layout, in the run's order; ``state``: ``{name: (flat
    buffer, element offset of each row's tensor)}`` for the names the coefficients need.
    Each call (``calls``) is a piece: its rows in the run, its elements, the size of its
    first row and its state views (empty for a tensor that is absent). Valid for as long
    as those buffers and offsets are: the life of a step plan's program (``optim.plan``).
    ``written``: the latest parameter arrays, their 1-D views and the owners of the
    memory a call writes.
    """

    def __init__(
        self,
        rule: FusedRule,
        layout: Layout,
        run: int,
        rows: Sequence[int],
        state: Mapping[str, tuple[np.ndarray, np.ndarray]],
    ) -> None:
        self.kernel = getattr(_kernels(), rule.kernel)
        self.blocks = getattr(_kernels(), f"{rule.kernel}_blocks", None)  # on numba's team
        self.rows = list(rows)
        self.buffers = [buf for buf, _ in state.values()]
        self.pad = layout.pad
        empty = self.pad[1][0][0]
        index = {row: i for i, row in enumerate(rows)}
        self.calls = []
        for first, stop, lo, hi in layout.of_run.get(run, []):
            i = index[first]
            start = {name: int(offsets[i]) for name, (_, offsets) in state.items()}
            views = tuple(
                state[n][0][start[n] + lo : start[n] + hi] if n in state else empty
                for n in rule.state
            )
            self.calls.append((i, i + stop - first, lo, hi, layout.sizes[first], views))
        self.size = sum(hi - lo for _, _, lo, hi, _, _ in self.calls)
        self.written: tuple[list[np.ndarray], list[np.ndarray], Owners] | None = None


def run(
    operands: RunOperands, coefficients: tuple, params: list[np.ndarray], grads: GradientTable
) -> None:
    """Update ``params`` and their state in place with the kernel of ``operands``, one pass.

    ``params``: the run's writable C-contiguous arrays of one dtype in ``DTYPES``, of the
    shapes ``operands`` was built for; ``grads``: the step's gradient table, checked
    (``first_nonfinite``). A gradient that shares memory with anything written is
    copied first.
    """
    kernel, calls, pad = operands.kernel, operands.calls, operands.pad
    flat_params, owners = _written(operands, params)
    flat_grads = [grads.flat[row] for row in operands.rows]
    everything = [*params, *operands.buffers]
    for i, g in enumerate(flat_grads):
        owner = _owner(g)
        if owner is g:  # a copy
            continue
        near = everything if owners is None or owner is None else owners.get(id(owner), ())
        if near and any(np.may_share_memory(g, a) for a in near):
            flat_grads[i] = _read_only(g.copy())

    def call(k: int, blocks: Callable[..., None] | None = None) -> None:
        first, stop, lo, hi, size, state = calls[k]
        p = _rows(flat_params, first, stop, lo, hi, size)
        g = _rows(flat_grads, first, stop, lo, hi, size)
        filler = pad[GROUP - len(p)]
        if blocks is None:
            kernel(p + filler[0], g + filler[1], *state, *coefficients)
        else:
            team.run(threads, blocks, p + filler[0], g + filler[1], *state, *coefficients,
                     CHUNK_MIN)  # fmt: skip

    threads, team = _threads_and_team(operands.size)
    if team is None or operands.blocks is None:
        _threads.share(call, len(calls), threads)
        return
    for k, (_, _, lo, hi, _, _) in enumerate(calls):
        call(k, operands.blocks if hi - lo >= 2 * CHUNK_MIN else None)


def _rows(
    flat: list[np.ndarray], first: int, stop: int, lo: int, hi: int, size: int
) -> tuple[np.ndarray, ...]:
    """The arrays of rows ``first`` .. ``stop`` of ``flat``, or the part ``lo`` .. ``hi`` of
    row ``first`` (of ``size`` elements)."""
    if hi - lo == size or stop - first > 1:
        return tuple(flat[first:stop])
    return (flat[first][lo:hi],)


def _read_only(a: np.ndarray) -> np.ndarray:
    """``a`` as a read-only C-contiguous 1-D array: a view, or a copy where ``a`` is strided.

    The one type the kernels are given what they only read: one specialisation each.
    """
    return _read_only_view(a)[0]


def _read_only_view(a: np.ndarray) -> tuple[np.ndarray, bool]:
    """``_read_only(a)``, and whether it is a view of a writable ``a`` (not a copy).

    ``reshape`` gives a new object every time: a view of a C-contiguous ``a``, or a copy
    of a strided one (itself C-contiguous, and with a ``base`` of its own: a copy never
    tells the caller's later writes).
    """
    flat = a.reshape(-1)
    flags = flat.flags
    if not flags.writeable and flags.c_contiguous:  # a read-only ``a``'s own view
        return flat, False
    of_writable = a.flags.c_contiguous
    flat = (flat if flags.c_contiguous else flat.copy()).view()  # a strided 1-D ``a``: a view
    flat.setflags(write=False)  # cheaper than ``flags.writeable = False`` (docs/performance.md)
    return flat, of_writable


def _owner(a: np.ndarray) -> np.ndarray | None:
    """The array owning ``a``'s memory (NumPy points a view's ``base`` at it), or None where
    another object does (a foreign buffer)."""
    owner = a if a.base is None else a.base
    return owner if isinstance(owner, np.ndarray) and owner.base is None else None


def _written(operands: RunOperands, params: list[np.ndarray]) -> tuple[list[np.ndarray], Owners]:
    """The 1-D views of ``params`` and ``{id of an owner: the arrays written in its memory}``
    for ``params`` and ``operands``'s state, None where one of them lives in a foreign
    buffer; kept in ``operands.written`` for as long as ``params`` are the same arrays."""
    last = operands.written
    if last is not None and len(last[0]) == len(params) and all(map(_same, last[0], params)):
        return last[1], last[2]
    owners: Owners = {}
    for a in [*params, *operands.buffers]:
        owner = _owner(a)
        if owner is None:
            owners = None
            break
        owners.setdefault(id(owner), []).append(a)
    flat = [a.reshape(-1) for a in params]
    operands.written = (list(params), flat, owners)
    return flat, owners


def _threads_and_team(size: int) -> tuple[int, ModuleType | None]:
    """The threads for a step part of ``size`` elements, and numba's team where the part
    is worth sharing and that team is oneMKL's (``numpy_backend.team``), else None.

    A part under two ``CHUNK_MIN`` runs on the caller without reading the thread count.
    """
    most = size // CHUNK_MIN
    if most <= 1:
        return most, None
    threads = min(_threads.count(CORES), most)
    return threads, _team() if threads > 1 else None
