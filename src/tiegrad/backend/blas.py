"""Matrix products through oneMKL when it is installed (the extra ``tiegrad[mkl]``).

NumPy's wheels multiply with OpenBLAS. On x86-64, Intel's oneMKL (the PyPI package
``mkl``) runs the float32 products of this project's workloads faster on Intel's CPUs
(the benchmarks' tables), so the host backend's ``matmul`` hands every product that BLAS
can read in place to ``cblas_?gemm``, and a stack of products to one ``cblas_?gemm_batch_strided``
(``cblas_?gemm_batch`` with per-matrix addresses where the batch axes share no stride).

What goes to MKL: plain ``np.ndarray`` operands (no subclass) of one native-order dtype,
float32 or float64, no empty axis, each matrix row- or column-contiguous, every size and
stride within MKL's 32-bit integers: a vector times a vector or a matrix, or operands of
at least two axes whose batch axes broadcast (``matmul``'s rules). Everything else, and
everything when MKL is absent, is ``np.matmul`` unchanged, errors included. Either way the
result has ``np.matmul``'s type, shape and dtype (a scalar for two vectors); MKL's arrays
are new and C-contiguous, where NumPy's may follow the operands' memory order. The values
agree with OpenBLAS's to rounding, since the two libraries sum in different orders. MKL's
products do not report overflow or invalid operations to ``np.errstate`` as NumPy's do.

Loading: nothing happens at import. The first product (or the first read of
``LIBRARY``) loads ``libmkl_rt`` and makes these process-wide settings, each through
MKL's documented service functions, each because the products here need it:

- ``MKL_Set_Interface_Layer(LP64)``, first: the signatures below pass 32-bit integers,
  and ``libmkl_rt`` would read 64-bit ones under ``MKL_INTERFACE_LAYER=ILP64``. Where
  an earlier caller in this process has already fixed ILP64, MKL stays unused.
- ``MKL_CBWR_Set(MKL_CBWR_AUTO)``, unless the environment sets ``MKL_CBWR``: MKL's
  conditional numerical reproducibility for the CPU it finds, so a product repeats bit
  for bit on one machine with one thread count, whatever the alignment of its
  operands; exact resumption from a checkpoint relies on that.
- ``mkl_set_xerbla``: a handler that records an argument MKL refuses (it then returns
  without writing the result), so ``matmul`` has NumPy compute that product instead
  of returning an uninitialized array; MKL's own handler only prints.

The threading layer is MKL's own choice (Intel OpenMP, or GNU OpenMP where that is
loaded already, e.g. by ``import torch``, or where ``MKL_THREADING_LAYER`` asks);
it is only read (``MKL_Set_Threading_Layer(-1)`` returns it and sets nothing, the
query threadpoolctl makes too).
GNU OpenMP's threads do not survive ``fork``, and a forked child's first
multithreaded product would wait for them forever: in a child of the process that
loaded MKL (told by the process id; no fork hook), MKL on GNU OpenMP runs on one
thread (``MKL_Set_Num_Threads(1)``) from its first product on. Loading also has
``tiegrad._threads`` look the BLAS libraries up again, so MKL's current thread count
(``threadpoolctl`` limits included) caps the host kernels' threads.

``TIEGRAD_BLAS`` chooses, read once at import: unset or ``auto`` uses MKL when its
``libmkl_rt`` lies in this Python environment's ``lib`` folder and the CPU is Intel's
(``/proc/cpuinfo`` says ``GenuineIntel``, or says no vendor), ``numpy`` never uses it,
and ``mkl`` requires it (the import raises ``ConfigError`` when the file is missing).
``auto``'s rule follows the benchmarks: on AMD's CPUs NumPy's OpenBLAS is the faster.
``LIBRARY`` is the loaded library's file name, or None when products go to NumPy;
``INSTALLED`` says whether the file is there, chosen or not.
"""

from __future__ import annotations

import ctypes
import functools
import math
import os
import sys
import threading
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from .. import _threads
from ..errors import ConfigError
from .base import scale_into

