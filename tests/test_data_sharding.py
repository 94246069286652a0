"""Data sharding for data-parallel training: each rank's part of every global batch."""

import subprocess
import sys

import numpy as np
import pytest

from tiegrad import ConfigError
from tiegrad.data import ArrayDataset, DataLoader, TextDataset

TEXT = "".join(f"def f{i}(x):\n    return x * {i % 7}\n" for i in range(80))


def epochs(make, world):
    """Per rank, the batches of one epoch drawn from the same generator seed."""
    return [list(make(r, world).epoch(np.random.default_rng(4))) for r in range(world)]


@pytest.mark.parametrize("world", [1, 2, 4])
def test_shards_are_disjoint_and_make_the_global_batch_of_one_process(world):
    data = ArrayDataset(np.arange(40)[:, None] * 1.0, np.arange(40))

    def make(rank, world):
        return DataLoader(data, 8, rank=rank, world_size=world)

    single = epochs(make, 1)[0]
    shards = epochs(make, world)
    assert all(len(s) == len(single) == len(make(0, world)) for s in shards)
    for k, batch in enumerate(single):
        parts = [s[k][1] for s in shards]
        assert all(len(p) == 8 // world for p in parts)
        np.testing.assert_array_equal(np.concatenate(parts), batch[1])


def test_window_shards_are_parts_of_the_same_global_windows():
    data = TextDataset(TEXT, block_size=6)
    single = epochs(lambda r, w: data.loader("train", 4, r, w), 1)[0]
    shards = epochs(lambda r, w: data.loader("train", 4, r, w), 2)
    for k, (x, y) in enumerate(single):
        np.testing.assert_array_equal(np.concatenate([s[k][0] for s in shards]), x)
        np.testing.assert_array_equal(np.concatenate([s[k][1] for s in shards]), y)


def test_a_partial_last_batch_is_split_evenly_or_refused():
    data = ArrayDataset(np.arange(10))
    parts = [
        list(DataLoader(data, 4, rank=r, world_size=2).epoch(np.random.default_rng(0)))
        for r in (0, 1)
    ]
    assert [len(b[0]) for b in parts[0]] == [2, 2, 1]  # the last batch of 2: one each
    for n, batch, world, last in ((9, 4, 4, 1), (14, 4, 4, 2), (21, 8, 2, 5)):
        with pytest.raises(ConfigError, match=f"last batch of {last} samples does not split"):
            DataLoader(ArrayDataset(np.arange(n)), batch, rank=1, world_size=world)


def test_an_unshareable_last_batch_is_refused_before_the_first_batch(monkeypatch):
    data = ArrayDataset(np.arange(7))
    with pytest.raises(ConfigError, match="DataLoader: the last batch of 1 samples does not"):
        DataLoader(data, 6, shuffle=False, rank=0, world_size=2)
    assert len(DataLoader(data, 6, drop_last=True, rank=0, world_size=2)) == 1
    from tiegrad.distributed import group  # the group's world size is read per epoch

    monkeypatch.setattr(group, "world_size", lambda: 2)
    monkeypatch.setattr(group, "rank", lambda: 0)
    epoch = DataLoader(data, 6, shuffle=False).epoch(np.random.default_rng(0))
    with pytest.raises(ConfigError, match="last batch of 1 samples does not split evenly over 2"):
        next(epoch)


def test_bad_shard_settings_are_config_errors():
    data = ArrayDataset(np.arange(10))
    with pytest.raises(ConfigError, match="give both rank and world_size"):
        DataLoader(data, 4, rank=1)
    with pytest.raises(ConfigError, match="rank 2 is outside 0..1"):
        DataLoader(data, 4, rank=2, world_size=2)
    with pytest.raises(ConfigError, match="global batch size 4 does not split evenly over 3"):
        list(DataLoader(data, 4, rank=0, world_size=3).epoch(np.random.default_rng(0)))


def test_the_distributed_layer_imports_no_torch():
    code = (
        "import sys, tiegrad, tiegrad.distributed as d, tiegrad.train, tiegrad.cli\n"
        "assert (d.rank(), d.world_size(), d.is_main()) == (0, 1, True)\n"
        "assert 'torch' not in sys.modules, 'torch imported'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
