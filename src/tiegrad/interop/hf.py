"""Hugging Face GPT-2 directories in and out, without torch or transformers.

A directory of transformers' ``save_pretrained`` holds ``config.json`` and either
``model.safetensors`` or shards listed by ``model.safetensors.index.json``, all read
with ``checkpoint.fileio``'s bounded readers (JSON of a capped size and depth; the
strict safetensors reader, which reads headers and maps the data). Tensor names may
carry the ``transformer.`` prefix or not (the hub's files have none); the causal-mask
buffers old files hold (``h.N.attn.bias``, ``h.N.attn.masked_bias``) are constants of
the architecture and skipped, as transformers skips them.

The tie (C1): a file without ``lm_head.weight`` (what transformers writes, and the
hub's files) gets the head tied to ``transformer.wte.weight`` when
``tie_word_embeddings`` is true; a file with both tensors ties them when their values
are equal and is refused when they differ, unless ``tie_word_embeddings`` is false, in
which case the two are loaded untied. Every tensor's presence, shape and dtype is
checked before any value is written (C6); missing or unexpected names are one
``CheckpointError`` naming a few of them and counting the rest, and they are checked
first, so that the error names the tensor rather than a count. A folder that cannot
be listed or a file that cannot be read is a ``CheckpointError`` naming it.

The functions take the model (or, to build one, its class: ``GPT2``) as an argument and
import nothing from ``tiegrad.models``: ``GPT2``'s ``from_pretrained``/``save_pretrained``
call in here, so the dependency points one way.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Collection, Mapping
from pathlib import Path
from typing import Any, TypeVar

import numpy as np

from ..checkpoint.fileio import SafetensorsFile, read_json, read_safetensors, write_safetensors
from ..checkpoint.finite import finite_cast
from ..errors import CheckpointError, ConfigError, HyperparameterError, shown, shown_list
from ..nn.module import Module

#: The model class ``load_gpt2`` builds (``GPT2``: ``check_config``, ``layout``).
ModelT = TypeVar("ModelT", bound=Module)
#: ``{full name: (file, name in the file)}``, as ``read_tensors`` gives it.
Tensors = dict[str, tuple[SafetensorsFile, str]]

CONFIG = "config.json"
WEIGHTS = "model.safetensors"
INDEX = "model.safetensors.index.json"
PREFIX = "transformer."
HEAD = "lm_head.weight"
EMBEDDING = "transformer.wte.weight"
_BUFFERS = (".attn.bias", ".attn.masked_bias")

#: ``config.json`` keys that are ``GPT2`` constructor arguments.
CONFIG_KEYS = (
    "vocab_size",
    "n_positions",
    "n_embd",
    "n_layer",
    "n_head",
    "n_inner",
    "activation_function",
    "resid_pdrop",
    "embd_pdrop",
    "attn_pdrop",
    "layer_norm_epsilon",
    "initializer_range",
    "scale_attn_weights",
    "scale_attn_by_inverse_layer_idx",
    "tie_word_embeddings",
)
#: ``config.json`` keys whose other values this architecture does not implement.
_UNSUPPORTED = {"add_cross_attention": False}


def folder_config(directory: str | os.PathLike[str]) -> dict[str, Any]:
    """The ``config.json`` of a transformers model directory as a dict: a folder that
    cannot be listed, no ``config.json``, or one that is not a JSON object of a bounded
    size and depth (``fileio.read_json``) is a ``CheckpointError`` naming it."""
    if CONFIG not in listing(directory):
        raise CheckpointError(f"{directory}: no {CONFIG} (not a transformers model directory)")
    return read_json(Path(directory) / CONFIG)


def read_config(directory: str | os.PathLike[str]) -> dict[str, Any]:
    """``folder_config`` of a GPT-2 directory (``model_type`` must be gpt2, and the
    features tiegrad's GPT2 lacks unset)."""
    path = Path(directory) / CONFIG
    config = folder_config(directory)
    kind = config.get("model_type", "gpt2")
    if kind != "gpt2":
        raise CheckpointError(f"{path}: model_type {shown(kind)}, expected 'gpt2'")
    for key, value in _UNSUPPORTED.items():
        if config.get(key, value) != value:
            raise ConfigError(
                f"{path}: {key}={shown(config[key])} is not supported by tiegrad's GPT2"
            )
    return config


def listing(directory: str | os.PathLike[str]) -> set[str]:
    """The names in ``directory``; a path that is no folder or cannot be listed is a
    ``CheckpointError`` naming it."""
    try:
        return set(os.listdir(directory))
    except FileNotFoundError:
        raise CheckpointError(f"{directory}: no such folder") from None
    except NotADirectoryError:
        raise CheckpointError(
            f"{directory}: not a folder (expected a transformers model directory)"
        ) from None
    except OSError as e:
        raise CheckpointError(f"{directory}: cannot list the folder: {e.strerror or e}") from None


def model_kwargs(config: dict[str, Any]) -> dict[str, Any]:
    """The ``GPT2`` constructor arguments of a transformers GPT-2 configuration."""
    return {k: config[k] for k in CONFIG_KEYS if k in config}


def load_gpt2(
    cls: type[ModelT],
    directory: str | os.PathLike[str],
    dtype: Any = "float32",
    *,
    allow_nonfinite: bool = False,
) -> ModelT:
    """A model of class ``cls`` (``GPT2``) built from ``config.json``, the directory's
    weights loaded (``load_weights``, which refuses NaN and infinite values unless
    ``allow_nonfinite``).

    Before anything is built, the configuration is checked against the tensors, whose
    shapes the safetensors headers give without reading data: first no size it implies
    (``cls.sizes``: layers, width, vocabulary, positions, inner width) may exceed the
    one the tensors hold (``cls.sizes_held``), which bounds the layout; then
    against ``cls.layout``: the names (a few missing and unexpected ones named), then
    the element count, which catches what names cannot (blocks of other shapes). So a
    ``config.json`` from elsewhere cannot make it allocate more than its weights, nor
    build a layout or a message larger than the folder (C6).
    """
    config = read_config(directory)
    path = Path(directory) / CONFIG
    try:
        args = cls.check_config(dict(model_kwargs(config), dtype=dtype))
    except (ConfigError, HyperparameterError) as e:  # check_config's verdicts
        raise ConfigError(f"{path}: {e}") from None
    tensors = read_tensors(directory)
    check_sizes(
        cls, path, args, {full: file.tensors[name].shape for full, (file, name) in tensors.items()}
    )
    paths = [p for p, _ in cls.layout(args)]
    tied_head = bool(args["tie_word_embeddings"])
    check_names(directory, f"the {cls.__name__} of its {CONFIG}", paths, tensors, tied_head)
    held = sum(math.prod(file.tensors[name].shape) for file, name in tensors.values())
    needed = cls.layout_size(args)[1]
    if needed > held:
        raise CheckpointError(
            f"{path}: describes a model of {needed} elements, but the "
            f"weights in {directory} hold {held} (every tensor is there: the configuration "
            "gives them other shapes)"
        )
    model = cls(**args)
    model.source_config = config
    load_weights(model, directory, tensors, allow_nonfinite=allow_nonfinite)
    return model


def check_sizes(
    cls: Any,
    path: str | os.PathLike[str],
    args: Mapping[str, Any],
    shapes: Mapping[str, tuple[int, ...]],
) -> None:
    """Refuse a configuration ``args`` (``cls.check_config``'s) any of whose sizes exceeds
    the one the tensors of ``shapes`` hold, naming the keys of ``path`` and both values;
    arithmetic only, so a configuration of a million layers costs nothing. What this
    leaves (a smaller size, a stray block) the names and shapes checks name by tensor,
    and the configuration no longer describes more than the folder holds (C6). ``n_head``,
    which no shape shows, is bounded by ``n_embd``, which it must divide."""
    implied, held = cls.sizes(args), cls.sizes_held(shapes)
    wrong = [
        f"{k}={implied[k]} but the weights hold {held[k]}" for k in held if implied[k] > held[k]
    ]
    if wrong:
        raise CheckpointError(f"{path}: {'; '.join(wrong)}")


def check_names(
    directory: str | os.PathLike[str],
    label: str,
    paths: Collection[str],
    tensors: Mapping[str, object],
    tied_head: bool,
) -> None:
    """Refuse tensors that are not exactly ``paths`` (a tied ``lm_head.weight`` may be
    absent), naming a few missing and unexpected ones and counting the rest (C6)."""
    missing = [p for p in paths if p not in tensors and not (tied_head and p == HEAD)]
    allowed = set(paths)
    unexpected = [n for n in tensors if n not in allowed]
    if missing or unexpected:
        raise CheckpointError(
            f"{directory}: the weights do not match {label}: "
            f"missing {shown_list(missing)}; unexpected {shown_list(unexpected)}"
        )


def _tensor_files(directory: Path) -> list[SafetensorsFile]:
    """The safetensors files of a directory: the single file or every shard of the index,
    each name in the shard the index names for it."""
    names = listing(directory)
    if WEIGHTS in names:
        return [read_safetensors(os.fspath(directory / WEIGHTS))]
    if INDEX not in names:
        raise CheckpointError(f"{directory}: neither {WEIGHTS} nor {INDEX}")
    index = directory / INDEX
    weight_map = read_json(index).get("weight_map")
    if not isinstance(weight_map, dict) or not all(
        isinstance(v, str) and v == os.path.basename(v) and v for v in weight_map.values()
    ):
        raise CheckpointError(f"{index}: weight_map must map names to file names in {directory}")
    files = []
    for shard in sorted(set(weight_map.values())):
        file = read_safetensors(os.fspath(directory / shard))
        strays = [n for n in file.tensors if weight_map.get(n) != shard]
        listed = [n for n, s in weight_map.items() if s == shard and n not in file.tensors]
        if strays or listed:
            raise CheckpointError(
                f"{directory / shard}: does not match {INDEX} (in the file but not listed "
                f"for it: {shown_list(strays)}; listed but absent: {shown_list(listed)})"
            )
        files.append(file)
    return files


def read_tensors(directory: str | os.PathLike[str]) -> Tensors:
    """``{full name: (file, name in the file)}`` of a directory's tensors, names given the
    ``transformer.`` prefix where they lack it; mask buffers left out."""
    out: Tensors = {}
    for file in _tensor_files(Path(directory)):
        for name in file.tensors:
            if name.endswith(_BUFFERS):
                continue
            full = name if name.startswith(PREFIX) or name == HEAD else PREFIX + name
            if full in out:
                raise CheckpointError(
                    f"{directory}: tensor {full!r} is stored twice ({out[full][1]!r} and {name!r})"
                )
            out[full] = (file, name)
    return out


def load_weights(
    model: Module,
    directory: str | os.PathLike[str],
    tensors: Tensors | None = None,
    *,
    allow_nonfinite: bool = False,
) -> None:
    """Write the directory's tensors (``read_tensors``, unless given) into ``model`` (see
    the module docstring).

    Checked first: the names (each model path once; missing and unexpected ones are
    listed), shapes, values and the model's ties: the tensors of two tied paths must be
    equal (a tied ``lm_head.weight`` may be absent, as transformers writes it). Values
    are cast to the model's dtype; a value that is NaN or infinite there (a float64
    beyond float32's range too) is refused, naming the file, the tensor and the count,
    unless ``allow_nonfinite`` (``checkpoint.finite``). On any error the model is
    unchanged (C6, C9).
    """
    if tensors is None:
        tensors = read_tensors(directory)
    slots = dict(model.named_slots())
    check_names(directory, model.label(), slots.keys(), tensors, tied_head=tied(model))
    values: dict[str, np.ndarray] = {}
    for path, (file, name) in tensors.items():
        entry, param = file.tensors[name], slots[path]
        if tuple(entry.shape) != param.shape:
            raise CheckpointError(
                f"{file.path}: tensor {name!r} has shape {tuple(entry.shape)}, "
                f"{path!r} needs {param.shape}"
            )
        if not np.issubdtype(np.dtype(entry.dtype), np.floating):
            raise CheckpointError(f"{file.path}: tensor {name!r} has dtype {entry.dtype}")
        what = f"{file.path}: tensor {name!r}"
        values[path] = finite_cast(file.array(name), param.dtype, what, allow_nonfinite)
    for first, others in model.aliases().items():
        for other in others:
            if other in values and not np.array_equal(values[other], values[first], equal_nan=True):
                hint = (
                    " (tie_word_embeddings is true); set it to false to load them untied"
                    if other == HEAD
                    else ", and one storage cannot hold both (C9)"
                )
                raise CheckpointError(
                    f"{directory}: {other!r} differs from {first!r} but the model ties them{hint}"
                )
            values.pop(other, None)
    for path, value in values.items():
        slots[path].storage.commit_host(np.ascontiguousarray(value))


def tied(model: Module) -> bool:
    """Whether ``lm_head.weight`` and ``transformer.wte.weight`` name one storage now."""
    slots = dict(model.named_slots())
    return slots[HEAD].storage is slots[EMBEDDING].storage


def hf_config(model: Module) -> dict[str, Any]:
    """The ``config.json`` of ``model``: the configuration it was loaded from (if any)
    with its architecture keys, dtype and ``architectures`` set from the model."""
    config = dict(getattr(model, "source_config", None) or {})
    config.update({k: model.config[k] for k in CONFIG_KEYS})
    config.update(
        model_type="gpt2",
        architectures=["GPT2LMHeadModel"],
        dtype=model.config["dtype"],
        tie_word_embeddings=tied(model),
    )
    config.pop("torch_dtype", None)
    return config


def save_gpt2(model: Module, directory: str | os.PathLike[str]) -> None:
    """Write ``config.json`` and ``model.safetensors`` (``format: pt`` metadata) into
    ``directory`` (created if needed).

    Each storage is written once under its first path; a tied ``lm_head.weight`` is
    left out, as transformers writes it, and re-tied on load from
    ``tie_word_embeddings``. Any other tie is a ``CheckpointError`` before anything is
    written: transformers' GPT-2 would load the left-out path with fresh random values.
    Both files are written atomically.
    """
    for first, others in model.aliases().items():
        if others == [HEAD]:
            continue
        raise CheckpointError(
            f"{directory}: {model.label()} ties {first!r} and {others[0]!r}, a tie "
            "transformers' GPT-2 cannot express (only lm_head.weight with "
            "transformer.wte.weight); save it with tiegrad.save, or untie them first"
        )
    text = json.dumps(hf_config(model), indent=2, sort_keys=True) + "\n"
    path = Path(directory)
    path.mkdir(parents=True, exist_ok=True)
    tensors = {p: param.storage.current_host_value() for p, param in model.named_parameters()}
    write_safetensors(os.fspath(path / WEIGHTS), tensors, {"format": "pt"})
    tmp = path / f".{CONFIG}.tmp"
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path / CONFIG)
