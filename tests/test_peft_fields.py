"""Every PEFT ``LoraConfig`` field that changes the arithmetic, against PEFT itself (issue 52).

Each adapter is made by PEFT on the tiny GPT-2 of ``test_peft`` and saved with
``save_pretrained``; tiegrad either computes PEFT's logits (float32, 1e-5) or refuses the
file naming the field, and then nothing has changed (C6: slots, values, ties,
trainability, adapters).
"""

from __future__ import annotations

import json
import re
import shutil
import warnings

import numpy as np
import pytest
from test_peft import (
    _edit_config,
    _refused,
    hf_base,
    ids,
    logits,
    peft,
    peft_model,
    randomize_adapters,
    randomize_and_save,
    torch,
    torch_logits,
)
from test_peft import base as base  # the module-scoped fixture: a saved random GPT-2

from tiegrad.adapters import add_lora
from tiegrad.interop.peft import load_adapter, save_adapter
from tiegrad.models import GPT2

C_ATTN_1 = "transformer.h.1.attn.c_attn"


def peft_reload(base, folder):
    """PEFT's own model of the adapter in ``folder``."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the fan_in_fan_out notice
        return peft.PeftModel.from_pretrained(hf_base(base), folder)


def adapted_by_peft(pm) -> set[str]:
    """The module paths (of the base model) that PEFT gave an adapter."""
    prefix = "base_model.model."
    return {n[len(prefix) :] for n, m in pm.named_modules() if hasattr(m, "lora_A") and m.r}


@pytest.fixture(scope="module")
def c_attn(base, tmp_path_factory):
    """An adapter of every ``c_attn`` that PEFT made and saved, and PEFT's model of it."""
    folder = tmp_path_factory.mktemp("c_attn")
    pm = peft_model(base, ["c_attn"])
    randomize_and_save(pm, folder)
    return folder, pm


def copy_of(adapter, tmp_path):
    """A copy of ``adapter``'s folder to edit."""
    return shutil.copytree(adapter[0], tmp_path / "adapter")


def loads_as_peft(base, folder, pm):
    """tiegrad loads ``folder`` and computes ``pm``'s logits; returns the model."""
    model = GPT2.from_pretrained(base)
    paths = load_adapter(model, folder)
    assert {p.removesuffix(".weight") for p in paths} == adapted_by_peft(pm)
    x = ids()
    np.testing.assert_allclose(logits(model, x), torch_logits(pm, x), rtol=0, atol=1e-5)
    return model


def test_regex_keys_of_alpha_and_rank_pattern_match_as_in_peft(base, tmp_path):
    # The first key that matches wins (h.0's c_attn: 3, not 5), as PEFT's get_pattern_key.
    alphas = {"h.0.attn.c_attn": 3, r".*c_attn": 5, r"h\.\d\.mlp\.c_\w+": 2}
    pm = peft_model(
        base, ["c_attn", "c_fc", "lm_head"], alpha_pattern=alphas, rank_pattern={r"h\.1\..*": 2}
    )
    randomize_and_save(pm, tmp_path)
    model = loads_as_peft(base, tmp_path, pm)
    h = model.transformer.h
    assert [h[0].attn.c_attn.lora.default.alpha, h[1].attn.c_attn.lora.default.alpha] == [3, 5]
    assert h[1].mlp.c_fc.lora.default.alpha == 2 and model.lm_head.lora.default.alpha == 8
    assert [h[0].mlp.c_fc.lora.default.rank, h[1].mlp.c_fc.lora.default.rank] == [4, 2]


@pytest.mark.parametrize(
    "targets, extra",
    [
        (["c_attn", "c_proj"], dict(exclude_modules=r".*\.1\.attn\.c_\w+")),
        (["c_attn", "c_proj"], dict(exclude_modules=["mlp.c_proj", "h.0.attn.c_attn"])),
        (["c_attn", "mlp.c_proj", "lm_head"], dict(layers_to_transform=[1])),
        (["c_attn", "c_fc"], dict(layers_to_transform=0, layers_pattern="h")),
        (["transformer.h.0.attn.c_attn", "c_fc"], dict(layers_to_transform=[1])),
        (r"transformer\.h\.1\.(attn\.c_attn|mlp\.c_proj)", {}),
    ],
)
def test_peft_targeting_chooses_the_modules_peft_adapts(base, tmp_path, targets, extra):
    # A whole path among target_modules is not filtered by layers_to_transform (PEFT).
    pm = peft_model(base, targets, **extra)
    randomize_and_save(pm, tmp_path)
    loads_as_peft(base, tmp_path, pm)


