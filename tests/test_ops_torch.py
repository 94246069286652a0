"""Differential tests: every op PyTorch also has, forward and gradient, in float32 (issue 2).

Each case runs the same inputs and the same random cotangent through tiegrad and
through PyTorch autograd. Errors are measured against the array's scale:
``|ours - torch| <= RTOL * max|torch|`` elementwise, with ``RTOL = 1e-5``.
"""

from __future__ import annotations

import numpy as np
import pytest

import tiegrad.ops as T
from tiegrad import EagerSession

torch = pytest.importorskip("torch")
F = torch.nn.functional

RTOL = 1e-5


def rnd(*shape: int, seed: int = 0, low: float | None = None) -> np.ndarray:
    g = np.random.default_rng(seed)
    x = g.uniform(low, 2.0, shape) if low is not None else g.standard_normal(shape)
    return x.astype(np.float32)


def assert_close(ours, theirs, what: str, floor: float = 1e-30) -> None:
    theirs = theirs.detach().numpy() if hasattr(theirs, "detach") else np.asarray(theirs)
    ours = np.asarray(ours)
    assert ours.shape == theirs.shape, f"{what}: shape {ours.shape}, torch {theirs.shape}"
    assert ours.dtype == np.float32, f"{what}: dtype {ours.dtype}, expected float32"
    scale = float(np.max(np.abs(theirs))) if theirs.size else 0.0
    np.testing.assert_allclose(ours, theirs, rtol=0, atol=RTOL * max(scale, floor), err_msg=what)


def compare(ours_fn, torch_fn, inputs, seed: int = 99, floor: float = 1e-30) -> None:
    """Forward values and every input's gradient of tiegrad and PyTorch agree.

    ``floor``: the least scale of the tolerance, for a result that is zero by algebra
    (its rounding is that of the inputs' scale, not of zero)."""
    s = EagerSession()
    refs = [s.leaf(a) for a in inputs]
    out = ours_fn(*refs)
    tins = [torch.tensor(a, requires_grad=True) for a in inputs]
    tout = torch_fn(*tins)
    assert_close(out.value, tout, "forward", floor)
    cot = np.random.default_rng(seed).standard_normal(tuple(tout.shape)).astype(np.float32)
    grads = s.backward(out, seed=cot)
    tout.backward(torch.tensor(cot))
    for k, (r, t) in enumerate(zip(refs, tins)):
        assert_close(grads[r], t.grad, f"gradient of input {k}", floor)


# -- arithmetic -------------------------------------------------------------------------
BINARY = [
    ("add", T.add, torch.add),
    ("sub", T.sub, torch.sub),
    ("mul", T.mul, torch.mul),
    ("div", T.div, torch.div),
]


@pytest.mark.parametrize("name, ours, theirs", BINARY, ids=[b[0] for b in BINARY])
@pytest.mark.parametrize(
    "sa, sb", [((3, 4), (3, 4)), ((2, 1, 4), (3, 1)), ((), (2, 3)), ((4,), (1,))]
)
def test_binary(name, ours, theirs, sa, sb):
    b = rnd(*sb, seed=1, low=0.5) if name == "div" else rnd(*sb, seed=1)
    compare(ours, theirs, [rnd(*sa), b])


@pytest.mark.parametrize("name, ours, theirs", BINARY, ids=[b[0] for b in BINARY])
def test_binary_with_numbers(name, ours, theirs):
    x = rnd(2, 3, low=0.5)
    compare(lambda a: ours(a, 1.5), lambda a: theirs(a, 1.5), [x])
    compare(lambda a: ours(np.float64(2.0), a), lambda a: theirs(torch.tensor(2.0), a), [x])


def test_neg_and_pow():
    x = rnd(3, 4, low=0.5)
    compare(T.neg, torch.neg, [x])
    for e in (2, 3, 0.5, -1.5, 0):
        compare(lambda a, e=e: a**e, lambda a, e=e: a**e, [x])


@pytest.mark.parametrize(
    "sa, sb",
    [((4,), (4,)), ((4,), (4, 3)), ((2, 4), (4,)), ((5, 4), (4, 3)), ((2, 1, 5, 4), (3, 4, 2))],
)
def test_matmul(sa, sb):
    compare(T.matmul, torch.matmul, [rnd(*sa), rnd(*sb, seed=1)])


