"""Compiling a ``tiegrad train`` run's kernels in child processes while the run starts.

With an empty numba cache (a first run after install) the first training step used to
compile every kernel it calls, one after the other, in the training process. The
``tiegrad`` command (``_tiegrad_launcher``, its own process; importing tiegrad starts
no process) instead starts, before it imports tiegrad and where a CPU is idle for them,
one child process per part of a training step (``python -m tiegrad.train.precompile
PART``, ``PARTS``): the child runs that part on the default model of ``tiegrad train``,
which compiles the kernels it calls into numba's cache, and lists the signatures it
compiled in the cache's folder. The children run in parallel with each other and with
the command's own start (imports, text, vocabulary, model, optimizer). ``Precompiling``
starts a thread per kernel module in the command that sets up numba, imports the module
and loads every listed signature from the cache, so that the run's kernel calls find
them compiled: at once where an earlier run's children listed them (the children,
with nothing left to compile, are stopped), else once the children have.

Results never depend on timing. The host kernels (GELU, layer norm, softmax) round
differently from the NumPy code (the tests compare them within a tolerance), so a run
uses them from its first step, as a run from a filled cache does: the first use waits
for the module's thread. The optimizer's kernels give the NumPy code's bits (the tests
compare the bytes), so the run's first steps update on the NumPy code while their child,
at a lower priority, compiles them, and switch to them once loaded
(``tiegrad._numba.defer``). A child that fails, is killed or misses a signature only
costs time: the run compiles what the cache lacks on first use, as it did before. After
the run's last step the command waits for the children still compiling, so that the
next run finds every kernel in the cache.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import subprocess
import sys
import threading
from collections.abc import Callable
from typing import Any, NamedTuple

from .. import _numba

WAIT_S = 300  # a child still compiling after this is killed; the command compiles itself
NICENESS = 10  # a child nothing waits for yields its CPU to the run and the other children
HOST_KERNELS = "tiegrad.backend.host_kernels"
OPTIMIZER_KERNELS = "tiegrad.optim.kernels"
SAME_BITS = frozenset({OPTIMIZER_KERNELS})  # modules whose kernels give the NumPy code's bits


class Precompiling:
    """A command's compile children and the threads that load what they compiled.

    ``children``: part name (``PARTS``) -> its child process (``_tiegrad_launcher``).
    Each kernel module with children is deferred (``tiegrad._numba.defer``) until its
    thread has loaded the signatures of its parts (``_load_when_compiled``); the run
    waits for it at the first use, or runs the NumPy code meanwhile for a module in
    ``SAME_BITS``. Without compiled kernels (``tiegrad._numba.ENABLED`` false) the
    children are stopped at once and no thread starts.
    """

    def __init__(self, children: dict[str, subprocess.Popen[Any]]) -> None:
        self.children = children
        self.ending = threading.Event()  # set: the run needs no more kernels loaded
        self.loaders: list[threading.Thread] = []
        if not _numba.ENABLED:
            self.stop()
            return
        modules: dict[str, dict[str, subprocess.Popen[Any]]] = {}
        for part, child in children.items():
            modules.setdefault(PARTS[part].module, {})[part] = child
        for module, parts in modules.items():
            ready = threading.Event()
            _numba.defer(module, ready, wait=module not in SAME_BITS)
            loader = threading.Thread(
                target=self._load_when_compiled,
                args=(module, parts, ready),
                name=f"tiegrad-load-{module}",
                daemon=True,
            )
            loader.start()
            self.loaders.append(loader)

    def finish(self) -> None:
        """Wait for the children still compiling, after the run's last step: they fill
        the cache that the next run loads its kernels from."""
        self.ending.set()
        for child in self.children.values():
            _wait(child)

    def stop(self) -> None:
        """Kill the children still running (the command ends early) and wait for the
        loading threads."""
        self.ending.set()
        for child in self.children.values():
            _kill(child)
        for loader in self.loaders:
            loader.join()

    def _load_when_compiled(
        self, module: str, parts: dict[str, subprocess.Popen[Any]], ready: threading.Event
    ) -> None:
        """(a thread of the command) Load ``module``'s kernels for the run, then set
        ``ready``: import the module, stop the children of the parts whose signatures an
        earlier child listed in the cache (``_manifest_path``: nothing is left for them
        to compile), set up numba's compiler (``tiegrad._numba.warm_up``), load those
        signatures from the cache, and those of the other parts once their children
        have compiled and listed them. ``ready`` is set however the children ended (the
        run then compiles what is missing itself); nothing is loaded once the run has
        ended."""
        try:
            kernels = _numba._load(module)
            if kernels is None:
                return
            listed = {part: _read_signatures(_manifest_path(kernels, part)) for part in parts}
            for part, signatures in listed.items():
                if signatures:
                    _kill(parts[part])
            _numba.warm_up()
            for signatures in listed.values():
                self._load_signatures(kernels, signatures)
            compiling = {part: child for part, child in parts.items() if not listed[part]}
            for part, child in compiling.items():
                _wait(child)
                if child.returncode == 0:
                    self._load_signatures(kernels, _read_signatures(_manifest_path(kernels, part)))
        finally:
            ready.set()

    def _load_signatures(self, kernels: Any, signatures: dict[str, list[Any]]) -> None:
        """Compile each of ``signatures`` (kernel name -> numba signatures) of the module
        ``kernels``, which loads it from numba's cache; none once the run has ended."""
        for name, listed in signatures.items():
            dispatcher = getattr(kernels, name, None)
            for signature in listed if dispatcher is not None else ():
                if self.ending.is_set():
                    return
                dispatcher.compile(signature)


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


