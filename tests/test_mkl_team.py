"""Which OpenMP team oneMKL lends ``tiegrad._threads`` (``backend.blas``), and forks.

Each check runs in a fresh process: the team is chosen once, when MKL loads.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest

from tiegrad.backend import blas


def _lent_in_a_fresh_process(first="", **env):
    lines = ["from tiegrad import _threads", "from tiegrad.backend import blas", "blas.LIBRARY"]
    code = "\n".join([first, *lines, "print(_threads.TEAM)"])
    out = subprocess.run(
        [sys.executable, "-c", code], env={**os.environ, **env}, capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr
    return out.stdout.strip() != "None"


@pytest.mark.skipif(blas.LIBRARY is None, reason="needs oneMKL (tiegrad[mkl])")
def test_mkl_lends_its_team_unless_it_runs_another_threading_layer():
    assert _lent_in_a_fresh_process(MKL_THREADING_LAYER="intel")
    assert _lent_in_a_fresh_process(MKL_THREADING_LAYER="GNU")
    assert not _lent_in_a_fresh_process(MKL_THREADING_LAYER="SEQUENTIAL")
    assert not _lent_in_a_fresh_process(TIEGRAD_BLAS="numpy")


_GNU_TEAM_IN_A_CHILD = """
import os, torch  # GNU OpenMP first: MKL takes its GNU layer
import numpy as np
from tiegrad import _threads
from tiegrad.backend import NUMPY, blas
assert blas.LIBRARY  # loads MKL, which lends its team
team = _threads.TEAM
assert team is not None and not team.survives_fork, team
seen = []
_threads.share(seen.append, 8, 2)
x = np.random.default_rng(0).standard_normal((1000, 96)).astype(np.float32)
w, b = np.ones(96, np.float32), np.zeros(96, np.float32)
rows = NUMPY.layer_norm_rows(x, w, b, 1e-5)  # None without numba
pid = os.fork()
if pid == 0:
    child = []
    _threads.share(child.append, 8, 2)
    again = NUMPY.layer_norm_rows(x, w, b, 1e-5)
    same = rows is None or all(np.array_equal(p, c) for p, c in zip(rows, again))
    os._exit(0 if _threads.team() is None and sorted(child) == list(range(8)) and same else 3)
_, status = os.waitpid(pid, 0)
assert status == 0 and _threads.team() is team and sorted(seen) == list(range(8))
print("ok")
"""


@pytest.mark.skipif(blas.LIBRARY is None, reason="needs oneMKL (tiegrad[mkl])")
@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
@pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="needs torch")
def test_a_forked_child_gives_a_gnu_openmp_team_up_for_the_pool():
    env = {k: v for k, v in os.environ.items() if k != "MKL_THREADING_LAYER"}  # MKL's choice
    out = subprocess.run(
        [sys.executable, "-c", _GNU_TEAM_IN_A_CHILD],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr
