"""The configuration of a language-model run: defaults, TOML files, flags, validation.

A configuration is a flat dict with exactly the keys of ``DEFAULTS``. It is
resolved in three layers, later ones winning: ``DEFAULTS``, a TOML file
(``--config FILE.toml``, flat ``key = value`` pairs), then command-line flags. A key
that does not exist, a value of the wrong type or out of range is a ``ConfigError``
naming the key (and the file), raised before anything is built; integers are
64-bit (TOML's range), so ``steps = 10**26`` is refused rather than run forever.

The defaults are the main job, ``tiegrad train`` with no arguments: a character
``TiedLM`` trained on the standard library's source (``text = ""``), sized to finish
within a few minutes on two CPU cores.
"""

from __future__ import annotations

import json
import math
import os
import re
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ..checkpoint.fileio import MAX_JSON_BYTES, read_limited
from ..errors import ConfigError
from ..optim.hyperparams import INT64_LIMIT
from .lora import parse_lora

DEFAULTS: dict[str, Any] = {
    # data
    "text": "",
    "vocab": "char",
    "corpus_chars": 2_000_000,
    "val_fraction": 0.1,
    "init": "",
    "lora": "",
    "freeze": "",
    "add_tokens": "",
    "train_rows": "all",
    # model (TiedLM)
    "d_model": 128,
    "n_layers": 2,
    "n_heads": 4,
    "seq_len": 64,
    "mlp_ratio": 4,
    "dropout": 0.0,
    # optimization
    "steps": 1000,
    "batch_size": 32,
    "grad_accum": 1,
    "lr": 3e-3,
    "min_lr": 3e-4,
    "warmup_steps": -1,
    "warmup_ratio": 0.05,
    "weight_decay": 0.01,
    "clip_norm": 1.0,
    # evaluation, checkpoints, run
    "eval_every": 100,
    "eval_batches": 8,
    "sample_every": 100,
    "log": "",
    "checkpoint_every": 250,
    "keep_last": 3,
    "patience": 0,
    "seed": 0,
    "device": "cpu",
    "shard": "",
    "run": "",
    "progress": True,
}

#: What each key means (the command's help and the README reference use it).
HELP: dict[str, str] = {
    "text": "training text file (UTF-8); empty: the Python standard library's source",
    "vocab": "token vocabulary: char or byte",
    "corpus_chars": "size cap of the standard-library corpus, in characters",
    "val_fraction": "fraction of the text (its end) held out for validation",
    "init": "Hugging Face model directory to fine-tune: GPT-2 or the Llama family (llama, "
    "qwen2, qwen3, smollm3, mistral); empty: a new TiedLM",
    "lora": "train LoRA adapters only, the --init model frozen: "
    "rank=N,alpha=A,dropout=P,targets=NAME[+NAME...]; empty: train every weight",
    "freeze": "parameter paths whose use does not train: comma-separated globs "
    "(model.embed_tokens.weight freezes the input use; a tied storage trains through its "
    "other uses); empty: every weight trains",
    "add_tokens": "a file of tokens, one per line, added to the --init folder's tokenizer; "
    "the model's vocabulary grows to match (new rows: the mean of the old); empty: none",
    "train_rows": "rows of the token embedding (and head) that train: all, or new (the "
    "added tokens' rows alone; the other rows stay as they are)",
    "d_model": "model width",
    "n_layers": "transformer blocks",
    "n_heads": "attention heads (must divide d_model)",
    "seq_len": "context length in tokens",
    "mlp_ratio": "MLP hidden width as a multiple of d_model",
    "dropout": "dropout probability in [0, 1)",
    "steps": "optimizer steps",
    "batch_size": "sequences per batch",
    "grad_accum": "batches accumulated into one step",
    "lr": "peak learning rate (AdamW)",
    "min_lr": "learning rate at the end of the cosine decay",
    "warmup_steps": "linear warmup steps (at most the step count); -1: warmup_ratio of the steps",
    "warmup_ratio": "linear warmup as a fraction of the steps, when warmup_steps is -1",
    "weight_decay": "AdamW weight decay",
    "clip_norm": "global gradient-norm clip; 0 turns clipping off",
    "eval_every": "evaluate on the validation split every N steps",
    "eval_batches": "validation batches per evaluation",
    "sample_every": "print a text sample at the evaluations every N steps; 0 prints none",
    "log": "extra log writers: tensorboard (event files in RUN/tensorboard); empty: none",
    "checkpoint_every": "write a checkpoint every N steps",
    "keep_last": "periodic checkpoints kept (the best is kept as well)",
    "patience": "stop after N evaluations without improvement; 0 never stops early",
    "seed": "seed of initialization, batches and dropout",
    "device": "cpu, or a device backend (cuda, mps, torch:cpu)",
    "shard": "data parallel: split the optimizer state (optimizer) or also the gradients "
    "(gradients) over the processes; empty: every process holds all",
    "run": "run folder; empty: runs/<date-time>",
    "progress": "show the progress bar",
}

