"""Modules, layers, tying and freezing by path (C1, C4, C5).

``Module`` registers ``Param``s and submodules by attribute; ``tie``/``untie``,
``Module.freeze``/``unfreeze`` and ``train_rows`` (a row mask) work on dotted paths;
``summary`` reports storages, paths, frozen uses, optimizer slots and checkpoint copies;
``checkpoint`` recomputes a block exactly in backward instead of keeping its
intermediates. Layer constructors take ``rng`` (a ``numpy.random.Generator``; see
``tiegrad.nn.init``).
"""

from .attention import MultiHeadAttention, TransformerBlock
from .conv import Conv2d, MaxPool2d
from .layers import GELU, MLP, Dropout, Embedding, Flatten, LayerNorm, Linear, ReLU, Tanh
from .module import Module, ModuleList, Sequential, set_trainable
from .recompute import checkpoint
from .row_mask import train_rows, trained_rows
from .summary import summary
from .tying import tie, untie

__all__ = [
    "Conv2d",
    "Dropout",
    "Embedding",
    "Flatten",
    "GELU",
    "LayerNorm",
    "Linear",
    "MLP",
    "MaxPool2d",
    "Module",
    "ModuleList",
    "MultiHeadAttention",
    "ReLU",
    "Sequential",
    "Tanh",
    "TransformerBlock",
    "checkpoint",
    "set_trainable",
    "summary",
    "tie",
    "train_rows",
    "trained_rows",
    "untie",
]
