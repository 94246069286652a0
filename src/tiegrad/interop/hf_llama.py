"""Hugging Face directories of the Llama family in and out, without torch or transformers.

The family (``model_type`` llama, qwen2, qwen3, smollm3, mistral) shares one layout
(``tiegrad.models.LlamaLM``); this module turns a transformers ``config.json`` into that
class's arguments, checks a directory against it before anything is allocated, and
writes a model back in transformers' layout. The tensor files are read with
``tiegrad.interop.hf``'s readers (``model.safetensors`` or a sharded index; bfloat16
and float16 widened to float32).

Configuration (C6: every refusal is one ``ConfigError`` naming the key, raised before
anything is allocated):

- where ``config.json`` is silent, the default of that ``model_type``'s transformers
  class applies (``ARCHITECTURES``): SmolLM3 ties its head, the others do not; Qwen3's
  ``head_dim`` is 128; SmolLM3's ``rope_theta`` is 2000000;
- rotary settings are read in both forms, ``rope_theta`` + ``rope_scaling``
  (transformers 4) and ``rope_parameters`` (transformers 5), ``rope_scaling`` first as
  transformers reads them; ``rope_type`` default, ``linear`` and ``llama3`` are
  implemented, any other (and a ``partial_rotary_factor`` other than 1, which these
  classes do not apply) is refused;
- a sliding window that bites (one narrower than ``max_position_embeddings`` on some
  layer), an activation other than SiLU and attention dropout are refused.

Weights: every tensor's name and header shape is checked against the model's layout,
and its values for NaN and infinity (``checkpoint.finite``), before the model is
built; a tied configuration whose file holds an
``lm_head.weight`` that differs from ``model.embed_tokens.weight`` is refused, naming
the tensor (loading it either way would lose one of them). ``save`` writes
``tie_word_embeddings`` as the storages are (C1): one storage, ``true`` and one tensor;
two, ``false`` and both.

Like ``interop.hf``, the functions take the model class or model as an argument and
import nothing from ``tiegrad.models``.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

import numpy as np

from .. import _checks
from ..checkpoint.fileio import write_safetensors
from ..checkpoint.finite import finite_cast
from ..errors import CheckpointError, ConfigError, HyperparameterError, shown_list
from ..nn.module import Module
from ..ops.rope import ROPE_TYPES
from . import hf

ModelT = TypeVar("ModelT", bound=Module)

EMBEDDING = "model.embed_tokens.weight"
HEAD = hf.HEAD


@dataclasses.dataclass(frozen=True)
class Architecture:
    """What a ``model_type``'s transformers class fixes, and its defaults."""

    #: transformers' class name (``architectures`` in ``config.json``).
    name: str
    #: ``config.json`` defaults of the class (where the file is silent).
    defaults: Mapping[str, Any]
    #: "config": ``attention_bias`` puts biases on q, k, v and o; "qkv": q, k and v
    #: always have one, o never; "none": no attention bias.
    attention_bias: str = "config"
    #: Whether ``mlp_bias`` is a setting of the class (else the MLP has no bias).
    mlp_bias: bool = False
    #: An RMSNorm per head on queries and keys before the rotation (Qwen3).
    qk_norm: bool = False
    #: Whether some layers go without rotation (SmolLM3: ``no_rope_layers``, else every
    #: ``no_rope_layer_interval``-th).
    no_rope: bool = False


_COMMON = {
    "pad_token_id": None,
    "num_key_value_heads": None,
    "head_dim": None,
    "rms_norm_eps": 1e-6,
    "initializer_range": 0.02,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
    "hidden_act": "silu",
    "attention_dropout": 0.0,
    "attention_bias": False,
    "mlp_bias": False,
}

