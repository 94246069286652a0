"""G1 GPT-2 fine-tuning: tiegrad's ``GPT2`` against transformers' ``GPT2LMHeadModel``.

4 layers, 4 heads, 256 dims, sequence 128, batch 8, vocab 8192, no dropout; AdamW lr
3e-4, weight decay 0.01; mean next-token cross-entropy. A random transformers model is
saved with ``save_pretrained`` into a temporary folder and both sides load it from
there (``GPT2.from_pretrained``, ``GPT2LMHeadModel.from_pretrained``), so they start
from the same weights with the ``wte``/``lm_head`` tie restored on both. The torch side
is PyTorch eager with transformers' default attention and ``use_cache=False`` (a
training step keeps no key/value cache). transformers is imported only when G1 runs.
"""

from __future__ import annotations

import tempfile
from collections.abc import Collection
from typing import Any

import torch
import torch.nn.functional as F

from ..runner import Built
from ._common import TiegradTrainer, TorchTrainer, token_batches, wanted

ID = "G1"
TITLE = "GPT-2 fine-tune"
STEPS = (2, 12)
VOCAB, D_MODEL, LAYERS, HEADS, SEQ, BATCH = 8192, 256, 4, 4, 128, 8
BATCHES = 4
LR, WEIGHT_DECAY = 3e-4, 0.01


def make_data() -> dict[str, Any]:
    """The batches and a temporary folder holding the saved model (removed by ``build``,
    once its sides have loaded the model)."""
    import transformers

    torch.manual_seed(0)
    config = transformers.GPT2Config(
        vocab_size=VOCAB, n_positions=SEQ, n_embd=D_MODEL, n_layer=LAYERS, n_head=HEADS,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0,
    )  # fmt: skip
    folder = tempfile.TemporaryDirectory(prefix="tiegrad-g1-")
    transformers.GPT2LMHeadModel(config).save_pretrained(folder.name)
    return {"batches": token_batches(BATCHES, BATCH, SEQ, VOCAB, offset=7), "folder": folder}


def _tiegrad_loss(model: Any, session: Any, x: Any, y: Any) -> Any:
    return model.loss(session, x, y)


def torch_loss(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    logits = model(x, use_cache=False).logits
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))


def build(data: dict[str, Any], sides: Collection[str] | None = None) -> Built:
    built = Built([])
    folder = data["folder"].name
    if wanted(sides, "tiegrad"):
        from tiegrad import EagerSession
        from tiegrad.models import GPT2
        from tiegrad.optim import AdamW

        model = GPT2.from_pretrained(folder)
        optimizer = AdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)
        trainer = TiegradTrainer(EagerSession(), model, optimizer, _tiegrad_loss, data["batches"])
        built.sides.append(trainer.side())
    if wanted(sides, "torch"):
        import transformers

        hf = transformers.GPT2LMHeadModel.from_pretrained(folder).train()
        optimizer = torch.optim.AdamW(hf.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)
        built.sides.append(TorchTrainer(hf, optimizer, torch_loss, data["batches"]).side())
    data["folder"].cleanup()  # the sides hold the model in memory: nothing reads the files again
    return built