# -- reductions and shape ops -----------------------------------------------------------
@pytest.mark.parametrize("axis", [None, 0, (0, 2), -1])
@pytest.mark.parametrize("keepdims", [False, True])
def test_reductions(axis, keepdims):
    x = rnd(2, 3, 4)
    dim = tuple(range(3)) if axis is None else axis
    compare(lambda a: T.sum(a, axis, keepdims), lambda a: torch.sum(a, dim, keepdim=keepdims), [x])
    compare(
        lambda a: T.mean(a, axis, keepdims), lambda a: torch.mean(a, dim, keepdim=keepdims), [x]
    )
    compare(lambda a: T.max(a, axis, keepdims), lambda a: torch.amax(a, dim, keepdim=keepdims), [x])


def test_max_ties_like_amax():
    x = np.array([[1.0, 3.0, 3.0], [2.0, 2.0, 2.0]], dtype=np.float32)
    compare(lambda a: T.max(a, 1), lambda a: torch.amax(a, 1), [x])


def test_shape_ops():
    x = rnd(2, 3, 4)
    compare(lambda a: a.reshape(4, 6), lambda a: a.reshape(4, 6), [x])
    compare(lambda a: T.permute(a, (2, 0, 1)), lambda a: a.permute(2, 0, 1), [x])
    compare(lambda a: T.transpose(a, 0, 2), lambda a: a.transpose(0, 2), [x])
    compare(lambda a: a.T, lambda a: a.permute(2, 1, 0), [x])


@pytest.mark.parametrize(
    "index",
    [
        1,
        (slice(None), slice(1, 3)),
        (Ellipsis, 0),
        np.array([0, 2, 0, 0]),
        (np.array([0, 1, 1]), np.array([2, 2, 2])),
        np.array([True, False, True]),
    ],
)
def test_getitem(index):
    tindex = (
        tuple(torch.tensor(i) if isinstance(i, np.ndarray) else i for i in index)
        if isinstance(index, tuple)
        else torch.tensor(index)
        if isinstance(index, np.ndarray)
        else index
    )
    compare(lambda a: a[index], lambda a: a[tindex], [rnd(3, 4)])


@pytest.mark.parametrize("axis", [0, 1, -1])
def test_concat_stack(axis):
    xs = [rnd(2, 3), rnd(2, 3, seed=1), rnd(2, 3, seed=2)]
    compare(lambda *r: T.concat(list(r), axis), lambda *t: torch.cat(t, axis), xs)
    compare(lambda *r: T.stack(list(r), axis), lambda *t: torch.stack(t, axis), xs)


def test_where():
    cond = rnd(3, 1, seed=5) > 0
    compare(
        lambda a, b: T.where(cond, a, b),
        lambda a, b: torch.where(torch.tensor(cond), a, b),
        [rnd(3, 4), rnd(4, seed=1)],
    )


# -- elementwise ------------------------------------------------------------------------
@pytest.mark.parametrize(
    "name, ours, theirs, low",
    [
        ("exp", T.exp, torch.exp, None),
        ("log", T.log, torch.log, 0.1),
        ("sqrt", T.sqrt, torch.sqrt, 0.1),
        ("tanh", T.tanh, torch.tanh, None),
        ("sigmoid", T.sigmoid, torch.sigmoid, None),
        ("relu", T.relu, torch.relu, None),
        ("gelu", T.gelu, F.gelu, None),
        (
            "gelu_tanh",
            lambda a: T.gelu(a, approximate="tanh"),
            lambda a: F.gelu(a, approximate="tanh"),
            None,
        ),
    ],
)
def test_unary(name, ours, theirs, low):
    x = rnd(5, 7, low=low) * (1.0 if low else 3.0)
    compare(ours, theirs, [x])


# -- softmax, layer_norm, linear ----------------------------------------------------------
@pytest.mark.parametrize("axis", [0, -1])
def test_softmax_log_softmax(axis):
    x = rnd(3, 5, 4) * 4
    compare(lambda a: T.softmax(a, axis), lambda a: torch.softmax(a, axis), [x])
    compare(lambda a: T.log_softmax(a, axis), lambda a: torch.log_softmax(a, axis), [x])


def test_layer_norm():
    x, w, b = rnd(2, 3, 8), rnd(8, seed=1), rnd(8, seed=2)
    compare(T.layer_norm, lambda a, w, b: F.layer_norm(a, (8,), w, b), [x, w, b])
    compare(lambda a: T.layer_norm(a, eps=1e-3), lambda a: F.layer_norm(a, (8,), eps=1e-3), [x])


