"""PEFT's trainable tokens (``TrainableTokensConfig``) both ways (issue 49, item 2): the
selected rows of a tied embedding train in both uses, as a row mask on its one storage.

Tiny tied Qwen2- and Llama-style models are made by transformers' config classes; PEFT's
``get_peft_model`` (with ``init_weights=False``, so the rows differ from the base) and
``PeftModel.from_pretrained`` write and read the adapter folders.
"""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

os.environ["HF_HUB_OFFLINE"] = "1"
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

from tiegrad import CheckpointError, EagerSession, SlotError  # noqa: E402
from tiegrad.interop.peft import load_trainable_tokens, save_trainable_tokens  # noqa: E402
from tiegrad.models import from_pretrained  # noqa: E402
from tiegrad.nn import train_rows, trained_rows  # noqa: E402
from tiegrad.optim import AdamW  # noqa: E402

EMBED, HEAD = "model.embed_tokens.weight", "lm_head.weight"
ROWS = [3, 30, 31]
TINY = dict(
    vocab_size=40, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
    num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=32,
    tie_word_embeddings=True,
)  # fmt: skip
X = np.array([[3, 5, 30, 31, 7, 3]])


def hf_base(kind: str):
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(getattr(transformers, kind)(**TINY))


@pytest.fixture(scope="module", params=["Qwen2Config", "LlamaConfig"])
def folders(request, tmp_path_factory):
    """The base folder and a trainable-tokens adapter PEFT saved for it."""
    root = tmp_path_factory.mktemp("tokens")
    hf_base(request.param).save_pretrained(root / "base")
    config = peft.TrainableTokensConfig(
        target_modules=["embed_tokens"], token_indices=ROWS, init_weights=False
    )
    peft.get_peft_model(hf_base(request.param), config).save_pretrained(root / "adapter")
    return request.param, root


def peft_logits(kind, base, adapter) -> np.ndarray:
    hf = transformers.AutoModelForCausalLM.from_pretrained(base)
    model = peft.PeftModel.from_pretrained(hf, adapter).eval()
    with torch.no_grad():
        return model(torch.tensor(X)).logits.numpy()


def test_a_peft_adapter_loads_as_a_row_mask_on_the_tied_storage(folders):
    kind, root = folders
    model = from_pretrained(root / "base")
    base = np.array(model.get_parameter(EMBED).value)
    assert load_trainable_tokens(model, root / "adapter") == ROWS
    embed, head = model.get_parameter(EMBED), model.get_parameter(HEAD)
    assert embed.storage is head.storage and list(trained_rows(model, EMBED)) == ROWS
    assert embed.requires_grad and head.requires_grad  # both uses train the rows
    frozen = [path for path, p in model.named_slots() if path not in (EMBED, HEAD)]
    assert not any(model.get_parameter(path).requires_grad for path in frozen)
    others = np.setdiff1d(np.arange(40), ROWS)
    assert np.array_equal(embed.value[others], base[others])
    assert not np.allclose(embed.value[ROWS], base[ROWS])
    theirs = peft_logits(kind, root / "base", root / "adapter")
    np.testing.assert_allclose(model(EagerSession(), X).numpy(), theirs, rtol=0, atol=1e-5)


def test_trained_rows_saved_by_tiegrad_load_in_peft(folders, tmp_path):
    kind, root = folders
    model = from_pretrained(root / "base")
    model.freeze("*")
    model.unfreeze([EMBED, HEAD])
    train_rows(model, EMBED, ROWS)
    optimizer = AdamW(model.parameters(), lr=0.05)
    for _ in range(3):
        s = EagerSession()
        optimizer.step(s.backward(model.loss(s, X[:, :-1], X[:, 1:])))
    assert save_trainable_tokens(model, tmp_path / "mine") == ROWS
    config = json.loads((tmp_path / "mine" / "adapter_config.json").read_text())
    assert config["peft_type"] == "TRAINABLE_TOKENS" and config["token_indices"] == ROWS
    theirs = peft_logits(kind, root / "base", tmp_path / "mine")
    np.testing.assert_allclose(model(EagerSession(), X).numpy(), theirs, rtol=0, atol=1e-5)


def _edited(root, tmp_path, config_edit=None, tensors_edit=None):
    from safetensors.numpy import load_file, save_file

    out = tmp_path / "edited"
    out.mkdir()
    config = json.loads((root / "adapter" / "adapter_config.json").read_text())
    (out / "adapter_config.json").write_text(json.dumps({**config, **(config_edit or {})}))
    tensors = load_file(root / "adapter" / "adapter_model.safetensors")
    save_file(tensors_edit(tensors) if tensors_edit else tensors, out / "adapter_model.safetensors")
    return out


DELTA = "base_model.model.model.embed_tokens.trainable_tokens_delta"


@pytest.mark.parametrize(
    "config_edit, tensors_edit, match",
    [
        ({"peft_type": "LORA"}, None, "peft_type 'LORA', expected 'TRAINABLE_TOKENS'"),
        ({"token_indices": [3, 40, 2]}, None, r"rows 40 are outside \[-40, 40\)"),
        ({"token_indices": [3, 3, 4]}, None, "rows 3 are given more than once"),
        ({"target_modules": ["q_proj"]}, None, "does not name the token embedding"),
        ({"layers_to_transform": [0]}, None, "'layers_to_transform' not TrainableTokensConfig"),
        (None, lambda t: {**t, DELTA: t[DELTA][:2]}, r"has shape \(2, 16\), expected \(3, 16\)"),
        (None, lambda t: {**t, DELTA: t[DELTA] * np.inf}, "infinit|NaN|non-finite"),
        (None, lambda t: {**t, "x.trainable_tokens_delta": t[DELTA]}, "expected the tensors"),
    ],
    ids=["type", "index-range", "index-twice", "targets", "unknown", "shape", "inf", "stray"],
)
def test_a_refused_adapter_is_one_error_that_changes_nothing(
    folders, tmp_path, config_edit, tensors_edit, match
):
    _, root = folders
    model = from_pretrained(root / "base")
    before = {path: (np.array(p.value), p.requires_grad) for path, p in model.named_slots()}
    with pytest.raises(CheckpointError, match=match):
        load_trainable_tokens(model, _edited(root, tmp_path, config_edit, tensors_edit))
    assert trained_rows(model, EMBED) is None
    for path, p in model.named_slots():
        assert np.array_equal(p.value, before[path][0]) and p.requires_grad is before[path][1]


def test_saving_refuses_other_trained_weights_and_writes_nothing(folders, tmp_path):
    _, root = folders
    model = from_pretrained(root / "base")
    with pytest.raises(SlotError, match="has no row mask"):
        save_trainable_tokens(model, tmp_path / "a")
    train_rows(model, EMBED, ROWS)
    with pytest.raises(SlotError, match="model.layers.0.* train too"):
        save_trainable_tokens(model, tmp_path / "a")
    assert not (tmp_path / "a").exists()
