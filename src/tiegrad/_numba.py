"""numba, the compiler of tiegrad's fused host kernels (a default dependency where it has wheels).

Two kernel modules need it: ``tiegrad.optim.kernels`` (optimizer updates) and
``tiegrad.backend.host_kernels`` (GELU, layer norm, softmax rows and their VJPs).
``ENABLED`` is the one switch for compiled kernels: false
when the environment sets ``TIEGRAD_NO_NUMBA`` to anything but ``""`` or ``"0"`` (read at
import), or when a program sets it to False; the NumPy code paths then run
everywhere. ``kernels`` is how every caller asks: the kernel module, or None where the
switch is off or numba is missing or fails to import (with one warning), so the library
runs the same without it, only slower.

``before_first_use`` lets the ``tiegrad`` command make the first ``kernels`` call for a
module wait until a child process has compiled that module's kernels into numba's cache
(``tiegrad.train.precompile``); nothing registers a wait on import.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import os
import threading
import warnings
from collections.abc import Callable
from types import ModuleType
from typing import Any

ENV_SWITCH = "TIEGRAD_NO_NUMBA"
ENABLED: bool = os.environ.get(ENV_SWITCH, "") in ("", "0")

_first_use: dict[str, Callable[[], None]] = {}  # module -> what to wait for before using it
_first_use_lock = threading.Lock()


def kernels(module: str) -> ModuleType | None:
    """The kernel module ``module`` (absolute name) where ``ENABLED``, else None.

    The switch is read at every call; the import (which compiles or loads the kernels)
    happens once. The first call for a module with a wait (``before_first_use``) runs
    the wait before it loads the module; calls from other threads meanwhile wait too.
    """
    if not ENABLED:
        return None
    if _first_use:
        with _first_use_lock:
            wait = _first_use.pop(module, None)
            if wait is not None:
                wait()
    return _load(module)


def before_first_use(module: str, wait: Callable[[], None]) -> None:
    """Make the next ``kernels(module)`` call ``wait()`` (once) before it returns: the
    command waits there for the child process compiling ``module``'s kernels."""
    _first_use[module] = wait


@functools.cache
def _load(module: str) -> ModuleType | None:
    """Import the kernel module ``module``, or None without numba."""
    if importlib.util.find_spec("numba") is None:
        return None
    try:
        return importlib.import_module(module)
    except ImportError as e:  # e.g. a numba release that does not support this NumPy
        warnings.warn(
            f"tiegrad: numba is installed but does not import ({e}); {module} is not used "
            f"and the NumPy code runs instead",
            RuntimeWarning,
            stacklevel=3,
        )
        return None


def jit(**options: Any) -> Any:
    """A decorator: ``numba.njit(**options)`` with the on-disk cache where one is usable.

    The cache lives next to the module, or in the user's cache directory when that is
    not writable (numba's own fallback); without either the kernel compiles in every
    process.
    """
    import numba

    return _cached(lambda cache: numba.njit(cache=cache, **options))


def _cached(decorator: Callable[[bool], Any]) -> Any:
    """A decorator applying ``decorator(True)``, or ``decorator(False)`` without a cache."""

    def wrap(func: Any) -> Any:
        try:
            return decorator(True)(func)
        except RuntimeError:  # no writable cache location
            return decorator(False)(func)

    return wrap
