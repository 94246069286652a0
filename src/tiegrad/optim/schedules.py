"""Learning-rate schedules with torch.optim.lr_scheduler's usage.

::

    sched = CosineWarmup(opt, warmup_steps=100, total_steps=10_000, min_lr=1e-5)
    for batch in data:
        ...
        opt.step()
        sched.step()

A schedule records each group's ``lr`` at construction as its base learning rate,
sets every group's ``lr`` for step 0 at once and, at each ``step()``, advances
``last_epoch`` and sets every group's ``lr`` for it. Learning rates are closed-form
functions of the step (no drift from repeated multiplication). Every new learning
rate is checked (finite, >= 0) before any group changes (C6).

So a schedule owns its groups' ``lr``: a manual change is overwritten at the next
``step()``, and two schedules on one optimizer do not multiply as torch's chained
schedulers do (the last one stepped sets the value). A second live schedule on an
optimizer warns; write a combined rule as one ``LambdaLR`` instead.

``state_dict()`` is JSON-serializable: ``{"kind", "last_epoch", "base_lrs", ...the
schedule's parameters}``; ``load_state_dict`` validates all of it, then sets the
groups' learning rates for the loaded step. ``LambdaLR``'s functions are code and
are not saved: the schedule loading the state supplies them.
"""

from __future__ import annotations

import math
import warnings
import weakref
from collections.abc import Callable, Mapping, Sequence
from typing import Any, ClassVar

from ..errors import CheckpointError, HyperparameterError, shown_list
from .hyperparams import (
    at_least_zero,
    count,
    decay_rate,
    flag,
    learning_rate,
    plain,
    positive,
    unit_interval,
)

# optimizer -> its latest schedule (both weakly: a schedule dropped frees its place)
_SCHEDULES: weakref.WeakKeyDictionary[Any, weakref.ref[Schedule]] = weakref.WeakKeyDictionary()


