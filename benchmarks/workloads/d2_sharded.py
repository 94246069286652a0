"""D2 sharded data-parallel tied-LM: D1's model and AdamW on 2 gloo processes, ZeRO 1 and 2.

Each side is a pool of 2 worker processes (D1's ``d1_worker``, started and driven as
D1 starts and drives them): ``tiegrad stage 1`` (``DataParallel(shard="optimizer")``)
and ``tiegrad stage 2`` (``shard="gradients"``) against ``tiegrad unsharded`` (D1's
data-parallel step) and, on the PyTorch side, ``torch DDP + ZeRO``
(``DistributedDataParallel`` with ``torch.distributed.optim.ZeroRedundancyOptimizer``
over AdamW) and ``torch DDP``. A timed step is the slower rank's full training step.

After the timing every worker reports the bytes of optimizer state and of averaged
gradients it holds between steps (the arrays themselves; stage 2's packing scratch,
held during its gradient scatter only, apart) and its peak RSS; the extras list them per
rank and per side, with each tiegrad stage's share of the unsharded side's bytes.
The peak RSS columns of the table measure the controlling process only: the workers'
own peaks are in the extras.
"""

from __future__ import annotations

import statistics
from collections.abc import Collection
from typing import Any

from ..runner import Built, SideStats
from . import w1_tied_lm as w1
from ._common import wanted
from .d1_data_parallel import _Pool

ID = "D2"
TITLE = "sharded data-parallel tied-LM (2 gloo processes, AdamW)"
STEPS = w1.STEPS
# side: (framework, worker variant)
SIDES = {
    "tiegrad stage 1": ("tiegrad", "optimizer"),
    "tiegrad stage 2": ("tiegrad", "gradients"),
    "tiegrad unsharded": ("tiegrad", None),
    "torch DDP + ZeRO": ("torch", "zero"),
    "torch DDP": ("torch", None),
}
_POOLS: dict[str, _Pool] = {}  # the pools of the latest build, for extras


def make_data() -> dict[str, Any]:
    """Nothing to share: each worker makes W1's data and weights itself (seeded)."""
    return {}


def build(data: dict[str, Any], sides: Collection[str] | None = None) -> Built:
    built = Built([])
    _POOLS.clear()
    for name, (framework, variant) in SIDES.items():
        if wanted(sides, name):
            pool = _POOLS[name] = _Pool(framework, *([variant] if variant else []))
            built.sides.append(pool.side(name, framework, "step"))
    return built


def extras(stats: dict[str, SideStats]) -> tuple[dict[str, Any], list[str]]:
    """Per side and rank: optimizer-state bytes, gradient bytes, peak RSS; the stages'
    shares of the unsharded side's bytes; the step-time ratios against ZeRO."""
    held = {name: pool.memory() for name, pool in _POOLS.items()}
    notes = []
    shares: dict[str, dict[str, float]] = {}
    base = held.get("tiegrad unsharded")
    for name, ranks in held.items():
        figures = "; ".join(
            f"rank {r}: state {m['optimizer_state'] / 2**20:.2f} MiB, gradients "
            f"{m['gradients'] / 2**20:.2f} MiB{_scratch(m)}, peak RSS {m['peak_rss_mb']:.0f} MB"
            for r, m in enumerate(ranks)
        )
        notes.append(f"{name}: {figures}")
        if base is not None and name.startswith("tiegrad stage"):
            shares[name] = {
                key: max(m[key] for m in ranks) / max(m[key] for m in base)
                for key in ("optimizer_state", "gradients")
            }
            notes.append(
                f"{name} / tiegrad unsharded, the larger rank: optimizer state "
                f"{shares[name]['optimizer_state']:.2f}x, gradients "
                f"{shares[name]['gradients']:.2f}x"
            )
    ratios = {}
    zero = stats.get("torch DDP + ZeRO")
    for name in ("tiegrad stage 1", "tiegrad stage 2", "tiegrad unsharded"):
        if name in stats and zero is not None:
            ratios[name] = stats[name].median_ms / zero.median_ms
    if ratios:
        notes.append(
            "step time against torch DDP + ZeRO (medians): "
            + ", ".join(f"{n} {r:.2f}" for n, r in ratios.items())
        )
    notes.append(
        "D2 peak RSS columns: the controlling process only; the workers' are above "
        f"(median step ms: {_medians(stats)})"
    )
    return {"held": held, "share_of_unsharded": shares, "ratio_to_zero": ratios}, notes


def _scratch(m: dict[str, float]) -> str:
    """Stage 2's packing scratch, held during the gradient scatter only."""
    return f" (+{m['scratch'] / 2**20:.2f} MiB scratch in the step)" if m.get("scratch") else ""


def _medians(stats: dict[str, SideStats]) -> str:
    return ", ".join(f"{n} {statistics.median(s.times_ms):.1f}" for n, s in stats.items())
