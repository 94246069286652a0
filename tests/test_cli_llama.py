"""``tiegrad train --init``, ``sample``, ``inspect``, ``resume`` and ``export --format hf``
on a Llama-family folder end to end (issue 48, item 6).

The folder is a tiny tied Qwen2-style model saved by transformers' ``save_pretrained``
with a byte-level BPE tokenizer trained here by ``tokenizers`` (its special tokens in
``tokenizer_config.json``); nothing is downloaded. The commands run in process.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import shutil

import numpy as np
import pytest
from test_cli import files_of
from test_untrusted_input import assert_one_line_error, cli

os.environ["HF_HUB_OFFLINE"] = "1"
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")

from tiegrad import EagerSession, load  # noqa: E402
from tiegrad.cli import main  # noqa: E402
from tiegrad.cli.checkpoints import checkpoint_extra  # noqa: E402
from tiegrad.cli.sample import until_eos  # noqa: E402
from tiegrad.models import LlamaLM, from_pretrained  # noqa: E402
from tiegrad.train import RunDir  # noqa: E402

TEXT = "".join(f"tied weights are one storage {i % 9}; the head reads it.\n" for i in range(80))
EMBED, HEAD = "model.embed_tokens.weight", "lm_head.weight"
TRAIN = [
    "--text", "text.txt", "--steps", "3", "--seq-len", "16", "--batch-size", "2",
    "--eval-every", "3", "--eval-batches", "1", "--checkpoint-every", "3",
    "--warmup-steps", "1", "--lr", "0.01", "--sample-every", "0", "--no-progress",
]  # fmt: skip


def qwen2_folder(folder) -> None:
    """A tiny tied Qwen2 model (hidden 32, 2 layers, GQA 4/2) and its tokenizer."""
    tok = tokenizers.Tokenizer(tokenizers.models.BPE())
    tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = tokenizers.decoders.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=["<pad>", "<s>", "</s>"],
        initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator([TEXT], trainer)
    folder.mkdir()
    tok.save(str(folder / "tokenizer.json"))
    special = {"bos_token": "<s>", "eos_token": "</s>", "pad_token": "<pad>"}
    config = {**special, "tokenizer_class": "PreTrainedTokenizerFast"}
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    torch.manual_seed(0)
    hf = transformers.Qwen2ForCausalLM(
        transformers.Qwen2Config(
            vocab_size=tok.get_vocab_size(), hidden_size=32, intermediate_size=64,
            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            max_position_embeddings=64, tie_word_embeddings=True, pad_token_id=0,
            bos_token_id=1, eos_token_id=2,
        )
    )  # fmt: skip
    hf.save_pretrained(folder)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A 3-step ``train --init`` run of the folder with the input use of the tied
    embedding frozen (``--freeze model.embed_tokens.weight``: the head's use trains the
    storage), its ``export --format hf`` and what ``train`` printed."""
    root = tmp_path_factory.mktemp("cli_llama")
    (root / "text.txt").write_text(TEXT)
    qwen2_folder(root / "model")
    out = io.StringIO()
    with pytest.MonkeyPatch.context() as mp, contextlib.redirect_stdout(out):
        mp.chdir(root)
        assert main(["train", "--init", "model", "--run", "run", "--freeze", EMBED, *TRAIN]) == 0
        assert main(["export", "run", "out", "--format", "hf"]) == 0
    return root, out.getvalue()


@pytest.fixture
def work(trained, tmp_path, monkeypatch):
    """A copy of the trained folder, the current directory."""
    shutil.copytree(trained[0], tmp_path, dirs_exist_ok=True)
    monkeypatch.chdir(tmp_path)
    return tmp_path


def tuned(root) -> LlamaLM:
    """The run's best checkpoint in the model its --init folder gives."""
    model = from_pretrained(root / "model")
    model.freeze(EMBED)
    load(RunDir(root / "run").best_or_latest(), model)
    return model


def test_train_init_fine_tunes_the_tied_storage_through_the_head(trained):
    root, printed = trained
    assert "LlamaLM(model_type='qwen2'" in printed and "from model" in printed
    assert f"freeze   {EMBED}" in printed and "done: 3 steps" in printed
    extra = checkpoint_extra(RunDir(root / "run").best_or_latest())
    assert extra["model"]["class"] == "LlamaLM" and extra["freeze"] == EMBED
    assert extra["vocab"]["kind"] == "hf"
    start, model = from_pretrained(root / "model"), tuned(root)
    assert model.aliases() == {EMBED: [HEAD]}
    assert not np.array_equal(model.get_parameter(EMBED).value, start.get_parameter(EMBED).value)


