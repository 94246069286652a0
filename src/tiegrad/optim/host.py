"""The host executor: updates of NumPy parameters by the NumPy rule or its fused kernel.

The rule (``UpdateRule.rule``) is fed cache-sized chunks: a large parameter in slices of
``CHUNK`` elements, consecutive small parameters gathered into one buffer (their state
is contiguous in ``FlatState``), with reused work buffers, so a step allocates no
temporaries. Where numba is installed (``optim.fused``) the rule's compiled kernel
replaces it for float32 and float64 parameters: all canonical slots sharing
coefficients are updated by one kernel that reads and writes each element once, with
the same arithmetic bit for bit; the finiteness check is then one compiled read of the
gradients.

What depends only on the layout (runs, fused tables, state views) is the ``Program`` of
the step plan (``optim.plan``), made again when the layout, the state names or the state
changed; values are read and checked every step. Each storage is updated from its
current value (C3): ``host_for_update`` (in place when no live tape pins the array, a
copy otherwise, C2) and ``commit_host``.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import numpy as np

from . import fused
from .gradients import resolve
from .norms import all_finite
from .plan import CHUNK, Program, Run, StepPlan
from .rule import UpdateRule
from .update import Labeler, Update


class HostExecutor:
    """``Executor`` of NumPy gradients (``optim.update``); keeps its work buffers."""

    def __init__(self) -> None:
        self._work: dict[np.dtype, list[np.ndarray]] = {}

    @contextmanager
    def gradients(self, labeler: Labeler, plan: StepPlan, given: Any) -> Iterator[list[Any]]:
        yield resolve(labeler, plan, given)

    def first_nonfinite(self, update: Update, grads: list[Any]) -> int | None:
        program = _program(update)
        tables = {
            dtype: fused.GradientTable(layout, [grads[s] for s in layout.slots])
            for dtype, layout in program.fused.items()
        }
        update.prepared = program, tables
        bad = [table.first_nonfinite() for table in tables.values()]
        bad += [s for s in program.rest if not all_finite(grads[s])]
        return min((slot for slot in bad if slot is not None), default=None)

    def apply(self, update: Update, grads: list[Any]) -> None:
        """State arranged on a program's first step, then one rule or kernel call per run.

        A square of a finite gradient may overflow to +inf (``optim.state_values``): the
        NumPy rules do not warn of it, as the kernels and PyTorch do not.
        """
        program, tables = update.prepared
        state, rule = update.state, update.rule
        state.release()
        if not program.arranged:
            update.arrange(program.specs)
        with np.errstate(over="ignore"):
            for i, run in enumerate(program.runs):
                gi, step, fresh, dtype = run.key
                names = program.specs[run.slots[0]][2]
                c = update.coefficients(gi, step, fresh)
                if dtype in tables and rule.fused is not None:
                    operands = program.operands.get(i)
                    if operands is None:
                        operands = _operands(rule.fused, update, program, i, names)
                        program.operands[i] = operands
                    _update_fused(operands, run, tables[dtype], c)
                elif len(run.slots) == 1:
                    self._update_one(rule, update, run, grads[run.slots[0]], names, c)
                else:
                    self._update_many(rule, update, run, grads, names, c)
                state.flat.set_steps(run.slots, step)
        program.advance()

    def _work_rows(self, rule: UpdateRule, dtype: np.dtype) -> list[np.ndarray]:
        """``work_buffers`` scratch rows plus two gather rows of ``CHUNK`` elements, reused."""
        rows = self._work.get(dtype)
        if rows is None:
            rows = list(np.empty((rule.work_buffers + 2, CHUNK), dtype))
            self._work[dtype] = rows
        return rows

    def _update_one(
        self,
        rule: UpdateRule,
        update: Update,
        run: Run,
        g: np.ndarray,
        names: tuple[str, ...],
        c: Any,
    ) -> None:
        """The one slot of ``run`` updated by the rule in slices of ``CHUNK`` elements."""
        slot, storage = run.slots[0], run.storages[0]
        arr = _contiguous(storage.host_for_update())
        p = arr.reshape(-1)
        gf = g.reshape(-1)
        flat = update.state.flat
        state = {name: flat.span(slot, slot, name) for name in names}
        if any(np.may_share_memory(gf, a) for a in (p, *state.values())):
            gf = gf.copy()  # the rule writes the parameter and its state before it reads g
        work = self._work_rows(rule, arr.dtype)[: rule.work_buffers]
        for s in range(0, p.size, CHUNK):
            e = min(s + CHUNK, p.size)
            n = e - s
            rule.rule(
                np, p[s:e], gf[s:e], {k: v[s:e] for k, v in state.items()}, [w[:n] for w in work], c
            )
        storage.commit_host(arr)

    def _update_many(
        self,
        rule: UpdateRule,
        update: Update,
        run: Run,
        grads: Sequence[Any],
        names: tuple[str, ...],
        c: Any,
    ) -> None:
        """The small slots of ``run`` gathered into one buffer, updated by one rule call."""
        arrs = [storage.host_for_update() for storage in run.storages]
        n = sum(a.size for a in arrs)
        rows = self._work_rows(rule, arrs[0].dtype)
        p, g = rows[-2][:n], rows[-1][:n]
        np.concatenate([a.reshape(-1) for a in arrs], out=p)
        np.concatenate([grads[slot].reshape(-1) for slot in run.slots], out=g)
        flat = update.state.flat
        state = {name: flat.span(run.slots[0], run.slots[-1], name) for name in names}
        rule.rule(np, p, g, state, [w[:n] for w in rows[: rule.work_buffers]], c)
        start = 0
        for storage, a in zip(run.storages, arrs):
            a[...] = p[start : start + a.size].reshape(a.shape)
            start += a.size
            storage.commit_host(a)


def _program(update: Update) -> Program:
    """The plan's cached ``Program`` while it holds, else a new one (``optim.plan``).

    A new program's state layout is checked against the existing state first (C6).
    """
    plan, state = update.plan, update.state
    rule = update.rule.fused
    fusable = frozenset(d for d in plan.dtype_set if rule is not None and fused.supports(d))
    key = (update.names, fusable)
    program = plan.program
    if program is None or not program.current(key, state.flat):
        specs = update.specs()
        program = Program(key, specs, state.flat, update.slot_group, plan.storages, fusable)
        plan.program = program
    return program


def _operands(
    rule: fused.FusedRule, update: Update, program: Program, i: int, names: tuple[str, ...]
) -> fused.RunOperands:
    """The ``fused.RunOperands`` of ``program``'s run ``i`` on the arranged state."""
    run = program.runs[i]
    rows = np.array(run.slots, np.intp)
    flat = update.state.flat
    state = {name: flat.offsets(rows, name) for name in names}
    return fused.RunOperands(rule, program.fused[run.key[3]], i, run.rows, state)


def _update_fused(
    operands: fused.RunOperands, run: Run, grads: fused.GradientTable, c: Any
) -> None:
    """The slots of ``run`` updated by ``operands``' kernel calls, in place."""
    storages = run.storages
    arrs = [_contiguous(storage.host_for_update()) for storage in storages]
    fused.run(operands, c, arrs, grads)
    for storage, arr in zip(storages, arrs):
        storage.commit_host(arr)


def _contiguous(arr: np.ndarray) -> np.ndarray:
    """``arr`` itself when C-contiguous, else a C-contiguous copy of the same shape."""
    return arr if arr.flags.c_contiguous else np.ascontiguousarray(arr)
