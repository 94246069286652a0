"""Every op of ``tiegrad.ops`` on the torch device backend equals the NumPy backend.

Each case records the same computation on a host session and on a device session
(``TIEGRAD_TEST_DEVICE``, default ``torch:cpu``) with float64 leaves, pulls the same
random cotangent back and compares the forward value and every input's gradient.
Device gradients are torch tensors on the device (C7).
"""

from __future__ import annotations

import os

import numpy as np
import pytest

import tiegrad
from tiegrad import EagerSession, ops
from tiegrad.backend import NUMPY, device_backend

torch = pytest.importorskip("torch")

DEVICE = os.environ.get("TIEGRAD_TEST_DEVICE", "torch:cpu")


def _r(*shape: int, seed: int = 0, positive: bool = False) -> np.ndarray:
    a = np.random.default_rng(seed + 7 * len(shape) + sum(shape)).standard_normal(shape)
    return np.abs(a) + 0.5 if positive else a


IDX = np.array([2, 0, 2, 1, 2])
MASK = np.array([[True, False, True, False], [False, False, True, True], [True, True, True, False]])
TARGETS = np.array([[1, 0, 3], [2, -100, 1]])
PADDING = np.array([[False, False, True, False], [False, True, False, False]])

# name -> (fn of leaf refs, float64 inputs). Constants (NumPy arrays, numbers) are passed
# as they are, so the device session uploads them itself.
CASES = {
    "add": (lambda a, b: ops.add(a, b), [_r(3, 4), _r(4)]),
    "add:scalar": (lambda a: ops.add(2.5, a) + 1.0, [_r(3, 4)]),
    "add:constant": (lambda a: a + _r(1, 4, seed=9), [_r(3, 4)]),
    "sub": (lambda a, b: ops.sub(a, b), [_r(3, 1), _r(1, 4)]),
    "sub:scalar": (lambda a: 3.0 - a - 1.0, [_r(2, 3)]),
    "mul": (lambda a, b: ops.mul(a, b), [_r(2, 3, 4), _r(3, 1)]),
    "mul:scalar": (lambda a: 0.5 * a * 3.0, [_r(5)]),
    "div": (lambda a, b: ops.div(a, b), [_r(3, 4), _r(4, positive=True)]),
    "div:scalar": (lambda a: 2.0 / a + a / 4.0, [_r(3, positive=True)]),
    "neg": (lambda a: ops.neg(a), [_r(2, 2)]),
    "pow": (lambda a: ops.pow(a, 2) + ops.pow(a, 3) + ops.pow(a, 0.5), [_r(4, positive=True)]),
    "matmul": (lambda a, b: ops.matmul(a, b), [_r(3, 4), _r(4, 5)]),
    "matmul:vector": (
        lambda a, b, c: ops.concat([ops.matmul(a, b), ops.matmul(b, c)]),
        [_r(4), _r(4, 3), _r(3)],
    ),
    "matmul:batched": (lambda a, b: ops.matmul(a, b), [_r(2, 1, 3, 4), _r(3, 4, 2)]),
    "exp": (lambda a: ops.exp(a), [_r(3, 3)]),
    "log": (lambda a: ops.log(a), [_r(3, 3, positive=True)]),
    "sqrt": (lambda a: ops.sqrt(a), [_r(3, 3, positive=True)]),
    "tanh": (lambda a: ops.tanh(a), [_r(3, 3)]),
    "sigmoid": (lambda a: ops.sigmoid(a), [_r(3, 3) * 10]),
    "relu": (lambda a: ops.relu(a), [_r(4, 4)]),
    "gelu": (lambda a: ops.gelu(a), [_r(4, 4) * 3]),
    "gelu:tanh": (lambda a: ops.gelu(a, approximate="tanh"), [_r(4, 4) * 3]),
    "sum": (
        lambda a: ops.sum(a, axis=(0, 2), keepdims=True) + ops.sum(a, axis=1)[:, None, :],
        [_r(2, 3, 4)],
    ),
    "sum:all": (lambda a: ops.sum(a), [_r(2, 3)]),
    "mean": (lambda a: ops.mean(a, axis=-1) + ops.mean(a), [_r(3, 5)]),
    "max": (lambda a: ops.max(a, axis=1) + ops.max(a, axis=0, keepdims=True)[0, 0], [_r(3, 4)]),
    "max:ties": (lambda a: ops.max(a * 0.0 + 1.0, axis=1) * a[:, 0], [_r(3, 4)]),
    "concat": (lambda a, b: ops.concat([a, b, a], axis=1), [_r(2, 3), _r(2, 1)]),
    "stack": (lambda a, b: ops.stack([a, b], axis=-1), [_r(2, 3), _r(2, 3)]),
    "getitem:basic": (lambda a: a[1:, ::2] + a[0, None, :2], [_r(3, 4)]),
    "getitem:repeats": (lambda a: a[IDX], [_r(3, 4)]),
    "getitem:pairs": (lambda a: a[np.array([0, 2, 0]), np.array([1, 1, 1])], [_r(3, 4)]),
    "getitem:mixed": (lambda a: a[:, np.array([3, 3, 0])], [_r(3, 4)]),
    "getitem:mask": (lambda a: a[MASK], [_r(3, 4)]),
    "permute": (lambda a: ops.permute(a, (2, 0, 1)), [_r(2, 3, 4)]),
    "transpose": (lambda a: ops.transpose(a) @ a, [_r(3, 2)]),
    "reshape": (lambda a: ops.reshape(a, (4, -1)), [_r(2, 3, 2)]),
    "where": (lambda a, b: ops.where(MASK, a, b), [_r(3, 4), _r(4)]),
    "softmax": (lambda a: ops.softmax(a, axis=0), [_r(3, 4)]),
    "log_softmax": (lambda a: ops.log_softmax(a), [_r(3, 4)]),
    "scaled_dot_product_attention:causal": (
        lambda q, k, v: ops.scaled_dot_product_attention(q, k, v, causal=True),
        [_r(2, 4, 3), _r(2, 4, 3, seed=1), _r(2, 4, 5)],
    ),
    "scaled_dot_product_attention:causal-wide": (
        lambda q, k, v: ops.scaled_dot_product_attention(q, k, v, causal=True, scale=0.3),
        [_r(2, 3, 3), _r(2, 5, 3, seed=1), _r(2, 5, 2)],
    ),
    "scaled_dot_product_attention:padding": (
        lambda q, k, v: ops.scaled_dot_product_attention(q, k, v, key_padding_mask=PADDING),
        [_r(2, 3, 3), _r(2, 4, 3, seed=1), _r(2, 4, 2)],
    ),
    "self_attention:causal": (
        lambda x: ops.self_attention(x, 2, causal=True),
        [_r(2, 4, 12)],
    ),
    "self_attention:padding": (
        lambda x: ops.self_attention(x, 3, key_padding_mask=PADDING),
        [_r(2, 4, 18)],
    ),
    # 64 keys: batched products on torch's CPU (torch_attention.in_cache), flash elsewhere
    "scaled_dot_product_attention:products": (
        lambda q, k, v: ops.scaled_dot_product_attention(q, k, v, scale=0.4),
        [_r(2, 3, 5), _r(2, 64, 5, seed=1), _r(2, 64, 3)],
    ),
    "self_attention:causal-products": (
        lambda x: ops.self_attention(x, 2, causal=True),
        [_r(2, 64, 12)],
    ),
    "conv2d": (
        lambda x, w, b: ops.conv2d(x, w, b, stride=2, padding=1),
        [_r(2, 2, 5, 5), _r(3, 2, 3, 3), _r(3)],
    ),
    "max_pool2d": (lambda x: ops.max_pool2d(x, 2), [_r(1, 2, 4, 4)]),
    "dropout": (lambda a: ops.dropout(a, 0.4), [_r(6, 5)]),
    "embedding": (lambda w: ops.embedding(w, np.array([[3, 0], [3, 3]])), [_r(4, 3)]),
    "linear": (lambda x, w, b: ops.linear(x, w, b), [_r(2, 3, 4), _r(5, 4), _r(5)]),
    "affine": (lambda x, w, b: ops.affine(x, w, b), [_r(2, 3, 4), _r(4, 5), _r(5)]),
    "cross_entropy": (
        lambda z: ops.cross_entropy(z, TARGETS, label_smoothing=0.1),
        [_r(2, 3, 4)],
    ),
    "cross_entropy:fused": (  # no smoothing: the backend's log-softmax and NLL kernels
        lambda z: ops.concat(
            [
                ops.reshape(ops.cross_entropy(z, TARGETS), (1,)),
                ops.reshape(ops.cross_entropy(z, TARGETS, reduction="sum"), (1,)),
                ops.reshape(ops.cross_entropy(z, TARGETS, reduction="none"), (6,)),
            ]
        ),
        [_r(2, 3, 4)],
    ),
    "cross_entropy:ignored-class": (  # ignore_index among the targets' range: a masked count
        lambda z: ops.concat(
            [
                ops.reshape(ops.cross_entropy(z, TARGETS % 4, ignore_index=1), (1,)),
                ops.reshape(
                    ops.cross_entropy(z, TARGETS % 4, reduction="sum", ignore_index=0), (1,)
                ),
            ]
        ),
        [_r(2, 3, 4)],
    ),
    "linear_cross_entropy": (  # the head and its loss fused (issue 50)
        lambda h, w: ops.concat(
            [
                ops.reshape(ops.linear_cross_entropy(h, w, TARGETS, label_smoothing=0.1), (1,)),
                ops.reshape(
                    ops.linear_cross_entropy(h, w, TARGETS % 4, reduction="none", ignore_index=1),
                    (6,),
                ),
            ]
        ),
        [_r(2, 3, 5), _r(4, 5, seed=1)],
    ),
    "cross_entropy:all-ignored": (
        lambda z: ops.cross_entropy(z, np.full((2, 3), -100)),
        [_r(2, 3, 4)],
    ),
    "mse_loss": (lambda a, b: ops.mse_loss(a, b, reduction="sum"), [_r(3, 2), _r(3, 2, seed=4)]),
    "layer_norm": (lambda x, w, b: ops.layer_norm(x, w, b), [_r(2, 3, 6), _r(6), _r(6)]),
    "layer_norm:plain": (lambda x: ops.layer_norm(x, eps=0.1), [_r(4, 5) * 3]),
    "layer_norm:weight": (lambda x, w: ops.layer_norm(x, w), [_r(3, 7), _r(7)]),
    # the ops of Llama-family decoders (issue 48)
    "silu": (lambda a: ops.silu(a), [_r(3, 4) * 5]),
    "rsqrt": (lambda a: ops.rsqrt(a), [_r(3, 4, positive=True)]),
    "cos": (lambda a: ops.cos(a), [_r(3, 4) * 3]),
    "sin": (lambda a: ops.sin(a), [_r(3, 4) * 3]),
    "rms_norm": (lambda x, w: ops.rms_norm(x, w), [_r(2, 3, 6), _r(6)]),
    "rms_norm:gemma": (lambda x, w: ops.rms_norm(x, w, eps=1e-3, offset=1.0), [_r(4, 5), _r(5)]),
    "rms_norm:plain": (lambda x: ops.rms_norm(x), [_r(4, 5) * 3]),
    "rotary": (
        lambda x: ops.rotary(x, *ops.rope_tables(np.arange(4), 4, dtype=np.float64)),
        [_r(2, 3, 4, 6)],
    ),
    "rotary:tables": (
        lambda x, c, s: ops.rotary(x, c, s),
        [_r(2, 3, 4, 6), _r(2, 1, 4, 4), _r(2, 1, 4, 4)],
    ),
    "rope_tables:continued": (
        lambda x: ops.rotary(x, *ops.rope_tables(np.arange(7, 10), 8, 500.0, dtype=np.float64)),
        [_r(1, 2, 3, 8)],
    ),
    "scaled_dot_product_attention:gqa-causal": (
        lambda q, k, v: ops.scaled_dot_product_attention(q, k, v, causal=True),
        [_r(2, 6, 3, 4), _r(2, 2, 5, 4, seed=1), _r(2, 2, 5, 3)],
    ),
    "scaled_dot_product_attention:gqa-bottom-right": (
        lambda q, k, v: ops.scaled_dot_product_attention(q, k, v, causal="bottom_right"),
        [_r(2, 4, 3, 4), _r(2, 2, 5, 4, seed=1), _r(2, 2, 5, 3)],
    ),
    "scaled_dot_product_attention:gqa-padding": (
        lambda q, k, v: ops.scaled_dot_product_attention(q, k, v, key_padding_mask=PADDING),
        [_r(2, 4, 3, 4), _r(2, 2, 4, 4, seed=1), _r(2, 2, 4, 3)],
    ),
    "scaled_dot_product_attention:more-queries-than-keys": (
        lambda q, k, v: ops.scaled_dot_product_attention(q, k, v, causal="bottom_right"),
        [_r(1, 2, 5, 3), _r(1, 2, 3, 3, seed=1), _r(1, 2, 3, 2)],
    ),
    "scaled_dot_product_attention:gqa-bottom-right-products": (
        lambda q, k, v: ops.scaled_dot_product_attention(q, k, v, causal="bottom_right"),
        [_r(1, 4, 3, 4), _r(1, 2, 64, 4, seed=1), _r(1, 2, 64, 3)],
    ),
    "unsqueeze": (lambda a: ops.unsqueeze(a, 1) * a.unsqueeze(-1), [_r(2, 3)]),
    "squeeze": (lambda a: ops.squeeze(a, 1) + a.squeeze()[:, None], [_r(3, 1)]),
    "expand": (lambda a: ops.expand(a, (2, 3, 4)) * a.expand(-1, 4), [_r(3, 1)]),
    "repeat_interleave": (lambda a: ops.repeat_interleave(a, 2, 1), [_r(3, 2)]),
    "repeat_interleave:counts": (lambda a: ops.repeat_interleave(a, [0, 3, 1], 0), [_r(3, 2)]),
    "chunk": (lambda a: ops.concat([p * 2.0 for p in ops.chunk(a, 2, 1)], 1), [_r(2, 5)]),
    "split": (lambda a: ops.concat(ops.split(a, [1, 3], 0)[::-1], 0), [_r(4, 2)]),
}


