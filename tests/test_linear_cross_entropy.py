"""``ops.linear_cross_entropy``: the head's projection and its cross-entropy in one op
(issue 50), and the models' ``loss`` on it.

Tolerances: float64 agrees with the unfused ``cross_entropy(linear(h, W))`` to 1e-12 of
the result's scale and with central differences to ``gradcheck``'s 1e-5; float32 agrees
with the unfused path and with PyTorch to 1e-5 of the scale (the products sum in
other orders). ``chunked`` makes the chunks whole rows of logits, one or two at a time,
and the weight's blocks a few rows; ``blocks`` makes them a few rows by three classes
(the two passes of a vocabulary larger than a chunk), so every size of the tests runs
several of each.
"""

from __future__ import annotations

import importlib
import re
import tracemalloc

import numpy as np
import pytest
from gradcheck import check_grad

import tiegrad.ops as T
from tiegrad import (
    DTypeError,
    EagerSession,
    HyperparameterError,
    IndexRangeError,
    ShapeError,
    TiegradError,
)
from tiegrad.models import GPT2, LlamaLM, SharedBlockLM, TiedLM

LCE = importlib.import_module("tiegrad.ops.linear_cross_entropy")
V, H = 11, 6
REDUCTIONS = ["mean", "sum", "none"]


@pytest.fixture(params=["whole", "chunked", "blocks"])
def chunked(request, monkeypatch):
    if request.param == "chunked":  # chunks of whole rows: one row (float64), two (float32)
        monkeypatch.setattr(LCE, "TILE_BYTES", 2 * V * 8 - 1)
        monkeypatch.setattr(LCE, "BLOCK_BYTES", 3 * H * 8)  # three rows of the weight
    if request.param == "blocks":  # chunks of 4 rows (float64) or 8 x 3 classes: two passes
        monkeypatch.setattr(LCE, "TILE_BYTES", 4 * 3 * 8)
        monkeypatch.setattr(LCE, "MIN_COLUMNS", 3)
    return request.param


def inputs(dtype=np.float64, shape=(2, 5), seed=0, ignored=0):
    g = np.random.default_rng(seed)
    h = g.standard_normal(shape + (H,)).astype(dtype)
    w = g.standard_normal((V, H)).astype(dtype)
    t = g.integers(0, V, shape)
    t.reshape(-1)[: ignored or 0] = -100
    return h, w, t


def run(fused, h, w, t, device=None, seed=7, **kw):
    """The loss and the gradients of ``h`` and ``w`` under a random cotangent."""
    s = EagerSession(device=device)
    hr, wr = s.leaf(h), s.leaf(w)
    if fused:
        out = T.linear_cross_entropy(hr, wr, t, **kw)
    else:
        out = T.cross_entropy(T.linear(hr, wr), t, **kw)
    cot = np.random.default_rng(seed).standard_normal(out.shape).astype(h.dtype)
    if device is not None:
        cot = s.backend.asarray(cot)
    grads = s.backward(out, seed=cot)
    return [s.backend.to_numpy(x) for x in (out.value, grads[hr], grads[wr])]


def assert_near(ours, theirs, rtol, what):
    ours, theirs = np.asarray(ours), np.asarray(theirs)
    assert ours.shape == theirs.shape and ours.dtype == theirs.dtype, what
    scale = float(np.max(np.abs(theirs))) if theirs.size else 0.0
    np.testing.assert_allclose(ours, theirs, rtol=0, atol=rtol * max(scale, 1e-30), err_msg=what)


@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("smoothing", [0.0, 0.2])
@pytest.mark.parametrize("ignored", [0, 3])
def test_gradients_match_finite_differences_in_float64(chunked, reduction, smoothing, ignored):
    h, w, t = inputs(ignored=ignored)
    kw = dict(reduction=reduction, label_smoothing=smoothing)
    check_grad(lambda a, b: T.linear_cross_entropy(a, b, t, **kw), [h, w])


@pytest.mark.parametrize("dtype, rtol", [(np.float64, 1e-12), (np.float32, 1e-5)])
@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("smoothing", [0.0, 0.1])
@pytest.mark.parametrize("ignored", [0, 4, 10])  # none, some, every position
def test_agrees_with_the_unfused_path(chunked, dtype, rtol, reduction, smoothing, ignored):
    h, w, t = inputs(dtype, ignored=ignored)
    kw = dict(reduction=reduction, label_smoothing=smoothing)
    fused, unfused = run(True, h, w, t, **kw), run(False, h, w, t, **kw)
    for what, a, b in zip(("loss", "grad h", "grad w"), fused, unfused):
        assert_near(a, b, rtol, what)
    if ignored == 10:  # nothing counted: loss 0 (PyTorch's mean gives NaN), no gradient
        assert not np.any(fused[0]) and not np.any(fused[1]) and not np.any(fused[2])


