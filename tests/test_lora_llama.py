"""LoRA on the Llama family against transformers + PEFT (issue 49, items 1-3).

Tiny random tied Llama-, Qwen2- and Qwen3-style models made by transformers' config
classes and saved with ``save_pretrained`` (``test_llama_hf``'s variants); PEFT's
``get_peft_model`` with ``init_lora_weights=False`` so its adapters are not zero;
nothing is downloaded. Float32 tolerances: logits 1e-5, adapter weights after 20 AdamW
steps 1e-4. The input use of a tied embedding whose head alone was adapted is compared
bit for bit, after training, after the merge and after transformers' reload.
"""

from __future__ import annotations

import json
import os
import warnings

import numpy as np
import pytest
from test_llama_hf import hf_model, ids

os.environ["HF_HUB_OFFLINE"] = "1"
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

from tiegrad import CheckpointError, EagerSession  # noqa: E402
from tiegrad.adapters import add_lora, merge, unload, untied_by_merge  # noqa: E402
from tiegrad.adapters.layers import LoRAPaddedEmbedding  # noqa: E402
from tiegrad.checkpoint.fileio import read_safetensors, write_safetensors  # noqa: E402
from tiegrad.interop.peft import load_adapter, save_adapter  # noqa: E402
from tiegrad.models import LlamaLM  # noqa: E402
from tiegrad.optim import AdamW  # noqa: E402

PROJ = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
EMBED, HEAD = "model.embed_tokens.weight", "lm_head.weight"
TIED = ["llama-tied-llama3", "qwen2-tied", "qwen3-tied-headdim"]


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """``{variant: save_pretrained folder}`` of the tied variants."""
    out = {}
    for name in TIED:
        out[name] = tmp_path_factory.mktemp(name)
        hf_model(name).save_pretrained(out[name])
    return out


def hf_base(folder):
    return transformers.AutoModelForCausalLM.from_pretrained(
        folder, attn_implementation="eager"
    ).eval()


