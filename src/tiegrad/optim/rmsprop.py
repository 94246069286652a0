"""``RMSprop``: gradient scaled by a running average of its square, optionally centered.

The update follows ``torch.optim.RMSprop``'s documented algorithm, per storage (C4)
with ``d`` its summed gradient::

    d = -d if maximize;  d = d + weight_decay * p
    s = alpha * s + (1 - alpha) * d * d
    centered:  a = alpha * a + (1 - alpha) * d;  r = sqrt(max(s - a * a, 0)) + eps
    otherwise: r = sqrt(s) + eps
    momentum > 0:  b = momentum * b + d / r;  p = p - lr * b
    otherwise:     p = p - lr * d / r

State per canonical slot: ``square_avg``, plus ``momentum_buffer`` when momentum > 0
and ``grad_avg`` when centered.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, NamedTuple

from .fused import FusedRule
from .hyperparams import at_least_zero, flag, learning_rate, positive, unit_interval
from .optimizer import Optimizer, ParamsArg
from .rule import l2_gradient


class RMSpropCoefficients(NamedTuple):
    """The scalars of one RMSprop update."""

    lr: float
    alpha: float
    one_minus_alpha: float
    eps: float
    weight_decay: float
    momentum: float
    centered: bool
    maximize: bool


def rmsprop_rule(
    xp: Any, p: Any, g: Any, state: dict[str, Any], work: list[Any], c: RMSpropCoefficients
) -> None:
    """One RMSprop update of ``p`` and its state in place; 2 work buffers.

    ``g`` is only read. ``xp`` is ``numpy`` or ``torch``: only NumPy-named functions with
    ``out=`` and in-place operators are used.
    """
    w = work[1]
    d = l2_gradient(xp, p, g, work[0], c.weight_decay, c.maximize)
    sq = state["square_avg"]
    sq *= c.alpha
    xp.square(d, out=w)
    w *= c.one_minus_alpha
    sq += w
    if c.centered:
        ga = state["grad_avg"]
        xp.multiply(d, c.one_minus_alpha, out=w)
        ga *= c.alpha
        ga += w
        xp.multiply(ga, ga, out=w)
        xp.subtract(sq, w, out=w)
        xp.maximum(w, 0.0, out=w)  # s >= a * a exactly; rounded, s - a * a can be -1 ulp
        xp.sqrt(w, out=w)
    else:
        xp.sqrt(sq, out=w)
    w += c.eps
    xp.divide(d, w, out=w)
    if c.momentum > 0:
        buf = state["momentum_buffer"]
        buf *= c.momentum
        buf += w
        xp.multiply(buf, -c.lr, out=w)
    else:
        w *= -c.lr
    p += w


class RMSprop(Optimizer):
    """``torch.optim.RMSprop`` with tiegrad's guarantees (see ``Optimizer``).

    ``alpha`` and ``momentum`` lie in [0, 1]; ``eps`` > 0 and nonzero in the
    parameters' dtype.
    """

    kind = "RMSprop"
    hyperparameters = {
        "lr": learning_rate,
        "alpha": unit_interval,
        "eps": positive,
        "weight_decay": at_least_zero,
        "momentum": unit_interval,
        "centered": flag,
        "maximize": flag,
    }
    work_buffers = 2
    rule = staticmethod(rmsprop_rule)
    fused_rule = FusedRule("rmsprop", ("square_avg", "momentum_buffer", "grad_avg"))

    def __init__(
        self,
        params: ParamsArg,
        lr: float = 1e-2,
        alpha: float = 0.99,
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        momentum: float = 0.0,
        centered: bool = False,
        *,
        maximize: bool = False,
        nonfinite: str = "raise",
    ) -> None:
        defaults = {
            "lr": lr,
            "alpha": alpha,
            "eps": eps,
            "weight_decay": weight_decay,
            "momentum": momentum,
            "centered": centered,
            "maximize": maximize,
        }
        super().__init__(params, defaults, nonfinite=nonfinite)

    def _state_names(self, hp: Mapping[str, Any]) -> tuple[str, ...]:
        names = ["square_avg"]
        if hp["momentum"] > 0:
            names.append("momentum_buffer")
        if hp["centered"]:
            names.append("grad_avg")
        return tuple(names)

    def _coefficients(
        self, hp: Mapping[str, Any], step: int, fresh: frozenset[str]
    ) -> RMSpropCoefficients:
        return RMSpropCoefficients(
            lr=hp["lr"],
            alpha=hp["alpha"],
            one_minus_alpha=1.0 - hp["alpha"],
            eps=hp["eps"],
            weight_decay=hp["weight_decay"],
            momentum=hp["momentum"],
            centered=hp["centered"],
            maximize=hp["maximize"],
        )
