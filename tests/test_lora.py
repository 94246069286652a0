"""LoRA adapters on frozen storage, ties kept (issue 41): ``tiegrad.adapters``.

Tiny GPT-2 models built here (no transformers); the comparisons against PyTorch and
peft are in ``test_peft.py``. Each refusal is checked to change nothing (C6).
"""

from __future__ import annotations

import copy
import re

import numpy as np
import pytest

import tiegrad
from tiegrad import (
    AliasError,
    ConfigError,
    EagerSession,
    HyperparameterError,
    SlotError,
    TiegradError,
)
from tiegrad import nn as tnn
from tiegrad.adapters import (
    LoRAConv1D,
    LoRALinear,
    active_adapter,
    adapter_names,
    add_lora,
    disable,
    enable,
    merge,
    set_adapter,
    unload,
    unmerge,
)
from tiegrad.models import GPT2
from tiegrad.models.gpt2 import Conv1D
from tiegrad.optim import AdamW

TINY = dict(n_layer=2, n_head=2, n_embd=32, vocab_size=100, n_positions=64)
NO_DROPOUT = dict(resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
WTE, HEAD = "transformer.wte.weight", "lm_head.weight"


def gpt2(seed: int = 0) -> GPT2:
    return GPT2(**TINY, **NO_DROPOUT, seed=seed)


def ids(shape=(2, 9), seed=0):
    return np.random.default_rng(seed).integers(0, TINY["vocab_size"], shape)


def logits(model, x) -> np.ndarray:
    return model(EagerSession(), x).numpy()


def randomize_adapters(model, seed: int = 1, scale: float = 0.3) -> None:
    """Non-zero A and B everywhere, so every adapter changes its use."""
    rng = np.random.default_rng(seed)
    for path, p in model.named_parameters():
        if ".lora." in path:
            p.set_value(rng.normal(0.0, scale, p.shape).astype(p.dtype))


def state(model) -> dict:
    """Everything a refused call must leave alone: paths, storages, flags, values, classes."""
    slots = model.named_slots()
    storages = {id(p.storage): k for k, (_, p) in enumerate(slots)}
    return {
        "paths": [path for path, _ in slots],
        "layout": [storages[id(p.storage)] for _, p in slots],
        "flags": [p.requires_grad for _, p in slots],
        "values": [p.value.tobytes() for _, p in slots],
        "classes": [type(m).__name__ for _, m in model.named_modules()],
        "names": adapter_names(model),
        "active": active_adapter(model),
    }


def adamw(model) -> AdamW:
    return AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)


def run_steps(model, opt, first: int, last: int) -> None:
    """Steps ``first``..``last - 1``; the batch of a step depends on the step alone."""
    for step in range(first, last):
        s = EagerSession()
        batch = ids((2, 10), seed=100 + step)
        opt.step(s.backward(model.loss(s, batch[:, :-1], batch[:, 1:])))


def train(model, steps: int = 3) -> AdamW:
    opt = adamw(model)
    run_steps(model, opt, 0, steps)
    return opt


def test_adapters_start_at_the_base_and_only_they_train():  # C4, C5
    model = gpt2()
    x = ids()
    base = logits(model, x)
    paths = add_lora(model, "c_attn", rank=4, alpha=8)
    assert paths == [f"transformer.h.{i}.attn.c_attn.weight" for i in range(2)]
    assert isinstance(model.transformer.h[0].attn.c_attn, LoRAConv1D)
    np.testing.assert_array_equal(logits(model, x), base)  # B = 0: the base's output
    trainable = [path for path, p in model.named_slots() if p.requires_grad]
    assert trainable == [
        f"transformer.h.{i}.attn.c_attn.lora.default.{f}" for i in range(2) for f in "AB"
    ]
    adapter = model.transformer.h[0].attn.c_attn.lora.default
    assert adapter.A.shape == (4, 32) and adapter.B.shape == (96, 4)
    assert adapter.scaling == 2.0
    before = {path: p.value.copy() for path, p in model.named_slots()}
    opt = train(model)
    state_elements = sum(v.size for st in opt.state.values() for k, v in st.items() if k != "step")
    adapter_elements = sum(p.size for path, p in model.named_parameters() if ".lora." in path)
    assert state_elements == 2 * adapter_elements  # AdamW: no state for frozen storages
    for path, p in model.named_slots():
        changed = not np.array_equal(p.value, before[path])
        assert changed == (".lora." in path), path


