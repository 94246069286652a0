"""LoRA on the uses of a model: add, choose, disable, merge, unmerge, unload (issue 41).

How an adapter attaches to one use is ``tiegrad.adapters.layers``'s business; this
module works on whole models.

Targets: ``add_lora(model, targets)`` takes a glob or a collection of globs (``fnmatch``,
case-sensitive, ``*`` crossing dots, as ``Module.freeze`` takes them). A pattern names
an adaptable layer (a ``Linear``, an ``Embedding``, a GPT-2 ``Conv1D``) when it matches
the layer's path or its weight's path, whole or as a dotted suffix (PEFT's
``target_modules`` rule): ``"c_attn"``, ``"*.attn.c_attn"`` and
``"transformer.h.0.attn.c_attn.weight"`` all name the first block's ``c_attn``.

Trainability: the first ``add_lora`` of a model freezes every use that is not an
adapter's (PEFT's default; unfreeze what else should train), so an optimizer over
``model.parameters()`` keeps state for adapter storages only (C5). The active
adapter's storages are trainable and every other adapter's frozen. The first adapter
of a model is active; a later one is added inactive, as PEFT adds adapters, until
``set_adapter`` makes it the one.

Ties: every targeted use gets its own adapter. Adapting the head of a tied embedding
leaves the input use as it is, and the base stays one storage, stored once (C1, C9).
``share_tied=True`` gives all the adaptable uses of a targeted weight's storage one
adapter instead (a use of the other layout reads it transposed).

Merging: ``merge`` adds each applied adapter's ``scaling * B A`` into its weight. A
storage has one value for all its uses, so where a use being merged shares its storage
with a use that would change differently (one without an adapter, or with another
adapter), ``merge`` refuses and says so (``MergeRefused``, an ``AliasError``), unless
``untie=True``: then each such group of uses gets its own storage, and the group of the
storage's uses without an adapter keeps the original, bit for bit (where every use has
an adapter, the group of the storage's first use keeps it).
``unmerge`` subtracts what ``merge`` added (up to rounding; an untie stays). ``unload``
removes every adapter and keeps the weights as they are (merged or not).

Every function checks everything before it changes anything (C6); bad input is a
``TiegradError`` naming the path or the adapter and what was expected.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from fnmatch import fnmatchcase
from typing import Any

import numpy as np

from .._checks import count, decay_rate, flag, positive
from ..errors import AliasError, ConfigError, SlotError, TiegradError
from ..nn import init
from ..nn.module import Module
from ..params import Param, ParameterStorage
from .layers import (
    LoRA,
    LoRAAdapters,
    adaptable,
    adapters,
    adapters_of,
    initial_factors,
    layout_of,
    restore,
)

ADAPTABLE = "the weight of a Linear, an Embedding (a Llama-family one too) or a GPT-2 Conv1D"


@dataclass(frozen=True)
class Layer:
    """An adaptable layer of a model and every module path it is registered at."""

    module: Module
    paths: tuple[str, ...]

    def weight_paths(self) -> list[str]:
        return [weight_path(p) for p in self.paths]

    @property
    def adapters(self) -> LoRAAdapters | None:
        return adapters(self.module)


@dataclass(frozen=True)
class AdapterSpec:
    """One adapter to attach: its factors in the terms of ``layers[0]`` (its home layer) and
    the layers whose weight use it adapts (several only for uses of one storage);
    ``rslora``: scaling ``alpha / sqrt(rank)`` (see ``LoRA``)."""

    layers: tuple[Layer, ...]
    a: np.ndarray
    b: np.ndarray
    alpha: float
    dropout: float
    rslora: bool = False


def weight_path(module_path: str) -> str:
    return f"{module_path}.weight" if module_path else "weight"


def matches(pattern: str, path: str) -> bool:
    """Whether ``pattern`` matches ``path`` whole or as a dotted suffix."""
    return fnmatchcase(path, pattern) or fnmatchcase(path, "*." + pattern)


def _module_at(model: Module, path: str) -> Any:
    return functools.reduce(getattr, path.split("."), model) if path else model


def adaptable_layers(model: Module) -> list[Layer]:
    """Every adaptable layer of ``model`` once, in slot order of its weight, with all the
    paths it is registered at."""
    found: dict[int, tuple[Module, list[str]]] = {}
    for path, _ in model.named_slots():
        if path != "weight" and not path.endswith(".weight"):
            continue
        module_path = path[: -len("weight")].rstrip(".")
        layer = _module_at(model, module_path)
        if adaptable(layer):
            found.setdefault(id(layer), (layer, []))[1].append(module_path)
    return [Layer(m, tuple(paths)) for m, paths in found.values()]


def adapted_layers(model: Module) -> list[Layer]:
    """The layers of ``model`` that hold adapters."""
    return [layer for layer in adaptable_layers(model) if layer.adapters is not None]


def adapter_names(model: Module) -> list[str]:
    """The names of ``model``'s adapters, in order of first appearance."""
    names: dict[str, None] = {}
    for layer in adapted_layers(model):
        names.update(dict.fromkeys(layer.adapters.names()))
    return list(names)


