"""PEFT's LoRA files in and out: ``adapter_model.safetensors`` and ``adapter_config.json``.

What PEFT's ``save_pretrained`` writes, without torch, transformers or peft: one tensor
per factor, ``base_model.model.<module path>.lora_A.weight`` and ``.lora_B.weight`` for
a ``Linear`` or GPT-2 ``Conv1D`` (``.lora_embedding_A`` and ``.lora_embedding_B`` for
an ``Embedding``), A (r, in) and B (out, r) in the terms of that use, as PEFT holds
them (its ``fan_in_fan_out`` concerns merging only); and a ``LoraConfig``: ``r``,
``lora_alpha``, ``lora_dropout``, ``use_rslora``, ``target_modules`` (the adapted
module paths), ``fan_in_fan_out`` (true with a ``Conv1D``, as PEFT sets it for GPT-2) and
``rank_pattern``/``alpha_pattern`` (whole paths) for the layers that differ. The module
paths are the model's: a ``GPT2``'s are transformers' ``GPT2LMHeadModel``'s, so
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

Every ``LoraConfig`` field that changes the arithmetic is computed as PEFT computes it
or refused by name. Computed: ``r``, ``lora_alpha`` and ``lora_dropout``;
``rank_pattern`` and ``alpha_pattern``, whose keys are regular expressions matching a
module path whole or after a dot, the first matching key winning (PEFT's
``get_pattern_key``); which modules are adapted (PEFT's ``check_target_module_exists``):
``target_modules`` (a regular expression matching the whole path, or names matching it
whole or as a dotted suffix), ``exclude_modules`` (the same two forms, applied first),
``layers_to_transform`` and ``layers_pattern`` (a name matching a suffix only, in those
layers); ``use_rslora`` (scaling ``alpha / sqrt(r)``, written back by ``save_adapter``);
``fan_in_fan_out``, true or false: PEFT sets it by the layer (true for a ``Conv1D``, false
for a ``Linear``, unread by an ``Embedding``'s forward), so the file's value changes
nothing. ``init_lora_weights`` may be any initialisation that leaves the base as it was
(true, false, gaussian, orthogonal, nora, eva); those that change the base (PiSSA, OLoRA,
CorDA, Astra, LoRA-GA, LoftQ) are refused with how to get a plain LoRA file, MiCA (B
frozen while training) too. ``modules_to_save``: see below. Refused when set: the
``UNSUPPORTED`` keys (DoRA, a trained bias, ``target_parameters``, ...), a ``bias`` other than
``"none"``, and any key that is not PEFT 0.22's (``KNOWN``). The flags take true, false
or null (false) only.

``load_adapter`` checks everything before it changes anything (C6): the configuration
(above), every tensor name (a module path of an adaptable layer PEFT adapts under the
configuration, or with ``ensure_weight_tying`` one storage with such a layer's weight;
both factors present; a file with factors of a module PEFT would not adapt is refused,
where PEFT drops them with a warning, or raises with ``strict_adapter_check="error"``),
every shape against the model's weight, the rank against the configuration; a
``base_layer.weight`` (which PEFT writes with an embedding target) must equal the
model's weight; the uses sharing an adapter must hold one adapter's factors and alpha,
and with ``ensure_weight_tying`` every adaptable use of a targeted storage must have its
factors in the file (and ``tiegrad.shared``, where present, must group the same uses).
The first mismatch is a ``CheckpointError`` naming the file and the tensor, the expected
and the actual value.

``modules_to_save`` (modules PEFT trains in full beside the adapters) are written and
read in PEFT's layout: each parameter of such a module under ``base_model.model.<its
path>``. Names match module paths as PEFT matches them (whole, or as a dotted suffix).
A tied embedding is one storage: with ``ensure_weight_tying`` every use of a saved
storage is saved (PEFT writes the same value under each use's name, the embedding named
in ``modules_to_save``), and the file's copies must be equal; they load into the one
storage, which stays tied and trains through every use (C1, C4). Without
``ensure_weight_tying`` PEFT trains a copy of the named module alone, so the named uses
get a storage of their own with the file's value and the other uses keep the base (the
untie PEFT makes, said by the file). The loaded values replace the model's: they are
the adapter's state, not kept apart from the base as PEFT keeps them (``disable`` and
``unload`` leave them), so a model that has adapters already is refused.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Collection, Sequence
from dataclasses import dataclass
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
    prefixes,
)
from ..checkpoint.fileio import (
    SafetensorsFile,
    parse_json,
    read_json,
    read_safetensors,
    write_safetensors,
)
from ..checkpoint.finite import finite_cast
from ..errors import CheckpointError, HyperparameterError, SlotError, TiegradError, shown_list
from ..models.gpt2 import Conv1D
from ..nn.layers import Embedding
from ..nn.module import Module
from ..params import Param, ParameterStorage
from ..params.rows import checked_rows

__all__ = ["load_adapter", "load_trainable_tokens", "save_adapter", "save_trainable_tokens"]

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
    "lora_bias",
    "use_qalora",
    "use_bdlora",
    "alora_invocation_tokens",
    "arrow_config",
    "velora_config",
    "kasa_config",
    "monteclora_config",
    "trainable_token_indices",
    "target_parameters",
    "layer_replication",
    "megatron_config",
)
#: The other keys of PEFT's ``LoraConfig`` (0.22): read by ``load_adapter``, or changing
#: nothing it computes (bookkeeping; the settings of an initialisation or a variant that
#: ``init_lora_weights``, ``use_qalora`` or ``megatron_config`` would have to name, which
#: PEFT ignores otherwise). A key outside both lists is refused when set: it may be a
#: newer PEFT's, changing the arithmetic in a way tiegrad cannot know.
KNOWN = (
    "peft_type",
    "task_type",
    "auto_mapping",
    "peft_version",
    "base_model_name_or_path",
    "revision",
    "inference_mode",
    "r",
    "lora_alpha",
    "lora_dropout",
    "target_modules",
    "exclude_modules",
    "layers_to_transform",
    "layers_pattern",
    "rank_pattern",
    "alpha_pattern",
    "fan_in_fan_out",
    "use_rslora",
    "bias",
    "init_lora_weights",
    "ensure_weight_tying",
    "modules_to_save",
    "loftq_config",
    "eva_config",
    "corda_config",
    "astra_config",
    "lora_ga_config",
    "qalora_group_size",
    "megatron_core",
)
#: ``init_lora_weights`` values after which PEFT's factors apply to the base as it was:
#: only the initial factors differ (``"eva"`` sets its ranks through ``rank_pattern``).
PLAIN_INITS = ("gaussian", "orthogonal", "nora", "eva")
#: ``init_lora_weights`` prefixes whose initialisation changes the base weight: PiSSA,
#: OLoRA, CorDA, Astra and LoRA-GA subtract their initial factors from it, LoftQ
#: quantises it. Their factors are a correction of that changed base, not of this one.
BASE_CHANGING = ("pissa", "olora", "corda", "astra", "lora_ga", "loftq")


def _names(layer: Layer) -> tuple[str, str]:
    """The tensor names of ``layer``'s factors A and B."""
    embedding = isinstance(layer.module, Embedding)
    a, b = (k for k, (e, _) in FACTORS.items() if e == embedding)
    return PREFIX + layer.paths[0] + a, PREFIX + layer.paths[0] + b