def test_summary_describe_and_inspect_show_the_adapters(tmp_path):
    model = gpt2()
    add_lora(model, "lm_head", rank=2)
    table = tnn.summary(model)
    # the adapter: frozen nowhere, an optimizer slot, shape (rank, d)
    assert re.search(r"lm_head\.lora\.default\.A\s+-\s+\d+\s+\(2, 32\)", table)
    # the tied base: one storage, frozen at both paths, no optimizer slot
    assert re.search(rf"{WTE}, {HEAD}\s+{WTE}, {HEAD}\s+-\s+\(100, 32\)", table)
    assert "lm_head.lora.default.B" in model.parameters().describe()
    tiegrad.save(tmp_path / "a.safetensors", model)
    text = tiegrad.inspect(tmp_path / "a.safetensors")
    assert "lm_head.lora.default.A" in text and f"tie: {WTE} = {HEAD}" in text


@pytest.mark.parametrize(
    "targets",
    [
        "c_attn",
        "*.attn.c_attn",
        "transformer.h.*.attn.c_attn",
        ["transformer.h.0.attn.c_attn.weight", "transformer.h.1.attn.c_attn"],
        "attn.c_attn",
    ],
)
def test_targets_are_globs_on_layer_or_weight_paths_whole_or_as_dotted_suffix(targets):
    model = gpt2()
    assert add_lora(model, targets) == [f"transformer.h.{i}.attn.c_attn.weight" for i in (0, 1)]


def test_c_proj_names_both_projections_as_peft_does():
    model = gpt2()
    assert add_lora(model, "c_proj") == [
        f"transformer.h.{i}.{kind}.c_proj.weight" for i in (0, 1) for kind in ("attn", "mlp")
    ]


def test_the_tied_head_gets_its_own_adapter_and_the_input_use_is_unchanged():
    model = gpt2()
    add_lora(model, "lm_head", rank=4)
    assert model.aliases()[WTE] == [HEAD]  # still one storage, stored once (C1, C9)
    randomize_adapters(model)
    s = EagerSession()
    h = s.constant(np.random.default_rng(3).normal(size=(2, 5, 32)).astype(np.float32))
    weight = model.transformer.wte.weight.value
    x = ids()
    np.testing.assert_array_equal(model.transformer.wte(s, x).numpy(), weight[x])
    head = model.lm_head(s, h).numpy()
    adapter = model.lm_head.lora.default
    delta = adapter.scaling * (h.numpy() @ adapter.A.value.T) @ adapter.B.value.T
    np.testing.assert_allclose(head, h.numpy() @ weight.T + delta, rtol=1e-5, atol=1e-5)
    wte = weight.copy()
    train(model)
    np.testing.assert_array_equal(model.transformer.wte.weight.value, wte)


def test_the_input_embedding_alone_leaves_the_head_use_unchanged():
    model = gpt2()
    assert add_lora(model, "wte", rank=4) == [WTE]
    randomize_adapters(model)
    s = EagerSession()
    weight = model.transformer.wte.weight.value
    h = s.constant(np.random.default_rng(3).normal(size=(2, 5, 32)).astype(np.float32))
    np.testing.assert_allclose(model.lm_head(s, h).numpy(), h.numpy() @ weight.T, atol=1e-5)
    x = ids()
    adapter = model.transformer.wte.lora.default
    delta = adapter.scaling * adapter.A.value.T[x] @ adapter.B.value.T
    np.testing.assert_allclose(
        model.transformer.wte(s, x).numpy(), weight[x] + delta, rtol=1e-5, atol=1e-5
    )


