"""``python -m benchmarks run [--quick] [--only W1,...] [--json FILE] [--no-rss]``.

``python -m benchmarks profile W1 [SIDE] [--steps N] [--top K]`` prints a cProfile of
one side's steps (default side ``tiegrad``).

``python -m benchmarks cold-start [--steps N] [--repeats R] [--children] [--kernels]`` times
the first steps of ``tiegrad train`` with an empty compile cache (``benchmarks.cold_start``).

``python -m benchmarks rss WORKLOAD SIDE [--quick]`` is the peak-RSS subprocess the
runner spawns per side; it prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
import sys

from . import pin_threads


def main(argv: list[str] | None = None) -> int:
    pin_threads()
    from tiegrad.backend import tune_process

    tune_process()  # what a program owning its process does (the tiegrad command does)
    from . import runner

    parser = argparse.ArgumentParser(prog="python -m benchmarks")
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="run the workloads and print the table")
    run.add_argument("--quick", action="store_true", help="smoke run: tiny step counts")
    run.add_argument("--only", default="", help="comma-separated workload ids, e.g. W1,W4")
    run.add_argument("--json", metavar="FILE", help="also write the results as JSON")
    run.add_argument("--no-rss", action="store_true", help="skip the peak-RSS subprocesses")
    rss = sub.add_parser("rss", help="(internal) peak RSS of one side, as one JSON line")
    rss.add_argument("workload")
    rss.add_argument("side")
    rss.add_argument("--quick", action="store_true")
    prof = sub.add_parser("profile", help="cProfile one side of one workload")
    prof.add_argument("workload")
    prof.add_argument("side", nargs="?", default="tiegrad")
    prof.add_argument("--steps", type=int, default=5)
    prof.add_argument("--top", type=int, default=15)
    cold = sub.add_parser("cold-start", help="first steps of tiegrad train, empty compile cache")
    cold.add_argument("--steps", type=int, default=2, help="steps per tiegrad train run")
    cold.add_argument("--repeats", type=int, default=3, help="rounds of the three routes")
    cold.add_argument(
        "--children",
        action="store_true",
        help="the command starts its compile child whatever the load (an idle machine)",
    )
    cold.add_argument("--kernels", action="store_true", help="per-kernel compile seconds instead")
    args = parser.parse_args(argv)

    if args.command == "rss":
        print(json.dumps(runner.rss_child(args.workload, args.side, args.quick)))
        return 0
    if args.command == "cold-start":
        from . import cold_start

        return cold_start.main(args)
    if args.command == "profile":
        try:
            print(runner.profile_side(args.workload, args.side, args.steps, args.top))
        except runner.UnknownWorkload as e:
            parser.error(str(e))
        return 0
    only = [w.strip() for w in args.only.split(",") if w.strip()]
    try:
        report = runner.run(only, quick=args.quick, rss=not args.no_rss, log=_log)
    except runner.UnknownWorkload as e:
        parser.error(str(e))
    print(runner.format_table(report))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    return 0


def _log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


if __name__ == "__main__":
    sys.exit(main())
