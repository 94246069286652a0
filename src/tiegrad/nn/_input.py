"""Input checks of layers: a wrong shape is a ShapeError naming the layer and both shapes."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ..errors import ShapeError
from ..ops._core import lift, value_of
from ..session import EagerSession, TensorRef

if TYPE_CHECKING:
    from .module import Module

Pattern = tuple[Any, ...]


def describe(pattern: Pattern) -> str:
    """``(..., 4)`` or ``(N, 3, H, W)``: ints are exact sizes, names any size."""
    cells = ["..." if p is Ellipsis else str(p) for p in pattern]
    return (
        f"({cells[0]},)"
        if len(cells) == 1 and pattern[0] is not Ellipsis
        else f"({', '.join(cells)})"
    )


def check_shape(layer: Module, what: str, shape: tuple[int, ...], pattern: Pattern) -> None:
    """Raise unless ``shape`` fits ``pattern`` (an optional leading ``...``, ints, names)."""
    if len(pattern) == 2 and pattern[0] is Ellipsis and shape and shape[-1] == pattern[1]:
        return  # ``(..., n)`` met (most layers' inputs): one comparison
    lead = bool(pattern) and pattern[0] is Ellipsis
    fixed = pattern[1:] if lead else pattern
    fits = len(shape) >= len(fixed) if lead else len(shape) == len(fixed)
    if fits and fixed:
        tail = shape[len(shape) - len(fixed) :]
        fits = all(not isinstance(p, int) or p == n for p, n in zip(fixed, tail))
    if not fits:
        raise ShapeError(f"{layer.label()}: {what} has shape {shape}, expected {describe(pattern)}")


def checked_input(
    layer: Module, session: EagerSession, x: Any, pattern: Pattern
) -> tuple[Any, Any]:
    """``x`` unrecorded (a ref of ``session`` or the caller's operand) and its value,
    once the shape fits ``pattern``: for a layer with more to check before ``lift(session,
    x, value)`` records it (C6)."""
    if isinstance(x, TensorRef):
        x = lift(session, x)  # checked: a ref of another session or generation raises
    value = value_of(session, x)
    check_shape(layer, "input", tuple(value.shape), pattern)
    return x, value


def layer_input(layer: Module, session: EagerSession, x: Any, pattern: Pattern) -> TensorRef:
    """``x`` as a ref of ``session`` (arrays become constants), its shape checked first:
    a wrong shape records nothing (C6)."""
    return lift(session, *checked_input(layer, session, x, pattern))
