"""``main``: parse the command line, run the subcommand, turn errors into exit codes.

A ``TiegradError`` or ``OSError`` is the one-line error and ``EXIT_BAD_INPUT``; Ctrl-C
at any point (the imports included) exits quietly with ``EXIT_INTERRUPTED``. ``--nproc
N`` relaunches the command on N processes through torchrun instead of running it.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING

from ..backend.tuning import tune_process
from ..errors import TiegradError
from .exits import EXIT_BAD_INPUT, EXIT_INTERRUPTED, fail, main_process, one_line
from .parser import build_parser, unknown_arguments

if TYPE_CHECKING:
    import subprocess


def main(
    argv: Sequence[str] | None = None, precompiling: subprocess.Popen[str] | None = None
) -> int:
    """Run the command line; returns the exit code (0, 2 bad input, 130 interrupted,
    143 terminated). Ctrl-C at any point (the imports included) exits quietly with 130.

    ``precompiling``: the child process compiling the kernels (``_tiegrad_launcher``,
    ``tiegrad.train.precompile``): a thread watches it (``Precompiling``) while the
    run steps on NumPy code with the kernels' bits, switching to the kernels as it
    compiles them; the command waits for it after a run that succeeded, and stops it
    where it ends otherwise."""
    from ..train import precompile

    compiling = precompile.Precompiling(precompiling)
    try:
        code = _main(argv)
        if code == 0:
            compiling.finish()
        return code
    except KeyboardInterrupt:
        if main_process():
            print("tiegrad: aborted", file=sys.stderr)
        return EXIT_INTERRUPTED
    finally:
        compiling.stop()


def _main(argv: Sequence[str] | None) -> int:
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    if unknown:
        unknown_arguments(parser, args.command, unknown)
    if args.command is None:
        parser.print_help(sys.stderr)
        return EXIT_BAD_INPUT
    try:
        if getattr(args, "nproc", None) is not None:
            return _relaunch(args.nproc, sys.argv[1:] if argv is None else argv)
        tune_process()  # the command owns its process (tiegrad.backend.tuning)
        return args.handler(args)
    except TiegradError as e:
        fail(one_line(e))
    except OSError as e:
        fail(f"{e.strerror or e}: {e.filename}" if e.filename else str(e))


def _relaunch(nproc: int, argv: Sequence[str]) -> int:
    """Start the command on ``nproc`` local processes (``tiegrad.distributed.launch``)."""
    from ..distributed.group import in_launcher_environment
    from ..distributed.launch import relaunch, without_flag

    if nproc < 1:
        fail(f"--nproc must be >= 1, got {nproc}")
    if in_launcher_environment():
        fail("--nproc starts the processes itself: leave it out under torchrun")
    return relaunch(nproc, without_flag(argv, "--nproc"))