def test_share_tied_gives_both_uses_one_adapter_and_sums_their_gradients():  # C4
    shared, apart = gpt2(), gpt2()
    paths = add_lora(shared, "lm_head", rank=3, share_tied=True)
    assert paths == [WTE, HEAD]
    assert shared.lm_head.lora.default is shared.transformer.wte.lora.default
    aliases = shared.aliases()
    assert aliases["transformer.wte.lora.default.A"] == ["lm_head.lora.default.A"]
    add_lora(apart, ["wte", "lm_head"], rank=3)
    randomize_adapters(shared)
    a, b = (shared.transformer.wte.lora.default.A, shared.transformer.wte.lora.default.B)
    apart.transformer.wte.lora.default.A.set_value(a.value)
    apart.transformer.wte.lora.default.B.set_value(b.value)
    apart.lm_head.lora.default.A.set_value(b.value.T)  # the head reads it transposed
    apart.lm_head.lora.default.B.set_value(a.value.T)
    x, y = ids(seed=1), ids(seed=2)
    np.testing.assert_allclose(logits(shared, x), logits(apart, x), rtol=1e-5, atol=1e-5)
    gs = shared.named_gradients((s := EagerSession()).backward(shared.loss(s, x, y)))
    ga = apart.named_gradients((s := EagerSession()).backward(apart.loss(s, x, y)))
    np.testing.assert_allclose(
        gs["transformer.wte.lora.default.A"],
        ga["transformer.wte.lora.default.A"] + ga["lm_head.lora.default.B"].T,
        rtol=1e-4,
        atol=1e-6,
    )
    np.testing.assert_allclose(
        gs["transformer.wte.lora.default.B"],
        ga["transformer.wte.lora.default.B"] + ga["lm_head.lora.default.A"].T,
        rtol=1e-4,
        atol=1e-6,
    )


def test_merge_folds_the_adapter_and_unmerge_takes_it_out():
    model = gpt2()
    add_lora(model, ["c_attn", "c_fc"], rank=4)
    randomize_adapters(model)
    x = ids()
    adapted = logits(model, x)
    base = {path: p.value.copy() for path, p in model.named_slots()}
    assert merge(model) == [
        f"transformer.h.{i}.{m}.weight" for i in (0, 1) for m in ("attn.c_attn", "mlp.c_fc")
    ]
    np.testing.assert_allclose(logits(model, x), adapted, rtol=0, atol=1e-5)
    assert not np.array_equal(
        model.transformer.h[0].attn.c_attn.weight.value, base["transformer.h.0.attn.c_attn.weight"]
    )
    assert merge(model) == []  # nothing left to merge
    assert len(unmerge(model)) == 4
    for path, p in model.named_slots():
        np.testing.assert_allclose(p.value, base[path], rtol=0, atol=1e-6, err_msg=path)
    np.testing.assert_allclose(logits(model, x), adapted, rtol=0, atol=1e-5)


def test_merging_the_tied_head_alone_is_refused_with_the_choices():  # C6
    model = gpt2()
    add_lora(model, "lm_head")
    randomize_adapters(model)
    before = state(model)
    with pytest.raises(AliasError) as e:
        merge(model)
    message = str(e.value)
    assert f"{HEAD!r} shares its storage with {WTE!r}, which has no adapter" in message
    assert "untie=True" in message and "share_tied=True" in message
    assert state(model) == before


def test_merge_with_untie_gives_the_head_its_own_storage_and_keeps_the_embedding():
    model = gpt2()
    add_lora(model, "lm_head")
    randomize_adapters(model)
    x = ids()
    adapted = logits(model, x)
    wte = model.transformer.wte.weight
    storage, value = wte.storage, wte.value.copy()
    assert merge(model, untie=True) == [HEAD]
    assert wte.storage is storage  # the input use keeps the original, bit for bit
    np.testing.assert_array_equal(wte.value, value)
    assert model.lm_head.weight.storage is not storage
    assert WTE not in model.aliases()
    np.testing.assert_allclose(logits(model, x), adapted, rtol=0, atol=1e-5)
    unmerge(model)
    np.testing.assert_allclose(model.lm_head.weight.value, value, rtol=0, atol=1e-6)
    assert model.lm_head.weight.storage is not storage  # the untie stays


def test_merging_two_different_adapters_of_one_storage_is_refused():
    model = gpt2()
    add_lora(model, ["wte", "lm_head"])
    randomize_adapters(model)
    before = state(model)
    with pytest.raises(AliasError, match="which has another adapter"):
        merge(model)
    assert state(model) == before
    merge(model, untie=True)  # the embedding keeps the storage, the head gets a copy
    assert model.lm_head.weight.storage is not model.transformer.wte.weight.storage


