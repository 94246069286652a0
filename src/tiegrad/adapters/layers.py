"""The LoRA adapter and the adapted layers: one more trainable storage pair on one use.

An adapter (``LoRA``) holds two storages in PEFT's layout, ``A`` (rank, fan_in) and
``B`` (fan_out, rank), in the terms of the use it was made for (its *home layer*): a
``Linear`` (weight (out, in)), a GPT-2 ``Conv1D`` (weight (in, out)) or an
``Embedding`` (table (V, d), fan_in V). The use's output gains
``scaling * B A dropout(x)`` (an embedding: ``scaling * B A onehot(ids)``, no dropout,
as PEFT), ``scaling = alpha / rank`` (rank-stabilised, PEFT's ``use_rslora``:
``alpha / sqrt(rank)``); the base storage is read as it is, never copied
(C1). A use whose weight has the other layout reads the same storages transposed
(``A' = B.T``, ``B' = A.T``): that is how one adapter serves both uses of a tied
embedding (``share_tied``), its two uses summed into one gradient per storage (C4).

Adapting a layer changes its class, in place, to the adapted subclass of its class
(``LoRALinear`` for ``Linear``, ...), which adds a ``lora`` submodule (the layer's
adapters by name) and the adapter's term to the layer's own forward. The object, its
paths and its handles stay: ties (C1), per-use freezing (C4, C5), references held to the
layer and checkpoints of the base keep working, and a layer registered at several
paths is adapted at all of them. The adapter storages are paths of the model
(``<layer>.lora.<name>.A``), so optimizers, ``summary``, checkpoints (C9) see them as
any other parameter.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from .. import ops
from ..models.gpt2 import Conv1D
from ..models.llama import PaddedEmbedding
from ..nn import init
from ..nn._input import layer_input
from ..nn.layers import Embedding, Linear
from ..nn.module import Module
from ..params import Param
from ..session import EagerSession, TensorRef

#: Weight layouts: ``Linear``'s (out, in); ``Conv1D``'s and ``Embedding``'s (in, out).
OUT_IN, IN_OUT = "out_in", "in_out"


class LoRA(Module):
    """One adapter: ``A`` (rank, fan_in) and ``B`` (fan_out, rank) for a weight of ``layout``.

    ``scaling`` is ``alpha / rank``, or ``alpha / sqrt(rank)`` with ``rslora``
    (rank-stabilised LoRA, PEFT's ``use_rslora``); ``dropout`` the probability on the
    adapter's input while training (``Linear`` and ``Conv1D`` uses only, as PEFT).
    """

    def __init__(
        self,
        layout: str,
        a: np.ndarray,
        b: np.ndarray,
        alpha: float,
        dropout: float,
        rslora: bool = False,
    ):
        super().__init__()
        self.layout, self.alpha, self.dropout = layout, float(alpha), float(dropout)
        self.rank, self.rslora = int(a.shape[0]), bool(rslora)
        self.scaling = self.alpha / (math.sqrt(self.rank) if self.rslora else self.rank)
        self.A = Param(a)
        self.B = Param(b)

    def weight_delta(self) -> np.ndarray:
        """``scaling * B @ A`` in the layout of the home layer's weight (the storage's)."""
        delta = self.B.value_synced() @ self.A.value_synced()
        delta *= delta.dtype.type(self.scaling)
        return delta if self.layout == OUT_IN else delta.T

    def extra_repr(self) -> str:
        rslora = ", rslora=True" if self.rslora else ""
        return f"rank={self.rank}, alpha={self.alpha:g}, dropout={self.dropout:g}{rslora}"


def initial_factors(
    layer: Module, rank: int, rng: np.random.Generator
) -> tuple[np.ndarray, np.ndarray]:
    """PEFT's initial ``A`` and ``B`` for ``layer``'s weight: ``B = 0`` and ``A`` from
    ``U(-1/sqrt(fan_in), 1/sqrt(fan_in))`` (kaiming-uniform) for a matrix use; ``A = 0``
    and ``B`` from ``N(0, 1)`` for an embedding. The adapted use starts as its base."""
    fan_in, fan_out = fans(layer)
    dtype = layer.weight.dtype
    if isinstance(layer, Embedding):
        a = np.zeros((rank, fan_in), dtype)
        return a, rng.normal(0.0, 1.0, (fan_out, rank)).astype(dtype)
    bound = init.fan_in_bound(fan_in)
    a = rng.uniform(-bound, bound, (rank, fan_in)).astype(dtype)
    return a, np.zeros((fan_out, rank), dtype)


def layout_of(layer: Module) -> str:
    """The weight layout of an adaptable layer."""
    return OUT_IN if isinstance(layer, Linear) else IN_OUT


def fans(layer: Module) -> tuple[int, int]:
    """``(fan_in, fan_out)`` of an adaptable layer's weight use."""
    shape = layer.weight.shape
    return (shape[1], shape[0]) if layout_of(layer) == OUT_IN else (shape[0], shape[1])


