"""What a checkpoint file says about its model, read without loading its tensors.

``tiegrad train`` stores the model's class and constructor arguments in the
checkpoint's ``extra`` (``extra["model"]``); the commands read them to rebuild the
model (``sample``, ``export``, a resumed fine-tuning run) and to refuse a run folder
holding another model's checkpoints.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from ..errors import CheckpointError, ConfigError, TiegradError

#: The key of a checkpoint's ``extra`` holding the run's ``freeze`` setting (absent: none).
FREEZE = "freeze"


def checkpoint_schema(path: Path) -> Any:
    """The parsed schema of the checkpoint at ``path`` (its header, no tensor read)."""
    from ..checkpoint import Schema
    from ..checkpoint.fileio import read_safetensors

    return Schema.parse(read_safetensors(os.fspath(path)))


def checkpoint_extra(path: Path) -> Any:
    return checkpoint_schema(path).extra


def checkpoint_model(path: Path) -> Any:
    return model_config(checkpoint_extra(path))


def model_config(extra: Any) -> Any:
    """The model constructor arguments stored in a checkpoint's ``extra`` (or ``None``)."""
    model = extra.get("model") if isinstance(extra, dict) else None
    if not isinstance(model, dict) or not isinstance(model.get("config"), dict):
        return None
    return model["config"]


def model_difference(stored: Any, kwargs: dict[str, Any]) -> str:
    """How the model of a checkpoint (its constructor arguments ``stored``) differs from
    the one a run builds (``kwargs``): the keys that differ, with both values."""
    if not isinstance(stored, dict):
        return "the checkpoint holds no tiegrad language model"
    keys = [*kwargs, *(k for k in stored if k not in kwargs)]
    differ = [k for k in keys if stored.get(k) != kwargs.get(k)]
    return (
        f"the checkpoint's {' '.join(f'{k}={stored.get(k)}' for k in differ)}; "
        f"this run's {' '.join(f'{k}={kwargs.get(k)}' for k in differ)}"
    )


def checked_model_config(
    path: Path,
    schema: Any,
    kwargs: Any,
    vocab_size: int | None,
    model_class: str,
    lora: bool = False,
) -> dict[str, Any]:
    """The file's model configuration, checked completely before anything is built (C6).

    ``model_class`` must be one of ``train.job.MODEL_CLASSES``; the class's
    ``check_config`` checks its keys, types and ranges; then the slot count,
    parameter count and bytes it implies (the class's ``layout_size``, arithmetic
    alone) must be the file's own (so a configuration cannot make ``sample``,
    ``resume`` or ``export`` allocate more than the file holds), and its ``vocab_size``
    fit the stored vocabulary's ``vocab_size`` (``None``: not checked here; a
    ``TiedLM``'s is the vocabulary's own). Any mismatch is a ``CheckpointError``.
    ``lora``: the file is a LoRA run's, whose adapter slots (``<layer>.lora.<name>.A``
    and ``.B``) are left out of the count (``load`` checks them against the adapters
    built).
    """
    import math

    import numpy as np

    from ..checkpoint.schema import nbytes
    from ..train.job import model_class as class_named

    where = f"checkpoint {path}"
    try:
        cls = class_named(model_class)
    except ConfigError as e:
        raise CheckpointError(f"{where}: {e}") from None
    try:
        config = cls.check_config(kwargs)
    except TiegradError as e:
        raise CheckpointError(f"{where}: invalid model configuration: {e}") from None
    slots, elements = cls.layout_size(config)
    implied = (slots, elements, elements * np.dtype(config["dtype"]).itemsize)
    base = [(i, s) for i, s in enumerate(schema.slots) if not (lora and ".lora." in s.path)]
    stored = [s for i, s in base if s.storage == i]
    held = (len(base), sum(math.prod(s.shape) for s in stored), sum(map(nbytes, stored)))
    if implied != held:
        raise CheckpointError(
            f"{where}: the model configuration implies {implied[0]} slots and {implied[1]:,} "
            f"parameters ({implied[2]:,} bytes); the file holds {held[0]} slots and "
            f"{held[1]:,} parameters ({held[2]:,} bytes)"
        )
    if vocab_size is not None and (
        config["vocab_size"] < vocab_size
        or (model_class == "TiedLM" and config["vocab_size"] != vocab_size)
    ):
        raise CheckpointError(
            f"{where}: the model's vocab_size is {config['vocab_size']}, the stored "
            f"vocabulary has {vocab_size} symbols"
        )
    return config


