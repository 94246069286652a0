"""Convolution and pooling over (N, C, H, W) images."""

from __future__ import annotations

from typing import Any

import numpy as np

from .. import ops
from .._checks import count, size
from ..session import EagerSession, TensorRef
from . import init
from ._input import layer_input
from .module import Module


class Conv2d(Module):
    """Cross-correlation with weight (out, in, k, k) and bias (out,), square ``stride``.

    Both drawn from ``U(-1/sqrt(fan_in), 1/sqrt(fan_in))``, ``fan_in = in * k * k``
    (PyTorch's default); zero ``padding`` on every side.
    """

    def __init__(
        self,
        in_channels: int,
        out_channels: int,
        kernel_size: int,
        stride: int = 1,
        padding: int = 0,
        bias: bool = True,
        rng: np.random.Generator | None = None,
        dtype: Any = np.float32,
    ) -> None:
        super().__init__()
        rng, dtype = init.generator(rng), init.float_dtype(dtype)
        self.in_channels = size("Conv2d", "in_channels", in_channels)
        self.out_channels = size("Conv2d", "out_channels", out_channels)
        self.kernel_size = size("Conv2d", "kernel_size", kernel_size)
        self.stride = size("Conv2d", "stride", stride)
        self.padding = count("Conv2d", "padding", padding)
        k = self.kernel_size
        self.weight, self.bias = init.fan_in_uniform(
            rng, (self.out_channels, self.in_channels, k, k), bias, dtype
        )

    def forward(self, session: EagerSession, x: Any) -> TensorRef:
        x = layer_input(self, session, x, ("N", self.in_channels, "H", "W"))
        bias = None if self.bias is None else session.use(self.bias)
        return ops.conv2d(x, session.use(self.weight), bias, self.stride, self.padding)

    def extra_repr(self) -> str:
        return (
            f"{self.in_channels}, {self.out_channels}, kernel_size={self.kernel_size}, "
            f"stride={self.stride}, padding={self.padding}"
        )


class MaxPool2d(Module):
    """Maximum over ``kernel_size`` windows; ``stride`` defaults to ``kernel_size``."""

    def __init__(self, kernel_size: int, stride: int | None = None) -> None:
        super().__init__()
        self.kernel_size = size("MaxPool2d", "kernel_size", kernel_size)
        self.stride = self.kernel_size if stride is None else size("MaxPool2d", "stride", stride)

    def forward(self, session: EagerSession, x: Any) -> TensorRef:
        x = layer_input(self, session, x, ("N", "C", "H", "W"))
        return ops.max_pool2d(x, self.kernel_size, self.stride)

    def extra_repr(self) -> str:
        return f"kernel_size={self.kernel_size}, stride={self.stride}"
