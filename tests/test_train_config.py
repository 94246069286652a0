"""``TrainConfig``, the one configuration of a run: a TOML file, the ``train`` flags and
a run's ``config.json`` read into it and written from it (every field), one error naming
an unknown key or a bad value with nothing changed (C6), ``--help`` showing each
field's help, a ``Trainer`` built from it or from its keywords alike, and a run folder
written before ``min_delta`` existed resuming."""

from __future__ import annotations

import dataclasses
import json
import shutil

import pytest
from test_cli import TEXT, files_of
from test_cli_resume_inputs import TRAIN
from test_trainer import digits_like
from test_untrusted_input import assert_one_line_error, cli

from tiegrad import ConfigError
from tiegrad.cli import build_parser, main
from tiegrad.cli.train import configuration
from tiegrad.data import DataLoader
from tiegrad.models import MLPClassifier
from tiegrad.optim import SGD
from tiegrad.train import Trainer, read_metrics
from tiegrad.train.config import DEFAULTS, FIELDS, TrainConfig, flag, resolve
from tiegrad.train.rundir import RUN_ID

#: Every field away from its default; ``lora`` needs ``init`` and excludes ``freeze``,
#: ``chat`` excludes ``text`` and ``train_rows = "new"`` excludes ``lora``, so the settings
#: of each pair go in two configurations.
CHANGED = {
    "text": "corpus.txt", "vocab": "byte", "corpus_chars": 1234, "val_fraction": 0.25,
    "init": "hf-folder", "freeze": "model.embed_tokens.weight,lm_head.*", "d_model": 24,
    "n_layers": 3, "n_heads": 6, "seq_len": 32, "mlp_ratio": 2, "dropout": 0.125,
    "steps": 77, "batch_size": 5, "grad_accum": 2, "lr": 1e-4, "min_lr": 1e-05,
    "warmup_steps": 7, "warmup_ratio": 0.5, "weight_decay": 0.2, "clip_norm": 0.0,
    "eval_every": 0, "eval_batches": 3, "sample_every": 0, "log": "tensorboard",
    "checkpoint_every": 0, "keep_last": 9, "patience": 4, "min_delta": 0.001,
    "seed": 2**63 - 1, "device": "torch:cpu", "shard": "gradients", "run": "runs/a b",
    "progress": False, "recompute": True, "add_tokens": "tokens.txt", "train_rows": "new",
}  # fmt: skip
WITH_LORA = {k: v for k, v in CHANGED.items() if k not in ("freeze", "text", "train_rows")}
WITH_LORA["lora"] = "rank=4,alpha=8.0,dropout=0.0,targets=c_attn"
WITH_LORA["chat"] = "chats.jsonl"


def absolute(values, folder):
    """``values`` with its path fields under ``folder`` (a TOML file's are relative to it)."""
    paths = [k for k, f in FIELDS.items() if f.metadata["path"]]
    return {k: str(folder / v) if k in paths else v for k, v in values.items()}


def flags_of(values):
    """The ``train`` command line that sets ``values``."""
    argv = []
    for key, value in values.items():
        if isinstance(value, bool):
            argv += [flag(key)] if value != DEFAULTS[key] else []
        else:
            argv += [flag(key), str(value)]
    return argv


@pytest.mark.parametrize("values", [CHANGED, WITH_LORA], ids=["freeze", "lora"])
def test_toml_flags_and_config_json_round_trip_every_field(tmp_path, values):
    values = absolute(values, tmp_path)
    config = TrainConfig(**values)
    assert {k: v for k, v in config.items() if v != DEFAULTS[k]} == values
    assert set(values) | {"lora", "freeze", "text", "chat", "train_rows"} == set(FIELDS)
    toml = tmp_path / "run.toml"
    toml.write_text(config.to_toml())
    from_file = resolve(toml)
    args = build_parser().parse_args(["train", *flags_of(values)])
    from_flags = configuration(args)
    from_json = TrainConfig.from_mapping(json.loads(json.dumps(config.to_dict())))
    assert from_file == from_flags == from_json == config
    assert from_file.to_dict() == config.to_dict() == dict(config)
    # relative paths of a TOML file are relative to its folder, as before
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "rel.toml").write_text('text = "corpus.txt"\nrun = "out"\n')
    relative = resolve(tmp_path / "sub" / "rel.toml")
    assert relative.text == str(tmp_path / "sub" / "corpus.txt")
    assert relative.run == str(tmp_path / "sub" / "out")


