"""The eager tape: sparse reverse sweep, retain sets, cotangent sums and misuse errors."""

from __future__ import annotations

import gc
import weakref

import numpy as np
import pytest

import tiegrad.ops as T
from tiegrad import (
    DTypeError,
    EagerSession,
    Gradients,
    Param,
    ShapeError,
    TapeError,
    TiegradError,
)
from tiegrad.optim import SGD


def counting_node(s: EagerSession, name: str, parents, calls: list[str]):
    """A node with identity cotangents to every parent that logs each VJP call."""
    ids = tuple(p.id for p in parents)

    def vjp(g):
        calls.append(name)
        return tuple(g for _ in ids)

    return s._record(parents[0].value.copy(), ids, vjp)


def test_sparse_sweep_runs_only_vjps_that_received_a_cotangent():
    s = EagerSession()
    calls: list[str] = []
    x = s.leaf(np.ones(3))
    a = counting_node(s, "a", [x], calls)
    counting_node(s, "dead_branch", [x], calls)  # uses x but does not lead to out
    c = counting_node(s, "c", [a], calls)
    counting_node(s, "after_out", [c], calls)  # recorded after out
    out = T.sum(c)
    g = s.backward(out)
    assert calls == ["c", "a"]
    np.testing.assert_array_equal(g[x], np.ones(3))


def test_nodes_without_gradient_never_run_a_vjp():
    s = EagerSession()
    calls: list[str] = []
    k = s.constant(np.ones(2))
    frozen = counting_node(s, "frozen", [k], calls)  # no parent requires grad
    w = s.leaf(np.ones(2))
    out = T.sum(T.mul(frozen, w))
    g = s.backward(out)
    assert calls == []
    assert list(g) == [w.id]


def test_default_retain_is_every_differentiable_leaf():
    s = EagerSession()
    x = s.leaf(np.ones(2))
    unused = s.leaf(np.ones((3, 1)))
    s.constant(np.ones(2))
    s.leaf(np.ones(2), requires_grad=False)
    mid = T.exp(x)
    g = s.backward(T.sum(mid))
    assert sorted(g) == [x.id, unused.id]
    np.testing.assert_allclose(g[x], np.e * np.ones(2))
    np.testing.assert_array_equal(g[unused], np.zeros((3, 1)))  # not reached: zeros
    assert mid not in g


def test_retain_limits_the_result_and_can_keep_intermediates():
    s = EagerSession()
    x = s.leaf(np.array([1.0, 2.0]))
    y = s.leaf(np.array([3.0, 4.0]))
    mid = T.mul(x, y)
    out = T.sum(T.mul(mid, 2.0))
    g = s.backward(out, retain=[mid, y.id], retain_graph=True)
    assert sorted(g) == sorted([mid.id, y.id])
    np.testing.assert_array_equal(g[mid], [2.0, 2.0])
    np.testing.assert_array_equal(g[y], [2.0, 4.0])
    assert x not in g
    with pytest.raises(KeyError):
        g[x]
    assert len(s.backward(out, retain=[])) == 0


def test_value_used_by_two_ops_gets_the_sum_of_both_cotangents():
    s = EagerSession()
    x = s.leaf(np.array([1.0, 2.0, 3.0]))
    a = T.mul(x, 3.0)  # d/dx = 3
    b = T.exp(x)  # d/dx = exp(x)
    out = T.sum(T.add(a, b))
    g = s.backward(out)
    np.testing.assert_allclose(g[x], 3.0 + np.exp([1.0, 2.0, 3.0]))


def test_a_value_used_many_times_and_the_seed_is_not_mutated():
    s = EagerSession()
    x = s.leaf(np.ones(4))
    y = x + x + x + x  # four uses through add, whose VJP passes g on unchanged
    seed = np.arange(4.0)
    g = s.backward(y, seed=seed)
    np.testing.assert_array_equal(g[x], 4 * np.arange(4.0))
    np.testing.assert_array_equal(seed, np.arange(4.0))


def test_gradient_of_a_leaf_used_in_a_diamond():
    s = EagerSession()
    x = s.leaf(np.array(2.0))
    a = x * x  # 2x
    b = T.exp(a)  # exp(x^2) * 2x
    out = a + b
    g = s.backward(out)
    assert float(g[x]) == pytest.approx(4.0 + np.exp(4.0) * 4.0)