def active_adapter(model: Module) -> str | None:
    """The name of the adapter the forward applies (None: no adapters)."""
    return next((x.adapters.active for x in adapted_layers(model) if x.adapters.active), None)


def _listing(paths: Sequence[str], n: int = 6) -> str:
    more = f", ... ({len(paths)} in all)" if len(paths) > n else ""
    return ", ".join(paths[:n]) + more if paths else "none"


def _patterns(op: str, targets: Any) -> list[str]:
    patterns = [targets] if isinstance(targets, str) else None
    if patterns is None and isinstance(targets, Iterable):
        patterns = list(targets)
    if not patterns or not all(isinstance(p, str) and p for p in patterns):
        raise SlotError(
            f"{op}: targets must be a glob pattern or a non-empty collection of them, "
            f"got {targets!r:.80}"
        )
    return patterns


def select(model: Module, targets: Any, op: str = "add_lora") -> list[Layer]:
    """The adaptable layers ``targets`` names (see the module docstring), in slot order.

    Every pattern must name an adaptable layer (a ``SlotError`` says what it matched
    instead), and a layer registered at several paths is named at all of them or at
    none (``AliasError``).
    """
    layers = adaptable_layers(model)
    named: dict[int, set[str]] = {}
    for pattern in _patterns(op, targets):
        hits = 0
        for layer in layers:
            for p in layer.paths:
                if matches(pattern, p) or matches(pattern, weight_path(p)):
                    named.setdefault(id(layer.module), set()).add(p)
                    hits += 1
        if not hits:
            slots = [p for p, _ in model.named_slots()]
            paths = list(dict.fromkeys(q for p in slots for q in prefixes(p)))
            other = [p for p in paths if matches(pattern, p)]
            found = (
                f"names {_listing(other)}, which no adapter can take"
                if other
                else f"matches no path of {model.label()}"
            )
            raise SlotError(
                f"{op}: target {pattern!r} {found}: expected {ADAPTABLE} (adaptable "
                f"layers: {_listing([p for x in layers for p in x.paths])})"
            )
    chosen = [layer for layer in layers if id(layer.module) in named]
    for layer in chosen:
        missed = [p for p in layer.paths if p not in named[id(layer.module)]]
        if missed:
            raise AliasError(
                f"{op}: {sorted(named[id(layer.module)])[0]!r} and {missed[0]!r} are one "
                "layer (a submodule registered at both paths); name both paths or neither"
            )
    return chosen


def prefixes(path: str) -> list[str]:
    """``a.b.c`` -> ``a``, ``a.b``, ``a.b.c``: the modules on a parameter path and itself."""
    parts = path.split(".")
    return [".".join(parts[: i + 1]) for i in range(len(parts))]


