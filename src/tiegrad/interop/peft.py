"""PEFT's LoRA files in and out: ``adapter_model.safetensors`` and ``adapter_config.json``.

What PEFT's ``save_pretrained`` writes, without torch, transformers or peft: one tensor
per factor, ``base_model.model.<module path>.lora_A.weight`` and ``.lora_B.weight`` for
a ``Linear`` or GPT-2 ``Conv1D`` (``.lora_embedding_A`` and ``.lora_embedding_B`` for
an ``Embedding``), A (r, in) and B (out, r) in the terms of that use, as PEFT holds
them (its ``fan_in_fan_out`` concerns merging only); and a ``LoraConfig``: ``r``,
``lora_alpha``, ``lora_dropout``, ``target_modules`` (the adapted module paths),
``fan_in_fan_out`` (true with a ``Conv1D``, as PEFT sets it for GPT-2) and
``rank_pattern``/``alpha_pattern`` for the layers that differ. The module paths are the
model's: a ``GPT2``'s are transformers' ``GPT2LMHeadModel``'s, so
``PeftModel.from_pretrained(GPT2LMHeadModel.from_pretrained(base), directory)``
computes what the tiegrad model computes.

An adapter shared by tied uses (``share_tied``) is written once per use, the transposed
factors under the other use's names, which is how PEFT's models hold it; the metadata
key ``tiegrad.shared`` lists the groups, so that ``load_adapter`` shares it again, and
the configuration sets ``ensure_weight_tying``, so that PEFT ties the uses' adapters
too (one adapter, as in tiegrad) instead of loading two equal ones. A file PEFT saved
with ``ensure_weight_tying`` names only the embedding among ``target_modules`` and holds
the factors of both uses; it loads as the model that saved it computed: one adapter
shared by every adaptable use of a targeted storage (PEFT 0.21's own reload of such a
GPT-2 file adapts the embedding alone, as ``wte`` is not among its embedding names).

``load_adapter`` checks everything before it changes anything (C6): the configuration
(a LoRA computing nothing tiegrad does not: no DoRA, rsLoRA, trained bias,
``modules_to_save``, ...), every tensor name (a module path of an adaptable layer
among ``target_modules``, or with ``ensure_weight_tying`` one storage with such a
layer's weight; both factors present), every shape against the model's weight, the
rank against the configuration; a ``base_layer.weight`` (which PEFT writes with an
embedding target) must equal the model's weight; the uses sharing an adapter must hold
one adapter's factors and alpha, and with ``ensure_weight_tying`` every adaptable use of
a targeted storage must have its factors in the file (and ``tiegrad.shared``, where
present, must group the same uses). The first mismatch is a ``CheckpointError`` naming
the file and the tensor, the expected and the actual value.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import numpy as np

from .._checks import decay_rate, positive, size
from ..adapters.layers import LoRA, fans, layout_of
from ..adapters.lora import (
    AdapterSpec,
    Layer,
    active_adapter,
    adaptable_layers,
    adapted_layers,
    attach,
    check_model,
    check_name,
    matches,
)
from ..checkpoint.fileio import (
    SafetensorsFile,
    parse_json,
    read_json,
    read_safetensors,
    write_safetensors,
)
from ..errors import CheckpointError, HyperparameterError, SlotError
from ..models.gpt2 import Conv1D
from ..nn.layers import Embedding
from ..nn.module import Module

__all__ = ["load_adapter", "save_adapter"]

CONFIG = "adapter_config.json"
WEIGHTS = "adapter_model.safetensors"
PREFIX = "base_model.model."
SHARED = "tiegrad.shared"
BASE_WEIGHT = ".base_layer.weight"
#: Tensor name suffixes: (embedding use, factor).
FACTORS = {
    ".lora_A.weight": (False, "A"),
    ".lora_B.weight": (False, "B"),
    ".lora_embedding_A": (True, "A"),
    ".lora_embedding_B": (True, "B"),
}
#: ``LoraConfig`` keys whose set values change what PEFT computes in ways tiegrad does not.
UNSUPPORTED = (
    "use_dora",
    "use_rslora",
    "lora_bias",
    "use_qalora",
    "use_bdlora",
    "alora_invocation_tokens",
    "arrow_config",
    "velora_config",
    "kasa_config",
    "monteclora_config",
    "modules_to_save",
    "trainable_token_indices",
    "target_parameters",
    "layer_replication",
)


def _names(layer: Layer) -> tuple[str, str]:
    """The tensor names of ``layer``'s factors A and B."""
    embedding = isinstance(layer.module, Embedding)
    a, b = (k for k, (e, _) in FACTORS.items() if e == embedding)
    return PREFIX + layer.paths[0] + a, PREFIX + layer.paths[0] + b


