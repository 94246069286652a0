"""Compiling a ``tiegrad train`` run's kernels in child processes while the run starts.

With an empty numba cache (a first run after install) the first training step used to
compile every kernel it calls, one after the other, in the training process. The
``tiegrad`` command (``_tiegrad_launcher``, its own process; importing tiegrad starts
no process) instead starts, before it imports tiegrad and where a CPU is idle for them,
child processes (``python -m tiegrad.train.precompile PART``, ``PARTS``) that run a part
of a training step on the default model of ``tiegrad train``, which compiles the
kernels it calls into numba's cache, and then mark the part done there; the run does
not wait for them (``NICENESS`` says which yield their CPU). ``Precompiling`` watches
the children from a thread of the command, which also sets up numba's compiler while the run steps;
children whose part an earlier run's child marked done are stopped (nothing is left
for them to compile).

Results never depend on timing. Until a part's child has ended, the run steps on NumPy
code that gives the bits of that part's kernels (``tiegrad._numba.defer``): the host
kernels' stand-in ``tiegrad.backend.host_reference`` (the forward and the backward),
the optimizer's own NumPy code (the update); then it switches to the kernels, which
numba loads from the cache. A child that fails, is killed or compiles another
signature only costs time: the run compiles what the cache lacks on first use after
the switch. After the run's last step the command waits for the children still
compiling, so that the next run finds every kernel in the cache.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from typing import Any, NamedTuple

from .. import _numba

WAIT_S = 300  # a child still compiling after this is killed; the command compiles itself
POLL_S = 0.05  # how often the watching thread looks at the children
# A child whose stand-in is the callers' own NumPy code yields its CPU to everything
# else: the run loses little on that code. The host kernels' child may not: the run's
# threads on the stand-in keep every CPU busy, and at the lowest priority it would
# never end (a 120-step run stayed on the stand-in throughout).
NICENESS = 19
HOST_KERNELS = "tiegrad.backend.host_kernels"
HOST_BLOCKS = "tiegrad.backend.host_blocks"
OPTIMIZER_KERNELS = "tiegrad.optim.kernels"


class Precompiling:
    """A command's compile children and the thread that watches them.

    ``children``: part name (``PARTS``) -> its child process (``_tiegrad_launcher``).
    A child whose part an earlier run's child marked done in the cache (``_done_path``)
    is stopped at once: nothing is left for it to compile; so is one whose kernels have
    no cache to pass them on through (the run compiles them). The kernel module of every
    other part, and the modules whose kernels call it, are deferred
    (``tiegrad._numba.defer``, with the part's stand-in): the run steps on NumPy code
    with the kernels' bits until the module's children have ended (``_watch``).
    Without compiled kernels (``tiegrad._numba.ENABLED`` false) the children are
    stopped at once and no thread starts.
    """

    def __init__(self, children: dict[str, subprocess.Popen[Any]]) -> None:
        self.children = children
        self.watcher: threading.Thread | None = None
        if not _numba.ENABLED:
            self.stop()
            return
        deferred: dict[str, threading.Event] = {}
        for part, child in children.items():
            module, _, stand_in, callers = PARTS[part]
            kernels = _numba._load(module)
            done = _done_path(kernels, part) if kernels is not None else None
            if done is None or os.path.exists(done):  # nothing a child could pass on
                _kill(child)
            elif module not in deferred:
                deferred[module] = threading.Event()
                _numba.defer(module, deferred[module], stand_in)
                for caller in callers:
                    _numba.defer(caller, deferred[module])
        if children:
            self.watcher = threading.Thread(
                target=self._watch, args=(deferred,), name="tiegrad-precompile", daemon=True
            )
            self.watcher.start()

    def finish(self) -> None:
        """Wait for the children still compiling, after the run's last step: they fill
        the cache that the next run loads its kernels from."""
        for child in self.children.values():
            _wait(child)

    def stop(self) -> None:
        """Kill the children still running (the command ends early) and wait for the
        watching thread."""
        for child in self.children.values():
            _kill(child)
        if self.watcher is not None:
            self.watcher.join()

    def _watch(self, deferred: dict[str, threading.Event]) -> None:
        """(a thread of the command) Set each ``deferred`` module's event once its own
        children have ended, however they ended (children still running after
        ``WAIT_S`` are killed), numba's compiler set up first
        (``tiegrad._numba.warm_up``): the run's next kernel call needs it to load the
        kernels, and the run keeps stepping on NumPy code meanwhile. With nothing
        deferred (every part compiled by an earlier run) the set-up starts at once."""
        try:
            deadline = time.monotonic() + WAIT_S
            pending = {
                module: [c for p, c in self.children.items() if PARTS[p].module == module]
                for module in deferred
            }
            while pending:
                for module, children in list(pending.items()):
                    if all(child.poll() is not None for child in children):
                        _numba.warm_up()
                        del pending[module]
                        deferred[module].set()
                if time.monotonic() > deadline:
                    for child in self.children.values():
                        _kill(child)
                if pending:
                    time.sleep(POLL_S)
            _numba.warm_up()
        finally:
            for ready in deferred.values():
                ready.set()


def _wait(child: subprocess.Popen[Any]) -> None:
    """Wait for ``child``; kill it after ``WAIT_S`` seconds."""
    try:
        child.wait(timeout=WAIT_S)
    except subprocess.TimeoutExpired:
        _kill(child)


def _kill(child: subprocess.Popen[Any]) -> None:
    """Kill ``child`` if it still runs, and reap it."""
    if child.poll() is None:
        child.kill()
        child.wait()


def _done_path(kernels: Any, part: str) -> str | None:
    """The file by which the child of ``part`` marks its kernels compiled into numba's
    cache: in the cache folder of the module ``kernels``, under a name that changes with
    numba's version, the Python's and the module's source (numba's own index of the
    cached code changes with them too); None where the module's kernels have no cache.
    A run that needs a signature the child did not compile (another model) only costs
    time: it compiles that one itself."""
    dispatchers = [obj for obj in vars(kernels).values() if _is_kernel(obj)]
    folder = dispatchers[0].stats.cache_path if dispatchers else None
    if not folder:
        return None
    import numba

    source = os.stat(kernels.__file__)
    stamp = f"{numba.__version__}-{sys.implementation.cache_tag}"
    stamp += f"-{source.st_mtime_ns}-{source.st_size}"
    return os.path.join(folder, f"tiegrad-{part}-{stamp}.done")


def _is_kernel(obj: Any) -> bool:
    """Whether ``obj`` is a numba dispatcher (a kernel)."""
    from numba.extending import is_jitted

    return is_jitted(obj)


def _mark_done(kernels: Any, part: str) -> None:
    """(the child) Mark ``part``'s kernels compiled into the cache (``_done_path``)."""
    path = _done_path(kernels, part)
    if path is not None:
        with contextlib.suppress(OSError):
            open(path, "wb").close()


