"""Checkpoints of the reference models with AdamW and a cosine schedule (C9).

Round trips restore ties (the same storage object at every alias slot) and every
tensor and counter bit for bit; a run resumed in a new process from a checkpoint at
step 20 ends bit-identical to a straight 40-step run, with dropout on (so the session's
RNG state must travel with the checkpoint).
"""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
from test_checkpoint_file import layout, snapshot

import tiegrad
from tiegrad import CheckpointError, EagerSession
from tiegrad.models import SharedBlockLM, TiedLM
from tiegrad.optim import SGD, AdamW
from tiegrad.optim.schedules import CosineWarmup

VOCAB, BATCH, SEQ, TOTAL = 32, 4, 8, 40
SMALL = {
    TiedLM: dict(vocab_size=VOCAB, d_model=16, n_layers=1, n_heads=2, max_seq_len=SEQ),
    SharedBlockLM: dict(vocab_size=VOCAB, d_model=16, n_heads=2, n_repeats=2, max_seq_len=SEQ),
}


def setup(model_cls=TiedLM, seed: int = 0, session_seed: int = 0):
    """A small model with dropout, AdamW over its slots and a cosine schedule."""
    model = model_cls(**SMALL[model_cls], dropout=0.1, seed=seed)
    opt = AdamW(model.param_list(), lr=1e-2, weight_decay=0.01)
    sched = CosineWarmup(opt, warmup_steps=5, total_steps=TOTAL, min_lr=1e-4)
    return model, opt, sched, EagerSession(seed=session_seed)


def train(model, opt, sched, session, first: int, last: int) -> None:
    """Steps ``first``..``last - 1``; the batch of a step depends on the step alone."""
    for step in range(first, last):
        session.reset()
        batch = np.random.default_rng(1000 + step).integers(0, VOCAB, (BATCH, SEQ + 1))
        loss = model.loss(session, batch[:, :-1], batch[:, 1:])
        opt.step(session.backward(loss))
        sched.step()


def opt_bytes(opt) -> dict:
    sd = opt.state_dict()
    sd["state"] = {
        c: {k: (v.tobytes() if isinstance(v, np.ndarray) else v) for k, v in st.items()}
        for c, st in sd["state"].items()
    }
    return sd


@pytest.mark.parametrize("model_cls", [TiedLM, SharedBlockLM])
def test_round_trip_restores_ties_tensors_and_counters(tmp_path, model_cls):  # C9
    model, opt, sched, session = setup(model_cls)
    train(model, opt, sched, session, 0, 3)
    path = tmp_path / "ckpt.safetensors"
    tiegrad.save(path, model, optimizer=opt, schedule=sched, rng=session, extra={"run": "a"})

    fresh, fresh_opt, fresh_sched, fresh_session = setup(model_cls, seed=7, session_seed=7)
    result = tiegrad.load(path, fresh, optimizer=fresh_opt, schedule=fresh_sched, rng=fresh_session)
    assert result.step == 3 and result.extra == {"run": "a"}
    assert fresh.lm_head.weight.storage is fresh.embed.weight.storage
    assert layout(fresh.param_list()) == layout(model.param_list())
    assert [s[1:] for s in snapshot(fresh.param_list())] == [
        s[1:] for s in snapshot(model.param_list())
    ]
    assert opt_bytes(fresh_opt) == opt_bytes(opt)
    assert fresh_sched.state_dict() == sched.state_dict()
    assert fresh_opt.param_groups[0]["lr"] == opt.param_groups[0]["lr"]
    assert fresh_session.rng.bit_generator.state == session.rng.bit_generator.state


def test_shared_block_is_stored_once(tmp_path):
    model = SharedBlockLM(vocab_size=512, d_model=64, n_heads=2, n_repeats=3, max_seq_len=SEQ)
    path = tmp_path / "shared.safetensors"
    tiegrad.save(path, model)
    plist = model.param_list()
    unique = sum(p.value.nbytes for p in {id(p.storage): p for p in plist}.values())
    assert os.path.getsize(path) <= 1.05 * unique
    assert "tie: embed.weight = lm_head.weight" in tiegrad.inspect(path)


def test_model_of_another_architecture_changes_nothing(tmp_path):
    model, opt, sched, session = setup(TiedLM)
    train(model, opt, sched, session, 0, 2)
    path = tmp_path / "tied.safetensors"
    tiegrad.save(path, model, optimizer=opt, schedule=sched)
    other, other_opt, other_sched, _ = setup(SharedBlockLM)
    train(other, other_opt, other_sched, EagerSession(), 0, 1)
    before = (snapshot(other.param_list()), opt_bytes(other_opt), other_sched.state_dict())
    with pytest.raises(CheckpointError, match="blocks.0.ln1.weight"):
        tiegrad.load(path, other, optimizer=other_opt, schedule=other_sched)
    after = (snapshot(other.param_list()), opt_bytes(other_opt), other_sched.state_dict())
    assert after == before


def test_optimizer_of_another_kind_changes_nothing(tmp_path):
    model, opt, sched, session = setup(TiedLM)
    train(model, opt, sched, session, 0, 2)
    path = tmp_path / "adamw.safetensors"
    tiegrad.save(path, model, optimizer=opt)
    target, *_ = setup(TiedLM, seed=3)
    sgd = SGD(target.param_list(), lr=0.1, momentum=0.9)
    before = (snapshot(target.param_list()), opt_bytes(sgd))
    with pytest.raises(CheckpointError, match="optimizer kind mismatch.*'AdamW'.*'SGD'"):
        tiegrad.load(path, target, optimizer=sgd)
    assert (snapshot(target.param_list()), opt_bytes(sgd)) == before


_RESUME = """
import sys
sys.path.insert(0, sys.argv[1])
import tiegrad
from test_checkpoint_models import setup, train, TOTAL
model, opt, sched, session = setup(seed=99, session_seed=99)
tiegrad.load(sys.argv[2], model, optimizer=opt, schedule=sched, rng=session)
train(model, opt, sched, session, TOTAL // 2, TOTAL)
tiegrad.save(sys.argv[3], model, optimizer=opt, schedule=sched, rng=session)
"""


def test_resume_in_a_new_process_is_bit_identical_to_a_straight_run(tmp_path):
    straight = setup()
    train(*straight, 0, TOTAL)
    tiegrad.save(tmp_path / "straight.safetensors", straight[0], *straight[1:3], rng=straight[3])

    half = setup()
    train(*half, 0, TOTAL // 2)
    tiegrad.save(tmp_path / "half.safetensors", half[0], *half[1:3], rng=half[3])
    here = os.path.dirname(os.path.abspath(__file__))
    subprocess.run(
        [
            sys.executable,
            "-c",
            _RESUME,
            here,
            str(tmp_path / "half.safetensors"),
            str(tmp_path / "resumed.safetensors"),
        ],
        check=True,
    )
    resumed = (tmp_path / "resumed.safetensors").read_bytes()
    assert resumed == (tmp_path / "straight.safetensors").read_bytes()
    assert resumed != (tmp_path / "half.safetensors").read_bytes()
