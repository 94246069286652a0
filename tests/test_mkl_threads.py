"""oneMKL's threads as ``backend.blas`` loads it: its own threading layer, and forks.

Each check runs in a fresh process: MKL chooses its threading layer once, as it loads.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest

from tiegrad.backend import blas

pytestmark = pytest.mark.skipif(blas.LIBRARY is None, reason=str(blas.unused_reason()))

_LAYER = """
import ctypes, sys
from pathlib import Path
{first}
if {through_tiegrad}:
    from tiegrad.backend import blas
    assert blas.LIBRARY
lib = ctypes.CDLL(str(Path(sys.prefix) / "lib" / "libmkl_rt.so.3"))
lib.MKL_Get_Max_Threads()
print(lib.MKL_Set_Threading_Layer(-1))  # -1: reads the layer
"""


def _layer(first="", through_tiegrad=True, **env):
    code = _LAYER.format(first=first, through_tiegrad=through_tiegrad)
    environ = {k: v for k, v in os.environ.items() if k != "MKL_THREADING_LAYER"}
    out = subprocess.run(
        [sys.executable, "-c", code], env={**environ, **env}, capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr
    return int(out.stdout)


def test_tiegrad_leaves_the_threading_layer_to_mkl():
    assert _layer() == _layer(through_tiegrad=False)
    for asked in ("GNU", "SEQUENTIAL"):
        want = _layer(through_tiegrad=False, MKL_THREADING_LAYER=asked)
        assert _layer(MKL_THREADING_LAYER=asked) == want


_GNU_OPENMP_IN_A_CHILD = """
import os, time
{first}
import numpy as np
from tiegrad.backend import blas
a = np.random.default_rng(0).standard_normal((512, 512)).astype(np.float32)
want = blas.matmul(a, a)  # MKL's threads run in the parent
pid = os.fork()
if pid == 0:
    got = blas.matmul(a, a)  # on one thread where MKL runs on GNU OpenMP: rounding differs
    os._exit(0 if np.allclose(got, want, rtol=1e-5, atol=1e-3) else 3)
for _ in range(600):
    done, status = os.waitpid(pid, os.WNOHANG)
    if done:
        break
    time.sleep(0.05)
else:
    os.kill(pid, 9)
    raise SystemExit("the child hangs in its first product")
assert status == 0, status
print("ok")
"""


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
@pytest.mark.parametrize("first", ["", "import torch  # GNU OpenMP first: MKL takes it"])
def test_a_forked_child_multiplies_after_its_parent_did(first):
    if first and importlib.util.find_spec("torch") is None:
        pytest.skip("needs torch")
    env = {k: v for k, v in os.environ.items() if k != "MKL_THREADING_LAYER"}  # MKL's choice
    out = subprocess.run(
        [sys.executable, "-c", _GNU_OPENMP_IN_A_CHILD.format(first=first)],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr
