"""``Module``: parameters and submodules registered by attribute, enumerated by path.

A module holds ``Param`` handles and submodules. Assigning a ``Param`` or a ``Module``
to an attribute registers it under that name; ``ModuleList`` and ``Sequential`` register
their items under ``"0"``, ``"1"``, ... . A parameter's *path* is its dotted attribute
path from the module enumerating it (``"blocks.0.attn.qkv.weight"``).

Slot order (``named_slots``, ``param_list``): a module's own parameters in registration
order, then each submodule's slots in registration order, depth first. That is PyTorch's
``named_parameters(remove_duplicate=False)`` order, so state dicts line up.

A handle's ``name`` is its path: set when it is registered (prefixed as its module is
registered in a parent) and refreshed by every enumeration from the root.

Ties are storage identity (C1), never handle identity. A use is a path: every path owns
its handle, with its own ``requires_grad`` flag and ``name`` (its path). Assigning the
handle another path holds (``head.weight = embed.weight``, PyTorch's way to tie) installs
an alias handle on the same storage (``Param.alias``, the flag copied) at the new path,
as ``tiegrad.nn.tie`` does, so one use of a tied storage can be frozen while another
trains it (C4, C5): ``head.weight is embed.weight`` is False after the assignment, and
``head.weight.storage is embed.weight.storage`` is the tie. Enumeration does the same for
a handle that reached a second path another way. A submodule registered at two paths is
one object: its handles are shared by both paths.

Freezing is by path (``freeze``, ``unfreeze``, ``set_trainable``) and lives here, with the
enumeration it matches against; ``tiegrad.nn.tying`` builds on ``Module`` and is not
imported by it, so the dependency points one way.
"""

from __future__ import annotations

import difflib
import weakref
from collections.abc import Iterable, Iterator, Mapping
from fnmatch import fnmatchcase
from numbers import Integral
from typing import Any

import numpy as np

from .._checks import flag
from .._hints import missing_attribute
from ..errors import (
    AliasError,
    DTypeError,
    ShapeError,
    SlotError,
    TapeError,
    TiegradError,
    shown_list,
)
from ..params import Param, ParamList
from ..session import EagerSession, Gradients
from .state_dict import load_state_dict, state_dict

_DTYPE_HINT = "parameters keep the dtype they were built with: build the model in the one you want"
_BUFFER_HINT = (
    "tiegrad modules hold no buffers: every array is a Param (freeze it to keep it fixed)"
)
_HINTS = {
    "cuda": "module.to('cuda') mirrors every storage on the device",
    "cpu": "module.to('cpu') syncs every storage and drops its device mirror",
    "zero_grad": "gradients live in the result of backward, not on parameters: "
    "optimizer.zero_grad() clears param.grad",
    "modules": "module.named_modules() yields (path, module) pairs",
    "children": "module.named_modules() yields (path, module) pairs",
    "buffers": _BUFFER_HINT,
    "named_buffers": _BUFFER_HINT,
    "half": _DTYPE_HINT,
    "double": _DTYPE_HINT,
    "float": _DTYPE_HINT,
}


