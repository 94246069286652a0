"""Data for training: text windows, conversations, in-memory arrays, batching, the
default corpus."""

from .chat import ChatDataset, ChatTemplate, read_chat
from .corpus import DEFAULT_MAX_CHARS, stdlib_corpus, stdlib_root
from .loader import ArrayDataset, Batch, BatchSource, DataLoader
from .text import TextDataset, WindowLoader, read_text
from .tokenizer import HFTokenizer, directory_tokenizer, tokenizer_from_dict
from .vocab import Vocab

__all__ = [
    "ArrayDataset",
    "Batch",
    "BatchSource",
    "ChatDataset",
    "ChatTemplate",
    "DEFAULT_MAX_CHARS",
    "DataLoader",
    "HFTokenizer",
    "TextDataset",
    "Vocab",
    "WindowLoader",
    "directory_tokenizer",
    "read_chat",
    "read_text",
    "stdlib_corpus",
    "stdlib_root",
    "tokenizer_from_dict",
]
