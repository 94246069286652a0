"""Data-parallel training on ``torch.distributed`` (gloo on the host, NCCL for cuda).

Start the processes with ``torchrun --nproc-per-node N`` (or ``tiegrad train --nproc
N``), call ``init()`` in each, and wrap the model: ``DataParallel(model)``. The
``Trainer`` does the wrapping itself when a group is initialised.
``DataParallel(model, shard="optimizer" | "gradients")`` shards the optimizer state (and
the gradients) over the ranks by storage (ZeRO stages 1 and 2). torch is imported only
when a group starts.
"""

from .group import (
    DEFAULT_TIMEOUT_S,
    RankFailedError,
    barrier,
    in_launcher_environment,
    init,
    is_initialized,
    is_main,
    rank,
    shutdown,
    world_size,
)
from .parallel import DataParallel

__all__ = [
    "DEFAULT_TIMEOUT_S",
    "DataParallel",
    "RankFailedError",
    "barrier",
    "in_launcher_environment",
    "init",
    "is_initialized",
    "is_main",
    "rank",
    "shutdown",
    "world_size",
]
