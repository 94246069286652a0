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