def _default_run() -> tuple[Any, Any, Any]:
    """The default ``tiegrad train`` model, its optimizer and one batch of the default
    size, of a synthetic text.

    Built by the functions ``tiegrad train`` uses (``tiegrad.train.job``) and of the
    default sizes, so that the kernels see the operand types, layouts and flags of a
    default run's (the host backend chooses some code paths by size); another run may
    need a kernel variant more, which it compiles itself.
    """
    from ..data import TextDataset
    from .config import DEFAULTS
    from .job import build_model, build_optimizer, model_config

    size, width = DEFAULTS["batch_size"], DEFAULTS["seq_len"]
    text = "".join(chr(32 + k % 95) for k in range(2 * (size + 1) * width))
    dataset = TextDataset(text, block_size=width, vocab="char", val_fraction=0.5)
    model = build_model(model_config(DEFAULTS, dataset.vocab_size))
    optimizer, _ = build_optimizer(DEFAULTS, model)
    return model, optimizer, dataset.eval_batches("train", size, 1)[0]


def _gradients(model: Any, optimizer: Any, batch: Any) -> list[Any]:
    """What a training step does before the update: forward, backward, the gradients
    summed per canonical slot and clipped (``Trainer.train_step``)."""
    from ..optim.clip import clip_grad_norm
    from ..session import EagerSession

    s = EagerSession()
    grads = optimizer.canonical_gradients(s.backward(model.loss(s, *batch)))
    s.reset()
    clip_grad_norm(grads, 1.0)
    return grads


def _step_kernels() -> None:
    """The host kernels of a training step: its forward and backward."""
    from ..session import EagerSession

    model, _, batch = _default_run()
    model.train()
    s = EagerSession()
    s.backward(model.loss(s, *batch))


def _optimizer_kernels() -> None:
    """The optimizer's kernels: one AdamW step, from gradients computed by the NumPy
    code (so that this child compiles only the optimizer's kernels)."""
    model, optimizer, batch = _default_run()
    _numba.ENABLED = False
    grads = _gradients(model, optimizer, batch)
    _numba.ENABLED = True
    optimizer.step(grads)


class Part(NamedTuple):
    """A part of a training step run by one child: the kernel module it compiles
    (``run``), and what the run uses meanwhile: ``stand_in``, a module of NumPy code
    with the kernels' bits (None: the callers' own NumPy code gives them, and the
    child runs at ``NICENESS``), and nothing of ``callers``, modules whose kernels call
    the module's."""

    module: str
    run: Callable[[], None]
    stand_in: str | None = None
    callers: tuple[str, ...] = ()


PARTS: dict[str, Part] = {
    "step": Part(HOST_KERNELS, _step_kernels, "tiegrad.backend.host_reference", (HOST_BLOCKS,)),
    "optimizer": Part(OPTIMIZER_KERNELS, _optimizer_kernels),
}


def main(part: str) -> int:
    """(the child) Run ``part`` (``PARTS``), compiling its kernels into numba's cache,
    and mark it done there (``_mark_done``); 0, or 2 for an unknown part. Nothing to
    do without compiled kernels."""
    if part not in PARTS:
        print(f"tiegrad.train.precompile: unknown part {part!r}", file=sys.stderr)
        return 2
    module, run, stand_in, _ = PARTS[part]
    if stand_in is None and hasattr(os, "nice"):
        os.nice(NICENESS)
    kernels = _numba.kernels(module)
    if kernels is not None:
        run()
        _mark_done(kernels, part)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else ""))