def use_factors(layer: Layer, adapter: LoRA) -> tuple[np.ndarray, np.ndarray]:
    """``adapter``'s A and B in the terms of ``layer``'s use (transposed for a use of the
    other layout than its owner's)."""
    a, b = adapter.A.value_synced(), adapter.B.value_synced()
    return (a, b) if adapter.layout == layout_of(layer.module) else (b.T, a.T)


def _one_path(layer: Layer, where: str) -> None:
    if len(layer.paths) > 1:
        raise CheckpointError(
            f"{where}: {layer.paths[0]!r} and {layer.paths[1]!r} are one layer; PEFT's "
            "format names each module once"
        )


def save_adapter(
    model: Module,
    directory: str | os.PathLike[str],
    name: str | None = None,
    *,
    base_model_name_or_path: str | None = None,
) -> list[str]:
    """Write adapter ``name`` (None: the active one) of ``model`` as PEFT writes it.

    ``directory`` is created if needed; both files are written atomically. Returns the
    adapted module paths (``target_modules``). ``base_model_name_or_path`` goes into
    the configuration as given.
    """
    where = f"{Path(directory) / WEIGHTS}"
    check_model(model, "save_adapter")
    name = active_adapter(model) if name is None else name
    holders = [
        (layer, layer.adapters.get(name))
        for layer in adapted_layers(model)
        if name in layer.adapters.names()
    ]
    if not holders:
        which = "adapters" if name is None else f"adapter {name!r}"
        raise SlotError(f"save_adapter: {model.label()} has no {which} (add_lora or load_adapter)")
    tensors: dict[str, np.ndarray] = {}
    groups: dict[int, list[str]] = {}
    for layer, adapter in holders:
        _one_path(layer, where)
        for key, value in zip(_names(layer), use_factors(layer, adapter)):
            tensors[key] = np.ascontiguousarray(value)
        groups.setdefault(id(adapter), []).append(layer.paths[0])
    targets = [layer.paths[0] for layer, _ in holders]
    first = holders[0][1]
    config = {
        "peft_type": "LORA",
        "task_type": None,
        "base_model_name_or_path": base_model_name_or_path,
        "r": first.rank,
        "lora_alpha": first.alpha,
        "lora_dropout": first.dropout,
        "target_modules": targets,
        "fan_in_fan_out": any(isinstance(x.module, Conv1D) for x, _ in holders),
        "bias": "none",
        "rank_pattern": {x.paths[0]: a.rank for x, a in holders if a.rank != first.rank},
        "alpha_pattern": {x.paths[0]: a.alpha for x, a in holders if a.alpha != first.alpha},
        "init_lora_weights": True,
        "inference_mode": True,
        "modules_to_save": None,
        "use_dora": False,
        "use_rslora": False,
    }
    shared = [paths for paths in groups.values() if len(paths) > 1]
    config["ensure_weight_tying"] = bool(shared)
    metadata = {"format": "pt"} | ({SHARED: json.dumps(shared)} if shared else {})
    folder = Path(directory)
    folder.mkdir(parents=True, exist_ok=True)
    write_safetensors(os.fspath(folder / WEIGHTS), tensors, metadata)
    tmp = folder / f".{CONFIG}.tmp"
    tmp.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    os.replace(tmp, folder / CONFIG)
    return targets