def test_flags_win_over_the_file_and_the_file_over_the_defaults(tmp_path):
    toml = tmp_path / "job.toml"
    toml.write_text("steps = 50\nlr = 1e-3\n")
    args = build_parser().parse_args(["train", "--config", str(toml), "--steps", "70"])
    config = configuration(args)
    assert (config.steps, config.lr, config.seed) == (70, 1e-3, DEFAULTS["seed"])


@pytest.mark.parametrize(
    "text, fragments",
    [
        ("step = 5\n", ["unknown config key 'step'", "did you mean 'steps'"]),
        ("zzz = 1\n", ["unknown config key 'zzz'", "known keys:", f"and {len(FIELDS) - 3} more"]),
        ("eval_every = -2\n", ["'eval_every'", "expected a value >= 0, got -2"]),
        ("min_delta = 'small'\n", ["'min_delta'", "expected a finite float, got 'small'"]),
        ("shard = 'all'\n", ["'shard'", "expected one of 'optimizer', 'gradients' or empty"]),
    ],
)
def test_an_unknown_toml_key_or_a_bad_value_is_one_error_naming_it(
    tmp_path, monkeypatch, capsys, text, fragments
):  # C6
    monkeypatch.chdir(tmp_path)
    toml = tmp_path / "bad.toml"
    toml.write_text(text)
    with pytest.raises(ConfigError) as caught:
        resolve(toml)
    message = str(caught.value)
    assert str(toml) in message and all(f in message for f in fragments), message
    assert len(message) < 400  # a few keys named, the rest counted
    before = files_of(tmp_path)
    assert_one_line_error(cli(capsys, "train", "--config", str(toml), "--run", "r"), *fragments)
    assert files_of(tmp_path) == before  # no run folder, nothing written


