"""Hyperparameter checks shared by the optimizers and schedules (C6).

Each checker takes ``label`` (``"AdamW group 1"``), the hyperparameter's name and its
value, and returns the value normalized (a Python ``float``, ``bool`` or pair of
floats) or raises ``HyperparameterError`` naming the label, the hyperparameter, the
allowed range and the value received. Nothing is ever written by a check, so an
optimizer can validate everything before its first write.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

import numpy as np

from .. import _checks
from ..errors import HyperparameterError
from ..params.groups import check_learning_rate

Checker = Callable[[str, str, Any], Any]

# The scalar checks live below every layer (``tiegrad._checks``: the ops use them too).
real, at_least_zero, positive = _checks.real, _checks.at_least_zero, _checks.positive
unit_interval, decay_rate, flag = _checks.unit_interval, _checks.decay_rate, _checks.flag
count, size = _checks.count, _checks.size


def learning_rate(label: str, name: str, value: Any) -> float:
    """A finite learning rate >= 0 (the check of ``tiegrad.params``)."""
    try:
        return check_learning_rate(value)
    except HyperparameterError as e:
        raise HyperparameterError(f"{label}: {e}") from None


def betas(label: str, name: str, value: Any) -> tuple[float, float]:
    """A pair ``(beta1, beta2)``, each in [0, 1)."""
    if isinstance(value, (str, bytes)) or not isinstance(value, (tuple, list)) or len(value) != 2:
        raise HyperparameterError(f"{label}: {name} must be a pair (beta1, beta2), got {value!r}")
    return (
        decay_rate(label, f"{name}[0]", value[0]),
        decay_rate(label, f"{name}[1]", value[1]),
    )


#: Integers of configurations are below INT64_LIMIT (TOML's range, a C ``int64``).
INT64_LIMIT = 2**63


def seed(label: str, name: str, value: Any) -> int:
    """A seed: an integer in [0, ``INT64_LIMIT``)."""
    x = count(label, name, value)
    if x >= INT64_LIMIT:
        raise HyperparameterError(
            f"{label}: {name} must be < 2**63, got an integer of {x.bit_length()} bits"
        )
    return x


def plain(values: Mapping[str, Any]) -> dict[str, Any]:
    """Hyperparameters as JSON values (tuples become lists), for a ``state_dict``."""
    return {k: list(v) if isinstance(v, tuple) else v for k, v in values.items()}


def check_eps_in(label: str, eps: float, dtypes: Iterable[np.dtype]) -> None:
    """``eps`` must stay > 0 once rounded to each parameter dtype (1e-50 is 0 in float32)."""
    for dt in dtypes:
        if not dt.type(eps) > 0:
            raise HyperparameterError(
                f"{label}: eps={eps!r} rounds to 0 in {dt.name}; use a value representable "
                f"in {dt.name}"
            )
