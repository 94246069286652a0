"""``tiegrad train --init DIR --lora`` on a tied Qwen2-style folder, then ``export --format
peft`` and ``export --format hf --merge`` against peft and transformers (issue 49).

The folder is ``test_cli_llama``'s tiny tied Qwen2 model and tokenizer; the adapters
are on the seven projections and on the head's use of the tied embedding alone, so the
merge unties it. The commands run in process; nothing is downloaded.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import warnings

import numpy as np
import pytest
from test_cli import files_of
from test_cli_llama import TEXT, TRAIN, qwen2_folder
from test_untrusted_input import assert_one_line_error, cli

os.environ["HF_HUB_OFFLINE"] = "1"
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

from tiegrad import EagerSession, load  # noqa: E402
from tiegrad.adapters import add_lora  # noqa: E402
from tiegrad.cli import main  # noqa: E402
from tiegrad.models import LlamaLM  # noqa: E402
from tiegrad.train import RunDir  # noqa: E402

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "lm_head"]
LORA = f"rank=2,targets={'+'.join(TARGETS)}"
EMBED, HEAD = "model.embed_tokens.weight", "lm_head.weight"
IDS = np.array([[5, 17, 42, 8, 99, 3, 250, 11]])


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """A 3-step LoRA run of the folder, its PEFT and merged exports, what they printed."""
    root = tmp_path_factory.mktemp("cli_lora_llama")
    (root / "text.txt").write_text(TEXT)
    qwen2_folder(root / "model")
    out = io.StringIO()
    with pytest.MonkeyPatch.context() as mp, contextlib.redirect_stdout(out):
        mp.chdir(root)
        assert main(["train", "--init", "model", "--run", "run", "--lora", LORA, *TRAIN]) == 0
        assert main(["export", "run", "adapter", "--format", "peft"]) == 0
        assert main(["export", "run", "merged", "--format", "hf", "--merge"]) == 0
    return root, out.getvalue()


def tuned(root) -> LlamaLM:
    """The run's best checkpoint in the --init model with the run's adapters."""
    model = LlamaLM.from_pretrained(root / "model")
    add_lora(model, TARGETS, rank=2)
    load(RunDir(root / "run").best_or_latest(), model)
    return model.eval()


def torch_logits(model) -> np.ndarray:
    with torch.no_grad():
        return model.eval()(torch.tensor(IDS)).logits.numpy()


def test_the_head_adapter_trains_and_the_input_use_stays_bit_for_bit(exported):
    root, _ = exported
    base, model = LlamaLM.from_pretrained(root / "model"), tuned(root)
    np.testing.assert_array_equal(
        model.model.embed_tokens.weight.value, base.model.embed_tokens.weight.value
    )
    assert model.lm_head.lora.default.B.value.any()


def test_export_peft_loads_in_peft_to_the_same_logits(exported):
    root, _ = exported
    config = json.loads((root / "adapter" / "adapter_config.json").read_text())
    assert "model.layers.0.mlp.down_proj" in config["target_modules"]
    assert not config["ensure_weight_tying"]
    base = transformers.AutoModelForCausalLM.from_pretrained(root / "model")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the tied-layer notice: the head alone is adapted
        theirs = peft.PeftModel.from_pretrained(base, root / "adapter")
    ours = tuned(root)(EagerSession(), IDS).numpy()
    np.testing.assert_allclose(torch_logits(theirs), ours, rtol=0, atol=1e-5)


def test_export_merge_unties_the_head_says_so_and_reloads_in_transformers(exported):
    root, printed = exported
    untied = [line for line in printed.splitlines() if line.startswith("untied")]
    assert len(untied) == 1 and untied[0].startswith(f"untied {HEAD} from {EMBED}:")
    config = json.loads((root / "merged" / "config.json").read_text())
    assert config["tie_word_embeddings"] is False
    hf, info = transformers.AutoModelForCausalLM.from_pretrained(
        root / "merged", output_loading_info=True
    )
    assert all(not v for v in info.values()), info
    base = LlamaLM.from_pretrained(root / "model").model.embed_tokens.weight.value
    np.testing.assert_array_equal(hf.model.embed_tokens.weight.detach().numpy(), base)
    ours = tuned(root)(EagerSession(), IDS).numpy()
    np.testing.assert_allclose(torch_logits(hf), ours, rtol=0, atol=1e-5)


def test_a_shared_adapter_trains_both_uses_and_merges_keeping_the_tie(exported, tmp_path):
    root, _ = exported
    out = io.StringIO()
    spec = "rank=2,share_tied=true,targets=lm_head"
    with pytest.MonkeyPatch.context() as mp, contextlib.redirect_stdout(out):
        mp.chdir(root)
        assert (
            main(
                ["train", "--init", "model", "--run", str(tmp_path / "run"), "--lora", spec, *TRAIN]
            )
            == 0
        )
        assert main(["export", str(tmp_path / "run"), str(tmp_path / "merged"), "--merge"]) == 0
    assert "untied" not in out.getvalue() and "share_tied=true" in out.getvalue()
    model = LlamaLM.from_pretrained(root / "model")
    add_lora(model, "lm_head", rank=2, share_tied=True)
    load(RunDir(tmp_path / "run").best_or_latest(), model)
    assert model.lm_head.lora.default is model.model.embed_tokens.lora.default
    config = json.loads((tmp_path / "merged" / "config.json").read_text())
    assert config["tie_word_embeddings"] is True
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged")
    assert hf.lm_head.weight.data_ptr() == hf.model.embed_tokens.weight.data_ptr()
    ours = model.eval()(EagerSession(), IDS).numpy()
    np.testing.assert_allclose(torch_logits(hf), ours, rtol=0, atol=1e-4)


@pytest.mark.parametrize(
    ("spec", "named"),
    [
        ("share_tied=yes,targets=lm_head", "share_tied='yes' is not true or false"),
        ("targets=q_proj+nothing", "target 'nothing' matches no path"),
    ],
)
def test_a_bad_lora_on_the_folder_is_one_line_and_writes_no_run(
    exported, tmp_path, capsys, spec, named
):
    root, _ = exported
    before = files_of(root)
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(root)
        result = cli(capsys, "train", "--init", "model", "--run", "bad", "--lora", spec, *TRAIN)
    assert_one_line_error(result, "--lora", named)
    assert files_of(root) == before
