"""A 0-d parameter and 0-d optimizer state round-trip through a checkpoint (issue 16)."""

from __future__ import annotations

import numpy as np

import tiegrad as tg
from tiegrad import EagerSession, Param, ParamList
from tiegrad.optim import Adam


def test_a_scalar_parameter_and_its_adam_state_save_load_and_inspect(tmp_path):
    scale = Param(np.float32(1.5), name="scale")
    w = Param(np.ones(2, np.float32), name="w")
    opt = Adam(ParamList([scale, w]), lr=0.1)
    s = EagerSession()
    opt.step(s.backward((s.use(w) * s.use(scale)).sum()))
    path = tmp_path / "scalar.safetensors"
    tg.save(path, ParamList([scale, w]), optimizer=opt)
    saved_value, saved_state = scale.value.copy(), {k: v for k, v in opt.state[0].items()}

    scale2 = Param(np.float32(0.0), name="scale")
    w2 = Param(np.zeros(2, np.float32), name="w")
    opt2 = Adam(ParamList([scale2, w2]), lr=0.1)
    tg.load(path, ParamList([scale2, w2]), optimizer=opt2)
    assert scale2.value.shape == () and scale2.value == saved_value
    assert opt2.state[0]["exp_avg"].shape == () and opt2.state[0]["step"] == 1
    np.testing.assert_array_equal(opt2.state[0]["exp_avg_sq"], saved_state["exp_avg_sq"])
    assert "scale" in tg.inspect(path) and "scalar" in tg.inspect(path)
