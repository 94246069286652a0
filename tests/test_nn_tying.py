"""Tying, untying and freezing by path, with per-use freezing of a tied weight (C1, C4, C5).

A tied weight frozen at one use receives exactly the gradient of its trainable use:
PyTorch can only express that by writing the frozen use as ``.detach()`` by hand
(docs/design.md: why per-use trainability), which is the oracle here.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tiegrad import AliasError, DTypeError, EagerSession, Param, ShapeError, SlotError, ops
from tiegrad import nn as tnn

torch = pytest.importorskip("torch")

V, D = 6, 4
IDS = np.array([[0, 2, 2, 5], [1, 0, 3, 3]])


class TinyTied(tnn.Module):
    """``logits = tanh(embed[idx]) @ embed.T`` through a ``head`` tied to ``embed``."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = tnn.Embedding(V, D, rng=np.random.default_rng(0), dtype="float64")
        self.head = tnn.Linear(D, V, bias=False, dtype="float64")
        tnn.tie(self, "head.weight", "embed.weight")

    def forward(self, session, idx):
        return self.head(session, ops.tanh(self.embed(session, idx)))


def tiegrad_grad(model: tnn.Module) -> np.ndarray:
    s = EagerSession()
    logits = model(s, IDS)
    grads = s.backward(ops.cross_entropy(logits, IDS))
    return model.named_gradients(grads)


def torch_grad(value: np.ndarray, detach_embedding: bool, detach_head: bool) -> np.ndarray:
    e = torch.tensor(value, requires_grad=True)
    rows = (e.detach() if detach_embedding else e)[torch.from_numpy(IDS)]
    logits = torch.tanh(rows) @ (e.detach() if detach_head else e).T
    torch.nn.functional.cross_entropy(
        logits.reshape(-1, V), torch.from_numpy(IDS).reshape(-1)
    ).backward()
    return e.grad.numpy()


def test_tie_shares_storage_and_sums_both_uses():
    m = TinyTied()
    assert m.head.weight.storage is m.embed.weight.storage and m.head.weight is not m.embed.weight
    assert m.aliases() == {"embed.weight": ["head.weight"]}
    g = tiegrad_grad(m)
    assert list(g) == ["embed.weight"]
    want = torch_grad(m.embed.weight.value, False, False)
    np.testing.assert_allclose(g["embed.weight"], want, rtol=1e-10, atol=1e-13)


@pytest.mark.parametrize("frozen", ["head.weight", "embed.weight"])
def test_a_tied_weight_frozen_at_one_use_gets_exactly_the_other_uses_gradient(frozen):
    m = TinyTied()
    assert m.freeze(frozen) == [frozen]
    assert m.get_parameter(frozen).storage is m.embed.weight.storage  # the tie survives
    trainable = [(path, p) for path, p in m.named_parameters() if p.requires_grad]
    assert [path for path, _ in trainable] == ["embed.weight"]  # the name stays put
    trained = "head.weight" if frozen == "embed.weight" else "embed.weight"
    assert trainable[0][1] is m.get_parameter(trained)  # the handle of the trained use
    g = tiegrad_grad(m)["embed.weight"]
    want = torch_grad(m.embed.weight.value, frozen == "embed.weight", frozen == "head.weight")
    np.testing.assert_allclose(g, want, rtol=1e-10, atol=1e-13)
    both = torch_grad(m.embed.weight.value, False, False)
    assert not np.allclose(g, both)  # the frozen use really contributed something


def test_tie_with_requires_grad_false_installs_a_frozen_alias():
    m = TinyTied()
    handle = tnn.tie(m, "head.weight", "embed.weight", requires_grad=False)
    assert m.head.weight is handle and not handle.requires_grad and m.embed.weight.requires_grad
    pl = m.param_list()
    assert pl.requires_grad_array() == [True, False]
    assert pl.canonical_slot_indices() == [0, None]  # C5: frozen slots map to none
    want = torch_grad(m.embed.weight.value, False, True)
    np.testing.assert_allclose(tiegrad_grad(m)["embed.weight"], want, rtol=1e-10, atol=1e-13)


def test_sgd_step_moves_the_storage_once_by_the_trainable_use_only():
    m = TinyTied()
    m.freeze("head.weight")
    before = m.embed.weight.value.copy()
    s = EagerSession()
    grads = s.backward(ops.cross_entropy(m(s, IDS), IDS))
    s.sgd_step(0.5, grads)
    want = before - 0.5 * torch_grad(before, False, True)
    np.testing.assert_allclose(m.head.weight.value, want, rtol=1e-10, atol=1e-13)
    assert m.head.weight.storage is m.embed.weight.storage


def test_a_weight_frozen_at_every_path_is_not_updated():
    m = TinyTied()
    assert m.freeze("*.weight") == ["embed.weight", "head.weight"]
    before = m.embed.weight.value.copy()
    s = EagerSession()
    grads = s.backward(ops.cross_entropy(m(s, IDS), IDS))
    assert m.named_gradients(grads) == {}
    s.sgd_step(0.5, grads)
    m.param_list().sgd_step(0.5, [np.ones((V, D)), np.ones((V, D))])
    np.testing.assert_array_equal(m.embed.weight.value, before)
    assert m.unfreeze("head.*") == ["head.weight"]
    assert m.param_list().requires_grad_array() == [False, True]


