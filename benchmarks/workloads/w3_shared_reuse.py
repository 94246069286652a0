"""W3 shared-reuse: ONE transformer block applied 6 times, tied embedding and output.

d_model 128, 4 heads, sequence 32, batch 16, vocab 96, Adam lr 3e-4: every block
parameter is used 6 times per step, so its gradient is a sum of 6 uses (C4).
``tiegrad.models.SharedBlockLM`` against its PyTorch mirror.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

import torch

from ..runner import Built
from ._common import Recipe, build_training, model_loss, token_batches, training_data
from ._torch_models import TiedLM, lm_loss

ID = "W3"
TITLE = "shared-reuse"
STEPS = (3, 30)
VOCAB, D_MODEL, HEADS, SEQ, BATCH, REPEATS = 96, 128, 4, 32, 16, 6
BATCHES = 4
LR = 3e-4


def _model() -> Any:
    from tiegrad.models import SharedBlockLM

    return SharedBlockLM(VOCAB, D_MODEL, HEADS, n_repeats=REPEATS, max_seq_len=SEQ)


def _optimizer(params: Any) -> Any:
    from tiegrad.optim import Adam

    return Adam(params, lr=LR)


TIEGRAD = Recipe(_model, _optimizer, model_loss)
TORCH = Recipe(
    lambda: TiedLM(VOCAB, D_MODEL, HEADS, SEQ, repeats=REPEATS),
    lambda params: torch.optim.Adam(params, lr=LR),
    lm_loss,
)


def make_data() -> dict[str, Any]:
    return training_data(_model, token_batches(BATCHES, BATCH, SEQ, VOCAB, offset=3))


def build(data: dict[str, Any], sides: Collection[str] | None = None) -> Built:
    return build_training(data, sides, TIEGRAD, TORCH)
