"""A training loop written the PyTorch way (no ``session.reset()``) holds flat memory and
full speed, because ``backward`` releases the tape (issue 20, item 1)."""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from tiegrad import EagerSession
from tiegrad.models import TiedLM
from tiegrad.optim import AdamW

pytestmark = pytest.mark.skipif(
    not Path("/proc/self/status").is_file(), reason="reads the resident set size from /proc"
)

VOCAB, SEQ, BATCH = 24, 16, 8


def rss_mb() -> float:
    """This process's resident set size in MB (Linux)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS line")  # pragma: no cover


class Loop:
    """The default model's loop, small: ``loss = ...; opt.step(session.backward(loss))``."""

    def __init__(self, reset: bool) -> None:
        self.model = TiedLM(VOCAB, d_model=32, n_layers=2, n_heads=4, max_seq_len=SEQ, seed=0)
        self.opt = AdamW(self.model.parameters(), lr=1e-3)
        self.session = EagerSession(seed=0)
        self.rng = np.random.default_rng(0)
        self.reset = reset

    def step(self) -> float:
        x = self.rng.integers(0, VOCAB, (BATCH, SEQ))
        if self.reset:
            self.session.reset()
        loss = self.model.loss(self.session, x, (x + 1) % VOCAB)
        self.opt.step(self.session.backward(loss))
        return loss.item()


def test_a_loop_without_reset_holds_flat_memory_over_300_steps():
    loop = Loop(reset=False)
    for _ in range(200):
        loop.step()
    before = rss_mb()
    for _ in range(100):
        loop.step()
    grown = rss_mb() - before
    print(f"RSS over steps 200-300 without reset: {grown:+.2f} MB", file=sys.stderr)
    assert grown < 5.0
    assert len(loop.session) == 0  # nothing is left on the tape between steps


def test_a_loop_without_reset_runs_within_10_percent_of_one_with_reset():
    """Steps of the two loops alternate, so a loaded machine slows both alike; the medians
    of their step times are compared."""
    loops = {False: Loop(reset=False), True: Loop(reset=True)}
    times: dict[bool, list[float]] = {False: [], True: []}
    for k in range(240):
        for reset in (k % 2 == 0, k % 2 == 1):
            t0 = time.perf_counter()
            loops[reset].step()
            if k >= 40:  # warm: caches, kernels, allocator
                times[reset].append(time.perf_counter() - t0)
    ratio = statistics.median(times[False]) / statistics.median(times[True])
    print(f"step time without / with reset: {ratio:.3f}", file=sys.stderr)
    assert ratio < 1.10
    assert loops[False].step() == pytest.approx(loops[True].step(), rel=1e-5)
