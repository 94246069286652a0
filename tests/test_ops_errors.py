"""Bad op input: each op raises a TiegradError naming the op and the offending shapes or
values, and records nothing on the tape (C6)."""

from __future__ import annotations

import re

import numpy as np
import pytest

import tiegrad.ops as T
from tiegrad import (
    ConfigError,
    DTypeError,
    EagerSession,
    HyperparameterError,
    IndexRangeError,
    ShapeError,
    TapeError,
    TiegradError,
)


@pytest.fixture
def s():
    return EagerSession()


def leaf(s, *shape):
    return s.leaf(np.ones(shape, dtype=np.float32))


def raises_and_records_nothing(s, exc, match, fn):
    """``fn()`` raises ``exc`` matching ``match`` and leaves the tape and generator unchanged."""
    n = len(s)
    state = s.rng.bit_generator.state
    with pytest.raises(exc, match=match) as info:
        fn()
    assert isinstance(info.value, TiegradError)
    assert len(s) == n, f"a failing op recorded {len(s) - n} node(s)"
    assert s.rng.bit_generator.state == state


@pytest.mark.parametrize("op", ["add", "sub", "mul", "div"])
def test_binary_shapes_that_do_not_broadcast(s, op):
    x, y = leaf(s, 2, 3), leaf(s, 4)
    fn = getattr(T, op)
    msg = rf"{op}: shapes \(2, 3\) and \(4,\) do not broadcast"
    raises_and_records_nothing(s, ShapeError, msg, lambda: fn(x, y))
    raises_and_records_nothing(s, ShapeError, msg, lambda: fn(x, np.ones(4)))
    raises_and_records_nothing(
        s, ShapeError, rf"{op}: shapes \(4,\) and \(2, 3\)", lambda: fn(np.ones(4), x)
    )


def test_matmul_misaligned(s):
    a, b = leaf(s, 2, 3), leaf(s, 2, 3)
    raises_and_records_nothing(
        s, ShapeError, r"matmul: shapes \(2, 3\) and \(2, 3\) are not aligned", lambda: a @ b
    )
    raises_and_records_nothing(
        s, ShapeError, r"matmul: shapes \(2, 3\) and \(4,\)", lambda: T.matmul(a, np.ones(4))
    )
    c, d = leaf(s, 2, 2, 3), leaf(s, 3, 3, 4)
    raises_and_records_nothing(
        s, ShapeError, r"matmul: batch axes of shapes \(2, 2, 3\) and \(3, 3, 4\)", lambda: c @ d
    )
    scalar = leaf(s)
    raises_and_records_nothing(s, ShapeError, "matmul", lambda: T.matmul(scalar, a))


def test_pow_needs_a_number(s):
    x = leaf(s, 2)
    raises_and_records_nothing(
        s, ShapeError, "pow: the exponent must be a Python number", lambda: x ** np.ones(2)
    )
    raises_and_records_nothing(
        s, DTypeError, "pow: the exponent must be a Python number, got TensorRef", lambda: x**x
    )


def test_axes_out_of_range(s):
    x = leaf(s, 2, 3)
    for fn in (T.sum, T.mean, T.max, T.softmax, T.log_softmax):
        name = fn.__name__
        raises_and_records_nothing(
            s,
            ShapeError,
            rf"{name}: axis 2 is out of range for an array of rank 2",
            lambda fn=fn: fn(x, axis=2),
        )


def test_reshape_permute_transpose(s):
    x = leaf(s, 2, 3)
    raises_and_records_nothing(
        s, ShapeError, r"reshape: cannot reshape \(2, 3\) to \(4, 2\)", lambda: x.reshape(4, 2)
    )
    for axes in [(0,), (0, 0), (0, 2), (1, 0, 2)]:
        raises_and_records_nothing(
            s,
            ShapeError,
            "permute: axes .* are not a permutation of 2 axes",
            lambda axes=axes: T.permute(x, axes),
        )
    raises_and_records_nothing(
        s, ShapeError, "transpose: axis 5 is out of range", lambda: T.transpose(x, 0, 5)
    )


def test_getitem_out_of_range(s):
    x = leaf(s, 2, 3)
    raises_and_records_nothing(
        s, IndexRangeError, r"getitem: index .* is invalid for shape \(2, 3\)", lambda: x[5]
    )
    raises_and_records_nothing(s, IndexError, "getitem", lambda: x[np.array([0, 3])])


