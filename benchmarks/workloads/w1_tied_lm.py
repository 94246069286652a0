"""W1 tied-LM: character transformer LM with its output projection tied to the embedding.

Vocab 96, d_model 128, 2 layers, 4 heads, sequence 64, batch 32, GELU MLP 4x, pre-LN,
learned positions, final LayerNorm; AdamW lr 3e-4, weight decay 0.01; mean
cross-entropy. ``tiegrad.models.TiedLM`` against its PyTorch mirror; the optional side
``tiegrad torch:cpu`` runs the same tiegrad model on the torch CPU device backend and
is skipped, with the reason, where that backend is not available.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

import torch

from ..runner import Built
from ._common import Recipe, build_training, model_loss, token_batches, training_data
from ._torch_models import TiedLM, lm_loss

ID = "W1"
TITLE = "tied-LM"
STEPS = (3, 30)
VOCAB, D_MODEL, LAYERS, HEADS, SEQ, BATCH = 96, 128, 2, 4, 64, 32
BATCHES = 4
LR, WEIGHT_DECAY = 3e-4, 0.01
DEVICE = "torch:cpu"


def _model() -> Any:
    from tiegrad.models import TiedLM as TiegradTiedLM

    return TiegradTiedLM(VOCAB, D_MODEL, LAYERS, HEADS, SEQ)


def _optimizer(params: Any) -> Any:
    from tiegrad.optim import AdamW

    return AdamW(params, lr=LR, weight_decay=WEIGHT_DECAY)


TIEGRAD = Recipe(_model, _optimizer, model_loss)
TORCH = Recipe(
    lambda: TiedLM(VOCAB, D_MODEL, HEADS, SEQ, n_blocks=LAYERS),
    lambda params: torch.optim.AdamW(params, lr=LR, weight_decay=WEIGHT_DECAY),
    lm_loss,
)


def make_data() -> dict[str, Any]:
    return training_data(_model, token_batches(BATCHES, BATCH, SEQ, VOCAB, offset=1))


def build(data: dict[str, Any], sides: Collection[str] | None = None) -> Built:
    return build_training(data, sides, TIEGRAD, TORCH, device=DEVICE)
