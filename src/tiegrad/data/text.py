"""``TextDataset``: a token stream with a train/validation split and random windows.

The text is encoded once (character or byte vocabulary, ``Vocab``) and split in two
contiguous parts: the first ``1 - val_fraction`` for training, the rest for
validation. A training batch is ``batch_size`` windows of ``block_size + 1`` tokens
at random offsets drawn from the generator the caller passes; inputs are the first
``block_size`` tokens of each window and targets the last ``block_size``, so the
same generator state always yields the same batch. Evaluation uses fixed, evenly
spaced windows, so every evaluation of a run (and of a twin run) sees the same text.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import numpy as np

from ..errors import ConfigError
from .loader import Batch, Shard, check_fraction, check_positive, check_rng
from .tokenizer import HFTokenizer, check_path
from .vocab import KINDS, Vocab

SPLITS = ("train", "val")


def read_text(path: str | os.PathLike, kind: str = "char") -> str | bytes:
    """The contents of a text file: ``str`` for ``kind="char"``, ``bytes`` for ``"byte"``.

    A ``path`` that is no ``str``/``os.PathLike``, another ``kind``, a missing,
    unreadable or empty file, or (for ``char``) one that is not UTF-8, raises
    ``ConfigError`` naming the argument or the file.
    """
    path = os.fspath(check_path("read_text", "path", path))
    if not isinstance(kind, str) or kind not in KINDS:
        raise ConfigError(f"read_text: unknown kind {kind!r}, expected one of {KINDS}")
    if not os.path.isfile(path):
        raise ConfigError(f"text file {path!r} does not exist or is not a file")
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except OSError as e:
        raise ConfigError(f"text file {path!r} cannot be read: {e.strerror}") from None
    if not raw:
        raise ConfigError(f"text file {path!r} is empty")
    if kind == "byte":
        return raw
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError(
            f"text file {path!r} is not UTF-8 (byte {e.start}); use the byte vocabulary"
        ) from None


class TextDataset:
    """An encoded text, split into train and validation tokens, served as windows.

    ``vocab`` is ``"char"`` (built from the text), ``"byte"``, a ``Vocab`` (e.g. the
    one stored with a checkpoint) or an ``HFTokenizer``. Each split must hold at least
    ``block_size + 1`` tokens; a shorter text is a ``ConfigError`` giving both numbers.
    ``val_fraction`` is a real number (Python or NumPy, not a bool) in (0, 1).
    """

    def __init__(
        self,
        text: str | bytes,
        block_size: int,
        vocab: str | Vocab = "char",
        val_fraction: float = 0.1,
    ) -> None:
        self.block_size = check_positive("TextDataset: block_size", block_size)
        check_fraction("TextDataset: val_fraction", val_fraction)
        if not isinstance(text, (str, bytes)):
            raise ConfigError(
                f"TextDataset: text must be a str or bytes, got {type(text).__name__}"
            )
        if not text:
            raise ConfigError("TextDataset: the text is empty")
        if isinstance(text, bytes):
            if (vocab.kind if isinstance(vocab, Vocab) else vocab) != "byte":
                raise ConfigError("TextDataset: bytes need the byte vocabulary")
            self.vocab = Vocab("byte")
            ids = np.frombuffer(text, dtype=np.uint8).astype(np.int64)
        else:
            known = isinstance(vocab, (Vocab, HFTokenizer))
            self.vocab = vocab if known else Vocab.build(text, vocab)
            ids = self.vocab.encode(text)
        n_val = int(len(ids) * val_fraction)
        need = self.block_size + 1
        if len(ids) - n_val < need or n_val < need:
            raise ConfigError(
                f"TextDataset: the text has {len(ids)} tokens; with val_fraction {val_fraction} "
                f"each split needs at least block_size + 1 = {need} (train {len(ids) - n_val}, "
                f"val {n_val})"
            )
        self.train = ids[: len(ids) - n_val]
        self.val = ids[len(ids) - n_val :]

    @classmethod
    def from_file(
        cls,
        path: str | os.PathLike,
        block_size: int,
        vocab: str | Vocab = "char",
        val_fraction: float = 0.1,
    ) -> TextDataset:
        """A dataset of a UTF-8 (or, with ``vocab="byte"``, any) file; see ``read_text``."""
        kind = vocab.kind if isinstance(vocab, Vocab) else vocab
        return cls(
            read_text(path, "byte" if kind == "byte" else "char"), block_size, vocab, val_fraction
        )

    # -- vocabulary ------------------------------------------------------------------
    @property
    def vocab_size(self) -> int:
        return self.vocab.size

    def encode(self, text: str) -> np.ndarray:
        return self.vocab.encode(text)

    def decode(self, ids: np.ndarray) -> str:
        return self.vocab.decode(ids)

    # -- batches ---------------------------------------------------------------------
    def tokens(self, split: str) -> np.ndarray:
        """The token ids of ``"train"`` or ``"val"``."""
        if split not in SPLITS:
            raise ConfigError(f"TextDataset: unknown split {split!r}, expected one of {SPLITS}")
        return self.train if split == "train" else self.val

    def _windows(self, split: str, starts: np.ndarray) -> Batch:
        data = self.tokens(split)
        win = np.lib.stride_tricks.sliding_window_view(data, self.block_size + 1)[starts]
        return np.ascontiguousarray(win[:, :-1]), np.ascontiguousarray(win[:, 1:])

    def sample(self, split: str, batch_size: int, rng: np.random.Generator) -> Batch:
        """``(inputs, targets)`` of shape ``(batch_size, block_size)`` at random offsets
        drawn from ``rng`` (a ``numpy.random.Generator``)."""
        batch_size = check_positive("TextDataset: batch_size", batch_size)
        check_rng("TextDataset.sample", rng)
        high = len(self.tokens(split)) - self.block_size
        return self._windows(split, rng.integers(0, high, size=batch_size))

    def eval_batches(self, split: str, batch_size: int, max_batches: int) -> list[Batch]:
        """Fixed batches of evenly spaced windows over ``split`` (the same on every call)."""
        batch_size = check_positive("TextDataset: batch_size", batch_size)
        max_batches = check_positive("TextDataset: max_batches", max_batches)
        high = len(self.tokens(split)) - self.block_size - 1
        n = min(max_batches * batch_size, high + 1)
        starts = np.linspace(0, high, n).astype(np.int64)
        return [self._windows(split, starts[k : k + batch_size]) for k in range(0, n, batch_size)]

    def loader(
        self, split: str, batch_size: int, rank: int | None = None, world_size: int | None = None
    ) -> WindowLoader:
        """A batch source of random windows of ``split`` for the trainer; with several
        processes, this rank's shard of each global batch (``tiegrad.data.loader``)."""
        return WindowLoader(self, split, batch_size, rank, world_size)

    def __repr__(self) -> str:
        return (
            f"TextDataset({self.vocab!r}, block_size={self.block_size}, "
            f"train={len(self.train)}, val={len(self.val)} tokens)"
        )


