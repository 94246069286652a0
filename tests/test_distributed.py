"""tiegrad.distributed: data-parallel training on gloo, processes started by the test.

Every run is a few steps of a tiny ``TiedLM`` (``dist_worker.py``); ports are chosen
free on 127.0.0.1 and every process has a bounded wait.
"""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("torch.distributed")

from dist_launch import WAIT_S, base_env, launch, run_module, tiny_train_flags  # noqa: E402

from tiegrad.errors import DistributedError  # noqa: E402

WORKER = str(Path(__file__).with_name("dist_worker.py"))
RTOL = 1e-5


def run_ok(world, scenario, out, steps=20):
    results, _ = launch(WORKER, world, [scenario, out, steps])
    for rank, (rc, _, err) in enumerate(results):
        assert rc == 0, f"rank {rank} exited {rc}:\n{err[-3000:]}"
    return np.load(os.path.join(out, "params.npz"))


def assert_close(a, b):
    """Every parameter within ``RTOL`` of the reference, relative to its norm: averaging
    two half-batch means rounds otherwise than one full-batch mean, and 20 steps of
    float32 training carry those last bits on, most visibly in near-zero elements."""
    assert len(a.files) == len(b.files)
    for k in a.files:
        gap = np.linalg.norm(a[k] - b[k]) / np.linalg.norm(b[k])
        assert gap <= RTOL, f"parameter {k}: relative gap {gap:.2e}"


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    """The 1-process reference run: 20 steps, global batch 8."""
    out = tmp_path_factory.mktemp("straight")
    return run_ok(0, "train", out)


def test_two_processes_match_one_and_reduce_each_trainable_storage_once(straight, tmp_path):
    two = run_ok(2, "train", tmp_path)
    assert_close(two, straight)
    counts = json.loads((tmp_path / "bytes.json").read_text())
    assert len(counts["per_step"]) == 20
    # the tied embedding once, the frozen pos_embed not at all
    assert set(counts["per_step"]) == {counts["trainable_unique"]}
    assert counts["trainable_unique"] == sum(
        straight[k].nbytes for i, k in enumerate(straight.files) if i not in (1, 16)
    )


def test_overlapped_all_reduces_equal_the_ones_after_backward_bit_for_bit(tmp_path):
    results, _ = launch(WORKER, 2, ["overlap", tmp_path, 4])
    for rank, (rc, _, err) in enumerate(results):
        assert rc == 0, f"rank {rank} exited {rc}:\n{err[-3000:]}"
    found = json.loads((tmp_path / "overlap.json").read_text())
    assert found["equal"] == [True] * 4
    assert found["per_step"] == [found["trainable_unique"]] * 4
    # launched during the sweep: every bucket but the one the embedding (used first) ends
    assert found["buckets"] > 2 and found["launched_early"] == 4 * (found["buckets"] - 1)


@pytest.mark.slow
def test_a_device_session_trains_the_same_on_two_processes(straight, tmp_path):
    assert_close(run_ok(2, "device", tmp_path), straight)


@pytest.mark.slow
@pytest.mark.parametrize("first,second", [(2, 0), (0, 2)])
def test_resume_with_another_process_count(straight, tmp_path, first, second):
    run_ok(first, "train", tmp_path, steps=10)
    resumed = run_ok(second, "train", tmp_path, steps=20)
    assert_close(resumed, straight)


def seconds_after_the_failure(ended, out):
    return ended - float((Path(out) / "failed_at").read_text())


def test_a_rank_that_raises_stops_every_rank_naming_it(tmp_path):
    results, ended = launch(WORKER, 2, ["raise", tmp_path], timeout=30.0)
    assert seconds_after_the_failure(ended, tmp_path) < 30.0
    assert all(rc != 0 for rc, _, _ in results)
    assert "injected failure" in results[1][2]
    last = results[0][2].strip().splitlines()[-1]
    assert "rank 1 failed at step 5: RuntimeError: injected failure" in last


def test_a_rank_that_dies_stops_the_others_within_the_timeout(tmp_path):
    results, ended = launch(WORKER, 2, ["die", tmp_path], timeout=30.0)
    assert seconds_after_the_failure(ended, tmp_path) < 30.0
    assert results[1][0] == 3 and results[0][0] != 0
    last = results[0][2].strip().splitlines()[-1]
    assert "rank 0: stopping: rank 1 died or did not answer within 30 s" in last


def test_a_signal_after_the_step_agreement_stops_every_rank_at_the_next_step(tmp_path):
    results, _ = launch(WORKER, 2, ["late_signal", tmp_path])
    for rank, (rc, _, err) in enumerate(results):
        assert rc == 0, f"rank {rank} exited {rc}:\n{err[-3000:]}"
        assert (tmp_path / f"status_{rank}").read_text() == "interrupted 4"


