"""PyTorch habits that work as written, or say what to do instead (issue 53).

A use is a path (PyTorch's ``m[2].weight = m[0].weight`` ties, and a flag set through
one path freezes that use alone, C4, C5); ``loss.backward()``, ``param.grad``,
``opt.zero_grad()``, ``requires_grad_`` and ``state_dict``/``load_state_dict`` behave as
a PyTorch user expects; attributes tiegrad spells otherwise name tiegrad's way.
"""

from __future__ import annotations

import gc
import warnings
import weakref

import numpy as np
import pytest

import tiegrad
from tiegrad import EagerSession, nn
from tiegrad.errors import (
    AliasError,
    DTypeError,
    HyperparameterError,
    MissingGradientError,
    ShapeError,
    SlotError,
)
from tiegrad.models import TiedLM
from tiegrad.nn import Linear, Sequential, Tanh
from tiegrad.optim import SGD, AdamW
from tiegrad.session import forget_latest_gradients

X = np.linspace(-1.0, 1.0, 8, dtype=np.float32).reshape(2, 4)


@pytest.fixture(autouse=True)
def no_latest_gradients():
    """Each test starts as a fresh thread would: no latest gradients, none unstepped."""
    forget_latest_gradients()


def assignment_tied() -> Sequential:
    """Two equal-shaped Linears tied PyTorch's way, nothing enumerated yet."""
    m = Sequential(
        Linear(4, 4, rng=np.random.default_rng(0)),
        Tanh(),
        Linear(4, 4, rng=np.random.default_rng(1)),
    )
    m[2].weight = m[0].weight
    return m


def snapshot(model: nn.Module) -> list[tuple[str, bytes, bool, int]]:
    """Every path's value bytes, flag and storage (by first path): what a refusal keeps."""
    first: dict[int, int] = {}
    return [
        (path, p.value.tobytes(), p.requires_grad, first.setdefault(id(p.storage), i))
        for i, (path, p) in enumerate(model.named_slots())
    ]


def tiny_lm(seed: int = 0) -> TiedLM:
    return TiedLM(11, d_model=8, n_layers=1, n_heads=2, max_seq_len=6, seed=seed)


def batch(seed: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, 11, (3, 7))
    return ids[:, :-1], ids[:, 1:]


# -- a use is a path ---------------------------------------------------------------------


def test_a_flag_set_through_one_path_of_an_assignment_tie_freezes_that_use_alone():  # C4
    m = assignment_tied()
    m[0].weight.requires_grad = False  # before anything enumerated the model
    assert m[0].weight is not m[2].weight
    assert m[0].weight.storage is m[2].weight.storage
    assert m[2].weight.requires_grad
    assert m.aliases() == {"0.weight": ["2.weight"]}
    report = nn.summary(m)
    row = next(line for line in report.splitlines() if "0.weight, 2.weight" in line)
    assert row.split()[3] == "0.weight"  # frozen at the first path only
    before = np.array(m[0].weight.value)
    opt = SGD(m.parameters(), lr=0.5)
    s = EagerSession()
    opt.step(s.backward((m(s, X) ** 2).mean()))
    assert not np.array_equal(m[0].weight.value, before)  # the use at 2.weight trains it
    assert m.param_list().requires_grad_array() == [False, True, True, True]


def test_an_assignment_tie_is_the_tie_nn_tie_makes():  # C1, C5
    assigned = assignment_tied()
    tied = Sequential(
        Linear(4, 4, rng=np.random.default_rng(0)),
        Tanh(),
        Linear(4, 4, rng=np.random.default_rng(1)),
    )
    nn.tie(tied, "2.weight", "0.weight")
    for m in (assigned, tied):
        m.freeze("2.weight")
    a, t = assigned.param_list(), tied.param_list()
    assert a.canonical_slot_indices() == t.canonical_slot_indices()
    assert a.requires_grad_array() == t.requires_grad_array()
    assert nn.summary(assigned) == nn.summary(tied)


