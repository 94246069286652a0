"""``tune_process``: the process-wide settings tiegrad's host steps run fastest with.

Importing tiegrad changes nothing outside tiegrad. A program that owns its process
(the ``tiegrad`` command does, for its own) may call ``tune_process()`` once, early:

- glibc's ``mallopt``: the mmap threshold at its maximum (32 MiB) and the trim threshold
  at 1 GiB, so the arrays a step frees stay in the process and the next step's
  temporaries reuse their pages instead of faulting in fresh ones (docs/design.md:
  memory is reused). Not applied on other C libraries.

oneMKL's modes are not among them: ``tiegrad.backend.blas`` sets the ones its products
need when it first loads MKL (its docstring).
"""

from __future__ import annotations

import ctypes
import os

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_MMAP_THRESHOLD_MAX = 32 * 1024 * 1024  # glibc's upper limit on 64-bit systems
_TRIM_THRESHOLD = 1 << 30


def tune_process() -> dict[str, bool]:
    """Apply the settings of the module docstring to this process; what was applied.

    Returns ``{"mallopt": applied}``; calling it again applies the same values again.
    """
    return {"mallopt": _keep_freed_memory()}


def _keep_freed_memory() -> bool:
    """Tune glibc's malloc to keep freed memory in the process; False where not glibc."""
    try:
        if not (os.confstr("CS_GNU_LIBC_VERSION") or "").startswith("glibc"):
            return False
        mallopt = ctypes.CDLL(None).mallopt
    except (AttributeError, OSError, ValueError):
        return False
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    mallopt.restype = ctypes.c_int
    return bool(
        mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD_MAX)
        and mallopt(_M_TRIM_THRESHOLD, _TRIM_THRESHOLD)
    )