def test_the_checksum_catches_a_perturbed_parameter(tmp_path):
    results, _ = launch(WORKER, 2, ["perturb", tmp_path])
    for rc, _, err in results:
        assert rc != 0
        assert "diverged at step 4: rank 1 differs from rank 0 first at slot 2" in err
        assert "'blocks.0.ln1.weight'" in err


def test_a_sharded_validation_loader_gives_every_rank_one_processs_losses(tmp_path):
    one, two = tmp_path / "one", tmp_path / "two"
    one.mkdir(), two.mkdir()
    run_ok(0, "val", one, steps=8)
    run_ok(2, "val", two, steps=8)
    single, shared = (json.loads((d / "val.json").read_text()) for d in (one, two))
    assert len(shared) == len(single) == 4  # steps 2, 4, 6 and 8 (the final one)
    np.testing.assert_allclose(shared, single, rtol=1e-5)


@pytest.mark.parametrize(
    "scenario, differs",
    [
        ("datasize", "train_batches"),
        ("lr", "optimizer"),
        ("samples", "train_samples"),  # 60 and 64 samples: 8 batches of 8 each
        ("accum", "grad_accum"),
        ("clip", "clip_norm"),
    ],
)
def test_ranks_with_other_data_or_settings_are_refused_at_the_start(tmp_path, scenario, differs):
    results, _ = launch(WORKER, 2, [scenario, tmp_path])
    for rc, _, err in results:
        assert rc != 0
        assert f"rank 1 starts from another trainer state than rank 0 (differs in {differs}" in err


def test_each_rank_draws_its_own_dropout_masks_and_resumes_its_stream(tmp_path):
    whole, halves = tmp_path / "whole", tmp_path / "halves"
    whole.mkdir(), halves.mkdir()
    run_ok(2, "dropout", whole, steps=20)
    run_ok(2, "dropout", halves, steps=10)
    run_ok(2, "dropout", halves, steps=20)  # resumes from the step-10 checkpoint
    draws = {d: [json.loads((d / f"draws_{r}.json").read_text()) for r in (0, 1)]
             for d in (whole, halves)}  # fmt: skip
    assert draws[whole][0] != draws[whole][1]  # not the same masks on both shards
    assert draws[halves] == draws[whole]  # each rank's stream continues exactly


def test_without_torch_distributed_both_entry_points_say_what_to_install(monkeypatch, capsys):
    from tiegrad.cli import main
    from tiegrad.distributed import init

    monkeypatch.setitem(sys.modules, "torch.distributed", None)  # import fails
    for name, value in (("RANK", "0"), ("WORLD_SIZE", "1"), ("MASTER_ADDR", "localhost")):
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("MASTER_PORT", "29500")
    with pytest.raises(DistributedError, match="init: data-parallel training needs torch"):
        init()
    for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name)
    with pytest.raises(SystemExit) as exit_info:
        main(["train", "--nproc", "2", "--steps", "1"])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and len(err.strip().splitlines()) == 1
    assert err.startswith("tiegrad: error: --nproc: data-parallel training needs torch"), err


@pytest.mark.parametrize("draws", [1, 2, 3, 7])
def test_a_resumed_rank_keeps_the_half_output_a_jump_drops(draws):
    """Rank 1's stream is rank 0's jumped; after an odd number of float32 draws (dropout
    masks of an odd size) the generator holds half a 64-bit output, which ``jumped``
    drops: a rank resumed from rank 0's saved state must draw what it would have."""
    from tiegrad.train.trainer import _jumped

    rank0 = np.random.Generator(np.random.PCG64(5))
    rank1 = np.random.Generator(_jumped(rank0.bit_generator, 1))
    rank0.random(draws, dtype=np.float32), rank1.random(draws, dtype=np.float32)
    saved = np.random.PCG64()
    saved.state = rank0.bit_generator.state  # what a checkpoint holds
    resumed = np.random.Generator(_jumped(saved, 1))
    np.testing.assert_array_equal(
        resumed.random(9, dtype=np.float32), rank1.random(9, dtype=np.float32)
    )


def test_a_storage_one_rank_does_not_use_trains_as_in_one_process(tmp_path):
    one, two = tmp_path / "one", tmp_path / "two"
    one.mkdir(), two.mkdir()
    assert_close(run_ok(2, "partial", two, steps=6), run_ok(0, "partial", one, steps=6))


def test_a_callbacks_failure_names_the_step_it_followed(tmp_path):
    results, _ = launch(WORKER, 2, ["raise_cb", tmp_path], timeout=30.0)
    assert all(rc != 0 for rc, _, _ in results)
    last = results[0][2].strip().splitlines()[-1]
    assert "rank 1 failed at step 3: RuntimeError: injected callback failure" in last


