"""``from_pretrained``: a transformers model directory as the tiegrad class of its ``model_type``.

As transformers' ``AutoModelForCausalLM``: the folder's ``config.json`` names the
architecture, and that class's own ``from_pretrained`` loads it (``gpt2``: ``GPT2``; the
Llama family, ``hf_llama.MODEL_TYPES``: ``LlamaLM``). A missing ``model_type`` reads as
``gpt2``, as the GPT-2 loader has always read it.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from ..errors import ConfigError
from ..interop import hf, hf_llama
from ._causal_lm import TiedCausalLM
from .gpt2 import GPT2
from .llama import LlamaLM

#: ``model_type`` -> the class that loads it.
CLASSES: dict[str, type[GPT2] | type[LlamaLM]] = {
    "gpt2": GPT2,
    **dict.fromkeys(hf_llama.MODEL_TYPES, LlamaLM),
}


def from_pretrained(
    directory: str | os.PathLike[str], dtype: Any = "float32", *, allow_nonfinite: bool = False
) -> TiedCausalLM:
    """The model of a transformers ``save_pretrained`` directory, of the class its
    ``model_type`` names (``CLASSES``), without torch or transformers. An unknown
    ``model_type`` is a ``ConfigError`` naming it and the supported ones, raised before
    any weight is read (C6); ``allow_nonfinite`` goes to the class's loader."""
    config = hf.folder_config(directory)
    kind = config.get("model_type", "gpt2")
    if not isinstance(kind, str) or kind not in CLASSES:
        raise ConfigError(
            f"{Path(directory) / hf.CONFIG}: model_type {kind!r:.80} is not supported "
            f"(supported: {', '.join(CLASSES)})"
        )
    return CLASSES[kind].from_pretrained(directory, dtype, allow_nonfinite=allow_nonfinite)
