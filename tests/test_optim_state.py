"""Optimizer ``state_dict`` / ``load_state_dict``: keyed by canonical slot (C5), validated
completely before anything changes (C6)."""

from __future__ import annotations

import copy
import json

import numpy as np
import pytest

from tiegrad import (
    AliasError,
    CheckpointError,
    DTypeError,
    HyperparameterError,
    NonFiniteError,
    Param,
    ParamList,
    ShapeError,
)
from tiegrad.optim import SGD, Adagrad, Adam, AdamW, RMSprop

OPTIMIZERS = [
    (SGD, {"lr": 0.1, "momentum": 0.9}),
    (Adam, {"lr": 0.05, "amsgrad": True}),
    (AdamW, {"lr": 0.05, "betas": (0.8, 0.9)}),
    (RMSprop, {"lr": 0.01, "momentum": 0.5, "centered": True}),
    (Adagrad, {"lr": 0.1}),
]
IDS = [cls.kind for cls, _ in OPTIMIZERS]


def make_params(seed: int = 0) -> list[Param]:
    """Storages p, q and a frozen r, laid out as slots [p, q, p, r]."""
    g = np.random.default_rng(seed)
    p, q = Param(g.standard_normal((3, 2)), name="p"), Param(g.standard_normal(4), name="q")
    r = Param(g.standard_normal(2), requires_grad=False, name="r")
    return [p, q, p, r]


def groups_of(slots: list[Param]) -> list[dict]:
    return [{"params": slots[:2]}, {"params": slots[2:]}]


def grads_for(opt, step: int) -> list:
    g = np.random.default_rng(100 + step)
    per_slot = [g.standard_normal(p.shape) for p in opt.params]
    return opt.params.canonical_gradients(opt.params.canonical_slot_indices(), per_slot)


def snapshot(opt) -> tuple:
    values = [p.value.tobytes() for p in opt.params]
    state = {
        slot: {k: v.tobytes() if isinstance(v, np.ndarray) else v for k, v in entry.items()}
        for slot, entry in opt.state.items()
    }
    groups = [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]
    return values, state, opt.step_count, opt.skipped_steps, groups, opt.defaults


def trained(cls, kwargs, steps: int = 3):
    opt = cls(groups_of(make_params()), **kwargs)
    for k in range(steps):
        opt.step(grads_for(opt, k))
    return opt


@pytest.mark.parametrize("cls, kwargs", OPTIMIZERS, ids=IDS)
def test_state_dict_layout(cls, kwargs):  # C5
    opt = trained(cls, kwargs)
    sd = opt.state_dict()
    keys = ["kind", "defaults", "param_groups", "layout", "state", "step_count", "skipped_steps"]
    assert list(sd) == keys
    assert [(r["canonical"], r["storage"]) for r in sd["layout"]] == [
        (0, 0),
        (1, 1),
        (0, 0),
        (None, 3),
    ]
    assert sd["kind"] == cls.kind and sd["step_count"] == 3 and sd["skipped_steps"] == 0
    assert [g["slots"] for g in sd["param_groups"]] == [[0, 1], [2, 3]]
    assert sorted(sd["state"]) == [0, 1]  # canonical slots; slot 2 is p again, 3 frozen
    for slot, entry in sd["state"].items():
        assert entry["step"] == 3
        specs = opt.state_tensor_specs()[slot]
        assert {k: (v.shape, v.dtype.name) for k, v in entry.items() if k != "step"} == specs
    json.dumps({k: v for k, v in sd.items() if k != "state"})  # everything else is JSON
    entry = sd["state"][0]
    name = next(k for k in entry if k != "step")
    entry[name][...] = 123.0  # the dict owns copies
    assert not np.any(opt.state[0][name] == 123.0)