def test_untie_gives_the_path_a_copy():
    m = TinyTied()
    m.freeze("head.weight")
    fresh = tnn.untie(m, "head.weight")
    assert m.head.weight is fresh and fresh.storage is not m.embed.weight.storage
    assert not fresh.requires_grad and fresh.name == "head.weight"
    np.testing.assert_array_equal(fresh.value, m.embed.weight.value)
    fresh.set_value(np.zeros((V, D)))
    assert m.embed.weight.value.any()
    assert m.aliases() == {}
    with pytest.raises(AliasError, match="'head.weight' .* shares its storage with no other path"):
        tnn.untie(m, "head.weight")


def test_an_optimizer_built_before_a_tie_trains_the_tied_storage_once():  # C4, C5
    from tiegrad.optim import AdamW

    m = tnn.Module()
    m.a, m.b = Param(np.ones(3)), Param(np.full(3, 2.0))
    opt = AdamW(m.parameters(), lr=0.1)

    def step():
        s = EagerSession()
        loss = ops.sum(s.use(m.a) * 3.0 + s.use(m.b) * s.use(m.b))
        opt.step(s.backward(loss))

    step()
    handle = m.b
    assert tnn.tie(m, "b", "a") is handle and handle.storage is m.a.storage
    step()  # the optimizer holds the handle at 'b': one storage, its gradient 3 + 2a
    state = opt.state_dict()["state"]
    assert list(state) == [0] and state[0]["step"] == 2
    assert opt.params.canonical_slot_indices() == [0, 0]


# -- bad input (C6: nothing changes) -----------------------------------------------------
def test_tying_different_shapes_names_both_paths_and_shapes():
    m = tnn.Module()
    m.a, m.b = tnn.Linear(3, 4), tnn.Linear(4, 3)
    with pytest.raises(ShapeError) as err:
        tnn.tie(m, "b.weight", "a.weight")
    assert "'b.weight' has shape (3, 4)" in str(err.value)
    assert "'a.weight' has shape (4, 3)" in str(err.value)
    assert m.aliases() == {}
    m.c = tnn.Linear(3, 4, dtype="float64")
    with pytest.raises(DTypeError, match="'c.weight' has dtype float64 but 'a.weight'"):
        tnn.tie(m, "c.weight", "a.weight")


@pytest.mark.parametrize("args", [("head.weight", "embd.weight"), ("head.w", "embed.weight")])
def test_tying_to_a_missing_path_names_it(args):
    m = TinyTied()
    before = m.named_slots()
    missing = args[0] if args[0] == "head.w" else args[1]
    with pytest.raises(SlotError, match=f"no parameter at path '{missing}'"):
        tnn.tie(m, *args)
    assert m.named_slots() == before


def test_a_pattern_that_matches_nothing_is_an_error_and_changes_nothing():
    m = TinyTied()
    with pytest.raises(SlotError, match=r"freeze: pattern 'blocks\.\*' matches no parameter path"):
        m.freeze("blocks.*")
    with pytest.raises(SlotError, match="unfreeze: pattern 'nope'"):
        m.unfreeze(["head.weight", "nope"])
    with pytest.raises(SlotError, match="non-empty collection"):
        m.freeze([])
    assert m.param_list().requires_grad_array() == [True, True]


def test_patterns_come_in_any_iterable():
    m = TinyTied()
    assert m.freeze({"head.weight"}) == ["head.weight"]
    assert m.unfreeze(p for p in ("head.weight",)) == ["head.weight"]
    assert m.param_list().requires_grad_array() == [True, True]
    with pytest.raises(SlotError, match="glob pattern"):
        m.freeze({"head.weight": 1, 2: 3})


def test_partial_freeze_of_a_submodule_registered_twice_is_refused():
    enc = tnn.Linear(2, 2)
    m = tnn.Module()
    m.left, m.right = enc, enc
    with pytest.raises(AliasError, match="'left.weight' and 'right.weight' are one handle"):
        m.freeze("left.weight")
    assert enc.weight.requires_grad
    assert m.freeze("*.weight") == ["left.weight", "right.weight"]


# -- property: ties, untie and freezes keep the alias map in step (C1, C5) --------------
OPS = st.lists(
    st.tuples(
        st.sampled_from(["tie", "untie", "freeze", "unfreeze"]),
        st.integers(0, 3),
        st.integers(0, 3),
    ),
    max_size=12,
)


@settings(max_examples=50, deadline=None)
@given(OPS)
def test_random_tie_untie_freeze_sequences_match_a_model(ops_seq):
    m = tnn.Module()
    for i in range(4):
        setattr(m, f"p{i}", Param(np.full(2, float(i), np.float32)))
    group = list(range(4))  # model: storage class per path
    flags = [True] * 4
    for op, i, j in ops_seq:
        path, src = f"p{i}", f"p{j}"
        if op == "tie":
            tnn.tie(m, path, src)
            group[i], flags[i] = group[j], flags[j]
        elif op == "untie":
            if sum(g == group[i] for g in group) == 1:
                with pytest.raises(AliasError):
                    tnn.untie(m, path)
            else:
                tnn.untie(m, path)
                group[i] = max(group) + 1
        else:
            getattr(m, op)(path)
            flags[i] = op == "unfreeze"
    slots = m.named_slots()
    assert [p.requires_grad for _, p in slots] == flags
    want: list[int | None] = [None] * 4
    seen: dict[int, int] = {}
    for k in range(4):
        if flags[k]:
            want[k] = seen.setdefault(group[k], k)
    assert m.param_list().canonical_slot_indices() == want
    assert len(list(m.named_parameters())) == len(set(group))
    for a in range(4):
        for b in range(4):
            assert (slots[a][1].storage is slots[b][1].storage) == (group[a] == group[b])
