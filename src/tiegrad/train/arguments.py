"""Checks of the ``Trainer``'s arguments and of what its ``loss_fn`` returns.

A bad argument is a ``ConfigError`` naming it and what was expected, raised by the
constructor before anything runs or is written (C6); a ``loss_fn`` result that has no
gradient or is not one number is refused at the step that records it.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable, Sequence
from typing import Any

from ..data.loader import Batch, BatchSource, check_positive
from ..errors import ConfigError, shown_list
from ..session import EagerSession, TensorRef
from .callbacks import Callback
from .config import TrainConfig

LossFn = Callable[[EagerSession, Batch], TensorRef]


def check_data(train_data: Any, val_data: Any) -> None:
    """``train_data`` a batch source with a batch at least; ``val_data`` None, a batch
    source or a non-empty list of batches."""
    if train_data is None or not isinstance(train_data, BatchSource):
        raise ConfigError(
            "Trainer: train_data must be a batch source with epoch(rng), len() and "
            f"count(batch) (e.g. TextDataset.loader), got {type(train_data).__name__}"
        )
    if len(train_data) < 1:
        raise ConfigError("Trainer: train_data yields no batch")
    if val_data is not None and not isinstance(val_data, (BatchSource, list, tuple)):
        raise ConfigError(
            "Trainer: val_data must be None, a batch source or a list of batches, got "
            f"{type(val_data).__name__}"
        )
    if isinstance(val_data, (list, tuple)):
        _check_batches(val_data)


def _check_batches(batches: Sequence[Any]) -> None:
    """A list of validation batches: at least one, each a tuple (or list) of arrays."""
    if not batches:
        raise ConfigError("Trainer: val_data is an empty list; give None or at least one batch")
    for i, batch in enumerate(batches):
        if not isinstance(batch, (tuple, list)):
            raise ConfigError(
                f"Trainer: val_data[{i}] is a {type(batch).__name__}, expected a batch (a tuple "
                "of arrays); for one batch (x, y) pass [(x, y)]"
            )


def check_optimizer(optimizer: Any) -> None:
    """A tiegrad optimizer: the trainer calls its ``canonical_gradients`` and ``step``."""
    for method in ("step", "canonical_gradients"):
        if not callable(getattr(optimizer, method, None)):
            raise ConfigError(
                f"Trainer: the optimizer must be a tiegrad optimizer (with {method}()), got "
                f"{type(optimizer).__name__}"
            )


#: The ``Trainer`` keywords that are settings, and the ``TrainConfig`` key each sets
#: (``None``: the length, ``max_steps`` or ``epochs``); their defaults are the signature's.
SETTING_KEYWORDS: dict[str, str | None] = {
    "max_steps": None,
    "epochs": None,
    "grad_accum": "grad_accum",
    "clip_norm": "clip_norm",
    "eval_every": "eval_every",
    "checkpoint_every": "checkpoint_every",
    "keep_last": "keep_last",
    "patience": "patience",
    "min_delta": "min_delta",
    "run_dir": "run",
    "seed": "seed",
    "device": "device",
    "progress": "progress",
    "recompute": "recompute",
}


def keyword_config(settings: dict[str, Any], batches: int) -> TrainConfig:
    """The ``TrainConfig`` of the ``Trainer``'s setting keywords (``SETTING_KEYWORDS``),
    ``batches`` being the batches of an epoch of ``train_data``.

    The keywords say "off" with ``None`` (``clip_norm``, ``eval_every``,
    ``checkpoint_every``, ``patience``: 0 in the configuration, where 0 turns them
    off), so 0 given as a keyword is refused; ``epochs`` becomes the step count. A bad
    value is a ``ConfigError`` naming the keyword (``Trainer: NAME``) (C6).
    """
    if (settings["max_steps"] is None) == (settings["epochs"] is None):
        raise ConfigError("Trainer: give exactly one of max_steps and epochs")
    grad_accum = check_positive("Trainer: grad_accum", settings["grad_accum"])
    if settings["max_steps"] is not None:
        steps = check_positive("Trainer: max_steps", settings["max_steps"])
    else:
        steps = max(
            1, check_positive("Trainer: epochs", settings["epochs"]) * batches // grad_accum
        )
    off = {
        name: check_positive(f"Trainer: {name}", settings[name])
        if settings[name] is not None
        else 0
        for name in ("eval_every", "checkpoint_every", "patience")
    }
    clip_norm = settings["clip_norm"]
    if clip_norm is not None and (
        isinstance(clip_norm, bool)
        or not isinstance(clip_norm, (int, float))
        or not 0 < clip_norm < math.inf
    ):
        raise ConfigError(
            f"Trainer: clip_norm must be a finite number > 0 or None, got {clip_norm!r}"
        )
    run_dir = settings["run_dir"]
    if run_dir is not None and not isinstance(run_dir, (str, os.PathLike)):
        raise ConfigError(
            f"Trainer: run_dir must be a str, os.PathLike or None, got {type(run_dir).__name__}"
        )
    device = settings["device"]
    if not isinstance(settings["recompute"], bool):
        raise ConfigError(
            f"Trainer: recompute must be True or False, got {settings['recompute']!r:.80}"
        )
    values = {
        "steps": steps,
        "grad_accum": grad_accum,
        "clip_norm": clip_norm or 0.0,
        **off,
        "keep_last": settings["keep_last"],
        "min_delta": settings["min_delta"],
        "seed": settings["seed"],
        "device": "cpu" if device is None else device,
        "progress": settings["progress"],
        "recompute": settings["recompute"],
        "run": "" if run_dir is None else os.fspath(run_dir),
    }
    names = {key: name for name, key in SETTING_KEYWORDS.items() if key is not None}
    names["steps"] = "max_steps" if settings["max_steps"] is not None else "epochs"
    return TrainConfig.from_mapping(values, labels={k: f"Trainer: {n}" for k, n in names.items()})


def check_config_alone(config: Any, settings: dict[str, Any], defaults: dict[str, Any]) -> None:
    """With ``config`` (a ``TrainConfig``), every setting keyword keeps its default (in
    ``defaults``): the settings come from one place. Else a ``ConfigError`` naming the
    keywords given."""
    if not isinstance(config, TrainConfig):
        raise ConfigError(
            f"Trainer: config must be a tiegrad.train.TrainConfig, got {type(config).__name__}"
        )
    given = [
        name
        for name, value in settings.items()
        if value is not defaults[name] and value != defaults[name]
    ]
    if given:
        raise ConfigError(
            f"Trainer: give the settings in config or as keywords, not both (config and "
            f"{shown_list(given)})"
        )


def callback_list(callbacks: Any) -> list[Any]:
    """``callbacks`` (a list or tuple) as a new list; its entries are checked by
    ``check_callbacks``."""
    if not isinstance(callbacks, (list, tuple)):
        raise ConfigError(
            f"Trainer: callbacks must be a list of Callbacks, got {type(callbacks).__name__}"
        )
    return list(callbacks)


def check_callbacks(callbacks: list[Any]) -> None:
    """Every entry a ``tiegrad.train.Callback``."""
    for i, cb in enumerate(callbacks):
        if not isinstance(cb, Callback):
            raise ConfigError(
                f"Trainer: callbacks[{i}] is a {type(cb).__name__}, expected a "
                "tiegrad.train.Callback (override on_step_end, on_eval, on_checkpoint "
                "or on_train_end)"
            )


def checked_extra(extra: Any) -> dict[str, Any]:
    """``extra`` as a dict that a checkpoint can store (JSON), without the key
    ``"trainer"`` that the trainer's own state takes."""
    if extra is None:
        return {}
    if not isinstance(extra, dict):
        raise ConfigError(f"Trainer: extra must be a dict or None, got {type(extra).__name__}")
    if "trainer" in extra:
        raise ConfigError("Trainer: extra['trainer'] is reserved for the trainer's own state")
    try:
        json.dumps(extra)
    except (TypeError, ValueError) as e:
        raise ConfigError(f"Trainer: extra is not JSON-serializable: {e}") from None
    return dict(extra)


