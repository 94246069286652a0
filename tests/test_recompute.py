"""Exact recomputation: ``tiegrad.nn.checkpoint`` and the models' ``recompute`` switch.

The gradients with recomputation are compared bit for bit (``np.array_equal``) with
those of the same forward without it, on the same machine and code path: dropout on
where the model has it, ties across blocks (one block used six times), per-use freezing
and LoRA adapters inside a recomputed block, nested checkpoints, and a parameter written
between forward and backward (C2), where PyTorch's ``torch.utils.checkpoint`` gives a
gradient no forward computed.
"""

from __future__ import annotations

import os
import tracemalloc

import numpy as np
import pytest

from tiegrad import (
    ConfigError,
    EagerSession,
    HyperparameterError,
    Param,
    ShapeError,
    TapeError,
    ops,
)
from tiegrad.adapters import add_lora
from tiegrad.models import GPT2, LlamaLM, SharedBlockLM, TiedLM
from tiegrad.nn import Linear, Module, checkpoint, tie

os.environ["HF_HUB_OFFLINE"] = "1"

VOCAB, B, T = 40, 2, 12


def _batch(seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    return rng.integers(0, VOCAB, (B, T)), rng.integers(0, VOCAB, (B, T))


def _step(model, recompute: bool, device: str | None = None):
    """Loss, tape length before backward and every slot's gradient (by path) of one
    seeded forward and backward, with or without recomputation."""
    model.recompute = recompute
    s = EagerSession(device=device, seed=7)
    loss = model.loss(s, *_batch())
    nodes = len(s)
    g = s.backward(loss)
    grads = {}
    for path, p in model.named_parameters():
        if p.storage is not None and p.requires_grad:
            grad = g.storage_gradient(p.storage)
            grads[path] = None if grad is None else s.backend.to_numpy(grad).copy()
    return loss.item(), nodes, grads


def _assert_identical(model, device: str | None = None) -> None:
    plain_loss, plain_nodes, plain = _step(model, False, device)
    loss, nodes, again = _step(model, True, device)
    assert loss == plain_loss
    assert nodes < plain_nodes  # the blocks are single nodes: recomputation happened
    assert plain.keys() == again.keys()
    for path in plain:
        assert (plain[path] is None) == (again[path] is None), path
        if plain[path] is not None:
            assert np.array_equal(plain[path], again[path]), path


def test_tiedlm_gradients_bit_identical_with_dropout():
    _assert_identical(TiedLM(VOCAB, d_model=16, n_layers=2, n_heads=2, max_seq_len=T, dropout=0.2))


def test_tiedlm_on_a_torch_device_bit_identical():
    pytest.importorskip("torch")
    model = TiedLM(VOCAB, d_model=16, n_layers=2, n_heads=2, max_seq_len=T, dropout=0.2)
    _assert_identical(model.to("torch:cpu"), "torch:cpu")


def test_shared_block_used_six_times_ties_across_recomputed_blocks():
    model = SharedBlockLM(VOCAB, d_model=16, n_heads=2, n_repeats=6, max_seq_len=T, dropout=0.1)
    _assert_identical(model)
    model.recompute = True
    s = EagerSession(seed=7)
    g = s.backward(model.loss(s, *_batch()))
    qkv = [
        grp for grp in g.parameter_groups() if grp.storage is model.block.attn.qkv.weight.storage
    ]
    assert len(qkv) == 1 and len(qkv[0].leaves) == 6  # six uses, one group (C4)


def test_gpt2_gradients_bit_identical_with_its_three_dropouts():
    model = GPT2(
        vocab_size=VOCAB, n_positions=T, n_embd=16, n_layer=2, n_head=2,
        resid_pdrop=0.1, embd_pdrop=0.1, attn_pdrop=0.1,
    )  # fmt: skip
    _assert_identical(model)


def test_llama_from_a_transformers_folder_bit_identical(tmp_path):
    transformers = pytest.importorskip("transformers")
    config = transformers.Qwen2Config(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        tie_word_embeddings=True,
    )  # fmt: skip
    transformers.Qwen2ForCausalLM(config).save_pretrained(tmp_path)
    model = LlamaLM.from_pretrained(tmp_path)
    _assert_identical(model)


def test_lora_adapters_inside_recomputed_blocks():
    model = TiedLM(VOCAB, d_model=16, n_layers=2, n_heads=2, max_seq_len=T, dropout=0.1)
    paths = add_lora(model, ["blocks.*.attn.qkv", "blocks.*.mlp.layers.0"], rank=2, dropout=0.1)
    rng = np.random.default_rng(3)
    for path, p in model.named_parameters():
        if "lora" in path:  # B starts at zero: give the adapters a term of their own
            p.set(rng.normal(0, 0.1, p.shape).astype(np.float32))
    assert paths
    _assert_identical(model)
    _, _, grads = _step(model, True)
    assert any("lora" in path for path in grads)
    assert not any(path in grads for path in paths)  # the adapted weights stay frozen


class _TiedPair(Module):
    """``b(tanh(a(x)))`` with ``b.weight`` the storage of ``a.weight`` (a square tie)."""

    def __init__(self) -> None:
        super().__init__()
        rng = np.random.default_rng(0)
        self.a = Linear(6, 6, rng=rng)
        self.b = Linear(6, 6, rng=rng)
        tie(self, "b.weight", "a.weight")

    def forward(self, session, x):
        return self.b(session, ops.tanh(self.a(session, x)))


def _pair_gradients(module: _TiedPair, recompute: bool):
    s = EagerSession()
    x = s.leaf(np.linspace(-1, 1, 12, dtype=np.float32).reshape(2, 6))
    y = checkpoint(module, s, x) if recompute else module(s, x)
    g = s.backward(ops.sum(y * y))
    return g.storage_gradient(module.a.weight.storage), g[x], g.parameter_groups()


def test_per_use_freezing_inside_a_recomputed_block():
    module = _TiedPair()
    module.freeze("b.weight")  # the tie trains through a's use alone
    plain, plain_x, plain_groups = _pair_gradients(module, False)
    again, again_x, groups = _pair_gradients(module, True)
    assert np.array_equal(plain, again) and np.array_equal(plain_x, again_x)
    assert [len(grp.leaves) for grp in groups] == [len(grp.leaves) for grp in plain_groups]
    module.unfreeze("b.weight")
    both, _, _ = _pair_gradients(module, True)
    assert not np.array_equal(both, again)  # the frozen use's term was left out


def _small_block(w: Param):
    def block(session, x):
        return ops.tanh(x @ session.use(w))

    return block


def _written_between(recompute: bool):
    """The input's gradient of a 4x4 matmul + tanh whose weight is written (+1) after
    the forward and before the backward."""
    w = Param(np.arange(16, dtype=np.float32).reshape(4, 4) / 16)
    s = EagerSession()
    x = s.leaf(np.linspace(-1, 1, 8, dtype=np.float32).reshape(2, 4))
    block = _small_block(w)
    y = checkpoint(block, s, x) if recompute else block(s, x)
    w.set(w.value + 1)
    g = s.backward(ops.sum(y * y))
    return g[x], g.storage_gradient(w.storage)


def test_a_parameter_written_between_forward_and_backward_gives_the_forwards_gradient():
    plain_x, plain_w = _written_between(False)
    x_grad, w_grad = _written_between(True)
    assert np.array_equal(plain_x, x_grad) and np.array_equal(plain_w, w_grad)


def test_torch_checkpoint_recomputes_from_the_written_value_where_tiegrad_does_not():
    torch = pytest.importorskip("torch")
    from torch.utils.checkpoint import checkpoint as torch_checkpoint

    def torch_grad(write: bool) -> np.ndarray:
        lin = torch.nn.Linear(4, 4, bias=False)
        with torch.no_grad():
            lin.weight.copy_(torch.arange(16.0).reshape(4, 4).T / 16)
        x = torch.linspace(-1, 1, 8).reshape(2, 4).requires_grad_()
        y = torch_checkpoint(lambda v: torch.tanh(lin(v)), x, use_reentrant=False)
        if write:
            with torch.no_grad():
                lin.weight += 1
        (y * y).sum().backward()
        return x.grad.numpy()

    forward_grad = torch_grad(False)
    assert np.allclose(forward_grad, _written_between(True)[0], atol=1e-6)
    assert not np.allclose(torch_grad(True), forward_grad, atol=1e-2)


def test_nested_checkpoints_are_recomputed_exactly():
    w = Param(np.random.default_rng(1).normal(0, 0.5, (5, 5)).astype(np.float32))
    inner = _small_block(w)

    def outer(session, x):
        h = checkpoint(inner, session, x)
        return ops.dropout(inner(session, h), 0.5)

    def run(fn):
        s = EagerSession(seed=2)
        x = s.leaf(np.linspace(-1, 1, 10, dtype=np.float32).reshape(2, 5))
        y = fn(s, x)
        return y.numpy(), s.backward(ops.sum(y * y)).storage_gradient(w.storage)

    def plain(session, x):
        return ops.dropout(inner(session, inner(session, x)), 0.5)

    y0, g0 = run(plain)
    y1, g1 = run(lambda s, x: checkpoint(outer, s, x))
    assert np.array_equal(y0, y1) and np.array_equal(g0, g1)


def test_the_blocks_intermediates_are_not_held():
    rng = np.random.default_rng(0)
    w1 = Param(rng.normal(0, 0.1, (32, 4096)).astype(np.float32))
    w2 = Param(rng.normal(0, 0.1, (4096, 32)).astype(np.float32))

    def block(session, x):
        return ops.tanh(ops.tanh(x @ session.use(w1)) @ session.use(w2))

    def held(recompute: bool) -> int:
        s = EagerSession()
        x = s.leaf(rng.normal(0, 1, (64, 32)).astype(np.float32))
        tracemalloc.start()
        before = tracemalloc.get_traced_memory()[0]
        y = checkpoint(block, s, x) if recompute else block(s, x)
        after = tracemalloc.get_traced_memory()[0]
        tracemalloc.stop()
        s.backward(ops.sum(y))
        return after - before

    intermediate = 64 * 4096 * 4  # one (64, 4096) float32 array: 1 MiB
    assert held(False) >= intermediate  # the inner tanh's output, which the VJPs keep
    assert held(True) < intermediate // 8


def test_dropout_stream_goes_on_as_without_recomputation():
    w = Param(np.eye(4, dtype=np.float32))

    def block(session, x):
        return ops.dropout(x @ session.use(w), 0.5)

    def draws(recompute: bool) -> np.ndarray:
        s = EagerSession(seed=5)
        x = s.leaf(np.ones((3, 4), np.float32))
        y = checkpoint(block, s, x) if recompute else block(s, x)
        return ops.dropout(y, 0.5).numpy()  # the next draw after the block

    assert np.array_equal(draws(False), draws(True))


def test_without_gradients_the_block_runs_plainly():
    w = Param(np.eye(3, dtype=np.float32))
    s = EagerSession()
    with s.no_grad():
        y = checkpoint(_small_block(w), s, s.constant(np.ones((2, 3), np.float32)))
    assert len(s) > 2  # the block's ops are on the tape itself
    assert np.allclose(y.numpy(), np.tanh(1.0))


def test_refusals_name_the_problem_and_record_nothing():
    w = Param(np.eye(3, dtype=np.float32))
    s = EagerSession()
    x = s.leaf(np.ones((2, 3), np.float32))
    with pytest.raises(ConfigError, match="use_reentrant is a flag of torch.utils.checkpoint"):
        checkpoint(_small_block(w), s, x, use_reentrant=False)
    with pytest.raises(TapeError, match="no EagerSession and no TensorRef"):
        checkpoint(lambda: None)
    with pytest.raises(TapeError, match="must return one TensorRef"):
        checkpoint(lambda session, v: v.numpy(), s, x)
    other = EagerSession()
    with pytest.raises(TapeError, match="two different sessions"):
        checkpoint(lambda a, b, v: v, s, other, x)
    assert len(s) == 1  # x alone: nothing was recorded by a refusal


def test_a_block_that_changes_its_uses_is_refused_in_backward():
    w, v = Param(np.eye(3, dtype=np.float32)), Param(np.eye(3, dtype=np.float32))
    calls = []

    def fickle(session, x):
        calls.append(1)
        return x @ session.use(w if len(calls) == 1 else v)

    s = EagerSession()
    y = checkpoint(fickle, s, s.leaf(np.ones((2, 3), np.float32)))
    with pytest.raises(TapeError, match="must use the same parameters in the same order"):
        s.backward(ops.sum(y))

    def shrinking(session, x):
        calls.append(1)
        return x.reshape(6) if len(calls) > 3 else x

    s = EagerSession()
    y = checkpoint(shrinking, s, s.leaf(np.ones((2, 3), np.float32)))
    calls.append(1)
    with pytest.raises(ShapeError, match=r"gave shape \(6,\), its forward \(2, 3\)"):
        s.backward(ops.sum(y))


def test_the_switch_transformers_names_and_its_refusals():
    model = TiedLM(VOCAB, d_model=8, n_layers=1, n_heads=2, max_seq_len=T)
    assert model.recompute is False and model.is_gradient_checkpointing is False
    model.gradient_checkpointing_enable()
    assert model.recompute is True and model.is_gradient_checkpointing is True
    model.gradient_checkpointing_disable()
    assert model.recompute is False
    model.activation_checkpointing_enable()  # transformers 5's names
    assert model.is_activation_checkpointing is True
    model.activation_checkpointing_disable()
    assert model.recompute is False
    with pytest.raises(ConfigError, match="'use_reentrant' are options of torch.utils"):
        model.gradient_checkpointing_enable({"use_reentrant": False})
    with pytest.raises(HyperparameterError, match="recompute"):
        model.recompute = "yes"
    assert model.recompute is False
    assert "recompute" not in model.config


def test_a_recomputing_model_holds_no_block_activations_between_forward_and_backward():
    model = TiedLM(VOCAB, d_model=32, n_layers=4, n_heads=2, max_seq_len=64, dropout=0.1)
    rng = np.random.default_rng(0)
    x, y = rng.integers(0, VOCAB, (4, 64)), rng.integers(0, VOCAB, (4, 64))

    def held(recompute: bool) -> tuple[int, int]:
        """Memory held after the forward, and the peak through the backward."""
        model.recompute = recompute
        s = EagerSession(seed=1)
        tracemalloc.start()
        before = tracemalloc.get_traced_memory()[0]
        loss = model.loss(s, x, y)
        after = tracemalloc.get_traced_memory()[0]
        s.backward(loss)
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        return after - before, peak - before

    held(False)  # first calls compile and cache what they need
    plain, plain_peak = held(False)
    kept, peak = held(True)
    logits = 4 * 64 * VOCAB * 4  # the head's output, which both keep for the loss
    assert kept < logits + (plain - logits) // 4
    assert peak < plain_peak
