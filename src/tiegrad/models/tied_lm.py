"""``TiedLM``: a decoder-only transformer whose output projection is its token embedding."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from ..nn.attention import TransformerBlock
from ..nn.kv_cache import KVCache
from ..nn.module import ModuleList
from ..nn.recompute import checkpoint_if
from ..optim.hyperparams import size
from ..session import EagerSession, TensorRef
from ._causal_lm import TiedCausalLM


class TiedLM(TiedCausalLM):
    """Token embedding + learned positions, ``n_layers`` pre-LN causal blocks, final LayerNorm,
    and ``lm_head.weight`` tied to ``embed.weight`` (C1): ``model(session, idx)`` gives
    logits (B, T, V); ``loss`` and ``generate`` as in ``TiedCausalLM``.

    The embedding storage receives the sum of the gradients of its two uses (C4) and is
    updated once per step; ``tie(model, "lm_head.weight", "embed.weight",
    requires_grad=False)`` or ``model.freeze("embed.weight")`` makes one use frozen
    while the other still trains it. ``config`` holds the constructor arguments, so
    ``TiedLM(**model.config)`` rebuilds the architecture; ``seed`` fixes every initial
    value (layers draw in construction order from ``default_rng(seed)``).
    """

    ARGS = {**TiedCausalLM.ARGS, "n_layers": size}

    @classmethod
    def stored_blocks(cls, config: Mapping[str, Any]) -> int:
        return config["n_layers"]

    def __init__(
        self,
        vocab_size: int,
        d_model: int = 128,
        n_layers: int = 2,
        n_heads: int = 4,
        max_seq_len: int = 64,
        dropout: float = 0.0,
        mlp_ratio: int = 4,
        seed: int = 0,
        dtype: Any = "float32",
    ) -> None:
        super().__init__()
        self._build(
            seed,
            dtype,
            vocab_size=vocab_size,
            d_model=d_model,
            n_layers=n_layers,
            n_heads=n_heads,
            max_seq_len=max_seq_len,
            dropout=dropout,
            mlp_ratio=mlp_ratio,
        )

    def _build_blocks(self, new_block: Callable[[], TransformerBlock]) -> None:
        self.blocks = ModuleList(new_block() for _ in range(self.config["n_layers"]))

    def _body(self, session: EagerSession, h: TensorRef, cache: KVCache | None) -> TensorRef:
        recompute = self._recomputes(cache)
        for i, block in enumerate(self.blocks):
            h = checkpoint_if(recompute, block, session, h, cache=cache, layer=i)
        return h

    def _applications(self) -> int:
        return len(self.blocks)
