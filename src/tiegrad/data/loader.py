"""Batch sources: what the ``Trainer`` draws its batches from.

A batch source has ``epoch(rng)``, an iterator over one epoch's batches that takes
every random choice from the generator it is given, and ``len()``, the number of
batches in an epoch. Because the generator comes from outside, a trainer that
stores the generator's state at the start of an epoch and the number of batches it
consumed can replay the epoch exactly after a restart. ``unit`` and ``count(batch)``
say what a batch holds, for throughput (tokens or samples per second).

``ArrayDataset`` + ``DataLoader`` batch in-memory arrays (samples along axis 0).

Data parallel: a loader with ``rank``/``world_size`` (by default those of an
initialised ``tiegrad.distributed`` group, read when an epoch starts) still draws
every global batch, from the same generator calls as a single process, and yields
this rank's contiguous shard of it (``Shard``): the shards of one global batch are
disjoint and together the whole batch, and the sequence of global batches does not
depend on the number of processes.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from numbers import Real
from typing import Any, Protocol, runtime_checkable

import numpy as np

from .. import _checks
from ..errors import ConfigError, DTypeError, ShapeError

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


def check_fraction(what: str, value: Any) -> float:
    """``value`` as a float when it is a real number (Python or NumPy, not a bool) in
    (0, 1); else a ``ConfigError`` naming ``what``."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, Real):
        raise ConfigError(f"{what} must be a real number, got {value!r:.80}")
    if not 0.0 < value < 1.0:
        raise ConfigError(f"{what} must lie in (0, 1), got {value}")
    return float(value)


def check_rng(label: str, rng: Any, legacy: bool = False) -> Any:
    """``rng`` itself when it is a ``numpy.random.Generator`` (or, with ``legacy``, where
    only ``permutation`` is drawn, a ``RandomState``), else a ``ConfigError`` naming
    ``label`` (a seed or None is not turned into a generator)."""
    kinds = (np.random.Generator, np.random.RandomState) if legacy else np.random.Generator
    if not isinstance(rng, kinds):
        raise ConfigError(
            f"{label}: rng must be a numpy.random.Generator (np.random.default_rng(seed)), "
            f"got {type(rng).__name__}"
        )
    return rng


