"""G3 Llama LoRA fine-tune: rank-16 adapters on every projection of L1's model.

L1's SmolLM2-135M-shaped tied Llama (random weights saved by transformers, loaded by
both sides from the same folder), L1's batches (4 x 256) and AdamW (lr 3e-4, weight
decay 0.01). Both sides attach LoRA (rank 16, alpha 32, no dropout) to ``q_proj``,
``k_proj``, ``v_proj``, ``o_proj``, ``gate_proj``, ``up_proj`` and ``down_proj`` of
every layer: tiegrad's ``add_lora``, peft's ``get_peft_model`` on transformers'
``LlamaForCausalLM`` (torch eager, ``attn_implementation="eager"``). They start from the
same adapter weights, drawn here: ``A`` as PEFT draws it, ``B`` small and non-zero (a
zero ``B`` would hide a mismatch from the first-step probes). Only the adapters train
(the tied embedding and head frozen on both sides), and the optimizer sees only them.
Issue 49's goals: step time ratio <= 0.9 and peak RSS ratio <= 0.8 (``extras``). The
quick run (``make_quick_data``) uses L1's two-layer model. transformers and peft are
imported only when G3 runs.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Mapping
from typing import Any

import numpy as np
import torch

from ..runner import Built
from . import l1_llama
from ._common import TiegradTrainer, TorchTrainer, model_loss, rng, wanted

ID = "G3"
TITLE = "Llama LoRA fine-tune"
STEPS = l1_llama.STEPS
RANK, ALPHA = 16, 32
ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP = ("gate_proj", "up_proj", "down_proj")
TARGETS = ATTENTION + MLP


def projections(shape: Mapping[str, int]) -> dict[str, tuple[int, int]]:
    """``{projection: (fan_in, fan_out)}`` of one layer of a model of ``shape``."""
    d, inner = shape["hidden_size"], shape["intermediate_size"]
    head = d // shape["num_attention_heads"]
    kv = head * shape["num_key_value_heads"]
    return {
        "q_proj": (d, d), "k_proj": (d, kv), "v_proj": (d, kv), "o_proj": (d, d),
        "gate_proj": (d, inner), "up_proj": (d, inner), "down_proj": (inner, d),
    }  # fmt: skip


def _data(shape: Mapping[str, int], data: dict[str, Any]) -> dict[str, Any]:
    """L1's ``data`` plus the initial adapters ``{module path: (A, B)}`` in PEFT's layout."""
    g = rng(13)
    adapters = {}
    for i in range(shape["num_hidden_layers"]):
        for name, (fan_in, fan_out) in projections(shape).items():
            block = "self_attn" if name in ATTENTION else "mlp"
            bound = 1.0 / math.sqrt(fan_in)
            a = g.uniform(-bound, bound, (RANK, fan_in)).astype(np.float32)
            b = g.normal(0.0, 0.01, (fan_out, RANK)).astype(np.float32)
            adapters[f"model.layers.{i}.{block}.{name}"] = (a, b)
    data["adapters"] = adapters
    return data


def make_data() -> dict[str, Any]:
    """L1's batches and saved model (a temporary folder, removed with the dict) and the
    initial adapters."""
    return _data(l1_llama.SHAPE, l1_llama.make_data())


def make_quick_data() -> dict[str, Any]:
    """``make_data`` for L1's two-layer model on short sequences."""
    return _data(l1_llama.QUICK_SHAPE, l1_llama.make_quick_data())


def tiegrad_trainer(data: Mapping[str, Any]) -> TiegradTrainer:
    from tiegrad import EagerSession
    from tiegrad.adapters import add_lora
    from tiegrad.models import from_pretrained
    from tiegrad.optim import AdamW

    model = from_pretrained(data["folder"].name)
    add_lora(model, TARGETS, rank=RANK, alpha=ALPHA)
    for path, (a, b) in data["adapters"].items():
        model.get_parameter(f"{path}.lora.default.A").set_value(a)
        model.get_parameter(f"{path}.lora.default.B").set_value(b)
    optimizer = AdamW(model.parameters(), lr=l1_llama.LR, weight_decay=l1_llama.WEIGHT_DECAY)
    return TiegradTrainer(EagerSession(), model, optimizer, model_loss, data["batches"])


def torch_trainer(data: Mapping[str, Any]) -> TorchTrainer:
    import peft

    hf = l1_llama.hf_model(data["folder"].name).train()
    config = peft.LoraConfig(
        r=RANK, lora_alpha=ALPHA, lora_dropout=0.0, target_modules=list(TARGETS)
    )
    model = peft.get_peft_model(hf, config)
    state = {}
    for path, (a, b) in data["adapters"].items():
        state[f"base_model.model.{path}.lora_A.weight"] = torch.from_numpy(a)
        state[f"base_model.model.{path}.lora_B.weight"] = torch.from_numpy(b)
    peft.set_peft_model_state_dict(model, state)
    trained = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trained, lr=l1_llama.LR, weight_decay=l1_llama.WEIGHT_DECAY)
    return TorchTrainer(model, optimizer, l1_llama.torch_loss, data["batches"])


def build(data: dict[str, Any], sides: Collection[str] | None = None) -> Built:
    built = Built([])
    if wanted(sides, "tiegrad"):
        built.sides.append(tiegrad_trainer(data).side())
    if wanted(sides, "torch"):
        built.sides.append(torch_trainer(data).side())
    return built


#: The step time and peak RSS ratios against the goals, which are L1's.
extras = l1_llama.extras
