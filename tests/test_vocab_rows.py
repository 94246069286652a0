"""Growing a tied vocabulary (``resize_vocab``) and row masks on a storage (issue 49, item 4).

Tiny tied Qwen2- and Llama-style models (and an untied Llama) are made by transformers'
config classes and saved with ``save_pretrained``; tiegrad grows them, trains only the
new rows with every optimizer rule on the host and on a torch device, saves and resumes
checkpoints and exports folders transformers loads back.
"""

from __future__ import annotations

import os

import numpy as np
import pytest

os.environ["HF_HUB_OFFLINE"] = "1"
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import tiegrad  # noqa: E402
from tiegrad import CheckpointError, ConfigError, EagerSession, TiegradError  # noqa: E402
from tiegrad.models import from_pretrained, resize_vocab  # noqa: E402
from tiegrad.nn import train_rows, trained_rows  # noqa: E402
from tiegrad.optim import SGD, Adagrad, Adam, AdamW, RMSprop, clip_grad_norm  # noqa: E402

EMBED, HEAD = "model.embed_tokens.weight", "lm_head.weight"
OLD, NEW = 40, 46
TINY = dict(
    vocab_size=OLD, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
    num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=32,
)  # fmt: skip
KINDS = {
    "qwen2-tied": ("Qwen2Config", True),
    "llama-tied": ("LlamaConfig", True),
    "llama-untied": ("LlamaConfig", False),
}
#: name -> optimizer with momentum, state and weight decay where the rule has them.
RULES = {
    "sgd": lambda ps: SGD(ps, lr=0.05, momentum=0.9, weight_decay=0.1),
    "adam": lambda ps: Adam(ps, lr=0.01, weight_decay=0.1),
    "adamw": lambda ps: AdamW(ps, lr=0.01, weight_decay=0.1),
    "rmsprop": lambda ps: RMSprop(ps, lr=0.01, momentum=0.5, weight_decay=0.1),
    "adagrad": lambda ps: Adagrad(ps, lr=0.05, weight_decay=0.1),
}
X = np.random.default_rng(1).integers(0, NEW, (2, 7))
DEVICE = os.environ.get("TIEGRAD_TEST_DEVICE", "torch:cpu")


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("vocab")
    out = {}
    for name, (kind, tied) in KINDS.items():
        torch.manual_seed(0)
        config = getattr(transformers, kind)(**TINY, tie_word_embeddings=tied)
        transformers.AutoModelForCausalLM.from_config(config).save_pretrained(root / name)
        out[name] = root / name
    return out


def grown(folder, train="new"):
    model = from_pretrained(folder)
    resize_vocab(model, NEW, train=train)
    return model


def values(model) -> dict[str, np.ndarray]:
    return {path: np.array(p.value) for path, p in model.named_slots()}


def steps(model, optimizer, n, device=None, clip=None):
    for _ in range(n):
        s = EagerSession(device=device) if device else EagerSession()
        loss = model.loss(s, X[:, :-1], X[:, 1:])
        grads = s.backward(loss)
        if clip is not None:
            grads = optimizer.canonical_gradients(grads)
            clip_grad_norm(grads, clip)
        optimizer.step(grads)
    model.param_list().sync()


def test_resize_grows_the_one_tied_storage_with_the_mean_row(folders):
    model = from_pretrained(folders["qwen2-tied"])
    before = np.array(model.get_parameter(EMBED).value)
    resize_vocab(model, NEW)
    embed, head = model.get_parameter(EMBED), model.get_parameter(HEAD)
    assert embed.storage is head.storage and embed.shape == (NEW, 16)
    assert np.array_equal(embed.value[:OLD], before)
    mean = before.mean(axis=0, dtype=np.float64).astype(np.float32)
    assert np.array_equal(embed.value[OLD:], np.broadcast_to(mean, (NEW - OLD, 16)))
    assert model.vocab_size == model.config["vocab_size"] == NEW
    assert model(EagerSession(), X).shape == (2, 7, NEW)
    assert trained_rows(model, EMBED) is None  # train="all": every row


