"""``Param``: a handle on a ``ParameterStorage`` with its own trainability flag and name."""

from __future__ import annotations

from typing import Any

import numpy as np

from ..errors import DTypeError
from .storage import ParameterStorage


class Param:
    """A parameter handle. Several handles may share one storage (a tie, C1).

    ``Param(value)`` copies ``value`` into a new storage, so NumPy views never create
    hidden aliases (C1). One dtype rule: a value that has a dtype (a NumPy array, a
    NumPy scalar such as ``np.float64(1.5)``, a torch tensor, detached first) keeps it
    and must be floating; Python numbers and lists become float32, as in PyTorch.
    ``requires_grad`` and ``name`` belong to the handle: a frozen alias of a trainable
    handle shares the storage but contributes no gradient (C4, C5).
    """

    __slots__ = ("storage", "requires_grad", "name")

    def __init__(
        self,
        value: Any,
        requires_grad: bool = True,
        name: str | None = None,
        dtype: Any = None,
    ) -> None:
        if callable(getattr(value, "detach", None)):  # a torch tensor, maybe requiring grad
            try:
                value = value.detach().cpu().numpy()
            except TypeError:  # bfloat16 and the other torch types NumPy lacks
                raise DTypeError(
                    f"Param {name!r}: torch dtype {value.dtype} has no NumPy type "
                    "(convert the tensor first, e.g. tensor.float())"
                ) from None
        if hasattr(value, "dtype") or dtype is not None:
            arr = np.array(value, dtype=dtype, copy=True)
        else:
            arr = np.array(value, copy=True)
            if arr.dtype.kind in "fiub":
                arr = arr.astype(np.float32)
        if not np.issubdtype(arr.dtype, np.floating):
            raise DTypeError(f"Param {name!r}: needs a floating dtype, got {arr.dtype.name}")
        self.storage = ParameterStorage.adopting(arr)
        self.requires_grad = bool(requires_grad)
        self.name = name

    @classmethod
    def of_storage(
        cls, storage: ParameterStorage, requires_grad: bool = True, name: str | None = None
    ) -> Param:
        """A new handle on an existing storage (no copy)."""
        p = cls.__new__(cls)
        p.storage = storage
        p.requires_grad = bool(requires_grad)
        p.name = name
        return p

    def alias(self, requires_grad: bool | None = None, name: str | None = None) -> Param:
        """Another handle on the same storage; flags and name default to this handle's."""
        return Param.of_storage(
            self.storage,
            self.requires_grad if requires_grad is None else requires_grad,
            self.name if name is None else name,
        )

    @property
    def shape(self) -> tuple[int, ...]:
        return self.storage.shape

    @property
    def dtype(self) -> np.dtype:
        return self.storage.dtype

    @property
    def size(self) -> int:
        return int(np.prod(self.shape))

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def value(self) -> np.ndarray:
        """The host value as a read-only array, without syncing a mirror (C7).

        A view of the storage's memory, as PyTorch's ``param.data`` is: an optimizer step
        that finds no tape holding it updates it in place, so a value kept across steps
        reads the new one; ``np.array(p.value)`` keeps a copy. A use (``session.use``)
        keeps the value it recorded (C2).
        """
        return self.storage.host

    def value_synced(self) -> np.ndarray:
        """The host value after syncing a newer device mirror (C7)."""
        return self.storage.current_host_value()

    def set_value(self, value: Any) -> None:
        """Replace the value (shape and dtype checked first); releases the mirror (C7)."""
        self.storage.write_host(value, f"set_value of {self._label()}")

    def set_device_value(self, value: Any) -> None:
        """Replace the value by a copy of a device tensor; the host becomes stale (C7)."""
        self.storage.set_device_value(value, f"set_device_value of {self._label()}")

    def to(self, device: str | None) -> Param:
        """Mirror the storage on ``device`` (``"cpu"``: sync and drop the mirror); returns self.

        The storage is shared, so every handle on it moves (C1, C7).
        """
        self.storage.to(device)
        return self

    def get(self) -> np.ndarray:
        """Host read without sync (the handle protocol of ``EagerSession.use``)."""
        return self.storage.host

    def set(self, value: Any) -> None:
        """Same as ``set_value`` (the handle protocol of ``EagerSession.use``)."""
        self.set_value(value)

    def _label(self) -> str:
        return f"parameter {self.name!r}" if self.name else "parameter"

    def __repr__(self) -> str:
        flag = "" if self.requires_grad else ", frozen"
        name = f"{self.name!r}, " if self.name else ""
        return f"Param({name}shape={self.shape}, dtype={self.dtype.name}{flag})"


def parameter_of_storage(storage: ParameterStorage) -> Param:
    """A trainable handle over ``storage``'s cells, for synchronisation helpers."""
    return Param.of_storage(storage)