@pytest.mark.parametrize(
    "changes, message",
    [
        (dict(exclude_modules=[C_ATTN_1]), "excluded by exclude_modules"),
        (dict(exclude_modules=r".*1\.attn.*"), r"excluded by exclude_modules '\.\*1"),
        (dict(layers_to_transform=[0]), "in layer 1, not in layers_to_transform \\[0\\]"),
        (
            dict(layers_to_transform=1, layers_pattern="layers"),
            "in no numbered layer, not in layers_to_transform 1",
        ),
        (dict(target_modules=r".*\.0\.attn\.c_attn"), r"not matched by '\.\*"),
    ],
)
def test_factors_of_a_module_peft_does_not_adapt_are_refused(
    base, c_attn, tmp_path, changes, message
):
    folder = copy_of(c_attn, tmp_path)
    _edit_config(folder, **changes)
    _refused(
        base,
        folder,
        r"c_attn\.lora_A\.weight' names 'transformer\.h\.\d\.attn\.c_attn', " + message,
    )


def test_rslora_scales_by_the_root_of_the_rank_both_ways(base, tmp_path):
    # alpha 4: scaling 2 at rank 4 (1 without rsLoRA), 2.83 at rank 2 (2 without)
    extra = dict(use_rslora=True, rank_pattern={"lm_head": 2})
    pm = peft_model(base, ["c_attn", "lm_head"], alpha=4, **extra)
    randomize_and_save(pm, tmp_path / "peft")
    model = loads_as_peft(base, tmp_path / "peft", pm)
    assert model.lm_head.lora.default.scaling == 4 / np.sqrt(2)
    mine = GPT2.from_pretrained(base)
    add_lora(mine, ["c_attn", "wte"], rank=4, alpha=4, rslora=True)
    randomize_adapters(mine)
    save_adapter(mine, tmp_path / "tiegrad")
    assert json.loads((tmp_path / "tiegrad" / "adapter_config.json").read_text())["use_rslora"]
    x = ids()
    theirs = torch_logits(peft_reload(base, tmp_path / "tiegrad"), x)
    np.testing.assert_allclose(logits(mine, x), theirs, rtol=0, atol=1e-5)


@pytest.mark.parametrize("fan_in_fan_out", [True, False, None])
def test_fan_in_fan_out_is_set_by_the_layer_as_peft_does(base, tmp_path, fan_in_fan_out):
    # PEFT sets it per layer (true for a Conv1D, false for a Linear; an Embedding's forward
    # reads no such flag), whatever the file says: the same logits either way.
    pm = peft_model(base, ["c_attn", "lm_head", "wte"])
    randomize_and_save(pm, tmp_path)
    _edit_config(tmp_path, fan_in_fan_out=fan_in_fan_out)
    loads_as_peft(base, tmp_path, peft_reload(base, tmp_path))
    loads_as_peft(base, tmp_path, pm)


def test_pissa_loads_once_peft_converts_it_to_lora_and_is_refused_before(base, tmp_path):
    torch.manual_seed(0)
    pm = peft_model(base, ["c_attn"], init_lora_weights="pissa")
    initial = tmp_path / "initial"
    pm.save_pretrained(initial)  # PEFT's recipe: the initial factors, before training
    randomize_and_save(pm, tmp_path / "pissa")
    config = json.loads((tmp_path / "pissa" / "adapter_config.json").read_text())
    assert config["init_lora_weights"] == "pissa"
    _refused(base, tmp_path / "pissa", "init_lora_weights='pissa': PEFT changed the base")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pm.save_pretrained(tmp_path / "lora", path_initial_model_for_weight_conversion=initial)
    model = GPT2.from_pretrained(base)
    load_adapter(model, tmp_path / "lora")  # rank 8: the trained factors and the initial ones
    assert model.transformer.h[0].attn.c_attn.lora.default.rank == 8
    x = ids()
    np.testing.assert_allclose(logits(model, x), torch_logits(pm, x), rtol=0, atol=1e-5)


