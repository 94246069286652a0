"""Forward+backward of the issue 9 workloads, tiegrad against PyTorch eager, plus a profile.

Run ``python -m benchmarks.profile_step [--only W1,W5] [--steps N] [--full] [--top K]``.
For each workload (W1, W2, W3, W5) it builds the tiegrad model and its PyTorch twin from
the workload's own recipe and data (``benchmarks.workloads``: same weights, same
batches, float32), then times one step of each side in turn, alternating the order
every round, and prints the median ms per step and the ratio tiegrad/PyTorch. A step
is forward + backward (``--full`` adds the optimizer update). tiegrad runs on a
persistent ``EagerSession`` reset after every step (the intended fast path). With
``--top K`` it then prints the K costliest functions of a cProfile of tiegrad's steps.
Everything runs on ``benchmarks.THREADS`` threads.
"""

from __future__ import annotations

from . import pin_threads

pin_threads()

import argparse  # noqa: E402
import cProfile  # noqa: E402
import gc  # noqa: E402
import pstats  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402
from collections.abc import Callable  # noqa: E402

import torch  # noqa: E402

from . import THREADS  # noqa: E402
from .workloads import WORKLOADS  # noqa: E402
from .workloads._common import tiegrad_side, torch_side  # noqa: E402

DEFAULT = ("W1", "W2", "W3", "W5")


def _time(fn: Callable[[], None]) -> float:
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1e3


def measure(steps: dict[str, Callable[[], None]], n: int, warmup: int = 3) -> dict[str, float]:
    """Median ms per step of each side, the sides alternating (ABBA) for ``n`` rounds."""
    for fn in steps.values():
        for _ in range(warmup):
            fn()
    names = list(steps)
    times: dict[str, list[float]] = {k: [] for k in names}
    for r in range(n):
        for k in names if r % 2 == 0 else reversed(names):
            times[k].append(_time(steps[k]))
    return {k: statistics.median(v) for k, v in times.items()}


def profile(step: Callable[[], None], n: int, top: int) -> None:
    """Print the ``top`` functions by own time over ``n`` steps."""
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(n):
        step()
    prof.disable()
    pstats.Stats(prof).sort_stats("tottime").print_stats(top)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.profile_step")
    p.add_argument("--only", default=",".join(DEFAULT), help="workload ids, e.g. W1,W5")
    p.add_argument("--steps", type=int, default=20, help="timed rounds per workload")
    p.add_argument("--full", action="store_true", help="include the optimizer update")
    p.add_argument("--top", type=int, default=0, help="print a cProfile top list of K rows")
    args = p.parse_args(argv)
    torch.set_num_threads(THREADS)
    what = "forward+backward+update" if args.full else "forward+backward"
    print(f"{what}, median of {args.steps} alternating rounds, {THREADS} threads")
    for wid in args.only.split(","):
        mod = WORKLOADS[wid.strip()]
        data = mod.make_data()
        steps = {
            "tiegrad": tiegrad_side(data, mod.TIEGRAD, update=args.full).step,
            "torch": torch_side(data, mod.TORCH, update=args.full).step,
        }
        gc.collect()
        med = measure(steps, args.steps)
        ratio = med["tiegrad"] / med["torch"]
        print(
            f"{mod.ID} {mod.TITLE:14s} tiegrad {med['tiegrad']:8.2f} ms  "
            f"torch {med['torch']:8.2f} ms  ratio {ratio:5.2f}",
            flush=True,
        )
        if args.top:
            profile(steps["tiegrad"], max(3, args.steps // 2), args.top)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
