"""``tiegrad train --nproc N``: the same command started on N processes by torchrun.

``relaunch`` hands the command line (without ``--nproc``) to
``torch.distributed.run``, as ``torchrun --nproc-per-node N -m tiegrad ...`` would:
one node, the rendezvous on a free local port, the workers in sessions of their own.
Ctrl-C reaches the launcher alone; torchrun passes it on to every worker, where rank
0 writes a checkpoint and all exit (code 130). When a worker fails, torchrun stops
the others and the launcher returns the first failed worker's exit code.
"""

from __future__ import annotations

from collections.abc import Sequence


def without_flag(argv: Sequence[str], flag: str) -> list[str]:
    """``argv`` without ``flag VALUE`` and ``flag=VALUE``."""
    out: list[str] = []
    skip = False
    for arg in argv:
        if skip:
            skip = False
        elif arg == flag:
            skip = True
        elif not arg.startswith(flag + "="):
            out.append(arg)
    return out


def relaunch(nproc: int, argv: Sequence[str]) -> int:
    """Run ``python -m tiegrad ARGV`` on ``nproc`` local processes; returns the exit code."""
    from .group import require_torch

    require_torch("--nproc")
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import get_args_parser, run

    args = get_args_parser().parse_args(
        ["--standalone", f"--nproc-per-node={nproc}", "-m", "tiegrad"]
    )
    args.training_script_args = list(argv)  # not parsed by torchrun: '--run' would be ambiguous
    try:
        run(args)
    except ChildFailedError as e:
        codes = [f.exitcode for _, f in sorted(e.failures.items())]
        return next((c for c in codes if c > 0), 1)
    except SignalException:
        return 130
    return 0


def join_if_launched(device: str | None) -> bool:
    """Join the process group when torchrun started this process; returns whether it did."""
    from .group import in_launcher_environment, init, is_initialized

    if not in_launcher_environment():
        return False
    if not is_initialized():
        init(device=device)
    return True
