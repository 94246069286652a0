"""The host kernels as bodies of an OpenMP parallel region: C functions, no Python, no GIL.

``numpy_backend`` shares a kernel call between the threads of MKL's OpenMP team
(``tiegrad._threads.Team.launch``): every thread of the team calls the kernel's entry
point here with the address of one job, and the threads claim the job's blocks with an
atomic counter until none is left. A thread of the team never enters Python, so a
shared call costs a few microseconds instead of the tens that a Python callback per
thread costs (each needs the GIL, and waking a thread that waits for it is slow), and
calls of 64k elements gain from the second thread.

A job is a C-contiguous int64 array, built by ``job``:

====  ====================================================================
 0    the next block to claim (the counter; 0 when the job starts)
 1    the number of blocks
 2    the rows (or elements) of a block
 3    the rows (or elements) of the call
 4    the row size (1 for an elementwise kernel)
 5..  the operands in the kernel's order: an array's data address, a float
      scalar's float32 bit pattern
====  ====================================================================

The caller keeps every operand alive until the region ends and guarantees the layout
the kernel expects (float32, C-contiguous, shapes as in ``host_kernels``). ``ENTRIES``
maps a kernel's name to its entry point.
"""

from __future__ import annotations

from typing import Any

import numba
import numpy as np
from llvmlite import ir
from numba import types
from numba.extending import intrinsic

from .. import _numba
from . import host_kernels as hk

_entry = _numba.cfunc(types.void(types.CPointer(types.int64)))
_inline = _numba.jit(inline="always")


@intrinsic
def _claim(typingctx: Any, counter: Any) -> Any:
    """Atomically add 1 to the int64 at ``counter``; the value before."""
    sig = types.int64(types.CPointer(types.int64))

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        return builder.atomic_rmw("add", args[0], ir.Constant(ir.IntType(64), 1), "monotonic")

    return sig, codegen


@intrinsic
def _floats(typingctx: Any, address: Any) -> Any:
    """The int64 ``address`` as a pointer to float32."""
    sig = types.CPointer(types.float32)(types.int64)

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        return builder.inttoptr(args[0], context.get_value_type(signature.return_type))

    return sig, codegen


@_inline
def _flat(job: Any, k: int) -> Any:
    """Operand ``k`` of ``job`` as a flat float32 array of the call's elements."""
    return numba.carray(_floats(job[5 + k]), job[3])


@_inline
def _rows(job: Any, k: int, width: int) -> Any:
    """Operand ``k`` of ``job`` as a (rows, width) float32 array."""
    return numba.carray(_floats(job[5 + k]), (job[3], width))


@_inline
def _vector(job: Any, k: int) -> Any:
    """Operand ``k`` of ``job`` as a float32 vector of the row size."""
    return numba.carray(_floats(job[5 + k]), job[4])


@_inline
def _next(job: Any) -> Any:
    """The next block ``(lo, hi)`` of ``job``, claimed for this thread; ``lo == hi`` at the end."""
    b = _claim(job)
    if b >= job[1]:
        return 0, 0
    lo = b * job[2]
    return lo, min(job[3], lo + job[2])


@_entry
def gelu(job: Any) -> None:
    """``host_kernels.gelu``; operands x, y, d."""
    x, y, d = _flat(job, 0), _flat(job, 1), _flat(job, 2)
    lo, hi = _next(job)
    while lo < hi:
        hk.gelu(x, y, d, lo, hi)
        lo, hi = _next(job)


@_entry
def relu_vjp(job: Any) -> None:
    """``host_kernels.relu_vjp``; operands g, y, out."""
    g, y, out = _flat(job, 0), _flat(job, 1), _flat(job, 2)
    lo, hi = _next(job)
    while lo < hi:
        hk.relu_vjp(g, y, out, lo, hi)
        lo, hi = _next(job)


@_entry
def multiply(job: Any) -> None:
    """``host_kernels.multiply``; operands a, b, out."""
    a, b, out = _flat(job, 0), _flat(job, 1), _flat(job, 2)
    lo, hi = _next(job)
    while lo < hi:
        hk.multiply(a, b, out, lo, hi)
        lo, hi = _next(job)


@_entry
def add(job: Any) -> None:
    """``host_kernels.add``; operands a, b, out."""
    a, b, out = _flat(job, 0), _flat(job, 1), _flat(job, 2)
    lo, hi = _next(job)
    while lo < hi:
        hk.add(a, b, out, lo, hi)
        lo, hi = _next(job)


@_entry
def add_row_vector(job: Any) -> None:
    """``host_kernels.add_row_vector``; operands x, v."""
    x, v = _rows(job, 0, job[4]), _vector(job, 1)
    lo, hi = _next(job)
    while lo < hi:
        hk.add_row_vector(x, v, lo, hi)
        lo, hi = _next(job)


@_entry
def layer_norm(job: Any) -> None:
    """``host_kernels.layer_norm``; operands x, w, b, eps, xhat, rstd, out."""
    d = job[4]
    x, w, b = _rows(job, 0, d), _vector(job, 1), _vector(job, 2)
    eps = hk.float_from_bits(np.int32(job[8]))
    xhat, rstd, out = _rows(job, 4, d), _rows(job, 5, 1), _rows(job, 6, d)
    lo, hi = _next(job)
    while lo < hi:
        hk.layer_norm(x, w, b, eps, xhat, rstd, out, lo, hi)
        lo, hi = _next(job)


@_entry
def layer_norm_backward(job: Any) -> None:
    """``host_kernels.layer_norm_backward``; operands g, w, xhat, rstd, gx."""
    d = job[4]
    g, w, xhat = _rows(job, 0, d), _vector(job, 1), _rows(job, 2, d)
    rstd, gx = _rows(job, 3, 1), _rows(job, 4, d)
    lo, hi = _next(job)
    while lo < hi:
        hk.layer_norm_backward(g, w, xhat, rstd, gx, lo, hi)
        lo, hi = _next(job)


@_entry
def softmax(job: Any) -> None:
    """``host_kernels.softmax``; operand x."""
    x = _rows(job, 0, job[4])
    lo, hi = _next(job)
    while lo < hi:
        hk.softmax(x, lo, hi)
        lo, hi = _next(job)


@_entry
def softmax_backward(job: Any) -> None:
    """``host_kernels.softmax_backward``; operands gp, p."""
    gp, p = _rows(job, 0, job[4]), _rows(job, 1, job[4])
    lo, hi = _next(job)
    while lo < hi:
        hk.softmax_backward(gp, p, lo, hi)
        lo, hi = _next(job)


ENTRIES = {
    f.__name__: f.address
    for f in (
        gelu,
        relu_vjp,
        multiply,
        add,
        add_row_vector,
        layer_norm,
        layer_norm_backward,
        softmax,
        softmax_backward,
    )
}


def job(n_blocks: int, per_block: int, items: int, row_size: int, operands: Any) -> np.ndarray:
    """The job array of one call (module docstring); ``operands`` in the kernel's order."""
    words = [0, n_blocks, per_block, items, row_size]
    for op in operands:
        if isinstance(op, np.ndarray):
            words.append(hk.address(op))
        else:
            words.append(int(np.float32(op).view(np.int32)))
    return np.array(words, np.int64)
