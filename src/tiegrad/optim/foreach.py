"""The optimizer rules over lists of device tensors, through PyTorch's ``foreach`` kernels.

An optimizer rule (``sgd_rule``, ``adam_rule``...) is written once against NumPy names
(``xp.multiply(a, b, out=w)``, ``m *= beta``, ``buf[...] = d``). ``ForeachOps`` is such
an ``xp`` whose arrays are ``TensorList``s: each operation is one ``torch._foreach_*``
call over every storage of a run (one multi-tensor kernel on a GPU, one C++ loop on
torch's CPU) instead of a gather of the run into one flat tensor and a scatter back.
Each foreach operation applies the same correctly rounded elementwise operation to
each tensor as the flat tensor operation does, so the update is the rule's, bit for
bit (DESIGN: optimizers).

A list is *persistent* (parameters, optimizer state, gradients: its tensors are written
in place or only read) or *scratch* (a rule's work buffers): a scratch list that is the
``out`` of an operation takes the operation's fresh result tensors instead of a copy
into them, so work buffers cost no allocation of their own and no extra pass. Rules
write a work buffer before reading it, which is all a scratch list needs.

torch itself is reached through the backend's ``xp``: this module imports nothing.
"""

from __future__ import annotations

from typing import Any

Operand = Any  # TensorList or a Python number


class TensorList:
    """Tensors an optimizer rule treats as one array; in-place operators run foreach kernels.

    ``tensors`` is None for a scratch list no operation has written yet.
    """

    __slots__ = ("ops", "tensors", "scratch")

    def __init__(self, ops: ForeachOps, tensors: list[Any] | None, scratch: bool = False) -> None:
        self.ops = ops
        self.tensors = tensors
        self.scratch = scratch

    def __imul__(self, other: Operand) -> TensorList:
        return self.ops.multiply(self, other, out=self)

    def __iadd__(self, other: Operand) -> TensorList:
        return self.ops.add(self, other, out=self)

    def __isub__(self, other: Operand) -> TensorList:
        return self.ops.subtract(self, other, out=self)

    def __setitem__(self, key: Any, value: TensorList) -> None:
        """``a[...] = b``: copy ``b`` into ``a``'s tensors (the only assignment rules make)."""
        if key is not Ellipsis:
            raise TypeError(f"TensorList: only a[...] = b is supported, got index {key!r}")
        self.ops.xp._foreach_copy_(self.tensors, value.tensors)


class ForeachOps:
    """The NumPy-named functions optimizer rules call, over ``TensorList``s (see module)."""

    __slots__ = ("xp",)

    def __init__(self, xp: Any) -> None:
        self.xp = xp

    def tensors(self, tensors: list[Any]) -> TensorList:
        """A persistent list over ``tensors``."""
        return TensorList(self, tensors)

    def scratch(self) -> TensorList:
        """An unwritten scratch list (a rule's work buffer)."""
        return TensorList(self, None, scratch=True)

    def _apply(self, name: str, out: TensorList | None, a: TensorList, *rest: Operand) -> Any:
        """``out = name(a, *rest)``: in place when ``out`` is ``a``, else fresh results that a
        scratch ``out`` (or a new one, when None) takes and a persistent one copies."""
        xp = self.xp
        args = [r.tensors if isinstance(r, TensorList) else r for r in rest]
        if out is a:
            getattr(xp, f"_foreach_{name}_")(a.tensors, *args)
            return out
        result = getattr(xp, f"_foreach_{name}")(a.tensors, *args)
        if out is None:
            return TensorList(self, result, scratch=True)
        if out.scratch:
            out.tensors = result
        else:
            xp._foreach_copy_(out.tensors, result)
        return out

    def multiply(self, a: TensorList, b: Operand, out: TensorList | None = None) -> TensorList:
        return self._apply("mul", out, a, b)

    def add(self, a: TensorList, b: Operand, out: TensorList | None = None) -> TensorList:
        return self._apply("add", out, a, b)

    def subtract(self, a: TensorList, b: Operand, out: TensorList | None = None) -> TensorList:
        return self._apply("sub", out, a, b)

    def divide(self, a: TensorList, b: Operand, out: TensorList | None = None) -> TensorList:
        return self._apply("div", out, a, b)

    def maximum(self, a: TensorList, b: TensorList, out: TensorList | None = None) -> TensorList:
        return self._apply("maximum", out, a, b)

    def negative(self, a: TensorList, out: TensorList | None = None) -> TensorList:
        return self._apply("neg", out, a)

    def sqrt(self, a: TensorList, out: TensorList | None = None) -> TensorList:
        return self._apply("sqrt", out, a)

    def square(self, a: TensorList, out: TensorList | None = None) -> TensorList:
        """``a * a``, as NumPy's and torch's ``square`` compute it."""
        return self._apply("mul", out, a, a)
