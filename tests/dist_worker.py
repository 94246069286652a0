"""One rank of the data-parallel tests (``test_distributed.py`` starts the processes).

``python tests/dist_worker.py SCENARIO OUT [STEPS]`` trains a tiny ``TiedLM`` (its
embedding tied to the output, ``pos_embed`` frozen) with the ``Trainer``. It joins a
process group when torchrun's variables are set, else it is the 1-process reference.
Rank 0 writes the final parameters and the gradient bytes reduced per step to
``OUT/params.npz`` and ``OUT/bytes.json``. Scenarios: ``train``, ``raise`` (rank 1
raises in step 5), ``die`` (rank 1 exits at once in step 5; both write the time to
``OUT/failed_at``), ``perturb`` (rank 1
perturbs a parameter before step 4, checksums every 2 steps), ``layout`` (rank 1
unties the output), ``device`` (``train`` on the torch CPU device backend).
"""

import json
import os
import sys
import time

import numpy as np

import tiegrad.distributed as dist
from tiegrad.data import ArrayDataset, DataLoader
from tiegrad.models import TiedLM
from tiegrad.nn import untie
from tiegrad.optim import SGD
from tiegrad.train import Trainer

VOCAB, SEQ, BATCH = 16, 8, 8


def data() -> ArrayDataset:
    ids = np.random.default_rng(7).integers(0, VOCAB, size=(64, SEQ + 1))
    return ArrayDataset(ids[:, :-1], ids[:, 1:])


def main(scenario: str, out: str, steps: int) -> None:
    launched = dist.in_launcher_environment()
    if launched:
        dist.init()
    model = TiedLM(VOCAB, d_model=16, n_layers=1, n_heads=2, max_seq_len=SEQ, seed=3)
    model.freeze("pos_embed.weight")
    if scenario == "layout" and dist.rank() == 1:
        untie(model, "lm_head.weight")
    opt = SGD(model.parameters(), lr=0.05, momentum=0.9, weight_decay=0.01)
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
        return model.loss(session, *batch)

    per_step = []
    if parallel is not None:
        average = parallel.average

        def counted(grads):
            before = parallel.buckets.bytes_reduced
            out = average(grads)
            per_step.append(parallel.buckets.bytes_reduced - before)
            return out

        parallel.average = counted
    run = os.path.join(out, "run")
    trainer = Trainer(
        model,
        opt,
        loss_fn,
        DataLoader(data(), BATCH, shuffle=True),
        max_steps=steps,
        checkpoint_every=10,
        run_dir=run,
        resume=os.path.isdir(os.path.join(run, "checkpoints")),
        seed=5,
        progress=False,
        plot=False,
        parallel=parallel,
        device="torch:cpu" if scenario == "device" else None,
    )
    trainer.fit()
    if dist.is_main():
        plist = model.param_list()
        canonical = plist.canonical_slot_indices()
        trainable = sum(plist[i].value.nbytes for i, c in enumerate(canonical) if c == i)
        np.savez(os.path.join(out, "params.npz"), *plist.values())
        with open(os.path.join(out, "bytes.json"), "w") as f:
            json.dump({"per_step": per_step, "trainable_unique": trainable}, f)
    dist.shutdown()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]) if len(sys.argv) > 3 else 20)
