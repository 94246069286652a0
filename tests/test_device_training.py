"""Training ``TiedLM`` on a device gives the host's parameters within float32 tolerance."""

from __future__ import annotations

import os

import numpy as np
import pytest

from tiegrad import EagerSession
from tiegrad.models import TiedLM
from tiegrad.optim import AdamW

torch = pytest.importorskip("torch")

DEVICE = os.environ.get("TIEGRAD_TEST_DEVICE", "torch:cpu")
VOCAB, D, LAYERS, HEADS, SEQ, BATCH = 16, 16, 2, 2, 8, 4
STEPS, LR = 20, 3e-3


def _train(device: str | None):
    model = TiedLM(VOCAB, D, LAYERS, HEADS, SEQ, seed=0)
    opt = AdamW(model.parameters(), lr=LR, weight_decay=0.01)
    s = EagerSession(device=device)
    data = np.random.default_rng(1)
    losses = []
    for _ in range(STEPS):
        ids = data.integers(0, VOCAB, (BATCH, SEQ + 1))
        loss = model.loss(s, ids[:, :-1], ids[:, 1:])
        opt.step(s.backward(loss))
        losses.append(loss.item())
        s.reset()
    return model, opt, losses


def test_tied_lm_trains_on_the_device_like_on_the_host():  # C3, C4, C7
    host, _, host_losses = _train(None)
    dev, dev_opt, dev_losses = _train(DEVICE)
    np.testing.assert_allclose(dev_losses, host_losses, rtol=1e-5)
    embed = dev.embed.weight.storage
    assert dev.lm_head.weight.storage is embed  # the tie holds on the device
    assert embed.uploads == 1 and embed.downloads == 0 and not embed.host_current
    host_params = dict(host.named_parameters())
    for name, p in dev.named_parameters():
        want, got = host_params[name].value, p.value_synced()
        if name.endswith("attn.qkv.bias"):
            # The key bias has a zero gradient in exact arithmetic (softmax ignores a
            # shift shared by all keys); Adam rescales its rounding noise to steps of up
            # to lr, so the two runs may drift apart by at most STEPS * LR there.
            np.testing.assert_allclose(got[:D], want[:D], rtol=1e-4, atol=1e-6)
            np.testing.assert_allclose(got[D : 2 * D], want[D : 2 * D], atol=STEPS * LR)
            np.testing.assert_allclose(got[2 * D :], want[2 * D :], rtol=1e-4, atol=1e-6)
        else:
            np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-6, err_msg=name)
    assert embed.downloads == 1
    assert dev_opt.state_dict()["state"][0]["step"] == STEPS
