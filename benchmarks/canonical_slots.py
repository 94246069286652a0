"""Time ``ParamList.canonical_slot_indices`` on 10k and 100k slots with random sharing.

Run ``python benchmarks/canonical_slots.py``. Each slot holds a handle on one of
``slots // 3`` storages chosen at random (so most storages are tied to several slots)
and one slot in ten is a frozen alias. The alias map is one hash index on storage
identity (C5), so the time should grow linearly: the printed ratio should be near 10.
The time per slot is printed too; ``--sizes 10000,100000,300000`` shows it level off
once the working set (handles, index, result) has left the per-core L2 cache.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from tiegrad import Param, ParamList


def random_layout(slots: int, rng: np.random.Generator) -> ParamList:
    """``slots`` handles over ``slots // 3`` storages, one frozen alias in ten."""
    bases = [Param(np.zeros(1, np.float32)) for _ in range(max(1, slots // 3))]
    owners = rng.integers(0, len(bases), size=slots)
    frozen = rng.random(slots) < 0.1
    return ParamList(bases[o].alias(requires_grad=not f) for o, f in zip(owners, frozen))


def median_seconds(pl: ParamList, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        pl.canonical_slot_indices()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=15, help="timed calls per size")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--sizes", default="10000,100000", help="comma-separated slot counts")
    args = parser.parse_args()
    sizes = [int(n) for n in args.sizes.split(",")]
    rng = np.random.default_rng(args.seed)
    results = {}
    for slots in sizes:
        pl = random_layout(slots, rng)
        pl.canonical_slot_indices()  # warm-up
        results[slots] = median_seconds(pl, args.repeats)
        print(
            f"{slots:>8} slots: {results[slots] * 1e3:8.3f} ms "
            f"({results[slots] / slots * 1e9:5.0f} ns/slot, median of {args.repeats})"
        )
    small, large = sizes[0], sizes[-1]
    print(
        f"ratio {large} / {small} slots: {results[large] / results[small]:.2f} "
        f"(linear: {large / small:g})"
    )


if __name__ == "__main__":
    main()