@pytest.mark.parametrize(
    "init, message",
    [
        ("olora", "PEFT changed the base weights"),
        ("pissa_niter_4", "PEFT changed the base weights"),
        ("corda", "path_initial_model_for_weight_conversion"),
        ("loftq", "LoftQ quantises them"),
        ("lora_ga", "PEFT changed the base weights"),
        ("mica", "trains A alone"),
        ("kaiming", "is not an initialisation PEFT's LoRA knows"),
        (1.5, "is not an initialisation PEFT's LoRA knows"),
    ],
)
def test_an_initialisation_tiegrad_cannot_follow_is_refused_by_name(
    base, c_attn, tmp_path, init, message
):
    folder = copy_of(c_attn, tmp_path)
    _edit_config(folder, init_lora_weights=init)
    _refused(base, folder, f"init_lora_weights={re.escape(repr(init))}.*{message}")


@pytest.mark.parametrize("init", [False, "gaussian", "orthogonal", "nora", "eva"])
def test_an_initialisation_that_keeps_the_base_loads_as_plain_lora(base, c_attn, tmp_path, init):
    folder = copy_of(c_attn, tmp_path)
    _edit_config(folder, init_lora_weights=init)
    loads_as_peft(base, folder, c_attn[1])


@pytest.mark.parametrize("key", ["ensure_weight_tying", "use_rslora", "fan_in_fan_out"])
@pytest.mark.parametrize("value", [1, 0, "true"])
def test_a_flag_takes_true_false_or_null_only(base, c_attn, tmp_path, key, value):
    folder = copy_of(c_attn, tmp_path)
    _edit_config(folder, **{key: value})
    _refused(base, folder, f"{key} must be true or false, got {value!r}")


@pytest.mark.parametrize(
    "key, value",
    [
        ("use_dora", True),
        ("lora_bias", True),
        ("trainable_token_indices", [1, 2]),
        ("target_parameters", ["attn.c_attn.weight"]),
        ("layer_replication", [[0, 2], [1, 2]]),
        ("megatron_config", {"tensor_model_parallel_size": 1}),
        ("alora_invocation_tokens", [3, 4]),
        ("use_qalora", True),
        ("use_bdlora", {"target_modules_bd_a": ["c_attn"]}),
        ("kasa_config", {"truncate": True}),
        ("a_newer_peft_field", 2),
    ],
)
def test_a_field_tiegrad_does_not_compute_is_refused_by_name(base, c_attn, tmp_path, key, value):
    folder = copy_of(c_attn, tmp_path)
    _edit_config(folder, **{key: value})
    _refused(base, folder, f"{key}={re.escape(repr(value))} is not ")


@pytest.mark.parametrize(
    "changes, message",
    [
        (dict(layers_pattern="h"), "layers_pattern 'h' needs layers_to_transform"),
        (dict(layers_to_transform="1"), "layers_to_transform must be a layer index"),
        (dict(layers_to_transform=[True]), "layers_to_transform must be a layer index"),
        (dict(exclude_modules=5), "exclude_modules must be a regular expression or a list"),
        (dict(target_modules=[]), "target_modules must be a regular expression or a non-empty"),
        (dict(target_modules="c_attn(", layers_pattern=None), "target_modules is not a regular"),
        (dict(alpha_pattern={"c_attn[": 3}), "alpha_pattern key 'c_attn\\[' is not a regular"),
        (
            dict(layers_to_transform=[0], layers_pattern="(?P<idx>h)"),
            "layers_pattern '\\(\\?P<idx>h\\)' is not a regular expression",
        ),
        (
            dict(target_modules=".*c_attn", layers_to_transform=[0]),
            "layers_to_transform applies to a list of target_modules, not to the regular",
        ),
    ],
)
def test_targeting_fields_peft_would_not_take_are_refused(base, c_attn, tmp_path, changes, message):
    folder = copy_of(c_attn, tmp_path)
    _edit_config(folder, **changes)
    _refused(base, folder, message)
