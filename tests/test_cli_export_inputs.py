"""Issue 52: ``tiegrad resume`` and ``tiegrad export`` of a GPT-2 LoRA run whose folder
was edited or crafted: an edited LoRA specification in ``config.json``, a crafted model
configuration or transformers configuration in a checkpoint. Each is refused before
anything is built or written, or (export) leaves the crafted keys out.

The run is ``test_cli_lora``'s 6-step LoRA run; the commands run in process.
"""

from __future__ import annotations

import contextlib
import io
import json
import shutil
import time

import pytest
from test_checkpoint_file import read_doc, write_doc
from test_cli import files_of
from test_cli_hf import TEXT, hf_directory
from test_cli_lora import LORA, TRAIN
from test_untrusted_input import assert_one_line_error, cli

transformers = pytest.importorskip("transformers")

from tiegrad.cli import main  # noqa: E402
from tiegrad.interop.hf import CONFIG_KEYS  # noqa: E402
from tiegrad.train import RunDir  # noqa: E402

#: The keys an exported config.json may hold: the model's own, and the token ids.
WRITTEN = {*CONFIG_KEYS, "model_type", "architectures", "dtype"}
WRITTEN |= {"bos_token_id", "eos_token_id", "pad_token_id"}


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """``test_cli_lora``'s finished 6-step LoRA run ``run`` (checkpoints at steps 3 and 6)."""
    root = tmp_path_factory.mktemp("export_inputs")
    (root / "text.txt").write_text(TEXT)
    hf_directory(root / "model")
    with pytest.MonkeyPatch.context() as mp, contextlib.redirect_stdout(io.StringIO()):
        mp.chdir(root)
        assert main([*TRAIN, "--lora", LORA, "--run", "run"]) == 0
    return root


@pytest.fixture
def work(trained, tmp_path, monkeypatch):
    """A copy of the trained folder, the current directory."""
    shutil.copytree(trained, tmp_path, dirs_exist_ok=True)
    monkeypatch.chdir(tmp_path)
    return tmp_path


def edit_checkpoints(run, change) -> None:
    """Apply ``change`` (a function of a checkpoint's ``extra``) to every checkpoint."""
    for path in sorted((run / "checkpoints").iterdir()):
        tensors, doc = read_doc(path)
        change(doc["extra"])
        write_doc(path, tensors, doc)


def edit_lora(work, text: str) -> None:
    config = work / "run" / "config.json"
    config.write_text(json.dumps(dict(json.loads(config.read_text()), lora=text)))


@pytest.mark.parametrize(
    ("lora", "named"),
    [
        (f"alpha=64,{LORA}", "alpha is 64.0 in config.json, 16.0 in the checkpoint"),
        (LORA.replace("rank=4", "rank=8"), "rank is 8 in config.json, 4 in the checkpoint"),
        ("rank=4,dropout=0.1,targets=c_attn", "targets is c_attn in config.json, c_attn+c_proj"),
        ("", "lora (--lora) is '', but the checkpoint"),
    ],
)
def test_an_edited_lora_spec_is_refused_and_export_keeps_the_trained_one(work, capsys, lora, named):
    edit_lora(work, lora)
    before = files_of(work)
    result = cli(capsys, "resume", "run", "--steps", 8)
    assert_one_line_error(result, "run/config.json", "step_0000006.safetensors", named)
    assert files_of(work) == before
    code, _, err = cli(capsys, "export", "run", "adapter", "--format", "peft")
    assert code == 0, err
    written = json.loads((work / "adapter" / "adapter_config.json").read_text())
    assert (written["r"], written["lora_alpha"]) == (4, 16.0)  # what the run trained with


def test_another_spelling_of_the_same_lora_spec_resumes(work, capsys):
    edit_lora(work, "targets=c_attn+c_proj,dropout=0.1,rank=4")
    code, _, err = cli(capsys, "resume", "run", "--steps", 7)
    assert code == 0, err


@pytest.mark.parametrize(
    "command",
    [("resume", "run", "--steps", 8), ("export", "run", "out", "--format", "peft")],
    ids=["resume", "export"],
)
@pytest.mark.parametrize(
    ("change", "named"),
    [
        ({"n_layer": 10**9}, "implies 12000000005 slots"),
        ({"n_embd": 2**20, "n_head": 1}, "parameters"),
        ({"n_positions": 10**12}, "parameters"),
        ({"n_head": 3}, "n_head=3 must divide n_embd=16"),
    ],
)
def test_a_crafted_model_config_is_refused_before_building(
    work, capsys, monkeypatch, command, change, named
):
    """The model configuration a checkpoint stores is checked against its tensors (the
    header alone) first: a crafted size is a quick error, nothing allocated."""
    edit_checkpoints(work / "run", lambda extra: extra["model"]["config"].update(change))
    built = []
    monkeypatch.setattr("tiegrad.train.job.build_model", lambda *a: built.append(a))
    before = files_of(work)
    started = time.perf_counter()
    assert_one_line_error(cli(capsys, *command), "run/checkpoints/", named)
    assert time.perf_counter() - started < 5 and built == []
    assert files_of(work) == before and not (work / "out").exists()


def crafted_hf_config(extra) -> None:
    extra["hf_config"].update(add_cross_attention=True, reorder_and_upcast_attn=True, evil=[1])


def test_export_writes_only_the_config_keys_the_model_has(work, capsys):
    edit_checkpoints(work / "run", crafted_hf_config)
    code, _, err = cli(capsys, "export", "run", "merged", "--format", "hf", "--merge")
    assert code == 0, err
    written = json.loads((work / "merged" / "config.json").read_text())
    assert set(written) <= WRITTEN, set(written) - WRITTEN
    assert written["eos_token_id"] == 0  # carried from the --init directory's config
    model, info = transformers.GPT2LMHeadModel.from_pretrained(
        work / "merged", output_loading_info=True
    )
    assert all(not v for v in info.values()), info  # no tensor built at random
    assert not model.config.add_cross_attention


def test_a_resumed_run_stores_no_crafted_config_key_again(work, capsys):
    edit_checkpoints(work / "run", crafted_hf_config)
    code, _, err = cli(capsys, "resume", "run", "--steps", 7)
    assert code == 0, err
    _, doc = read_doc(RunDir(work / "run").latest())
    assert doc["extra"]["trainer"]["step"] == 7
    assert set(doc["extra"]["hf_config"]) <= WRITTEN


@pytest.mark.parametrize(
    ("change", "named"),
    [
        ({"eos_token_id": "0"}, "eos_token_id must be null or a token id in [0, 300), got '0'"),
        ({"bos_token_id": 10**9}, "bos_token_id must be null or a token id"),
        ({"pad_token_id": True}, "pad_token_id must be null or a token id"),
        (None, "expected a JSON object, got [1, 2]"),
    ],
)
def test_a_bad_stored_transformers_config_is_refused_naming_the_key(work, capsys, change, named):
    def damage(extra) -> None:
        if change is None:
            extra["hf_config"] = [1, 2]
        else:
            extra["hf_config"].update(change)

    edit_checkpoints(work / "run", damage)
    before = files_of(work)
    result = cli(capsys, "export", "run", "merged", "--format", "hf", "--merge")
    assert_one_line_error(result, "best.safetensors: extra['hf_config']: ", named)
    assert files_of(work) == before and not (work / "merged").exists()