def test_resize_untied_grows_both_and_the_transformers_name_works(folders):
    model = from_pretrained(folders["llama-untied"])
    head_before = np.array(model.get_parameter(HEAD).value)
    layer = model.resize_token_embeddings(NEW, init="zeros", train="new")
    embed, head = model.get_parameter(EMBED), model.get_parameter(HEAD)
    assert layer is model.model.embed_tokens and layer.num_embeddings == NEW
    assert embed.storage is not head.storage and head.shape == (NEW, 16)
    assert np.array_equal(head.value[:OLD], head_before) and not head.value[OLD:].any()
    assert list(trained_rows(model, HEAD)) == list(range(OLD, NEW))


@pytest.mark.parametrize("rule", list(RULES))
@pytest.mark.parametrize("kind", ["qwen2-tied", "llama-tied"])
def test_only_the_new_rows_train_with_every_rule(folders, kind, rule):
    model = grown(folders[kind])
    before = values(model)
    optimizer = RULES[rule](model.parameters())
    steps(model, optimizer, 4, clip=0.5)
    after = values(model)
    for path in (EMBED, HEAD):  # both uses read the one storage
        assert np.array_equal(after[path][:OLD], before[path][:OLD]), path
        assert not np.allclose(after[path][OLD:], before[path][OLD:]), path
    assert not np.array_equal(after["model.norm.weight"], before["model.norm.weight"])
    for entry in optimizer.state.values():  # state of the trained rows alone
        shapes = {np.shape(v) for k, v in entry.items() if k != "step"}
        assert (OLD, 16) not in shapes and (NEW, 16) not in shapes


@pytest.mark.parametrize("rule", ["sgd", "adamw"])
def test_the_device_route_leaves_the_old_rows_bit_identical(folders, rule):
    model = grown(folders["qwen2-tied"])
    before = values(model)
    steps(model, RULES[rule](model.parameters()), 3, device=DEVICE)
    after = values(model)
    assert np.array_equal(after[EMBED][:OLD], before[EMBED][:OLD])
    assert not np.allclose(after[EMBED][OLD:], before[EMBED][OLD:])


def test_clip_norm_and_weight_decay_count_only_the_trained_rows(folders):
    model = grown(folders["llama-tied"])
    model.freeze("model.layers.*")  # keep the hand computation short
    plist = model.param_list()
    s = EagerSession()
    grads = s.backward(model.loss(s, X[:, :-1], X[:, 1:]))
    whole = {path: np.array(g) for path, g in model.named_gradients(grads).items()}
    rows = np.arange(OLD, NEW)
    by_hand = np.sqrt(
        np.sum(whole[EMBED][rows].astype(np.float64) ** 2)
        + sum(np.sum(whole[p].astype(np.float64) ** 2) for p in ("model.norm.weight",))
    )
    optimizer = SGD(plist, lr=0.1, weight_decay=0.5)
    canonical = optimizer.canonical_gradients(grads)
    assert np.isclose(clip_grad_norm(canonical, 1e9), by_hand, rtol=1e-6)
    p0 = np.array(model.get_parameter(EMBED).value)
    optimizer.step(canonical)
    p1 = model.get_parameter(EMBED).value
    expected = p0[rows] - np.float32(0.1) * (whole[EMBED][rows] + np.float32(0.5) * p0[rows])
    assert np.allclose(p1[rows], expected, rtol=1e-6, atol=1e-7)
    assert np.array_equal(p1[:OLD], p0[:OLD])


def test_a_checkpoint_carries_the_mask_and_resume_continues_the_run(folders, tmp_path):
    straight = grown(folders["qwen2-tied"])
    optimizer = RULES["adamw"](straight.parameters())
    steps(straight, optimizer, 2)
    path = tmp_path / "ck.safetensors"
    tiegrad.save(path, straight, optimizer)
    steps(straight, optimizer, 2)

    resumed = grown(folders["qwen2-tied"])
    opt2 = RULES["adamw"](resumed.parameters())
    tiegrad.load(path, resumed, opt2)
    assert list(trained_rows(resumed, EMBED)) == list(range(OLD, NEW))
    steps(resumed, opt2, 2)
    for path_, value in values(straight).items():
        assert np.array_equal(values(resumed)[path_], value), path_


