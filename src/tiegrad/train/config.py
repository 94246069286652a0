"""The settings of a training run: ``TrainConfig``, its TOML files and flags.

``TrainConfig`` is the one description of a run's settings. Each field carries its
default, type, help text, flag and allowed values (``setting``), so adding a setting
is one field: the ``Trainer`` reads it, ``tiegrad train`` gets its flag and ``--help``
line, TOML files and ``config.json`` read and write it.

A configuration is resolved in three layers, later ones winning: the defaults, a TOML
file (``--config FILE.toml``, flat ``key = value`` pairs), then command-line flags
(``resolve``). A key that does not exist, a value of the wrong type or out of range is
one ``ConfigError`` naming the key (its flag, or the file) with the expected and the
actual value, raised before anything is built or written (C6); integers are 64-bit
(TOML's range), so ``steps = 10**26`` is refused rather than run forever.

The defaults are the main job, ``tiegrad train`` with no arguments: a character
``TiedLM`` trained on the standard library's source (``text = ""``), sized to finish
within a few minutes on two CPU cores.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import math
import os
import re
import sys
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..checkpoint.fileio import MAX_JSON_BYTES, read_limited
from ..errors import ConfigError, shown_list
from ..optim.hyperparams import INT64_LIMIT
from .lora import parse_lora


def setting(
    default: Any,
    help: str,
    *,
    flag: str | None = None,
    metavar: str | None = None,
    choices: tuple[str, ...] | None = None,
    low: float | None = None,
    low_excluded: bool = False,
    below: float | None = None,
    path: bool = False,
) -> Any:
    """A ``TrainConfig`` field: its ``default`` (whose type is the field's: ``bool``,
    ``int``, ``float`` or ``str``) and its ``help`` text, the command-line ``flag``
    (default ``--`` and the name with dashes) and ``metavar``, the allowed values
    (``choices``; or ``low`` (excluded with ``low_excluded``) up to ``below``, excluded),
    and whether it is a file or folder (``path``: relative to a TOML file's folder)."""
    return field(
        default=default,
        metadata={
            "help": help,
            "flag": flag,
            "metavar": metavar,
            "choices": choices,
            "low": low,
            "low_excluded": low_excluded,
            "below": below,
            "path": path,
        },
    )


@dataclass(frozen=True)
class TrainConfig(Mapping[str, Any]):
    """The settings of a training run, checked when made (C6).

    ``Trainer(model, optimizer, ..., config=TrainConfig(steps=500, eval_every=50))``
    reads the loop's settings: ``steps``, ``grad_accum``, ``clip_norm``, ``eval_every``,
    ``checkpoint_every``, ``keep_last``, ``patience``, ``min_delta``, ``seed``,
    ``device``, ``progress`` and ``run`` (its folder; empty: none). The other fields
    describe the job ``tiegrad train`` builds from them (data, model, optimizer and
    schedule: ``tiegrad.train.job``); a ``Trainer`` is given those objects instead.

    Every value is checked against its field (type, 64-bit integers, choices, range)
    and the rules between fields; a bad one is a ``ConfigError`` naming the key, the
    expected and the actual value. The instance is frozen, so a checked configuration
    stays checked: ``replace(key=value)`` returns a new one, checked again.

    It is also a read-only mapping of its fields (``config["steps"]``, ``dict(config)``),
    the form of a run's ``config.json`` and of the job builders' input.
    """

    # data
    text: str = setting(
        "",
        "training text file (UTF-8); empty: the Python standard library's source",
        metavar="FILE",
        path=True,
    )
    chat: str = setting(
        "",
        'JSON Lines file of conversations ({"messages": [{"role": ..., "content": ...}, '
        "...]}) rendered with the chat template of init; the loss is taken on the "
        "assistant's tokens alone; empty: train on text",
        metavar="FILE.jsonl",
        path=True,
    )
    vocab: str = setting("char", "token vocabulary: char or byte", choices=("char", "byte"))
    corpus_chars: int = setting(
        2_000_000, "size cap of the standard-library corpus, in characters", low=1
    )
    val_fraction: float = setting(
        0.1,
        "fraction of the text (its end) held out for validation",
        low=0.0,
        low_excluded=True,
        below=1.0,
    )
    init: str = setting(
        "",
        "Hugging Face model directory to fine-tune: GPT-2 or the Llama family (llama, "
        "qwen2, qwen3, smollm3, mistral); empty: a new TiedLM",
        metavar="DIR",
        path=True,
    )
    lora: str = setting(
        "",
        "train LoRA adapters only, the --init model frozen: "
        "rank=N,alpha=A,dropout=P,targets=NAME[+NAME...]; empty: train every weight",
        metavar="SPEC",
    )
    freeze: str = setting(
        "",
        "parameter paths whose use does not train: comma-separated globs "
        "(model.embed_tokens.weight freezes the input use; a tied storage trains through "
        "its other uses); empty: every weight trains",
        metavar="PATHS",
    )
    add_tokens: str = setting(
        "",
        "a file of tokens, one per line, added to the --init folder's tokenizer; the "
        "model's vocabulary grows to match (new rows: the mean of the old); empty: none",
        metavar="FILE",
        path=True,
    )
    train_rows: str = setting(
        "all",
        "rows of the token embedding (and head) that train: all, or new (the added "
        "tokens' rows alone; the other rows stay as they are)",
        choices=("all", "new"),
    )
    # model (TiedLM)
    d_model: int = setting(128, "model width", low=1)
    n_layers: int = setting(2, "transformer blocks", flag="--layers", low=1)
    n_heads: int = setting(4, "attention heads (must divide d_model)", flag="--heads", low=1)
    seq_len: int = setting(64, "context length in tokens", low=1)
    mlp_ratio: int = setting(4, "MLP hidden width as a multiple of d_model", low=1)
    dropout: float = setting(0.0, "dropout probability in [0, 1)", low=0.0, below=1.0)
    # optimization
    steps: int = setting(1000, "optimizer steps", low=1)
    batch_size: int = setting(32, "sequences per batch", low=1)
    grad_accum: int = setting(1, "batches accumulated into one step", low=1)
    lr: float = setting(3e-3, "peak learning rate (AdamW)", low=0.0, low_excluded=True)
    min_lr: float = setting(3e-4, "learning rate at the end of the cosine decay", low=0.0)
    warmup_steps: int = setting(
        -1,
        "linear warmup steps (at most the step count); -1: warmup_ratio of the steps",
        low=-1,
    )
    warmup_ratio: float = setting(
        0.05,
        "linear warmup as a fraction of the steps, when warmup_steps is -1",
        low=0.0,
        below=1.0,
    )
    weight_decay: float = setting(0.01, "AdamW weight decay", low=0.0)
    clip_norm: float = setting(1.0, "global gradient-norm clip; 0 turns clipping off", low=0.0)
    recompute: bool = setting(
        False,
        "recompute each block in backward instead of keeping its activations (less memory, "
        "the same gradients, about one more forward per step)",
    )
    # evaluation, checkpoints, run
    eval_every: int = setting(
        100,
        "evaluate on the validation split every N steps (and at the end); 0: at the end only",
        low=0,
    )
    eval_batches: int = setting(8, "validation batches per evaluation", low=1)
    sample_every: int = setting(
        100, "print a text sample at the evaluations every N steps; 0 prints none", low=0
    )
    log: str = setting(
        "",
        "extra log writers: tensorboard (event files in RUN/tensorboard); empty: none",
        choices=("", "tensorboard"),
        metavar="{tensorboard}",
    )
    checkpoint_every: int = setting(
        250, "write a checkpoint every N steps (and at the end); 0: at the end only", low=0
    )
    keep_last: int = setting(3, "periodic checkpoints kept (the best is kept as well)", low=1)
    patience: int = setting(
        0, "stop after N evaluations without improvement; 0 never stops early", low=0
    )
    min_delta: float = setting(
        0.0,
        "the least decrease of the validation loss that counts as an improvement",
        low=0.0,
    )
    seed: int = setting(0, "seed of initialization, batches and dropout", low=0)
    device: str = setting("cpu", "cpu, or a device backend (cuda, mps, torch:cpu)")
    shard: str = setting(
        "",
        "data parallel: split the optimizer state (optimizer) or also the gradients "
        "(gradients) over the processes; empty: every process holds all",
        choices=("", "optimizer", "gradients"),
        metavar="{optimizer,gradients}",
    )
    run: str = setting("", "run folder; empty: runs/<date-time>", metavar="DIR", path=True)
    progress: bool = setting(
        True, "show the progress bar (--no-progress hides it)", flag="--no-progress"
    )

    def __post_init__(self) -> None:
        for key, value in _checked(self._values(), {}).items():
            object.__setattr__(self, key, value)  # floats given as ints become floats

    @classmethod
    def from_mapping(
        cls,
        values: Mapping[str, Any],
        where: str = "",
        labels: Mapping[str, str] | None = None,
    ) -> TrainConfig:
        """The configuration of ``values`` (any subset of the keys, the rest their
        defaults): a TOML file's pairs, a run's ``config.json``, keyword settings.
        ``where`` (a file) and ``labels`` (key -> flag, ``--heads``) name the origin in
        a ``ConfigError``; an unknown key is one."""
        labels = labels or {}
        given = {k: check_value(k, v, where, labels.get(k)) for k, v in values.items()}
        return cls(**_checked({**DEFAULTS, **given}, labels))

    def replace(self, **changes: Any) -> TrainConfig:
        """A copy with ``changes``, checked as a new configuration is."""
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        """The settings as a plain dict (JSON-ready), in field order."""
        return self._values()

    def to_toml(self) -> str:
        """The settings as a TOML file that ``--config`` (``read_toml``) reads back to
        this configuration: flat ``key = value`` lines, in field order."""
        return "".join(f"{key} = {_toml_value(value)}\n" for key, value in self._values().items())

    def _values(self) -> dict[str, Any]:
        return {key: getattr(self, key) for key in FIELDS}

    def __getitem__(self, key: str) -> Any:
        if key not in FIELDS:
            raise KeyError(key)
        return getattr(self, key)

    def __iter__(self) -> Iterator[str]:
        return iter(FIELDS)

    def __len__(self) -> int:
        return len(FIELDS)


#: Every setting's field, by key, in the order ``--help`` lists them.
FIELDS: dict[str, dataclasses.Field] = {f.name: f for f in dataclasses.fields(TrainConfig)}
#: Every setting's default (``tiegrad train`` with no arguments).
DEFAULTS: dict[str, Any] = {key: f.default for key, f in FIELDS.items()}


def flag(key: str) -> str:
    """The command-line flag of the setting ``key`` (``n_layers``: ``--layers``)."""
    return FIELDS[key].metadata["flag"] or "--" + key.replace("_", "-")


def _toml_value(value: bool | int | float | str) -> str:
    """``value`` as TOML writes it (JSON's escapes are TOML's basic-string escapes)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return json.dumps(value)
    return repr(value)


def check_value(key: str, value: Any, where: str = "", label: str | None = None) -> Any:
    """``value`` checked (and, for float keys, converted) for the setting ``key``; else a
    ``ConfigError`` naming ``label`` (e.g. the flag ``--steps``) or the key and ``where``,
    the expected and the actual value. An unknown key names a few known ones."""
    origin = f" in {where}" if where else ""
    if key not in FIELDS:
        close = difflib.get_close_matches(key, FIELDS, n=3)
        known = shown_list(close) if close else shown_list(FIELDS)
        hint = "did you mean" if close else "known keys:"
        raise ConfigError(
            f"unknown config key {key!r:.80}{origin} ({hint} {known}; {len(FIELDS)} keys "
            "in all, listed by 'tiegrad train --help')"
        )
    name = label or f"config key {key!r}{origin}"
    meta = FIELDS[key].metadata
    kind = type(DEFAULTS[key])
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
        raise ConfigError(f"{name}: expected {article} {kind.__name__}, got {value!r:.80}")
    if kind is int and not -INT64_LIMIT <= value < INT64_LIMIT:  # steps = 10**26, seed 2**70
        raise ConfigError(
            f"{name}: expected a 64-bit integer (|value| < 2**63), got an integer of "
            f"{value.bit_length()} bits"
        )
    choices = meta["choices"]
    if choices is not None and value not in choices:
        listed = ", ".join(repr(c) for c in choices if c)
        empty = " or empty" if "" in choices else ""
        raise ConfigError(f"{name}: expected one of {listed}{empty}, got {value!r:.80}")
    if key == "lora" and value:
        parse_lora(value, name)
    if key == "freeze" and value:
        parse_freeze(value, name)
    low, below = meta["low"], meta["below"]
    if low is not None:
        strict = meta["low_excluded"]
        bad_low = value <= low if strict else value < low
        bad_high = below is not None and value >= below
        if bad_low or bad_high:
            span = f"{'>' if strict else '>='} {low}" + (
                f" and < {below}" if below is not None else ""
            )
            raise ConfigError(f"{name}: expected a value {span}, got {value!r}")
    return value


def _checked(values: Mapping[str, Any], labels: Mapping[str, str]) -> dict[str, Any]:
    """Every value of a complete configuration checked (``check_value``), then the
    rules between keys; a rule's message names each key by its flag in ``labels``
    (``--heads``) where it has one (the command line set it), else by the key."""
    out = {k: check_value(k, v) for k, v in values.items()}

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
    if out["chat"] and not out["init"]:
        raise ConfigError(
            f"config: {named('chat')} renders conversations with the chat template of the "
            "init folder's tokenizer: give --init DIR with --chat"
        )
    if out["chat"] and out["text"]:
        raise ConfigError(
            f"config: {named('chat')} and {named('text')} do not go together: a run trains "
            "on conversations or on text"
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
        if FIELDS[key].metadata["path"] and value and not os.path.isabs(value):
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
) -> TrainConfig:
    """The defaults, then the TOML ``file``, then ``overrides`` (flags), checked.

    ``labels`` names the flag of each override key in error messages.
    """
    values = read_toml(file) if file is not None else {}
    labels = labels or {}
    for key, value in (overrides or {}).items():
        values[key] = check_value(key, value, "the command line", labels.get(key))
    return TrainConfig.from_mapping(
        values, labels={k: labels[k] for k in overrides or {} if k in labels}
    )