def read_config(directory: str | os.PathLike[str]) -> dict[str, Any]:
    """The ``adapter_config.json`` of ``directory``, checked to be a LoRA tiegrad computes."""
    path = Path(directory) / CONFIG
    if not path.is_file():
        raise CheckpointError(f"{directory}: no {CONFIG} (not a PEFT adapter directory)")
    try:
        config = read_json(path)
    except OSError as e:
        raise CheckpointError(f"{path}: cannot read: {e}") from None
    if config.get("peft_type") != "LORA":
        raise CheckpointError(f"{path}: peft_type {config.get('peft_type')!r}, expected 'LORA'")
    for key in UNSUPPORTED:
        value = config.get(key)
        if value not in (None, False) and value != [] and value != {}:
            raise CheckpointError(f"{path}: {key}={value!r:.80} is not supported by tiegrad")
    tying = config.get("ensure_weight_tying")
    if tying not in (None, False, True):
        raise CheckpointError(
            f"{path}: ensure_weight_tying must be true or false, got {tying!r:.80}"
        )
    config["ensure_weight_tying"] = bool(tying)  # unset (null) is false, as in PEFT
    if config.get("bias", "none") != "none":
        raise CheckpointError(f"{path}: bias={config['bias']!r} is not supported (only 'none')")
    targets = config.get("target_modules")
    if not isinstance(targets, list) or not targets or not all(isinstance(t, str) for t in targets):
        raise CheckpointError(
            f"{path}: target_modules must be a list of module names, got {targets!r:.80} "
            "(a regular expression is not read)"
        )
    try:
        size(f"{path}", "r", config.get("r"))
        positive(f"{path}", "lora_alpha", config.get("lora_alpha"))
        decay_rate(f"{path}", "lora_dropout", config.get("lora_dropout", 0.0))
        for key, check in (("rank_pattern", size), ("alpha_pattern", positive)):
            pattern = config.get(key) or {}
            if not isinstance(pattern, dict):
                raise CheckpointError(f"{path}: {key} must be an object, got {pattern!r:.80}")
            for k, v in pattern.items():
                check(f"{path}", f"{key}[{k!r}]", v)
    except HyperparameterError as e:
        raise CheckpointError(str(e)) from None
    return config


def _pattern_value(config: dict[str, Any], key: str, default: str, path: str) -> Any:
    """PEFT's per-module value: the first key of ``config[key]`` naming ``path`` whole or
    as a dotted suffix, else ``config[default]``."""
    for k, v in (config.get(key) or {}).items():
        if path == k or path.endswith("." + k):
            return v
    return config[default]


def load_adapter(
    model: Module, directory: str | os.PathLike[str], name: str = "default"
) -> list[str]:
    """Attach the PEFT adapter in ``directory`` to ``model`` as adapter ``name``.

    Everything is checked first (see the module docstring); then it is attached as
    ``tiegrad.adapters.add_lora`` attaches (trainability, the active adapter). Returns
    the adapted weight paths.
    """
    check_name(model, name, "load_adapter")
    config = read_config(directory)
    file = read_safetensors(os.fspath(Path(directory) / WEIGHTS))
    where = file.path
    layers = {p: layer for layer in adaptable_layers(model) for p in layer.paths}
    for target in config["target_modules"]:
        if not any(matches(target, p) for p in layers):
            raise CheckpointError(
                f"{where}: target module {target!r} names no adaptable layer of {model.label()}"
            )
    factors = _read_factors(file, config, layers, model)
    groups = _shared_groups(file, factors, layers, config)
    dropout = float(config.get("lora_dropout", 0.0))
    specs = []
    for group in groups:
        a, b = factors[group[0]]
        alphas = {p: _pattern_value(config, "alpha_pattern", "lora_alpha", p) for p in group}
        if len(set(alphas.values())) > 1:
            raise CheckpointError(
                f"{where}: {' and '.join(map(repr, group))} share one adapter, but "
                f"alpha_pattern gives them alphas {list(alphas.values())} (one adapter has one)"
            )
        alpha = float(alphas[group[0]])
        specs.append(AdapterSpec(tuple(layers[p] for p in group), a, b, alpha, dropout))
    return attach(model, name, specs)


