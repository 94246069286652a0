"""``GPT2`` against transformers' ``GPT2LMHeadModel`` on tiny random models (issue 18).

Every model is built from a config and saved with ``save_pretrained`` into a temporary
folder: nothing is downloaded (``HF_HUB_OFFLINE=1``). Comparisons are float32 with
stated tolerances: logits 1e-5 absolute, gradients 1e-5 of each array's scale,
parameters after 20 AdamW steps 1e-4.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

os.environ["HF_HUB_OFFLINE"] = "1"
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from tiegrad import CheckpointError, EagerSession  # noqa: E402
from tiegrad.errors import shown_list  # noqa: E402
from tiegrad.models import GPT2  # noqa: E402
from tiegrad.optim import AdamW  # noqa: E402

TINY = dict(n_layer=2, n_head=2, n_embd=32, vocab_size=100, n_positions=64)
NO_DROPOUT = dict(resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)


def hf_model(seed: int = 0, **overrides):
    torch.manual_seed(seed)
    config = transformers.GPT2Config(**TINY, **NO_DROPOUT, bos_token_id=0, eos_token_id=0)
    for k, v in overrides.items():
        setattr(config, k, v)
    return transformers.GPT2LMHeadModel(config).eval()


def ids(shape=(3, 17), seed=0):
    return np.random.default_rng(seed).integers(0, TINY["vocab_size"], shape)


def hf_logits(model, x) -> np.ndarray:
    with torch.no_grad():
        return model(torch.tensor(x)).logits.numpy()


def hf_loss(model, x, y):
    out = model(torch.tensor(x)).logits
    return torch.nn.functional.cross_entropy(out.flatten(0, 1), torch.tensor(y).flatten())


def logits(model: GPT2, x) -> np.ndarray:
    return model(EagerSession(), x).numpy()


def values(model: GPT2) -> dict[str, np.ndarray]:
    return {p: h.value.copy() for p, h in model.named_slots()}


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A tied tiny model and its save_pretrained folder."""
    folder = tmp_path_factory.mktemp("gpt2")
    model = hf_model()
    model.save_pretrained(folder)
    return model, folder


def test_logits_equal_transformers(saved):
    hf, folder = saved
    model = GPT2.from_pretrained(folder)
    assert model.aliases() == {"transformer.wte.weight": ["lm_head.weight"]}
    hf_paths = [p for p, _ in hf.named_parameters(remove_duplicate=False)]
    assert [p for p, _ in model.named_slots()] == hf_paths
    x = ids()
    np.testing.assert_allclose(logits(model, x), hf_logits(hf, x), rtol=0, atol=1e-5)


def test_gradients_equal_autograd(saved):
    hf, folder = saved
    model = GPT2.from_pretrained(folder)
    x, y = ids(seed=1), ids(seed=2)
    s = EagerSession()
    grads = model.named_gradients(s.backward(model.loss(s, x, y)))
    hf.zero_grad()
    hf_loss(hf, x, y).backward()
    theirs = dict(hf.named_parameters())  # the tied pair once: its .grad sums both uses
    assert set(grads) == set(theirs)
    for path, g in grads.items():
        ref = theirs[path].grad.numpy()
        scale = float(np.abs(ref).max())
        np.testing.assert_allclose(g, ref, rtol=0, atol=1e-5 * scale, err_msg=path)


def test_adamw_steps_track_pytorch(saved):
    hf, folder = saved
    model = GPT2.from_pretrained(folder)
    hf = hf_model()  # a fresh copy of the same weights
    opt = AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
    topt = torch.optim.AdamW(hf.parameters(), lr=1e-3, weight_decay=0.01)
    for step in range(20):
        x, y = ids((2, 16), seed=10 + step), ids((2, 16), seed=50 + step)
        s = EagerSession()
        opt.step(s.backward(model.loss(s, x, y)))
        topt.zero_grad()
        hf_loss(hf, x, y).backward()
        topt.step()
    theirs = dict(hf.named_parameters(remove_duplicate=False))
    for path, value in values(model).items():
        np.testing.assert_allclose(
            value, theirs[path].detach().numpy(), rtol=0, atol=1e-4, err_msg=path
        )


def test_export_reloads_in_transformers(saved, tmp_path):
    hf, folder = saved
    model = GPT2.from_pretrained(folder)
    s = EagerSession()
    AdamW(model.parameters(), lr=1e-2).step(s.backward(model.loss(s, ids(), ids(seed=3))))
    model.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["architectures"] == ["GPT2LMHeadModel"] and config["bos_token_id"] == 0
    back, info = transformers.GPT2LMHeadModel.from_pretrained(tmp_path, output_loading_info=True)
    assert all(not v for v in info.values()), info  # no missing or unexpected keys
    assert back.lm_head.weight is back.transformer.wte.weight
    x = ids(seed=4)
    np.testing.assert_allclose(hf_logits(back.eval(), x), logits(model, x), rtol=0, atol=1e-5)
    assert not np.allclose(hf_logits(hf, x), logits(model, x), atol=1e-3)


