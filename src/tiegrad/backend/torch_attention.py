"""Attention on torch, for ``TorchBackend.fused_attention``: forward and VJP.

``sdpa_attention`` is PyTorch's ``scaled_dot_product_attention`` with torch's autograd
as the VJP. On torch's CPU, where a call's scores are small (``in_cache``),
``products_attention`` is faster: batched products and torch's softmax kernels. Both
take a causal mask's query offset (``query_offset``: query ``i`` sees keys ``j <= i +
query_offset``) and grouped-query heads (k and v with fewer heads than q).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from .base import Array

# Batched products beat PyTorch's flash kernel on torch's CPU where each head's scores
# span at least _KEYS_MIN keys and all of a call's scores stay within _SCORES_MAX bytes
# (cache-resident); with fewer keys, or more scores, the flash kernel is faster.
_KEYS_MIN = 64
_SCORES_MAX = 4 << 20
_PRODUCTS_DTYPES = (torch.float32, torch.float64)


def _has_gqa() -> bool:
    """Whether this torch's ``scaled_dot_product_attention`` takes ``enable_gqa`` (2.5+)."""
    t = torch.zeros(1, 2, 1, 1)
    try:
        F.scaled_dot_product_attention(t, t[:, :1], t[:, :1], enable_gqa=True)
    except TypeError:
        return False
    return True


HAS_GQA = _has_gqa()


def sdpa_attention(
    q: Array,
    k: Array,
    v: Array,
    causal: bool,
    scale: float,
    want: bool,
    query_offset: int = 0,
    gqa: bool = False,
) -> tuple[Array, Any]:
    """PyTorch's ``scaled_dot_product_attention`` and, if ``want``, a VJP through torch's
    autograd (the graph of the call, kept until the VJP is dropped). A causal mask with
    a query offset is an explicit boolean mask; ``gqa`` passes ``enable_gqa``."""
    options: dict[str, Any] = {"scale": scale}
    if gqa:
        options["enable_gqa"] = True
    if causal and query_offset:
        seen = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool, device=q.device)
        options["attn_mask"] = seen.tril_(query_offset)
    else:
        options["is_causal"] = causal
    if not want:
        return F.scaled_dot_product_attention(q, k, v, **options), None
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    with torch.enable_grad():
        out = F.scaled_dot_product_attention(*leaves, **options)

    def vjp(g: Array) -> tuple[Array, Array, Array]:
        return torch.autograd.grad(out, leaves, g, retain_graph=True)

    return out.detach(), vjp


def in_cache(q: Array, k: Array) -> bool:
    """Whether attention of ``q`` over ``k`` runs as batched products (see above); q and
    k have the same leading axes (``fused_attention`` checks), so the scores are q's
    rows times the keys."""
    tk = k.shape[-2]
    scores = q.shape[:-1].numel() * tk * q.element_size()
    return q.dtype in _PRODUCTS_DTYPES and tk >= _KEYS_MIN and scores <= _SCORES_MAX


def products_attention(
    q: Array,
    k: Array,
    v: Array,
    causal: bool,
    scale: float,
    want: bool,
    query_offset: int = 0,
    groups: int = 1,
) -> tuple[Array, Any]:
    """``softmax(q k^T * scale + mask) v`` as ``scaled_dot_product_attention``'s math:
    batched products and torch's softmax kernels, within float rounding of the flash
    kernel's results (not bit for bit). A query whose scores are all ``-inf`` (every key
    hidden, or products overflowing) gets zeros and no gradient, as from the flash
    kernel and the host (without torch's ``_safe_softmax``, several times the softmax's
    time, and without a synchronisation); NaN stays NaN, and an infinite or NaN value
    reaching such a row through v or k makes its gradient NaN, as on the host. The VJP
    keeps the probabilities (``in_cache`` bounds them) and q, k and v as batches of
    matrices (copies of strided views). With ``groups`` query heads per key/value head,
    each group's queries attend as one block of rows (no copy of k and v per head)."""
    lead, tq, tk = q.shape[:-2], q.shape[-2], k.shape[-2]
    q3 = q.reshape(-1, groups * tq, q.shape[-1])
    k3, v3 = (t.reshape((-1,) + tuple(t.shape[-2:])) for t in (k, v))
    if causal:  # key j hidden from query i when j > i + query_offset (is_causal: offset 0)
        bias = torch.full((tq, tk), -torch.inf, dtype=q.dtype, device=q.device)
        bias = bias.triu_(1 + query_offset).repeat(groups, 1)
        scores = torch.baddbmm(bias, q3, k3.transpose(1, 2), alpha=scale)
    else:
        scores = torch.bmm(q3, k3.transpose(1, 2)).mul_(scale)
    # softmax gives NaN rows for a NaN or +inf score and for -inf scores only; the
    # last become zeros, the others stay NaN (the rows whose maximum is not below inf)
    top = scores.amax(-1, keepdim=True)
    p = torch.softmax(scores, -1).nan_to_num_(0.0)
    p.mul_(torch.where(top < torch.inf, 1.0, torch.nan))
    out = torch.bmm(p, v3).reshape(lead + (tq, v.shape[-1]))
    if not want:
        return out, None

    def vjp(g: Array) -> tuple[Array, Array, Array]:
        g3 = g.reshape((-1, groups * tq, g.shape[-1])).to(p.dtype)  # a wider cotangent: p's dtype
        gv = torch.bmm(p.transpose(1, 2), g3)
        gs = torch._softmax_backward_data(torch.bmm(g3, v3.transpose(1, 2)), p, -1, p.dtype)
        gq = torch.bmm(gs, k3).mul_(scale)
        gk = torch.bmm(gs.transpose(1, 2), q3).mul_(scale)
        return gq.reshape(q.shape), gk.reshape(k.shape), gv.reshape(v.shape)

    return out, vjp
