"""L2 Llama generation: greedy decoding with a KV cache, tiegrad against transformers.

L1's model (the same saved folder and weights), one 32-token prompt, 128 new tokens
greedy (``LlamaLM.generate(prompt, 128, temperature=0)`` against transformers'
``generate(do_sample=False)`` with its default cache, eager attention, on the CPU). The
model has no eos token, so both sides always produce all 128 tokens. A step is one
whole ``generate`` call (the prompt's forward pass included); the probe is the sum of
the new token ids, equal on both sides when they generate the same tokens. ``extras``
gives each side's tokens per second and the ratio tiegrad/torch, issue 48's goal being
>= 1.0. The quick run uses L1's two-layer model.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping
from typing import Any

import numpy as np
import torch

from ..runner import Built, Side, SideStats
from . import l1_llama
from ._common import rng, wanted

ID = "L2"
TITLE = "Llama greedy generation"
STEPS = (1, 6)
PROMPT, NEW_TOKENS = 32, 128
TOKENS_PER_S_GOAL = 1.0


def _data(shape: Mapping[str, int]) -> dict[str, Any]:
    prompt = rng(49).integers(0, shape["vocab_size"], size=(1, PROMPT), dtype=np.int64)
    return {"prompt": prompt, "folder": l1_llama.llama_folder(shape, "tiegrad-l2-")}


def make_data() -> dict[str, Any]:
    """The prompt (1, 32) and the saved model's folder (removed with the dict)."""
    return _data(l1_llama.SHAPE)


def make_quick_data() -> dict[str, Any]:
    """``make_data`` for L1's two-layer model."""
    return _data(l1_llama.QUICK_SHAPE)


def _side(name: str, framework: str, generate: Callable[[], np.ndarray]) -> Side:
    """A side whose step is one ``generate()`` call returning the new tokens."""
    out: list[np.ndarray] = []

    def step() -> None:
        out[:] = [generate()]

    return Side(name, framework, step, lambda: float(out[0].sum()))


def tiegrad_side(data: Mapping[str, Any]) -> Side:
    from tiegrad.models import from_pretrained

    model = from_pretrained(data["folder"].name)
    prompt = data["prompt"]
    return _side(
        "tiegrad",
        "tiegrad",
        lambda: model.generate(prompt, NEW_TOKENS, temperature=0)[:, PROMPT:],
    )


def torch_side(data: Mapping[str, Any]) -> Side:
    model = l1_llama.hf_model(data["folder"].name).eval()
    prompt = torch.from_numpy(data["prompt"])
    mask = torch.ones_like(prompt)

    def generate() -> np.ndarray:
        out = model.generate(
            prompt, attention_mask=mask, max_new_tokens=NEW_TOKENS, do_sample=False, use_cache=True
        )
        return out[:, PROMPT:].numpy()

    return _side("torch", "torch", generate)


def build(data: dict[str, Any], sides: Collection[str] | None = None) -> Built:
    built = Built([])
    if wanted(sides, "tiegrad"):
        built.sides.append(tiegrad_side(data))
    if wanted(sides, "torch"):
        built.sides.append(torch_side(data))
    return built


def extras(stats: dict[str, SideStats]) -> tuple[dict[str, Any], list[str]]:
    """Tokens per second of each side (new tokens over the median call) and their ratio."""
    tg, pt = stats["tiegrad"], stats["torch"]
    rates = {s.name: _rate(s) for s in (tg, pt)}
    ratio = rates["tiegrad"] / rates["torch"]
    extra = {"tokens_per_s": rates, "tokens_per_s_ratio": ratio, "goal": TOKENS_PER_S_GOAL}
    note = (
        f"tokens/s tiegrad {rates['tiegrad']:.1f}, torch {rates['torch']:.1f}: "
        f"ratio {ratio:.2f} (goal >= {TOKENS_PER_S_GOAL})"
    )
    return extra, [note]


def _rate(stats: SideStats) -> float:
    return NEW_TOKENS / (stats.median_ms * 1e-3)
