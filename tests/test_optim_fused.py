"""The fused (numba) host step against the NumPy rules and torch.optim (C3-C6).

Both paths must give the same bytes: parameters and state after several steps, in
float32 and float64, with ties, frozen slots, a 0-d parameter, a non-contiguous
gradient and batches that the fused path splits into chunks shared by threads
(``CHUNK_MIN`` is lowered so small tensors exercise the chunking). The fused path is
checked against torch in float64 at 1e-10 here and in ``test_optim_torch.py`` (which
runs it by default); the NumPy path against torch here. Then what only the fused
path has: its finiteness check (C6), gradients that share memory with what a step
writes, concurrent steps, a forked child, the switch and the fallback.
"""

from __future__ import annotations

import gc
import os
import subprocess
import sys
import threading
import time
import warnings
import weakref

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

pytest.importorskip("numba")

from optim_lists import make_list  # noqa: E402

from tiegrad import NonFiniteError, Param, ParamList, _numba, _threads  # noqa: E402
from tiegrad.backend import blas  # noqa: E402
from tiegrad.optim import SGD, Adagrad, Adam, AdamW, RMSprop, fused  # noqa: E402

CASES = [
    (SGD, {"lr": 0.1}),
    (SGD, {"lr": 0.1, "weight_decay": 0.05, "maximize": True}),
    (SGD, {"lr": 0.1, "momentum": 0.9, "dampening": 0.3, "weight_decay": 0.01}),
    (SGD, {"lr": 0.1, "momentum": 0.9, "nesterov": True}),
    (SGD, {"lr": 0.1, "momentum": 0.5, "maximize": True}),
    (Adam, {"lr": 0.01}),
    (Adam, {"lr": 0.01, "weight_decay": 0.1, "amsgrad": True, "maximize": True}),
    (Adam, {"lr": 0.01, "betas": (0.5, 0.8), "eps": 1e-3, "weight_decay": 0.1}),
    (AdamW, {"lr": 0.01}),
    (AdamW, {"lr": 0.01, "weight_decay": 0.3, "amsgrad": True, "maximize": True}),
    (RMSprop, {"lr": 0.005}),
    (RMSprop, {"lr": 0.005, "momentum": 0.9}),
    (RMSprop, {"lr": 0.005, "centered": True}),
    (RMSprop, {"lr": 0.005, "alpha": 0.5, "momentum": 0.9, "centered": True, "weight_decay": 0.05}),
    (Adagrad, {"lr": 0.05}),
    (
        Adagrad,
        {"lr": 0.05, "lr_decay": 0.1, "weight_decay": 0.05, "initial_accumulator_value": 0.2},
    ),
]
IDS = [f"{cls.kind}-{i}" for i, (cls, _) in enumerate(CASES)]


@pytest.fixture(autouse=True)
def fused_on(monkeypatch):
    """The fused path, even under ``TIEGRAD_NO_NUMBA=1``; tests comparing paths flip it."""
    monkeypatch.setattr(_numba, "ENABLED", True)


@pytest.fixture
def small_chunks(monkeypatch):
    """Chunks of 512 elements shared by three threads, so small batches are split."""
    monkeypatch.setattr(fused, "CHUNK_MIN", 512)
    monkeypatch.setenv("TIEGRAD_NUM_THREADS", "3")


@pytest.fixture
def fused_calls(monkeypatch):
    """The number of ``fused.run`` calls so far, in a one-element list."""
    calls = [0]
    real = fused.run

    def counting(*args):
        calls[0] += 1
        real(*args)

    monkeypatch.setattr(fused, "run", counting)
    return calls


def gradients(plist: ParamList, g: np.random.Generator) -> list:
    """One gradient per canonical slot; w's is a transposed (non-contiguous) view."""
    out = []
    for i, c in enumerate(plist.canonical_slot_indices()):
        p = plist[i]
        if c != i:
            out.append(None)
        elif i == 0:
            out.append(np.ascontiguousarray(g.standard_normal(p.shape[::-1]), p.dtype).T)
        else:
            out.append(np.asarray(g.standard_normal(p.shape), p.dtype))
    return out


