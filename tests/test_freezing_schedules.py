"""Per-use freezing during training, ``no_grad`` uses and what the optimizer sees (issue 16).

A tied weight ``W`` is used twice (an input path ``W_in`` and an output path ``W_out``,
one storage). Freezing the input path for some steps and releasing it again keeps one
optimizer history per storage (C1, C5): the trajectory equals PyTorch's with
``.detach()`` at the frozen use, to 1e-10 in float64. A use recorded under ``no_grad``
is in no group (C4): it contributes nothing, as in PyTorch. Trainability is the one each
use was recorded with; a step that would drop a recorded gradient is refused.
"""

from __future__ import annotations

import numpy as np
import pytest

import tiegrad as tg
import tiegrad.ops as T
from tiegrad import (
    AliasError,
    EagerSession,
    NonFiniteError,
    Param,
    ParamList,
    dense_group_gradient,
)
from tiegrad.models import TiedLM
from tiegrad.optim import SGD, AdamW

torch = pytest.importorskip("torch")

TOL = 1e-10  # float64, the same arithmetic in another order
F64 = np.float64
# Which use of W is trainable at each step: (input path, output path).
SCHEDULE = [(True, True)] * 3 + [(False, True)] * 3 + [(True, True)] * 3 + [(True, False)] * 2
OPTIMIZERS = {
    "AdamW": (AdamW, torch.optim.AdamW, {"lr": 0.05, "weight_decay": 0.1}),
    "SGD momentum": (SGD, torch.optim.SGD, {"lr": 0.05, "momentum": 0.9, "nesterov": True}),
}


def data():
    rng = np.random.default_rng(0)
    w = rng.standard_normal((4, 3)) * 0.5
    b = rng.standard_normal(3) * 0.1
    xs = [rng.standard_normal((5, 4)) for _ in SCHEDULE]
    return w, b, xs


def tiegrad_loss(s, w_in, w_out, b, x):
    h = T.tanh(s.constant(x) @ s.use(w_in) + s.use(b))  # (5, 3)
    y = h @ s.use(w_out).T  # (5, 4): the output path of the same storage
    return ((y - s.constant(x)) ** 2).mean()


def torch_loss(w, b, x, frozen_in, frozen_out):
    x = torch.tensor(x)
    w_in = w.detach() if frozen_in else w
    w_out = w.detach() if frozen_out else w
    y = torch.tanh(x @ w_in + b) @ w_out.T
    return ((y - x) ** 2).mean()


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_freeze_then_unfreeze_a_use_of_a_tied_weight_equals_pytorch_with_detach(name):
    ours, theirs, kwargs = OPTIMIZERS[name]
    w0, b0, xs = data()
    W = Param(w0, name="W_in")
    W_out = W.alias(name="W_out")
    b = Param(b0, name="b")
    opt = ours(ParamList([W, W_out, b]), **kwargs)
    tw = torch.tensor(w0, requires_grad=True)
    tb = torch.tensor(b0, requires_grad=True)
    topt = theirs([tw, tb], **kwargs)
    s = EagerSession()
    for k, ((train_in, train_out), x) in enumerate(zip(SCHEDULE, xs)):
        W.requires_grad, W_out.requires_grad = train_in, train_out
        s.reset()
        opt.step(s.backward(tiegrad_loss(s, W, W_out, b, x)))
        topt.zero_grad()
        torch_loss(tw, tb, x, not train_in, not train_out).backward()
        topt.step()
        np.testing.assert_allclose(W.value, tw.detach().numpy(), rtol=TOL, atol=TOL, err_msg=k)
        np.testing.assert_allclose(b.value, tb.detach().numpy(), rtol=TOL, atol=TOL, err_msg=k)
        # one history per storage: W's entry is at the canonical slot of this step
        slot = 0 if train_in else 1
        assert opt.state[slot]["step"] == k + 1, k
        assert sorted(opt.state) == [slot, 2]


