"""Core layers: Linear, Embedding, LayerNorm, Dropout, Flatten, activations and MLP.

Constructors take ``rng`` (see ``tiegrad.nn.init`` for the convention) and ``dtype``
(float32 by default). ``forward(session, x)`` reads each parameter through
``session.use`` at each call (C2); a wrong input shape is a ShapeError naming the layer
and both shapes.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from .. import ops
from .._checks import count, positive, size, unit_interval
from ..errors import ConfigError
from ..session import EagerSession, TensorRef
from . import init
from ._input import layer_input
from .module import Module, ModuleList

ACTIVATIONS: dict[str, Callable[[TensorRef], TensorRef]] = {
    "relu": ops.relu,
    "gelu": ops.gelu,
    "tanh": ops.tanh,
    "sigmoid": ops.sigmoid,
}


def get_activation(name: str) -> Callable[[TensorRef], TensorRef]:
    """The elementwise function called ``name`` (``relu``, ``gelu`` (erf form), ...)."""
    try:
        return ACTIVATIONS[name]
    except (KeyError, TypeError):
        raise ConfigError(
            f"activation: expected one of {sorted(ACTIVATIONS)}, got {name!r}"
        ) from None


def hidden_widths(label: str, name: str, value: Any) -> list[int]:
    """One hidden width or a sequence of them (an ``MLP``'s ``hidden``), each >= 1."""
    if isinstance(value, (int, np.integer)):
        return [size(label, name, value)]
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence):
        raise ConfigError(
            f"{label}: {name} must be an integer or a sequence of integers, got {value!r:.80}"
        )
    return [size(label, f"{name}[{i}]", w) for i, w in enumerate(value)]


class Linear(Module):
    """``y = x @ weight.T + bias``; weight (out, in) as in PyTorch, bias (out,).

    Both drawn from ``U(-1/sqrt(in), 1/sqrt(in))`` (PyTorch's default).
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        rng: np.random.Generator | None = None,
        dtype: Any = np.float32,
    ) -> None:
        super().__init__()
        rng, dtype = init.generator(rng), init.float_dtype(dtype)
        self.in_features = size("Linear", "in_features", in_features)
        self.out_features = size("Linear", "out_features", out_features)
        self.weight, self.bias = init.fan_in_uniform(
            rng, (self.out_features, self.in_features), bias, dtype
        )

    def forward(self, session: EagerSession, x: Any) -> TensorRef:
        x = layer_input(self, session, x, (..., self.in_features))
        bias = None if self.bias is None else session.use(self.bias)
        return ops.linear(x, session.use(self.weight), bias)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"bias={self.bias is not None}"
        )


class Embedding(Module):
    """Rows of ``weight`` (num_embeddings, dim) at integer ids; weight ``N(0, 1)``."""

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        rng: np.random.Generator | None = None,
        dtype: Any = np.float32,
    ) -> None:
        super().__init__()
        rng, dtype = init.generator(rng), init.float_dtype(dtype)
        self.num_embeddings = size("Embedding", "num_embeddings", num_embeddings)
        self.embedding_dim = size("Embedding", "embedding_dim", embedding_dim)
        self.weight = init.normal(rng, (self.num_embeddings, self.embedding_dim), 1.0, dtype)

    def forward(self, session: EagerSession, indices: Any) -> TensorRef:
        """``indices`` of any shape give ``indices.shape + (dim,)``."""
        return ops.embedding(session.use(self.weight), indices)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}"


class LayerNorm(Module):
    """Normalisation over the last axis (size ``dim``); weight ones, bias zeros."""

    def __init__(self, dim: int, eps: float = 1e-5, dtype: Any = np.float32) -> None:
        super().__init__()
        dtype = init.float_dtype(dtype)
        self.dim, self.eps = size("LayerNorm", "dim", dim), positive("LayerNorm", "eps", eps)
        self.weight = init.constant((self.dim,), 1.0, dtype)
        self.bias = init.constant((self.dim,), 0.0, dtype)

    def forward(self, session: EagerSession, x: Any) -> TensorRef:
        x = layer_input(self, session, x, (..., self.dim))
        return ops.layer_norm(x, session.use(self.weight), session.use(self.bias), self.eps)

    def extra_repr(self) -> str:
        return f"{self.dim}, eps={self.eps}"


class Dropout(Module):
    """Inverted dropout with probability ``p`` while ``training``; masks from ``session.rng``."""

    def __init__(self, p: float = 0.5) -> None:
        super().__init__()
        self.p = unit_interval("Dropout", "p", p)

    def forward(self, session: EagerSession, x: Any) -> TensorRef:
        x = layer_input(self, session, x, (...,))
        return ops.dropout(x, self.p, self.training)

    def extra_repr(self) -> str:
        return f"p={self.p}"


class Flatten(Module):
    """Merge the axes from ``start_dim`` on: (N, C, H, W) -> (N, C*H*W) by default."""

    def __init__(self, start_dim: int = 1) -> None:
        super().__init__()
        self.start_dim = count("Flatten", "start_dim", start_dim)

    def forward(self, session: EagerSession, x: Any) -> TensorRef:
        x = layer_input(self, session, x, (...,) + ("D",) * (self.start_dim + 1))
        shape = x.shape
        return x.reshape(shape[: self.start_dim] + (int(np.prod(shape[self.start_dim :])),))

    def extra_repr(self) -> str:
        return f"start_dim={self.start_dim}"


class _Elementwise(Module):
    kind = ""

    def forward(self, session: EagerSession, x: Any) -> TensorRef:
        return ACTIVATIONS[self.kind](layer_input(self, session, x, (...,)))


class ReLU(_Elementwise):
    kind = "relu"


class GELU(_Elementwise):
    """GELU, exact (erf) form."""

    kind = "gelu"


class Tanh(_Elementwise):
    kind = "tanh"


class MLP(Module):
    """Linear layers ``in -> hidden... -> out`` with an activation after every hidden one.

    ``hidden`` is one width or a sequence of widths (empty: a single Linear). Dropout
    with probability ``dropout`` follows each hidden activation while training. The
    Linear layers are ``layers.0``, ``layers.1``, ...
    """

    def __init__(
        self,
        in_features: int,
        hidden: int | Sequence[int],
        out_features: int,
        activation: str = "gelu",
        dropout: float = 0.0,
        rng: np.random.Generator | None = None,
        dtype: Any = np.float32,
    ) -> None:
        super().__init__()
        rng = init.generator(rng)
        widths = hidden_widths("MLP", "hidden", hidden)
        self._act = get_activation(activation)
        self.activation = activation
        sizes = [size("MLP", "in_features", in_features), *widths]
        sizes.append(size("MLP", "out_features", out_features))
        self.layers = ModuleList(
            Linear(a, b, rng=rng, dtype=dtype) for a, b in zip(sizes[:-1], sizes[1:])
        )
        self.drop = Dropout(dropout)

    def forward(self, session: EagerSession, x: Any) -> TensorRef:
        last = len(self.layers) - 1
        drop = self.drop if self.drop.p else None  # p == 0: dropout returns its input
        for i, layer in enumerate(self.layers):
            x = layer(session, x)
            if i < last:
                x = self._act(x)
                if drop is not None:
                    x = drop(session, x)
        return x

    def extra_repr(self) -> str:
        return f"activation={self.activation!r}"