def test_sample_decodes_with_the_folder_tokenizer_and_stops_at_eos(work, capsys):
    code, out, err = cli(
        capsys, "sample", "--run", "run", "--prompt", "tied weights", "--tokens", 6
    )
    assert code == 0, err
    assert out.startswith("tied weights") and "</s>" not in out
    model, tok = tuned(work), transformers.AutoTokenizer.from_pretrained(work / "model")
    prompt = tok("tied weights", add_special_tokens=False)["input_ids"]
    greedy = model.generate(np.array([prompt]), 6, temperature=0, eos_token_id=tok.eos_token_id)
    code, out, err = cli(
        capsys, "sample", "--run", "run", "--prompt", "tied weights", "--tokens", 6,
        "--temperature", 0,
    )  # fmt: skip
    assert code == 0, err
    assert out == tok.decode(greedy[0], skip_special_tokens=True) + "\n"


def test_the_sampled_text_ends_before_the_first_generated_eos():
    """The prompt's own eos tokens stay; without an eos every token is decoded."""
    ids = np.array([2, 5, 2, 7, 2, 9])
    assert until_eos(ids, 1, 2).tolist() == [2, 5]
    assert until_eos(ids, 3, 2).tolist() == [2, 5, 2, 7]
    assert until_eos(ids, 1, None).tolist() == ids.tolist()
    assert until_eos(ids, 1, 4).tolist() == ids.tolist()


def test_export_loads_in_transformers_to_the_same_logits(trained):
    root, _ = trained
    out = root / "out"
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= set(os.listdir(out))
    hf, info = transformers.AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    assert all(not v for v in info.values()), info
    assert isinstance(hf, transformers.Qwen2ForCausalLM)
    assert hf.lm_head.weight is hf.model.embed_tokens.weight
    config = json.loads((out / "config.json").read_text())
    assert config["tie_word_embeddings"] is True and config["eos_token_id"] == 2
    tok = transformers.AutoTokenizer.from_pretrained(out)
    ids = np.array([tok("the head reads it", add_special_tokens=False)["input_ids"]])
    with torch.no_grad():
        theirs = hf.eval()(torch.tensor(ids)).logits.numpy()
    ours = tuned(root)(EagerSession(), ids).numpy()
    np.testing.assert_allclose(ours, theirs, rtol=0, atol=1e-5)


def test_inspect_shows_the_tie_and_the_frozen_use(work, capsys):
    code, out, err = cli(capsys, "inspect", "run")
    assert code == 0, err
    assert f"tie: {EMBED} = {HEAD}" in out and "1 tied slot, 1 frozen slot" in out


def test_resume_continues_the_run_with_its_frozen_use(work, capsys):
    (work / "model").rename(work / "moved")  # the checkpoint holds the model
    code, out, err = cli(capsys, "resume", "run", "--steps", 5, "--no-progress")
    assert code == 0, out + err
    assert "done: 5 steps" in out and f"freeze   {EMBED}" in out


def test_resume_refuses_another_freeze_and_changes_nothing(work, capsys):
    path = RunDir(work / "run").config_path
    config = json.loads(path.read_text())
    path.write_text(json.dumps({**config, "freeze": ""}))
    before = files_of(work)
    assert_one_line_error(cli(capsys, "resume", "run", "--steps", 5), "freeze (--freeze)", EMBED)
    assert files_of(work) == before


@pytest.mark.parametrize(
    "edit, args, fragments",
    [
        ({"model_type": "gemma"}, [], ("config.json", "model_type 'gemma'", "qwen2")),
        ({}, ["--freeze", "model.nope.*"], ("--freeze", "'model.nope.*'", EMBED)),
        ({}, ["--seq-len", "65"], ("--seq-len 65", "64 positions")),
        ({}, ["--freeze", EMBED, "--lora", "rank=2,targets=q_proj"], ("--freeze", "--lora")),
    ],
    ids=["unknown-model-type", "freeze-matching-nothing", "seq-len-past-the-model", "with-lora"],
)
def test_a_refused_init_is_one_line_and_writes_nothing(work, capsys, edit, args, fragments):
    path = work / "model" / "config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **edit}))
    before = files_of(work)
    result = cli(capsys, "train", "--init", "model", "--run", "again", *TRAIN, *args)
    assert_one_line_error(result, *fragments)
    assert files_of(work) == before and not (work / "again").exists()


def test_a_crafted_layer_count_is_refused_before_building(work, capsys, monkeypatch):
    """A checkpoint's stored LlamaLM configuration is bounded by its tensors by
    arithmetic (C6): 10**9 layers is a quick error, nothing built."""
    import tiegrad.checkpoint as ckpt

    latest = RunDir(work / "run").best_or_latest()
    model = tuned(work)
    extra = checkpoint_extra(latest)
    extra["model"]["config"]["num_hidden_layers"] = 10**9
    ckpt.save(latest, model, extra=extra)
    built = []
    monkeypatch.setattr("tiegrad.train.job.build_model", lambda *a: built.append(a))
    before = files_of(work)
    assert_one_line_error(cli(capsys, "export", "run", "out2"), "implies 12000000003 slots")
    assert built == [] and files_of(work) == before
