"""Per-op cost of the tiegrad tape against raw NumPy and against PyTorch autograd.

Run ``python -m benchmarks.tape_overhead``. On 64x64 float32 operands it times
``add``, ``mul`` and ``matmul`` (record + forward) and a 10-op chain with its
backward, and on ``--logits`` (default W2's 128 x 10) a mean cross-entropy with its
backward, and prints a table of microseconds per op (per call for the cross-entropy)
with the ratios. The goal
(issue 2): tiegrad's per-op time is at most PyTorch's with autograd recording
(inputs with ``requires_grad``).

Method: a timed block is ``--block`` calls; the sides (NumPy, tiegrad, PyTorch) run
one block each in turn, rotating the order every round, for ``--repeats`` rounds,
and the table shows each side's median. Interleaving makes load from other
processes hit every side alike. For single ops tiegrad records into a session reset
before each block (untimed); a chain resets its session first (timed), as a training
step would. The NumPy column is the bare array
math: the op itself, and for the chain the same forward plus a hand-written
backward; the three chains are checked to give the same gradients before timing.
Everything runs on ``--threads`` threads (default 1: small ops gain nothing from
more, and the figures stay stable). ``--device torch:cpu`` (or ``cuda``) records tiegrad
on that device's session, its operands uploaded once, against PyTorch on the same
device (issue 42: the device tape's per-op cost); the NumPy column stays the host's.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable


def _parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description="tiegrad tape overhead vs NumPy and PyTorch")
    p.add_argument("--repeats", type=int, default=300, help="timed rounds per case")
    p.add_argument("--block", type=int, default=100, help="calls per timed block")
    p.add_argument("--threads", type=int, default=1, help="BLAS / OpenMP / torch threads")
    p.add_argument("--size", type=int, default=64, help="operands are size x size")
    p.add_argument("--device", default=None, help="tiegrad's device (torch:cpu, cuda)")
    p.add_argument("--logits", default="128,10", help="rows,classes of the cross-entropy's logits")
    return p.parse_args()


ARGS = _parse()
for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ[_var] = str(ARGS.threads)

import numpy as np  # noqa: E402  (the thread variables must be set before the import)

import tiegrad.ops as T  # noqa: E402
from tiegrad import EagerSession  # noqa: E402

try:
    import torch
    import torch.nn.functional as F

    torch.set_num_threads(ARGS.threads)
except ImportError:
    torch = None

CHAIN_OPS = 10
DEVICE = ARGS.device


def _session() -> EagerSession:
    return EagerSession(device=DEVICE)


def _torch_device() -> str:
    """PyTorch's device for the torch side: the one tiegrad records on."""
    return "cpu" if DEVICE in (None, "torch:cpu") else DEVICE.removeprefix("torch:")


def _operand(s: EagerSession, a: np.ndarray):
    """``a`` as the session's array (uploaded once, outside the timed blocks)."""
    return s.backend.asarray(a)


def _host(g) -> np.ndarray:
    return g.detach().cpu().numpy() if torch is not None and isinstance(g, torch.Tensor) else g


Side = tuple[Callable[[], object], Callable[[], None] | None]  # (call, untimed setup)


def interleaved_medians(sides: list[Side], calls_per_block: int) -> list[float]:
    """Median seconds per call of each side, the sides' blocks run in rotating order."""
    times: list[list[float]] = [[] for _ in sides]
    k = ARGS.block
    for r in range(ARGS.repeats):
        for j in range(len(sides)):
            j = (j + r) % len(sides)
            call, setup = sides[j]
            if setup is not None:
                setup()
            t0 = time.perf_counter()
            for _ in range(k):
                call()
            times[j].append((time.perf_counter() - t0) / calls_per_block)
    return [statistics.median(t) for t in times]


def bench_single(name: str, a: np.ndarray, b: np.ndarray) -> list[float]:
    """Seconds per call of one binary op: [numpy, tiegrad, torch (if installed)]."""
    np_op = {"add": np.add, "mul": np.multiply, "matmul": np.matmul}[name]
    tg_op = {"add": T.add, "mul": T.mul, "matmul": T.matmul}[name]
    s = _session()
    refs: list = []
    da, db = _operand(s, a), _operand(s, b)

    def tg_setup() -> None:
        s.reset()
        refs[:] = [s.leaf(da), s.leaf(db)]

    sides: list[Side] = [
        (lambda: np_op(a, b), None),
        (lambda: tg_op(*refs), tg_setup),
    ]
    if torch is not None:
        th_op = {"add": torch.add, "mul": torch.mul, "matmul": torch.matmul}[name]
        ta = torch.tensor(a, requires_grad=True, device=_torch_device())
        tb = torch.tensor(b, requires_grad=True, device=_torch_device())
        sides.append((lambda: th_op(ta, tb), None))
    return interleaved_medians(sides, ARGS.block)


