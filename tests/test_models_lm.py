"""``TiedLM`` and ``SharedBlockLM`` against equivalent PyTorch models with the same ties.

Loss and every gradient agree in float64; a tied weight frozen at its head use receives
exactly the gradient PyTorch gives when that use is written ``.detach()``; after 10
AdamW steps the parameters still agree (C3, C4, C5).
"""

from __future__ import annotations

import re

import numpy as np
import pytest

from tiegrad import ConfigError, DTypeError, EagerSession, HyperparameterError, ShapeError
from tiegrad import nn as tnn
from tiegrad.models import SharedBlockLM, TiedLM

torch = pytest.importorskip("torch")
from nn_reference import TorchTiedLM, assert_grads_match, copy_to_torch  # noqa: E402

V, T = 13, 6
SMALL = dict(vocab_size=V, d_model=8, n_heads=2, max_seq_len=T, dtype="float64")


def build(kind: str):
    if kind == "tied":
        return TiedLM(n_layers=2, **SMALL), False
    return SharedBlockLM(n_repeats=3, **SMALL), True


def batch(seed: int, b: int = 3):
    r = np.random.default_rng(seed)
    return r.integers(0, V, (b, T)), r.integers(0, V, (b, T))


def perturb(model) -> None:
    """Move LayerNorms and zero biases off their defaults so their gradients are tested."""
    r = np.random.default_rng(99)
    for _, p in model.named_parameters():
        p.set_value(p.value + 0.05 * r.normal(size=p.shape))


def torch_loss(ref, idx, targets):
    logits = ref(torch.from_numpy(idx))
    return torch.nn.functional.cross_entropy(
        logits.reshape(-1, V), torch.from_numpy(targets).reshape(-1)
    )


@pytest.mark.parametrize("kind", ["tied", "shared"])
@pytest.mark.parametrize("frozen_head", [False, True])
def test_loss_and_every_gradient_match_pytorch(kind, frozen_head):
    model, shared = build(kind)
    perturb(model)
    if frozen_head:
        tnn.tie(model, "lm_head.weight", "embed.weight", requires_grad=False)
    ref = TorchTiedLM(model.config, shared, detach_head=frozen_head)
    copy_to_torch(model, ref)
    idx, targets = batch(0)
    s = EagerSession()
    loss = model.loss(s, idx, targets)
    grads = s.backward(loss)
    tl = torch_loss(ref, idx, targets)
    tl.backward()
    assert abs(loss.item() - tl.item()) < 1e-12
    assert_grads_match(model.named_gradients(grads), ref)


