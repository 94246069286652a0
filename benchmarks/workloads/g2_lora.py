"""G2 LoRA fine-tune: rank-8 adapters on every attention projection of G1's GPT-2.

G1's model, batches and AdamW (lr 3e-4, weight decay 0.01). Both sides load the saved
model and attach LoRA (rank 8, alpha 16, no dropout) to ``attn.c_attn`` and
``attn.c_proj`` of every block: tiegrad's ``add_lora``, peft's ``get_peft_model``
(``fan_in_fan_out``, as for GPT-2's ``Conv1D``). They start from the same adapter
weights, drawn here: ``A`` as PEFT draws it, ``B`` small and non-zero (PEFT's zero
``B`` would hide a mismatch from the first-step probes). Only the adapters train, and
the optimizer sees only them. ``extras`` reports each side's optimizer state bytes,
which must be twice the adapter elements in float32: no state for the frozen base.
transformers and peft are imported only when G2 runs.
"""

from __future__ import annotations

import math
from collections.abc import Collection
from typing import Any

import numpy as np
import torch

from ..runner import Built, SideStats
from . import g1_gpt2
from ._common import TiegradTrainer, TorchTrainer, model_loss, rng, wanted

ID = "G2"
TITLE = "GPT-2 LoRA fine-tune"
STEPS = g1_gpt2.STEPS
RANK, ALPHA = 8, 16
TARGETS = ("attn.c_attn", "attn.c_proj")


def make_data() -> dict[str, Any]:
    """G1's data (its folder removed once the sides have loaded the model) and the initial
    adapters ``{module path: (A, B)}`` in PEFT's layout."""
    data = g1_gpt2.make_data()
    g, d = rng(11), g1_gpt2.D_MODEL
    adapters = {}
    for i in range(g1_gpt2.LAYERS):
        for name, fan_out in (("c_attn", 3 * d), ("c_proj", d)):
            bound = 1.0 / math.sqrt(d)
            a = g.uniform(-bound, bound, (RANK, d)).astype(np.float32)
            b = g.normal(0.0, 0.01, (fan_out, RANK)).astype(np.float32)
            adapters[f"transformer.h.{i}.attn.{name}"] = (a, b)
    data["adapters"] = adapters
    return data


def tiegrad_trainer(data: dict[str, Any]) -> TiegradTrainer:
    from tiegrad import EagerSession
    from tiegrad.adapters import add_lora
    from tiegrad.models import GPT2
    from tiegrad.optim import AdamW

    model = GPT2.from_pretrained(data["folder"].name)
    add_lora(model, TARGETS, rank=RANK, alpha=ALPHA)
    for path, (a, b) in data["adapters"].items():
        model.get_parameter(f"{path}.lora.default.A").set_value(a)
        model.get_parameter(f"{path}.lora.default.B").set_value(b)
    optimizer = AdamW(model.parameters(), lr=g1_gpt2.LR, weight_decay=g1_gpt2.WEIGHT_DECAY)
    return TiegradTrainer(EagerSession(), model, optimizer, model_loss, data["batches"])


def torch_trainer(data: dict[str, Any]) -> TorchTrainer:
    import peft
    import transformers

    hf = transformers.GPT2LMHeadModel.from_pretrained(data["folder"].name).train()
    config = peft.LoraConfig(
        r=RANK, lora_alpha=ALPHA, lora_dropout=0.0, target_modules=list(TARGETS),
        fan_in_fan_out=True,
    )  # fmt: skip
    model = peft.get_peft_model(hf, config)
    state = {}
    for path, (a, b) in data["adapters"].items():
        state[f"base_model.model.{path}.lora_A.weight"] = torch.from_numpy(a)
        state[f"base_model.model.{path}.lora_B.weight"] = torch.from_numpy(b)
    peft.set_peft_model_state_dict(model, state)
    trained = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trained, lr=g1_gpt2.LR, weight_decay=g1_gpt2.WEIGHT_DECAY)
    return TorchTrainer(model, optimizer, g1_gpt2.torch_loss, data["batches"])


def build(data: dict[str, Any], sides: Collection[str] | None = None) -> Built:
    built = Built([])
    if wanted(sides, "tiegrad"):
        built.sides.append(tiegrad_trainer(data).side())
    if wanted(sides, "torch"):
        built.sides.append(torch_trainer(data).side())
    data["folder"].cleanup()  # the sides hold the model in memory: nothing reads the files again
    return built


def extras(stats: dict[str, SideStats]) -> tuple[dict[str, Any], list[str]]:
    """Optimizer state bytes of each side after one step, against 2 x adapter elements."""
    data = make_data()
    elements = sum(a.size + b.size for a, b in data["adapters"].values())
    tg, pt = tiegrad_trainer(data), torch_trainer(data)
    data["folder"].cleanup()
    tg.step()
    pt.step()
    tiegrad_bytes = sum(
        v.nbytes for st in tg.optimizer.state.values() for k, v in st.items() if k != "step"
    )
    torch_bytes = sum(
        t.nbytes
        for st in pt.optimizer.state.values()
        for k, t in st.items()
        if k in ("exp_avg", "exp_avg_sq")
    )
    expected = 2 * elements * 4
    extra = {
        "adapter_elements": elements,
        "expected_state_bytes": expected,
        "optimizer_state_bytes": {"tiegrad": tiegrad_bytes, "torch": torch_bytes},
    }
    notes = [
        f"optimizer state (AdamW moments): tiegrad {tiegrad_bytes:,} bytes, peft {torch_bytes:,} "
        f"bytes; 2 x {elements:,} adapter elements x 4 bytes = {expected:,}"
    ]
    return extra, notes
