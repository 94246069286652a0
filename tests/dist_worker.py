"""One rank of the data-parallel tests (``test_distributed.py`` starts the processes).

``python tests/dist_worker.py SCENARIO OUT [STEPS]`` trains a tiny ``TiedLM`` (its
embedding tied to the output, ``pos_embed`` frozen) with the ``Trainer``. It joins a
process group when torchrun's variables are set, else it is the 1-process reference.
Rank 0 writes the final parameters and the gradient bytes reduced per step to
``OUT/params.npz`` and ``OUT/bytes.json``. Scenarios: ``train``, ``raise`` (rank 1
raises in step 5), ``die`` (rank 1 exits at once in step 5; both write the time to
``OUT/failed_at``), ``perturb`` (rank 1
perturbs a parameter before step 4, checksums every 2 steps), ``layout`` (rank 1
unties the output), ``device`` (``train`` on the torch CPU device backend),
``overlap`` (no trainer: each step's gradients averaged with and without overlap,
compared in ``OUT/overlap.json``), ``late_signal`` (rank 1 signals itself after step
3's end-of-step all-reduce), ``val`` (``train`` with a sharded validation loader
evaluated every 2 steps, patience 50; rank 0 writes the validation losses to
``OUT/val.json``), ``datasize`` (rank 1 has more training samples) and ``lr`` (rank 1
another learning rate), ``dropout`` (``train`` with dropout 0.1; every rank writes the
next 4 numbers of its session generator to ``OUT/draws_RANK.json``), ``raise_cb`` (rank
1's callback raises after step 3) and ``perturb_last`` (rank 1 perturbs a parameter
after the last step). Every rank writes its result's status and step to
``OUT/status_RANK``.
"""

import json
import os
import signal
import sys
import time

import numpy as np

import tiegrad.distributed as dist
from tiegrad import Param, ops
from tiegrad.data import ArrayDataset, DataLoader
from tiegrad.models import TiedLM
from tiegrad.nn import untie
from tiegrad.optim import SGD
from tiegrad.train import Callback, Trainer

VOCAB, SEQ, BATCH = 16, 8, 8


def data(samples: int = 64, seed: int = 7) -> ArrayDataset:
    ids = np.random.default_rng(seed).integers(0, VOCAB, size=(samples, SEQ + 1))
    return ArrayDataset(ids[:, :-1], ids[:, 1:])


class ValLosses(Callback):
    """The validation losses of the run, in order."""

    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_eval(self, trainer, logs) -> None:
        self.losses.append(logs["val_loss"])


class OnRank1(Callback):
    """On rank 1 after step ``step``: raise, or perturb the model's third parameter."""

    def __init__(self, step: int, model=None) -> None:
        self.step, self.model = step, model

    def on_step_end(self, trainer, logs) -> None:
        if dist.rank() == 1 and logs["step"] == self.step:
            if self.model is None:
                raise RuntimeError("injected callback failure")
            p = self.model.param_list()[2]
            p.set_value(p.value + 1e-3)


class LateSignal(Callback):
    """Rank 1 signals itself SIGINT after step 3's agreement on who was signalled."""

    def on_step_end(self, trainer, logs) -> None:
        if dist.rank() == 1 and logs["step"] == 3:
            os.kill(os.getpid(), signal.SIGINT)


def trainable_bytes(model) -> int:
    plist = model.param_list()
    canonical = plist.canonical_slot_indices()
    return sum(plist[i].value.nbytes for i, c in enumerate(canonical) if c == i)


def bits(grads) -> list:
    return [None if g is None else g.tobytes() for g in grads]


def compare_overlap(model, opt, out: str, steps: int) -> None:
    """Each step's batch twice: ``DataParallel.backward`` with overlap, then ``average``
    after a plain backward; rank 0 writes whether each step's averaged gradients were
    equal bit for bit, the bytes reduced per step and the buckets launched early."""
    from tiegrad import EagerSession

    parallel = dist.DataParallel(model, bucket_mb=2e-3, overlap=True)  # several buckets
    session = EagerSession()
    batches = DataLoader(data(), BATCH, shuffle=True).epoch(np.random.default_rng(5))
    equal, per_step = [], []
    for _, batch in zip(range(steps), batches):
        before = parallel.buckets.bytes_reduced
        session.reset()
        early = bits(parallel.backward(session, model.loss(session, *batch), opt))
        per_step.append(parallel.buckets.bytes_reduced - before)
        session.reset()
        grads = opt.canonical_gradients(session.backward(model.loss(session, *batch)))
        after = parallel.average(grads)
        equal.append(early == bits(after))
        session.reset()
        opt.step(after)
    if dist.is_main():
        with open(os.path.join(out, "overlap.json"), "w") as f:
            summary = {
                "equal": equal,
                "per_step": per_step,
                "trainable_unique": trainable_bytes(model),
                "buckets": len(parallel.buckets.buckets),
                "launched_early": parallel.buckets.launched_early,
            }
            json.dump(summary, f)
    dist.shutdown()