def state_bytes(opt) -> tuple:
    """Every parameter's bytes and ``{slot: {name: bytes or step}}`` of the state."""
    values = [p.value.tobytes() for p in opt.params]
    state = {
        slot: {k: v.tobytes() if isinstance(v, np.ndarray) else v for k, v in entry.items()}
        for slot, entry in opt.state.items()
    }
    return values, state


def trajectory(monkeypatch, enabled, cls, kwargs, dtype, steps=4) -> tuple:
    """``state_bytes`` after ``steps`` steps on the fused or the NumPy path."""
    monkeypatch.setattr(_numba, "ENABLED", enabled)
    plist = make_list(dtype)
    opt = cls(plist, **kwargs)
    g = np.random.default_rng(1)
    for _ in range(steps):
        opt.step(gradients(plist, g))
    return state_bytes(opt)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("cls, kwargs", CASES, ids=IDS)
def test_fused_and_numpy_paths_agree_bit_for_bit(
    monkeypatch, small_chunks, fused_calls, cls, kwargs, dtype
):
    ours = trajectory(monkeypatch, True, cls, kwargs, dtype)
    assert fused_calls[0] == 4  # one batch per step: every slot shares coefficients
    reference = trajectory(monkeypatch, False, cls, kwargs, dtype)
    assert fused_calls[0] == 4
    assert ours == reference
    assert sorted(ours[1]) == [0, 1, 3, 5]  # state at canonical trainable slots only (C5)


@settings(max_examples=30, deadline=None)
@given(
    case=st.integers(0, len(CASES) - 1),
    dtype=st.sampled_from([np.float32, np.float64]),
    sizes=st.lists(st.integers(0, 2000), min_size=1, max_size=6),
    seed=st.integers(0, 2**16),
)
def test_paths_agree_on_random_layouts(case, dtype, sizes, seed):
    cls, kwargs = CASES[case]
    results = []
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(fused, "CHUNK_MIN", 256)
        mp.setenv("TIEGRAD_NUM_THREADS", "2")
        for enabled in (True, False):
            mp.setattr(_numba, "ENABLED", enabled)
            g = np.random.default_rng(seed)
            plist = ParamList.of_pack([g.standard_normal(n).astype(dtype) for n in sizes])
            opt = cls(plist, **kwargs)
            for _ in range(2):
                opt.step([g.standard_normal(n).astype(dtype) for n in sizes])
            results.append([p.value.tobytes() for p in plist])
    assert results[0] == results[1]


def test_mixed_dtypes_take_one_batch_each(monkeypatch, fused_calls):
    results = []
    for enabled in (True, False):
        monkeypatch.setattr(_numba, "ENABLED", enabled)
        g = np.random.default_rng(0)
        dtypes = (np.float32, np.float64, np.float32)
        plist = ParamList([Param(g.standard_normal(5), dtype=dt) for dt in dtypes])
        opt = Adam(plist, lr=0.1)
        for _ in range(2):
            opt.step([g.standard_normal(5).astype(p.dtype) for p in plist])
        results.append([p.value.tobytes() for p in plist])
    assert fused_calls[0] == 4  # two steps of a float32 and a float64 batch
    assert results[0] == results[1]


def test_unsupported_dtypes_take_the_numpy_rule(fused_calls):
    plist = ParamList([Param(np.ones(4), dtype=np.float16), Param(np.ones(3), dtype=np.float32)])
    opt = SGD(plist, lr=0.5)
    opt.step([np.ones(4, np.float16), np.ones(3, np.float32)])
    assert fused_calls[0] == 1  # the float32 slot only
    np.testing.assert_array_equal(plist[0].value, np.full(4, 0.5, np.float16))
    np.testing.assert_array_equal(plist[1].value, np.full(3, 0.5, np.float32))


# -- against torch in float64 -------------------------------------------------------------
TORCH_CASES = [
    (Adam, "Adam", {"lr": 0.02, "weight_decay": 0.1, "amsgrad": True, "maximize": True}),
    (AdamW, "AdamW", {"lr": 0.02, "weight_decay": 0.3}),
    (SGD, "SGD", {"lr": 0.05, "momentum": 0.9, "dampening": 0.3, "weight_decay": 0.05}),
    (SGD, "SGD", {"lr": 0.05, "momentum": 0.9, "nesterov": True, "maximize": True}),
    (RMSprop, "RMSprop", {"lr": 0.005, "momentum": 0.9, "centered": True, "weight_decay": 0.05}),
    (Adagrad, "Adagrad", {"lr": 0.05, "lr_decay": 0.1, "initial_accumulator_value": 0.2}),
]