def _run(device: str | None, fn, inputs):
    s = EagerSession(device=device, seed=3)
    leaves = [s.leaf(np.array(a)) for a in inputs]
    out = fn(*leaves)
    cot = np.random.default_rng(11).standard_normal(out.shape)
    grads = s.backward(out, seed=cot)
    return s, out, [grads[leaf] for leaf in leaves]


def test_every_op_has_a_device_case():
    covered = {name.split(":")[0] for name in CASES}
    missing = [op for op in ops.__all__ if op not in covered]
    assert not missing, f"ops without a device-vs-host case: {missing}"


@pytest.mark.parametrize("name", sorted(CASES))
def test_op_on_device_equals_numpy(name):
    fn, inputs = CASES[name]
    _, host_out, host_grads = _run(None, fn, inputs)
    s, dev_out, dev_grads = _run(DEVICE, fn, inputs)
    assert isinstance(dev_out.value, torch.Tensor)
    assert s.backend.is_array(dev_out.value)
    np.testing.assert_allclose(dev_out.numpy(), host_out.numpy(), rtol=1e-10, atol=1e-12)
    for hg, dg in zip(host_grads, dev_grads):
        assert isinstance(dg, torch.Tensor) and s.backend.is_array(dg)  # C7
        assert dg.dtype == torch.float64
        np.testing.assert_allclose(dg.cpu().numpy(), hg, rtol=1e-9, atol=1e-11)


