"""Compiling a ``tiegrad train`` run's kernels in child processes while the command starts.

With an empty numba cache (a first run after install) the first training step used to
compile every kernel it calls, one after the other, in the training process. The
``tiegrad`` command (``_tiegrad_launcher``, its own process; importing tiegrad starts
no process) instead starts, before it imports tiegrad and where a CPU is idle for them,
one child process per kernel module (``python -m tiegrad.train.precompile MODULE``):
the child runs, on the default model of ``tiegrad train``, the part of a training step
that calls that module's kernels, which compiles them into numba's cache (or loads
them from it: a child costs about one import of tiegrad when nothing is left to
compile). The children run in
parallel with each other and with the command's own start (imports, text, vocabulary,
model, optimizer). ``attach`` hands them to ``tiegrad._numba``: the first use of a
module's kernels in the command waits for that module's child, then loads the kernels
from the cache.

Results never depend on timing: the command uses the compiled kernels from its first
step on, whatever the children do; a child that fails, is killed or misses a signature
only costs time (the command compiles what the cache lacks, as it did before).
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable
from typing import Any

from .. import _numba

WAIT_S = 300  # a child still compiling after this is killed; the command compiles itself


def attach(children: dict[str, subprocess.Popen[Any]]) -> None:
    """Make the first use of each module's kernels (``tiegrad._numba.kernels``) wait
    for its child in ``children`` (module name -> process); without compiled kernels
    (``tiegrad._numba.ENABLED`` false) the children are stopped instead."""
    if not _numba.ENABLED:
        stop(children)
        return
    for module, child in children.items():
        _numba.before_first_use(module, _waiter(child))


def stop(children: dict[str, subprocess.Popen[Any]]) -> None:
    """Stop the children still running (the command ends before it used their kernels)."""
    for child in children.values():
        if child.poll() is None:
            child.kill()
            child.wait()


def _waiter(child: subprocess.Popen[Any]) -> Callable[[], None]:
    def wait() -> None:
        try:
            child.wait(timeout=WAIT_S)
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait()

    return wait


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


def _model_kernels() -> None:
    """The host kernels: a training step up to the update, then an evaluation forward."""
    from ..session import EagerSession

    model, optimizer, batch = _default_run()
    model.train()
    _gradients(model, optimizer, batch)
    model.eval()
    s = EagerSession()
    with s.no_grad():
        model.loss(s, *batch)


def _optimizer_kernels() -> None:
    """The optimizer's kernels: one AdamW step, from gradients computed by the NumPy
    code (so that this child compiles only the optimizer's kernels)."""
    model, optimizer, batch = _default_run()
    _numba.ENABLED = False
    grads = _gradients(model, optimizer, batch)
    _numba.ENABLED = True
    optimizer.step(grads)


PARTS: dict[str, Callable[[], None]] = {
    "tiegrad.backend.host_kernels": _model_kernels,
    "tiegrad.optim.kernels": _optimizer_kernels,
}


def main(module: str) -> int:
    """(the child) Compile ``module``'s kernels into numba's cache; 0, or 2 for an unknown
    module. Nothing to do without compiled kernels."""
    if module not in PARTS:
        print(f"tiegrad.train.precompile: unknown kernel module {module!r}", file=sys.stderr)
        return 2
    if _numba.kernels(module) is not None:
        PARTS[module]()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else ""))
