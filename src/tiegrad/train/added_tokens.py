"""``--add-tokens FILE``: tokens added to an ``--init`` folder's tokenizer, the model grown
to match (``tiegrad.models.resize_vocab``), and with ``--train-rows new`` a row mask so
that only the added tokens' rows of the embedding (and head) train (``params.rows``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..checkpoint.fileio import MAX_JSON_BYTES, read_limited
from ..data.tokenizer import HFTokenizer
from ..errors import ConfigError


def read_tokens(path: str | Path, label: str = "--add-tokens") -> list[str]:
    """The tokens of a file of one token per line (UTF-8; the line ends are not part of
    a token). A file that cannot be read, holds no token or an empty line is a
    ``ConfigError`` naming ``label``, the file and the line."""
    where = f"{label} {str(path)!r}"
    try:
        text = read_limited(Path(path), MAX_JSON_BYTES, ConfigError, where).decode("utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"{where}: cannot be read as UTF-8 text: {e}") from None
    tokens = text.splitlines()
    for i, token in enumerate(tokens):
        if not token:
            raise ConfigError(f"{where}: line {i + 1} is empty (one token per line)")
    if not tokens:
        raise ConfigError(f"{where}: the file holds no token")
    return tokens


def add_tokens(
    model: Any, tokenizer: Any, path: str | Path, train_rows: str = "all"
) -> HFTokenizer:
    """Add the tokens of ``path`` to ``tokenizer`` and grow ``model`` to the grown
    tokenizer's size (where it is larger: a model may hold spare rows); returns the grown
    tokenizer. ``train_rows="new"``: only the added tokens' rows of the embedding and
    head storages train. Everything is checked before the model changes (C6)."""
    where = f"--add-tokens {str(path)!r}"
    if not isinstance(tokenizer, HFTokenizer):
        raise ConfigError(f"{where}: the --init folder has no tokenizer.json to add tokens to")
    tokens = read_tokens(path)
    grown = tokenizer.with_added_tokens(tokens, where)
    from ..models import resize_vocab

    resize_vocab(model, max(model.vocab_size, grown.size))
    if train_rows == "new":
        rows = grown.token_ids(tokens)
        for path_ in model.VOCAB_PATHS:
            model.get_parameter(path_).storage.train_rows(rows, where)
    return grown
