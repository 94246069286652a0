"""The reference models read unusual but valid arguments as their values, and refuse a
directory whose configuration its weights cannot fill before building anything (C6)."""

from __future__ import annotations

import json
from fractions import Fraction

import numpy as np
import pytest

from tiegrad import CheckpointError, EagerSession
from tiegrad.models import GPT2, TiedLM

TINY = dict(n_layer=1, n_head=2, n_embd=8, vocab_size=20, n_positions=16)


def test_numpy_scalars_and_fractions_are_saved_as_python_numbers(tmp_path):
    model = GPT2(
        **dict(TINY, vocab_size=np.int64(30)),
        attn_pdrop=np.float32(0.25),
        embd_pdrop=Fraction(1, 10),
    )
    assert model.config["vocab_size"] == 30 and type(model.config["vocab_size"]) is int
    assert model.config["attn_pdrop"] == 0.25 and model.config["embd_pdrop"] == 0.1
    json.dumps(model.config)
    model.save_pretrained(tmp_path)
    again = GPT2.from_pretrained(tmp_path)
    assert again.config == model.config
    for (path, a), (_, b) in zip(model.named_slots(), again.named_slots()):
        np.testing.assert_array_equal(a.value, b.value, err_msg=path)


def test_a_config_larger_than_its_weights_is_refused_before_building(tmp_path):
    GPT2(**TINY).save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config["vocab_size"] = 10**12  # 10**12 * 8 float32: no machine could build it
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=r"config.json: vocab_size=10+ but the weights hold"):
        GPT2.from_pretrained(tmp_path)


@pytest.mark.parametrize("extra", [{}, {"n_inner": 12, "tie_word_embeddings": False}])
def test_gpt2_layout_is_the_built_model(extra):  # C5: the paths from_pretrained checks
    model = GPT2(**TINY, **extra)
    layout = GPT2.layout(GPT2.check_config(model.config))
    assert layout == [(path, p.shape) for path, p in model.named_slots()]


def test_float16_attention_dropout_keeps_float16():
    model = GPT2(**TINY, attn_pdrop=0.1, dtype="float16")
    model.train()
    x = np.random.default_rng(0).integers(0, 20, (2, 5))
    assert model(EagerSession(), x).value.dtype == np.float16


def test_generate_takes_unsigned_ids_and_returns_int64():
    model = TiedLM(vocab_size=12, d_model=8, n_heads=2, n_layers=1, max_seq_len=8)
    prompt = np.array([1, 2], np.uint64)
    out = model.generate(prompt, 3, temperature=0)
    assert out.dtype == np.int64
    np.testing.assert_array_equal(out, model.generate(prompt.astype(np.int64), 3, temperature=0))


def test_a_tiny_temperature_samples_the_greedy_token():
    model = TiedLM(vocab_size=12, d_model=8, n_heads=2, n_layers=1, max_seq_len=8, seed=3)
    prompt = np.array([[3, 5], [7, 1]])
    greedy = model.generate(prompt, 5, temperature=0)
    np.testing.assert_array_equal(model.generate(prompt, 5, temperature=1e-310), greedy)