ARCHITECTURES: dict[str, Architecture] = {
    "llama": Architecture(
        "LlamaForCausalLM", {**_COMMON, "max_position_embeddings": 2048}, mlp_bias=True
    ),
    "qwen2": Architecture(
        "Qwen2ForCausalLM",
        {**_COMMON, "num_key_value_heads": 32, "max_position_embeddings": 32768},
        attention_bias="qkv",
    ),
    "qwen3": Architecture(
        "Qwen3ForCausalLM",
        {**_COMMON, "num_key_value_heads": 32, "head_dim": 128, "max_position_embeddings": 32768},
        qk_norm=True,
    ),
    "smollm3": Architecture(
        "SmolLM3ForCausalLM",
        {
            **_COMMON,
            "num_key_value_heads": 4,
            "max_position_embeddings": 32768,
            "rope_theta": 2000000.0,
            "tie_word_embeddings": True,
            "pad_token_id": 128004,
        },
        mlp_bias=True,
        no_rope=True,
    ),
    "mistral": Architecture(
        "MistralForCausalLM",
        {**_COMMON, "num_key_value_heads": 8, "max_position_embeddings": 131072},
        attention_bias="none",
    ),
}
MODEL_TYPES = tuple(ARCHITECTURES)

#: SmolLM3's default ``no_rope_layer_interval``.
NO_ROPE_INTERVAL = 4

#: ``config.json`` keys without a default: the sizes.
_SIZES = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
          "num_attention_heads")  # fmt: skip


@dataclasses.dataclass(frozen=True)
class Variant:
    """The resolved shape of a model of the family (``variant``)."""

    head_dim: int
    kv_heads: int
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    qk_norm: bool
    #: Per layer, whether it rotates its queries and keys.
    rotary: tuple[bool, ...]
    rope: Mapping[str, Any]


def rope_parameters(label: str, value: Any) -> dict[str, Any]:
    """Rotary parameters checked and in transformers 5's form: ``rope_type``,
    ``rope_theta`` and the keys of that type (``ROPE_TYPES``); ``type`` is read as
    ``rope_type``. An unimplemented type, a key this code would ignore (a
    ``partial_rotary_factor`` other than 1 included) and a missing one are each a
    ``ConfigError`` naming it; values out of range a ``HyperparameterError``."""
    if not isinstance(value, Mapping):
        raise ConfigError(f"{label}: expected a mapping of rotary parameters, got {value!r:.80}")
    kind = value.get("rope_type", value.get("type", "default"))
    if not isinstance(kind, str) or kind not in ROPE_TYPES:
        raise ConfigError(
            f"{label}: rope_type {kind!r:.80} is not supported (supported: {', '.join(ROPE_TYPES)})"
        )
    if value.get("partial_rotary_factor", 1.0) != 1.0:
        raise ConfigError(
            f"{label}: partial_rotary_factor {value['partial_rotary_factor']!r:.40} is not "
            "supported (the family's transformers classes rotate whole heads)"
        )
    needed = ROPE_TYPES[kind]
    known = {"rope_type", "type", "rope_theta", "partial_rotary_factor", *needed}
    unknown = sorted(str(k) for k in value if k not in known)
    if unknown:
        raise ConfigError(
            f"{label}: {shown_list(unknown)} not supported for rope_type {kind!r} (it takes "
            f"{', '.join(sorted(known - {'type'}))})"
        )
    missing = [k for k in ("rope_theta", *needed) if value.get(k) is None]
    if missing:
        raise ConfigError(f"{label}: rope_type {kind!r} needs {', '.join(missing)}")
    out: dict[str, Any] = {"rope_type": kind}
    for key in ("rope_theta", *needed):
        check = _checks.size if key == "original_max_position_embeddings" else _checks.positive
        out[key] = check(label, key, value[key])
    if kind == "llama3" and out["high_freq_factor"] <= out["low_freq_factor"]:
        raise HyperparameterError(
            f"{label}: high_freq_factor ({out['high_freq_factor']}) must exceed "
            f"low_freq_factor ({out['low_freq_factor']})"
        )
    return out


