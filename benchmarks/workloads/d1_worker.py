"""A rank of D1 and D2: ``python -m benchmarks.workloads.d1_worker FRAMEWORK [VARIANT]``.

It joins the gloo group from torchrun's variables, builds W1's model, data and AdamW
(``tiegrad``: ``DataParallel``, with ``shard=VARIANT`` when given; ``torch``:
``DistributedDataParallel``, with ``ZeroRedundancyOptimizer`` over AdamW for the
variant ``zero``) on its 16 of each batch's 32 samples and answers each line on stdin
(``ready``; ``step``: a data-parallel step, all-reduces overlapped with backward on
both sides; ``after``: tiegrad's step averaging after backward; ``local``: a step
without communication) with its loss, the milliseconds from the step's first
all-reduce launch to its last result (the same span on both sides; overlapped with
backward, so not all of it lengthens the step) and the process's CPU milliseconds of
the step; ``memory`` with one JSON line: the bytes of optimizer state and of gradients
the rank holds (the arrays themselves: tiegrad's ``DataParallel.memory``, torch's
optimizer state tensors and ``.grad``) and its peak RSS in MB: ``VmHWM``, the peak of
this process's own memory (``ru_maxrss`` would carry over the peak of the process
that started it, across ``exec``).
"""

from __future__ import annotations

import itertools
import json
import os
import sys
import time
from typing import Any

from ..runner import status_mb
from . import w1_tied_lm as w1

BATCH = w1.BATCH  # global


def _tiegrad_worker(rank: int, shard: str | None) -> Any:
    import tiegrad.distributed as dist
    from tiegrad import EagerSession

    from ._common import set_tiegrad_weights

    data = w1.make_data()
    dist.init()
    model = w1.TIEGRAD.model()
    set_tiegrad_weights(model, data["weights"])
    optimizer = w1.TIEGRAD.optimizer(model.parameters())
    # no checksum: the local steps let the replicas drift apart on purpose
    parallel = dist.DataParallel(model, check_every=2**62, shard=shard)
    session = EagerSession()
    batches = itertools.cycle(_shards(data["batches"], rank))
    first = _first_all_reduce()

    def step(kind: str) -> tuple[float, float]:
        x, y = next(batches)
        first.clear()
        loss = w1.TIEGRAD.loss(model, session, x, y)
        if kind == "step":
            grads = parallel.backward(session, loss, optimizer)
        else:
            grads = optimizer.canonical_gradients(session.backward(loss))
            if kind == "after":
                grads = parallel.average(grads)
        comm = time.perf_counter() - first[0] if first else 0.0
        value = float(loss.item())
        session.reset()
        if kind == "local":
            optimizer.step(grads)
        else:
            parallel.step(optimizer, grads)
        return value, comm * 1e3

    return step, lambda: parallel.memory(optimizer)


def _first_all_reduce() -> list[float]:
    """A list that holds the time of the first ``torch.distributed.all_reduce`` call
    since it was last cleared (the tiegrad side launches through that function)."""
    import torch.distributed as dist

    calls: list[float] = []
    all_reduce = dist.all_reduce

    def timed(*args: Any, **kwargs: Any) -> Any:
        if not calls:
            calls.append(time.perf_counter())
        return all_reduce(*args, **kwargs)

    dist.all_reduce = timed
    return calls


def _torch_worker(rank: int, variant: str | None) -> Any:
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
    first: list[float] = []
    last = [0.0]

    def timed_allreduce(state, bucket):  # DDP checks the annotations: none or its own
        if not first:
            first.append(time.perf_counter())

        def done(fut):
            last[0] = time.perf_counter()
            return fut.value()

        return default_hooks.allreduce_hook(state, bucket).then(done)

    ddp.register_comm_hook(dist.group.WORLD, timed_allreduce)
    if variant == "zero":
        from torch.distributed.optim import ZeroRedundancyOptimizer

        optimizer = ZeroRedundancyOptimizer(
            ddp.parameters(),
            optimizer_class=torch.optim.AdamW,
            lr=w1.LR,
            weight_decay=w1.WEIGHT_DECAY,
        )
        local = optimizer.optim  # this rank's AdamW over its partition
    else:
        optimizer = local = w1.TORCH.optimizer(ddp.parameters())
    batches = itertools.cycle(torch_batches(_shards(data["batches"], rank)))

    def step(kind: str) -> tuple[float, float]:
        x, y = next(batches)
        first.clear()
        optimizer.zero_grad(set_to_none=True)
        with contextlib.nullcontext() if kind == "step" else ddp.no_sync():
            loss = w1.TORCH.loss(ddp, x, y)
            loss.backward()
        comm = last[0] - first[0] if first else 0.0
        optimizer.step()
        return float(loss.item()), comm * 1e3

    def memory() -> dict[str, int]:
        state = sum(
            t.nbytes
            for s in local.state.values()
            for t in s.values()
            if torch.is_tensor(t) and t.dim()
        )
        grads = sum(p.grad.nbytes for p in model.parameters() if p.grad is not None)
        return {"optimizer_state": state, "gradients": grads}

    return step, memory


def _shards(batches: list[Any], rank: int) -> list[Any]:
    world = int(os.environ["WORLD_SIZE"])
    part = slice(rank * BATCH // world, (rank + 1) * BATCH // world)
    return [(x[part].copy(), y[part].copy()) for x, y in batches]


def _serve(framework: str, variant: str | None) -> None:
    """Answer ``ready``, ``step``, ``after`` and ``local`` on stdin with the loss, the
    communication milliseconds and the CPU milliseconds, until ``quit``.

    The worker owns its process, so it tunes it as the benchmark runner tunes its own
    (``tiegrad.backend.tune_process``, both frameworks alike): without it every step
    faults its temporaries in afresh (W1 at 16 samples: 3000-4000 faults per tiegrad
    step, 0-500 per torch step)."""
    from tiegrad.backend import tune_process

    tune_process()
    rank = int(os.environ["RANK"])
    step, memory = (_tiegrad_worker if framework == "tiegrad" else _torch_worker)(rank, variant)
    out = sys.stdout
    for line in sys.stdin:
        command = line.strip()
        if command == "quit":
            break
        if command == "memory":
            peak_mb = status_mb()["VmHWM"]
            out.write(json.dumps(memory() | {"peak_rss_mb": peak_mb}) + "\n")
            out.flush()
            continue
        cpu = time.process_time()
        loss, comm = (0.0, 0.0) if command == "ready" else step(command)
        out.write(f"{loss!r} {comm!r} {(time.process_time() - cpu) * 1e3!r}\n")
        out.flush()


if __name__ == "__main__":
    _serve(sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else None)