def test_a_custom_ignore_index_and_leading_axes(chunked):
    h, w, t = inputs(np.float64, shape=(2, 1, 3))
    t[0, 0, 1] = t[1, 0, 2] = 4
    fused = run(True, h, w, t, ignore_index=4)
    unfused = run(False, h, w, t, ignore_index=4)
    for what, a, b in zip(("loss", "grad h", "grad w"), fused, unfused):
        assert_near(a, b, 1e-12, what)
    assert fused[1].shape == h.shape


torch = pytest.importorskip("torch")
F = torch.nn.functional


@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("smoothing", [0.0, 0.1])
def test_matches_pytorch_unfused_cross_entropy(chunked, reduction, smoothing):
    h, w, t = inputs(np.float32, ignored=3)
    loss, gh, gw = run(True, h, w, t, reduction=reduction, label_smoothing=smoothing)
    th = torch.tensor(h, requires_grad=True)
    tw = torch.tensor(w, requires_grad=True)
    tl = F.cross_entropy(
        (th @ tw.T).reshape(-1, V),
        torch.tensor(t).reshape(-1),
        reduction=reduction,
        label_smoothing=smoothing,
    )
    if reduction == "none":
        tl = tl.reshape(t.shape)
    cot = np.random.default_rng(7).standard_normal(tuple(tl.shape)).astype(np.float32)
    tl.backward(torch.tensor(cot))
    assert_near(loss, tl.detach().numpy(), 1e-5, "loss")
    assert_near(gh, th.grad.numpy(), 1e-5, "grad h")
    assert_near(gw, tw.grad.numpy(), 1e-5, "grad w")


@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_torch_device_route_matches_the_host(chunked, reduction):
    h, w, t = inputs(np.float32, ignored=2)
    kw = dict(reduction=reduction, label_smoothing=0.1)
    host = run(True, h, w, t, **kw)
    for targets in (t, torch.tensor(t)):  # counted on the host, and on the device
        device = run(True, h, w, targets, device="torch:cpu", **kw)
        for what, a, b in zip(("loss", "grad h", "grad w"), device, host):
            assert_near(a, b, 1e-5, what)


def test_uses_that_need_no_gradient_get_none_and_skip_their_products(monkeypatch):
    h, w, t = inputs()
    products = []
    real = LCE._Chunks.run

    def counting(self, row_weight, want_h, want_w):
        products.append((want_h, want_w))
        return real(self, row_weight, want_h, want_w)

    monkeypatch.setattr(LCE._Chunks, "run", counting)
    s = EagerSession()
    hr, frozen = s.leaf(h), s.leaf(w, requires_grad=False)
    grads = s.backward(T.linear_cross_entropy(hr, frozen, t))
    assert frozen.id not in grads and products == [(True, False)]
    s2 = EagerSession()
    a, b = s2.leaf(h), s2.leaf(w, requires_grad=False)
    assert_near(grads[hr], s2.backward(T.cross_entropy(T.linear(a, b), t))[a], 1e-12, "grad h")
    products.clear()
    s = EagerSession()
    with s.no_grad():
        out = T.linear_cross_entropy(s.leaf(h), s.leaf(w), t)
    assert products == [(False, False)] and np.isfinite(out.value)


def test_the_logits_are_never_held(monkeypatch):
    # 512 positions x 4096 classes: 8 MiB of float32 logits, and as much again for their
    # gradient on the unfused path; chunks of 64 KiB keep the op's extra memory near that.
    monkeypatch.setattr(LCE, "TILE_BYTES", 1 << 16)
    monkeypatch.setattr(LCE, "BLOCK_BYTES", 1 << 16)
    g = np.random.default_rng(3)
    h = g.standard_normal((512, 16), dtype=np.float32)
    w = g.standard_normal((4096, 16), dtype=np.float32)
    t = g.integers(0, 4096, 512)
    s = EagerSession()
    hr, wr = s.leaf(h), s.leaf(w)
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        grads = s.backward(T.linear_cross_entropy(hr, wr, t))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    beyond = peak - base - grads[hr].nbytes - grads[wr].nbytes
    assert beyond < 1 << 20, f"{beyond} bytes beyond the inputs and gradients"


def raises_and_records_nothing(s, exc, match, fn):
    n = len(s)
    with pytest.raises(exc, match=match) as info:
        fn()
    assert isinstance(info.value, TiegradError)
    assert len(s) == n, f"a failing op recorded {len(s) - n} node(s)"