def test_backward_can_run_twice_and_reports_latest_gradients():
    s = EagerSession()
    x = s.leaf(np.ones(2))
    out = T.sum(T.mul(x, 5.0))
    g1 = s.backward(out, retain_graph=True)
    g2 = s.backward(out, seed=2.0)
    np.testing.assert_array_equal(g1[x], [5.0, 5.0])
    np.testing.assert_array_equal(g2[x], [10.0, 10.0])
    assert s.last_gradients is g2


def test_backward_releases_the_tape_unless_retain_graph_keeps_it():
    """Like PyTorch's retain_graph=False: the tape is freed, the refs keep their values
    and index the result, and a new op or backward on them says how to keep the tape."""
    s = EagerSession()
    x = s.leaf(np.array([1.0, 2.0]))
    out = T.sum(T.mul(x, x))
    g = s.backward(out)
    assert len(s) == 0
    assert out.item() == 5.0
    np.testing.assert_array_equal(g[x], [2.0, 4.0])
    np.testing.assert_array_equal(s.grad(g, x), [2.0, 4.0])
    with pytest.raises(TapeError, match="retain_graph=True"):
        s.backward(out)
    with pytest.raises(TapeError, match="retain_graph=True"):
        T.mul(x, 2.0)
    y = s.leaf(np.array([3.0]))
    kept = s.backward(T.sum(y * y), retain_graph=True)
    assert len(s) > 0 and kept[y].tolist() == [6.0]
    with pytest.raises(TapeError, match="not recorded by the tape"):
        s.grad(g, y)


def test_a_kept_tape_that_spans_a_parameter_update_warns_once():
    """A loop that keeps its tape across steps grows it every step: it is told what to do."""
    from tiegrad import Param
    from tiegrad.optim import SGD

    p = Param(np.ones(2))
    opt = SGD([p], lr=0.1)
    s = EagerSession()
    with pytest.warns(RuntimeWarning, match=r"session.reset\(\) after each step") as seen:
        for _ in range(3):
            opt.step(s.backward(T.sum(s.use(p) * 2.0), retain_graph=True))
    assert len(seen) == 1
    for _ in range(3):  # the default releases the tape: nothing grows, nothing is said
        opt.step(s.backward(T.sum(s.use(p) * 2.0)))
        assert len(s) == 0


def test_gradients_is_a_read_only_mapping_keyed_by_id_or_ref():
    s = EagerSession()
    x = s.leaf(np.ones(2))
    g = s.backward(T.sum(x))
    assert isinstance(g, Gradients) and g.session is s
    assert g[x] is g[x.id]
    assert x in g and x.id in g
    with pytest.raises(TypeError):
        g[x.id] = np.zeros(2)  # type: ignore[index]


def test_no_grad_records_without_gradients():
    s = EagerSession()
    x = s.leaf(np.ones(2))
    with s.no_grad():
        y = T.exp(x)
        z = s.leaf(np.ones(2))
    assert not y.requires_grad and not z.requires_grad
    assert s.grad_enabled
    g = s.backward(T.sum(T.mul(y, x)))
    np.testing.assert_allclose(g[x], np.e * np.ones(2))


def test_float32_gradients_stay_float32():
    s = EagerSession()
    x = s.leaf(np.ones((2, 3), dtype=np.float32))
    out = T.sum(T.mean(T.mul(T.add(x, np.float64(1.0)), 0.5), axis=0))
    g = s.backward(out)
    assert out.dtype == np.float32 and g[x].dtype == np.float32


def test_an_unreferenced_op_output_is_released():
    s = EagerSession()
    x = s.leaf(np.ones((8, 8)))
    y = T.add(x, x)  # add's VJP does not hold its output
    yid = y.id
    np.testing.assert_array_equal(s.value(yid), 2 * np.ones((8, 8)))
    np.testing.assert_array_equal(s.value(y), 2 * np.ones((8, 8)))
    del y
    gc.collect()
    with pytest.raises(TapeError, match=f"value of node {yid} was released"):
        s.value(yid)
    np.testing.assert_array_equal(s.value(x.id), np.ones((8, 8)))  # leaves are kept


def test_backward_through_released_outputs():
    s = EagerSession()
    x = s.leaf(np.ones(3))
    out = T.sum(T.add(T.add(x, 1.0), x))
    gc.collect()
    np.testing.assert_array_equal(s.backward(out)[x], [2.0, 2.0, 2.0])


def saving_node(s: EagerSession, parent, log: list):
    """A node whose VJP saves a forward value of its own (held by the VJP alone) and
    logs, when it runs, which saved values of the other saving nodes are still alive."""
    saved = parent.value * 3.0
    alive = weakref.ref(saved)

    def vjp(g):
        log.append([w() is not None for w in log[0]])
        return (g * (saved / parent_value),)

    parent_value = parent.value
    log[0].append(alive)
    return s._record(saved.copy(), (parent.id,), vjp)