def main(scenario: str, out: str, steps: int) -> None:
    launched = dist.in_launcher_environment()
    if launched:
        dist.init()
    dropout = 0.1 if scenario == "dropout" else 0.0
    model = TiedLM(VOCAB, d_model=16, n_layers=1, n_heads=2, max_seq_len=SEQ, seed=3,
                   dropout=dropout)  # fmt: skip
    model.freeze("pos_embed.weight")
    if scenario == "partial":  # a storage only rank 0 uses
        model.extra = Param(np.zeros(4, np.float32))
    if scenario == "layout" and dist.rank() == 1:
        untie(model, "lm_head.weight")
    lr = 0.06 if scenario == "lr" and dist.rank() == 1 else 0.05
    opt = SGD(model.parameters(), lr=lr, momentum=0.9, weight_decay=0.01)
    if scenario == "overlap":
        compare_overlap(model, opt, out, steps)
        return
    parallel = None
    if launched:
        parallel = dist.DataParallel(model, check_every=2 if scenario == "perturb" else 100)
    trainer: Trainer

    def loss_fn(session, batch):
        step = trainer.step + 1
        if dist.rank() == 1 and scenario in ("raise", "die") and step == 5:
            with open(os.path.join(out, "failed_at"), "w") as f:
                f.write(repr(time.time()))
            if scenario == "die":
                os._exit(3)
            raise RuntimeError("injected failure")
        if dist.rank() == 1 and scenario == "perturb" and step == 4:
            p = model.param_list()[2]
            p.set_value(p.value + 1e-3)
        loss = model.loss(session, *batch)
        if scenario == "partial" and dist.rank() == 0:  # rank 1 has no gradient for it:
            weight = 0.5 if launched else 0.25  # the mean over 2 ranks of 0.5 and 0
            loss = loss + ops.sum(session.use(model.extra)) * weight
        return loss

    per_step = []
    if parallel is not None:
        step = opt.step

        def counted(grads):
            per_step.append(parallel.buckets.bytes_reduced - sum(per_step))
            step(grads)

        opt.step = counted
    run = os.path.join(out, "run")
    rank1 = dist.rank() == 1
    samples = {"datasize": 72, "samples": 60}.get(scenario, 64) if rank1 else 64
    val = ValLosses()
    callbacks = {
        "val": [val],
        "raise_cb": [OnRank1(3)],
        "perturb_last": [OnRank1(steps, model)],
        "late_signal": [LateSignal()],
    }.get(scenario, [])
    trainer = Trainer(
        model,
        opt,
        loss_fn,
        DataLoader(data(samples), BATCH, shuffle=True),
        val_data=DataLoader(data(16, seed=8), BATCH, shuffle=False) if scenario == "val" else None,
        eval_every=2 if scenario == "val" else None,
        patience=50 if scenario == "val" else None,
        max_steps=steps,
        grad_accum=2 if scenario == "accum" and rank1 else 1,
        clip_norm=0.5 if scenario == "clip" and rank1 else None,
        checkpoint_every=10,
        run_dir=run,
        resume=os.path.isdir(os.path.join(run, "checkpoints")),
        seed=5,
        progress=False,
        plot=False,
        parallel=parallel,
        device="torch:cpu" if scenario == "device" else None,
        callbacks=callbacks,
    )
    result = trainer.fit()
    with open(os.path.join(out, f"status_{dist.rank()}"), "w") as f:
        f.write(f"{result.status} {result.step}")
    if scenario == "dropout":
        with open(os.path.join(out, f"draws_{dist.rank()}.json"), "w") as f:
            json.dump(trainer.session.rng.random(4).tolist(), f)
    if dist.is_main():
        if scenario == "val":
            with open(os.path.join(out, "val.json"), "w") as f:
                json.dump(val.losses, f)
        np.savez(os.path.join(out, "params.npz"), *model.param_list().values())
        with open(os.path.join(out, "bytes.json"), "w") as f:
            json.dump({"per_step": per_step, "trainable_unique": trainable_bytes(model)}, f)
    dist.shutdown()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]) if len(sys.argv) > 3 else 20)