def check_recompute(model: Any, recompute: bool) -> None:
    """When ``recompute``, ``model`` has transformers' switch
    ``gradient_checkpointing_enable()`` (the language models: ``TiedCausalLM.recompute``)."""
    if recompute and not callable(getattr(model, "gradient_checkpointing_enable", None)):
        raise ConfigError(
            f"Trainer: recompute=True needs a model with gradient_checkpointing_enable() "
            f"(TiedLM, SharedBlockLM, GPT2, LlamaLM); {type(model).__name__} has none: wrap "
            "its blocks in tiegrad.nn.checkpoint in its forward instead"
        )


def loss_fn_of(model: Any, loss_fn: LossFn | None) -> LossFn:
    """``loss_fn``, or by default ``model.loss(session, *batch)``."""
    if loss_fn is not None:
        return loss_fn
    if not callable(getattr(model, "loss", None)):
        raise ConfigError("Trainer: the model has no loss(); pass loss_fn")

    def model_loss(session: EagerSession, batch: Batch) -> TensorRef:
        return model.loss(session, *batch)

    return model_loss


def scalar_loss(loss: Any) -> TensorRef:
    """``loss`` when it is one number recorded on the tape; else a ``ConfigError`` naming
    ``loss_fn`` (a float has no gradient, a per-sample loss needs a reduction)."""
    if not isinstance(loss, TensorRef):
        raise ConfigError(
            f"Trainer: loss_fn must return the loss as a TensorRef of the session, got "
            f"{type(loss).__name__}"
        )
    if loss.size != 1:
        raise ConfigError(
            f"Trainer: loss_fn must return one number, got shape {tuple(loss.shape)} (reduce "
            "it, e.g. with ops.mean)"
        )
    return loss