def tie_groups(model: Module, chosen: Sequence[Layer]) -> list[tuple[Layer, ...]]:
    """For each storage of a chosen layer's weight, every adaptable layer whose weight
    holds it (slot order: the first is the shared adapter's home layer)."""
    by_storage: dict[int, list[Layer]] = {}
    for layer in adaptable_layers(model):
        by_storage.setdefault(id(layer.module.weight.storage), []).append(layer)
    keys = dict.fromkeys(id(layer.module.weight.storage) for layer in chosen)
    return [tuple(by_storage[k]) for k in keys]


def check_model(model: Any, op: str) -> None:
    """``model`` must be a ``Module`` (a ``TiegradError`` otherwise)."""
    if not isinstance(model, Module):
        raise TiegradError(f"{op}: expected a tiegrad Module, got {type(model).__name__}")


def check_name(model: Module, name: Any, op: str) -> str:
    """``name`` as a new adapter name of ``model``: an identifier that names no attribute
    of an adapter container (ConfigError) and no adapter of ``model`` yet (SlotError)."""
    check_model(model, op)
    if (
        not isinstance(name, str)
        or not name.isidentifier()
        or name.startswith("_")
        or hasattr(LoRAAdapters(), name)
    ):
        raise ConfigError(
            f"{op}: an adapter name is an identifier not starting with '_' and not "
            f"an attribute of LoRAAdapters, got {name!r}"
        )
    for layer in adapted_layers(model):
        if name in layer.adapters.names():
            raise SlotError(
                f"{op}: {model.label()} already has an adapter {name!r} (at "
                f"{layer.paths[0]}.lora.{name}); choose another name, or unload the adapters"
            )
    return name


def add_lora(
    model: Module,
    targets: str | Iterable[str],
    rank: int = 8,
    alpha: float = 16,
    dropout: float = 0.0,
    *,
    name: str = "default",
    share_tied: bool = False,
    rslora: bool = False,
    rng: np.random.Generator | None = None,
) -> list[str]:
    """Attach a LoRA adapter ``name`` to the weight use of every layer ``targets`` names.

    ``rank`` is an integer >= 1, ``alpha`` a real > 0 (``scaling = alpha / rank``, or
    ``alpha / sqrt(rank)`` with ``rslora``, PEFT's ``use_rslora``), ``dropout`` in
    [0, 1); PEFT's initialisation (``B = 0``: the model computes what
    it computed) drawn from ``rng`` (None: ``default_rng(0)``). Ties, trainability and
    the active adapter: see the module docstring. Returns the adapted weight paths in
    slot order; on any error nothing has changed (C6).
    """
    op = "add_lora"
    rank = count(op, "rank", rank, minimum=1)
    alpha = positive(op, "alpha", alpha)
    dropout = decay_rate(op, "dropout", dropout)
    share_tied = flag(op, "share_tied", share_tied)
    rslora = flag(op, "rslora", rslora)
    rng = init.generator(rng)
    check_name(model, name, op)
    chosen = select(model, targets, op)
    groups = tie_groups(model, chosen) if share_tied else [(layer,) for layer in chosen]
    specs = [
        AdapterSpec(group, *initial_factors(group[0].module, rank, rng), alpha, dropout, rslora)
        for group in groups
    ]
    return attach(model, name, specs)


def attach(model: Module, name: str, specs: Sequence[AdapterSpec]) -> list[str]:
    """Attach one adapter ``name`` per spec (factors checked by the caller); returns the
    adapted weight paths in slot order. The first adapter of a model is made active and
    everything else frozen (see the module docstring)."""
    check_name(model, name, "attach")
    first = not adapted_layers(model)
    for spec in specs:
        layout = layout_of(spec.layers[0].module)
        adapter = LoRA(layout, spec.a, spec.b, spec.alpha, spec.dropout, spec.rslora)
        for layer in spec.layers:
            setattr(adapters_of(layer.module), name, adapter)
    if first:
        adapter_handles = _adapter_handles(model)
        for _, p in model.named_slots():
            if id(p) not in adapter_handles:
                p.requires_grad = False
        _activate(model, name)
    _sync_trainable(model)
    ids = {id(layer.module) for spec in specs for layer in spec.layers}
    done = {p for x in adaptable_layers(model) if id(x.module) in ids for p in x.weight_paths()}
    return [p for p, _ in model.named_slots() if p in done]