def peft_model(folder, targets, rank=4, alpha=8, **extra):
    config = peft.LoraConfig(
        r=rank, lora_alpha=alpha, target_modules=targets, init_lora_weights=False, **extra
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the tied-layer notice
        pm = peft.get_peft_model(hf_base(folder), config)
    with torch.no_grad():  # PEFT's random factors, scaled to keep the logits near 1
        for name, p in pm.named_parameters():
            if "lora_" in name:
                p.mul_(0.3)
    return pm


def peft_save(pm, folder):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the save_embedding_layers notice
        pm.save_pretrained(folder)


def logits(model, x) -> np.ndarray:
    return model(EagerSession(), x).numpy()


def torch_logits(model, x) -> np.ndarray:
    with torch.no_grad():
        return model(torch.tensor(x)).logits.numpy()


def randomize_adapters(model, seed=1, scale=0.3):
    rng = np.random.default_rng(seed)
    for path, p in model.named_parameters():
        if ".lora." in path:
            p.set_value(rng.normal(0.0, scale, p.shape).astype(p.dtype))


def slots(model) -> dict[str, np.ndarray]:
    return {p: h.value.copy() for p, h in model.named_slots()}


def file_tensors(folder) -> dict[str, np.ndarray]:
    file = read_safetensors(os.fspath(folder / "adapter_model.safetensors"))
    return {name: file.array(name) for name in file.tensors}


# -- item 1: LoRA on the family ---------------------------------------------------------------
def test_every_projection_and_each_use_of_the_tie_takes_an_adapter(folders):
    model = LlamaLM.from_pretrained(folders["qwen2-tied"])
    paths = add_lora(model, [*PROJ, "lm_head", "embed_tokens"], rank=2)
    ends = tuple(f".{t}.weight" for t in [*PROJ, "lm_head", "embed_tokens"])
    assert paths == [p for p, _ in model.named_slots() if f".{p}".endswith(ends)]
    assert {EMBED, HEAD} <= set(paths) and len(paths) == 2 * 7 + 2
    assert isinstance(model.model.embed_tokens, LoRAPaddedEmbedding)
    assert model.lm_head.weight.storage is model.model.embed_tokens.weight.storage
    trainable = {p for p, h in model.named_slots() if h.requires_grad}
    assert trainable and all(".lora." in p for p in trainable)
    assert model.model.embed_tokens.lora.default is not model.lm_head.lora.default


def test_share_tied_gives_both_uses_of_the_embedding_one_adapter(folders):
    model = LlamaLM.from_pretrained(folders["llama-tied-llama3"])
    assert add_lora(model, "lm_head", rank=2, share_tied=True) == [EMBED, HEAD]
    assert model.model.embed_tokens.lora.default is model.lm_head.lora.default


def test_the_embedding_adapters_gradient_equals_peft_padding_row_included(folders, tmp_path):
    folder = folders["qwen2-tied"]  # pad_token_id 0: PEFT looks A up with padding_idx too
    pm = peft_model(folder, ["embed_tokens"])
    peft_save(pm, tmp_path)
    model = LlamaLM.from_pretrained(folder)
    load_adapter(model, tmp_path)
    x, y = np.array([[0, 5, 0, 7]]), np.array([[5, 0, 7, 3]])
    s = EagerSession()
    grads = model.named_gradients(s.backward(model.loss(s, x, y)))
    out = pm(torch.tensor(x)).logits
    torch.nn.functional.cross_entropy(out.flatten(0, 1), torch.tensor(y).flatten()).backward()
    lora = pm.base_model.model.model.embed_tokens
    for ours, theirs in (("A", lora.lora_embedding_A), ("B", lora.lora_embedding_B)):
        g, ref = grads[f"model.embed_tokens.lora.default.{ours}"], theirs["default"].grad.numpy()
        np.testing.assert_allclose(g, ref, rtol=0, atol=1e-5 * float(np.abs(ref).max()))
    a = grads["model.embed_tokens.lora.default.A"]
    assert not a[:, 0].any() and a[:, 5].any()


# -- item 2: PEFT's files both ways -----------------------------------------------------------
@pytest.mark.parametrize(
    "variant, targets, extra",
    [
        *((v, PROJ, {}) for v in TIED),
        ("qwen2-tied", ["lm_head"], {}),
        ("qwen2-tied", ["embed_tokens"], {}),
        ("qwen2-tied", [*PROJ, "lm_head"], {"ensure_weight_tying": True}),
        ("llama-tied-llama3", ["q_proj", "v_proj"], {"use_rslora": True}),
    ],
)
def test_tiegrad_loads_what_peft_saves(folders, tmp_path, variant, targets, extra):
    pm = peft_model(folders[variant], targets, **extra)
    peft_save(pm, tmp_path)
    model = LlamaLM.from_pretrained(folders[variant])
    embed = model.model.embed_tokens.weight.value.copy()
    load_adapter(model, tmp_path)
    x = ids()
    theirs = torch_logits(pm, x)
    assert not np.allclose(theirs, torch_logits(hf_base(folders[variant]), x), atol=1e-3)
    np.testing.assert_allclose(logits(model, x), theirs, rtol=0, atol=1e-5)
    np.testing.assert_array_equal(model.model.embed_tokens.weight.value, embed)
    if extra.get("ensure_weight_tying"):
        assert model.model.embed_tokens.lora.default is model.lm_head.lora.default


@pytest.mark.parametrize("targets, share_tied", [([*PROJ, "lm_head"], False), (["lm_head"], True)])
def test_peft_loads_what_tiegrad_saves(folders, tmp_path, targets, share_tied):
    folder = folders["qwen3-tied-headdim"]
    model = LlamaLM.from_pretrained(folder)
    add_lora(model, targets, rank=4, alpha=8, share_tied=share_tied)
    randomize_adapters(model)
    save_adapter(model, tmp_path)
    names = set(file_tensors(tmp_path))
    config = json.loads((tmp_path / "adapter_config.json").read_text())
    assert config["ensure_weight_tying"] is share_tied
    expected = {"base_model.model.lm_head.lora_A.weight", "base_model.model.lm_head.lora_B.weight"}
    if share_tied:
        expected |= {f"base_model.model.model.embed_tokens.lora_embedding_{f}" for f in "AB"}
    else:
        expected.add("base_model.model.model.layers.1.mlp.down_proj.lora_B.weight")
    assert expected <= names and len(names) == 2 * len(config["target_modules"])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pm = peft.PeftModel.from_pretrained(hf_base(folder), tmp_path)
    x = ids()
    np.testing.assert_allclose(torch_logits(pm, x), logits(model, x), rtol=0, atol=1e-5)


def _train_both(folder, targets, steps=20, **extra):
    """20 AdamW steps of LoRA on both sides from PEFT's (non-zero) initial adapters."""
    pm = peft_model(folder, targets, **extra)
    initial = folder.parent / f"initial-{'-'.join(targets)}-{len(extra)}"
    peft_save(pm, initial)
    model = LlamaLM.from_pretrained(folder)
    load_adapter(model, initial)
    opt = AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    topt = torch.optim.AdamW(
        [p for p in pm.parameters() if p.requires_grad], lr=1e-2, weight_decay=0.01
    )
    for step in range(steps):
        batch = ids((2, 13), seed=10 + step)
        x, y = batch[:, :-1], batch[:, 1:]
        s = EagerSession()
        opt.step(s.backward(model.loss(s, x, y)))
        out = pm(torch.tensor(x)).logits
        loss = torch.nn.functional.cross_entropy(out.flatten(0, 1), torch.tensor(y).flatten())
        topt.zero_grad()
        loss.backward()
        topt.step()
    return model, pm


def test_twenty_adamw_steps_track_peft_with_the_input_embedding_bit_identical(folders, tmp_path):
    folder = folders["qwen2-tied"]
    embed = LlamaLM.from_pretrained(folder).model.embed_tokens.weight.value.copy()
    model, pm = _train_both(folder, [*PROJ, "lm_head"])
    save_adapter(model, tmp_path)
    ours = file_tensors(tmp_path)
    state = peft.get_peft_model_state_dict(pm, save_embedding_layers=False)
    theirs = {k: v.detach().numpy() for k, v in state.items()}
    assert set(ours) == set(theirs) and len(ours) == 2 * (2 * 7 + 1)
    for key, value in ours.items():
        np.testing.assert_allclose(value, theirs[key], rtol=0, atol=1e-4, err_msg=key)
    np.testing.assert_array_equal(model.model.embed_tokens.weight.value, embed)


@pytest.mark.parametrize(
    "edit, match",
    [
        (dict(use_dora=True), "use_dora=True is not supported"),
        (dict(alpha_pattern={"lm_head": 3.0}), "alpha_pattern gives them alphas"),
        (dict(rank_pattern={"lm_head": 3}), "(rank 3, from rank_pattern) needs (3, 32)"),
        (dict(lora_bias=True), "lora_bias=True is not supported"),
    ],
)
def test_a_file_tiegrad_does_not_compute_is_refused_by_name_and_changes_nothing(
    folders, tmp_path, edit, match
):
    pm = peft_model(folders["qwen2-tied"], ["q_proj", "lm_head"], ensure_weight_tying=True)
    peft_save(pm, tmp_path)
    config = json.loads((tmp_path / "adapter_config.json").read_text())
    (tmp_path / "adapter_config.json").write_text(json.dumps(config | edit))
    model = LlamaLM.from_pretrained(folders["qwen2-tied"])
    before = slots(model)
    with pytest.raises(CheckpointError, match=match.replace("(", r"\(").replace(")", r"\)")):
        load_adapter(model, tmp_path)
    after = slots(model)
    assert after.keys() == before.keys()
    assert all(np.array_equal(after[k], v) for k, v in before.items())
    assert all(h.requires_grad for _, h in model.named_slots())
    assert model.lm_head.weight.storage is model.model.embed_tokens.weight.storage


# -- item 3: merges that say what they untie --------------------------------------------------
@pytest.mark.parametrize("variant", ["llama-tied-llama3", "qwen2-tied"])
def test_a_merged_head_adapter_exports_untied_and_reloads_to_the_unmerged_logits(
    folders, tmp_path, variant
):
    folder = folders[variant]
    model = LlamaLM.from_pretrained(folder)
    embed = model.model.embed_tokens.weight.value.copy()
    add_lora(model, ["q_proj", "lm_head"], rank=4)
    randomize_adapters(model, scale=0.1)
    x = ids()
    adapted = logits(model, x)
    assert untied_by_merge(model) == [(EMBED, HEAD)]
    assert merge(model, untie=True) == [
        "model.layers.0.self_attn.q_proj.weight",
        "model.layers.1.self_attn.q_proj.weight",
        HEAD,
    ]
    unload(model)
    model.save_pretrained(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["tie_word_embeddings"] is False
    assert {EMBED, HEAD} <= set(read_safetensors(os.fspath(tmp_path / "model.safetensors")).tensors)
    hf, info = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path, attn_implementation="eager", output_loading_info=True
    )
    assert all(not v for v in info.values()), info
    assert hf.lm_head.weight.data_ptr() != hf.model.embed_tokens.weight.data_ptr()
    np.testing.assert_array_equal(hf.model.embed_tokens.weight.detach().numpy(), embed)
    np.testing.assert_allclose(torch_logits(hf.eval(), x), adapted, rtol=0, atol=1e-5)


def test_a_shared_adapter_merges_into_the_one_storage_and_keeps_the_tie(folders, tmp_path):
    folder = folders["qwen2-tied"]
    model = LlamaLM.from_pretrained(folder)
    add_lora(model, "lm_head", rank=4, share_tied=True)
    randomize_adapters(model, scale=0.1)
    x = ids()
    adapted = logits(model, x)
    assert untied_by_merge(model) == []
    merge(model)
    unload(model)
    assert model.lm_head.weight.storage is model.model.embed_tokens.weight.storage
    model.save_pretrained(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["tie_word_embeddings"] is True
    hf = hf_base(tmp_path)
    assert hf.lm_head.weight.data_ptr() == hf.model.embed_tokens.weight.data_ptr()
    np.testing.assert_allclose(torch_logits(hf, x), adapted, rtol=0, atol=1e-4)


def test_merging_the_input_use_alone_leaves_the_head_bit_identical(folders):
    model = LlamaLM.from_pretrained(folders["qwen2-tied"])
    head = model.lm_head.weight.value.copy()
    add_lora(model, "embed_tokens", rank=2)
    randomize_adapters(model)
    x = ids()
    adapted = logits(model, x)
    before = slots(model)
    assert untied_by_merge(model) == [(HEAD, EMBED)]
    after = slots(model)
    assert all(np.array_equal(after[k], v) for k, v in before.items())
    assert model.lm_head.weight.storage is model.model.embed_tokens.weight.storage
    merge(model, untie=True)
    assert model.lm_head.weight.storage is not model.model.embed_tokens.weight.storage
    np.testing.assert_array_equal(model.lm_head.weight.value, head)
    np.testing.assert_allclose(logits(model, x), adapted, rtol=0, atol=1e-5)


# -- modules_to_save: the tied embedding trained in full --------------------------------------
def test_a_tied_embedding_in_modules_to_save_loads_into_the_one_storage(folders, tmp_path):
    folder = folders["qwen2-tied"]
    pm = peft_model(folder, ["q_proj"], modules_to_save=["embed_tokens"], ensure_weight_tying=True)
    with torch.no_grad():
        pm.base_model.model.model.embed_tokens.modules_to_save["default"].weight.normal_(0, 0.1)
    peft_save(pm, tmp_path)
    assert {"base_model.model.model.embed_tokens.weight", "base_model.model.lm_head.weight"} <= (
        set(file_tensors(tmp_path))
    )
    model = LlamaLM.from_pretrained(folder)
    load_adapter(model, tmp_path)
    assert model.lm_head.weight.storage is model.model.embed_tokens.weight.storage
    assert model.get_parameter(EMBED).requires_grad and model.get_parameter(HEAD).requires_grad
    x = ids()
    np.testing.assert_allclose(logits(model, x), torch_logits(pm, x), rtol=0, atol=1e-5)


def test_peft_loads_a_tied_embedding_tiegrad_saves_in_full(folders, tmp_path):
    folder = folders["llama-tied-llama3"]
    model = LlamaLM.from_pretrained(folder)
    add_lora(model, ["q_proj", "down_proj"], rank=4)
    randomize_adapters(model)
    embed = model.get_parameter(EMBED)
    embed.set_value(embed.value + np.float32(0.05))
    save_adapter(model, tmp_path, modules_to_save=["lm_head"])
    config = json.loads((tmp_path / "adapter_config.json").read_text())
    assert config["modules_to_save"] == ["model.embed_tokens"] and config["ensure_weight_tying"]
    tensors = file_tensors(tmp_path)
    np.testing.assert_array_equal(tensors["base_model.model.lm_head.weight"], embed.value)
    np.testing.assert_array_equal(
        tensors["base_model.model.model.embed_tokens.weight"], embed.value
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pm = peft.PeftModel.from_pretrained(hf_base(folder), tmp_path)
    x = ids()
    np.testing.assert_allclose(torch_logits(pm, x), logits(model, x), rtol=0, atol=1e-5)


def test_modules_to_save_without_ensure_weight_tying_unties_as_peft_does(folders, tmp_path):
    folder = folders["qwen2-tied"]
    pm = peft_model(folder, ["q_proj"], modules_to_save=["embed_tokens"])
    with torch.no_grad():
        pm.base_model.model.model.embed_tokens.modules_to_save["default"].weight.normal_(0, 0.1)
    peft_save(pm, tmp_path)
    model = LlamaLM.from_pretrained(folder)
    head = model.lm_head.weight.value.copy()
    load_adapter(model, tmp_path)
    assert model.lm_head.weight.storage is not model.model.embed_tokens.weight.storage
    np.testing.assert_array_equal(model.lm_head.weight.value, head)
    assert not model.get_parameter(HEAD).requires_grad
    x = ids()
    np.testing.assert_allclose(logits(model, x), torch_logits(pm, x), rtol=0, atol=1e-5)


def test_twenty_steps_with_the_tied_embedding_in_full_track_peft(folders, tmp_path):
    model, pm = _train_both(
        folders["qwen2-tied"], ["q_proj", "v_proj"], modules_to_save=["embed_tokens"],
        ensure_weight_tying=True,
    )  # fmt: skip
    assert model.lm_head.weight.storage is model.model.embed_tokens.weight.storage
    theirs = pm.base_model.model.model.embed_tokens.modules_to_save["default"].weight
    np.testing.assert_allclose(
        model.get_parameter(EMBED).value, theirs.detach().numpy(), rtol=0, atol=1e-4
    )
    save_adapter(model, tmp_path)
    state = peft.get_peft_model_state_dict(pm, save_embedding_layers=False)
    for key, value in file_tensors(tmp_path).items():
        np.testing.assert_allclose(value, state[key].detach().numpy(), rtol=0, atol=1e-4)


@pytest.mark.parametrize(
    "edit, match",
    [
        ("differ", "ensure_weight_tying ties 'model.embed_tokens.weight' and 'lm_head.weight'"),
        ("missing", "'base_model.model.lm_head.weight' is missing"),
        ("name", "modules_to_save 'nowhere' names no module"),
    ],
)
def test_a_bad_full_copy_is_refused_and_changes_nothing(folders, tmp_path, edit, match):
    folder = folders["qwen2-tied"]
    pm = peft_model(folder, ["q_proj"], modules_to_save=["embed_tokens"], ensure_weight_tying=True)
    peft_save(pm, tmp_path)
    tensors = file_tensors(tmp_path)
    config = json.loads((tmp_path / "adapter_config.json").read_text())
    if edit == "differ":
        tensors["base_model.model.lm_head.weight"] = tensors["base_model.model.lm_head.weight"] + 1
    elif edit == "missing":
        del tensors["base_model.model.lm_head.weight"]
    else:
        config["modules_to_save"] = ["nowhere"]
    write_safetensors(os.fspath(tmp_path / "adapter_model.safetensors"), tensors, {"format": "pt"})
    (tmp_path / "adapter_config.json").write_text(json.dumps(config))
    model = LlamaLM.from_pretrained(folder)
    before = slots(model)
    with pytest.raises(CheckpointError, match=match):
        load_adapter(model, tmp_path)
    after = slots(model)
    assert after.keys() == before.keys()
    assert all(np.array_equal(after[k], v) for k, v in before.items())
    assert all(h.requires_grad for _, h in model.named_slots())
    assert model.lm_head.weight.storage is model.model.embed_tokens.weight.storage


def test_two_adapters_on_the_two_uses_merge_into_two_storages(folders, tmp_path):
    folder = folders["qwen3-tied-headdim"]
    model = LlamaLM.from_pretrained(folder)
    add_lora(model, ["embed_tokens", "lm_head"], rank=2)
    randomize_adapters(model, scale=0.1)
    x = ids()
    adapted = logits(model, x)
    assert untied_by_merge(model) == [(EMBED, HEAD)]
    merge(model, untie=True)
    unload(model)
    model.save_pretrained(tmp_path)
    hf = hf_base(tmp_path)
    assert not hf.config.tie_word_embeddings
    np.testing.assert_allclose(torch_logits(hf, x), adapted, rtol=0, atol=1e-5)
