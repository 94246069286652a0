"""The backend interface: the array operations the differentiable ops are written against.

Ops call these methods and never import an array library (docs/design.md: layers). A backend
wraps one array library: ``numpy`` on the host (the default) or ``torch`` on a device.
Methods follow NumPy's names and broadcasting rules; ``axis`` arguments take an int, a
tuple of ints or ``None``. Arrays are the library's own type (``np.ndarray``,
``torch.Tensor``); dtypes are the library's dtype objects.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from ..errors import ShapeError

Array = Any
DType = Any
Shape = tuple[int, ...]


def smoothed_loss(nll: Any, shifted_sum: Any, log_den: Any, classes: int, e: float) -> Any:
    """The cross-entropy of rows under label smoothing ``e``, from each row's loss without
    it (``nll = log(den) - shifted[t]``), the sum of its shifted logits and ``log(den)``:
    ``(1 - e) * nll - e / C * (shifted_sum - C * log(den))``, which is
    ``-(1 - e) * logp[t] - e / C * sum(logp)``. One order of operations for every route."""
    total = shifted_sum - classes * log_den
    return (1.0 - e) * nll - (e / classes) * total


def scale_into(product: Any, scale: float, out: Any = None) -> Any:
    """``scale * product`` as a new array, or assigned into ``out`` and ``out`` returned.

    ``out`` must have the product's shape: a ``ShapeError`` (a ``ValueError``) otherwise,
    where an assignment would broadcast a product of another shape.
    """
    if scale != 1.0:
        product = product * scale
    if out is None:
        return product
    if tuple(out.shape) != tuple(product.shape):
        raise ShapeError(
            f"scaled_matmul: out has shape {tuple(out.shape)}, the product {tuple(product.shape)}"
        )
    out[...] = product
    return out


def grouped_heads(qs: tuple[int, ...], ks: tuple[int, ...], vs: tuple[int, ...]) -> int:
    """How many query heads share each key/value head, from the shapes of q, k and v:
    ``Hq / Hkv`` where k and v have fewer heads (axis -3) than q, dividing them, and the
    same other leading axes (grouped-query attention); else 1."""
    if not len(qs) == len(ks) == len(vs) >= 3 or not qs[:-3] == ks[:-3] == vs[:-3]:
        return 1
    hq, hk = qs[-3], ks[-3]
    return hq // hk if hk == vs[-3] and 0 < hk < hq and hq % hk == 0 else 1


class Backend:
    """Abstract array backend. Subclasses implement every method below."""

    name: str
    device: str
    float32: DType
    float64: DType
    int64: DType
    bool_: DType
    slow_row_reductions: bool = False
    """Whether reductions over the last axis of many short rows are slow (NumPy's ufuncs).

    Ops then sum rows as BLAS products with a ones vector and shift a softmax by one
    block maximum (checking for underflow) instead of each row's own; elsewhere they
    use the backend's row reductions, one kernel each and no device synchronisation.
    """

    # -- creation and conversion -------------------------------------------------
    def asarray(self, x: Any, dtype: DType | None = None) -> Array:
        """An array of this backend holding ``x`` (no copy when already one of ours)."""
        raise NotImplementedError

    def copy(self, x: Array) -> Array:
        """A fresh, writable copy of ``x``."""
        raise NotImplementedError

    def memory_owner(self, x: Array) -> Any:
        """The array whose memory ``x`` lies in: ``x`` itself, or the one it is a view of."""
        raise NotImplementedError

    def to_numpy(self, x: Array) -> Any:
        """A NumPy array with the values of ``x`` (downloads from a device)."""
        raise NotImplementedError

    def is_array(self, x: Any) -> bool:
        raise NotImplementedError

    def zeros(self, shape: Shape, dtype: DType) -> Array:
        raise NotImplementedError

    def ones(self, shape: Shape, dtype: DType) -> Array:
        raise NotImplementedError

    def empty(self, shape: Shape, dtype: DType) -> Array:
        """A fresh array whose contents the caller overwrites entirely before reading."""
        return self.zeros(shape, dtype)

    def arange(self, n: int, dtype: DType) -> Array:
        raise NotImplementedError

    def astype(self, x: Array, dtype: DType) -> Array:
        raise NotImplementedError

    def dtype_name(self, dtype: DType) -> str:
        """The NumPy-style name of ``dtype`` (``"float32"``), used in errors and checkpoints."""
        raise NotImplementedError

    def dtype_of(self, name: str) -> DType:
        raise NotImplementedError

    def is_floating(self, dtype: DType) -> bool:
        raise NotImplementedError

    def is_integer(self, dtype: DType) -> bool:
        """Whether ``dtype`` is a signed or unsigned integer type (not bool)."""
        raise NotImplementedError

    # -- elementwise ---------------------------------------------------------------
    def exp(self, x: Array) -> Array:
        raise NotImplementedError

    def exp_(self, x: Array) -> Array:
        """``exp`` written over ``x`` itself (which the caller owns); returns ``x``."""
        x[...] = self.exp(x)
        return x

    def log(self, x: Array) -> Array:
        raise NotImplementedError

    def sqrt(self, x: Array) -> Array:
        raise NotImplementedError

    def tanh(self, x: Array) -> Array:
        raise NotImplementedError

    def cos(self, x: Array) -> Array:
        raise NotImplementedError

    def sin(self, x: Array) -> Array:
        raise NotImplementedError

    def rsqrt(self, x: Array) -> Array:
        """``1 / sqrt(x)``; a backend with its own kernel (torch's ``rsqrt``) uses it."""
        return 1.0 / self.sqrt(x)

    def erf(self, x: Array) -> Array:
        raise NotImplementedError

    def maximum(self, x: Array, y: Array | float) -> Array:
        raise NotImplementedError

    def where(self, cond: Array, x: Array | float, y: Array | float) -> Array:
        raise NotImplementedError

    def isfinite_all(self, x: Array) -> bool:
        raise NotImplementedError

    # -- fused kernels: defaults built from the methods above; backends may override --
    def blockwise(self, kernel: Callable[[int, int], None], n: int, item_size: int) -> None:
        """Run ``kernel(lo, hi)`` over consecutive ranges that together cover ``range(n)``.

        ``kernel`` handles items ``lo..hi-1`` (rows, say) of about ``item_size`` elements
        each: it reads its inputs and writes its outputs through slices, and its ranges
        must be independent of each other. The same ``n`` and ``item_size`` always give
        the same ranges, so a backward pass may find what its forward kept per range.
        This default runs ``kernel(0, n)`` once; the NumPy backend cuts the range into
        cache-sized blocks (docs/design.md: performance).
        """
        if n:
            kernel(0, n)

    def gelu(self, x: Array) -> tuple[Array, Array]:
        """GELU (erf form) of ``x`` and what its VJP keeps: ``(x * Phi(x), saved)``.

        ``Phi`` is the standard normal CDF and ``phi`` its density. By default ``saved``
        is the derivative ``Phi(x) + x * phi(x)`` (the NumPy backend too), so the op
        keeps one array and ``gelu_vjp`` multiplies; a backend with a fused backward
        kernel may keep ``x`` instead.
        """
        cdf = 0.5 * (1.0 + self.erf(x * (1.0 / math.sqrt(2.0))))
        density = self.exp(-0.5 * x * x) * (1.0 / math.sqrt(2.0 * math.pi))
        return x * cdf, cdf + x * density

    def gelu_vjp(self, g: Array, saved: Array) -> Array:
        """The input cotangent of ``gelu`` from the output cotangent ``g`` and ``saved``."""
        return g * saved

    def add(self, a: Array, b: Array) -> Array:
        """``a + b`` of two arrays, with the backend's broadcasting and type promotion."""
        return a + b

    def add_(self, x: Array, b: Array) -> Array:
        """``x += b`` in place (``b`` broadcasts to ``x`` without changing its dtype); ``x``.

        ``x`` must be an array nothing else holds (a fresh result).
        """
        x += b
        return x

    def relu(self, x: Array) -> Array:
        """``max(x, 0)`` as a new array; NaN stays NaN."""
        return self.maximum(x, 0.0)

    def relu_vjp(self, g: Array, out: Array) -> Array:
        """``g * (out > 0)``, the input cotangent of ``relu`` from its output ``out``.

        NaN and infinite entries of ``g`` give NaN where ``out`` is 0, as the product does.
        """
        return g * (out > 0)

    # Fused kernels: a backend that has one for the operands returns its result; None
    # or False (the defaults) make the op run its generic code instead.
    def layer_norm_rows(
        self, x: Array, w: Array | None, b: Array | None, eps: float
    ) -> tuple[Array, Array, Array] | None:
        """``layer_norm`` of the rows of 2-D ``x``: ``(out, xhat, rstd)``, or None.

        ``xhat = (x - mean) * rstd``, ``rstd = 1 / sqrt(var + eps)`` of shape (rows, 1),
        ``out = xhat * w + b`` (``w``, ``b`` may be None). A backend whose
        ``layer_norm_backward_rows`` computes every wanted cotangent may return, in place
        of ``xhat``, whatever that backward needs (torch: the rows and their means).
        """
        return None

    def layer_norm_backward_rows(
        self, g: Array, w: Array | None, xhat: Array, rstd: Array, wants: tuple[bool, bool, bool]
    ) -> tuple[Array | None, Array | None, Array | None] | None:
        """Cotangents ``(gx, gw, gb)`` of ``layer_norm_rows`` for the rows' cotangent ``g``.

        ``gx = rstd * (gh - mean(gh) - xhat * mean(gh * xhat))`` with ``gh = g * w``,
        ``gw`` the column sums of ``g * xhat``, ``gb`` those of ``g``. ``wants`` says
        which are needed; an entry the backend leaves None (or a None result) is
        computed by the op's generic code.
        """
        return None

    def affine_rows(self, x: Array, w: Array, b: Array | None, out_in: bool) -> Array | None:
        """``x @ w.T + b`` (``out_in``: ``w`` is (out, in)) or ``x @ w + b`` of 2-D ``x`` in one
        fused kernel (``b`` may be None), or None without one for these operands."""
        return None

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
        """Cross-entropy of the rows of 2-D ``logits`` against 1-D integer ``targets`` by the
        backend's own fused kernel: ``(loss, vjp)`` with ``vjp(g) -> gradient of logits``
        for the cotangent ``g`` of ``loss`` (None when ``want`` is false), or None without
        one.

        As ``ops.cross_entropy`` with ``reduction``: a row whose target is ``ignore_index``
        has loss and gradient 0; ``"none"`` gives the per-row losses, ``"sum"`` their sum,
        ``"mean"`` their sum over the number of rows not ignored. ``count`` is that number
        where the caller counted it on the host; callers ask for ``"mean"`` only with a
        positive ``count``, which a backend may use instead of counting. Targets are
        already range-checked.
        """
        return None

    def cross_entropy_tile_(
        self,
        logits: Array,
        targets: Array,
        ignore_index: int,
        label_smoothing: float,
        weights: Array | None,
    ) -> Array | None:
        """Per-row cross-entropy of the 2-D ``logits`` (a temporary the caller owns) by the
        backend's own kernels, with ``logits`` then overwritten by the gradient of
        ``sum(weights * loss)`` where ``weights`` (one per row, or one for every row) is
        given, else left holding scratch values; None without such kernels (``logits``
        untouched).

        The rows' losses and gradients are ``cross_entropy_rows``' with ``"none"``: a row
        whose target is ``ignore_index`` has loss and gradient 0. Targets are already
        range-checked. ``ops.linear_cross_entropy`` runs it on each chunk of its logits,
        so the chunk needs no second array of its size.
        """
        return None

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
        """``softmax(q k^T * scale [+ causal mask]) v`` by the backend's own fused kernel.

        ``(out, vjp)`` with ``vjp(g) -> (gq, gk, gv)`` (None when ``want`` is false: no
        gradient needed), or None where the backend has none for these operands.
        ``causal`` hides key ``j`` from query ``i`` when ``j > i + query_offset``
        (``query_offset >= 0``). k and v may have fewer heads (axis -3) than q, dividing
        them, with equal other leading axes: grouped-query attention, query head ``h``
        reading key/value head ``h // (Hq / Hkv)``.
        """
        return None

    def softmax_rows_(self, x: Array) -> bool:
        """``x`` replaced by its softmax over the last axis, each row shifted by its maximum.

        A row of only ``-inf`` becomes zeros.
        """
        return False

    def softmax_backward_rows_(self, gp: Array, p: Array) -> bool:
        """``gp`` (cotangent of ``p``, a softmax over the last axis) replaced in place by the
        cotangent of the softmax's input: ``p * (gp - sum(gp * p))`` per row."""
        return False

    # -- reductions and shape ------------------------------------------------------
    def sum(self, x: Array, axis: Any = None, keepdims: bool = False) -> Array:
        raise NotImplementedError

    def max(self, x: Array, axis: Any = None, keepdims: bool = False) -> Array:
        raise NotImplementedError

    def argmax(self, x: Array, axis: int) -> Array:
        raise NotImplementedError

    def reshape(self, x: Array, shape: Shape) -> Array:
        raise NotImplementedError

    def transpose(self, x: Array, axes: Shape) -> Array:
        raise NotImplementedError

    def broadcast_to(self, x: Array, shape: Shape) -> Array:
        raise NotImplementedError

    def expand_dims(self, x: Array, axis: int) -> Array:
        raise NotImplementedError

    def concat(self, xs: list[Array], axis: int) -> Array:
        raise NotImplementedError

    def stack(self, xs: list[Array], axis: int) -> Array:
        raise NotImplementedError

    def pad(self, x: Array, widths: list[tuple[int, int]]) -> Array:
        """Zero padding; ``widths`` has one ``(before, after)`` pair per axis."""
        raise NotImplementedError

    def matmul(self, a: Array, b: Array) -> Array:
        raise NotImplementedError

    def scaled_matmul(self, a: Array, b: Array, scale: float, out: Array | None = None) -> Array:
        """``scale * (a @ b)`` for operands of at least two axes; into ``out`` when given.

        ``out`` has the product's shape (else ``ShapeError``) and may be a view into a
        larger array; it is returned, or the new array. A backend may scale inside the
        product (BLAS's alpha), so the bits may differ from ``matmul`` followed by a
        multiplication.
        """
        return scale_into(self.matmul(a, b), scale, out)

    def einsum(self, subscripts: str, *operands: Array) -> Array:
        raise NotImplementedError

    # -- indexing --------------------------------------------------------------------
    def take(self, x: Array, indices: Array, axis: int = 0) -> Array:
        raise NotImplementedError

    def take_along_axis(self, x: Array, indices: Array, axis: int) -> Array:
        raise NotImplementedError

    def index(self, index: Any) -> Any:
        """``index`` (NumPy's indexing: ints, slices, ``None``, ``...``, integer arrays, a
        boolean mask, alone or in a tuple) as this backend's arrays read it, with NumPy's
        meaning; NumPy arrays read it as it is."""
        return index

    def accumulate_at(self, out: Array, index: Any, values: Array) -> None:
        """``out[index] += values`` in place, accumulating repeated indices.

        ``index`` is anything NumPy indexing accepts: basic (ints, slices, ``None``,
        ``...``), integer arrays or a boolean mask, alone or in a tuple.
        """
        raise NotImplementedError

    def index_add(self, out: Array, indices: Array, values: Array) -> None:
        """``out[indices[i]] += values[i]`` in place for every ``i`` (rows, axis 0).

        ``indices`` is 1-D with integers in ``[0, out.shape[0])``; ``values`` has shape
        ``(len(indices),) + out.shape[1:]``. Repeated indices accumulate (scatter-add,
        like ``torch.Tensor.index_add_``).
        """
        raise NotImplementedError

    def sliding_windows(self, x: Array, kh: int, kw: int, stride: int) -> Array:
        """View (N, C, OH, OW, kh, kw) of the kh x kw windows of (N, C, H, W) ``x``."""
        raise NotImplementedError

    # -- randomness ------------------------------------------------------------------
    def random_uniform(self, generator: Any, shape: Shape, dtype: DType) -> Array:
        """Uniform [0, 1) samples drawn from a NumPy ``Generator`` (the session's RNG)."""
        raise NotImplementedError
