"""The optimizer rules over lists of device tensors, through PyTorch's ``foreach`` kernels.

An optimizer rule (``sgd_rule``, ``adam_rule``...) is written once against NumPy names
(``xp.multiply(a, b, out=w)``, ``m *= beta``, ``buf[...] = d``). ``ForeachOps`` is such
an ``xp`` whose arrays are ``TensorList``s: each operation is one ``torch._foreach_*``
call over every storage of a run (one multi-tensor kernel on a GPU, one C++ loop on
torch's CPU) instead of a gather of the run into one flat tensor and a scatter back.
Each foreach operation applies the same correctly rounded elementwise operation to
each tensor as the flat tensor operation does, so the update is the rule's, bit for
bit (docs/design.md: optimizers).

A list is *persistent* (parameters, optimizer state, gradients: its tensors are written
in place or only read) or *scratch* (a rule's work buffers): a scratch list that is the
``out`` of an operation takes the operation's fresh result tensors instead of a copy
into them, so work buffers cost no allocation of their own and no extra pass. Rules
write a work buffer before reading it, which is all a scratch list needs.

``fused_sgd`` and ``fused_adam`` are the device kernels of ``SGD`` and ``Adam``/``AdamW``
(their ``device_kernel``): PyTorch's fused optimizer kernels, one call per run updating
every parameter and its state in one pass each, where the run allows them. They compute
the rule's update with other roundings (torch folds the bias corrections into other
operations and runs the first moment as a ``lerp``), within ``OPTIMIZER_ULPS`` of the
host; the foreach rule remains for what they do not take.

torch itself is reached through the backend's ``xp``: this module imports nothing.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

Operand = Any  # TensorList or a Python number
FUSED_DEVICES = ("cpu", "cuda")  # where torch has its fused SGD and Adam kernels


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

    def maximum(self, a: TensorList, b: Operand, out: TensorList | None = None) -> TensorList:
        return self._apply("maximum", out, a, b)

    def negative(self, a: TensorList, out: TensorList | None = None) -> TensorList:
        return self._apply("neg", out, a)

    def sqrt(self, a: TensorList, out: TensorList | None = None) -> TensorList:
        return self._apply("sqrt", out, a)

    def square(self, a: TensorList, out: TensorList | None = None) -> TensorList:
        """``a * a``, as NumPy's and torch's ``square`` compute it."""
        return self._apply("mul", out, a, a)


def _fusable(xp: Any, name: str, params: Sequence[Any], grads: list[Any]) -> Any:
    """torch's fused kernel ``name`` when it takes a run of ``params``: contiguous tensors of
    one float32 or float64 dtype on a CPU or CUDA device; else None (the rule runs
    through foreach).

    The kernels read every tensor as contiguous memory (torch's CPU kernels do not check),
    so a strided gradient in ``grads`` is replaced by a contiguous copy (the caller's
    tensor is only read). The run's gradients and state were checked to have their
    parameter's dtype and device; the state tensors are contiguous (``DeviceState``).
    """
    kernel = getattr(xp, name, None)
    first = params[0]
    if kernel is None or first.device.type not in FUSED_DEVICES:
        return None
    if first.dtype not in (xp.float32, xp.float64) or len({p.dtype for p in params}) != 1:
        return None
    if not all(p.is_contiguous() for p in params):
        return None
    for k, g in enumerate(grads):
        if not g.is_contiguous():
            grads[k] = g.contiguous()
    return kernel


def fused_sgd(
    xp: Any,
    params: list[Any],
    grads: list[Any],
    state: Mapping[str, list[Any]],
    hp: Mapping[str, Any],
    step: int,
    fresh: frozenset[str],
) -> bool:
    """``sgd_rule`` over a run as ``torch._fused_sgd_``; False where it does not apply.

    The gradients are only read (``grads`` may get contiguous copies); ``fresh`` holds
    ``momentum_buffer`` on the buffer's first step (torch's ``is_first_step``: the
    buffer becomes the gradient).
    """
    kernel = _fusable(xp, "_fused_sgd_", params, grads)
    if kernel is None:
        return False
    kernel(
        params,
        grads,
        state.get("momentum_buffer", []),
        weight_decay=hp["weight_decay"],
        momentum=hp["momentum"],
        lr=hp["lr"],
        dampening=hp["dampening"],
        nesterov=hp["nesterov"],
        maximize=hp["maximize"],
        is_first_step="momentum_buffer" in fresh,
    )
    return True


def fused_adam(decoupled: bool) -> Any:
    """The device kernel of ``Adam`` (``decoupled=False``) or ``AdamW``: ``adam_rule`` over a
    run as ``torch._fused_adam_`` / ``torch._fused_adamw_``, False where it does not apply.

    Every slot of a run has the same ``step``, read by the kernel from one tensor on the
    run's device (made there, no transfer to wait for).
    """
    name = "_fused_adamw_" if decoupled else "_fused_adam_"

    def kernel(
        xp: Any,
        params: list[Any],
        grads: list[Any],
        state: Mapping[str, list[Any]],
        hp: Mapping[str, Any],
        step: int,
        fresh: frozenset[str],
    ) -> bool:
        fused = _fusable(xp, name, params, grads)
        if fused is None:
            return False
        steps = xp.full((), float(step), dtype=xp.float32, device=params[0].device)
        beta1, beta2 = hp["betas"]
        fused(
            params,
            grads,
            state["exp_avg"],
            state["exp_avg_sq"],
            state.get("max_exp_avg_sq", []),
            [steps] * len(params),
            lr=hp["lr"],
            beta1=beta1,
            beta2=beta2,
            weight_decay=hp["weight_decay"],
            eps=hp["eps"],
            amsgrad=hp["amsgrad"],
            maximize=hp["maximize"],
        )
        return True

    return kernel
