"""Sharded data parallel (ZeRO stages 1 and 2) by storage, on 1, 2 and 3 gloo processes.

The partition plan is tested directly; training runs a tiny ``TiedLM`` whose tied
vocabulary (67) neither 2 nor 3 divides (``shard_worker.py``) and compares the final
parameters, losses and checkpoints with the 1-process and the unsharded runs.
"""

import json
from functools import cache
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file

pytest.importorskip("torch.distributed")

from dist_launch import launch, run_module, tiny_train_flags  # noqa: E402
from shard_worker import model  # noqa: E402

from tiegrad import Param, ParamList  # noqa: E402
from tiegrad.distributed import DataParallel  # noqa: E402
from tiegrad.distributed.sharding import ShardPlan  # noqa: E402
from tiegrad.errors import DistributedError  # noqa: E402

WORKER = str(Path(__file__).with_name("shard_worker.py"))
RTOL = 1e-5  # test_distributed's: a mean taken in parts rounds otherwise than one mean


def run(world, out, **config):
    out.mkdir(parents=True, exist_ok=True)
    results, _ = launch(WORKER, world, [json.dumps(config), out])
    for rank, (rc, _, err) in enumerate(results):
        assert rc == 0, f"rank {rank} exited {rc}:\n{err[-3000:]}"
    ranks = [json.loads((out / f"rank_{r}.json").read_text()) for r in range(max(world, 1))]
    return np.load(out / "params.npz"), ranks


def reference_dir(tmp_root, config):
    return tmp_root / "ref" / json.dumps(config, sort_keys=True)


@cache
def _reference(tmp_root, key):
    config = json.loads(key)
    return run(0, reference_dir(tmp_root, config), **config)[0]


def reference(tmp_root, **config):
    """The final parameters of the 1-process run of ``config`` (run once per session)."""
    return _reference(tmp_root, json.dumps(config, sort_keys=True))


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("sharded")


def assert_close(a, b):
    assert len(a.files) == len(b.files)
    for k in a.files:
        gap = np.linalg.norm(a[k] - b[k]) / np.linalg.norm(b[k])
        assert gap <= RTOL, f"parameter {k}: relative gap {gap:.2e}"


def assert_equal(a, b):
    assert len(a) == len(b)
    for k in a.files if hasattr(a, "files") else a:
        np.testing.assert_array_equal(a[k], b[k], err_msg=k)


def final_checkpoint(out):
    (path,) = sorted((out / "run" / "checkpoints").glob("step_*.safetensors"))[-1:]
    return load_file(path)


# -- the plan -------------------------------------------------------------------------
def pieces_of(plan_rows):
    return {(rank, slot, start, stop) for _, rank, slot, start, stop in plan_rows}


@pytest.mark.parametrize("world", [1, 2, 3])
def test_the_plan_covers_each_trained_storage_once_in_near_equal_ranges(world):
    net = model()
    plist = net.param_list()
    plan = ShardPlan(plist, world, 0)
    trained = [i for i, c in enumerate(plist.canonical_slot_indices()) if c == i]
    assert 16 not in trained and 1 not in trained  # the tie's second use; frozen pos_embed
    covered = {i: np.zeros(plist[i].size, int) for i in trained}
    per_rank = [0] * world
    for _, rank, slot, start, stop in plan.rows():
        covered[slot][start:stop] += 1
        per_rank[rank] += stop - start
    assert all((c == 1).all() for c in covered.values())
    assert sum(per_rank) == plan.trained_elements == sum(plist[i].size for i in trained)
    assert max(per_rank) - min(per_rank) <= world  # ceil(N / world) each, the last less
    if world == 3:  # the tied embedding (67 x 8) spans ranks 0 and 1
        assert {rank for _, rank, slot, _, _ in plan.rows() if slot == 0} == {0, 1}


def test_a_storage_frozen_at_one_use_is_partitioned_once_at_its_trained_use():
    net = model()
    net.freeze("embed.weight")
    plan = ShardPlan(net.param_list(), 2, 0)
    slots = {slot for _, _, slot, _, _ in plan.rows()}
    assert 0 not in slots and 16 in slots and 1 not in slots
    net.freeze("lm_head.weight")  # frozen at both uses: no partition
    assert 16 not in {slot for _, _, slot, _, _ in ShardPlan(net.param_list(), 2, 0).rows()}


def test_more_ranks_than_elements_leave_the_last_ranks_empty_partitions():
    plist = ParamList([Param(np.ones(2, np.float32)), Param(np.ones(1, np.float64))])
    plans = [ShardPlan(plist, 4, r) for r in range(4)]
    assert [[(p.slot, p.start, p.stop) for _, p in pl.pieces] for pl in plans] == [
        [(0, 0, 1), (1, 0, 1)],
        [(0, 1, 2)],
        [],
        [],
    ]


def test_an_unknown_shard_mode_is_refused_naming_the_choices():
    with pytest.raises(DistributedError, match="shard must be None, 'optimizer' or 'gradients'"):
        DataParallel(model(), shard="parameters")


