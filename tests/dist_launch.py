"""Start the ranks of a multi-process test on gloo: free ports on 127.0.0.1, torchrun's
variables, one thread per process, a bounded wait."""

import os
import socket
import subprocess
import sys
import time

WAIT_S = 240


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def base_env(timeout: float = 60.0) -> dict[str, str]:
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1")
    env["TIEGRAD_DIST_TIMEOUT"] = str(timeout)
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    return env


def launch(worker, world, args, timeout=60.0):
    """Start ``world`` ranks of the script ``worker`` (0: one plain process, no group);
    wait for all.

    Returns ``[(returncode, stdout, stderr)]`` per rank and the time (``time.time()``)
    rank 0 exited.
    """
    port = free_port()
    procs = []
    for rank in range(max(world, 1)):
        env = base_env(timeout)
        if world:
            env.update(
                RANK=str(rank),
                LOCAL_RANK=str(rank),
                WORLD_SIZE=str(world),
                MASTER_ADDR="127.0.0.1",
                MASTER_PORT=str(port),
            )
        procs.append(
            subprocess.Popen(
                [sys.executable, worker, *map(str, args)],
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
        )
    results = []
    ended = None
    try:
        for p in procs:
            out, err = p.communicate(timeout=WAIT_S)
            results.append((p.returncode, out, err))
            if ended is None:
                ended = time.time()  # rank 0's exit: it is waited for first
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    return results, ended


def run_module(*args, env=None) -> subprocess.CompletedProcess:
    """``python -m ARGS`` (each made a str) in ``base_env()`` (or ``env``), its output
    captured as text, for at most ``WAIT_S`` seconds."""
    return subprocess.run(
        [sys.executable, "-m", *map(str, args)],
        env=base_env() if env is None else env,
        capture_output=True,
        text=True,
        timeout=WAIT_S,
    )


def tiny_train_flags(folder) -> list:
    """``tiegrad train`` flags for a tiny model on a small Python text written in ``folder``."""
    text = folder / "t.txt"
    text.write_text("".join(f"def f{i}(x):\n    return x * {i % 7}\n" for i in range(300)))
    flags = ["--text", text, "--d-model", "16", "--layers", "1", "--heads", "2"]
    return flags + [
        "--seq-len",
        "16",
        "--batch-size",
        "4",
        "--eval-every",
        "10",
        "--eval-batches",
        "2",
    ]
