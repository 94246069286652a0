"""The language-model job: data, model, optimizer and schedule built from a configuration.

``tiegrad train``, ``tiegrad resume`` and the PyTorch twin benchmark all build their
run through these functions, so the data pipeline (text, vocabulary, split, batch
windows, evaluation windows; or conversations, ``chat``) and the hyperparameters are the
same everywhere.
"""

from __future__ import annotations

import hashlib
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from fnmatch import fnmatchcase
from typing import Any

from ..data import TextDataset, Vocab, directory_tokenizer, read_text, stdlib_corpus
from ..data.chat import ChatDataset, ChatFile, ChatTemplate, read_chat
from ..errors import AliasError, ConfigError, shown_list
from .added_tokens import add_tokens
from .config import parse_freeze, warmup_steps
from .lora import parse_lora

MODEL_CLASS = "TiedLM"
#: The classes ``models.from_pretrained`` gives for an ``--init`` directory
#: (``models.auto.CLASSES``).
PRETRAINED_CLASSES = ("GPT2", "LlamaLM")
#: The classes a run's checkpoint may name (``extra["model"]["class"]``).
MODEL_CLASSES = (MODEL_CLASS, *PRETRAINED_CLASSES)


@dataclass
class TextSource:
    """The text of a run (or its conversations): its contents, a short description and a
    digest."""

    text: str | bytes | ChatFile
    description: str
    sha256: str


def load_text(config: Mapping[str, Any]) -> TextSource:
    """The configured chat file (``data.chat.read_chat``), text file, or the
    standard-library corpus when both are empty."""
    if config["chat"]:
        chat = read_chat(config["chat"])
        what = f"{config['chat']} ({len(chat.conversations):,} conversations)"
        return TextSource(chat, what, chat.sha256)
    if config["text"]:
        text = read_text(config["text"], config["vocab"])
        what = f"{config['text']} ({len(text):,} {'bytes' if isinstance(text, bytes) else 'chars'})"
    else:
        text = stdlib_corpus(config["corpus_chars"])
        if config["vocab"] == "byte":
            text = text.encode("ascii")
        version = f"{sys.version_info.major}.{sys.version_info.minor}"
        what = f"Python {version} standard library source ({len(text):,} chars)"
    raw = text if isinstance(text, bytes) else text.encode("utf-8")
    return TextSource(text, what, hashlib.sha256(raw).hexdigest())


def build_dataset(
    config: Mapping[str, Any], source: TextSource, vocab: Vocab | None = None
) -> TextDataset | ChatDataset:
    """The windows dataset of ``source`` (with a stored ``vocab`` when resuming), or the
    conversations of a chat source rendered with ``vocab``'s chat template (of the
    ``init`` folder's tokenizer, whose errors name the folder)."""
    if isinstance(source.text, ChatFile):
        try:
            template = ChatTemplate.from_tokenizer(vocab)
        except ConfigError as e:
            raise ConfigError(f"--init {config['init']}: {e}") from None
        return ChatDataset(source.text, template, config["seq_len"], config["val_fraction"])
    return TextDataset(
        source.text,
        block_size=config["seq_len"],
        vocab=vocab if vocab is not None else config["vocab"],
        val_fraction=config["val_fraction"],
    )


def model_config(config: Mapping[str, Any], vocab_size: int) -> dict[str, Any]:
    """The ``TiedLM`` constructor arguments of a run."""
    return {
        "vocab_size": vocab_size,
        "d_model": config["d_model"],
        "n_layers": config["n_layers"],
        "n_heads": config["n_heads"],
        "max_seq_len": config["seq_len"],
        "dropout": config["dropout"],
        "mlp_ratio": config["mlp_ratio"],
        "seed": config["seed"],
    }


