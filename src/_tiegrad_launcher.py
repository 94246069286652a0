"""The ``tiegrad`` console script, kept outside the package so that Ctrl-C while the
package imports (NumPy, numba, the kernels) exits quietly with code 130, as Ctrl-C does
at any later point, instead of printing a ``KeyboardInterrupt`` traceback.

For ``tiegrad train`` and ``tiegrad resume`` it first starts the child process that
compiles the kernels into numba's cache while the command imports tiegrad, builds its
run and takes its first steps (``tiegrad.train.precompile``; this file only starts
it, with the standard library, before tiegrad's own import).
"""

from __future__ import annotations

import os
import subprocess
import sys

EXIT_INTERRUPTED = 130
TRAINING_COMMANDS = ("train", "resume")
# The child runs one small step: more threads than one would only slow the run.
CHILD_THREADS = ("TIEGRAD_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS")
MIN_IDLE_CPUS = 1.0


def start_precompile(argv: list[str]) -> subprocess.Popen[str] | None:
    """The compile child for the command line ``argv``: none but for a training command
    in this process (not ``--nproc``, which relaunches, nor ``--help``), and none unless
    a CPU is idle for it besides this process's own (``idle_cpus``): on a busy machine
    it would only compete with the command for the same CPUs, and the command compiles
    its kernels itself, as fast without it. The run reads what it has compiled from its
    standard output, and stops it where it finds the kernels in the cache already."""
    if not argv or argv[0] not in TRAINING_COMMANDS:
        return None
    if any(a in ("-h", "--help") or a.startswith("--nproc") for a in argv[1:]):
        return None
    if idle_cpus() < MIN_IDLE_CPUS:
        return None
    env = dict(os.environ, **{name: "1" for name in CHILD_THREADS})
    # A process group of its own: the terminal's Ctrl-C stops the run after its step
    # (a checkpoint), which then stops the child itself (tiegrad.train.precompile). Not a
    # session of its own: where the scheduler groups processes by session (autogroup),
    # the child's niceness would then count against nothing but itself.
    group = {"process_group": 0} if sys.version_info >= (3, 11) else {}
    return subprocess.Popen(
        [sys.executable, "-m", "tiegrad.train.precompile"],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        errors="replace",
        env=env,
        **group,
    )


def idle_cpus() -> float:
    """The CPUs this process may use less the 1-minute load average (where the system
    has one), 0 on a single CPU."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    if (cpus or 1) < 2:
        return 0.0
    try:
        load = os.getloadavg()[0]
    except (AttributeError, OSError):  # Windows
        load = 0.0
    return cpus - load


def main() -> int:
    """Start the compile child, import and run ``tiegrad.cli.main``; its exit code. The
    child is stopped, reaped and its pipe closed where the import fails or is
    interrupted."""
    child = start_precompile(sys.argv[1:])
    try:
        from tiegrad.cli import main as cli_main
    except BaseException as e:
        if child is not None:
            with child:  # on leaving: its pipe closed, the process reaped
                child.kill()
        if not isinstance(e, KeyboardInterrupt):
            raise
        print("tiegrad: aborted", file=sys.stderr)
        return EXIT_INTERRUPTED
    return cli_main(precompiling=child)


if __name__ == "__main__":
    sys.exit(main())
