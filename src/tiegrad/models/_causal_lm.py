"""The skeleton shared by the tied language models: embeddings, tied head, loss, sampling.

Layout (slot order): ``embed.weight`` (token embedding, V x d), ``pos_embed.weight``
(learned positions), the model's blocks, ``ln_f`` (final LayerNorm), then
``lm_head.weight``, tied to ``embed.weight`` (C1): ``logits = h @ embed.weight.T`` is
the ``lm_head`` Linear (weight layout (out, in) = (V, d)) over the same storage. The
embedding tables start from ``N(0, 0.02**2)`` (GPT-2), so the tied output starts with
small logits; every other layer keeps its PyTorch default.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from numbers import Integral
from typing import Any

import numpy as np

from .. import ops
from ..errors import ConfigError, DTypeError, HyperparameterError, ShapeError, shown_list
from ..nn import init
from ..nn.attention import TransformerBlock
from ..nn.kv_cache import KVCache
from ..nn.layers import Dropout, Embedding, LayerNorm, Linear
from ..nn.tying import tie
from ..optim.hyperparams import at_least_zero, count, flag, size, unit_interval
from ..session import EagerSession, TensorRef
from ._configured import ConfiguredModel

EMBED_STD = 0.02

#: Slots of one TransformerBlock: two LayerNorms, qkv, proj and two MLP Linears, each
#: with a weight and a bias.
BLOCK_SLOTS = 12


class TiedCausalLM(ConfiguredModel):
    """Base of the language models (``TiedLM``, ``SharedBlockLM``, ``GPT2``, ``LlamaLM``);
    subclasses add ``_build_blocks``, ``_body`` and ``stored_blocks``.

    ``recompute`` (False by default; transformers' names ``gradient_checkpointing_enable()``
    and ``gradient_checkpointing_disable()``, or transformers 5's
    ``activation_checkpointing_*``, set it) runs each block application through
    ``tiegrad.nn.checkpoint`` while training: a block's intermediates are recomputed in
    backward instead of kept, and the gradients are bit-identical to those without it
    (C2). A forward with a KV cache never recomputes. The switch is the model object's,
    not part of ``config``.
    """

    _recompute = False

    ARGS = {
        "vocab_size": size,
        "d_model": size,
        "n_heads": size,
        "max_seq_len": size,
        "dropout": unit_interval,
        "mlp_ratio": size,
    }

    #: The token embedding and the head, as ``resize_vocab`` grows them.
    VOCAB_PATHS = ("embed.weight", "lm_head.weight")

    @classmethod
    def check_relations(cls, label: str, args: Mapping[str, Any]) -> None:
        if args["d_model"] % args["n_heads"]:
            raise ConfigError(
                f"{label}: d_model={args['d_model']} must be a multiple of "
                f"n_heads={args['n_heads']}"
            )

    @classmethod
    def stored_blocks(cls, config: Mapping[str, Any]) -> int:
        """How many distinct TransformerBlocks a model of ``config`` holds."""
        raise NotImplementedError

    @classmethod
    def layout_size(cls, config: Mapping[str, Any]) -> tuple[int, int]:
        """``(slots, elements)`` of a model of ``config`` (as ``check_config`` returns it):
        the length of its parameter list and the elements of its distinct storages (the
        tied head counted once), computed without building anything."""
        d, r, n = config["d_model"], config["mlp_ratio"], cls.stored_blocks(config)
        block = 4 * d * d + 2 * r * d * d + 9 * d + r * d
        embeddings = (config["vocab_size"] + config["max_seq_len"]) * d
        return 5 + BLOCK_SLOTS * n, embeddings + n * block + 2 * d

    @property
    def recompute(self) -> bool:
        """Whether training forwards recompute each block in backward (see the class)."""
        return self._recompute

    @recompute.setter
    def recompute(self, value: bool) -> None:
        self._recompute = flag(self.label(), "recompute", value)

    def gradient_checkpointing_enable(
        self, gradient_checkpointing_kwargs: Mapping[str, Any] | None = None
    ) -> None:
        """transformers' name for ``recompute = True``. tiegrad's recomputation has no
        options (it is always exact): ``gradient_checkpointing_kwargs`` other than None
        or empty is a ``ConfigError`` naming them, the switch unchanged."""
        self._enable_recompute("gradient_checkpointing_kwargs", gradient_checkpointing_kwargs)

    def activation_checkpointing_enable(
        self, activation_checkpointing_kwargs: Mapping[str, Any] | None = None
    ) -> None:
        """transformers 5's newer name of ``gradient_checkpointing_enable``."""
        self._enable_recompute("activation_checkpointing_kwargs", activation_checkpointing_kwargs)

    def _enable_recompute(self, name: str, options: Mapping[str, Any] | None) -> None:
        if options:
            raise ConfigError(
                f"{self.label()}: {name} {shown_list(sorted(map(str, options)))} are options "
                "of torch.utils.checkpoint; tiegrad's recomputation takes none (it is exact, "
                "with dropout's stream replayed)"
            )
        self.recompute = True

    def gradient_checkpointing_disable(self) -> None:
        """transformers' name for ``recompute = False``."""
        self.recompute = False

    activation_checkpointing_disable = gradient_checkpointing_disable

    @property
    def is_gradient_checkpointing(self) -> bool:
        """transformers' name for ``recompute``."""
        return self.recompute

    is_activation_checkpointing = is_gradient_checkpointing

    def _recomputes(self, cache: KVCache | None) -> bool:
        """Whether a forward with ``cache`` runs its blocks through ``checkpoint``."""
        return self._recompute and cache is None

    def _build(self, seed: int, dtype: Any, **args: Any) -> None:
        """Set ``config`` (``args``, ``seed``, ``dtype``) and build the layers in slot order,
        all drawing from ``default_rng(seed)``; ``_build_blocks`` adds the blocks."""
        rng, dt = self._configure(seed, dtype, **args)
        vocab_size, d_model, max_seq_len = args["vocab_size"], args["d_model"], args["max_seq_len"]
        n_heads, mlp_ratio, dropout = args["n_heads"], args["mlp_ratio"], args["dropout"]
        self.vocab_size, self.max_seq_len = int(vocab_size), int(max_seq_len)
        self.embed = Embedding(vocab_size, d_model, rng=rng, dtype=dt)
        self.embed.weight = init.normal(rng, (vocab_size, d_model), EMBED_STD, dt)
        self.pos_embed = Embedding(max_seq_len, d_model, rng=rng, dtype=dt)
        self.pos_embed.weight = init.normal(rng, (max_seq_len, d_model), EMBED_STD, dt)
        self.drop = Dropout(dropout)
        self._build_blocks(
            lambda: TransformerBlock(
                d_model, n_heads, mlp_ratio, dropout, causal=True, rng=rng, dtype=dt
            )
        )
        self.ln_f = LayerNorm(d_model, dtype=dt)
        self.lm_head = Linear(d_model, vocab_size, bias=False, rng=rng, dtype=dt)
        tie(self, "lm_head.weight", "embed.weight")

    def resize_token_embeddings(
        self, new_num_tokens: int, init: str = "mean", *, train: str = "all", seed: int = 0
    ) -> Any:
        """transformers' name for ``tiegrad.models.resize_vocab(self, new_num_tokens, ...)``;
        returns the token embedding module, as transformers does."""
        from .vocab import resize_vocab

        resize_vocab(self, new_num_tokens, init, train=train, seed=seed)
        return self._holder(self.VOCAB_PATHS[0])[0]

    def _build_blocks(self, new_block: Callable[[], TransformerBlock]) -> None:
        """Add the model's blocks, each made by ``new_block()`` (in drawing order)."""
        raise NotImplementedError

    def _body(self, session: EagerSession, h: TensorRef, cache: KVCache | None) -> TensorRef:
        """The blocks on ``h``; each application of a block uses its own entry of
        ``cache`` (``_applications`` of them)."""
        raise NotImplementedError

    def _applications(self) -> int:
        """How many block applications a forward makes (the entries of a cache)."""
        raise NotImplementedError

    def _token_ids(self, idx: Any) -> Any:
        """``idx`` (a ref, else as an array), checked to be (B, T) with 1 <= T <= max_seq_len."""
        if not isinstance(idx, TensorRef):
            idx = np.asarray(idx)
        shape = tuple(idx.shape)
        if len(shape) != 2 or not 1 <= shape[1] <= self.max_seq_len:
            raise ShapeError(
                f"{self.label()}: input has shape {shape}, expected (B, T) with "
                f"1 <= T <= max_seq_len = {self.max_seq_len}"
            )
        return idx

    def forward(self, session: EagerSession, idx: Any, cache: KVCache | None = None) -> TensorRef:
        """Logits (B, T, vocab_size) for integer token ids ``idx`` (B, T), T <= max_seq_len.

        With a ``KVCache`` (``new_cache()``) the ids continue its ``length`` positions and
        their keys and values are appended to it; ``length + T`` may not exceed
        ``max_seq_len`` (``ShapeError``, the cache unchanged).
        """
        return self.lm_head(session, self._hidden(session, idx, cache))

    def _hidden(self, session: EagerSession, idx: Any, cache: KVCache | None) -> TensorRef:
        """The hidden states (B, T, d_model) that ``lm_head`` projects: ``forward`` but
        the head."""
        idx = self._token_ids(idx)
        seen, t = self._cached_positions(idx, cache), idx.shape[1]
        h = self.embed(session, idx) + self.pos_embed(session, np.arange(seen, seen + t))
        h = self._body(session, self.drop(session, h), cache)
        if cache is not None:
            cache.advance(t)
        return self.ln_f(session, h)

    def loss(
        self, session: EagerSession, idx: Any, targets: Any, ignore_index: int = -100
    ) -> TensorRef:
        """Mean cross entropy of the next-token logits against ``targets`` (B, T).

        A plain head (a ``Linear`` without bias, tied or not, a use frozen or not) and the
        loss are one op, ``ops.linear_cross_entropy``: the (B, T, vocab_size) logits are
        never held, and the head's weight is an ordinary use (its tie's gradients sum
        once, C4). Any other head (one with a LoRA adapter) takes the unfused path,
        ``ops.cross_entropy`` of ``forward``'s logits, so its adapter trains.
        """
        h = self._hidden(session, idx, None)
        head = self.lm_head
        if type(head) is Linear and head.bias is None:
            weight = session.use(head.weight)
            return ops.linear_cross_entropy(h, weight, targets, ignore_index=ignore_index)
        return ops.cross_entropy(head(session, h), targets, ignore_index=ignore_index)

    def _cached_positions(self, idx: Any, cache: KVCache | None) -> int:
        """How many positions ``cache`` holds before ``idx`` (B, T) (0 without one),
        checked first: a cache holds at most ``max_seq_len`` positions (``ShapeError``,
        the cache unchanged)."""
        if cache is None:
            return 0
        seen, t = cache.length, idx.shape[1]
        if seen + t > self.max_seq_len:
            raise ShapeError(
                f"{self.label()}: a cache of {seen} positions cannot take {t} more tokens "
                f"(max_seq_len = {self.max_seq_len} in all)"
            )
        return seen

    def new_cache(self) -> KVCache:
        """An empty KV cache for ``forward(..., cache=)`` (one entry per block application)."""
        return KVCache(self._applications())

    def generate(
        self,
        idx: Any,
        max_new_tokens: int,
        temperature: float = 1.0,
        rng: np.random.Generator | None = None,
        top_k: int | None = None,
        *,
        top_p: float | None = None,
        eos_token_id: int | Sequence[int] | None = None,
        pad_token_id: int | None = None,
        use_cache: bool = True,
    ) -> np.ndarray:
        """Append up to ``max_new_tokens`` sampled tokens to ``idx`` ((B, T) or (T,)); no
        gradients.

        Each step divides the last logits by ``temperature`` (0 = greedy), keeps the
        ``top_k`` largest if given, then the fewest most likely tokens whose probability
        reaches ``top_p`` if given (transformers' order and rules), and samples with
        ``rng`` (``None``: ``default_rng(0)``). With a KV cache (``new_cache``; unless
        ``use_cache`` is false) the prompt is fed once and then one token per step;
        otherwise each step feeds the last ``max_seq_len`` tokens. Both give the same
        tokens (their logits differ by float rounding only). Past ``max_seq_len``
        positions the cache starts again from the last ``max_seq_len`` tokens, as the
        uncached window does. A row that has produced one of the ``eos_token_id`` tokens
        gets ``pad_token_id`` (default: the first eos token) from then on, and generation
        stops early once every row has, as transformers' ``generate`` does. Runs in eval
        mode on a host session; the training flag is restored afterwards. Returns the ids
        as a NumPy array.

        Checked before any work: ``idx`` holds integers and at least one token per row
        (else ``DTypeError``, ``ShapeError``); ``max_new_tokens`` is an integer >= 0,
        ``temperature`` a finite real >= 0, ``top_k`` an integer in [1, vocab_size],
        ``top_p`` a real in (0, 1] and the token ids integers in [0, vocab_size) (bools
        refused; else ``HyperparameterError`` naming the argument).
        """
        out = np.asarray(idx)
        single = out.ndim == 1
        out = out[None] if single else out
        if out.ndim != 2 or out.shape[1] < 1:
            raise ShapeError(
                f"{self.label()}: generate input has shape {np.shape(idx)}, expected (B, T) "
                "or (T,) with T >= 1"
            )
        if not np.issubdtype(out.dtype, np.integer):
            raise DTypeError(f"{self.label()}: generate needs integer ids, got {out.dtype.name}")
        out = out.astype(np.int64)  # sampled ids join them: uint64 with int64 is float64
        max_new_tokens = count("generate", "max_new_tokens", max_new_tokens)
        temperature = at_least_zero("generate", "temperature", temperature)
        if top_k is not None:
            top_k = count("generate", "top_k", top_k)
            if not 1 <= top_k <= self.vocab_size:
                raise HyperparameterError(
                    f"generate: top_k must be in [1, {self.vocab_size}], got {top_k!r}"
                )
        if top_p is not None:
            top_p = unit_interval("generate", "top_p", top_p)
            if top_p == 0:
                raise HyperparameterError("generate: top_p must be in (0, 1], got 0")
        eos = [] if eos_token_id is None else eos_token_id
        if isinstance(eos, Integral):
            eos = [eos]
        if not isinstance(eos, (list, tuple)):
            raise HyperparameterError(
                f"generate: eos_token_id must be a token id or a list of them, got {eos!r:.80}"
            )
        eos = [self._token_count(f"eos_token_id[{i}]", t) for i, t in enumerate(eos)]
        pad = eos[0] if pad_token_id is None and eos else pad_token_id
        pad = None if pad is None else self._token_count("pad_token_id", pad)
        rng = init.generator(rng)
        cache = self.new_cache() if flag("generate", "use_cache", use_cache) else None
        done = np.zeros(out.shape[0], dtype=bool)
        with self._inference() as session:
            for _ in range(max_new_tokens):
                session.reset()
                logits = self._next_logits(session, out, cache)
                token = _sample(logits, temperature, top_k, top_p, rng)
                if eos:
                    token = np.where(done[:, None], pad, token)
                    done |= np.isin(token[:, 0], eos)
                out = np.concatenate([out, token], 1)
                if done.all():
                    break
        return out[0] if single else out

    def _token_count(self, name: str, value: Any) -> int:
        """``value`` checked to be a token id, an integer in [0, vocab_size)."""
        value = count("generate", name, value)
        if value >= self.vocab_size:
            raise HyperparameterError(
                f"generate: {name} must be in [0, {self.vocab_size}), got {value!r}"
            )
        return value

    def _next_logits(
        self, session: EagerSession, ids: np.ndarray, cache: KVCache | None
    ) -> np.ndarray:
        """The last position's logits (B, V) after ``ids``: through ``cache`` when given
        (the prompt on its first call, the newest token after), else from the window of
        the last ``max_seq_len`` tokens."""
        if cache is None:
            return self(session, ids[:, -self.max_seq_len :]).numpy()[:, -1, :]
        if cache.length + 1 > self.max_seq_len:
            cache.clear()
        feed = ids[:, -self.max_seq_len :] if cache.length == 0 else ids[:, -1:]
        return self(session, feed, cache=cache).numpy()[:, -1, :]


