"""``ParameterStorage``: the mutable cell behind one or more parameter handles.

A storage holds a host value (a read-only NumPy array), an optional device mirror and
a host-current flag (C7). Its identity is the identity of this object: two storages
with equal contents are distinct (C1), and nothing here ever compares values.

Snapshots are free (C2): a tape leaf holds a reference to the current host array.
The storage never writes into an array that a live tape holds; updates go to a copy
then (copy-on-write) and are done in place only when nothing pins the array.
"""

from __future__ import annotations

import weakref
from typing import Any

import numpy as np

from ..errors import DTypeError, ShapeError


def check_host_array(what: str, value: Any, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
    """``value`` as an array of ``shape`` and ``dtype``, or a Shape/DType error naming ``what``.

    An ndarray must already have ``dtype``; lists and numbers are converted to it.
    """
    if isinstance(value, np.ndarray):
        if value.dtype != dtype:
            raise DTypeError(f"{what}: expected dtype {dtype.name}, got {value.dtype.name}")
        arr = value
    else:
        arr = np.asarray(value, dtype=dtype)
    if arr.shape != shape:
        raise ShapeError(f"{what}: expected shape {shape}, got {arr.shape}")
    return arr


class ParameterStorage:
    """One mutable parameter cell: host value, optional device mirror, host-current flag.

    ``shape`` and ``dtype`` are fixed at creation. Create storages through ``Param``;
    the constructor takes ownership of ``value`` without copying it.
    """

    __slots__ = ("shape", "dtype", "_host", "_mirror", "_host_current", "_pins", "__weakref__")

    def __init__(self, value: np.ndarray) -> None:
        if not np.issubdtype(value.dtype, np.floating):
            raise DTypeError(f"a parameter needs a floating dtype, got {value.dtype.name}")
        self.shape: tuple[int, ...] = tuple(value.shape)
        self.dtype: np.dtype = value.dtype
        value.flags.writeable = False
        self._host = value
        self._mirror: Any = None
        self._host_current = True
        self._pins: list[tuple[weakref.ref, int]] = []

    def __repr__(self) -> str:
        return f"ParameterStorage(shape={self.shape}, dtype={self.dtype.name}, id=0x{id(self):x})"

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
        arr = self._host
        arr.flags.writeable = True
        return arr

    def commit_host(self, arr: np.ndarray) -> None:
        """Install an owned array of the right shape and dtype as the host value.

        Releases the mirror (dereferenced, never freed: leaves may share it) and marks
        the host current (C7). Callers validate ``arr`` before calling.
        """
        self._install_host(arr)
        self._mirror = None
        self._host_current = True

    def _install_host(self, arr: np.ndarray) -> None:
        if arr is not self._host:
            self._pins = []
        arr.flags.writeable = False
        self._host = arr

    # -- tape side -------------------------------------------------------------------
    def _value_for(self, session: Any) -> Any:
        """The value a use in ``session`` snapshots (C2); pins it against in-place writes."""
        self.sync()
        pins = self._pins
        if not pins or pins[-1][0]() is not session or pins[-1][1] != session._generation:
            pins.append((weakref.ref(session), session._generation))
        return self._host

    def _pinned(self) -> bool:
        live = [
            (ref, gen)
            for ref, gen in self._pins
            if (s := ref()) is not None and s._generation == gen
        ]
        self._pins = live
        return bool(live)

    def _mirror_to_numpy(self) -> np.ndarray:
        m = self._mirror
        return m.detach().cpu().numpy() if hasattr(m, "detach") else np.asarray(m)
