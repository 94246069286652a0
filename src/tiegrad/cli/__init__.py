"""The ``tiegrad`` command: ``train``, ``sample``, ``inspect``, ``resume`` and ``export``.

``tiegrad train`` with no arguments is the main job: a character ``TiedLM`` trained on
the running interpreter's standard-library source (no download). It prints the
resolved configuration first and a summary at the end. Bad input (a missing or empty
text file, an unknown config key, a value out of range, a run folder holding another
model's checkpoint, a damaged checkpoint) is one line on stderr, ``tiegrad: error:
...``, and exit code 2; Ctrl-C (SIGINT) or SIGTERM during training writes a checkpoint
and exits with code 130 (143 for SIGTERM) after printing how to resume.

On several processes (``torchrun --nproc-per-node N -m tiegrad train ...``, or
``tiegrad train --nproc N``) every rank trains on its shard of each global batch
(``tiegrad.distributed``) and rank 0 alone prints and writes the run folder.

One module per subcommand (``train``, ``resume``, ``sample``, ``inspect``, ``export``:
its options and its ``run``), on shared parts: ``parser`` and ``options`` (the
parser), ``exits`` (exit codes, the one-line error), ``runs`` (run folders),
``checkpoints`` (what a checkpoint describes), ``job`` (the training run ``train``
and ``resume`` share), ``report`` (the printed configuration and summary) and
``command`` (``main``).
"""

from .command import main
from .exits import EXIT_BAD_INPUT, EXIT_INTERRUPTED, EXIT_TERMINATED
from .parser import build_parser
from .runs import LATEST, RUNS
from .train import FLAGS

__all__ = [
    "EXIT_BAD_INPUT",
    "EXIT_INTERRUPTED",
    "EXIT_TERMINATED",
    "FLAGS",
    "LATEST",
    "RUNS",
    "build_parser",
    "main",
]