def _adapter_handles(model: Module) -> set[int]:
    out: set[int] = set()
    for layer in adapted_layers(model):
        for n in layer.adapters.names():
            adapter = layer.adapters.get(n)
            out.update((id(adapter.A), id(adapter.B)))
    return out


def _activate(model: Module, name: str) -> None:
    for layer in adapted_layers(model):
        layer.adapters.active = name if name in layer.adapters.names() else None


def _sync_trainable(model: Module) -> None:
    """The active adapter's storages trainable, every other adapter's frozen."""
    for layer in adapted_layers(model):
        for n in layer.adapters.names():
            adapter = layer.adapters.get(n)
            adapter.A.requires_grad = adapter.B.requires_grad = n == layer.adapters.active


def _require(model: Module, op: str) -> list[Layer]:
    check_model(model, op)
    layers = adapted_layers(model)
    if not layers:
        raise TiegradError(f"{op}: {model.label()} has no adapters (add_lora or load_adapter)")
    return layers


def _refuse_merged(layers: Sequence[Layer], op: str) -> None:
    for layer in layers:
        if layer.adapters.merged:
            raise TiegradError(
                f"{op}: adapter {layer.adapters.active!r} is merged into "
                f"{weight_path(layer.paths[0])!r}; unmerge(model) first"
            )


def set_adapter(model: Module, name: str) -> None:
    """Make ``name`` the adapter the forward applies and the one that trains; layers
    without an adapter of that name compute their own output. Refused while merged."""
    layers = _require(model, "set_adapter")
    names = adapter_names(model)
    if name not in names:
        raise SlotError(f"set_adapter: no adapter {name!r}; {model.label()} has {names}")
    _refuse_merged(layers, "set_adapter")
    _activate(model, name)
    _sync_trainable(model)


def disable(model: Module) -> None:
    """Compute every adapted layer's own output (the base) until ``enable``; refused while
    merged (the base is not kept apart then)."""
    layers = _require(model, "disable")
    _refuse_merged(layers, "disable")
    for layer in layers:
        layer.adapters.enabled = False


def enable(model: Module) -> None:
    """Apply the active adapter again after ``disable``."""
    for layer in _require(model, "enable"):
        layer.adapters.enabled = True


@dataclass
class _Write:
    """A new value for the storage under ``handles`` (the uses at ``paths``);
    ``separate``: a storage of their own, split from the use at ``kept``."""

    handles: list[Param]
    paths: list[str]
    storage: ParameterStorage
    value: np.ndarray
    separate: bool
    kept: str


def _merge_plan(model: Module, untie: bool, op: str) -> tuple[list[Layer], list[_Write]]:
    """The layers ``merge`` folds and the storage writes that do it, nothing changed;
    ``MergeRefused`` where a storage's uses would change differently and not ``untie``."""
    layers = _require(model, op)
    if any(not x.adapters.enabled for x in layers):
        raise TiegradError(f"{op}: the adapters of {model.label()} are disabled; enable first")
    todo = [x for x in layers if x.adapters.applied() is not None]
    adapter_at = {p: x.adapters.applied() for x in todo for p in x.weight_paths()}
    touched = {id(x.module.weight.storage) for x in todo}
    uses: dict[int, list[tuple[str, Param]]] = {}
    for path, p in model.named_slots():
        if id(p.storage) in touched:
            uses.setdefault(id(p.storage), []).append((path, p))
    writes = []
    for members in uses.values():
        groups: dict[int | None, list[tuple[str, Param]]] = {}
        for path, p in members:
            adapter = adapter_at.get(path)
            groups.setdefault(None if adapter is None else id(adapter), []).append((path, p))
        if len(groups) > 1 and not untie:
            raise MergeRefused(groups)
        base = members[0][1].storage
        value = base.current_host_value()
        keeper = None if None in groups else next(iter(groups))
        kept = groups[keeper][0][0]
        for key, group in groups.items():
            if key is not None:
                delta = adapter_at[group[0][0]].weight_delta()
                handles, paths = [p for _, p in group], [path for path, _ in group]
                writes.append(_Write(handles, paths, base, value + delta, key != keeper, kept))
    return todo, writes


