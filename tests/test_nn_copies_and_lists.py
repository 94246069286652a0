"""Module behaviours a PyTorch user relies on: copies that train on their own, the path
``named_parameters`` gives a tied storage frozen at its first path, untying under a live
optimizer, ``ModuleList`` edits, names with dots, and modes kept through ``generate``."""

from __future__ import annotations

import copy
import pickle

import numpy as np
import pytest

import tiegrad.nn as tnn
from tiegrad import EagerSession, HyperparameterError, SlotError
from tiegrad.models import TiedLM
from tiegrad.optim import SGD, AdamW

IDS = np.arange(10).reshape(2, 5) % 10


def small_lm() -> TiedLM:
    return TiedLM(10, d_model=8, n_layers=1, n_heads=2, max_seq_len=4)


def train(model, opt, steps: int = 3) -> list[float]:
    losses = []
    for _ in range(steps):
        s = EagerSession()
        loss = model.loss(s, IDS[:, :-1], IDS[:, 1:])
        opt.step(s.backward(loss))
        losses.append(float(loss.value))
    return losses


@pytest.mark.parametrize(
    "copier", [copy.deepcopy, lambda m: pickle.loads(pickle.dumps(m))], ids=["deepcopy", "pickle"]
)
def test_a_copied_model_trains_on_its_own_and_keeps_its_ties(copier):
    original = small_lm()
    start = original.embed.weight.value.copy()
    twin = copier(original)
    assert twin.embed.weight.storage is twin.lm_head.weight.storage  # a tie inside the copy
    assert twin.embed.weight.storage is not original.embed.weight.storage
    assert not twin.embed.weight.value.flags.writeable
    losses = train(twin, AdamW(twin.parameters(), lr=1e-2))
    assert losses[0] > losses[1] > losses[2]  # each step reached the weights the forward reads
    np.testing.assert_array_equal(original.embed.weight.value, start)
    reference = small_lm()
    reference.embed.weight.set_value(start)
    for (_, p), (_, q) in zip(reference.named_slots(), original.named_slots()):
        p.set_value(q.value)
    assert train(reference, AdamW(reference.parameters(), lr=1e-2)) == losses


def test_named_parameters_gives_a_tied_storage_the_handle_of_its_trainable_path():
    model = small_lm()
    model.freeze("embed.weight")  # the storage still trains through lm_head.weight
    names = dict((path, p) for path, p in model.named_parameters() if p.requires_grad)
    assert "lm_head.weight" not in names  # one entry per storage, under its first path
    assert names["embed.weight"] is model.lm_head.weight
    params = list(names.values())
    before = model.embed.weight.value.copy()
    train(model, SGD(params, lr=0.5), steps=1)
    assert not np.array_equal(model.embed.weight.value, before)


def test_untie_under_a_live_optimizer_trains_both_storages():
    model = small_lm()
    opt = SGD(model.parameters(), lr=0.5)
    tnn.untie(model, "lm_head.weight")
    head, embed = model.lm_head.weight.value.copy(), model.embed.weight.value.copy()
    train(model, opt, steps=1)
    assert model.lm_head.weight.storage is not model.embed.weight.storage
    assert not np.array_equal(model.lm_head.weight.value, head)
    assert not np.array_equal(model.embed.weight.value, embed)


def test_module_list_edits_renumber_the_paths():
    a, b, c, d = (tnn.Linear(2, 2) for _ in range(4))
    ml = tnn.ModuleList([a, b, c])
    del ml[0]
    assert list(ml) == [b, c] and ml[0] is b
    assert [path for path, _ in ml.named_slots()][:2] == ["0.weight", "0.bias"]
    ml.insert(0, a)
    ml[2] = d
    ml += [c]
    assert list(ml) == [a, b, d, c]
    assert list(ml[1:3]) == [b, d] and isinstance(ml[1:3], tnn.ModuleList)
    assert isinstance(tnn.Sequential(a, b)[1:], tnn.Sequential)
    for bad in ("1", 1.0, True, 4):
        with pytest.raises(IndexError):
            ml[bad]
    with pytest.raises(Exception, match="items must be Modules"):
        ml.extend([a, "not a module"])
    assert list(ml) == [a, b, d, c]  # a refused extend added nothing


@pytest.mark.parametrize("name", ["a.weight", ""])
def test_a_name_with_a_dot_or_no_name_is_refused(name):
    m = tnn.Linear(2, 2)
    with pytest.raises(SlotError, match="without '.'"):
        setattr(m, name, tnn.Linear(1, 1))
    assert [path for path, _ in m.named_slots()] == ["weight", "bias"]


def test_generate_restores_each_submodules_own_mode():
    model = small_lm()
    model.train()
    model.blocks[0].eval()
    model.generate(np.array([[1, 2]]), 2)
    assert model.training and not model.blocks[0].training


def test_mode_and_patterns_are_checked():
    model = small_lm()
    with pytest.raises(HyperparameterError, match="mode must be True or False"):
        model.train("no")
    with pytest.raises(SlotError, match="glob pattern"):
        model.freeze(5)
    assert model.embed.weight.ndim == 2
