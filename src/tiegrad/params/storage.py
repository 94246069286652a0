"""``ParameterStorage``: the mutable cell behind one or more parameter handles.

A storage holds a host value (a read-only NumPy array), an optional device mirror and
a host-current flag (C7). Its identity is the identity of this object: two storages
with equal contents are distinct (C1), and nothing here ever compares values.

Snapshots are free (C2): a tape leaf holds a reference to the current host array.
The storage never writes into an array that a live tape holds; updates go to a copy
then (copy-on-write) and are done in place only when nothing pins the array.

Device mirrors (C7): a use in a device session takes the current mirror and uploads
only when there is none; a device write (``set_device_value``, device optimizers)
marks the host stale; a host write releases the mirror by dereference, never by
freeing it, since leaves may share it. A mirror is pinned by device tapes exactly as
the host array is by host tapes. ``uploads`` and ``downloads`` count transfers.
"""

from __future__ import annotations

import weakref
from typing import Any

import numpy as np

from ..backend import NUMPY, Backend, backend_of, device_backend, dtype_name
from ..errors import DeviceError, DTypeError, ShapeError
from .rows import TrainedRows, checked_rows

HOST_DEVICES = (None, "cpu", "host", "numpy")


def check_host_array(what: str, value: Any, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
    """``value`` as an array of ``shape`` and ``dtype``, or a Shape/DType error naming ``what``.

    An array (anything with a ``dtype``: ndarray, NumPy scalar, torch tensor) must already
    have ``dtype``, in either byte order (the other one is converted, exactly); lists and
    Python numbers are converted to it (C6). An ndarray subclass (``np.matrix``) is read
    as a plain array.
    """
    if isinstance(value, np.ndarray):
        if value.dtype != dtype:
            if value.dtype.newbyteorder("=") != dtype:
                raise DTypeError(f"{what}: expected dtype {dtype.name}, got {value.dtype.name}")
            value = value.astype(dtype)
        arr = value if type(value) is np.ndarray else np.asarray(value)
    else:
        if hasattr(value, "dtype") and dtype_name(value) != dtype.name:
            raise DTypeError(f"{what}: expected dtype {dtype.name}, got {dtype_name(value)}")
        try:
            arr = np.asarray(value, dtype=dtype)
        except (TypeError, ValueError) as e:
            raise DTypeError(
                f"{what}: expected an array of shape {shape} and dtype {dtype.name}, "
                f"got a {type(value).__name__} that does not convert ({e})"
            ) from None
    if arr.shape != shape:
        raise ShapeError(f"{what}: expected shape {shape}, got {arr.shape}")
    return arr


class ParameterStorage:
    """One mutable parameter cell: host value, optional device mirror, host-current flag.

    ``shape`` and ``dtype`` are fixed at creation. The constructor copies ``value`` (an
    array of a floating dtype), so the caller's array never aliases the storage (C1);
    ``adopting`` takes ownership of an array its caller made (``Param`` does, after its
    own copy). The storage keeps its array writable for in-place updates and hands out
    ``host``, a read-only view of it, so that an update needs no flag change. A value in
    non-native byte order (``'>f4'`` on a little-endian machine) is converted: the
    storage's ``dtype`` is native, as every array tiegrad computes is.
    """

    __slots__ = (
        "shape",
        "dtype",
        "_host",
        "_owned",
        "_mirror",
        "_host_current",
        "_pins",
        "_mirror_pins",
        "_checked",
        "_uploads",
        "_downloads",
        "rows_cell",
        "__weakref__",
    )

    def __init__(self, value: np.ndarray) -> None:
        self._adopt(np.array(value))

    @classmethod
    def adopting(cls, value: np.ndarray) -> ParameterStorage:
        """A storage that owns ``value`` itself, without a copy: for a caller that made the
        array and keeps no other reference to it (as ``commit_host`` takes its value)."""
        storage = cls.__new__(cls)
        storage._adopt(value)
        return storage

    def _adopt(self, value: np.ndarray) -> None:
        if not np.issubdtype(value.dtype, np.floating):
            raise DTypeError(f"a parameter needs a floating dtype, got {value.dtype.name}")
        if not value.dtype.isnative:
            value = value.astype(value.dtype.newbyteorder("="))
        self.shape: tuple[int, ...] = tuple(value.shape)
        self.dtype: np.dtype = value.dtype
        self._owned, self._host = _owned_and_view(value)
        self._mirror: Any = None
        self._host_current = True
        self._pins: list[tuple[weakref.ref, int]] = []
        self._mirror_pins: list[tuple[weakref.ref, int]] = []
        # (mirror, backend) of the latest mirror check that passed: reading the same
        # mirror on the same backend again needs no new check (an identity compare).
        self._checked: tuple[Any, Backend] | None = None
        self._uploads = 0
        self._downloads = 0
        # the row mask (params.rows): what an optimizer updates in place of this storage
        self.rows_cell: TrainedRows | None = None

    def __repr__(self) -> str:
        return f"ParameterStorage(shape={self.shape}, dtype={self.dtype.name}, id=0x{id(self):x})"

    def __reduce__(self) -> tuple[type, tuple[np.ndarray], np.ndarray | None]:
        """A copy (``copy``, ``deepcopy``, ``pickle``) is a new storage of the current host
        value (a newer mirror synced first, C7) and row mask, with no mirror and no pins:
        an update of one never reaches the other. ``deepcopy`` copies a storage once, so
        the ties of a module copied whole stay ties in the copy (C1)."""
        return (ParameterStorage, (self.current_host_value(),), self.trained_rows)

    def __setstate__(self, rows: np.ndarray | None) -> None:
        if rows is not None:
            self.train_rows(rows)

    # -- row mask (params.rows) ----------------------------------------------------------
    @property
    def trained_rows(self) -> np.ndarray | None:
        """The rows an optimizer updates (ascending, read-only), or None: every row."""
        return None if self.rows_cell is None else self.rows_cell.rows

    def train_rows(self, rows: Any, what: str = "train_rows") -> None:
        """Let optimizers update only ``rows`` of this storage (``params.rows.checked_rows``
        forms; None: every row again). The mask is the storage's, so every use of a tie
        sees it (C1); the other rows never change. Checked before it is set (C6)."""
        if rows is None:
            self.rows_cell = None
            return
        checked = checked_rows(f"{what} of {self!r}", rows, self.shape)
        old = self.trained_rows
        if old is None or not np.array_equal(old, checked):
            self.rows_cell = TrainedRows(self, checked)

    # -- host side -------------------------------------------------------------------
    @property
    def host(self) -> np.ndarray:
        """The host value, read-only, without syncing a newer mirror (C7)."""
        return self._host

    @property
    def host_current(self) -> bool:
        """False while the device mirror is newer than the host value (C7)."""
        return self._host_current

    @property
    def mirror(self) -> Any:
        """The device mirror, or None."""
        return self._mirror

    @property
    def device(self) -> str | None:
        """The device of the mirror (``"cuda"``, ``"torch:cpu"``...), or None without one."""
        return None if self._mirror is None else backend_of(self._mirror).device

    @property
    def uploads(self) -> int:
        """How many times the host value was uploaded to make a mirror (C7)."""
        return self._uploads

    @property
    def downloads(self) -> int:
        """How many times a newer mirror was downloaded to the host (C7)."""
        return self._downloads

    def sync(self) -> None:
        """Make the host current: download a newer mirror; the mirror is kept (C7)."""
        if self._host_current:
            return
        if self._mirror is not None:
            host = np.array(self._mirror_to_numpy(), dtype=self.dtype, copy=True)
            if host.shape != self.shape:
                raise ShapeError(
                    f"sync: the device mirror has shape {host.shape}, expected {self.shape}"
                )
            self._install_host(host)
            self._downloads += 1
        self._host_current = True

    def current_host_value(self) -> np.ndarray:
        """The current value on the host, syncing a newer mirror first (C3, C7)."""
        self.sync()
        return self._host

    def write_host(self, value: Any, what: str = "set_value") -> None:
        """Replace the host value by a copy of ``value`` (shape and dtype checked first).

        Releases the mirror and marks the host current (C7). Leaves recorded earlier
        keep the old array (C2).
        """
        arr = check_host_array(what, value, self.shape, self.dtype)
        self.commit_host(np.array(arr, copy=True))

    def host_for_update(self) -> np.ndarray:
        """A writable array holding the current value, for an in-place update.

        The host array itself when no live tape holds it, otherwise a copy
        (copy-on-write, C2). Pass the result to ``commit_host`` when done.
        """
        self.sync()
        if self._pinned():
            return self._host.copy()
        return self._owned

    def commit_host(self, arr: np.ndarray) -> None:
        """Install an owned array of the right shape and dtype as the host value.

        Releases the mirror (dereferenced, never freed: leaves may share it) and marks
        the host current (C7). Callers validate ``arr`` before calling.
        """
        self._install_host(arr)
        self._release_mirror()
        self._host_current = True

    def _install_host(self, arr: np.ndarray) -> None:
        if arr is not self._owned:
            self._pins = []
            self._owned, self._host = _owned_and_view(arr)

    # -- device side (C7) -------------------------------------------------------------
    def device_value(self, backend: Backend) -> Any:
        """The current value on ``backend``'s device: the mirror, uploaded only if there is none.

        A mirror on another device, a mirror of the wrong shape or dtype, and a stale
        host without a mirror are errors, raised before anything changes (C7).
        """
        m = self._mirror
        if m is not None:
            checked = self._checked
            if checked is None or checked[0] is not m or checked[1] is not backend:
                self._check_mirror("device value", m, backend)
                self._checked = (m, backend)
            return m
        if not self._host_current:
            raise DeviceError(
                f"device value of {self!r}: the host value is stale and there is no mirror "
                "to read the current value from"
            )
        m = backend.upload(self._host)
        self._uploads += 1
        self._mirror = m
        self._mirror_pins = []
        self._checked = (m, backend)
        return m

    def device_for_update(self, backend: Backend) -> Any:
        """A writable tensor holding the current device value, for an in-place update.

        The mirror itself when no live device tape holds it, otherwise a copy
        (copy-on-write, C2). Starts from the current mirror and uploads only when there
        is none (C3, C7). Pass the result to ``commit_device`` when done.
        """
        m = self.device_value(backend)
        return backend.copy(m) if _prune(self._mirror_pins) else m

    def commit_device(self, value: Any) -> None:
        """Install an owned device tensor as the mirror; the host becomes stale (C7).

        Callers validate ``value`` (shape, dtype, device) before calling.
        """
        if value is not self._mirror:
            self._mirror_pins = []
            self._checked = None
        self._mirror = value
        self._host_current = False

    def set_device_value(self, value: Any, what: str = "set_device_value") -> None:
        """Replace the value by a copy of device tensor ``value``: a device write (C7).

        Shape, dtype and that ``value`` lives on a device are checked first (C6). The
        new mirror is newer than the host until a ``sync``.
        """
        bk = backend_of(value)
        if bk is NUMPY:
            raise DeviceError(
                f"{what}: expected a device tensor for {self!r}, got a host array "
                "(host values are written with set_value)"
            )
        self._check_mirror(what, value, bk)
        self.commit_device(bk.upload(value))

    def to(self, device: str | None) -> ParameterStorage:
        """Keep the value on ``device``: upload a mirror there, or for ``"cpu"`` drop it.

        A mirror already on ``device`` is kept (no transfer). A newer mirror on another
        device is synced to the host first, then the host is uploaded. Moving to the
        host syncs a newer mirror and releases the mirror (C7). Returns ``self``.
        """
        if device in HOST_DEVICES:
            self.sync()
            self._release_mirror()
            return self
        bk = device_backend(device)
        m = self._mirror
        if m is not None and backend_of(m) is bk:
            self._check_mirror(f"to({device!r})", m, bk)
            return self
        self.sync()
        self._release_mirror()
        self.device_value(bk)
        return self

    def _check_mirror(self, what: str, value: Any, backend: Backend) -> None:
        if not backend.is_array(value):
            raise DeviceError(
                f"{what}: {self!r} has a value on device {backend_of(value).device!r}, "
                f"expected {backend.device!r} (move it with Param.to)"
            )
        if value.shape != self.shape:
            raise ShapeError(
                f"{what}: the device value has shape {tuple(value.shape)}, expected {self.shape}"
            )
        if value.dtype != backend.to_dtype(self.dtype):
            raise DTypeError(
                f"{what}: the device value has dtype {dtype_name(value)}, "
                f"expected {self.dtype.name}"
            )

    def _release_mirror(self) -> None:
        """Drop the mirror reference (never freed in place: leaves may share it, C7)."""
        self._mirror = None
        self._mirror_pins = []
        self._checked = None

    # -- tape side -------------------------------------------------------------------
    def _value_for(self, session: Any) -> Any:
        """The value a use in ``session`` snapshots (C2); pins it against in-place writes.

        A host session reads the host after syncing a newer mirror; a device session
        takes the mirror, uploading only when there is none (C7). Pins of reset or
        collected sessions are dropped when a new pin is added, so repeated uses
        across resets or sessions keep the pin list small.
        """
        if session.backend is not NUMPY:
            m = self.device_value(session.backend)
            _add_pin(self._mirror_pins, session)
            return m
        self.sync()
        _add_pin(self._pins, session)
        return self._host

    def _pinned(self) -> bool:
        return _prune(self._pins)

    def _mirror_to_numpy(self) -> np.ndarray:
        m = self._mirror
        return m.detach().cpu().numpy() if hasattr(m, "detach") else np.asarray(m)


def _owned_and_view(arr: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``arr`` made writable (a copy where it cannot be) and a read-only view of it: a
    storage updates the first in place and hands out the second."""
    if not arr.flags.writeable:
        try:
            arr.setflags(write=True)
        except ValueError:  # a view of read-only memory
            arr = arr.copy()
    view = arr.view()
    view.setflags(write=False)
    return arr, view


def _prune(pins: list[tuple[weakref.ref, int]]) -> bool:
    """Drop pins of collected or reset sessions, in place; whether any live pin remains."""
    if not pins:
        return False
    pins[:] = [(ref, gen) for ref, gen in pins if (s := ref()) is not None and s._generation == gen]
    return bool(pins)


def _add_pin(pins: list[tuple[weakref.ref, int]], session: Any) -> None:
    """Pin a value for ``session``'s current tape (C2), once per session and generation."""
    gen = session._generation
    if pins:  # none is the common case: an update pruned the pins of the last step's tape
        ref, last = pins[-1]
        if ref() is session and last == gen:
            return
        if any(ref() is session and g == gen for ref, g in pins):
            return
        _prune(pins)
    pins.append((weakref.ref(session), gen))
