"""``stdlib_corpus``: the default training text, read from the running interpreter.

Every Python install ships the source of its standard library: real, varied text
that nobody in this project wrote, available without a download. The corpus is the
ASCII ``.py`` files of that library (tests, ``site-packages`` and generated files
left out) concatenated in sorted path order until ``max_chars`` is reached, so the
same interpreter always yields the same text.
"""

from __future__ import annotations

import os
import sysconfig
from pathlib import Path

from ..errors import ConfigError

DEFAULT_MAX_CHARS = 2_000_000
_SKIP_DIRS = {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"}


def stdlib_root() -> Path:
    """The folder holding the running interpreter's standard library sources."""
    return Path(sysconfig.get_paths()["stdlib"])


def stdlib_corpus(max_chars: int = DEFAULT_MAX_CHARS, root: str | Path | None = None) -> str:
    """At most ``max_chars`` characters of standard-library source, whole files only.

    Files are taken in sorted relative-path order; a file that is not pure ASCII is
    skipped (it keeps the character vocabulary at the 96 printable ASCII symbols and
    whitespace). The first file is always taken even if it alone exceeds the cap.
    Raises ``ConfigError`` when no source file is found (an install without ``.py``
    sources): then pass a text file instead.
    """
    if isinstance(max_chars, bool) or not isinstance(max_chars, int) or max_chars < 1:
        raise ConfigError(f"stdlib_corpus: max_chars must be a positive integer, got {max_chars!r}")
    base = Path(root) if root is not None else stdlib_root()
    parts: list[str] = []
    total = 0
    for path in _source_files(base):
        try:
            text = path.read_bytes().decode("ascii")
        except (OSError, UnicodeDecodeError):
            continue
        if not text:
            continue
        if parts and total + len(text) > max_chars:
            break
        parts.append(text)
        total += len(text)
    if not parts:
        raise ConfigError(
            f"no Python source files found under {str(base)!r} to build the default corpus; "
            "train on a file with --text FILE"
        )
    return "".join(parts)


def _source_files(base: Path) -> list[Path]:
    """The ``.py`` files under ``base`` in sorted relative-path order, skipped folders pruned."""
    found: list[tuple[str, Path]] = []
    for folder, dirs, names in os.walk(base):
        dirs[:] = [d for d in dirs if d not in _SKIP_DIRS]
        for name in names:
            if name.endswith(".py") and not name.startswith("_sysconfigdata"):
                path = Path(folder, name)
                found.append((path.relative_to(base).as_posix(), path))
    return [path for _, path in sorted(found)]
