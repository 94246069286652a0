"""``Param``: a handle on a ``ParameterStorage`` with its own trainability flag and name."""

from __future__ import annotations

from typing import Any

import numpy as np

from .._checks import flag
from .._hints import missing_attribute
from ..errors import DTypeError
from .storage import ParameterStorage

_HINTS = {
    "data": "p.value is the host value (read-only), p.set_value(x) replaces it",
    "detach": "p.value is the host value (read-only); np.array(p.value) is a copy",
    "numpy": "p.value is the host value (read-only); np.array(p.value) is a copy",
    "item": "p.value.item() reads a one-element parameter",
    "tolist": "p.value.tolist()",
    "copy_": "p.set_value(x) replaces the value (shape and dtype checked, C6)",
    "zero_": "p.set_value(np.zeros(p.shape, p.dtype))",
    "fill_": "p.set_value(np.full(p.shape, x, p.dtype))",
    "cuda": "p.to('cuda') mirrors the storage on the device (every handle on it moves)",
    "cpu": "p.to('cpu') syncs the storage and drops its device mirror",
    "data_ptr": "a tie is storage identity: p.storage is q.storage (C1)",
    "grad_fn": "a Param is a storage handle, not a recorded value: session.use(p) records a use",
    "is_leaf": "a Param is a storage handle, not a recorded value: session.use(p) records a use",
}


class Param:
    """A parameter handle. Several handles may share one storage (a tie, C1).

    ``Param(value)`` copies ``value`` into a new storage, so NumPy views never create
    hidden aliases (C1). One dtype rule: a value that has a dtype (a NumPy array, a
    NumPy scalar such as ``np.float64(1.5)``, a torch tensor, detached first) keeps it
    and must be floating; Python numbers and lists become float32, as in PyTorch.
    ``requires_grad`` and ``name`` belong to the handle: a frozen alias of a trainable
    handle shares the storage but contributes no gradient (C4, C5). A module path holds
    its own handle (``tiegrad.nn.Module``), so a flag set through one path of a tie
    freezes that use alone; ``holder`` is ``(weak reference to the module, attribute)``
    that holds this handle, kept by the module, or None. A copy or a pickle of a handle
    has no holder (its module, copied with it, gives it one).
    """

    __slots__ = ("storage", "requires_grad", "name", "holder")

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
        self.holder: Any = None

    @classmethod
    def of_storage(
        cls, storage: ParameterStorage, requires_grad: bool = True, name: str | None = None
    ) -> Param:
        """A new handle on an existing storage (no copy)."""
        p = cls.__new__(cls)
        p.storage = storage
        p.requires_grad = bool(requires_grad)
        p.name = name
        p.holder = None
        return p

    def alias(self, requires_grad: bool | None = None, name: str | None = None) -> Param:
        """Another handle on the same storage; flags and name default to this handle's."""
        return Param.of_storage(
            self.storage,
            self.requires_grad if requires_grad is None else requires_grad,
            self.name if name is None else name,
        )

    def __getstate__(self) -> tuple[None, dict[str, Any]]:
        return None, {"storage": self.storage, "requires_grad": self.requires_grad,
                      "name": self.name}  # fmt: skip

    def __setstate__(self, state: tuple[None, dict[str, Any]]) -> None:
        for key, value in state[1].items():
            setattr(self, key, value)
        self.holder = None

    def requires_grad_(self, requires_grad: bool = True) -> Param:
        """Set this handle's ``requires_grad`` (a bool); returns self, as in PyTorch.

        The flag is this use's (C4, C5): other handles on the storage keep theirs.
        """
        self.requires_grad = flag(self._label(), "requires_grad", requires_grad)
        return self

    @property
    def grad(self) -> Any:
        """The storage's summed gradient from the calling thread's latest ``backward``.

        The sum over the trainable uses of this handle's storage that the latest
        backward (``loss.backward()`` or ``session.backward(loss)``) recorded (C4), read
        only: the very array that backward produced for a storage used once, a device
        tensor on a device session. None before any backward, after
        ``optimizer.zero_grad()``, and where that backward reached no trainable use of
        the storage. Frozen handles of a trained storage read the same sum: the storage
        is what the step updates.
        """
        from ..session import latest_gradients

        gradients = latest_gradients()
        return None if gradients is None else gradients.storage_gradient(self.storage)

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

    def __getattr__(self, name: str) -> Any:
        """Only names found nowhere else: a PyTorch habit gets tiegrad's way in the error."""
        raise missing_attribute("Param", name, _HINTS)

    def __repr__(self) -> str:
        flag = "" if self.requires_grad else ", frozen"
        name = f"{self.name!r}, " if self.name else ""
        return f"Param({name}shape={self.shape}, dtype={self.dtype.name}{flag})"


def parameter_of_storage(storage: ParameterStorage) -> Param:
    """A trainable handle over ``storage``'s cells, for synchronisation helpers."""
    return Param.of_storage(storage)
