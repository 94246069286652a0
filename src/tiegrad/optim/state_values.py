"""Checks of optimizer state values that no step can produce (C6).

A step refuses non-finite gradients (or skips them), so no moment it stores is NaN
or -inf, and only a sum or average of squares can reach +inf (the square of a finite
gradient can overflow: 300**2 in float16; such an element then moves by 0, as in
PyTorch). Second moments, their running maximum and Adagrad's sums of squares are
never negative, and AMSGrad's maximum is never below the second moment. Loaded state
that breaks one of these (a NaN moment, a negative ``exp_avg_sq``, ``exp_avg`` and
``exp_avg_sq`` swapped) would write NaN into the parameters at the next step, so
``Optimizer.load_state_dict`` refuses it, naming the slot and the state tensor.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from ..errors import CheckpointError

#: State tensors that are sums or averages of squares: never negative.
NON_NEGATIVE = frozenset({"exp_avg_sq", "max_exp_avg_sq", "sum", "square_avg"})
#: ``(larger, smaller)``: the first is an elementwise running maximum of the second.
AT_LEAST = (("max_exp_avg_sq", "exp_avg_sq"),)


def _count(mask: np.ndarray) -> int:
    return int(np.count_nonzero(mask))


def check_state_values(where: str, entries: Mapping[int, Mapping[str, Any]]) -> None:
    """Raise ``CheckpointError`` for the first slot whose state cannot occur.

    ``entries`` maps a slot to its state (name -> array, other names ignored); the
    message names the slot, the tensor, what is wrong and how many elements.
    """
    for slot, entry in entries.items():
        arrays = {k: v for k, v in entry.items() if isinstance(v, np.ndarray)}
        for name, value in arrays.items():
            what = f"{where}: state {name!r} of slot {slot}"
            squares = name in NON_NEGATIVE
            finite = np.isfinite(value)
            bad = value.size - _count(finite | (value == np.inf) if squares else finite)
            if bad:
                allowed = "NaN or -inf" if squares else "NaN or infinite"
                raise CheckpointError(f"{what}: {bad} of {value.size} values are {allowed}")
            if squares and (neg := _count(value < 0)):
                raise CheckpointError(
                    f"{what}: {neg} of {value.size} values are negative; it is a sum or "
                    f"average of squares (are exp_avg and exp_avg_sq swapped?)"
                )
        for high, low in AT_LEAST:
            if high in arrays and low in arrays and (n := _count(arrays[high] < arrays[low])):
                raise CheckpointError(
                    f"{where}: state {high!r} of slot {slot} is below {low!r} at {n} of "
                    f"{arrays[low].size} elements; it is the running maximum of {low!r}"
                )
