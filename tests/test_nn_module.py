"""The module system: registration by attribute, slot order, paths and handles (C1, C5)."""

from __future__ import annotations

import numpy as np
import pytest

from tiegrad import (
    DTypeError,
    EagerSession,
    Param,
    ParamList,
    ShapeError,
    SlotError,
    TapeError,
    TiegradError,
)
from tiegrad import nn as tnn


class Tower(tnn.Module):
    """Own parameter first, then submodules: exercises the documented slot order."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = tnn.Linear(3, 4, rng=np.random.default_rng(1))
        self.scale = Param(np.ones(4, np.float32))
        self.heads = tnn.ModuleList(
            [tnn.Linear(4, 2, rng=np.random.default_rng(i)) for i in (2, 3)]
        )

    def forward(self, session, x):
        h = self.fc(session, x) * session.use(self.scale)
        return [head(session, h) for head in self.heads]


def test_slot_order_is_own_parameters_then_submodules_depth_first():
    paths = [p for p, _ in Tower().named_slots()]
    assert paths == [
        "scale",
        "fc.weight",
        "fc.bias",
        "heads.0.weight",
        "heads.0.bias",
        "heads.1.weight",
        "heads.1.bias",
    ]


def test_param_list_holds_the_modules_own_handles_named_by_path():
    m = Tower()
    pl = m.param_list()
    assert isinstance(pl, ParamList) and len(pl) == 7
    assert pl[1] is m.fc.weight and pl[0] is m.scale
    assert [p.name for p in pl] == [p for p, _ in m.named_slots()]
    assert m.parameters().shapes == pl.shapes
    assert m.get_parameter("heads.1.bias") is m.heads[1].bias


def test_reassignment_keeps_position_and_non_params_unregister():
    m = Tower()
    m.fc = tnn.Linear(3, 4)
    m.scale = Param(np.zeros(4))
    assert [p for p, _ in m.named_slots()][:3] == ["scale", "fc.weight", "fc.bias"]
    m.scale = None
    assert m.scale is None and "scale" not in [p for p, _ in m.named_slots()]
    del m.fc
    assert [p for p, _ in m.named_slots()][0] == "heads.0.weight"
    with pytest.raises(AttributeError):
        _ = m.fc


def test_assigning_a_param_ties_storage_and_each_path_gets_its_own_handle():
    a, b = tnn.Linear(3, 3), tnn.Linear(3, 3)
    root = tnn.Sequential(a, b)
    b.weight = a.weight  # C1: same storage
    slots = dict(root.named_slots())
    assert slots["1.weight"].storage is slots["0.weight"].storage
    assert slots["1.weight"] is not slots["0.weight"]  # each path owns its flag
    assert slots["1.weight"].name == "1.weight" and slots["0.weight"].name == "0.weight"
    assert root.aliases() == {"0.weight": ["1.weight"]}
    assert [p for p, _ in root.named_parameters()] == ["0.weight", "0.bias", "1.bias"]
    assert root.param_list().canonical_slot_indices() == [0, 1, 0, 3]  # C5
    assert root.num_parameters() == 9 + 3 + 3 and root.num_parameters(unique=False) == 24


@pytest.mark.parametrize("frozen", ["embed.weight", "head.weight"])
def test_a_tie_by_assignment_freezes_only_the_frozen_paths_use(frozen):  # C4, C5
    class LM(tnn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = tnn.Embedding(5, 3, dtype=np.float64)
            self.head = tnn.Linear(3, 5, bias=False, dtype=np.float64)
            self.head.weight = self.embed.weight  # ANCHORS: transformers#11903

        def forward(self, s, idx):
            return self.head(s, self.embed(s, idx))

    model = LM()
    model.freeze(frozen)
    assert model.head.weight is model.get_parameter("head.weight")  # the handle used
    s = EagerSession()
    hidden = model.embed(s, np.array([[0, 1, 2]]))  # leaf 0: the embedding's use
    model.head(s, hidden)  # the head's use comes after the input it multiplies
    (group,) = s.parameter_groups()  # one use trains the storage: the other path's
    other = "head.weight" if frozen == "embed.weight" else "embed.weight"
    assert len(group.leaves) == 1 and group.parameter is model.get_parameter(other)


def test_equal_values_never_tie():
    a, b = tnn.Linear(2, 2), tnn.Linear(2, 2)  # rng=None: identical values
    np.testing.assert_array_equal(a.weight.value, b.weight.value)
    assert tnn.Sequential(a, b).aliases() == {}  # C1: identity, not contents


def test_submodule_at_two_paths_shares_handles():
    enc = tnn.Linear(2, 2)
    root = tnn.Module()
    root.left, root.right = enc, enc
    slots = root.named_slots()
    assert [p for p, _ in slots] == ["left.weight", "left.bias", "right.weight", "right.bias"]
    assert slots[0][1] is slots[2][1] and slots[2][1].name == "left.weight"
    assert root.aliases() == {"left.weight": ["right.weight"], "left.bias": ["right.bias"]}
    assert [p for p, _ in root.named_modules()] == ["", "left"]


def test_train_and_eval_reach_every_submodule():
    m = Tower()
    assert m.eval() is m
    assert not any(sub.training for _, sub in m.named_modules())
    m.train()
    assert all(sub.training for _, sub in m.named_modules())


def test_forward_uses_each_parameter_through_the_session():
    m = Tower()
    s = EagerSession()
    outs = m(s, np.ones((2, 3), np.float32))
    regs = s.parameter_registrations()
    assert sorted(p.name for p in regs.values()) == sorted(p for p, _ in m.named_slots())
    grads = s.backward(outs[0].sum() + outs[1].sum())
    named = m.named_gradients(grads)
    assert set(named) == {p for p, _ in m.named_slots()}
    np.testing.assert_allclose(named["heads.0.bias"], np.full(2, 2.0))


def test_named_gradients_sums_the_uses_of_a_shared_storage():
    lin = tnn.Linear(2, 2, bias=False, dtype="float64")
    s = EagerSession()
    x = np.array([[1.0, 2.0]])
    y = lin(s, lin(s, x))  # two uses of one storage
    grads = s.backward(y.sum())
    w = lin.weight.value
    h = x @ w.T
    want = np.ones((1, 2)).T @ h + (np.ones((1, 2)) @ w).T @ x  # both uses (C4)
    np.testing.assert_allclose(lin.named_gradients(grads)["weight"], want)
    with pytest.raises(TapeError, match="named_gradients"):
        lin.named_gradients({0: np.zeros(2)})


def test_get_and_set_parameter_by_path():
    m = Tower()
    new = Param(np.zeros((2, 4), np.float32))
    m.set_parameter("heads.0.weight", new)
    assert m.heads[0].weight is new and new.name == "heads.0.weight"
    with pytest.raises(SlotError, match=r"no parameter at path 'heads.0.wieght'.*'heads.0.weight'"):
        m.get_parameter("heads.0.wieght")
    with pytest.raises(SlotError, match="no parameter at path 'fc'"):
        m.get_parameter("fc")
    with pytest.raises(
        ShapeError, match=r"'heads.0.weight': expected shape \(2, 4\), got \(4, 2\)"
    ):
        m.set_parameter("heads.0.weight", Param(np.zeros((4, 2), np.float32)))
    with pytest.raises(DTypeError, match="expected dtype float32, got float64"):
        m.set_parameter("heads.0.weight", Param(np.zeros((2, 4))))
    with pytest.raises(SlotError, match="expected a Param"):
        m.set_parameter("heads.0.weight", np.zeros((2, 4), np.float32))
    assert m.heads[0].weight is new  # C6: nothing changed


def test_misuse_errors():
    class NoInit(tnn.Module):
        def __init__(self) -> None:
            self.w = Param(np.ones(2))

    with pytest.raises(TiegradError, match="super\\(\\).__init__"):
        NoInit()
    loop = tnn.Module()
    loop.inner = tnn.Module()
    loop.inner.back = loop
    with pytest.raises(TiegradError, match="contains itself"):
        loop.named_slots()
    with pytest.raises(TiegradError, match="items must be Modules"):
        tnn.ModuleList([tnn.Linear(1, 1), 3])
    with pytest.raises(NotImplementedError):
        tnn.Module()(EagerSession())
