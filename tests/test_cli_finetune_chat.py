"""Issue 49 end to end through the command: a tiny tied Qwen2-style folder with a chat
template, ``tiegrad train --init DIR --chat FILE.jsonl --lora`` with an adapter on the
head's use of the tied embedding, then ``export --format peft`` and ``export --format hf
--merge``; peft and transformers reload both to the logits of the trained run, and the
merged folder holds the input embedding bit for bit as the base (transformers#45127,
peft#2777). Nothing is downloaded.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import warnings

import numpy as np
import pytest
from test_chat_data import CHATML, write_chat
from test_cli_chat import CHATS, TRAIN, chat_folder

os.environ["HF_HUB_OFFLINE"] = "1"
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")
pytest.importorskip("jinja2")

from tiegrad import EagerSession, load  # noqa: E402
from tiegrad.adapters import add_lora  # noqa: E402
from tiegrad.cli import main  # noqa: E402
from tiegrad.models import LlamaLM  # noqa: E402
from tiegrad.train import RunDir  # noqa: E402

TARGETS = ["q_proj", "v_proj", "lm_head"]
EMBED, HEAD = "model.embed_tokens.weight", "lm_head.weight"
IDS = np.array([[5, 17, 42, 8, 99, 3, 11]])


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """The chat LoRA run, its two exports, and what the commands printed."""
    root = tmp_path_factory.mktemp("cli_finetune_chat")
    chat_folder(root / "model", CHATML)
    write_chat(root / "chat.jsonl", CHATS)
    lora = ["--lora", f"rank=2,targets={'+'.join(TARGETS)}"]
    out = io.StringIO()
    with pytest.MonkeyPatch.context() as mp, contextlib.redirect_stdout(out):
        mp.chdir(root)
        assert main(["train", "--init", "model", "--run", "run", *TRAIN, *lora]) == 0
        assert main(["export", "run", "adapter", "--format", "peft"]) == 0
        assert main(["export", "run", "merged", "--format", "hf", "--merge"]) == 0
    model = LlamaLM.from_pretrained(root / "model")
    add_lora(model, TARGETS, rank=2)
    load(RunDir(root / "run").best_or_latest(), model)
    return root, out.getvalue(), model.eval()(EagerSession(), IDS).numpy()


def logits_of(model) -> np.ndarray:
    with torch.no_grad():
        return model.eval()(torch.tensor(IDS)).logits.numpy()


def test_the_run_trained_the_head_adapter_and_left_the_input_use(run):
    root, _, ours = run
    base = LlamaLM.from_pretrained(root / "model")
    assert not np.allclose(base(EagerSession(), IDS).numpy(), ours, atol=1e-6)


def test_peft_loads_the_exported_adapter_to_the_runs_logits(run):
    root, _, ours = run
    base = transformers.AutoModelForCausalLM.from_pretrained(root / "model")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # peft's tied-layer notice: the head alone is adapted
        theirs = peft.PeftModel.from_pretrained(base, root / "adapter")
    np.testing.assert_allclose(logits_of(theirs), ours, rtol=0, atol=1e-5)


def test_the_merged_export_is_untied_says_so_and_reloads_to_the_runs_logits(run):
    root, printed, ours = run
    untied = [line for line in printed.splitlines() if line.startswith("untied")]
    assert len(untied) == 1 and untied[0].startswith(f"untied {HEAD} from {EMBED}:")
    assert json.loads((root / "merged" / "config.json").read_text())["tie_word_embeddings"] is False
    hf, info = transformers.AutoModelForCausalLM.from_pretrained(
        root / "merged", output_loading_info=True
    )
    assert all(not v for v in info.values()), info
    base = LlamaLM.from_pretrained(root / "model").model.embed_tokens.weight.value
    np.testing.assert_array_equal(hf.model.embed_tokens.weight.detach().numpy(), base)
    np.testing.assert_allclose(logits_of(hf), ours, rtol=0, atol=1e-5)
