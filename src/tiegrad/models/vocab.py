"""Growing a language model's vocabulary: ``resize_vocab``.

transformers' ``resize_token_embeddings`` for tiegrad's language models (``GPT2``,
``LlamaLM``, ``TiedLM``, ``SharedBlockLM``): rows are appended to the token embedding
and to the head. A tied head is a second use of the embedding's storage (C1), so the one
storage grows once and both uses see the new rows; an untied head grows its own
storage. Each path's handle keeps its trainability and name (it is the same handle on
a new storage), so an optimizer holding it steps the grown storage (with fresh state).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..errors import ConfigError, shown_list
from ..params import ParameterStorage

#: How new rows start: ``mean`` of the old rows (transformers' default, without the
#: 1e-9-scaled noise it adds), ``zeros``, or ``normal``: N(0, initializer_range**2).
INITS = ("mean", "zeros", "normal")
#: Which rows train afterwards: ``all``, or ``new`` (a row mask on the grown storages,
#: ``tiegrad.params.rows``: the old rows stay bit-identical).
TRAIN = ("all", "new")


def resize_vocab(
    model: Any, new_size: int, init: str = "mean", *, train: str = "all", seed: int = 0
) -> None:
    """Grow ``model``'s vocabulary to ``new_size`` tokens, in place.

    The token embedding and the head (``model.VOCAB_PATHS``) get ``new_size - vocab_size``
    new rows, initialised by ``init`` (``INITS``; ``normal`` draws from
    ``default_rng(seed)``); ``model.vocab_size`` and ``model.config["vocab_size"]`` (what
    ``save_pretrained`` and checkpoints write) follow. ``train="new"`` sets a row mask
    on the grown storages so that only the new rows train (``tiegrad.nn.train_rows``);
    with ``"all"`` a row mask already there is kept. ``new_size`` equal to the current
    size changes nothing. Shrinking is refused, as is a model with a LoRA adapter on the
    embedding or the head, a bad size, ``init`` or ``train``: one ``ConfigError`` naming
    the model and the value, before anything changes (C6).
    """
    label = model.label() if hasattr(model, "label") else type(model).__name__
    paths = getattr(model, "VOCAB_PATHS", None)
    if paths is None:
        raise ConfigError(f"resize_vocab: {label} is not a language model with a token embedding")
    old = int(model.vocab_size)
    if isinstance(new_size, bool) or not isinstance(new_size, (int, np.integer)):
        raise ConfigError(
            f"resize_vocab {label}: new_size must be an integer, got {new_size!r:.40}"
        )
    new_size = int(new_size)
    if new_size < old:
        raise ConfigError(
            f"resize_vocab {label}: new_size {new_size} is below the vocabulary of {old} "
            f"tokens; shrinking is not supported (it would drop trained rows)"
        )
    if init not in INITS:
        raise ConfigError(f"resize_vocab {label}: init must be one of {INITS}, got {init!r:.40}")
    if train not in TRAIN:
        raise ConfigError(f"resize_vocab {label}: train must be one of {TRAIN}, got {train!r:.40}")
    slots = model.named_slots()
    layers = {path.rsplit(".", 1)[0] for path in paths}
    adapted = [p for p, _ in slots if any(p.startswith(f"{m}.lora.") for m in layers)]
    if adapted:
        raise ConfigError(
            f"resize_vocab {label}: LoRA adapters on the embedding or the head "
            f"({shown_list(adapted)}) depend on the vocabulary; resize before adding them"
        )
    handles = [model.get_parameter(path) for path in paths]
    for path, p in zip(paths, handles):
        if len(p.shape) != 2 or p.shape[0] != old:
            raise ConfigError(
                f"resize_vocab {label}: {path} has shape {p.shape}, expected ({old}, d)"
            )
    if new_size == old:
        return
    rng = np.random.default_rng(seed)
    std = float(model.config.get("initializer_range", 0.02))
    grown: dict[ParameterStorage, ParameterStorage] = {}
    for p in handles:
        if p.storage not in grown:
            grown[p.storage] = _grown(p.storage, new_size, init, rng, std)
    new_rows = np.arange(old, new_size)
    for old_storage, storage in grown.items():
        storage.train_rows(new_rows if train == "new" else old_storage.trained_rows)
    for _, p in slots:
        p.storage = grown.get(p.storage, p.storage)
    for path in paths:
        layer, _ = model._holder(path)
        for size_name in ("num_embeddings", "out_features"):
            if hasattr(layer, size_name):
                setattr(layer, size_name, new_size)
    model.vocab_size = new_size
    model.config["vocab_size"] = new_size


def _grown(
    storage: ParameterStorage, size: int, init: str, rng: np.random.Generator, std: float
) -> ParameterStorage:
    """A new storage of ``size`` rows: ``storage``'s current rows, then new ones by ``init``."""
    value = storage.current_host_value()
    shape = (size - value.shape[0], *value.shape[1:])
    if init == "mean":
        rows = np.broadcast_to(value.mean(axis=0, dtype=np.float64), shape)
    elif init == "zeros":
        rows = np.zeros(shape)
    else:
        rows = rng.normal(0.0, std, shape)
    return ParameterStorage.adopting(np.concatenate([value, rows.astype(value.dtype)]))
