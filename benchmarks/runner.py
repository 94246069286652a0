"""The benchmark runner: alternate tiegrad and PyTorch step by step, then tabulate.

Method (issue 9):

- Every workload builds all its sides in one process from the same NumPy data and
  initial weights (``Workload.make_data``). Each side warms up (its first step's
  probe, normally the loss, is compared across sides: a relative gap above
  ``PROBE_RTOL`` prints a warning, which catches mismatched models), then the sides
  take turns in runs of steps, alternating the order every round (ABBA); a run starts
  with a short pause (another framework's idle worker threads keep spinning for a
  while) and untimed steps for ``WARM_S`` (the machine is slow for tens of
  milliseconds after it idled); the other steps are timed with ``time.perf_counter``.
  The table reports the median and the min-max in ms per step and the ratio of
  medians tiegrad/PyTorch.
- Peak RSS is measured per side in a fresh subprocess (``python -m benchmarks rss``,
  Linux ``/proc``) that imports both frameworks and does their one-time lazy imports,
  makes the data, records the RSS, builds only that side, warms up and runs a few
  steps. The figure reported is the peak anonymous RSS during the steps minus the
  anonymous RSS before the side was built: the side's parameters, optimizer state,
  kept buffers and the transient peak of a step (library code pages are left out).
  The peak is read from ``VmHWM`` after resetting it (``/proc/self/clear_refs``) once
  warm-up is done; ``step_transient_mb`` is the part above the steady state.
"""

from __future__ import annotations

import datetime
import gc
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from . import THREADS, thread_environment

PROBE_RTOL = 1e-4
REFERENCE = "reference"
ROOT = Path(__file__).resolve().parent.parent
QUICK_STEPS = (1, 1)
RUNS = 6  # runs per side in ``measure``: each starts with a pause and untimed steps
SETTLE_S = 0.25  # the pause: longer than BLAS and OpenMP workers spin after their last task
WARM_S = 0.1  # untimed steps after the pause, at least one: longer than the slow spell after idling
RSS_STEPS = (2, 3)
QUICK_RSS_STEPS = (1, 1)
RSS_TIMEOUT_S = 600


class UnknownWorkload(ValueError):
    """A workload id that ``benchmarks.workloads`` does not define, or a side it cannot build."""


@dataclass
class Side:
    """One implementation of a workload.

    ``framework`` is ``"tiegrad"``, ``"torch"`` or ``REFERENCE`` (a bound such as W5's
    GEMM-only step: timed alongside, but in no row, probe check or RSS measurement);
    ``step()`` runs one full training step (forward, backward, optimizer update);
    ``probe()`` returns a float observed after the latest step (the loss), compared
    across sides after the first step (None: nothing to compare). An
    ``optional`` side whose first step raises is left out of the measurement instead of
    failing the run; ``measure`` puts the reason in ``dropped``.
    """

    name: str
    framework: str
    step: Callable[[], None]
    probe: Callable[[], float] | None
    optional: bool = False
    dropped: str | None = None


@dataclass
class Built:
    """The sides a workload could build and, per side it could not, the reason."""

    sides: list[Side]
    skipped: dict[str, str] = field(default_factory=dict)


class Workload(Protocol):
    """A workload module of ``benchmarks.workloads`` (``W1`` ... ``W5``).

    A module may also define ``make_quick_data()``: smaller sizes for the quick run (a
    model too large for a smoke test); without it the quick run uses ``make_data``.
    """

    ID: str
    TITLE: str
    STEPS: tuple[int, int]

    def make_data(self) -> Any: ...

    def build(self, data: Any, sides: Collection[str] | None = None) -> Built: ...


@dataclass
class SideStats:
    """Timings (ms per step), the first-step probe and the RSS figures of one side."""

    name: str
    framework: str
    times_ms: list[float]
    first_probe: float | None
    rss: dict[str, Any] | None = None

    @property
    def median_ms(self) -> float:
        return statistics.median(self.times_ms)

    @property
    def min_ms(self) -> float:
        return min(self.times_ms)

    @property
    def max_ms(self) -> float:
        return max(self.times_ms)

    def to_json(self) -> dict[str, Any]:
        return {
            "framework": self.framework,
            "median_ms": self.median_ms,
            "min_ms": self.min_ms,
            "max_ms": self.max_ms,
            "times_ms": self.times_ms,
            "first_probe": self.first_probe,
            "rss": self.rss,
        }