@pytest.mark.parametrize("enabled", [True, False], ids=["fused", "numpy"])
@pytest.mark.parametrize(
    "cls, torch_name, kwargs", TORCH_CASES, ids=[f"{c[1]}-{i}" for i, c in enumerate(TORCH_CASES)]
)
def test_both_paths_match_torch_in_float64(monkeypatch, enabled, cls, torch_name, kwargs):
    torch = pytest.importorskip("torch")
    from test_optim_torch import run  # the tied model, 25 steps, 1e-10 after each

    monkeypatch.setattr(_numba, "ENABLED", enabled)
    run(cls, getattr(torch.optim, torch_name), kwargs)


def test_large_tensors_on_threads_match_torch(monkeypatch):
    # The real thread settings and sizes: batches above 2 * CHUNK_MIN are split.
    torch = pytest.importorskip("torch")
    monkeypatch.setenv("TIEGRAD_NUM_THREADS", "2")
    g = np.random.default_rng(5)
    shapes = [(3 * fused.CHUNK_MIN + 17,), (300, 7), ()]
    values = [g.standard_normal(s) for s in shapes]
    plist = ParamList.of_pack(values)
    tensors = [torch.tensor(v, requires_grad=True) for v in values]
    opt = AdamW(plist, lr=0.01, amsgrad=True)
    topt = torch.optim.AdamW(tensors, lr=0.01, amsgrad=True)
    for _ in range(3):
        grads = [g.standard_normal(s) for s in shapes]
        for t, gr in zip(tensors, grads):
            t.grad = torch.tensor(gr)
        opt.step(grads)
        topt.step()
    for p, t in zip(plist, tensors):
        np.testing.assert_allclose(p.value, t.detach().numpy(), rtol=0, atol=1e-10)


# -- the kernels' arguments: named and checked ------------------------------------------
def coefficients(cls, kwargs):
    """``(coefficients of the first step, state names)`` of ``cls(**kwargs)``."""
    opt = cls(ParamList.of_pack([np.ones(3)]), **kwargs)
    hp = opt.param_groups[0]
    names = opt._state_names(hp)
    return opt._coefficients(hp, 1, frozenset(names)), names


def kernel_call(cls, kwargs, dtype, sizes):
    """``(kernel, p, g, state, coefficients)`` for parameters of ``sizes`` in GROUP-tuples;
    the state tensors the coefficients do not need are empty."""
    kernel = getattr(fused._kernels(), cls.fused_rule.kernel)
    g = np.random.default_rng(7)
    pad = fused.Layout([0], [1], [0], np.dtype(dtype)).pad[fused.GROUP - len(sizes)]
    p = tuple(g.standard_normal(n).astype(dtype) for n in sizes) + pad[0]
    grads = []
    for n in sizes:
        grads.append(g.standard_normal(n).astype(dtype))
        grads[-1].flags.writeable = False
    c, names = coefficients(cls, kwargs)
    state = [
        np.abs(g.standard_normal(sum(sizes) if name in names else 0)).astype(dtype)
        for name in cls.fused_rule.state
    ]
    return kernel, p, tuple(grads) + pad[1], state, c


def test_kernel_arguments_are_the_rule_state_then_the_coefficient_fields():
    import inspect

    for cls, kwargs in CASES:
        rule = cls.fused_rule
        kernel = getattr(fused._kernels(), rule.kernel)
        names = list(inspect.signature(kernel.py_func).parameters)
        assert names == ["p", "g", *rule.state, *type(coefficients(cls, kwargs)[0])._fields]


@pytest.mark.parametrize("block", [0, -4])
def test_the_block_drivers_refuse_a_block_of_no_element(block):
    kernels = _numba.kernels("tiegrad.optim.kernels")
    x = np.ones(10, np.float32)
    x[3] = np.nan
    rows = (x,) + (np.empty(0, np.float32),) * (fused.GROUP - 1)
    with pytest.raises(ValueError, match="nonfinite_blocks: block must be at least one"):
        kernels.nonfinite_blocks(rows, block)
    kernel, p, g, state, c = kernel_call(Adam, {}, np.float32, [5, 3])
    before = [a.copy() for a in p]
    with pytest.raises(ValueError, match="adam_blocks: block must be at least one"):
        kernels.adam_blocks(p, g, *state, *c, block)
    for a, b in zip(p, before):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("cls, kwargs", CASES, ids=IDS)