def test_the_ranks_are_compared_at_the_end_of_fit(tmp_path):
    results, _ = launch(WORKER, 2, ["perturb_last", tmp_path, 4])  # checksums every 100 steps
    for rc, _, err in results:
        assert rc != 0
        assert "diverged at step 4: rank 1 differs from rank 0 first at slot 2" in err


def test_another_tie_layout_fails_at_wrap_time_showing_both(tmp_path):
    results, _ = launch(WORKER, 2, ["layout", tmp_path])
    for rc, _, err in results:
        assert rc != 0
        assert "rank 1 holds another parameter layout than rank 0" in err
        assert "rank 0" in err and "<-- differs" in err


@pytest.mark.slow
def test_torchrun_trains_end_to_end_and_one_process_resumes(tmp_path):
    run = tmp_path / "run"
    cmd = ["torch.distributed.run", "--nproc-per-node", "2", "-m", "tiegrad", "train"]
    cmd += ["--steps", "20", *tiny_train_flags(tmp_path), "--run-dir", run, "--no-progress"]
    done = run_module(*cmd)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.count("resolved configuration") == 1  # rank 0 alone prints
    assert "done: 20 steps" in done.stdout
    assert (run / "checkpoints" / "step_0000020.safetensors").is_file()
    lines = (run / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(x)["step"] for x in lines if "train_loss" in x] == list(range(1, 21))
    resumed = run_module("tiegrad", "resume", run, "--steps", "22", "--no-progress")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resumed from step 20" in resumed.stdout and "done: 22 steps" in resumed.stdout


def test_with_nproc_rank_0_alone_says_it_was_interrupted_or_is_finished(tmp_path):
    text = tmp_path / "t.txt"
    text.write_text("".join(f"def f{i}(x):\n    return x * {i % 7}\n" for i in range(300)))
    run = tmp_path / "run"
    flags = ["--text", text, "--d-model", "16", "--layers", "1", "--heads", "2", "--seq-len"]
    flags += ["16", "--batch-size", "4", "--eval-every", "1000", "--checkpoint-every", "3"]
    cmd = [sys.executable, "-m", "tiegrad", "train", "--nproc", "2", "--steps", "100000"]
    cmd += [*flags, "--run-dir", run, "--no-progress"]
    env = dict(base_env(), PYTHONUNBUFFERED="1")
    proc = subprocess.Popen(
        list(map(str, cmd)), env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline and proc.poll() is None:
        if (run / "checkpoints" / "step_0000003.safetensors").exists():
            break
        time.sleep(0.05)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=WAIT_S)
    assert proc.returncode == 130, err[-3000:]
    assert err.count("SIGINT: finishing the current step") == 1, err[-3000:]
    assert out.count("interrupted at step") == 1, out[-3000:] + err[-3000:]
    reached = max(int(p.stem.split("_")[1]) for p in (run / "checkpoints").glob("step_*"))
    again = ["resume", run, "--steps", reached, "--nproc", "2", "--no-progress"]
    done = run_module("tiegrad", *again, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.count(f"is finished: it reached step {reached} of {reached}") == 1


def test_with_nproc_an_error_every_rank_meets_is_printed_once_with_its_exit_code(tmp_path):
    missing = tmp_path / "missing.txt"
    cmd = ["tiegrad", "train", "--nproc", "2", "--text", missing, "--steps", "2"]
    done = run_module(*cmd, "--no-progress")
    assert done.returncode == 2, done.stderr[-3000:]
    assert done.stderr.count("tiegrad: error:") == 1, done.stderr[-3000:]
    assert f"text file '{missing}' does not exist" in done.stderr


def test_init_outside_torchrun_names_the_missing_variable(monkeypatch):
    import tiegrad.distributed as dist
    from tiegrad import TiegradError

    for key in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(key, raising=False)
    with pytest.raises(TiegradError, match="WORLD_SIZE is not set.*torchrun"):
        dist.init()
    assert not dist.is_initialized() and dist.rank() == 0 and dist.world_size() == 1
    monkeypatch.setenv("TIEGRAD_DIST_TIMEOUT", "soon")
    with pytest.raises(TiegradError, match="TIEGRAD_DIST_TIMEOUT='soon' is not a number"):
        dist.init()


def test_nproc_is_taken_out_of_the_relaunched_command():
    from tiegrad.distributed.launch import without_flag

    argv = ["train", "--nproc", "2", "--steps", "5", "--nproc=3", "--run-dir", "r"]
    assert without_flag(argv, "--nproc") == ["train", "--steps", "5", "--run-dir", "r"]
