"""Layers against PyTorch's (same weights, float64): forward, input and weight gradients.

Also: default initialisations have PyTorch's distributions, all randomness comes from
the given generator, and a wrong input shape is a ShapeError naming the layer and both
shapes.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from tiegrad import DTypeError, EagerSession, ShapeError
from tiegrad import nn as tnn

torch = pytest.importorskip("torch")
from nn_reference import assert_grads_match, copy_to_torch, encoder_layer  # noqa: E402

F64 = "float64"


def rng(seed: int = 0) -> np.random.Generator:
    return np.random.default_rng(seed)


def compare(layer, reference, x, names=None, call=None, tcall=None, differentiable=True):
    """Run ``layer`` and ``reference`` on ``x`` with one random cotangent; compare all."""
    copy_to_torch(layer, reference, names)
    s = EagerSession()
    xr = s.leaf(x) if differentiable else x
    y = call(s, xr) if call else layer(s, xr)
    seed = rng(1).normal(size=y.shape)
    grads = s.backward(y, seed=seed)
    xt = torch.tensor(x, requires_grad=differentiable)
    yt = tcall(xt) if tcall else reference(xt)
    yt.backward(torch.from_numpy(seed))
    np.testing.assert_allclose(y.numpy(), yt.detach().numpy(), rtol=1e-10, atol=1e-12)
    if differentiable:
        np.testing.assert_allclose(grads[xr], xt.grad.numpy(), rtol=1e-9, atol=1e-11)
    assert_grads_match(layer.named_gradients(grads), reference, names)


@pytest.mark.parametrize("bias", [True, False])
def test_linear_matches_torch(bias):
    layer = tnn.Linear(5, 3, bias=bias, rng=rng(), dtype=F64)
    ref = torch.nn.Linear(5, 3, bias=bias, dtype=torch.float64)
    compare(layer, ref, rng(2).normal(size=(2, 4, 5)))


def test_embedding_matches_torch_with_repeated_ids():
    layer = tnn.Embedding(7, 4, rng=rng(), dtype=F64)
    ref = torch.nn.Embedding(7, 4, dtype=torch.float64)
    ids = np.array([[0, 3, 3], [6, 0, 3]])
    compare(layer, ref, ids, tcall=lambda t: ref(t), differentiable=False)


def test_layer_norm_matches_torch():
    layer = tnn.LayerNorm(6, eps=1e-4, dtype=F64)
    layer.weight.set_value(rng(3).normal(size=6))
    layer.bias.set_value(rng(4).normal(size=6))
    ref = torch.nn.LayerNorm(6, eps=1e-4, dtype=torch.float64)
    compare(layer, ref, rng(2).normal(size=(3, 2, 6)))


def test_mlp_and_sequential_match_torch():
    mlp = tnn.MLP(4, [8, 6], 3, activation="gelu", rng=rng(), dtype=F64)
    ref = torch.nn.Sequential(
        torch.nn.Linear(4, 8, dtype=torch.float64),
        torch.nn.GELU(),
        torch.nn.Linear(8, 6, dtype=torch.float64),
        torch.nn.GELU(),
        torch.nn.Linear(6, 3, dtype=torch.float64),
    )
    names = {f"layers.{i}.{k}": f"{2 * i}.{k}" for i in range(3) for k in ("weight", "bias")}
    compare(mlp, ref, rng(2).normal(size=(5, 4)), names)
    seq = tnn.Sequential(
        tnn.Linear(4, 8, rng=rng(5), dtype=F64), tnn.Tanh(), tnn.Linear(8, 2, rng=rng(6), dtype=F64)
    )
    tseq = torch.nn.Sequential(
        torch.nn.Linear(4, 8, dtype=torch.float64),
        torch.nn.Tanh(),
        torch.nn.Linear(8, 2, dtype=torch.float64),
    )
    compare(seq, tseq, rng(2).normal(size=(5, 4)))


@pytest.mark.parametrize("causal, padded", [(False, False), (True, False), (True, True)])
def test_multi_head_attention_matches_torch(causal, padded):
    layer = tnn.MultiHeadAttention(8, 2, causal=causal, rng=rng(), dtype=F64)
    for p in (layer.qkv.bias, layer.proj.bias):  # zero by default; make the test see them
        p.set_value(rng(7).normal(size=p.shape))
    ref = torch.nn.MultiheadAttention(8, 2, batch_first=True, dtype=torch.float64)
    names = {
        "qkv.weight": "in_proj_weight",
        "qkv.bias": "in_proj_bias",
        "proj.weight": "out_proj.weight",
        "proj.bias": "out_proj.bias",
    }
    t = 5
    pad = np.zeros((2, t), dtype=bool)
    if padded:
        pad[0, 3:] = True  # right padding: every query still sees key 0
    mask = torch.triu(torch.ones(t, t, dtype=torch.bool), 1) if causal else None

    def tcall(x):
        return ref(
            x,
            x,
            x,
            attn_mask=mask,
            key_padding_mask=torch.from_numpy(pad) if padded else None,
            need_weights=False,
            is_causal=causal,
        )[0]

    compare(
        layer,
        ref,
        rng(2).normal(size=(2, t, 8)),
        names,
        call=lambda s, x: layer(s, x, key_padding_mask=pad if padded else None),
        tcall=tcall,
    )


def test_transformer_block_matches_torch_encoder_layer():
    block = tnn.TransformerBlock(8, 2, mlp_ratio=4, causal=True, rng=rng(), dtype=F64)
    for _, p in block.named_parameters():  # move LayerNorm and biases off their defaults
        p.set_value(p.value + 0.1 * rng(8).normal(size=p.shape))
    ref = encoder_layer(8, 2, 4).train()
    t = 4
    mask = torch.triu(torch.ones(t, t, dtype=torch.bool), 1)
    compare(
        block,
        ref,
        rng(2).normal(size=(3, t, 8)),
        tcall=lambda x: ref(x, src_mask=mask, is_causal=True),
    )


@pytest.mark.parametrize("stride, padding", [(1, 0), (2, 1)])
def test_conv2d_matches_torch(stride, padding):
    layer = tnn.Conv2d(3, 4, 3, stride=stride, padding=padding, rng=rng(), dtype=F64)
    ref = torch.nn.Conv2d(3, 4, 3, stride=stride, padding=padding, dtype=torch.float64)
    compare(layer, ref, rng(2).normal(size=(2, 3, 7, 6)))


def test_cnn_of_conv_pool_flatten_linear_matches_torch():
    net = tnn.Sequential(
        tnn.Conv2d(2, 3, 3, padding=1, rng=rng(1), dtype=F64),
        tnn.ReLU(),
        tnn.MaxPool2d(2),
        tnn.Flatten(),
        tnn.Linear(3 * 3 * 3, 4, rng=rng(2), dtype=F64),
    )
    ref = torch.nn.Sequential(
        torch.nn.Conv2d(2, 3, 3, padding=1, dtype=torch.float64),
        torch.nn.ReLU(),
        torch.nn.MaxPool2d(2),
        torch.nn.Flatten(),
        torch.nn.Linear(27, 4, dtype=torch.float64),
    )
    compare(net, ref, rng(3).normal(size=(2, 2, 6, 7)))


# -- dropout --------------------------------------------------------------------------
def test_dropout_uses_the_session_generator_and_is_off_in_eval():
    layer = tnn.Dropout(0.25)
    x = np.ones((200, 50))

    def run(seed):
        return layer(EagerSession(seed=seed), x).numpy()

    a, b, c = run(3), run(3), run(4)
    np.testing.assert_array_equal(a, b)
    assert not np.array_equal(a, c)
    assert set(np.unique(a)) == {0.0, 1.0 / 0.75}
    assert abs((a == 0).mean() - 0.25) < 0.02
    layer.eval()
    np.testing.assert_array_equal(run(3), x)


# -- initialisation ---------------------------------------------------------------------
def _assert_uniform(values: np.ndarray, bound: float) -> None:
    assert np.abs(values).max() <= bound
    assert abs(values.std() / (bound / math.sqrt(3)) - 1) < 0.03
    assert abs(values.mean()) < 0.02 * bound


def test_default_initialisations_have_pytorch_distributions():
    lin = tnn.Linear(300, 200, rng=rng())
    _assert_uniform(lin.weight.value, 1 / math.sqrt(300))
    assert np.abs(lin.bias.value).max() <= 1 / math.sqrt(300)
    emb = tnn.Embedding(300, 100, rng=rng())
    assert abs(emb.weight.value.std() - 1) < 0.02 and abs(emb.weight.value.mean()) < 0.02
    ln = tnn.LayerNorm(5)
    np.testing.assert_array_equal(ln.weight.value, np.ones(5))
    np.testing.assert_array_equal(ln.bias.value, np.zeros(5))
    conv = tnn.Conv2d(16, 64, 5, rng=rng())
    _assert_uniform(conv.weight.value, 1 / math.sqrt(16 * 25))
    mha = tnn.MultiHeadAttention(128, 4, rng=rng())
    _assert_uniform(mha.qkv.weight.value, math.sqrt(6 / (128 + 3 * 128)))
    _assert_uniform(mha.proj.weight.value, 1 / math.sqrt(128))
    assert not mha.qkv.bias.value.any() and not mha.proj.bias.value.any()
    assert lin.weight.dtype == np.float32


def test_torch_layers_have_the_same_initial_spread():
    torch.manual_seed(0)
    for ours, theirs in [
        (tnn.Linear(256, 128, rng=rng()).weight, torch.nn.Linear(256, 128).weight),
        (tnn.Conv2d(8, 32, 3, rng=rng()).weight, torch.nn.Conv2d(8, 32, 3).weight),
        (tnn.Embedding(64, 64, rng=rng()).weight, torch.nn.Embedding(64, 64).weight),
    ]:
        want = theirs.detach().numpy()
        assert abs(ours.value.std() / want.std() - 1) < 0.05
        if np.abs(want).max() < 1:  # bounded (uniform) layers: the same bound
            assert abs(np.abs(ours.value).max() / np.abs(want).max() - 1) < 0.02


def test_initialisation_comes_only_from_the_generator():
    a, b = tnn.MLP(4, 8, 2, rng=rng(5)), tnn.MLP(4, 8, 2, rng=rng(5))
    c = tnn.MLP(4, 8, 2, rng=rng(6))
    for (pa, x), (_, y), (_, z) in zip(a.named_slots(), b.named_slots(), c.named_slots()):
        np.testing.assert_array_equal(x.value, y.value, err_msg=pa)
        assert not np.array_equal(x.value, z.value)
    np.testing.assert_array_equal(tnn.Linear(3, 3).weight.value, tnn.Linear(3, 3).weight.value)


# -- bad input --------------------------------------------------------------------------
@pytest.mark.parametrize(
    "layer, shape, expected",
    [
        (tnn.Linear(4, 3), (2, 5), "(..., 4)"),
        (tnn.LayerNorm(6), (3, 5), "(..., 6)"),
        (tnn.MultiHeadAttention(8, 2), (2, 3, 6), "(B, T, 8)"),
        (tnn.MultiHeadAttention(8, 2), (3, 8), "(B, T, 8)"),
        (tnn.TransformerBlock(8, 2), (2, 3, 4), "(B, T, 8)"),
        (tnn.Conv2d(3, 4, 3), (1, 2, 5, 5), "(N, 3, H, W)"),
        (tnn.MaxPool2d(2), (4, 4), "(N, C, H, W)"),
        (tnn.Flatten(2), (4, 4), "(..., D, D, D)"),
    ],
)
def test_wrong_input_shape_names_the_layer_and_both_shapes(layer, shape, expected):
    s = EagerSession()
    with pytest.raises(ShapeError) as err:
        layer(s, np.zeros(shape, dtype=np.float32))
    msg = str(err.value)
    assert msg.startswith(layer.label()), msg
    assert str(shape) in msg and expected in msg


@pytest.mark.parametrize(
    "mask, error, message",
    [
        (
            np.zeros((2, 4), bool),
            ShapeError,
            r"key_padding_mask has shape \(2, 4\), expected \(2, 3\)",
        ),
        (np.zeros((2, 3), np.int64), DTypeError, "key_padding_mask must be bool, got int64"),
    ],
)
@pytest.mark.parametrize("layer", [tnn.MultiHeadAttention, tnn.TransformerBlock])
def test_a_wrong_key_padding_mask_names_the_layer_and_records_nothing(
    layer, mask, error, message
):  # C6
    s = EagerSession()
    with pytest.raises(error, match=layer.__name__ + r"\(.*" + message):
        layer(8, 2)(s, np.zeros((2, 3, 8), np.float32), key_padding_mask=mask)
    assert len(s) == 0


def test_module_called_without_a_session_says_how_to_call_it():
    from tiegrad import TapeError

    with pytest.raises(TapeError, match="module\\(session, x"):
        tnn.Linear(2, 2)(np.zeros((1, 2)))