def test_an_assignment_tie_round_trips_through_a_checkpoint(tmp_path):  # C9
    m = assignment_tied()
    m[0].weight.requires_grad_(False)
    opt = AdamW(m.parameters(), lr=1e-2)
    s = EagerSession()
    opt.step(s.backward((m(s, X) ** 2).mean()))
    tiegrad.save(tmp_path / "m.safetensors", m, optimizer=opt)
    fresh = Sequential(
        Linear(4, 4, rng=np.random.default_rng(5)),
        Tanh(),
        Linear(4, 4, rng=np.random.default_rng(6)),
    )
    fresh[2].weight = fresh[0].weight
    fresh[0].weight.requires_grad_(False)
    tiegrad.load(tmp_path / "m.safetensors", fresh, optimizer=AdamW(fresh.parameters(), lr=1e-2))
    assert fresh[2].weight.storage is fresh[0].weight.storage
    assert snapshot(fresh) == snapshot(m)


def test_the_same_handle_assigned_to_its_own_path_or_after_removal_is_not_aliased():
    m = Sequential(Linear(4, 4, rng=np.random.default_rng(0)))
    w = m[0].weight
    m[0].weight = w
    assert m[0].weight is w
    other = Sequential(Linear(4, 4, rng=np.random.default_rng(1)))
    m[0].weight = Tanh  # the path is no longer w's: a plain attribute now
    other[0].weight = w
    assert other[0].weight is w
    w.requires_grad = False
    assert not other[0].weight.requires_grad


def test_a_submodule_at_two_paths_still_shares_its_handles():
    inner = Linear(4, 4, rng=np.random.default_rng(0))
    m = Sequential(inner, Tanh(), inner)
    assert m[0].weight is m[2].weight
    with pytest.raises(AliasError, match="one handle"):
        m.freeze("0.weight")


# -- loss.backward(), param.grad, zero_grad ----------------------------------------------


def train(pytorch_style: bool, steps: int = 4) -> TiedLM:
    model = tiny_lm()
    model.freeze("embed.weight")
    opt = AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    for step in range(steps):
        s = EagerSession(seed=step)
        x, y = batch(step)
        loss = model.loss(s, x, y)
        if pytorch_style:
            loss.backward()
            opt.step()
            opt.zero_grad()
        else:
            opt.step(s.backward(loss))
    return model


def test_a_pytorch_style_loop_gives_the_explicit_loops_weights_bit_for_bit():
    ours, theirs = train(pytorch_style=True), train(pytorch_style=False)
    assert snapshot(ours) == snapshot(theirs)
    assert snapshot(ours) != snapshot(tiny_lm())


def test_param_grad_is_the_storages_summed_gradient_until_zero_grad():  # C4
    model = tiny_lm()
    opt = AdamW(model.parameters(), lr=1e-2)
    opt.zero_grad()
    embed = model.get_parameter("embed.weight")
    assert embed.grad is None
    s = EagerSession()
    x, y = batch(0)
    loss = model.loss(s, x, y)
    result = loss.backward()
    want = model.named_gradients(result)["embed.weight"]  # both uses summed
    np.testing.assert_array_equal(embed.grad, want)
    np.testing.assert_array_equal(model.get_parameter("lm_head.weight").grad, want)
    with pytest.raises(ValueError, match="read-only"):
        embed.grad[0, 0] = 1.0
    opt.step()
    np.testing.assert_array_equal(embed.grad, want)  # a step does not clear it, as in torch
    opt.zero_grad()
    assert embed.grad is None
    with pytest.raises(MissingGradientError, match="zero_grad"):
        opt.step()


def test_zero_grad_frees_the_latest_gradients_as_set_to_none_frees_grad():
    """The session lets go of them too: a loop that clears before its forward, as
    PyTorch's, holds no gradients while it records the next step."""
    model = tiny_lm()
    opt = AdamW(model.parameters(), lr=1e-2)
    s = EagerSession()
    model.loss(s, *batch(0)).backward()
    opt.step()
    alive = [weakref.ref(g) for g in s.last_gradients.values()]
    opt.zero_grad()
    assert s.last_gradients is None
    loss = model.loss(s, *batch(1))  # the next forward
    gc.collect()
    assert alive and not any(ref() is not None for ref in alive)
    loss.backward()
    opt.step()


