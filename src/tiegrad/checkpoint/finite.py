"""Values read from a file are finite, unless the caller opts in (C6).

Every loader of stored weights (``tiegrad.load``, ``GPT2.from_pretrained`` and
``load_weights``, ``load_adapter``) turns a stored tensor into the value it writes
through ``finite_cast``, while it checks, before anything is written (C6). A NaN or an
infinity in a weight makes every later loss NaN, and the first step would blame the
gradient; refusing it on load names the file and the tensor instead. A float64 value
beyond the target dtype's range becomes an infinity in the cast and counts as
non-finite. ``allow_nonfinite=True`` on each loader loads such values as they are.
"""

from __future__ import annotations

import numpy as np
from numpy.typing import DTypeLike

from ..errors import CheckpointError


def finite_cast(
    stored: np.ndarray, dtype: DTypeLike, what: str, allow_nonfinite: bool = False
) -> np.ndarray:
    """``stored`` cast to ``dtype`` (no copy when it has that dtype already).

    Unless ``allow_nonfinite``, a result holding NaN or an infinity is a
    ``CheckpointError``: ``what`` (the file and the tensor, e.g. ``"model.safetensors:
    tensor 'h.0.attn.c_attn.weight'"``) holds N non-finite values, with how many of them
    are finite stored values that overflowed ``dtype``.
    """
    with np.errstate(over="ignore"):  # an overflow is counted below, not warned about
        value = stored.astype(dtype, copy=False)
    if allow_nonfinite:
        return value
    bad = _nonfinite(value)
    if bad:
        plural = "s" if bad != 1 else ""
        overflowed = bad - _nonfinite(stored) if value is not stored else 0
        cause = (
            f", {overflowed} of them finite {stored.dtype} values beyond {value.dtype}'s range"
            if overflowed
            else ""
        )
        raise CheckpointError(
            f"{what} holds {bad} non-finite value{plural} (NaN or Inf) among {value.size}"
            f"{cause}; pass allow_nonfinite=True to load {'them' if plural else 'it'} anyway"
        )
    return value


def _nonfinite(value: np.ndarray) -> int:
    """How many elements of ``value`` are NaN or infinite."""
    return value.size - int(np.count_nonzero(np.isfinite(value)))
