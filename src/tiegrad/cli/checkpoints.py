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

    The model class's ``check_config`` checks its keys, types and ranges; then the slot count,
    parameter count and bytes it implies must be the file's own (so a configuration
    cannot make ``sample``, ``resume`` or ``export`` allocate more than the file holds),
    and its ``vocab_size`` fit the stored vocabulary's ``vocab_size`` (``None``: not
    checked here). Any mismatch is a ``CheckpointError``.
    ``lora``: the file is a LoRA run's, whose adapter slots (``<layer>.lora.<name>.A``
    and ``.B``) are left out of the count (``load`` checks them against the adapters
    built).
    """
    import math

    import numpy as np

    from .. import models
    from ..checkpoint.schema import nbytes

    where = f"checkpoint {path}"
    if model_class not in ("TiedLM", "GPT2"):
        raise CheckpointError(f"{where}: unknown model class {model_class!r:.80}")
    cls = getattr(models, model_class)
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


def stored_gpt2(path: Path, what: str) -> tuple[Any, Any]:
    """The ``GPT2`` a checkpoint describes (its model and transformers configurations, its
    LoRA adapters), built but not loaded, and the checkpoint's ``extra``; ``what`` names
    the caller in the error for a checkpoint of another model.

    The stored model configuration is checked against the file's tensors before anything
    is built (``checked_model_config``); of the stored transformers configuration only
    ``CARRIED_HF_KEYS`` are kept (``carried_hf_config``), so what ``export`` writes and a
    resumed run stores again holds the model's own keys and no key the file made up."""
    from ..train.job import build_model
    from ..train.lora import KEY

    schema = checkpoint_schema(path)
    extra = schema.extra
    kwargs = model_config(extra)
    if kwargs is None or extra["model"].get("class") != "GPT2":
        raise ConfigError(f"{path}: {what} needs a GPT2 checkpoint (from 'tiegrad train --init')")
    config = checked_model_config(path, schema, kwargs, None, "GPT2", lora=KEY in extra)
    source = carried_hf_config(path, extra.get("hf_config"), config["vocab_size"])
    model = build_model(config, "GPT2")
    model.source_config = source
    attach_stored_lora(model, schema, path)
    return model, extra


#: The keys of a checkpoint's stored transformers configuration (``extra["hf_config"]``,
#: the ``--init`` directory's ``config.json``) that are passed on: the special token ids
#: generation reads. Every other key is the model's own (``interop.hf.hf_config``) or
#: one tiegrad's ``GPT2`` does not implement, and is not written.
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

    extra = schema.extra
    text = extra.get(KEY) if isinstance(extra, dict) else None
    if text is None:
        return
    where = f"{path}: extra[{KEY!r}]"
    if not isinstance(text, str):
        raise CheckpointError(f"{where}: expected a LoRA specification string, got {text!r:.80}")
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