def test_a_checkpoint_refuses_a_model_with_another_mask_and_changes_nothing(folders, tmp_path):
    model = grown(folders["qwen2-tied"])
    path = tmp_path / "ck.safetensors"
    tiegrad.save(path, model)
    other = grown(folders["qwen2-tied"], train="all")
    other.get_parameter(EMBED).set_value(np.zeros((NEW, 16), np.float32))
    before = values(other)
    with pytest.raises(CheckpointError, match=r"row mask mismatch at slot 0 .*every row"):
        tiegrad.load(path, other)
    assert trained_rows(other, EMBED) is None
    assert all(np.array_equal(values(other)[p], v) for p, v in before.items())


@pytest.mark.parametrize("kind", ["qwen2-tied", "llama-untied"])
def test_the_export_loads_in_transformers_with_the_new_size_and_tie(folders, kind, tmp_path):
    model = grown(folders[kind])
    steps(model, RULES["adamw"](model.parameters()), 2)
    model.save_pretrained(tmp_path / "out")
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    assert hf.config.vocab_size == NEW
    assert hf.config.tie_word_embeddings is KINDS[kind][1]
    tied = hf.lm_head.weight is hf.model.embed_tokens.weight
    assert tied is KINDS[kind][1]
    with torch.no_grad():
        expected = hf(torch.tensor(X)).logits.numpy()
    assert np.allclose(model(EagerSession(), X).numpy(), expected, atol=1e-5)


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda m: resize_vocab(m, OLD - 1), "shrinking is not supported"),
        (lambda m: resize_vocab(m, 50.0), "new_size must be an integer"),
        (lambda m: resize_vocab(m, NEW, init="kaiming"), "init must be one of"),
        (lambda m: resize_vocab(m, NEW, train="old"), "train must be one of"),
        (lambda m: train_rows(m, EMBED, [3, 40]), r"rows 40 are outside \[-40, 40\)"),
        (lambda m: train_rows(m, EMBED, [3, 3]), "rows 3 are given more than once"),
        (lambda m: train_rows(m, EMBED, []), "selects no row"),
        (lambda m: train_rows(m, EMBED, np.ones(39, bool)), "needs 40 flags, got 39"),
        (lambda m: train_rows(m, "model.norm.weight", [[1]]), "expected a 1-D list"),
        (lambda m: train_rows(m, "nope.weight", [1]), "no parameter at path 'nope.weight'"),
    ],
)
def test_every_refusal_is_one_library_error_that_changes_nothing(folders, call, match):
    model = from_pretrained(folders["qwen2-tied"])
    train_rows(model, EMBED, [1, 2])
    before, storage = values(model), model.get_parameter(EMBED).storage
    with pytest.raises(TiegradError, match=match):
        call(model)
    assert model.get_parameter(EMBED).storage is storage is model.get_parameter(HEAD).storage
    assert list(trained_rows(model, EMBED)) == [1, 2]
    assert model.vocab_size == model.config["vocab_size"] == OLD
    assert all(np.array_equal(values(model)[p], v) for p, v in before.items())


def test_resize_refuses_a_lora_adapter_on_the_head(folders):
    from tiegrad.adapters import add_lora

    model = from_pretrained(folders["llama-untied"])
    add_lora(model, ["lm_head"], rank=2)
    with pytest.raises(ConfigError, match="LoRA adapters on the embedding or the head"):
        resize_vocab(model, NEW)
    assert model.vocab_size == OLD


def test_a_sharded_optimizer_refuses_a_row_mask(folders):
    from tiegrad.distributed.sharding import ShardPlan
    from tiegrad.errors import DistributedError

    model = grown(folders["qwen2-tied"])
    with pytest.raises(DistributedError, match=f"'{EMBED}' has a row mask"):
        ShardPlan(model.param_list(), 2, 0)


