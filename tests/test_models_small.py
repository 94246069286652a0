"""``SiameseEncoder`` and ``MLPClassifier``: PyTorch agreement, config rebuilds, training."""

from __future__ import annotations

import numpy as np
import pytest

from tiegrad import ConfigError, EagerSession, HyperparameterError, ShapeError
from tiegrad.models import MLPClassifier, SiameseEncoder

torch = pytest.importorskip("torch")
from nn_reference import assert_grads_match, copy_to_torch  # noqa: E402

NAMES = {f"encoder.layers.{i}.{k}": f"{2 * i}.{k}" for i in range(3) for k in ("weight", "bias")}


def torch_mlp(sizes, act):
    layers = []
    for a, b in zip(sizes[:-1], sizes[1:]):
        layers += [torch.nn.Linear(a, b, dtype=torch.float64), act()]
    return torch.nn.Sequential(*layers[:-1])


def test_siamese_encoder_sums_both_uses_like_pytorch():
    model = SiameseEncoder(5, hidden=[7, 6], embed_dim=3, margin=2.0, dtype="float64")
    ref = torch_mlp([5, 7, 6, 3], torch.nn.ReLU)
    copy_to_torch(model, ref, NAMES)
    r = np.random.default_rng(0)
    x1, x2 = r.normal(size=(8, 5)), r.normal(size=(8, 5))
    same = np.array([1, 0, 1, 0, 0, 1, 1, 0])
    s = EagerSession()
    loss = model.loss(s, x1, x2, same)
    grads = s.backward(loss)
    z1, z2 = ref(torch.from_numpy(x1)), ref(torch.from_numpy(x2))
    d = (z1 - z2).pow(2).sum(-1)
    sm = torch.from_numpy(same.astype(np.float64))
    gap = torch.relu(2.0 - torch.sqrt(d + 1e-12))
    tl = (sm * d + (1 - sm) * gap**2).mean()
    tl.backward()
    assert abs(loss.item() - tl.item()) < 1e-12
    assert_grads_match(model.named_gradients(grads), ref, NAMES)
    assert len(s.parameter_groups()) == 6
    assert all(len(g.leaves) == 2 for g in s.parameter_groups())  # C4: two uses, one group


def test_siamese_bad_input():
    model = SiameseEncoder(4)
    x = np.zeros((3, 4), np.float32)
    with pytest.raises(
        ShapeError, match=r"SiameseEncoder\(.*same has shape \(2,\), expected \(3,\)"
    ):
        model.loss(EagerSession(), x, x, [1, 0])
    with pytest.raises(ShapeError, match=r"Linear\(in_features=4.*input has shape \(3, 5\)"):
        model(EagerSession(), x, np.zeros((3, 5), np.float32))
    with pytest.raises(HyperparameterError, match="margin"):
        SiameseEncoder(4, margin=0.0)


def test_mlp_classifier_matches_pytorch_and_rebuilds_from_config():
    model = MLPClassifier(4, 9, 3, activation="tanh", seed=2, dtype="float64")
    ref = torch_mlp([4, 9, 3], torch.nn.Tanh)
    names = {k.replace("encoder", "mlp"): v for k, v in NAMES.items()}
    copy_to_torch(model, ref, names)
    r = np.random.default_rng(1)
    x, y = r.normal(size=(10, 4)), r.integers(0, 3, 10)
    s = EagerSession()
    loss = model.loss(s, x, y)
    grads = s.backward(loss)
    tl = torch.nn.functional.cross_entropy(ref(torch.from_numpy(x)), torch.from_numpy(y))
    tl.backward()
    assert abs(loss.item() - tl.item()) < 1e-12
    assert_grads_match(model.named_gradients(grads), ref, names)
    again = type(model)(**model.config)
    for (_, a), (_, b) in zip(model.named_slots(), again.named_slots()):
        np.testing.assert_array_equal(a.value, b.value)


@pytest.mark.parametrize("cls", [MLPClassifier, SiameseEncoder])
def test_hidden_takes_numpy_integers_and_refuses_none(cls):
    model = cls(4, np.int64(8), 3, seed=1)
    same = cls(4, 8, 3, seed=1)
    assert [h.value.shape for _, h in model.named_slots()] == [(8, 4), (8,), (3, 8), (3,)]
    for (_, a), (_, b) in zip(model.named_slots(), same.named_slots()):
        np.testing.assert_array_equal(a.value, b.value)
    with pytest.raises(ConfigError, match=rf"{cls.__name__}: hidden must be an integer or a seq"):
        cls(4, None, 3)


def test_mlp_classifier_learns_a_separable_problem():
    r = np.random.default_rng(0)
    x = r.normal(size=(64, 2)).astype(np.float32)
    y = (x[:, 0] + x[:, 1] > 0).astype(np.int64)
    model = MLPClassifier(2, 16, 2, dropout=0.1)
    s = EagerSession(seed=1)
    first = None
    for _ in range(60):
        s.reset()
        loss = model.loss(s, x, y)
        first = loss.item() if first is None else first
        s.sgd_step(0.5, s.backward(loss))
    assert loss.item() < 0.5 * first
    assert model.training
    assert (model.predict(x) == y).mean() > 0.9 and model.training
