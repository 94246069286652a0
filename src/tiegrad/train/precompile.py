"""Compiling a ``tiegrad train`` run's kernels in a child process while the run starts.

With an empty numba cache (a first run after install) the first training step would
compile every kernel it calls, one after the other, in the training process. The
``tiegrad`` command (``_tiegrad_launcher``) instead starts, before it imports tiegrad
and where a CPU is idle for it, a child process (``python -m tiegrad.train.precompile``)
that runs a training step of the default model part by part (``PARTS``), which compiles
the kernels they call into numba's cache, marks each part done there and says so on
its standard output. The run does not wait for it: ``Precompiling`` reads those lines
from a thread of the command, and a child whose parts an earlier run's child marked
done is stopped (nothing is left for it to compile). Importing tiegrad starts no process.

Results never depend on timing. Until a part is done, the run steps on NumPy code that
gives the bits of that part's kernels (``tiegrad._numba.defer``): the host kernels'
stand-in ``tiegrad.backend.host_reference`` (the forward and the backward), the
optimizer's own NumPy code (the update); then it switches to the part's kernels, which
numba loads from the cache: the kernels compiled so far by their names
(``tiegrad._numba.ready``), the whole module after its last part. A child that fails,
is killed or compiles another signature only costs time: the run compiles what the
cache lacks on first use after the switch. After the run's last step the command waits
for the child, so that the next run finds every kernel in the cache.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from typing import Any, NamedTuple

from .. import _numba

WAIT_S = 300  # a child still compiling after this is killed; the command compiles itself
# The child's niceness once the host kernels are compiled: the optimizer's NumPy code is
# as fast as its kernels, so the child compiling them at normal priority beside the
# run's threads would only slow the run's steps.
NICENESS = 19
HOST_KERNELS = "tiegrad.backend.host_kernels"
HOST_BLOCKS = "tiegrad.backend.host_blocks"
OPTIMIZER_KERNELS = "tiegrad.optim.kernels"


class Kernels(NamedTuple):
    """A kernel module the child compiles, and what the run uses meanwhile:
    ``stand_in``, a module of NumPy code with the kernels' bits (None: the callers' own
    NumPy code gives them), and nothing of ``callers``, modules whose kernels call the
    module's, until the module's last part is done."""

    stand_in: str | None = None
    callers: tuple[str, ...] = ()


MODULES: dict[str, Kernels] = {
    HOST_KERNELS: Kernels("tiegrad.backend.host_reference", (HOST_BLOCKS,)),
    OPTIMIZER_KERNELS: Kernels(),
}
# The child's parts, in the order it runs them (``_parts``) -> the module compiled.
# GELU and softmax first: their stand-ins are the slowest part of a step on the stand-in.
PARTS: dict[str, str] = {
    "gelu": HOST_KERNELS,
    "softmax": HOST_KERNELS,
    "forward": HOST_KERNELS,
    "backward": HOST_KERNELS,
    "optimizer": OPTIMIZER_KERNELS,
}


class Precompiling:
    """A command's compile child and the thread that watches it.

    ``child``: the process (``_tiegrad_launcher``), or None. If an earlier run's child
    marked every part done in the cache (``_done_path``), it is stopped at once: nothing
    is left for it to compile; so is one whose kernels have no cache to pass them on
    through (the run compiles them). Every other module of ``MODULES`` with a part not
    done, and its callers, are deferred (``tiegrad._numba.defer``, with the module's
    stand-in) until the child says their parts are done (``_watch``). Without compiled
    kernels (``tiegrad._numba.ENABLED`` false) the child is stopped at once and no
    thread starts.
    """

    def __init__(self, child: subprocess.Popen[str] | None) -> None:
        self.child = child
        self.watcher: threading.Thread | None = None
        if not _numba.ENABLED:
            self.stop()
            return
        try:
            deferred = [module for module in MODULES if not _all_done(module)] if child else []
        except BaseException:
            self.stop()
            raise
        for module in deferred:
            _numba.defer(module, MODULES[module].stand_in)
            for caller in MODULES[module].callers:
                _numba.defer(caller)
        if not deferred:
            self.stop()
        if child is not None:
            self.watcher = threading.Thread(
                target=self._watch, args=(deferred,), name="tiegrad-precompile", daemon=True
            )
            self.watcher.start()

    def finish(self) -> None:
        """Wait for the child if it is still compiling, after the run's last step: it
        fills the cache that the next run loads its kernels from."""
        if self.child is not None:
            try:
                self.child.wait(timeout=WAIT_S)
            except subprocess.TimeoutExpired:
                _kill(self.child)

    def stop(self) -> None:
        """Kill the child if it still runs (the command ends early) and wait for the
        watching thread."""
        if self.child is not None:
            _kill(self.child)
        if self.watcher is not None:
            self.watcher.join()
        if self.child is not None and self.child.stdout is not None:
            self.child.stdout.close()

    def _watch(self, deferred: list[str]) -> None:
        """(a thread of the command) Set up numba's compiler (``tiegrad._numba.warm_up``),
        then let each part's kernels in once the child prints that the part is done
        (``main``). The set-up (mostly holding the GIL) runs beside the run's first
        step, so that no switch waits for it: loading the kernels needs it, and it is
        done before the child's first part. The child is killed after ``WAIT_S``; every
        deferred module is let in once the child has ended, however it ended (its
        output is read to the end)."""
        timer = threading.Timer(WAIT_S, _kill, (self.child,))
        timer.daemon = True
        try:
            _numba.warm_up()
            if deferred and self.child is not None:
                timer.start()
                for line in self.child.stdout or ():
                    words = line.split()  # other lines (numba's debug log) are left out
                    if words and words[0] in PARTS:
                        _let_in(words[0], words[1:])
                self.child.wait()  # its output ended: it has ended, or ends now
        finally:
            timer.cancel()
            for module in deferred:
                _let_in(_last_part(module), [])


def _let_in(part: str, names: list[str]) -> None:
    """Let in the kernels of ``part``, called ``names``; all of its module's, and its
    callers, after the module's last part."""
    module = PARTS[part]
    if part != _last_part(module):
        _numba.ready(module, names)
        return
    _numba.ready(module)
    for caller in MODULES[module].callers:
        _numba.ready(caller)