def test_param_grad_of_a_storage_the_backward_did_not_reach_is_none():
    model = tiny_lm()
    unused = tiegrad.Param(np.ones(3, np.float32))
    s = EagerSession()
    model.loss(s, *batch(0)).backward()
    assert unused.grad is None


def test_a_second_loss_backward_before_a_step_warns_that_nothing_accumulates():
    model = tiny_lm()
    opt = SGD(model.parameters(), lr=0.1)
    opt.zero_grad()
    s = EagerSession()
    model.loss(s, *batch(0)).backward()
    with pytest.warns(RuntimeWarning, match="does not add them up"):
        model.loss(s, *batch(1)).backward()
    opt.step()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        model.loss(s, *batch(2)).backward()  # after a step: the ordinary loop
        opt.zero_grad()
        model.loss(s, *batch(3)).backward()


def test_requires_grad_underscore_sets_the_flag_of_this_use_and_returns_the_handle():
    m = assignment_tied()
    assert m[2].weight.requires_grad_(False) is m[2].weight
    assert [p.requires_grad for _, p in m.named_slots()] == [True, True, False, True]
    with pytest.raises(HyperparameterError, match="True or False"):
        m[2].weight.requires_grad_(0)
    assert m.requires_grad_(False) is m
    assert not any(p.requires_grad for _, p in m.named_slots())
    assert all(p.requires_grad for _, p in m.requires_grad_().named_slots())


# -- state_dict / load_state_dict --------------------------------------------------------


def test_state_dict_names_every_path_and_a_tie_once_as_one_array():  # C1
    model = tiny_lm()
    sd = model.state_dict()
    assert list(sd) == [path for path, _ in model.named_slots()]
    assert sd["embed.weight"] is sd["lm_head.weight"]
    assert sd["embed.weight"].flags.writeable
    sd["embed.weight"][0, 0] += 1.0  # an owned copy: the model does not change
    assert model.get_parameter("embed.weight").value[0, 0] != sd["embed.weight"][0, 0]


def test_a_state_dict_round_trips_into_a_fresh_tied_model():  # C1, C6
    model = train(pytorch_style=False)
    fresh = tiny_lm(seed=3)
    assert fresh.load_state_dict(model.state_dict()) == ([], [])
    assert fresh.aliases() == {"embed.weight": ["lm_head.weight"]}
    values = [(path, p.value.tobytes()) for path, p in fresh.named_slots()]
    assert values == [(path, p.value.tobytes()) for path, p in model.named_slots()]


def test_a_state_dict_from_pytorch_loads_with_its_tie():
    torch = pytest.importorskip("torch")
    model = tiny_lm()
    theirs = {k: torch.from_numpy(v.copy()) for k, v in tiny_lm(seed=4).state_dict().items()}
    model.load_state_dict({k: t.numpy() for k, t in theirs.items()})
    np.testing.assert_array_equal(
        model.get_parameter("lm_head.weight").value, theirs["lm_head.weight"].numpy()
    )


@pytest.mark.parametrize(
    "mutate, error, match",
    [
        (lambda sd: {**sd, "extra": np.zeros(1, np.float32)}, SlotError, "unexpected keys 'extra'"),
        (
            lambda sd: {k: v for k, v in sd.items() if k != "ln_f.bias"},
            SlotError,
            "missing keys 'ln_f.bias'",
        ),
        (lambda sd: {**sd, "ln_f.bias": np.zeros(3, np.float32)}, ShapeError, "ln_f.bias"),
        (lambda sd: {**sd, "ln_f.bias": np.zeros(8)}, DTypeError, "float32"),
        (
            lambda sd: {**sd, "lm_head.weight": sd["lm_head.weight"] + 1},
            AliasError,
            "'embed.weight' and 'lm_head.weight' are one storage",
        ),
        (lambda sd: list(sd.items()), SlotError, "mapping"),
    ],
    ids=["unexpected", "missing", "shape", "dtype", "tie-differs", "not-a-mapping"],
)
def test_a_bad_load_state_dict_changes_nothing(mutate, error, match):  # C6
    model = tiny_lm()
    sd = mutate(tiny_lm(seed=7).state_dict())
    before = snapshot(model)
    with pytest.raises(error, match=match):
        model.load_state_dict(sd)
    assert snapshot(model) == before


