"""The language-model job: data, model, optimizer and schedule built from a configuration.

``tiegrad train``, ``tiegrad resume`` and the PyTorch twin benchmark all build their
run through these functions, so the data pipeline (text, vocabulary, split, batch
windows, evaluation windows) and the hyperparameters are the same everywhere.
"""

from __future__ import annotations

import hashlib
import sys
from dataclasses import dataclass
from typing import Any

from ..data import TextDataset, Vocab, directory_tokenizer, read_text, stdlib_corpus
from ..errors import ConfigError
from .config import warmup_steps
from .lora import parse_lora

MODEL_CLASS = "TiedLM"


@dataclass
class TextSource:
    """The text of a run: its contents, a short description and a digest."""

    text: str | bytes
    description: str
    sha256: str


def load_text(config: dict[str, Any]) -> TextSource:
    """The configured text file, or the standard-library corpus when ``text`` is empty."""
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
    config: dict[str, Any], source: TextSource, vocab: Vocab | None = None
) -> TextDataset:
    """The windows dataset of ``source`` (with a stored ``vocab`` when resuming)."""
    return TextDataset(
        source.text,
        block_size=config["seq_len"],
        vocab=vocab if vocab is not None else config["vocab"],
        val_fraction=config["val_fraction"],
    )


def model_config(config: dict[str, Any], vocab_size: int) -> dict[str, Any]:
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


def build_model(kwargs: dict[str, Any], model_class: str = MODEL_CLASS) -> Any:
    """A ``TiedLM`` (or the model named ``model_class``: ``GPT2``) from its constructor
    arguments."""
    from .. import models

    if model_class not in ("TiedLM", "GPT2"):
        raise ConfigError(f"unknown model class {model_class!r} (expected TiedLM or GPT2)")
    return getattr(models, model_class)(**kwargs)


def build_init(
    config: dict[str, Any], source: TextSource, vocab: Any = None, model: Any = None
) -> tuple[Any, TextDataset]:
    """The ``GPT2`` of ``config["init"]`` (a transformers directory) with the LoRA adapters
    of ``config["lora"]`` (``tiegrad.train.lora``), or ``model`` (the one a resumed run's
    checkpoint describes, adapters included), and the dataset of ``source`` tokenised by
    the directory's tokenizer (``data.directory_tokenizer``) or by ``vocab`` (the one a
    resumed run stored)."""
    from ..models import GPT2

    if model is None:
        model = GPT2.from_pretrained(config["init"])
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
            f"--seq-len {config['seq_len']} exceeds the model's n_positions {model.max_seq_len}"
        )
    return model, build_dataset(config, source, vocab)


def build_optimizer(config: dict[str, Any], model: Any) -> tuple[Any, Any]:
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
