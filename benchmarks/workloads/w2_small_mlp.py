"""W2 small-MLP: 64 -> 256 -> 256 -> 10, ReLU, batch 128, SGD momentum 0.9.

Overhead-dominated: the arrays are small, so the per-op cost of the tape and the
optimizer's per-tensor work decide the ratio. ``tiegrad.models.MLPClassifier`` (mean
cross-entropy over 10 classes) against its PyTorch mirror; the optional side
``tiegrad torch:cpu`` runs the same tiegrad model on the torch CPU device backend
(issue 21: the device path's per-op overhead) and is skipped, with the reason, where
that backend is not available.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from ..runner import Built
from ._common import Recipe, build_training, model_loss, rng, training_data
from ._torch_models import Classifier

ID = "W2"
TITLE = "small-MLP"
STEPS = (20, 200)
SIZES = [64, 256, 256, 10]
BATCH = 128
BATCHES = 4
LR = 0.01
MOMENTUM = 0.9
DEVICE = "torch:cpu"


def _model() -> Any:
    from tiegrad.models import MLPClassifier

    return MLPClassifier(SIZES[0], SIZES[1:-1], SIZES[-1], activation="relu")


def _optimizer(params: Any) -> Any:
    from tiegrad.optim import SGD

    return SGD(params, lr=LR, momentum=MOMENTUM)


def _torch_loss(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(model(x), y)


TIEGRAD = Recipe(_model, _optimizer, model_loss)
TORCH = Recipe(
    lambda: Classifier(SIZES),
    lambda params: torch.optim.SGD(params, lr=LR, momentum=MOMENTUM),
    _torch_loss,
)


def make_data() -> dict[str, Any]:
    """``BATCHES`` batches of inputs and class labels, and the initial weights."""
    g = rng(2)
    batches = [
        (
            g.standard_normal((BATCH, SIZES[0]), dtype=np.float32),
            g.integers(0, SIZES[-1], size=BATCH, dtype=np.int64),
        )
        for _ in range(BATCHES)
    ]
    return training_data(_model, batches)


def build(data: dict[str, Any], sides: Collection[str] | None = None) -> Built:
    return build_training(data, sides, TIEGRAD, TORCH, device=DEVICE)
