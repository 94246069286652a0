"""``tiegrad train --init DIR --lora SPEC``, its resume, ``sample`` and ``export --format
peft`` / ``--format hf --merge`` end to end, against transformers and peft (issue 41);
and the one-line errors of bad ``--lora`` and export requests, which change nothing.

The GPT-2 directory is ``test_cli_hf``'s tiny one; the commands run in process.
"""

from __future__ import annotations

import contextlib
import io
import os
import shutil

import numpy as np
import pytest
from test_cli import files_of
from test_cli_hf import TEXT, hf_directory
from test_untrusted_input import assert_one_line_error, cli

os.environ["HF_HUB_OFFLINE"] = "1"
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

from tiegrad import EagerSession, load, save  # noqa: E402
from tiegrad.adapters import add_lora  # noqa: E402
from tiegrad.checkpoint.fileio import read_safetensors  # noqa: E402
from tiegrad.cli import main  # noqa: E402
from tiegrad.cli.checkpoints import checkpoint_extra  # noqa: E402
from tiegrad.errors import ConfigError  # noqa: E402
from tiegrad.models import GPT2  # noqa: E402
from tiegrad.train import RunDir  # noqa: E402
from tiegrad.train.lora import FORM, LoraSpec, parse_lora  # noqa: E402

LORA = "rank=4,dropout=0.1,targets=c_attn,c_proj"  # the issue's form: bare items are targets
TRAIN = [
    "train", "--init", "model", "--text", "text.txt", "--steps", "6", "--seq-len", "16",
    "--batch-size", "4", "--eval-every", "3", "--eval-batches", "1", "--checkpoint-every",
    "3", "--keep-last", "5", "--warmup-steps", "2", "--lr", "0.01", "--sample-every", "0",
    "--no-progress",
]  # fmt: skip
IDS = np.array([[5, 17, 42, 8, 99, 3, 250, 11]])


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A finished 6-step LoRA run ``run`` (checkpoints at steps 3 and 6) and what it printed."""
    root = tmp_path_factory.mktemp("cli_lora")
    (root / "text.txt").write_text(TEXT)
    hf_directory(root / "model")
    out = io.StringIO()
    with pytest.MonkeyPatch.context() as mp, contextlib.redirect_stdout(out):
        mp.chdir(root)
        assert main([*TRAIN, "--lora", LORA, "--run", "run"]) == 0
    return root, out.getvalue()


@pytest.fixture
def work(trained, tmp_path, monkeypatch):
    """A copy of the trained folder, the current directory."""
    shutil.copytree(trained[0], tmp_path, dirs_exist_ok=True)
    monkeypatch.chdir(tmp_path)
    return tmp_path


def tuned(root, checkpoint=None):
    """The run's model as tiegrad computes it: the --init model, the adapters, the
    checkpoint (default: the best)."""
    model = GPT2.from_pretrained(root / "model")
    add_lora(model, ["c_attn", "c_proj"], rank=4, dropout=0.1)
    load(checkpoint or RunDir(root / "run").best_or_latest(), model)
    return model.eval()


def logits(model) -> np.ndarray:
    return model(EagerSession(), IDS).numpy()


def torch_logits(model) -> np.ndarray:
    with torch.no_grad():
        return model.eval()(torch.tensor(IDS)).logits.numpy()


# -- the specification ----------------------------------------------------------------------
@pytest.mark.parametrize(
    "text",
    [
        "rank=4,targets=c_attn,c_proj",  # the issue's
        "rank=4,targets=c_attn+c_proj",
        "targets=c_attn,c_proj,rank=4",
        "targets=c_attn,rank=4,c_proj",
    ],
)
def test_the_issue_form_and_the_plus_form_say_the_same(text):
    spec = parse_lora(text)
    assert spec == LoraSpec(("c_attn", "c_proj"), rank=4, alpha=16.0, dropout=0.0)
    assert parse_lora(spec.text()) == spec


def test_every_key_is_read():
    spec = parse_lora("rank=2,alpha=3.5,dropout=0.25,targets=*.attn.c_attn+lm_head")
    assert spec == LoraSpec(("*.attn.c_attn", "lm_head"), rank=2, alpha=3.5, dropout=0.25)
    assert spec.text() == "rank=2,alpha=3.5,dropout=0.25,targets=*.attn.c_attn+lm_head"


@pytest.mark.parametrize(
    ("text", "named"),
    [
        ("rank=4,bogus=1,targets=c_attn", "unknown key 'bogus'"),
        ("rank=0,targets=c_attn", "rank must be >= 1, got 0"),
        ("rank=-2,targets=c_attn", "rank must be >= 1, got -2"),
        ("rank=2.5,targets=c_attn", "rank='2.5' is not an integer"),
        ("alpha=0,targets=c_attn", "alpha must be > 0"),
        ("dropout=1,targets=c_attn", "dropout must be in [0, 1)"),
        ("rank=4", "targets= is missing"),
        ("c_attn,targets=c_proj", "'c_attn' is not key=value"),
        ("targets=c_attn++c_proj", "an empty target"),
        ("targets=c_attn,", "an empty target"),
        ("rank=4,rank=8,targets=c_attn", "'rank' is given twice"),
        ("targets=c_attn,targets=c_proj", "'targets' is given twice"),
    ],
)
def test_a_bad_specification_names_the_item_and_the_form(text, named):
    with pytest.raises(ConfigError) as e:
        parse_lora(text)
    assert named in str(e.value) and FORM in str(e.value) and "\n" not in str(e.value)


# -- train, resume, sample --------------------------------------------------------------------
def test_train_lora_trains_the_adapters_only(trained):
    root, printed = trained
    assert "  lora     rank=4,alpha=16.0,dropout=0.1,targets=c_attn+c_proj; " in printed
    assert "done: 6 steps" in printed
    base = GPT2.from_pretrained(root / "model")
    model = tuned(root)
    adapters = {p for p, _ in model.named_slots() if ".lora." in p}
    # c_attn and both c_proj (attn, mlp; PEFT's suffix rule) of the one block: A and B each
    assert len(adapters) == 6
    assert {p for p, s in model.named_slots() if s.requires_grad} == adapters
    for path, p in base.named_slots():  # the base is bit for bit the --init model's
        assert np.array_equal(model.get_parameter(path).value, p.value), path
    b = model.get_parameter("transformer.h.0.attn.c_attn.lora.default.B").value
    assert np.abs(b).max() > 0  # B starts at zero: it trained
    run = RunDir(root / "run")
    assert run.read_config()["lora"] == LORA
    assert checkpoint_extra(run.latest())["lora"] == parse_lora(LORA).text()


def test_resume_restores_the_adapters_bit_for_bit(work, capsys):
    run = RunDir(work / "run")
    final = run.step_path(6)
    original = read_safetensors(os.fspath(final))
    expected = {k: original.array(k).copy() for k in original.tensors}
    final.unlink()  # resume from step 3 to 6 again
    code, out, err = cli(capsys, "resume", "run", "--no-progress")
    assert code == 0, err
    assert "tiegrad resume: resolved configuration" in out and "done: 6 steps" in out
    again = read_safetensors(os.fspath(final))
    assert set(again.tensors) == set(expected)
    assert any(".lora." in k for k in expected)
    for key, value in expected.items():  # weights, adapters and optimizer state
        assert np.array_equal(again.array(key), value), key


def test_sample_runs_on_a_lora_run(work, capsys):
    code, out, err = cli(capsys, "sample", "--run", "run", "--prompt", "def f", "--tokens", "4")
    assert code == 0, err
    assert out.startswith("def f")


# -- export ----------------------------------------------------------------------------------
def test_export_peft_loads_in_peft_with_the_same_logits(work, capsys):
    code, out, err = cli(capsys, "export", "run", "adapter", "--format", "peft")
    assert code == 0, err
    assert sorted(os.listdir(work / "adapter")) == [
        "adapter_config.json",
        "adapter_model.safetensors",
    ]
    base = transformers.GPT2LMHeadModel.from_pretrained(work / "model")
    theirs = peft.PeftModel.from_pretrained(base, work / "adapter")
    ours = logits(tuned(work))
    assert not np.allclose(ours, logits(GPT2.from_pretrained(work / "model")), atol=1e-4)
    np.testing.assert_allclose(torch_logits(theirs), ours, rtol=0, atol=1e-5)


def test_export_hf_merge_loads_in_transformers_with_the_same_logits(work, capsys):
    code, out, err = cli(capsys, "export", "run", "merged", "--format", "hf", "--merge")
    assert code == 0, err
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= set(os.listdir("merged"))
    hf, info = transformers.GPT2LMHeadModel.from_pretrained(
        work / "merged", output_loading_info=True
    )
    assert all(not v for v in info.values()), info
    np.testing.assert_allclose(torch_logits(hf), logits(tuned(work)), rtol=0, atol=1e-5)


# -- bad input: one line, exit code 2, nothing changed ----------------------------------------
@pytest.mark.parametrize(
    ("args", "named"),
    [
        (["--lora", "rank=4,bogus=1,targets=c_attn"], "unknown key 'bogus'"),
        (["--lora", "rank=0,targets=c_attn"], "rank must be >= 1"),
        (["--lora", "rank=4,targets=c_attn+nothing"], "target 'nothing' matches no path"),
    ],
)
def test_bad_lora_is_one_line_and_writes_no_run(work, capsys, args, named):
    before = files_of(work)
    err = assert_one_line_error(cli(capsys, *TRAIN, *args, "--run", "bad"), "--lora", named)
    assert "expected" in err
    assert files_of(work) == before and not (work / "bad").exists()


def test_lora_without_init_is_refused(work, capsys):
    before = files_of(work)
    result = cli(capsys, "train", "--lora", LORA, "--run", "bad", "--no-progress")
    assert_one_line_error(result, "--lora", "--init DIR")
    assert files_of(work) == before


def gpt2_checkpoint(folder, name: str, lora=None, attach: bool = True) -> None:
    """``folder/name``: the --init GPT-2 saved as ``train --init`` saves it, ``lora`` (if
    any) in its ``extra``, attached first where ``attach``."""
    model = GPT2.from_pretrained(folder / "model")
    extra = {"model": {"class": "GPT2", "config": model.config}}
    if lora is not None:
        extra["lora"] = lora
        if attach:
            parse_lora(lora).attach(model, "test")
    save(folder / name, model, extra=extra)


@pytest.fixture
def sources(work):
    """``plain.safetensors``, a checkpoint without adapters."""
    gpt2_checkpoint(work, "plain.safetensors")


@pytest.mark.parametrize(
    ("args", "named"),
    [
        (["plain.safetensors", "out", "--format", "peft"], "this run has none"),
        (["plain.safetensors", "out", "--merge"], "--merge folds LoRA adapters"),
        (["run", "out", "--format", "hf"], "needs --merge"),
        (["run", "out", "--format", "peft", "--merge"], "goes with --format hf"),
    ],
)
def test_an_export_the_source_cannot_give_is_refused(work, sources, capsys, args, named):
    before = files_of(work)
    assert_one_line_error(cli(capsys, "export", *args), named)
    assert files_of(work) == before and not (work / "out").exists()


def test_merging_the_tied_heads_adapter_exports_untied_and_says_so(work, capsys):
    model = GPT2.from_pretrained(work / "model")
    wte = model.transformer.wte.weight.value.copy()
    spec = "rank=2,alpha=16.0,dropout=0.0,targets=c_attn+lm_head"
    parse_lora(spec).attach(model, "test")
    rng = np.random.default_rng(0)
    for path, p in model.named_parameters():
        if ".lora." in path:
            p.set_value(rng.normal(0.0, 0.1, p.shape).astype(p.dtype))
    save(work / "head.safetensors", model, extra={
        "model": {"class": "GPT2", "config": model.config}, "lora": spec,
    })  # fmt: skip
    code, out, err = cli(capsys, "export", "head.safetensors", "out", "--merge")
    assert code == 0, err
    untied = [line for line in out.splitlines() if line.startswith("untied")]
    assert untied == [
        "untied lm_head.weight from transformer.wte.weight: the merge changes them "
        "differently, so the export holds both tensors (tie_word_embeddings false)"
    ]
    hf, info = transformers.GPT2LMHeadModel.from_pretrained(work / "out", output_loading_info=True)
    assert all(not v for v in info.values()), info
    assert not hf.config.tie_word_embeddings
    np.testing.assert_array_equal(hf.transformer.wte.weight.detach().numpy(), wte)
    np.testing.assert_allclose(torch_logits(hf), logits(model.eval()), rtol=0, atol=1e-5)


@pytest.mark.parametrize(
    ("lora", "named"),
    [
        ("rank=0,targets=c_attn", "rank must be >= 1"),
        (8, "expected a LoRA specification"),
        ("rank=100000000,targets=c_attn", "rank 100000000, but the file's adapter tensors"),
    ],
)
def test_a_damaged_lora_in_a_checkpoint_is_refused_naming_the_file(work, capsys, lora, named):
    gpt2_checkpoint(work, "damaged.safetensors", lora, attach=False)
    before = files_of(work)
    result = cli(capsys, "export", "damaged.safetensors", "out", "--format", "peft")
    assert_one_line_error(result, "damaged.safetensors: extra['lora']", named)
    assert files_of(work) == before