def model_class(name: str) -> Any:
    """The class of ``tiegrad.models`` a checkpoint names, one of ``MODEL_CLASSES``; any
    other name is a ``ConfigError``."""
    from .. import models

    if name not in MODEL_CLASSES:
        raise ConfigError(f"unknown model class {name!r:.80} (expected {', '.join(MODEL_CLASSES)})")
    return getattr(models, name)


def build_model(kwargs: dict[str, Any], name: str = MODEL_CLASS) -> Any:
    """A ``TiedLM`` (or the model of the class ``name``, ``MODEL_CLASSES``) from its
    constructor arguments: ``cls(**model.config)`` rebuilds a model (C9)."""
    return model_class(name)(**kwargs)


def apply_freeze(model: Any, text: str, label: str = "--freeze") -> list[str]:
    """Freeze the uses of ``model``'s weights that the ``freeze`` setting ``text`` names
    (``config.parse_freeze``; empty: none) and return the frozen paths. Per use (C4, C5):
    freezing ``model.embed_tokens.weight`` of a tied model leaves ``lm_head.weight``
    training the storage. Every pattern must match a path, checked before any flag is
    set (C6): else a ``ConfigError`` naming ``label``, the pattern and a few paths."""
    if not text:
        return []
    patterns = parse_freeze(text, label)
    paths = [path for path, _ in model.named_slots()]
    unmatched = [p for p in patterns if not any(fnmatchcase(path, p) for path in paths)]
    if unmatched:
        raise ConfigError(
            f"{label}: no parameter path of {model.label()} matches {shown_list(unmatched)} "
            f"(its paths: {shown_list(paths)})"
        )
    try:
        return model.freeze(patterns)
    except AliasError as e:  # a handle at several paths matched at some of them
        raise ConfigError(f"{label}: {e}") from None


def build_init(
    config: Mapping[str, Any], source: TextSource, vocab: Any = None, model: Any = None
) -> tuple[Any, TextDataset | ChatDataset]:
    """The model of ``config["init"]`` (a transformers directory, of the class its
    ``model_type`` names: ``models.from_pretrained``) with the LoRA adapters of
    ``config["lora"]`` (``tiegrad.train.lora``), grown by the tokens of
    ``config["add_tokens"]`` (``tiegrad.train.added_tokens``), or ``model`` (the one a
    resumed run's checkpoint describes, adapters, row masks and frozen uses included), and
    the dataset of ``source`` tokenised by the directory's tokenizer
    (``data.directory_tokenizer``, with the added tokens) or by ``vocab`` (the one a
    resumed run stored); a chat source is rendered with that tokenizer's chat template."""
    from ..models import from_pretrained

    if model is None:
        model = from_pretrained(config["init"])
        vocab = directory_tokenizer(config["init"])
        if config["add_tokens"]:
            vocab = add_tokens(model, vocab, config["add_tokens"], config["train_rows"])
        if config["lora"]:
            parse_lora(config["lora"]).attach(model, "--lora")
    vocab = vocab if vocab is not None else directory_tokenizer(config["init"])
    if vocab.size > model.vocab_size:
        raise ConfigError(
            f"--init {config['init']}: the tokenizer has {vocab.size} ids but the model's "
            f"vocabulary {model.vocab_size}"
        )
    if config["seq_len"] > model.max_seq_len:
        raise ConfigError(
            f"--seq-len {config['seq_len']} exceeds the model's context of "
            f"{model.max_seq_len} positions ({model.label()})"
        )
    return model, build_dataset(config, source, vocab)


def build_optimizer(config: Mapping[str, Any], model: Any) -> tuple[Any, Any]:
    """AdamW over the model's parameters and a cosine schedule with linear warmup."""
    from ..optim import AdamW
    from ..optim.schedules import CosineWarmup

    optimizer = AdamW(model.parameters(), lr=config["lr"], weight_decay=config["weight_decay"])
    schedule = CosineWarmup(
        optimizer,
        warmup_steps=warmup_steps(config),
        total_steps=config["steps"],
        min_lr=config["min_lr"],
    )
    return optimizer, schedule
