"""Array backends. ``NUMPY`` (host) is the default; the torch backend is optional."""

from .base import Array, Backend, DType, Shape
from .numpy_backend import NUMPY, NumpyBackend
from .tuning import tune_process

__all__ = [
    "Array",
    "Backend",
    "DType",
    "NUMPY",
    "NumpyBackend",
    "Shape",
    "backend_of",
    "device_backend",
    "dtype_name",
    "tune_process",
]

#: How to install the PyTorch that device sessions and data-parallel training need: the
#: CPU build that ``constraints.txt`` pins (an unpinned ``torch`` pulls a multi-GB CUDA
#: build); a CUDA device needs PyTorch's CUDA build instead.
TORCH_HINT = (
    "pip install -c constraints.txt 'torch==2.13.0', the CPU build tiegrad pins (an "
    "unpinned torch pulls a multi-GB CUDA build; cuda needs PyTorch's CUDA build)"
)


def dtype_name(x: Array) -> str:
    """The NumPy-style dtype name of a NumPy array or torch tensor (``"float32"``)."""
    return str(x.dtype).removeprefix("torch.")


_DEVICE_BACKENDS: dict[str, Backend] = {}


def device_backend(device: str) -> Backend:
    """The torch backend of a device name: ``"cuda"``, ``"cuda:N"``, ``"mps"``, ``"torch:cpu"``.

    One backend per physical device (``"cuda"`` and ``"cuda:0"`` may share one), so
    identity compares devices. An unknown name, a device
    this machine lacks or a missing torch install is a ``DeviceError`` (C7). torch is
    imported here, on first use, never by ``import tiegrad``.
    """
    from ..errors import DeviceError

    bk = _DEVICE_BACKENDS.get(device)
    if bk is not None:
        return bk
    if not isinstance(device, str) or not (
        device in ("torch:cpu", "mps", "cuda") or (device[:5] == "cuda:" and device[5:].isdigit())
    ):
        raise DeviceError(
            f"unknown device {device!r}: expected 'cpu', 'cuda', 'cuda:N', 'mps' or 'torch:cpu'"
        )
    try:
        from .torch_backend import TorchBackend, torch_device_of
    except ImportError as e:
        raise DeviceError(f"device {device!r} needs PyTorch ({e}): {TORCH_HINT}") from None
    tdev = torch_device_of(device)
    key = str(tdev)
    bk = _DEVICE_BACKENDS.get(key)
    if bk is None:
        bk = _DEVICE_BACKENDS[key] = TorchBackend(device, tdev)
    _DEVICE_BACKENDS[device] = bk
    return bk


def backend_of(x: Array) -> Backend:
    """The backend an array belongs to: ``NUMPY`` for host arrays, else its device backend.

    A torch tensor maps to ``"torch:cpu"``, ``"cuda:N"`` or ``"mps"`` by its device.
    Anything else is a ``DeviceError``.
    """
    from ..errors import DeviceError

    if NUMPY.is_array(x):
        return NUMPY
    if type(x).__module__.partition(".")[0] == "torch":
        dev = x.device
        if dev.type == "cpu":
            return device_backend("torch:cpu")
        if dev.type == "cuda":
            return device_backend(f"cuda:{dev.index or 0}")
        return device_backend(dev.type)
    raise DeviceError(f"expected a NumPy array or a torch tensor, got {type(x).__name__}")
