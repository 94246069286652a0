"""Initialisers and the randomness convention of layers.

Convention: every layer constructor takes ``rng: numpy.random.Generator | None`` and
draws its initial values from it, in a fixed order (weight, then bias). ``None`` means
``numpy.random.default_rng(0)``, so a layer built alone is reproducible; a model makes
one generator from its ``seed`` and passes it to every layer it builds, in order, so
its layers differ and the model is reproducible from ``seed`` alone. Run-time
randomness (dropout) comes from the session's generator (``EagerSession.rng``).

Distributions match PyTorch's defaults for the same layer: Linear and Conv2d weights
and biases ``U(-1/sqrt(fan_in), 1/sqrt(fan_in))`` (kaiming-uniform with ``a=sqrt(5)``),
Embedding ``N(0, 1)``, LayerNorm ones and zeros, the attention input projection
xavier-uniform with a zero bias.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from ..errors import ConfigError, DTypeError
from ..params import Param


def generator(rng: np.random.Generator | None) -> np.random.Generator:
    """``rng`` itself, or ``default_rng(0)`` for None (the layer convention above)."""
    if rng is None:
        return np.random.default_rng(0)
    if not isinstance(rng, np.random.Generator):
        raise ConfigError(f"rng: expected a numpy.random.Generator or None, got {rng!r}")
    return rng


def float_dtype(dtype: Any) -> np.dtype:
    """``dtype`` as a floating NumPy dtype (names like ``"float64"`` accepted)."""
    try:
        dt = np.dtype(dtype)
    except TypeError:
        raise DTypeError(f"dtype: expected a floating dtype, got {dtype!r}") from None
    if not np.issubdtype(dt, np.floating):
        raise DTypeError(f"dtype: expected a floating dtype, got {dt.name}")
    return dt


def uniform(rng: np.random.Generator, shape: tuple[int, ...], bound: float, dtype: Any) -> Param:
    """A parameter drawn from ``U(-bound, bound)``."""
    return Param(rng.uniform(-bound, bound, size=shape).astype(dtype), dtype=dtype)


def normal(rng: np.random.Generator, shape: tuple[int, ...], std: float, dtype: Any) -> Param:
    """A parameter drawn from ``N(0, std**2)``."""
    return Param(rng.normal(0.0, std, size=shape).astype(dtype), dtype=dtype)


def constant(shape: tuple[int, ...], value: float, dtype: Any) -> Param:
    """A parameter filled with ``value``."""
    return Param(np.full(shape, value, dtype=dtype), dtype=dtype)


def fan_in_bound(fan_in: int) -> float:
    """PyTorch's default bound ``1 / sqrt(fan_in)`` (kaiming-uniform, ``a=sqrt(5)``)."""
    return 1.0 / math.sqrt(fan_in) if fan_in > 0 else 0.0


def fan_in_uniform(
    rng: np.random.Generator, shape: tuple[int, ...], bias: bool, dtype: Any
) -> tuple[Param, Param | None]:
    """A weight of ``shape`` (out, in, ...) and, if ``bias``, a bias (out,), drawn in that
    order from ``U(-b, b)``, ``b = fan_in_bound(in * ...)`` (PyTorch's Linear and Conv)."""
    bound = fan_in_bound(int(np.prod(shape[1:])))
    weight = uniform(rng, shape, bound, dtype)
    return weight, uniform(rng, shape[:1], bound, dtype) if bias else None


def xavier_bound(fan_in: int, fan_out: int) -> float:
    """The xavier-uniform bound ``sqrt(6 / (fan_in + fan_out))``."""
    return math.sqrt(6.0 / (fan_in + fan_out))
