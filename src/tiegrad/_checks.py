"""Checks of scalar arguments shared by the ops, the layers and the optimizers (C6).

Each takes ``label`` (``"AdamW group 1"``, ``"layer_norm"``), the argument's name and
its value, and returns the value normalized (a Python ``float``, ``int`` or ``bool``)
or raises ``HyperparameterError`` naming the label, the argument, the allowed range and
the value received. Nothing is written by a check. This module sits below every layer
(it imports only ``errors``); ``tiegrad.optim.hyperparams`` re-exports it beside the
optimizers' own checks.
"""

from __future__ import annotations

import math
from numbers import Integral, Real
from typing import Any

import numpy as np

from .errors import HyperparameterError


def real(label: str, name: str, value: Any) -> float:
    """A finite real number (Python's, NumPy's, a ``Fraction``; bools refused), as a float."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, Real):
        raise HyperparameterError(f"{label}: {name} must be a real number, got {value!r}")
    try:
        x = float(value)
    except OverflowError:  # an int or Fraction beyond float's range
        x = math.inf
    if not math.isfinite(x):
        raise HyperparameterError(f"{label}: {name} must be finite, got {value!r}")
    return x


def at_least_zero(label: str, name: str, value: Any) -> float:
    """A finite number >= 0."""
    x = real(label, name, value)
    if x < 0:
        raise HyperparameterError(f"{label}: {name} must be >= 0, got {value!r}")
    return x


def positive(label: str, name: str, value: Any) -> float:
    """A finite number > 0."""
    x = real(label, name, value)
    if x <= 0:
        raise HyperparameterError(f"{label}: {name} must be > 0, got {value!r}")
    return x


def unit_interval(label: str, name: str, value: Any) -> float:
    """A number in [0, 1]."""
    x = real(label, name, value)
    if not 0.0 <= x <= 1.0:
        raise HyperparameterError(f"{label}: {name} must be in [0, 1], got {value!r}")
    return x


def decay_rate(label: str, name: str, value: Any) -> float:
    """A number in [0, 1): a running-average coefficient such as a beta."""
    x = real(label, name, value)
    if not 0.0 <= x < 1.0:
        raise HyperparameterError(f"{label}: {name} must be in [0, 1), got {value!r}")
    return x


def flag(label: str, name: str, value: Any) -> bool:
    """A bool (``True``/``False``; numbers are refused so typos do not pass)."""
    if not isinstance(value, (bool, np.bool_)):
        raise HyperparameterError(f"{label}: {name} must be True or False, got {value!r}")
    return bool(value)


def count(label: str, name: str, value: Any, minimum: int = 0) -> int:
    """An integer >= ``minimum`` (bools refused)."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, Integral):
        raise HyperparameterError(f"{label}: {name} must be an integer, got {value!r}")
    if value < minimum:
        raise HyperparameterError(f"{label}: {name} must be >= {minimum}, got {value!r}")
    return int(value)


def size(label: str, name: str, value: Any) -> int:
    """An integer >= 1: a width, a count of layers, a vocabulary size."""
    return count(label, name, value, minimum=1)
