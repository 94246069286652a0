"""The decoder ops against transformers' own modules (issue 48): ``rope_tables`` against
the rotary embeddings of Llama and Phi (partial rotary), ``rotary`` against
``apply_rotary_pos_emb``, ``rms_norm`` against ``LlamaRMSNorm`` and ``GemmaRMSNorm`` in
float32 and half precision. Tiny configs, nothing downloaded."""

from __future__ import annotations

import numpy as np
import pytest

import tiegrad.ops as T
from tiegrad import EagerSession

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
from transformers import LlamaConfig, PhiConfig  # noqa: E402
from transformers.models.gemma.modeling_gemma import GemmaRMSNorm  # noqa: E402
from transformers.models.llama.modeling_llama import (  # noqa: E402
    LlamaRMSNorm,
    LlamaRotaryEmbedding,
    apply_rotary_pos_emb,
)
from transformers.models.phi.modeling_phi import PhiRotaryEmbedding  # noqa: E402

LLAMA3 = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}


def _llama_tables(head_dim: int, theta: float, scaling: dict | None, positions: np.ndarray):
    params = dict(scaling or {"rope_type": "default"}, rope_theta=theta)
    config = LlamaConfig(
        hidden_size=2 * head_dim,
        num_attention_heads=2,
        max_position_embeddings=4096,
        rope_parameters=params,
    )
    cos, sin = LlamaRotaryEmbedding(config)(torch.zeros(1), torch.tensor(positions))
    return cos.numpy(), sin.numpy()


@pytest.mark.parametrize("scaling", [None, {"rope_type": "linear", "factor": 4.0}, LLAMA3])
@pytest.mark.parametrize("head_dim, theta", [(16, 10000.0), (64, 500000.0)])
def test_rope_tables_are_transformers_tables(scaling, head_dim, theta):
    # a batch of two rows, the second continuing at position 1000 (a KV cache)
    positions = np.stack([np.arange(0, 9), np.arange(1000, 1009)])
    theirs = _llama_tables(head_dim, theta, scaling, positions)
    ours = T.rope_tables(positions, head_dim, theta, scaling=scaling)
    for name, o, t in zip(("cos", "sin"), ours, theirs):
        assert o.dtype == np.float32 and o.shape == t.shape == (2, 9, head_dim), name
        np.testing.assert_allclose(o, t, rtol=0, atol=1e-6, err_msg=name)


def test_rope_tables_of_partial_rotary_are_phis():
    config = PhiConfig(
        hidden_size=64,
        num_attention_heads=2,
        rope_parameters={
            "rope_type": "default",
            "rope_theta": 10000.0,
            "partial_rotary_factor": 0.5,
        },
    )
    positions = np.arange(3, 12)[None]
    theirs = PhiRotaryEmbedding(config)(torch.zeros(1), torch.tensor(positions))
    ours = T.rope_tables(positions, 32, partial_rotary_factor=0.5)
    for o, t in zip(ours, theirs):
        assert o.shape == (1, 9, 16)
        np.testing.assert_allclose(o, t.numpy(), rtol=0, atol=1e-6)


def test_rope_tables_take_the_old_type_key_and_cast_to_dtype():
    positions = np.arange(5)
    ours = T.rope_tables(positions, 8, scaling={"type": "linear", "factor": 2.0}, dtype=np.float64)
    want = T.rope_tables(positions, 8, scaling={"rope_type": "linear", "factor": 2.0})
    assert ours[0].dtype == np.float64
    np.testing.assert_array_equal(ours[0], want[0].astype(np.float64))
    unscaled = T.rope_tables(positions, 8)
    assert not np.array_equal(unscaled[1], want[1])


