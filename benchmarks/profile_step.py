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
from typing import Any  # noqa: E402

import torch  # noqa: E402

from . import THREADS  # noqa: E402
from .workloads import WORKLOADS  # noqa: E402
from .workloads._common import load_torch, set_tiegrad_weights, torch_batches  # noqa: E402

DEFAULT = ("W1", "W2", "W3", "W5")


def tiegrad_step(data: dict[str, Any], recipe: Any, full: bool) -> Callable[[], None]:
    """One tiegrad step per call on a persistent session: forward, backward (, update)."""
    from tiegrad import EagerSession

    session = EagerSession()
    model = recipe.model()
    set_tiegrad_weights(model, data["weights"])
    opt = recipe.optimizer(model.parameters()) if full else None
    batches = data["batches"]
    count = [0]

    def step() -> None:
        x, y = batches[count[0] % len(batches)]
        count[0] += 1
        grads = session.backward(recipe.loss(model, session, x, y))
        if opt is not None:
            opt.step(grads)
        session.reset()

    return step


def torch_step(data: dict[str, Any], recipe: Any, full: bool) -> Callable[[], None]:
    """One PyTorch eager step per call: zero grads, forward, backward (, update)."""
    model = recipe.model()
    load_torch(model, data["weights"])
    opt = recipe.optimizer(model.parameters())
    batches = torch_batches(data["batches"])
    count = [0]

    def step() -> None:
        x, y = batches[count[0] % len(batches)]
        count[0] += 1
        opt.zero_grad(set_to_none=True)
        recipe.loss(model, x, y).backward()
        if full:
            opt.step()

    return step


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
            "tiegrad": tiegrad_step(data, mod.TIEGRAD, args.full),
            "torch": torch_step(data, mod.TORCH, args.full),
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
