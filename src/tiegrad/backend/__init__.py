"""Array backends. ``NUMPY`` (host) is the default; the torch backend is optional."""

from .base import Array, Backend, DType, Shape
from .numpy_backend import NUMPY, NumpyBackend

__all__ = [
    "Array",
    "Backend",
    "DType",
    "NUMPY",
    "NumpyBackend",
    "Shape",
    "device_backend",
    "dtype_name",
]


def dtype_name(x: Array) -> str:
    """The NumPy-style dtype name of a NumPy array or torch tensor (``"float32"``)."""
    return str(x.dtype).removeprefix("torch.")


def device_backend(device: str) -> Backend:
    """The backend for a device name (``"cuda"``, ``"mps"``, ``"torch:cpu"``)."""
    from ..errors import DeviceError

    raise DeviceError(f"unknown device {device!r}: expected 'cpu', 'cuda', 'mps' or 'torch:cpu'")
