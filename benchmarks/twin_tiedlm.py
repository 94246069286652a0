"""The PyTorch twin of the default ``tiegrad train`` run; prints its final validation loss L.

``python -m benchmarks.twin_tiedlm [--steps N] [--config FILE.toml]`` trains, in
PyTorch eager, the same run that ``tiegrad train`` (with the same options) trains:

- data: the same text (``tiegrad.train.job.load_text``), vocabulary, split, training
  windows (``TextDataset.sample`` driven by a generator seeded exactly as the
  ``Trainer`` seeds its data generator) and evaluation windows;
- model: ``benchmarks.workloads._torch_models.TiedLM`` (pre-LN blocks, 4x GELU MLP,
  learned positions, output projection tied to the token embedding) with every
  initial weight copied from the ``tiegrad.models.TiedLM`` the run builds;
- optimization: ``torch.optim.AdamW`` with the run's lr, betas, eps and weight decay,
  the learning rate of each step taken from the run's own ``CosineWarmup`` schedule,
  and ``clip_grad_norm_`` at ``clip_norm``.

The issue's quality bar: the tiegrad run reaches at most L + 0.05 nats per character.
"""

from __future__ import annotations

import argparse
import sys
import time

from . import THREADS, pin_threads


def main(argv: list[str] | None = None) -> float:
    pin_threads()
    import numpy as np
    import torch

    from tiegrad.train.config import resolve
    from tiegrad.train.job import build_dataset, build_model, build_optimizer, load_text
    from tiegrad.train.job import model_config as tiegrad_model_config
    from tiegrad.train.trainer import derive_seeds

    from .workloads._common import load_torch, tiegrad_weights
    from .workloads._torch_models import TiedLM, lm_loss

    parser = argparse.ArgumentParser(prog="python -m benchmarks.twin_tiedlm")
    parser.add_argument("--config", metavar="FILE.toml", help="the run's TOML config, if any")
    parser.add_argument("--steps", type=int, help="optimizer steps (default: the run's)")
    args = parser.parse_args(argv)
    config = resolve(args.config, {} if args.steps is None else {"steps": args.steps})
    if config["dropout"] != 0.0 or config["mlp_ratio"] != 4 or config["grad_accum"] != 1:
        parser.error("the twin covers dropout 0, mlp_ratio 4 and grad_accum 1 only")
    torch.set_num_threads(THREADS)

    source = load_text(config)
    data = build_dataset(config, source)
    reference = build_model(tiegrad_model_config(config, data.vocab_size))
    tg_opt, schedule = build_optimizer(config, reference)
    model = TiedLM(
        data.vocab_size,
        config["d_model"],
        config["n_heads"],
        config["seq_len"],
        n_blocks=config["n_layers"],
    )
    load_torch(model, tiegrad_weights(reference))
    hp = tg_opt.param_groups[0]
    opt = torch.optim.AdamW(
        model.parameters(),
        lr=hp["lr"],
        betas=hp["betas"],
        eps=hp["eps"],
        weight_decay=hp["weight_decay"],
    )
    rng = np.random.default_rng(derive_seeds(config["seed"])[0])
    evals = [
        (torch.from_numpy(x), torch.from_numpy(y))
        for x, y in data.eval_batches("val", config["batch_size"], config["eval_batches"])
    ]

    def evaluate() -> float:
        model.eval()
        with torch.no_grad():
            losses = [lm_loss(model, x, y).item() for x, y in evals]
        model.train()
        return float(np.mean(losses))

    print(
        f"twin: {source.description}; TiedLM d_model={config['d_model']} "
        f"n_layers={config['n_layers']} in PyTorch {torch.__version__}; {config['steps']} steps"
    )
    start = time.perf_counter()
    val = evaluate()
    for step in range(config["steps"]):
        for group in opt.param_groups:
            group["lr"] = schedule.lr_at(step)[0]
        x, y = data.sample("train", config["batch_size"], rng)
        loss = lm_loss(model, torch.from_numpy(x), torch.from_numpy(y))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        if config["clip_norm"]:
            torch.nn.utils.clip_grad_norm_(model.parameters(), config["clip_norm"])
        opt.step()
        done = step + 1
        if done % config["eval_every"] == 0 or done == config["steps"]:
            val = evaluate()
            print(f"twin step {done:>6}  train {loss.item():.4f}  val {val:.4f}", flush=True)
    elapsed = time.perf_counter() - start
    print(
        f"twin: {config['steps']} steps in {elapsed:.1f}s; final validation loss "
        f"L = {val:.4f} nats/{data.vocab.unit}"
    )
    return val


if __name__ == "__main__":
    main(sys.argv[1:])
