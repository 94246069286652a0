"""The process group of a data-parallel run: start it from torchrun's environment.

``init`` reads ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR`` and
``MASTER_PORT`` (what ``torchrun``/``torch.distributed.run`` sets), meets the other
ranks through ``torch.distributed.rendezvous("env://")`` and starts the process group
with ``torch.distributed.init_process_group``: gloo for host sessions, NCCL for a
``cuda`` device. Every collective of the group, and the meeting itself, gives up
after ``timeout`` seconds (default 60, or ``TIEGRAD_DIST_TIMEOUT``), so a rank that
dies or hangs never blocks the others for longer.

The group's key-value store also carries failure reports: a rank that fails writes
``report_failure(...)`` before it leaves, and the survivors name it from there
(``failure_report``). torch is imported here, never by ``import tiegrad``; without an
initialised group ``rank()`` is 0, ``world_size()`` 1 and ``is_main()`` true.
"""

from __future__ import annotations

import atexit
import contextlib
import datetime
import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from ..backend import TORCH_HINT
from ..errors import DistributedError

DEFAULT_TIMEOUT_S = 60.0
TIMEOUT_ENV = "TIEGRAD_DIST_TIMEOUT"
ENV_KEYS = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
_FAILED_KEY = "tiegrad/failed"


@dataclass(frozen=True)
class Group:
    """The initialised group: this process's rank, the world size, backend and timeout."""

    rank: int
    world_size: int
    local_rank: int
    backend: str
    timeout: float
    store: Any


_group: Group | None = None


def in_launcher_environment() -> bool:
    """Whether the variables ``torchrun`` sets are all present (this is a launched rank)."""
    return all(k in os.environ for k in ENV_KEYS)


def _env_int(name: str, default: int | None = None) -> int:
    raw = os.environ.get(name)
    if raw is None:
        if default is None:
            raise DistributedError(
                f"tiegrad.distributed.init: the environment variable {name} is not set; "
                "start the processes with 'torchrun --nproc-per-node N ...' (it sets "
                f"{', '.join(ENV_KEYS)})"
            )
        return default
    try:
        return int(raw)
    except ValueError:
        raise DistributedError(
            f"tiegrad.distributed.init: {name}={raw!r} is not an integer"
        ) from None


def require_torch(what: str) -> None:
    """Raise ``DistributedError`` naming ``what`` unless ``torch.distributed`` imports:
    data-parallel training runs on it, and tiegrad does not install torch itself."""
    try:
        import torch.distributed  # noqa: F401
    except ImportError as e:
        raise DistributedError(
            f"{what}: data-parallel training needs torch.distributed ({e}): {TORCH_HINT}"
        ) from None


def resolve_timeout(timeout: float | None) -> float:
    """``timeout`` in seconds, else ``TIEGRAD_DIST_TIMEOUT``, else 60; must be > 0."""
    if timeout is None:
        raw = os.environ.get(TIMEOUT_ENV)
        if raw is None:
            return DEFAULT_TIMEOUT_S
        try:
            timeout = float(raw)
        except ValueError:
            raise DistributedError(f"{TIMEOUT_ENV}={raw!r} is not a number of seconds") from None
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0:
        raise DistributedError(
            f"distributed timeout must be a number of seconds > 0, got {timeout!r}"
        )
    return float(timeout)


def init(device: str | None = None, timeout: float | None = None) -> Group:
    """Join the process group torchrun describes; returns it. See the module docstring.

    ``device`` is the session's device: one naming ``cuda`` selects NCCL (and the GPU
    ``LOCAL_RANK``), anything else gloo. Bad or missing variables, a second ``init``
    and a meeting that times out are a ``DistributedError``. The group is left at
    interpreter exit if ``shutdown`` was not called.
    """
    global _group
    if _group is not None:
        raise DistributedError(
            f"tiegrad.distributed.init: already initialised (rank {_group.rank} of "
            f"{_group.world_size}); call shutdown() first"
        )
    seconds = resolve_timeout(timeout)
    world = _env_int("WORLD_SIZE")
    rank = _env_int("RANK")
    local_rank = _env_int("LOCAL_RANK", rank)
    for name in ("MASTER_ADDR", "MASTER_PORT"):
        if not os.environ.get(name):
            _env_int(name)  # raises: not set
    if world < 1 or not 0 <= rank < world:
        raise DistributedError(
            f"tiegrad.distributed.init: RANK={rank} and WORLD_SIZE={world}: expected "
            "0 <= RANK < WORLD_SIZE"
        )
    require_torch("tiegrad.distributed.init")
    import torch
    import torch.distributed as dist

    backend = "nccl" if device is not None and "cuda" in device else "gloo"
    delta = datetime.timedelta(seconds=seconds)
    try:
        store, rank, world = next(
            dist.rendezvous("env://", rank=rank, world_size=world, timeout=delta)
        )
        if backend == "nccl":
            torch.cuda.set_device(local_rank)
        dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=delta)
    except (RuntimeError, ValueError) as e:
        raise DistributedError(
            f"tiegrad.distributed.init: rank {rank} of {world} could not join the group at "
            f"{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']} within {seconds:g} s "
            f"({_first_line(e)})"
        ) from None
    _group = Group(rank, world, local_rank, backend, seconds, store)
    atexit.register(shutdown)  # a rank leaving on an error still closes its group cleanly
    return _group


def group() -> Group:
    """The initialised group, or a ``DistributedError`` saying to call ``init`` first."""
    if _group is None:
        raise DistributedError(
            "tiegrad.distributed: not initialised; call tiegrad.distributed.init()"
        )
    return _group