class Shard:
    """This rank's part of every global batch; ``None`` means the group's (or 0 of 1)."""

    def __init__(self, what: str, rank: int | None, world_size: int | None) -> None:
        if (rank is None) != (world_size is None):
            raise ConfigError(f"{what}: give both rank and world_size, or neither")
        if world_size is not None:
            world_size = check_positive(f"{what}: world_size", world_size)
            if isinstance(rank, bool) or not isinstance(rank, (int, np.integer)):
                raise ConfigError(f"{what}: rank must be an integer, got {rank!r}")
            if not 0 <= rank < world_size:
                raise ConfigError(f"{what}: rank {rank} is outside 0..{world_size - 1}")
        self.what = what
        self.fixed = None if world_size is None else (int(rank), world_size)

    def resolve(self, batch_size: int, last: int = 0) -> tuple[int, int]:
        """``(rank, world_size)``, or a ``ConfigError`` if the batches cannot be shared.

        ``batch_size`` must split evenly over the ranks, and so must a last, partial
        batch of ``last`` samples (0: none): each rank's loss is the mean over its shard
        and the ranks' gradients are averaged, which weighs every sample alike only when
        the shards are equal.
        """
        if self.fixed is not None:
            rank, world = self.fixed
        else:
            from ..distributed import group

            rank, world = group.rank(), group.world_size()
        if batch_size % world:
            raise ConfigError(
                f"{self.what}: the global batch size {batch_size} does not split evenly over "
                f"{world} processes"
            )
        if last % world:
            raise ConfigError(
                f"{self.what}: the last batch of {last} samples does not split evenly over "
                f"{world} processes, whose averaged gradients would weigh its samples "
                "unequally (use drop_last=True, or a dataset size that splits)"
            )
        return rank, world

    def part(self, n: int, rank: int, world: int) -> slice:
        """The rank's contiguous part of ``n`` items, ``n`` a multiple of ``world``."""
        return slice(n * rank // world, n * (rank + 1) // world)


class ArrayDataset:
    """Samples stored as arrays that share their first dimension (features, labels, ...).

    Each array has one NumPy dtype (numbers, or strings for a ``loss_fn`` that reads
    them); a ragged list or an array of Python objects is a ``DTypeError`` naming it.
    """

    def __init__(self, *arrays: Any) -> None:
        if not arrays:
            raise ConfigError("ArrayDataset needs at least one array")
        arrs = []
        for i, a in enumerate(arrays):
            try:
                arr = np.asarray(a)
            except ValueError:  # NumPy refuses ragged nested lists
                raise DTypeError(
                    f"ArrayDataset: array {i} is ragged (its rows differ in length)"
                ) from None
            if arr.dtype.kind == "O":
                raise DTypeError(
                    f"ArrayDataset: array {i} holds Python objects; give an array of one "
                    "NumPy dtype (numbers, or strings for a loss_fn that reads them)"
                )
            arrs.append(arr)
        for i, a in enumerate(arrs):
            if a.ndim == 0:
                raise ShapeError(f"ArrayDataset: array {i} is a scalar; samples lie along axis 0")
            if a.shape[0] != arrs[0].shape[0]:
                raise ShapeError(
                    f"ArrayDataset: array {i} has {a.shape[0]} samples, "
                    f"expected {arrs[0].shape[0]} (like array 0)"
                )
        self.arrays = tuple(arrs)

    def __len__(self) -> int:
        return int(self.arrays[0].shape[0])

    def __getitem__(self, index: Any) -> Batch:
        return tuple(a[index] for a in self.arrays)

    def split(self, fraction: float, rng: np.random.Generator) -> tuple[ArrayDataset, ArrayDataset]:
        """Two datasets: a random ``1 - fraction`` of the samples, then the rest.

        ``fraction`` is a real number (not a bool or a string) in (0, 1); ``rng`` a
        ``numpy.random.Generator``."""
        if isinstance(fraction, (bool, np.bool_)) or not isinstance(fraction, Real):
            raise ConfigError(
                f"ArrayDataset.split: fraction must be a real number, got {fraction!r:.80}"
            )
        check_rng("ArrayDataset.split", rng, legacy=True)
        if not 0.0 < fraction < 1.0:
            raise ConfigError(f"ArrayDataset.split: fraction must lie in (0, 1), got {fraction}")
        order = rng.permutation(len(self))
        n_second = max(1, int(round(len(self) * fraction)))
        if n_second >= len(self):
            raise ConfigError(f"ArrayDataset.split: {len(self)} samples cannot be split")
        return ArrayDataset(*self[order[:-n_second]]), ArrayDataset(*self[order[-n_second:]])


def check_dataset(label: str, dataset: Any) -> None:
    """A ``ConfigError`` naming ``label`` unless ``dataset`` is an ``ArrayDataset`` or a
    dataset object (``len()``, and ``dataset[index_array]`` gives a tuple of arrays).

    Plain arrays, lists, tuples, mappings and strings are refused: indexed by an array of
    sample indices they do not give a tuple of arrays (wrap them: ``ArrayDataset(x, y)``).
    """
    plain = (np.ndarray, Sequence, Mapping, str, bytes)
    if isinstance(dataset, ArrayDataset):
        return
    if isinstance(dataset, plain) or not all(
        hasattr(dataset, m) for m in ("__len__", "__getitem__")
    ):
        raise ConfigError(
            f"{label}: dataset must be an ArrayDataset (or a dataset whose [index array] is a "
            f"tuple of arrays), got {type(dataset).__name__}; wrap arrays as ArrayDataset(x, y)"
        )


def check_batch(label: str, batch: Any) -> Batch:
    """``batch`` (a non-empty tuple or list of NumPy arrays) as a tuple, else a
    ``ConfigError``."""
    if not (
        isinstance(batch, (tuple, list)) and batch and all(isinstance(a, np.ndarray) for a in batch)
    ):
        raise ConfigError(
            f"{label}: dataset[index array] must be a tuple of NumPy arrays, "
            f"got {type(batch).__name__}"
        )
    return tuple(batch)


class DataLoader:
    """Batches of an ``ArrayDataset`` (or of a dataset whose ``[index array]`` is a tuple
    of arrays); shuffled (when asked) by the epoch's generator.

    Iterating the loader directly uses its own generator seeded with ``seed``; the
    trainer calls ``epoch(rng)`` with its generator instead. ``batch_size`` is the
    global batch; with several processes each yields its shard (module docstring).
    The last, partial batch (``drop_last=False``) must split evenly over the
    processes too, so that every sample weighs the same in the averaged gradient;
    otherwise a ``ConfigError`` is raised by the constructor (given
    ``rank``/``world_size``) or when an epoch starts (group's), before any batch.

    Checked first, before anything is built: ``dataset`` (``check_dataset``), then
    ``shuffle``, ``drop_last`` (bools) and ``seed`` (an integer >= 0), which raise
    ``HyperparameterError`` as tiegrad's other scalar arguments (``tiegrad._checks``);
    ``epoch`` checks its generator when called, before any batch is drawn.
    """

    unit = "samples"

    def __init__(
        self,
        dataset: ArrayDataset,
        batch_size: int,
        shuffle: bool = True,
        drop_last: bool = False,
        seed: int = 0,
        rank: int | None = None,
        world_size: int | None = None,
    ) -> None:
        check_dataset("DataLoader", dataset)
        shuffle = _checks.flag("DataLoader", "shuffle", shuffle)
        drop_last = _checks.flag("DataLoader", "drop_last", drop_last)
        seed = _checks.count("DataLoader", "seed", seed)
        self.shard = Shard("DataLoader", rank, world_size)
        self.batch_size = check_positive("DataLoader: batch_size", batch_size)
        if drop_last and len(dataset) < batch_size:
            raise ConfigError(
                f"DataLoader: drop_last with batch_size {batch_size} leaves no batch "
                f"of a dataset of {len(dataset)} samples"
            )
        self.partial = 0 if drop_last else len(dataset) % self.batch_size
        if self.shard.fixed is not None:
            self.shard.resolve(self.batch_size, self.partial)
        self.dataset = dataset
        self.shuffle = shuffle
        self.drop_last = drop_last
        self.rng = np.random.default_rng(seed)

    def __len__(self) -> int:
        n, b = len(self.dataset), self.batch_size
        return n // b if self.drop_last else -(-n // b)

    def epoch(self, rng: np.random.Generator) -> Iterator[Batch]:
        """One pass over the dataset; the order is drawn from ``rng`` (a
        ``numpy.random.Generator``, checked at this call) when shuffling."""
        return self._epoch(check_rng("DataLoader.epoch", rng, legacy=True))

    def _epoch(self, rng: np.random.Generator) -> Iterator[Batch]:
        rank, world = self.shard.resolve(self.batch_size, self.partial)
        n = len(self.dataset)
        order = rng.permutation(n) if self.shuffle else np.arange(n)
        for k in range(len(self)):
            batch = order[k * self.batch_size : (k + 1) * self.batch_size]
            yield check_batch(
                "DataLoader", self.dataset[batch[self.shard.part(len(batch), rank, world)]]
            )

    def __iter__(self) -> Iterator[Batch]:
        return self.epoch(self.rng)

    def count(self, batch: Batch) -> int:
        """Samples in ``batch``."""
        return int(batch[0].shape[0])
