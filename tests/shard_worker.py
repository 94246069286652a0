"""One rank of the sharded data-parallel tests (``test_sharded.py`` starts the processes).

``python tests/shard_worker.py CONFIG OUT`` trains a tiny ``TiedLM`` (vocabulary 67,
which neither 2 nor 3 divides; the embedding tied to the output, ``pos_embed`` frozen)
with the ``Trainer`` for ``steps`` steps of a global batch of 12, in a process group
when torchrun's variables are set (``DataParallel(shard=CONFIG["shard"])``), else as the
1-process reference. ``CONFIG`` is JSON: ``shard``, ``opt`` (a key of ``OPTIMIZERS``),
``steps``, ``accum``, ``clip``, ``toggle`` (the embedding's input use frozen after step
2, released after step 5, as per-use freezing), ``reset_at`` (after that step the
optimizer loads a fresh optimizer's state dict: no state, counters 0),
``checkpoint_every``, ``keep_last``, ``bucket_mb``, ``nan_at`` (the last rank multiplies
its loss by NaN at that step, with ``nonfinite="skip"``), ``rank1_shard`` (rank 1's own
shard mode), ``device`` (the session's), ``misuse`` (no training: ``DataParallel.step``
given a plain list, then another model's optimizer, then a negative clip_norm; the
errors go to ``OUT/errors.json``, with whether the parameters stayed as they were),
``refusals`` (no training: one sharded step, then a refused negative lr and a refused
NaN gradient, see ``refusals``). A run folder ``OUT/run`` that holds checkpoints is
resumed. Rank 0 writes ``OUT/params.npz`` and ``OUT/losses.json`` (the losses and the
gradient norms of the steps); every rank writes ``OUT/rank_RANK.json`` (the bytes of
optimizer state and gradients it held, its skipped steps and step count).
"""

import json
import os
import sys

import numpy as np

import tiegrad.distributed as dist
from tiegrad.data import ArrayDataset, DataLoader
from tiegrad.models import TiedLM
from tiegrad.optim import SGD, Adagrad, Adam, AdamW, RMSprop
from tiegrad.train import Callback, Trainer

VOCAB, SEQ, BATCH = 67, 8, 12
# eps 1e-3: the attention's key bias has a zero gradient up to rounding, which a small eps
# would turn into full-size updates of that rounding (in one process as in several)
OPTIMIZERS = {
    "sgd": lambda p, **kw: SGD(p, lr=0.05, momentum=0.9, weight_decay=0.01, **kw),
    "adam": lambda p, **kw: Adam(p, lr=0.01, eps=1e-3, weight_decay=0.01, **kw),
    "adamw": lambda p, **kw: AdamW(p, lr=0.01, eps=1e-3, weight_decay=0.1, **kw),
    "rmsprop": lambda p, **kw: RMSprop(p, lr=0.01, eps=1e-3, momentum=0.5, weight_decay=0.01, **kw),
    "adagrad": lambda p, **kw: Adagrad(p, lr=0.05, initial_accumulator_value=0.1, **kw),
}


def data(samples: int = 48, seed: int = 7) -> ArrayDataset:
    ids = np.random.default_rng(seed).integers(0, VOCAB, size=(samples, SEQ + 1))
    return ArrayDataset(ids[:, :-1], ids[:, 1:])


def model() -> TiedLM:
    m = TiedLM(VOCAB, d_model=8, n_layers=1, n_heads=2, max_seq_len=SEQ, seed=3)
    m.freeze("pos_embed.weight")
    return m


class Record(Callback):
    """The training losses and gradient norms; the toggling of the embedding's input use
    and the optimizer's reset."""

    def __init__(self, net: TiedLM, config: dict) -> None:
        self.net, self.losses, self.norms = net, [], []
        self.toggle, self.reset_at = config.get("toggle", False), config.get("reset_at")
        self.fresh = OPTIMIZERS[config.get("opt", "adamw")]

    def on_step_end(self, trainer, logs) -> None:
        self.losses.append(logs["train_loss"])
        self.norms.append(logs["grad_norm"])
        if logs["step"] == self.reset_at:
            trainer.optimizer.load_state_dict(self.fresh(self.net.parameters()).state_dict())
        if self.toggle and logs["step"] == 2:
            self.net.freeze("embed.weight")  # trained through lm_head alone
        if self.toggle and logs["step"] == 5:
            self.net.unfreeze("embed.weight")


