"""``ConfiguredModel``: the base of the reference models, rebuildable from ``config``.

``check_config`` is the one validator of a model configuration: the constructors run
it on their arguments before building anything, and ``tiegrad sample`` runs it on the
configuration a checkpoint file carries (C6).
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, ClassVar

import numpy as np

from ..errors import ConfigError, shown_list
from ..nn import init
from ..nn.layers import get_activation
from ..nn.module import Module
from ..optim import hyperparams
from ..session import EagerSession


def dtype_name(label: str, name: str, value: Any) -> Any:
    """A floating dtype (``init.float_dtype``); the value itself is kept."""
    init.float_dtype(value)
    return value


def listed(value: Any) -> Any:
    """``value`` as ``config`` keeps it: a sequence other than a string as a list, anything
    else as given (never raises; ``check_config`` judges the value)."""
    if isinstance(value, Sequence) and not isinstance(value, (str, bytes)):
        return list(value)
    return value


def activation_name(label: str, name: str, value: Any) -> Any:
    """The name of an activation of ``tiegrad.nn`` (``relu``, ``gelu``, ...)."""
    get_activation(value)
    return value


class ConfiguredModel(Module):
    """A model whose ``config`` holds its constructor arguments: ``type(m)(**m.config)``.

    Subclasses declare ``ARGS``, a checker (``tiegrad.optim.hyperparams`` style) per
    constructor argument other than ``seed`` and ``dtype``.
    """

    ARGS: ClassVar[dict[str, hyperparams.Checker]] = {}
    config: dict[str, Any]

    @classmethod
    def check_config(cls, config: Mapping[str, Any]) -> dict[str, Any]:
        """``config`` checked as the constructor's keyword arguments (C6); returns every
        argument (defaults filled in).

        Every key must be a constructor argument and every argument without a default
        must be present; each value is checked for type and range, then the rules
        between values (``check_relations``). Errors name the model and the argument:
        ``HyperparameterError``, ``ConfigError`` or ``DTypeError``.
        """
        label = cls.__name__
        if not isinstance(config, Mapping):
            raise ConfigError(f"{label}: the configuration must be a mapping, got {config!r:.80}")
        params = list(inspect.signature(cls.__init__).parameters.values())[1:]
        known = {p.name for p in params}
        unknown = sorted(map(str, set(config) - known))
        if unknown:
            raise ConfigError(
                f"{label}: unknown argument(s) {shown_list(unknown)}; it takes "
                f"{', '.join(sorted(known))}"
            )
        missing = [p.name for p in params if p.default is p.empty and p.name not in config]
        if missing:
            raise ConfigError(f"{label}: missing argument(s) {shown_list(missing)}")
        checks: dict[str, hyperparams.Checker] = {
            **cls.ARGS,
            "seed": hyperparams.seed,
            "dtype": dtype_name,
        }
        out = {p.name: config.get(p.name, p.default) for p in params}
        out = {k: checks[k](label, k, v) for k, v in out.items()}
        cls.check_relations(label, out)
        return out

    @classmethod
    def check_relations(cls, label: str, args: Mapping[str, Any]) -> None:
        """Rules between arguments (all present, each already checked); none by default."""

    def _configure(
        self, seed: int, dtype: Any, **args: Any
    ) -> tuple[np.random.Generator, np.dtype]:
        """Check the arguments (``check_config``), set ``config`` to them as the checks
        read them (Python numbers for NumPy scalars and ``Fraction``s, so ``config`` is
        JSON) with the dtype's name; return the generator ``default_rng(seed)`` and the
        dtype."""
        checked = self.check_config(dict(args, seed=seed, dtype=dtype))
        dt = init.float_dtype(dtype)
        self.config = dict(checked, dtype=dt.name)
        return np.random.default_rng(checked["seed"]), dt

    @contextlib.contextmanager
    def _inference(self) -> Iterator[EagerSession]:
        """A host session recording no gradients, with the model in eval mode inside the
        block; every submodule's own training flag is restored afterwards."""
        session = EagerSession()
        modes = [(m, m.training) for _, m in self.named_modules()]
        self.eval()
        try:
            with session.no_grad():
                yield session
        finally:
            for m, mode in modes:
                object.__setattr__(m, "training", mode)  # this module's flag alone

    def extra_repr(self) -> str:
        return ", ".join(f"{k}={v!r}" for k, v in self.config.items())
