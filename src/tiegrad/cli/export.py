"""``tiegrad export``: write a fine-tuned run or checkpoint for transformers or PEFT.

The source is a run folder (its best checkpoint, else its latest) or a checkpoint
file of a model fine-tuned from a transformers directory (``tiegrad train --init``: a
``GPT2`` or a Llama-family ``LlamaLM``); ``--format`` picks the output. ``hf``: the
model class's ``save_pretrained`` folder, which transformers'
``AutoModelForCausalLM.from_pretrained`` loads (a tied head one tensor,
``tie_word_embeddings`` true), with the tokenizer files where the run has a Hugging
Face tokenizer; a LoRA run
(``tiegrad train --lora``) needs ``--merge``, which folds the adapters into the
weights. Where an adapter is on one use of the tied embedding alone (the head's, say),
the merge unties it: that use gets a storage of its own holding the merged weight, the
other use keeps the base bit for bit, the folder holds both tensors with
``tie_word_embeddings`` false (which transformers loads untied), and one line names the
pair it untied. An adapter shared by both uses (``share_tied``) merges into the one
storage and the tie stays. ``peft``: a LoRA run's adapter, ``adapter_model.safetensors``
and ``adapter_config.json``, which ``peft.PeftModel.from_pretrained`` loads onto the
``--init`` model (``tiegrad.interop.peft``). A format the source cannot give (``peft``
without adapters, ``hf`` of adapters without ``--merge``, ``--merge`` without adapters)
is refused before anything is written (C6).
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from ..errors import ConfigError
from .checkpoints import stored_model


def add_parser(sub: Any) -> None:
    """The ``export`` subcommand: the source, the output directory, the format, ``--merge``."""
    export = sub.add_parser(
        "export",
        help="write a fine-tuned (--init) run or checkpoint for transformers (hf) or PEFT (peft)",
    )
    export.set_defaults(handler=run)
    export.add_argument("source", metavar="RUN_OR_CHECKPOINT", help="run folder or checkpoint")
    export.add_argument("dir", metavar="DIR", help="output directory")
    export.add_argument(
        "--format",
        choices=["hf", "peft"],
        default="hf",
        help="hf: a transformers model directory; peft: a LoRA run's adapter (default: hf)",
    )
    export.add_argument(
        "--merge",
        action="store_true",
        help="with --format hf: fold a LoRA run's adapters into the weights",
    )


def run(args: argparse.Namespace) -> int:
    """Write a fine-tuned run's best (else latest) checkpoint, or a checkpoint file, as
    ``--format`` says (see the module docstring)."""
    from ..checkpoint import load
    from ..data import HFTokenizer, tokenizer_from_dict
    from ..interop.peft import save_adapter
    from ..train.lora import KEY
    from ..train.rundir import RunDir

    if args.merge and args.format != "hf":
        raise ConfigError(
            "export --merge writes full weights: it goes with --format hf (--format peft "
            "writes the adapter alone)"
        )
    source = Path(args.source)
    if source.is_dir():
        path = RunDir(source).best_or_latest()
        if path is None:
            raise ConfigError(f"run folder {args.source!r} holds no checkpoint")
    elif source.is_file():
        path = source
    else:
        raise ConfigError(f"{args.source!r} is neither a run folder nor a checkpoint file")
    model, extra = stored_model(path, f"export --format {args.format}")
    adapted = KEY in extra
    if args.format == "peft" and not adapted:
        raise ConfigError(
            f"{path}: export --format peft writes LoRA adapters and this run has none (trained "
            "without --lora); write its weights with --format hf"
        )
    if args.format == "hf" and adapted != args.merge:
        raise ConfigError(
            f"{path}: export --format hf of a LoRA run needs --merge (the adapters folded into "
            "the weights), or write the adapter with --format peft"
            if adapted
            else f"{path}: export --merge folds LoRA adapters into the weights and this run "
            "has none (trained without --lora); leave --merge out"
        )
    load(path, model)
    if args.format == "peft":
        targets = save_adapter(model, args.dir)
        print(
            f"exported the LoRA adapter of {path} ({len(targets)} modules) to {args.dir} "
            "(peft.PeftModel.from_pretrained loads it onto the --init model)"
        )
        return 0
    if args.merge:
        for kept, split in merge_adapters(model):
            print(
                f"untied {split} from {kept}: the merge changes them differently, so the "
                "export holds both tensors (tie_word_embeddings false)"
            )
    tokenizer = tokenizer_from_dict(extra["vocab"]) if "vocab" in extra else None
    model.save_pretrained(args.dir)
    if isinstance(tokenizer, HFTokenizer):
        tokenizer.save(args.dir)
    print(
        f"exported {path} to {args.dir} ({type(model).__name__}; transformers' "
        "AutoModelForCausalLM.from_pretrained loads it)"
    )
    return 0


def merge_adapters(model: Any) -> list[tuple[str, str]]:
    """Fold ``model``'s adapters into its weights and remove them; returns the ties the
    merge split, ``(kept, split)`` (``tiegrad.adapters.untied_by_merge``)."""
    from ..adapters import merge, unload, untied_by_merge

    untied = untied_by_merge(model)
    merge(model, untie=True)
    unload(model)
    return untied