def test_the_issue_case_tied_lm_keeps_its_adam_history_through_freeze_and_unfreeze():
    model = TiedLM(11, d_model=8, n_layers=1, n_heads=2, max_seq_len=6, seed=0)
    opt = AdamW(model.parameters(), lr=1e-2)
    x = np.random.default_rng(0).integers(0, 11, (2, 6))
    s = EagerSession(seed=0)

    def step():
        s.reset()
        opt.step(s.backward(model.loss(s, x, x)))

    for _ in range(3):
        step()
    embed = model.param_list().canonical_slot_indices()[0]
    assert opt.state[embed]["step"] == 3
    model.freeze("embed.weight")
    step()
    head = model.param_list().canonical_slot_indices()[-1]
    assert embed not in opt.state and opt.state[head]["step"] == 4
    model.unfreeze("embed.weight")
    step()
    assert head not in opt.state and opt.state[embed]["step"] == 5


def test_a_save_after_a_freeze_round_trips(tmp_path):
    # The state dict is keyed by the current layout, so loading it back is accepted.
    w0, b0, xs = data()
    W, b = Param(w0, name="W_in"), Param(b0, name="b")
    W_out = W.alias(name="W_out")
    opt = AdamW(ParamList([W, W_out, b]), lr=0.05)
    s = EagerSession()
    for x in xs[:2]:
        s.reset()
        opt.step(s.backward(tiegrad_loss(s, W, W_out, b, x)))
    W.requires_grad = False  # no step since: the state is still keyed at slot 0
    sd = opt.state_dict()
    assert sorted(sd["state"]) == [1, 2] and sd["state"][1]["step"] == 2
    twin = AdamW(ParamList([W, W_out, b]), lr=0.05)
    twin.load_state_dict(sd)
    assert twin.state[1]["step"] == 2
    path = tmp_path / "frozen.safetensors"  # and through a checkpoint (C9)
    tg.save(path, ParamList([W, W_out, b]), optimizer=opt)
    again = AdamW(ParamList([W, W_out, b]), lr=0.05)
    tg.load(path, ParamList([W, W_out, b]), optimizer=again)
    assert sorted(again.state) == [1, 2] and again.state[1]["step"] == 2
    np.testing.assert_array_equal(again.state[1]["exp_avg"], opt.state[1]["exp_avg"])


def test_a_refused_step_after_a_freeze_keeps_the_history_of_an_untrained_storage():
    # Freezing an untied weight drops its state at the next write; a step refused before
    # that write (non-finite gradient) changes nothing (C6): unfreezing resumes it.
    p, q = Param(np.ones(2)), Param(np.ones(3))
    opt = AdamW(ParamList([p, q]), lr=0.1)
    opt.step([np.ones(2), np.ones(3)])
    before = {slot: {k: np.array(v) for k, v in e.items()} for slot, e in opt.state.items()}
    p.requires_grad = False
    with pytest.raises(NonFiniteError, match="NaN or infinity"):
        opt.step([None, np.full(3, np.nan)])
    p.requires_grad = True
    assert {slot: e["step"] for slot, e in opt.state.items()} == {0: 1, 1: 1}
    np.testing.assert_array_equal(opt.state[0]["exp_avg"], before[0]["exp_avg"])
    p.requires_grad = False
    opt.step([None, np.ones(3)])
    assert sorted(opt.state) == [1]  # written: p's storage is not trained, its state goes


# -- no_grad uses (item 2) -----------------------------------------------------------------
def bootstrap_loss(s, w, b, x, x2):
    with s.no_grad():
        target = T.tanh(s.constant(x2) @ s.use(w) + s.use(b))  # a target from the same weights
    return ((T.tanh(s.constant(x) @ s.use(w) + s.use(b)) - target) ** 2).mean()