def numpy_chain(x, w1, w2, bias) -> list[np.ndarray]:
    """The chain's forward and a hand-written backward in NumPy: grads of x, w1, w2, bias."""
    h1 = x @ w1
    h2 = h1 + bias
    h3 = np.tanh(h2)
    h4 = h3 * x
    h5 = h4 - bias
    h6 = h5 @ w2
    h7 = 0.5 * (1.0 + np.tanh(0.5 * h6))
    h8 = h7 * h7
    h9 = np.maximum(h8, 0.0)
    h9.sum()
    g8 = np.ones_like(h9) * (h8 > 0)
    g6 = g8 * (2.0 * h7) * h7 * (1.0 - h7)
    gw2 = h5.T @ g6
    g5 = g6 @ w2.T
    g2 = g5 * x * (1.0 - h3 * h3)
    gx = g5 * h3 + g2 @ w1.T
    gw1 = x.T @ g2
    gb = g2.sum(axis=0) - g5.sum(axis=0)
    return [gx, gw1, gw2, gb]


def tiegrad_chain(s: EagerSession, x, w1, w2, bias) -> list[np.ndarray]:
    """The chain recorded on ``s`` (reset first), then its backward; the leaves' grads."""
    s.reset()
    leaves = [s.leaf(v) for v in (x, w1, w2, bias)]
    xr, a, b, c = leaves
    h = T.matmul(xr, a)
    h = T.add(h, c)
    h = T.tanh(h)
    h = T.mul(h, xr)
    h = T.sub(h, c)
    h = T.matmul(h, b)
    h = T.sigmoid(h)
    h = T.mul(h, h)
    h = T.relu(h)
    grads = s.backward(T.sum(h))
    return [grads[r] for r in leaves]


def torch_chain(tx, ta, tb, tc) -> list[np.ndarray]:
    """The chain in PyTorch with autograd; the leaves' grads (cleared for the next call)."""
    h = torch.matmul(tx, ta)
    h = h + tc
    h = torch.tanh(h)
    h = h * tx
    h = h - tc
    h = torch.matmul(h, tb)
    h = torch.sigmoid(h)
    h = h * h
    h = torch.relu(h)
    h.sum().backward()
    leaves = (tx, ta, tb, tc)
    grads = [t.grad for t in leaves]
    for t in leaves:
        t.grad = None
    return grads


def bench_chain(x, w1, w2, bias) -> list[float]:
    """Seconds per op of the 10-op chain with backward: [numpy, tiegrad, torch]."""
    s = _session()
    arrays = (x, w1, w2, bias)
    ours_in = tuple(_operand(s, v) for v in arrays)
    reference = numpy_chain(*arrays)
    for ours, ref in zip(tiegrad_chain(s, *ours_in), reference):
        np.testing.assert_allclose(_host(ours), ref, rtol=1e-4, atol=1e-4)
    sides: list[Side] = [
        (lambda: numpy_chain(*arrays), None),
        (lambda: tiegrad_chain(s, *ours_in), None),
    ]
    if torch is not None:
        leaves = [torch.tensor(v, requires_grad=True, device=_torch_device()) for v in arrays]
        for theirs, ref in zip(torch_chain(*leaves), reference):
            np.testing.assert_allclose(_host(theirs), ref, rtol=1e-4, atol=1e-4)
        sides.append((lambda: torch_chain(*leaves), None))
    return interleaved_medians(sides, ARGS.block * CHAIN_OPS)


def numpy_cross_entropy(x: np.ndarray, t: np.ndarray) -> np.ndarray:
    """The mean cross-entropy of the rows of ``x`` and its gradient, by hand in NumPy."""
    rows = np.arange(len(t))
    shifted = x - x.max(axis=1, keepdims=True)
    e = np.exp(shifted)
    den = e.sum(axis=1, keepdims=True)
    (np.log(den[:, 0]) - shifted[rows, t]).mean()
    g = e / den
    g[rows, t] -= 1.0
    return g / len(t)