def test_concat_and_stack(s):
    a, b = leaf(s, 2, 3), leaf(s, 2, 4)
    raises_and_records_nothing(
        s,
        ShapeError,
        r"concat: shapes \[\(2, 3\), \(2, 4\), \(2, 4\)\] cannot be joined on axis 0",
        lambda: T.concat([a, b, np.ones((2, 4))], axis=0),
    )
    raises_and_records_nothing(s, ShapeError, "concat", lambda: T.concat([a, a], axis=2))
    raises_and_records_nothing(
        s,
        ShapeError,
        r"stack: all shapes must be equal, got \[\(2, 3\), \(2, 4\)\]",
        lambda: T.stack([a, np.ones((2, 4))]),
    )
    raises_and_records_nothing(
        s, ShapeError, "stack: axis 3 is out of range", lambda: T.stack([a, a], axis=3)
    )


def test_where(s):
    a = leaf(s, 2, 3)
    raises_and_records_nothing(
        s,
        ShapeError,
        r"where: shapes \(2, 3\) and \(2,\) do not broadcast",
        lambda: T.where(np.ones((2, 3)) > 0, a, np.ones(2)),
    )


def test_layer_norm(s):
    x = leaf(s, 2, 4)
    raises_and_records_nothing(
        s,
        ShapeError,
        r"layer_norm: weight has shape \(3,\), expected \(4,\)",
        lambda: T.layer_norm(x, np.ones(3)),
    )
    raises_and_records_nothing(
        s,
        ShapeError,
        r"layer_norm: bias has shape \(4, 1\), expected \(4,\)",
        lambda: T.layer_norm(x, np.ones(4), np.ones((4, 1))),
    )
    raises_and_records_nothing(
        s, HyperparameterError, "layer_norm: eps must be > 0", lambda: T.layer_norm(x, eps=0.0)
    )


def test_linear(s):
    x = leaf(s, 2, 4)
    raises_and_records_nothing(
        s,
        ShapeError,
        r"linear: input of shape \(2, 4\) does not fit weight of shape \(3, 5\)",
        lambda: T.linear(x, np.ones((3, 5))),
    )
    raises_and_records_nothing(
        s,
        ShapeError,
        r"linear: bias has shape \(4,\), expected \(3,\)",
        lambda: T.linear(x, np.ones((3, 4)), np.ones(4)),
    )


def test_cross_entropy(s):
    x = leaf(s, 4, 3)
    good = np.array([0, 1, 2, 0])
    raises_and_records_nothing(
        s,
        ShapeError,
        r"cross_entropy: targets of shape \(3,\) do not fit logits of shape \(4, 3\)",
        lambda: T.cross_entropy(x, good[:3]),
    )
    raises_and_records_nothing(
        s,
        DTypeError,
        "cross_entropy: indices must have an integer dtype, got float64",
        lambda: T.cross_entropy(x, good.astype(float)),
    )
    for odd in (
        np.array(["a", "b", "c", "a"]),
        np.array([0, 1, 2, 0], dtype=object),
        np.array([f"2020-01-0{d}" for d in (1, 2, 3, 1)], dtype="datetime64[D]"),
        np.array([True, False, True, True]),
    ):  # no integer dtype: the op's error, not one from deep inside NumPy
        raises_and_records_nothing(
            s,
            DTypeError,
            re.escape(f"cross_entropy: indices must have an integer dtype, got {odd.dtype}"),
            lambda odd=odd: T.cross_entropy(x, odd),
        )
    raises_and_records_nothing(
        s,
        IndexRangeError,
        r"cross_entropy: targets must lie in \[0, 3\).*got values in \[0, 3\]",
        lambda: T.cross_entropy(x, np.array([0, 1, 3, 0])),
    )
    raises_and_records_nothing(
        s,
        IndexRangeError,
        r"got values in \[-1, 2\]",
        lambda: T.cross_entropy(x, np.array([0, -1, 2, 0])),
    )
    raises_and_records_nothing(
        s,
        HyperparameterError,
        "cross_entropy: reduction must be 'mean', 'sum' or 'none'",
        lambda: T.cross_entropy(x, good, reduction="avg"),
    )
    raises_and_records_nothing(
        s,
        HyperparameterError,
        r"label_smoothing must be in \[0, 1\], got 1.5",
        lambda: T.cross_entropy(x, good, label_smoothing=1.5),
    )


def test_mse_loss(s):
    x = leaf(s, 2, 3)
    raises_and_records_nothing(
        s,
        ShapeError,
        r"mse_loss: pred has shape \(2, 3\) but target has shape \(3,\)",
        lambda: T.mse_loss(x, np.ones(3)),
    )
    raises_and_records_nothing(
        s, HyperparameterError, "mse_loss: reduction", lambda: T.mse_loss(x, x, reduction="x")
    )


