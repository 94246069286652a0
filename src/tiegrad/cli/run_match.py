"""Whether the checkpoint ``tiegrad resume`` would load is the run's own.

A run is its ``config.json``. Its checkpoints store what defines its model (``extra``:
the model's class and constructor arguments, the vocabulary, the LoRA specification)
and the run's id (``RUN_ID``, made when ``tiegrad train`` created the run).
``check_checkpoint`` compares them before anything is built or written (C6), so a
``config.json`` edited to another architecture, vocabulary or LoRA specification, or
another run's checkpoint copied into the folder, is refused instead of continued:

- the run id of ``config.json`` must be the checkpoint's (a run made before run ids
  has none in either and is matched by its model alone);
- the model class (``init``: one of ``PRETRAINED_CLASSES``, the ``GPT2`` or
  ``LlamaLM`` of a transformers directory, else a ``TiedLM``), the vocabulary
  (``vocab_table``, and ``vocab`` for a ``TiedLM``: the tokens ``--add-tokens`` added
  included), ``lora``, ``freeze`` and ``train_rows`` must be the checkpoint's;
- a ``TiedLM``'s constructor arguments (``d_model``, ``n_layers``, ``n_heads``,
  ``seq_len``, ``mlp_ratio``, ``dropout``, ``seed``) must be the checkpoint's; a
  fine-tuned run's model is the checkpoint's own;
- the stored model configuration must be that of the file's tensors
  (``checked_model_config``), so a crafted size is refused before it is allocated.

Errors name ``config.json`` and the checkpoint, the key with its flag
(``n_heads (--heads)``) and both values.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ..errors import CheckpointError, ConfigError
from .checkpoints import FREEZE, checked_model_config, model_config

#: Config keys whose ``TiedLM`` constructor argument has another name.
_ARGUMENT_KEYS = {"max_seq_len": "seq_len", "vocab_size": "vocab_table"}
#: How many differing keys an error names before "and N more".
_NAMED = 3


def check_checkpoint(
    config_path: Path, raw: dict[str, Any], config: Mapping[str, Any], path: Path, schema: Any
) -> str | None:
    """Refuse the checkpoint at ``path`` (its parsed ``schema``) unless it belongs to the
    run of ``config_path``: ``raw`` is that file's contents, ``config`` the resolved,
    checked configuration (see the module docstring). Returns the run's id, or ``None``
    for a run made before run ids. Reads nothing but the two headers; changes nothing."""
    from ..train.job import MODEL_CLASSES, PRETRAINED_CLASSES
    from ..train.lora import KEY
    from ..train.rundir import RUN_ID

    extra = schema.extra if isinstance(schema.extra, dict) else {}
    run_id = _run_id(config_path, raw.get(RUN_ID), path, extra.get(RUN_ID))
    kwargs = model_config(extra)
    model = extra.get("model")
    stored_class = model.get("class") if kwargs is not None else None
    if stored_class not in MODEL_CLASSES:
        raise CheckpointError(
            f"{path}: holds no model configuration of 'tiegrad train' (class "
            f"{stored_class!r:.40}), so it cannot be matched to the run of {config_path}"
        )
    fine_tuned = stored_class in PRETRAINED_CLASSES
    if bool(config["init"]) != fine_tuned:
        theirs = (
            f"a {stored_class} fine-tuned from an --init directory" if fine_tuned else "a TiedLM"
        )
        raise ConfigError(
            f"{config_path}: init (--init) is {config['init']!r}, but the checkpoint {path} "
            f"holds {theirs}: it is not this run's model"
        )
    vocab = extra.get("vocab")
    if not isinstance(vocab, dict):
        raise CheckpointError(f"{path}: holds no vocabulary (extra['vocab']), got {vocab!r:.40}")
    if raw.get("vocab_table") != vocab:
        raise ConfigError(
            f"{config_path}: vocab_table (the run's vocabulary, --vocab) is "
            f"{_vocabulary(raw.get('vocab_table'))}, but the checkpoint {path} was trained "
            f"with {_vocabulary(vocab)}{_first_difference(raw.get('vocab_table'), vocab)}"
        )
    _check_lora(config_path, config["lora"], path, extra.get(KEY))
    _check_freeze(config_path, config["freeze"], path, extra.get(FREEZE))
    _check_train_rows(config_path, config["train_rows"], path, schema.rows)
    if fine_tuned:
        checked_model_config(path, schema, kwargs, None, stored_class, lora=KEY in extra)
        return run_id
    if vocab.get("kind") != config["vocab"]:
        raise ConfigError(
            f"{config_path}: vocab (--vocab) is {config['vocab']!r}, but the checkpoint {path} "
            f"was trained with a {vocab.get('kind')!r:.40} vocabulary"
        )
    from ..data import tokenizer_from_dict
    from ..train.job import model_config as run_model_config

    size = tokenizer_from_dict(vocab).size
    checked = checked_model_config(path, schema, kwargs, size, "TiedLM")
    ours = run_model_config(config, size)
    differ = [k for k in ours if ours[k] != checked.get(k)]
    if differ:
        named = "; ".join(
            f"{_label(k)} is {ours[k]!r} in {config_path.name}, {checked.get(k)!r} in the "
            "checkpoint"
            for k in differ[:_NAMED]
        )
        more = f"; and {len(differ) - _NAMED} more" if len(differ) > _NAMED else ""
        raise ConfigError(
            f"{config_path}: the model differs from the one the checkpoint {path} was trained "
            f"with: {named}{more}. Restore the run's values (the keys a resume may change are "
            "listed in the command's documentation, 'Resuming a run')"
        )
    return run_id


def _run_id(config_path: Path, ours: Any, path: Path, theirs: Any) -> str | None:
    """The run id both files hold (``None``: neither holds one); else the error naming both."""
    from ..train.rundir import RUN_ID

    if ours is not None and not isinstance(ours, str):
        raise ConfigError(f"{config_path}: {RUN_ID} must be a string, got {ours!r:.60}")
    if theirs is not None and not isinstance(theirs, str):
        raise CheckpointError(f"{path}: extra[{RUN_ID!r}] must be a string, got {theirs!r:.60}")
    if ours != theirs:
        raise ConfigError(
            f"{path} is another run's checkpoint: its {RUN_ID} is {theirs!r:.60}, "
            f"{config_path} has {ours!r:.60}; resume continues only the run it belongs to"
        )
    return ours


def _check_lora(config_path: Path, text: str, path: Path, stored: Any) -> None:
    """``lora`` of the configuration (checked; empty: none) is the checkpoint's
    specification (``None``: none), compared as specifications (``parse_lora``), so two
    spellings of one are equal; else the error naming the fields that differ."""
    from ..train.lora import KEY, parse_lora

    ours = parse_lora(text, f"{config_path}: lora") if text else None
    if stored is not None and not isinstance(stored, str):
        raise CheckpointError(
            f"{path}: extra[{KEY!r}]: expected a LoRA specification string, got {stored!r:.80}"
        )
    try:
        theirs = parse_lora(stored, f"{path}: extra[{KEY!r}]") if stored is not None else None
    except ConfigError as e:
        raise CheckpointError(str(e)) from None
    if ours == theirs:
        return
    if ours is None or theirs is None:
        what = "trained without adapters" if theirs is None else f"trained with {stored!r}"
        raise ConfigError(
            f"{config_path}: lora (--lora) is {text!r}, but the checkpoint {path} was {what}"
        )
    fields = ("rank", "alpha", "dropout", "targets")
    differ = [k for k in fields if getattr(ours, k) != getattr(theirs, k)]
    named = "; ".join(
        f"{k} is {_spec_value(getattr(ours, k))} in {config_path.name}, "
        f"{_spec_value(getattr(theirs, k))} in the checkpoint"
        for k in differ
    )
    raise ConfigError(
        f"{config_path}: lora (--lora) differs from the adapters the checkpoint {path} was "
        f"trained with: {named}"
    )


def _check_freeze(config_path: Path, text: str, path: Path, stored: Any) -> None:
    """``freeze`` of the configuration (checked; empty: none) is the checkpoint's setting
    (``None``: none), compared as lists of patterns, so spacing does not count; else the
    error naming both."""
    from ..train.config import parse_freeze

    if stored is not None and not isinstance(stored, str):
        raise CheckpointError(
            f"{path}: extra[{FREEZE!r}]: expected a freeze setting string, got {stored!r:.80}"
        )
    ours = parse_freeze(text) if text else []
    try:
        theirs = parse_freeze(stored, f"{path}: extra[{FREEZE!r}]") if stored else []
    except ConfigError as e:
        raise CheckpointError(str(e)) from None
    if ours != theirs:
        raise ConfigError(
            f"{config_path}: freeze (--freeze) is {text!r:.80}, but the checkpoint {path} was "
            f"trained with {'freeze ' + repr(stored)[:80] if theirs else 'every weight training'}"
        )


def _check_train_rows(config_path: Path, setting: str, path: Path, rows: dict) -> None:
    """``train_rows`` of the configuration says what the checkpoint's row masks do:
    ``new`` where it holds some (``params.rows``), ``all`` where it holds none."""
    stored = "new" if rows else "all"
    if setting != stored:
        held = "holds row masks" if rows else "trains every row"
        raise ConfigError(
            f"{config_path}: train_rows (--train-rows) is {setting!r}, but the checkpoint "
            f"{path} {held} ({stored!r})"
        )


def _spec_value(value: Any) -> str:
    return "+".join(value) if isinstance(value, tuple) else repr(value)


def _label(argument: str) -> str:
    """``key (--flag)`` of the config key behind a ``TiedLM`` constructor argument."""
    from ..train.config import FIELDS, flag

    key = _ARGUMENT_KEYS.get(argument, argument)
    return f"{key} ({flag(key)})" if key in FIELDS else key


def _vocabulary(table: Any) -> str:
    """A short description of a stored vocabulary (``Vocab``/``HFTokenizer.to_dict``)."""
    if not isinstance(table, dict):
        return "none" if table is None else f"{table!r:.40}"
    chars = table.get("chars")
    if isinstance(chars, str):
        return f"a {table.get('kind')!r:.20} vocabulary of {len(chars)} symbols"
    return f"a {table.get('kind')!r:.20} tokenizer"


def _first_difference(ours: Any, theirs: Any) -> str:
    """Where two character vocabularies first differ (empty when that says nothing)."""
    a = ours.get("chars") if isinstance(ours, dict) else None
    b = theirs.get("chars") if isinstance(theirs, dict) else None
    if not isinstance(a, str) or not isinstance(b, str):
        return ""
    i = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    x, y = a[i : i + 1], b[i : i + 1]
    return f" (they differ first at symbol {i}: {x!r} here, {y!r} in the checkpoint)"
