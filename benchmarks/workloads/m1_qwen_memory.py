"""M1 memory at a large vocabulary: tiegrad with recomputation against transformers,
with and without its gradient checkpointing.

A Qwen2.5-0.5B-shaped decoder at reduced depth (issue 50: vocab 151936, hidden 896, 4
layers, 14 heads, 2 key-value heads, intermediate 4864, embedding and head tied; Qwen2's
biases on q, k and v, rotary base 10**6) with random weights; one full fine-tuning step
per call at batch 1 x sequence 2048: mean next-token cross-entropy, AdamW lr 3e-4,
weight decay 0.01, every parameter trained. A random transformers model is saved with
``save_pretrained`` into a temporary folder and every side loads it from there, so they
start from the same weights with the tie restored.

Sides: ``tiegrad recompute``, tiegrad's ``LlamaLM`` with ``gradient_checkpointing_enable()``
(each layer recomputed exactly in backward) and the model's own ``loss``; ``torch``,
transformers' ``Qwen2ForCausalLM`` in PyTorch eager (``attn_implementation="eager"``,
``use_cache=False``); ``torch checkpointing``, the same with transformers' gradient
checkpointing (``activation_checkpointing_enable()``, ``gradient_checkpointing_enable()``
before transformers 5). Issue 50's goals (``extras``): peak RSS <= 0.5 of
``torch`` and <= 0.8 of ``torch checkpointing``, step time <= 1.0 of ``torch
checkpointing``. The quick run (``make_quick_data``) uses a two-layer model of the same
family on 16 tokens. transformers is imported only when M1 runs.
"""

from __future__ import annotations

import tempfile
from collections.abc import Collection, Mapping
from typing import Any

import torch

from ..runner import Built, SideStats
from ._common import TiegradTrainer, TorchTrainer, model_loss, token_batches, wanted
from .l1_llama import LR, WEIGHT_DECAY, torch_loss

ID = "M1"
TITLE = "Qwen2.5-shaped fine-tune, recomputed"
STEPS = (1, 2)  # a step takes many seconds on 2 cores: each timed step adds a settling step
SHAPE = {
    "vocab_size": 151936,
    "hidden_size": 896,
    "intermediate_size": 4864,
    "num_hidden_layers": 4,
    "num_attention_heads": 14,
    "num_key_value_heads": 2,
}
QUICK_SHAPE = {
    "vocab_size": 512,
    "hidden_size": 56,
    "intermediate_size": 112,
    "num_hidden_layers": 2,
    "num_attention_heads": 14,
    "num_key_value_heads": 2,
}
BATCH, SEQ = 1, 2048
QUICK_BATCH, QUICK_SEQ = 1, 16
BATCHES = 2
TIEGRAD, TORCH, TORCH_CHECKPOINTING = "tiegrad recompute", "torch", "torch checkpointing"
RSS_GOAL, RSS_CHECKPOINTING_GOAL, STEP_CHECKPOINTING_GOAL = 0.5, 0.8, 1.0


def qwen_folder(shape: Mapping[str, int]) -> tempfile.TemporaryDirectory:
    """A temporary folder holding a random tied Qwen2 model of ``shape`` saved by
    transformers (Qwen2.5-0.5B's rotary base, norm epsilon and initialiser range; no eos
    token). Removed with the returned object."""
    import transformers

    torch.manual_seed(0)
    config = transformers.Qwen2Config(
        **shape, max_position_embeddings=32768, rms_norm_eps=1e-6, rope_theta=1000000.0,
        initializer_range=0.02, tie_word_embeddings=True,
        bos_token_id=None, eos_token_id=None, pad_token_id=None,
    )  # fmt: skip
    folder = tempfile.TemporaryDirectory(prefix="tiegrad-m1-")
    transformers.Qwen2ForCausalLM(config).save_pretrained(folder.name)
    return folder


def _data(shape: Mapping[str, int], batch: int, seq: int) -> dict[str, Any]:
    return {
        "batches": token_batches(BATCHES, batch, seq, shape["vocab_size"], offset=50),
        "folder": qwen_folder(shape),
    }


def make_data() -> dict[str, Any]:
    """The batches and a temporary folder holding the saved model (removed with the dict)."""
    return _data(SHAPE, BATCH, SEQ)


def make_quick_data() -> dict[str, Any]:
    """``make_data`` for a two-layer model of the family on 16 tokens."""
    return _data(QUICK_SHAPE, QUICK_BATCH, QUICK_SEQ)


def tiegrad_trainer(data: Mapping[str, Any]) -> TiegradTrainer:
    """tiegrad's step with every layer recomputed, on a persistent host session."""
    from tiegrad import EagerSession
    from tiegrad.models import from_pretrained
    from tiegrad.optim import AdamW

    model = from_pretrained(data["folder"].name)
    model.gradient_checkpointing_enable()
    optimizer = AdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)
    return TiegradTrainer(EagerSession(), model, optimizer, model_loss, data["batches"])


def torch_trainer(data: Mapping[str, Any], checkpointing: bool) -> TorchTrainer:
    """transformers' step in PyTorch eager, with its gradient checkpointing or without."""
    import transformers

    model = transformers.Qwen2ForCausalLM.from_pretrained(
        data["folder"].name, attn_implementation="eager"
    ).train()
    if checkpointing:  # transformers 5's name, else the earlier one
        enable = getattr(model, "activation_checkpointing_enable", None)
        (enable or model.gradient_checkpointing_enable)()
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)
    return TorchTrainer(model, optimizer, torch_loss, data["batches"])


def build(data: dict[str, Any], sides: Collection[str] | None = None) -> Built:
    built = Built([])
    if wanted(sides, TIEGRAD):
        built.sides.append(tiegrad_trainer(data).side(TIEGRAD))
    if wanted(sides, TORCH):
        built.sides.append(torch_trainer(data, False).side(TORCH))
    if wanted(sides, TORCH_CHECKPOINTING):
        built.sides.append(torch_trainer(data, True).side(TORCH_CHECKPOINTING))
    return built


def _peak(stats: SideStats) -> float | None:
    return stats.rss.get("peak_mb") if stats.rss else None


def extras(stats: dict[str, SideStats]) -> tuple[dict[str, Any], list[str]]:
    """The step time ratio against ``torch checkpointing`` and the peak RSS ratios against
    both torch sides, with issue 50's goals."""
    tg, plain, ckpt = stats[TIEGRAD], stats[TORCH], stats[TORCH_CHECKPOINTING]
    step = tg.median_ms / ckpt.median_ms
    extra: dict[str, Any] = {
        "step_ratio_checkpointing": step,
        "step_ratio_checkpointing_goal": STEP_CHECKPOINTING_GOAL,
    }
    line = f"step time ratio to torch checkpointing {step:.2f} (goal <= {STEP_CHECKPOINTING_GOAL})"
    ours = _peak(tg)
    for key, other, goal in (
        ("rss_ratio", plain, RSS_GOAL),
        ("rss_ratio_checkpointing", ckpt, RSS_CHECKPOINTING_GOAL),
    ):
        theirs = _peak(other)
        if ours is not None and theirs is not None:
            extra.update({key: ours / theirs, f"{key}_goal": goal})
            line += f", peak RSS ratio to {other.name} {ours / theirs:.2f} (goal <= {goal})"
    return extra, [line]
