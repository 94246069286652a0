"""Plumbing shared by the workloads: data, weight transfer and the training sides.

Both sides of a training workload start from one NumPy weight dict taken from a
freshly built tiegrad model (``training_data``) and train on the same NumPy batches;
the torch side receives the weights by name through ``load_torch`` (strict: every
torch parameter is written exactly once with the expected shape). ``build_training``
makes the sides from one ``Recipe`` per framework.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ..runner import Built, Side

SEED = 0
Batch = tuple[np.ndarray, np.ndarray]


def rng(offset: int = 0) -> np.random.Generator:
    """The data generator of a workload (seeded, so every run sees the same data)."""
    return np.random.default_rng(SEED + offset)


def token_batches(n: int, batch: int, seq: int, vocab: int, offset: int = 0) -> list[Batch]:
    """``n`` language-model batches: int64 inputs ``(batch, seq)`` and next-token targets."""
    g = rng(offset)
    out = []
    for _ in range(n):
        ids = g.integers(0, vocab, size=(batch, seq + 1), dtype=np.int64)
        out.append((np.ascontiguousarray(ids[:, :-1]), np.ascontiguousarray(ids[:, 1:])))
    return out


def tiegrad_weights(model: Any) -> dict[str, np.ndarray]:
    """A copy of every storage of a tiegrad module, by its first name."""
    return {name: np.array(p.value, copy=True) for name, p in model.named_parameters()}


def set_tiegrad_weights(model: Any, weights: Mapping[str, np.ndarray]) -> None:
    """Write ``weights`` (as from ``tiegrad_weights``) into a module built the same way."""
    for name, p in model.named_parameters():
        p.set_value(weights[name])


def load_torch(model: torch.nn.Module, state: Mapping[str, np.ndarray]) -> None:
    """Copy NumPy arrays into ``model``'s parameters by name; names and shapes must match."""
    params = dict(model.named_parameters())
    if set(params) != set(state):
        raise ValueError(
            f"load_torch: torch parameters {sorted(params)} do not match the transferred "
            f"weights {sorted(state)}"
        )
    with torch.no_grad():
        for name, p in params.items():
            arr = state[name]
            if tuple(p.shape) != arr.shape:
                raise ValueError(
                    f"load_torch: {name} has shape {tuple(p.shape)} in torch, got {arr.shape}"
                )
            p.copy_(torch.from_numpy(np.ascontiguousarray(arr, dtype=np.float32)))