# -- training ---------------------------------------------------------------------------
@pytest.fixture(scope="module")
def plain_two(root):
    """The unsharded run on 2 processes: its folder, parameters and rank figures."""
    out = root / "plain_two"
    return (out, *run(2, out, opt="adamw", steps=6, checkpoint_every=6))


@pytest.mark.parametrize(
    "shard, bucket_mb",
    [("optimizer", 25.0), ("gradients", 25.0), ("gradients", 5e-4)],  # 5e-4: many rounds
)
def test_two_processes_equal_unsharded_data_parallel_bit_for_bit(
    root, tmp_path, plain_two, shard, bucket_mb
):
    config = {"opt": "adamw", "steps": 6, "checkpoint_every": 6}
    plain_dir, plain, plain_ranks = plain_two
    sharded, ranks = run(2, tmp_path, shard=shard, bucket_mb=bucket_mb, **config)
    assert_equal(sharded, plain)
    assert_equal(final_checkpoint(tmp_path), final_checkpoint(plain_dir))
    assert_close(sharded, reference(root, **config))
    full_state = plain_ranks[0]["optimizer_state"]
    assert [r["optimizer_state"] for r in ranks] == [full_state // 2, full_state // 2]
    full_grads = plain_ranks[0]["gradients"]
    if shard == "gradients":  # its partition; the scratch, at most bucket_mb, apart
        assert all(r["gradients"] == full_grads // 2 for r in ranks)
        assert all(0 < r["scratch"] <= bucket_mb * 2**20 for r in ranks)
    else:
        assert all(r["gradients"] == full_grads for r in ranks)


@pytest.mark.parametrize("shard", [None, "optimizer", "gradients"])
def test_three_processes_with_per_use_freezing_toggled_and_clipping_match_one(
    root, tmp_path, shard
):
    config = {"opt": "adamw", "steps": 8, "toggle": True, "clip": 0.2}
    config |= {"checkpoint_every": 2, "keep_last": 4}
    sharded, ranks = run(3, tmp_path, shard=shard, **config)
    assert_close(sharded, reference(root, **config))
    logged = json.loads((tmp_path / "losses.json").read_text())
    single = json.loads((reference_dir(root, config) / "losses.json").read_text())
    assert len(logged["losses"]) == 8 and all(r["step_count"] == 8 for r in ranks)
    # the global norm, clipped at every step, counts the tied storage once, as one process
    assert min(logged["norms"]) > 0.2
    np.testing.assert_allclose(logged["norms"], single["norms"], rtol=RTOL)
    # step 2's checkpoint follows the freeze of the embedding's input use: the tie's
    # state is keyed by its new canonical slot, lm_head's (16), as one process keys it
    name = Path("run", "checkpoints", "step_0000002.safetensors")
    one = load_file(reference_dir(root, config) / name)
    mine = load_file(tmp_path / name)
    assert sorted(mine) == sorted(one)
    assert [k for k in one if "16" in k and "exp_avg" in k]
    for k in one:
        np.testing.assert_allclose(mine[k], one[k], rtol=1e-5, atol=1e-7, err_msg=k)


@pytest.mark.parametrize("opt", ["sgd", "adam", "rmsprop", "adagrad"])
def test_every_optimizer_with_state_trains_sharded_as_in_one_process(root, tmp_path, opt):
    config = {"opt": opt, "steps": 6}
    assert_close(run(3, tmp_path, shard="gradients", **config)[0], reference(root, **config))


def test_a_device_session_trains_sharded_as_in_one_process(root, tmp_path):
    config = {"opt": "adamw", "steps": 4, "toggle": True}
    sharded, _ = run(2, tmp_path, shard="optimizer", device="torch:cpu", **config)
    assert_close(sharded, reference(root, **config))


def test_gradient_accumulation_on_two_processes_matches_one(root, tmp_path):
    config = {"opt": "adam", "steps": 4, "accum": 2, "clip": 0.2}
    assert_close(run(2, tmp_path, shard="gradients", **config)[0], reference(root, **config))
    norms = json.loads((tmp_path / "losses.json").read_text())["norms"]
    assert min(norms) > 0.2  # clipped at every step


@pytest.mark.parametrize("shard", ["optimizer", "gradients"])
def test_one_process_sharded_equals_one_process_bit_for_bit(root, tmp_path, shard):
    config = {"opt": "adamw", "steps": 4, "toggle": True}
    params, ranks = run(1, tmp_path, shard=shard, **config)
    assert_equal(params, reference(root, **config))


@pytest.mark.parametrize("toggle", [False, True])
def test_an_empty_state_loaded_mid_run_replaces_the_sharded_state(root, tmp_path, toggle):
    # after step 2 a step-0 state dict (no state) is loaded; with ``toggle`` the layout
    # changes at that step too, so the old pieces' state must not move to the new plan
    config = {"opt": "adamw", "steps": 5, "reset_at": 2, "toggle": toggle}
    params, ranks = run(1, tmp_path, shard="optimizer", **config)
    assert_equal(params, reference(root, **config))
    assert [r["step_count"] for r in ranks] == [3]
    kept = reference(root, **{**config, "reset_at": None})  # the reset changes the run
    assert any(not np.array_equal(params[k], kept[k]) for k in params.files)


def test_a_nonfinite_gradient_on_one_rank_skips_the_step_on_every_rank(tmp_path):
    config = {"opt": "adamw", "steps": 4, "nan_at": 2}
    params, ranks = run(3, tmp_path, shard="gradients", **config)
    assert [r["skipped"] for r in ranks] == [1, 1, 1]
    assert [r["step_count"] for r in ranks] == [3, 3, 3]


def test_a_sharded_step_refuses_a_plain_list_another_models_optimizer_and_a_bad_clip(tmp_path):
    results, _ = launch(WORKER, 1, [json.dumps({"shard": "gradients", "misuse": True}), tmp_path])
    assert results[0][0] == 0, results[0][2][-3000:]
    found = json.loads((tmp_path / "errors.json").read_text())
    assert found["errors"] == [
        "DataParallel.step: a sharded step takes the PartitionGradients that backward or "
        "average returned for the current layout, got list",
        "sharded step: slot 0 ('embed.weight') of the optimizer's parameter list is not the "
        "model's (other storage or trainability)",
        "DataParallel.step: clip_norm must be >= 0, got -1.0",
    ]
    assert found["unchanged"] and found["state"] == 0


@pytest.mark.parametrize("shard", ["optimizer", "gradients"])
def test_a_refused_sharded_step_changes_nothing(tmp_path, shard):
    # a bad hyperparameter and a non-finite gradient under nonfinite="raise" (C6)
    results, _ = launch(WORKER, 1, [json.dumps({"shard": shard, "refusals": True}), tmp_path])
    assert results[0][0] == 0, results[0][2][-3000:]
    found = json.loads((tmp_path / "errors.json").read_text())
    lr, nan = found["errors"]
    assert "lr" in lr and "-1.0" in lr
    assert "holds NaN or" in nan and "slot" in nan
    assert found["unchanged"]


def test_a_rank_with_another_shard_mode_is_refused_at_the_start(tmp_path):
    config = json.dumps({"shard": "optimizer", "rank1_shard": "gradients", "steps": 2})
    results, _ = launch(WORKER, 2, [config, tmp_path])
    for rc, _, err in results:
        assert rc != 0
        assert "rank 1 starts from another trainer state than rank 0 (differs in shard" in err


@pytest.mark.slow
@pytest.mark.parametrize(
    "first, second",
    [
        ((3, "gradients"), (0, None)),
        ((0, None), (2, "optimizer")),
        ((3, "optimizer"), (2, "gradients")),
    ],
)
def test_a_run_resumes_with_another_process_count_and_sharding(root, tmp_path, first, second):
    config = {"opt": "adamw", "steps": 8, "checkpoint_every": 4}
    run(first[0], tmp_path, shard=first[1], **(config | {"steps": 4}))
    resumed, _ = run(second[0], tmp_path, shard=second[1], **config)
    assert_close(resumed, reference(root, **config))
    straight = json.loads((reference_dir(root, config) / "losses.json").read_text())["losses"]
    losses = json.loads((tmp_path / "losses.json").read_text())["losses"]
    np.testing.assert_allclose(losses, straight[4:], rtol=RTOL)  # the steps after the resume


def test_the_command_trains_sharded_and_resumes_unsharded_on_one_process(tmp_path):
    run_dir = tmp_path / "run"
    cmd = ["tiegrad", "train", "--nproc", "2", "--shard", "gradients", "--steps", "3"]
    done = run_module(*cmd, *tiny_train_flags(tmp_path), "--run-dir", run_dir, "--no-progress")
    assert done.returncode == 0, done.stderr[-3000:]
    assert "done: 3 steps" in done.stdout
    assert json.loads((run_dir / "config.json").read_text())["shard"] == "gradients"
    again = ["tiegrad", "resume", run_dir, "--steps", "4", "--shard", "none", "--no-progress"]
    resumed = run_module(*again)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resumed from step 3" in resumed.stdout and "done: 4 steps" in resumed.stdout


def test_the_command_refuses_an_unknown_shard_mode_naming_the_choices(tmp_path):
    done = run_module("tiegrad", "train", "--shard", "params", "--steps", "1")
    assert done.returncode == 2
    assert "--shard: expected one of 'optimizer', 'gradients' or empty, got 'params'" in done.stderr


def test_a_rank_whose_plan_differs_is_named_with_the_first_differing_piece():
    from tiegrad.distributed.sharding import check_plans

    rows = ShardPlan(model().param_list(), 2, 0).rows()
    check_plans([rows, list(rows)])  # the same plan: accepted
    other = list(rows)
    other[3] = other[3][:4] + (other[3][4] + 1,)
    with pytest.raises(DistributedError, match=r"rank 1 partitions .* first at piece 3 "):
        check_plans([rows, other])
    with pytest.raises(DistributedError, match=r"rank 2 .* first at piece 3 .*: None on rank 2"):
        check_plans([rows, rows, rows[:3]])