def test_a_kernel_refuses_a_size_mismatch_and_changes_nothing(cls, kwargs, dtype):
    kernel, p, g, state, c = kernel_call(cls, kwargs, dtype, [5, 3])
    before = [a.copy() for a in (*p, *state)]
    short = g[1][:2]
    with pytest.raises(ValueError, match="gradient's size differs"):
        kernel(p, (g[0], short, *g[2:]), *state, *c)
    for k in [k for k, a in enumerate(state) if a.size]:  # each tensor the coefficients need
        with pytest.raises(ValueError, match="state tensor's size differs"):
            kernel(p, g, *state[:k], state[k][:-1], *state[k + 1 :], *c)
    for a, b in zip((*p, *state), before):
        np.testing.assert_array_equal(a, b)
    kernel(p, g, *state, *c)  # the same arrays, sized right: updated
    assert not np.array_equal(p[0], before[0])


def test_a_kernel_refuses_another_dtype_before_any_write():
    errors = pytest.importorskip("numba.core.errors")
    kernel, p, g, state, c = kernel_call(Adam, {"lr": 0.1}, np.float32, [4])
    before = [a.copy() for a in (*p, *state)]
    wide = (g[0].astype(np.float64), *(np.empty(0) for _ in g[1:]))
    with pytest.raises(errors.TypingError, match="do not match"):
        kernel(p, wide, *state, *c)
    with pytest.raises(errors.TypingError, match="given where"):
        kernel(p, g, state[0].astype(np.float64), *state[1:], *c)
    with pytest.raises(errors.TypingError, match="given where"):
        kernel(p, g, state[0].reshape(2, 2), *state[1:], *c)
    for a, b in zip((*p, *state), before):
        np.testing.assert_array_equal(a, b)


def test_each_kernel_compiles_one_specialisation_per_dtype():
    # Writable and read-only gradients, float32 and float64, strided ones: the kernels
    # always get GROUP-tuples of writable parameters and read-only C-contiguous gradients.
    kernels = fused._kernels()
    for dtype in (np.float32, np.float64):
        for writable in (True, False):
            for cls, kwargs in CASES:
                plist = ParamList.of_pack([np.ones((3, 4), dtype), np.ones(5, dtype)])
                grads = [np.ones((4, 3), dtype).T, np.ones(5, dtype)]
                for gr in grads:
                    gr.flags.writeable = writable
                cls(plist, **kwargs).step(grads)
    for name in ("adam", "sgd", "rmsprop", "adagrad", "nonfinite"):
        signatures = getattr(kernels, name).signatures
        assert 1 <= len(signatures) <= 2, (name, signatures)
        for sig in signatures:
            p, g = (sig[0], sig[0]) if name == "nonfinite" else (sig[0], sig[1])
            assert len(p) == len(g) == fused.GROUP
            assert p.dtype.layout == g.dtype.layout == "C" and p.dtype.ndim == 1
            assert name == "nonfinite" or p.dtype.mutable
            assert not g.dtype.mutable


