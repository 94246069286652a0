"""``GPT2``: the architecture of Hugging Face's ``GPT2LMHeadModel``, with its parameter names.

Paths are transformers' own (``transformer.wte.weight``, ``transformer.h.0.attn.c_attn.weight``,
..., ``lm_head.weight``), in its ``named_parameters(remove_duplicate=False)`` order, so
``freeze``, ``tie`` and checkpoints take the names a transformers user knows. Pre-LN
blocks with learned positions; ``Conv1D`` weights are stored as transformers stores them,
(in, out) (``ops.affine``); ``c_attn`` packs queries, keys and values; the MLP's
activation is ``gelu_new`` (tanh GELU) by default; ``lm_head.weight`` is tied to
``transformer.wte.weight`` (C1) unless ``tie_word_embeddings`` is false, so per-use
freezing works as on ``TiedLM`` (C4, C5). ``from_pretrained``/``save_pretrained`` read
and write the directory format of transformers' ``save_pretrained`` without torch or
transformers; the format lives in ``tiegrad.interop.hf``, which takes the class or model
as an argument and imports nothing from here, so the dependency points one way.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np

from .. import ops
from ..errors import ConfigError
from ..interop import hf
from ..nn import init
from ..nn._input import layer_input
from ..nn.kv_cache import KVCache
from ..nn.layers import Dropout, Embedding, LayerNorm, Linear
from ..nn.module import Module, ModuleList
from ..nn.recompute import checkpoint_if
from ..nn.tying import tie
from ..optim import hyperparams
from ..session import EagerSession, TensorRef
from ._causal_lm import EMBED_STD, TiedCausalLM

#: ``activation_function`` values of transformers' GPT-2 and the matching GELU form.
ACTIVATIONS = {"gelu_new": "tanh", "gelu_pytorch_tanh": "tanh", "gelu": "none"}
#: The tensors whose shapes give the sizes of a configuration: ``{path: (key of the first
#: dimension, key of the second)}`` (``GPT2.sizes_held``).
_SIZE_TENSORS = {
    "transformer.wte.weight": ("vocab_size", "n_embd"),
    "transformer.wpe.weight": ("n_positions", None),
    "transformer.h.0.mlp.c_fc.weight": (None, "n_inner"),
}
_BLOCK = re.compile(r"transformer\.h\.(0|[1-9][0-9]*)\.")


def _block_numbers(paths: Iterable[str]) -> set[str]:
    """The distinct block numbers ``N`` of the paths ``transformer.h.N....``."""
    return {m.group(1) for m in map(_BLOCK.match, paths) if m is not None}


def _optional_size(label: str, name: str, value: Any) -> int | None:
    """``None`` (transformers' default: four times the width) or a size."""
    return None if value is None else hyperparams.size(label, name, value)


def _inner(config: Any) -> int:
    """The MLP width of a checked configuration: ``n_inner``, or four times the width."""
    return config["n_inner"] if config["n_inner"] is not None else 4 * config["n_embd"]


def _activation(label: str, name: str, value: Any) -> str:
    if not isinstance(value, str) or value not in ACTIVATIONS:
        raise ConfigError(
            f"{label}: {name} {value!r:.80} is not supported (supported: {', '.join(ACTIVATIONS)})"
        )
    return value


class Conv1D(Module):
    """transformers' ``Conv1D``: ``x @ weight + bias`` with ``weight`` (in, out)."""

    def __init__(
        self, in_features: int, out_features: int, std: float, rng: np.random.Generator, dtype: Any
    ) -> None:
        super().__init__()
        self.in_features, self.out_features = int(in_features), int(out_features)
        self.weight = init.normal(rng, (self.in_features, self.out_features), std, dtype)
        self.bias = init.constant((self.out_features,), 0.0, dtype)

    def forward(self, session: EagerSession, x: Any) -> TensorRef:
        x = layer_input(self, session, x, (..., self.in_features))
        return ops.affine(x, session.use(self.weight), session.use(self.bias))

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}"