def test_a_shared_adapter_merges_into_the_one_storage():
    model = gpt2()
    add_lora(model, "lm_head", share_tied=True)
    randomize_adapters(model)
    x = ids()
    adapted = logits(model, x)
    assert merge(model) == [WTE, HEAD]
    assert model.aliases()[WTE] == [HEAD]
    np.testing.assert_allclose(logits(model, x), adapted, rtol=0, atol=1e-4)


def adapted_c_attn():
    """A model with random adapters on c_attn, a batch and the logits without and with."""
    model = gpt2()
    x = ids()
    base = logits(model, x)
    add_lora(model, "c_attn")
    randomize_adapters(model)
    return model, x, base, logits(model, x)


def test_disable_evaluates_the_base_and_enable_the_adapter():
    model, x, base, adapted = adapted_c_attn()
    disable(model)
    np.testing.assert_array_equal(logits(model, x), base)
    with pytest.raises(TiegradError, match="disabled; enable first"):
        merge(model)
    enable(model)
    np.testing.assert_array_equal(logits(model, x), adapted)
    merge(model)
    before = state(model)
    with pytest.raises(TiegradError, match="unmerge"):
        disable(model)
    assert state(model) == before


def test_named_adapters_one_active_and_training():
    model = gpt2()
    x = ids()
    add_lora(model, "c_attn", rank=2)
    add_lora(model, ["c_attn", "lm_head"], rank=3, name="second")
    assert adapter_names(model) == ["default", "second"]
    assert active_adapter(model) == "default"  # a later adapter is added inactive
    randomize_adapters(model)
    first = logits(model, x)
    second_flags = [p.requires_grad for path, p in model.named_slots() if ".second." in path]
    assert second_flags and not any(second_flags)
    set_adapter(model, "second")
    assert active_adapter(model) == "second"
    trainable = {path for path, p in model.named_slots() if p.requires_grad}
    assert trainable == {path for path, _ in model.named_slots() if ".lora.second." in path}
    assert not np.allclose(logits(model, x), first)
    set_adapter(model, "default")
    np.testing.assert_array_equal(logits(model, x), first)  # lm_head: no "default" adapter
    before = state(model)
    with pytest.raises(SlotError, match="no adapter 'third'"):
        set_adapter(model, "third")
    assert state(model) == before


def test_unload_restores_the_layers_and_keeps_a_merge():
    model, x, base, adapted = adapted_c_attn()
    unload(model)
    assert type(model.transformer.h[0].attn.c_attn) is Conv1D
    assert [p for p, _ in model.named_slots()] == [p for p, _ in gpt2().named_slots()]
    np.testing.assert_array_equal(logits(model, x), base)
    add_lora(model, "c_attn")
    randomize_adapters(model)
    merge(model)
    unload(model)
    np.testing.assert_allclose(logits(model, x), adapted, rtol=0, atol=1e-5)


@pytest.mark.parametrize(
    "kwargs, error, message",
    [
        (dict(targets="nope"), SlotError, "target 'nope' matches no path of GPT2"),
        (dict(targets="transformer.ln_f"), SlotError, "names transformer.ln_f, "),
        (dict(targets="*.bias"), SlotError, "which no adapter can take: expected the weight"),
        (dict(targets=[]), SlotError, "non-empty collection"),
        (dict(targets="c_attn", rank=0), HyperparameterError, "rank must be >= 1, got 0"),
        (dict(targets="c_attn", rank=True), HyperparameterError, "rank must be an integer"),
        (dict(targets="c_attn", alpha=-1.0), HyperparameterError, "alpha"),
        (dict(targets="c_attn", dropout=1.0), HyperparameterError, "dropout must be in [0, 1)"),
        (dict(targets="c_attn", name="a.b"), ConfigError, "an adapter name is an identifier"),
        (dict(targets="c_attn", name="merged"), ConfigError, "got 'merged'"),
        (dict(targets="c_attn", name="first"), SlotError, "already has an adapter 'first'"),
    ],
)
def test_bad_input_is_named_and_changes_nothing(kwargs, error, message):  # C6
    model = gpt2()
    add_lora(model, "c_fc", name="first")
    before = state(model)
    rng = np.random.default_rng(5)
    rng_state = copy.deepcopy(rng.bit_generator.state)
    with pytest.raises(error) as e:
        add_lora(model, rng=rng, **kwargs)
    assert message in str(e.value)
    assert state(model) == before
    assert rng.bit_generator.state == rng_state


