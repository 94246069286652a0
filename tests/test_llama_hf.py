"""``LlamaLM`` against transformers' Llama-family classes on tiny random models (issue 48).

Every model is built from transformers' own config classes (``LlamaConfig``,
``Qwen2Config``, ``Qwen3Config``, ``SmolLM3Config``, ``MistralConfig``) and saved with
``save_pretrained`` into a temporary folder: nothing is downloaded. Comparisons are
float32: logits 1e-5 absolute, gradients 1e-5 of each array's scale (plus 1e-8, float32's
noise on the tiny gradients of the qk-norm weights). The variants
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

from tiegrad import CheckpointError, ConfigError, EagerSession, models  # noqa: E402
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
    pad_token_id=0,  # embed_tokens' padding_idx: that row's input use has no gradient
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
    x[0, 3] = x[1, 7] = TINY["pad_token_id"]
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
        np.testing.assert_allclose(g, ref, rtol=0, atol=1e-5 * scale + 1e-8, err_msg=path)


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


@pytest.fixture(scope="module")
def tied_folder(tmp_path_factory):
    """The tied llama3 variant: its transformers model and folder."""
    folder = tmp_path_factory.mktemp("tied")
    model = hf_model("llama-tied-llama3")
    model.save_pretrained(folder)
    return model, folder


def _copy(folder: Path, to: Path, config_edit=None, tensors_edit=None) -> Path:
    """``folder``'s config.json and model.safetensors in ``to``, each edited (no torch)."""
    from safetensors.numpy import load_file, save_file

    config = json.loads((folder / "config.json").read_text())
    if config_edit is not None:
        config_edit(config)
    (to / "config.json").write_text(json.dumps(config))
    tensors = load_file(folder / "model.safetensors")
    if tensors_edit is not None:
        tensors_edit(tensors)
    save_file(tensors, to / "model.safetensors", {"format": "pt"})
    return to


def test_bfloat16_float16_and_sharded_folders(tied_folder, tmp_path):
    hf, _ = tied_folder
    x = ids()
    hf.save_pretrained(tmp_path / "sharded", max_shard_size="20KB")
    assert len(list((tmp_path / "sharded").glob("model-*.safetensors"))) > 1
    sharded = models.from_pretrained(tmp_path / "sharded")
    np.testing.assert_allclose(logits(sharded, x), hf_logits(hf, x), rtol=0, atol=1e-5)
    for dtype in (torch.bfloat16, torch.float16):
        half = hf_model("llama-tied-llama3").to(dtype)
        half.save_pretrained(tmp_path / str(dtype))
        model = models.from_pretrained(tmp_path / str(dtype))
        assert model.config["dtype"] == "float32"
        embedding = half.model.embed_tokens.weight.detach().float().numpy()
        loaded = model.get_parameter("model.embed_tokens.weight").value
        np.testing.assert_array_equal(loaded, embedding)
        np.testing.assert_allclose(logits(model, x), hf_logits(half.float(), x), rtol=0, atol=1e-5)


def test_both_rope_config_forms_load_alike(tied_folder, tmp_path):
    """transformers 4's rope_theta + rope_scaling reads as transformers 5's rope_parameters."""
    hf, folder = tied_folder

    def old_form(config):
        rope = config.pop("rope_parameters")
        config["rope_theta"] = rope.pop("rope_theta")
        config["rope_scaling"] = dict(rope, type=rope.pop("rope_type"))

    model = models.from_pretrained(_copy(folder, tmp_path, old_form))
    assert model.config["rope_parameters"] == dict(LLAMA3)
    x = ids()
    np.testing.assert_allclose(logits(model, x), hf_logits(hf, x), rtol=0, atol=1e-5)