def test_torch_backend_implements_every_abstract_backend_method():
    import inspect

    from tiegrad.backend.base import Backend
    from tiegrad.backend.torch_backend import TorchBackend

    names = [n for n, f in vars(Backend).items() if callable(f) and not n.startswith("__")]
    abstract = [
        n for n in names if "raise NotImplementedError" in inspect.getsource(getattr(Backend, n))
    ]
    missing = [n for n in abstract if getattr(TorchBackend, n) is getattr(Backend, n)]
    assert abstract and not missing, f"TorchBackend lacks {missing}"


def test_float32_is_the_default_on_device():
    s = EagerSession(device=DEVICE)
    a = s.constant([[1.0, 2.0]])
    assert a.value.dtype == torch.float32
    assert (a @ a.T).value.dtype == torch.float32


def test_backend_methods_match_numpy():
    bk = device_backend(DEVICE)
    x = np.arange(24, dtype=np.float64).reshape(2, 3, 4) - 7.5
    t = bk.asarray(x)
    pairs = [
        (bk.sum(t, axis=()), NUMPY.sum(x, axis=())),
        (bk.sum(t, axis=None, keepdims=True), NUMPY.sum(x, axis=None, keepdims=True)),
        (bk.max(t, axis=(0, 2)), NUMPY.max(x, axis=(0, 2))),
        (bk.argmax(t, axis=1), NUMPY.argmax(x, axis=1)),
        (bk.pad(t, [(0, 1), (2, 0), (1, 1)]), NUMPY.pad(x, [(0, 1), (2, 0), (1, 1)])),
        (bk.take(t, np.array([[2, -1]]), axis=1), NUMPY.take(x, np.array([[2, -1]]), axis=1)),
        (bk.expand_dims(t, (0, -1)), NUMPY.expand_dims(x, (0, -1))),
        (bk.einsum("abc,c->ab", t, t[0, 0]), NUMPY.einsum("abc,c->ab", x, x[0, 0])),
        (bk.einsum("abc,abc->ca", t, t), NUMPY.einsum("abc,abc->ca", x, x)),
        (bk.einsum("ij,ij->j", t[0], t[1]), NUMPY.einsum("ij,ij->j", x[0], x[1])),
        (bk.einsum("ij,ij->ij", t[0], t[1]), NUMPY.einsum("ij,ij->ij", x[0], x[1])),
        (bk.maximum(t, 0.0), NUMPY.maximum(x, 0.0)),
        (bk.where(t > 0, t, 0.0), NUMPY.where(x > 0, x, 0.0)),
        (bk.sliding_windows(t[None], 2, 2, 1), NUMPY.sliding_windows(x[None], 2, 2, 1)),
    ]
    for got, want in pairs:
        assert tuple(got.shape) == tuple(np.shape(want))
        np.testing.assert_array_equal(bk.to_numpy(got), want)
    assert bk.isfinite_all(t) and not bk.isfinite_all(bk.asarray(np.array([np.inf])))
    assert bk.dtype_name(bk.float32) == "float32" and bk.dtype_of("int64") is bk.int64
    for name in ("int8", "int16", "int32", "int64", "uint8", "bool", "float32", "float64"):
        want = name.startswith(("int", "uint"))
        assert bk.is_integer(bk.dtype_of(name)) is NUMPY.is_integer(np.dtype(name)) is want, name
    assert not bk.is_integer(torch.complex64) and not NUMPY.is_integer(np.dtype("complex64"))
    # ``take_along_axis``: NumPy's own route for 2-D operands (a negative index counts
    # from the end, as in np.take_along_axis), and the device's, on 2-D and N-D operands
    cols = np.array([[2, 0, -1], [1, 1, 3], [0, 3, 2]])
    for xs, idx in ((x[0], cols), (x[1], cols[:1]), (x, cols[None])):
        want = np.take_along_axis(xs, idx, axis=-1)
        np.testing.assert_array_equal(NUMPY.take_along_axis(xs, idx, -1), want)
        idx = idx % xs.shape[-1]
        got = bk.take_along_axis(bk.asarray(xs), idx, -1)
        np.testing.assert_array_equal(bk.to_numpy(got), np.take_along_axis(xs, idx, axis=-1))
    with pytest.raises(tiegrad.DTypeError, match="no torch dtype named 'float7'"):
        bk.dtype_of("float7")