def variant(args: Mapping[str, Any]) -> Variant:
    """The resolved shape of the (checked) constructor arguments ``args`` of ``LlamaLM``:
    ``None`` entries take the defaults of the constructor (``LlamaLM``)."""
    arch = ARCHITECTURES[args["model_type"]]
    heads, n = args["num_attention_heads"], args["num_hidden_layers"]
    head_dim = args["head_dim"] or args["hidden_size"] // heads
    bias = args["attention_bias"]
    qkv_bias = {"config": bool(bias), "qkv": True, "none": False}[arch.attention_bias]
    o_bias = arch.attention_bias == "config" and bool(bias)
    rotary = args["no_rope_layers"]
    if rotary is None:
        every = args["no_rope_layer_interval"] if arch.no_rope else None
        rotary = [1 if every is None else int((i + 1) % every != 0) for i in range(n)]
    rope = args["rope_parameters"] or {
        "rope_type": "default",
        "rope_theta": arch.defaults["rope_theta"],
    }
    return Variant(
        head_dim=head_dim,
        kv_heads=args["num_key_value_heads"] or heads,
        qkv_bias=qkv_bias,
        o_bias=o_bias,
        mlp_bias=args["mlp_bias"],
        qk_norm=arch.qk_norm,
        rotary=tuple(bool(r) for r in rotary),
        rope=rope,
    )


def check_variant(label: str, args: Mapping[str, Any]) -> None:
    """The rules between ``LlamaLM``'s (checked) arguments: heads divide, an even head
    width, and settings only where the ``model_type``'s class has them (C6)."""
    arch = ARCHITECTURES[args["model_type"]]
    kind, heads = args["model_type"], args["num_attention_heads"]
    if arch.attention_bias != "config" and args["attention_bias"] is not None:
        fixed = "q, k and v always have biases" if arch.attention_bias == "qkv" else "no biases"
        raise ConfigError(f"{label}: attention_bias is not a setting of {kind} ({fixed})")
    if args["mlp_bias"] and not arch.mlp_bias:
        raise ConfigError(f"{label}: mlp_bias is not a setting of {kind} (its MLP has no bias)")
    nope = args["no_rope_layers"]
    if not arch.no_rope and (
        nope is not None or args["no_rope_layer_interval"] != NO_ROPE_INTERVAL
    ):
        key = "no_rope_layers" if nope is not None else "no_rope_layer_interval"
        raise ConfigError(f"{label}: {key} is not a setting of {kind} (every layer rotates)")
    if nope is not None and len(nope) != args["num_hidden_layers"]:
        raise ConfigError(
            f"{label}: no_rope_layers has {len(nope)} entries, expected one per layer "
            f"(num_hidden_layers={args['num_hidden_layers']})"
        )
    if args["head_dim"] is None and args["hidden_size"] % heads:
        raise ConfigError(
            f"{label}: num_attention_heads={heads} must divide hidden_size="
            f"{args['hidden_size']} (or give head_dim)"
        )
    kv = args["num_key_value_heads"] or heads
    if heads % kv:
        raise ConfigError(
            f"{label}: num_key_value_heads={kv} must divide num_attention_heads={heads}"
        )
    pad = args["pad_token_id"]
    if pad is not None and pad >= args["vocab_size"]:
        raise ConfigError(
            f"{label}: pad_token_id={pad} must be below vocab_size={args['vocab_size']}"
        )
    head_dim = args["head_dim"] or args["hidden_size"] // heads
    if head_dim % 2:
        raise ConfigError(f"{label}: the head width {head_dim} must be even (rotary halves)")