def _sample(
    logits: np.ndarray,
    temperature: float,
    top_k: int | None,
    top_p: float | None,
    rng: np.random.Generator,
) -> np.ndarray:
    """One token id per row (B, 1) from last-position logits (B, V)."""
    z = logits.astype(np.float64)
    if temperature == 0:
        return np.argmax(z, axis=-1)[:, None]
    with np.errstate(over="ignore"):  # a tiny temperature: -inf, all but the largest
        z = (z - z.max(axis=-1, keepdims=True)) / temperature  # max 0: never inf - inf
    if top_k is not None:
        kth = np.sort(z, axis=-1)[:, -top_k][:, None]
        z = np.where(z < kth, -np.inf, z)
    p = np.exp(z)  # the largest is 0 (above), and top-k keeps it
    p /= p.sum(axis=-1, keepdims=True)
    if top_p is not None:  # keep a token when the mass of the likelier ones is < top_p
        order = np.argsort(-p, axis=-1, kind="stable")
        ranked = np.take_along_axis(p, order, axis=-1)
        before = np.cumsum(ranked, axis=-1) - ranked
        kept = np.zeros_like(p, dtype=bool)
        np.put_along_axis(kept, order, before < top_p, axis=-1)
        p = np.where(kept, p, 0.0)
        p /= p.sum(axis=-1, keepdims=True)
    cdf = np.cumsum(p, axis=-1)
    u = rng.random((z.shape[0], 1))
    return np.minimum((cdf < u).sum(axis=-1), z.shape[1] - 1)[:, None]
