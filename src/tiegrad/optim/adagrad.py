"""``Adagrad``: gradient scaled by the root of its accumulated square.

The update follows ``torch.optim.Adagrad``'s documented algorithm, per storage (C4)
with ``d`` its summed gradient and ``t`` the slot's step::

    d = -d if maximize;  d = d + weight_decay * p
    s = s + d * d                         (s starts at initial_accumulator_value)
    p = p - lr / (1 + (t - 1) * lr_decay) * d / (sqrt(s) + eps)

State per canonical slot: ``sum``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, NamedTuple

from .fused import FusedRule
from .hyperparams import at_least_zero, flag, learning_rate, positive
from .optimizer import Optimizer, ParamsArg
from .rule import l2_gradient


class AdagradCoefficients(NamedTuple):
    """The scalars of one Adagrad update (``clr``: the decayed learning rate)."""

    clr: float
    eps: float
    weight_decay: float
    maximize: bool


def adagrad_rule(
    xp: Any, p: Any, g: Any, state: dict[str, Any], work: list[Any], c: AdagradCoefficients
) -> None:
    """One Adagrad update of ``p`` and ``state["sum"]`` in place; 2 work buffers.

    ``g`` is only read. ``xp`` is ``numpy`` or ``torch``: only NumPy-named functions with
    ``out=`` and in-place operators are used.
    """
    w = work[1]
    d = l2_gradient(xp, p, g, work[0], c.weight_decay, c.maximize)
    s = state["sum"]
    xp.square(d, out=w)
    s += w
    xp.sqrt(s, out=w)
    w += c.eps
    xp.divide(d, w, out=w)
    w *= -c.clr
    p += w


class Adagrad(Optimizer):
    """``torch.optim.Adagrad`` with tiegrad's guarantees (see ``Optimizer``).

    ``lr_decay`` and ``initial_accumulator_value`` are >= 0; ``eps`` > 0 and nonzero in
    the parameters' dtype.
    """

    kind = "Adagrad"
    hyperparameters = {
        "lr": learning_rate,
        "lr_decay": at_least_zero,
        "weight_decay": at_least_zero,
        "initial_accumulator_value": at_least_zero,
        "eps": positive,
        "maximize": flag,
    }
    work_buffers = 2
    rule = staticmethod(adagrad_rule)
    fused_rule = FusedRule("adagrad", ("sum",))

    def __init__(
        self,
        params: ParamsArg,
        lr: float = 1e-2,
        lr_decay: float = 0.0,
        weight_decay: float = 0.0,
        initial_accumulator_value: float = 0.0,
        eps: float = 1e-10,
        *,
        maximize: bool = False,
        nonfinite: str = "raise",
    ) -> None:
        defaults = {
            "lr": lr,
            "lr_decay": lr_decay,
            "weight_decay": weight_decay,
            "initial_accumulator_value": initial_accumulator_value,
            "eps": eps,
            "maximize": maximize,
        }
        super().__init__(params, defaults, nonfinite=nonfinite)

    def _state_names(self, hp: Mapping[str, Any]) -> tuple[str, ...]:
        return ("sum",)

    def _initial_value(self, name: str, hp: Mapping[str, Any]) -> float:
        return hp["initial_accumulator_value"]

    def _coefficients(
        self, hp: Mapping[str, Any], step: int, fresh: frozenset[str]
    ) -> AdagradCoefficients:
        return AdagradCoefficients(
            clr=hp["lr"] / (1.0 + (step - 1) * hp["lr_decay"]),
            eps=hp["eps"],
            weight_decay=hp["weight_decay"],
            maximize=hp["maximize"],
        )
