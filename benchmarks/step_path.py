"""The modules one ``Optimizer.step`` passes through, read off a call trace.

Run ``python -m benchmarks.step_path [--device]``. It builds a small tied ``TiedLM``
with ``AdamW``, takes two warm steps, then traces the third (``sys.setprofile``, Python
calls only) on the host route, or with ``--device`` on a ``torch:cpu`` session's route.
A stop is a call that enters another tiegrad module than its caller's. It prints the
modules in the order the step first enters them, each caller -> callee edge between
modules with its number of calls, then the counts: modules, edges, and climbs: the calls
into a module that is already on the stack below the caller (a lower layer calling back
up; a thread pool running a task it was handed counts too).
"""

from __future__ import annotations

import argparse
import sys
from types import FrameType
from typing import Any

import numpy as np

import tiegrad
from tiegrad.models import TiedLM
from tiegrad.optim import AdamW

_ROOT = "tiegrad"


def _module(frame: FrameType | None) -> str | None:
    name = frame.f_globals.get("__name__", "") if frame is not None else ""
    return name if name == _ROOT or name.startswith(_ROOT + ".") else None


def trace_step(device: bool) -> list[tuple[str, str, bool]]:
    """``[(caller, callee, climbed)]`` for each stop of one traced ``step`` (see the module)."""
    session = tiegrad.EagerSession(seed=0, device="torch:cpu" if device else None)
    model = TiedLM(32, d_model=16, n_layers=1, n_heads=2, max_seq_len=8, seed=0)
    model.freeze("embed.weight")
    opt = AdamW(model.parameters(), lr=1e-2)
    x = np.random.default_rng(0).integers(0, 32, (4, 8))
    stops: list[tuple[str, bool]] = []

    def profile(frame: FrameType, event: str, arg: Any) -> None:
        if event != "call":
            return
        callee, caller = _module(frame), _module(frame.f_back)
        if callee is None or caller is None or callee == caller:
            return
        below: set[str] = set()
        f = frame.f_back.f_back if frame.f_back is not None else None
        while f is not None:
            m = _module(f)
            if m is not None:
                below.add(m)
            f = f.f_back
        stops.append((caller, callee, callee in below))

    for traced in (False, False, True):
        session.reset()
        loss = model.loss(session, x, x)
        grads = session.backward(loss)
        if traced:
            sys.setprofile(profile)
            try:
                opt.step(grads)
            finally:
                sys.setprofile(None)
        else:
            opt.step(grads)
    return stops


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.step_path")
    parser.add_argument("--device", action="store_true", help="the torch:cpu route")
    args = parser.parse_args(argv)
    stops = trace_step(args.device)
    order = list(dict.fromkeys(callee for _, callee, _ in stops))
    edges: dict[tuple[str, str], list[int]] = {}
    for caller, callee, climbed in stops:
        edges.setdefault((caller, callee), [0, 0])
        edges[caller, callee][0] += 1
        edges[caller, callee][1] += climbed
    print("modules in order of entry:")
    for k, module in enumerate(order):
        print(f"{k + 1:3d} {_short(module)}")
    print("calls between modules (caller -> callee: calls, climbs):")
    for (caller, callee), (calls, climbs) in edges.items():
        mark = f", {climbs} climbing" if climbs else ""
        print(f"    {_short(caller)} -> {_short(callee)}: {calls}{mark}")
    climbs = sum(climbed for _, _, climbed in stops)
    print(f"modules {len(order)}, edges {len(edges)}, climbs {climbs}")
    return 0


def _short(module: str) -> str:
    return module.removeprefix(_ROOT + ".")


if __name__ == "__main__":
    sys.exit(main())
