"""``Vocab``: the map between text and token ids, character- or byte-level.

A vocabulary is plain data: ``to_dict()`` gives a JSON-able dict that a checkpoint
or a run folder stores next to the weights, and ``Vocab.from_dict`` rebuilds the
very same map, so sampling from a checkpoint needs nothing but the file.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..errors import ConfigError, DTypeError

KINDS = ("char", "byte")


def check_token_ids(label: str, ids: Any, size: int) -> np.ndarray:
    """``ids`` as a flat int64 array of token ids in ``[0, size)``.

    Non-integer ids (floats, bools, strings) are a ``DTypeError``, never truncated; ids
    out of range are a ``ConfigError``. Both name ``label``.
    """
    arr = np.asarray(ids).reshape(-1)
    if arr.size and arr.dtype.kind not in "iu":
        raise DTypeError(f"{label}: token ids must be integers, got {arr.dtype.name}")
    if arr.size and (arr.min() < 0 or arr.max() >= size):
        raise ConfigError(
            f"{label}: token ids must lie in [0, {size}), got [{arr.min()}, {arr.max()}]"
        )
    return arr.astype(np.int64)


def check_text(label: str, name: str, value: Any) -> str:
    """``value`` itself when it is a ``str``; otherwise a ``ConfigError`` naming ``label``,
    ``name`` and the type received (bytes, None and numbers are never converted)."""
    if not isinstance(value, str):
        raise ConfigError(f"{label}: {name} must be a str, got {type(value).__name__}")
    return value


def utf8(label: str, text: str) -> bytes:
    """The UTF-8 bytes of ``text``; a character without any (a lone surrogate) is a
    ``ConfigError`` naming ``label``, the character and its position."""
    try:
        return text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ConfigError(
            f"{label}: character {text[e.start]!r} at position {e.start} has no UTF-8 bytes"
        ) from None


class Vocab:
    """A token vocabulary: ``kind="char"`` (the sorted characters of a text) or ``"byte"``.

    A byte vocabulary always has 256 ids (UTF-8 bytes) and encodes any text. A char
    vocabulary encodes only the characters it was built from; any other character is
    a ``ConfigError`` naming it. ``chars`` is a ``str`` of distinct characters (a list,
    even of single characters, is a ``ConfigError``: ``to_dict`` must read back).
    """

    __slots__ = ("kind", "chars", "_index")

    def __init__(self, kind: str, chars: str = "") -> None:
        if not isinstance(kind, str) or kind not in KINDS:
            raise ConfigError(f"vocab: unknown kind {kind!r}, expected one of {KINDS}")
        check_text("vocab", "chars", chars)
        if kind == "char":
            if not chars:
                raise ConfigError("vocab: a char vocabulary needs at least one character")
            if len(set(chars)) != len(chars):
                raise ConfigError("vocab: the characters of a char vocabulary must be distinct")
        elif chars:
            raise ConfigError("vocab: a byte vocabulary takes no character list")
        self.kind = kind
        self.chars = chars
        self._index = {c: i for i, c in enumerate(chars)}

    @classmethod
    def build(cls, text: str, kind: str = "char") -> Vocab:
        """The vocabulary of ``text``: its sorted distinct characters (a ``str``), or the
        256 bytes (``kind="byte"``: a ``str`` or the ``bytes`` ``read_text`` gives)."""
        if not (kind == "byte" and isinstance(text, bytes)):
            check_text("Vocab.build", "text", text)
        return cls(kind, "".join(sorted(set(text))) if kind == "char" else "")

    @classmethod
    def from_dict(cls, data: Any) -> Vocab:
        """Rebuild a vocabulary from ``to_dict()`` output (checked, never executed)."""
        if not isinstance(data, dict) or not isinstance(data.get("kind"), str):
            raise ConfigError(f"vocab: expected a dict with a 'kind', got {data!r:.80}")
        chars = data.get("chars", "")
        if not isinstance(chars, str):
            raise ConfigError(f"vocab: 'chars' must be a string, got {type(chars).__name__}")
        return cls(data["kind"], chars)

    def to_dict(self) -> dict[str, str]:
        """A JSON-able description: ``{"kind": ..., "chars": ...}``."""
        return {"kind": self.kind, "chars": self.chars}

    @property
    def size(self) -> int:
        """The number of token ids."""
        return 256 if self.kind == "byte" else len(self.chars)

    def __len__(self) -> int:
        return self.size

    @property
    def unit(self) -> str:
        """What one token is, for reporting losses: ``"char"`` or ``"byte"``."""
        return self.kind

    def encode(self, text: str) -> np.ndarray:
        """Token ids of ``text`` (a ``str``) as an int64 array; a character the vocabulary
        cannot encode (char: not in it; byte: not UTF-8, a lone surrogate) is a
        ``ConfigError`` naming it, and so is a ``text`` of another type (bytes, None)."""
        check_text("vocab.encode", "text", text)
        if self.kind == "byte":
            return np.frombuffer(utf8("vocab", text), dtype=np.uint8).astype(np.int64)
        index = self._index
        try:
            return np.fromiter((index[c] for c in text), dtype=np.int64, count=len(text))
        except KeyError as e:
            raise ConfigError(
                f"vocab: character {e.args[0]!r} is not in this {self.size}-character vocabulary"
            ) from None

    def decode(self, ids: Any) -> str:
        """The text of a sequence of token ids (invalid UTF-8 bytes are replaced); the ids
        are checked first (``check_token_ids``)."""
        arr = check_token_ids("vocab", ids, self.size)
        if self.kind == "byte":
            return arr.astype(np.uint8).tobytes().decode("utf-8", errors="replace")
        chars = self.chars
        return "".join(chars[i] for i in arr.tolist())

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Vocab) and (self.kind, self.chars) == (other.kind, other.chars)

    def __hash__(self) -> int:
        return hash((self.kind, self.chars))

    def __repr__(self) -> str:
        return f"Vocab({self.kind!r}, size={self.size})"
