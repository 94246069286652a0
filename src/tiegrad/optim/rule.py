"""``UpdateRule``: an optimizer's update written once, as the executors run it.

An optimizer class is a small pure update rule plus the scalars it needs. ``rule`` is a
function over arrays, ``rule(xp, p, g, state, work, c)``, that writes the new parameter
and state values into the buffers it is given with NumPy-named functions (``out=``) and
in-place operators only, so the same rule runs on NumPy arrays (the host executor,
``optim.host``) and on lists of torch tensors (the device executor, ``optim.device``,
through ``optim.foreach``). The NumPy rule is the reference the fused and device kernels
are tested against.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

from .fused import FusedRule

Hyper = Mapping[str, Any]


class UpdateRule(NamedTuple):
    """Everything an executor needs of an optimizer's arithmetic, nothing of its bookkeeping.

    ``rule``: the update (see the module); ``work_buffers``: the scratch arrays it needs;
    ``coefficients(hp, step, fresh)``: its scalars for a slot's ``step``-th update
    (``fresh``: the state tensors made by this step); ``initial(name, hp)``: the value a
    new state tensor starts from; ``fused``: the compiled host kernel of the same rule,
    bit for bit (``optim.fused``), or None; ``device_kernel``: torch's fused kernel of
    it (``optim.foreach``), or None.
    """

    rule: Callable[..., None]
    work_buffers: int
    coefficients: Callable[[Hyper, int, frozenset[str]], Any]
    initial: Callable[[str, Hyper], float]
    fused: FusedRule | None
    device_kernel: Callable[..., bool] | None


def l2_gradient(xp: Any, p: Any, g: Any, out: Any, weight_decay: float, maximize: bool) -> Any:
    """torch.optim's gradient preamble: ``-g`` when maximizing, then ``+ weight_decay * p``.

    Returns ``g`` itself when neither applies (no copy), else the result in ``out``.
    """
    if weight_decay:
        xp.multiply(p, weight_decay, out=out)
        (xp.subtract if maximize else xp.add)(out, g, out=out)
        return out
    if maximize:
        xp.negative(g, out=out)
        return out
    return g
