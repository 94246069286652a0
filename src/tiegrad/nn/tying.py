"""Tying and untying parameters of a module by path.

A tie makes two paths hold the same storage (C1); every path keeps its own handle, so
trainability is per use: a tied storage frozen at one path still trains through the
other (C4, C5). This is the per-use freezing of a tied weight that PyTorch, Flax, MLX
and Keras cannot express (docs/design.md: why per-use trainability).
"""

from __future__ import annotations

from ..errors import AliasError, DTypeError, ShapeError
from ..params import Param, ParameterStorage
from .module import Module, set_trainable

__all__ = ["set_trainable", "tie", "untie"]


def tie(module: Module, path: str, source: str, requires_grad: bool | None = None) -> Param:
    """Make ``path`` name the storage of ``source``; returns the handle at ``path``.

    The handle at ``path`` stays and now holds ``source``'s storage (wherever else that
    handle is registered, it follows), with its own flag:
    ``requires_grad=None`` copies ``source``'s flag; ``False`` makes the use through
    ``path`` contribute no gradient while ``source`` still trains the storage. An
    optimizer built before the tie therefore trains the one storage from its next step
    (its state moves to the storage's canonical slot, C5), as after ``untie``. Both
    paths must exist (SlotError) and have equal shapes (ShapeError naming both paths
    and shapes) and dtypes; a transposed use (an output projection tied to an
    embedding) is written in the forward, never as a copy. Nothing changes on error.
    """
    target = module.get_parameter(path)
    src = module.get_parameter(source)
    if target.shape != src.shape:
        raise ShapeError(
            f"tie: {path!r} has shape {target.shape} but {source!r} has shape {src.shape}; "
            "tied paths need equal shapes (write a transposed use in the forward)"
        )
    if target.dtype != src.dtype:
        raise DTypeError(
            f"tie: {path!r} has dtype {target.dtype.name} but {source!r} has dtype {src.dtype.name}"
        )
    flag = src.requires_grad if requires_grad is None else bool(requires_grad)
    if target is src:  # one handle at both paths (a submodule registered twice)
        target = src.alias(requires_grad=flag, name=path)
        module.set_parameter(path, target)
        return target
    target.storage, target.requires_grad = src.storage, flag
    return target


def untie(module: Module, path: str) -> Param:
    """Give ``path`` a new storage holding a copy of its current value (C1, C7).

    The handle at ``path`` stays (with its flag) and now holds the new storage, so an
    optimizer built before the untie trains the two storages apart from its next step,
    as after ``tie``. An AliasError is raised when no other path of ``module`` names that
    storage through its own handle (nothing to untie).
    """
    handle = module.get_parameter(path)
    others = [
        q
        for q, p in module.named_slots()
        if p.storage is handle.storage and p is not handle and q != path
    ]
    if not others:
        raise AliasError(
            f"untie: {path!r} of {module.label()} shares its storage with no other path"
        )
    handle.storage = ParameterStorage(handle.storage.current_host_value())
    return handle