class WindowLoader:
    """Random windows of one split; an epoch is as many batches as cover it once."""

    unit = "tokens"

    def __init__(
        self,
        dataset: TextDataset,
        split: str,
        batch_size: int,
        rank: int | None = None,
        world_size: int | None = None,
    ) -> None:
        if not isinstance(dataset, TextDataset):
            raise ConfigError(
                f"WindowLoader: dataset must be a TextDataset, got {type(dataset).__name__}"
            )
        self.shard = Shard("WindowLoader", rank, world_size)
        dataset.tokens(split)
        self.dataset = dataset
        self.split = split
        self.batch_size = check_positive("WindowLoader: batch_size", batch_size)

    def __len__(self) -> int:
        per_batch = self.batch_size * self.dataset.block_size
        return max(1, len(self.dataset.tokens(self.split)) // per_batch)

    def epoch(self, rng: np.random.Generator) -> Iterator[Batch]:
        """One epoch of random windows drawn from ``rng`` (checked at this call)."""
        return self._epoch(check_rng("WindowLoader.epoch", rng))

    def _epoch(self, rng: np.random.Generator) -> Iterator[Batch]:
        rank, world = self.shard.resolve(self.batch_size)
        part = self.shard.part(self.batch_size, rank, world)
        for _ in range(len(self)):
            inputs, targets = self.dataset.sample(self.split, self.batch_size, rng)
            yield inputs[part], targets[part]

    def count(self, batch: Batch) -> int:
        """Target tokens in ``batch``."""
        return int(batch[1].size)