def _read_factors(
    file: SafetensorsFile, config: dict[str, Any], layers: dict[str, Layer], model: Module
) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """``{module path: (A, B)}`` in the model's slot order, in the terms of each use,
    cast to the weight's dtype; every name, shape and base weight checked."""
    where = file.path
    targeted = _targeted_paths(config, layers)
    found: dict[str, dict[str, str]] = {}
    for key in file.tensors:
        rest = key[len(PREFIX) :] if key.startswith(PREFIX) else None
        match = None if rest is None else next((s for s in FACTORS if rest.endswith(s)), None)
        if rest is not None and rest.endswith(BASE_WEIGHT):
            _check_base(file, key, rest[: -len(BASE_WEIGHT)], layers)
            continue
        if match is None:
            raise CheckpointError(
                f"{where}: unexpected tensor {key!r} (expected {PREFIX}<module path> with one "
                f"of {', '.join(FACTORS)})"
            )
        path = rest[: -len(match)]
        layer = layers.get(path)
        if layer is None:
            raise CheckpointError(
                f"{where}: tensor {key!r} names {path!r}, which is not an adaptable layer of "
                f"{model.label()}"
            )
        _one_path(layer, where)
        embedding, factor = FACTORS[match]
        if embedding != isinstance(layer.module, Embedding):
            raise CheckpointError(
                f"{where}: tensor {key!r} is a factor of an {'' if embedding else 'non-'}"
                f"embedding, but {path!r} is a {type(layer.module).__name__}"
            )
        if path not in targeted:
            tied = (
                " nor one storage with one in this model" if config["ensure_weight_tying"] else ""
            )
            raise CheckpointError(
                f"{where}: tensor {key!r} names {path!r}, not a target_module{tied}"
            )
        found.setdefault(path, {})[factor] = key
    out = {}
    for path in (p for p in layers if p in found):
        keys, layer = found[path], layers[path]
        for factor, key in zip("AB", _names(layer)):
            if factor not in keys:
                raise CheckpointError(f"{where}: {key!r} is missing")
        fan_in, fan_out = fans(layer.module)
        rank = int(_pattern_value(config, "rank_pattern", "r", path))
        for factor, shape in (("A", (rank, fan_in)), ("B", (fan_out, rank))):
            entry = file.tensors[keys[factor]]
            if tuple(entry.shape) != shape:
                raise CheckpointError(
                    f"{where}: tensor {keys[factor]!r} has shape {tuple(entry.shape)}, "
                    f"{path!r} (rank {rank}) needs {shape}"
                )
            if not np.issubdtype(np.dtype(entry.dtype), np.floating):
                raise CheckpointError(f"{where}: tensor {keys[factor]!r} has dtype {entry.dtype}")
        dtype = layer.module.weight.dtype
        out[path] = tuple(file.array(keys[f]).astype(dtype, copy=False) for f in "AB")
    if not out:
        raise CheckpointError(f"{where}: holds no LoRA factors")
    return out


def _targeted_paths(config: dict[str, Any], layers: dict[str, Layer]) -> set[str]:
    """The module paths among ``target_modules`` and, with ``ensure_weight_tying``, those
    whose weight is one storage with one of theirs (PEFT adapts the uses tied to a
    target and names only the target)."""
    named = {p for p in layers if any(matches(t, p) for t in config["target_modules"])}
    if not config["ensure_weight_tying"]:
        return named
    storages = {id(layers[p].module.weight.storage) for p in named}
    return {p for p, layer in layers.items() if id(layer.module.weight.storage) in storages}


