"""The fused host step: one pass over memory per optimizer step, when numba is installed.

``Optimizer.step`` uses it for every parameter of a dtype in ``DTYPES`` where
``tiegrad._numba`` has the kernels (its ``ENABLED`` switch, ``TIEGRAD_NO_NUMBA``). Both
paths compute the same values bit for bit (see ``kernels``); only the speed differs.
numba is the optional extra ``tiegrad[fast]``; ``kernels`` says why this dependency.

Work. A step plan's program (``optim.plan``) gives each fused dtype a ``Layout``: its
canonical slots (C5) in order, the rows, cut into ``Piece``s, one kernel call each. A
row larger than ``CHUNK_MIN // 4`` elements is cut into pieces of at most
``4 * CHUNK_MIN``; consecutive smaller rows of one run are gathered into one piece of at
most ``CHUNK_MIN`` (copied into the layout's buffers, updated, copied back), since a
kernel call costs microseconds. A step locates its gradients once per dtype
(``GradientTable``), checks them all for NaN and infinity before any write (C6, one read,
which also gathers the small ones), then hands ``run`` each run of slots that share
coefficients with its ``Batch``: the run's pieces with their views of the state
(``FlatState`` keeps it in one flat buffer per name and dtype), made once per program.

Threads. A run or check of at least ``2 * CHUNK_MIN`` elements shares its pieces among up
to ``tiegrad._threads.count(CORES)`` threads (read at every step: ``TIEGRAD_NUM_THREADS``,
else the threads the host backend has, else the cores), the caller's among them (the
kernels release the GIL), through ``tiegrad._threads.share``.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from types import ModuleType
from typing import Any, NamedTuple

import numpy as np

from .. import _numba, _threads

DTYPES = frozenset({np.dtype(np.float32), np.dtype(np.float64)})
CORES: int = min(
    8, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
)
CHUNK_MIN = 1 << 16  # elements; work under two of these runs on the calling thread


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

    ``at`` >= 0: the rows gathered at ``at`` in the layout's buffers (``lo`` = 0, ``hi``
    their total size); else elements ``lo`` .. ``hi`` of row ``first`` alone.
    """

    first: int
    stop: int
    lo: int
    hi: int
    at: int


def _kernels() -> ModuleType | None:
    """``tiegrad.optim.kernels`` (importing numba), or None (``tiegrad._numba.kernels``)."""
    return _numba.kernels("tiegrad.optim.kernels")


def supports(dtype: np.dtype) -> bool:
    """Whether steps over parameters of ``dtype`` run fused (the switch, numba, ``DTYPES``)."""
    return dtype in DTYPES and _kernels() is not None


