"""``summary(module)``: one table of storages, their paths, frozen uses and slots.

The diagnostic no other framework gives in one place (docs/design.md: why per-use
trainability): for each storage, every path naming it, which of those uses are frozen,
the optimizer slot that owns its state (the canonical slot, C5; ``-`` when frozen at
every path) and how many copies a checkpoint holds (one per storage, C9).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..params import ParamList

if TYPE_CHECKING:
    from .module import Module


def summary(module: Module) -> str:
    """A text table, one row per storage in order of first path, then the totals.

    Totals: slots, storages and optimizer slots; parameter elements and bytes over
    every slot (``total``) and over storages (``unique``, what is stored and trained).
    """
    slots = module.named_slots()
    canonical = ParamList(p for _, p in slots).canonical_slot_indices()
    rows: dict[int, list[int]] = {}
    for i, (_, p) in enumerate(slots):
        rows.setdefault(id(p.storage), []).append(i)
    header = ("storage", "paths", "frozen at", "slot", "shape", "dtype", "elements", "ckpt")
    table = [header]
    for k, members in enumerate(rows.values()):
        p = slots[members[0]][1]
        frozen = [slots[i][0] for i in members if not slots[i][1].requires_grad]
        canonical_slot = next((canonical[i] for i in members if canonical[i] is not None), None)
        table.append(
            (
                f"S{k}",
                ", ".join(slots[i][0] for i in members),
                ", ".join(frozen) or "-",
                "-" if canonical_slot is None else str(canonical_slot),
                str(p.shape),
                p.dtype.name,
                str(p.size),
                "1",
            )
        )
    widths = [max(len(row[c]) for row in table) for c in range(len(header))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in table]
    storages = [slots[m[0]][1] for m in rows.values()]
    total = sum(p.size for _, p in slots)
    total_bytes = sum(p.size * p.dtype.itemsize for _, p in slots)
    unique = sum(p.size for p in storages)
    unique_bytes = sum(p.size * p.dtype.itemsize for p in storages)
    n_opt = sum(1 for i, c in enumerate(canonical) if c == i)
    lines.append(
        f"{len(slots)} paths, {len(storages)} storages, {n_opt} optimizer slots, "
        f"{len(storages)} checkpoint tensors"
    )
    lines.append(
        f"parameters: total {total:,} ({total_bytes:,} bytes), "
        f"unique {unique:,} ({unique_bytes:,} bytes)"
    )
    return "\n".join(lines)
