"""A training step's bits are the same in every process of one environment (C9's resume).

What may differ between the processes of a straight and a resumed run: whether the
kernels were compiled in the process or loaded from numba's cache, the number of
kernel threads (``TIEGRAD_NUM_THREADS``), and what else runs on the cores. Each child
below trains the same model three AdamW steps, with batches large enough for the
kernels to split their rows between threads, and prints a digest of the parameters:
the first compiles every kernel into an empty cache, the others load them from that
cache while another process keeps a core busy. The digests must all be equal. Without
numba (or with ``TIEGRAD_NO_NUMBA=1``) the same holds for the NumPy route.
"""

from __future__ import annotations

import os
import subprocess
import sys

_STEPS = """
import hashlib
import numpy as np
from tiegrad import EagerSession
from tiegrad.models import TiedLM
from tiegrad.optim import AdamW

model = TiedLM(vocab_size=64, d_model=128, n_layers=1, n_heads=4, max_seq_len=64, seed=0)
opt = AdamW(model.param_list(), lr=1e-2, weight_decay=0.01)
session = EagerSession(seed=0)
for step in range(3):
    session.reset()
    batch = np.random.default_rng(step).integers(0, 64, (8, 65))
    opt.step(session.backward(model.loss(session, batch[:, :-1], batch[:, 1:])))
digest = hashlib.sha256()
for p in model.param_list():
    digest.update(np.ascontiguousarray(p.value).tobytes())
print(digest.hexdigest())
"""


def _digest(env: dict[str, str]) -> str:
    done = subprocess.run(
        [sys.executable, "-c", _STEPS], env=env, capture_output=True, text=True, check=True
    )
    return done.stdout.strip()


def test_steps_repeat_bit_for_bit_across_processes_compiles_threads_and_load(tmp_path):
    env = {**os.environ, "NUMBA_CACHE_DIR": str(tmp_path / "numba")}  # empty: compiled anew
    compiled = _digest({**env, "TIEGRAD_NUM_THREADS": "2"})
    hog = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        cached = [_digest({**env, "TIEGRAD_NUM_THREADS": n}) for n in ("1", "2", "3")]
    finally:
        hog.kill()
        hog.wait()
    assert cached == [compiled] * 3
