"""``HFTokenizer``: a Hugging Face ``tokenizer.json`` (through ``tokenizers``) as a vocabulary.

Like ``Vocab`` it is plain data: ``to_dict()`` holds the text of the directory's
tokenizer files, so a checkpoint or run folder can encode, decode and export them
with nothing else. ``tokenizers`` is imported only when one is built (the ``hf`` extra).
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path
from typing import Any

import numpy as np

from ..checkpoint.fileio import MAX_JSON_BYTES, parse_json, read_limited
from ..errors import ConfigError, shown_list
from .vocab import Vocab, check_text, check_token_ids, utf8

#: The tokenizer files transformers writes next to a model, copied along on export.
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "vocab.json",
    "merges.txt",
    "added_tokens.json",
    "chat_template.jinja",
)
#: The special tokens read from ``tokenizer_config.json`` and ``special_tokens_map.json``
#: whose ids the tokenizer gives (each must be in the vocabulary).
SPECIAL_TOKENS = ("bos_token", "eos_token", "pad_token")
#: The named special tokens transformers hands a chat template (its ``special_tokens_map``).
TEMPLATE_TOKENS = (
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
)


def check_path(label: str, name: str, value: Any) -> Path:
    """``value`` (a ``str`` or ``os.PathLike``) as a ``Path``; anything else (None, an int
    file descriptor, bytes) is a ``ConfigError`` naming ``label``, ``name`` and the type."""
    if not isinstance(value, (str, os.PathLike)):
        raise ConfigError(
            f"{label}: {name} must be a str or os.PathLike, got {type(value).__name__}"
        )
    return Path(value)


class HFTokenizer:
    """A ``tokenizers.Tokenizer`` built from ``files["tokenizer.json"]``.

    ``files`` maps file names of ``TOKENIZER_FILES`` to their text; the others are kept
    only to be written back by ``save``. Encoding adds no special tokens. ``size`` is the
    largest token id + 1 (added tokens included), so every id ``encode`` gives lies in
    ``[0, size)`` even when the vocabulary's ids have gaps.

    ``template_tokens`` maps the named special tokens of ``TEMPLATE_TOKENS`` to their
    text where the files name them: ``tokenizer_config.json`` first,
    ``special_tokens_map.json`` for those it does not name (as transformers reads them; a
    value is the token's text or an added-token object with its ``content``); a chat
    template sees them as variables (``tiegrad.data.chat``). ``special_tokens`` holds
    those of ``SPECIAL_TOKENS`` (``bos_token``, ``eos_token``, ``pad_token``), whose ids
    ``bos_token_id``, ``eos_token_id`` and ``pad_token_id`` give, or None. Both files are
    checked whole: one that is not a JSON object, a value of another form and a token of
    ``SPECIAL_TOKENS`` the vocabulary lacks are each a ``ConfigError`` naming the file,
    the key and the token, raised before the tokenizer exists (C6).
    """

    kind = "hf"
    unit = "token"

    def __init__(self, files: dict[str, str]) -> None:
        try:
            from tokenizers import Tokenizer
        except ImportError:
            raise ConfigError(
                "a tokenizer.json needs the 'tokenizers' package (pip install 'tiegrad[hf]')"
            ) from None
        if not isinstance(files, dict) or not isinstance(files.get("tokenizer.json"), str):
            raise ConfigError("tokenizer: expected the text of a tokenizer.json")
        unknown = sorted(set(files) - set(TOKENIZER_FILES))
        if unknown or not all(isinstance(v, str) for v in files.values()):
            raise ConfigError(
                f"tokenizer: unexpected files {shown_list(unknown)} or non-text contents"
            )
        try:
            self._tokenizer = Tokenizer.from_str(files["tokenizer.json"])
        except Exception as e:  # tokenizers raises its own Exception type
            raise ConfigError(f"tokenizer.json cannot be read by tokenizers: {e}") from None
        self.files = dict(files)
        ids = self._tokenizer.get_vocab(with_added_tokens=True).values()
        self._size = max(ids) + 1 if ids else 0
        self.template_tokens = self._named_tokens()
        self.special_tokens = {k: v for k, v in self.template_tokens.items() if k in SPECIAL_TOKENS}

    def _named_tokens(self) -> dict[str, str]:
        """``{key: token text}`` of ``TEMPLATE_TOKENS`` the files name (see the class)."""
        found: dict[str, str] = {}
        for name in ("tokenizer_config.json", "special_tokens_map.json"):
            if name not in self.files:
                continue
            data = parse_json(self.files[name], name, dict, ConfigError)
            for key in TEMPLATE_TOKENS:
                value = data.get(key)
                if value is None:
                    continue
                token = value.get("content") if isinstance(value, dict) else value
                if not isinstance(token, str):
                    raise ConfigError(
                        f"{name}: {key} must be a token's text or an object with its "
                        f"content, got {value!r:.80}"
                    )
                if key in SPECIAL_TOKENS and self._tokenizer.token_to_id(token) is None:
                    raise ConfigError(f"{name}: {key} {token!r:.80} is not in the vocabulary")
                found.setdefault(key, token)
        return found

    def _special_id(self, key: str) -> int | None:
        token = self.special_tokens.get(key)
        return None if token is None else self._tokenizer.token_to_id(token)

    @property
    def bos_token_id(self) -> int | None:
        """The id of the beginning-of-sequence token, or None when the files name none."""
        return self._special_id("bos_token")

    @property
    def eos_token_id(self) -> int | None:
        """The id of the end-of-sequence token, or None when the files name none."""
        return self._special_id("eos_token")

    @property
    def pad_token_id(self) -> int | None:
        """The id of the padding token, or None when the files name none."""
        return self._special_id("pad_token")

    @classmethod
    def from_directory(cls, directory: str | os.PathLike[str]) -> HFTokenizer | None:
        """The tokenizer of a model directory, or None when it has no ``tokenizer.json``;
        a file too large (``MAX_JSON_BYTES``), unreadable or refused by ``tokenizers`` is
        a ``ConfigError`` naming the folder."""
        folder = check_path("HFTokenizer.from_directory", "directory", directory)
        if not (folder / "tokenizer.json").is_file():
            return None
        files = {}
        for name in TOKENIZER_FILES:
            if (folder / name).is_file():
                try:
                    files[name] = read_limited(folder / name, MAX_JSON_BYTES, ConfigError).decode()
                except (OSError, UnicodeDecodeError) as e:
                    raise ConfigError(f"{folder / name}: cannot be read: {e}") from None
        try:
            return cls(files)
        except ConfigError as e:  # the files' own errors, named by their folder
            raise ConfigError(f"{folder}: {e}") from None

    def to_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "files": dict(self.files)}

    def with_added_tokens(self, tokens: list[str], where: str = "add_tokens") -> HFTokenizer:
        """A new tokenizer with ``tokens`` added (``tokenizers``' ``add_tokens``, as
        transformers' ``tokenizer.add_tokens`` does), each given the next free id in order;
        this one is unchanged. An empty token, one given twice and one the vocabulary
        already holds are a ``ConfigError`` naming ``where`` and the token (transformers
        would skip the last silently: its row would not be a new one)."""
        from tokenizers import Tokenizer

        seen: dict[str, int] = {}
        for i, token in enumerate(tokens):
            if not token:
                raise ConfigError(f"{where}: token {i + 1} is empty")
            if token in seen:
                raise ConfigError(f"{where}: token {token!r:.60} is given twice")
            known = self._tokenizer.token_to_id(token)
            if known is not None:
                raise ConfigError(
                    f"{where}: token {token!r:.60} is in the vocabulary already (id {known})"
                )
            seen[token] = i
        grown = Tokenizer.from_str(self._tokenizer.to_str())
        grown.add_tokens(tokens)
        return HFTokenizer({**self.files, "tokenizer.json": grown.to_str()})

    def token_ids(self, tokens: list[str]) -> list[int]:
        """The ids of ``tokens`` (each in the vocabulary)."""
        return [self._tokenizer.token_to_id(t) for t in tokens]

    @property
    def size(self) -> int:
        """The number of token ids: the largest id (added tokens included) + 1; 0 when
        the vocabulary is empty. Ids missing from a vocabulary with gaps count too."""
        return self._size

    def __len__(self) -> int:
        return self.size

    def encode(self, text: str) -> np.ndarray:
        """Token ids of ``text`` (a ``str``) as an int64 array (no special tokens added).

        A ``text`` of another type, a character without UTF-8 bytes (a lone surrogate,
        named with its position) and text that ``tokenizers`` cannot encode (a word-level
        vocabulary without an unknown token meeting an unseen word) are ``ConfigError``.
        """
        return np.asarray(self._encoding(text).ids, dtype=np.int64)

    def encode_with_offsets(self, text: str) -> tuple[np.ndarray, np.ndarray]:
        """The ids of ``encode`` and each token's ``[start, end)`` character span in
        ``text`` (an int64 array of shape (n, 2)): the offsets transformers maps
        character spans to tokens with. Refuses what ``encode`` refuses."""
        encoding = self._encoding(text)
        offsets = np.asarray(encoding.offsets, dtype=np.int64).reshape(-1, 2)
        return np.asarray(encoding.ids, dtype=np.int64), offsets

    def _encoding(self, text: str) -> Any:
        """The ``tokenizers`` encoding of ``text`` without special tokens (see ``encode``)."""
        check_text("tokenizer.encode", "text", text)
        try:
            return self._tokenizer.encode(text, add_special_tokens=False)
        except Exception as e:  # tokenizers raises bare Exception
            utf8("tokenizer", text)  # names a lone surrogate (which tokenizers refuses)
            raise ConfigError(
                f"tokenizer: tokenizers cannot encode the text ({len(text)} characters): {e}"
            ) from None

    def decode(self, ids: Any) -> str:
        """The text of a sequence of token ids, checked first (``check_token_ids``)."""
        arr = check_token_ids("tokenizer", ids, self.size)
        return self._tokenizer.decode(arr.tolist(), skip_special_tokens=False)

    def save(self, directory: str | os.PathLike[str]) -> None:
        """Write the tokenizer files into ``directory``, creating it and its parents as
        ``save_pretrained`` does; a folder that cannot be made or written is a
        ``ConfigError`` naming the path."""
        folder = check_path("HFTokenizer.save", "directory", directory)
        try:
            folder.mkdir(parents=True, exist_ok=True)
            for name, text in self.files.items():
                (folder / name).write_text(text, encoding="utf-8")
        except OSError as e:
            raise ConfigError(f"tokenizer: cannot write into {str(folder)!r}: {e}") from None

    def __repr__(self) -> str:
        return f"HFTokenizer(size={self.size})"


def directory_tokenizer(directory: str | os.PathLike[str]) -> HFTokenizer | Vocab:
    """The tokenizer of a model directory; without a ``tokenizer.json``, the byte-level
    ``Vocab`` (256 ids) with a warning."""
    tokenizer = HFTokenizer.from_directory(directory)
    if tokenizer is None:
        warnings.warn(
            f"{directory} has no tokenizer.json: using byte-level tokens (ids 0-255)",
            stacklevel=2,
        )
        return Vocab("byte")
    return tokenizer


def tokenizer_from_dict(data: Any) -> HFTokenizer | Vocab:
    """Rebuild a ``Vocab`` or an ``HFTokenizer`` from its ``to_dict()`` output."""
    if isinstance(data, dict) and data.get("kind") == HFTokenizer.kind:
        return HFTokenizer(data.get("files"))
    return Vocab.from_dict(data)
