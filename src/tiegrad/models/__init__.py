"""Reference models, each rebuildable from its ``config``: ``type(m)(**m.config)``."""

from ..nn.kv_cache import KVCache
from .auto import from_pretrained
from .gpt2 import GPT2
from .llama import LlamaLM
from .mlp_classifier import MLPClassifier
from .shared_block_lm import SharedBlockLM
from .siamese import SiameseEncoder
from .tied_lm import TiedLM
from .vocab import resize_vocab

__all__ = [
    "GPT2",
    "KVCache",
    "LlamaLM",
    "MLPClassifier",
    "SharedBlockLM",
    "SiameseEncoder",
    "TiedLM",
    "from_pretrained",
    "resize_vocab",
]