def test_embedding(s):
    w, flat = leaf(s, 5, 2), leaf(s, 5)
    raises_and_records_nothing(
        s,
        IndexRangeError,
        r"embedding: indices must lie in \[0, 5\), got values in \[0, 5\]",
        lambda: T.embedding(w, np.array([0, 5])),
    )
    raises_and_records_nothing(
        s, IndexRangeError, r"got values in \[-1, 1\]", lambda: T.embedding(w, np.array([-1, 1]))
    )
    raises_and_records_nothing(
        s,
        DTypeError,
        "embedding: indices must have an integer dtype",
        lambda: T.embedding(w, np.array([0.0])),
    )
    raises_and_records_nothing(
        s,
        ShapeError,
        r"embedding: weight must have shape \(V, D\), got \(5,\)",
        lambda: T.embedding(flat, np.array([0])),
    )


def test_dropout_probability_and_no_draw_on_error(s):
    x = leaf(s, 3)
    for p in (-0.1, 1.5, float("nan")):
        raises_and_records_nothing(
            s,
            HyperparameterError,
            r"dropout: p must be (in \[0, 1\]|finite)",
            lambda p=p: T.dropout(x, p),
        )


def test_dropout_identity_cases_record_nothing(s):
    x = leaf(s, 3)
    n = len(s)
    assert T.dropout(x, 0.0) is x and T.dropout(x, 0.5, training=False) is x
    assert len(s) == n
    np.testing.assert_array_equal(T.dropout(x, 1.0).value, np.zeros(3))


def test_attention(s):
    q, k, k3 = leaf(s, 2, 3, 4), leaf(s, 2, 5, 4), leaf(s, 3, 5, 4)
    raises_and_records_nothing(
        s,
        ShapeError,
        r"scaled_dot_product_attention: q \(2, 3, 4\), k \(2, 5, 4\) and v \(2, 4, 4\) do not fit",
        lambda: T.scaled_dot_product_attention(q, k, np.ones((2, 4, 4))),
    )
    raises_and_records_nothing(
        s,
        ShapeError,
        "leading axes of q",
        lambda: T.scaled_dot_product_attention(q, k3, np.ones((3, 5, 4))),
    )
    raises_and_records_nothing(
        s,
        ShapeError,
        r"key_padding_mask has shape \(2, 4\), expected \(B, Tk\) = \(2, 5\)",
        lambda: T.scaled_dot_product_attention(q, k, k, key_padding_mask=np.ones((2, 4), bool)),
    )
    raises_and_records_nothing(
        s,
        DTypeError,
        "key_padding_mask must be bool, got float",
        lambda: T.scaled_dot_product_attention(q, k, k, key_padding_mask=np.ones((2, 5))),
    )


def test_conv2d_and_max_pool2d(s):
    x = leaf(s, 1, 3, 5, 5)
    raises_and_records_nothing(
        s,
        ShapeError,
        r"conv2d: input of shape \(1, 3, 5, 5\) does not fit weight of shape \(2, 4, 3, 3\)",
        lambda: T.conv2d(x, np.ones((2, 4, 3, 3))),
    )
    raises_and_records_nothing(
        s,
        ShapeError,
        r"conv2d: padded input \(5, 5\) is smaller than the kernel \(6, 6\)",
        lambda: T.conv2d(x, np.ones((2, 3, 6, 6))),
    )
    raises_and_records_nothing(
        s,
        ShapeError,
        r"conv2d: bias has shape \(3,\), expected \(2,\)",
        lambda: T.conv2d(x, np.ones((2, 3, 3, 3)), np.ones(3)),
    )
    for kw in ({"stride": 0}, {"padding": -1}, {"stride": 1.5}):
        raises_and_records_nothing(
            s,
            HyperparameterError,
            "conv2d: (stride|padding) must be (an integer|>= [01])",
            lambda kw=kw: T.conv2d(x, np.ones((2, 3, 3, 3)), **kw),
        )
    raises_and_records_nothing(
        s,
        ShapeError,
        r"max_pool2d: input of shape \(1, 3, 5, 5\) does not fit kernel_size 6",
        lambda: T.max_pool2d(x, 6),
    )
    raises_and_records_nothing(
        s,
        HyperparameterError,
        "max_pool2d: stride must be >= 1",
        lambda: T.max_pool2d(x, 2, 0),
    )


