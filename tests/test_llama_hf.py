"""``LlamaLM`` against transformers' Llama-family classes on tiny random models (issue 48).

Every model is built from transformers' own config classes (``LlamaConfig``,
``Qwen2Config``, ``Qwen3Config``, ``SmolLM3Config``, ``MistralConfig``) and saved with
``save_pretrained`` into a temporary folder: nothing is downloaded. Comparisons are
float32: logits 1e-5 absolute, gradients 1e-5 of each array's scale. The variants
cover tied and untied heads, grouped-query attention (4 query, 2 key-value heads),
llama3 and linear rope scaling, biases on and off, qk-norm and layers without rotation.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest

os.environ["HF_HUB_OFFLINE"] = "1"
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from tiegrad import CheckpointError, ConfigError, EagerSession  # noqa: E402
from tiegrad import models  # noqa: E402
from tiegrad.models import LlamaLM  # noqa: E402

VOCAB = 100
TINY = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
    pad_token_id=None,  # torch's padding_idx would hold one embedding row's gradient at 0
    bos_token_id=1,
    eos_token_id=2,
)
LLAMA3 = dict(
    rope_type="llama3",
    rope_theta=500000.0,
    factor=8.0,
    low_freq_factor=1.0,
    high_freq_factor=4.0,
    original_max_position_embeddings=16,
)

#: name -> (config class, its arguments beside TINY).
VARIANTS = {
    "llama-tied-llama3": ("LlamaConfig", dict(tie_word_embeddings=True, rope_parameters=LLAMA3)),
    "llama-untied-bias-linear": (
        "LlamaConfig",
        dict(
            attention_bias=True,
            mlp_bias=True,
            rope_parameters=dict(rope_type="linear", rope_theta=10000.0, factor=2.0),
        ),
    ),
    "qwen2-tied": ("Qwen2Config", dict(tie_word_embeddings=True)),
    "qwen3-tied-headdim": ("Qwen3Config", dict(tie_word_embeddings=True, head_dim=16)),
    "qwen3-untied-bias": ("Qwen3Config", dict(attention_bias=True, head_dim=8)),
    "smollm3-tied-nope": ("SmolLM3Config", dict(no_rope_layer_interval=2)),
    "mistral-untied": ("MistralConfig", dict(sliding_window=None)),
}


def hf_model(name: str, seed: int = 0):
    kind, extra = VARIANTS[name]
    torch.manual_seed(seed)
    config = getattr(transformers, kind)(**TINY, **extra)
    config._attn_implementation = "eager"
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    with torch.no_grad():  # biases and norms start at 0 and 1: give them values to check
        for path, p in model.named_parameters():
            if not path.endswith(("q_proj.weight", "embed_tokens.weight")) and p.ndim == 1:
                p.add_(0.1 * torch.randn_like(p))
    return model.eval()


def ids(shape=(2, 11), seed=0):
    return np.random.default_rng(seed).integers(0, VOCAB, shape)


def hf_logits(model, x) -> np.ndarray:
    with torch.no_grad():
        return model(torch.tensor(x)).logits.numpy()


def logits(model, x) -> np.ndarray:
    return model(EagerSession(), x).numpy()


def values(model) -> dict[str, np.ndarray]:
    return {p: h.value.copy() for p, h in model.named_slots()}


@pytest.fixture(scope="module", params=list(VARIANTS))
def saved(request, tmp_path_factory):
    """A tiny transformers model of one variant and its save_pretrained folder."""
    folder = tmp_path_factory.mktemp(request.param)
    model = hf_model(request.param)
    model.save_pretrained(folder)
    return request.param, model, folder


def test_logits_equal_transformers(saved):
    name, hf, folder = saved
    model = models.from_pretrained(folder)
    assert isinstance(model, LlamaLM)
    hf_paths = [p for p, _ in hf.named_parameters(remove_duplicate=False)]
    assert [p for p, _ in model.named_slots()] == hf_paths
    tied = hf.config.tie_word_embeddings
    assert model.aliases() == ({"model.embed_tokens.weight": ["lm_head.weight"]} if tied else {})
    x = ids()
    np.testing.assert_allclose(logits(model, x), hf_logits(hf, x), rtol=0, atol=1e-5)


def test_gradients_equal_autograd(saved):
    """Every gradient, the tied embedding's the sum of both uses (C4)."""
    name, hf, folder = saved
    model = LlamaLM.from_pretrained(folder)
    x, y = ids(seed=1), ids(seed=2)
    s = EagerSession()
    grads = model.named_gradients(s.backward(model.loss(s, x, y)))
    hf.zero_grad()
    out = hf(torch.tensor(x)).logits
    torch.nn.functional.cross_entropy(out.flatten(0, 1), torch.tensor(y).flatten()).backward()
    theirs = dict(hf.named_parameters())  # the tied pair once: its .grad sums both uses
    assert set(grads) == set(theirs)
    for path, g in grads.items():
        ref = theirs[path].grad.numpy()
        scale = float(np.abs(ref).max())
        np.testing.assert_allclose(g, ref, rtol=0, atol=1e-5 * scale, err_msg=path)


def test_save_pretrained_loads_in_transformers(saved, tmp_path):
    name, hf, folder = saved
    model = LlamaLM.from_pretrained(folder)
    with_values = {p: v + 0.01 for p, v in values(model).items()}  # not the source's weights
    for path, param in model.named_parameters():
        param.storage.commit_host(with_values[path])
    model.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    tied = hf.config.tie_word_embeddings
    assert config["tie_word_embeddings"] is tied
    back, info = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path, output_loading_info=True, attn_implementation="eager"
    )
    assert type(back) is type(hf)
    assert all(not v for v in info.values()), info  # no missing or unexpected keys
    assert (back.lm_head.weight is back.model.embed_tokens.weight) is tied
    x = ids(seed=4)
    np.testing.assert_allclose(hf_logits(back.eval(), x), logits(model, x), rtol=0, atol=1e-5)
    again = LlamaLM.from_pretrained(tmp_path)
    assert again.aliases() == model.aliases()
    np.testing.assert_array_equal(logits(again, x), logits(model, x))
