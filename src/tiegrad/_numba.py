"""numba, the compiler of tiegrad's fused host kernels (a default dependency where it has wheels).

Three kernel modules need it: ``tiegrad.optim.kernels`` (optimizer updates),
``tiegrad.backend.host_kernels`` (GELU, layer norm, softmax rows and their VJPs) and
``tiegrad.backend.host_blocks`` (those kernels' blocks on numba's threads).
``ENABLED`` is the one switch for compiled kernels: false
when the environment sets ``TIEGRAD_NO_NUMBA`` to anything but ``""`` or ``"0"`` (read at
import), or when a program sets it to False; the NumPy code paths then run
everywhere. ``kernels`` is how every caller asks: the kernel module, or None where the
switch is off or numba is missing or fails to import (with one warning), so the library
runs the same without it, only slower.

``defer`` lets the ``tiegrad`` command hold a kernel module back until its child
process has compiled it into numba's cache (``tiegrad.train.precompile``): ``kernels``
gives a stand-in until then, NumPy code with the kernels' bits (a module of the same
functions, or None where the caller's own NumPy code gives those bits), and ``ready``
lets the kernels in, some at a time (a module with a stand-in) or all at once.
Nothing defers a module on import.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import os
import types
import warnings
from collections.abc import Callable, Iterable
from types import ModuleType
from typing import Any

ENV_SWITCH = "TIEGRAD_NO_NUMBA"
ENABLED: bool = os.environ.get(ENV_SWITCH, "") in ("", "0")

# A deferred module -> what ``kernels`` gives meanwhile: None, its stand-in, or a copy
# of the stand-in with the kernels that are ready in place of theirs.
_deferred: dict[str, ModuleType | types.SimpleNamespace | None] = {}
_NOT_DEFERRED = object()


def kernels(module: str) -> ModuleType | types.SimpleNamespace | None:
    """The kernel module ``module`` (absolute name) where ``ENABLED``, else None.

    The switch is read at every call; the import (which compiles or loads the kernels)
    happens once. A deferred module (``defer``) gives its stand-in instead, with the
    kernels that are ``ready`` in place of theirs, until ``ready`` lets the module in.
    """
    if not ENABLED:
        return None
    if _deferred:
        meanwhile = _deferred.get(module, _NOT_DEFERRED)  # one read: ``ready`` may pop it
        if meanwhile is not _NOT_DEFERRED:
            return meanwhile
    return _load(module)


def defer(module: str, stand_in: str | None = None) -> None:
    """Hold ``kernels(module)`` back until ``ready(module)``; it gives meanwhile the
    module ``stand_in`` (absolute name), whose functions must give the kernels' bits,
    or None, where the callers' NumPy code must."""
    _deferred[module] = None if stand_in is None else importlib.import_module(stand_in)


def ready(module: str, names: Iterable[str] | None = None) -> None:
    """Let the kernels of the deferred ``module`` in, now in numba's cache: those called
    ``names`` in place of the stand-in's functions of those names (none where the
    stand-in is the callers' own code; a name the stand-in or the module lacks is
    left out), or, where ``names`` is None, the module itself from now on. Nothing for
    a module not deferred; one store, so callers on other threads see the stand-in
    before it or the kernels after it."""
    meanwhile = _deferred.get(module)
    if names is None:
        _deferred.pop(module, None)
    elif meanwhile is not None and (compiled := _load(module)) is not None:
        mixed = types.SimpleNamespace(**vars(meanwhile))
        for name in names:
            if hasattr(meanwhile, name) and hasattr(compiled, name):
                setattr(mixed, name, getattr(compiled, name))
        _deferred[module] = mixed


@functools.cache
def warm_up() -> None:
    """Import numba and set up its compiler in this process, once: the first compile or
    cache load of a process pays for it (numba's target registries), here for a function
    of nothing, compiled without the cache. Nothing without numba, or
    where it does not import (``kernels`` warns of that)."""
    if importlib.util.find_spec("numba") is None:
        return
    try:
        import numba
    except ImportError:
        return
    numba.njit(cache=False)(_nothing)()


def _nothing() -> None:
    """The function ``warm_up`` compiles."""


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