@pytest.mark.parametrize("cls, kwargs", OPTIMIZERS, ids=IDS)
def test_state_survives_re_creating_handles(cls, kwargs):  # C5
    # Run A: 6 steps. Run B: 3 steps, then new handles on the same storages (and a new
    # optimizer over them) load the state and take the last 3 steps: bit-identical.
    a = trained(cls, kwargs, steps=6)
    b = trained(cls, kwargs, steps=3)
    sd = json_round_trip(b.state_dict())
    handles = [p.alias() for p in b.params]
    handles[2] = handles[0]  # slot 2 holds p's storage again
    c = cls(groups_of(handles), **kwargs)
    c.load_state_dict(sd)
    for k in range(3, 6):
        c.step(grads_for(c, k))
    assert snapshot(c)[:4] == snapshot(a)[:4]


@pytest.mark.parametrize("cls, kwargs", OPTIMIZERS, ids=IDS)
def test_state_moves_to_fresh_storages_with_the_same_layout(cls, kwargs):  # C5
    a = trained(cls, kwargs, steps=5)
    b = trained(cls, kwargs, steps=2)
    fresh = [Param(v, requires_grad=p.requires_grad) for p, v in zip(b.params, b.params.values())]
    fresh[2] = fresh[0]
    c = cls(groups_of(fresh), **kwargs)
    c.load_state_dict(b.state_dict())
    for k in range(2, 5):
        c.step(grads_for(c, k))
    assert snapshot(c)[:4] == snapshot(a)[:4]


def json_round_trip(sd: dict) -> dict:
    """What a checkpoint does: JSON for everything but the arrays, which are kept."""
    config = json.loads(json.dumps({k: v for k, v in sd.items() if k != "state"}))
    return config | {"state": sd["state"]}


def test_loading_adopts_the_saved_hyperparameters():
    saved = trained(Adam, {"lr": 0.05, "amsgrad": True})
    opt = Adam(groups_of(make_params()), lr=0.5)
    opt.load_state_dict(json_round_trip(saved.state_dict()))
    assert opt.param_groups[0]["lr"] == 0.05 and opt.param_groups[1]["amsgrad"] is True
    assert opt.param_groups[0]["betas"] == (0.9, 0.999)
    assert opt.defaults == saved.defaults


def test_loading_an_empty_state_before_any_step():
    opt = trained(AdamW, {"lr": 0.05})
    fresh = AdamW(groups_of(make_params()), lr=0.05)
    opt.load_state_dict(fresh.state_dict())
    assert dict(opt.state) == {} and opt.step_count == 0


def test_loads_counts_the_adopted_state_dicts_and_not_the_refused_ones():
    opt = trained(AdamW, {"lr": 0.05})
    sd = opt.state_dict()
    assert opt.loads == 0
    opt.load_state_dict(sd)
    bad = copy.deepcopy(sd)
    bad["step_count"] = -1
    with pytest.raises(CheckpointError):
        opt.load_state_dict(bad)
    assert opt.loads == 1


def corrupt(edit):
    def make(sd):
        sd = copy.deepcopy(sd)
        edit(sd)
        return sd

    return make