def test_freezing_the_input_use_trains_the_head_use(saved):
    _, folder = saved
    model = GPT2.from_pretrained(folder)
    x, y = ids(seed=5), ids(seed=6)

    def embedding_gradient():
        s = EagerSession()
        return model.named_gradients(s.backward(model.loss(s, x, y)))["transformer.wte.weight"]

    both = embedding_gradient()
    assert model.freeze("transformer.wte.weight") == ["transformer.wte.weight"]
    head_use = embedding_gradient()
    model.unfreeze("transformer.wte.weight")
    model.freeze("lm_head.weight")
    input_use = embedding_gradient()
    assert not np.allclose(head_use, both) and not np.allclose(input_use, both)
    np.testing.assert_allclose(head_use + input_use, both, rtol=0, atol=1e-6)
    model.unfreeze("lm_head.weight")
    model.freeze("transformer.wte.weight")
    before = model.get_parameter("transformer.wte.weight").value.copy()
    s = EagerSession()
    AdamW(model.parameters(), lr=1e-2).step(s.backward(model.loss(s, x, y)))
    after = model.get_parameter("lm_head.weight").value
    assert model.get_parameter("transformer.wte.weight").value is after
    assert not np.array_equal(after, before)  # the head use trained the tied storage


def test_untied_model(tmp_path):
    hf = hf_model(seed=1, tie_word_embeddings=False)
    hf.save_pretrained(tmp_path)
    model = GPT2.from_pretrained(tmp_path)
    assert model.aliases() == {} and model.config["tie_word_embeddings"] is False
    x = ids()
    np.testing.assert_allclose(logits(model, x), hf_logits(hf, x), rtol=0, atol=1e-5)
    out = tmp_path / "out"
    model.save_pretrained(out)
    back = transformers.GPT2LMHeadModel.from_pretrained(out).eval()
    assert back.lm_head.weight is not back.transformer.wte.weight
    np.testing.assert_allclose(hf_logits(back, x), logits(model, x), rtol=0, atol=1e-5)


def _rewrite(folder: Path, edit) -> None:
    """Rewrite model.safetensors with ``edit(tensors)`` applied (no torch involved)."""
    from safetensors.numpy import load_file, save_file

    path = folder / "model.safetensors"
    tensors = load_file(path)
    edit(tensors)
    save_file(tensors, path, {"format": "pt"})


def test_file_with_equal_head_ties_and_unprefixed_names(saved, tmp_path):
    hf, folder = saved
    for name in ("config.json", "model.safetensors"):
        (tmp_path / name).write_bytes((folder / name).read_bytes())

    def hub_style(t):
        for k in list(t):
            t[k.removeprefix("transformer.")] = t.pop(k)
        t["lm_head.weight"] = t["wte.weight"].copy()
        t["h.0.attn.bias"] = np.tril(np.ones((1, 1, 64, 64), np.float32))

    _rewrite(tmp_path, hub_style)
    model = GPT2.from_pretrained(tmp_path)
    assert model.aliases() == {"transformer.wte.weight": ["lm_head.weight"]}
    x = ids()
    np.testing.assert_allclose(logits(model, x), hf_logits(hf, x), rtol=0, atol=1e-5)

    def differing_head(t):
        t["lm_head.weight"] = t["wte.weight"] + 1.0

    _rewrite(tmp_path, differing_head)
    with pytest.raises(CheckpointError, match="differs from 'transformer.wte.weight'"):
        GPT2.from_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(dict(config, tie_word_embeddings=False)))
    untied = GPT2.from_pretrained(tmp_path)
    assert untied.aliases() == {}
    np.testing.assert_array_equal(
        untied.get_parameter("lm_head.weight").value,
        untied.get_parameter("transformer.wte.weight").value + 1.0,
    )