def test_silent_config_takes_the_architectures_defaults(tmp_path):
    """SmolLM3 ties its head where config.json says nothing; Llama does not."""
    hf = hf_model("smollm3-tied-nope")
    hf.save_pretrained(tmp_path / "src")

    def silent(config):
        del config["tie_word_embeddings"]

    model = models.from_pretrained(_copy(tmp_path / "src", tmp_path, silent))
    assert model.aliases() == {"model.embed_tokens.weight": ["lm_head.weight"]}
    assert model.config["no_rope_layers"] == [1, 0]


def _refused(error, match, folder: Path) -> None:
    """Loading ``folder`` is one ``error`` matching ``match`` and writes nothing there."""
    before = {p.name: p.read_bytes() for p in folder.iterdir()}
    with pytest.raises(error, match=match):
        models.from_pretrained(folder)
    assert {p.name: p.read_bytes() for p in folder.iterdir()} == before


def test_a_tied_config_with_a_differing_head_is_refused(tied_folder, tmp_path):
    _, folder = tied_folder

    def equal_head(t):  # a file that writes the tied head out, as some exporters do
        t["lm_head.weight"] = t["model.embed_tokens.weight"].copy()

    equal = models.from_pretrained(_copy(folder, tmp_path, tensors_edit=equal_head))
    assert equal.aliases() == {"model.embed_tokens.weight": ["lm_head.weight"]}

    def differing_head(t):
        t["lm_head.weight"] = t["model.embed_tokens.weight"] + 1.0

    _copy(folder, tmp_path, tensors_edit=differing_head)
    _refused(
        CheckpointError, r"'lm_head\.weight' differs from 'model\.embed_tokens\.weight'", tmp_path
    )

    def untie(config):
        config["tie_word_embeddings"] = False

    untied = models.from_pretrained(_copy(tmp_path, tmp_path, untie))
    assert untied.aliases() == {}
    np.testing.assert_array_equal(
        untied.get_parameter("lm_head.weight").value,
        untied.get_parameter("model.embed_tokens.weight").value + 1.0,
    )


@pytest.mark.parametrize(
    "edit, match",
    [
        (dict(model_type="gemma"), r"model_type 'gemma' is not supported"),
        (dict(rope_parameters=dict(rope_type="yarn", factor=2.0)), r"rope_type 'yarn'"),
        (dict(sliding_window=16, model_type="mistral"), r"sliding_window=16 narrower"),
        (dict(hidden_act="gelu"), r"hidden_act 'gelu'"),
        (dict(rope_parameters=dict(LLAMA3, partial_rotary_factor=0.5)), "partial_rotary_factor"),
        (dict(num_key_value_heads=3), r"num_key_value_heads=3 must divide"),
    ],
    ids=["unknown-type", "rope-type", "sliding-window", "activation", "partial-rotary", "heads"],
)
def test_unsupported_configurations_are_one_config_error(tied_folder, tmp_path, edit, match):
    _, folder = tied_folder
    _copy(folder, tmp_path, lambda config: config.update(edit))
    _refused(ConfigError, match, tmp_path)


@pytest.mark.parametrize(
    "edit, match",
    [
        (
            dict(intermediate_size=48),
            r"'model\.layers\.0\.mlp\.gate_proj\.weight' has shape \(64, 32\)",
        ),
        (dict(num_hidden_layers=3), "num_hidden_layers=3 but the weights hold 2"),
        (dict(vocab_size=1000), "vocab_size=1000 but the weights hold 100"),
        (dict(vocab_size=50), r"'model\.embed_tokens\.weight' has shape \(100, 32\)"),
    ],
    ids=["width", "layers", "vocab", "smaller-vocab"],
)
def test_sizes_are_checked_against_the_tensors(tied_folder, tmp_path, edit, match):
    _, folder = tied_folder
    _copy(folder, tmp_path, lambda config: config.update(edit))
    _refused(CheckpointError, match, tmp_path)