@pytest.mark.parametrize("partial", [1.0, 0.5])
def test_rotary_is_apply_rotary_pos_emb(partial):
    b, h, t, d = 2, 3, 6, 16
    r = int(d * partial)
    positions = np.stack([np.arange(t), np.arange(40, 40 + t)])
    cos, sin = T.rope_tables(positions, d, partial_rotary_factor=partial)
    q = np.random.default_rng(0).standard_normal((b, h, t, d)).astype(np.float32)
    tq = torch.tensor(q)
    rot, _ = apply_rotary_pos_emb(tq[..., :r], tq[..., :r], torch.tensor(cos), torch.tensor(sin))
    theirs = torch.cat((rot, tq[..., r:]), dim=-1).numpy()
    s = EagerSession()
    ours = T.rotary(s.leaf(q), cos[:, None], sin[:, None]).value
    np.testing.assert_array_equal(ours, theirs)


def _rms_norm_cases():
    x = np.random.default_rng(1).standard_normal((3, 5, 32)) * 4
    w = np.random.default_rng(2).standard_normal(32)
    return x, w


@pytest.mark.parametrize("device", [None, "torch:cpu"])
@pytest.mark.parametrize(
    "module, offset", [(LlamaRMSNorm, 0.0), (GemmaRMSNorm, 1.0)], ids=["llama", "gemma"]
)
def test_rms_norm_is_transformers_norm_in_float32(device, module, offset):
    x, w = (a.astype(np.float32) for a in _rms_norm_cases())
    norm = module(32, eps=1e-6)
    with torch.no_grad():
        norm.weight.copy_(torch.tensor(w))
    tx = torch.tensor(x, requires_grad=True)
    want = norm(tx)
    cot = np.random.default_rng(3).standard_normal(x.shape).astype(np.float32)
    want.backward(torch.tensor(cot))
    s = EagerSession(device=device)
    xr, wr = s.leaf(x), s.leaf(w)
    out = T.rms_norm(xr, wr, eps=1e-6, offset=offset)
    grads = s.backward(out, seed=cot)
    got = s.backend.to_numpy(out.value)
    assert got.dtype == np.float32
    np.testing.assert_allclose(got, want.detach().numpy(), rtol=2e-7, atol=1e-6)
    for ref, t in ((xr, tx.grad), (wr, norm.weight.grad)):
        theirs = t.numpy()
        scale = np.abs(theirs).max()
        np.testing.assert_allclose(s.backend.to_numpy(grads[ref]), theirs, atol=1e-5 * scale)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize(
    "module, offset", [(LlamaRMSNorm, 0.0), (GemmaRMSNorm, 1.0)], ids=["llama", "gemma"]
)
def test_rms_norm_of_half_precision_is_computed_in_float32_as_transformers_does(
    dtype, module, offset
):
    # bfloat16 exists on the torch backend only; float16 runs on the host too
    x, w = _rms_norm_cases()
    tdtype = getattr(torch, dtype)
    norm = module(32, eps=1e-6).to(tdtype)
    with torch.no_grad():
        norm.weight.copy_(torch.tensor(w))
    tx = torch.tensor(x).to(tdtype).requires_grad_()
    want = norm(tx)
    cot = torch.tensor(np.random.default_rng(3).standard_normal(x.shape)).to(tdtype)
    want.backward(cot)
    devices = ["torch:cpu"] + ([None] if dtype == "float16" else [])
    for device in devices:
        s = EagerSession(device=device)
        xv, wv, gv = (t.detach() if device else t.detach().numpy() for t in (tx, norm.weight, cot))
        xr, wr = s.leaf(xv), s.leaf(wv)
        out = T.rms_norm(xr, wr, offset=offset)
        grads = s.backward(out, seed=gv)
        got = out.value if device else torch.tensor(out.value)
        assert got.dtype == want.dtype == tdtype, device
        # the same float32 formula, rounded once: at most one unit in the last place
        ulp = torch.finfo(tdtype).eps * want.float().abs().clamp_min(1.0)
        assert ((got.float() - want.float()).abs() <= ulp).all(), device
        # gradients in the operands' dtype, computed in float32 (torch's autograd rounds
        # its intermediates to half precision, so the two agree to that precision)
        for ref, t in ((xr, tx.grad), (wr, norm.weight.grad)):
            ours = grads[ref] if device else torch.tensor(grads[ref])
            assert ours.dtype == tdtype, device
            scale = t.float().abs().max()
            assert ((ours.float() - t.float()).abs() <= 0.02 * scale).all(), device