def test_a_released_sweep_frees_each_vjps_saved_values_once_it_has_run():
    """As PyTorch frees saved tensors during backward: when the earlier node's VJP runs,
    the later node's saved value is gone (retain_graph=True keeps both for a second run)."""
    for retain in (False, True):
        s = EagerSession()
        log: list = [[]]
        x = s.leaf(np.ones(4))
        out = T.sum(saving_node(s, saving_node(s, x, log), log))
        g = s.backward(out, retain_graph=retain)
        np.testing.assert_array_equal(g[x], np.full(4, 9.0))
        assert log[1:] == [[True, True], [True, retain]]
        if retain:
            np.testing.assert_array_equal(s.backward(out)[x], np.full(4, 9.0))


def test_an_error_during_a_released_sweep_releases_the_tape():
    """A VJP that raises after others have freed their saved values: the error comes
    through unchanged and the tape is released (its refs stale), as after a backward;
    the latest gradients are those of the previous backward."""
    s = EagerSession()
    x = s.leaf(np.ones(3))
    before = s.backward(T.sum(x * 2.0))
    x = s.leaf(np.ones(3))

    def broken(g):
        raise ValueError("broken vjp")

    bad = s._record(x.value * 2, (x.id,), broken)
    out = T.sum(T.mul(bad, 2.0))
    with pytest.raises(ValueError, match="broken vjp"):
        s.backward(out)
    assert len(s) == 0 and s.last_gradients is before
    with pytest.raises(TapeError, match="stale"):
        s.backward(out)


# -- errors -----------------------------------------------------------------------------
def test_non_scalar_output_needs_a_seed():
    s = EagerSession()
    y = T.mul(s.leaf(np.ones((2, 3))), 2.0)
    with pytest.raises(TapeError, match=r"output \d+ has shape \(2, 3\).*needs a seed"):
        s.backward(y)


def test_seed_of_wrong_shape():
    s = EagerSession()
    y = T.mul(s.leaf(np.ones((2, 3))), 2.0)
    with pytest.raises(TapeError, match=r"seed has shape \(3, 2\), expected .*\(2, 3\)"):
        s.backward(y, seed=np.ones((3, 2)))


def test_seed_is_converted_to_the_output_dtype():
    s = EagerSession()
    x = s.leaf(np.ones(2, dtype=np.float32))
    g = s.backward(T.mul(x, 2.0), seed=[1.0, 3.0])
    assert g[x].dtype == np.float32
    np.testing.assert_array_equal(g[x], [2.0, 6.0])


def test_ref_from_another_session():
    s1, s2 = EagerSession(), EagerSession()
    x1 = s1.leaf(np.ones(2))
    x2 = s2.leaf(np.ones(2))
    out1 = T.sum(x1)
    with pytest.raises(TapeError, match=f"ref {out1.id} belongs to another session"):
        s2.backward(out1)
    with pytest.raises(TapeError, match="another session"):
        T.add(x1, x2)
    with pytest.raises(TapeError, match="another session"):
        T.matmul(x2, x1)
    with pytest.raises(TapeError, match="another session"):
        s2.backward(T.sum(x2), retain=[x1])


def test_stale_ref_after_reset():
    s = EagerSession()
    x = s.leaf(np.ones(2))
    out = T.sum(x)
    s.reset()
    with pytest.raises(TapeError, match=f"ref {out.id} is stale"):
        s.backward(out)
    with pytest.raises(TapeError, match="stale"):
        T.exp(x)
    with pytest.raises(TapeError, match="stale"):
        x + x


def test_id_not_on_the_tape():
    s = EagerSession()
    x = s.leaf(np.ones(2))
    out = T.sum(x)
    with pytest.raises(TapeError, match=r"id 17 is not on the tape \(tape has 2 nodes\)"):
        s.backward(out, retain=[17])
    with pytest.raises(TapeError, match="id -1 is not on the tape"):
        s.value(-1)
    with pytest.raises(TapeError, match="expected a TensorRef or a node id, got str"):
        s.backward(out, retain=["x"])


def test_a_vjp_of_the_wrong_shape_is_reported():
    s = EagerSession()
    x = s.leaf(np.ones(3))
    bad = s._record(x.value * 2, (x.id,), lambda g: (np.ones(4),))
    with pytest.raises(ShapeError, match=rf"node {bad.id} sent a cotangent of shape \(4,\)"):
        s.backward(T.sum(bad))


