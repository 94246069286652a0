"""``SharedBlockLM``: one transformer block applied ``n_repeats`` times (cross-layer sharing)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from ..nn.attention import TransformerBlock
from ..nn.kv_cache import KVCache
from ..nn.recompute import checkpoint_if
from ..optim.hyperparams import size
from ..session import EagerSession, TensorRef
from ._causal_lm import TiedCausalLM


class SharedBlockLM(TiedCausalLM):
    """As ``TiedLM``, but its body is ONE pre-LN causal block (``block``) applied
    ``n_repeats`` times, ALBERT-style, with the output tied to the token embedding.

    Every application records new uses of the block's storages (C2); each storage gets
    the sum of its uses' gradients and one update per step (C4), and a checkpoint stores
    the block once (C9). ``config`` holds the constructor arguments.
    """

    ARGS = {**TiedCausalLM.ARGS, "n_repeats": size}

    @classmethod
    def stored_blocks(cls, config: Mapping[str, Any]) -> int:
        return 1

    def __init__(
        self,
        vocab_size: int,
        d_model: int = 128,
        n_heads: int = 4,
        n_repeats: int = 4,
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
            n_heads=n_heads,
            n_repeats=n_repeats,
            max_seq_len=max_seq_len,
            dropout=dropout,
            mlp_ratio=mlp_ratio,
        )

    def _build_blocks(self, new_block: Callable[[], TransformerBlock]) -> None:
        self.n_repeats = int(self.config["n_repeats"])
        self.block = new_block()

    def _body(self, session: EagerSession, h: TensorRef, cache: KVCache | None) -> TensorRef:
        recompute = self._recomputes(cache)
        for i in range(self.n_repeats):
            h = checkpoint_if(recompute, self.block, session, h, cache=cache, layer=i)
        return h

    def _applications(self) -> int:
        return self.n_repeats