def torch_bootstrap(w, b, x, x2):
    with torch.no_grad():
        target = torch.tanh(torch.tensor(x2) @ w + b)
    return ((torch.tanh(torch.tensor(x) @ w + b) - target) ** 2).mean()


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_a_no_grad_use_of_a_trained_weight_steps_like_pytorch(name):
    ours, theirs, kwargs = OPTIMIZERS[name]
    w0, b0, xs = data()
    W, b = Param(w0, name="W"), Param(b0, name="b")
    opt = ours([W, b], **kwargs)
    tw, tb = torch.tensor(w0, requires_grad=True), torch.tensor(b0, requires_grad=True)
    topt = theirs([tw, tb], **kwargs)
    s = EagerSession()
    for k in range(5):
        s.reset()
        opt.step(s.backward(bootstrap_loss(s, W, b, xs[k], xs[k + 1])))
        topt.zero_grad()
        torch_bootstrap(tw, tb, xs[k], xs[k + 1]).backward()
        topt.step()
        np.testing.assert_allclose(W.value, tw.detach().numpy(), rtol=TOL, atol=TOL, err_msg=k)


def test_a_no_grad_use_is_in_no_group_for_sgd_step_and_dense_group_gradient():
    w0, b0, xs = data()
    W, b = Param(w0), Param(b0)
    tw, tb = torch.tensor(w0, requires_grad=True), torch.tensor(b0, requires_grad=True)
    s = EagerSession()
    grads = s.backward(bootstrap_loss(s, W, b, xs[0], xs[1]))
    torch_bootstrap(tw, tb, xs[0], xs[1]).backward()
    gw, gb = s.parameter_groups()
    assert len(gw.leaves) == 1 and len(gb.leaves) == 1  # the no_grad uses are not grouped
    assert dense_group_gradient(gw, grads) is grads[gw.id]  # a group of one (C4)
    np.testing.assert_allclose(dense_group_gradient(gw, grads), tw.grad.numpy(), rtol=TOL)
    s.sgd_step(0.5, grads)
    np.testing.assert_allclose(W.value, w0 - 0.5 * tw.grad.numpy(), rtol=TOL, atol=TOL)
    np.testing.assert_allclose(b.value, b0 - 0.5 * tb.grad.numpy(), rtol=TOL, atol=TOL)


# -- trainability after backward (item 3) --------------------------------------------------
def two_uses(p, h):
    s = EagerSession()
    loss = (s.use(p) * 2.0).sum() + (s.use(h) * 3.0).sum()
    return s.backward(loss)


def test_freezing_a_handle_after_backward_still_applies_its_recorded_gradient():
    p = Param(np.zeros(2, F64))
    h = p.alias()
    opt = SGD(ParamList([p, h]), lr=1.0)
    grads = two_uses(p, h)
    h.requires_grad = False  # after backward: the recorded sum (2 + 3) is applied
    opt.step(grads)
    np.testing.assert_array_equal(p.value, [-5.0, -5.0])


def test_a_step_that_would_drop_a_recorded_gradient_is_refused_and_changes_nothing():
    p = Param(np.zeros(2, F64))
    h = p.alias()
    opt = SGD(ParamList([p, h]), lr=1.0, momentum=0.9)
    grads = two_uses(p, h)
    p.requires_grad = h.requires_grad = False  # the storage is frozen at every slot now
    with pytest.raises(AliasError, match="the layout changed since backward"):
        opt.step(grads)
    np.testing.assert_array_equal(p.value, [0.0, 0.0])
    assert dict(opt.state) == {} and opt.step_count == 0


def test_on_a_device_a_step_that_would_drop_a_recorded_gradient_is_refused_too():
    p = Param(np.zeros(2, np.float32))
    h = p.alias()
    opt = SGD(ParamList([p, h]), lr=1.0)
    s = EagerSession(device="torch:cpu")
    grads = s.backward((s.use(p) * 2.0).sum() + (s.use(h) * 3.0).sum())
    p.requires_grad = h.requires_grad = False
    with pytest.raises(AliasError, match="the layout changed since backward"):
        opt.step(grads)
    np.testing.assert_array_equal(p.value_synced(), [0.0, 0.0])