def is_initialized() -> bool:
    return _group is not None


def rank() -> int:
    """This process's rank (0 without a group)."""
    return 0 if _group is None else _group.rank


def world_size() -> int:
    """The number of processes (1 without a group)."""
    return 1 if _group is None else _group.world_size


def is_main() -> bool:
    """Whether this is rank 0, the process that prints, writes metrics and checkpoints:
    of the group, or before ``init`` of the launch (torchrun's ``RANK``), else true."""
    if _group is None and in_launcher_environment():
        return os.environ["RANK"].strip() == "0"
    return rank() == 0


def barrier() -> None:
    """Wait for every rank (nothing without a group); a lost rank is a ``DistributedError``."""
    if _group is not None:
        import torch.distributed as dist

        with collective("barrier"):
            dist.barrier()


def shutdown() -> None:
    """Leave the process group (nothing without one); ``init`` may be called again."""
    global _group
    if _group is None:
        return
    import torch.distributed as dist

    _group = None
    if dist.is_initialized():
        dist.destroy_process_group()


def _first_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return text[0] if text else type(error).__name__


class RankFailedError(DistributedError):
    """Another rank failed, died or stopped answering; this rank stops too."""


def report_failure(error: BaseException, step: int | None = None) -> None:
    """Tell the other ranks that this one fails with ``error``, then leave the group.

    The first report wins (the store's compare-and-set). Leaving closes this rank's
    connections, which wakes the ranks waiting for it in a collective at once.
    Afterwards this rank waits (up to 5 s) until every other rank has read the report,
    so that a failing rank 0, which hosts the store, is still there to answer. A
    ``DistributedError`` (ranks that disagree, a failure another rank reported) is
    raised on the other ranks too: it is not reported, the group is only left.
    """
    g = _group
    if g is None or isinstance(error, DistributedError):
        shutdown()  # the other ranks raise the same error, or reported this one
        return
    at = "" if step is None else f" at step {step}"
    text = f"rank {g.rank} failed{at}: {type(error).__name__}: {_first_line(error)}"
    try:
        g.store.compare_set(_FAILED_KEY, "", text)
    except RuntimeError:
        pass
    shutdown()
    others = [f"tiegrad/read/{r}" for r in range(g.world_size) if r != g.rank]
    try:
        g.store.wait(others, datetime.timedelta(seconds=min(5.0, g.timeout)))
    except RuntimeError:
        pass


def failure_report() -> str | None:
    """The report of the rank that failed first, or ``None`` (waits up to 2 s for one)."""
    g = _group
    if g is None:
        return None
    try:
        g.store.wait([_FAILED_KEY], datetime.timedelta(seconds=min(2.0, g.timeout)))
        text = g.store.get(_FAILED_KEY).decode()
        g.store.set(f"tiegrad/read/{g.rank}", "1")
        return text or None
    except RuntimeError:
        return None


@contextlib.contextmanager
def collective(what: str) -> Iterator[None]:
    """Context of one collective: a torch error in it becomes a ``RankFailedError``.

    The message names the rank that reported a failure, or says that the others were
    lost or silent for the group's timeout; afterwards this rank has left the group.
    """
    try:
        yield
    except RuntimeError as error:
        g = group()
        report = failure_report()
        shutdown()
        if report is not None:
            raise RankFailedError(f"rank {g.rank}: stopping: {report}") from None
        others = [r for r in range(g.world_size) if r != g.rank]
        who = f"rank {others[0]}" if len(others) == 1 else "another rank"
        raise RankFailedError(
            f"rank {g.rank}: stopping: {who} died or did not answer within {g.timeout:g} s "
            f"during {what} ({_first_line(error)})"
        ) from None


def agree(value: Any) -> Any:
    """Rank 0's ``value`` on every rank (``value`` itself without a group), e.g. a name
    each rank would otherwise pick on its own, such as a timestamped run folder."""
    if _group is None:
        return value
    import torch.distributed as dist

    box = [value]
    with collective("agreeing on a value"):
        dist.broadcast_object_list(box, src=0)
    return box[0]


def staged(tensor: Any) -> Any:
    """``tensor`` where the group's backend reduces: itself for gloo, a GPU copy for NCCL."""
    return tensor.cuda() if group().backend == "nccl" else tensor


def all_gather_array(out: Any, mine: Any, what: str) -> None:
    """Every rank's ``mine`` (NumPy arrays of one size) end to end into ``out``, rank by rank."""
    import torch.distributed as dist

    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor  # torch < 2.13
    _into(out, mine, gather, what)


def reduce_scatter_array(out: Any, parts: Any, what: str) -> None:
    """The sum over the ranks of ``parts`` (NumPy, ``world_size`` equal blocks end to end):
    block ``rank`` of that sum into ``out``."""
    import torch.distributed as dist

    scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    _into(out, parts, scatter, what)


def _into(out: Any, source: Any, op: Any, what: str) -> None:
    """``op(output, input)``, a collective named ``what``, from NumPy ``source`` into NumPy
    ``out``, both staged where the backend reduces."""
    import torch

    host = torch.from_numpy(out)
    target = staged(host)
    with collective(what):
        op(target, staged(torch.from_numpy(source)))
    if target is not host:
        host.copy_(target)


def all_gather_objects(obj: Any, what: str) -> list[Any]:
    """Every rank's ``obj`` (picklable), rank by rank."""
    import torch.distributed as dist

    out: list[Any] = [None] * group().world_size
    with collective(what):
        dist.all_gather_object(out, obj)
    return out