@pytest.mark.parametrize(
    "index",
    [
        np.array([0, 2, 0, 0]),
        (np.array([1, 1]), np.array([0, 0])),
        MASK,
        (slice(None), np.array([1, 1])),
    ],
)
def test_accumulate_at_accumulates_repeats_like_numpy(index):
    bk = device_backend(DEVICE)
    host = np.zeros((3, 4))
    values = np.ones(host[index].shape) * 1.5
    NUMPY.accumulate_at(host, index, values)
    dev = bk.zeros((3, 4), bk.float64)
    bk.accumulate_at(dev, index, bk.asarray(values))
    np.testing.assert_array_equal(bk.to_numpy(dev), host)


def test_uploads_are_copies_and_constants_do_not_alias_read_only_arrays():
    bk = device_backend(DEVICE)
    x = np.arange(3.0)
    up = bk.upload(x)
    x[0] = 99.0
    assert bk.to_numpy(up)[0] == 0.0
    down = bk.download(up)
    down[1] = -1.0
    assert bk.to_numpy(up)[1] == 1.0
    frozen = np.arange(3.0)
    frozen.flags.writeable = False
    assert bk.to_numpy(bk.asarray(frozen)).tolist() == [0.0, 1.0, 2.0]


@pytest.mark.parametrize("t", [5, 64])  # 64: attention as batched products on torch's CPU
def test_fused_device_kernels_allow_a_second_backward_and_no_grad(t):
    """PyTorch's fused attention, layer norm and GELU keep what a second backward needs."""
    x0 = _r(2, t, 12)
    s = EagerSession(device=DEVICE)
    x = s.leaf(x0)
    y = ops.self_attention(x, 2, causal=True)
    loss = ops.sum(ops.layer_norm(ops.gelu(y)) * y)
    first = s.backward(loss, retain_graph=True)[x].cpu().numpy()
    second = s.backward(loss, retain_graph=True)[x].cpu().numpy()
    np.testing.assert_array_equal(first, second)
    host = EagerSession()
    hx = host.leaf(x0)
    hy = ops.self_attention(hx, 2, causal=True)
    want = host.backward(ops.sum(ops.layer_norm(ops.gelu(hy)) * hy))[hx]
    np.testing.assert_allclose(first, want, rtol=1e-9, atol=1e-11)
    with s.no_grad():
        again = ops.self_attention(x, 2, causal=True)
    np.testing.assert_array_equal(again.numpy(), y.numpy())