class Module:
    """Base class of layers and models.

    Subclasses call ``super().__init__()`` first, assign ``Param``s and submodules as
    attributes, and define ``forward(session, ...)``, which records its computation on
    ``session`` and reads every parameter through ``session.use(param)`` at each use, so
    each use is a tape leaf holding the value of that moment (C2).
    """

    def __init__(self) -> None:
        object.__setattr__(self, "_params", {})
        object.__setattr__(self, "_modules", {})
        object.__setattr__(self, "training", True)

    # -- registration ----------------------------------------------------------------
    def __setattr__(self, name: str, value: Any) -> None:
        d = self.__dict__
        if "_params" not in d:
            raise TiegradError(
                f"{type(self).__name__}: call super().__init__() before assigning attributes"
            )
        params: dict[str, Param] = d["_params"]
        modules: dict[str, Module] = d["_modules"]
        if isinstance(value, (Param, Module)) and (not name or "." in name):
            raise SlotError(  # a path segment: "a.weight" would name two things
                f"{type(self).__name__}: a parameter or submodule name must be non-empty and "
                f"without '.', got {name!r}"
            )
        if isinstance(value, Param):
            modules.pop(name, None)
            self._hold(name, value)
        elif isinstance(value, Module):
            params.pop(name, None)
            for path, p in value.named_slots():
                p.name = f"{name}.{path}"
            modules[name] = d[name] = value
        else:
            params.pop(name, None)
            modules.pop(name, None)
            object.__setattr__(self, name, value)

    def _hold(self, name: str, param: Param) -> Param:
        """Install ``param`` at attribute ``name``, or an alias of it where another path
        holds it (a use is a path, C4); returns the handle installed."""
        holder = getattr(param, "holder", None)
        if holder is not None:
            other, key = holder[0](), holder[1]
            held = other is not None and other._params.get(key) is param
            if held and (other is not self or key != name):
                param = param.alias(name=name)
        if param.name is None:
            param.name = name
        param.holder = (weakref.ref(self), name)
        self._params[name] = self.__dict__[name] = param
        return param

    def __setstate__(self, state: dict[str, Any]) -> None:
        """A copy or an unpickled module: its state, and its handles held by it again."""
        self.__dict__.update(state)
        for name, param in state["_params"].items():
            param.holder = (weakref.ref(self), name)

    def __getattr__(self, name: str) -> Any:
        """A registered parameter or submodule: each is also kept in the instance
        dictionary, so plain attribute lookup finds it (a forward reads several per op)
        and this runs only for names found nowhere else."""
        d = self.__dict__
        for registry in ("_params", "_modules"):
            entries = d.get(registry)
            if entries is not None and name in entries:
                return entries[name]
        raise missing_attribute(type(self).__name__, name, _HINTS)

    def __delattr__(self, name: str) -> None:
        d = self.__dict__
        if name in d["_params"]:
            del d["_params"][name]
            d.pop(name, None)
        elif name in d["_modules"]:
            del d["_modules"][name]
            d.pop(name, None)
        else:
            object.__delattr__(self, name)

    # -- running -----------------------------------------------------------------------
    def __call__(self, session: EagerSession, *args: Any, **kwargs: Any) -> Any:
        """Record ``forward(session, *args, **kwargs)`` on ``session``."""
        if not isinstance(session, EagerSession):
            raise TapeError(
                f"{self.label()}: the first argument must be an EagerSession, got "
                f"{type(session).__name__}; call it as module(session, x, ...)"
            )
        return self.forward(session, *args, **kwargs)

    def forward(self, session: EagerSession, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError(f"{type(self).__name__} defines no forward")

    def train(self, mode: bool = True) -> Module:
        """Set ``training`` on this module and every submodule (dropout reads it); ``mode``
        is a bool (a ``HyperparameterError`` otherwise, as torch refuses one)."""
        mode = flag(self.label(), "mode", mode)
        for _, m in self.named_modules():
            object.__setattr__(m, "training", mode)
        return self

    def to(self, device: str | None) -> Module:
        """Mirror every storage on ``device``, each once (C1, C7); ``"cpu"`` syncs and drops.

        A session on that device then reads the mirrors; ``Param.to`` does the work.
        """
        for _, p in self.named_parameters():
            p.to(device)
        return self

    def eval(self) -> Module:
        """``train(False)``."""
        return self.train(False)

    # -- enumeration -------------------------------------------------------------------
    def named_modules(self) -> Iterator[tuple[str, Module]]:
        """``(path, module)`` for this module (path ``""``) and each submodule once."""
        seen: set[int] = set()
        stack: list[tuple[str, Module]] = [("", self)]
        while stack:
            path, m = stack.pop()
            if id(m) in seen:
                continue
            seen.add(id(m))
            yield path, m
            prefix = f"{path}." if path else ""
            stack.extend((prefix + k, c) for k, c in reversed(m._modules.items()))

    def named_slots(self) -> list[tuple[str, Param]]:
        """``(path, handle)`` for every parameter path, aliases included, in slot order.

        Sets each handle's ``name`` to its path and gives a later path that holds the
        handle of an earlier one its own alias handle (see the module docstring).
        """
        out: list[tuple[str, Param]] = []
        self._collect("", out, {}, set(), set())
        return out

    def _collect(
        self,
        prefix: str,
        out: list[tuple[str, Param]],
        located: dict[int, tuple[int, str]],
        visited: set[int],
        ancestors: set[int],
    ) -> None:
        me = id(self)
        if me in ancestors:
            raise TiegradError(f"{type(self).__name__} at {prefix!r} contains itself")
        first_visit = me not in visited
        visited.add(me)
        params = self._params
        for name, p in list(params.items()):
            path = prefix + name
            location = (me, name)
            if located.setdefault(id(p), location) != location:
                p = self._hold(name, p.alias(name=path))  # the forward reads the alias (C4)
                located[id(p)] = location
            elif first_visit:
                p.name = path
            out.append((path, p))
        ancestors.add(me)
        for name, m in self._modules.items():
            m._collect(f"{prefix}{name}.", out, located, visited, ancestors)
        ancestors.discard(me)

    def named_parameters(self) -> Iterator[tuple[str, Param]]:
        """``(path, handle)`` once per storage (C1), under its first path. The handle is
        that of the storage's first trainable path (its canonical slot, C5), or of its
        first path when every path is frozen: filtering on ``p.requires_grad`` keeps
        exactly the storages that train, and the names stay put when a path is frozen."""
        chosen: dict[int, tuple[str, Param]] = {}
        for path, p in self.named_slots():
            first = chosen.get(id(p.storage))
            if first is None:
                chosen[id(p.storage)] = (path, p)
            elif p.requires_grad and not first[1].requires_grad:
                chosen[id(p.storage)] = (first[0], p)
        yield from chosen.values()

    def aliases(self) -> dict[str, list[str]]:
        """``{first path: [other paths]}`` for every storage named by several paths."""
        paths: dict[int, list[str]] = {}
        for path, p in self.named_slots():
            paths.setdefault(id(p.storage), []).append(path)
        return {ps[0]: ps[1:] for ps in paths.values() if len(ps) > 1}

    def param_list(self) -> ParamList:
        """A ``ParamList`` of every slot (aliases included) in slot order.

        Each slot holds this module's own handle for that path, named by its path, so
        ``requires_grad_array()`` is the per-path trainability mask and
        ``canonical_slot_indices()`` the alias map (C5).
        """
        return ParamList(p for _, p in self.named_slots())

    def parameters(self) -> ParamList:
        """Same as ``param_list()``; what optimizers take."""
        return self.param_list()

    def num_parameters(self, unique: bool = True) -> int:
        """Element count over storages (``unique``) or over every slot."""
        if unique:
            return sum(p.size for _, p in self.named_parameters())
        return sum(p.size for _, p in self.named_slots())

    def named_gradients(self, gradients: Gradients) -> dict[str, Any]:
        """``{first path: gradient}`` per storage with a trainable use in ``gradients``.

        The gradient of a storage is the sum over its trainable uses recorded in
        ``gradients.session`` (C4), read-only (``Gradients.storage_gradient``); frozen uses
        contribute nothing, and a storage with no trainable use is left out.
        """
        session = getattr(gradients, "session", None)
        if not isinstance(session, EagerSession):
            raise TapeError(
                f"{self.label()}: named_gradients needs the Gradients returned by "
                f"EagerSession.backward, got {type(gradients).__name__}"
            )
        gradient = gradients.storage_gradient
        named = ((path, gradient(p.storage)) for path, p in self.named_parameters())
        return {path: g for path, g in named if g is not None}

    def state_dict(self) -> dict[str, np.ndarray]:
        """``{path: array}`` for every parameter path in slot order, as PyTorch's.

        A tied storage appears under each of its paths as one array object (C1). Arrays
        are owned copies of the host values, a newer device mirror synced first (C7):
        later steps do not change them.
        """
        return state_dict(self.named_slots())

    def load_state_dict(self, state_dict: Mapping[str, Any], strict: bool = True) -> Any:
        """Write ``state_dict``'s arrays into the storages at its paths, ties kept.

        Validates everything before writing anything (C6): every value's shape and dtype
        (``Param.set_value``'s rule), the paths (``strict``: each path present and no
        other key, as PyTorch's ``strict``; otherwise the missing and unexpected keys
        are returned), and the ties: a storage is written once, and the values given at
        two paths of one storage must be equal (an ``AliasError`` otherwise). Returns
        ``(missing_keys, unexpected_keys)``.
        """
        return load_state_dict(self.label(), self.named_slots(), state_dict, strict)

    def requires_grad_(self, requires_grad: bool = True) -> Module:
        """Set ``requires_grad`` at every parameter path (``freeze("*")`` or
        ``unfreeze("*")``); returns self, as in PyTorch."""
        requires_grad = flag(self.label(), "requires_grad", requires_grad)
        for _, p in self.named_slots():
            p.requires_grad = requires_grad
        return self

    # -- paths -------------------------------------------------------------------------
    def _holder(self, path: str) -> tuple[Module, str]:
        """The module holding parameter ``path`` and its attribute name, or a SlotError."""
        if not isinstance(path, str):
            raise SlotError(f"{self.label()}: a parameter path is a str, got {path!r}")
        *parts, leaf = path.split(".")
        m: Module = self
        for part in parts:
            child = m._modules.get(part)
            if child is None:
                raise self._missing(path)
            m = child
        if leaf not in m._params:
            raise self._missing(path)
        return m, leaf

    def _missing(self, path: str) -> SlotError:
        known = [q for q, _ in self.named_slots()]
        close = difflib.get_close_matches(path, known, n=3)
        hint = f"; did you mean {', '.join(map(repr, close))}?" if close else ""
        return SlotError(
            f"{self.label()}: no parameter at path {path!r} ({len(known)} paths){hint}"
        )

    def get_parameter(self, path: str) -> Param:
        """The handle at ``path`` (a SlotError names the path and close matches)."""
        self.named_slots()
        m, leaf = self._holder(path)
        return m._params[leaf]

    def set_parameter(self, path: str, param: Param) -> None:
        """Install ``param`` at the existing ``path``; shape and dtype must match (C6).

        A handle another path holds is installed as an alias, as by assignment (C4)."""
        m, leaf = self._holder(path)
        if not isinstance(param, Param):
            raise SlotError(f"set_parameter {path!r}: expected a Param, got {type(param).__name__}")
        old = m._params[leaf]
        if param.shape != old.shape:
            raise ShapeError(
                f"set_parameter {path!r}: expected shape {old.shape}, got {param.shape}"
            )
        if param.dtype != old.dtype:
            raise DTypeError(
                f"set_parameter {path!r}: expected dtype {old.dtype.name}, got {param.dtype.name}"
            )
        m._hold(leaf, param).name = path

    # -- freezing ----------------------------------------------------------------------
    def freeze(self, pattern: str | Iterable[str]) -> list[str]:
        """Clear ``requires_grad`` on the handles of the paths matching ``pattern``.

        See ``set_trainable``; returns the matched paths.
        """
        return set_trainable(self, pattern, False)

    def unfreeze(self, pattern: str | Iterable[str]) -> list[str]:
        """Set ``requires_grad`` on the handles of the paths matching ``pattern``."""
        return set_trainable(self, pattern, True)

    # -- display -----------------------------------------------------------------------
    def extra_repr(self) -> str:
        """The constructor arguments shown by ``repr`` and in error messages."""
        return ""

    def label(self) -> str:
        """``ClassName(extra_repr)``: how errors name this module."""
        return f"{type(self).__name__}({self.extra_repr()})"

    def __repr__(self) -> str:
        if not self._modules:
            return self.label()
        lines = [f"{type(self).__name__}("]
        if self.extra_repr():
            lines.append(f"  {self.extra_repr()}")
        for name, m in self._modules.items():
            child = repr(m).replace("\n", "\n  ")
            lines.append(f"  ({name}): {child}")
        return "\n".join(lines) + "\n)"


def set_trainable(module: Module, pattern: str | Iterable[str], requires_grad: bool) -> list[str]:
    """Set ``requires_grad`` on the handles at the paths matching ``pattern``.

    ``pattern`` is a glob (``fnmatch``, case-sensitive; ``*`` also crosses dots) or an
    iterable of globs (list, tuple, set, generator), matched against whole paths. Only
    the matched paths change: a tied storage frozen at one path stays trainable through
    its other paths. Every pattern must match some path (SlotError), and a handle shared
    by a submodule registered at several paths cannot be set at some of them only
    (AliasError). Everything is checked before any flag is set (C6). Returns the matched
    paths in slot order.
    """
    op = "unfreeze" if requires_grad else "freeze"
    if isinstance(pattern, str):
        patterns = [pattern]
    else:
        patterns = list(pattern) if isinstance(pattern, Iterable) else []
    if not patterns or not all(isinstance(p, str) for p in patterns):
        raise SlotError(
            f"{op}: expected a glob pattern or a non-empty collection of them, got {pattern!r}"
        )
    slots = module.named_slots()
    for pat in patterns:
        if not any(fnmatchcase(path, pat) for path, _ in slots):
            raise SlotError(
                f"{op}: pattern {pat!r} matches no parameter path of {module.label()} "
                f"(paths: {shown_list(path for path, _ in slots)})"
            )
    matched = [(path, p) for path, p in slots if any(fnmatchcase(path, pat) for pat in patterns)]
    chosen = {id(p) for _, p in matched}
    names = {path for path, _ in matched}
    for path, p in slots:
        if id(p) in chosen and path not in names:
            other = next(q for q, h in matched if h is p)
            raise AliasError(
                f"{op}: {other!r} and {path!r} are one handle (a submodule registered at "
                f"both paths); match both paths or neither"
            )
    for _, p in matched:
        p.requires_grad = requires_grad
    return [path for path, _ in matched]


class ModuleList(Module):
    """A list of submodules registered as ``"0"``, ``"1"``, ...; it has no forward.

    Reads and edits as a Python list (``ml[i]``, ``ml[a:b]``, ``ml[i] = m``, ``del
    ml[i]``, ``insert``, ``append``, ``extend``, ``+=``); after an edit the items are
    registered again as ``"0"`` .. ``"n-1"``, so paths follow positions, as in
    ``torch.nn.ModuleList``. Items must be Modules and indexes integers or slices (a
    ``TiegradError`` / ``IndexError`` otherwise, before anything changes).
    """

    def __init__(self, modules: Any = ()) -> None:
        super().__init__()
        self.extend(modules)

    def _checked(self, module: Any) -> Module:
        if not isinstance(module, Module):
            raise TiegradError(
                f"{type(self).__name__}: items must be Modules, got {type(module).__name__}"
            )
        return module

    def _position(self, i: Any) -> int:
        n = len(self)
        if isinstance(i, bool) or not isinstance(i, Integral):
            raise IndexError(
                f"{type(self).__name__}: an item's index is an int (slices read and delete), "
                f"got {i!r}"
            )
        if not -n <= i < n:
            raise IndexError(f"{type(self).__name__}: index {i} out of range for {n} modules")
        return int(i) % n

    def _register(self, items: list[Module]) -> None:
        """Register ``items`` as ``"0"`` .. ``"n-1"``, replacing the current ones."""
        for key in list(self._modules):
            delattr(self, key)
        for k, m in enumerate(items):
            setattr(self, str(k), m)

    def append(self, module: Module) -> ModuleList:
        setattr(self, str(len(self._modules)), self._checked(module))
        return self

    def extend(self, modules: Any) -> ModuleList:
        items = [self._checked(m) for m in modules]
        for m in items:
            self.append(m)
        return self

    def insert(self, i: int, module: Module) -> None:
        items = list(self)
        items.insert(i, self._checked(module))
        self._register(items)

    def __iadd__(self, modules: Any) -> ModuleList:
        return self.extend(modules)

    def __len__(self) -> int:
        return len(self._modules)

    def __iter__(self) -> Iterator[Module]:
        return iter(list(self._modules.values()))

    def __getitem__(self, i: Any) -> Any:
        if isinstance(i, slice):
            items = list(self)[i]  # a new list of the same modules (torch's slicing)
            return Sequential(*items) if isinstance(self, Sequential) else ModuleList(items)
        return self._modules[str(self._position(i))]

    def __setitem__(self, i: Any, module: Module) -> None:
        setattr(self, str(self._position(i)), self._checked(module))

    def __delitem__(self, i: Any) -> None:
        items = list(self)
        if isinstance(i, slice):
            del items[i]
        else:
            del items[self._position(i)]
        self._register(items)


class Sequential(ModuleList):
    """Submodules applied in order: ``forward(session, x)`` feeds each one's output on."""

    def __init__(self, *modules: Module) -> None:
        super().__init__(modules)

    def forward(self, session: EagerSession, x: Any) -> Any:
        for m in self:
            x = m(session, x)
        return x
