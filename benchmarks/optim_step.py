"""One Adam step of tiegrad against torch.optim.Adam (default and ``fused=True``).

Run ``python benchmarks/optim_step.py``. The workload (issue 4): 300 float32 tensors
(100 of 256x256, 100 of 256, 100 of 64x64), lr 1e-3 and Adam's default betas and eps,
fixed gradients given to the step (tiegrad: a per-slot list, ``opt.step(grads)``;
PyTorch: ``.grad`` set once). A timed sample is one optimizer step. The three sides
run one sample each in turn, rotating the order every round, for ``--repeats``
rounds, and the table shows each side's median and the ratios. Everything runs on
``--threads`` threads (default 2: BLAS/OpenMP variables, ``torch.set_num_threads`` and
``TIEGRAD_NUM_THREADS``). Before timing, one step from the same values is
checked to agree across the sides; the time of tiegrad's first step (importing numba
and compiling or loading its kernels) is printed. ``--numpy`` times tiegrad's NumPy
rules instead of the fused numba kernels (``TIEGRAD_NO_NUMBA=1``).
The goals: tiegrad's median <= 0.7 x PyTorch's default (issue 4) and <= 1.0 x PyTorch's
``fused=True`` (issue 9, W4).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable


def _parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description="tiegrad Adam step vs torch.optim.Adam")
    p.add_argument("--repeats", type=int, default=41, help="timed rounds")
    p.add_argument("--threads", type=int, default=2, help="BLAS / OpenMP / torch threads")
    p.add_argument("--numpy", action="store_true", help="tiegrad's NumPy rules, not numba")
    return p.parse_args()


ARGS = _parse()
for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS", "TIEGRAD_NUM_THREADS"):
    os.environ[_var] = str(ARGS.threads)
if ARGS.numpy:
    os.environ["TIEGRAD_NO_NUMBA"] = "1"

import numpy as np  # noqa: E402  (the thread variables must be set before the import)
import torch  # noqa: E402

from tiegrad import ParamList  # noqa: E402
from tiegrad.optim import Adam, fused  # noqa: E402

torch.set_num_threads(ARGS.threads)

SHAPES = [(256, 256)] * 100 + [(256,)] * 100 + [(64, 64)] * 100
LR = 1e-3
GOALS = {"torch default": 0.7, "torch fused": 1.0}


def make_data() -> tuple[list[np.ndarray], list[np.ndarray]]:
    g = np.random.default_rng(0)
    params = [g.standard_normal(s, dtype=np.float32) for s in SHAPES]
    grads = [g.standard_normal(s, dtype=np.float32) for s in SHAPES]
    return params, grads


def tiegrad_side(params, grads) -> tuple[Callable[[], None], Callable[[], np.ndarray]]:
    plist = ParamList.of_pack(params)
    opt = Adam(plist, lr=LR)
    return (lambda: opt.step(grads)), (lambda: plist[0].value)


def torch_side(params, grads, fused: bool) -> tuple[Callable[[], None], Callable[[], np.ndarray]]:
    tensors = [torch.nn.Parameter(torch.tensor(p)) for p in params]
    for t, g in zip(tensors, grads):
        t.grad = torch.tensor(g)
    opt = torch.optim.Adam(tensors, lr=LR, fused=True if fused else None)
    return opt.step, (lambda: tensors[0].detach().numpy())


def main() -> None:
    params, grads = make_data()
    sides = {
        "tiegrad": tiegrad_side(params, grads),
        "torch default": torch_side(params, grads, fused=False),
        "torch fused": torch_side(params, grads, fused=True),
    }
    first_step = {}
    for name, (step, _) in sides.items():
        t0 = time.perf_counter()
        step()
        first_step[name] = time.perf_counter() - t0
    first = {name: probe().copy() for name, (_, probe) in sides.items()}
    for name, value in first.items():
        gap = float(np.abs(value - first["torch default"]).max())
        if gap > 1e-5:
            raise SystemExit(f"{name} disagrees with torch after one step (max gap {gap})")
    names = list(sides)
    times: dict[str, list[float]] = {name: [] for name in names}
    for r in range(ARGS.repeats):
        for name in names[r % 3 :] + names[: r % 3]:
            step = sides[name][0]
            t0 = time.perf_counter()
            step()
            times[name].append(time.perf_counter() - t0)
    med = {name: statistics.median(ts) * 1e3 for name, ts in times.items()}
    base, fast = med["torch default"], med["torch fused"]
    path = "fused numba kernels" if fused.supports(np.dtype(np.float32)) else "NumPy rules"
    print(f"Adam step, 300 float32 tensors, {ARGS.threads} threads, {ARGS.repeats} rounds")
    print(f"tiegrad: {path}; first step {first_step['tiegrad']:.2f} s (imports, compiling)")
    print(f"{'side':<14} {'median ms':>10} {'min ms':>8} {'/ default':>10} {'/ fused':>8}")
    for name in names:
        lo = min(times[name]) * 1e3
        print(
            f"{name:<14} {med[name]:>10.2f} {lo:>8.2f} "
            f"{med[name] / base:>10.2f} {med[name] / fast:>8.2f}"
        )
    for other, goal in GOALS.items():
        ratio = med["tiegrad"] / med[other]
        verdict = "met" if ratio <= goal else "not met"
        print(f"goal tiegrad <= {goal} x {other}: {ratio:.2f} ({verdict})")


if __name__ == "__main__":
    main()