class Schedule:
    """Base class: base learning rates, the step counter, applying and saving.

    Subclasses set ``kind`` and implement ``_checked_config`` (the schedule's
    parameters, validated and normalized, from a mapping) and ``_lr`` (a group's
    learning rate at a step, a pure function of the config).
    """

    kind: ClassVar[str] = "Schedule"

    def __init__(self, optimizer: Any, **config: Any) -> None:
        self.optimizer = optimizer
        groups = optimizer.param_groups
        self.base_lrs = [
            learning_rate(f"{self.kind}: group {i}", "lr", g["lr"]) for i, g in enumerate(groups)
        ]
        self.config: dict[str, Any] = self._checked_config(config)
        self.last_epoch = 0
        self._last_lr: list[float] = []
        self._apply(self._values(0, self.base_lrs, self.config))
        earlier = _SCHEDULES.get(optimizer)
        if earlier is not None and earlier() is not None:
            warnings.warn(
                f"{self.kind}: this optimizer already has a live {earlier().kind} schedule; "
                "each sets the learning rates from its own formula, so they do not multiply "
                "as chained torch schedulers do (the last one stepped wins)",
                stacklevel=2,
            )
        _SCHEDULES[optimizer] = weakref.ref(self)

    # -- subclass hooks ------------------------------------------------------------------
    def _checked_config(self, values: Mapping[str, Any]) -> dict[str, Any]:
        raise NotImplementedError

    def _lr(self, cfg: Mapping[str, Any], base: float, epoch: int, group: int) -> float:
        raise NotImplementedError

    def _values(
        self, epoch: int, base_lrs: Sequence[float], cfg: Mapping[str, Any]
    ) -> dict[str, list[Any]]:
        """``{"lr": [...]}`` (and other group keys a schedule sets) at ``epoch``, checked."""
        lrs = [
            learning_rate(
                f"{self.kind} at step {epoch}: group {i}", "lr", self._lr_or_inf(cfg, b, epoch, i)
            )
            for i, b in enumerate(base_lrs)
        ]
        return {"lr": lrs}

    def _lr_or_inf(self, cfg: Mapping[str, Any], base: float, epoch: int, group: int) -> float:
        """``_lr``, or inf where its power leaves float's range (``gamma ** epoch``)."""
        try:
            return self._lr(cfg, base, epoch, group)
        except OverflowError:
            return math.inf

    # -- public API ----------------------------------------------------------------------
    def step(self) -> None:
        """Advance one step and set every group's learning rate for it."""
        values = self._values(self.last_epoch + 1, self.base_lrs, self.config)
        self.last_epoch += 1
        self._apply(values)

    def get_last_lr(self) -> list[float]:
        """The learning rates this schedule set last, one per group."""
        return list(self._last_lr)

    def lr_at(self, epoch: int) -> list[float]:
        """The learning rates at step ``epoch`` (nothing is set)."""
        epoch = count(self.kind, "epoch", epoch)
        return self._values(epoch, self.base_lrs, self.config)["lr"]

    def state_dict(self) -> dict[str, Any]:
        """``{"kind", "last_epoch", "base_lrs", ...parameters}``, JSON-serializable."""
        return {
            "kind": self.kind,
            "last_epoch": self.last_epoch,
            "base_lrs": list(self.base_lrs),
        } | plain(self.config)

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Adopt a state, validated completely first (C6); sets the groups' learning rates."""
        epoch, base_lrs, cfg, values = self._read_state(state_dict)
        self.base_lrs, self.config, self.last_epoch = base_lrs, cfg, epoch
        self._apply(values)

    def check_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Raise the ``CheckpointError`` that ``load_state_dict`` would raise; change nothing
        (``tiegrad.load`` checks a schedule's state before it loads the optimizer's)."""
        self._read_state(state_dict)

    def _read_state(
        self, state_dict: Mapping[str, Any]
    ) -> tuple[int, list[float], dict[str, Any], dict[str, list[Any]]]:
        """``(last_epoch, base_lrs, config, values)`` of a state, checked (C6)."""
        where = f"{self.kind}.load_state_dict"
        if not isinstance(state_dict, Mapping):
            raise CheckpointError(f"{where}: expected a mapping, got {type(state_dict).__name__}")
        kind = state_dict.get("kind", self.kind)
        if kind != self.kind:
            raise CheckpointError(
                f"{where}: the state is for a {kind!r:.80} schedule, this one is {self.kind!r}"
            )
        keys = ["kind", "last_epoch", "base_lrs", *self.config]
        if sorted(map(str, state_dict)) != sorted(keys):
            raise CheckpointError(
                f"{where}: keys {shown_list(sorted(map(str, state_dict)), 8)}, expected "
                f"{sorted(keys)}"
            )
        epoch = count(where, "last_epoch", state_dict["last_epoch"])
        base = state_dict["base_lrs"]
        groups = len(self.optimizer.param_groups)
        if not isinstance(base, (list, tuple)) or len(base) != groups:
            raise CheckpointError(f"{where}: base_lrs must be a list of {groups} learning rates")
        base_lrs = [learning_rate(where, f"base_lrs[{i}]", b) for i, b in enumerate(base)]
        cfg = self._checked_config({k: state_dict[k] for k in self.config})
        return epoch, base_lrs, cfg, self._values(epoch, base_lrs, cfg)

    def _apply(self, values: Mapping[str, list[Any]]) -> None:
        for key, per_group in values.items():
            for group, value in zip(self.optimizer.param_groups, per_group):
                group[key] = value
        self._last_lr = list(values["lr"])

    def __repr__(self) -> str:
        params = ", ".join(f"{k}={v!r}" for k, v in self.config.items())
        return f"{self.kind}({params}, last_epoch={self.last_epoch})"


class ConstantLR(Schedule):
    """``torch.optim.lr_scheduler.ConstantLR``: ``base * factor`` before ``total_iters``.

    With ``factor=1.0`` the learning rate stays constant.
    """

    kind = "ConstantLR"

    def __init__(self, optimizer: Any, factor: float = 1.0 / 3, total_iters: int = 5) -> None:
        super().__init__(optimizer, factor=factor, total_iters=total_iters)

    def _checked_config(self, values: Mapping[str, Any]) -> dict[str, Any]:
        return {
            "factor": unit_interval(self.kind, "factor", values["factor"]),
            "total_iters": count(self.kind, "total_iters", values["total_iters"]),
        }

    def _lr(self, cfg: Mapping[str, Any], base: float, epoch: int, group: int) -> float:
        return base * cfg["factor"] if epoch < cfg["total_iters"] else base


class StepLR(Schedule):
    """``torch.optim.lr_scheduler.StepLR``: ``base * gamma ** (epoch // step_size)``."""

    kind = "StepLR"

    def __init__(self, optimizer: Any, step_size: int, gamma: float = 0.1) -> None:
        super().__init__(optimizer, step_size=step_size, gamma=gamma)

    def _checked_config(self, values: Mapping[str, Any]) -> dict[str, Any]:
        return {
            "step_size": count(self.kind, "step_size", values["step_size"], minimum=1),
            "gamma": at_least_zero(self.kind, "gamma", values["gamma"]),
        }

    def _lr(self, cfg: Mapping[str, Any], base: float, epoch: int, group: int) -> float:
        return base * cfg["gamma"] ** (epoch // cfg["step_size"])


class ExponentialLR(Schedule):
    """``torch.optim.lr_scheduler.ExponentialLR``: ``base * gamma ** epoch``."""

    kind = "ExponentialLR"

    def __init__(self, optimizer: Any, gamma: float) -> None:
        super().__init__(optimizer, gamma=gamma)

    def _checked_config(self, values: Mapping[str, Any]) -> dict[str, Any]:
        return {"gamma": at_least_zero(self.kind, "gamma", values["gamma"])}

    def _lr(self, cfg: Mapping[str, Any], base: float, epoch: int, group: int) -> float:
        return base * cfg["gamma"] ** epoch


class LambdaLR(Schedule):
    """``torch.optim.lr_scheduler.LambdaLR``: ``base * lr_lambda(epoch)``.

    ``lr_lambda`` is one function for every group or a list with one per group. The
    functions are not part of ``state_dict``.
    """

    kind = "LambdaLR"

    def __init__(
        self, optimizer: Any, lr_lambda: Callable[[int], float] | Sequence[Callable[[int], float]]
    ) -> None:
        groups = len(optimizer.param_groups)
        fns = list(lr_lambda) if isinstance(lr_lambda, (list, tuple)) else [lr_lambda] * groups
        if len(fns) != groups or not all(callable(f) for f in fns):
            raise HyperparameterError(
                f"{self.kind}: lr_lambda must be a function or a list of {groups} functions"
            )
        self.lr_lambdas = fns
        super().__init__(optimizer)

    def _checked_config(self, values: Mapping[str, Any]) -> dict[str, Any]:
        return {}

    def _lr(self, cfg: Mapping[str, Any], base: float, epoch: int, group: int) -> float:
        return base * self.lr_lambdas[group](epoch)


class CosineWarmup(Schedule):
    """Linear warmup, then cosine decay to ``min_lr`` (HF transformers' convention).

    At step ``t``: ``base * t / warmup_steps`` while ``t < warmup_steps``; then
    ``min_lr + (base - min_lr) * (1 + cos(pi * progress)) / 2`` with ``progress =
    (t - warmup_steps) / (total_steps - warmup_steps)``; ``min_lr`` from
    ``total_steps`` on. ``min_lr`` is the same absolute floor for every group.
    """

    kind = "CosineWarmup"

    def __init__(
        self, optimizer: Any, warmup_steps: int, total_steps: int, min_lr: float = 0.0
    ) -> None:
        super().__init__(
            optimizer, warmup_steps=warmup_steps, total_steps=total_steps, min_lr=min_lr
        )

    def _checked_config(self, values: Mapping[str, Any]) -> dict[str, Any]:
        total = count(self.kind, "total_steps", values["total_steps"], minimum=1)
        warmup = count(self.kind, "warmup_steps", values["warmup_steps"])
        if warmup > total:
            raise HyperparameterError(
                f"{self.kind}: warmup_steps ({warmup}) exceeds total_steps ({total})"
            )
        min_lr = at_least_zero(self.kind, "min_lr", values["min_lr"])
        return {"warmup_steps": warmup, "total_steps": total, "min_lr": min_lr}

    def _lr(self, cfg: Mapping[str, Any], base: float, epoch: int, group: int) -> float:
        warmup, total, min_lr = cfg["warmup_steps"], cfg["total_steps"], cfg["min_lr"]
        if epoch < warmup:
            return base * epoch / warmup
        if epoch >= total:
            return min_lr
        progress = (epoch - warmup) / (total - warmup)
        return min_lr + (base - min_lr) * 0.5 * (1.0 + math.cos(math.pi * progress))


CosineWithWarmup = CosineWarmup  # the name the training job uses


class OneCycleLR(Schedule):
    """``torch.optim.lr_scheduler.OneCycleLR`` (``total_steps`` form), momentum included.

    The learning rate rises from ``max_lr / div_factor`` to ``max_lr`` over the first
    ``pct_start`` of ``total_steps`` and anneals to ``initial / final_div_factor``
    (``three_phase``: back to the initial value first). With ``cycle_momentum`` the
    momentum (``momentum``, or ``betas[0]`` for Adam-like optimizers) moves inversely
    between ``max_momentum`` and ``base_momentum``. Steps ``0 .. total_steps - 1`` have
    torch's values; step ``total_steps`` (the one a loop of ``total_steps`` iterations
    reaches with its last ``sched.step()``) holds the last phase's end values,
    ``initial / final_div_factor`` and its momentum, where torch extrapolates past them
    (a negative learning rate with ``anneal_strategy="linear"``). Stepping past
    ``total_steps`` raises. ``max_lr`` and the momenta take one value or one per group.
    """

    kind = "OneCycleLR"

    def __init__(
        self,
        optimizer: Any,
        max_lr: float | Sequence[float],
        total_steps: int,
        pct_start: float = 0.3,
        anneal_strategy: str = "cos",
        cycle_momentum: bool = True,
        base_momentum: float | Sequence[float] = 0.85,
        max_momentum: float | Sequence[float] = 0.95,
        div_factor: float = 25.0,
        final_div_factor: float = 1e4,
        three_phase: bool = False,
    ) -> None:
        groups = len(optimizer.param_groups)
        super().__init__(
            optimizer,
            max_lr=_per_group(max_lr, groups),
            total_steps=total_steps,
            pct_start=pct_start,
            anneal_strategy=anneal_strategy,
            cycle_momentum=cycle_momentum,
            base_momentum=_per_group(base_momentum, groups),
            max_momentum=_per_group(max_momentum, groups),
            div_factor=div_factor,
            final_div_factor=final_div_factor,
            three_phase=three_phase,
        )

    def _checked_config(self, values: Mapping[str, Any]) -> dict[str, Any]:
        k = self.kind
        groups = len(self.optimizer.param_groups)
        cfg = {
            "max_lr": _checked_list(k, "max_lr", values["max_lr"], groups, at_least_zero),
            "total_steps": count(k, "total_steps", values["total_steps"], minimum=1),
            "pct_start": unit_interval(k, "pct_start", values["pct_start"]),
            "anneal_strategy": values["anneal_strategy"],
            "cycle_momentum": flag(k, "cycle_momentum", values["cycle_momentum"]),
            "base_momentum": _checked_list(
                k, "base_momentum", values["base_momentum"], groups, decay_rate
            ),
            "max_momentum": _checked_list(
                k, "max_momentum", values["max_momentum"], groups, decay_rate
            ),
            "div_factor": positive(k, "div_factor", values["div_factor"]),
            "final_div_factor": positive(k, "final_div_factor", values["final_div_factor"]),
            "three_phase": flag(k, "three_phase", values["three_phase"]),
        }
        if cfg["anneal_strategy"] not in ("cos", "linear"):
            raise HyperparameterError(
                f"{k}: anneal_strategy must be 'cos' or 'linear', got {cfg['anneal_strategy']!r}"
            )
        if cfg["cycle_momentum"] and self._momentum_key() is None:
            raise HyperparameterError(
                f"{k}: cycle_momentum needs an optimizer with 'momentum' or 'betas'; "
                f"{type(self.optimizer).__name__} has neither (pass cycle_momentum=False)"
            )
        return cfg

    def _momentum_key(self) -> str | None:
        names = self.optimizer.defaults
        return "betas" if "betas" in names else "momentum" if "momentum" in names else None

    def _phase(self, cfg: Mapping[str, Any], epoch: int, group: int) -> tuple[float, float]:
        """(learning rate, momentum) at ``epoch``, as torch computes them before
        ``total_steps``; at ``total_steps`` the last phase's end (its fraction held at 1)."""
        total, pct = cfg["total_steps"], cfg["pct_start"]
        initial = cfg["max_lr"][group] / cfg["div_factor"]
        peak = cfg["max_lr"][group]
        low = initial / cfg["final_div_factor"]
        m_hi, m_lo = cfg["max_momentum"][group], cfg["base_momentum"][group]
        if cfg["three_phase"]:
            phases = [
                (pct * total - 1, initial, peak, m_hi, m_lo),
                (2 * pct * total - 2, peak, initial, m_lo, m_hi),
                (total - 1, initial, low, m_hi, m_hi),
            ]
        else:
            phases = [
                (pct * total - 1, initial, peak, m_hi, m_lo),
                (total - 1, peak, low, m_lo, m_hi),
            ]
        anneal = _cos_anneal if cfg["anneal_strategy"] == "cos" else _linear_anneal
        start, chosen = 0.0, phases[-1]
        for phase in phases[:-1]:
            if epoch <= phase[0]:
                chosen = phase
                break
            start = phase[0]
        end, lr0, lr1, mom0, mom1 = chosen
        frac = min((epoch - start) / (end - start), 1.0) if end > start else 1.0
        return anneal(lr0, lr1, frac), anneal(mom0, mom1, frac)

    def _lr(self, cfg: Mapping[str, Any], base: float, epoch: int, group: int) -> float:
        return self._phase(cfg, epoch, group)[0]

    def _values(
        self, epoch: int, base_lrs: Sequence[float], cfg: Mapping[str, Any]
    ) -> dict[str, list[Any]]:
        if epoch > cfg["total_steps"]:
            raise HyperparameterError(
                f"{self.kind}: step {epoch} is past total_steps ({cfg['total_steps']})"
            )
        values = super()._values(epoch, base_lrs, cfg)
        key = self._momentum_key()
        if cfg["cycle_momentum"] and key is not None:
            moms = [self._phase(cfg, epoch, i)[1] for i in range(len(base_lrs))]
            groups = self.optimizer.param_groups
            values[key] = (
                [(m, *g["betas"][1:]) for m, g in zip(moms, groups)] if key == "betas" else moms
            )
        return values


def _cos_anneal(start: float, end: float, frac: float) -> float:
    return end + (start - end) / 2.0 * (math.cos(math.pi * frac) + 1)


def _linear_anneal(start: float, end: float, frac: float) -> float:
    return (end - start) * frac + start


def _per_group(value: Any, groups: int) -> Any:
    return list(value) if isinstance(value, (list, tuple)) else [value] * groups


def _checked_list(
    label: str, name: str, values: Any, groups: int, check: Callable[[str, str, Any], float]
) -> list[float]:
    if not isinstance(values, (list, tuple)) or len(values) != groups:
        raise HyperparameterError(f"{label}: {name} needs one value per group ({groups})")
    return [check(label, f"{name}[{i}]", v) for i, v in enumerate(values)]