BAD_STATES = {
    "groups sharing a storage with different hyperparameters": (
        corrupt(lambda sd: sd["param_groups"][0].update(amsgrad=False)),
        AliasError,
        "amsgrad False vs True",
    ),
    "another kind": (corrupt(lambda sd: sd.update(kind="SGD")), CheckpointError, "'SGD'"),
    "a missing key": (corrupt(lambda sd: sd.pop("skipped_steps")), CheckpointError, "missing"),
    "an extra key": (corrupt(lambda sd: sd.update(extra=1)), CheckpointError, "unexpected"),
    "not a mapping": (lambda sd: [sd], CheckpointError, "mapping"),
    "a bad default": (
        corrupt(lambda sd: sd["defaults"].update(eps=-1.0)),
        HyperparameterError,
        "eps",
    ),
    "a negative lr": (
        corrupt(lambda sd: sd["param_groups"][1].update(lr=-1.0)),
        HyperparameterError,
        "lr",
    ),
    "betas out of range": (
        corrupt(lambda sd: sd["param_groups"][0].update(betas=[1.0, 0.9])),
        HyperparameterError,
        "betas",
    ),
    "a missing hyperparameter": (
        corrupt(lambda sd: sd["param_groups"][0].pop("eps")),
        CheckpointError,
        "eps",
    ),
    "another group layout": (
        corrupt(lambda sd: sd["param_groups"][0].update(slots=[0, 1, 2])),
        CheckpointError,
        "holds slots",
    ),
    "group slots that are a number": (
        corrupt(lambda sd: sd["param_groups"][0].update(slots=5)),
        CheckpointError,
        r'param_groups\[0\]\["slots"\] must be a list of slot indices, got int',
    ),
    "group slots that are None": (
        corrupt(lambda sd: sd["param_groups"][1].update(slots=None)),
        CheckpointError,
        r'param_groups\[1\]\["slots"\] must be a list of slot indices, got NoneType',
    ),
    "a group slot that is a float": (
        corrupt(lambda sd: sd["param_groups"][0].update(slots=[0, 1.0])),
        CheckpointError,
        r'param_groups\[0\]\["slots"\]\[1\] must be a slot index \(an integer\), got float',
    ),
    "a group fewer": (corrupt(lambda sd: sd["param_groups"].pop()), CheckpointError, "2 groups"),
    "state at an alias slot": (
        corrupt(lambda sd: sd["state"].update({2: sd["state"][0]})),
        AliasError,
        "shares the storage of slot 0",
    ),
    "state at a frozen slot": (
        corrupt(lambda sd: sd["state"].update({3: sd["state"][0]})),
        AliasError,
        "is frozen",
    ),
    "state outside the list": (
        corrupt(lambda sd: sd["state"].update({9: sd["state"][0]})),
        CheckpointError,
        "outside",
    ),
    "a string slot key": (
        corrupt(lambda sd: sd["state"].update({"1": sd["state"].pop(1)})),
        CheckpointError,
        "not a slot index",
    ),
    "a state tensor of the wrong shape": (
        corrupt(lambda sd: sd["state"][1].update(exp_avg=np.zeros(5))),
        ShapeError,
        "exp_avg",
    ),
    "a state tensor of the wrong dtype": (
        corrupt(lambda sd: sd["state"][1].update(exp_avg=np.zeros(4, np.float32))),
        DTypeError,
        "float32",
    ),
    "a state tensor that is a list": (
        corrupt(lambda sd: sd["state"][1].update(exp_avg=[0.0] * 4)),
        CheckpointError,
        "NumPy array",
    ),
    "a missing state tensor": (
        corrupt(lambda sd: sd["state"][1].pop("max_exp_avg_sq")),
        CheckpointError,
        "max_exp_avg_sq",
    ),
    "a state tensor amsgrad=False does not use": (
        corrupt(lambda sd: [g.update(amsgrad=False) for g in sd["param_groups"]]),
        CheckpointError,
        "max_exp_avg_sq",
    ),
    "a negative step": (
        corrupt(lambda sd: sd["state"][0].update(step=-1)),
        CheckpointError,
        "step of slot 0",
    ),
    "a float step": (
        corrupt(lambda sd: sd["state"][0].update(step=2.0)),
        CheckpointError,
        "step of slot 0",
    ),
    "a negative step_count": (
        corrupt(lambda sd: sd.update(step_count=-1)),
        CheckpointError,
        "step_count",
    ),
}


@pytest.mark.parametrize("case", list(BAD_STATES))
def test_bad_state_dict_changes_nothing(case):  # C6
    source = trained(Adam, {"lr": 0.05, "amsgrad": True})
    target = trained(Adam, {"lr": 0.01, "amsgrad": True}, steps=2)
    make, error, fragment = BAD_STATES[case]
    bad = make(source.state_dict())
    before = snapshot(target)
    with pytest.raises(error, match=fragment):
        target.load_state_dict(bad)
    assert snapshot(target) == before


def test_state_saved_untied_is_refused_where_the_slot_is_an_alias():  # C5, C6
    # Saved on [p, q, r] (three storages): state at slots 0, 1 and 2. Loading into
    # [P, Q, Q] (slot 2 shares slot 1's storage) is refused: state is by canonical slot.
    saved = Adam(ParamList([Param(np.zeros(s)) for s in [(2,), (3,), (3,)]]), lr=0.05)
    saved.step([np.ones(2), np.ones(3), np.ones(3)])
    big_p, big_q = Param(np.zeros(2)), Param(np.zeros(3))
    tied = Adam(ParamList([big_p, big_q, big_q]), lr=0.05)
    tied.step([np.ones(2), np.ones(3), None])
    before = snapshot(tied)
    with pytest.raises(CheckpointError, match="alias layout mismatch at slot 2"):
        tied.load_state_dict(saved.state_dict())
    assert snapshot(tied) == before


