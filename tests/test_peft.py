"""LoRA against PyTorch + peft on the tiny GPT-2 (issue 41): files both ways, training.

The base is a random transformers ``GPT2LMHeadModel`` saved with ``save_pretrained``
into a temporary folder (nothing is downloaded); both sides load it from there.
Float32 tolerances: logits 1e-5, losses 1e-5, adapter weights after 20 AdamW steps
1e-4. The input embedding of a model whose tied head alone was adapted is compared bit
for bit, after training and after the merge.
"""

from __future__ import annotations

import json
import os
import warnings

import numpy as np
import pytest

os.environ["HF_HUB_OFFLINE"] = "1"
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

from tiegrad import CheckpointError, EagerSession  # noqa: E402
from tiegrad.adapters import adapter_names, add_lora, merge, unload  # noqa: E402
from tiegrad.checkpoint.fileio import read_safetensors, write_safetensors  # noqa: E402
from tiegrad.interop.peft import load_adapter, save_adapter  # noqa: E402
from tiegrad.models import GPT2  # noqa: E402
from tiegrad.nn.tying import untie  # noqa: E402
from tiegrad.optim import AdamW  # noqa: E402

TINY = dict(n_layer=2, n_head=2, n_embd=32, vocab_size=100, n_positions=64)
NO_DROPOUT = dict(resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
WTE, HEAD = "transformer.wte.weight", "lm_head.weight"


def hf_model(**overrides):
    torch.manual_seed(0)
    config = transformers.GPT2Config(
        **(TINY | overrides), **NO_DROPOUT, bos_token_id=0, eos_token_id=0
    )
    return transformers.GPT2LMHeadModel(config).eval()


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    folder = tmp_path_factory.mktemp("gpt2")
    hf_model().save_pretrained(folder)
    return folder


def hf_base(folder):
    return transformers.GPT2LMHeadModel.from_pretrained(folder).eval()


def peft_model(folder, targets, rank=4, alpha=8, **extra):
    config = peft.LoraConfig(r=rank, lora_alpha=alpha, target_modules=targets, **extra)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the tied-head and fan_in_fan_out notices
        return peft.get_peft_model(hf_base(folder), config)


def ids(shape=(3, 11), seed=0):
    return np.random.default_rng(seed).integers(0, TINY["vocab_size"], shape)


def logits(model, x) -> np.ndarray:
    return model(EagerSession(), x).numpy()


def torch_logits(model, x) -> np.ndarray:
    with torch.no_grad():
        return model(torch.tensor(x)).logits.numpy()


def randomize_and_save(pm, folder):
    """PEFT model ``pm``'s adapter factors drawn at random, then saved by PEFT to ``folder``."""
    with torch.no_grad():
        for name, p in pm.named_parameters():
            if "lora_" in name:
                p.normal_(0.0, 0.3)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # save_embedding_layers notice
        pm.save_pretrained(folder)


def randomize_adapters(model, seed=1, scale=0.3):
    rng = np.random.default_rng(seed)
    for path, p in model.named_parameters():
        if ".lora." in path:
            p.set_value(rng.normal(0.0, scale, p.shape).astype(p.dtype))


def peft_factors(pm) -> dict[str, np.ndarray]:
    """PEFT's adapter tensors by the names its files use."""
    state = peft.get_peft_model_state_dict(pm, save_embedding_layers=False)
    return {k: v.detach().numpy().copy() for k, v in state.items()}


def tiegrad_factors(model, folder) -> dict[str, np.ndarray]:
    """The tiegrad model's adapter tensors by PEFT's names (through save_adapter)."""
    save_adapter(model, folder)
    file = read_safetensors(os.fspath(folder / "adapter_model.safetensors"))
    return {name: file.array(name) for name in file.tensors}


@pytest.mark.parametrize(
    "targets, share_tied",
    [
        (["c_attn", "c_proj", "c_fc"], False),
        (["lm_head"], False),
        (["wte"], False),
        (["lm_head"], True),
    ],
)
def test_peft_loads_what_tiegrad_saves(base, tmp_path, targets, share_tied):
    model = GPT2.from_pretrained(base)
    paths = add_lora(model, targets, rank=4, alpha=8, share_tied=share_tied)
    randomize_adapters(model)
    written = save_adapter(model, tmp_path, base_model_name_or_path=str(base))
    config = json.loads((tmp_path / "adapter_config.json").read_text())
    assert config["target_modules"] == written and config["r"] == 4
    assert config["fan_in_fan_out"] == (targets[0] == "c_attn")
    assert config["ensure_weight_tying"] is share_tied
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        pm = peft.PeftModel.from_pretrained(hf_base(base), tmp_path)
    if share_tied:  # PEFT ties the head's adapter to the embedding's: one adapter, as ours
        assert not [w for w in caught if "ensure_weight_tying" in str(w.message)]
        head, wte = pm.base_model.model.lm_head, pm.base_model.model.transformer.wte
        tied = wte.lora_embedding_B["default"].data_ptr()
        assert head.lora_A["default"].weight.data_ptr() == tied
    x = ids()
    np.testing.assert_allclose(logits(model, x), torch_logits(pm, x), rtol=0, atol=1e-5)
    again = GPT2.from_pretrained(base)
    assert load_adapter(again, tmp_path) == paths
    np.testing.assert_array_equal(logits(again, x), logits(model, x))
    assert again.aliases() == model.aliases()  # a shared adapter is shared again


@pytest.mark.parametrize(
    "targets, extra",
    [
        (["c_attn", "attn.c_proj"], dict(rank_pattern={"h.1.attn.c_attn": 2})),
        (["lm_head", "c_fc"], dict(alpha_pattern={"lm_head": 3})),
        (["wte"], {}),
    ],
)
def test_tiegrad_loads_what_peft_saves(base, tmp_path, targets, extra):
    pm = peft_model(base, targets, **extra)
    randomize_and_save(pm, tmp_path)
    model = GPT2.from_pretrained(base)
    paths = load_adapter(model, tmp_path, name="trained")
    assert adapter_names(model) == ["trained"] and paths
    x = ids()
    np.testing.assert_allclose(logits(model, x), torch_logits(pm, x), rtol=0, atol=1e-5)
    if "rank_pattern" in extra:
        assert model.transformer.h[1].attn.c_attn.lora.trained.rank == 2


def test_tiegrad_loads_a_tied_adapter_peft_saves_as_one_shared_adapter(base, tmp_path):
    # PEFT with ensure_weight_tying adapts the embedding, ties the head's adapter to it,
    # names only the embedding among target_modules and writes both uses' factors.
    pm = peft_model(base, ["lm_head"], ensure_weight_tying=True)
    randomize_and_save(pm, tmp_path)
    config = json.loads((tmp_path / "adapter_config.json").read_text())
    assert config["ensure_weight_tying"] and "lm_head" not in config["target_modules"]
    model = GPT2.from_pretrained(base)
    assert load_adapter(model, tmp_path) == [WTE, HEAD]
    assert model.aliases()["transformer.wte.lora.default.A"] == ["lm_head.lora.default.A"]
    np.testing.assert_allclose(logits(model, ids()), torch_logits(pm, ids()), rtol=0, atol=1e-5)
    _edit_config(tmp_path, ensure_weight_tying=False)  # the head's factors: no target now
    with pytest.raises(CheckpointError, match="'lm_head', not a target_module"):
        load_adapter(GPT2.from_pretrained(base), tmp_path)


def _slots(model):
    """Every slot's path, value, trainability and storage identity, and the ties."""
    slots = [(k, p.value.copy(), p.requires_grad, id(p.storage)) for k, p in model.named_slots()]
    return slots, model.aliases(), adapter_names(model)


def _same_model(a, b):
    (slots_a, *rest_a), (slots_b, *rest_b) = a, b
    assert rest_a == rest_b and len(slots_a) == len(slots_b)
    for (k, v, rg, st), (k2, v2, rg2, st2) in zip(slots_a, slots_b):
        assert (k, rg, st) == (k2, rg2, st2) and np.array_equal(v, v2)


def _peft_tied_file(base, folder, **extra):
    """What PEFT saves for an adapter of the tied head with ensure_weight_tying."""
    randomize_and_save(peft_model(base, ["lm_head"], ensure_weight_tying=True, **extra), folder)


def _refused(base, folder, match, model=None):
    """``load_adapter`` of ``folder`` raises ``match`` and changes nothing (C6)."""
    model = GPT2.from_pretrained(base) if model is None else model
    before = _slots(model)
    with pytest.raises(CheckpointError, match=match):
        load_adapter(model, folder)
    _same_model(_slots(model), before)


def test_tied_uses_whose_factors_differ_or_a_bad_tying_flag_are_refused(base, tmp_path):
    model = GPT2.from_pretrained(base)
    add_lora(model, "lm_head", share_tied=True)
    randomize_adapters(model)
    save_adapter(model, tmp_path)
    head_a = f"{PEFT_HEAD}.lora_A.weight"
    # as PEFT writes it, without tiegrad.shared
    _edit_tensors(tmp_path, lambda t: t.update({head_a: t[head_a] * 2}), {"format": "pt"})
    _refused(base, tmp_path, "ensure_weight_tying groups .* not one adapter's")
    _edit_config(tmp_path, ensure_weight_tying="yes")
    _refused(base, tmp_path, "ensure_weight_tying must be true or false")


def test_a_tied_file_whose_uses_differ_in_alpha_or_miss_factors_is_refused(base, tmp_path):
    _peft_tied_file(base, tmp_path, alpha_pattern={"lm_head": 3})  # PEFT scales them apart
    _refused(base, tmp_path, "'transformer.wte' and 'lm_head' share one adapter, but alpha")
    _peft_tied_file(base, tmp_path)
    _edit_tensors(tmp_path, lambda t: [t.pop(k) for k in list(t) if k.startswith(PEFT_HEAD)])
    _refused(base, tmp_path, "ties 'lm_head' to 'transformer.wte' .* no factors of 'lm_head'")


def test_a_tied_file_meets_an_untied_model_or_disagreeing_metadata(base, tmp_path):
    _peft_tied_file(base, tmp_path)
    untied = GPT2.from_pretrained(base)
    untie(untied, HEAD)
    _refused(base, tmp_path, "'lm_head', not a target_module nor one storage with one", untied)
    model = GPT2.from_pretrained(base)
    add_lora(model, "lm_head", share_tied=True)
    save_adapter(model, tmp_path)
    _edit_tensors(tmp_path, lambda t: None, {"format": "pt", "tiegrad.shared": "[]"})  # no group
    _refused(base, tmp_path, "metadata tiegrad.shared groups \\[\\], but ensure_weight_tying ties")
    _edit_config(tmp_path, ensure_weight_tying=None)  # null: false; the metadata alone
    again = GPT2.from_pretrained(base)
    assert load_adapter(again, tmp_path) == [WTE, HEAD]
    assert again.aliases() == {WTE: [HEAD]}  # two adapters, as the metadata says


LAYER_1 = "base_model.model.transformer.h.1.attn.c_attn"
PEFT_HEAD = "base_model.model.lm_head"


def _edit_tensors(folder, edit, metadata=None):
    """Rewrite the adapter file with ``edit`` applied to its ``{name: array}`` (and
    ``metadata`` instead of its own, if given)."""
    path = os.fspath(folder / "adapter_model.safetensors")
    file = read_safetensors(path)
    tensors = {k: file.array(k) for k in file.tensors}
    edit(tensors)
    write_safetensors(path, tensors, file.metadata if metadata is None else metadata)


def test_a_base_weight_in_the_file_equal_to_the_models_is_accepted(base, tmp_path):
    model = GPT2.from_pretrained(base)
    add_lora(model, "lm_head")
    save_adapter(model, tmp_path)
    head = model.lm_head.weight.value
    _edit_tensors(tmp_path, lambda t: t.update({f"{PEFT_HEAD}.base_layer.weight": head}))
    assert load_adapter(GPT2.from_pretrained(base), tmp_path) == [HEAD]


def _edit_config(folder, **changes):
    path = folder / "adapter_config.json"
    config = json.loads(path.read_text())
    config.update(changes)
    path.write_text(json.dumps(config))


@pytest.mark.parametrize(
    "defect, message",
    [
        ("other_base", "'base_model.model.transformer.h.0.attn.c_attn.lora_A.weight' has shape"),
        ("unknown_target", "target module 'q_proj' names no adaptable layer"),
        ("dora", "use_dora=True is not supported"),
        ("rank", "needs (3, 32)"),
        ("missing_factor", "lora_B.weight' is missing"),
        ("regex_targets", "names 'lm_head', not matched by '.*c_attn'"),
        ("changed_base", "differs from the model's lm_head.weight"),
        ("unexpected", "unexpected tensor 'base_model.model.lm_head.lora_magnitude_vector'"),
    ],
)
def test_a_mismatched_adapter_is_refused_before_anything_changes(
    base, tmp_path, defect, message
):  # C6
    if defect == "other_base":
        other = tmp_path / "other"
        hf_model(n_embd=16, n_head=2).save_pretrained(other)
        source = GPT2.from_pretrained(other)
    else:
        source = GPT2.from_pretrained(base)
    add_lora(source, ["c_attn", "lm_head"], rank=4)
    randomize_adapters(source)
    folder = tmp_path / "adapter"
    save_adapter(source, folder)
    if defect == "unknown_target":
        _edit_config(folder, target_modules=["c_attn", "lm_head", "q_proj"])
    elif defect == "dora":
        _edit_config(folder, use_dora=True)
    elif defect == "rank":
        _edit_config(folder, r=3)
    elif defect == "regex_targets":
        _edit_config(folder, target_modules=".*c_attn")
    elif defect == "missing_factor":
        _edit_tensors(folder, lambda t: t.pop(f"{LAYER_1}.lora_B.weight"))
    elif defect == "changed_base":
        changed = source.lm_head.weight.value + 1.0
        _edit_tensors(folder, lambda t: t.update({f"{PEFT_HEAD}.base_layer.weight": changed}))
    elif defect == "unexpected":
        vector = np.ones(100, np.float32)
        _edit_tensors(folder, lambda t: t.update({f"{PEFT_HEAD}.lora_magnitude_vector": vector}))
    model = GPT2.from_pretrained(base)
    before = [(p, h.storage, h.requires_grad, h.value.tobytes()) for p, h in model.named_slots()]
    with pytest.raises(CheckpointError) as e:
        load_adapter(model, folder)
    assert message in str(e.value)
    after = [(p, h.storage, h.requires_grad, h.value.tobytes()) for p, h in model.named_slots()]
    assert after == before and adapter_names(model) == []


def _train_both(base, folder, targets, steps=20):
    """20 AdamW steps of LoRA on both sides from the same initial adapters."""
    model = GPT2.from_pretrained(base)
    add_lora(model, targets, rank=4, alpha=8)
    randomize_adapters(model, scale=0.1)
    pm = peft_model(base, targets)
    initial = tiegrad_factors(model, folder / "initial")
    peft.set_peft_model_state_dict(pm, {k: torch.tensor(v) for k, v in initial.items()})
    assert all(np.array_equal(peft_factors(pm)[k], v) for k, v in initial.items())
    opt = AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    topt = torch.optim.AdamW(
        [p for p in pm.parameters() if p.requires_grad], lr=1e-2, weight_decay=0.01
    )
    losses = []
    for step in range(steps):
        batch = ids((2, 17), seed=10 + step)
        x, y = batch[:, :-1], batch[:, 1:]
        s = EagerSession()
        loss = model.loss(s, x, y)
        opt.step(s.backward(loss))
        out = pm(torch.tensor(x)).logits
        tloss = torch.nn.functional.cross_entropy(out.flatten(0, 1), torch.tensor(y).flatten())
        topt.zero_grad()
        tloss.backward()
        topt.step()
        losses.append((float(loss.numpy()), float(tloss.detach())))
    return model, pm, losses


@pytest.mark.parametrize("targets", [["c_attn"], ["lm_head"]])
def test_twenty_adamw_steps_track_peft(base, tmp_path, targets):
    model, pm, losses = _train_both(base, tmp_path, targets)
    mine, theirs = np.array(losses).T
    np.testing.assert_allclose(mine, theirs, rtol=0, atol=1e-5)
    ours, peft_side = tiegrad_factors(model, tmp_path), peft_factors(pm)
    assert set(ours) == set(peft_side)
    for key, value in ours.items():
        np.testing.assert_allclose(value, peft_side[key], rtol=0, atol=1e-4, err_msg=key)


def test_the_tied_head_trains_and_merges_with_the_input_embedding_bit_identical(base, tmp_path):
    wte = GPT2.from_pretrained(base).transformer.wte.weight.value.copy()
    model, pm, _ = _train_both(base, tmp_path, ["lm_head"])
    np.testing.assert_array_equal(model.transformer.wte.weight.value, wte)
    x = ids()
    adapted = logits(model, x)
    assert merge(model, untie=True) == [HEAD]
    unload(model)
    np.testing.assert_array_equal(model.transformer.wte.weight.value, wte)
    np.testing.assert_allclose(logits(model, x), adapted, rtol=0, atol=1e-5)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # peft's tied-merge notice
        merged = pm.merge_and_unload()
    np.testing.assert_allclose(
        model.lm_head.weight.value, merged.lm_head.weight.detach().numpy(), rtol=0, atol=1e-4
    )


def test_merged_weights_export_to_transformers(base, tmp_path):
    model = GPT2.from_pretrained(base)
    add_lora(model, ["c_attn", "lm_head"], rank=4)
    randomize_adapters(model, scale=0.1)
    x = ids()
    adapted = logits(model, x)
    merge(model, untie=True)
    unload(model)
    merged = logits(model, x)
    np.testing.assert_allclose(merged, adapted, rtol=0, atol=1e-4)  # float32 rounding
    model.save_pretrained(tmp_path)
    hf = transformers.GPT2LMHeadModel.from_pretrained(tmp_path).eval()
    assert hf.lm_head.weight.data_ptr() != hf.transformer.wte.weight.data_ptr()
    np.testing.assert_allclose(torch_logits(hf, x), merged, rtol=0, atol=1e-5)
