"""Every op's VJP against central finite differences in float64 (issue 2).

Shapes include broadcasting and size-1 axes; hypothesis draws shapes where the rule
is general (elementwise broadcasting, reductions). Inputs of non-smooth ops (relu,
max, max_pool2d) are kept away from their kinks.
"""

from __future__ import annotations

import numpy as np
import pytest
from gradcheck import check_grad
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import array_shapes, mutually_broadcastable_shapes

import tiegrad.ops as T
from tiegrad import EagerSession

SETTINGS = settings(max_examples=25, deadline=None)


def rnd(*shape: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(shape)


def positive(*shape: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).uniform(0.5, 2.0, shape)


def away_from_zero(*shape: int, seed: int = 0) -> np.ndarray:
    x = rnd(*shape, seed=seed)
    return np.where(np.abs(x) < 0.1, np.sign(x) * 0.1 + x, x)


def distinct(*shape: int, seed: int = 0) -> np.ndarray:
    """Values at least 0.1 apart (no ties, so max and max_pool2d are differentiable)."""
    n = int(np.prod(shape))
    return np.random.default_rng(seed).permutation(n).reshape(shape) * 0.1 - n * 0.05


# -- arithmetic --------------------------------------------------------------------------
BINARY = {"add": T.add, "sub": T.sub, "mul": T.mul, "div": T.div}


@SETTINGS
@given(
    op=st.sampled_from(sorted(BINARY)),
    shapes=mutually_broadcastable_shapes(num_shapes=2, min_dims=0, max_dims=3, max_side=3),
)
def test_binary_broadcasting(op, shapes):
    sa, sb = shapes.input_shapes
    b = positive(*sb, seed=1) if op == "div" else rnd(*sb, seed=1)
    out = check_grad(BINARY[op], [rnd(*sa), b])
    assert out[0].shape == sa and out[1].shape == sb


@pytest.mark.parametrize("op", sorted(BINARY))
@pytest.mark.parametrize("scalar", [2.5, 3, np.float64(0.5)])
def test_binary_with_a_number_on_either_side(op, scalar):
    x = positive(2, 3)
    check_grad(lambda a: BINARY[op](a, scalar), [x])
    check_grad(lambda a: BINARY[op](scalar, a), [x])


def test_binary_with_a_constant_array_operand():
    c = rnd(3, seed=2)
    for op in BINARY.values():
        check_grad(lambda a, op=op: op(a, c), [positive(2, 3)])


def test_the_same_ref_on_both_sides():
    for op in BINARY.values():
        check_grad(lambda a, op=op: op(a, a), [positive(2, 3)])


def test_neg():
    check_grad(T.neg, [rnd(2, 3)])


@pytest.mark.parametrize("exponent", [2, 3, 0.5, -1.0, 1, 0])
def test_pow(exponent):
    check_grad(lambda a: T.pow(a, exponent), [positive(2, 3)])


def test_pow_zero_exponent_has_zero_gradient_at_zero():
    s = EagerSession()
    x = s.leaf(np.array([0.0, 1.0, -2.0]))
    g = s.backward(T.sum(x**0))
    np.testing.assert_array_equal(g[x], np.zeros(3))


@pytest.mark.parametrize(
    "sa, sb",
    [
        ((3,), (3,)),
        ((3,), (3, 4)),
        ((2, 3), (3,)),
        ((2, 3), (3, 4)),
        ((1, 3), (3, 1)),
        ((2, 2, 3), (3, 4)),
        ((2, 1, 2, 3), (4, 3, 2)),
        ((3,), (2, 3, 4)),
        ((2, 2, 3), (3,)),
    ],
)
def test_matmul(sa, sb):
    check_grad(T.matmul, [rnd(*sa), rnd(*sb, seed=1)])


# -- reductions -------------------------------------------------------------------------
@st.composite
def shape_and_axis(draw):
    shape = draw(array_shapes(min_dims=1, max_dims=3, min_side=1, max_side=3))
    axes = draw(st.lists(st.integers(-len(shape), len(shape) - 1), max_size=len(shape)))
    axis = draw(st.sampled_from([None, tuple(axes), axes[0] if axes else 0]))
    return shape, axis, draw(st.booleans())


@SETTINGS
@given(case=shape_and_axis(), op=st.sampled_from(["sum", "mean", "max"]))
def test_reductions(case, op):
    shape, axis, keepdims = case
    if axis == ():
        axis = None
    fn = getattr(T, op)
    check_grad(lambda a: fn(a, axis=axis, keepdims=keepdims), [distinct(*shape)])


def test_max_splits_the_gradient_among_ties():
    s = EagerSession()
    x = s.leaf(np.array([1.0, 3.0, 3.0, 2.0]))
    g = s.backward(T.max(x))
    np.testing.assert_array_equal(g[x], [0.0, 0.5, 0.5, 0.0])


# -- shape ops --------------------------------------------------------------------------
def test_reshape_permute_transpose():
    x = rnd(2, 3, 4)
    check_grad(lambda a: T.reshape(a, (4, 6)), [x])
    check_grad(lambda a: T.reshape(a, (-1,)), [x])
    check_grad(lambda a: T.permute(a, (2, 0, 1)), [x])
    check_grad(lambda a: T.permute(a, (-1, 0, 1)), [x])
    check_grad(lambda a: T.transpose(a, 0, 2), [x])
    check_grad(lambda a: a.T, [x])
    check_grad(lambda a: a.reshape(6, 4).transpose(), [x])


@pytest.mark.parametrize(
    "index",
    [
        1,
        -1,
        (slice(None), 2),
        (slice(None, None, -1), slice(1, 3)),
        (Ellipsis, None, 0),
        np.array([0, 2, 0, 0]),
        (np.array([0, 1, 1]), np.array([2, 2, 2])),
        np.array([True, False, True]),
    ],
)
def test_getitem(index):
    check_grad(lambda a: a[index], [rnd(3, 4)])


def test_getitem_repeated_indices_accumulate():
    s = EagerSession()
    x = s.leaf(np.arange(3.0))
    g = s.backward(T.sum(x[np.array([2, 2, 0, 2])]))
    np.testing.assert_array_equal(g[x], [1.0, 0.0, 3.0])


def test_getitem_with_a_ref_index():
    idx = np.array([1, 1, 0])
    check_grad(lambda a: a[a.session.constant(idx)], [rnd(3, 2)])


@pytest.mark.parametrize("axis", [0, 1, -1])
def test_concat_and_stack(axis):
    a, b, c = rnd(2, 3), rnd(2, 3, seed=1), rnd(2, 3, seed=2)
    check_grad(lambda x, y, z: T.concat([x, y, z], axis=axis), [a, b, c])
    check_grad(lambda x, y, z: T.stack([x, y, z], axis=axis), [a, b, c])


def test_concat_unequal_sizes_and_a_constant():
    const = rnd(1, 3, seed=5)
    check_grad(lambda x, y: T.concat([x, const, y], axis=0), [rnd(2, 3), rnd(4, 3, seed=1)])


@SETTINGS
@given(shapes=mutually_broadcastable_shapes(num_shapes=3, min_dims=0, max_dims=3, max_side=3))
def test_where_broadcasting(shapes):
    sc, sa, sb = shapes.input_shapes
    cond = rnd(*sc, seed=7) > 0
    check_grad(lambda a, b: T.where(cond, a, b), [rnd(*sa), rnd(*sb, seed=1)])


# -- elementwise ------------------------------------------------------------------------
@pytest.mark.parametrize("op", ["exp", "tanh", "sigmoid", "gelu"])
def test_smooth_unary(op):
    check_grad(getattr(T, op), [rnd(3, 4) * 2])


def test_sigmoid_is_finite_for_large_inputs():
    s = EagerSession()
    x = s.leaf(np.array([-800.0, 0.0, 800.0]))
    y = T.sigmoid(x)
    g = s.backward(T.sum(y))
    np.testing.assert_allclose(y.value, [0.0, 0.5, 1.0])
    assert np.isfinite(g[x]).all()


@pytest.mark.parametrize("op", ["log", "sqrt"])
def test_positive_domain_unary(op):
    check_grad(getattr(T, op), [positive(3, 4)])


def test_relu():
    check_grad(T.relu, [away_from_zero(3, 4)])


def test_gelu_tanh_form():
    check_grad(lambda a: T.gelu(a, approximate="tanh"), [rnd(3, 4) * 2])


# -- softmax, normalization, linear -----------------------------------------------------
@pytest.mark.parametrize("axis", [0, 1, -1])
def test_softmax_and_log_softmax(axis):
    x = rnd(3, 4, 2) * 3
    check_grad(lambda a: T.softmax(a, axis=axis), [x])
    check_grad(lambda a: T.log_softmax(a, axis=axis), [x])


def test_softmax_size_one_axis():
    check_grad(lambda a: T.softmax(a, axis=1), [rnd(3, 1)])
    check_grad(lambda a: T.log_softmax(a, axis=1), [rnd(3, 1)])


def test_layer_norm_affine():
    check_grad(
        lambda a, w, b: T.layer_norm(a, w, b), [rnd(2, 3, 5), rnd(5, seed=1), rnd(5, seed=2)]
    )


def test_layer_norm_variants():
    check_grad(lambda a: T.layer_norm(a), [rnd(4, 6)])
    check_grad(lambda a: T.layer_norm(a, eps=1e-3), [rnd(6)])
    check_grad(lambda a, w: T.layer_norm(a, weight=w), [rnd(3, 4), rnd(4, seed=1)])
    check_grad(lambda a, b: T.layer_norm(a, bias=b), [rnd(3, 4), rnd(4, seed=1)])


@pytest.mark.parametrize("xshape", [(5,), (3, 5), (2, 3, 5), (1, 1, 5)])
def test_linear(xshape):
    check_grad(T.linear, [rnd(*xshape), rnd(4, 5, seed=1), rnd(4, seed=2)])
    check_grad(lambda x, w: T.linear(x, w), [rnd(*xshape), rnd(4, 5, seed=1)])


@pytest.mark.parametrize("xshape", [(5,), (3, 5), (2, 3, 5)])
def test_affine(xshape):
    check_grad(T.affine, [rnd(*xshape), rnd(5, 4, seed=1), rnd(4, seed=2)])
    check_grad(lambda x, w: T.affine(x, w), [rnd(*xshape), rnd(5, 4, seed=1)])


# -- losses -----------------------------------------------------------------------------
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("smoothing", [0.0, 0.2])
def test_cross_entropy(reduction, smoothing):
    targets = np.array([[1, -100, 2], [0, 3, 3]])
    check_grad(
        lambda a: T.cross_entropy(a, targets, reduction=reduction, label_smoothing=smoothing),
        [rnd(2, 3, 4) * 2],
    )


def test_cross_entropy_2d_and_custom_ignore_index():
    targets = np.array([0, 2, 2, 1, 0])
    check_grad(lambda a: T.cross_entropy(a, targets, ignore_index=2), [rnd(5, 3)])
    check_grad(lambda a: T.cross_entropy(a, targets, label_smoothing=1.0), [rnd(5, 3)])


@pytest.mark.parametrize("dtype", [np.uint8, np.int8, np.int16, np.int32])
@pytest.mark.parametrize("smoothing", [0.0, 0.1])
def test_cross_entropy_targets_of_small_integer_types_over_many_rows(dtype, smoothing):
    # 300 rows: more than an int8 or uint8 row index can count
    targets = np.random.default_rng(3).integers(0, 5, 300)
    grads = []
    for t in (targets, targets.astype(dtype)):
        s = EagerSession()
        x = s.leaf(rnd(300, 5))
        loss = T.cross_entropy(x, t, reduction="sum", label_smoothing=smoothing)
        grads.append((float(loss.value), s.backward(loss)[x]))
    assert grads[0][0] == grads[1][0]
    np.testing.assert_array_equal(grads[0][1], grads[1][1])


@pytest.mark.parametrize("device", [None, "torch:cpu"])
@pytest.mark.parametrize("shape", [(0, 4), (2, 0, 4)])
def test_cross_entropy_of_an_empty_batch(device, shape):
    # no position: a sum (and tiegrad's mean) of 0, no per-position loss, an empty gradient
    if device is not None:
        pytest.importorskip("torch")
    for reduction in ("mean", "sum", "none"):
        s = EagerSession(device=device)
        x = s.leaf(np.zeros(shape, np.float32))
        loss = T.cross_entropy(x, np.zeros(shape[:-1], np.int64), reduction=reduction)
        value = s.backend.to_numpy(loss.value)
        seed = np.ones(shape[:-1], np.float32) if reduction == "none" else None
        grad = s.backend.to_numpy(s.backward(loss, seed)[x])
        assert value.shape == (shape[:-1] if reduction == "none" else ())
        assert value.sum() == 0.0 and grad.shape == shape


def test_cross_entropy_all_ignored_is_zero_with_zero_gradient():
    s = EagerSession()
    x = s.leaf(rnd(2, 3))
    loss = T.cross_entropy(x, np.array([-100, -100]))
    g = s.backward(loss)
    assert float(loss.value) == 0.0
    np.testing.assert_array_equal(g[x], np.zeros((2, 3)))


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_mse_loss(reduction):
    check_grad(lambda p, t: T.mse_loss(p, t, reduction=reduction), [rnd(3, 2), rnd(3, 2, seed=1)])
    target = rnd(3, 2, seed=1)
    check_grad(lambda p: T.mse_loss(p, target, reduction=reduction), [rnd(3, 2)])


# -- embedding, dropout -----------------------------------------------------------------
def test_embedding_repeated_indices():
    idx = np.array([[1, 1, 3], [0, 1, 1]])
    check_grad(lambda w: T.embedding(w, idx), [rnd(4, 3)])


def test_embedding_more_ids_than_rows_accumulates():
    # more ids than rows takes the backend's sorted scatter-add path
    idx = np.random.default_rng(3).integers(0, 3, size=(4, 5))
    g = check_grad(lambda w: T.embedding(w, idx), [rnd(3, 2)])
    assert g[0].shape == (3, 2)
    s = EagerSession()
    w = s.leaf(np.zeros((3, 2)))
    counts = s.backward(T.sum(T.embedding(w, idx)))[w][:, 0]
    np.testing.assert_array_equal(counts, np.bincount(idx.ravel(), minlength=3))


def test_embedding_scalar_index_and_ref_indices():
    check_grad(lambda w: T.embedding(w, np.array(2)), [rnd(4, 3)])
    check_grad(lambda w: T.embedding(w, w.session.constant(np.array([3, 0, 3]))), [rnd(4, 3)])


def test_dropout_gradient_is_the_mask():
    g = check_grad(lambda a: T.dropout(a, 0.3), [rnd(6, 7)], seed=11)[0]
    s = EagerSession(seed=11)
    x = s.leaf(np.ones((6, 7)))
    y = T.dropout(x, 0.3)
    kept = y.value != 0
    assert 0 < kept.sum() < kept.size
    np.testing.assert_allclose(y.value[kept], 1 / 0.7)
    cot = np.random.default_rng(1234).standard_normal((6, 7))
    np.testing.assert_allclose(g, np.where(kept, cot / 0.7, 0.0))


# -- attention --------------------------------------------------------------------------
def _qkv(b=2, h=2, tq=3, tk=4, d=3, dv=2):
    return [rnd(b, h, tq, d), rnd(b, h, tk, d, seed=1), rnd(b, h, tk, dv, seed=2)]


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("padded", [False, True])
def test_attention(causal, padded):
    mask = np.array([[False, False, True, False], [False, True, False, True]]) if padded else None
    check_grad(
        lambda q, k, v: T.scaled_dot_product_attention(
            q, k, v, causal=causal, key_padding_mask=mask
        ),
        _qkv(),
    )


def test_attention_scale_3d_and_broadcast_heads():
    check_grad(
        lambda q, k, v: T.scaled_dot_product_attention(q, k, v, scale=0.3),
        [rnd(2, 3, 4), rnd(2, 5, 4, seed=1), rnd(2, 5, 2, seed=2)],
    )
    check_grad(
        lambda q, k, v: T.scaled_dot_product_attention(q, k, v, causal=True),
        [rnd(2, 3, 4, 2), rnd(2, 1, 4, 2, seed=1), rnd(2, 1, 4, 3, seed=2)],
    )


def test_attention_fully_masked_query_gives_zeros():
    # causal + padding of key 0: query 0 sees no key at all; the others see keys 1..i
    first_hidden = np.array([[True, False, False, False]])
    every_key_hidden = np.array([[True, True, True, True]])
    for m in (first_hidden, every_key_hidden):
        check_grad(
            lambda q, k, v, m=m: T.scaled_dot_product_attention(
                q, k, v, causal=True, key_padding_mask=m
            ),
            _qkv(b=1, h=1, tq=4, tk=4),
        )
    s = EagerSession()
    q, k, v = (s.leaf(a) for a in _qkv(b=1, h=1, tq=4, tk=4))
    out = T.scaled_dot_product_attention(q, k, v, causal=True, key_padding_mask=first_hidden)
    np.testing.assert_array_equal(out.value[0, 0, 0], np.zeros(2))
    assert np.abs(out.value[0, 0, 1:]).min() > 0
    g = s.backward(out, seed=np.ones((1, 1, 4, 2)))
    assert np.isfinite(g[q]).all() and np.isfinite(g[k]).all()
    np.testing.assert_array_equal(g[q][0, 0, 0], np.zeros(3))


# -- convolution and pooling ------------------------------------------------------------
@pytest.mark.parametrize("stride, padding", [(1, 0), (2, 1), (1, 2), (3, 0)])
def test_conv2d(stride, padding):
    check_grad(
        lambda x, w, b: T.conv2d(x, w, b, stride=stride, padding=padding),
        [rnd(2, 2, 5, 6), rnd(3, 2, 3, 2, seed=1), rnd(3, seed=2)],
    )


def test_conv2d_without_bias_and_1x1_kernel():
    check_grad(lambda x, w: T.conv2d(x, w), [rnd(1, 3, 4, 4), rnd(2, 3, 1, 1, seed=1)])
    check_grad(lambda x, w: T.conv2d(x, w, padding=1), [rnd(1, 1, 2, 3), rnd(1, 1, 3, 3, seed=1)])


@pytest.mark.parametrize("kernel, stride", [(2, None), (3, 1), (2, 3), (1, 1)])
def test_max_pool2d(kernel, stride):
    check_grad(lambda x: T.max_pool2d(x, kernel, stride), [distinct(2, 2, 5, 6)])


def test_array_inputs_with_ref_parameters():
    x = rnd(2, 5)
    check_grad(lambda w, b: T.layer_norm(x, w, b), [rnd(5, seed=1), rnd(5, seed=2)])
    check_grad(lambda w, b: T.linear(x, w, b), [rnd(3, 5, seed=1), rnd(3, seed=2)])
    img = rnd(1, 2, 4, 4)
    check_grad(lambda w: T.conv2d(img, w, padding=1), [rnd(3, 2, 3, 3, seed=1)])
    check_grad(lambda k, v: T.scaled_dot_product_attention(x, k, v), [rnd(3, 5), rnd(3, 2)])


# -- the ops of Llama-family decoders (issue 48) ------------------------------------------
@pytest.mark.parametrize("op", ["silu", "cos", "sin"])
def test_smooth_unary_of_decoders(op):
    check_grad(getattr(T, op), [rnd(3, 4) * 2])


def test_rsqrt():
    check_grad(T.rsqrt, [positive(3, 4)])


@pytest.mark.parametrize("offset", [0.0, 1.0])
@pytest.mark.parametrize("xshape", [(5,), (2, 3, 5)])
def test_rms_norm(offset, xshape):
    check_grad(lambda a, w: T.rms_norm(a, w, offset=offset), [rnd(*xshape), rnd(5, seed=1)])
    check_grad(lambda a: T.rms_norm(a, None, eps=1e-2, offset=offset), [rnd(*xshape)])


def test_rms_norm_with_only_the_weight_trainable():
    x = rnd(3, 4)
    check_grad(lambda w: T.rms_norm(x, w), [rnd(4, seed=1)])


@pytest.mark.parametrize(
    "xshape, tshape",
    [
        ((2, 3, 4, 6), (4, 6)),  # (B, H, T, D) with (T, R): every feature rotates
        ((2, 3, 4, 6), (4, 4)),  # partial rotary: the last 2 features pass through
        ((2, 3, 4, 6), (2, 1, 4, 2)),  # per-batch tables, as transformers' (B, 1, T, R)
        ((4, 2), (1, 2)),
    ],
)
def test_rotary(xshape, tshape):
    c, s = rnd(*tshape, seed=1), rnd(*tshape, seed=2)
    check_grad(lambda x: T.rotary(x, c, s), [rnd(*xshape)])
    check_grad(T.rotary, [rnd(*xshape), c, s])  # tables that take a gradient


@pytest.mark.parametrize("causal", [False, True, "bottom_right"])
@pytest.mark.parametrize("padded", [False, True])
def test_grouped_query_attention(causal, padded):
    # 6 query heads over 2 key/value heads, 3 queries at the end of 5 keys (a KV cache)
    mask = np.array([[False, True, False, False, False], [False] * 4 + [True]]) if padded else None
    check_grad(
        lambda q, k, v: T.scaled_dot_product_attention(
            q, k, v, causal=causal, key_padding_mask=mask
        ),
        [rnd(2, 6, 3, 4), rnd(2, 2, 5, 4, seed=1), rnd(2, 2, 5, 3, seed=2)],
    )


def test_bottom_right_causal_attention_with_more_queries_than_keys():
    # query i sees keys j <= i - 2: the first two see none (zeros, no gradient)
    check_grad(
        lambda q, k, v: T.scaled_dot_product_attention(q, k, v, causal="bottom_right"),
        [rnd(1, 2, 5, 3), rnd(1, 2, 3, 3, seed=1), rnd(1, 2, 3, 2, seed=2)],
    )


def test_unsqueeze_squeeze_expand():
    x = rnd(3, 1, 2)
    check_grad(lambda a: T.unsqueeze(a, 0), [x])
    check_grad(lambda a: a.unsqueeze(-1), [x])
    check_grad(lambda a: T.squeeze(a, 1), [x])
    check_grad(lambda a: a.squeeze(), [x])
    check_grad(lambda a: T.expand(a, (2, 3, 4, 2)), [x])
    check_grad(lambda a: a.expand(3, 5, -1), [x])


@pytest.mark.parametrize("repeats, axis", [(2, 1), (3, -1), (0, 0), ([2, 0, 1], 0), (2, None)])
def test_repeat_interleave(repeats, axis):
    check_grad(lambda a: T.repeat_interleave(a, repeats, axis), [rnd(3, 4)])


def test_chunk_and_split_pieces_each_take_their_gradient():
    x = rnd(5, 7)

    def joined(pieces):
        return T.concat([p * (i + 1.0) for i, p in enumerate(pieces)], axis=1)

    check_grad(lambda a: joined(T.chunk(a, 3, axis=1)), [x])
    check_grad(lambda a: joined(a.split(2, 1)), [x])
    check_grad(lambda a: joined(T.split(a, [4, 0, 3], axis=-1)), [x])
