"""Contracts on the fused and device code paths: snapshots (C2) and checks first (C6).

The fused kernels (``host_kernels`` through the NumPy backend, PyTorch's native layer
norm, GELU and attention on ``torch:cpu``) and the host-side index checks of
``embedding`` and ``cross_entropy`` are pinned here for every path they take.
"""

from __future__ import annotations

import numpy as np
import pytest

import tiegrad.backend.host_dispatch as nb
from tiegrad import DTypeError, EagerSession, IndexRangeError, Param, ParamList, ShapeError, ops
from tiegrad.optim import Adam

V, D, HEADS, B, T = 7, 8, 2, 2, 5
IDS = np.array([[1, 3, 3, 0, 6], [2, 2, 5, 4, 1]])
MASK = np.array([[False, False, True, False, False], [False, True, False, False, True]])


def _np(x):
    return x.detach().cpu().numpy() if hasattr(x, "detach") else np.asarray(x)


@pytest.fixture(params=["numba kernels", "numpy", "torch:cpu"])
def device(request, monkeypatch):
    """The session device of each path: the host with and without ``host_kernels``, torch."""
    if request.param == "torch:cpu":
        pytest.importorskip("torch")
        return "torch:cpu"
    if request.param == "numba kernels":
        if nb._fused_kernels(np.zeros(1, np.float32)) is None:
            pytest.skip("the host kernels are off (no numba, or TIEGRAD_NO_NUMBA)")
    else:
        monkeypatch.setattr(nb._numba, "ENABLED", False)
    return None


def _params() -> list[Param]:
    rng = np.random.default_rng(0)
    shapes = [(V, D), (D,), (D,), (D, 3 * D)]
    return [Param(rng.standard_normal(sh).astype(np.float32)) for sh in shapes]


def _loss(s: EagerSession, ps: list[Param]):
    """Every fused op once: GELU, layer norm (affine and plain), attention (fused, masked)."""
    leaves = [s.use(p) for p in ps]
    emb, w, b, wqkv = leaves
    h = ops.layer_norm(ops.embedding(emb, IDS), w, b)
    a = ops.self_attention(ops.matmul(h, wqkv), HEADS, causal=True)
    m = ops.scaled_dot_product_attention(a, h, h, key_padding_mask=MASK)  # unfused on torch
    y = ops.layer_norm(ops.gelu(a + m))  # plain: the kernels' xhat is the output
    logits = ops.matmul(y, ops.transpose(s.use(ps[0])))  # tied: a second use of emb
    return leaves, ops.cross_entropy(logits, np.roll(IDS, 1, axis=1))


def test_c2_fused_paths_keep_leaves_and_gradients_when_the_parameters_are_written(device):
    """C2: writes after the uses (the session's SGD, in place where nothing pins, then a
    fused optimizer step) change no leaf, no gradient already computed, nor a later backward
    of the same tape: no fused kernel writes into an array a tape holds."""
    ps = _params()
    s = EagerSession(device=device)
    leaves, loss = _loss(s, ps)
    snapshots = [_np(r.value).copy() for r in leaves]
    grads = s.backward(loss, retain_graph=True)
    first = [_np(grads[r]).copy() for r in leaves]
    s.sgd_step(0.5, grads)
    Adam(ParamList(ps), lr=0.1).step(grads)
    for p, snap in zip(ps, snapshots):
        assert not np.array_equal(p.value_synced(), snap)  # the writes happened
    again = s.backward(loss)
    for r, snap, g in zip(leaves, snapshots, first):
        np.testing.assert_array_equal(_np(r.value), snap)
        np.testing.assert_array_equal(_np(grads[r]), g)
        np.testing.assert_array_equal(_np(again[r]), g)


def _forms(s: EagerSession, data) -> list:
    """``data`` as a NumPy array, a list, a constant ref and (on a device) a device tensor."""
    arr = np.asarray(data)
    forms = [arr, arr.tolist(), s.constant(arr)]
    if s.backend.name == "torch":
        forms.append(s.backend.asarray(arr))
    return forms


@pytest.mark.parametrize("device", [None, "torch:cpu"])
def test_c6_index_and_mask_checks_raise_before_anything_changes_for_every_form(device):
    """C6: the checks of embedding ids, cross-entropy targets and attention masks given as
    NumPy arrays (checked on the host), lists, refs or device tensors raise the same error
    naming the actual values, before the tape, the parameter's mirror or the device's
    live temporaries change."""
    if device is not None:
        pytest.importorskip("torch")
    w = Param(np.ones((5, 2), np.float32))
    s = EagerSession(device=device)
    table = s.use(w)
    logits = s.leaf(np.zeros((4, 3), np.float32))
    q = s.leaf(np.ones((2, 3, 6), np.float32))
    cases = [
        (
            [0, 5],
            IndexRangeError,
            r"embedding: indices must lie in \[0, 5\), got values in \[0, 5\]",
            lambda bad: ops.embedding(table, bad),
        ),
        (
            [[-1, 1], [4, 2]],
            IndexRangeError,
            r"got values in \[-1, 4\]",
            lambda bad: ops.embedding(table, bad),
        ),
        (
            [0.0, 1.0],
            DTypeError,
            "embedding: indices must have an integer dtype",
            lambda bad: ops.embedding(table, bad),
        ),
        (
            [0, -100, 3, -1],
            IndexRangeError,
            r"targets must lie in \[0, 3\) or equal ignore_index=-100, got values in \[-1, 3\]",
            lambda bad: ops.cross_entropy(logits, bad),
        ),
        (
            [[False, True, False]],
            ShapeError,
            r"key_padding_mask has shape \(1, 3\), expected \(B, Tk\) = \(2, 3\)",
            lambda bad: ops.self_attention(q, 1, key_padding_mask=bad),
        ),
        (
            np.zeros((2, 3), np.int64),
            DTypeError,
            "key_padding_mask must be bool",
            lambda bad: ops.scaled_dot_product_attention(q, q, q, key_padding_mask=bad),
        ),
    ]
    tracker = getattr(s.backend, "temporaries", None)

    def state():
        return len(s), id(w.storage.mirror), w.storage.uploads, tracker and tracker.live

    for data, exc, match, op in cases:
        for bad in _forms(s, data):
            before = state()
            with pytest.raises(exc, match=match):
                op(bad)
            assert state() == before


@pytest.mark.parametrize("device", [None, "torch:cpu"])
def test_c6_unsigned_ids_get_the_same_check_on_every_path(device):
    """C6: the range check names the actual values; unsigned ids that pass as a NumPy array
    (checked on the host) pass as a ref or a device tensor too."""
    if device is not None:
        pytest.importorskip("torch")
    s = EagerSession(device=device)
    table = s.leaf(np.ones((5, 2), np.float32))
    ids = np.array([0, 1], np.uint8)
    assert tuple(ops.embedding(table, ids).shape) == (2, 2)  # checked on the host: passes
    for form in _forms(s, ids)[2:]:  # the ref and the device tensor
        assert tuple(ops.embedding(table, form).shape) == (2, 2)
    bad = np.array([0, 7], np.uint8)
    for form in _forms(s, bad):
        with pytest.raises(IndexRangeError, match=r"must lie in \[0, 5\), got values in \[0, 7\]"):
            ops.embedding(table, form)