class Layout:
    """The fused canonical ``slots`` of one dtype in a program, cut into ``pieces``.

    ``sizes``: each slot's elements; ``runs``: the run each slot belongs to (pieces never
    mix runs: ``of_run`` lists each run's pieces). ``gradients`` and ``params`` are the
    gather buffers, reused by every step of the program.
    """

    def __init__(
        self, slots: Sequence[int], sizes: Sequence[int], runs: Sequence[int], dtype: np.dtype
    ) -> None:
        self.slots = list(slots)
        self.size = int(sum(sizes))
        self.pieces: list[Piece] = []
        gathered, k = 0, 0
        while k < len(sizes):
            n, stop = sizes[k], k + 1
            if n > CHUNK_MIN // 4:
                parts = -(-n // (4 * CHUNK_MIN))
                self.pieces += [
                    Piece(k, stop, n * i // parts, n * (i + 1) // parts, -1) for i in range(parts)
                ]
            else:
                while (
                    stop < len(sizes)
                    and runs[stop] == runs[k]
                    and sizes[stop] <= CHUNK_MIN // 4
                    and n + sizes[stop] <= CHUNK_MIN
                ):
                    n, stop = n + sizes[stop], stop + 1
                if stop - k > 1:
                    self.pieces.append(Piece(k, stop, 0, n, gathered))
                    gathered += n
                elif n:
                    self.pieces.append(Piece(k, stop, 0, n, -1))
            k = stop
        self.of_run: dict[int, list[Piece]] = {}
        for piece in self.pieces:
            self.of_run.setdefault(runs[piece.first], []).append(piece)
        self.alone = sorted({pc.first for pc in self.pieces if pc.at < 0})
        self.gradients = np.empty(gathered, dtype)
        self.read_only = _read_only(self.gradients)
        self.params = np.empty(gathered, dtype)


class GradientTable:
    """The validated gradients of one step's fused slots of one dtype (``arrays``, in order).

    ``flat``: the gradient of each row a piece reads alone, as a read-only C-contiguous
    1-D array (a strided one copied), None for gathered rows: ``first_nonfinite``
    gathers those into the layout's ``gradients`` buffer.
    """

    def __init__(self, layout: Layout, arrays: Sequence[np.ndarray]) -> None:
        self.layout = layout
        self.arrays = arrays
        self.flat: list[np.ndarray | None] = [None] * len(arrays)
        for k in layout.alone:
            self.flat[k] = _read_only(arrays[k])

    def first_nonfinite(self) -> int | None:
        """The first slot whose gradient holds a NaN or an infinity, or None (C6).

        One read of every gradient (``kernels.nonfinite``), gathering the small ones.
        """
        layout, flat, arrays = self.layout, self.flat, self.arrays
        pieces, nonfinite = layout.pieces, _kernels().nonfinite
        gathered = layout.read_only
        hits = [False] * len(pieces)

        def check(i: int) -> None:
            first, stop, lo, hi, at = pieces[i]
            if at < 0:
                hits[i] = nonfinite(flat[first][lo:hi])
            else:
                np.concatenate(arrays[first:stop], axis=None, out=layout.gradients[at : at + hi])
                hits[i] = nonfinite(gathered[at : at + hi])

        _share(check, len(pieces), layout.size)
        for piece, hit in zip(pieces, hits):
            for k in range(piece.first, piece.stop) if hit else ():
                if not np.isfinite(arrays[k]).all():
                    return layout.slots[k]
        return None


class Batch:
    """The fixed operands of ``rule``'s kernel over the run ``run`` of ``layout``, per program.

    ``rows``: the run's rows in the layout, in the run's order; ``shapes``: their
    parameters' shapes; ``state``: ``{name: (flat buffer, element offset of each row's
    tensor)}`` for the names the coefficients need. Each call (``calls``) is a piece with
    its row in the run, its state views (empty for a tensor that is absent) and, for a
    gathered piece, its views of the layout's buffers and one view per row for copying
    the parameters back. Valid for as long as those buffers and offsets are: the life
    of a step plan's program (``optim.plan``). ``written``: the owners of the memory the
    latest call wrote and the parameter arrays it found them for.
    """

    def __init__(
        self,
        rule: FusedRule,
        layout: Layout,
        run: int,
        rows: Sequence[int],
        shapes: Sequence[tuple[int, ...]],
        state: Mapping[str, tuple[np.ndarray, np.ndarray]],
    ) -> None:
        self.kernel = getattr(_kernels(), rule.kernel)
        self.buffers = [buf for buf, _ in state.values()]
        empty = np.empty(0, layout.params.dtype)
        index = {row: i for i, row in enumerate(rows)}
        self.rows = [(index[row], row) for row in layout.alone if row in index]
        self.calls = []
        for first, stop, lo, hi, at in layout.of_run.get(run, []):
            i = index[first]
            views = tuple(
                _span(*state[name], i, lo, hi) if name in state else empty for name in rule.state
            )
            gathered = None
            if at >= 0:
                params = layout.params[at : at + hi]
                starts = np.cumsum([0, *(int(np.prod(s)) for s in shapes[i : i + stop - first])])
                back = [params[a:b].reshape(s) for a, b, s in zip(starts, starts[1:], shapes[i:])]
                gathered = (params, layout.read_only[at : at + hi], back)
            self.calls.append((i, stop - first, lo, hi, views, gathered))
        self.size = sum(hi - lo for _, _, lo, hi, _, _ in self.calls)
        self.written: tuple[list[np.ndarray], dict[int, list[np.ndarray]] | None] | None = None


def run(batch: Batch, coefficients: tuple, params: list[np.ndarray], grads: GradientTable) -> None:
    """Update ``params`` and their state in place with ``batch``'s kernel, one pass.

    ``params``: the run's writable C-contiguous arrays of one dtype in ``DTYPES``, of the
    shapes ``batch`` was built for; ``grads``: the step's gradient table, checked
    (``first_nonfinite``). A gradient read alone that shares memory with anything
    written is copied first.
    """
    kernel, calls = batch.kernel, batch.calls
    flat_params: list[Any] = [None] * len(params)
    flat_grads: list[Any] = [None] * len(params)
    owners = _owners(batch, params)
    for i, row in batch.rows:
        flat_params[i] = params[i].reshape(-1)
        g = grads.flat[row]
        flat_grads[i] = _read_only(g.copy()) if _overlaps(g, owners, params, batch) else g

    def call(k: int) -> None:
        i, count, lo, hi, state, gathered = calls[k]
        if gathered is None:
            kernel(flat_params[i][lo:hi], flat_grads[i][lo:hi], *state, *coefficients)
            return
        p, g, back = gathered
        np.concatenate(params[i : i + count], axis=None, out=p)
        kernel(p, g, *state, *coefficients)
        any(map(np.copyto, params[i : i + count], back))

    _share(call, len(calls), batch.size)


def _span(buffer: np.ndarray, starts: np.ndarray, i: int, lo: int, hi: int) -> np.ndarray:
    """Elements ``lo`` .. ``hi`` of the tensor in ``buffer`` that starts at ``starts[i]``."""
    start = int(starts[i])
    return buffer[start + lo : start + hi]


def _read_only(a: np.ndarray) -> np.ndarray:
    """``a`` as a read-only C-contiguous 1-D array: a view, or a copy where ``a`` is strided.

    The one type the kernels are given what they only read: one specialisation each.
    """
    flat = np.ascontiguousarray(a).reshape(-1)
    if flat.flags.writeable:
        flat = flat.view()
        flat.flags.writeable = False
    return flat


def _owner(a: np.ndarray) -> np.ndarray | None:
    """The array owning ``a``'s memory, or None where another object does (a foreign buffer)."""
    while isinstance(a.base, np.ndarray):
        a = a.base
    return a if a.base is None else None


def _owners(batch: Batch, params: list[np.ndarray]) -> dict[int, list[np.ndarray]] | None:
    """``{id of an owner: the arrays written in its memory}`` for ``params`` and ``batch``'s
    state; None where one of them lives in a foreign buffer. Kept while ``params`` are
    the same arrays."""
    last = batch.written
    if (
        last is not None
        and len(last[0]) == len(params)
        and all(a is b for a, b in zip(last[0], params))
    ):
        return last[1]
    owners: dict[int, list[np.ndarray]] | None = {}
    for a in [*params, *batch.buffers]:
        owner = _owner(a)
        if owner is None:
            owners = None
            break
        owners.setdefault(id(owner), []).append(a)
    batch.written = (list(params), owners)
    return owners


def _overlaps(
    g: np.ndarray, owners: dict[int, list[np.ndarray]] | None, params: list, batch: Batch
) -> bool:
    """Whether the gradient ``g`` may share memory with a parameter or state buffer written."""
    owner = _owner(g)
    if owners is None or owner is None:
        candidates = [*params, *batch.buffers]
    else:
        candidates = owners.get(id(owner), [])
    return any(np.may_share_memory(g, a) for a in candidates)


def _share(work: Callable[[int], None], n: int, size: int) -> None:
    """``work(i)`` for ``i`` in ``range(n)``: ``size`` elements in all, on threads when large."""
    threads = min(_threads.count(CORES), size // CHUNK_MIN)
    _threads.share(work, n, threads)