def test_non_strict_loads_the_paths_that_match_and_returns_the_rest():
    model, source = tiny_lm(), tiny_lm(seed=7)
    sd = {k: v for k, v in source.state_dict().items() if k != "embed.weight"}
    sd["extra"] = np.zeros(1, np.float32)
    missing, unexpected = model.load_state_dict(sd, strict=False)
    assert (missing, unexpected) == (["embed.weight"], ["extra"])
    # the tie's other path carried the value: the one storage has it
    np.testing.assert_array_equal(
        model.get_parameter("embed.weight").value, source.get_parameter("embed.weight").value
    )


def test_a_strict_refusal_names_a_few_keys_then_counts_the_rest():
    model = tiny_lm()
    with pytest.raises(SlotError) as err:
        model.load_state_dict({})
    assert "more" in str(err.value) and len(str(err.value)) < 400


# -- what stays different says what to do ------------------------------------------------


@pytest.mark.parametrize(
    "get, hint",
    [
        (lambda m, loss: loss.grad, "grads[ref]"),
        (lambda m, loss: loss.data, "ref.value"),
        (lambda m, loss: loss.to("cuda"), "EagerSession(device="),
        (lambda m, loss: loss.detach(), "ref.numpy()"),
        (lambda m, loss: m.get_parameter("ln_f.bias").data, "p.value"),
        (lambda m, loss: m.get_parameter("ln_f.bias").cuda(), "p.to('cuda')"),
        (lambda m, loss: m.get_parameter("ln_f.bias").item(), "p.value.item()"),
        (lambda m, loss: m.cuda(), "module.to('cuda')"),
        (lambda m, loss: m.zero_grad(), "optimizer.zero_grad()"),
    ],
)
def test_a_pytorch_attribute_tiegrad_spells_otherwise_names_tiegrads_way(get, hint):
    model = tiny_lm()
    loss = model.loss(EagerSession(), *batch(0))
    with pytest.raises(AttributeError) as err:
        get(model, loss)
    assert hint in str(err.value)
    assert not hasattr(loss, "grad") and hasattr(loss, "item")


def test_a_dropped_model_frees_its_storages_without_the_garbage_collector():
    import gc
    import weakref

    m = assignment_tied()
    alive = weakref.ref(m[0].weight.storage)
    gc.disable()
    try:
        del m
        assert alive() is None  # a handle refers to its module weakly: no cycle
    finally:
        gc.enable()


def test_copies_of_a_module_hold_their_own_handles():  # C1
    import copy
    import pickle

    for twin in (copy.deepcopy(assignment_tied()), pickle.loads(pickle.dumps(assignment_tied()))):
        assert twin[2].weight.storage is twin[0].weight.storage
        other = Sequential(Linear(4, 4, rng=np.random.default_rng(2)))
        other[0].weight = twin[0].weight  # a handle a copy holds is a second use elsewhere
        assert other[0].weight is not twin[0].weight


def test_a_skipped_step_counts_as_a_step_for_the_accumulation_warning():
    model = tiny_lm()
    opt = SGD(model.parameters(), lr=0.1, nonfinite="skip")
    opt.zero_grad()
    s = EagerSession()
    (model.loss(s, *batch(0)) * float("nan")).backward()
    opt.step()
    assert opt.skipped_steps == 1
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        model.loss(s, *batch(1)).backward()


def test_state_dict_reads_a_newer_device_mirror():  # C7
    torch = pytest.importorskip("torch")
    m = assignment_tied()
    w = m[0].weight
    newer = np.full(w.shape, 3.0, np.float32)
    w.set_device_value(torch.from_numpy(newer))  # the host is now stale
    sd = m.state_dict()
    np.testing.assert_array_equal(sd["0.weight"], newer)
    assert sd["2.weight"] is sd["0.weight"]


def test_param_grad_of_a_storage_used_once_is_the_array_backward_produced():  # C4
    w = tiegrad.Param(np.arange(3.0, dtype=np.float32))
    s = EagerSession()
    use = s.use(w)
    grads = (use * use).sum().backward()
    assert np.shares_memory(w.grad, grads[use])  # a read-only view, no copy or sum
    np.testing.assert_array_equal(w.grad, 2 * np.arange(3.0))