def test_a_bad_flag_value_names_the_flag(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert_one_line_error(
        cli(capsys, "train", "--min-delta", "-1", "--run", "r"),
        "--min-delta: expected a value >= 0",
    )
    assert list(tmp_path.iterdir()) == []


def test_a_config_is_checked_when_made_and_cannot_be_changed_in_place():
    with pytest.raises(ConfigError, match=r"config key 'steps': expected a value >= 1, got 0"):
        TrainConfig(steps=0)
    with pytest.raises(ConfigError, match=r"n_heads \(5\) must divide d_model \(128\)"):
        TrainConfig(n_heads=5)
    config = TrainConfig(steps=5)
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.steps = 0
    with pytest.raises(ConfigError, match="'keep_last'"):
        config.replace(keep_last=0)
    assert config == TrainConfig(steps=5) and config.replace(lr=1).lr == 1.0
    assert isinstance(config.replace(lr=1).lr, float)  # an integer given for a float


def test_train_help_shows_every_fields_help(capsys):
    with pytest.raises(SystemExit) as done:
        main(["train", "--help"])
    assert done.value.code == 0
    shown = "".join(capsys.readouterr().out.split())  # argparse wraps the lines
    for key, field in FIELDS.items():
        assert flag(key) in shown, key
        assert "".join(field.metadata["help"].split()) in shown, key


# -- the Trainer -------------------------------------------------------------------------
def tiny_trainer(**kw):
    """A ``Trainer`` of a small classifier on ``digits_like`` batches of 8."""
    model = MLPClassifier(5, 8, 3, seed=1)
    optimizer = SGD(model.parameters(), lr=0.1)
    return Trainer(model, optimizer, None, DataLoader(digits_like(), 8), None, plot=False, **kw)


def test_a_trainer_from_a_config_trains_as_one_from_keywords(tmp_path):
    keyword = tiny_trainer(
        max_steps=4, clip_norm=0.5, seed=3, run_dir=tmp_path / "a", progress=False
    )
    assert keyword.config == TrainConfig(
        steps=4, clip_norm=0.5, seed=3, run=str(tmp_path / "a"), eval_every=0,
        checkpoint_every=0, progress=False,
    )  # fmt: skip
    config = keyword.config.replace(run=str(tmp_path / "b"))
    made = tiny_trainer(config=config)
    assert (made.max_steps, made.clip_norm, made.eval_every, made.patience) == (4, 0.5, None, None)
    a, b = keyword.fit(), made.fit()
    assert (a.step, a.train_loss) == (b.step, b.train_loss)
    assert read_metrics(tmp_path / "a" / "metrics.jsonl") != []


def test_config_and_setting_keywords_together_are_refused(tmp_path):
    with pytest.raises(ConfigError, match="not both .*'max_steps'"):
        tiny_trainer(config=TrainConfig(steps=3), max_steps=3)
    with pytest.raises(ConfigError, match="config must be a tiegrad.train.TrainConfig, got dict"):
        tiny_trainer(config={"steps": 3})
    trainer = tiny_trainer(max_steps=3)
    with pytest.raises(ConfigError, match="'steps'"):
        trainer.max_steps = 0
    assert trainer.max_steps == 3 and trainer.config.steps == 3


# -- a run folder written before min_delta and the keys of chat, recompute and vocabulary growth
#: The keys ``config.json`` held before ``TrainConfig`` (main's ``DEFAULTS``), with the
#: run's own records.
OLD_KEYS = {
    "text", "vocab", "corpus_chars", "val_fraction", "init", "lora", "freeze", "d_model",
    "n_layers", "n_heads", "seq_len", "mlp_ratio", "dropout", "steps", "batch_size",
    "grad_accum", "lr", "min_lr", "warmup_steps", "warmup_ratio", "weight_decay",
    "clip_norm", "eval_every", "eval_batches", "sample_every", "log", "checkpoint_every",
    "keep_last", "patience", "seed", "device", "shard", "run", "progress",
}  # fmt: skip


def test_an_old_config_json_resumes(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "text.txt").write_text(TEXT)
    assert main([*TRAIN, "--run", "old"]) == 0
    path = tmp_path / "old" / "config.json"
    new = json.loads(path.read_text())
    assert new["min_delta"] == 0.0
    old = {k: v for k, v in new.items() if k in OLD_KEYS | {"vocab_table", "text_sha256", RUN_ID}}
    assert set(new) - set(old) == {"min_delta", "chat", "recompute", "add_tokens", "train_rows"}
    path.write_text(json.dumps(old, indent=2, sort_keys=True) + "\n")  # as the old code wrote
    capsys.readouterr()
    assert main(["resume", "old", "--steps", "6"]) == 0
    assert "tiegrad resume: resolved configuration" in capsys.readouterr().out
    assert read_metrics(tmp_path / "old" / "metrics.jsonl")[-1]["step"] == 6
    assert json.loads(path.read_text()) == {**new, "steps": 6}


def test_an_unknown_key_in_config_json_is_refused_naming_the_file(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "text.txt").write_text(TEXT)
    assert main([*TRAIN, "--run", "r"]) == 0
    path = tmp_path / "r" / "config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), "stpes": 9, "steps": 8}))
    shutil.copy(path, tmp_path / "before.json")
    before = files_of(tmp_path)
    assert_one_line_error(cli(capsys, "resume", "r"), "unknown config key 'stpes'", "r/config.json")
    assert files_of(tmp_path) == before
