"""Adapters on frozen storage, ties kept: LoRA (issue 41).

``add_lora`` attaches low-rank adapters to chosen weight uses (``tiegrad.adapters.lora``);
``set_adapter``, ``disable``/``enable``, ``merge``/``unmerge`` and ``unload`` act on all
of a model's adapters. PEFT's files are read and written by ``tiegrad.interop.peft``.
"""

from .layers import (
    LoRA,
    LoRAAdapters,
    LoRAConv1D,
    LoRAEmbedding,
    LoRALinear,
    LoRAPaddedEmbedding,
)
from .lora import (
    MergeRefused,
    active_adapter,
    adapter_names,
    add_lora,
    disable,
    enable,
    merge,
    set_adapter,
    unload,
    unmerge,
    untied_by_merge,
)

__all__ = [
    "LoRA",
    "LoRAAdapters",
    "LoRAConv1D",
    "LoRAEmbedding",
    "LoRALinear",
    "LoRAPaddedEmbedding",
    "MergeRefused",
    "active_adapter",
    "adapter_names",
    "add_lora",
    "disable",
    "enable",
    "merge",
    "set_adapter",
    "unload",
    "unmerge",
    "untied_by_merge",
]