def test_an_op_needs_a_ref_operand_and_leaves_need_floats():
    with pytest.raises(TapeError, match="at least one TensorRef"):
        T.add(np.ones(2), np.ones(2))
    s = EagerSession()
    with pytest.raises(DTypeError, match="floating dtype, got int64"):
        s.leaf(np.arange(3))
    assert s.leaf(np.arange(3), requires_grad=False).dtype == np.int64


def test_every_tape_error_is_a_tiegrad_error():
    for cls in (TapeError, ShapeError, DTypeError):
        assert issubclass(cls, TiegradError)


def test_on_final_callbacks_run_once_each_when_every_later_node_is_done():
    s = EagerSession()
    a = s.leaf(np.array([1.0, 2.0]))  # node 0
    unused = s.leaf(np.array([5.0]))  # node 1: never reached
    b = s.leaf(np.array([3.0, 4.0]))  # node 2
    loss = T.sum(T.mul(T.mul(a, b), a))  # a used first and last: final only at node 0
    seen: list[tuple[int, dict]] = []

    def record(node):
        return node, lambda found: seen.append((node, {k: v.copy() for k, v in found.items()}))

    beyond = len(s) + 3
    grads = s.backward(loss, on_final=[record(0), record(2), record(beyond), record(1)])
    assert [node for node, _ in seen] == [beyond, 2, 1, 0]
    assert seen[0][1] == {}  # nothing above the output was differentiated
    at_b, at_a = seen[1][1], seen[3][1]
    np.testing.assert_array_equal(at_b[b.id], grads[b])  # b's gradient is final at node 2
    assert a.id not in at_b and unused.id not in seen[2][1]  # unreached: absent, not zeros
    np.testing.assert_array_equal(at_a[a.id], grads[a])
    np.testing.assert_array_equal(grads[a], 2 * a.numpy() * b.numpy())


def test_a_0d_value_used_three_times_gets_every_contribution():  # C4, REFERENCE section 3
    s = EagerSession()
    x = s.leaf(np.array(2.0))
    assert s.backward(x * x + x * x + x * x + x)[x] == 13.0  # 6x + 1 at 2
    s = EagerSession()
    v = s.leaf(np.array([1.0, 2.0], np.float32))
    t = T.sum(v)  # a 0-d node used three times
    np.testing.assert_array_equal(s.backward(t * t + t)[v], [7.0, 7.0])  # 2t + 1 at t = 3


@pytest.mark.parametrize("device", [None, "torch:cpu"])
def test_sgd_step_with_an_earlier_recordings_gradients_updates_their_storages(device):  # C4
    if device is not None:
        pytest.importorskip("torch")
    p = Param(np.ones(2, np.float32), name="p")
    q = Param(np.full(2, 10.0, np.float32), name="q")
    s = EagerSession(device=device)
    first = s.backward(T.sum(s.use(p) * 3.0))
    s.use(q)  # a new recording, whose leaf 0 is q
    s.sgd_step(1.0, first)
    np.testing.assert_array_equal(p.value_synced(), [-2.0, -2.0])
    np.testing.assert_array_equal(q.value_synced(), [10.0, 10.0])


@pytest.mark.parametrize("device", [None, "torch:cpu"])
def test_refs_kept_past_the_tape_keep_their_recorded_values(device):  # C2
    if device is not None:
        pytest.importorskip("torch")
    p = Param(np.array([1.0, 2.0], np.float32))
    opt = SGD([p], lr=0.5)
    s = EagerSession(device=device)
    use = s.use(p)
    view = use.T  # an op output in the parameter's memory
    square = use * use
    grads = s.backward(T.sum(square))  # releases the tape: nothing pins p any more
    opt.step(grads)
    np.testing.assert_array_equal(p.value_synced(), [0.0, 0.0])
    for ref in (use, view):
        np.testing.assert_array_equal(ref.numpy(), [1.0, 2.0])
    np.testing.assert_array_equal(square.numpy(), [1.0, 4.0])
    np.testing.assert_array_equal(grads[use], [2.0, 4.0])


def test_the_reference_snapshot_sequence_holds_through_backward_and_sgd():  # C2, C3, case 8
    p = Param(np.float32(1.0))
    s = EagerSession()
    first = s.use(p)
    p.set_value(np.float32(5.0))
    second = s.use(p)
    s.sgd_step(0.25, s.backward(first * first + second))  # d/dp = 2 * 1 + 1 = 3
    assert (first.value, second.value, p.value) == (1.0, 5.0, 4.25)