def _check_base(file: SafetensorsFile, key: str, path: str, layers: dict[str, Layer]) -> None:
    """A base weight in the file must be the model's own (PEFT writes it with embeddings)."""
    layer = layers.get(path)
    if layer is None:
        raise CheckpointError(f"{file.path}: tensor {key!r} names no adaptable layer {path!r}")
    weight = layer.module.weight
    entry = file.tensors[key]
    same = tuple(entry.shape) == weight.shape and np.array_equal(
        file.array(key).astype(weight.dtype, copy=False), weight.value_synced()
    )
    if not same:
        raise CheckpointError(
            f"{file.path}: tensor {key!r} differs from the model's {path}.weight; load the "
            "base model the adapter was trained on"
        )


def _shared_groups(
    file: SafetensorsFile,
    factors: dict[str, tuple[np.ndarray, np.ndarray]],
    layers: dict[str, Layer],
    config: dict[str, Any],
) -> list[list[str]]:
    """The module paths that share one adapter, singletons for the others, in slot order:
    the groups of ``tiegrad.shared``, and with ``ensure_weight_tying`` the adaptable uses
    of each targeted storage, all of which must be in ``factors`` (the two must agree
    where both are given). The factors of a group must be one adapter's."""
    where = file.path
    raw = file.metadata.get(SHARED)
    shared: list[list[str]] = []
    if raw is not None:
        shared = parse_json(raw, f"{where}: metadata {SHARED}", list)
        if not all(
            isinstance(g, list) and len(g) > 1 and all(p in factors for p in g) for g in shared
        ):
            raise CheckpointError(f"{where}: metadata {SHARED} must list groups of its modules")
    if config["ensure_weight_tying"]:
        tied = _tied_groups(where, factors, layers)
        if raw is not None and sorted(map(sorted, shared)) != sorted(map(sorted, tied)):
            raise CheckpointError(
                f"{where}: metadata {SHARED} groups {shared}, but ensure_weight_tying ties {tied}"
            )
        shared = tied
    grouped = {p for g in shared for p in g}
    groups = {g[0]: [p for p in factors if p in g] for g in shared}
    groups.update({p: [p] for p in factors if p not in grouped})
    out = sorted(groups.values(), key=lambda g: list(factors).index(g[0]))
    for group in out:
        owner = layers[group[0]]
        a, b = factors[group[0]]
        for path in group[1:]:
            layer = layers[path]
            if layer.module.weight.storage is not owner.module.weight.storage:
                raise CheckpointError(
                    f"{where}: {SHARED} groups {group[0]!r} and {path!r}, whose weights are "
                    "not one storage in the model"
                )
            same = layout_of(layer.module) == layout_of(owner.module)
            expected = (a, b) if same else (b.T, a.T)
            if not all(np.array_equal(x, y) for x, y in zip(factors[path], expected)):
                why = "ensure_weight_tying" if config["ensure_weight_tying"] else SHARED
                raise CheckpointError(
                    f"{where}: {why} groups {group[0]!r} and {path!r}, whose factors "
                    "are not one adapter's"
                )
    return out


def _tied_groups(
    where: str, factors: dict[str, tuple[np.ndarray, np.ndarray]], layers: dict[str, Layer]
) -> list[list[str]]:
    """With ``ensure_weight_tying``: the adaptable uses of each storage that ``factors``
    adapts at more than one use, in slot order; each such use must have its factors."""
    groups: dict[int, list[str]] = {}
    for p, layer in layers.items():
        if p == layer.paths[0]:  # a layer once, however many paths reach it
            groups.setdefault(id(layer.module.weight.storage), []).append(p)
    out = []
    for paths in groups.values():
        held = [p for p in paths if p in factors]
        if len(paths) < 2 or not held:
            continue
        missing = [p for p in paths if p not in factors]
        if missing:
            raise CheckpointError(
                f"{where}: ensure_weight_tying ties {missing[0]!r} to {held[0]!r} (one storage "
                f"in the model), but the file holds no factors of {missing[0]!r}"
            )
        out.append(paths)
    return out
