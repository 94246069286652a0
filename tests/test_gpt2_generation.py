"""``GPT2.generate`` through the KV cache against transformers' ``generate`` (issue 48).

A tiny random ``GPT2LMHeadModel`` saved with ``save_pretrained`` (nothing downloaded):
greedy tokens equal transformers' ``generate(do_sample=False)`` with the cache and
without it, and sampling gives the same tokens on both paths, past ``n_positions`` too.
"""

from __future__ import annotations

import os

import numpy as np
import pytest

os.environ["HF_HUB_OFFLINE"] = "1"
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from tiegrad.models import GPT2  # noqa: E402

TINY = dict(n_layer=2, n_head=2, n_embd=32, vocab_size=100, n_positions=32)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    folder = tmp_path_factory.mktemp("gpt2")
    torch.manual_seed(0)
    config = transformers.GPT2Config(
        **TINY, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0
    )
    hf = transformers.GPT2LMHeadModel(config).eval()
    hf.save_pretrained(folder)
    return hf, GPT2.from_pretrained(folder)


def prompt(shape, seed=0):
    return np.random.default_rng(seed).integers(0, TINY["vocab_size"], shape)


def test_greedy_tokens_equal_transformers_with_and_without_the_cache(models):
    hf, model = models
    x = prompt((2, 5))
    hf.generation_config.eos_token_id = None
    hf.generation_config.pad_token_id = 0
    with torch.no_grad():
        theirs = hf.generate(torch.tensor(x), max_new_tokens=12, do_sample=False).numpy()
    np.testing.assert_array_equal(model.generate(x, 12, temperature=0), theirs)
    np.testing.assert_array_equal(model.generate(x, 12, temperature=0, use_cache=False), theirs)


def test_sampling_past_n_positions_gives_the_same_tokens_on_both_paths(models):
    _, model = models
    x = prompt((2, 28), seed=1)
    runs = [
        model.generate(x, 8, temperature=0.9, top_p=0.95, rng=np.random.default_rng(2), use_cache=c)
        for c in (True, False)
    ]
    np.testing.assert_array_equal(*runs)
    assert runs[0].shape == (2, 36)