def stored_model(path: Path, what: str, pretrained: bool = True) -> tuple[Any, Any]:
    """The model a checkpoint describes, built but not loaded, and the checkpoint's
    ``extra``; ``what`` names the caller in the error for a checkpoint of no model or,
    with ``pretrained``, of a model not fine-tuned from a transformers directory
    (``train.job.PRETRAINED_CLASSES``: ``tiegrad train --init``).

    The stored class (``train.job.MODEL_CLASSES``) and configuration are checked against
    the file's tensors before anything is built (``checked_model_config``; the stored
    vocabulary's size too, where the file has one), and the model is its class's own
    rebuild, ``cls(**config)`` (C9), with what the run changed on it: its LoRA adapters
    (``attach_stored_lora``), its frozen uses (``apply_stored_freeze``) and row masks
    (``apply_stored_rows``), so the checkpoint loads into it. A model of a transformers
    directory (``tiegrad train --init``) keeps, of the stored transformers configuration,
    only ``CARRIED_HF_KEYS`` (``carried_hf_config``), so what ``export`` writes and a resumed
    run stores again holds the model's own keys and no key the file made up."""
    from ..data import tokenizer_from_dict
    from ..train.job import MODEL_CLASS, PRETRAINED_CLASSES, build_model
    from ..train.lora import KEY

    schema = checkpoint_schema(path)
    extra = schema.extra
    kwargs = model_config(extra)
    if kwargs is None:
        raise ConfigError(f"{path}: {what} needs a checkpoint of 'tiegrad train' (no model in it)")
    name = extra["model"].get("class", MODEL_CLASS)
    if pretrained and name not in PRETRAINED_CLASSES:
        raise ConfigError(
            f"{path}: {what} needs a checkpoint of a model fine-tuned from a transformers "
            f"directory ('tiegrad train --init': {' or '.join(PRETRAINED_CLASSES)}); this one "
            f"holds a {name!r:.40}"
        )
    vocab = extra.get("vocab")
    vocab = tokenizer_from_dict(vocab).size if isinstance(vocab, dict) else None
    config = checked_model_config(path, schema, kwargs, vocab, name, lora=KEY in extra)
    source = (
        carried_hf_config(path, extra.get("hf_config"), config["vocab_size"])
        if "hf_config" in extra
        else None
    )
    model = build_model(config, name)
    if source is not None:
        model.source_config = source
    attach_stored_lora(model, schema, path)
    apply_stored_freeze(model, extra, path)
    apply_stored_rows(model, schema)
    return model, extra


def apply_stored_rows(model: Any, schema: Any) -> None:
    """Set the row masks a checkpoint's ``schema`` holds (``params.rows``: a ``tiegrad
    train --train-rows new`` run's) on the storages of ``model`` at the same paths, so
    the checkpoint loads into it and a resumed run trains those rows alone. The schema
    checked each mask against its slot's shape, which is the model's (C6)."""
    for slot, rows in schema.rows.items():
        model.get_parameter(schema.slots[slot].path).storage.train_rows(rows)


def apply_stored_freeze(model: Any, extra: Any, path: Path) -> None:
    """Freeze the uses of ``model`` that a checkpoint's ``extra[FREEZE]`` names (a
    ``tiegrad train --freeze`` run's setting; none for another run), so that the
    checkpoint's trainability is the model's; a malformed setting, or a pattern matching
    no path, is a ``CheckpointError`` naming the file."""
    from ..train.job import apply_freeze

    text, where = _extra_text(extra, FREEZE, path, "a freeze setting")
    if text is None:
        return
    try:
        apply_freeze(model, text, where)
    except ConfigError as e:
        raise CheckpointError(str(e)) from None


#: The keys of a checkpoint's stored transformers configuration (``extra["hf_config"]``,
#: the ``--init`` directory's ``config.json``) that are passed on: the special token ids
#: generation reads. Every other key is the model's own (its class's ``save_pretrained``
#: writes it from ``config``) or one the tiegrad class does not implement, and is not
#: written.
CARRIED_HF_KEYS = ("bos_token_id", "eos_token_id", "pad_token_id")


def carried_hf_config(path: Path, stored: Any, vocab_size: int) -> dict[str, Any]:
    """The ``CARRIED_HF_KEYS`` of a checkpoint's stored transformers configuration
    (``stored``: a JSON object, or absent); a value other than null or a token id below
    ``vocab_size`` is a ``CheckpointError`` naming the file and the key."""
    if stored is None:
        return {}
    where = f"{path}: extra['hf_config']"
    if not isinstance(stored, dict):
        raise CheckpointError(f"{where}: expected a JSON object, got {stored!r:.80}")
    out = {}
    for key in CARRIED_HF_KEYS:
        value = stored.get(key)
        if value is not None and (
            isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < vocab_size
        ):
            raise CheckpointError(
                f"{where}: {key} must be null or a token id in [0, {vocab_size}), got {value!r:.40}"
            )
        if key in stored:
            out[key] = value
    return out


def attach_stored_lora(model: Any, schema: Any, path: Path) -> None:
    """Attach to ``model`` the LoRA adapters the ``extra`` of a checkpoint's ``schema`` describes
    (those of a ``tiegrad train --lora`` run, ``tiegrad.train.lora``; none for another run),
    so that the checkpoint loads into it. A malformed description, or a rank other than that
    of the file's adapter tensors, is a ``CheckpointError`` naming the file, raised before
    anything is built (a file's description cannot make it allocate adapters it does not
    hold)."""
    from ..train.lora import KEY, parse_lora

    text, where = _extra_text(schema.extra, KEY, path, "a LoRA specification")
    if text is None:
        return
    ranks = {
        s.shape[0] for s in schema.slots if ".lora." in s.path and s.path.endswith(".A") and s.shape
    }
    try:
        spec = parse_lora(text, where)
        if ranks != {spec.rank}:
            raise CheckpointError(
                f"{where}: rank {spec.rank}, but the file's adapter tensors have rank "
                f"{sorted(ranks) or 'none (no adapter tensor)'}"
            )
        spec.attach(model, where)
    except ConfigError as e:
        raise CheckpointError(str(e)) from None


def _extra_text(extra: Any, key: str, path: Any, what: str) -> tuple[str | None, str]:
    """``(extra[key], where)``: the text a run stored under ``key`` of a checkpoint's
    ``extra`` (None where it stored none) and how errors name it; a value that is not
    a string is a ``CheckpointError`` naming ``what`` was expected."""
    text = extra.get(key) if isinstance(extra, dict) else None
    where = f"{path}: extra[{key!r}]"
    if text is not None and not isinstance(text, str):
        raise CheckpointError(f"{where}: expected {what} string, got {text!r:.80}")
    return text, where
