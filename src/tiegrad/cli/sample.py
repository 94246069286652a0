"""``tiegrad sample``: generate text from a run's best checkpoint (or a checkpoint file).

The model is rebuilt from the class and configuration the checkpoint stores (a
``TiedLM``, or the ``GPT2`` or ``LlamaLM`` of a ``--init`` run), and the text is encoded
and decoded with the run's stored tokenizer. The configuration is checked against the
file's own slots and sizes before anything is built (C6), so a damaged or hostile file
cannot make the command allocate more than it holds; loading never runs code from the
file (C9).
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from ..errors import ConfigError
from .checkpoints import checkpoint_schema, model_config, stored_model
from .runs import LATEST, RUNS, newest_run


def add_parser(sub: Any) -> None:
    """The ``sample`` subcommand: where the checkpoint is, the prompt and the sampling."""
    sample = sub.add_parser("sample", help="generate text from a run's best checkpoint")
    sample.set_defaults(handler=run)
    sample.add_argument(
        "--run", metavar="DIR", help=f"run folder, its best checkpoint (default: {RUNS}/{LATEST})"
    )
    sample.add_argument("--checkpoint", metavar="FILE", help="a checkpoint file instead")
    sample.add_argument("--prompt", default="", help="text to continue (default: none)")
    sample.add_argument("--tokens", type=int, default=200, help="tokens to generate (default: 200)")
    sample.add_argument(
        "--temperature",
        type=float,
        default=0.8,
        help="sampling temperature; 0 is greedy (default: 0.8)",
    )
    sample.add_argument(
        "--top-k", type=int, default=None, help="sample among the k most likely (default: all)"
    )
    sample.add_argument("--seed", type=int, default=0, help="sampling seed (default: 0)")


def run(args: argparse.Namespace) -> int:
    """Generate ``--tokens`` tokens after ``--prompt`` and print the text, decoded with the
    run's stored tokenizer; with a Hugging Face tokenizer that names an end-of-sequence
    token, generation stops there and the text ends before it."""
    import numpy as np

    from ..checkpoint import load
    from ..data import tokenizer_from_dict
    from ..train.config import check_value
    from ..train.rundir import RunDir

    if args.tokens < 1:
        raise ConfigError(f"--tokens must be >= 1, got {args.tokens}")
    if not args.temperature >= 0:
        raise ConfigError(f"--temperature must be >= 0 (0 is greedy), got {args.temperature}")
    if args.top_k is not None and args.top_k < 1:
        raise ConfigError(f"--top-k must be >= 1, got {args.top_k}")
    check_value("seed", args.seed, label="--seed")
    if args.run is not None and args.checkpoint is not None:
        raise ConfigError("sample: give one of --run DIR and --checkpoint FILE, not both")
    if args.checkpoint is not None:
        path = Path(args.checkpoint)
        if not path.is_file():
            raise ConfigError(f"checkpoint {args.checkpoint!r} does not exist or is not a file")
    else:
        folder = args.run if args.run is not None else newest_run()
        found = RunDir(folder).best_or_latest()
        if found is None:
            raise ConfigError(f"run folder {folder!r} holds no checkpoint")
        path = found
    extra = checkpoint_schema(path).extra
    if model_config(extra) is None or not isinstance(extra.get("vocab"), dict):
        raise ConfigError(f"{path}: not a checkpoint of 'tiegrad train' (no model or vocab)")
    vocab = tokenizer_from_dict(extra["vocab"])
    prompt = args.prompt or default_prompt(vocab)
    try:
        ids = vocab.encode(prompt)[None, :]
    except ConfigError as e:
        raise ConfigError(f"--prompt {args.prompt!r}: {e}") from None
    model, _ = stored_model(path, "sample", pretrained=False)
    load(path, model)
    model.eval()
    rng = np.random.default_rng(args.seed)
    eos = getattr(vocab, "eos_token_id", None)
    out = model.generate(
        ids, args.tokens, temperature=args.temperature, rng=rng, top_k=args.top_k,
        eos_token_id=eos,
    )  # fmt: skip
    text = vocab.decode(until_eos(np.asarray(out)[0], ids.shape[1], eos))
    print(text if args.prompt else text[1:])
    return 0


def until_eos(ids: Any, prompt: int, eos: int | None) -> Any:
    """``ids`` up to the first ``eos`` after the ``prompt`` tokens (left out, as
    transformers' ``decode(..., skip_special_tokens=True)`` leaves it); all of them
    without an ``eos``."""
    import numpy as np

    if eos is None:
        return ids
    stops = np.flatnonzero(ids[prompt:] == eos)
    return ids[: prompt + stops[0]] if stops.size else ids


def default_prompt(vocab: Any) -> str:
    """The prompt of a sample without ``--prompt``: a newline when the vocabulary holds
    one, else its first character (a character vocabulary of a text without newlines)."""
    chars = getattr(vocab, "chars", "")
    return "\n" if not chars or "\n" in chars else chars[0]
