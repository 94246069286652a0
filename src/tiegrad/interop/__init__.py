"""Models in and out: PyTorch modules (``from_torch``/``to_torch``) and Hugging Face GPT-2
directories (``hf``, which ``tiegrad.models.GPT2`` calls), ties kept (C1).

Nothing here imports torch or transformers at import time.
"""

from .pytorch import from_torch, to_torch, torch_buffers

__all__ = ["from_torch", "to_torch", "torch_buffers"]
