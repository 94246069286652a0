"""W4 optimizer: one Adam step over 300 tensors with given gradients.

100 tensors of 256x256, 100 of 256 and 100 of 64x64, float32, lr 1e-3 and Adam's
default betas and eps. The gradients are fixed arrays made once; a step is the
optimizer update alone. PyTorch runs twice: its default CPU Adam and ``fused=True``
(its fastest CPU path, the goal's reference). The probe is the sum of squares of the
first tensor after the step.
"""

from __future__ import annotations

from collections.abc import Collection

import numpy as np
import torch

from ..runner import Built, Side
from ._common import rng, wanted

ID = "W4"
TITLE = "optimizer"
STEPS = (3, 40)
SHAPES = [(256, 256)] * 100 + [(256,)] * 100 + [(64, 64)] * 100
LR = 1e-3

Data = tuple[list[np.ndarray], list[np.ndarray]]


def make_data() -> Data:
    """Initial values and the fixed gradients, one pair per tensor."""
    g = rng(4)
    params = [g.standard_normal(s, dtype=np.float32) for s in SHAPES]
    grads = [g.standard_normal(s, dtype=np.float32) for s in SHAPES]
    return params, grads


def _tiegrad_side(params: list[np.ndarray], grads: list[np.ndarray]) -> Side:
    from tiegrad import ParamList
    from tiegrad.optim import Adam

    plist = ParamList.of_pack(params)
    opt = Adam(plist, lr=LR)
    first = plist[0]

    def step() -> None:
        opt.step(grads)

    def probe() -> float:
        return float(np.square(first.value, dtype=np.float64).sum())

    return Side("tiegrad", "tiegrad", step, probe)


def _torch_side(name: str, params: list[np.ndarray], grads: list[np.ndarray], fused: bool) -> Side:
    tensors = [torch.nn.Parameter(torch.tensor(p)) for p in params]
    for t, g in zip(tensors, grads):
        t.grad = torch.from_numpy(g)  # shares the given gradient, as the tiegrad side does
    opt = torch.optim.Adam(tensors, lr=LR, fused=fused or None)
    first = tensors[0]

    def probe() -> float:
        return float(first.detach().double().square().sum())

    return Side(name, "torch", opt.step, probe)


def build(data: Data, sides: Collection[str] | None = None) -> Built:
    params, grads = data
    out = []
    if wanted(sides, "tiegrad"):
        out.append(_tiegrad_side(params, grads))
    if wanted(sides, "torch"):
        out.append(_torch_side("torch", params, grads, fused=False))
    if wanted(sides, "torch fused"):
        out.append(_torch_side("torch fused", params, grads, fused=True))
    return Built(out)