def model_args(config: Mapping[str, Any], where: str) -> dict[str, Any]:
    """``LlamaLM``'s constructor arguments of a transformers ``config.json`` (see the
    module docstring); ``where`` (the file) starts every error."""
    kind = config.get("model_type")
    if not isinstance(kind, str) or kind not in ARCHITECTURES:
        raise ConfigError(
            f"{where}: model_type {kind!r:.80} is not supported by LlamaLM "
            f"(supported: {', '.join(MODEL_TYPES)})"
        )
    arch = ARCHITECTURES[kind]

    def get(key: str) -> Any:
        return config[key] if key in config else arch.defaults[key]

    missing = [k for k in _SIZES if k not in config]
    if missing:
        raise ConfigError(f"{where}: {', '.join(missing)} missing")
    if get("hidden_act") != "silu":
        raise ConfigError(
            f"{where}: hidden_act {get('hidden_act')!r:.40} is not supported (supported: silu)"
        )
    if get("attention_dropout"):
        raise ConfigError(
            f"{where}: attention_dropout {get('attention_dropout')!r:.40} is not supported (only 0)"
        )
    _check_window(config, kind, where)
    args = {k: config[k] for k in _SIZES}
    for key in ("num_key_value_heads", "head_dim", "max_position_embeddings", "rms_norm_eps",
                "initializer_range", "tie_word_embeddings", "pad_token_id"):  # fmt: skip
        args[key] = get(key)
    if arch.attention_bias == "config":
        args["attention_bias"] = get("attention_bias")
    if arch.mlp_bias:
        args["mlp_bias"] = get("mlp_bias")
    if arch.no_rope:
        args["no_rope_layers"] = config.get("no_rope_layers")
        args["no_rope_layer_interval"] = config.get("no_rope_layer_interval", NO_ROPE_INTERVAL)
    args["rope_parameters"] = _rope_of(config, get("rope_theta"), where)
    return dict(args, model_type=kind)


def _rope_of(config: Mapping[str, Any], theta: Any, where: str) -> dict[str, Any]:
    """The rotary parameters of a configuration in either form, checked."""
    raw = config.get("rope_scaling") or config.get("rope_parameters") or {}
    key = "rope_scaling" if config.get("rope_scaling") else "rope_parameters"
    if not isinstance(raw, Mapping):
        raise ConfigError(f"{where}: {key} must be a mapping, got {raw!r:.80}")
    layer_types = config.get("layer_types") or ()
    if any(k in layer_types for k in raw):
        raise ConfigError(f"{where}: {key} per layer type is not supported (one for all layers)")
    rope = dict(raw)
    if rope.get("rope_theta") is None:
        rope["rope_theta"] = theta
    if rope.get("rope_type", rope.get("type")) == "llama3":
        rope.setdefault("original_max_position_embeddings", config.get("max_position_embeddings"))
    if "partial_rotary_factor" in config:
        rope.setdefault("partial_rotary_factor", config["partial_rotary_factor"])
    return rope_parameters(f"{where}: {key}", rope)


def _check_window(config: Mapping[str, Any], kind: str, where: str) -> None:
    """Refuse a sliding window that bites: narrower than ``max_position_embeddings`` on
    a layer that uses it, as the ``model_type``'s transformers class decides."""
    layer_types = config.get("layer_types")
    if layer_types is not None and not isinstance(layer_types, list):
        raise ConfigError(f"{where}: layer_types must be a list, got {layer_types!r:.80}")
    if kind == "mistral":
        window, used = config.get("sliding_window", 4096), True
    elif kind in ("qwen2", "qwen3"):
        window = config.get("sliding_window", 4096)
        n = _checks.size(where, "num_hidden_layers", config["num_hidden_layers"])
        first = _checks.count(where, "max_window_layers", config.get("max_window_layers", 28))
        sliding = "sliding_attention" in layer_types if layer_types else first < n
        used = bool(config.get("use_sliding_window")) and sliding
    elif kind == "smollm3":
        window = config.get("sliding_window")
        sliding = not layer_types or "sliding_attention" in layer_types
        used = bool(config.get("use_sliding_window")) and sliding
    else:
        return
    limit = config.get(
        "max_position_embeddings", ARCHITECTURES[kind].defaults["max_position_embeddings"]
    )
    limit = _checks.size(where, "max_position_embeddings", limit)
    if used and window is not None and _checks.size(where, "sliding_window", window) < limit:
        raise ConfigError(
            f"{where}: sliding_window={window} narrower than max_position_embeddings="
            f"{limit} is not supported (attention over every earlier position only)"
        )