def test_a_layer_registered_at_two_paths_is_named_at_both_or_neither():
    layer = tnn.Linear(4, 4)
    model = tnn.Sequential(layer, tnn.ReLU(), layer)
    before = state(model)
    with pytest.raises(AliasError, match="'0' and '2' are one layer"):
        add_lora(model, "0")
    assert state(model) == before
    assert add_lora(model, ["0", "2"], rank=2) == ["0.weight", "2.weight"]
    assert isinstance(model[0], LoRALinear) and model[0] is model[2]


def test_checkpoints_resume_adapter_training_bit_exact(tmp_path):  # C9
    def setup():
        model = gpt2()
        add_lora(model, ["c_attn", "lm_head"], rank=2)
        return model, adamw(model)

    straight, opt = setup()
    run_steps(straight, opt, 0, 5)
    model, opt = setup()
    run_steps(model, opt, 0, 3)
    tiegrad.save(tmp_path / "run.safetensors", model, opt)
    resumed, ropt = setup()
    assert tiegrad.load(tmp_path / "run.safetensors", resumed, ropt).step == 3
    run_steps(resumed, ropt, 3, 5)
    for (path, a), (_, b) in zip(straight.named_slots(), resumed.named_slots()):
        np.testing.assert_array_equal(a.value, b.value, err_msg=path)


def test_dropout_applies_to_the_adapter_input_in_training_only():
    model = gpt2()
    add_lora(model, "c_attn", dropout=0.5)
    randomize_adapters(model)
    x = ids()
    trained = [model(EagerSession(seed=k), x).numpy() for k in (0, 1)]
    assert not np.allclose(trained[0], trained[1])
    model.eval()
    np.testing.assert_array_equal(
        model(EagerSession(seed=0), x).numpy(), model(EagerSession(seed=1), x).numpy()
    )


def test_a_copy_of_an_adapted_model_is_independent():
    model = gpt2()
    add_lora(model, "c_attn")
    randomize_adapters(model)
    twin = copy.deepcopy(model)
    x = ids()
    np.testing.assert_array_equal(logits(twin, x), logits(model, x))
    disable(twin)
    assert not np.array_equal(logits(twin, x), logits(model, x))


@pytest.mark.parametrize("call", [lambda m: add_lora(m, "c_attn"), merge, disable, unload])
def test_a_model_that_is_not_a_module_is_named(call):
    with pytest.raises(TiegradError, match="expected a tiegrad Module, got ParamList"):
        call(gpt2().parameters())


def test_adapters_train_on_a_device_session_as_on_the_host():  # C7
    pytest.importorskip("torch")
    host, device = gpt2(), gpt2()
    for model in (host, device):
        add_lora(model, ["c_attn", "lm_head", "wte"], rank=2)
        randomize_adapters(model)
    device.to("torch:cpu")
    opts = {"host": adamw(host), "device": adamw(device)}
    for step in range(3):
        batch = ids((2, 10), seed=step)
        for kind, model in (("host", host), ("device", device)):
            s = EagerSession(device=None if kind == "host" else "torch:cpu")
            opts[kind].step(s.backward(model.loss(s, batch[:, :-1], batch[:, 1:])))
    for (path, a), (_, b) in zip(host.named_slots(), device.named_slots()):
        np.testing.assert_allclose(b.value_synced(), a.value, rtol=0, atol=1e-5, err_msg=path)
    merge(host, untie=True)
    merge(device, untie=True)  # reads the synced values (C7)
    for (path, a), (_, b) in zip(host.named_slots(), device.named_slots()):
        np.testing.assert_allclose(b.value_synced(), a.value, rtol=0, atol=1e-5, err_msg=path)