ENV_SWITCH = "TIEGRAD_BLAS"
_NAMES = ("libmkl_rt.so.3", "libmkl_rt.so.2", "libmkl_rt.so")
_ROW_MAJOR, _NO_TRANS, _TRANS = 101, 111, 112
_CBWR_AUTO = 2
_LP64 = 0  # MKL_INTERFACE_LP64
_GNU_OPENMP = 3  # MKL_THREADING_GNU
_QUERY = -1  # not a layer: MKL_Set_Threading_Layer only returns the current one
_INT_MAX = 2**31 - 1  # MKL's LP64 interface takes 32-bit sizes and strides
_XERBLA = ctypes.CFUNCTYPE(None, ctypes.c_char_p, ctypes.POINTER(ctypes.c_int), ctypes.c_int)
_refusals = threading.local()  # .calls: (routine, argument position) MKL refused, per thread


@_XERBLA
def _record_refusal(routine: bytes, position: Any, length: int) -> None:
    """MKL's handler of a wrong argument (``mkl_set_xerbla``): MKL returns without computing.

    MKL checks the arguments on the calling thread, so each thread keeps its own record.
    """
    if not hasattr(_refusals, "calls"):
        _refusals.calls = []
    _refusals.calls.append((routine[:length].decode(errors="replace"), position[0]))


def _refused() -> bool:
    """Whether MKL refused an argument on this thread since the last check; warns.

    The caller then has NumPy compute the product. The handler is the process's: a
    refusal in another library's MKL call on this thread is reported at tiegrad's next
    product, which NumPy then computes as well (still right).
    """
    calls = getattr(_refusals, "calls", None)
    if not calls:
        return False
    routine, position = calls[-1]
    calls.clear()
    warnings.warn(
        f"tiegrad: MKL refused argument {position} of {routine}; NumPy computed the product",
        RuntimeWarning,
        stacklevel=4,
    )
    return True


class _Kernels(NamedTuple):
    """MKL's CBLAS entry points for one dtype."""

    gemm: Callable[..., None]
    gemm_batch_strided: Callable[..., None]
    gemm_batch: Callable[..., None]
    gemv: Callable[..., None]
    dot: Callable[..., float]


def _installed() -> list[Path]:
    """The MKL files in this Python environment's ``lib`` folder, in the loader's order."""
    paths = [Path(sys.prefix) / "lib" / name for name in _NAMES]
    return [path for path in paths if path.exists()]


def _intel_cpu() -> bool:
    """Whether the CPU is Intel's: ``/proc/cpuinfo``'s first ``vendor_id``, True unread."""
    try:
        with open("/proc/cpuinfo") as info:
            vendors = [line.split(":", 1)[1] for line in info if line.startswith("vendor_id")]
    except OSError:
        return True
    return not vendors or vendors[0].strip() == "GenuineIntel"


def _candidates() -> list[Path]:
    """The MKL files ``TIEGRAD_BLAS`` lets the loader try, in order (nothing is loaded)."""
    choice = os.environ.get(ENV_SWITCH, "auto") or "auto"
    if choice not in ("auto", "numpy", "mkl"):
        raise ConfigError(f"{ENV_SWITCH}={choice!r}: expected 'auto', 'numpy' or 'mkl'")
    if choice == "numpy" or (choice == "auto" and not _intel_cpu()):
        return []
    paths = _installed()
    if not paths and choice == "mkl":
        raise ConfigError(
            f"{ENV_SWITCH}=mkl but no {_NAMES[0]} in {Path(sys.prefix) / 'lib'}; "
            f"install it with: pip install 'tiegrad[mkl]'"
        )
    return paths


_CANDIDATES = _candidates()
_REQUIRED = os.environ.get(ENV_SWITCH) == "mkl"
MAY_LOAD = bool(_CANDIDATES)
"""Whether a product may go to MKL (a file to try); False: ``matmul`` is ``np.matmul``'s."""
INSTALLED = bool(_installed())
"""Whether oneMKL's file is in this environment (``TIEGRAD_BLAS=mkl`` then loads it)."""


