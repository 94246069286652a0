"""How the command stops: its exit codes and the one-line error.

Bad input is one line on stderr, ``tiegrad: error: ...``, and ``EXIT_BAD_INPUT``, never
a traceback; an interrupted run exits with the shell's code for its signal.
"""

from __future__ import annotations

import sys
from typing import NoReturn

EXIT_BAD_INPUT = 2
EXIT_INTERRUPTED = 130  # SIGINT, 128 + 2
EXIT_TERMINATED = 143  # SIGTERM, 128 + 15


def main_process() -> bool:
    """Whether this process speaks for the command: rank 0 of a data-parallel launch, or
    the only process."""
    from ..distributed.group import is_main

    return is_main()


def fail(message: str) -> NoReturn:
    """Exit with ``EXIT_BAD_INPUT`` after one line on stderr; of a data-parallel launch's
    ranks, which all fail the same way (same command line and configuration), rank 0
    alone prints the line, the others exit with the same code in silence."""
    if main_process():
        print(f"tiegrad: error: {message}", file=sys.stderr)
    raise SystemExit(EXIT_BAD_INPUT)


def one_line(error: BaseException) -> str:
    """The first line of ``error``'s message, with the count of the lines left out."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    text = lines[0] if lines else type(error).__name__
    return text if len(lines) <= 1 else f"{text} (+{len(lines) - 1} more lines)"