def torch_batches(batches: Sequence[Batch]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The same batches as torch tensors sharing the NumPy memory (read-only use)."""
    return [(torch.from_numpy(x), torch.from_numpy(y)) for x, y in batches]


class TorchTrainer:
    """One PyTorch eager training step per call: zero grads, forward, backward, step.

    Without an ``optimizer`` a step is forward and backward only (the model's gradients
    are cleared first).
    """

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer | None,
        loss_fn: Callable[[torch.nn.Module, torch.Tensor, torch.Tensor], torch.Tensor],
        batches: Sequence[Batch],
    ) -> None:
        self.model = model
        self.optimizer = optimizer
        self.loss_fn = loss_fn
        self.batches = torch_batches(batches)
        self.i = 0
        self.loss: torch.Tensor | None = None

    def step(self) -> None:
        x, y = self.batches[self.i % len(self.batches)]
        self.i += 1
        (self.optimizer or self.model).zero_grad(set_to_none=True)
        loss = self.loss_fn(self.model, x, y)
        loss.backward()
        if self.optimizer is not None:
            self.optimizer.step()
        self.loss = loss

    def probe(self) -> float:
        return float(self.loss.item())

    def side(self, name: str = "torch") -> Side:
        return Side(name, "torch", self.step, self.probe)


class TiegradTrainer:
    """One tiegrad training step per call on a persistent session.

    ``loss_fn(model, session, x, y)`` records the forward pass and returns the loss ref; the
    step is ``backward``, then ``session.reset()`` (nothing pins the storages any more, so
    the update is written in place), then ``optimizer.step(gradients)``: the gradients keep
    their recording's uses and are grouped by storage (C4). As the PyTorch step, a step
    starts with ``optimizer.zero_grad()``, which frees the previous step's gradients before
    the forward. Without an ``optimizer`` a step is forward and backward only.
    """

    def __init__(
        self,
        session: Any,
        model: Any,
        optimizer: Any,
        loss_fn: Callable[[Any, Any, np.ndarray, np.ndarray], Any],
        batches: Sequence[Batch],
    ) -> None:
        self.session = session
        self.model = model
        self.optimizer = optimizer
        self.loss_fn = loss_fn
        self.batches = list(batches)
        self.i = 0
        self.loss: Any = None

    def step(self) -> None:
        s = self.session
        x, y = self.batches[self.i % len(self.batches)]
        self.i += 1
        if self.optimizer is not None:
            self.optimizer.zero_grad()
        loss = self.loss_fn(self.model, s, x, y)
        grads = s.backward(loss)
        self.loss = loss.value
        s.reset()
        if self.optimizer is not None:
            self.optimizer.step(grads)

    def probe(self) -> float:
        return float(self.session.backend.to_numpy(self.loss))

    def side(self, name: str = "tiegrad") -> Side:
        return Side(name, "tiegrad", self.step, self.probe)


def wanted(sides: Collection[str] | None, name: str) -> bool:
    """Whether ``build`` should make side ``name`` (``None`` means every side)."""
    return sides is None or name in sides


@dataclass(frozen=True)
class Recipe:
    """How one framework builds its side: ``model()``, ``optimizer(model.parameters())`` and
    the loss of a step, ``loss(model, session, x, y)`` for tiegrad and ``loss(model, x, y)``
    for torch."""

    model: Callable[[], Any]
    optimizer: Callable[[Any], Any]
    loss: Callable[..., Any]


def training_data(make_model: Callable[[], Any], batches: list[Batch]) -> dict[str, Any]:
    """The batches and the initial weights of a freshly built tiegrad model."""
    return {"batches": batches, "weights": tiegrad_weights(make_model())}


def tiegrad_side(
    data: Mapping[str, Any],
    recipe: Recipe,
    name: str = "tiegrad",
    device: str | None = None,
    update: bool = True,
) -> Side:
    """A tiegrad side from ``data["weights"]`` on a persistent session on ``device``.

    A side on a device is optional (``Side.optional``): the device backend may lack what
    the step needs. Making the session raises where the device itself is unavailable.
    ``update=False`` builds no optimizer: a step is forward and backward only.
    """
    from tiegrad import EagerSession

    session = EagerSession(device=device)
    model = recipe.model()
    set_tiegrad_weights(model, data["weights"])
    trainer = TiegradTrainer(
        session,
        model,
        recipe.optimizer(model.parameters()) if update else None,
        recipe.loss,
        data["batches"],
    )
    side = trainer.side(name)
    side.optional = device is not None
    return side


def torch_side(
    data: Mapping[str, Any], recipe: Recipe, name: str = "torch", update: bool = True
) -> Side:
    """A PyTorch eager side with the weights of ``data["weights"]`` (``update=False``: no
    optimizer, a step is forward and backward only)."""
    model = recipe.model()
    load_torch(model, data["weights"])
    optimizer = recipe.optimizer(model.parameters()) if update else None
    trainer = TorchTrainer(model, optimizer, recipe.loss, data["batches"])
    return trainer.side(name)


def build_training(
    data: Mapping[str, Any],
    sides: Collection[str] | None,
    tiegrad: Recipe,
    torch_recipe: Recipe,
    device: str | None = None,
) -> Built:
    """The sides ``tiegrad``, ``torch`` and, with ``device``, the optional ``tiegrad <device>``."""
    built = Built([])
    if wanted(sides, "tiegrad"):
        built.sides.append(tiegrad_side(data, tiegrad))
    device_name = f"tiegrad {device}"
    if device is not None and wanted(sides, device_name):
        try:
            built.sides.append(tiegrad_side(data, tiegrad, device_name, device))
        except Exception as e:  # an optional row: any failure means "not available here"
            built.skipped[device_name] = f"{type(e).__name__}: {e}"
    if wanted(sides, "torch"):
        built.sides.append(torch_side(data, torch_recipe))
    return built


def model_loss(model: Any, session: Any, x: np.ndarray, y: np.ndarray) -> Any:
    """The tiegrad loss of models that define ``loss(session, x, y)`` (``tiegrad.models``)."""
    return model.loss(session, x, y)
