"""``from_torch``/``to_torch``: torch module parameters in and out, ties by storage (issue 18)."""

from __future__ import annotations

import numpy as np
import pytest

from tiegrad import AliasError, DTypeError, Param, ShapeError, SlotError
from tiegrad.interop import from_torch, to_torch, torch_buffers

torch = pytest.importorskip("torch")
nn = torch.nn


class Net(nn.Module):
    """A tied embedding/head pair, a frozen layer and a BatchNorm (buffers)."""

    def __init__(self, tied: bool = True) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(10, 4)
        self.frozen = nn.Linear(4, 4)
        self.frozen.weight.requires_grad_(False)
        self.bn = nn.BatchNorm1d(4)
        self.head = nn.Linear(4, 10, bias=False)
        if tied:
            self.head.weight = self.emb.weight


def test_from_torch_keeps_paths_ties_flags_and_values():
    net = Net()
    params = from_torch(net)
    names = [p for p, _ in net.named_parameters(remove_duplicate=False)]
    assert list(params) == names == [
        "emb.weight", "frozen.weight", "frozen.bias", "bn.weight", "bn.bias", "head.weight"
    ]  # fmt: skip
    assert params["head.weight"].storage is params["emb.weight"].storage
    assert params["head.weight"] is not params["emb.weight"]
    assert len({id(p.storage) for p in params.values()}) == 5
    assert params["frozen.weight"].requires_grad is False and params["frozen.bias"].requires_grad
    for path, t in net.named_parameters(remove_duplicate=False):
        np.testing.assert_array_equal(params[path].value, t.detach().numpy())
        assert params[path].name == path
    with torch.no_grad():
        net.emb.weight.add_(1.0)  # values were copied
    assert not np.array_equal(params["emb.weight"].value, net.emb.weight.detach().numpy())


def test_round_trip_writes_each_storage_once_and_keeps_the_torch_tie():
    net = Net()
    params = from_torch(net)
    new = {p: h.value * 2.0 + 1.0 for p, h in params.items()}
    for path, h in params.items():
        h.set_value(new[path])
    net.bn.train()
    net.bn(torch.randn(8, 4))
    buffers = torch_buffers(net)
    assert set(buffers) == {"bn.running_mean", "bn.running_var", "bn.num_batches_tracked"}
    assert not buffers["bn.running_mean"].flags.writeable
    fresh = Net()
    to_torch(params, fresh, buffers=buffers)
    assert fresh.head.weight is fresh.emb.weight
    for path, t in fresh.named_parameters(remove_duplicate=False):
        np.testing.assert_array_equal(t.detach().numpy(), new[path], err_msg=path)
    for path, b in fresh.named_buffers():
        np.testing.assert_array_equal(b.numpy(), buffers[path], err_msg=path)
    assert fresh.frozen.weight.requires_grad is False


def test_distinct_parameter_objects_over_one_view_are_one_storage():
    m = nn.Module()
    m.a = nn.Parameter(torch.randn(3, 2))
    m.b = nn.Parameter(m.a.data)  # another object, the same storage view
    params = from_torch(m)
    assert params["a"].storage is params["b"].storage


def test_non_overlapping_views_are_separate_storages_and_overlapping_ones_are_refused():
    base = torch.arange(10.0)
    ok = nn.Module()
    ok.lo = nn.Parameter(base[:5])
    ok.hi = nn.Parameter(base[5:])
    params = from_torch(ok)
    assert params["lo"].storage is not params["hi"].storage
    params["hi"].set_value(np.zeros(5, np.float32))
    to_torch(params, ok)
    np.testing.assert_array_equal(base.numpy(), [0, 1, 2, 3, 4, 0, 0, 0, 0, 0])
    bad = nn.Module()
    bad.first = nn.Parameter(base[:6])
    bad.second = nn.Parameter(base[4:])
    with pytest.raises(AliasError, match=r"'first' \(6,\) and 'second' \(6,\) overlap"):
        from_torch(bad)
    transposed = nn.Module()
    transposed.w = nn.Parameter(torch.randn(3, 3))
    transposed.wt = nn.Parameter(transposed.w.data.t())
    with pytest.raises(AliasError, match="'w' .* and 'wt' .* overlap"):
        from_torch(transposed)


def test_to_torch_refuses_another_tie_layout_and_writes_nothing():
    untied = from_torch(Net(tied=False))
    for h in untied.values():
        h.set_value(np.zeros(h.shape, h.dtype))
    target = Net(tied=True)
    before = {p: t.detach().clone() for p, t in target.named_parameters(remove_duplicate=False)}
    with pytest.raises(AliasError) as info:
        to_torch(untied, target)
    text = str(info.value)
    assert "nothing was written" in text
    assert "path" in text and "torch" in text and "tiegrad" in text
    head_row = next(line for line in text.splitlines() if line.strip().startswith("head.weight"))
    assert "storage 0 (10, 4)" in head_row and "storage 5 (10, 4)" in head_row
    for path, t in target.named_parameters(remove_duplicate=False):
        assert torch.equal(t, before[path]), path