@dataclass
class WorkloadResult:
    """Everything measured for one workload, plus the workload's own extra figures."""

    id: str
    title: str
    stats: dict[str, SideStats]
    skipped: dict[str, str]
    warnings: list[str]
    extras: dict[str, Any]
    notes: list[str]

    def rows(self) -> list[dict[str, Any]]:
        """One row per (tiegrad side, torch side) pair: medians, ranges, RSS and ratio."""
        rows = []
        for tg in self.stats.values():
            if tg.framework != "tiegrad":
                continue
            for pt in self.stats.values():
                if pt.framework != "torch":
                    continue
                rows.append(
                    {
                        "workload": f"{self.id} {self.title}",
                        "tiegrad": tg.name,
                        "torch": pt.name,
                        "tiegrad_ms": tg.median_ms,
                        "tiegrad_range_ms": (tg.min_ms, tg.max_ms),
                        "torch_ms": pt.median_ms,
                        "torch_range_ms": (pt.min_ms, pt.max_ms),
                        "tiegrad_rss_mb": _peak_mb(tg.rss),
                        "torch_rss_mb": _peak_mb(pt.rss),
                        "ratio": tg.median_ms / pt.median_ms,
                    }
                )
        return rows

    def to_json(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "title": self.title,
            "sides": {name: s.to_json() for name, s in self.stats.items()},
            "rows": self.rows(),
            "skipped": self.skipped,
            "warnings": self.warnings,
            "extras": self.extras,
            "notes": self.notes,
        }


def _peak_mb(rss: dict[str, Any] | None) -> float | None:
    if not rss or "peak_mb" not in rss:
        return None
    return rss["peak_mb"]


