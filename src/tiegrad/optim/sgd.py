"""``SGD``: stochastic gradient descent with momentum, dampening, Nesterov and weight decay.

The update follows ``torch.optim.SGD``'s documented algorithm, per storage (C4) with
``d`` its summed gradient::

    d = -d if maximize;  d = d + weight_decay * p
    if momentum:  b = d on the first step, else momentum * b + (1 - dampening) * d
                  d = d + momentum * b if nesterov else b
    p = p - lr * d

State per canonical slot: ``momentum_buffer`` when momentum is non-zero.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, NamedTuple

import numpy as np

from ..errors import HyperparameterError
from .foreach import fused_sgd
from .fused import FusedRule
from .hyperparams import at_least_zero, flag, learning_rate, unit_interval
from .optimizer import Optimizer, ParamsArg
from .rule import l2_gradient


class SGDCoefficients(NamedTuple):
    """The scalars of one SGD update (``first``: the momentum buffer is new)."""

    lr: float
    momentum: float
    dampening: float
    weight_decay: float
    nesterov: bool
    maximize: bool
    first: bool


def sgd_rule(
    xp: Any, p: Any, g: Any, state: dict[str, Any], work: list[Any], c: SGDCoefficients
) -> None:
    """One SGD update of ``p`` (and ``state["momentum_buffer"]``) in place; 3 work buffers.

    ``g`` is only read. ``xp`` is ``numpy`` or ``torch``: only NumPy-named functions with
    ``out=`` and in-place operators are used.
    """
    d = l2_gradient(xp, p, g, work[0], c.weight_decay, c.maximize)
    if c.momentum:
        buf = state["momentum_buffer"]
        if c.first:
            buf[...] = d
        else:
            buf *= c.momentum
            if c.dampening:
                xp.multiply(d, 1.0 - c.dampening, out=work[1])
                buf += work[1]
            else:
                buf += d
        if c.nesterov:
            xp.multiply(buf, c.momentum, out=work[1])
            work[1] += d
            d = work[1]
        else:
            d = buf
    xp.multiply(d, -c.lr, out=work[2])
    p += work[2]


class SGD(Optimizer):
    """``torch.optim.SGD`` with tiegrad's guarantees (see ``Optimizer``).

    ``momentum`` and ``dampening`` lie in [0, 1]; ``nesterov`` needs momentum > 0 and
    zero dampening.
    """

    kind = "SGD"
    hyperparameters = {
        "lr": learning_rate,
        "momentum": unit_interval,
        "dampening": unit_interval,
        "weight_decay": at_least_zero,
        "nesterov": flag,
        "maximize": flag,
    }
    work_buffers = 3
    rule = staticmethod(sgd_rule)
    fused_rule = FusedRule("sgd", ("momentum_buffer",))
    device_kernel = staticmethod(fused_sgd)  # torch's fused SGD on a device (optim.device)

    def __init__(
        self,
        params: ParamsArg,
        lr: float = 1e-3,
        momentum: float = 0.0,
        dampening: float = 0.0,
        weight_decay: float = 0.0,
        nesterov: bool = False,
        *,
        maximize: bool = False,
        nonfinite: str = "raise",
    ) -> None:
        defaults = {
            "lr": lr,
            "momentum": momentum,
            "dampening": dampening,
            "weight_decay": weight_decay,
            "nesterov": nesterov,
            "maximize": maximize,
        }
        super().__init__(params, defaults, nonfinite=nonfinite)

    def _check_group(self, label: str, hp: dict[str, Any], dtypes: set[np.dtype]) -> None:
        if hp["nesterov"] and (hp["momentum"] <= 0 or hp["dampening"] != 0):
            raise HyperparameterError(
                f"{label}: nesterov needs momentum > 0 and dampening 0, got momentum "
                f"{hp['momentum']!r} and dampening {hp['dampening']!r}"
            )

    def _state_names(self, hp: Mapping[str, Any]) -> tuple[str, ...]:
        return ("momentum_buffer",) if hp["momentum"] else ()

    def _coefficients(
        self, hp: Mapping[str, Any], step: int, fresh: frozenset[str]
    ) -> SGDCoefficients:
        return SGDCoefficients(
            hp["lr"],
            hp["momentum"],
            hp["dampening"],
            hp["weight_decay"],
            hp["nesterov"],
            hp["maximize"],
            "momentum_buffer" in fresh,
        )
