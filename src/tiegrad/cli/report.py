"""What the training commands print: the resolved configuration first, a summary last.

The configuration block shows every setting a run uses (and those that differ from the
defaults), so a log says what was trained; the summary says where the run's files are
and which command continues or samples it.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from typing import Any


def quote(path: str) -> str:
    """``path`` as the printed commands write it: quoted unless it is plain."""
    return path if all(c.isalnum() or c in "/._-" for c in path) else repr(path)


def print_config(
    config: Mapping[str, Any],
    text: str,
    dataset: Any,
    model: Any,
    command: str,
    schedule: Any = None,
) -> None:
    """Print the resolved configuration. ``schedule``: a resumed run's stored schedule
    state, whose warmup and length are printed (the run keeps them, whatever ``steps``
    now is); else they follow from ``config``."""
    from ..errors import shown_list
    from ..train.config import DEFAULTS, warmup_steps
    from ..train.lora import parse_lora

    unique = model.num_parameters()
    c = config
    warmup, length = warmup_steps(c), c["steps"]
    if isinstance(schedule, dict) and all(
        type(schedule.get(k)) is int for k in ("warmup_steps", "total_steps")
    ):  # a malformed state prints the configured one; the checkpoint's load refuses it
        warmup, length = schedule["warmup_steps"], schedule["total_steps"]
    kept = ""
    if length != c["steps"]:
        kept = f"; the run keeps its schedule of {length} steps"
        if length < c["steps"]:
            kept += f" (steps {length + 1}-{c['steps']} at min_lr)"
    if c["chat"]:
        by = "generation blocks" if dataset.template.marks_generation else "prefix rendering"
        split = (
            f"train {len(dataset.train):,} / val {len(dataset.val):,} conversations "
            f"({dataset.train.trained:,} assistant tokens in training); template "
            f"{dataset.template.where}, assistant tokens by {by}"
        )
    else:
        split = f"train {len(dataset.train):,} / val {len(dataset.val):,} tokens"
    print(f"tiegrad {command}: resolved configuration")
    print(
        f"  data     {text}; vocab {dataset.vocab.kind if c['init'] else c['vocab']} "
        f"({dataset.vocab_size} symbols); {split}"
    )
    if c["init"]:
        print(f"  model    {model.label()} from {c['init']}; {unique:,} parameters")
    else:
        print(
            f"  model    TiedLM d_model={c['d_model']} n_layers={c['n_layers']} "
            f"n_heads={c['n_heads']} seq_len={c['seq_len']} mlp_ratio={c['mlp_ratio']} "
            f"dropout={c['dropout']}; {unique:,} parameters (embedding tied to the output)"
        )
    if c["freeze"]:
        frozen = [path for path, p in model.named_slots() if not p.requires_grad]
        print(
            f"  freeze   {c['freeze']}: {shown_list(frozen)} frozen (per use: a tied storage "
            "trains through its other uses)"
        )
    if c["lora"]:
        trainable = sum(p.size for _, p in model.named_parameters() if p.requires_grad)
        spec = parse_lora(c["lora"]).text()
        print(f"  lora     {spec}; {trainable:,} parameters train, the rest is frozen")
    print(
        f"  optim    AdamW lr={c['lr']:g} min_lr={c['min_lr']:g} "
        f"warmup={warmup} "
        f"weight_decay={c['weight_decay']:g} clip_norm={c['clip_norm']:g}{kept}"
    )
    print(
        f"  train    steps={c['steps']} batch_size={c['batch_size']} "
        f"grad_accum={c['grad_accum']} seed={c['seed']} device={c['device']}"
    )
    print(
        f"  run      {c['run']} (eval every {c['eval_every']}, checkpoint every "
        f"{c['checkpoint_every']}, keep {c['keep_last']})"
    )
    changed = sorted(k for k in DEFAULTS if c[k] != DEFAULTS[k] and k != "run")
    if changed:
        print(f"  changed  {', '.join(f'{k}={c[k]}' for k in changed)}")
    sys.stdout.flush()


def clock(seconds: float) -> str:
    """``seconds`` as ``<minutes>m<seconds>s``."""
    minutes, seconds = divmod(seconds, 60)
    return f"{int(minutes)}m{seconds:04.1f}s"


def print_summary(result: Any, run: Any, unit: str) -> None:
    """How the run ended (``result``, a ``TrainResult``), its losses in nats per ``unit``,
    its files and the command that samples it."""
    verb = {"completed": "done", "early_stopped": "stopped early", "interrupted": "interrupted"}
    line = f"{verb[result.status]}: {result.step} steps in {clock(result.elapsed)}"
    if result.resumed_from is not None:
        line += (
            f" in all (this process: {result.process_steps} steps from step "
            f"{result.resumed_from} in {clock(result.process_elapsed)})"
        )
    print(line)
    if result.status == "interrupted" and result.train_loss is not None:
        loss, step = result.train_loss, result.train_loss_step
        print(f"last train loss: {loss:.4f} nats/{unit} (step {step})")
    if result.val_loss is not None:
        best = "" if result.best_val_loss is None else f" (best {result.best_val_loss:.4f})"
        at = f" at step {result.val_loss_step}" if result.val_loss_step != result.step else ""
        print(f"final validation loss: {result.val_loss:.4f} nats/{unit}{at}{best}")
    print(f"checkpoint: {result.checkpoint}")
    if result.best_checkpoint is not None:
        print(f"best:       {result.best_checkpoint}")
    print(f"metrics:    {result.metrics}, {result.metrics_csv}")
    if result.plot is not None:
        print(f"plot:       {result.plot}")
    if result.status != "interrupted":
        print(f"sample:     tiegrad sample --run {quote(str(run.path))}")
    if (run.path / "tensorboard").is_dir():
        print(f"tensorboard: tensorboard --logdir {quote(str(run.path / 'tensorboard'))}")
