"""Differentiable operations, each a forward and its vector-Jacobian product.

Every op takes ``TensorRef`` operands of one session (arrays and Python numbers are
accepted where documented), records one node and returns its ``TensorRef``. Ops are
written against the session's backend (``tiegrad.backend``), never against an array
library directly, so the same op runs on NumPy and on torch devices.

Importing this package also installs the operators of ``TensorRef``.
"""

from ..tape import TensorRef
from .arithmetic import add, div, matmul, mul, neg, pow, sub
from .attention import scaled_dot_product_attention, self_attention
from .conv import conv2d, max_pool2d
from .dropout import dropout
from .elementwise import cos, exp, gelu, log, relu, rsqrt, sigmoid, silu, sin, sqrt, tanh
from .embedding import embedding
from .linear import affine, linear
from .linear_cross_entropy import linear_cross_entropy
from .loss import cross_entropy, mse_loss
from .norm import layer_norm, rms_norm
from .pieces import chunk, repeat_interleave, split
from .reduce import max, mean, sum
from .rope import rope_tables, rotary
from .shape import (
    concat,
    expand,
    getitem,
    permute,
    reshape,
    squeeze,
    stack,
    transpose,
    unsqueeze,
    where,
)
from .softmax import log_softmax, softmax

__all__ = [
    "add",
    "affine",
    "chunk",
    "concat",
    "conv2d",
    "cos",
    "cross_entropy",
    "div",
    "dropout",
    "embedding",
    "exp",
    "expand",
    "gelu",
    "getitem",
    "layer_norm",
    "linear",
    "linear_cross_entropy",
    "log",
    "log_softmax",
    "matmul",
    "max",
    "max_pool2d",
    "mean",
    "mse_loss",
    "mul",
    "neg",
    "permute",
    "pow",
    "relu",
    "repeat_interleave",
    "reshape",
    "rms_norm",
    "rope_tables",
    "rotary",
    "rsqrt",
    "scaled_dot_product_attention",
    "self_attention",
    "sigmoid",
    "silu",
    "sin",
    "softmax",
    "split",
    "sqrt",
    "squeeze",
    "stack",
    "sub",
    "sum",
    "tanh",
    "transpose",
    "unsqueeze",
    "where",
]


def _install_operators() -> None:
    """Give ``TensorRef`` its Python operators and methods (each records one op)."""
    t = TensorRef
    t.__add__ = add
    t.__radd__ = lambda self, other: add(other, self)
    t.__sub__ = sub
    t.__rsub__ = lambda self, other: sub(other, self)
    t.__mul__ = mul
    t.__rmul__ = lambda self, other: mul(other, self)
    t.__truediv__ = div
    t.__rtruediv__ = lambda self, other: div(other, self)
    t.__neg__ = neg
    t.__pow__ = pow
    t.__matmul__ = matmul
    t.__rmatmul__ = lambda self, other: matmul(other, self)
    t.__getitem__ = getitem
    t.T = property(lambda self: permute(self, tuple(reversed(range(self.ndim)))))
    t.reshape = lambda self, *shape: reshape(
        self, shape[0] if len(shape) == 1 and isinstance(shape[0], (tuple, list)) else shape
    )
    t.transpose = transpose
    t.permute = lambda self, *axes: permute(
        self, axes[0] if len(axes) == 1 and isinstance(axes[0], (tuple, list)) else axes
    )
    t.unsqueeze = unsqueeze
    t.squeeze = squeeze
    t.expand = lambda self, *shape: expand(
        self, shape[0] if len(shape) == 1 and isinstance(shape[0], (tuple, list)) else shape
    )
    t.repeat_interleave = repeat_interleave
    t.chunk = chunk
    t.split = split
    t.sum = sum
    t.mean = mean
    t.max = max


_install_operators()
