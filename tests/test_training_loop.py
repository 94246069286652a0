"""A training loop written the PyTorch way (no ``session.reset()``) holds flat memory and
records no more per step than one with it, because ``backward`` releases the tape
(issue 20, item 1)."""

from __future__ import annotations

import sys
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
        self.recorded = 0  # tape entries of the latest step's forward

    def step(self) -> float:
        x = self.rng.integers(0, VOCAB, (BATCH, SEQ))
        if self.reset:
            self.session.reset()
        loss = self.model.loss(self.session, x, (x + 1) % VOCAB)
        self.recorded = len(self.session)  # tape entries before the backward releases them
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


def test_a_loop_without_reset_records_what_one_with_reset_does_and_computes_the_same():
    """Each step of a loop without ``reset`` records as many tape entries as one with
    it, in every step (a tape that kept the earlier steps' entries would grow, and every
    step would take longer), and the two give the same losses. The speed itself is the
    benchmarks' business, not a timed test's."""
    loops = {False: Loop(reset=False), True: Loop(reset=True)}
    recorded: dict[bool, list[int]] = {False: [], True: []}
    losses: dict[bool, list[float]] = {False: [], True: []}
    for reset, loop in loops.items():
        for _ in range(20):
            losses[reset].append(loop.step())
            recorded[reset].append(loop.recorded)
    assert len(set(recorded[False])) == 1 and recorded[False] == recorded[True]
    assert recorded[False][0] > 0
    assert losses[False] == pytest.approx(losses[True], rel=1e-5)