@pytest.mark.parametrize("kind, frozen_head", [("tied", False), ("shared", False), ("tied", True)])
def test_ten_adamw_steps_keep_matching_pytorch(kind, frozen_head):
    from tiegrad.optim import AdamW

    model, shared = build(kind)
    if frozen_head:
        model.freeze("lm_head.weight")
    ref = TorchTiedLM(model.config, shared, detach_head=frozen_head)
    copy_to_torch(model, ref)
    hp = dict(lr=3e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    opt = AdamW(model.parameters(), **hp)
    topt = torch.optim.AdamW(ref.parameters(), **hp)
    s = EagerSession()
    for step in range(10):
        idx, targets = batch(step)
        s.reset()
        opt.step(s.backward(model.loss(s, idx, targets)))
        topt.zero_grad()
        torch_loss(ref, idx, targets).backward()
        topt.step()
    assert model.lm_head.weight.storage is model.embed.weight.storage
    check = TorchTiedLM(model.config, shared)
    copy_to_torch(model, check)
    for (name, a), (_, b) in zip(check.named_parameters(), ref.named_parameters()):
        np.testing.assert_allclose(
            a.detach().numpy(), b.detach().numpy(), rtol=1e-8, atol=1e-10, err_msg=name
        )


def test_unique_parameter_counts_match_pytorch():
    for kind in ("tied", "shared"):
        model, shared = build(kind)
        ref = TorchTiedLM(model.config, shared)
        assert model.num_parameters() == sum(p.numel() for p in ref.parameters())
        assert model.num_parameters(unique=False) == model.num_parameters() + V * 8
    tied, _ = build("tied")
    shared_model, _ = build("shared")
    block = sum(p.size for _, p in shared_model.block.named_parameters())
    assert tied.num_parameters() - shared_model.num_parameters() == block  # 2 blocks vs 1


def test_ties_survive_param_list_and_freezing():
    model = TiedLM(**SMALL)
    pl = model.param_list()
    last = len(pl) - 1
    assert pl[last].name == "lm_head.weight" and pl[last].storage is pl[0].storage
    assert pl.canonical_slot_indices()[last] == 0
    model.freeze("embed.weight")
    pl = model.param_list()
    assert pl[last].storage is pl[0].storage
    assert pl.canonical_slot_indices()[0] is None and pl.canonical_slot_indices()[last] == last
    assert model.aliases() == {"embed.weight": ["lm_head.weight"]}


def test_config_rebuilds_the_same_model():
    for model in (TiedLM(**SMALL, seed=3), SharedBlockLM(**SMALL, seed=3, dropout=0.1)):
        again = type(model)(**model.config)
        assert again.config == model.config
        for (pa, a), (pb, b) in zip(model.named_slots(), again.named_slots()):
            assert pa == pb
            np.testing.assert_array_equal(a.value, b.value)
        assert again.aliases() == model.aliases()
    assert not np.array_equal(TiedLM(**SMALL, seed=4).embed.weight.value, model.embed.weight.value)


def test_dropout_draws_from_the_session_and_is_off_in_eval():
    model = TiedLM(**{**SMALL, "dropout": 0.3})
    idx, _ = batch(1)

    def logits(seed):
        return model(EagerSession(seed=seed), idx).numpy()

    np.testing.assert_array_equal(logits(1), logits(1))
    assert not np.allclose(logits(1), logits(2))
    model.eval()
    np.testing.assert_array_equal(logits(1), logits(2))


def test_generate_samples_from_the_generator_and_restores_the_mode():
    model = TiedLM(**SMALL)
    prompt = np.array([[1, 2], [3, 4]])
    out = model.generate(prompt, 9, rng=np.random.default_rng(5))
    assert out.shape == (2, 11) and out.dtype.kind == "i"
    np.testing.assert_array_equal(out[:, :2], prompt)
    assert (out >= 0).all() and (out < V).all()
    np.testing.assert_array_equal(out, model.generate(prompt, 9, rng=np.random.default_rng(5)))
    assert model.training
    greedy = model.generate(np.array([1, 2]), 1, temperature=0)
    s = EagerSession()
    assert greedy[-1] == int(np.argmax(model(s, np.array([[1, 2]])).numpy()[0, -1]))
    top1 = model.generate(np.array([1, 2]), 3, top_k=1, rng=np.random.default_rng(0))
    np.testing.assert_array_equal(top1, model.generate(np.array([1, 2]), 3, temperature=0))


def test_bad_input_names_the_model():
    model = TiedLM(**SMALL)
    s = EagerSession()
    with pytest.raises(
        ShapeError, match=r"TiedLM\(vocab_size=13.*input has shape \(2, 7\), expected \(B, T\)"
    ):
        model(s, np.zeros((2, T + 1), dtype=np.int64))
    with pytest.raises(ShapeError, match=r"input has shape \(6,\)"):
        model(s, np.zeros(T, dtype=np.int64))
    with pytest.raises(DTypeError):
        model(s, np.zeros((1, 2)))
    with pytest.raises(HyperparameterError, match="temperature"):
        model.generate(np.array([1]), 2, temperature=-1.0)
    with pytest.raises(HyperparameterError, match="top_k"):
        model.generate(np.array([1]), 2, top_k=V + 1)
    with pytest.raises(DTypeError, match="integer ids"):
        model.generate(np.array([1.0]), 2)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(top_k=2.5), "generate: top_k must be an integer, got 2.5"),
        (dict(top_k=True), "generate: top_k must be an integer, got True"),
        (dict(max_new_tokens=True), "generate: max_new_tokens must be an integer, got True"),
        (dict(max_new_tokens=-1), "generate: max_new_tokens must be >= 0, got -1"),
        (dict(temperature=None), "generate: temperature must be a real number, got None"),
        (dict(temperature=float("inf")), "generate: temperature must be finite, got inf"),
    ],
)
def test_generate_names_a_bad_argument(kwargs, message):
    model = TiedLM(**SMALL)
    args = {"idx": np.array([1, 2]), "max_new_tokens": 2, **kwargs}
    with pytest.raises(HyperparameterError, match=re.escape(message)):
        model.generate(**args)


