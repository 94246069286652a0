"""Row masks: the rows of a storage that train; the others never change.

A storage may carry a row mask (``ParameterStorage.train_rows``): the rows, along its
first axis, that an optimizer updates. It belongs to the storage, so both uses of a tied
embedding see it (C1). The optimizer steps the storage's ``TrainedRows`` instead of the
storage: a cell of shape ``(rows, *rest)`` that gathers those rows to update them and
writes back those rows alone. So, for every update rule, on the host and on a device:

- the other rows are never written: bit-identical after any number of steps;
- the gradient the optimizer resolves for the storage is that of the trained rows
  (``Optimizer.canonical_gradients``), so gradient clipping sums only them;
- optimizer state has the cell's shape (state for the trained rows only), and weight
  decay and momentum reach only them.

A row mask is an ascending array of distinct row indices; ``checked_rows`` accepts the
forms a PyTorch user has at hand (indices, a boolean mask, a ``range``) and refuses
anything else before anything changes (C6).
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from typing import Any

import numpy as np

from ..backend import backend_of
from ..errors import DTypeError, ShapeError, SlotError, shown_list


def checked_rows(what: str, rows: Any, shape: tuple[int, ...]) -> np.ndarray:
    """``rows`` as an ascending, read-only ``intp`` array of distinct rows of ``shape``.

    ``rows``: integer indices (any order; a negative one counts from the end, as in
    NumPy), a boolean mask of one flag per row, or a ``range``. A storage without a first
    axis, an empty selection, a repeated row, a row out of range and a mask of another
    length are errors naming ``what`` and the expected value (C6).
    """
    if not shape:
        raise ShapeError(f"{what}: a row mask needs a storage with rows, got shape ()")
    n = shape[0]
    arr = np.asarray(list(rows) if isinstance(rows, range) else rows)
    if arr.ndim != 1:
        raise ShapeError(f"{what}: expected a 1-D list of rows, got shape {arr.shape}")
    if arr.dtype == np.bool_:
        if arr.size != n:
            raise ShapeError(f"{what}: a boolean row mask needs {n} flags, got {arr.size}")
        arr = np.flatnonzero(arr)
    elif arr.size and arr.dtype.kind not in "iu":
        raise DTypeError(f"{what}: expected integer rows or a boolean mask, got {arr.dtype.name}")
    if arr.size == 0:
        raise SlotError(
            f"{what}: the row mask selects no row (freeze the parameter instead, or pass "
            f"None to train every row)"
        )
    bad = arr[(arr < -n) | (arr >= n)]
    if bad.size:
        raise SlotError(
            f"{what}: rows {shown_list(bad.tolist())} are outside [-{n}, {n}) (the storage "
            f"has {n} rows)"
        )
    arr = np.where(arr < 0, arr + n, arr).astype(np.intp)
    out = np.unique(arr)
    if out.size != arr.size:
        values, counts = np.unique(arr, return_counts=True)
        raise SlotError(
            f"{what}: rows {shown_list(values[counts > 1].tolist())} are given more than once"
        )
    out.setflags(write=False)
    return out


class TrainedRows:
    """The trained rows of a storage as an optimizer updates them (see the module).

    ``shape`` is ``(len(rows), *storage.shape[1:])`` and ``dtype`` the storage's. The
    update methods are those of ``ParameterStorage`` the optimizer calls
    (``host_for_update``/``commit_host``, ``device_value``, ``device_for_update``/
    ``commit_device``): each reads the storage's current value (C3, C7) and writes
    the trained rows alone back into it.
    """

    __slots__ = ("_storage", "rows", "shape", "dtype", "_device_rows", "__weakref__")

    def __init__(self, storage: Any, rows: np.ndarray) -> None:
        self._storage = weakref.ref(storage)  # the storage holds its cell: no cycle
        self.rows = rows
        self.shape: tuple[int, ...] = (int(rows.size), *storage.shape[1:])
        self.dtype: np.dtype = storage.dtype
        self._device_rows: dict[Any, Any] = {}  # backend -> the rows as a device tensor

    @property
    def storage(self) -> Any:
        """The ``ParameterStorage`` whose rows these are."""
        return self._storage()

    def __repr__(self) -> str:
        return f"TrainedRows({len(self.rows)} of {self.storage.shape[0]} rows of {self.storage!r})"

    def gather(self, full: Any) -> Any:
        """The trained rows of ``full`` (an array or device tensor of the storage's shape),
        a new contiguous array or tensor."""
        if isinstance(full, np.ndarray):
            return full[self.rows]
        return full.index_select(0, self._rows_on(backend_of(full)))

    def trained_part(self, gradient: Any) -> Any:
        """``gradient`` of the trained rows: gathered from a whole-storage gradient,
        anything else as it is (the caller checks it against ``shape``)."""
        if tuple(getattr(gradient, "shape", ())) == self.storage.shape:
            return self.gather(gradient)
        return gradient

    # -- host (C2, C3) -------------------------------------------------------------------
    def host_for_update(self) -> np.ndarray:
        """A writable copy of the trained rows of the current host value."""
        return self.storage.host_for_update()[self.rows]

    def commit_host(self, arr: np.ndarray) -> None:
        """Write ``arr`` (this cell's shape) into the trained rows; the others keep their bits."""
        full = self.storage.host_for_update()
        full[self.rows] = arr
        self.storage.commit_host(full)

    # -- device (C7) ---------------------------------------------------------------------
    def device_value(self, backend: Any) -> Any:
        """The storage's current device value (its mirror, uploaded only if there is none)."""
        return self.storage.device_value(backend)

    def device_for_update(self, backend: Any) -> Any:
        """A new device tensor holding the trained rows of the current device value."""
        return self.storage.device_value(backend).index_select(0, self._rows_on(backend))

    def commit_device(self, value: Any) -> None:
        """Write ``value`` (this cell's shape) into the trained rows of the mirror."""
        backend = backend_of(value)
        full = self.storage.device_for_update(backend)
        full.index_copy_(0, self._rows_on(backend), value)
        self.storage.commit_device(full)

    def _rows_on(self, backend: Any) -> Any:
        rows = self._device_rows.get(backend)
        if rows is None:
            rows = self._device_rows[backend] = backend.upload(self.rows.astype(np.int64))
        return rows


def optimizer_cells(storages: Sequence[Any]) -> list[Any]:
    """What an optimizer updates at each slot: the storage, its ``TrainedRows`` where it
    has a row mask, None at frozen slots (``ParamList.optimizer_storage``'s None)."""
    return [None if st is None else st.rows_cell or st for st in storages]


def subtract_scaled(storage: Any, arr: np.ndarray, lr: float, gradient: np.ndarray) -> None:
    """Plain SGD into ``arr`` (the storage's writable value): ``arr -= lr * gradient``
    on the trained rows of ``storage``'s mask, on every row without one."""
    cell = storage.rows_cell
    if cell is None:
        arr -= lr * gradient
    else:
        arr[cell.rows] -= lr * np.asarray(gradient)[cell.rows]