def use_factors(layer: Layer, adapter: LoRA) -> tuple[np.ndarray, np.ndarray]:
    """``adapter``'s A and B in the terms of ``layer``'s use (transposed for a use of the
    other layout than its home layer's)."""
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
    modules_to_save: Sequence[str] = (),
) -> list[str]:
    """Write adapter ``name`` (None: the active one) of ``model`` as PEFT writes it.

    ``directory`` is created if needed; both files are written atomically. Returns the
    adapted module paths (``target_modules``). ``base_model_name_or_path`` goes into
    the configuration as given. ``modules_to_save``: module paths whose parameters are
    written in full beside the adapter (every use of a tied storage among them, with
    ``ensure_weight_tying``; see the module docstring).
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
    saved, saved_modules, tied_saved = _full_copies_to_write(model, modules_to_save, holders)
    tensors.update(saved)
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
        "modules_to_save": saved_modules or None,
        "use_dora": False,
        "use_rslora": first.rslora,
    }
    shared = [paths for paths in groups.values() if len(paths) > 1]
    config["ensure_weight_tying"] = bool(shared) or tied_saved
    metadata = {"format": "pt"} | ({SHARED: json.dumps(shared)} if shared else {})
    folder = Path(directory)
    folder.mkdir(parents=True, exist_ok=True)
    write_safetensors(os.fspath(folder / WEIGHTS), tensors, metadata)
    tmp = folder / f".{CONFIG}.tmp"
    tmp.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    os.replace(tmp, folder / CONFIG)
    return targets


def _plain_slots(model: Module) -> dict[str, Param]:
    """The model's parameter paths and handles, its adapters' left out."""
    return {p: h for p, h in model.named_slots() if ".lora." not in f".{p}"}


def _storage_uses(slots: dict[str, Param]) -> dict[int, list[str]]:
    """``{id(storage): its paths in slot order}``."""
    uses: dict[int, list[str]] = {}
    for p, h in slots.items():
        uses.setdefault(id(h.storage), []).append(p)
    return uses


def _full_copies_to_write(
    model: Module, modules: Sequence[str], holders: list[tuple[Layer, LoRA]]
) -> tuple[dict[str, np.ndarray], list[str], bool]:
    """The ``modules_to_save`` tensors of ``save_adapter`` by PEFT's names, the module
    names for its configuration (the module of each saved storage's first use: the
    embedding of a tied pair, as PEFT names it) and whether a saved storage is tied
    (then every use of it is written). A path that is no module of
    ``model`` with parameters, or a saved storage that also has an adapter, is a
    ``SlotError``."""
    if isinstance(modules, str) or not all(isinstance(m, str) and m for m in modules):
        raise SlotError(
            f"save_adapter: modules_to_save must be a list of module paths, got {modules!r:.80}"
        )
    slots = _plain_slots(model)
    uses = _storage_uses(slots)
    chosen: dict[str, None] = {}
    for module in modules:
        under = [p for p in slots if p.startswith(f"{module}.")]
        if not under:
            raise SlotError(
                f"save_adapter: modules_to_save {module!r} is no module with parameters of "
                f"{model.label()}"
            )
        for p in under:
            chosen.update(dict.fromkeys(uses[id(slots[p].storage)]))
    adapted = {id(x.module.weight.storage): x.paths[0] for x, _ in holders}
    for p in chosen:
        if id(slots[p].storage) in adapted:
            raise SlotError(
                f"save_adapter: {p!r} is in modules_to_save and its storage has an adapter "
                f"(at {adapted[id(slots[p].storage)]!r}); PEFT trains a module either way, "
                "not both"
            )
    tied = any(len(uses[id(slots[p].storage)]) > 1 for p in chosen)
    values = {PREFIX + p: np.ascontiguousarray(slots[p].value_synced()) for p in chosen}
    firsts = {uses[id(slots[p].storage)][0] for p in chosen}
    names = list(dict.fromkeys(p.rpartition(".")[0] for p in chosen if p in firsts))
    return values, names, tied


def read_config(directory: str | os.PathLike[str]) -> dict[str, Any]:
    """The ``adapter_config.json`` of ``directory``, checked to be a LoRA tiegrad computes."""
    path = Path(directory) / CONFIG
    if not os.path.lexists(path):
        raise CheckpointError(f"{directory}: no {CONFIG} (not a PEFT adapter directory)")
    config = read_json(path)
    if config.get("peft_type") != "LORA":
        raise CheckpointError(f"{path}: peft_type {config.get('peft_type')!r}, expected 'LORA'")
    for key, value in config.items():
        if key in UNSUPPORTED and not _unset(value):
            raise CheckpointError(f"{path}: {key}={value!r:.80} is not supported by tiegrad")
        if key not in KNOWN and key not in UNSUPPORTED and not _unset(value):
            raise CheckpointError(
                f"{path}: {key}={value!r:.80} is not a LoraConfig field tiegrad knows (PEFT "
                "0.22's); it may change what the adapter computes"
            )
    for key in ("fan_in_fan_out", "use_rslora", "ensure_weight_tying"):
        value = config.get(key)
        if not isinstance(value, bool) and value is not None:
            raise CheckpointError(f"{path}: {key} must be true or false, got {value!r:.80}")
        config[key] = bool(value)  # unset (null) is false, as in PEFT
    _check_init(path, config.get("init_lora_weights", True))
    if config.get("bias", "none") != "none":
        raise CheckpointError(f"{path}: bias={config['bias']!r} is not supported (only 'none')")
    _check_targeting(path, config)
    try:
        size(f"{path}", "r", config.get("r"))
        positive(f"{path}", "lora_alpha", config.get("lora_alpha"))
        decay_rate(f"{path}", "lora_dropout", config.get("lora_dropout", 0.0))
        for key, check in (("rank_pattern", size), ("alpha_pattern", positive)):
            pattern = config.get(key) or {}
            if not isinstance(pattern, dict):
                raise CheckpointError(f"{path}: {key} must be an object, got {pattern!r:.80}")
            for k, v in pattern.items():
                _regex(path, f"{key} key {k!r}", rf"(.*\.)?({k})$")
                check(f"{path}", f"{key}[{k!r}]", v)
    except HyperparameterError as e:
        raise CheckpointError(str(e)) from None
    return config


def _unset(value: Any) -> bool:
    """Whether a configuration value is PEFT's "not used" (null, false, empty)."""
    return value is None or value is False or value == [] or value == {}


