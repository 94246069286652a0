"""``tiegrad export``: write a GPT-2 run or checkpoint as a Hugging Face model directory.

The source is a run folder (its best checkpoint, else its latest) or a checkpoint
file; ``--format`` picks the output (``hf``: what ``GPT2LMHeadModel.from_pretrained``
loads, with the tokenizer files where the run has a Hugging Face tokenizer).
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from ..errors import ConfigError
from .checkpoints import stored_gpt2


def add_parser(sub: Any) -> None:
    """The ``export`` subcommand: the source, the output directory and the format."""
    export = sub.add_parser(
        "export", help="write a GPT-2 run or checkpoint as a Hugging Face model directory"
    )
    export.set_defaults(handler=run)
    export.add_argument("source", metavar="RUN_OR_CHECKPOINT", help="run folder or checkpoint")
    export.add_argument("dir", metavar="DIR", help="output directory")
    export.add_argument("--format", choices=["hf"], default="hf", help="output format (hf)")


def run(args: argparse.Namespace) -> int:
    """Write a ``GPT2`` run's best (else latest) checkpoint, or a checkpoint file, as a
    transformers directory: ``config.json``, ``model.safetensors`` and the tokenizer files."""
    from ..checkpoint import load
    from ..data import HFTokenizer, tokenizer_from_dict
    from ..train.rundir import RunDir

    source = Path(args.source)
    if source.is_dir():
        path = RunDir(source).best_or_latest()
        if path is None:
            raise ConfigError(f"run folder {args.source!r} holds no checkpoint")
    elif source.is_file():
        path = source
    else:
        raise ConfigError(f"{args.source!r} is neither a run folder nor a checkpoint file")
    model, extra = stored_gpt2(path, "export --format hf")
    load(path, model)
    tokenizer = tokenizer_from_dict(extra["vocab"]) if "vocab" in extra else None
    model.save_pretrained(args.dir)
    if isinstance(tokenizer, HFTokenizer):
        tokenizer.save(args.dir)
    print(f"exported {path} to {args.dir} (GPT2LMHeadModel.from_pretrained loads it)")
    return 0
