"""The ``tiegrad`` console script, kept outside the package so that Ctrl-C while the
package imports (NumPy, numba, the kernels) exits quietly with code 130, as Ctrl-C does
at any later point, instead of printing a ``KeyboardInterrupt`` traceback."""

from __future__ import annotations

import sys

EXIT_INTERRUPTED = 130


def main() -> int:
    """Import and run ``tiegrad.cli.main``; returns its exit code."""
    try:
        from tiegrad.cli import main as cli_main
    except KeyboardInterrupt:
        print("tiegrad: aborted", file=sys.stderr)
        return EXIT_INTERRUPTED
    return cli_main()


if __name__ == "__main__":
    sys.exit(main())