@pytest.mark.parametrize("d", [7, 96])
def test_layer_norm_of_constant_rows_is_exactly_the_bias_as_in_torch(d):
    x = np.stack([np.full(d, c, np.float32) for c in (10.1, -3.3, 0.0, 3e4)] + [rnd(d)])
    b = rnd(d, seed=2)
    s = EagerSession()
    out = T.layer_norm(s.leaf(x), bias=s.leaf(b))
    np.testing.assert_array_equal(out.value[:4], np.broadcast_to(b, (4, d)))
    theirs = F.layer_norm(torch.tensor(x), (d,), bias=torch.tensor(b))
    assert_close(out.value, theirs, "layer_norm of constant rows")
    compare(T.layer_norm, lambda a: F.layer_norm(a, (d,)), [x[[0, 1, 2, 4]]])


@pytest.mark.parametrize("xshape", [(6,), (4, 6), (2, 3, 6)])
def test_linear(xshape):
    x, w, b = rnd(*xshape), rnd(5, 6, seed=1), rnd(5, seed=2)
    compare(T.linear, F.linear, [x, w, b])
    compare(T.linear, F.linear, [x, w])


@pytest.mark.parametrize("xshape", [(6,), (4, 6), (2, 3, 6)])
def test_affine(xshape):
    x, w, b = rnd(*xshape), rnd(6, 5, seed=1), rnd(5, seed=2)
    compare(T.affine, lambda a, w, b: b + a @ w, [x, w, b])
    compare(T.affine, torch.matmul, [x, w])


# -- losses -----------------------------------------------------------------------------
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("smoothing", [0.0, 0.1])
@pytest.mark.parametrize("shape", [(6, 5), (2, 3, 5)])
def test_cross_entropy(reduction, smoothing, shape):
    t = np.random.default_rng(3).integers(0, shape[-1], shape[:-1])
    t.reshape(-1)[[1, 4]] = -100

    def theirs(a):
        logits = a if a.ndim == 2 else a.permute(0, 2, 1)  # torch: classes on axis 1
        return F.cross_entropy(
            logits, torch.tensor(t), reduction=reduction, label_smoothing=smoothing
        )

    compare(
        lambda a: T.cross_entropy(a, t, reduction=reduction, label_smoothing=smoothing),
        theirs,
        [rnd(*shape) * 3],
    )


def test_cross_entropy_custom_ignore_index():
    t = np.array([0, 2, 1, 2])
    compare(
        lambda a: T.cross_entropy(a, t, ignore_index=2),
        lambda a: F.cross_entropy(a, torch.tensor(t), ignore_index=2),
        [rnd(4, 3)],
    )


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_mse_loss(reduction):
    compare(
        lambda p, t: T.mse_loss(p, t, reduction),
        lambda p, t: F.mse_loss(p, t, reduction=reduction),
        [rnd(3, 4), rnd(3, 4, seed=1)],
    )


def test_embedding():
    idx = np.array([[1, 1, 3], [0, 1, 1]])
    compare(lambda w: T.embedding(w, idx), lambda w: F.embedding(torch.tensor(idx), w), [rnd(5, 3)])
    many = np.random.default_rng(4).integers(0, 3, (40,))
    compare(
        lambda w: T.embedding(w, many), lambda w: F.embedding(torch.tensor(many), w), [rnd(3, 4)]
    )


# -- attention, convolution, pooling ----------------------------------------------------
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("padded", [False, True])
def test_scaled_dot_product_attention(causal, padded):
    pad = np.array([[False, False, False, True, True], [False, True, False, False, False]])
    tq, tk = 5, 5

    def theirs(q, k, v):
        allowed = torch.ones(tq, tk, dtype=torch.bool)
        if causal:
            allowed = allowed.tril()
        if padded:
            allowed = allowed & ~torch.tensor(pad)[:, None, None, :]
        return F.scaled_dot_product_attention(q, k, v, attn_mask=allowed)

    compare(
        lambda q, k, v: T.scaled_dot_product_attention(
            q, k, v, causal=causal, key_padding_mask=pad if padded else None
        ),
        theirs,
        [rnd(2, 3, tq, 4), rnd(2, 3, tk, 4, seed=1), rnd(2, 3, tk, 6, seed=2)],
    )