# -- timing ------------------------------------------------------------------------------
def measure(sides: Sequence[Side], warmup: int, steps: int) -> dict[str, SideStats]:
    """Warm every side up, then time ``steps`` steps per side in runs, alternating ABBA.

    A run is a pause of ``SETTLE_S`` seconds, untimed settling steps for ``WARM_S``
    seconds (at least one) and up to ``steps // RUNS`` timed steps of one side; the
    sides take turns run by run, in ABBA order. The pause absorbs what the previous side
    left behind: its BLAS and OpenMP worker threads keep spinning after their last task
    (OpenBLAS's for about 2**28 cycles, a tenth of a second) and would compete with the
    next side for the cores, whichever framework it is. The settling steps absorb what
    the pause leaves: on the shared 2-core machines a loop that streams memory runs up
    to 40% slower for 30-60 ms after the process idled (W4's tiegrad step, measured
    alone: 7.4 ms for the first step after 0.25 s of sleep, 6.0 ms from the tenth step
    on), so one settling step covered a 50 ms step but not a 5 ms one.

    The first warm-up step of each side is its first step from the initial weights;
    its probe is kept for the agreement check. An optional side whose first step raises
    gets the reason in ``side.dropped`` and no stats.
    """
    if warmup < 1 or steps < 1:
        raise ValueError(f"measure: warmup and steps must be >= 1, got {warmup} and {steps}")
    first: dict[str, float | None] = {}
    for side in sides:
        try:
            side.step()
        except Exception as e:
            if not side.optional:
                raise
            side.dropped = f"{type(e).__name__}: {e}"
            continue
        first[side.name] = None if side.probe is None else float(side.probe())
    sides = [side for side in sides if side.name in first]
    for _ in range(warmup - 1):
        for side in sides:
            side.step()
    times: dict[str, list[float]] = {side.name: [] for side in sides}
    order = list(sides)
    gc.collect()
    clock = time.perf_counter
    run = max(1, steps // RUNS)
    for i, start in enumerate(range(0, steps, run)):
        for side in order if i % 2 == 0 else reversed(order):
            time.sleep(SETTLE_S)
            settle = clock()
            side.step()
            while clock() - settle < WARM_S:
                side.step()
            for _ in range(min(run, steps - start)):
                t0 = clock()
                side.step()
                times[side.name].append((clock() - t0) * 1e3)
    return {
        side.name: SideStats(side.name, side.framework, times[side.name], first[side.name])
        for side in sides
    }


def probe_warnings(workload_id: str, stats: dict[str, SideStats]) -> list[str]:
    """Warnings for first-step probes that differ from the first side's (mismatched models)."""
    sides = [s for s in stats.values() if s.first_probe is not None]
    if not sides:
        return []
    ref = sides[0]
    out = []
    for other in sides[1:]:
        a, b = ref.first_probe, other.first_probe
        gap = abs(a - b) / max(abs(a), abs(b), 1e-30)
        if not (math.isfinite(a) and math.isfinite(b)) or gap > PROBE_RTOL:
            out.append(
                f"WARNING {workload_id}: first-step probe of {ref.name} is {a:.8g} but "
                f"{other.name} gives {b:.8g} (relative gap {gap:.2e} > {PROBE_RTOL:g}): "
                "the sides do not compute the same step"
            )
    return out


# -- peak RSS in a subprocess ------------------------------------------------------------
def status_mb() -> dict[str, float]:
    """This process's memory figures from ``/proc/self/status``, in MB."""
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, rest = line.partition(":")
            if key in ("VmHWM", "RssAnon", "RssFile", "RssShmem"):
                out[key] = int(rest.split()[0]) / 1024
    return out


def _warm_frameworks() -> None:
    """Do the one-time lazy loads of both frameworks before the baseline is taken.

    The first ``torch.optim`` optimizer imports ``torch._dynamo`` (about 65 MB); tiegrad's
    first fused op or optimizer step loads numba and its compiled kernels (about 40 MB of
    anonymous memory, where PyTorch's compiled kernels are file-backed library pages).
    Both are the cost of loading a library, not memory of a training step, so a tiny
    step of each framework runs first: an SGD step for PyTorch; for tiegrad a layer
    norm, GELU and attention forward and backward and one step of each optimizer.
    """
    import numpy as np
    import torch

    import tiegrad.ops as T
    from tiegrad import EagerSession, Param, optim

    p = torch.zeros(1, requires_grad=True)
    p.sum().backward()
    torch.optim.SGD([p], lr=0.1).step()

    s = EagerSession()
    w = Param(np.ones((2, 6), np.float32))
    x = T.layer_norm(T.gelu(s.use(w)), s.use(w)[0], s.use(w)[1])
    y = T.self_attention(T.reshape(x, (1, 2, 6)), 1, causal=True)
    grads = s.backward(T.sum(y))
    s.reset()
    for make in (optim.SGD, optim.Adam, optim.AdamW, optim.RMSprop, optim.Adagrad):
        make([w], lr=1e-3).step(grads)


def rss_child(workload_id: str, side_name: str, quick: bool) -> dict[str, Any]:
    """Build one side of one workload in this process and measure its memory (see module).

    Figures are anonymous memory (``RssAnon``; the peak is ``VmHWM`` less the file-backed
    and shared pages at the end, which stay constant once warm-up has loaded the code).
    """
    import torch

    torch.set_num_threads(THREADS)
    module = workload_module(workload_id)
    warmup, steps = QUICK_RSS_STEPS if quick else RSS_STEPS
    _warm_frameworks()
    data = workload_data(module, quick)
    gc.collect()
    base = status_mb()["RssAnon"]
    built = module.build(data, {side_name})
    try:
        side = single_side(workload_id, built, side_name)
    except UnknownWorkload as e:
        return {"skipped": str(e)}
    for _ in range(warmup):
        side.step()
    gc.collect()
    steady = status_mb()["RssAnon"]
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM to the current RSS
    for _ in range(steps):
        side.step()
    end = status_mb()
    peak = end["VmHWM"] - end["RssFile"] - end["RssShmem"]
    return {
        "base_mb": base,
        "steady_mb": steady - base,
        "peak_mb": peak - base,
        "step_transient_mb": peak - steady,
        "method": "anonymous RSS; VmHWM reset after warm-up",
    }


def measure_rss(workload_id: str, side_name: str, quick: bool) -> dict[str, Any]:
    """Run ``rss_child`` in a fresh interpreter with the thread pins; errors become a dict."""
    cmd = [sys.executable, "-m", "benchmarks", "rss", workload_id, side_name]
    if quick:
        cmd.append("--quick")
    try:
        proc = subprocess.run(
            cmd,
            cwd=ROOT,
            env=thread_environment(),
            capture_output=True,
            text=True,
            timeout=RSS_TIMEOUT_S,
        )
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {RSS_TIMEOUT_S} s"}
    lines = proc.stdout.strip().splitlines()
    if proc.returncode != 0 or not lines:
        tail = proc.stderr.strip().splitlines()[-1:] or ["no output"]
        return {"error": f"exit {proc.returncode}: {tail[0]}"}
    return json.loads(lines[-1])


# -- profile -----------------------------------------------------------------------------
def profile_side(workload_id: str, side_name: str, steps: int, top: int) -> str:
    """cProfile of ``steps`` steps of one side after one warm-up step: the ``top`` lines by
    cumulative and by own time."""
    import cProfile
    import io
    import pstats

    import torch

    torch.set_num_threads(THREADS)
    module = workload_module(workload_id)
    side = single_side(workload_id, module.build(module.make_data(), {side_name}), side_name)
    side.step()
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(steps):
        side.step()
    profiler.disable()
    out = io.StringIO()
    stats = pstats.Stats(profiler, stream=out)
    out.write(f"{workload_id} {side_name}: cProfile of {steps} steps\n")
    stats.sort_stats("cumulative").print_stats(top)
    stats.sort_stats("tottime").print_stats(top)
    return out.getvalue()


# -- the run -----------------------------------------------------------------------------
def workload_module(workload_id: str) -> Workload:
    """The module of workload ``workload_id`` (``"W1"`` ... ``"W5"``)."""
    from .workloads import WORKLOADS

    try:
        return WORKLOADS[workload_id]
    except KeyError:
        known = ", ".join(WORKLOADS)
        raise UnknownWorkload(
            f"unknown workload {workload_id!r}: expected one of {known}"
        ) from None


def workload_data(module: Workload, quick: bool) -> Any:
    """The data of ``module``: its ``make_quick_data()`` in a quick run where it has one,
    else its ``make_data()``."""
    make = getattr(module, "make_quick_data", None) if quick else None
    return (make or module.make_data)()


def single_side(workload_id: str, built: Built, side_name: str) -> Side:
    """The side ``side_name`` of ``built``, or ``UnknownWorkload`` saying why there is none."""
    for side in built.sides:
        if side.name == side_name:
            return side
    reason = built.skipped.get(side_name, "no side of that name")
    raise UnknownWorkload(f"{workload_id} has no side {side_name!r}: {reason}")


def run_workload(
    workload_id: str, quick: bool, rss: bool, log: Callable[[str], None] = print
) -> WorkloadResult:
    """Build, warm up, time alternating, check probes, measure RSS and extras of one workload."""
    module = workload_module(workload_id)
    warmup, steps = QUICK_STEPS if quick else module.STEPS
    log(f"{workload_id} {module.TITLE}: building")
    built = module.build(workload_data(module, quick))
    for name, reason in built.skipped.items():
        log(f"{workload_id}: side {name!r} skipped: {reason}")
    log(f"{workload_id}: {warmup} warm-up + {steps} timed steps per side, alternating")
    stats = measure(built.sides, warmup, steps)
    dropped = {side.name: side.dropped for side in built.sides if side.dropped}
    for name, reason in dropped.items():
        log(f"{workload_id}: optional side {name!r} dropped: {reason}")
    warnings = probe_warnings(workload_id, stats)
    for w in warnings:
        log(w)
    if rss:
        for name in [n for n, s in stats.items() if s.framework != REFERENCE]:
            log(f"{workload_id}: peak RSS of side {name!r} (subprocess)")
            stats[name].rss = measure_rss(workload_id, name, quick)
    extras: dict[str, Any] = {}
    notes: list[str] = []
    describe = getattr(module, "extras", None)
    if describe is not None:
        extras, notes = describe(stats)
    result = WorkloadResult(
        workload_id, module.TITLE, stats, built.skipped | dropped, warnings, extras, notes
    )
    del built
    gc.collect()
    return result


def machine() -> dict[str, Any]:
    """Where and with what the figures were measured."""
    import numpy
    import torch

    from tiegrad.backend import blas

    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            names = [line.split(":", 1)[1].strip() for line in f if line.startswith("model name")]
        cpu = names[0] if names else cpu
    except OSError:
        pass
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "cpu": cpu,
        "cores": os.cpu_count(),
        "threads": THREADS,
        "python": platform.python_version(),
        "numpy": numpy.__version__,
        "host_gemm": f"oneMKL ({blas.LIBRARY})" if blas.LIBRARY else "NumPy's BLAS",
        "torch": torch.__version__,
    }


