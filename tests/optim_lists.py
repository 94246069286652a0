"""The parameter list the optimizer tests share: a tie, a 0-d slot, a frozen slot, a large one."""

from __future__ import annotations

import numpy as np

from tiegrad import Param, ParamList


def make_list(dtype=np.float32, seed=0) -> ParamList:
    """[w, b, w (tied), s (0-d), f (frozen), v (large)]: canonical slots [0, 1, 0, 3, None, 5]."""
    g = np.random.default_rng(seed)
    w = Param(g.standard_normal((40, 30)), dtype=dtype, name="w")
    b = Param(g.standard_normal(7), dtype=dtype, name="b")
    s = Param(g.standard_normal(()), dtype=dtype, name="s")
    f = Param(g.standard_normal(5), dtype=dtype, requires_grad=False, name="f")
    v = Param(g.standard_normal(3001), dtype=dtype, name="v")
    return ParamList([w, b, w.alias(), s, f, v])