def test_save_refuses_a_tie_transformers_cannot_express(tied_folder, tmp_path):
    from tiegrad.nn import tie

    _, folder = tied_folder
    model = LlamaLM.from_pretrained(folder)
    tie(model, "model.layers.1.input_layernorm.weight", "model.layers.0.input_layernorm.weight")
    with pytest.raises(CheckpointError, match="model.layers.1.input_layernorm.weight"):
        model.save_pretrained(tmp_path / "out")
    assert not (tmp_path / "out").exists()


def hf_greedy(hf, prompt, new: int, eos=None) -> np.ndarray:
    hf.generation_config.eos_token_id = eos
    hf.generation_config.pad_token_id = 0
    with torch.no_grad():
        out = hf.generate(torch.tensor(prompt), max_new_tokens=new, do_sample=False)
    return out.numpy()


def test_greedy_generation_equals_transformers(saved):
    """Token for token, with and without the KV cache, and stopping at an eos token."""
    name, hf, folder = saved
    model = LlamaLM.from_pretrained(folder)
    prompt = ids((2, 5), seed=7)
    cached = model.generate(prompt, 12, temperature=0)
    np.testing.assert_array_equal(cached, hf_greedy(hf, prompt, 12))
    np.testing.assert_array_equal(
        model.generate(prompt, 12, temperature=0, use_cache=False), cached
    )
    eos = int(cached[0, 8])  # row 0 ends by there; row 1 goes on until it meets it too
    stopped = model.generate(prompt, 12, temperature=0, eos_token_id=[eos], pad_token_id=0)
    np.testing.assert_array_equal(stopped, hf_greedy(hf, prompt, 12, eos=eos))
    first = 5 + int(np.argmax(cached[0, 5:] == eos))  # where row 0 first produced it
    assert stopped[0, first] == eos and (stopped[0, first + 1 :] == 0).all()


def test_cached_sampling_and_long_generation_match_the_uncached_path(tied_folder):
    """Past max_position_embeddings (64) both restart from the last 64 tokens."""
    _, folder = tied_folder
    model = LlamaLM.from_pretrained(folder)
    prompt = ids((2, 58), seed=8)
    options = dict(temperature=0.8, top_k=50, top_p=0.9)
    runs = [
        model.generate(prompt, 10, rng=np.random.default_rng(3), use_cache=c, **options)
        for c in (True, False)
    ]
    np.testing.assert_array_equal(*runs)
    assert runs[0].shape == (2, 68)


def test_top_p_keeps_the_fewest_likeliest_tokens():
    from tiegrad.models._causal_lm import _sample

    logits = np.log(np.array([[0.5, 0.3, 0.15, 0.05]]))
    rng = np.random.default_rng(0)
    drawn = {int(_sample(logits, 1.0, None, 0.75, rng)[0, 0]) for _ in range(300)}
    assert drawn == {0, 1}  # 0.5 < 0.75 <= 0.5 + 0.3
    drawn = {int(_sample(logits, 1.0, None, 0.45, rng)[0, 0]) for _ in range(50)}
    assert drawn == {0}


@pytest.mark.parametrize(
    "option, match",
    [
        (dict(top_p=0), "top_p must be in"),
        (dict(top_p=1.5), "top_p must be in"),
        (dict(eos_token_id=VOCAB), r"eos_token_id\[0\] must be in \[0, 100\)"),
        (dict(eos_token_id=2.0), "eos_token_id must be a token id"),
        (dict(eos_token_id=2, pad_token_id=-1), "pad_token_id must be >= 0"),
    ],
)
def test_generation_options_are_checked(tied_folder, option, match):
    from tiegrad import HyperparameterError

    _, folder = tied_folder
    model = LlamaLM.from_pretrained(folder)
    with pytest.raises(HyperparameterError, match=match):
        model.generate(ids((1, 3)), 2, **option)