def read_tensors(directory: str | os.PathLike[str]) -> hf.Tensors:
    """``{name: (file, name)}`` of a directory's tensors as the files name them
    (``model.safetensors`` or every shard of its index; ``hf.read_tensors``)."""
    return {name: (file, name) for file, name in hf.read_tensors(directory).values()}


def checked_values(
    directory: str | os.PathLike[str],
    label: str,
    layout: Sequence[tuple[str, tuple[int, ...]]],
    tensors: hf.Tensors,
    tied_head: bool,
    dtype: Any,
    allow_nonfinite: bool = False,
) -> dict[str, np.ndarray]:
    """``{path: value}`` of every storage of ``layout`` (a tied head left out), cast to
    ``dtype``, with everything checked first (C6).

    Refused: tensors whose names are not the layout's (a tied ``lm_head.weight`` may be
    absent; ``hf.check_names`` names a few missing and unexpected ones),
    whose header shape differs from the layout's or whose dtype is not floating, a value
    holding NaN or infinity unless ``allow_nonfinite`` (``checkpoint.finite``), and, for
    a tied head, an ``lm_head.weight`` whose values differ from
    ``model.embed_tokens.weight``.
    """
    hf.check_names(directory, label, [p for p, _ in layout], tensors, tied_head)
    for path, shape in layout:
        if path not in tensors:
            continue
        file, name = tensors[path]
        entry = file.tensors[name]
        if tuple(entry.shape) != shape:
            raise CheckpointError(
                f"{file.path}: tensor {name!r} has shape {tuple(entry.shape)}, {label} "
                f"needs {shape}"
            )
        if not np.issubdtype(np.dtype(entry.dtype), np.floating):
            raise CheckpointError(
                f"{file.path}: tensor {name!r} has dtype {entry.dtype}, expected a float"
            )
    values = {}
    for path, _ in layout:
        if path in tensors:
            file, name = tensors[path]
            what = f"{file.path}: tensor {name!r}"
            values[path] = finite_cast(file.array(name), dtype, what, allow_nonfinite)
    if tied_head and HEAD in values:
        if not np.array_equal(values.pop(HEAD), values[EMBEDDING], equal_nan=True):
            raise CheckpointError(
                f"{directory}: tensor {HEAD!r} differs from {EMBEDDING!r}, but "
                "tie_word_embeddings is true (one storage cannot hold both); set it to "
                "false in config.json to load them untied"
            )
    return values


def load(
    cls: type[ModelT],
    directory: str | os.PathLike[str],
    dtype: Any = "float32",
    allow_nonfinite: bool = False,
) -> ModelT:
    """A model of class ``cls`` (``LlamaLM``) built from the directory's ``config.json``,
    its weights loaded (see the module docstring). Everything is checked before the model
    is allocated: the configuration (``ConfigError`` naming the key), then the sizes it
    implies against those the safetensors headers hold (``hf.check_sizes``, by arithmetic:
    a configuration of a million layers builds no layout), then the tensors
    (``checked_values``: ``CheckpointError`` naming the tensor)."""
    config = hf.folder_config(directory)
    where = os.fspath(Path(directory) / hf.CONFIG)
    try:
        args = model_args(config, where)
    except HyperparameterError as e:  # a value out of range, named with the file
        raise ConfigError(str(e)) from None
    try:
        args = cls.check_config(dict(args, dtype=dtype))
    except (ConfigError, HyperparameterError) as e:  # check_config's verdicts
        raise ConfigError(f"{where}: {e}") from None
    tensors = read_tensors(directory)
    hf.check_sizes(cls, where, args, {p: f.tensors[n].shape for p, (f, n) in tensors.items()})
    label = f"the {cls.__name__} of its {hf.CONFIG}"
    tied_head = bool(args["tie_word_embeddings"])
    values = checked_values(
        directory, label, cls.layout(args), tensors, tied_head, np.dtype(args["dtype"]),
        allow_nonfinite,
    )  # fmt: skip
    model = cls(**args)
    model.source_config = config
    slots = dict(model.named_slots())
    for path, value in values.items():
        slots[path].storage.commit_host(np.ascontiguousarray(value))
    return model


