"""A rank of D1 (``d1_data_parallel``): ``python -m benchmarks.workloads.d1_worker FRAMEWORK``.

It joins the gloo group from torchrun's variables, builds W1's model, data and AdamW
(``tiegrad``: ``DataParallel``; ``torch``: ``DistributedDataParallel``) on its 16 of
each batch's 32 samples and answers each line on stdin (``ready``, ``step``: a
data-parallel step, ``local``: a step without communication) with its loss and the
milliseconds of the step spent communicating: tiegrad's ``average`` (pack, all-reduce,
scale; nothing overlaps it), DDP's all-reduces from the comm hook's call to the
result (overlapped with backward, so not all of it lengthens the step).
"""

from __future__ import annotations

import os
import sys
import time
from typing import Any

from . import w1_tied_lm as w1

WORLD = 2
BATCH = w1.BATCH  # global


def _tiegrad_worker(rank: int) -> Any:
    import tiegrad.distributed as dist
    from tiegrad import EagerSession

    from ._common import set_tiegrad_weights

    data = w1.make_data()
    dist.init()
    model = w1.TIEGRAD.model()
    set_tiegrad_weights(model, data["weights"])
    optimizer = w1.TIEGRAD.optimizer(model.parameters())
    # no checksum: the local steps let the replicas drift apart on purpose
    parallel = dist.DataParallel(model, check_every=2**62)
    session = EagerSession()
    batches = _shards(data["batches"], rank)
    i = 0

    def step(average: bool) -> tuple[float, float]:
        nonlocal i
        x, y = batches[i % len(batches)]
        i += 1
        loss = w1.TIEGRAD.loss(model, session, x, y)
        grads = optimizer.canonical_gradients(session.backward(loss))
        t0 = time.perf_counter()
        if average:
            grads = parallel.average(grads)
        comm = time.perf_counter() - t0 if average else 0.0
        value = float(loss.item())
        session.reset()
        optimizer.step(grads)
        return value, comm * 1e3

    return step


def _torch_worker(rank: int) -> Any:
    import contextlib

    import torch
    import torch.distributed as dist
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.nn.parallel import DistributedDataParallel

    from ._common import load_torch, torch_batches

    torch.set_num_threads(1)
    data = w1.make_data()
    dist.init_process_group("gloo")
    model = w1.TORCH.model()
    load_torch(model, data["weights"])
    ddp = DistributedDataParallel(model)
    spans: list[float] = []

    def timed_allreduce(state, bucket):  # DDP checks the annotations: none or its own

        t0 = time.perf_counter()

        def done(fut):
            spans.append(time.perf_counter() - t0)
            return fut.value()

        return default_hooks.allreduce_hook(state, bucket).then(done)

    ddp.register_comm_hook(dist.group.WORLD, timed_allreduce)
    optimizer = w1.TORCH.optimizer(ddp.parameters())
    batches = torch_batches(_shards(data["batches"], rank))
    i = 0

    def step(average: bool) -> tuple[float, float]:
        nonlocal i
        x, y = batches[i % len(batches)]
        i += 1
        optimizer.zero_grad(set_to_none=True)
        with contextlib.nullcontext() if average else ddp.no_sync():
            loss = w1.TORCH.loss(ddp, x, y)
            loss.backward()
        optimizer.step()
        comm = sum(spans)
        spans.clear()
        return float(loss.item()), comm * 1e3

    return step


def _shards(batches: list[Any], rank: int) -> list[Any]:
    part = slice(rank * BATCH // WORLD, (rank + 1) * BATCH // WORLD)
    return [(x[part].copy(), y[part].copy()) for x, y in batches]


def _serve(framework: str) -> None:
    """Answer ``ready``, ``step`` and ``local`` on stdin with the loss and the
    communication milliseconds, until ``quit``."""
    rank = int(os.environ["RANK"])
    step = (_tiegrad_worker if framework == "tiegrad" else _torch_worker)(rank)
    out = sys.stdout
    for line in sys.stdin:
        command = line.strip()
        if command == "quit":
            break
        loss, comm = (0.0, 0.0) if command == "ready" else step(command == "step")
        out.write(f"{loss!r} {comm!r}\n")
        out.flush()


if __name__ == "__main__":
    _serve(sys.argv[1])