def test_sharded_save(saved, tmp_path):
    hf, _ = saved
    hf.save_pretrained(tmp_path, max_shard_size="20KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    assert len(list(tmp_path.glob("model-*.safetensors"))) > 1
    model = GPT2.from_pretrained(tmp_path)
    x = ids()
    np.testing.assert_allclose(logits(model, x), hf_logits(hf, x), rtol=0, atol=1e-5)


@pytest.mark.parametrize("defect", ["missing", "extra", "shape"])
def test_bad_files_change_nothing(saved, tmp_path, defect):
    hf, folder = saved
    for name in ("config.json", "model.safetensors"):
        (tmp_path / name).write_bytes((folder / name).read_bytes())

    def edit(t):
        if defect == "missing":
            del t["transformer.h.1.mlp.c_fc.weight"]
        elif defect == "extra":
            t["transformer.h.2.ln_1.weight"] = np.ones(32, np.float32)
        else:
            t["transformer.h.0.ln_1.bias"] = np.zeros(33, np.float32)
        t["transformer.h.0.ln_1.weight"] = t["transformer.h.0.ln_1.weight"] + 5.0

    _rewrite(tmp_path, edit)
    model = GPT2(**TINY, **NO_DROPOUT, seed=3)
    before = values(model)
    expected = {
        "missing": r"missing 'transformer.h.1.mlp.c_fc.weight'; unexpected none",
        "extra": r"missing none; unexpected 'transformer.h.2.ln_1.weight'",
        "shape": r"'transformer.h.0.ln_1.bias' has shape \(33,\)",
    }[defect]
    with pytest.raises(CheckpointError, match=expected):
        model.load_pretrained(tmp_path)
    for path, value in values(model).items():
        np.testing.assert_array_equal(value, before[path], err_msg=path)
    with pytest.raises(CheckpointError, match=expected):
        GPT2.from_pretrained(tmp_path)


@pytest.mark.parametrize(
    "defect, missing, unexpected",
    [
        ("missing", ["transformer.h.1.mlp.c_fc.weight"], []),
        ("unexpected", [], ["transformer.h.0.attn.c_attn.scale"]),
        ("renamed", ["transformer.h.0.ln_2.bias"], ["transformer.h.0.ln_2.beta"]),
    ],
)
def test_from_pretrained_names_missing_and_unexpected_tensors_before_counting(
    saved, tmp_path, defect, missing, unexpected
):  # C6: the names come first; the element count is for what names cannot explain
    _, folder = saved
    for name in ("config.json", "model.safetensors"):
        (tmp_path / name).write_bytes((folder / name).read_bytes())

    def edit(t):
        for name in missing:
            value = t.pop(name)
        for name in unexpected:
            t[name] = value if missing else np.ones(3, np.float32)

    _rewrite(tmp_path, edit)
    with pytest.raises(CheckpointError) as err:
        GPT2.from_pretrained(tmp_path)
    message = str(err.value)
    assert f"missing {shown_list(missing)}; unexpected {shown_list(unexpected)}" in message
    assert "the GPT2 of its config.json" in message and "elements" not in message


def test_from_pretrained_counts_elements_where_every_name_is_there(saved, tmp_path):  # C6
    _, folder = saved
    for name in ("config.json", "model.safetensors"):
        (tmp_path / name).write_bytes((folder / name).read_bytes())

    def narrow_second_block(t):  # the sizes the first block shows match the config
        t["transformer.h.1.mlp.c_fc.weight"] = np.zeros((32, 1), np.float32)

    _rewrite(tmp_path, narrow_second_block)
    with pytest.raises(CheckpointError, match=r"describes a model of \d+ elements.*other shapes"):
        GPT2.from_pretrained(tmp_path)


def test_from_pretrained_checks_the_sizes_of_config_json_against_the_tensors(saved, tmp_path):
    _, folder = saved
    (tmp_path / "model.safetensors").write_bytes((folder / "model.safetensors").read_bytes())
    config = json.loads((folder / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(dict(config, n_embd=64)))
    with pytest.raises(CheckpointError) as err:  # C6: before any layout or array
        GPT2.from_pretrained(tmp_path)
    assert "config.json: n_embd=64 but the weights hold 32; n_inner=256" in str(err.value)


def test_attention_dropout_path_matches_fused_in_eval_and_trains():
    model = GPT2(**TINY, attn_pdrop=0.5, resid_pdrop=0.0, embd_pdrop=0.0, seed=1)
    x = ids()
    model.eval()
    fused = logits(model, x)
    model.train()
    for block in model.transformer.h:
        block.attn.attn_pdrop = 1e-12  # the unfused path with (practically) no dropout
    np.testing.assert_allclose(logits(model, x), fused, rtol=0, atol=1e-5)
    for block in model.transformer.h:
        block.attn.attn_pdrop = 0.5
    s = EagerSession(seed=0)
    loss = model.loss(s, x, ids(seed=1))
    assert np.isfinite(loss.numpy())
    assert not np.allclose(model(EagerSession(seed=0), x).numpy(), fused)


def test_from_pretrained_imports_neither_torch_nor_transformers(saved):
    _, folder = saved
    code = (
        "import sys\n"
        "from tiegrad.models import GPT2\n"
        f"m = GPT2.from_pretrained({str(folder)!r})\n"
        "import numpy as np\n"
        "from tiegrad import EagerSession\n"
        "m(EagerSession(), np.zeros((1, 4), dtype=np.int64))\n"
        "bad = [k for k in ('torch', 'transformers') if k in sys.modules]\n"
        "assert not bad, bad\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr


def test_readme_section_runs_and_prints_what_it_shows(tmp_path, monkeypatch):
    from readme_sections import run_example, section_text

    monkeypatch.chdir(tmp_path)
    printed, shown = run_example(section_text("## Fine-tune a Hugging Face GPT-2"), "readme_hf")
    assert printed == shown
    assert (tmp_path / "gpt2-tuned" / "model.safetensors").is_file()


def test_greedy_generate_follows_transformers(saved):
    hf, folder = saved
    model = GPT2.from_pretrained(folder)
    prompt = ids((2, 5), seed=8)
    ours = model.generate(prompt, 6, temperature=0)
    theirs = prompt
    for _ in range(6):
        nxt = hf_logits(hf, theirs)[:, -1].argmax(-1)[:, None]
        theirs = np.concatenate([theirs, nxt], axis=1)
    np.testing.assert_array_equal(ours, theirs)


def test_a_model_built_here_saves_for_transformers(tmp_path):
    model = GPT2(**TINY, **NO_DROPOUT, n_inner=48, seed=4)
    rebuilt = type(model)(**model.config)
    np.testing.assert_array_equal(
        rebuilt.get_parameter("transformer.h.1.mlp.c_fc.weight").value,
        model.get_parameter("transformer.h.1.mlp.c_fc.weight").value,
    )
    model.save_pretrained(tmp_path)
    hf, info = transformers.GPT2LMHeadModel.from_pretrained(tmp_path, output_loading_info=True)
    assert all(not v for v in info.values()), info
    x = ids()
    np.testing.assert_allclose(hf_logits(hf.eval(), x), logits(model, x), rtol=0, atol=1e-5)


@pytest.mark.parametrize(
    "key, value, message",
    [
        ("n_layer", "2", "n_layer must be an integer"),
        ("attn_pdrop", 1.0, r"attn_pdrop must be in \[0, 1\)"),
        ("activation_function", "swish", "activation_function 'swish' is not supported"),
        ("add_cross_attention", True, "add_cross_attention=True is not supported"),
        ("model_type", "llama", "model_type 'llama', expected 'gpt2'"),
    ],
)
def test_bad_config_is_named(saved, tmp_path, key, value, message):
    from tiegrad import ConfigError, TiegradError

    _, folder = saved
    config = json.loads((folder / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(dict(config, **{key: value})))
    (tmp_path / "model.safetensors").write_bytes((folder / "model.safetensors").read_bytes())
    with pytest.raises(TiegradError, match=message) as info:
        GPT2.from_pretrained(tmp_path)
    assert isinstance(info.value, (ConfigError, CheckpointError))


C_ATTN = "transformer.h.{}.attn.c_attn.weight"


def test_a_tie_transformers_cannot_express_is_refused_before_writing(tmp_path):  # C9, C6
    from tiegrad.nn import tie

    model = GPT2(**TINY)
    tie(model, C_ATTN.format(1), C_ATTN.format(0))
    with pytest.raises(CheckpointError, match=r"ties 'transformer\.h\.0\.attn\.c_attn"):
        model.save_pretrained(tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_loading_two_different_tensors_into_one_storage_is_refused(saved):  # C9, C6
    from tiegrad.nn import tie

    _, folder = saved
    model = GPT2(**TINY, seed=2)
    tie(model, C_ATTN.format(1), C_ATTN.format(0))
    before = values(model)
    with pytest.raises(CheckpointError, match=r"'transformer\.h\.1\.attn\.c_attn\.weight' differs"):
        model.load_pretrained(folder)
    after = values(model)
    assert all(np.array_equal(before[p], after[p]) for p in before)


def test_a_bfloat16_directory_imports_exactly_widened(tmp_path):
    hf = hf_model().to(torch.bfloat16)
    hf.save_pretrained(tmp_path)
    model = GPT2.from_pretrained(tmp_path)
    assert model.config["dtype"] == "float32"
    wte = hf.transformer.wte.weight.detach().float().numpy()
    np.testing.assert_array_equal(model.get_parameter("transformer.wte.weight").value, wte)
    x = ids()
    np.testing.assert_allclose(logits(model, x), hf_logits(hf.float(), x), rtol=0, atol=1e-5)