def tied(model: Module) -> bool:
    """Whether ``lm_head.weight`` and ``model.embed_tokens.weight`` name one storage now."""
    slots = dict(model.named_slots())
    return slots[HEAD].storage is slots[EMBEDDING].storage


def hf_config(model: Module) -> dict[str, Any]:
    """The ``config.json`` of ``model``: the configuration it was loaded from (if any)
    with its architecture keys, rotary settings (both forms), dtype, ``architectures``
    and ``tie_word_embeddings`` (from the storages) set from the model."""
    args = model.config
    arch = ARCHITECTURES[args["model_type"]]
    v = variant(args)
    config = dict(getattr(model, "source_config", None) or {})
    for key in ("torch_dtype", "rope_scaling", "rope_theta", "rope_parameters"):
        config.pop(key, None)
    config.update({k: args[k] for k in _SIZES})
    config.update(
        model_type=args["model_type"],
        architectures=[arch.name],
        num_key_value_heads=v.kv_heads,
        head_dim=v.head_dim,
        max_position_embeddings=args["max_position_embeddings"],
        rms_norm_eps=args["rms_norm_eps"],
        initializer_range=args["initializer_range"],
        hidden_act="silu",
        rope_parameters=dict(v.rope),
        rope_theta=v.rope["rope_theta"],
        dtype=args["dtype"],
        tie_word_embeddings=tied(model),
        pad_token_id=args["pad_token_id"],
    )
    if v.rope["rope_type"] != "default":
        config["rope_scaling"] = {k: x for k, x in v.rope.items() if k != "rope_theta"}
    if arch.attention_bias == "config":
        config["attention_bias"] = v.qkv_bias
    if arch.mlp_bias:
        config["mlp_bias"] = v.mlp_bias
    if arch.no_rope:
        config["no_rope_layers"] = [int(r) for r in v.rotary]
    return config


def save(model: Module, directory: str | os.PathLike[str]) -> None:
    """Write ``config.json`` (``hf_config``) and ``model.safetensors`` (``format: pt``
    metadata) into ``directory`` (created if needed), both atomically.

    Each storage is written once under its first path: a tied ``lm_head.weight`` is
    left out, as transformers writes it, and ``tie_word_embeddings`` is true. Any other
    tie is a ``CheckpointError`` before anything is written: transformers would load the
    left-out path with fresh random values.
    """
    for first, others in model.aliases().items():
        if first == EMBEDDING and others == [HEAD]:
            continue
        raise CheckpointError(
            f"{directory}: {model.label()} ties {first!r} and {others[0]!r}, a tie "
            f"transformers cannot express (only {HEAD} with {EMBEDDING}); save it with "
            "tiegrad.save, or untie them first"
        )
    text = json.dumps(hf_config(model), indent=2, sort_keys=True) + "\n"
    path = Path(directory)
    path.mkdir(parents=True, exist_ok=True)
    tensors = {p: param.storage.current_host_value() for p, param in model.named_parameters()}
    write_safetensors(os.fspath(path / hf.WEIGHTS), tensors, {"format": "pt"})
    tmp = path / f".{hf.CONFIG}.tmp"
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path / hf.CONFIG)