# -- the finiteness check (C6) ------------------------------------------------------------
def first_nonfinite(arrays: list[np.ndarray]) -> int | None:
    n = len(arrays)
    layout = fused.Layout(range(10, 10 + n), [a.size for a in arrays], [0] * n, arrays[0].dtype)
    return fused.GradientTable(layout, arrays).first_nonfinite()


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_the_check_finds_every_position(small_chunks, dtype, bad):
    arrays = [np.ones(n, dtype) for n in (0, 3, 1000, 5, 2049)]
    assert first_nonfinite(arrays) is None
    for k, a in enumerate(arrays):
        for j in sorted({0, a.size // 4, a.size // 2, a.size - 2, a.size - 1}):
            if 0 <= j < a.size:
                a[j] = bad
                assert first_nonfinite(arrays) == 10 + k, (k, j)  # the slot
                a[j] = 1
    big = np.full((5, 2), np.finfo(dtype).max, dtype)  # finite, however large
    assert first_nonfinite([big, big[:, 0]]) is None  # the second one strided
    big[3, 0] = bad
    assert first_nonfinite([big[:, 1], big[:, 0]]) == 11


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_the_check_finds_every_position_of_every_short_size(dtype):
    # The kernel reads the four quarters side by side, then the tail after them.
    for n in range(41):
        for j in range(n):
            a = np.ones(n, dtype)
            a[j] = np.nan
            assert first_nonfinite([np.ones(3, dtype), a]) == 11, (n, j)


def steps_with(grads_of, steps: int = 3) -> tuple:
    """``state_bytes`` after Adam steps on the gradients ``grads_of(k)`` of step ``k``."""
    plist = ParamList.of_pack([np.full(n, 0.5, np.float32) for n in (700, 3, 1500)])
    opt = Adam(plist, lr=0.1)
    for k in range(steps):
        opt.step(grads_of(k))
    return state_bytes(opt)


def test_a_caller_passing_the_same_arrays_every_step_is_read_afresh(small_chunks):
    # Gradient buffers the caller owns and refills in place between steps (the views of
    # contiguous ones are kept from step to step; a strided one is copied every step):
    # each step reads their current values.
    g = np.random.default_rng(4)
    values = [[g.standard_normal(n).astype(np.float32) for n in (700, 3, 1500)] for _ in "abc"]
    buffers = [np.empty(700, np.float32), np.empty(3, np.float32), np.empty(3000, np.float32)[::2]]

    def refilled(k):
        for buf, v in zip(buffers, values[k]):
            buf[...] = v
        return buffers

    assert steps_with(refilled) == steps_with(lambda k: [v.copy() for v in values[k]])


@pytest.mark.parametrize(
    "layout",
    ["columns of a wider array", "fortran order", "reversed rows", "broadcast row"],
)
def test_a_refilled_2d_buffer_that_flattens_to_a_copy_is_read_afresh(small_chunks, layout):
    # Such a buffer flattens to a new copy at every step, never to a view of its memory:
    # a step once kept the copy made at the second step and read it ever after.
    shape = (40, 35)
    if layout == "columns of a wider array":
        source = np.empty((40, 70), np.float32)
        grad = source[:, :35]
    elif layout == "fortran order":
        grad = source = np.empty(shape, np.float32, order="F")
    elif layout == "reversed rows":
        source = np.empty(shape, np.float32)
        grad = source[::-1]
    else:
        source = np.empty((1, 35), np.float32)
        grad = np.broadcast_to(source, shape)
    values = np.random.default_rng(5).standard_normal((4,) + shape).astype(np.float32)
    plist = ParamList.of_pack([np.zeros(shape, np.float32)])
    opt = Adam(plist, lr=0.1)
    twin = ParamList.of_pack([np.zeros(shape, np.float32)])
    twin_opt = Adam(twin, lr=0.1)
    for v in values:
        if grad.flags.writeable:
            grad[...] = v
        else:
            source[...] = v[:1]
        opt.step([grad])
        twin_opt.step([np.array(grad)])
        np.testing.assert_array_equal(plist[0].value, twin[0].value)


def test_a_nan_written_into_a_kept_gradient_buffer_is_found(small_chunks):
    plist = ParamList.of_pack([np.full(n, 0.5, np.float32) for n in (700, 1500)])
    opt = Adam(plist, lr=0.1)
    buffers = [np.ones(700, np.float32), np.ones(1500, np.float32)]
    opt.step(buffers)
    before = state_bytes(opt)
    buffers[1][1499] = np.nan
    with pytest.raises(NonFiniteError, match="slot 1"):
        opt.step(buffers)
    assert state_bytes(opt) == before


def test_a_gradient_whose_layout_changed_in_place_is_read_in_its_new_layout(small_chunks):
    grid = np.arange(16, dtype=np.float32).reshape(4, 4) / 16
    plist = ParamList.of_pack([np.zeros((4, 4), np.float32)])
    opt = SGD(plist, lr=1.0)
    opt.step([grid])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        try:
            grid.strides = grid.strides[::-1]  # the same object now reads as the transpose
        except AttributeError:
            pytest.skip("this NumPy no longer sets strides in place")
    opt.step([grid])
    want = -(np.arange(16, dtype=np.float32).reshape(4, 4) / 16)
    np.testing.assert_array_equal(plist[0].value, want + want.T)


@pytest.mark.parametrize("writable", [False, True], ids=["read-only", "writable"])
def test_a_step_keeps_no_gradient_array_that_is_new_at_every_step_alive(small_chunks, writable):
    # Read-only as backward hands gradients out, writable as a clipped copy: arrays new
    # at every step live only as long as the caller keeps them.
    plist = ParamList.of_pack([np.ones(600, np.float32), np.ones(900, np.float32)])
    opt = Adam(plist, lr=0.1)
    watched = []
    for _ in range(3):
        grads = [np.ones(600, np.float32), np.ones(900, np.float32)]
        for gr in grads:
            gr.flags.writeable = writable
        opt.step(grads)
        watched += [weakref.ref(gr) for gr in grads]
        del grads, gr
    gc.collect()
    assert [k for k, ref in enumerate(watched) if ref() is not None] == []


def test_a_layout_groups_consecutive_rows_of_one_run(small_chunks):
    # CHUNK_MIN 512: up to GROUP (8) rows of one run and 2048 elements per kernel call; a
    # larger row is cut into parts; empty rows ride along.
    sizes = [3, 100, 0, 120, 300, 5, 2049, 7, 9, 128] + [1] * 9
    runs = [0] * 8 + [1] * 11
    layout = fused.Layout(range(len(sizes)), sizes, runs, np.dtype(np.float32))
    assert fused.GROUP == 8
    assert layout.pieces == [
        fused.Piece(0, 6, 0, 528),
        fused.Piece(6, 7, 0, 1024),
        fused.Piece(6, 7, 1024, 2049),
        fused.Piece(7, 8, 0, 7),
        fused.Piece(8, 16, 0, 143),
        fused.Piece(16, 19, 0, 3),
    ]
    assert [len(layout.of_run[r]) for r in (0, 1)] == [4, 2]


@pytest.mark.parametrize("mode", ["raise", "skip"])
def test_a_nonfinite_gradient_changes_nothing_on_either_path(monkeypatch, small_chunks, mode):
    outcomes = []
    for enabled in (True, False):
        monkeypatch.setattr(_numba, "ENABLED", enabled)
        plist = make_list(np.float32)
        opt = Adam(plist, lr=0.1, nonfinite=mode)
        g = np.random.default_rng(2)
        opt.step(gradients(plist, g))
        before = state_bytes(opt)
        grads = gradients(plist, g)
        grads[5][2500] = np.nan
        grads[3][...] = np.inf  # slot 3 comes first: the error names it
        if mode == "raise":
            with pytest.raises(NonFiniteError, match=r"slot 3 \('s'\)") as info:
                opt.step(grads)
            outcomes.append(str(info.value))
        else:
            opt.step(grads)
            assert opt.skipped_steps == 1
        assert state_bytes(opt) == before
        assert opt.step_count == 1
    if mode == "raise":
        assert outcomes[0] == outcomes[1]


def test_finite_gradients_whose_squares_overflow_pass_the_check_on_either_path(monkeypatch):
    # Finiteness is decided by the values: 1e200 squared overflows float64, yet both
    # paths update with it (as torch does), and both refuse an infinity beside it (C6).
    outcomes = []
    for enabled in (True, False):
        monkeypatch.setattr(_numba, "ENABLED", enabled)
        p = Param(np.zeros(4))
        opt = SGD([p], lr=1e-300)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            opt.step([np.array([1e200, 1.0, 2.0, 3.0])])
        outcomes.append(p.value.tobytes())
        with pytest.raises(NonFiniteError, match="slot 0"):
            opt.step([np.array([1e200, 1.0, np.inf, 3.0])])
        assert p.value.tobytes() == outcomes[-1] and opt.step_count == 1
    np.testing.assert_array_equal(p.value, [-1e-100, -1e-300, -2e-300, -3e-300])
    assert outcomes[0] == outcomes[1]


# -- gradients sharing memory with what a step writes ---------------------------------------
def two_steps(grads_of, copy: bool) -> list[np.ndarray]:
    """Values after two Adam steps, the second one's gradients ``grads_of(plist, opt)``."""
    g = np.random.default_rng(3)
    plist = ParamList.of_pack([g.standard_normal(n).astype(np.float32) for n in (3000, 3000, 5)])
    opt = Adam(plist, lr=0.1)
    opt.step([np.ones(p.shape, np.float32) for p in plist])
    grads = grads_of(plist, opt)
    opt.step([np.array(x, copy=True) for x in grads] if copy else grads)
    return [p.value.copy() for p in plist]


@pytest.mark.parametrize(
    "grads_of",
    [
        lambda plist, opt: [p.value for p in plist],  # each its own storage's array
        lambda plist, opt: [plist[1].value, plist[0].value, plist[2].value],  # crossed
        lambda plist, opt: [opt.state[i]["exp_avg"] for i in range(3)],  # the state
        lambda plist, opt: [
            np.frombuffer(memoryview(plist[k].value), np.float32) for k in (1, 0, 2)
        ],
    ],
    ids=["own-value", "other-value", "state", "other-through-a-buffer"],
)
def test_gradients_that_alias_parameters_or_state_are_read_before_any_write(
    small_chunks, fused_calls, grads_of
):
    expected = two_steps(grads_of, copy=True)
    got = two_steps(grads_of, copy=False)
    assert fused_calls[0] == 4
    for value, want in zip(got, expected):
        np.testing.assert_array_equal(value, want)


@pytest.mark.parametrize("dtype", [np.float16, np.float32])
@pytest.mark.parametrize(
    "make, name",
    [
        (lambda p: SGD([p], lr=0.1, momentum=0.9), "momentum_buffer"),
        (lambda p: Adam([p], lr=0.1, eps=1e-3), "exp_avg"),
    ],
    ids=["sgd-momentum", "adam"],
)
def test_on_the_numpy_rules_a_gradient_that_is_the_state_is_read_before_any_write(
    monkeypatch, dtype, make, name
):
    # float16 always takes the NumPy rules; float32 does without numba. The rules write
    # the state before they read the gradient, so a gradient in the state is copied first.
    monkeypatch.setattr(_numba, "ENABLED", False)

    def second_step(copy: bool) -> np.ndarray:
        p = Param(np.linspace(-1.0, 1.0, 3000).astype(dtype))
        opt = make(p)
        opt.step([np.full(p.shape, 0.5, dtype)])
        g = opt.state[0][name]
        opt.step([g.copy() if copy else g])
        return p.value.copy()

    np.testing.assert_array_equal(second_step(copy=False), second_step(copy=True))


# -- threads and processes ----------------------------------------------------------------
def test_concurrent_steps_from_two_threads_match_sequential_steps(small_chunks):
    def train(seed: int) -> list[bytes]:
        g = np.random.default_rng(seed)
        plist = ParamList.of_pack([g.standard_normal(4000).astype(np.float32) for _ in range(3)])
        opt = RMSprop(plist, lr=0.01, momentum=0.5)
        for _ in range(20):
            opt.step([g.standard_normal(4000).astype(np.float32) for _ in range(3)])
        return [p.value.tobytes() for p in plist]

    expected = [train(0), train(1)]
    results: list = [None, None]
    workers = [
        threading.Thread(target=lambda i=i: results.__setitem__(i, train(i))) for i in (0, 1)
    ]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    assert results == expected


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_a_forked_child_steps_after_its_parent_used_the_threads(small_chunks):
    g = np.random.default_rng(4)
    plist = ParamList.of_pack([g.standard_normal(5000).astype(np.float32)])
    opt = SGD(plist, lr=0.5)
    grad = np.ones(5000, np.float32)
    opt.step([grad])  # starts the pool in the parent
    expected = plist[0].value - np.float32(0.5)
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: one more step on its own pool, then report
        try:
            opt.step([grad])
            right = np.array_equal(plist[0].value, expected)
            threads = _threads._pool._threads  # the child's own pool, its threads alive
            right = right and bool(threads) and all(t.is_alive() for t in threads)
            os.write(write, b"ok" if right else b"bad")
        finally:
            os._exit(0)
    os.close(write)
    deadline = time.monotonic() + 60
    while os.waitpid(pid, os.WNOHANG) == (0, 0):
        if time.monotonic() > deadline:
            os.kill(pid, 9)
            pytest.fail("the forked child hung in its optimizer step")
        time.sleep(0.01)
    assert os.read(read, 16) == b"ok"
    os.close(read)


# -- the switch and the fallback ----------------------------------------------------------
@pytest.mark.parametrize("value, enabled", [("1", False), ("0", True), ("", True)])
def test_the_environment_switch(value, enabled):
    env = dict(os.environ, **{_numba.ENV_SWITCH: value})
    code = "from tiegrad.optim import fused; print(fused._kernels() is not None)"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert out.stdout.strip() == str(enabled)


def test_without_numba_the_numpy_rules_run(monkeypatch, fused_calls):
    monkeypatch.setattr(fused, "_kernels", lambda: None)
    assert not fused.supports(np.dtype(np.float32))
    plist = ParamList.of_pack([np.ones(3, np.float32)])
    SGD(plist, lr=0.25).step([np.ones(3, np.float32)])
    assert fused_calls[0] == 0
    np.testing.assert_array_equal(plist[0].value, np.full(3, 0.75, np.float32))


def test_a_numba_that_does_not_import_warns_and_falls_back(monkeypatch):
    def broken(name, package=None):
        raise ImportError("numba needs another NumPy")

    monkeypatch.setattr(_numba.importlib, "import_module", broken)
    with pytest.warns(RuntimeWarning, match="numba is installed but does not import"):
        assert _numba._load.__wrapped__("tiegrad.optim.kernels") is None


_TEAM_CHILD = """
import os
import torch  # GNU OpenMP first: oneMKL then runs its products on it, as beside PyTorch
import numpy as np
from tiegrad import NonFiniteError, ParamList
from tiegrad.backend import blas
from tiegrad.optim import Adam, fused
blas.matmul(np.ones((64, 64), np.float32), np.ones((64, 64), np.float32))
if fused._team() is None:
    print("SKIP: oneMKL is not on GNU OpenMP here, or numba's threading layer is not omp")
    raise SystemExit(0)
g = np.random.default_rng(3)
sizes = [300000, 7, 131072, 5000, 70000, 262144 * 3 + 11]
values = [g.standard_normal(n).astype(np.float32) for n in sizes]
grads = [g.standard_normal(n).astype(np.float32) for n in sizes]
def steps(amsgrad):
    plist = ParamList.of_pack([v.copy() for v in values])
    opt = Adam(plist, lr=0.01, weight_decay=0.1, amsgrad=amsgrad)
    for _ in range(3):
        opt.step(grads)
    bad = [x.copy() for x in grads]
    bad[5][-1] = np.nan
    before = [p.value.copy() for p in plist]
    try:
        opt.step(bad)
        raise AssertionError("a NaN passed the check")
    except NonFiniteError as e:
        assert "5" in str(e), str(e)
    assert all(a.tobytes() == p.value.tobytes() for a, p in zip(before, plist))
    return [p.value.tobytes() for p in plist]
for amsgrad in (False, True):
    os.environ["TIEGRAD_NUM_THREADS"] = "1"
    want = steps(amsgrad)
    os.environ.pop("TIEGRAD_NUM_THREADS")
    assert steps(amsgrad) == want, amsgrad
kernels = fused._kernels()
assert kernels.adam_blocks.signatures and kernels.nonfinite_blocks.signatures
print("OK")
"""


def test_steps_on_mkls_openmp_team_give_the_bits_of_one_thread():
    pytest.importorskip("torch")
    env = {k: v for k, v in os.environ.items() if k != "TIEGRAD_NUM_THREADS"}
    env.update(OMP_NUM_THREADS="2", MKL_NUM_THREADS="2", NUMBA_NUM_THREADS="2")
    if blas.INSTALLED:  # oneMKL whatever the CPU: the team is its OpenMP team
        env["TIEGRAD_BLAS"] = "mkl"
    proc = subprocess.run(
        [sys.executable, "-c", _TEAM_CHILD], capture_output=True, text=True, env=env, timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    if proc.stdout.startswith("SKIP"):
        pytest.skip(proc.stdout.strip())
    assert proc.stdout.strip().endswith("OK"), proc.stdout
