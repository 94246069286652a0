"""L1 Llama fine-tune: tiegrad's ``LlamaLM`` against transformers' ``LlamaForCausalLM``.

A SmolLM2-135M-shaped decoder (issue 48: vocab 49152, hidden 576, 30 layers, 9 heads,
3 key-value heads, intermediate 1536, embedding and head tied) with random weights;
one full fine-tuning step per call at batch 4 x sequence 256: mean next-token
cross-entropy, AdamW lr 3e-4, weight decay 0.01, every parameter trained. A random
transformers model is saved with ``save_pretrained`` into a temporary folder and both
sides load it from there (``tiegrad.models.from_pretrained``,
``LlamaForCausalLM.from_pretrained``), so they start from the same weights with the tie
restored on both. The torch side is PyTorch eager with ``attn_implementation="eager"``
and ``use_cache=False``. ``TIEGRAD_L1_LAYERS=N`` in the environment gives the full-size model
``N`` layers instead of 30 (a reduced run for profiling; the goals are for
30). The quick run (``make_quick_data``) uses a two-layer model of
the same family. Issue 48's goals: step time ratio <= 0.9 and peak RSS ratio <= 0.8
(``extras``). ``device_sides`` runs the step on a GPU (``benchmarks.device_w1``).
transformers is imported only when L1 or L2 runs.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Collection, Mapping
from typing import Any

import torch
import torch.nn.functional as F

from ..runner import Built, Side, SideStats
from ._common import TiegradTrainer, TorchTrainer, model_loss, token_batches, wanted

ID = "L1"
TITLE = "Llama fine-tune"
LAYERS_VARIABLE = "TIEGRAD_L1_LAYERS"
STEPS = (1, 3)  # a step takes seconds on 2 cores: each timed step adds a settling step
SHAPE = {
    "vocab_size": 49152,
    "hidden_size": 576,
    "intermediate_size": 1536,
    "num_hidden_layers": 30,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
}
QUICK_SHAPE = {
    "vocab_size": 512,
    "hidden_size": 48,
    "intermediate_size": 96,
    "num_hidden_layers": 2,
    "num_attention_heads": 3,
    "num_key_value_heads": 1,
}
BATCH, SEQ = 4, 256
QUICK_BATCH, QUICK_SEQ = 2, 16
BATCHES = 2
LR, WEIGHT_DECAY = 3e-4, 0.01
STEP_RATIO_GOAL, RSS_RATIO_GOAL = 0.9, 0.8


def llama_folder(shape: Mapping[str, int], prefix: str) -> tempfile.TemporaryDirectory:
    """A temporary folder holding a random tied Llama model of ``shape`` saved by
    transformers (SmolLM2's rotary base, norm epsilon and initialiser range; no eos
    token, so generation never stops early). Removed with the returned object."""
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        **shape, max_position_embeddings=8192, rms_norm_eps=1e-5, rope_theta=100000.0,
        initializer_range=0.041666666666666664, tie_word_embeddings=True,
        bos_token_id=None, eos_token_id=None, pad_token_id=None,
    )  # fmt: skip
    folder = tempfile.TemporaryDirectory(prefix=prefix)
    transformers.LlamaForCausalLM(config).save_pretrained(folder.name)
    return folder


def hf_model(folder: str) -> torch.nn.Module:
    """transformers' model of ``folder`` with eager attention, on the CPU."""
    import transformers

    return transformers.LlamaForCausalLM.from_pretrained(folder, attn_implementation="eager")


def _data(shape: Mapping[str, int], batch: int, seq: int) -> dict[str, Any]:
    return {
        "batches": token_batches(BATCHES, batch, seq, shape["vocab_size"], offset=48),
        "folder": llama_folder(shape, "tiegrad-l1-"),
    }


def full_shape() -> dict[str, int]:
    """``SHAPE`` with ``num_hidden_layers`` from ``TIEGRAD_L1_LAYERS`` where it is set."""
    layers = os.environ.get(LAYERS_VARIABLE)
    if layers is None:
        return dict(SHAPE)
    if not layers.isdigit() or int(layers) < 1:
        raise ValueError(f"{LAYERS_VARIABLE}={layers!r}: expected a positive layer count")
    return {**SHAPE, "num_hidden_layers": int(layers)}


def make_data() -> dict[str, Any]:
    """The batches and a temporary folder holding the saved model (removed with the dict)."""
    return _data(full_shape(), BATCH, SEQ)


def make_quick_data() -> dict[str, Any]:
    """``make_data`` for a two-layer model of the family on short sequences."""
    return _data(QUICK_SHAPE, QUICK_BATCH, QUICK_SEQ)


def torch_loss(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    logits = model(x, use_cache=False).logits
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))


def tiegrad_trainer(data: Mapping[str, Any], device: str | None = None) -> TiegradTrainer:
    """The tiegrad step on a persistent session on ``device`` (None: the host)."""
    from tiegrad import EagerSession
    from tiegrad.models import from_pretrained
    from tiegrad.optim import AdamW

    model = from_pretrained(data["folder"].name)
    optimizer = AdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)
    session = EagerSession(device=device)
    return TiegradTrainer(session, model, optimizer, model_loss, data["batches"])


def torch_trainer(data: Mapping[str, Any], device: torch.device | None = None) -> TorchTrainer:
    """The PyTorch eager step, model and batches on ``device`` (None: the CPU)."""
    model = hf_model(data["folder"].name).train()
    if device is not None:
        model.to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)
    trainer = TorchTrainer(model, optimizer, torch_loss, data["batches"])
    if device is not None:
        trainer.batches = [(x.to(device), y.to(device)) for x, y in trainer.batches]
    return trainer


def build(data: dict[str, Any], sides: Collection[str] | None = None) -> Built:
    built = Built([])
    if wanted(sides, "tiegrad"):
        built.sides.append(tiegrad_trainer(data).side())
    if wanted(sides, "torch"):
        built.sides.append(torch_trainer(data).side())
    return built


def device_sides(data: dict[str, Any], device: str, torch_device: torch.device) -> list[Side]:
    """The tiegrad step on ``EagerSession(device=device)`` and the PyTorch step on
    ``torch_device`` (the same hardware), from the same folder and batches."""
    tg = tiegrad_trainer(data, device).side(f"tiegrad {device}")
    return [tg, torch_trainer(data, torch_device).side(f"torch {torch_device.type}")]


def extras(stats: dict[str, SideStats]) -> tuple[dict[str, Any], list[str]]:
    """The step time and peak RSS ratios tiegrad/torch against issue 48's goals."""
    tg, pt = stats["tiegrad"], stats["torch"]
    step = tg.median_ms / pt.median_ms
    extra: dict[str, Any] = {"step_ratio": step, "step_ratio_goal": STEP_RATIO_GOAL}
    line = f"step time ratio {step:.2f} (goal <= {STEP_RATIO_GOAL})"
    peaks = [s.rss.get("peak_mb") if s.rss else None for s in (tg, pt)]
    if None not in peaks:
        rss = peaks[0] / peaks[1]
        extra.update(rss_ratio=rss, rss_ratio_goal=RSS_RATIO_GOAL)
        line += f", peak RSS ratio {rss:.2f} (goal <= {RSS_RATIO_GOAL})"
    return extra, [line]
