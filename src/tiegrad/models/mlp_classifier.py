"""``MLPClassifier``: an MLP over feature vectors with a cross-entropy loss."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from .. import ops
from ..nn.layers import MLP, hidden_widths
from ..optim.hyperparams import size, unit_interval
from ..session import EagerSession, TensorRef
from ._configured import ConfiguredModel, activation_name, listed


class MLPClassifier(ConfiguredModel):
    """``mlp``: ``in_features -> hidden... -> n_classes`` logits (see ``tiegrad.nn.MLP``).

    ``loss(session, x, y)`` is the mean cross entropy against integer labels ``y`` (B,);
    ``predict(x)`` returns the arg-max classes without recording gradients. ``config``
    holds the constructor arguments.
    """

    ARGS = {
        "in_features": size,
        "hidden": hidden_widths,
        "n_classes": size,
        "activation": activation_name,
        "dropout": unit_interval,
    }

    def __init__(
        self,
        in_features: int,
        hidden: int | Sequence[int],
        n_classes: int,
        activation: str = "relu",
        dropout: float = 0.0,
        seed: int = 0,
        dtype: Any = "float32",
    ) -> None:
        super().__init__()
        rng, dt = self._configure(
            seed,
            dtype,
            in_features=in_features,
            hidden=listed(hidden),
            n_classes=n_classes,
            activation=activation,
            dropout=dropout,
        )
        self.mlp = MLP(in_features, hidden, n_classes, activation, dropout, rng=rng, dtype=dt)

    def forward(self, session: EagerSession, x: Any) -> TensorRef:
        return self.mlp(session, x)

    def loss(self, session: EagerSession, x: Any, y: Any) -> TensorRef:
        return ops.cross_entropy(self(session, x), y)

    def predict(self, x: Any) -> np.ndarray:
        """Arg-max classes (B,) in eval mode on a host session; the training flag is restored."""
        with self._inference() as session:
            logits = self(session, x).numpy()
        return np.argmax(logits, axis=-1)
