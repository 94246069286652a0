"""``ConfiguredModel``: the base of the reference models, rebuildable from ``config``."""

from __future__ import annotations

from typing import Any

import numpy as np

from ..nn import init
from ..nn.module import Module


class ConfiguredModel(Module):
    """A model whose ``config`` holds its constructor arguments: ``type(m)(**m.config)``."""

    config: dict[str, Any]

    def _configure(
        self, seed: int, dtype: Any, **args: Any
    ) -> tuple[np.random.Generator, np.dtype]:
        """Set ``config`` to ``args`` plus ``seed`` and the dtype's name; return the model's
        generator ``default_rng(seed)`` and the floating dtype."""
        dt = init.float_dtype(dtype)
        self.config = dict(args, seed=seed, dtype=dt.name)
        return np.random.default_rng(seed), dt

    def extra_repr(self) -> str:
        return ", ".join(f"{k}={v!r}" for k, v in self.config.items())