def test_gelu_mode(s):
    x = leaf(s, 2)
    raises_and_records_nothing(
        s,
        HyperparameterError,
        "gelu: approximate must be 'none' or 'tanh', got 'fast'",
        lambda: T.gelu(x, approximate="fast"),
    )


def test_ops_reject_foreign_and_stale_refs(s):
    other = EagerSession()
    x, y = leaf(s, 2, 2), other.leaf(np.ones((2, 2)))
    for fn in (
        lambda: T.linear(x, y),
        lambda: T.layer_norm(x, y[0]),
        lambda: T.scaled_dot_product_attention(x, x, y),
        lambda: T.where(np.ones(2) > 0, x, y),
        lambda: T.concat([x, y]),
        lambda: T.cross_entropy(x, other.constant(np.array([0, 1]))),
        lambda: T.embedding(x, other.constant(np.array([0, 1]))),
        lambda: x[other.constant(np.array([0]))],
    ):
        raises_and_records_nothing(s, TapeError, "belongs to another session", fn)
    z = leaf(s, 2)
    s.reset()
    raises_and_records_nothing(s, TapeError, "stale", lambda: T.softmax(z))


def test_max_over_an_axis_with_no_element_names_the_op_and_the_shape(s):
    x = s.leaf(np.ones((0, 3)))
    assert T.max(x, axis=1).shape == (0,)
    with pytest.raises(ShapeError, match=re.escape("max: axis 0 of the input's shape (0, 3)")):
        T.max(x, axis=0)


# -- the ops of Llama-family decoders (issue 48) ------------------------------------------
def test_rms_norm(s):
    x, scalar = leaf(s, 2, 4), leaf(s)
    ints = s.constant(np.ones((2, 4), np.int64))
    raises_and_records_nothing(
        s,
        ShapeError,
        r"rms_norm: weight has shape \(3,\), expected \(4,\) for input of shape \(2, 4\)",
        lambda: T.rms_norm(x, np.ones(3)),
    )
    raises_and_records_nothing(
        s,
        DTypeError,
        "rms_norm: input has dtype int64, expected a floating dtype",
        lambda: T.rms_norm(ints, np.ones(4)),
    )
    raises_and_records_nothing(
        s,
        DTypeError,
        "rms_norm: weight has dtype int32, expected a floating dtype",
        lambda: T.rms_norm(x, np.ones(4, np.int32)),
    )
    raises_and_records_nothing(
        s, HyperparameterError, "rms_norm: eps must be > 0", lambda: T.rms_norm(x, eps=0.0)
    )
    raises_and_records_nothing(
        s,
        HyperparameterError,
        "rms_norm: offset must be finite",
        lambda: T.rms_norm(x, offset=float("nan")),
    )
    raises_and_records_nothing(
        s, ShapeError, r"rms_norm: input must have at least one axis", lambda: T.rms_norm(scalar)
    )


def test_rotary(s):
    x, vector = leaf(s, 2, 3, 4, 6), leaf(s, 6)
    table = np.ones((4, 6), np.float32)
    for cos, what in [
        (np.ones((4, 5)), r"\(4, 5\)"),  # R odd
        (np.ones((4, 8)), r"\(4, 8\)"),  # R > D
        (np.ones((3, 6)), r"\(3, 6\)"),  # another T
        (np.ones((5, 2, 3, 4, 6)), r"\(5, 2, 3, 4, 6\)"),  # would enlarge x
    ]:
        raises_and_records_nothing(
            s,
            ShapeError,
            rf"rotary: cos and sin have shape {what}, expected \(T, R\) .* x of shape "
            r"\(2, 3, 4, 6\)",
            lambda cos=cos: T.rotary(x, cos, cos),
        )
    raises_and_records_nothing(
        s,
        ShapeError,
        r"rotary: sin has shape \(4, 4\), expected cos's shape \(4, 6\)",
        lambda: T.rotary(x, table, np.ones((4, 4))),
    )
    raises_and_records_nothing(
        s,
        DTypeError,
        "rotary: sin has dtype int64, expected a floating dtype",
        lambda: T.rotary(x, table, np.ones((4, 6), np.int64)),
    )
    raises_and_records_nothing(
        s,
        ShapeError,
        r"rotary: x has shape \(6,\), expected \(\.\.\., T, D\)",
        lambda: T.rotary(vector, table, table),
    )


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"scaling": {"rope_type": "yarn", "factor": 2.0}}, "rope type 'yarn' is not supported"),
        ({"scaling": {"rope_type": "linear"}}, "rope type 'linear' needs 'factor'"),
        ({"scaling": {"rope_type": "linear", "factor": 0}}, "factor must be a finite number > 0"),
        (
            {"scaling": {"rope_type": "linear", "factor": 2.0, "beta_fast": 32, "mscale": 1}},
            "unknown key.*'beta_fast', 'mscale'",
        ),
        (
            {
                "scaling": {
                    **{"rope_type": "llama3", "factor": 8.0},
                    "low_freq_factor": 4.0,
                    "high_freq_factor": 1.0,
                    "original_max_position_embeddings": 64,
                }
            },
            "low_freq_factor < high_freq_factor, got 4.0 and 1.0",
        ),
        ({"scaling": {"rope_type": "default", "rope_theta": 500.0}}, "rope_theta=500.0"),
        ({"partial_rotary_factor": 0.5}, "rotates 7 features, expected an even number"),
        ({"partial_rotary_factor": 1.5}, "partial_rotary_factor=1.5"),
        ({"dim": 0}, "dim must be an integer > 0, got 0"),
        ({"scaling": ["linear"]}, "scaling must be a dict or None, got list"),
    ],
)
def test_rope_tables_refuse_configs_they_cannot_follow(kwargs, match):
    args = {"positions": np.arange(4), "dim": 14, **kwargs}
    with pytest.raises(ConfigError, match=match):
        T.rope_tables(**args)