def tiegrad_cross_entropy(s: EagerSession, x, t: np.ndarray):
    """The mean cross-entropy recorded on ``s`` (reset first), then its backward."""
    s.reset()
    xr = s.leaf(x)
    return s.backward(T.cross_entropy(xr, t))[xr]


def torch_cross_entropy(tx, tt):
    """``F.cross_entropy`` and its backward; the gradient (cleared for the next call)."""
    F.cross_entropy(tx, tt).backward()
    g, tx.grad = tx.grad, None
    return g


def bench_cross_entropy(x: np.ndarray, t: np.ndarray) -> list[float]:
    """Seconds per call of a mean cross-entropy with its backward: [numpy, tiegrad, torch]."""
    s = _session()
    ours_in = _operand(s, x)
    reference = numpy_cross_entropy(x, t)
    tol = {"rtol": 1e-4, "atol": 1e-6}
    np.testing.assert_allclose(_host(tiegrad_cross_entropy(s, ours_in, t)), reference, **tol)
    sides: list[Side] = [
        (lambda: numpy_cross_entropy(x, t), None),
        (lambda: tiegrad_cross_entropy(s, ours_in, t), None),
    ]
    if torch is not None:
        tx = torch.tensor(x, requires_grad=True, device=_torch_device())
        tt = torch.tensor(t, device=_torch_device())
        np.testing.assert_allclose(_host(torch_cross_entropy(tx, tt)), reference, **tol)
        sides.append((lambda: torch_cross_entropy(tx, tt), None))
    return interleaved_medians(sides, ARGS.block)


def main() -> int:
    n = ARGS.size
    rng = np.random.default_rng(0)
    a = rng.standard_normal((n, n)).astype(np.float32)
    b = rng.standard_normal((n, n)).astype(np.float32)
    bias = rng.standard_normal(n).astype(np.float32)
    w1 = (rng.standard_normal((n, n)) / np.sqrt(n)).astype(np.float32)
    w2 = (rng.standard_normal((n, n)) / np.sqrt(n)).astype(np.float32)
    rows = [(name, bench_single(name, a, b)) for name in ("add", "mul", "matmul")]
    rows.append((f"chain{CHAIN_OPS}+bwd", bench_chain(a, w1, w2, bias)))
    n_rows, classes = (int(k) for k in ARGS.logits.split(","))
    logits = (rng.standard_normal((n_rows, classes)) * 3).astype(np.float32)
    targets = rng.integers(0, classes, n_rows)
    rows.append(("xent+bwd", bench_cross_entropy(logits, targets)))
    torch_name = f"torch {torch.__version__}" if torch is not None else "torch not installed"
    print(
        f"tape overhead: {n}x{n} float32, median of {ARGS.repeats} interleaved blocks of "
        f"{ARGS.block} calls, {ARGS.threads} thread(s), numpy {np.__version__}, {torch_name}, "
        f"tiegrad on {DEVICE or 'the host'}"
    )
    header = (
        f"{'case':<14}{'numpy us':>10}{'tiegrad us':>12}{'torch us':>10}"
        f"{'tg/numpy':>10}{'tg/torch':>10}"
    )
    print(header)
    print("-" * len(header))
    worst = 0.0
    for name, (t_np, t_tg, *rest) in rows:
        t_th = rest[0] if rest else None
        th = f"{t_th * 1e6:10.2f}" if t_th is not None else f"{'n/a':>10}"
        ratio = f"{t_tg / t_th:10.2f}" if t_th is not None else f"{'n/a':>10}"
        print(f"{name:<14}{t_np * 1e6:10.2f}{t_tg * 1e6:12.2f}{th}{t_tg / t_np:10.2f}{ratio}")
        if t_th is not None:
            worst = max(worst, t_tg / t_th)
    print("chain: per op, forward + backward; numpy = forward + hand-written backward")
    print(f"xent+bwd: per call, mean cross-entropy of {n_rows}x{classes} logits + backward")
    if torch is not None:
        verdict = "met" if worst <= 1.0 else "NOT met"
        print(f"goal tiegrad <= torch per op: {verdict} (worst ratio {worst:.2f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
