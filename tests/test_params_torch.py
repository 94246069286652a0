"""A tied two-use model against PyTorch: the same weight as input embedding and as output
projection receives one summed gradient (C4), equal to torch's gradient of a tied weight."""

from __future__ import annotations

import numpy as np
import pytest

from tiegrad import EagerSession, Param, dense_group_gradient, ops

torch = pytest.importorskip("torch")


def lookup(w, idx):
    embedding = getattr(ops, "embedding", None)
    return embedding(w, idx) if embedding is not None else ops.getitem(w, idx)


def test_tied_embedding_and_output_projection_match_torch():  # C4
    rng = np.random.default_rng(0)
    vocab, dim = 7, 5
    w0 = rng.standard_normal((vocab, dim))
    idx = np.array([3, 1, 3, 6])  # a repeated id: the embedding VJP must accumulate
    target = rng.standard_normal((len(idx), vocab))

    W = Param(w0, name="tied")
    s = EagerSession()
    w_in, w_out = s.use(W), s.use(W)  # two uses of one storage: two leaves, one group
    logits = lookup(w_in, idx) @ w_out.T
    loss = (ops.tanh(logits) * target).sum()
    grads = s.backward(loss)
    (group,) = s.parameter_groups()
    assert group.leaves == (w_in.id, w_out.id)
    ours = dense_group_gradient(group, grads)

    wt = torch.tensor(w0, requires_grad=True)
    t_logits = torch.nn.functional.embedding(torch.tensor(idx), wt) @ wt.T
    t_loss = (torch.tanh(t_logits) * torch.tensor(target)).sum()
    t_loss.backward()
    np.testing.assert_allclose(ours, wt.grad.numpy(), rtol=1e-10, atol=1e-12)
    # the sum really has two parts: neither use alone gives torch's gradient
    assert not np.allclose(grads[w_in], wt.grad.numpy())
    assert not np.allclose(grads[w_out], wt.grad.numpy())
    np.testing.assert_allclose(loss.item(), t_loss.item())

    s.sgd_step(0.1, grads)
    with torch.no_grad():
        wt -= 0.1 * wt.grad
    np.testing.assert_allclose(W.value, wt.detach().numpy(), rtol=1e-12, atol=1e-12)