def untied_by_merge(model: Module) -> list[tuple[str, str]]:
    """The ties ``merge(model, untie=True)`` would split, as ``(kept, split)`` pairs: the
    first path of the uses that keep the storage (those without an adapter, else the
    storage's first use's group) and the first path of a group of uses that gets a
    storage of its own. Empty: the merge keeps every tie. Nothing changes."""
    _, writes = _merge_plan(model, True, "untied_by_merge")
    return [(w.kept, w.paths[0]) for w in writes if w.separate]


def merge(model: Module, untie: bool = False) -> list[str]:
    """Fold every applied adapter into its weight; returns the merged weight paths.

    The adapters stay (not applied while merged; ``unmerge`` takes them out again,
    ``unload`` drops them). A shared storage whose uses would change differently is
    refused unless ``untie`` (see the module docstring; ``untied_by_merge`` says which
    ties that splits). Refused while disabled.
    """
    op = "merge"
    untie = flag(op, "untie", untie)
    todo, writes = _merge_plan(model, untie, op)
    for w in writes:
        if w.separate:
            storage = ParameterStorage.adopting(w.value)
            for p in w.handles:
                p.storage = storage
        else:
            w.storage.commit_host(w.value)
    for x in todo:
        x.adapters.merged = True
    merged = {p for x in todo for p in x.weight_paths()}
    return [p for p, _ in model.named_slots() if p in merged]


class MergeRefused(AliasError):
    """``merge`` without ``untie`` of a storage whose uses would change differently;
    ``conflict`` names the two uses (the message adds how to choose)."""

    def __init__(self, groups: dict[int | None, list[tuple[str, Param]]]) -> None:
        adapted = next(g for k, g in groups.items() if k is not None)[0][0]
        other_key, other = next((k, g[0][0]) for k, g in groups.items() if g[0][0] != adapted)
        how = "has no adapter" if other_key is None else "has another adapter"
        self.conflict = (
            f"{adapted!r} shares its storage with {other!r}, which {how}: merging would "
            f"change {other!r} too"
        )
        super().__init__(
            f"merge: {self.conflict}. Choose: merge(model, untie=True) gives each "
            "differently adapted use its own storage (uses without an adapter keep the "
            "original); add_lora(..., share_tied=True) adapts all the uses with one adapter; "
            "or keep the adapters unmerged"
        )


def unmerge(model: Module) -> list[str]:
    """Subtract what ``merge`` added from each merged weight (up to rounding; a storage
    that ``merge`` untied stays apart); returns the unmerged weight paths."""
    layers = _require(model, "unmerge")
    merged = [x for x in layers if x.adapters.merged]
    values: dict[int, tuple[ParameterStorage, np.ndarray]] = {}
    seen: set[tuple[int, int]] = set()
    for x in merged:
        storage, adapter = x.module.weight.storage, x.adapters.get(x.adapters.active)
        if (id(storage), id(adapter)) in seen:
            continue
        seen.add((id(storage), id(adapter)))
        current = values[id(storage)][1] if id(storage) in values else storage.current_host_value()
        values[id(storage)] = (storage, current - adapter.weight_delta())
    for storage, value in values.values():
        storage.commit_host(value)
    for x in merged:
        x.adapters.merged = False
    paths = {p for x in merged for p in x.weight_paths()}
    return [p for p, _ in model.named_slots() if p in paths]


def unload(model: Module) -> list[str]:
    """Remove every adapter; the weights stay as they are (merged or not) and so do their
    flags (frozen by ``add_lora``). Returns the paths of the layers restored."""
    layers = _require(model, "unload")
    for layer in layers:
        restore(layer.module)
    return [p for x in layers for p in x.paths]