@pytest.fixture(scope="module")
def tokenizer_folder(tmp_path_factory):
    """A byte-level BPE tokenizer trained here, with Llama-style special tokens in
    tokenizer_config.json (bos, eos) and special_tokens_map.json (pad)."""
    tokenizers = pytest.importorskip("tokenizers")
    folder = tmp_path_factory.mktemp("tokenizer")
    tok = tokenizers.Tokenizer(tokenizers.models.BPE())
    tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = tokenizers.decoders.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(
        vocab_size=VOCAB,
        special_tokens=["<pad>", "<s>", "</s>"],
        initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(["tied weights are one storage"] * 20, trainer)
    tok.save(str(folder / "tokenizer.json"))
    pad = {"content": "<pad>", "lstrip": False, "rstrip": False, "special": True}
    config = {"bos_token": "<s>", "eos_token": "</s>", "tokenizer_class": "PreTrainedTokenizerFast"}
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    (folder / "special_tokens_map.json").write_text(json.dumps({"pad_token": pad}))
    return folder


def test_tokenizer_special_tokens_as_transformers_reads_them(tokenizer_folder):
    from tiegrad.data.tokenizer import HFTokenizer

    ours = HFTokenizer.from_directory(tokenizer_folder)
    theirs = transformers.AutoTokenizer.from_pretrained(tokenizer_folder)
    assert ours.special_tokens == {"bos_token": "<s>", "eos_token": "</s>", "pad_token": "<pad>"}
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        assert getattr(ours, key) == getattr(theirs, key), key
    text = "one storage, tied"
    assert ours.encode(text).tolist() == theirs.encode(text, add_special_tokens=False)
    assert ours.decode(ours.encode(text)) == text


@pytest.mark.parametrize(
    "name, content, match",
    [
        ("tokenizer_config.json", {"eos_token": "<eot>"}, r"eos_token '<eot>' is not in the"),
        ("special_tokens_map.json", {"bos_token": 7}, "bos_token must be a token's text"),
        ("tokenizer_config.json", ["<s>"], "holds a JSON list, expected an object"),
    ],
    ids=["unknown-token", "wrong-form", "not-an-object"],
)
def test_bad_special_tokens_are_refused(tokenizer_folder, tmp_path, name, content, match):
    from tiegrad.data.tokenizer import HFTokenizer

    for path in tokenizer_folder.iterdir():
        (tmp_path / path.name).write_bytes(path.read_bytes())
    (tmp_path / name).write_text(json.dumps(content))
    with pytest.raises(ConfigError, match=f"{name}:? {match}"):
        HFTokenizer.from_directory(tmp_path)


def test_freezing_one_use_of_the_tied_embedding_trains_the_other(tied_folder):
    """Per-use trainability (C4, C5): the two uses' gradients add up to the tie's."""
    _, folder = tied_folder
    model = LlamaLM.from_pretrained(folder)
    x, y = ids(seed=5), ids(seed=6)

    def embedding_gradient():
        s = EagerSession()
        return model.named_gradients(s.backward(model.loss(s, x, y)))["model.embed_tokens.weight"]

    both = embedding_gradient()
    model.freeze("model.embed_tokens.weight")
    head_use = embedding_gradient()
    model.unfreeze("model.embed_tokens.weight")
    model.freeze("lm_head.weight")
    input_use = embedding_gradient()
    assert not np.allclose(head_use, both) and not np.allclose(input_use, both)
    np.testing.assert_allclose(head_use + input_use, both, rtol=0, atol=1e-6)


def test_a_tiegrad_checkpoint_rebuilds_from_config_with_the_tie(tied_folder, tmp_path):
    """``type(m)(**m.config)`` builds the same layout; the checkpoint restores values
    and the tie (C9)."""
    import tiegrad

    _, folder = tied_folder
    model = LlamaLM.from_pretrained(folder)
    tiegrad.save(tmp_path / "ckpt.safetensors", model)
    fresh = LlamaLM(**model.config)
    assert fresh.aliases() == model.aliases()
    tiegrad.load(tmp_path / "ckpt.safetensors", fresh)
    x = ids()
    np.testing.assert_array_equal(logits(fresh, x), logits(model, x))


def test_from_pretrained_picks_gpt2_by_model_type(tmp_path):
    from tiegrad.models import GPT2

    GPT2(n_layer=1, n_head=2, n_embd=16, vocab_size=50, n_positions=16).save_pretrained(tmp_path)
    model = models.from_pretrained(tmp_path)
    assert type(model) is GPT2
    assert model.aliases() == {"transformer.wte.weight": ["lm_head.weight"]}


def test_the_torch_backend_computes_what_the_host_does(tied_folder):
    """Logits and gradients on ``torch:cpu`` (the device code path) equal the host's."""
    _, folder = tied_folder
    model = LlamaLM.from_pretrained(folder)
    x, y = ids(seed=1), ids(seed=2)
    x[0, 3] = TINY["pad_token_id"]

    def run(device):
        s = EagerSession(device=device)
        out = model(s, x).numpy()
        return out, model.named_gradients(s.backward(model.loss(s, x, y)))

    host, host_grads = run(None)
    model.to("torch:cpu")
    device, device_grads = run("torch:cpu")
    np.testing.assert_allclose(device, host, rtol=0, atol=1e-5)
    for path, g in host_grads.items():
        scale = float(np.abs(g).max())
        np.testing.assert_allclose(
            np.asarray(device_grads[path]), g, rtol=0, atol=1e-5 * scale + 1e-8, err_msg=path
        )


def test_a_cache_continues_the_sequence_it_holds(tied_folder):
    from tiegrad import ShapeError

    _, folder = tied_folder
    model = LlamaLM.from_pretrained(folder)
    cache = model.new_cache()
    tokens = ids((2, 9))
    model(EagerSession(), tokens[:, :6], cache=cache)
    assert cache.length == 6
    with pytest.raises(ShapeError, match="a cache of 6 positions cannot take 59 more tokens"):
        model(EagerSession(), ids((2, 59)), cache=cache)
    assert cache.length == 6
    more = model(EagerSession(), tokens[:, 6:], cache=cache).numpy()  # three at once
    np.testing.assert_allclose(more, logits(model, tokens)[:, 6:], rtol=0, atol=1e-5)
    assert cache.length == 9


def test_non_finite_weights_are_refused_unless_allowed(tied_folder, tmp_path):
    _, folder = tied_folder

    def poisoned(t):
        t["model.layers.1.mlp.up_proj.weight"][3, 4] = np.nan

    _copy(folder, tmp_path, tensors_edit=poisoned)
    _refused(
        CheckpointError,
        r"tensor 'model\.layers\.1\.mlp\.up_proj\.weight' holds 1 non-finite",
        tmp_path,
    )
    model = models.from_pretrained(tmp_path, allow_nonfinite=True)
    assert np.isnan(model.get_parameter("model.layers.1.mlp.up_proj.weight").value[3, 4])


@pytest.mark.parametrize("layers", [10**6, 10**30])
def test_a_config_of_absurd_size_is_refused_by_arithmetic(tied_folder, tmp_path, layers):
    """No layout of a million layers is built: the count of layers the tensors hold
    refuses it at once (C6)."""
    _, folder = tied_folder
    _copy(folder, tmp_path, lambda config: config.update(num_hidden_layers=layers))
    _refused(CheckpointError, f"num_hidden_layers={layers} but the weights hold 2", tmp_path)


def test_missing_tensors_are_named_a_few_at_a_time(tied_folder, tmp_path):
    _, folder = tied_folder

    def drop_layer_1(t):
        for name in [n for n in t if n.startswith("model.layers.1.") and "layernorm" not in n]:
            del t[name]

    _copy(folder, tmp_path, tensors_edit=drop_layer_1)
    _refused(
        CheckpointError,
        r"missing 'model\.layers\.1\.self_attn\.q_proj\.weight', .* and 4 more;",
        tmp_path,
    )
