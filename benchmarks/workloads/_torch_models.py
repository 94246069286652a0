"""The PyTorch eager models of the workloads, written as a PyTorch user would.

Parameter names mirror the tiegrad models (``tiegrad.models``, ``tiegrad.nn.MLP``) so
weights transfer by name. Attention uses one fused ``qkv`` projection and
``F.scaled_dot_product_attention`` (PyTorch's fastest eager path); GELU is the exact
(erf) form; LayerNorm has PyTorch's default eps.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn


class Attention(nn.Module):
    """Causal multi-head self-attention: fused ``qkv`` projection, output ``proj``."""

    def __init__(self, d_model: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        qkv = self.qkv(x).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(qkv[0], qkv[1], qkv[2], is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, d))


class Block(nn.Module):
    """Pre-LayerNorm transformer block with a 4x GELU MLP."""

    def __init__(self, d_model: int, heads: int) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(d_model)
        self.attn = Attention(d_model, heads)
        self.ln2 = nn.LayerNorm(d_model)
        self.mlp = MLP([d_model, 4 * d_model, d_model], F.gelu)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class TiedLM(nn.Module):
    """Decoder-only LM: token + learned position embeddings, blocks, a final LayerNorm and
    an output projection tied to the token embedding.

    ``n_blocks`` distinct blocks (``blocks.0``, ...) or, with ``repeats``, ONE block
    (``block``) applied ``repeats`` times.
    """

    def __init__(
        self, vocab: int, d_model: int, heads: int, seq: int, n_blocks: int = 0, repeats: int = 0
    ) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, d_model)
        self.pos_embed = nn.Embedding(seq, d_model)
        if repeats:
            self.block = Block(d_model, heads)
            self.layers = [self.block] * repeats
        else:
            self.blocks = nn.ModuleList(Block(d_model, heads) for _ in range(n_blocks))
            self.layers = list(self.blocks)
        self.ln_f = nn.LayerNorm(d_model)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(ids) + self.pos_embed(torch.arange(ids.shape[1]))
        for block in self.layers:
            h = block(h)
        return F.linear(self.ln_f(h), self.embed.weight)


def lm_loss(model: nn.Module, ids: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy."""
    logits = model(ids)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


class MLP(nn.Module):
    """Linear layers ``layers.0``, ``layers.1``, ... of ``sizes`` with ``activation`` between
    them (the parameter names of ``tiegrad.nn.MLP``)."""

    def __init__(
        self,
        sizes: list[int],
        activation: Callable[[torch.Tensor], torch.Tensor] = F.relu,
    ) -> None:
        super().__init__()
        self.activation = activation
        self.layers = nn.ModuleList(nn.Linear(a, b) for a, b in zip(sizes[:-1], sizes[1:]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        last = len(self.layers) - 1
        for i, layer in enumerate(self.layers):
            x = layer(x)
            if i < last:
                x = self.activation(x)
        return x


class Classifier(nn.Module):
    """An ``MLP`` under the name ``mlp`` (the layout of ``tiegrad.models.MLPClassifier``)."""

    def __init__(self, sizes: list[int]) -> None:
        super().__init__()
        self.mlp = MLP(sizes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(x)
