"""The device backend: PyTorch tensors on ``cuda``, ``mps`` or torch's CPU (``torch:cpu``).

Imported only when a device backend is asked for (``device_backend``), so ``import
tiegrad`` never imports torch. It implements every method of ``Backend`` with NumPy's
names, broadcasting and dtype rules (products of mixed dtypes, conditions, indexes:
``torch_index``), so each op of ``tiegrad.ops`` runs unchanged on a device
(docs/design.md: layers); attention runs through ``torch_attention``. The arithmetic
operators of the
ops act on the tensors themselves and so promote mixed dtypes as torch does: a 0-d
float64 array leaves a float32 tensor float32, and an integer input to a floating op
gives float32 (NumPy: float64). Beyond the interface it offers ``upload`` /
``download`` (always copies, used by the mirror protocol, C7) and a
``TemporaryTracker`` counting owned temporaries (C8).

Create backends through ``tiegrad.backend.device_backend``: it keeps one instance per
device, so storages and sessions can compare backends by identity.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from ..errors import DeviceError, DTypeError
from .base import Array, Backend, DType, Shape, grouped_heads
from .torch_attention import (
    HAS_GQA,
    in_cache,
    products_attention,
    sdpa_attention,
)
from .torch_index import add_at, torch_index, wrap_negative
from .tracker import TemporaryTracker


def torch_device_of(device: str) -> torch.device:
    """The torch device of a tiegrad device name, or a DeviceError if it is unusable."""
    base, colon, index = device.partition(":")
    if device == "torch:cpu":
        return torch.device("cpu")
    if base == "cuda" and (not colon or index.isdigit()):
        if not torch.cuda.is_available():
            raise DeviceError(f"device {device!r}: CUDA is not available to this torch build")
        n = torch.cuda.device_count()
        i = int(index) if colon else torch.cuda.current_device()
        if i >= n:
            raise DeviceError(f"device {device!r}: expected 'cuda' or 'cuda:N' with N < {n}")
        return torch.device("cuda", i)
    if device == "mps":
        if not torch.backends.mps.is_available():
            raise DeviceError("device 'mps': MPS is not available on this machine")
        return torch.device("mps")
    raise DeviceError(
        f"unknown device {device!r}: expected 'cpu', 'cuda', 'cuda:N', 'mps' or 'torch:cpu'"
    )


_TORCH_DTYPES: dict[Any, torch.dtype] = {}
_REDUCTIONS = {"none": 0, "mean": 1, "sum": 2}  # torch's reduction enum
_NLL_FORWARD = torch.ops.aten.nll_loss_forward.default  # the overloads, resolved once
_NLL_BACKWARD = torch.ops.aten.nll_loss_backward.default
_LAYER_NORM_DTYPES = (torch.float32, torch.float64)  # of the fused layer norm kernels


class TorchBackend(Backend):
    """PyTorch tensors on one device. ``device`` is tiegrad's name (``"torch:cpu"``)."""

    name = "torch"
    xp = torch  # the array namespace, for code written against NumPy names (optimizer rules)
    float32 = torch.float32
    float64 = torch.float64
    int64 = torch.int64
    bool_ = torch.bool

    def __init__(self, device: str, torch_device: torch.device | None = None) -> None:
        self.device = device
        self.torch_device = torch_device_of(device) if torch_device is None else torch_device
        self.temporaries = TemporaryTracker()
        self._constants: dict[tuple[Any, ...], tuple[Array, Array]] = {}

    def __repr__(self) -> str:
        return f"TorchBackend({self.device!r})"

    # -- helpers ---------------------------------------------------------------------
    def to_dtype(self, dtype: Any) -> torch.dtype:
        """The torch dtype of a torch or NumPy dtype (or NumPy dtype name); None stays None."""
        if dtype is None or isinstance(dtype, torch.dtype):
            return dtype
        out = _TORCH_DTYPES.get(dtype)
        if out is None:
            out = _TORCH_DTYPES[dtype] = self.dtype_of(np.dtype(dtype).name)
        return out

    def _on_device(self, x: torch.Tensor) -> bool:
        d, want = x.device, self.torch_device
        if d == want:  # the common case, one comparison ("mps" has no index: below)
            return True
        return d.type == want.type and (want.index is None or d.index == want.index)

    def _tensor(self, x: Any) -> torch.Tensor:
        return x if isinstance(x, torch.Tensor) else self.asarray(x)

    def index(self, index: Any) -> Any:
        """NumPy's index as torch reads it (``torch_index``): array-like components become
        tensors on this device, int64 for integers, bool for masks; other element types,
        and slices of negative step (torch has no such view), are an ``IndexRangeError``."""
        return torch_index(self, index)

    # -- transfers (C7) --------------------------------------------------------------
    def upload(self, x: Any) -> torch.Tensor:
        """A fresh tensor on this device holding a copy of ``x`` (never shares memory)."""
        if isinstance(x, torch.Tensor):
            return x.detach().to(self.torch_device, copy=True)
        return torch.tensor(np.asarray(x), device=self.torch_device)

    def download(self, x: torch.Tensor) -> np.ndarray:
        """A fresh NumPy array holding a copy of ``x`` (never shares memory)."""
        return x.detach().to("cpu", copy=True).numpy()

    def synchronize(self) -> None:
        """Wait for queued device work (a no-op on torch's CPU)."""
        if self.torch_device.type == "cuda":
            torch.cuda.synchronize(self.torch_device)
        elif self.torch_device.type == "mps":
            torch.mps.synchronize()

    # -- creation and conversion -----------------------------------------------------
    def asarray(self, x: Any, dtype: DType | None = None) -> Array:
        dtype = self.to_dtype(dtype)
        if isinstance(x, torch.Tensor):
            if not self._on_device(x) or (dtype is not None and x.dtype != dtype):
                x = x.to(device=self.torch_device, dtype=dtype)
            return x
        arr = np.asarray(x)
        if not arr.flags.writeable or not arr.flags.c_contiguous:
            arr = np.array(arr, copy=True, order="C")
        t = torch.from_numpy(arr)
        if not self._on_device(t) or (dtype is not None and t.dtype != dtype):
            t = t.to(device=self.torch_device, dtype=dtype)
        return t

    def copy(self, x: Array) -> Array:
        return self._tensor(x).clone()

    def memory_owner(self, x: Array) -> Any:
        base = x._base
        return x if base is None else base

    def to_numpy(self, x: Array) -> Any:
        """A fresh NumPy copy of a tensor, never a view of it, on torch's CPU as on a GPU.

        Writing to the result changes nothing on the device: ``TensorRef.numpy()`` of a
        parameter use cannot alter a mirror behind the storage's back (C7), which the
        host refuses by handing out its read-only array.
        """
        if isinstance(x, torch.Tensor):
            return self.download(x)
        return np.asarray(x)

    def is_array(self, x: Any) -> bool:
        return isinstance(x, torch.Tensor) and self._on_device(x)

    def zeros(self, shape: Shape, dtype: DType) -> Array:
        return torch.zeros(tuple(shape), dtype=self.to_dtype(dtype), device=self.torch_device)

    def ones(self, shape: Shape, dtype: DType) -> Array:
        return torch.ones(tuple(shape), dtype=self.to_dtype(dtype), device=self.torch_device)

    def empty(self, shape: Shape, dtype: DType) -> Array:
        return torch.empty(tuple(shape), dtype=self.to_dtype(dtype), device=self.torch_device)

    def arange(self, n: int, dtype: DType) -> Array:
        return torch.arange(n, dtype=self.to_dtype(dtype), device=self.torch_device)

    def astype(self, x: Array, dtype: DType) -> Array:
        return self._tensor(x).to(self.to_dtype(dtype))

    def dtype_name(self, dtype: DType) -> str:
        return str(dtype).removeprefix("torch.")

    def dtype_of(self, name: str) -> DType:
        dtype = getattr(torch, name, None)
        if not isinstance(dtype, torch.dtype):
            raise DTypeError(f"torch backend: no torch dtype named {name!r}")
        return dtype

    def is_floating(self, dtype: DType) -> bool:
        return self.to_dtype(dtype).is_floating_point

    def is_integer(self, dtype: DType) -> bool:
        t = self.to_dtype(dtype)
        return not (t.is_floating_point or t.is_complex or t is torch.bool)

    # -- elementwise -------------------------------------------------------------------
    def exp(self, x: Array) -> Array:
        return torch.exp(x)

    def log(self, x: Array) -> Array:
        return torch.log(x)

    def sqrt(self, x: Array) -> Array:
        return torch.sqrt(x)

    def tanh(self, x: Array) -> Array:
        return torch.tanh(x)

    def cos(self, x: Array) -> Array:
        return torch.cos(x)

    def sin(self, x: Array) -> Array:
        return torch.sin(x)

    def rsqrt(self, x: Array) -> Array:
        return torch.rsqrt(x)

    def erf(self, x: Array) -> Array:
        return torch.erf(x)

    def maximum(self, x: Array, y: Array | float) -> Array:
        if not isinstance(x, torch.Tensor):
            x, y = y, x
        if isinstance(y, torch.Tensor):
            return torch.maximum(x, y)
        if isinstance(y, np.ndarray):
            return torch.maximum(x, self.asarray(y))
        return torch.clamp_min(x, y)

    def where(self, cond: Array, x: Array | float, y: Array | float) -> Array:
        if isinstance(x, np.ndarray) or not isinstance(y, (torch.Tensor, np.ndarray)):
            x = self._tensor(x)  # two Python numbers give NumPy's dtype (float64), not torch's
        if isinstance(y, np.ndarray):
            y = self.asarray(y)
        cond = self._tensor(cond)
        if cond.dtype != torch.bool:  # NumPy reads any condition as "nonzero"
            cond = cond != 0
        return torch.where(cond, x, y)

    def isfinite_all(self, x: Array) -> bool:
        return bool(torch.isfinite(x).all())

    # -- fused kernels: torch's native kernels, one pass each --------------------------
    def gelu(self, x: Array) -> tuple[Array, Array]:
        return F.gelu(x), x  # torch's backward kernel works from x

    def gelu_vjp(self, g: Array, saved: Array) -> Array:
        if g.dtype != saved.dtype:  # a wider cotangent: multiply, promoting like NumPy
            return g * torch.ops.aten.gelu_backward(torch.ones_like(saved), saved)
        return torch.ops.aten.gelu_backward(g, saved)

    def relu(self, x: Array) -> Array:
        return torch.clamp_min(x, 0.0)  # ``maximum(x, 0.0)``'s kernel, without its dispatch

    def relu_vjp(self, g: Array, out: Array) -> Array:
        """``g * sign(out)``: the bits of ``g * (out > 0)`` for a ReLU output ``out``.

        ``sign`` is 1 where ``out > 0`` and +0 at +-0 and NaN (never negative here), so
        the product is the host's, NaN and -0 included; on torch's CPU a float-by-bool
        product and the comparison behind it cost several times the two kernels.
        """
        if g.dtype != out.dtype:  # a wider cotangent: the generic product promotes
            return super().relu_vjp(g, out)
        return torch.sign(out).mul_(g)  # into the fresh sign: one allocation, the same bits

    def affine_rows(self, x: Array, w: Array, b: Array | None, out_in: bool) -> Array | None:
        """What ``torch.nn.functional.linear`` runs: one ``addmm`` (the bias is the product's
        initial value), for operands of one dtype."""
        if x.dtype != w.dtype or (b is not None and b.dtype != x.dtype):
            return None  # the generic path promotes like NumPy
        if out_in:
            return F.linear(x, w, b)
        return torch.mm(x, w) if b is None else torch.addmm(b, x, w)

    def layer_norm_rows(
        self, x: Array, w: Array | None, b: Array | None, eps: float
    ) -> tuple[Array, Any, Array] | None:
        """torch's fused layer norm; in place of ``xhat`` the input rows and their means,
        from which ``layer_norm_backward_rows`` runs torch's fused backward (no ``xhat``
        pass in the forward, as PyTorch's own autograd keeps them)."""
        if x.dtype not in _LAYER_NORM_DTYPES or any(
            p is not None and p.dtype != x.dtype for p in (w, b)
        ):
            return None  # one float32/float64 dtype; the generic path promotes the others
        out, mean, rstd = torch.native_layer_norm(x, [x.shape[-1]], w, b, eps)
        return out, (x, mean), rstd

    def layer_norm_backward_rows(
        self, g: Array, w: Array | None, saved: Any, rstd: Array, wants: tuple[bool, bool, bool]
    ) -> tuple[Array | None, Array | None, Array | None] | None:
        """torch's fused backward from the rows and means ``layer_norm_rows`` kept: every
        wanted cotangent (a wider cotangent runs it in the promoted dtype, as the
        generic formula would compute). None after the generic forward (its ``xhat``)."""
        if not isinstance(saved, tuple):
            return None
        x, mean = saved
        dtype = torch.promote_types(g.dtype, x.dtype)
        if g.dtype != dtype:
            g = g.to(dtype)
        if x.dtype != dtype:
            x, mean, rstd = x.to(dtype), mean.to(dtype), rstd.to(dtype)
            w = None if w is None else w.to(dtype)
        d = x.shape[-1]
        zeros, ones = self._unit_statistics(d, None, dtype)
        mask = [wants[0], wants[1] and w is not None, wants[2]]
        return torch.ops.aten.native_layer_norm_backward(
            g, x, [d], mean, rstd, ones if w is None else w, zeros, mask
        )

    def _unit_statistics(self, n: int, cols: int | None, dtype: torch.dtype) -> tuple[Array, Array]:
        """Zeros and ones of shape (n, cols) or (n,), made once per shape and kept (read only)."""
        key = (n, cols, dtype)
        pair = self._constants.get(key)
        if pair is None:
            shape = (n,) if cols is None else (n, cols)
            pair = self._constants[key] = (
                torch.zeros(shape, dtype=dtype, device=self.torch_device),
                torch.ones(shape, dtype=dtype, device=self.torch_device),
            )
        return pair

    def cross_entropy_rows(
        self,
        logits: Array,
        targets: Array,
        ignore_index: int,
        label_smoothing: float,
        want: bool,
        reduction: str = "none",
        count: int | None = None,
    ) -> tuple[Array, Any] | None:
        """torch's log-softmax and negative log-likelihood kernels, forward and backward
        (what ``F.cross_entropy`` runs), without smoothing and in float32 or float64; the
        reduction is the NLL kernel's own (one pass, no separate sum; it counts the rows
        of a mean itself)."""
        if label_smoothing or logits.dtype not in _LAYER_NORM_DTYPES:
            return None  # the generic path
        if targets.dtype != torch.int64:
            targets = targets.to(torch.int64)
        code = _REDUCTIONS[reduction]
        logp = torch.log_softmax(logits, -1)
        loss, total = _NLL_FORWARD(logp, targets, None, code, ignore_index)
        if not want:
            return loss, None

        def vjp(g: Array) -> Array:
            if g.dtype != logp.dtype:  # a wider cotangent: the kernels take one dtype
                g = g.to(logp.dtype)
            glogp = _NLL_BACKWARD(g, logp, targets, None, code, ignore_index, total)
            return torch._log_softmax_backward_data(glogp, logp, -1, logp.dtype)

        return loss, vjp

    def fused_attention(
        self,
        q: Array,
        k: Array,
        v: Array,
        causal: bool,
        scale: float,
        want: bool,
        query_offset: int = 0,
    ) -> tuple[Array, Any] | None:
        """PyTorch's ``scaled_dot_product_attention`` (``enable_gqa`` for grouped heads,
        where this torch has it); on torch's CPU, where the scores are small
        (``in_cache``), batched products and torch's softmax kernels instead."""
        if not (q.dtype == k.dtype == v.dtype) or not k.shape[:-2] == v.shape[:-2]:
            return None
        groups = 1
        if q.shape[:-2] != k.shape[:-2]:
            groups = grouped_heads(tuple(q.shape), tuple(k.shape), tuple(v.shape))
            if groups == 1:
                return None
        if self.torch_device.type == "cpu" and in_cache(q, k):
            return products_attention(q, k, v, causal, scale, want, query_offset, groups)
        if groups > 1 and not HAS_GQA:
            return None
        return sdpa_attention(q, k, v, causal, scale, want, query_offset, groups > 1)

    # -- reductions and shape ----------------------------------------------------------
    def sum(self, x: Array, axis: Any = None, keepdims: bool = False) -> Array:
        if axis is None:
            out = torch.sum(x)
            return out.reshape((1,) * x.ndim) if keepdims else out
        axis = (axis,) if isinstance(axis, int) else tuple(axis)
        if not axis:  # torch reads dim=() as "every axis"; NumPy as "no axis"
            return x.clone()
        return torch.sum(x, dim=axis, keepdim=keepdims)

    def max(self, x: Array, axis: Any = None, keepdims: bool = False) -> Array:
        if axis is None:
            axis = tuple(range(x.ndim))
        axis = (axis,) if isinstance(axis, int) else tuple(axis)
        if not axis:
            return x.clone()
        return torch.amax(x, dim=axis, keepdim=keepdims)

    def argmax(self, x: Array, axis: int) -> Array:
        return torch.argmax(x, dim=axis)

    def reshape(self, x: Array, shape: Shape) -> Array:
        return torch.reshape(self._tensor(x), tuple(shape))

    def transpose(self, x: Array, axes: Shape) -> Array:
        axes = tuple(axes)
        return x.t() if axes == (1, 0) else x.permute(axes)  # ``t``: half the dispatch

    def broadcast_to(self, x: Array, shape: Shape) -> Array:
        return torch.broadcast_to(self._tensor(x), tuple(shape))

    def expand_dims(self, x: Array, axis: Any) -> Array:
        if isinstance(axis, int):
            return torch.unsqueeze(x, axis)
        nd = x.ndim + len(axis)
        for a in sorted(a % nd for a in axis):
            x = torch.unsqueeze(x, a)
        return x

    def concat(self, xs: list[Array], axis: int) -> Array:
        return torch.cat([self._tensor(x) for x in xs], dim=axis)

    def stack(self, xs: list[Array], axis: int) -> Array:
        return torch.stack([self._tensor(x) for x in xs], dim=axis)

    def pad(self, x: Array, widths: list[tuple[int, int]]) -> Array:
        flat: list[int] = []
        for before, after in reversed(list(widths)):
            flat += [int(before), int(after)]
        return F.pad(x, flat)

    def matmul(self, a: Array, b: Array) -> Array:
        if a.dtype != b.dtype:  # torch's products refuse mixed operands; NumPy promotes
            dtype = self._numpy_result(a.dtype, b.dtype)
            a, b = a.to(dtype), b.to(dtype)
        return torch.matmul(a, b)

    def _numpy_result(self, a: torch.dtype, b: torch.dtype) -> torch.dtype:
        """The dtype NumPy gives an operation on arrays of dtypes ``a`` and ``b`` (torch's
        promotion where NumPy has no such type: bfloat16)."""
        try:
            names = (np.dtype(self.dtype_name(a)), np.dtype(self.dtype_name(b)))
        except TypeError:
            return torch.promote_types(a, b)
        return self.dtype_of(np.result_type(*names).name)

    def einsum(self, subscripts: str, *operands: Array) -> Array:
        """``torch.einsum``, except for a reduced elementwise product (``"ij,ij->j"``).

        torch lowers that pattern to a batched matrix product over strided rows, which
        is orders of magnitude slower on the CPU than multiplying and summing.
        """
        inputs, arrow, out = subscripts.replace(" ", "").partition("->")
        terms = inputs.split(",")
        if (
            arrow
            and len(operands) == 2
            and len(terms) == 2
            and terms[0] == terms[1]
            and "." not in terms[0]
            and len(set(terms[0])) == len(terms[0])
            and set(out) <= set(terms[0])
            and len(set(out)) == len(out)
            and operands[0].shape == operands[1].shape
        ):
            prod = operands[0] * operands[1]
            reduced = [k for k, c in enumerate(terms[0]) if c not in out]
            kept = [c for c in terms[0] if c in out]
            total = torch.sum(prod, dim=reduced) if reduced else prod
            return total.permute([kept.index(c) for c in out])
        return torch.einsum(subscripts, *operands)

    # -- indexing ------------------------------------------------------------------------
    def take(self, x: Array, indices: Array, axis: int = 0) -> Array:
        axis %= x.ndim
        idx = self._tensor(self.index(indices)).to(torch.int64)
        idx = wrap_negative(idx, x.shape[axis])
        out = torch.index_select(x, axis, idx.reshape(-1))
        if idx.ndim == 1:
            return out
        return out.reshape(tuple(x.shape[:axis]) + tuple(idx.shape) + tuple(x.shape[axis + 1 :]))

    def take_along_axis(self, x: Array, indices: Array, axis: int) -> Array:
        idx = self._tensor(self.index(indices)).to(torch.int64)
        return torch.take_along_dim(x, wrap_negative(idx, x.shape[axis]), dim=axis)

    def accumulate_at(self, out: Array, index: Any, values: Array) -> None:
        """``out[index] += values`` with repeated indices accumulated, like ``np.add.at``."""
        add_at(out, self.index(index), self._tensor(values).to(out.dtype))

    def index_add(self, out: Array, indices: Array, values: Array) -> None:
        out.index_add_(0, self.index(indices).to(torch.int64), self._tensor(values).to(out.dtype))

    def sliding_windows(self, x: Array, kh: int, kw: int, stride: int) -> Array:
        return x.unfold(2, kh, stride).unfold(3, kw, stride)

    # -- randomness ----------------------------------------------------------------------
    def random_uniform(self, generator: Any, shape: Shape, dtype: DType) -> Array:
        """Samples from the session's NumPy generator, uploaded: the same stream as the host."""
        np_dtype = np.dtype(self.dtype_name(self.to_dtype(dtype)))
        return self.asarray(generator.random(tuple(shape), dtype=np_dtype))
