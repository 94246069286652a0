"""Batch sources: what the ``Trainer`` draws its batches from.

A batch source has ``epoch(rng)``, an iterator over one epoch's batches that takes
every random choice from the generator it is given, and ``len()``, the number of
batches in an epoch. Because the generator comes from outside, a trainer that
stores the generator's state at the start of an epoch and the number of batches it
consumed can replay the epoch exactly after a restart. ``unit`` and ``count(batch)``
say what a batch holds, for throughput (tokens or samples per second).

``ArrayDataset`` + ``DataLoader`` batch in-memory arrays (samples along axis 0).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, Protocol, runtime_checkable

import numpy as np

from ..errors import ConfigError, ShapeError

Batch = tuple[np.ndarray, ...]


@runtime_checkable
class BatchSource(Protocol):
    """The interface the trainer needs from its training and validation data."""

    unit: str

    def __len__(self) -> int: ...

    def epoch(self, rng: np.random.Generator) -> Iterator[Batch]: ...

    def count(self, batch: Batch) -> int: ...


def check_positive(what: str, value: Any) -> int:
    """``value`` as a positive int, or a ``ConfigError`` naming ``what``."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise ConfigError(f"{what} must be a positive integer, got {value!r}")
    return int(value)


class ArrayDataset:
    """Samples stored as arrays that share their first dimension (features, labels, ...)."""

    def __init__(self, *arrays: Any) -> None:
        if not arrays:
            raise ConfigError("ArrayDataset needs at least one array")
        arrs = tuple(np.asarray(a) for a in arrays)
        for i, a in enumerate(arrs):
            if a.ndim == 0:
                raise ShapeError(f"ArrayDataset: array {i} is a scalar; samples lie along axis 0")
            if a.shape[0] != arrs[0].shape[0]:
                raise ShapeError(
                    f"ArrayDataset: array {i} has {a.shape[0]} samples, "
                    f"expected {arrs[0].shape[0]} (like array 0)"
                )
        self.arrays = arrs

    def __len__(self) -> int:
        return int(self.arrays[0].shape[0])

    def __getitem__(self, index: Any) -> Batch:
        return tuple(a[index] for a in self.arrays)

    def split(self, fraction: float, rng: np.random.Generator) -> tuple[ArrayDataset, ArrayDataset]:
        """Two datasets: a random ``1 - fraction`` of the samples, then the rest."""
        if not 0.0 < fraction < 1.0:
            raise ConfigError(f"ArrayDataset.split: fraction must lie in (0, 1), got {fraction}")
        order = rng.permutation(len(self))
        n_second = max(1, int(round(len(self) * fraction)))
        if n_second >= len(self):
            raise ConfigError(f"ArrayDataset.split: {len(self)} samples cannot be split")
        return ArrayDataset(*self[order[:-n_second]]), ArrayDataset(*self[order[-n_second:]])


class DataLoader:
    """Batches of an ``ArrayDataset``; shuffled (when asked) by the epoch's generator.

    Iterating the loader directly uses its own generator seeded with ``seed``; the
    trainer calls ``epoch(rng)`` with its generator instead.
    """

    unit = "samples"

    def __init__(
        self,
        dataset: ArrayDataset,
        batch_size: int,
        shuffle: bool = True,
        drop_last: bool = False,
        seed: int = 0,
    ) -> None:
        self.batch_size = check_positive("DataLoader: batch_size", batch_size)
        if drop_last and len(dataset) < batch_size:
            raise ConfigError(
                f"DataLoader: drop_last with batch_size {batch_size} leaves no batch "
                f"of a dataset of {len(dataset)} samples"
            )
        self.dataset = dataset
        self.shuffle = shuffle
        self.drop_last = drop_last
        self.rng = np.random.default_rng(seed)

    def __len__(self) -> int:
        n, b = len(self.dataset), self.batch_size
        return n // b if self.drop_last else -(-n // b)

    def epoch(self, rng: np.random.Generator) -> Iterator[Batch]:
        """One pass over the dataset; the order is drawn from ``rng`` when shuffling."""
        n = len(self.dataset)
        order = rng.permutation(n) if self.shuffle else np.arange(n)
        for k in range(len(self)):
            yield self.dataset[order[k * self.batch_size : (k + 1) * self.batch_size]]

    def __iter__(self) -> Iterator[Batch]:
        return self.epoch(self.rng)

    def count(self, batch: Batch) -> int:
        """Samples in ``batch``."""
        return int(batch[0].shape[0])