def unused_reason() -> str | None:
    """Why products do not go to oneMKL in this process, or None where they do (loading
    it): not installed, installed but not chosen (``TIEGRAD_BLAS=numpy``, or ``auto``
    on a CPU not Intel's), or installed and chosen but not loadable. For messages such
    as a test's skip reason."""
    folder = Path(sys.prefix) / "lib"
    if not INSTALLED:
        return f"oneMKL is not installed (no {_NAMES[0]} in {folder}; pip install 'tiegrad[mkl]')"
    if not MAY_LOAD:
        choice = os.environ.get(ENV_SWITCH) or "auto"
        why = "on this CPU (not Intel's)" if choice == "auto" else f"by {ENV_SWITCH}={choice}"
        return f"oneMKL is installed but not chosen {why}; {ENV_SWITCH}=mkl chooses it"
    if _load()[0] is None:
        return f"oneMKL is installed and chosen but did not load ({folder})"
    return None


@functools.cache
def _load() -> tuple[str | None, dict[np.dtype, _Kernels]]:
    """The MKL library's file name and its kernels per dtype, loaded on the first call."""
    global _loader_pid, _one_thread_in_a_child
    _loader_pid = os.getpid()
    lib = None
    for path in _CANDIDATES:
        try:
            lib = ctypes.CDLL(str(path))
        except OSError:
            continue
        break
    if lib is None:
        if _REQUIRED:
            raise ConfigError(
                f"{ENV_SWITCH}=mkl but no loadable {_NAMES[0]} in {Path(sys.prefix) / 'lib'}"
            )
        return None, {}
    loaded = Path(lib._name).name
    if lib.MKL_Set_Interface_Layer(_LP64) != _LP64:  # first, before MKL reads its environment
        if _REQUIRED:
            raise ConfigError(
                f"{ENV_SWITCH}=mkl but {loaded} already runs its ILP64 interface "
                f"in this process; tiegrad calls it with 32-bit integers (LP64)"
            )
        return None, {}
    if "MKL_CBWR" not in os.environ and lib.MKL_CBWR_Set(_CBWR_AUTO) != 0:
        warnings.warn(
            f"tiegrad: {loaded} was called before tiegrad set its reproducible "
            "mode (MKL_CBWR_AUTO); matrix products may differ in the last bits between runs",
            RuntimeWarning,
            stacklevel=2,
        )
    lib.mkl_set_xerbla.restype = ctypes.c_void_p
    lib.mkl_set_xerbla(_record_refusal)  # a refused call warns instead of printing
    if lib.MKL_Set_Threading_Layer(_QUERY) == _GNU_OPENMP:  # reads the layer, sets none
        _one_thread_in_a_child = functools.partial(lib.MKL_Set_Num_Threads, 1)
    _threads.rescan()  # MKL's thread count caps tiegrad's own kernels' from now on
    i, vp = ctypes.c_int, ctypes.c_void_p
    kernels = {}
    for dtype, scalar, prefix in (
        (np.dtype(np.float32), ctypes.c_float, "s"),
        (np.dtype(np.float64), ctypes.c_double, "d"),
    ):
        gemm = (i, i, i, i, i, i, scalar, vp, i, vp, i, scalar, vp, i)
        signatures = {  # in the order of ``_Kernels``
            "gemm": gemm,
            "gemm_batch_strided": gemm[:9] + (i,) + gemm[9:11] + (i,) + gemm[11:] + (i, i),
            "gemm_batch": (i,) + (vp,) * 13 + (i, vp),
            "gemv": (i, i, i, i, scalar, vp, i, vp, i, scalar, vp, i),
            "dot": (i, vp, i, vp, i),
        }
        entries = []
        for name, argtypes in signatures.items():
            entry = getattr(lib, f"cblas_{prefix}{name}")
            entry.argtypes = argtypes
            entry.restype = scalar if name == "dot" else None
            entries.append(entry)
        kernels[dtype] = _Kernels(*entries)
    return loaded, kernels


