"""``tiegrad train --init DIR --add-tokens FILE [--train-rows new]`` end to end (issue 49,
item 4): the tokens join the folder's tokenizer, the tied model grows to match, only the
new rows train, and sample, resume and ``export --format hf`` use the grown vocabulary.
"""

from __future__ import annotations

import contextlib
import io
import json
import shutil

import numpy as np
import pytest
from test_cli import files_of
from test_cli_llama import EMBED, HEAD, qwen2_folder
from test_untrusted_input import assert_one_line_error, cli

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from tiegrad import EagerSession, load  # noqa: E402
from tiegrad.cli import main  # noqa: E402
from tiegrad.cli.checkpoints import stored_model  # noqa: E402
from tiegrad.models import from_pretrained  # noqa: E402
from tiegrad.train import RunDir  # noqa: E402

TOKENS = ["<think>", "</think>"]
TEXT = "".join(f"<think> tied rows {i % 7} </think> the head reads it.\n" for i in range(60))
TRAIN = [
    "--text", "text.txt", "--steps", "3", "--seq-len", "16", "--batch-size", "2",
    "--eval-every", "3", "--eval-batches", "1", "--checkpoint-every", "3",
    "--warmup-steps", "1", "--lr", "0.05", "--sample-every", "0", "--no-progress",
]  # fmt: skip
ONLY_NEW = ["--train-rows", "new", "--freeze", "model.layers.*,model.norm.weight"]


@pytest.fixture(scope="module")
def grown_run(tmp_path_factory):
    """A 3-step run that adds two tokens and trains their rows alone, and its export."""
    root = tmp_path_factory.mktemp("cli_vocab")
    (root / "text.txt").write_text(TEXT)
    (root / "tokens.txt").write_text("\n".join(TOKENS) + "\n")
    qwen2_folder(root / "model")
    args = ["train", "--init", "model", "--run", "run", "--add-tokens", "tokens.txt"]
    with pytest.MonkeyPatch.context() as mp, contextlib.redirect_stdout(io.StringIO()):
        mp.chdir(root)
        assert main([*args, *ONLY_NEW, *TRAIN]) == 0
        assert main(["export", "run", "out", "--format", "hf"]) == 0
    return root


@pytest.fixture
def work(grown_run, tmp_path, monkeypatch):
    shutil.copytree(grown_run, tmp_path, dirs_exist_ok=True)
    monkeypatch.chdir(tmp_path)
    return tmp_path


def trained_model(root):
    model, _ = stored_model(RunDir(root / "run").latest(), "test")
    load(RunDir(root / "run").latest(), model)
    return model


def test_the_run_grows_the_tied_storage_and_trains_only_the_new_rows(grown_run):
    base = from_pretrained(grown_run / "model")
    model = trained_model(grown_run)
    old = base.vocab_size
    embed, head = model.get_parameter(EMBED), model.get_parameter(HEAD)
    assert embed.storage is head.storage and model.vocab_size == old + len(TOKENS)
    assert list(embed.storage.trained_rows) == [old, old + 1]
    assert np.array_equal(embed.value[:old], base.get_parameter(EMBED).value)
    mean = base.get_parameter(EMBED).value.mean(axis=0, dtype=np.float64).astype(np.float32)
    assert not np.allclose(embed.value[old:], mean)  # trained away from their start
    layer = "model.layers.0.mlp.up_proj.weight"
    assert np.array_equal(model.get_parameter(layer).value, base.get_parameter(layer).value)


def test_the_export_holds_the_grown_tokenizer_and_loads_in_transformers(grown_run):
    out = grown_run / "out"
    model = trained_model(grown_run)
    hf = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    config = json.loads((out / "config.json").read_text())
    assert config["vocab_size"] == model.vocab_size and config["tie_word_embeddings"] is True
    assert hf.lm_head.weight is hf.model.embed_tokens.weight
    tok = transformers.AutoTokenizer.from_pretrained(out)
    ids = tok("<think> tied rows 3 </think>", add_special_tokens=False)["input_ids"]
    assert ids[0] == model.vocab_size - 2 and ids[-1] == model.vocab_size - 1
    with torch.no_grad():
        theirs = hf(torch.tensor([ids])).logits.numpy()
    np.testing.assert_allclose(model(EagerSession(), np.array([ids])).numpy(), theirs, atol=1e-5)


def test_sample_and_resume_use_the_grown_vocabulary_and_mask(work, capsys):
    code, out, err = cli(capsys, "sample", "--run", "run", "--prompt", "<think>", "--tokens", 4)
    assert code == 0, err
    (work / "model").rename(work / "moved")  # the checkpoint holds the model
    before = trained_model(work)
    code, out, err = cli(capsys, "resume", "run", "--steps", 5, "--no-progress")
    assert code == 0, out + err
    after = trained_model(work)
    old = before.vocab_size - len(TOKENS)
    embed = after.get_parameter(EMBED)
    assert list(embed.storage.trained_rows) == [old, old + 1]
    assert np.array_equal(embed.value[:old], before.get_parameter(EMBED).value[:old])
    assert not np.array_equal(embed.value[old:], before.get_parameter(EMBED).value[old:])


@pytest.mark.parametrize(
    "tokens, args, fragments",
    [
        ("<think>\n<pad>\n", [], ("--add-tokens", "'<pad>'", "in the vocabulary already (id 0)")),
        ("<think>\n\n</think>\n", [], ("--add-tokens", "line 2 is empty")),
        ("<think>\n<think>\n", [], ("--add-tokens", "'<think>' is given twice")),
        ("", ["--add-tokens", ""], ("--train-rows", "give --add-tokens FILE")),
    ],
    ids=["known-token", "empty-line", "twice", "train-rows-without-tokens"],
)
def test_a_refused_add_tokens_is_one_line_and_writes_nothing(work, capsys, tokens, args, fragments):
    (work / "tokens.txt").write_text(tokens)
    before = files_of(work)
    result = cli(
        capsys, "train", "--init", "model", "--run", "again", "--add-tokens", "tokens.txt",
        *ONLY_NEW, *TRAIN, *args,
    )  # fmt: skip
    assert_one_line_error(result, *fragments)
    assert files_of(work) == before and not (work / "again").exists()


def test_resume_refuses_another_train_rows_and_changes_nothing(work, capsys):
    path = RunDir(work / "run").config_path
    path.write_text(json.dumps({**json.loads(path.read_text()), "train_rows": "all"}))
    before = files_of(work)
    result = cli(capsys, "resume", "run", "--steps", 5)
    assert_one_line_error(result, "train_rows (--train-rows) is 'all'", "holds row masks")
    assert files_of(work) == before