class GPT2Attention(Module):
    """Causal self-attention: ``c_attn`` (d, 3 d) packs q, k, v; ``c_proj`` (d, d).

    Scores are scaled by ``scale`` (``1/sqrt(head_dim)``, further divided by the layer
    number with ``scale_attn_by_inverse_layer_idx``). Without attention dropout (or in
    eval mode) one fused ``ops.self_attention`` node; with it, the probabilities go
    through ``ops.dropout`` as in transformers' eager attention. With a ``KVCache`` the
    new keys and values are appended to its ``layer`` entry and the queries attend over
    all of them (generation, no dropout).
    """

    def __init__(
        self, d: int, n_heads: int, scale: float, attn_pdrop: float, resid_pdrop: float,
        proj_std: float, rng: np.random.Generator, dtype: Any,
    ) -> None:  # fmt: skip
        super().__init__()
        self.d, self.n_heads, self.scale, self.attn_pdrop = d, n_heads, scale, attn_pdrop
        self.c_attn = Conv1D(d, 3 * d, EMBED_STD, rng, dtype)
        self.c_proj = Conv1D(d, d, proj_std, rng, dtype)
        self.resid_dropout = Dropout(resid_pdrop)

    def forward(
        self, session: EagerSession, x: TensorRef, cache: KVCache | None = None, layer: int = 0
    ) -> TensorRef:
        qkv = self.c_attn(session, x)
        if cache is not None:
            y = self._cached_attention(session, qkv, cache, layer)
        elif self.training and self.attn_pdrop > 0:
            y = self._dropout_attention(session, qkv)
        else:
            y = ops.self_attention(qkv, self.n_heads, causal=True, scale=self.scale)
        return self.resid_dropout(session, self.c_proj(session, y))

    def _cached_attention(
        self, session: EagerSession, qkv: TensorRef, cache: KVCache, layer: int
    ) -> TensorRef:
        b, t, _ = qkv.shape
        heads = qkv.reshape(b, t, 3, self.n_heads, self.d // self.n_heads).permute(2, 0, 3, 1, 4)
        k, v = cache.append(session, layer, heads[1], heads[2])
        y = ops.scaled_dot_product_attention(  # the queries are the last positions
            heads[0], k, v, causal="bottom_right", scale=self.scale
        )
        return y.permute(0, 2, 1, 3).reshape(b, t, self.d)

    def _dropout_attention(self, session: EagerSession, qkv: TensorRef) -> TensorRef:
        b, t, _ = qkv.shape
        h, hd = self.n_heads, self.d // self.n_heads
        heads = qkv.reshape(b, t, 3, h, hd).permute(2, 0, 3, 1, 4)
        q, k, v = heads[0], heads[1], heads[2]
        dtype = np.dtype(session.backend.dtype_name(qkv.dtype))  # the scores' own dtype
        hidden = np.triu(np.full((t, t), -np.inf, dtype=dtype), 1)
        scores = (q @ k.transpose(-2, -1)) * self.scale + session.constant(hidden)
        p = ops.dropout(ops.softmax(scores), self.attn_pdrop, True)
        return (p @ v).permute(0, 2, 1, 3).reshape(b, t, self.d)


class GPT2MLP(Module):
    """``c_fc`` (d, inner), the activation, ``c_proj`` (inner, d), dropout."""

    def __init__(
        self, d: int, inner: int, approximate: str, resid_pdrop: float, proj_std: float,
        rng: np.random.Generator, dtype: Any,
    ) -> None:  # fmt: skip
        super().__init__()
        self.approximate = approximate
        self.c_fc = Conv1D(d, inner, EMBED_STD, rng, dtype)
        self.c_proj = Conv1D(inner, d, proj_std, rng, dtype)
        self.dropout = Dropout(resid_pdrop)

    def forward(self, session: EagerSession, x: TensorRef) -> TensorRef:
        a = ops.gelu(self.c_fc(session, x), approximate=self.approximate)
        return self.dropout(session, self.c_proj(session, a))


class GPT2Block(Module):
    """Pre-LN: ``x + attn(ln_1(x))``, then ``x + mlp(ln_2(x))``."""

    def __init__(self, attn: GPT2Attention, mlp: GPT2MLP, d: int, eps: float, dtype: Any) -> None:
        super().__init__()
        self.ln_1 = LayerNorm(d, eps=eps, dtype=dtype)
        self.attn = attn
        self.ln_2 = LayerNorm(d, eps=eps, dtype=dtype)
        self.mlp = mlp

    def forward(
        self, session: EagerSession, x: TensorRef, cache: KVCache | None = None, layer: int = 0
    ) -> TensorRef:
        x = x + self.attn(session, self.ln_1(session, x), cache, layer)
        return x + self.mlp(session, self.ln_2(session, x))


class GPT2Body(Module):
    """transformers' ``GPT2Model``: ``wte``, ``wpe``, dropout, the blocks ``h``, ``ln_f``."""

    def __init__(
        self, wte: Embedding, wpe: Embedding, drop: Dropout, h: ModuleList, ln_f: LayerNorm
    ) -> None:
        super().__init__()
        self.wte, self.wpe, self.drop, self.h, self.ln_f = wte, wpe, drop, h, ln_f

    def forward(
        self,
        session: EagerSession,
        idx: Any,
        cache: KVCache | None = None,
        recompute: bool = False,
    ) -> TensorRef:
        """Hidden states of ``idx`` (B, T) at positions ``0 .. T-1``, or after the
        ``cache``'s positions, whose keys and values it then holds; with ``recompute``
        each block runs through ``tiegrad.nn.checkpoint``."""
        seen, t = (0 if cache is None else cache.length), idx.shape[1]
        positions = np.arange(seen, seen + t)
        h = self.drop(session, self.wte(session, idx) + self.wpe(session, positions))
        for i, block in enumerate(self.h):
            h = checkpoint_if(recompute, block, session, h, cache, i)
        if cache is not None:
            cache.advance(t)
        return self.ln_f(session, h)


class GPT2(TiedCausalLM):
    """GPT-2 language model; the constructor takes transformers' ``GPT2Config`` fields.

    Defaults are the 124M ``gpt2`` model. Initialisation follows transformers'
    ``_init_weights``: ``N(0, initializer_range**2)`` for embeddings and ``Conv1D``
    weights, ``N(0, (initializer_range / sqrt(2 n_layer))**2)`` for the ``c_proj``
    weights, zero biases, LayerNorm ones and zeros, all drawn from ``default_rng(seed)``.
    ``model(session, ids)`` gives logits (B, T, vocab_size); ``loss`` and ``generate`` are
    ``TiedLM``'s. ``config`` holds the constructor arguments: ``type(m)(**m.config)``.
    """

    VOCAB_PATHS = ("transformer.wte.weight", "lm_head.weight")

    ARGS = {
        **dict.fromkeys(
            ("vocab_size", "n_positions", "n_embd", "n_layer", "n_head"), hyperparams.size
        ),
        "n_inner": _optional_size,
        "activation_function": _activation,
        **dict.fromkeys(("resid_pdrop", "embd_pdrop", "attn_pdrop"), hyperparams.decay_rate),
        "layer_norm_epsilon": hyperparams.positive,
        "initializer_range": hyperparams.at_least_zero,
        **dict.fromkeys(
            ("scale_attn_weights", "scale_attn_by_inverse_layer_idx", "tie_word_embeddings"),
            hyperparams.flag,
        ),
    }

    @classmethod
    def check_relations(cls, label: str, args: Any) -> None:
        if args["n_embd"] % args["n_head"]:
            raise ConfigError(
                f"{label}: n_head={args['n_head']} must divide n_embd={args['n_embd']}"
            )

    @classmethod
    def sizes(cls, config: Any) -> dict[str, int]:
        """The sizes of a model of ``config`` (as ``check_config`` returns it) that its
        tensors' shapes show: ``vocab_size``, ``n_positions``, ``n_embd``, ``n_layer``
        and ``n_inner`` (four times the width when unset), by arithmetic alone."""
        keys = ("vocab_size", "n_positions", "n_embd", "n_layer")
        return {**{k: config[k] for k in keys}, "n_inner": _inner(config)}

    @classmethod
    def sizes_held(cls, shapes: Mapping[str, tuple[int, ...]]) -> dict[str, int]:
        """The ``sizes`` that tensors of these shapes (``{path: shape}``) hold: the
        vocabulary and width from ``transformer.wte.weight``, the positions from
        ``transformer.wpe.weight``, the inner width from the first block's
        ``mlp.c_fc.weight`` (each where present with two dimensions) and ``n_layer``,
        the count of distinct blocks ``transformer.h.N``. What a configuration is checked
        against before its ``layout`` is built (C6): a ``config.json`` of a million
        layers is refused by a count, not a list."""
        out: dict[str, int] = {"n_layer": len(_block_numbers(shapes))}
        for path, keys in _SIZE_TENSORS.items():
            shape = tuple(shapes.get(path, ()))
            if len(shape) == 2:
                out.update((k, n) for k, n in zip(keys, shape) if k is not None)
        return out

    @staticmethod
    def _block_layout(d: int, inner: int) -> list[tuple[str, tuple[int, ...]]]:
        """``(name, shape)`` of the slots of one block, in slot order."""
        return [
            ("ln_1.weight", (d,)), ("ln_1.bias", (d,)),
            ("attn.c_attn.weight", (d, 3 * d)), ("attn.c_attn.bias", (3 * d,)),
            ("attn.c_proj.weight", (d, d)), ("attn.c_proj.bias", (d,)),
            ("ln_2.weight", (d,)), ("ln_2.bias", (d,)),
            ("mlp.c_fc.weight", (d, inner)), ("mlp.c_fc.bias", (inner,)),
            ("mlp.c_proj.weight", (inner, d)), ("mlp.c_proj.bias", (d,)),
        ]  # fmt: skip

    @classmethod
    def layout(cls, config: Any) -> list[tuple[str, tuple[int, ...]]]:
        """``(path, shape)`` of every slot of a model of ``config`` (as ``check_config``
        returns it), in slot order, computed without building anything: what a weights
        directory is checked against before a model is allocated (C6)."""
        d, v, n = config["n_embd"], config["vocab_size"], config["n_layer"]
        block = cls._block_layout(d, _inner(config))
        return [
            ("transformer.wte.weight", (v, d)),
            ("transformer.wpe.weight", (config["n_positions"], d)),
            *((f"transformer.h.{i}.{name}", shape) for i in range(n) for name, shape in block),
            ("transformer.ln_f.weight", (d,)),
            ("transformer.ln_f.bias", (d,)),
            ("lm_head.weight", (v, d)),
        ]

    @classmethod
    def layout_size(cls, config: Any) -> tuple[int, int]:
        """``(slots, elements)`` of a model of ``config`` (``TiedCausalLM.layout_size``):
        the tied ``lm_head.weight`` is one storage with ``transformer.wte.weight``.
        Computed from one block's layout, so a configuration of 10**9 layers costs no
        more than one of 1 (what a file is checked against before anything is built)."""
        d, v, n = config["n_embd"], config["vocab_size"], config["n_layer"]
        block = cls._block_layout(d, _inner(config))
        head = 0 if config["tie_word_embeddings"] else v * d
        per_block = sum(math.prod(shape) for _, shape in block)
        elements = v * d + config["n_positions"] * d + n * per_block + 2 * d + head
        return 5 + len(block) * n, elements

    def __init__(
        self,
        vocab_size: int = 50257,
        n_positions: int = 1024,
        n_embd: int = 768,
        n_layer: int = 12,
        n_head: int = 12,
        n_inner: int | None = None,
        activation_function: str = "gelu_new",
        resid_pdrop: float = 0.1,
        embd_pdrop: float = 0.1,
        attn_pdrop: float = 0.1,
        layer_norm_epsilon: float = 1e-5,
        initializer_range: float = 0.02,
        scale_attn_weights: bool = True,
        scale_attn_by_inverse_layer_idx: bool = False,
        tie_word_embeddings: bool = True,
        seed: int = 0,
        dtype: Any = "float32",
    ) -> None:
        super().__init__()
        rng, dt = self._configure(
            seed, dtype, vocab_size=vocab_size, n_positions=n_positions, n_embd=n_embd,
            n_layer=n_layer, n_head=n_head, n_inner=n_inner,
            activation_function=activation_function, resid_pdrop=resid_pdrop,
            embd_pdrop=embd_pdrop, attn_pdrop=attn_pdrop, layer_norm_epsilon=layer_norm_epsilon,
            initializer_range=initializer_range, scale_attn_weights=scale_attn_weights,
            scale_attn_by_inverse_layer_idx=scale_attn_by_inverse_layer_idx,
            tie_word_embeddings=tie_word_embeddings,
        )  # fmt: skip
        self.vocab_size, self.max_seq_len = int(vocab_size), int(n_positions)
        d, std = int(n_embd), float(initializer_range)
        inner = int(n_inner) if n_inner is not None else 4 * d
        proj_std = std / math.sqrt(2 * n_layer)
        wte = Embedding(vocab_size, d, rng=rng, dtype=dt)
        wte.weight = init.normal(rng, (self.vocab_size, d), std, dt)
        wpe = Embedding(n_positions, d, rng=rng, dtype=dt)
        wpe.weight = init.normal(rng, (self.max_seq_len, d), std, dt)
        blocks = ModuleList()
        for i in range(int(n_layer)):
            scale = 1.0 / math.sqrt(d // n_head) if scale_attn_weights else 1.0
            if scale_attn_by_inverse_layer_idx:
                scale /= i + 1
            attn = GPT2Attention(
                d, int(n_head), scale, float(attn_pdrop), float(resid_pdrop), proj_std, rng, dt
            )
            mlp = GPT2MLP(
                d, inner, ACTIVATIONS[activation_function], float(resid_pdrop), proj_std, rng, dt
            )
            blocks.append(GPT2Block(attn, mlp, d, float(layer_norm_epsilon), dt))
        ln_f = LayerNorm(d, eps=float(layer_norm_epsilon), dtype=dt)
        self.transformer = GPT2Body(wte, wpe, Dropout(embd_pdrop), blocks, ln_f)
        self.lm_head = Linear(d, vocab_size, bias=False, rng=rng, dtype=dt)
        if tie_word_embeddings:
            tie(self, "lm_head.weight", "transformer.wte.weight")
        else:
            self.lm_head.weight = init.normal(rng, (self.vocab_size, d), std, dt)

    def extra_repr(self) -> str:
        keys = ("vocab_size", "n_positions", "n_embd", "n_layer", "n_head")
        tied = "" if self.config["tie_word_embeddings"] else ", untied"
        return ", ".join(f"{k}={self.config[k]}" for k in keys) + tied

    def new_cache(self) -> KVCache:
        """An empty KV cache for ``forward(..., cache=)`` (one entry per block)."""
        return KVCache(len(self.transformer.h))

    def forward(self, session: EagerSession, idx: Any, cache: KVCache | None = None) -> TensorRef:
        """Logits (B, T, vocab_size) for integer token ids ``idx`` (B, T), T <= n_positions
        (``max_seq_len``). With a ``KVCache`` (``new_cache()``) the ids continue its
        positions and their keys and values are appended to it (``generate`` feeds the
        prompt, then one token per step)."""
        return self.lm_head(session, self._hidden(session, idx, cache))

    def _hidden(self, session: EagerSession, idx: Any, cache: KVCache | None) -> TensorRef:
        idx = self._token_ids(idx)
        self._cached_positions(idx, cache)
        return self.transformer(session, idx, cache, recompute=self._recomputes(cache))

    @classmethod
    def from_pretrained(
        cls,
        directory: str | os.PathLike[str],
        dtype: Any = "float32",
        *,
        allow_nonfinite: bool = False,
    ) -> GPT2:
        """A model from a transformers ``save_pretrained`` directory, without torch or
        transformers; the directory is checked against ``layout`` before anything is
        built, and a weight holding NaN or infinity is refused unless ``allow_nonfinite``
        (C6, ``tiegrad.interop.hf.load_gpt2``)."""
        return hf.load_gpt2(cls, directory, dtype, allow_nonfinite=allow_nonfinite)

    def load_pretrained(
        self, directory: str | os.PathLike[str], *, allow_nonfinite: bool = False
    ) -> None:
        """Load the weights of a transformers directory into this model; everything is
        checked before anything is written, NaN and infinite values included unless
        ``allow_nonfinite`` (C6, ``tiegrad.interop.hf.load_weights``)."""
        hf.load_weights(self, directory, allow_nonfinite=allow_nonfinite)

    def save_pretrained(self, directory: str | os.PathLike[str]) -> None:
        """Write ``config.json`` and ``model.safetensors`` that transformers'
        ``GPT2LMHeadModel.from_pretrained`` loads (``tiegrad.interop.hf.save_gpt2``)."""
        hf.save_gpt2(self, directory)
