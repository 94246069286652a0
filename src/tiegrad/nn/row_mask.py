"""``train_rows``: let an optimizer update only some rows of a module's weight.

The mask belongs to the weight's storage (``ParameterStorage.train_rows``,
``tiegrad.params.rows``), so it holds for every use of a tie: the rows of a tied
embedding that train, train in both uses, and the others stay bit-identical (C1).
"""

from __future__ import annotations

from typing import Any

from .module import Module


def train_rows(module: Module, path: str, rows: Any) -> None:
    """Train only ``rows`` (first axis) of the weight at ``path`` of ``module``.

    ``rows``: row indices, a boolean mask of one flag per row or a ``range``; None trains
    every row again. Every optimizer step, whatever its rule and device, then updates
    those rows alone, with optimizer state, weight decay and gradient clipping over them
    alone. An unknown path, or rows the weight does not have, is an error naming the
    path and the rows; nothing changes then (C6).
    """
    param = module.get_parameter(path)
    param.storage.train_rows(rows, f"train_rows({path!r})")


def trained_rows(module: Module, path: str) -> Any:
    """The rows of the weight at ``path`` that train (ascending), or None: every row."""
    return module.get_parameter(path).storage.trained_rows