def _manifest_path(kernels: Any, part: str) -> str | None:
    """Where the child of ``part`` lists the signatures it compiled into numba's cache:
    in the cache folder of the module ``kernels``, under a name that changes with
    numba's version, the Python's and the module's source (numba's own index of the
    cached code changes with them too); None where the module's kernels have no cache.
    A list that misses a signature the run needs (a changed caller) only costs time: the
    run compiles it itself."""
    dispatchers = [obj for obj in vars(kernels).values() if _is_kernel(obj)]
    folder = dispatchers[0].stats.cache_path if dispatchers else None
    if not folder:
        return None
    import numba

    source = os.stat(kernels.__file__)
    stamp = f"{numba.__version__}-{sys.implementation.cache_tag}"
    stamp += f"-{source.st_mtime_ns}-{source.st_size}"
    return os.path.join(folder, f"tiegrad-{part}-{stamp}.signatures")


def _is_kernel(obj: Any) -> bool:
    """Whether ``obj`` is a numba dispatcher (a kernel)."""
    from numba.extending import is_jitted

    return is_jitted(obj)


def _read_signatures(path: str | None) -> dict[str, list[Any]]:
    """The signatures listed at ``path`` (kernel name -> numba signatures), or none where
    there is no such file or it is incomplete. A pickle, as numba's own index files in
    that folder are."""
    if path is None:
        return {}
    try:
        with open(path, "rb") as f:
            return pickle.load(f)
    except (OSError, EOFError, pickle.UnpicklingError):
        return {}


def _write_signatures(kernels: Any, part: str) -> None:
    """(the child) List each kernel of ``kernels`` with the signatures compiled so far at
    ``_manifest_path`` (written whole: to another name first)."""
    path = _manifest_path(kernels, part)
    if path is None:
        return
    listed = {
        name: list(obj.signatures)
        for name, obj in vars(kernels).items()
        if _is_kernel(obj) and obj.signatures
    }
    partial = f"{path}.{os.getpid()}"
    with contextlib.suppress(OSError):
        with open(partial, "wb") as f:
            pickle.dump(listed, f)
        os.replace(partial, path)


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


def _forward_kernels() -> None:
    """The host kernels of the forward: a training forward, then an evaluation one."""
    from ..session import EagerSession

    model, _, batch = _default_run()
    model.train()
    model.loss(EagerSession(), *batch)
    model.eval()
    s = EagerSession()
    with s.no_grad():
        model.loss(s, *batch)


def _backward_kernels() -> None:
    """The host kernels of the backward: a training step's backward, from a forward on
    the NumPy code (which records the same operand types)."""
    from ..session import EagerSession

    model, _, batch = _default_run()
    model.train()
    s = EagerSession()
    _numba.ENABLED = False
    loss = model.loss(s, *batch)
    _numba.ENABLED = True
    s.backward(loss)


def _optimizer_kernels() -> None:
    """The optimizer's kernels: one AdamW step, from gradients computed by the NumPy
    code (so that this child compiles only the optimizer's kernels)."""
    model, optimizer, batch = _default_run()
    _numba.ENABLED = False
    grads = _gradients(model, optimizer, batch)
    _numba.ENABLED = True
    optimizer.step(grads)


class Part(NamedTuple):
    """A part of a training step run by one child: the kernel module it compiles."""

    module: str
    run: Callable[[], None]


# The host kernels in two children: each compiles about half of their time.
PARTS: dict[str, Part] = {
    "forward": Part(HOST_KERNELS, _forward_kernels),
    "backward": Part(HOST_KERNELS, _backward_kernels),
    "optimizer": Part(OPTIMIZER_KERNELS, _optimizer_kernels),
}


def main(part: str) -> int:
    """(the child) Run ``part`` (``PARTS``), compiling its kernels into numba's cache,
    and list their signatures there (``_write_signatures``); 0, or 2 for an unknown
    part. Nothing to do without compiled kernels."""
    if part not in PARTS:
        print(f"tiegrad.train.precompile: unknown part {part!r}", file=sys.stderr)
        return 2
    module, run = PARTS[part]
    if module in SAME_BITS and hasattr(os, "nice"):
        os.nice(NICENESS)  # the run does not wait for these kernels
    kernels = _numba.kernels(module)
    if kernels is not None:
        run()
        _write_signatures(kernels, part)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else ""))