def _check_init(path: Path, init: Any) -> None:
    """``init_lora_weights`` must leave PEFT's factors a correction of the base as it
    was (``BASE_CHANGING`` refused, with how to get such a file) and name no variant."""
    if isinstance(init, bool) or init in PLAIN_INITS:
        return
    if isinstance(init, str) and init.lower().startswith(BASE_CHANGING):
        raise CheckpointError(
            f"{path}: init_lora_weights={init!r:.80}: PEFT changed the base weights when it "
            "made this adapter (LoftQ quantises them; PiSSA, OLoRA, CorDA, Astra and LoRA-GA "
            "subtract the initial factors), and the factors correct that changed base, not "
            "the original. PEFT's save_pretrained(..., path_initial_model_for_weight_"
            "conversion=DIR) writes a plain LoRA file of the original base (not for LoftQ); "
            "for a model that holds the changed base PEFT saved, set init_lora_weights to true"
        )
    if init == "mica":
        raise CheckpointError(
            f"{path}: init_lora_weights='mica' is MiCA, which trains A alone (B frozen); "
            "tiegrad's adapters train both factors"
        )
    raise CheckpointError(
        f"{path}: init_lora_weights={init!r:.80} is not an initialisation PEFT's LoRA "
        f"knows (expected true, false, {', '.join(map(repr, PLAIN_INITS))}, or one of "
        f"{', '.join(BASE_CHANGING)} and 'mica', which tiegrad refuses)"
    )


