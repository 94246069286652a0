"""The cold start of ``tiegrad train``: the first step with an empty compile cache (issue 17).

``python -m benchmarks cold-start [--steps N] [--repeats R] [--children] [--kernels]``.
Each repeat runs ``tiegrad train --steps N --no-progress`` (the default model; the
console script's code, ``python -m _tiegrad_launcher``) in a child process four ways,
and reads the step times
from the run's ``metrics.jsonl`` (``elapsed``: seconds since the training loop started):

- ``cold``: numba on, ``NUMBA_CACHE_DIR`` a fresh empty folder (a first run after install);
  the command starts its compile child only where a CPU is idle (the load average),
  ``--children`` makes it start it whatever the load (the command on an idle machine);
- ``cold in-process``: the same with ``python -m tiegrad``, which starts no compile
  child (``tiegrad.train.precompile``): the run compiles every kernel itself;
- ``cached``: the same folder again (every later run);
- ``numpy``: ``TIEGRAD_NO_NUMBA=1`` (the NumPy route, nothing to compile).

The table gives per route the median of the repeats: the first step, the second step,
the process's wall clock (start to exit, imports and the end-of-run checkpoint included)
and the CPU seconds of the process and its compile child (``resource``'s children
usage; Unix). The goal: the ``cold`` first step at most 2 s.

``--kernels`` prints instead where a cold compile spends its time: one child trains one
step with an empty cache and records the signatures every kernel was compiled for, a
second child with another empty cache compiles them one by one, helpers first (module
order), so that each figure is about that kernel alone.
"""

from __future__ import annotations

import json
import os
import pickle
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from . import thread_environment

KERNEL_MODULES = ("tiegrad.backend.host_kernels", "tiegrad.optim.kernels")
ROUTES = ("cold", "cold in-process", "cached", "numpy")
LAUNCHER = ["-m", "_tiegrad_launcher"]  # the console script: starts the compile child
# The console script as on an idle machine: it starts its child whatever the load.
WITH_CHILDREN = [
    "-c",
    "import sys, _tiegrad_launcher as m; m.idle_cpus = lambda: 2.0; sys.exit(m.main())",
]
IN_PROCESS = ["-m", "tiegrad"]  # the package's entry point: no compile child
TIMEOUT_S = 600
ROOT = Path(__file__).resolve().parent.parent


def run_train(
    folder: Path, steps: int, env: dict[str, str], entry: list[str] = LAUNCHER
) -> dict[str, float]:
    """One ``tiegrad train --steps steps`` (``python *entry``) in ``folder``: the first
    and second step and the wall clock, in seconds."""
    run = folder / f"run-{time.monotonic_ns()}"
    command = [sys.executable, *entry, "train", "--steps", str(steps)]
    command += ["--no-progress", "--run", str(run)]
    t0, cpu0 = time.perf_counter(), _children_cpu()
    done = subprocess.run(
        command, cwd=folder, env=env, capture_output=True, text=True, timeout=TIMEOUT_S
    )
    wall, cpu = time.perf_counter() - t0, _children_cpu() - cpu0
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} exited {done.returncode}:\n{done.stderr}")
    lines = (run / "metrics.jsonl").read_text().splitlines()
    elapsed = [r["elapsed"] for r in map(json.loads, lines) if "train_loss" in r]
    second = elapsed[1] - elapsed[0] if len(elapsed) > 1 else float("nan")
    return {"first": elapsed[0], "second": second, "wall": wall, "cpu": cpu}