_loader_pid = 0  # the process that loaded MKL
_one_thread_in_a_child: Callable[[], None] | None = None  # where MKL runs on GNU OpenMP


def on_gnu_openmp() -> bool:
    """Whether oneMKL is loaded and runs its products on GNU OpenMP (MKL chooses that
    layer where GNU OpenMP is loaded first, as PyTorch does, or ``MKL_THREADING_LAYER``
    says so): numba's ``omp`` threads are then MKL's team (``host_blocks``)."""
    return _one_thread_in_a_child is not None


def _kernels() -> dict[np.dtype, _Kernels]:
    """MKL's kernels per dtype (loading MKL on the first call); empty without MKL.

    In a forked child of a process whose MKL runs on GNU OpenMP, MKL runs on one thread
    from its first product on (module docstring).
    """
    global _loader_pid
    kernels = _load()[1]
    if _loader_pid != os.getpid():  # a forked child
        _loader_pid = os.getpid()
        if _one_thread_in_a_child is not None:
            _one_thread_in_a_child()
    return kernels


def __getattr__(name: str) -> Any:
    """``LIBRARY``: the loaded MKL's file name or None, loading MKL on the first read."""
    if name == "LIBRARY":
        return _load()[0]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _matrix(rows: int, cols: int, s0: int, s1: int) -> tuple[int, int] | None:
    """(transpose flag, leading dimension) for a matrix with element strides (s0, s1)."""
    if s1 == 1 or cols == 1:
        ld = s0 if rows > 1 else cols
        if ld >= cols:
            return _NO_TRANS, ld
    if s0 == 1 or rows == 1:
        ld = s1 if cols > 1 else rows
        if ld >= rows:
            return _TRANS, ld
    return None


def _batch_strides(
    shape: tuple[int, ...], strides: tuple[int, ...], batch: tuple[int, ...], item: int
) -> tuple[int, ...]:
    """The operand's element stride along each axis of ``batch`` (0 where it broadcasts)."""
    pad = len(batch) - len(shape)
    return tuple(
        strides[j - pad] // item if j >= pad and shape[j - pad] != 1 else 0
        for j in range(len(batch))
    )


def _even_stride(strides: tuple[int, ...], batch: tuple[int, ...]) -> int | None:
    """One stride stepping through the matrices in ``batch`` order, if the axes allow it."""
    axes = [(n, s) for n, s in zip(batch, strides) if n != 1]
    if not axes:
        return 0
    step = expected = axes[-1][1]
    for (_, stride), (inner_count, _) in zip(reversed(axes[:-1]), reversed(axes[1:])):
        expected *= inner_count
        if stride != expected:
            return None
    return step if step >= 0 else None


def _addresses(base: int, strides: tuple[int, ...], batch: tuple[int, ...], item: int) -> Any:
    """The address of every matrix of an operand, in ``batch`` order (int64 array)."""
    return _byte_offsets(strides, batch, item) + base


@functools.lru_cache(maxsize=256)
def _byte_offsets(strides: tuple[int, ...], batch: tuple[int, ...], item: int) -> np.ndarray:
    """The byte offset of every matrix from the first, in ``batch`` order (read-only).

    Cached: a training step multiplies operands of the same layouts at new addresses.
    """
    offsets = np.zeros(1, np.int64)
    for n, stride in zip(batch, strides):
        offsets = (offsets[:, None] + np.arange(n, dtype=np.int64) * stride).reshape(-1)
    offsets *= item
    offsets.flags.writeable = False
    return offsets


def _address(x: np.ndarray) -> int:
    """The address of ``x``'s first element (NumPy's documented ``ctypes.data``)."""
    return x.ctypes.data


