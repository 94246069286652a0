"""Multi-head self-attention and the pre-LN transformer block."""

from __future__ import annotations

from typing import Any

import numpy as np

from .. import ops
from .._checks import size
from ..errors import ConfigError, DTypeError
from ..ops._core import lift
from ..session import EagerSession, TensorRef
from . import init
from ._input import check_shape, checked_input
from .kv_cache import KVCache
from .layers import MLP, Dropout, LayerNorm, Linear
from .module import Module


def _checked_mask(layer: Module, key_padding_mask: Any, input_shape: Any) -> np.ndarray:
    """``key_padding_mask`` as a bool (B, T) array for an input of ``input_shape``, checked
    before the layer records anything (C6)."""
    mask = np.asarray(key_padding_mask)
    check_shape(layer, "key_padding_mask", mask.shape, tuple(input_shape[:2]))
    if mask.dtype != np.bool_:
        raise DTypeError(f"{layer.label()}: key_padding_mask must be bool, got {mask.dtype}")
    return mask


class MultiHeadAttention(Module):
    """Self-attention over (B, T, d_model) with ``n_heads`` heads.

    ``qkv`` projects to queries, keys and values at once (weight (3 d_model, d_model),
    laid out as PyTorch's ``in_proj_weight``: rows of q, then k, then v), ``proj`` is
    the output projection (PyTorch's ``out_proj``). Initialisation as
    ``torch.nn.MultiheadAttention``: ``qkv.weight`` xavier-uniform, ``proj.weight``
    ``U(-1/sqrt(d_model), 1/sqrt(d_model))``, both biases zero. ``causal`` hides later
    keys; ``key_padding_mask`` (B, T), True = ignore that key, is given per call.
    """

    def __init__(
        self,
        d_model: int,
        n_heads: int,
        causal: bool = False,
        bias: bool = True,
        rng: np.random.Generator | None = None,
        dtype: Any = np.float32,
    ) -> None:
        super().__init__()
        rng, dtype = init.generator(rng), init.float_dtype(dtype)
        d_model = size("MultiHeadAttention", "d_model", d_model)
        n_heads = size("MultiHeadAttention", "n_heads", n_heads)
        if d_model % n_heads:
            raise ConfigError(
                f"MultiHeadAttention: d_model={d_model} must be a multiple of n_heads={n_heads}"
            )
        self.d_model, self.n_heads, self.causal = d_model, n_heads, bool(causal)
        self.qkv = Linear(d_model, 3 * d_model, bias=bias, rng=rng, dtype=dtype)
        self.qkv.weight = init.uniform(
            rng, (3 * d_model, d_model), init.xavier_bound(d_model, 3 * d_model), dtype
        )
        self.proj = Linear(d_model, d_model, bias=bias, rng=rng, dtype=dtype)
        if bias:
            self.qkv.bias = init.constant((3 * d_model,), 0.0, dtype)
            self.proj.bias = init.constant((d_model,), 0.0, dtype)

    def forward(
        self,
        session: EagerSession,
        x: Any,
        key_padding_mask: Any = None,
        cache: KVCache | None = None,
        layer: int = 0,
    ) -> TensorRef:
        """Attention of ``x`` over itself, or with ``cache`` over the positions the
        cache's entry ``layer`` holds followed by ``x``'s (their keys and values appended
        to it; generation: a causal layer, no padding mask)."""
        x, value = checked_input(self, session, x, ("B", "T", self.d_model))
        if cache is not None and (key_padding_mask is not None or not self.causal):
            raise ConfigError(
                f"{self.label()}: a KV cache continues a causal layer without a key_padding_mask"
            )
        if key_padding_mask is not None:
            mask = _checked_mask(self, key_padding_mask, value.shape)
            key_padding_mask = session.backend.asarray(mask)
        qkv = self.qkv(session, lift(session, x, value))
        if cache is not None:
            return self.proj(session, self._cached(session, qkv, cache, layer))
        y = ops.self_attention(
            qkv, self.n_heads, causal=self.causal, key_padding_mask=key_padding_mask
        )
        return self.proj(session, y)

    def _cached(
        self, session: EagerSession, qkv: TensorRef, cache: KVCache, layer: int
    ) -> TensorRef:
        b, t, _ = qkv.shape
        heads = qkv.reshape(b, t, 3, self.n_heads, self.d_model // self.n_heads)
        heads = heads.permute(2, 0, 3, 1, 4)
        k, v = cache.append(session, layer, heads[1], heads[2])
        y = ops.scaled_dot_product_attention(heads[0], k, v, causal="bottom_right")
        return y.permute(0, 2, 1, 3).reshape(b, t, self.d_model)

    def extra_repr(self) -> str:
        return f"d_model={self.d_model}, n_heads={self.n_heads}, causal={self.causal}"


class TransformerBlock(Module):
    """Pre-LN block: ``x + drop(attn(ln1(x)))``, then ``x + drop(mlp(ln2(x)))``.

    The MLP is ``d_model -> mlp_ratio * d_model -> d_model`` with GELU (erf form), as
    ``torch.nn.TransformerEncoderLayer(norm_first=True, activation="gelu")`` with
    ``dim_feedforward = mlp_ratio * d_model``; ``causal`` is passed to the attention.
    """

    def __init__(
        self,
        d_model: int,
        n_heads: int,
        mlp_ratio: int = 4,
        dropout: float = 0.0,
        causal: bool = True,
        rng: np.random.Generator | None = None,
        dtype: Any = np.float32,
    ) -> None:
        super().__init__()
        rng = init.generator(rng)
        self.d_model = size("TransformerBlock", "d_model", d_model)
        mlp_ratio = size("TransformerBlock", "mlp_ratio", mlp_ratio)
        self.ln1 = LayerNorm(d_model, dtype=dtype)
        self.attn = MultiHeadAttention(d_model, n_heads, causal=causal, rng=rng, dtype=dtype)
        self.ln2 = LayerNorm(d_model, dtype=dtype)
        self.mlp = MLP(
            d_model, mlp_ratio * d_model, d_model, "gelu", dropout=dropout, rng=rng, dtype=dtype
        )
        self.drop = Dropout(dropout)

    def forward(
        self,
        session: EagerSession,
        x: Any,
        key_padding_mask: Any = None,
        cache: KVCache | None = None,
        layer: int = 0,
    ) -> TensorRef:
        """The block on ``x``; ``cache`` and ``layer`` go to the attention."""
        x, value = checked_input(self, session, x, ("B", "T", self.d_model))
        if key_padding_mask is not None:
            key_padding_mask = _checked_mask(self, key_padding_mask, value.shape)
        x = lift(session, x, value)
        y = self.attn(session, self.ln1(session, x), key_padding_mask, cache, layer)
        x = x + self.drop(session, y)
        return x + self.drop(session, self.mlp(session, self.ln2(session, x)))

    def extra_repr(self) -> str:
        return f"d_model={self.d_model}"