def test_bad_operands_are_refused_and_record_nothing():
    s = EagerSession()
    h, w = s.leaf(np.ones((4, H), np.float32)), s.leaf(np.ones((V, H), np.float32))
    good = np.array([0, 1, 2, 3])
    op = T.linear_cross_entropy
    raises_and_records_nothing(
        s,
        ShapeError,
        re.escape(f"input of shape (4, {H}) does not fit weight of shape ({H}, {V})"),
        lambda: op(h, np.ones((H, V), np.float32), good),
    )
    raises_and_records_nothing(
        s, ShapeError, r"weight of shape \(66,\)", lambda: op(h, np.ones(V * H, np.float32), good)
    )
    raises_and_records_nothing(
        s,
        ShapeError,
        r"targets of shape \(3,\) do not fit input of shape \(4, 6\)",
        lambda: op(h, w, good[:3]),
    )
    raises_and_records_nothing(
        s,
        DTypeError,
        "indices must have an integer dtype, got float64",
        lambda: op(h, w, good.astype(float)),
    )
    raises_and_records_nothing(
        s,
        DTypeError,
        "input and weight must share one floating dtype, got float32 and float64",
        lambda: op(h, np.ones((V, H)), good),
    )
    raises_and_records_nothing(
        s,
        IndexRangeError,
        rf"targets must lie in \[0, {V}\) or equal ignore_index=-100, got values in \[0, {V}\]",
        lambda: op(h, w, np.array([0, 1, V, 2])),
    )
    raises_and_records_nothing(
        s,
        IndexRangeError,
        r"got values in \[-1, 2\]",
        lambda: op(h, w, np.array([0, -1, 2, 0])),
    )
    raises_and_records_nothing(
        s, HyperparameterError, "reduction must be", lambda: op(h, w, good, reduction="avg")
    )
    raises_and_records_nothing(
        s,
        HyperparameterError,
        r"label_smoothing must be in \[0, 1\], got 1.5",
        lambda: op(h, w, good, label_smoothing=1.5),
    )


def test_out_of_range_device_targets_are_refused():
    s = EagerSession(device="torch:cpu")
    h, w = s.leaf(np.ones((3, H), np.float32)), s.leaf(np.ones((V, H), np.float32))
    raises_and_records_nothing(
        s,
        IndexRangeError,
        rf"targets must lie in \[0, {V}\).*got values in \[0, {V + 4}\]",
        lambda: T.linear_cross_entropy(h, w, torch.tensor([0, V + 4, -100])),
    )


# -- the models' loss ------------------------------------------------------------------------


def tiny(kind):
    if kind == "tied":
        return TiedLM(vocab_size=23, d_model=8, n_layers=1, n_heads=2, max_seq_len=8, seed=1)
    if kind == "shared":
        return SharedBlockLM(23, d_model=8, n_heads=2, n_repeats=2, max_seq_len=8, seed=1)
    if kind == "gpt2":
        return GPT2(
            vocab_size=23, n_positions=8, n_embd=8, n_layer=1, n_head=2, seed=1,
            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
        )  # fmt: skip
    return LlamaLM(
        vocab_size=23, hidden_size=8, intermediate_size=16, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=8,
        tie_word_embeddings=kind == "llama tied", seed=1,
    )  # fmt: skip


def loss_and_gradients(model, fused, idx, targets):
    s = EagerSession()
    if fused:
        loss = model.loss(s, idx, targets)
    else:
        loss = T.cross_entropy(model(s, idx), targets)
    return float(loss.value), dict(model.named_gradients(s.backward(loss)))


@pytest.mark.parametrize("kind", ["tied", "shared", "gpt2", "llama", "llama tied"])
@pytest.mark.parametrize("frozen_head", [False, True])
def test_model_loss_is_the_fused_op_and_matches_the_unfused_path(kind, frozen_head, monkeypatch):
    model = tiny(kind)
    if frozen_head:  # the head's use is frozen; a tied embedding still trains the storage
        model.freeze("lm_head.weight")
    calls = []
    real = LCE.linear_cross_entropy
    monkeypatch.setattr(T, "linear_cross_entropy", lambda *a, **k: calls.append(1) or real(*a, **k))
    g = np.random.default_rng(4)
    idx, targets = g.integers(0, 23, (2, 5)), g.integers(0, 23, (2, 5))
    targets[0, :2] = -100
    fused = loss_and_gradients(model, True, idx, targets)
    assert calls == [1]
    unfused = loss_and_gradients(model, False, idx, targets)
    assert fused[0] == pytest.approx(unfused[0], rel=1e-6)
    assert fused[1].keys() == unfused[1].keys()
    for path, grad in unfused[1].items():
        assert_near(fused[1][path], grad, 1e-5, path)


def test_a_head_with_a_lora_adapter_takes_the_unfused_path_and_trains(monkeypatch):
    from tiegrad.adapters import add_lora

    model = tiny("gpt2")
    add_lora(model, "lm_head", rank=2)
    calls = []
    monkeypatch.setattr(T, "linear_cross_entropy", lambda *a, **k: calls.append(1))
    g = np.random.default_rng(5)
    idx, targets = g.integers(0, 23, (2, 5)), g.integers(0, 23, (2, 5))
    loss, grads = loss_and_gradients(model, True, idx, targets)
    assert calls == []
    unfused = loss_and_gradients(model, False, idx, targets)
    assert loss == unfused[0] and grads.keys() == unfused[1].keys()
    adapter = "lm_head.lora.default.B"
    assert np.any(grads[adapter]) and np.array_equal(grads[adapter], unfused[1][adapter])