_PATH_KEYS = ("text", "init", "run", "add_tokens")
_CHOICES = {
    "train_rows": ("all", "new"),
    "vocab": ("char", "byte"),
    "log": ("", "tensorboard"),
    "shard": ("", "optimizer", "gradients"),
}
#: key -> (lowest allowed, whether the lowest is excluded, highest or None).
_RANGES: dict[str, tuple[float, bool, float | None]] = {
    "corpus_chars": (1, False, None),
    "val_fraction": (0.0, True, 1.0),
    "d_model": (1, False, None),
    "n_layers": (1, False, None),
    "n_heads": (1, False, None),
    "seq_len": (1, False, None),
    "mlp_ratio": (1, False, None),
    "dropout": (0.0, False, 1.0),
    "steps": (1, False, None),
    "batch_size": (1, False, None),
    "grad_accum": (1, False, None),
    "lr": (0.0, True, None),
    "min_lr": (0.0, False, None),
    "warmup_steps": (-1, False, None),
    "warmup_ratio": (0.0, False, 1.0),
    "sample_every": (0, False, None),
    "weight_decay": (0.0, False, None),
    "clip_norm": (0.0, False, None),
    "eval_every": (1, False, None),
    "eval_batches": (1, False, None),
    "checkpoint_every": (1, False, None),
    "keep_last": (1, False, None),
    "patience": (0, False, None),
    "seed": (0, False, None),
}


def check_value(key: str, value: Any, where: str = "", label: str | None = None) -> Any:
    """``value`` checked (and, for float keys, converted) for ``key``; else ``ConfigError``.

    The message names ``label`` (e.g. the flag ``--steps``) or the key and ``where``.
    """
    origin = f" in {where}" if where else ""
    if key not in DEFAULTS:
        known = ", ".join(sorted(DEFAULTS))
        raise ConfigError(f"unknown config key {key!r}{origin} (known keys: {known})")
    name = label or f"config key {key!r}{origin}"
    default = DEFAULTS[key]
    kind = type(default)
    if kind is bool:
        ok = isinstance(value, bool)
    elif kind is int:
        ok = isinstance(value, int) and not isinstance(value, bool)
    elif kind is float:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        if ok:
            value = float(value)
            ok = math.isfinite(value)
    else:
        ok = isinstance(value, str)
    if not ok:
        article = {float: "a finite", int: "an"}.get(kind, "a")
        raise ConfigError(f"{name}: expected {article} {kind.__name__}, got {value!r}")
    if kind is int and not -INT64_LIMIT <= value < INT64_LIMIT:  # steps = 10**26, seed 2**70
        raise ConfigError(
            f"{name}: expected a 64-bit integer (|value| < 2**63), got an integer of "
            f"{value.bit_length()} bits"
        )
    if key in _CHOICES and value not in _CHOICES[key]:
        listed = ", ".join(repr(c) for c in _CHOICES[key] if c)
        empty = " or empty" if "" in _CHOICES[key] else ""
        raise ConfigError(f"{name}: expected one of {listed}{empty}, got {value!r}")
    if key == "lora" and value:
        parse_lora(value, name)
    if key == "freeze" and value:
        parse_freeze(value, name)
    if key in _RANGES:
        low, strict, high = _RANGES[key]
        bad_low = value <= low if strict else value < low
        bad_high = high is not None and value >= high
        if bad_low or bad_high:
            span = f"{'>' if strict else '>='} {low}" + (
                f" and < {high}" if high is not None else ""
            )
            raise ConfigError(f"{name}: expected a value {span}, got {value!r}")
    return value


def check_config(
    config: Mapping[str, Any], labels: Mapping[str, str] | None = None
) -> dict[str, Any]:
    """Check every key of a complete configuration and the rules between keys; a rule's
    message names each key by its flag in ``labels`` (``--heads``) where it has one
    (the command line set it), else by the key."""
    missing = sorted(set(DEFAULTS) - set(config))
    if missing:
        raise ConfigError(f"configuration lacks keys {missing}")
    out = {k: check_value(k, v) for k, v in config.items()}
    labels = labels or {}

    def named(key: str) -> str:
        return labels.get(key, key)

    if out["d_model"] % out["n_heads"]:
        raise ConfigError(
            f"config: {named('n_heads')} ({out['n_heads']}) must divide {named('d_model')} "
            f"({out['d_model']})"
        )
    if out["lora"] and not out["init"]:
        raise ConfigError(
            "config: lora (--lora) adapts the model of init: give --init DIR with --lora"
        )
    if out["add_tokens"] and not out["init"]:
        raise ConfigError(
            f"config: {named('add_tokens')} grows the model of init: give --init DIR with it"
        )
    if out["train_rows"] == "new" and not out["add_tokens"]:
        raise ConfigError(
            f"config: {named('train_rows')} new trains the rows of added tokens: give "
            f"{named('add_tokens')} FILE with it"
        )
    if out["train_rows"] == "new" and out["lora"]:
        raise ConfigError(
            f"config: {named('train_rows')} new and {named('lora')} do not go together: "
            "--lora freezes the embedding whose new rows would train"
        )
    if out["lora"] and out["freeze"]:
        raise ConfigError(
            f"config: {named('freeze')} and {named('lora')} do not go together: --lora "
            "freezes every weight of the model already (its adapters train)"
        )
    if out["min_lr"] > out["lr"]:
        raise ConfigError(
            f"config: {named('min_lr')} ({out['min_lr']}) exceeds {named('lr')} ({out['lr']})"
        )
    return out


