"""``Adam`` and ``AdamW``: adaptive moment estimation, with L2 or decoupled weight decay.

The update follows ``torch.optim.Adam`` / ``AdamW``'s documented algorithm, per storage
(C4) with ``d`` its summed gradient and ``t`` the slot's step::

    d = -d if maximize
    Adam:  d = d + weight_decay * p          AdamW:  p = p * (1 - lr * weight_decay)
    m = beta1 * m + (1 - beta1) * d
    v = beta2 * v + (1 - beta2) * d * d
    vmax = max(vmax, v) if amsgrad, else v
    p = p - lr / (1 - beta1**t) * m / (sqrt(vmax) / sqrt(1 - beta2**t) + eps)

The last line is computed as ``p + c * m / (sqrt(vmax) + eps * sqrt(1 - beta2**t))``
with ``c = -lr * sqrt(1 - beta2**t) / (1 - beta1**t)``, one operation fewer per element.
State per canonical slot: ``exp_avg``, ``exp_avg_sq`` and, with amsgrad,
``max_exp_avg_sq``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, NamedTuple

from .foreach import fused_adam
from .fused import FusedRule
from .hyperparams import at_least_zero, betas, flag, learning_rate, positive
from .optimizer import Optimizer, ParamsArg
from .rule import l2_gradient


class AdamCoefficients(NamedTuple):
    """The scalars of one Adam update, bias corrections folded in."""

    decay: float  # AdamW's 1 - lr * weight_decay; 1.0 for Adam
    l2: float  # Adam's weight_decay; 0.0 for AdamW
    maximize: bool
    beta1: float
    beta2: float
    one_minus_beta1: float
    one_minus_beta2: float
    eps_hat: float  # eps * sqrt(1 - beta2**t)
    step_hat: float  # -lr * sqrt(1 - beta2**t) / (1 - beta1**t)
    amsgrad: bool


def adam_rule(
    xp: Any, p: Any, g: Any, state: dict[str, Any], work: list[Any], c: AdamCoefficients
) -> None:
    """One Adam/AdamW update of ``p`` and its moments in place; 3 work buffers.

    ``g`` is only read. ``xp`` is ``numpy`` or ``torch``: only NumPy-named functions with
    ``out=`` and in-place operators are used.
    """
    w, z = work[0], work[1]
    if c.decay != 1.0:
        p *= c.decay
    d = l2_gradient(xp, p, g, work[2], c.l2, c.maximize)
    m, v = state["exp_avg"], state["exp_avg_sq"]
    xp.multiply(d, c.one_minus_beta1, out=w)
    m *= c.beta1
    m += w
    xp.square(d, out=z)
    z *= c.one_minus_beta2
    v *= c.beta2
    v += z
    if c.amsgrad:
        vmax = state["max_exp_avg_sq"]
        xp.maximum(vmax, v, out=vmax)
        v = vmax
    xp.sqrt(v, out=z)
    z += c.eps_hat
    xp.divide(m, z, out=z)
    z *= c.step_hat
    p += z


class Adam(Optimizer):
    """``torch.optim.Adam`` with tiegrad's guarantees (see ``Optimizer``).

    ``betas`` lie in [0, 1); ``eps`` > 0 and nonzero in the parameters' dtype; the
    weight decay is an L2 term added to the gradient.
    """

    kind = "Adam"
    hyperparameters = {
        "lr": learning_rate,
        "betas": betas,
        "eps": positive,
        "weight_decay": at_least_zero,
        "amsgrad": flag,
        "maximize": flag,
    }
    work_buffers = 3
    rule = staticmethod(adam_rule)
    fused_rule = FusedRule("adam", ("exp_avg", "exp_avg_sq", "max_exp_avg_sq"))
    device_kernel = staticmethod(fused_adam(decoupled=False))  # torch's (optim.device)
    decoupled = False

    def __init__(
        self,
        params: ParamsArg,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        amsgrad: bool = False,
        *,
        maximize: bool = False,
        nonfinite: str = "raise",
    ) -> None:
        defaults = {
            "lr": lr,
            "betas": betas,
            "eps": eps,
            "weight_decay": weight_decay,
            "amsgrad": amsgrad,
            "maximize": maximize,
        }
        super().__init__(params, defaults, nonfinite=nonfinite)

    def _state_names(self, hp: Mapping[str, Any]) -> tuple[str, ...]:
        extra = ("max_exp_avg_sq",) if hp["amsgrad"] else ()
        return ("exp_avg", "exp_avg_sq", *extra)

    def _coefficients(
        self, hp: Mapping[str, Any], step: int, fresh: frozenset[str]
    ) -> AdamCoefficients:
        lr, wd = hp["lr"], hp["weight_decay"]
        beta1, beta2 = hp["betas"]
        bias1 = 1.0 - beta1**step
        bias2_sqrt = (1.0 - beta2**step) ** 0.5
        return AdamCoefficients(
            decay=1.0 - lr * wd if self.decoupled else 1.0,
            l2=0.0 if self.decoupled else wd,
            maximize=hp["maximize"],
            beta1=beta1,
            beta2=beta2,
            one_minus_beta1=1.0 - beta1,
            one_minus_beta2=1.0 - beta2,
            eps_hat=hp["eps"] * bias2_sqrt,
            step_hat=-(lr / bias1) * bias2_sqrt,
            amsgrad=hp["amsgrad"],
        )


class AdamW(Adam):
    """``torch.optim.AdamW``: Adam with decoupled weight decay (default 1e-2)."""

    kind = "AdamW"
    device_kernel = staticmethod(fused_adam(decoupled=True))
    decoupled = True

    def __init__(
        self,
        params: ParamsArg,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        amsgrad: bool = False,
        *,
        maximize: bool = False,
        nonfinite: str = "raise",
    ) -> None:
        super().__init__(
            params, lr, betas, eps, weight_decay, amsgrad, maximize=maximize, nonfinite=nonfinite
        )