def _regex(path: Path, what: str, pattern: str) -> None:
    """``pattern`` must be a regular expression Python's ``re`` (PEFT's) compiles."""
    try:
        re.compile(pattern)
    except re.error as e:
        raise CheckpointError(f"{path}: {what} is not a regular expression: {e}") from None


def _strings(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(v, str) for v in value)


def _check_targeting(path: Path, config: dict[str, Any]) -> None:
    """``target_modules``, ``exclude_modules``, ``layers_to_transform`` and
    ``layers_pattern`` of the types PEFT takes, combined as PEFT's ``LoraConfig`` lets
    them be (``_not_targeted`` applies them)."""
    targets = config.get("target_modules")
    if isinstance(targets, str):
        _regex(path, "target_modules", targets)
    elif not _strings(targets) or not targets:
        raise CheckpointError(
            f"{path}: target_modules must be a regular expression or a non-empty list of "
            f"module names, got {targets!r:.80}"
        )
    exclude = config.get("exclude_modules")
    if isinstance(exclude, str):
        _regex(path, "exclude_modules", exclude)
    elif exclude is not None and not _strings(exclude):
        raise CheckpointError(
            f"{path}: exclude_modules must be a regular expression or a list of module "
            f"names, got {exclude!r:.80}"
        )
    layers = config.get("layers_to_transform")
    indexes = layers if isinstance(layers, list) else [layers]
    if layers is not None and not all(isinstance(i, int) and type(i) is not bool for i in indexes):
        raise CheckpointError(
            f"{path}: layers_to_transform must be a layer index or a list of them, got "
            f"{layers!r:.80}"
        )
    pattern = config.get("layers_pattern")
    if pattern is not None and not isinstance(pattern, str) and not _strings(pattern):
        raise CheckpointError(
            f"{path}: layers_pattern must be a name or a list of names, got {pattern!r:.80}"
        )
    if pattern and layers is None:
        raise CheckpointError(f"{path}: layers_pattern {pattern!r:.80} needs layers_to_transform")
    if isinstance(targets, str) and (layers not in (None, []) or pattern):
        key = "layers_to_transform" if layers not in (None, []) else "layers_pattern"
        raise CheckpointError(
            f"{path}: {key} applies to a list of target_modules, not to the regular "
            f"expression {targets!r:.80}"
        )
    for p in [pattern] if isinstance(pattern, str) else pattern or []:
        _regex(path, f"layers_pattern {p!r}", _layer_regex(p))


def _named_by(names: list[str], path: str) -> bool:
    """PEFT's rule for a list of module names: ``path`` is one whole or ends in ``.name``."""
    return path in names or any(path.endswith("." + n) for n in names)


def _layer_index(config: dict[str, Any], path: str) -> int | None:
    """The layer index PEFT reads from ``path`` for ``layers_to_transform``: the number
    after the first ``<layers_pattern>.`` (any name without a pattern), or None."""
    pattern = config.get("layers_pattern")
    patterns = [pattern] if isinstance(pattern, str) else pattern
    found = None
    for regex in map(_layer_regex, patterns) if patterns else [_layer_regex(None)]:
        found = re.match(regex, path)
        if found:
            break
    return None if found is None else int(found["idx"])


def _layer_regex(pattern: str | None) -> str:
    """PEFT's regular expression of a layer index after ``pattern`` (None: any name)."""
    if pattern is None:
        return r".*?\.[^.]*\.(?P<idx>\d+)\."
    return rf"(?:^|.*?\.){pattern}\.(?P<idx>\d+)\."


