"""``SiameseEncoder``: one encoder applied to two inputs, trained with a contrastive loss."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from .. import ops
from ..nn._input import check_shape
from ..nn.layers import MLP, hidden_widths
from ..optim.hyperparams import positive, size
from ..session import EagerSession, TensorRef
from ._configured import ConfiguredModel, activation_name, listed


class SiameseEncoder(ConfiguredModel):
    """An MLP ``encoder`` (``in_features -> hidden -> embed_dim``) shared by both inputs.

    ``model(session, x1, x2)`` returns the two embeddings; both applications use the same
    storages, so each storage gets the sum of both uses' gradients and one update (C4).
    ``loss`` is the contrastive loss of Hadsell, Chopra and LeCun (2006): with distance
    ``d = |z1 - z2|``, ``same * d**2 + (1 - same) * max(0, margin - d)**2``, averaged.
    ``config`` holds the constructor arguments.
    """

    ARGS = {
        "in_features": size,
        "hidden": hidden_widths,
        "embed_dim": size,
        "activation": activation_name,
        "margin": positive,
    }

    def __init__(
        self,
        in_features: int,
        hidden: int | Sequence[int] = 64,
        embed_dim: int = 32,
        activation: str = "relu",
        margin: float = 1.0,
        seed: int = 0,
        dtype: Any = "float32",
    ) -> None:
        super().__init__()
        rng, dt = self._configure(
            seed,
            dtype,
            in_features=in_features,
            hidden=listed(hidden),
            embed_dim=embed_dim,
            activation=activation,
            margin=margin,
        )
        self.margin = float(margin)
        self.encoder = MLP(in_features, hidden, embed_dim, activation, rng=rng, dtype=dt)

    def forward(self, session: EagerSession, x1: Any, x2: Any) -> tuple[TensorRef, TensorRef]:
        return self.encoder(session, x1), self.encoder(session, x2)

    def loss(self, session: EagerSession, x1: Any, x2: Any, same: Any) -> TensorRef:
        """Contrastive loss; ``same`` (B,) is 1 for pairs of one class, 0 otherwise."""
        z1, z2 = self(session, x1, x2)
        flags = np.asarray(same, dtype=session.backend.dtype_name(z1.dtype))
        check_shape(self, "same", flags.shape, (z1.shape[0],))
        same = session.constant(flags)
        diff = z1 - z2
        d2 = (diff * diff).sum(axis=-1)
        gap = ops.relu(self.margin - ops.sqrt(d2 + 1e-12))
        return (same * d2 + (1.0 - same) * (gap * gap)).mean()