def test_layer_norm_of_mixed_dtypes_on_device_promotes_like_numpy():
    x, w, b = _r(3, 6).astype(np.float32), _r(6, seed=1), _r(6, seed=2).astype(np.float32)
    outs = []
    for device in (None, DEVICE):
        s = EagerSession(device=device)
        refs = [s.leaf(a) for a in (x, w, b)]
        out = ops.layer_norm(*refs)
        grads = s.backward(ops.sum(out * out))
        host_grads = [grads[r].cpu().numpy() if device else grads[r] for r in refs]
        outs.append([out.numpy()] + host_grads)
    for host, dev in zip(*outs):
        assert host.dtype == dev.dtype
        np.testing.assert_allclose(dev, host, rtol=1e-5, atol=1e-6)


def test_layer_norm_on_device_takes_a_wider_cotangent_like_the_host():
    x, w, b = (
        _r(*shape, seed=k).astype(np.float32) for k, shape in enumerate([(4, 6), (6,), (6,)])
    )
    weight = _r(4, 6, seed=3)  # float64: the layer norm's cotangent is float64
    outs = []
    for device in (None, DEVICE):
        s = EagerSession(device=device)
        refs = [s.leaf(a) for a in (x, w, b)]
        grads = s.backward(ops.sum(ops.layer_norm(*refs) * weight))
        outs.append([grads[r].cpu().numpy() if device else grads[r] for r in refs])
    for host, dev in zip(*outs):
        assert host.dtype == dev.dtype == np.float32
        np.testing.assert_allclose(dev, host, rtol=1e-5, atol=1e-6)


def test_gelu_on_device_takes_a_wider_cotangent_like_the_host():
    outs = []
    for device in (None, DEVICE):
        s = EagerSession(device=device)
        x = s.leaf(_r(3, 4).astype(np.float32))
        g = s.backward(ops.sum(ops.gelu(x) * _r(3, 4, seed=5)))[x]
        outs.append(g.cpu().numpy() if device else g)
    assert outs[0].dtype == outs[1].dtype
    np.testing.assert_allclose(outs[1], outs[0], rtol=1e-6, atol=1e-7)


