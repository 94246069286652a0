"""M2 the head's loss alone: ``ops.linear_cross_entropy`` against PyTorch's unfused loss.

A Qwen2.5-0.5B-shaped head: 2,048 tokens, hidden 896, vocabulary 151,936, float32.
One step is the mean cross-entropy of ``h @ W.T`` against random targets, forward and
backward, giving the gradients of ``h`` and ``W``. The tiegrad side runs the fused op,
which never holds the (tokens x vocabulary) logits; the torch side
``F.cross_entropy(h @ W.T, t)`` and ``backward``, which holds them and their gradient.
The reference side (``GEMM_SIDE``) times the three matrix products that any exact
route computes (the logits, and the products giving the two gradients), through the
host backend's ``matmul`` into preallocated outputs: the bound the op is measured
against, at this machine's sgemm rate as it is during the run.

``extras`` adds the ratio to that bound and the tiegrad step's peak memory beyond its
inputs and the gradients it returns, traced by ``tracemalloc`` during every tiegrad
step (NumPy reports its arrays to it; BLAS's own buffers are not counted).
"""

from __future__ import annotations

import tracemalloc
from collections.abc import Callable, Collection
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from ..runner import REFERENCE, Built, Side, SideStats
from ._common import rng, wanted

ID = "M2"
TITLE = "head loss, 152k vocabulary"
STEPS = (1, 1)
TOKENS, HIDDEN, VOCAB = 2048, 896, 151936
QUICK_TOKENS, QUICK_HIDDEN, QUICK_VOCAB = 64, 32, 1000
GEMM_SIDE = "3 GEMMs"
_PEAK: dict[str, float] = {}  # the latest tiegrad step's traced figures, for ``extras``


def _data(tokens: int, hidden: int, vocab: int) -> dict[str, Any]:
    g = rng(20)
    return {
        "h": g.standard_normal((tokens, hidden), dtype=np.float32),
        "w": g.standard_normal((vocab, hidden), dtype=np.float32) * np.float32(0.02),
        "t": g.integers(0, vocab, size=tokens, dtype=np.int64),
    }


def make_data() -> dict[str, Any]:
    """The hidden states, the head's weight and the targets at the benchmark's shape."""
    return _data(TOKENS, HIDDEN, VOCAB)


def make_quick_data() -> dict[str, Any]:
    """The same at a tiny shape, for the quick run."""
    return _data(QUICK_TOKENS, QUICK_HIDDEN, QUICK_VOCAB)


def build(data: dict[str, Any], sides: Collection[str] | None = None) -> Built:
    """The tiegrad (fused) and torch (unfused) sides and the three products' side."""
    built = Built([])
    if wanted(sides, "tiegrad"):
        built.sides.append(Side("tiegrad", "tiegrad", *tiegrad_step(data)))
    if wanted(sides, "torch"):
        built.sides.append(Side("torch", "torch", *torch_step(data)))
    if wanted(sides, GEMM_SIDE):
        built.sides.append(Side(GEMM_SIDE, REFERENCE, gemm_step(data), None))
    return built


def tiegrad_step(data: dict[str, Any]) -> tuple[Callable[[], None], Callable[[], float]]:
    """One fused loss and its backward, traced: the peak beyond the inputs and the two
    gradients goes to ``_PEAK``."""
    from tiegrad import EagerSession, ops

    h, w, t = data["h"], data["w"], data["t"]
    last: dict[str, float] = {}

    def step() -> None:
        started = not tracemalloc.is_tracing()
        if started:
            tracemalloc.start()
        try:
            s = EagerSession()
            hr, wr = s.leaf(h), s.leaf(w)
            tracemalloc.reset_peak()
            base = tracemalloc.get_traced_memory()[0]
            loss = ops.linear_cross_entropy(hr, wr, t)
            grads = s.backward(loss)
            peak = tracemalloc.get_traced_memory()[1]
            returned = grads[hr].nbytes + grads[wr].nbytes
        finally:
            if started:
                tracemalloc.stop()
        _PEAK["beyond_mib"] = (peak - base - returned) / 2**20
        last["loss"] = float(loss.value)

    return step, lambda: last["loss"]


def torch_step(data: dict[str, Any]) -> tuple[Callable[[], None], Callable[[], float]]:
    """``F.cross_entropy(h @ W.T, t)`` and its backward: the logits held."""
    h = torch.tensor(data["h"], requires_grad=True)
    w = torch.tensor(data["w"], requires_grad=True)
    t = torch.tensor(data["t"])
    last: dict[str, float] = {}

    def step() -> None:
        h.grad = w.grad = None
        loss = F.cross_entropy(h @ w.T, t)
        loss.backward()
        last["loss"] = loss.item()

    return step, lambda: last["loss"]


def gemm_step(data: dict[str, Any]) -> Callable[[], None]:
    """The three products of the loss's gradients at full size, into outputs made once:
    ``z = h @ W.T``, ``z @ W`` and ``z.T @ h``."""
    from tiegrad.backend import NUMPY

    h, w = data["h"], data["w"]
    z = np.empty((h.shape[0], w.shape[0]), np.float32)
    gh, gw = np.empty_like(h), np.empty_like(w)
    mm = NUMPY.scaled_matmul

    def step() -> None:
        mm(h, w.T, 1.0, out=z)
        mm(z, w, 1.0, out=gh)
        mm(z.T, h, 1.0, out=gw)

    return step


def extras(stats: dict[str, SideStats]) -> tuple[dict[str, Any], list[str]]:
    """The ratios to the three products' time and the tiegrad step's traced peak."""
    bound = stats[GEMM_SIDE].median_ms
    ratios = {name: s.median_ms / bound for name, s in stats.items() if s.framework != REFERENCE}
    beyond = _PEAK.get("beyond_mib")
    extra = {
        "gemm_bound_ms": bound,
        "ratio_to_gemm_bound": ratios,
        "tiegrad_peak_beyond_inputs_and_gradients_mib": beyond,
    }
    per_side = ", ".join(f"{name} {r:.2f}x" for name, r in ratios.items())
    notes = [
        f"three products alone: {bound:.0f} ms; median/bound: {per_side}",
        f"tiegrad peak beyond inputs and returned gradients (tracemalloc): {beyond:.1f} MiB",
    ]
    return extra, notes
