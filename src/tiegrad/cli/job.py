"""The training run that ``tiegrad train`` and ``tiegrad resume`` share.

``run_job`` builds the run a resolved configuration describes (``tiegrad.train.job``),
prints that configuration, trains it with ``Trainer`` and prints the summary; on
several processes every rank does so on its shard (rank 0 alone prints and writes the
run folder). ``config.json`` and ``runs/latest`` are written when training begins:
after a resumed run's checkpoint has loaded, so a refused checkpoint changes nothing.
"""

from __future__ import annotations

import os
import signal
from typing import Any

from ..train.config import TrainConfig
from .checkpoints import FREEZE, stored_model
from .exits import EXIT_INTERRUPTED, EXIT_TERMINATED, main_process
from .report import print_config, print_summary, quote
from .runs import check_fresh_run_folder, point_latest
from .sample import default_prompt


def join_group(config: TrainConfig) -> None:
    """Under torchrun, join the process group before anything else: every rank then
    builds the same run and trains on its shard (``tiegrad.distributed``)."""
    from ..distributed.launch import join_if_launched

    join_if_launched(None if config.device == "cpu" else config.device)


def run_job(
    config: TrainConfig,
    resume: bool,
    vocab: Any = None,
    stored_schedule: Any = None,
    run_id: str | None = None,
) -> int:
    """Train (``resume``: continue) the run ``config`` describes, the ``Trainer`` taking
    its settings from ``config`` as they are; ``vocab``: the run's
    stored vocabulary, ``stored_schedule``: its latest checkpoint's schedule state (printed,
    as the run keeps it), ``run_id``: the run's id (``tiegrad.train.rundir.RUN_ID``),
    written into ``config.json`` and every checkpoint (``None``: a run made before run
    ids, which keeps none). ``config.json`` is ``config`` (its paths absolute) with the
    vocabulary, the text's digest and the id. Returns the exit code."""
    from ..data import tokenizer_from_dict
    from ..train.job import (
        apply_freeze,
        build_dataset,
        build_init,
        build_model,
        build_optimizer,
        load_text,
        model_config,
    )
    from ..train.lora import KEY as LORA
    from ..train.lora import parse_lora
    from ..train.rundir import RUN_ID, RunDir
    from ..train.trainer import Trainer

    run = RunDir(config.run)
    source = load_text(config)
    vocab = tokenizer_from_dict(vocab) if vocab else None
    if config.init:  # resumed: the checkpoint's model (the --init folder may have moved)
        stored = stored_model(run.latest(), "resume")[0] if resume else None
        model, dataset = build_init(config, source, vocab, stored)
    else:
        dataset = build_dataset(config, source, vocab)
        model = build_model(model_config(config, dataset.vocab_size))
    if not (resume and config.init):  # a stored model has its frozen uses already
        apply_freeze(model, config.freeze)
    if not resume:
        check_fresh_run_folder(run, model.config)
    optimizer, schedule = build_optimizer(config, model)
    unit = dataset.vocab.unit
    extra = {
        "model": {"class": type(model).__name__, "config": model.config},
        "vocab": dataset.vocab.to_dict(),
        "loss_unit": unit,
    }
    if config.init:
        extra["hf_config"] = model.source_config
    if config.lora:
        extra[LORA] = parse_lora(config.lora).text()
    if config.freeze:
        extra[FREEZE] = config.freeze
    identity = {RUN_ID: run_id} if run_id is not None else {}
    extra.update(identity)
    speaks = main_process()
    callbacks = []
    if speaks:
        text = os.path.abspath(config.text) if config.text else ""
        chat = os.path.abspath(config.chat) if config.chat else ""
        init = os.path.abspath(config.init) if config.init else ""
        added = os.path.abspath(config.add_tokens) if config.add_tokens else ""
        saved = {
            **config.replace(text=text, chat=chat, init=init, add_tokens=added).to_dict(),
            "vocab_table": dataset.vocab.to_dict(),
            "text_sha256": source.sha256,
            **identity,
        }
        callbacks = [config_writer(run, saved), *job_callbacks(config, run, model, dataset.vocab)]
    trainer = Trainer(
        model,
        optimizer,
        None,
        dataset.loader("train", config.batch_size),
        dataset.eval_batches("val", config.batch_size, config.eval_batches),
        schedule,
        config=config,
        resume=resume,
        extra=extra,
        resume_hint=f"tiegrad resume {quote(str(run.path))}",
        callbacks=callbacks,
        parallel=data_parallel(model, config.shard),
    )
    if speaks:
        command = "resume" if resume else "train"
        print_config(config, source.description, dataset, model, command, stored_schedule)
        if resume and run.read_config().get("text_sha256") not in (None, source.sha256):
            print("warning: the training text differs from the one this run started with")
    result = trainer.fit()
    if speaks:
        print_summary(result, run, unit)
    if result.status != "interrupted":
        return 0
    return EXIT_TERMINATED if result.signal == signal.SIGTERM else EXIT_INTERRUPTED


def data_parallel(model: Any, shard: str) -> Any:
    """The run's ``DataParallel`` (``shard``: empty, ``optimizer`` or ``gradients``) when
    this process is a rank of a group, else None."""
    from ..distributed import DataParallel, is_initialized

    return DataParallel(model, shard=shard or None) if is_initialized() else None


def config_writer(run: Any, config: dict[str, Any]) -> Any:
    """A callback writing ``config`` as the run's ``config.json`` and pointing
    ``runs/latest`` at the run when training begins: after a resumed run's checkpoint
    loaded, so a refused checkpoint leaves the run folder as it was."""
    from ..train.callbacks import Callback

    class ConfigWriter(Callback):
        def on_train_begin(self, trainer: Any) -> None:
            run.write_config(config)
            point_latest(str(run.path))

    return ConfigWriter()


def job_callbacks(config: TrainConfig, run: Any, model: Any, vocab: Any) -> list[Any]:
    """TensorBoard (``--log tensorboard``) and text samples (``--sample-every``)."""
    import numpy as np

    from ..train.callbacks import TensorBoardLogger, TextSample

    callbacks: list[Any] = []
    if config.log == "tensorboard":
        callbacks.append(TensorBoardLogger(run.path / "tensorboard"))
    if config.sample_every:
        prompt = vocab.encode(default_prompt(vocab))[None, :]

        def generate(step: int) -> str:
            rng = np.random.default_rng(step)
            out = model.generate(prompt, 80, temperature=0.8, rng=rng)
            return vocab.decode(np.asarray(out)[0][1:])

        callbacks.append(TextSample(generate, config.sample_every))
    return callbacks