def matmul(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """``np.matmul(a, b)``, computed by MKL where the layout allows (module docstring).

    Aligned operands (NumPy's ``flags.aligned``) have strides in whole elements.
    """
    kernels = _operand_kernels(a, b)
    if kernels is None:
        return np.matmul(a, b)
    if a.ndim > 1 and b.ndim > 1:
        out = _matrix_product(kernels, a, b)
    else:
        out = _vector_product(kernels, a, b) if a.ndim and b.ndim and a.ndim + b.ndim <= 3 else None
    return np.matmul(a, b) if out is None else out


def scaled_matmul(
    a: np.ndarray, b: np.ndarray, scale: float, out: np.ndarray | None = None
) -> np.ndarray:
    """``scale * (a @ b)`` for operands of at least two axes, into ``out`` when given.

    MKL scales the product as it writes it (its ``alpha``), into a new array or into
    ``out`` where it reads the operands (as ``matmul``) and ``out`` is a writable array
    of the product's shape and dtype whose matrices have rows of unit stride (any row
    and batch strides: a view into a larger array works), sharing no memory with them.
    Otherwise, and for a ``scale`` of 0 or not finite (where BLAS would skip the
    operands and so drop their NaN), the product is computed, scaled and assigned with
    NumPy's casting. An ``out`` of another shape is a ``ShapeError`` (a ``ValueError``),
    even one the product would broadcast to. Returns ``out``, or the new array.
    """
    kernels = _operand_kernels(a, b)
    if kernels is not None and min(a.ndim, b.ndim) >= 2 and scale != 0 and math.isfinite(scale):
        writable = out is None or writable_out(out, a, b)
        done = _matrix_product(kernels, a, b, out, scale) if writable else None
        if done is not None:
            return done
    return scale_into(matmul(a, b), scale, out)


def writable_out(out: Any, a: np.ndarray, b: np.ndarray) -> bool:
    """Whether a product of ``a`` and ``b`` may be written into ``out`` itself: a plain,
    aligned, writable ndarray of ``a``'s dtype that shares no memory with either."""
    return (
        type(out) is np.ndarray
        and out.dtype == a.dtype
        and out.flags.aligned
        and out.flags.writeable
        and not np.may_share_memory(out, a)
        and not np.may_share_memory(out, b)
    )


def _operand_kernels(a: Any, b: Any) -> _Kernels | None:
    """MKL's kernels for ``a @ b``, or None where the operands go to NumPy."""
    if type(a) is not np.ndarray or type(b) is not np.ndarray:
        return None  # lists, scalars, subclasses: NumPy converts and wraps
    kernels = _kernels().get(a.dtype)
    if (
        kernels is None
        or b.dtype != a.dtype
        or not (a.flags.aligned and b.flags.aligned)
        or a.size == 0
        or b.size == 0
    ):
        return None
    return kernels


def _matrix_product(
    kernels: _Kernels, a: np.ndarray, b: np.ndarray, out: np.ndarray | None = None, alpha=1.0
) -> np.ndarray | None:
    """``alpha * (a @ b)`` for operands of at least two axes, into ``out`` (or a new array).

    None where BLAS cannot read the operands or write ``out``.
    """
    item = a.itemsize
    m, k = a.shape[-2:]
    k_b, n = b.shape[-2:]
    la = _matrix(m, k, a.strides[-2] // item, a.strides[-1] // item)
    lb = _matrix(k, n, b.strides[-2] // item, b.strides[-1] // item)
    if k != k_b or la is None or lb is None or max(m, n, k, la[1], lb[1]) > _INT_MAX:
        return None
    try:
        batch = np.broadcast_shapes(a.shape[:-2], b.shape[:-2]) if a.ndim + b.ndim > 4 else ()
    except ValueError:
        return None  # NumPy raises its own error
    if out is None:
        out = np.empty(batch + (m, n), a.dtype)
    elif out.shape != batch + (m, n):
        return None
    lc = _matrix(m, n, out.strides[-2] // item, out.strides[-1] // item)
    if lc is None or lc[0] != _NO_TRANS or lc[1] > _INT_MAX:
        return None
    if a.ndim == 2 and b.ndim == 2:
        kernels.gemm(_ROW_MAJOR, la[0], lb[0], m, n, k, alpha, _address(a), la[1],
             _address(b), lb[1], 0.0, _address(out), lc[1])  # fmt: skip
        return None if _refused() else out
    count = math.prod(batch)
    strides_c = _batch_strides(batch, out.strides[:-2], batch, item)
    if count * m * n > _INT_MAX or any(s <= 0 for s, c in zip(strides_c, batch) if c > 1):
        return None
    strides_a = _batch_strides(a.shape[:-2], a.strides[:-2], batch, item)
    strides_b = _batch_strides(b.shape[:-2], b.strides[:-2], batch, item)
    sa, sb = _even_stride(strides_a, batch), _even_stride(strides_b, batch)
    sc = _even_stride(strides_c, batch)
    if sc is not None and sc < lc[1] * m:  # MKL's strided call rejects it
        sc = lc[1] * m if count == 1 else None  # interleaved destinations: by address
    if sa is not None and sb is not None and sc is not None and max(sa, sb, sc) <= _INT_MAX:
        kernels.gemm_batch_strided(_ROW_MAJOR, la[0], lb[0], m, n, k, alpha, _address(a),
                                   la[1], sa, _address(b), lb[1], sb, 0.0, _address(out),
                                   lc[1], sc, count)  # fmt: skip
        return None if _refused() else out
    # One group of ``count`` products given by address: any batch strides, one call.
    pa = _addresses(_address(a), strides_a, batch, item)
    pb = _addresses(_address(b), strides_b, batch, item)
    pc = _addresses(_address(out), strides_c, batch, item)
    sizes = np.array([la[0], lb[0], m, n, k, la[1], lb[1], lc[1], count], np.int32)
    scalars = np.array([alpha, 0.0], a.dtype)
    at = _address(sizes)
    ax = _address(scalars)
    i4, f = 4, a.itemsize
    kernels.gemm_batch(_ROW_MAJOR, at, at + i4, at + 2 * i4, at + 3 * i4, at + 4 * i4, ax,
                       _address(pa), at + 5 * i4, _address(pb), at + 6 * i4, ax + f,
                       _address(pc), at + 7 * i4, 1, at + 8 * i4)  # fmt: skip
    return None if _refused() else out


def _vector_product(kernels: _Kernels, a: np.ndarray, b: np.ndarray) -> Any:
    """``a @ b`` where one operand is a vector and the other a vector or a matrix, or None."""
    item = a.itemsize
    if a.shape[-1] != b.shape[0 if b.ndim == 1 else -2]:
        return None
    if a.ndim == 1 and b.ndim == 1:
        ia, ib = a.strides[0] // item, b.strides[0] // item
        if min(ia, ib) <= 0 or max(ia, ib, a.size) > _INT_MAX:
            return None
        value = kernels.dot(a.size, _address(a), ia, _address(b), ib)
        return None if _refused() else a.dtype.type(value)
    mat, vec = (a, b) if b.ndim == 1 else (b, a)
    rows, cols = mat.shape
    layout = _matrix(rows, cols, mat.strides[0] // item, mat.strides[1] // item)
    inc = vec.strides[0] // item if vec.size > 1 else 1
    if layout is None or inc <= 0 or max(rows, cols, layout[1], inc) > _INT_MAX:
        return None
    trans, ld = layout
    if mat is b:  # vector @ matrix is the transposed matrix times the vector
        trans = _TRANS if trans == _NO_TRANS else _NO_TRANS
    stored_rows, stored_cols = (rows, cols) if layout[0] == _NO_TRANS else (cols, rows)
    out = np.empty(cols if mat is b else rows, a.dtype)
    kernels.gemv(_ROW_MAJOR, trans, stored_rows, stored_cols, 1.0, _address(mat), ld,
                 _address(vec), inc, 0.0, _address(out), 1)  # fmt: skip
    return None if _refused() else out
