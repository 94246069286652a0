"""``ConfiguredModel``: the base of the reference models, rebuildable from ``config``."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import numpy as np

from ..nn import init
from ..nn.module import Module
from ..session import EagerSession


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

    @contextlib.contextmanager
    def _inference(self) -> Iterator[EagerSession]:
        """A host session recording no gradients, with the model in eval mode inside the
        block; the training flag is restored afterwards."""
        session = EagerSession()
        was_training = self.training
        self.eval()
        try:
            with session.no_grad():
                yield session
        finally:
            self.train(was_training)

    def extra_repr(self) -> str:
        return ", ".join(f"{k}={v!r}" for k, v in self.config.items())