@pytest.mark.parametrize(
    "prompt, shape", [([], "(0,)"), (np.array([], dtype=np.int64), "(0,)"), ([[]], "(1, 0)")]
)
def test_generate_reports_an_empty_prompt_as_a_shape(prompt, shape):
    with pytest.raises(ShapeError, match=re.escape(f"generate input has shape {shape}, expected")):
        TiedLM(**SMALL).generate(prompt, 3)


def test_generate_takes_numpy_scalars():
    model = TiedLM(**SMALL)
    args = dict(rng=np.random.default_rng(3))
    out = model.generate([1, 2], np.int64(3), np.float32(0.5), top_k=np.int64(4), **args)
    again = model.generate([1, 2], 3, 0.5, top_k=4, rng=np.random.default_rng(3))
    np.testing.assert_array_equal(out, again)


def test_model_runs_on_a_torch_device_session_with_mirrored_storages():
    from tiegrad import DeviceError

    model = TiedLM(**SMALL)
    idx, targets = batch(2)
    s = EagerSession()
    host_loss = model.loss(s, idx, targets)
    host_grads = model.named_gradients(s.backward(host_loss))
    try:
        model.to("torch:cpu")
        d = EagerSession(device="torch:cpu")
    except DeviceError as e:
        pytest.skip(f"no torch backend: {e}")
    assert model.lm_head.weight.storage.mirror is model.embed.weight.storage.mirror
    loss = model.loss(d, idx, targets)
    assert abs(loss.item() - host_loss.item()) < 1e-12
    grads = model.named_gradients(d.backward(loss))
    assert set(grads) == set(host_grads)
    for path, g in grads.items():
        np.testing.assert_allclose(g.numpy(), host_grads[path], rtol=1e-9, atol=1e-12, err_msg=path)
    model.to("cpu")
    assert model.embed.weight.storage.mirror is None


CACHED = [
    (TiedLM, dict(n_layers=2)),
    (SharedBlockLM, dict(n_repeats=3)),
]


@pytest.mark.parametrize("cls, depth", CACHED, ids=["TiedLM", "SharedBlockLM"])
def test_a_kv_cache_gives_the_full_forwards_logits_and_tokens(cls, depth):
    model = cls(13, d_model=16, n_heads=4, max_seq_len=24, seed=1, **depth)
    ids = np.random.default_rng(0).integers(0, 13, (2, 7))
    full = model(EagerSession(), ids).numpy()
    cache, s = model.new_cache(), EagerSession()
    parts = [model(s, ids[:, :3], cache=cache).numpy(), model(s, ids[:, 3:], cache=cache).numpy()]
    np.testing.assert_allclose(np.concatenate(parts, axis=1), full, rtol=1e-5, atol=1e-6)
    assert cache.length == 7
    for temperature in (0.0, 0.8):
        cached = model.generate(ids, 15, temperature, rng=np.random.default_rng(3))
        plain = model.generate(ids, 15, temperature, rng=np.random.default_rng(3), use_cache=False)
        np.testing.assert_array_equal(cached, plain)


def test_a_cache_past_max_seq_len_is_refused_and_left_as_it_was():
    model = TiedLM(13, d_model=16, n_layers=1, n_heads=4, max_seq_len=8, seed=1)
    cache, s = model.new_cache(), EagerSession()
    model(s, np.zeros((1, 6), np.int64), cache=cache)
    with pytest.raises(ShapeError, match="cannot take 3 more"):
        model(s, np.zeros((1, 3), np.int64), cache=cache)
    assert cache.length == 6


def test_a_cache_with_a_padding_mask_is_refused():
    block = tnn.TransformerBlock(8, 2, causal=True, rng=np.random.default_rng(0))
    model = TiedLM(13, d_model=8, n_layers=1, n_heads=2, max_seq_len=8, seed=1)
    x = np.zeros((1, 3, 8), np.float32)
    with pytest.raises(ConfigError, match="KV cache"):
        block(EagerSession(), x, np.zeros((1, 3), bool), model.new_cache())