def test_to_torch_checks_buffers_and_shapes_before_writing():
    params = from_torch(Net())
    target = Net()
    target_emb = target.emb.weight.detach().clone()
    params["emb.weight"].set_value(np.zeros((10, 4), np.float32))
    with pytest.raises(SlotError, match="no buffer 'bn.nope'"):
        to_torch(params, target, buffers={"bn.nope": np.zeros(4)})
    with pytest.raises(ShapeError, match="buffer 'bn.running_mean' has shape"):
        to_torch(params, target, buffers={"bn.running_mean": np.zeros(5)})
    assert torch.equal(target.emb.weight, target_emb)
    missing = dict(params)
    del missing["frozen.bias"]
    with pytest.raises(AliasError, match="frozen.bias"):
        to_torch(missing, target)


def test_unsupported_dtype_is_named():
    m = nn.Linear(2, 2).to(torch.bfloat16)
    with pytest.raises(DTypeError, match="'weight': torch dtype bfloat16"):
        from_torch(m)


def test_parameters_with_no_element_are_tied_only_when_they_are_one_parameter():  # C1
    m = torch.nn.Module()
    m.a = torch.nn.Parameter(torch.empty(0))
    m.b = torch.nn.Parameter(torch.empty(0))
    m.c = m.a
    params = from_torch(m)
    assert params["a"].storage is params["c"].storage
    assert params["a"].storage is not params["b"].storage


def test_to_torch_refuses_a_buffer_value_its_dtype_would_round_and_writes_nothing():  # C6
    m = torch.nn.BatchNorm1d(3)
    params = from_torch(m)
    params["weight"].set_value(np.full(3, 2.0, np.float32))
    with pytest.raises(DTypeError, match="num_batches_tracked.*float64.*torch.int64"):
        to_torch(params, m, buffers={"num_batches_tracked": np.array(2.7)})
    assert torch.equal(m.weight, torch.ones(3)) and int(m.num_batches_tracked) == 0
    to_torch(params, m, buffers={"running_mean": np.array([1, 2, 3])})  # ints fit a float
    assert torch.equal(m.running_mean, torch.tensor([1.0, 2.0, 3.0]))


def test_to_torch_checks_every_buffer_value_before_writing_anything():  # C6
    m = torch.nn.BatchNorm1d(3)
    params = from_torch(m)
    params["weight"].set_value(np.full(3, 7.0, np.float32))
    rounded = {"running_mean": np.full(3, 5.0, np.float32), "running_var": np.full(3, 0.1)}
    with pytest.raises(DTypeError, match="'running_var' is float64 here but torch.float32"):
        to_torch(params, m, buffers=rounded)
    wrapped = {"num_batches_tracked": np.array(2**63 + 5, np.uint64)}
    with pytest.raises(DTypeError, match="'num_batches_tracked' is uint64"):
        to_torch(params, m, buffers=wrapped)
    assert torch.equal(m.weight, torch.ones(3)) and torch.equal(m.running_mean, torch.zeros(3))
    exact = {
        "running_mean": np.full(3, 0.5),  # float64 values that float32 holds exactly
        "running_var": np.full(3, 2.0, ">f4"),  # the other byte order
        "num_batches_tracked": np.array(4, np.int32),
    }
    to_torch(params, m, buffers=exact)
    assert torch.equal(m.running_mean, torch.full((3,), 0.5))
    assert torch.equal(m.running_var, torch.full((3,), 2.0))
    assert int(m.num_batches_tracked) == 4 and torch.equal(m.weight, torch.full((3,), 7.0))


@pytest.mark.parametrize("counter", [np.uint64(2**63 + 5), 2**63 + 5, 2**70])
def test_to_torch_keeps_numpy_scalars_and_python_ints_in_the_counters_range(counter):  # C6
    m = torch.nn.BatchNorm1d(3)
    params = from_torch(m)
    params["weight"].set_value(np.full(3, 7.0, np.float32))
    with pytest.raises(DTypeError, match="'num_batches_tracked' is .* here but torch.int64"):
        to_torch(params, m, buffers={"num_batches_tracked": counter})
    assert int(m.num_batches_tracked) == 0 and torch.equal(m.weight, torch.ones(3))
    to_torch(params, m, buffers={"num_batches_tracked": 2**62, "running_mean": [0.1, 1, 2]})
    assert int(m.num_batches_tracked) == 2**62
    assert torch.equal(m.running_mean, torch.tensor([0.1, 1.0, 2.0]))


def test_an_expanded_parameter_is_refused_both_ways():
    m = torch.nn.Module()
    m.a = torch.nn.Parameter(torch.zeros(3))
    m.b = torch.nn.Parameter(torch.ones(1, 4).expand(3, 4))
    with pytest.raises(AliasError, match="'b' .3, 4. repeats its elements along axis 0"):
        from_torch(m)
    params = {"a": Param(np.full(3, 9.0, np.float32)), "b": Param(np.ones((3, 4), np.float32))}
    with pytest.raises(AliasError, match="stride 0"):
        to_torch(params, m)
    assert torch.equal(m.a, torch.zeros(3))
