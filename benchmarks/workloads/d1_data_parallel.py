"""D1 data-parallel tied-LM: W1's model on 2 gloo processes, global batch 32.

Each side is a pool of 2 worker processes (``d1_worker``), started the same way (one
subprocess per rank with torchrun's variables, a free port on 127.0.0.1, one thread
each: the 2 cores, one per rank) and driven over pipes: a step sends one line to both
ranks and waits for both answers, so a timed step is the slower rank's full training
step on its 16 of the 32 samples. ``tiegrad``: ``tiegrad.distributed.DataParallel``,
its canonical gradients averaged in flat buckets after backward. ``torch DDP``:
``DistributedDataParallel`` (gloo, 25 MB buckets, all-reduce overlapped with
backward). Same W1 data, initial weights and AdamW.

The same pools also take local steps, timed as reference sides: the step without any
communication (tiegrad: no averaging; DDP: under ``no_sync()``). The share of a step
spent in communication is ``1 - local / data-parallel`` (medians), for both sides; the
workers also time it directly (``d1_worker``; the slower rank's figure per step).
The peak RSS columns measure the controlling process only, not the workers.
"""

from __future__ import annotations

import os
import socket
import statistics
import subprocess
import sys
import weakref
from collections.abc import Collection
from typing import Any

from .. import THREAD_VARIABLES
from ..runner import REFERENCE, ROOT, Built, Side, SideStats
from . import w1_tied_lm as w1
from ._common import wanted
from .d1_worker import WORLD

ID = "D1"
TITLE = "data-parallel tied-LM (2 gloo processes)"
STEPS = w1.STEPS
SIDES = {"tiegrad": ("tiegrad", "tiegrad local"), "torch": ("torch DDP", "torch DDP no_sync")}
_POOLS: dict[str, _Pool] = {}  # the pools of the latest build, for extras


def make_data() -> dict[str, Any]:
    """Nothing to share: each worker makes W1's data and weights itself (seeded)."""
    return {}


class _Pool:
    """The worker processes of one side; ``step(kind)`` is one step on every rank."""

    def __init__(self, framework: str) -> None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        self.procs = []
        for rank in range(WORLD):
            env = dict(os.environ, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(WORLD))
            env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
            env.update({var: "1" for var in THREAD_VARIABLES})
            self.procs.append(
                subprocess.Popen(
                    [sys.executable, "-m", f"{__package__}.d1_worker", framework],
                    cwd=ROOT,
                    env=env,
                    stdin=subprocess.PIPE,
                    stdout=subprocess.PIPE,
                    text=True,
                    bufsize=1,
                )
            )
        self.loss = float("nan")
        self.comm_ms: list[float] = []
        weakref.finalize(self, _stop, self.procs)
        self._ask("ready")

    def _ask(self, command: str) -> None:
        for p in self.procs:
            p.stdin.write(command + "\n")
        answers = [p.stdout.readline() for p in self.procs]
        if not all(answers):
            codes = [p.poll() for p in self.procs]
            raise RuntimeError(f"D1: a worker exited (exit codes {codes})")
        self.loss, comm = map(float, answers[0].split())
        if command == "step":
            self.comm_ms.append(max([comm, *(float(a.split()[1]) for a in answers[1:])]))

    def side(self, name: str, framework: str, kind: str) -> Side:
        """A side stepping every rank; a reference side (local steps) has no probe: its
        first step is not the first step from the initial weights."""
        probe = (lambda: self.loss) if framework != REFERENCE else None
        return Side(name, framework, lambda: self._ask(kind), probe)


def _stop(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        if p.poll() is None:
            try:
                p.stdin.write("quit\n")
                p.stdin.flush()
            except OSError:
                pass
    for p in procs:
        try:
            p.wait(timeout=30)
        except subprocess.TimeoutExpired:
            p.kill()


def build(data: dict[str, Any], sides: Collection[str] | None = None) -> Built:
    built = Built([])
    for framework, (dp, local) in SIDES.items():
        if wanted(sides, dp) or wanted(sides, local):
            pool = _POOLS[framework] = _Pool(framework)
            if wanted(sides, dp):
                built.sides.append(pool.side(dp, framework, "step"))
            if wanted(sides, local):
                built.sides.append(pool.side(local, REFERENCE, "local"))
    return built


def extras(stats: dict[str, SideStats]) -> tuple[dict[str, Any], list[str]]:
    """The communication share of each side's step, two ways (module docstring)."""
    share, measured = {}, {}
    notes = []
    for framework, (dp, local) in SIDES.items():
        if dp not in stats or local not in stats:
            continue
        share[framework] = 1.0 - stats[local].median_ms / stats[dp].median_ms
        comm = statistics.median(_POOLS[framework].comm_ms)
        measured[framework] = {"median_ms": comm, "share": comm / stats[dp].median_ms}
        notes.append(
            f"communication share of the step ({framework}): {share[framework]:.0%} as "
            f"1 - local / data-parallel step (medians); measured in the workers: {comm:.2f} ms "
            f"= {measured[framework]['share']:.0%} of the step"
            + (" (all-reduce spans, overlapped with backward)" if framework == "torch" else "")
        )
    notes.append("D1 peak RSS: the controlling process only, not the 2 worker processes")
    return {"communication_share": share, "communication_measured": measured}, notes