def _parts_of(module: str) -> list[str]:
    """The parts of ``PARTS`` that compile ``module``'s kernels, in their order."""
    return [part for part, compiled in PARTS.items() if compiled == module]


def _last_part(module: str) -> str:
    """The last of ``PARTS`` that compiles ``module``'s kernels."""
    return _parts_of(module)[-1]


def _all_done(module: str) -> bool:
    """Whether an earlier run's child marked every part of ``module`` done; True where
    there is nothing a child could pass on: numba does not load, or the module's
    kernels have no cache."""
    kernels = _numba._load(module)
    if kernels is None:
        return True
    paths = [_done_path(kernels, part) for part in _parts_of(module)]
    return all(path is None or os.path.exists(path) for path in paths)


def _kill(child: subprocess.Popen[Any]) -> None:
    """Kill ``child`` if it still runs, and reap it."""
    if child.poll() is None:
        child.kill()
        child.wait()


def _done_path(kernels: Any, part: str) -> str | None:
    """The file by which the child marks the kernels of ``part`` compiled into numba's
    cache: in the cache folder of the module ``kernels``, under a name that changes with
    numba's version, the Python's and the module's source (numba's own index of the
    cached code changes with them too); None where the module's kernels have no cache.
    A run that needs a signature the child did not compile (another model) only costs
    time: it compiles that one itself."""
    first = next((obj for obj in vars(kernels).values() if _is_kernel(obj)), None)
    folder = first.stats.cache_path if first is not None else None
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


def _is_compiled(obj: Any) -> bool:
    """Whether ``obj`` is a kernel compiled for a signature or more."""
    return _is_kernel(obj) and bool(obj.signatures)


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


def _parts() -> Iterator[str]:
    """(the child) The host backend's GELU and softmax rows on a small float32 array
    (the kernels a default step calls, for the same argument types), then a training
    step of the default model and its AdamW update, as ``Trainer.train_step`` runs
    them: yields the name of each part of ``PARTS`` once it has run, in their order.
    Before the update the process lowers its priority to ``NICENESS``."""
    import numpy as np

    from ..backend import backend_of
    from ..optim.clip import clip_grad_norm
    from ..session import EagerSession

    rows = np.zeros((2, 8), np.float32)
    host = backend_of(rows)
    host.gelu(rows)
    yield "gelu"
    host.softmax_rows_(rows)
    yield "softmax"
    model, optimizer, batch = _default_run()
    model.train()
    s = EagerSession()
    loss = model.loss(s, *batch)
    yield "forward"
    grads = optimizer.canonical_gradients(s.backward(loss))
    yield "backward"
    if hasattr(os, "nice"):
        os.nice(NICENESS)
    s.reset()
    clip_grad_norm(grads, 1.0)
    optimizer.step(grads)
    yield "optimizer"


def main() -> int:
    """(the child) Run ``PARTS``, compiling their kernels into numba's cache; mark each
    part done there (``_mark_done``) and print its name and the names of the kernels of
    its module compiled so far, a line each. Nothing to do without compiled kernels."""
    for part in _parts():
        kernels = _numba.kernels(PARTS[part])
        if kernels is None:
            break
        _mark_done(kernels, part)
        compiled = sorted(name for name, obj in vars(kernels).items() if _is_compiled(obj))
        print(part, *compiled, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