def test_scaled_dot_product_attention_scale_and_cross_lengths():
    compare(
        lambda q, k, v: T.scaled_dot_product_attention(q, k, v, scale=0.2),
        lambda q, k, v: F.scaled_dot_product_attention(q, k, v, scale=0.2),
        [rnd(2, 3, 4), rnd(2, 6, 4, seed=1), rnd(2, 6, 5, seed=2)],
    )


@pytest.mark.parametrize("stride, padding", [(1, 0), (2, 1), (1, 2), (3, 1)])
def test_conv2d(stride, padding):
    x, w, b = rnd(2, 3, 7, 6), rnd(4, 3, 3, 2, seed=1), rnd(4, seed=2)
    compare(
        lambda x, w, b: T.conv2d(x, w, b, stride=stride, padding=padding),
        lambda x, w, b: F.conv2d(x, w, b, stride=stride, padding=padding),
        [x, w, b],
    )
    compare(
        lambda x, w: T.conv2d(x, w, stride=stride, padding=padding),
        lambda x, w: F.conv2d(x, w, stride=stride, padding=padding),
        [x, w],
    )


@pytest.mark.parametrize("kernel, stride", [(2, None), (3, 1), (2, 3), (3, 2)])
def test_max_pool2d(kernel, stride):
    compare(
        lambda x: T.max_pool2d(x, kernel, stride),
        lambda x: F.max_pool2d(x, kernel, stride),
        [rnd(2, 3, 7, 8)],
    )


@pytest.mark.parametrize("zero", [0, 0.0, -0.0, np.float32(0.0)])
def test_division_by_a_zero_number_gives_torchs_infinities_and_nan(zero):
    x = np.array([1.0, -2.0, 0.0], np.float32)
    s = EagerSession()
    ref = s.leaf(x)
    with np.errstate(divide="ignore", invalid="ignore"):
        out = ref / zero
        grad = s.backward(T.sum(out))[ref]
    tx = torch.tensor(x, requires_grad=True)
    expected = tx / zero
    expected.sum().backward()
    np.testing.assert_array_equal(out.value, expected.detach().numpy())
    np.testing.assert_array_equal(grad, tx.grad.numpy())


def test_mse_loss_mean_of_no_elements_is_nan_as_in_torch():
    s = EagerSession()
    pred = s.leaf(np.zeros((0, 3), np.float32))
    loss = T.mse_loss(pred, np.zeros((0, 3), np.float32))
    expected = F.mse_loss(torch.zeros(0, 3), torch.zeros(0, 3))
    assert np.isnan(loss.value) and torch.isnan(expected)
    assert s.backward(loss)[pred].shape == (0, 3)


def test_where_with_a_python_number_keeps_the_tensors_dtype():
    mask = np.array([True, False, True])
    x = rnd(3)
    s = EagerSession()
    ref = s.leaf(x)
    for out, theirs in (
        (T.where(mask, ref, 0), torch.where(torch.tensor(mask), torch.tensor(x), 0)),
        (T.where(mask, 0.5, ref), torch.where(torch.tensor(mask), 0.5, torch.tensor(x))),
    ):
        assert_close(out.value, theirs, "where")
    ints = s.constant(np.array([1, 2, 3]))
    assert T.where(mask, ints, 0.5).value.dtype == np.float64  # a float is not cut to an int


# -- the ops of Llama-family decoders (issue 48) ------------------------------------------
@pytest.mark.parametrize(
    "name, ours, theirs, low",
    [
        ("silu", T.silu, F.silu, None),
        ("rsqrt", T.rsqrt, torch.rsqrt, 0.1),
        ("cos", T.cos, torch.cos, None),
        ("sin", T.sin, torch.sin, None),
    ],
)
def test_unary_of_decoders(name, ours, theirs, low):
    x = rnd(5, 7, low=low) * (1.0 if low else 3.0)
    compare(ours, theirs, [x])


def test_rms_norm():
    x, w = rnd(2, 3, 8), rnd(8, seed=1)
    compare(
        lambda a, w: T.rms_norm(a, w, eps=1e-5), lambda a, w: F.rms_norm(a, (8,), w, 1e-5), [x, w]
    )
    compare(T.rms_norm, lambda a: F.rms_norm(a, (8,), eps=1e-6), [x])
    compare(
        lambda a, w: T.rms_norm(a, w, offset=1.0),
        lambda a, w: F.rms_norm(a, (8,), 1.0 + w, 1e-6),
        [x, w],
    )


def _rotate_half(x):
    h = x.shape[-1] // 2
    return torch.cat((-x[..., h:], x[..., :h]), dim=-1)