def parse_freeze(text: str, label: str = "--freeze") -> list[str]:
    """The glob patterns of a ``freeze`` setting (comma-separated parameter paths, ``*``
    crossing dots as in ``Module.freeze``); an empty item is a ``ConfigError`` naming
    ``label``. Whether each matches a path of the model is checked where the model is
    built (``tiegrad.train.job.apply_freeze``)."""
    patterns = [p.strip() for p in text.split(",")]
    if not all(patterns):
        raise ConfigError(
            f"{label}: expected comma-separated parameter paths or globs (e.g. "
            f"model.embed_tokens.weight), got {text!r:.80} with an empty item"
        )
    return patterns


def warmup_steps(config: Mapping[str, Any]) -> int:
    """The warmup length of a run: ``warmup_steps``, or with -1 ``warmup_ratio`` of the
    steps (rounded), at most the step count."""
    steps = config["steps"]
    n = config["warmup_steps"]
    if n < 0:
        n = round(config["warmup_ratio"] * steps)
    return min(n, steps)


def read_toml(path: str | os.PathLike) -> dict[str, Any]:
    """The key-value pairs of a TOML file, relative paths resolved against its folder.

    Python 3.11+ parses with ``tomllib``; on 3.10 a small parser reads flat
    ``key = value`` lines (strings, integers, floats, booleans, comments). Unknown
    keys and bad values are ``ConfigError``s naming the file.
    """
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file {str(path)!r} does not exist or is not a file")
    try:
        raw = read_limited(path, MAX_JSON_BYTES, ConfigError, f"config file {str(path)!r}").decode()
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"config file {str(path)!r} cannot be read: {e}") from None
    data = _parse_toml(raw, str(path))
    out = {}
    for key, value in data.items():
        value = check_value(key, value, str(path))
        if key in _PATH_KEYS and value and not os.path.isabs(value):
            value = os.path.normpath(path.parent / value)
        out[key] = value
    return out


def _parse_toml(raw: str, where: str) -> dict[str, Any]:
    if sys.version_info >= (3, 11):
        import tomllib

        try:
            return tomllib.loads(raw)
        except (tomllib.TOMLDecodeError, RecursionError) as e:  # nesting past the stack
            raise ConfigError(f"config file {where!r} is not valid TOML: {e}") from None
    return parse_flat_toml(raw, where)


_LINE = re.compile(r"^([A-Za-z_][A-Za-z0-9_-]*)\s*=\s*(.+?)\s*$")


def parse_flat_toml(raw: str, where: str) -> dict[str, Any]:
    """A subset of TOML: flat ``key = value`` lines, ``#`` comments, basic strings,
    literal strings, integers, floats and booleans. Anything else is a ``ConfigError``
    naming the line (use Python 3.11+ for full TOML)."""
    out: dict[str, Any] = {}
    for n, line in enumerate(raw.splitlines(), 1):
        text = _strip_comment(line).strip()
        if not text:
            continue
        m = _LINE.match(text)
        if not m:
            raise ConfigError(
                f"config file {where!r} line {n}: expected 'key = value' (tables and other "
                f"TOML forms need Python 3.11+), got {line.strip()!r}"
            )
        key, value = m.group(1), m.group(2)
        if key in out:
            raise ConfigError(f"config file {where!r} line {n}: key {key!r} is set twice")
        out[key] = _scalar(value, where, n)
    return out


def _strip_comment(line: str) -> str:
    quote = None
    for i, c in enumerate(line):
        if quote:
            if c == quote:
                quote = None
        elif c in "\"'":
            quote = c
        elif c == "#":
            return line[:i]
    return line


def _scalar(text: str, where: str, n: int) -> Any:
    if text in ("true", "false"):
        return text == "true"
    if len(text) >= 2 and text[0] == text[-1] == "'":
        return text[1:-1]
    if len(text) >= 2 and text[0] == text[-1] == '"':
        try:
            return json.loads(text)
        except ValueError:
            pass
    else:
        number = text.replace("_", "")
        try:
            return int(number)
        except ValueError:
            pass
        try:
            value = float(number)
        except ValueError:
            pass
        else:
            if math.isfinite(value):
                return value
    raise ConfigError(f"config file {where!r} line {n}: cannot read the value {text!r}")


def resolve(
    file: str | os.PathLike | None = None,
    overrides: Mapping[str, Any] | None = None,
    labels: Mapping[str, str] | None = None,
) -> dict[str, Any]:
    """``DEFAULTS``, then the TOML ``file``, then ``overrides`` (flags), checked.

    ``labels`` names the flag of each override key in error messages.
    """
    config = dict(DEFAULTS)
    if file is not None:
        config.update(read_toml(file))
    labels = labels or {}
    for key, value in (overrides or {}).items():
        config[key] = check_value(key, value, "the command line", labels.get(key))
    return check_config(config, {k: labels[k] for k in overrides or {} if k in labels})