def misuse(net: TiedLM, opt, parallel, out: str) -> None:
    """Three refused sharded steps; writes their messages and whether anything changed."""
    from tiegrad import EagerSession
    from tiegrad.errors import DistributedError, HyperparameterError

    before = [v.copy() for v in net.param_list().values()]
    session = EagerSession()
    ids = np.random.default_rng(7).integers(0, VOCAB, size=(BATCH, SEQ + 1))
    x, y = ids[:, :-1], ids[:, 1:]
    grads = parallel.backward(session, net.loss(session, x, y), opt)
    session.reset()
    errors = []
    for optimizer, given, clip in (
        (opt, [None] * len(net.param_list()), None),
        (OPTIMIZERS["adamw"](model().parameters()), grads, None),
        (opt, grads, -1.0),
    ):
        try:
            parallel.step(optimizer, given, clip)
        except (DistributedError, HyperparameterError) as e:
            errors.append(str(e))
    same = all(np.array_equal(a, b) for a, b in zip(before, net.param_list().values()))
    with open(os.path.join(out, "errors.json"), "w") as f:
        json.dump({"errors": errors, "unchanged": same, "state": len(opt.state)}, f)
    dist.shutdown()


def refusals(net: TiedLM, opt, parallel, out: str) -> None:
    """One sharded step, then two refused ones (a negative lr, a NaN gradient under
    ``nonfinite="raise"``); writes their messages and whether parameters, counters and
    the gathered state stayed as the first step left them (C6)."""
    from tiegrad import EagerSession
    from tiegrad.errors import HyperparameterError, NonFiniteError

    ids = np.random.default_rng(7).integers(0, VOCAB, size=(BATCH, SEQ + 1))
    x, y = ids[:, :-1], ids[:, 1:]

    def gradients(scale: float):
        session = EagerSession()
        grads = parallel.backward(session, net.loss(session, x, y) * scale, opt)
        session.reset()
        return grads

    def snapshot():
        state = parallel.checkpoint_optimizer(opt).state_dict()["state"]
        arrays = [v.copy() for v in net.param_list().values()]
        arrays += [a for e in state.values() for n, a in sorted(e.items()) if n != "step"]
        return arrays, opt.step_count

    parallel.step(opt, gradients(1.0))
    before = snapshot()
    errors = []
    opt.param_groups[0]["lr"] = -1.0
    try:
        parallel.step(opt, gradients(1.0))
    except HyperparameterError as e:
        errors.append(str(e))
    opt.param_groups[0]["lr"] = 0.01
    try:
        parallel.step(opt, gradients(float("nan")))
    except NonFiniteError as e:
        errors.append(str(e))
    after = snapshot()
    same = before[1] == after[1] and all(
        np.array_equal(a, b) for a, b in zip(before[0], after[0], strict=True)
    )
    with open(os.path.join(out, "errors.json"), "w") as f:
        json.dump({"errors": errors, "unchanged": same}, f)
    dist.shutdown()


def main(config: dict, out: str) -> None:
    launched = dist.in_launcher_environment()
    if launched:
        dist.init()
    net = model()
    skip = config.get("nan_at") is not None
    opt = OPTIMIZERS[config.get("opt", "adamw")](
        net.parameters(), nonfinite="skip" if skip else "raise"
    )
    parallel = None
    if launched:
        shard = config.get("shard")
        if dist.rank() == 1 and "rank1_shard" in config:
            shard = config["rank1_shard"]
        parallel = dist.DataParallel(net, shard=shard, bucket_mb=config.get("bucket_mb", 25.0))
    if config.get("misuse"):
        misuse(net, opt, parallel, out)
        return
    if config.get("refusals"):
        refusals(net, opt, parallel, out)
        return

    def loss_fn(session, batch):
        loss = net.loss(session, *batch)
        if trainer.step + 1 == config.get("nan_at") and dist.rank() == dist.world_size() - 1:
            loss = loss * float("nan")
        return loss

    record = Record(net, config)
    run = os.path.join(out, "run")
    trainer = Trainer(
        net,
        opt,
        loss_fn,
        DataLoader(data(), BATCH, shuffle=True),
        max_steps=config.get("steps", 8),
        grad_accum=config.get("accum", 1),
        clip_norm=config.get("clip"),
        checkpoint_every=config.get("checkpoint_every"),
        keep_last=config.get("keep_last", 3),
        run_dir=run,
        resume=os.path.isdir(os.path.join(run, "checkpoints")),
        seed=5,
        progress=False,
        plot=False,
        parallel=parallel,
        device=config.get("device"),
        callbacks=[record],
    )
    trainer.fit()
    held = parallel.memory(opt) if parallel is not None else {}
    with open(os.path.join(out, f"rank_{dist.rank()}.json"), "w") as f:
        json.dump(held | {"skipped": opt.skipped_steps, "step_count": opt.step_count}, f)
    if dist.is_main():
        np.savez(os.path.join(out, "params.npz"), *net.param_list().values())
        with open(os.path.join(out, "losses.json"), "w") as f:
            json.dump({"losses": record.losses, "norms": record.norms}, f)
    dist.shutdown()


if __name__ == "__main__":
    main(json.loads(sys.argv[1]), sys.argv[2])
