"""``summary``: per storage its paths, frozen uses, optimizer slot and checkpoint copies."""

from __future__ import annotations

import numpy as np

from tiegrad import nn as tnn
from tiegrad.models import TiedLM


def rows(text: str) -> dict[str, list[str]]:
    """Storage label -> its cells, split on runs of two spaces."""
    out = {}
    for line in text.splitlines()[1:]:
        if line.startswith("S"):
            cells = [c.strip() for c in line.split("  ") if c.strip()]
            out[cells[0]] = cells[1:]
    return out


def test_summary_reports_paths_frozen_uses_slots_and_copies():
    m = TiedLM(11, d_model=8, n_layers=1, n_heads=2, max_seq_len=5)
    m.freeze("lm_head.weight")
    m.freeze("pos_embed.weight")
    text = tnn.summary(m)
    table = rows(text)
    assert table["S0"] == [
        "embed.weight, lm_head.weight",
        "lm_head.weight",
        "0",
        "(11, 8)",
        "float32",
        "88",
        "1",
    ]
    assert table["S1"][:3] == ["pos_embed.weight", "pos_embed.weight", "-"]
    assert len(table) == len(list(m.named_parameters())) == 16
    n_slots = len(m.named_slots())
    assert f"{n_slots} paths, 16 storages, 15 optimizer slots, 16 checkpoint tensors" in text
    unique, total = m.num_parameters(), m.num_parameters(unique=False)
    assert total - unique == 11 * 8
    assert (
        f"total {total:,} ({4 * total:,} bytes), unique {unique:,} ({4 * unique:,} bytes)" in text
    )


def test_summary_of_a_storage_frozen_at_one_path_and_trainable_at_the_next():
    m = tnn.Module()
    m.a, m.b = tnn.Linear(2, 2, bias=False), tnn.Linear(2, 2, bias=False, dtype=np.float32)
    tnn.tie(m, "b.weight", "a.weight")
    m.freeze("a.weight")
    assert rows(tnn.summary(m))["S0"][:3] == ["a.weight, b.weight", "a.weight", "1"]