def _not_targeted(config: dict[str, Any], path: str) -> str | None:
    """Why PEFT adapts no module at ``path`` under ``config`` (None: it does), as its
    ``check_target_module_exists``: ``exclude_modules`` first (a regular expression
    matching the whole path, or names), then ``target_modules`` (the same two forms); a
    name that matches a suffix, not the whole path, must be in ``layers_to_transform``."""
    exclude = config.get("exclude_modules")
    if exclude is not None and (
        re.fullmatch(exclude, path) if isinstance(exclude, str) else _named_by(exclude, path)
    ):
        return f"excluded by exclude_modules {exclude!r:.80}"
    targets = config["target_modules"]
    if isinstance(targets, str):
        return None if re.fullmatch(targets, path) else f"not matched by {targets!r:.80}"
    if path in targets:
        return None
    if not _named_by(targets, path):
        return "not a target_module"
    layers = config.get("layers_to_transform")
    if layers is None or layers == []:
        return None
    index = _layer_index(config, path)
    if index in ([layers] if isinstance(layers, int) else layers):
        return None
    where = "in no numbered layer" if index is None else f"in layer {index}"
    return f"{where}, not in layers_to_transform {layers!r:.80}"


def _pattern_value(config: dict[str, Any], key: str, default: str, path: str) -> Any:
    """PEFT's per-module value (``get_pattern_key``): that of the first key of
    ``config[key]`` that, as a regular expression, matches ``path`` whole or after a dot;
    else ``config[default]``."""
    for k, v in (config.get(key) or {}).items():
        if re.match(rf"(.*\.)?({k})$", path):
            return v
    return config[default]


def load_adapter(
    model: Module,
    directory: str | os.PathLike[str],
    name: str = "default",
    *,
    allow_nonfinite: bool = False,
) -> list[str]:
    """Attach the PEFT adapter in ``directory`` to ``model`` as adapter ``name``.

    Everything is checked first (see the module docstring); a factor holding NaN or
    infinity (in the weight's dtype) is refused, naming the tensor and the count, unless
    ``allow_nonfinite`` (``checkpoint.finite``). Then it is attached as
    ``tiegrad.adapters.add_lora`` attaches (trainability, the active adapter). Returns
    the adapted weight paths.
    """
    check_name(model, name, "load_adapter")
    config = read_config(directory)
    file = read_safetensors(os.fspath(Path(directory) / WEIGHTS))
    where = file.path
    layers = {p: layer for layer in adaptable_layers(model) for p in layer.paths}
    targets = config["target_modules"]
    if isinstance(targets, str):
        unmatched = [] if any(re.fullmatch(targets, p) for p in layers) else [targets]
    else:
        unmatched = [t for t in targets if not any(_named_by([t], p) for p in layers)]
    if unmatched:
        raise CheckpointError(
            f"{where}: target module {unmatched[0]!r} names no adaptable layer of {model.label()}"
        )
    copies = _full_copies_to_read(file, config, model, allow_nonfinite)
    skip = {PREFIX + p for c in copies for p in c.paths}
    factors = _read_factors(file, config, layers, model, allow_nonfinite, skip)
    _check_full_or_adapted(where, copies, factors, layers, model)
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
        alpha, rslora = float(alphas[group[0]]), config["use_rslora"]
        specs.append(AdapterSpec(tuple(layers[p] for p in group), a, b, alpha, dropout, rslora))
    adapted = attach(model, name, specs)
    _apply_full_copies(model, copies)
    return adapted