def run(
    only: Sequence[str] | None = None,
    quick: bool = False,
    rss: bool = True,
    log: Callable[[str], None] = print,
) -> dict[str, Any]:
    """Run the selected workloads (all by default) and return the JSON-ready report."""
    import torch

    from .workloads import WORKLOADS

    ids = list(WORKLOADS) if not only else list(only)
    for workload_id in ids:
        workload_module(workload_id)
    threads = torch.get_num_threads()
    torch.set_num_threads(THREADS)
    try:
        results = [run_workload(workload_id, quick, rss, log) for workload_id in ids]
    finally:
        torch.set_num_threads(threads)
    return {
        "machine": machine(),
        "quick": quick,
        "method": __doc__,
        "workloads": [r.to_json() for r in results],
    }


# -- the table ---------------------------------------------------------------------------
def _ms(median: float, lo_hi: Sequence[float]) -> str:
    return f"{median:.2f} ({lo_hi[0]:.2f}-{lo_hi[1]:.2f})"


def _mb(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def format_table(report: dict[str, Any]) -> str:
    """The report as a Markdown table, then skipped sides, warnings and notes."""
    m = report["machine"]
    lines = [
        f"tiegrad vs PyTorch eager, float32, {m['threads']} threads, {m['date']}, {m['cpu']}, "
        f"{m['cores']} cores, numpy {m['numpy']}, host GEMM {m.get('host_gemm', '?')}, "
        f"torch {m['torch']}"
        + (" (quick smoke run: timings meaningless)" if report["quick"] else ""),
        "",
        "| workload | tiegrad side | torch side | tiegrad ms/step median (min-max) "
        "| torch ms/step median (min-max) | peak RSS MB tiegrad | peak RSS MB torch "
        "| ratio tiegrad/torch |",
        "|---|---|---|---|---|---|---|---|",
    ]
    tail = []
    for w in report["workloads"]:
        for r in w["rows"]:
            lines.append(
                f"| {r['workload']} | {r['tiegrad']} | {r['torch']} "
                f"| {_ms(r['tiegrad_ms'], r['tiegrad_range_ms'])} "
                f"| {_ms(r['torch_ms'], r['torch_range_ms'])} "
                f"| {_mb(r['tiegrad_rss_mb'])} | {_mb(r['torch_rss_mb'])} | {r['ratio']:.2f} |"
            )
        for name, reason in w["skipped"].items():
            tail.append(f"{w['id']}: side {name!r} skipped: {reason}")
        for name, side in w["sides"].items():
            for problem in ("error", "skipped"):
                if side["rss"] and problem in side["rss"]:
                    tail.append(
                        f"{w['id']}: peak RSS of {name!r} {problem}: {side['rss'][problem]}"
                    )
        tail.extend(w["warnings"])
        tail.extend(f"{w['id']}: {note}" for note in w["notes"])
    methods = {
        side["rss"]["method"]
        for w in report["workloads"]
        for side in w["sides"].values()
        if side["rss"] and "method" in side["rss"]
    }
    if methods:
        tail.append(
            "peak RSS: per side in a fresh subprocess after both frameworks' imports, the "
            "peak during the steps minus the RSS before the side was built; method: "
            + ", ".join(sorted(methods))
        )
    return "\n".join(lines + ([""] + tail if tail else []))
