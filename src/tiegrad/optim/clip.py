"""Gradient clipping over canonical gradients: each storage counted once (C4, C5).

Both functions take the per-slot list form that ``Optimizer.step`` accepts (one entry
per slot, None at frozen and alias slots), as returned by
``opt.canonical_gradients(...)`` or ``ParamList.canonical_gradients``. Like PyTorch's
``clip_grad_norm_`` they clip in place and ``clip_grad_norm`` returns the total norm:
the list's entries are replaced by clipped arrays, while the arrays themselves (which
may be borrowed from a tape, C8) are never written. The list then goes into ``step``::

    grads = opt.canonical_gradients(session.backward(loss))
    norm = clip_grad_norm(grads, max_norm=1.0)
    opt.step(grads)

Because a tied storage appears once (its summed gradient at its canonical slot), the
global norm counts it once, as PyTorch does for a tied module.

An entry is a floating ndarray or, for a 0-d gradient, a NumPy floating scalar (what
NumPy arithmetic on 0-d arrays returns); every clipped entry written to the list is an
ndarray of the input's dtype and shape, 0-d ones included.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from ..errors import DTypeError, HyperparameterError, NonFiniteError
from .hyperparams import at_least_zero
from .norms import vector_norm


def _arrays(what: str, gradients: Sequence[Any]) -> list[np.ndarray | None]:
    """The entries of ``gradients`` as floating ndarrays (a NumPy floating scalar as a
    0-d array), None kept; ``DTypeError`` naming the first other entry's slot and type."""
    if isinstance(gradients, (str, bytes)) or not isinstance(gradients, Sequence):
        raise DTypeError(
            f"{what}: expected a per-slot list of gradients, got {type(gradients).__name__}"
        )
    out: list[np.ndarray | None] = []
    for i, g in enumerate(gradients):
        if g is None or (isinstance(g, np.ndarray) and g.dtype.kind == "f"):
            out.append(g)
        elif isinstance(g, np.floating):
            out.append(np.asarray(g))
        else:
            if isinstance(g, np.ndarray):
                got = f"an ndarray of dtype {g.dtype.name}"
            elif isinstance(g, np.generic):
                got = f"a NumPy scalar of dtype {g.dtype.name}"
            else:
                got = f"an object of type {type(g).__name__}"
            raise DTypeError(
                f"{what}: slot {i} holds {got}, expected a floating ndarray or a NumPy "
                f"floating scalar"
            )
    return out


def total_norm(gradients: Sequence[np.ndarray | None], norm_type: float = 2.0) -> float:
    """The ``norm_type``-norm of all entries together (None entries skipped).

    Computed as PyTorch's ``clip_grad_norm_`` does: the norm of the per-entry norms.
    ``norm_type`` is a positive number or ``math.inf``.
    """
    grads = _arrays("total_norm", gradients)
    p = _norm_type("total_norm", norm_type)
    norms = np.array([vector_norm(g, p) for g in grads if g is not None], dtype=np.float64)
    return vector_norm(norms, p)


def clip_grad_norm(
    gradients: list[np.ndarray | None],
    max_norm: float,
    norm_type: float = 2.0,
    *,
    error_if_nonfinite: bool = False,
) -> float:
    """Scale all gradients together so their global norm is at most ``max_norm``.

    Returns the total norm before clipping. When ``max_norm / (total_norm + 1e-6)`` is
    below 1 (PyTorch's rule) every entry of the list is replaced by the array times that
    factor; otherwise the list is left as it is. A non-finite norm (a NaN or infinity
    in the gradients, or inf, as torch reports it, when finite gradients' norm
    overflows float64) leaves the gradients as they are (the optimizer's ``nonfinite``
    policy then applies), or raises ``NonFiniteError`` with ``error_if_nonfinite``.
    Everything is checked first (C6).
    """
    grads = _arrays("clip_grad_norm", gradients)
    _check_list("clip_grad_norm", gradients)
    max_norm = at_least_zero("clip_grad_norm", "max_norm", max_norm)
    norm = total_norm(grads, norm_type)
    if not math.isfinite(norm):
        if error_if_nonfinite:
            raise NonFiniteError(
                f"clip_grad_norm: the total {norm_type}-norm of the gradients is {norm}"
            )
        return norm
    coef = clip_coefficient(max_norm, norm)
    if coef is not None:
        gradients[:] = [None if g is None else np.asarray(g * coef) for g in grads]
    return norm


def clip_coefficient(max_norm: float, norm: float) -> float | None:
    """The factor that clips gradients of total ``norm`` (finite) to ``max_norm``,
    PyTorch's ``max_norm / (norm + 1e-6)``, or None where it is not below 1 (no clipping)."""
    coef = max_norm / (norm + 1e-6)
    return coef if coef < 1.0 else None


def clip_grad_value(gradients: list[np.ndarray | None], clip_value: float) -> None:
    """Clamp every gradient element to ``[-clip_value, clip_value]``, replacing list entries
    (each by an ndarray of its dtype and shape)."""
    grads = _arrays("clip_grad_value", gradients)
    _check_list("clip_grad_value", gradients)
    v = at_least_zero("clip_grad_value", "clip_value", clip_value)
    gradients[:] = [None if g is None else np.asarray(np.clip(g, -v, v)) for g in grads]


def _check_list(what: str, gradients: Sequence[Any]) -> None:
    if not isinstance(gradients, list):
        raise DTypeError(
            f"{what}: expected a list (its entries are replaced by the clipped gradients), "
            f"got {type(gradients).__name__}"
        )


def _norm_type(what: str, norm_type: Any) -> float:
    if norm_type == math.inf:
        return math.inf
    try:
        p = float(norm_type)
    except (TypeError, ValueError, OverflowError):
        p = math.nan
    if not (math.isfinite(p) and p > 0):
        raise HyperparameterError(
            f"{what}: norm_type must be a positive number or math.inf, got {norm_type!r}"
        )
    return p