def _read_factors(
    file: SafetensorsFile,
    config: dict[str, Any],
    layers: dict[str, Layer],
    model: Module,
    allow_nonfinite: bool,
    skip: Collection[str] = (),
) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """``{module path: (A, B)}`` in the model's slot order, in the terms of each use,
    cast to the weight's dtype; every name (but those in ``skip``), shape, base weight
    and (unless ``allow_nonfinite``) value checked."""
    where = file.path
    untargeted = _untargeted_paths(config, layers)
    found: dict[str, dict[str, str]] = {}
    for key in file.tensors:
        if key in skip:
            continue
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
        if path in untargeted:
            tied = (
                " nor one storage with one in this model" if config["ensure_weight_tying"] else ""
            )
            raise CheckpointError(
                f"{where}: tensor {key!r} names {path!r}, {untargeted[path]}{tied}; PEFT "
                "adapts no such module"
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
        source = "r" if rank == config["r"] else "rank_pattern"
        for factor, shape in (("A", (rank, fan_in)), ("B", (fan_out, rank))):
            entry = file.tensors[keys[factor]]
            if tuple(entry.shape) != shape:
                raise CheckpointError(
                    f"{where}: tensor {keys[factor]!r} has shape {tuple(entry.shape)}, "
                    f"{path!r} (rank {rank}, from {source}) needs {shape}"
                )
            if not np.issubdtype(np.dtype(entry.dtype), np.floating):
                raise CheckpointError(f"{where}: tensor {keys[factor]!r} has dtype {entry.dtype}")
        dtype = layer.module.weight.dtype
        out[path] = tuple(
            finite_cast(file.array(keys[f]), dtype, f"{where}: tensor {keys[f]!r}", allow_nonfinite)
            for f in "AB"
        )
    if not out:
        raise CheckpointError(f"{where}: holds no LoRA factors")
    return out


@dataclass(frozen=True)
class FullCopy:
    """A file's full value of one storage PEFT trains in full (``modules_to_save``):
    ``paths``, the uses that take it; ``untie``: they get a storage of their own (the
    storage's other uses keep the base, as PEFT's copy of the named module leaves them)."""

    paths: tuple[str, ...]
    value: np.ndarray
    untie: bool


def _full_copies_to_read(
    file: SafetensorsFile, config: dict[str, Any], model: Module, allow_nonfinite: bool
) -> list[FullCopy]:
    """The ``modules_to_save`` values of the file by storage, checked (see the module
    docstring): each name matches a module, each saved parameter is in the file with
    the slot's shape, a float dtype and (unless ``allow_nonfinite``) finite values, and
    with ``ensure_weight_tying`` the copies of one storage are equal."""
    where = file.path
    names = config.get("modules_to_save") or []
    if not names:
        return []
    if not _strings(names):
        raise CheckpointError(f"{where}: modules_to_save must be a list of module names")
    if adapted_layers(model):
        raise CheckpointError(
            f"{where}: modules_to_save {names!r:.80} replaces the model's values, and "
            f"{model.label()} has adapters already; load it into a model without adapters"
        )
    slots = _plain_slots(model)
    modules = dict.fromkeys(m for p in slots for m in prefixes(p)[:-1])
    chosen: dict[str, None] = {}
    for name in names:
        hits = [m for m in modules if _named_by([name], m)]
        if not hits:
            raise CheckpointError(
                f"{where}: modules_to_save {name!r} names no module of {model.label()}"
            )
        chosen.update(dict.fromkeys(p for p in slots for m in hits if p.startswith(f"{m}.")))
    uses = _storage_uses(slots)
    out = []
    for paths_of_storage in uses.values():
        paths = [p for p in paths_of_storage if p in chosen]
        if paths and config["ensure_weight_tying"]:
            paths = paths_of_storage
        if not paths:
            continue
        values = [_full_value(file, slots[p], p, allow_nonfinite) for p in paths]
        for p, value in zip(paths[1:], values[1:]):
            if not np.array_equal(value, values[0]):
                raise CheckpointError(
                    f"{where}: ensure_weight_tying ties {paths[0]!r} and {p!r} (one storage "
                    f"in the model), but the file's {PREFIX + paths[0]!r} and {PREFIX + p!r} "
                    "differ"
                )
        out.append(FullCopy(tuple(paths), values[0], len(paths) < len(paths_of_storage)))
    return out


def _full_value(file: SafetensorsFile, slot: Param, path: str, allow_nonfinite: bool) -> Any:
    """The file's full copy of the parameter at ``path``, checked against ``slot``."""
    key = PREFIX + path
    entry = file.tensors.get(key)
    if entry is None:
        raise CheckpointError(
            f"{file.path}: {key!r} is missing (modules_to_save trains {path!r} in full)"
        )
    if tuple(entry.shape) != slot.shape:
        raise CheckpointError(
            f"{file.path}: tensor {key!r} has shape {tuple(entry.shape)}, {path!r} needs "
            f"{slot.shape}"
        )
    if not np.issubdtype(np.dtype(entry.dtype), np.floating):
        raise CheckpointError(f"{file.path}: tensor {key!r} has dtype {entry.dtype}")
    return finite_cast(file.array(key), slot.dtype, f"{file.path}: tensor {key!r}", allow_nonfinite)


def _check_full_or_adapted(
    where: str,
    copies: list[FullCopy],
    factors: dict[str, tuple[np.ndarray, np.ndarray]],
    layers: dict[str, Layer],
    model: Module,
) -> None:
    """A storage the file trains in full may not have factors too."""
    slots = dict(model.named_slots())
    full = {id(slots[p].storage): p for c in copies for p in c.paths}
    for path in factors:
        storage = id(layers[path].module.weight.storage)
        if storage in full:
            raise CheckpointError(
                f"{where}: {path!r} has LoRA factors and {full[storage]!r} (one storage) is "
                "in modules_to_save; PEFT trains a module either way, not both"
            )


def _apply_full_copies(model: Module, copies: list[FullCopy]) -> None:
    """Write the checked full copies into the model and make their uses trainable."""
    slots = dict(model.named_slots())
    for copy in copies:
        handles = [slots[p] for p in copy.paths]
        if copy.untie:
            storage = ParameterStorage.adopting(np.ascontiguousarray(copy.value))
            for handle in handles:
                handle.storage = storage
        else:
            handles[0].storage.commit_host(np.ascontiguousarray(copy.value))
        for handle in handles:
            handle.requires_grad = True


def _untargeted_paths(config: dict[str, Any], layers: dict[str, Layer]) -> dict[str, str]:
    """``{module path: why}`` of the paths PEFT adapts no module at (``_not_targeted``);
    with ``ensure_weight_tying``, a path whose weight is one storage with a targeted one's
    is targeted (PEFT adapts the uses tied to a target and names only the target)."""
    why = {p: _not_targeted(config, p) for p in layers}
    if config["ensure_weight_tying"]:
        storages = {id(layers[p].module.weight.storage) for p, w in why.items() if w is None}
        why = {p: w for p, w in why.items() if id(layers[p].module.weight.storage) not in storages}
    return {p: w for p, w in why.items() if w is not None}


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
        home = layers[group[0]]
        a, b = factors[group[0]]
        for path in group[1:]:
            layer = layers[path]
            if layer.module.weight.storage is not home.module.weight.storage:
                raise CheckpointError(
                    f"{where}: {SHARED} groups {group[0]!r} and {path!r}, whose weights are "
                    "not one storage in the model"
                )
            same = layout_of(layer.module) == layout_of(home.module)
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


# -- PEFT's trainable tokens (TrainableTokensConfig): rows of the embedding train -----------
#: The ``adapter_config.json`` fields of a ``TrainableTokensConfig`` (PEFT 0.22).
TOKENS_KNOWN = (
    "peft_type", "task_type", "auto_mapping", "peft_version", "base_model_name_or_path",
    "revision", "inference_mode", "token_indices", "target_modules", "init_weights",
)  # fmt: skip
TOKENS_DELTA = ".trainable_tokens_delta"


def _token_layers(model: Module) -> dict[str, str]:
    """``{module path: weight path}`` of the embedding and the head (``VOCAB_PATHS``)."""
    paths = getattr(model, "VOCAB_PATHS", None)
    if paths is None:
        raise SlotError(f"trainable tokens: {model.label()} has no token embedding")
    return {path.rsplit(".", 1)[0]: path for path in paths}


def save_trainable_tokens(
    model: Module, directory: str | os.PathLike[str], *, base_model_name_or_path: str | None = None
) -> list[int]:
    """Write the row mask of ``model``'s token embedding as PEFT's trainable tokens.

    ``adapter_config.json`` is a ``TrainableTokensConfig`` (``token_indices``: the rows
    of the embedding's row mask, ``tiegrad.nn.train_rows``) and
    ``adapter_model.safetensors`` holds those rows' current values per targeted module,
    ``base_model.model.<module>.trainable_tokens_delta``, as PEFT writes them: a tied
    head (one storage with the embedding, C1) is written under its own name too, with
    the same rows; an untied head is targeted when it has the same row mask. Returns
    the rows. The file can only hold those rows, so a model with another trainable
    weight (whose training the file would lose), an embedding without a row mask or an
    untied head with another one is refused before anything is written (C6).
    """
    layers = _token_layers(model)
    embed_module, embed_path = next(iter(layers.items()))
    storage = model.get_parameter(embed_path).storage
    rows = storage.trained_rows
    if rows is None:
        raise SlotError(
            f"save_trainable_tokens: {embed_path} has no row mask (tiegrad.nn.train_rows)"
        )
    targets = [
        module
        for module, path in layers.items()
        if model.get_parameter(path).storage is storage
        or np.array_equal(model.get_parameter(path).storage.trained_rows, rows)
    ]
    kept = {id(model.get_parameter(layers[m]).storage) for m in targets}
    other = [
        path for path, p in model.named_slots() if p.requires_grad and id(p.storage) not in kept
    ]
    if other:
        raise SlotError(
            f"save_trainable_tokens: {shown_list(other)} train too, and a trainable-tokens "
            "adapter holds the embedding's trained rows alone (freeze them, or save a "
            "checkpoint)"
        )
    tensors = {
        f"{PREFIX}{module}{TOKENS_DELTA}": model.get_parameter(
            layers[module]
        ).storage.current_host_value()[rows]
        for module in targets
    }
    config = {
        "peft_type": "TRAINABLE_TOKENS",
        "task_type": None,
        "base_model_name_or_path": base_model_name_or_path,
        "target_modules": [module.rsplit(".", 1)[-1] for module in targets],
        "token_indices": rows.tolist(),
        "init_weights": True,
        "inference_mode": True,
    }
    folder = Path(directory)
    folder.mkdir(parents=True, exist_ok=True)
    write_safetensors(os.fspath(folder / WEIGHTS), tensors, {"format": "pt"})
    tmp = folder / f".{CONFIG}.tmp"
    tmp.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    os.replace(tmp, folder / CONFIG)
    return rows.tolist()


def load_trainable_tokens(
    model: Module, directory: str | os.PathLike[str], *, allow_nonfinite: bool = False
) -> list[int]:
    """Load PEFT's trainable tokens (a ``TrainableTokensConfig`` folder) into ``model``.

    As ``get_peft_model`` trains them: the targeted storages (the embedding's, which a
    tied head shares, C1) train only the ``token_indices`` rows (a row mask,
    ``tiegrad.nn.train_rows``) in every use, and every other weight is frozen; the rows
    take the file's ``trainable_tokens_delta`` values (which are the rows themselves,
    not a difference). Returns the rows. Checked before anything changes (C6): the
    configuration's keys and ``peft_type``, that ``target_modules`` names the
    embedding (and at most the head; a tied head is adapted with it, and its rows, which
    PEFT writes too, must be the embedding's), the indices (distinct, within the vocabulary),
    every tensor's name, shape and dtype, finiteness (unless ``allow_nonfinite``) and
    that a tied head's rows equal the embedding's; the first problem is a
    ``CheckpointError`` naming the file and the key or tensor.
    """
    folder = Path(directory)
    path = folder / CONFIG
    if not os.path.lexists(path):
        raise CheckpointError(f"{directory}: no {CONFIG} (not a PEFT adapter directory)")
    config = read_json(path)
    if config.get("peft_type") != "TRAINABLE_TOKENS":
        raise CheckpointError(
            f"{path}: peft_type {config.get('peft_type')!r:.40}, expected 'TRAINABLE_TOKENS'"
        )
    unknown = [k for k, v in config.items() if k not in TOKENS_KNOWN and not _unset(v)]
    if unknown:
        raise CheckpointError(
            f"{path}: {shown_list(unknown)} not TrainableTokensConfig fields tiegrad knows "
            "(PEFT 0.22's); they may change what the adapter computes"
        )
    layers = _token_layers(model)
    targets = config.get("target_modules")
    names = [targets] if isinstance(targets, str) else targets
    if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
        raise CheckpointError(f"{path}: target_modules must be names, got {targets!r:.80}")
    chosen = [
        m
        for m in layers
        if (re.fullmatch(targets, m) if isinstance(targets, str) else _named_by(names, m))
    ]
    embed_module = next(iter(layers))
    if embed_module not in chosen:
        raise CheckpointError(
            f"{path}: target_modules {targets!r:.80} does not name the token embedding "
            f"{embed_module!r} of {model.label()}"
        )
    embed = model.get_parameter(layers[embed_module])
    tied = [m for m in layers if model.get_parameter(layers[m]).storage is embed.storage]
    chosen += [m for m in tied if m not in chosen]  # PEFT adapts a tied head with it
    try:
        rows = checked_rows(f"{path}: token_indices", config.get("token_indices"), embed.shape)
    except TiegradError as e:
        raise CheckpointError(str(e)) from None
    file = read_safetensors(os.fspath(folder / WEIGHTS))
    wanted = {f"{PREFIX}{m}{TOKENS_DELTA}": m for m in chosen}
    stray = sorted(set(file.tensors) - set(wanted))
    if stray or embed_module not in {wanted.get(k) for k in file.tensors}:
        raise CheckpointError(
            f"{file.path}: expected the tensors {shown_list(sorted(wanted))}, got "
            f"{shown_list(sorted(file.tensors))}"
        )
    values: dict[Any, np.ndarray] = {}
    for key in file.tensors:
        p = model.get_parameter(layers[wanted[key]])
        shape = (len(rows), *p.shape[1:])
        if file.tensors[key].shape != shape:
            raise CheckpointError(
                f"{file.path}: tensor {key!r} has shape {file.tensors[key].shape}, expected "
                f"{shape} (one row per token index)"
            )
        value = finite_cast(file.array(key), p.dtype, f"{file.path}: {key!r}", allow_nonfinite)
        if p.storage in values and not np.array_equal(values[p.storage], value):
            raise CheckpointError(
                f"{file.path}: tensor {key!r} differs from the rows of the tied embedding "
                "(one storage holds one value per row)"
            )
        values[p.storage] = value
    trained = {id(st) for st in values}
    for _, p in model.named_slots():
        p.requires_grad = id(p.storage) in trained
    for storage, value in values.items():
        full = np.array(storage.current_host_value())
        full[rows] = value
        storage.write_host(full, f"load_trainable_tokens {file.path}")
        storage.train_rows(rows)
    return rows.tolist()
