"""Importing tiegrad changes nothing outside tiegrad; ``tune_process`` is the explicit call.

Each check runs in a child process, which records what tiegrad's modules do while
``import tiegrad`` and ``import tiegrad.backend`` run, and then while host ops that are
not matrix products run (the fused kernels on two threads, where numba is installed):
C libraries they open through ctypes (glibc's ``mallopt``, oneMKL), fork hooks they
register, threads started by the imports; and whether oneMKL is mapped into the
process afterwards (an MKL that is not loaded keeps its own modes). glibc's allocator
is checked by its behaviour: a 16 MiB block comes from ``mmap`` under glibc's defaults
and from the heap once ``tune_process`` has raised the mmap threshold to 32 MiB.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

_MMAPPED = """
import ctypes

class Mallinfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd",
        "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]

def mmapped_after_a_16_mib_block():
    libc = ctypes.CDLL(None)
    libc.mallinfo2.restype = Mallinfo2
    libc.malloc.restype = ctypes.c_void_p
    before = libc.mallinfo2().hblks
    libc.malloc(16 << 20)  # kept: freeing an mmapped block would raise glibc's threshold
    return libc.mallinfo2().hblks > before

"""

_IMPORT = (
    _MMAPPED
    + """
import json, os, sys

def from_tiegrad():
    return sys._getframe(2).f_globals.get("__name__", "").startswith("tiegrad")

opened, hooks = [], []
cdll_init, register = ctypes.CDLL.__init__, os.register_at_fork

def recording_init(self, name, *args, **kwargs):
    if from_tiegrad():
        opened.append(str(name))
    cdll_init(self, name, *args, **kwargs)

def recording_register(**callbacks):
    if from_tiegrad():
        hooks.extend(callbacks)
    register(**callbacks)

import threading
ctypes.CDLL.__init__, os.register_at_fork = recording_init, recording_register
import tiegrad
import tiegrad.backend
threads = threading.active_count()
if {ops}:
    import numpy as np
    from tiegrad.backend import NUMPY
    os.environ["TIEGRAD_NUM_THREADS"] = "2"
    x = np.random.default_rng(0).standard_normal((1024, 512)).astype(np.float32)
    y, _ = NUMPY.gelu(x)
    NUMPY.layer_norm_rows(x, None, None, 1e-5)
    NUMPY.softmax_rows_(y)
    x + x
ctypes.CDLL.__init__, os.register_at_fork = cdll_init, register
maps = open("/proc/self/maps").read() if os.path.exists("/proc/self/maps") else ""
glibc = (os.confstr("CS_GNU_LIBC_VERSION") or "").startswith("glibc")
defaults = not glibc or mmapped_after_a_16_mib_block()
print(json.dumps({"opened": opened, "hooks": hooks, "mkl": "libmkl" in maps,
                  "threads": threads, "malloc defaults": defaults}))
"""
)


@pytest.mark.parametrize("ops", [False, True], ids=["import", "import and host ops"])
def test_import_and_host_ops_open_no_library_hook_no_fork_and_leave_mkl_unloaded(ops):
    out = subprocess.run(
        [sys.executable, "-c", _IMPORT.replace("{ops}", str(ops))],
        capture_output=True,
        text=True,
        check=True,
    )
    want = {"opened": [], "hooks": [], "mkl": False, "threads": 1, "malloc defaults": True}
    assert json.loads(out.stdout) == want


_MALLOC = (
    _MMAPPED
    + """
import tiegrad
from tiegrad.backend import tune_process

print(mmapped_after_a_16_mib_block(), tune_process(), mmapped_after_a_16_mib_block())
"""
)


@pytest.mark.skipif(
    not hasattr(os, "confstr") or not (os.confstr("CS_GNU_LIBC_VERSION") or "").startswith("glibc"),
    reason="the allocator setting applies to glibc only",
)
def test_glibc_keeps_its_defaults_until_tune_process_is_called():
    out = subprocess.run(
        [sys.executable, "-c", _MALLOC], capture_output=True, text=True, check=True
    )
    assert out.stdout.split() == ["True", "{'mallopt':", "True}", "False"]