@pytest.mark.parametrize("rotated", [8, 4])
def test_rotary(rotated):
    # transformers' apply_rotary_pos_emb, with partial rotary as its models write it
    def theirs(x, c, s):
        x_rot, x_pass = x[..., :rotated], x[..., rotated:]
        return torch.cat((x_rot * c + _rotate_half(x_rot) * s, x_pass), dim=-1)

    angles = rnd(5, rotated // 2, seed=3) * 3
    c, s = np.cos(np.tile(angles, 2)), np.sin(np.tile(angles, 2))
    compare(T.rotary, theirs, [rnd(2, 3, 5, 8), c, s])


def _gqa_reference(q, k, v, causal, pad=None):
    """torch's attention of K and V repeated per query head, with an explicit mask."""
    groups = q.shape[-3] // k.shape[-3]
    k, v = k.repeat_interleave(groups, dim=-3), v.repeat_interleave(groups, dim=-3)
    tq, tk = q.shape[-2], k.shape[-2]
    seen = torch.ones(tq, tk, dtype=torch.bool)
    if causal == "bottom_right":
        seen = seen.tril(tk - tq)
    elif causal:
        seen = seen.tril()
    if pad is not None:
        seen = seen & ~torch.tensor(pad)[:, None, None, :]
    return F.scaled_dot_product_attention(q, k, v, attn_mask=seen)


@pytest.mark.parametrize("causal", [False, True, "bottom_right"])
@pytest.mark.parametrize("heads", [(6, 2), (4, 1), (3, 3)])
@pytest.mark.parametrize("tq", [1, 4])
def test_grouped_query_attention(causal, heads, tq):
    hq, hkv = heads
    compare(
        lambda q, k, v: T.scaled_dot_product_attention(q, k, v, causal=causal),
        lambda q, k, v: _gqa_reference(q, k, v, causal),
        [rnd(2, hq, tq, 4), rnd(2, hkv, 6, 4, seed=1), rnd(2, hkv, 6, 5, seed=2)],
        # one query seeing one key (top-left, tq 1): its q gradient is zero by algebra
        floor=1.0 if (causal is True and tq == 1) else 1e-30,
    )


def test_grouped_query_attention_with_padding():
    pad = np.array([[False, True, False, False, False, False], [False] * 5 + [True]])
    compare(
        lambda q, k, v: T.scaled_dot_product_attention(
            q, k, v, causal="bottom_right", key_padding_mask=pad
        ),
        lambda q, k, v: _gqa_reference(q, k, v, "bottom_right", pad),
        [rnd(2, 4, 3, 4), rnd(2, 2, 6, 4, seed=1), rnd(2, 2, 6, 5, seed=2)],
    )


def test_shape_ops_of_decoders():
    x = rnd(3, 1, 4)
    compare(lambda a: a.unsqueeze(1), lambda a: a.unsqueeze(1), [x])
    compare(lambda a: T.squeeze(a, 1), lambda a: a.squeeze(1), [x])
    compare(lambda a: a.squeeze(), lambda a: a.squeeze(), [x])
    compare(lambda a: a.expand(2, 3, 5, -1), lambda a: a.expand(2, 3, 5, -1), [x])
    compare(lambda a: a.repeat_interleave(3, 2), lambda a: a.repeat_interleave(3, 2), [x])
    compare(lambda a: a.repeat_interleave(2), lambda a: a.repeat_interleave(2), [x])
    counts = [1, 0, 3, 2]
    compare(
        lambda a: T.repeat_interleave(a, counts, -1),
        lambda a: a.repeat_interleave(torch.tensor(counts), -1),
        [x],
    )
    for ours, theirs in (
        (lambda a: a.chunk(3, -1), lambda a: a.chunk(3, -1)),
        (lambda a: T.split(a, [1, 3], -1), lambda a: a.split([1, 3], -1)),
        (lambda a: a.split(3, 2), lambda a: a.split(3, 2)),
    ):
        compare(
            lambda a, ours=ours: T.concat([p * (i + 1.0) for i, p in enumerate(ours(a))], -1),
            lambda a, theirs=theirs: torch.cat(
                [p * (i + 1.0) for i, p in enumerate(theirs(a))], -1
            ),
            [x],
        )
    assert [p.shape for p in T.chunk(EagerSession().leaf(x), 3, -1)] == [
        tuple(p.shape) for p in torch.tensor(x).chunk(3, -1)
    ]
