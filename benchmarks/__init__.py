"""Benchmarks of tiegrad against PyTorch eager, run side by side in one process.

``python -m benchmarks run [--quick] [--only W1,...] [--json FILE]`` runs the workloads
of issue 9 (``benchmarks.workloads``) through ``benchmarks.runner``. Every figure is
float32 on ``THREADS`` threads: ``pin_threads`` sets the BLAS/OpenMP thread variables
and must run before NumPy is imported (``__main__`` calls it first).
"""

from __future__ import annotations

import os

THREADS = 2
THREAD_VARIABLES = (
    "OMP_NUM_THREADS",
    "OPENBLAS_NUM_THREADS",
    "MKL_NUM_THREADS",
    "BLIS_NUM_THREADS",
    "VECLIB_MAXIMUM_THREADS",
    "NUMEXPR_NUM_THREADS",
)


def thread_environment() -> dict[str, str]:
    """The environment for a benchmark subprocess: this one plus the thread pins."""
    env = dict(os.environ)
    env.update({var: str(THREADS) for var in THREAD_VARIABLES})
    return env


def pin_threads() -> None:
    """Pin this process's BLAS/OpenMP pools to ``THREADS`` (effective before NumPy loads)."""
    os.environ.update({var: str(THREADS) for var in THREAD_VARIABLES})
