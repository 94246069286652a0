"""``tiegrad train --init``, ``sample`` and ``export --format hf`` end to end (issue 18).

The GPT-2 directory is a tiny random model saved by transformers with a byte-level BPE
tokenizer trained here by ``tokenizers``; nothing is downloaded.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

os.environ["HF_HUB_OFFLINE"] = "1"
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")

from tiegrad import EagerSession, load, save  # noqa: E402
from tiegrad.models import GPT2, TiedLM  # noqa: E402
from tiegrad.train import RunDir  # noqa: E402

TEXT = "".join(f"def f{i}(x):\n    return x * {i % 7} + {i % 5}\n" for i in range(150))
TRAIN = ["--text", "text.txt", "--steps", "20", "--seq-len", "16", "--batch-size", "4"]
TRAIN += ["--eval-every", "10", "--eval-batches", "2", "--warmup-steps", "5", "--no-progress"]


def cli(*args, cwd):
    env = dict(os.environ, PYTHONUNBUFFERED="1", HF_HUB_OFFLINE="1")
    return subprocess.run(
        [sys.executable, "-m", "tiegrad.cli", *map(str, args)],
        cwd=cwd, capture_output=True, text=True, env=env, timeout=300,
    )  # fmt: skip


def tiny_gpt2(folder, vocab_size: int) -> None:
    torch.manual_seed(0)
    config = transformers.GPT2Config(
        n_layer=1, n_head=2, n_embd=16, n_positions=32, vocab_size=vocab_size,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0,
    )  # fmt: skip
    transformers.GPT2LMHeadModel(config).save_pretrained(folder)


def hf_directory(folder) -> tokenizers.Tokenizer:
    """A transformers directory at ``folder``: ``tiny_gpt2`` with a byte-level BPE
    tokenizer trained on ``TEXT``; returns the tokenizer."""
    tok = tokenizers.Tokenizer(tokenizers.models.BPE())
    tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = tokenizers.decoders.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator([TEXT], trainer)
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>")
    fast.save_pretrained(folder)
    tiny_gpt2(folder, tok.get_vocab_size())
    return tok


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    root = tmp_path_factory.mktemp("cli_hf")
    (root / "text.txt").write_text(TEXT)
    tok = hf_directory(root / "model")
    train = cli("train", "--init", "model", "--run", "run", *TRAIN, cwd=root)
    assert train.returncode == 0, train.stdout + train.stderr
    export = cli("export", "run", "out", "--format", "hf", cwd=root)
    assert export.returncode == 0, export.stdout + export.stderr
    return root, train, tok


def test_train_init_fine_tunes_the_directory(exported):
    root, train, tok = exported
    assert "GPT2(vocab_size=" in train.stdout and "from model" in train.stdout
    assert "done: 20 steps" in train.stdout and "nats/token" in train.stdout
    run = RunDir(root / "run")
    assert run.best_path.is_file()
    config = json.loads(run.config_path.read_text())
    assert config["init"].endswith("model") and config["vocab_table"]["kind"] == "hf"
    start = GPT2.from_pretrained(root / "model")
    tuned = GPT2.from_pretrained(root / "model")
    load(run.best_or_latest(), tuned)
    assert tuned.aliases() == {"transformer.wte.weight": ["lm_head.weight"]}
    assert not np.array_equal(
        tuned.get_parameter("transformer.wte.weight").value,
        start.get_parameter("transformer.wte.weight").value,
    )


def test_sample_decodes_with_the_tokenizer(exported):
    root, _, _ = exported
    proc = cli("sample", "--run", "run", "--prompt", "def f", "--tokens", "8", cwd=root)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("def f")


def test_export_loads_in_transformers_with_the_tokenizer(exported):
    root, _, tok = exported
    out = root / "out"
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= set(os.listdir(out))
    hf, info = transformers.GPT2LMHeadModel.from_pretrained(out, output_loading_info=True)
    assert all(not v for v in info.values()), info
    ours = GPT2.from_pretrained(root / "model")
    load(RunDir(root / "run").best_or_latest(), ours)
    text = "def f3(x):\n    return x"
    fast = transformers.AutoTokenizer.from_pretrained(out)
    ids = np.array([fast(text)["input_ids"]])
    assert ids[0].tolist() == tok.encode(text).ids
    with torch.no_grad():
        theirs = hf.eval()(torch.tensor(ids)).logits.numpy()
    np.testing.assert_allclose(ours(EagerSession(), ids).numpy(), theirs, rtol=0, atol=1e-5)


def test_resume_continues_with_the_stored_tokenizer(exported, tmp_path):
    root, _, _ = exported
    shutil.copytree(root / "run", tmp_path / "run")
    proc = cli("resume", "run", "--steps", "22", "--no-progress", cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "done: 22 steps" in proc.stdout and "nats/token" in proc.stdout


def test_resume_needs_no_init_folder_the_checkpoint_holds_the_model(exported, tmp_path):
    root, _, _ = exported
    shutil.copytree(root / "run", tmp_path / "run")
    config_path = RunDir(tmp_path / "run").config_path
    config = json.loads(config_path.read_text())
    config["init"] = str(tmp_path / "moved-away")  # the transformers folder is gone
    config_path.write_text(json.dumps(config))
    proc = cli("resume", "run", "--steps", "22", "--no-progress", cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "done: 22 steps" in proc.stdout


def test_without_tokenizer_json_bytes_with_a_warning(tmp_path):
    (tmp_path / "text.txt").write_text(TEXT)
    tiny_gpt2(tmp_path / "model", 256)
    args = ["--steps", "2", "--eval-every", "2", "--checkpoint-every", "2"]
    proc = cli("train", "--init", "model", "--run", "run", *TRAIN, *args, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "no tokenizer.json: using byte-level tokens" in proc.stderr
    assert "nats/byte" in proc.stdout


def test_export_refuses_a_tiedlm_checkpoint(tmp_path):
    model = TiedLM(vocab_size=20, d_model=8, n_layers=1, n_heads=2, max_seq_len=8)
    extra = {"model": {"class": "TiedLM", "config": model.config}, "vocab": {"kind": "byte"}}
    save(tmp_path / "tied.safetensors", model, extra=extra)
    proc = cli("export", "tied.safetensors", "out", cwd=tmp_path)
    assert proc.returncode == 2 and "needs a checkpoint of a model fine-tuned" in proc.stderr
    assert "'TiedLM'" in proc.stderr
    assert not (tmp_path / "out").exists()
