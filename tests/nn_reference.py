"""PyTorch references for the nn and models tests: weight copies and a tied LM.

tiegrad's layers keep PyTorch's weight layouts, so a reference is a PyTorch module with
the same weights under mapped names: ``torch_name(path)`` maps a tiegrad path (a
``TransformerBlock`` laid out as ``nn.TransformerEncoderLayer``) to PyTorch's name.
"""

from __future__ import annotations

import re

import numpy as np
import torch
from torch import nn

from tiegrad.nn import Module

BLOCK_NAMES = {
    "ln1": "norm1",
    "ln2": "norm2",
    "attn.qkv.weight": "self_attn.in_proj_weight",
    "attn.qkv.bias": "self_attn.in_proj_bias",
    "attn.proj": "self_attn.out_proj",
    "mlp.layers.0": "linear1",
    "mlp.layers.1": "linear2",
}


def torch_name(path: str, names: dict[str, str] | None = None) -> str:
    """The PyTorch name of a tiegrad parameter path: ``names[path]``, else block parts renamed."""
    if names and path in names:
        return names[path]
    for ours, theirs in BLOCK_NAMES.items():
        path = re.sub(rf"(^|\.){re.escape(ours)}(\.|$)", rf"\g<1>{theirs}\g<2>", path)
    return path


def copy_to_torch(
    module: Module, reference: nn.Module, names: dict[str, str] | None = None
) -> None:
    """Write every storage of ``module`` into ``reference`` (float64) under its mapped name."""
    for path, p in module.named_parameters():
        target = reference.get_parameter(torch_name(path, names))
        assert tuple(target.shape) == p.shape, (path, target.shape, p.shape)
        with torch.no_grad():
            target.copy_(torch.from_numpy(np.array(p.value, dtype=np.float64)))


def assert_grads_match(
    grads: dict[str, np.ndarray],
    reference: nn.Module,
    names: dict[str, str] | None = None,
    rtol: float = 1e-9,
) -> None:
    """Each storage's tiegrad gradient equals the reference parameter's ``.grad``."""
    assert grads, "no gradients to compare"
    with_grad = [name for name, q in reference.named_parameters() if q.grad is not None]
    assert len(with_grad) == len(grads), (sorted(with_grad), sorted(grads))
    for path, g in grads.items():
        want = reference.get_parameter(torch_name(path, names)).grad
        assert want is not None, path
        np.testing.assert_allclose(g, want.numpy(), rtol=rtol, atol=1e-11, err_msg=path)


def encoder_layer(d_model: int, n_heads: int, mlp_ratio: int) -> nn.TransformerEncoderLayer:
    """PyTorch's equivalent of ``tiegrad.nn.TransformerBlock`` (pre-LN, GELU, no dropout)."""
    return nn.TransformerEncoderLayer(
        d_model,
        n_heads,
        dim_feedforward=mlp_ratio * d_model,
        dropout=0.0,
        activation="gelu",
        batch_first=True,
        norm_first=True,
        dtype=torch.float64,
    )


def causal_mask(t: int) -> torch.Tensor:
    return torch.triu(torch.ones(t, t, dtype=torch.bool), diagonal=1)


class TorchTiedLM(nn.Module):
    """A ``TiedLM`` (``shared=False``) or ``SharedBlockLM`` (``shared=True``) in PyTorch.

    The output projection is ``embed.weight`` itself; ``detach_head=True`` writes that
    use as ``embed.weight.detach()`` (the head frozen, the embedding still trained).
    """

    def __init__(self, config: dict, shared: bool, detach_head: bool = False) -> None:
        super().__init__()
        d, v = config["d_model"], config["vocab_size"]
        self.embed = nn.Embedding(v, d, dtype=torch.float64)
        self.pos_embed = nn.Embedding(config["max_seq_len"], d, dtype=torch.float64)
        layer = lambda: encoder_layer(d, config["n_heads"], config["mlp_ratio"])  # noqa: E731
        if shared:
            self.block = layer()
            self.order = [self.block] * config["n_repeats"]
        else:
            self.blocks = nn.ModuleList(layer() for _ in range(config["n_layers"]))
            self.order = list(self.blocks)
        self.ln_f = nn.LayerNorm(d, dtype=torch.float64)
        self.detach_head = detach_head

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        t = idx.shape[1]
        h = self.embed(idx) + self.pos_embed(torch.arange(t))
        mask = causal_mask(t)
        for layer in self.order:
            h = layer(h, src_mask=mask, is_causal=True)
        w = self.embed.weight.detach() if self.detach_head else self.embed.weight
        return self.ln_f(h) @ w.T
