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

from ..errors import CheckpointError, ConfigError


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


def stored_gpt2(path: Path, what: str) -> tuple[Any, Any]:
    """The ``GPT2`` a checkpoint describes (its model and transformers configurations, its
    LoRA adapters), built but not loaded, and the checkpoint's ``extra``; ``what`` names
    the caller in the error for a checkpoint of another model."""
    from ..train.job import build_model

    schema = checkpoint_schema(path)
    extra = schema.extra
    kwargs = model_config(extra)
    if kwargs is None or extra["model"].get("class") != "GPT2":
        raise ConfigError(f"{path}: {what} needs a GPT2 checkpoint (from 'tiegrad train --init')")
    model = build_model(dict(kwargs), "GPT2")
    model.source_config = extra.get("hf_config") or {}
    attach_stored_lora(model, schema, path)
    return model, extra


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