class LoRAAdapters(Module):
    """The adapters of one adapted layer, registered by name, and which one applies.

    ``active`` is the name of the adapter the forward adds (None: none of this layer's);
    ``enabled`` False or ``merged`` True (the active adapter is folded into the weight)
    leave the layer's own output alone.
    """

    def __init__(self) -> None:
        super().__init__()
        self.active: str | None = None
        self.enabled = True
        self.merged = False

    def names(self) -> list[str]:
        return list(self._modules)

    def get(self, name: str) -> LoRA:
        return self._modules[name]

    def applied(self) -> LoRA | None:
        """The adapter the forward adds now, if any."""
        if self.active is None or self.merged or not self.enabled:
            return None
        return self._modules[self.active]


class _Adapted:
    """The layer's own forward plus the term of its applied adapter."""

    lora: LoRAAdapters

    def forward(self, session: EagerSession, x: Any) -> TensorRef:
        y = super().forward(session, x)  # type: ignore[misc]
        adapter = self.lora.applied()
        return y if adapter is None else y + self.adapter_term(session, x, adapter)

    def adapter_term(self, session: EagerSession, x: Any, adapter: LoRA) -> TensorRef:
        raise NotImplementedError


def _matrix_term(session: EagerSession, x: TensorRef, adapter: LoRA, layout: str) -> TensorRef:
    h = ops.dropout(x, adapter.dropout, adapter.training)
    a, b = session.use(adapter.A), session.use(adapter.B)
    if adapter.layout == layout:
        return ops.linear(ops.linear(h, a) * adapter.scaling, b)
    return ops.affine(ops.affine(h, b) * adapter.scaling, a)  # read transposed


class LoRALinear(_Adapted, Linear):
    """A ``Linear`` with adapters."""

    def adapter_term(self, session: EagerSession, x: Any, adapter: LoRA) -> TensorRef:
        x = layer_input(self, session, x, (..., self.in_features))
        return _matrix_term(session, x, adapter, OUT_IN)


class LoRAConv1D(_Adapted, Conv1D):
    """A GPT-2 ``Conv1D`` with adapters."""

    def adapter_term(self, session: EagerSession, x: Any, adapter: LoRA) -> TensorRef:
        x = layer_input(self, session, x, (..., self.in_features))
        return _matrix_term(session, x, adapter, IN_OUT)


class LoRAEmbedding(_Adapted, Embedding):
    """An ``Embedding`` with adapters: the rows ``ids`` of ``scaling * (B A).T`` added."""

    def adapter_term(self, session: EagerSession, ids: Any, adapter: LoRA) -> TensorRef:
        a, b = session.use(adapter.A), session.use(adapter.B)
        if adapter.layout == IN_OUT:
            return ops.linear(self.lookup(session, a.T, ids) * adapter.scaling, b)
        return ops.affine(self.lookup(session, b, ids) * adapter.scaling, a)  # read transposed

    def lookup(self, session: EagerSession, table: TensorRef, ids: Any) -> TensorRef:
        """The rows ``ids`` of the adapter's factor ``table`` (V, rank)."""
        return ops.embedding(table, ids)


class LoRAPaddedEmbedding(LoRAEmbedding, PaddedEmbedding):
    """A Llama-family ``PaddedEmbedding`` with adapters: the adapter factor's row of
    ``padding_idx`` passes no gradient either, as PEFT's embedding adapter looks the
    factor up with the base layer's ``padding_idx`` (the other factor's gradient counts
    those positions)."""

    def lookup(self, session: EagerSession, table: TensorRef, ids: Any) -> TensorRef:
        return self.cut_padding(session, ids, super().lookup(session, table, ids))


#: The adapted class of each adaptable class, and back.
ADAPTED: dict[type, type] = {
    Linear: LoRALinear,
    Conv1D: LoRAConv1D,
    Embedding: LoRAEmbedding,
    PaddedEmbedding: LoRAPaddedEmbedding,
}
BASE: dict[type, type] = {v: k for k, v in ADAPTED.items()}


def adaptable(layer: Any) -> bool:
    """Whether ``layer`` is one of the adaptable classes themselves (a subclass may compute
    something else with its weight) or already adapted."""
    return type(layer) in ADAPTED or type(layer) in BASE


def adapters(layer: Module) -> LoRAAdapters | None:
    """``layer``'s adapters, or None when it is not adapted."""
    return layer.lora if type(layer) in BASE else None


def adapters_of(layer: Module) -> LoRAAdapters:
    """``layer``'s adapters, adapting it first (its class changes in place)."""
    if type(layer) in ADAPTED:
        object.__setattr__(layer, "__class__", ADAPTED[type(layer)])
        layer.lora = LoRAAdapters()
    return layer.lora


def restore(layer: Module) -> None:
    """Remove ``layer``'s adapters and give it back its own class."""
    del layer.lora
    object.__setattr__(layer, "__class__", BASE[type(layer)])