def test_a_mask_set_or_cleared_between_steps_starts_the_state_afresh(folders):
    model = grown(folders["qwen2-tied"], train="all")
    optimizer = RULES["adam"](model.parameters())
    steps(model, optimizer, 2)
    assert optimizer.state[0]["exp_avg"].shape == (NEW, 16)
    train_rows(model, EMBED, [5, 6])
    before = values(model)[EMBED]
    steps(model, optimizer, 2)
    after = values(model)[EMBED]
    assert optimizer.state[0]["exp_avg"].shape == (2, 16) and optimizer.state[0]["step"] == 2
    assert np.array_equal(np.delete(after, [5, 6], 0), np.delete(before, [5, 6], 0))
    train_rows(model, EMBED, None)
    steps(model, optimizer, 1)
    assert optimizer.state[0]["exp_avg"].shape == (NEW, 16) and optimizer.state[0]["step"] == 1


def test_a_grown_gpt2_exports_to_transformers_with_the_new_size(tmp_path):
    torch.manual_seed(0)
    config = transformers.GPT2Config(
        vocab_size=OLD, n_positions=16, n_embd=16, n_layer=1, n_head=2, bos_token_id=0,
        eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
    )  # fmt: skip
    transformers.GPT2LMHeadModel(config).save_pretrained(tmp_path / "gpt2")
    model = from_pretrained(tmp_path / "gpt2")
    model.resize_token_embeddings(NEW, train="new")
    steps(model, RULES["sgd"](model.parameters()), 2)
    model.save_pretrained(tmp_path / "out")
    hf = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "out").eval()
    assert hf.config.vocab_size == NEW and hf.lm_head.weight is hf.transformer.wte.weight
    with torch.no_grad():
        expected = hf(torch.tensor(X)).logits.numpy()
    assert np.allclose(model(EagerSession(), X).numpy(), expected, atol=1e-5)


@pytest.mark.parametrize("device", [None, DEVICE])
def test_plain_sgd_steps_honour_the_mask(device):
    p = tiegrad.Param(np.random.default_rng(0).normal(size=(5, 3)).astype(np.float32))
    p.storage.train_rows([1, 3])
    before = np.array(p.value)
    s = EagerSession(device=device) if device else EagerSession()
    x = s.use(p)
    grads = s.backward((x * x).sum())
    s.sgd_step(0.1, grads)
    tiegrad.ParamList([p]).sgd_step(0.1, [np.ones((5, 3), np.float32)])
    after = p.value_synced()
    assert np.array_equal(after[[0, 2, 4]], before[[0, 2, 4]])
    assert np.allclose(after[[1, 3]], before[[1, 3]] * 0.8 - 0.1)


@pytest.mark.parametrize(
    "rows, match",
    [
        ({"0": [40, 99]}, r"row mask of slot 0 .*rows 99 are outside \[-46, 46\)"),
        ({"0": [41, 41]}, "rows 41 are given more than once"),
        ({"0": [-1]}, r"rows -1 < 0"),
        ({"0": "40"}, "expected a list of row indices"),
        ({"999": [0]}, "'999' is not the storage slot of a parameter"),
    ],
    ids=["range", "twice", "negative", "type", "slot"],
)
def test_a_crafted_row_mask_is_refused_and_changes_nothing(folders, tmp_path, rows, match):
    from test_checkpoint_file import read_doc, write_doc

    model = grown(folders["qwen2-tied"])
    path = tmp_path / "ck.safetensors"
    tiegrad.save(path, model)
    tensors, doc = read_doc(path)
    write_doc(path, tensors, {**doc, "rows": rows})
    model.get_parameter(EMBED).set_value(np.zeros((NEW, 16), np.float32))
    before = values(model)
    with pytest.raises(CheckpointError, match=match):
        tiegrad.load(path, model)
    assert all(np.array_equal(values(model)[p], v) for p, v in before.items())
    assert list(trained_rows(model, EMBED)) == list(range(OLD, NEW))