def test_rope_tables_need_integer_positions():
    with pytest.raises(DTypeError, match="rope_tables: positions must have an integer dtype"):
        T.rope_tables(np.arange(4.0), 8)


def test_grouped_query_attention_and_causal_modes(s):
    q, k, qkv = leaf(s, 2, 6, 3, 4), leaf(s, 2, 4, 5, 4), leaf(s, 1, 2, 6)
    raises_and_records_nothing(
        s,
        ShapeError,
        r"leading axes of q \(2, 6, 3, 4\), k \(2, 4, 5, 4\) and v \(2, 4, 5, 4\) do not "
        r"broadcast \(nor are they grouped-query heads",
        lambda: T.scaled_dot_product_attention(q, k, k),
    )
    raises_and_records_nothing(
        s,
        HyperparameterError,
        "scaled_dot_product_attention: causal must be False, True, 'top_left' or "
        "'bottom_right', got 'lower_right'",
        lambda: T.scaled_dot_product_attention(q, q, q, causal="lower_right"),
    )
    raises_and_records_nothing(
        s,
        HyperparameterError,
        "self_attention: causal must be",
        lambda: T.self_attention(qkv, 1, causal=1),
    )


def test_shape_ops_of_decoders(s):
    x = leaf(s, 2, 1, 3)
    raises_and_records_nothing(
        s,
        ShapeError,
        r"unsqueeze: axis 4 is out of range for an array of rank 3, expected an integer in "
        r"\[-4, 3\]",
        lambda: x.unsqueeze(4),
    )
    raises_and_records_nothing(
        s,
        ShapeError,
        r"squeeze: axis 2 of shape \(2, 1, 3\) has size 3, expected 1",
        lambda: x.squeeze((1, 2)),
    )
    raises_and_records_nothing(
        s,
        ShapeError,
        r"expand: cannot expand shape \(2, 1, 3\) to \(2, 4, 4\)",
        lambda: x.expand(2, 4, 4),
    )
    raises_and_records_nothing(
        s,
        ShapeError,
        r"expand: cannot expand shape \(2, 1, 3\) to \(-1, 2, 1, 3\)",
        lambda: x.expand(-1, 2, 1, 3),
    )
    raises_and_records_nothing(
        s,
        ShapeError,
        r"repeat_interleave: 2 repeats for axis 2 of size 3 in shape \(2, 1, 3\), expected 3",
        lambda: x.repeat_interleave([1, 2], 2),
    )
    raises_and_records_nothing(
        s,
        HyperparameterError,
        "repeat_interleave: repeats must be an integer >= 0, got -1",
        lambda: x.repeat_interleave(-1, 0),
    )
    raises_and_records_nothing(
        s,
        HyperparameterError,
        "chunk: chunks must be an integer >= 1, got 0",
        lambda: x.chunk(0, 2),
    )
    raises_and_records_nothing(
        s,
        ShapeError,
        r"split: sizes add up to 4, expected the size 3 of axis 2 of shape \(2, 1, 3\)",
        lambda: x.split([1, 3], 2),
    )
    raises_and_records_nothing(
        s, ShapeError, "split: axis 3 is out of range", lambda: x.split(1, 3)
    )