def _children_cpu() -> float:
    """CPU seconds (user + system) of this process's finished children and theirs."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def measure(steps: int, repeats: int, children: bool = False) -> dict[str, list[dict[str, float]]]:
    """``repeats`` rounds of the four routes, each cold run with its own empty cache;
    ``children``: the command starts its compile child whatever the load."""
    results: dict[str, list[dict[str, float]]] = {route: [] for route in ROUTES}
    base = thread_environment()
    base.pop("TIEGRAD_NO_NUMBA", None)
    for _ in range(repeats):
        with tempfile.TemporaryDirectory(prefix="tiegrad-cold-") as tmp:
            folder = Path(tmp)
            env = dict(base, NUMBA_CACHE_DIR=str(folder / "numba-cache"))
            command = WITH_CHILDREN if children else LAUNCHER
            results["cold"].append(run_train(folder, steps, env, command))
            fresh = dict(env, NUMBA_CACHE_DIR=str(folder / "numba-cache-2"))
            results["cold in-process"].append(run_train(folder, steps, fresh, IN_PROCESS))
            results["cached"].append(run_train(folder, steps, env, command))
            numpy = dict(env, TIEGRAD_NO_NUMBA="1")
            results["numpy"].append(run_train(folder, steps, numpy, command))
    return results


def format_table(results: dict[str, list[dict[str, float]]]) -> str:
    """The medians per route, with the load average of the machine."""
    rows = [
        "| route | first step s | second step s | wall s | CPU s | repeats |",
        "|---|---|---|---|---|---|",
    ]
    for route, runs in results.items():
        med = {k: statistics.median(r[k] for r in runs) for k in ("first", "second", "wall", "cpu")}
        rows.append(
            f"| {route} | {med['first']:.2f} | {med['second']:.3f} | {med['wall']:.2f} "
            f"| {med['cpu']:.2f} | {len(runs)} |"
        )
    load = " ".join(f"{x:.2f}" for x in os.getloadavg())
    return "\n".join([*rows, "", f"load average after the runs: {load} ({os.cpu_count()} CPUs)"])


def record_signatures(path: str, run: str) -> None:
    """(child) Train one step and pickle every kernel's compiled signatures to ``path``."""
    from numba.core.registry import CPUDispatcher

    from tiegrad.cli import main

    main(["train", "--steps", "1", "--no-progress", "--run", run])
    found = {}
    for name in KERNEL_MODULES:
        module = sys.modules.get(name)
        for attr, obj in vars(module or object()).items():
            if isinstance(obj, CPUDispatcher) and obj.signatures:
                found[f"{name}:{attr}"] = list(obj.signatures)
    with open(path, "wb") as f:
        pickle.dump(found, f)


def compile_signatures(path: str) -> None:
    """(child) Compile the signatures pickled at ``path`` one by one; print one line each."""
    import importlib

    with open(path, "rb") as f:
        found = pickle.load(f)
    t0 = time.perf_counter()
    for name in KERNEL_MODULES:
        importlib.import_module(name)
    print(f"{time.perf_counter() - t0:6.2f}  import numba and the kernel modules")
    total = 0.0
    for key, signatures in found.items():
        name, attr = key.split(":")
        dispatcher = getattr(sys.modules[name], attr)
        for signature in signatures:
            t = time.perf_counter()
            dispatcher.compile(signature)
            took = time.perf_counter() - t
            total += took
            args = ", ".join(str(a).replace(", aligned=True", "") for a in signature)
            print(f"{took:6.2f}  {name.rsplit('.', 1)[-1]}.{attr}({args})")
    print(f"{total:6.2f}  total compile")


def kernel_times() -> str:
    """The per-kernel compile table of ``--kernels`` (two children, two empty caches)."""
    with tempfile.TemporaryDirectory(prefix="tiegrad-kernels-") as tmp:
        env = dict(thread_environment(), PYTHONPATH=str(ROOT))
        env.pop("TIEGRAD_NO_NUMBA", None)
        sigs = str(Path(tmp) / "signatures.pickle")
        child = [sys.executable, "-m", "benchmarks.cold_start"]
        for name, command in (
            ("first", [*child, "record", sigs, str(Path(tmp) / "run")]),
            ("second", [*child, "compile", sigs]),
        ):
            env["NUMBA_CACHE_DIR"] = str(Path(tmp) / name)
            out = subprocess.run(
                command,
                cwd=tmp,
                env=env,
                check=True,
                capture_output=True,
                text=True,
                timeout=TIMEOUT_S,
            ).stdout
    load = " ".join(f"{x:.2f}" for x in os.getloadavg())
    return f"seconds  kernel (signature)\n{out}\nload average: {load} ({os.cpu_count()} CPUs)"


def main(args: Any) -> int:
    """``python -m benchmarks cold-start``: print the table (or the kernels' compile times)."""
    if args.kernels:
        print(kernel_times())
    else:
        print(format_table(measure(args.steps, args.repeats, args.children)))
        if args.children:
            print("(--children: the command started its compile child whatever the load)")
    return 0


if __name__ == "__main__":  # the children of ``kernel_times``
    if sys.argv[1] == "record":
        record_signatures(sys.argv[2], sys.argv[3])
    else:
        compile_signatures(sys.argv[2])
