"""The decoder ops against transformers' own modules (issue 48): ``rms_norm`` against
``LlamaRMSNorm`` and ``GemmaRMSNorm`` in float32 and half precision. Tiny configs,
nothing downloaded."""

from __future__ import annotations

import numpy as np
import pytest

import tiegrad.ops as T
from tiegrad import EagerSession

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
from transformers.models.gemma.modeling_gemma import GemmaRMSNorm  # noqa: E402
from transformers.models.llama.modeling_llama import LlamaRMSNorm  # noqa: E402


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
