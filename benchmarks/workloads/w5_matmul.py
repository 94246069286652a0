"""W5 matmul-bound: MLP 1024 -> 1024 -> 1024 -> 1024, batch 512, ReLU, plain SGD.

The loss is the mean squared error against a fixed random target. ``extras`` adds the
GEMM-only lower bound: the step's matmul FLOPs (3 forward products, 3 weight
gradients, 2 input gradients; the first layer's input needs none) over this
machine's GEMM rate, measured by timing exactly those eight float32 products through
the host backend's ``matmul`` (oneMKL where ``tiegrad[mkl]`` is installed, else NumPy's
OpenBLAS: the fastest GEMM tiegrad has) as a reference side (``GEMM_SIDE``) that
alternates with the two others, so it sees the same machine load.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from ..runner import REFERENCE, Built, Side, SideStats
from ._common import Recipe, build_training, rng, training_data, wanted
from ._torch_models import MLP

ID = "W5"
TITLE = "matmul-bound"
STEPS = (3, 20)
WIDTH = 1024
LAYERS = 3
BATCH = 512
LR = 0.01
GEMM_SIDE = "GEMM-only"
STEP_GEMMS = 3 * LAYERS - 1
STEP_FLOPS = STEP_GEMMS * 2 * BATCH * WIDTH * WIDTH


def _model() -> Any:
    from tiegrad import nn

    sizes = [WIDTH] * (LAYERS + 1)
    return nn.MLP(sizes[0], sizes[1:-1], sizes[-1], activation="relu", rng=rng())


def _optimizer(params: Any) -> Any:
    from tiegrad.optim import SGD

    return SGD(params, lr=LR)


def _loss(model: Any, session: Any, x: np.ndarray, y: np.ndarray) -> Any:
    from tiegrad import ops

    return ops.mse_loss(model(session, session.constant(x)), y)


def _torch_loss(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(model(x), y)


TIEGRAD = Recipe(_model, _optimizer, _loss)
TORCH = Recipe(
    lambda: MLP([WIDTH] * (LAYERS + 1)),
    lambda params: torch.optim.SGD(params, lr=LR),
    _torch_loss,
)


def make_data() -> dict[str, Any]:
    """One batch (input and regression target) and the initial weights."""
    g = rng(5)
    x = g.standard_normal((BATCH, WIDTH), dtype=np.float32)
    y = g.standard_normal((BATCH, WIDTH), dtype=np.float32)
    return training_data(_model, [(x, y)])


def build(data: dict[str, Any], sides: Collection[str] | None = None) -> Built:
    """The tiegrad and torch sides and the GEMM-only reference side (``GEMM_SIDE``)."""
    built = build_training(data, sides, TIEGRAD, TORCH)
    if wanted(sides, GEMM_SIDE):
        built.sides.append(Side(GEMM_SIDE, REFERENCE, gemm_step(), None))
    return built


def gemm_step() -> Callable[[], None]:
    """The step's eight GEMMs alone, in float32, through the host backend's ``matmul``."""
    from tiegrad.backend import NUMPY

    g = rng(50)
    a = [g.standard_normal((BATCH, WIDTH), dtype=np.float32) for _ in range(LAYERS + 1)]
    w = [g.standard_normal((WIDTH, WIDTH), dtype=np.float32) for _ in range(LAYERS)]
    matmul = NUMPY.matmul

    def step() -> None:
        for i in range(LAYERS):
            matmul(a[i], w[i].T)
        for i in range(LAYERS):
            matmul(a[i + 1].T, a[i])
        for i in range(1, LAYERS):
            matmul(a[i + 1], w[i])

    return step


def extras(stats: dict[str, SideStats]) -> tuple[dict[str, Any], list[str]]:
    """The GEMM-only lower bound and each side's ratio to it."""
    bound = stats[GEMM_SIDE].median_ms
    rate = STEP_FLOPS / (bound * 1e-3) / 1e9
    ratios = {name: s.median_ms / bound for name, s in stats.items() if s.framework != REFERENCE}
    extra = {
        "step_gflop": STEP_FLOPS / 1e9,
        "gemm_gflops": rate,
        "gemm_bound_ms": bound,
        "ratio_to_gemm_bound": ratios,
    }
    per_side = ", ".join(f"{name} {r:.2f}x" for name, r in ratios.items())
    notes = [
        f"GEMM-only lower bound: {STEP_FLOPS / 1e9:.2f} GFLOP per step at {rate:.0f} GFLOP/s "
        f"({_gemm_library()} sgemm, timed alternating with the sides) = {bound:.1f} ms; "
        f"median/bound: {per_side}"
    ]
    return extra, notes


def _gemm_library() -> str:
    """The library behind the host backend's ``matmul``."""
    from tiegrad.backend import blas

    return "oneMKL" if blas.LIBRARY else "NumPy (OpenBLAS)"
