"""D1 data-parallel tied-LM: W1's model on 2 gloo processes, global batch 32.

Each side is a pool of 2 worker processes (``d1_worker``), started the same way (one
subprocess per rank with torchrun's variables, a free port on 127.0.0.1, one thread
each: the 2 cores, one per rank) and driven over pipes: a step sends one line to both
ranks and waits for both answers, so a timed step is the slower rank's full training
step on its 16 of the 32 samples. ``tiegrad``: ``DataParallel.backward``, each
bucket's all-reduce launched during the backward sweep. ``torch DDP``:
``DistributedDataParallel`` (gloo, 25 MB buckets, the first 1 MB, all-reduces
overlapped with backward). Same W1 data, initial weights and AdamW.

The same pools also take reference steps, timed alongside: tiegrad averaging after
backward (no overlap), and the step without any communication (tiegrad: no
averaging; DDP: under ``no_sync()``). The share of a step spent in communication is
``1 - local / data-parallel`` (medians), for both sides; the workers also time the
span from a step's first all-reduce launch to its last result (the slower rank's per
step), and the CPU time of every step (the larger rank's), which the other
processes on the machine disturb less than the wall time.
The peak RSS columns measure the controlling process only, not the workers.
"""

from __future__ import annotations

import contextlib
import json
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

ID = "D1"
TITLE = "data-parallel tied-LM (2 gloo processes)"
STEPS = w1.STEPS
WORLD = 2
# framework: (data-parallel side, {reference side: the worker's command})
SIDES = {
    "tiegrad": ("tiegrad", {"tiegrad after backward": "after", "tiegrad local": "local"}),
    "torch": ("torch DDP", {"torch DDP no_sync": "local"}),
}
_POOLS: dict[str, _Pool] = {}  # the pools of the latest build, for extras


def make_data() -> dict[str, Any]:
    """Nothing to share: each worker makes W1's data and weights itself (seeded)."""
    return {}


class _Pool:
    """The worker processes of one side; ``step(kind)`` is one step on every rank."""

    def __init__(self, framework: str, *variant: str) -> None:
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
                    [sys.executable, "-m", f"{__package__}.d1_worker", framework, *variant],
                    cwd=ROOT,
                    env=env,
                    stdin=subprocess.PIPE,
                    stdout=subprocess.PIPE,
                    text=True,
                    bufsize=1,
                )
            )
        self.loss = float("nan")
        self.comm_ms: dict[str, list[float]] = {}
        self.cpu_ms: dict[str, list[float]] = {}
        weakref.finalize(self, _stop, self.procs)
        self._ask("ready")

    def _ask(self, command: str) -> None:
        for p in self.procs:
            p.stdin.write(command + "\n")
        answers = [p.stdout.readline() for p in self.procs]
        if not all(answers):
            codes = [p.poll() for p in self.procs]
            raise RuntimeError(f"D1: a worker exited (exit codes {codes})")
        figures = [list(map(float, a.split())) for a in answers]
        self.loss = figures[0][0]
        self.comm_ms.setdefault(command, []).append(max(f[1] for f in figures))
        self.cpu_ms.setdefault(command, []).append(max(f[2] for f in figures))

    def memory(self) -> list[dict[str, float]]:
        """Every rank's bytes of optimizer state and gradients and its peak RSS (MB)."""
        for p in self.procs:
            p.stdin.write("memory\n")
        return [json.loads(p.stdout.readline()) for p in self.procs]

    def side(self, name: str, framework: str, kind: str) -> Side:
        """A side stepping every rank; a reference side (local steps) has no probe: its
        first step is not the first step from the initial weights."""
        probe = (lambda: self.loss) if framework != REFERENCE else None
        return Side(name, framework, lambda: self._ask(kind), probe)


def _stop(procs: list[subprocess.Popen]) -> None:
    """Ask each worker to quit, wait for it (killing one that does not within 30 s) and
    close its pipes."""
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
            p.wait()
        for pipe in (p.stdin, p.stdout):
            with contextlib.suppress(OSError):  # a worker gone with a line unread
                pipe.close()


def build(data: dict[str, Any], sides: Collection[str] | None = None) -> Built:
    built = Built([])
    for framework, (dp, references) in SIDES.items():
        if not any(wanted(sides, name) for name in (dp, *references)):
            continue
        pool = _POOLS[framework] = _Pool(framework)
        if wanted(sides, dp):
            built.sides.append(pool.side(dp, framework, "step"))
        for name, kind in references.items():
            if wanted(sides, name):
                built.sides.append(pool.side(name, REFERENCE, kind))
    return built


def extras(stats: dict[str, SideStats]) -> tuple[dict[str, Any], list[str]]:
    """The communication share of each side's step, two ways, the CPU time of each
    kind of step and tiegrad without overlap against DDP (module docstring)."""
    share, measured, cpu = {}, {}, {}
    notes = []
    for framework, (dp, references) in SIDES.items():
        local = next(n for n, kind in references.items() if kind == "local")
        if dp not in stats or local not in stats:
            continue
        pool = _POOLS[framework]
        share[framework] = 1.0 - stats[local].median_ms / stats[dp].median_ms
        comm = statistics.median(pool.comm_ms["step"])
        measured[framework] = {"median_ms": comm, "share": comm / stats[dp].median_ms}
        cpu[framework] = {k: statistics.median(v) for k, v in pool.cpu_ms.items() if k != "ready"}
        notes.append(
            f"communication share of the step ({framework}): {share[framework]:.0%} as "
            f"1 - local / data-parallel step (medians); first all-reduce launch to last "
            f"result, in the workers: {comm:.2f} ms = {measured[framework]['share']:.0%} of "
            "the step (overlapped with backward)"
        )
        notes.append(
            f"CPU ms per step ({framework}, the larger rank's, medians): "
            + ", ".join(f"{kind} {ms:.1f}" for kind, ms in cpu[framework].items())
        )
    after, ddp = "tiegrad after backward", SIDES["torch"][0]
    local, ddp_local = "tiegrad local", "torch DDP no_sync"
    if local in stats and ddp_local in stats:
        notes.append(
            f"the steps without communication: {local} / {ddp_local} = "
            f"{stats[local].median_ms / stats[ddp_local].median_ms:.2f} (medians)"
        )
    if after in stats and ddp in stats:
        ratio = stats[after].median_ms / stats[ddp].median_ms
        notes.append(
            f"{after} (no overlap): {stats[after].median_ms:.2f} ms, ratio {ratio:.2f} "
            f"against {ddp}; overlapped: {stats['tiegrad'].median_ms:.2f} ms"
            if "tiegrad" in stats
            else f"{after} (no overlap): ratio {ratio:.2f} against {ddp}"
        )
    notes.append("D1 peak RSS: the controlling process only, not the 2 worker processes")
    return {"communication_share": share, "communication_measured": measured, "cpu_ms": cpu}, notes