@pytest.mark.parametrize("layout", ["abc", "qpp"], ids=["untied", "state swapped between storages"])
def test_state_of_a_tied_layout_is_refused_by_another_layout_side_by_side(layout):  # C6, C9
    # Saved on [p, q, p]; [a, b, c] and [q, p, p] have the same slots, shapes and group
    # slots, but not its ties: refused with both layouts shown, nothing changed.
    def handles(spec):
        made = {}
        return [made.setdefault(c, Param(np.zeros(2), name=f"s{i}")) for i, c in enumerate(spec)]

    saved = Adam(ParamList(handles("pqp")), lr=0.05)
    saved.step([np.ones(2), np.ones(2), None])
    target = Adam(ParamList(handles(layout)), lr=0.05)
    target.step([np.ones(2), np.ones(2), None if layout == "qpp" else np.ones(2)])
    before = snapshot(target)
    with pytest.raises(CheckpointError, match="alias layout mismatch at slot 2") as e:
        target.load_state_dict(saved.state_dict())
    assert "state dict" in str(e.value) and "<-- differs" in str(e.value)
    assert snapshot(target) == before


def test_a_state_dict_of_reordered_parameters_is_refused_not_swapped():  # C6, pytorch#1489
    def named(order: str) -> ParamList:
        return ParamList([Param(np.full(3, float(ord(n)), np.float32), name=n) for n in order])

    opt = Adam(named("ab"), lr=0.1)
    opt.step([np.array([1.0, 2.0, 3.0], np.float32), np.full(3, 10.0, np.float32)])
    state = opt.state_dict()
    reordered = Adam(named("ba"), lr=0.1)
    before = reordered.state_dict()
    with pytest.raises(CheckpointError, match="slot 0 is 'a', which is slot 1 here"):
        reordered.load_state_dict(state)
    assert json.dumps(reordered.state_dict(), default=repr) == json.dumps(before, default=repr)
    renamed = Adam(named("xy"), lr=0.1)  # names new here: matched by position
    renamed.load_state_dict(state)
    np.testing.assert_array_equal(renamed.state_dict()["state"][1]["exp_avg"], np.ones(3))


def _replaced_storage_then(action: str) -> tuple[dict, dict]:
    """An Adam slot's state before its storage is replaced and after it is put back, with
    ``action`` in between: a refused step, a look at the state, or a step that writes."""
    p = Param(np.ones(3, np.float32), name="a")
    opt = Adam([p], lr=0.1)
    opt.step([np.full(3, 0.5, np.float32)])
    before = {k: dict(v) for k, v in opt.state.items()}
    trained = p.storage
    p.storage = Param(np.ones(3, np.float32)).storage  # another storage at slot 0
    if action == "refused":
        with pytest.raises(NonFiniteError):
            opt.step([np.full(3, np.nan, np.float32)])
    elif action == "looked":
        assert dict(opt.state) == {}  # the new storage has no history
    else:
        opt.step([np.full(3, 0.5, np.float32)])
    p.storage = trained
    return before, {k: dict(v) for k, v in opt.state.items()}


@pytest.mark.parametrize("action", ["refused", "looked"])
def test_a_refused_step_or_a_look_keeps_the_state_of_a_replaced_storage(action):  # C5, C6
    before, after = _replaced_storage_then(action)
    assert before.keys() == after.keys() == {0}
    assert after[0]["step"] == before[0]["step"] == 1
    for name in ("exp_avg", "exp_avg_sq"):
        np.testing.assert_array_equal(after[0][name], before[0][name])


def test_a_step_that_writes_drops_the_state_of_a_storage_no_longer_trained():  # C5
    _, after = _replaced_storage_then("stepped")
    assert after == {}