def test_layer_norm_on_device_with_only_the_affine_parameters_trainable():
    x, w, b = _r(5, 6), _r(6, seed=1), _r(6, seed=2)
    cot = _r(5, 6, seed=3)
    outs = []
    for device in (None, DEVICE):
        s = EagerSession(device=device)
        wr, br = s.leaf(w), s.leaf(b)
        out = ops.layer_norm(x, wr, br)  # x is a constant: no input cotangent
        grads = s.backward(out, seed=cot)
        outs.append([np.asarray(grads[r].cpu()) if device else grads[r] for r in (wr, br)])
    for host, dev in zip(*outs):
        np.testing.assert_allclose(dev, host, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("targets_dtype", [np.uint8, np.int16, np.int64])
def test_cross_entropy_on_the_generic_device_path_keeps_the_logits_dtype(targets_dtype):
    # float16 logits take the op's own code on the device (not the backend's fused
    # kernel); a float32 loss scale must not widen the cotangent: the gradient's bits are
    # those of the same scale in float16. Small integer targets index rows as int64.
    rng = np.random.default_rng(0)
    logits = (rng.standard_normal((300, 5)) * 3).astype(np.float16)
    targets = rng.integers(0, 5, 300).astype(targets_dtype)
    targets[::7] = 1
    grads = []
    for scale_dtype in (np.float32, np.float16):
        s = EagerSession(device=DEVICE)
        x = s.leaf(logits)
        loss = ops.cross_entropy(x, targets, ignore_index=1, label_smoothing=0.1)
        scaled = ops.mul(loss, s.constant(np.array(1.5, scale_dtype)))
        grads.append(s.backend.to_numpy(s.backward(scaled)[x]))
    assert grads[0].dtype == np.float16
    np.testing.assert_array_equal(grads[0], grads[1])


def test_index_checks_and_the_mean_count_hold_for_host_arrays_lists_and_device_tensors():
    """NumPy index data is checked and counted on the host (no device synchronisation);
    lists and device tensors on the device; each gives the same error and the same loss."""
    from tiegrad.errors import IndexRangeError

    s = EagerSession(device=DEVICE)
    dev = s.backend.torch_device
    w = s.leaf(_r(5, 2))
    for idx in (np.array([0, 5]), [0, 5], torch.tensor([0, 5], device=dev)):
        with pytest.raises(IndexRangeError, match=r"indices must lie in \[0, 5\), got .*\[0, 5\]"):
            ops.embedding(w, idx)
    targets = np.array([0, -100, 2, 1])
    logits = _r(4, 3)
    host = EagerSession()
    want = ops.cross_entropy(host.leaf(logits), targets).numpy()
    for t in (targets, targets.tolist(), torch.tensor(targets, device=dev)):
        got = ops.cross_entropy(s.leaf(logits), t).numpy()
        np.testing.assert_allclose(got, want, rtol=1e-12)
        with pytest.raises(IndexRangeError, match=r"targets must lie in \[0, 3\)"):
            bad = t + 3 if not isinstance(t, list) else [v + 3 for v in t]
            ops.cross_entropy(s.leaf(logits), bad)


def test_relu_vjp_on_device_is_the_host_product_bit_for_bit():
    """``g * (out > 0)`` with NaN, infinities and signed zeros in the cotangent and every
    ReLU output (``>= 0`` or NaN, either zero)."""
    bk = device_backend(DEVICE)
    cotangents = [np.nan, np.inf, -np.inf, 0.0, -0.0, 2.5, -3.0]
    outputs = [np.nan, np.inf, 0.0, -0.0, 2.5]
    g, out = (a.reshape(-1) for a in np.meshgrid(cotangents, outputs))
    with np.errstate(invalid="ignore"):
        for dtype in (np.float32, np.float64):
            want = NUMPY.relu_vjp(g.astype(dtype), out.astype(dtype))
            got = bk.relu_vjp(bk.asarray(g.astype(dtype)), bk.asarray(out.astype(dtype)))
            bits = f"u{want.itemsize}"
            np.testing.assert_array_equal(bk.to_numpy(got).view(bits), want.view(bits))
        wide = bk.relu_vjp(bk.asarray(g), bk.asarray(out.astype(np.float32)))
        np.testing.assert_array_equal(bk.to_numpy(wide), g * (out > 0))


@pytest.mark.skipif(DEVICE != "torch:cpu", reason="the products path is torch's CPU's")
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize(
    "b, t, h, flash", [(3, 64, 2, False), (2, 100, 4, False), (2, 32, 2, True), (24, 256, 4, True)]
)
def test_attention_on_torch_cpu_runs_products_where_scores_are_small(
    monkeypatch, b, t, h, flash, causal
):
    """On torch's CPU, attention over at least 64 keys whose scores fit in 4 MiB runs as
    batched products (torch_attention.in_cache); otherwise PyTorch's flash kernel. Both
    agree with PyTorch's own float32 attention within float32 rounding."""
    import torch.nn.functional as F

    calls = []
    sdpa = F.scaled_dot_product_attention
    monkeypatch.setattr(
        F, "scaled_dot_product_attention", lambda *a, **k: calls.append(1) or sdpa(*a, **k)
    )
    d = 8 * h
    x0 = _r(b, t, 3 * d).astype(np.float32)
    w0 = _r(b, t, d, seed=1).astype(np.float32)
    s = EagerSession(device=DEVICE)
    x = s.leaf(x0)
    y = ops.self_attention(x, h, causal=causal)
    grad = s.backward(ops.sum(y * s.leaf(w0, requires_grad=False)))[x]
    assert bool(calls) == flash
    xt = torch.tensor(x0, requires_grad=True)
    q, k, v = xt.reshape(b, t, 3, h, d // h).permute(2, 0, 3, 1, 4)
    want = sdpa(q, k, v, is_causal=causal).transpose(1, 2).reshape(b, t, d)
    (want * torch.tensor(w0)).sum().backward()
    np.testing.assert_allclose(y.numpy(), want.detach().numpy(), rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(grad.numpy(), xt.grad.numpy(), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("causal", [True, False])
def test_attention_on_device_gives_zeros_where_every_score_is_minus_infinity(causal):
    """Finite q and k whose products overflow to -inf: that query gets zeros and no
    gradient on the device (batched products on torch's CPU, flash elsewhere), as on
    the host; a NaN input stays NaN."""
    rng = np.random.default_rng(5)
    q0, k0, v0 = (rng.standard_normal((1, 64, 4)).astype(np.float32) for _ in range(3))
    k0 = np.abs(k0) + 0.5
    q0[0, 0] = -3e38  # query 0's products with every key overflow to -inf
    results = []
    for device in (None, DEVICE):
        s = EagerSession(device=device)
        q, k, v = (s.leaf(a) for a in (q0, k0, v0))
        with np.errstate(over="ignore"):  # the host's product overflows, as intended
            y = ops.scaled_dot_product_attention(q, k, v, causal=causal)
        grads = s.backward(ops.sum(y))
        results.append([np.asarray(y.numpy())] + [s.backend.to_numpy(grads[r]) for r in (q, k, v)])
    for host, dev in zip(*results):
        assert np.isfinite(dev).all()
        np.testing.assert_allclose(dev, host, rtol=1e-4, atol=1e-5)
    assert not results[1][0][0, 0].any()
    q0[0, 3, 1], q0[0, 5, 2] = np.nan, np.inf  # a NaN score, scores of +inf and -inf
    nan_rows = []
    for device in (None, DEVICE):
        s = EagerSession(device=device)
        with np.errstate(over="ignore", invalid="ignore"):
            y = ops.scaled_dot_product_attention(*(s.leaf(a) for a in (q0, k0, v0)), causal=causal)
        nan_rows.append(np.isnan(s.backend.to_numpy(y.value)).all(axis=-1))
    assert nan_rows[1].tolist() == nan_rows[0].tolist()
    assert np.flatnonzero(nan_rows[1][0]).tolist() == [3, 5]


@pytest.mark.parametrize("t", [5, 64])
def test_attention_on_device_takes_a_wider_cotangent_like_the_host(t):
    rng = np.random.default_rng(6)
    q0, k0, v0 = (rng.standard_normal((2, t, 8)).astype(np.float32) for _ in range(3))
    w = rng.standard_normal((2, t, 8))  # float64: the product's cotangent is float64
    grads = []
    for device in (None, DEVICE):
        s = EagerSession(device=device)
        refs = [s.leaf(a) for a in (q0, k0, v0)]
        g = s.backward(ops.sum(ops.scaled_dot_product_attention(*refs, causal=True) * w))
        grads.append([s.backend.to_numpy(g[r]) for r in refs])
    for host, dev in zip(*grads):
        assert dev.dtype == host.dtype == np.float32
        np.testing.assert_allclose(dev, host, rtol=1e-4, atol=1e-5)


def _both(fn, *arrays, seed_dtype=None):
    """``fn`` of leaves of ``arrays`` on the host and on the device: (value, gradients) each."""
    results = []
    for device in (None, DEVICE):
        s = EagerSession(device=device)
        leaves = [s.leaf(a) for a in arrays]
        out = fn(*leaves)
        value = out.numpy()
        seed = np.ones(value.shape, seed_dtype or value.dtype)
        grads = s.backward(out, seed)
        host = [grads[r] for r in leaves]
        results.append((value, [g.cpu().numpy() if device else g for g in host]))
    return results


@pytest.mark.parametrize(
    "index",
    [[[0, 1], [2, 2]], np.array([1, 0, 1], np.uint8), np.array([[True], [False], [True]])[:, 0]],
    ids=["nested-list", "uint8", "mask"],
)
def test_indexes_mean_on_the_device_what_they_mean_to_numpy(index):
    x = np.arange(12.0).reshape(3, 4)
    (hv, hg), (dv, dg) = _both(lambda r: r[index], x)
    np.testing.assert_array_equal(dv, hv)
    np.testing.assert_array_equal(dg[0], hg[0])


@pytest.mark.parametrize("index", [np.array([1.0, 0.0]), slice(None, None, -1)])
def test_indexes_the_device_cannot_read_are_index_range_errors(index):
    s = EagerSession(device=DEVICE)
    x = s.leaf(np.arange(12.0).reshape(3, 4))
    n = len(s)
    with pytest.raises(tiegrad.IndexRangeError, match="getitem"):
        x[index]
    assert len(s) == n


@pytest.mark.parametrize(
    "fn, shapes",
    [
        (lambda a, b: ops.matmul(a, b), [(3, 4), (4, 2)]),
        (lambda x, w, b: ops.linear(x, w, b), [(5, 4), (3, 4), (3,)]),
        (lambda q, k, v: ops.scaled_dot_product_attention(q, k, v), [(2, 3, 4)] * 3),
    ],
    ids=["matmul", "linear", "attention"],
)
def test_products_of_mixed_dtypes_promote_on_the_device_like_numpy(fn, shapes):
    arrays = [
        _r(*sh, seed=i).astype(np.float32 if i else np.float64) for i, sh in enumerate(shapes)
    ]
    (hv, hg), (dv, dg) = _both(fn, *arrays)
    assert dv.dtype == hv.dtype == np.float64
    np.testing.assert_allclose(dv, hv, rtol=1e-6)
    for d, h in zip(dg, hg):
        assert d.dtype == h.dtype
        np.testing.assert_allclose(d, h, rtol=1e-5, atol=1e-6)


def test_a_wider_cotangent_reaches_a_float32_product_on_the_device():
    a, b = _r(3, 4).astype(np.float32), _r(4, 2, seed=1).astype(np.float32)
    (hv, hg), (dv, dg) = _both(lambda x, y: ops.matmul(x, y), a, b, seed_dtype=np.float64)
    for d, h in zip(dg, hg):
        assert d.dtype == h.dtype
        np.testing.assert_allclose(d, h, rtol=1e-6)


def test_where_reads_a_numeric_condition_as_nonzero_on_the_device():
    cond = np.array([[0, 2, 0, -1]] * 3)
    (hv, hg), (dv, dg) = _both(lambda x: ops.where(cond, x, 0.0), _r(3, 4))
    np.testing.assert_array_equal(dv, hv)
    np.testing.assert_array_equal(dg[0], hg[0])


def test_the_siamese_encoder_loss_runs_on_the_device():
    from tiegrad.models import SiameseEncoder

    model = SiameseEncoder(6, 4)
    x1, x2 = _r(5, 6).astype(np.float32), _r(5, 6, seed=2).astype(np.float32)
    same = np.array([1, 0, 1, 1, 0])
    losses = [
        float(model.loss(EagerSession(device=d), x1, x2, same).item()) for d in (None, DEVICE)
    ]
    np.testing.assert_allclose(losses[1], losses[0], rtol=1e-5)


def test_an_empty_list_index_selects_nothing_on_the_device_as_in_numpy():
    s = EagerSession(device=DEVICE)
    x = s.leaf(np.ones((3, 4)))
    assert tuple(x[[]].shape) == (0, 4)


@pytest.mark.skipif(DEVICE != "torch:cpu", reason="the products path is torch's CPU's")
@pytest.mark.parametrize("causal", [True, "bottom_right"])
@pytest.mark.parametrize("tk, flash", [(6, True), (64, False)])
def test_grouped_query_attention_on_the_device_runs_fused_without_repeating_k_and_v(
    monkeypatch, tk, flash, causal
):
    """Grouped heads reach PyTorch's attention with ``enable_gqa`` (few keys) or the
    batched products (64 keys), never the generic path; a bottom-right causal mask is
    an explicit mask there. Both agree with torch's attention of repeated K and V."""
    import torch.nn.functional as F

    device_backend(DEVICE)  # imported before the count: its import probes enable_gqa
    calls = []
    sdpa = F.scaled_dot_product_attention
    monkeypatch.setattr(
        F, "scaled_dot_product_attention", lambda *a, **k: calls.append(k) or sdpa(*a, **k)
    )
    q0, k0, v0 = (
        _r(2, h, t, 4, seed=i).astype(np.float32)
        for i, (h, t) in enumerate([(6, 3), (2, tk), (2, tk)])
    )
    s = EagerSession(device=DEVICE)
    q, k, v = s.leaf(q0), s.leaf(k0), s.leaf(v0)
    out = ops.scaled_dot_product_attention(q, k, v, causal=causal)
    grads = s.backward(ops.sum(out * out))
    assert len(calls) == int(flash)
    if flash:
        assert calls[0]["enable_gqa"] is True
        assert ("attn_mask" in calls[0]) == (causal == "bottom_right")
    tq_, tk_, tv_ = (torch.tensor(a, requires_grad=True) for a in (q0, k0, v0))
    seen = torch.ones(3, tk, dtype=torch.bool).tril(tk - 3 if causal == "bottom_right" else 0)
    want = sdpa(tq_, tk_.repeat_interleave(3, 1), tv_.repeat_interleave(3, 1), attn_mask=seen)
    (want * want).sum().backward()
    np.testing.assert_allclose(out.numpy(), want.detach().numpy(), rtol=1e-5, atol=1e-6)
    for ref, t in ((q, tq_), (k, tk_), (v, tv_)):
        np.testing.assert_allclose(grads[ref].numpy(), t.grad.numpy(), rtol=1e-4, atol=1e-5)
