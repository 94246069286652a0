"""``LlamaLM``: the Llama family of decoders (Llama 3.x, Qwen2/2.5, Qwen3, SmolLM2/3, Mistral).

One class for the family, as transformers' ``LlamaForCausalLM``, ``Qwen2ForCausalLM``,
``Qwen3ForCausalLM``, ``SmolLM3ForCausalLM`` and ``MistralForCausalLM`` compute it:
pre-norm blocks of RMSNorm, attention with rotary position embeddings and grouped-query
heads (``num_key_value_heads`` <= ``num_attention_heads``), and a SwiGLU MLP
(``down_proj(silu(gate_proj(x)) * up_proj(x))``). ``model_type`` picks the variant:

- ``qwen2``: biases on ``q_proj``, ``k_proj`` and ``v_proj`` (never on ``o_proj``);
- ``qwen3``: qk-norm, an RMSNorm over each head's features of the queries and keys
  (``q_norm``, ``k_norm``) before the rotation;
- ``smollm3``: the layers whose ``no_rope_layers`` entry is 0 use no rotation
  (by default every fourth: ``(i + 1) % 4 == 0``);
- ``llama``, ``qwen3``, ``smollm3``: ``attention_bias`` puts biases on all four
  projections, ``mlp_bias`` (``llama``, ``smollm3``) on the MLP's.

Paths are transformers' own, in its ``named_parameters(remove_duplicate=False)`` order
(``model.embed_tokens.weight``, ``model.layers.0.self_attn.q_proj.weight``, ...,
``model.norm.weight``, ``lm_head.weight``), so ``freeze``, ``tie``, checkpoints and
LoRA targets take the names a transformers user knows. With ``tie_word_embeddings``
the head is a second use of the embedding's storage (C1): per-use freezing works as on
``GPT2`` (C4, C5). The directory format lives in ``tiegrad.interop.hf_llama``.

The pieces are tiegrad's fused ops, each transformers' own computation:
``ops.rms_norm``, ``ops.silu``, ``ops.rope_tables`` and ``ops.rotary``, and
``ops.scaled_dot_product_attention`` with fewer key-value heads than query heads
(grouped-query, no copy of K and V per query head) and a bottom-right causal mask
(the queries are the last positions: a KV-cached step sees every earlier key).
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Mapping
from typing import Any

import numpy as np

from .. import ops
from ..errors import ConfigError
from ..interop import hf_llama
from ..nn import init
from ..nn._input import layer_input
from ..nn.kv_cache import KVCache
from ..nn.layers import Embedding, Linear
from ..nn.module import Module, ModuleList
from ..nn.recompute import checkpoint_if
from ..nn.tying import tie
from ..optim import hyperparams
from ..session import EagerSession, TensorRef
from ._causal_lm import TiedCausalLM

#: The ``model_type`` values this class implements.
MODEL_TYPES = hf_llama.MODEL_TYPES
_LAYER = re.compile(r"model\.layers\.(\d+)\.")


class PaddedEmbedding(Embedding):
    """``Embedding`` whose ``padding_idx`` rows, as in torch's ``nn.Embedding``, pass no
    gradient to ``weight`` (their values are the row's, as there); None: a plain one."""

    def __init__(
        self, num: int, dim: int, padding_idx: int | None, std: float,
        rng: np.random.Generator, dtype: Any,
    ) -> None:  # fmt: skip
        super().__init__(num, dim, rng=rng, dtype=dtype)
        self.weight = init.normal(rng, (num, dim), std, dtype)
        self.padding_idx = padding_idx

    def forward(self, session: EagerSession, indices: Any) -> TensorRef:
        return self.cut_padding(session, indices, super().forward(session, indices))

    def cut_padding(self, session: EagerSession, indices: Any, h: TensorRef) -> TensorRef:
        """``h`` (rows looked up for ``indices``) with the ``padding_idx`` rows' gradient
        cut, their values kept."""
        if self.padding_idx is None:
            return h
        ids = indices.numpy() if isinstance(indices, TensorRef) else np.asarray(indices)
        hidden = ids == self.padding_idx
        if not hidden.any():
            return h
        return ops.where(hidden[..., None], session.constant(h.value), h)


class RMSNorm(Module):
    """Root-mean-square normalisation over the last axis (size ``dim``); weight ones."""

    def __init__(self, dim: int, eps: float, dtype: Any) -> None:
        super().__init__()
        self.dim, self.eps = int(dim), float(eps)
        self.weight = init.constant((self.dim,), 1.0, dtype)

    def forward(self, session: EagerSession, x: Any) -> TensorRef:
        x = layer_input(self, session, x, (..., self.dim))
        return ops.rms_norm(x, session.use(self.weight), self.eps)

    def extra_repr(self) -> str:
        return f"{self.dim}, eps={self.eps}"


class LlamaAttention(Module):
    """Causal grouped-query attention with rotary embeddings (and, for Qwen3, qk-norm).

    ``forward(session, x, rope, cache, layer)`` takes the ``(cos, sin)`` refs of the
    positions of ``x`` (None for a layer without rotation) and, when generating, the
    ``KVCache`` whose ``layer`` entry the new keys and values are appended to.
    """

    def __init__(
        self, d: int, heads: int, kv_heads: int, head_dim: int, qkv_bias: bool, o_bias: bool,
        qk_norm: bool, eps: float, std: float, rng: np.random.Generator, dtype: Any,
    ) -> None:  # fmt: skip
        super().__init__()
        self.heads, self.kv_heads, self.head_dim, self.qk_norm = heads, kv_heads, head_dim, qk_norm
        self.q_proj = _linear(d, heads * head_dim, qkv_bias, std, rng, dtype)
        self.k_proj = _linear(d, kv_heads * head_dim, qkv_bias, std, rng, dtype)
        self.v_proj = _linear(d, kv_heads * head_dim, qkv_bias, std, rng, dtype)
        self.o_proj = _linear(heads * head_dim, d, o_bias, std, rng, dtype)
        if qk_norm:
            self.q_norm = RMSNorm(head_dim, eps, dtype)
            self.k_norm = RMSNorm(head_dim, eps, dtype)

    def _heads(self, session: EagerSession, proj: Linear, x: TensorRef, n: int) -> TensorRef:
        b, t, _ = x.shape
        return proj(session, x).reshape(b, t, n, self.head_dim).permute(0, 2, 1, 3)

    def forward(
        self,
        session: EagerSession,
        x: TensorRef,
        rope: tuple[TensorRef, TensorRef] | None,
        cache: KVCache | None = None,
        layer: int = 0,
    ) -> TensorRef:
        b, t, _ = x.shape
        q = self._heads(session, self.q_proj, x, self.heads)
        k = self._heads(session, self.k_proj, x, self.kv_heads)
        v = self._heads(session, self.v_proj, x, self.kv_heads)
        if self.qk_norm:
            q, k = self.q_norm(session, q), self.k_norm(session, k)
        if rope is not None:
            q, k = ops.rotary(q, *rope), ops.rotary(k, *rope)
        if cache is not None:
            k, v = cache.append(session, layer, k, v)
        y = ops.scaled_dot_product_attention(  # grouped-query: k, v with fewer heads
            q, k, v, causal="bottom_right", scale=self.head_dim**-0.5
        )
        y = y.permute(0, 2, 1, 3).reshape(b, t, self.heads * self.head_dim)
        return self.o_proj(session, y)


class LlamaMLP(Module):
    """SwiGLU: ``down_proj(silu(gate_proj(x)) * up_proj(x))``."""

    def __init__(
        self, d: int, inner: int, bias: bool, std: float, rng: np.random.Generator, dtype: Any
    ) -> None:
        super().__init__()
        self.gate_proj = _linear(d, inner, bias, std, rng, dtype)
        self.up_proj = _linear(d, inner, bias, std, rng, dtype)
        self.down_proj = _linear(inner, d, bias, std, rng, dtype)

    def forward(self, session: EagerSession, x: TensorRef) -> TensorRef:
        gate = ops.silu(self.gate_proj(session, x))
        return self.down_proj(session, gate * self.up_proj(session, x))


class LlamaDecoderLayer(Module):
    """Pre-norm: ``x + self_attn(input_layernorm(x))``, then
    ``x + mlp(post_attention_layernorm(x))``; ``rotary`` says whether it rotates."""

    def __init__(
        self, self_attn: LlamaAttention, mlp: LlamaMLP, d: int, eps: float, rotary: bool,
        dtype: Any,
    ) -> None:  # fmt: skip
        super().__init__()
        self.self_attn, self.mlp, self.rotary = self_attn, mlp, rotary
        self.input_layernorm = RMSNorm(d, eps, dtype)
        self.post_attention_layernorm = RMSNorm(d, eps, dtype)

    def forward(
        self,
        session: EagerSession,
        x: TensorRef,
        rope: tuple[TensorRef, TensorRef],
        cache: KVCache | None,
        layer: int,
    ) -> TensorRef:
        a = self.input_layernorm(session, x)
        x = x + self.self_attn(session, a, rope if self.rotary else None, cache, layer)
        return x + self.mlp(session, self.post_attention_layernorm(session, x))


class LlamaBody(Module):
    """transformers' ``LlamaModel``: ``embed_tokens``, the ``layers``, the final ``norm``."""

    def __init__(self, embed_tokens: Embedding, layers: ModuleList, norm: RMSNorm) -> None:
        super().__init__()
        self.embed_tokens, self.layers, self.norm = embed_tokens, layers, norm


def _linear(
    d_in: int, d_out: int, bias: bool, std: float, rng: np.random.Generator, dtype: Any
) -> Linear:
    """A ``Linear`` initialised as transformers does: ``N(0, std**2)`` weight, zero bias."""
    layer = Linear(d_in, d_out, bias=bias, rng=rng, dtype=dtype)
    layer.weight = init.normal(rng, (d_out, d_in), std, dtype)
    if bias:
        layer.bias = init.constant((d_out,), 0.0, dtype)
    return layer


def _model_type(label: str, name: str, value: Any) -> str:
    if value not in MODEL_TYPES:
        raise ConfigError(
            f"{label}: {name} {value!r:.80} is not supported (supported: {', '.join(MODEL_TYPES)})"
        )
    return value


def _optional_size(label: str, name: str, value: Any) -> int | None:
    """``None`` (the architecture's default) or a size."""
    return None if value is None else hyperparams.size(label, name, value)


def _optional_count(label: str, name: str, value: Any) -> int | None:
    """``None`` or an integer >= 0."""
    return None if value is None else hyperparams.count(label, name, value)


def _optional_flag(label: str, name: str, value: Any) -> bool | None:
    """``None`` (the architecture's default) or a boolean."""
    return None if value is None else hyperparams.flag(label, name, value)


def _no_rope_layers(label: str, name: str, value: Any) -> list[int] | None:
    """``None`` (the architecture's default) or a list of 0 (no rotation) and 1 per layer."""
    if value is None:
        return None
    if isinstance(value, (str, bytes)) or not isinstance(value, (list, tuple)):
        raise ConfigError(f"{label}: {name} must be a list of 0 and 1, got {value!r:.80}")
    bad = [v for v in value if isinstance(v, bool) or v not in (0, 1)]
    if bad:
        raise ConfigError(f"{label}: {name} holds {bad[:3]!r:.80}; expected 0 or 1 per layer")
    return [int(v) for v in value]


def _rope(label: str, name: str, value: Any) -> dict[str, Any] | None:
    """``None`` (default rotation, the architecture's theta) or rope parameters."""
    return None if value is None else hf_llama.rope_parameters(f"{label}: {name}", value)


class LlamaLM(TiedCausalLM):
    """A Llama-family decoder; the constructor takes transformers' config fields.

    ``None`` means: for ``num_key_value_heads``, as many as query heads; for
    ``head_dim``, ``hidden_size / num_attention_heads``; for ``attention_bias``, the
    ``model_type``'s own (Qwen2: on q, k and v; the others: none); for
    ``no_rope_layers``, every layer rotates (SmolLM3: all but every
    ``no_rope_layer_interval``-th, by default every fourth); for
    ``rope_parameters``, the default rotation with the ``model_type``'s ``rope_theta``
    (``hf_llama.ARCHITECTURES``). ``from_pretrained`` fills in the defaults of the
    transformers class where ``config.json`` is silent. The rows of
    ``pad_token_id`` pass no gradient to the embedding through the input use, as
    transformers' ``embed_tokens`` (``padding_idx``) does. Initialisation
    follows transformers' ``_init_weights``: ``N(0, initializer_range**2)`` for the
    embedding and every projection, zero biases, RMSNorm ones, drawn from
    ``default_rng(seed)``. ``model(session, ids)`` gives logits (B, T, vocab_size);
    ``generate`` runs with a KV cache. ``config`` holds the constructor arguments:
    ``type(m)(**m.config)``.
    """

    VOCAB_PATHS = (hf_llama.EMBEDDING, hf_llama.HEAD)

    ARGS = {
        "model_type": _model_type,
        **dict.fromkeys(
            (
                "vocab_size",
                "hidden_size",
                "intermediate_size",
                "num_hidden_layers",
                "num_attention_heads",
                "max_position_embeddings",
            ),
            hyperparams.size,
        ),  # fmt: skip
        "num_key_value_heads": _optional_size,
        "head_dim": _optional_size,
        "rms_norm_eps": hyperparams.positive,
        "initializer_range": hyperparams.at_least_zero,
        "rope_parameters": _rope,
        "attention_bias": _optional_flag,
        "mlp_bias": hyperparams.flag,
        "no_rope_layers": _no_rope_layers,
        "no_rope_layer_interval": hyperparams.size,
        "tie_word_embeddings": hyperparams.flag,
        "pad_token_id": _optional_count,
    }

    @classmethod
    def check_relations(cls, label: str, args: Any) -> None:
        hf_llama.check_variant(label, args)

    @classmethod
    def layout(cls, config: Any) -> list[tuple[str, tuple[int, ...]]]:
        """``(path, shape)`` of every slot of a model of ``config`` (as ``check_config``
        returns it), in slot order, computed without building anything: what a weights
        directory is checked against before a model is allocated (C6)."""
        v = hf_llama.variant(config)
        d, hd, inner = config["hidden_size"], v.head_dim, config["intermediate_size"]
        q, kv = config["num_attention_heads"] * hd, v.kv_heads * hd

        def linear(name: str, d_in: int, d_out: int, bias: bool) -> list[tuple[str, tuple]]:
            return [(f"{name}.weight", (d_out, d_in))] + ([(f"{name}.bias", (d_out,))] * bias)

        block = [
            *linear("self_attn.q_proj", d, q, v.qkv_bias),
            *linear("self_attn.k_proj", d, kv, v.qkv_bias),
            *linear("self_attn.v_proj", d, kv, v.qkv_bias),
            *linear("self_attn.o_proj", q, d, v.o_bias),
            *([("self_attn.q_norm.weight", (hd,)), ("self_attn.k_norm.weight", (hd,))] * v.qk_norm),
            *linear("mlp.gate_proj", d, inner, v.mlp_bias),
            *linear("mlp.up_proj", d, inner, v.mlp_bias),
            *linear("mlp.down_proj", inner, d, v.mlp_bias),
            ("input_layernorm.weight", (d,)),
            ("post_attention_layernorm.weight", (d,)),
        ]
        return [
            (hf_llama.EMBEDDING, (config["vocab_size"], d)),
            *(
                (f"model.layers.{i}.{name}", shape)
                for i in range(config["num_hidden_layers"])
                for name, shape in block
            ),
            ("model.norm.weight", (d,)),
            (hf_llama.HEAD, (config["vocab_size"], d)),
        ]

    @classmethod
    def sizes(cls, config: Any) -> dict[str, int]:
        """The sizes of a model of ``config`` (as ``check_config`` returns it) that its
        tensors' shapes show, by arithmetic alone: ``vocab_size``, ``hidden_size``,
        ``intermediate_size`` and ``num_hidden_layers``."""
        keys = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers")
        return {k: config[k] for k in keys}

    @classmethod
    def sizes_held(cls, shapes: Mapping[str, tuple[int, ...]]) -> dict[str, int]:
        """The ``sizes`` that tensors of these shapes (``{path: shape}``) hold: the
        vocabulary and width from ``model.embed_tokens.weight``, the MLP width from the
        first layer's ``mlp.gate_proj.weight`` (each where present with two dimensions)
        and ``num_hidden_layers``, the count of distinct ``model.layers.N``. What a
        configuration is checked against before its ``layout`` is built (C6): a
        ``config.json`` of a million layers is refused by a count, not a list."""
        layers = {m.group(1) for m in map(_LAYER.match, shapes) if m is not None}
        out = {"num_hidden_layers": len(layers)}
        embedding = tuple(shapes.get(hf_llama.EMBEDDING, ()))
        if len(embedding) == 2:
            out.update(vocab_size=embedding[0], hidden_size=embedding[1])
        gate = tuple(shapes.get("model.layers.0.mlp.gate_proj.weight", ()))
        if len(gate) == 2:
            out["intermediate_size"] = gate[0]
        return out

    @classmethod
    def layout_size(cls, config: Any) -> tuple[int, int]:
        """``(slots, elements)`` of a model of ``config`` (``TiedCausalLM.layout_size``):
        a tied ``lm_head.weight`` is one storage with ``model.embed_tokens.weight``.
        Computed from one layer's layout (the layers differ in rotation alone, which
        holds no weight), so a configuration of 10**9 layers costs no more than one of 1:
        what a checkpoint's stored configuration is checked against before anything is
        built (C6)."""
        one = cls.layout({**config, "num_hidden_layers": 1, "no_rope_layers": None})
        layer = [shape for path, shape in one if path.startswith("model.layers.0.")]
        n, v, d = config["num_hidden_layers"], config["vocab_size"], config["hidden_size"]
        head = 0 if config["tie_word_embeddings"] else v * d
        elements = v * d + n * sum(math.prod(s) for s in layer) + d + head
        return 3 + n * len(layer), elements

    def __init__(
        self,
        model_type: str = "llama",
        vocab_size: int = 32000,
        hidden_size: int = 4096,
        intermediate_size: int = 11008,
        num_hidden_layers: int = 32,
        num_attention_heads: int = 32,
        num_key_value_heads: int | None = None,
        head_dim: int | None = None,
        max_position_embeddings: int = 2048,
        rms_norm_eps: float = 1e-6,
        initializer_range: float = 0.02,
        rope_parameters: Mapping[str, Any] | None = None,
        attention_bias: bool | None = None,
        mlp_bias: bool = False,
        no_rope_layers: list[int] | None = None,
        no_rope_layer_interval: int = 4,
        tie_word_embeddings: bool = False,
        pad_token_id: int | None = None,
        seed: int = 0,
        dtype: Any = "float32",
    ) -> None:
        super().__init__()
        rng, dt = self._configure(
            seed, dtype, model_type=model_type, vocab_size=vocab_size, hidden_size=hidden_size,
            intermediate_size=intermediate_size, num_hidden_layers=num_hidden_layers,
            num_attention_heads=num_attention_heads, num_key_value_heads=num_key_value_heads,
            head_dim=head_dim, max_position_embeddings=max_position_embeddings,
            rms_norm_eps=rms_norm_eps, initializer_range=initializer_range,
            rope_parameters=rope_parameters, attention_bias=attention_bias, mlp_bias=mlp_bias,
            no_rope_layers=no_rope_layers, no_rope_layer_interval=no_rope_layer_interval,
            tie_word_embeddings=tie_word_embeddings,
            pad_token_id=pad_token_id,
        )  # fmt: skip
        v = hf_llama.variant(self.config)
        self.vocab_size, self.max_seq_len = int(vocab_size), int(max_position_embeddings)
        self.head_dim, self.rope = v.head_dim, v.rope
        d, std, eps = int(hidden_size), float(initializer_range), float(rms_norm_eps)
        embed = PaddedEmbedding(self.vocab_size, d, pad_token_id, std, rng, dt)
        layers = ModuleList()
        for rotary in v.rotary:
            attn = LlamaAttention(
                d, int(num_attention_heads), v.kv_heads, v.head_dim, v.qkv_bias, v.o_bias,
                v.qk_norm, eps, std, rng, dt,
            )  # fmt: skip
            mlp = LlamaMLP(d, int(intermediate_size), v.mlp_bias, std, rng, dt)
            layers.append(LlamaDecoderLayer(attn, mlp, d, eps, rotary, dt))
        self.model = LlamaBody(embed, layers, RMSNorm(d, eps, dt))
        self.lm_head = _linear(d, self.vocab_size, False, std, rng, dt)
        if tie_word_embeddings:
            tie(self, hf_llama.HEAD, hf_llama.EMBEDDING)

    def extra_repr(self) -> str:
        keys = ("model_type", "vocab_size", "hidden_size", "num_hidden_layers")
        tied = "" if self.config["tie_word_embeddings"] else ", untied"
        return ", ".join(f"{k}={self.config[k]!r}" for k in keys) + tied

    def new_cache(self) -> KVCache:
        """An empty KV cache for ``forward(..., cache=)`` (one entry per layer)."""
        return KVCache(len(self.model.layers))

    def forward(self, session: EagerSession, idx: Any, cache: KVCache | None = None) -> TensorRef:
        """Logits (B, T, vocab_size) for integer token ids ``idx`` (B, T).

        Without ``cache`` the ids are positions ``0 .. T-1`` and T <= max_position_embeddings.
        With a ``KVCache`` (``new_cache()``) they continue its ``length`` positions and
        their keys and values are appended to it; ``length + T`` may not exceed
        ``max_position_embeddings`` (``ShapeError``, the cache unchanged).
        """
        return self.lm_head(session, self._hidden(session, idx, cache))

    def _hidden(self, session: EagerSession, idx: Any, cache: KVCache | None) -> TensorRef:
        idx = self._token_ids(idx)
        seen, t = self._cached_positions(idx, cache), idx.shape[1]
        tables = ops.rope_tables(
            np.arange(seen, seen + t), self.head_dim, self.rope["rope_theta"], self.rope,
            dtype=self.config["dtype"],
        )  # fmt: skip
        rope = (session.constant(tables[0]), session.constant(tables[1]))
        h = self.model.embed_tokens(session, idx)
        recompute = self._recomputes(cache)
        for i, layer in enumerate(self.model.layers):
            h = checkpoint_if(recompute, layer, session, h, rope, cache, i)
        if cache is not None:
            cache.advance(t)
        return self.model.norm(session, h)

    @classmethod
    def from_pretrained(
        cls,
        directory: str | os.PathLike[str],
        dtype: Any = "float32",
        *,
        allow_nonfinite: bool = False,
    ) -> LlamaLM:
        """A model from a transformers ``save_pretrained`` directory of the family,
        without torch or transformers; the configuration and every tensor's name, shape
        and values (NaN and infinity refused unless ``allow_nonfinite``) are checked
        before anything is built (C6, ``tiegrad.interop.hf_llama.load``)."""
        return hf_llama.load(cls, directory, dtype, allow_nonfinite)

    def save_pretrained(self, directory: str | os.PathLike[str]) -> None:
        """Write ``config.json`` and ``model.safetensors`` that transformers'
        ``AutoModelForCausalLM.from_pretrained`` loads (``tiegrad.interop.hf_llama.save``)."""
        hf_llama.save(self, directory)
