"""W1 tied-LM (W2 small-MLP, L1 Llama) on a tiegrad device backend against PyTorch eager there.

``python -m benchmarks.device_w1 [--workload W1|W2|L1] [--device torch:cpu|cuda]
[--warmup N] [--steps N] [--json FILE]``

Both sides are the workload of ``benchmarks.workloads`` (W1: vocab 96, d_model 128, 2
layers, 4 heads, sequence 64, batch 32, AdamW; W2: 64-256-256-10 MLP, batch 128, SGD
momentum): the same data, the same initial weights and the same hyperparameters.
tiegrad runs the workload's model on an ``EagerSession(device=...)`` (parameters
mirrored on the device, optimizer state on the device); PyTorch runs its eager model on
the matching torch device (CPU for ``torch:cpu``), its batches moved there once. L1
(issue 48: the SmolLM2-135M-shaped Llama, batch 4 x 256, AdamW) builds both sides with
its ``device_sides``: tiegrad's ``LlamaLM`` and transformers' model (eager attention)
from the same saved folder.
Steps alternate ABBA after warm-up (``benchmarks.runner.measure``); on a GPU every step
ends with a device synchronisation so that it is timed whole. Prints the medians, the
ranges and the ratio tiegrad/PyTorch (issue 21's goals: W1 <= 1.0 on ``cuda``).
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from . import THREADS, pin_threads


def _synchronised(side: Any, sync: Any, device: Any = None) -> Any:
    """``side`` with each step ending in ``sync()``; with ``device``, run under it as the
    torch default device (the PyTorch model makes its position ids with ``arange``)."""
    step = side.step

    def timed_step() -> None:
        if device is None:
            step()
        else:
            with device:
                step()
        sync()

    side.step = timed_step
    return side


WORKLOADS = ("W1", "W2", "L1")


def build_sides(device: str, workload: str = "W1") -> list[Any]:
    """The tiegrad side of ``workload`` on ``device`` and the PyTorch eager side on the
    same hardware."""
    import torch

    from tiegrad.backend import device_backend

    from .workloads import WORKLOADS as ALL
    from .workloads._common import TorchTrainer, load_torch, tiegrad_side

    mod = ALL[workload]
    data = mod.make_data()
    bk = device_backend(device)
    tdev = bk.torch_device
    if hasattr(mod, "device_sides"):
        tg, pt = mod.device_sides(data, device, tdev)
    else:
        tg = tiegrad_side(data, mod.TIEGRAD, f"tiegrad {device}", device)
        model = mod.TORCH.model()
        load_torch(model, data["weights"])
        model.to(tdev)
        opt = mod.TORCH.optimizer(model.parameters())
        trainer = TorchTrainer(model, opt, mod.TORCH.loss, data["batches"])
        trainer.batches = [(x.to(tdev), y.to(tdev)) for x, y in trainer.batches]
        pt = trainer.side(f"torch {tdev.type}")
    if tdev.type == "cpu":
        torch.set_num_threads(THREADS)
        return [tg, pt]
    return [_synchronised(tg, bk.synchronize), _synchronised(pt, bk.synchronize, tdev)]


def main(argv: list[str] | None = None) -> int:
    pin_threads()
    parser = argparse.ArgumentParser(prog="python -m benchmarks.device_w1")
    parser.add_argument("--workload", default="W1", choices=WORKLOADS)
    parser.add_argument("--device", default="torch:cpu", help="torch:cpu (default), cuda, mps")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--json", metavar="FILE", help="also write the figures as JSON")
    args = parser.parse_args(argv)

    from .runner import measure, probe_warnings
    from .workloads import WORKLOADS as ALL

    sides = build_sides(args.device, args.workload)
    stats = measure(sides, args.warmup, args.steps)
    tg, pt = (stats[s.name] for s in sides)
    ratio = tg.median_ms / pt.median_ms
    for line in probe_warnings(f"{args.workload} device", stats):
        print(line)
    title = f"{args.workload} {ALL[args.workload].TITLE}"
    print(f"{title} on {args.device}, {args.steps} alternating steps after {args.warmup} warm-up")
    for st in (tg, pt):
        print(
            f"  {st.name:<20} median {st.median_ms:8.2f} ms/step  "
            f"(min {st.min_ms:.2f}, max {st.max_ms:.2f}), first loss {st.first_probe:.6f}"
        )
    print(f"  ratio tiegrad/torch = {ratio:.3f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "workload": args.workload,
                    "device": args.device,
                    "ratio": ratio,
                    "sides": {k: v.to_json() for k, v in stats.items()},
                },
                f,
                indent=1,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
