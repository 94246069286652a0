"""``checkpoint``: exact recomputation of a block in backward (activation checkpointing).

``checkpoint(fn, *args)`` takes PyTorch's ``torch.utils.checkpoint.checkpoint`` calling
convention: ``fn(*args, **kwargs)`` is the block, and its result is what ``fn`` returns.
In tiegrad the session is an argument like the others (``checkpoint(block, session, h)``).

Forward: ``fn`` runs on a private session, recording as it will when it runs again in
backward (the same ops on the same code path, so the same values on every backend, where
an op's route may depend on whether a gradient is wanted), and the private tape is
dropped when ``fn`` returns, so the block's intermediates are freed then. Every
parameter use it makes is recorded on the caller's session as usual (a leaf holding the
value of that moment, C2; its registration for grouping, C4); the private session is
given a leaf holding that same array. The caller's tape gets one node, the block's
output, whose parents are the block's inputs (every ``TensorRef`` among the arguments,
also inside tuples, lists and dicts) and the leaves of its uses. The node keeps the
inputs' values, the uses' values (the caller's tape holds them anyway) and the state of
the session's generator before the block (dropout's stream), nothing else.

Backward: the node's VJP runs ``fn`` again on another private session, from the kept
inputs and from the *recorded* values of its uses (not the storages' current values), with
the generator restored, then sweeps it backward from the output's cotangent and hands
each input and each use's leaf its gradient. The caller's tape then treats them as it
treats any leaf: per-use freezing, ties summed once per storage (C4) and adapters work as
without recomputation, and the gradients are bit-identical to the run without it (the
same ops on the same values, summed in the same order) where the block's inputs feed the
block alone, as in a chain of blocks; also when a parameter was written between forward
and backward, where ``torch.utils.checkpoint`` recomputes from the new value.

``fn`` must be a function of its arguments, its parameter uses and the session's
generator alone: every tensor it reads is an argument (a ref recorded outside and
captured by a closure is another session's, a ``TapeError`` when an op mixes it in), and
it has no other side effect (a KV cache is not appended to inside a checkpoint). A use of
another parameter, or of its parameters in another order, when it runs again is a
``TapeError`` naming both. Checkpoints nest: a checkpoint inside a checkpointed block is
recomputed in the outer block's backward, and recomputes its own block in turn.
Without gradients (``no_grad``) ``fn`` simply runs on the session.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from ..backend import Array
from ..errors import ConfigError, ShapeError, TapeError
from ..session import EagerSession
from ..tape import Tape, TapeGradients, TensorRef

__all__ = ["checkpoint"]

#: ``torch.utils.checkpoint.checkpoint``'s own keyword arguments: tiegrad has one behaviour
#: (exact, non-reentrant recomputation with the generator replayed), so none applies.
TORCH_FLAGS = ("use_reentrant", "preserve_rng_state", "context_fn", "determinism_check", "debug")


class _Input:
    """Where the ``index``-th ``TensorRef`` of the arguments goes when they are rebuilt."""

    __slots__ = ("index",)

    def __init__(self, index: int) -> None:
        self.index = index


_SESSION = object()  # where the caller's session goes when the arguments are rebuilt


def _split(obj: Any, session: EagerSession, refs: list[TensorRef]) -> Any:
    """``obj`` with every ``TensorRef`` (appended to ``refs``, checked to be ``session``'s
    and current) and ``session`` itself replaced by placeholders, through plain tuples,
    lists and dicts."""
    if isinstance(obj, TensorRef):
        session.check(obj)
        refs.append(obj)
        return _Input(len(refs) - 1)
    if obj is session:
        return _SESSION
    if isinstance(obj, EagerSession):
        raise TapeError("checkpoint: the arguments hold two different sessions")
    kind = type(obj)
    if kind is tuple or kind is list:
        return kind(_split(o, session, refs) for o in obj)
    if kind is dict:
        return {k: _split(v, session, refs) for k, v in obj.items()}
    return obj


def _fill(template: Any, session: EagerSession, inputs: list[TensorRef]) -> Any:
    """The arguments again, on ``session`` with ``inputs`` in the placeholders' places."""
    if template is _SESSION:
        return session
    if isinstance(template, _Input):
        return inputs[template.index]
    kind = type(template)
    if kind is tuple or kind is list:
        return kind(_fill(o, session, inputs) for o in template)
    if kind is dict:
        return {k: _fill(v, session, inputs) for k, v in template.items()}
    return template


def _find_session(args: tuple[Any, ...], kwargs: dict[str, Any]) -> EagerSession:
    """The session among the arguments, else the session of their first ``TensorRef``."""
    stack: list[Any] = [*args, *kwargs.values()]
    ref_session = None
    while stack:
        obj = stack.pop(0)
        if isinstance(obj, EagerSession):
            return obj
        if isinstance(obj, TensorRef) and ref_session is None:
            ref_session = obj.session
        elif type(obj) in (tuple, list):
            stack.extend(obj)
        elif type(obj) is dict:
            stack.extend(obj.values())
    if ref_session is None:
        raise TapeError(
            "checkpoint: no EagerSession and no TensorRef among the arguments; call it as "
            "checkpoint(block, session, x, ...)"
        )
    if not isinstance(ref_session, EagerSession):
        raise TapeError(
            f"checkpoint: the arguments' refs belong to a {type(ref_session).__name__}, "
            "expected an EagerSession (parameter uses are recorded on it)"
        )
    return ref_session


class _Forward(EagerSession):
    """The session a checkpointed block runs on in forward: each use is recorded on
    ``outer`` (C2, C4) and its leaf noted in ``uses`` with the parameter; its own leaf
    holds the same array and requires a gradient where the outer one does."""

    def __init__(self, outer: EagerSession) -> None:
        super().__init__(backend=outer.backend)
        self.rng = outer.rng  # the caller's stream goes on as without recomputation
        self._outer = outer
        self.uses: list[tuple[Any, TensorRef]] = []

    def use(self, param: Any) -> TensorRef:
        ref = self._outer.use(param)
        self.uses.append((param, ref))
        return self._leaf(ref.value, ref.requires_grad)


class _Replay(EagerSession):
    """The session a checkpointed block runs on again in backward: its uses get the
    values the forward's uses recorded, in the same order (``uses``: ``(param, requires
    grad, value)``), and its backward leaves the thread's latest gradients alone."""

    def __init__(self, outer: Tape, rng: np.random.Generator, uses: list[tuple[Any, bool, Array]]):
        super().__init__(backend=outer.backend)
        self.rng = rng
        self._uses = uses
        self.leaves: list[TensorRef] = []

    def use(self, param: Any) -> TensorRef:
        n = len(self.leaves)
        if n >= len(self._uses) or self._uses[n][0] is not param:
            was = self._uses[n][0] if n < len(self._uses) else "no further use"
            raise TapeError(
                f"checkpoint: recomputing the block, its use {n} is {_name(param)} where its "
                f"forward used {_name(was)}: the block must use the same parameters in the "
                "same order every time it runs"
            )
        _, requires_grad, value = self._uses[n]
        ref = self._leaf(value, requires_grad)
        self.leaves.append(ref)
        return ref

    def _result(self, grads: dict[int, Array], retain_graph: bool) -> TapeGradients:
        return Tape._result(self, grads, retain_graph)


def _name(param: Any) -> str:
    if isinstance(param, str):
        return param
    name = getattr(param, "name", None)
    return repr(name) if name else repr(param)


def _generator(state: dict[str, Any], kind: type) -> np.random.Generator:
    """A generator whose bit generator (of type ``kind``) is in ``state``."""
    bits = kind()
    bits.state = state
    return np.random.Generator(bits)


def _output(out: Any, session: EagerSession) -> TensorRef:
    if not isinstance(out, TensorRef) or out.session is not session:
        raise TapeError(
            f"checkpoint: the block must return one TensorRef recorded on the session it "
            f"was given, got {type(out).__name__}"
        )
    return out


def checkpoint(fn: Callable[..., TensorRef], *args: Any, **kwargs: Any) -> TensorRef:
    """``fn(*args, **kwargs)``, recomputed exactly in backward instead of kept (see the
    module): the block's intermediates are not held between forward and backward.

    The session is the ``EagerSession`` among the arguments (else that of their refs);
    ``fn`` returns one ``TensorRef``. The gradients equal, bit for bit, those of calling
    ``fn`` directly (C2: from the values the uses recorded). ``torch.utils.checkpoint``'s
    flags (``use_reentrant``, ``preserve_rng_state``, ...) are a ``ConfigError``: the
    behaviour is always the exact one.
    """
    flags = [k for k in TORCH_FLAGS if k in kwargs]
    if flags:
        raise ConfigError(
            f"checkpoint: {', '.join(flags)} is a flag of torch.utils.checkpoint; tiegrad's "
            "checkpoint takes none (it always recomputes exactly, with dropout's stream "
            "replayed)"
        )
    session = _find_session(args, kwargs)
    if not session.grad_enabled:
        return fn(*args, **kwargs)
    refs: list[TensorRef] = []
    template = _split((args, kwargs), session, refs)
    state = session.rng.bit_generator.state
    kind = type(session.rng.bit_generator)
    block = _Forward(session)
    inputs = [block._leaf(r.value, r.requires_grad) for r in refs]
    a, kw = _fill(template, block, inputs)
    out = _output(fn(*a, **kw), block)
    value, uses = out.value, block.uses
    shape = tuple(value.shape)
    block.reset()  # the intermediates go with the private tape, reference cycles or not
    del block, inputs, a, kw, out
    values = [r.value for r in refs]
    needs = [r.requires_grad for r in refs]
    recorded = [(param, r.requires_grad, r.value) for param, r in uses]
    parents = tuple(r.id for r in (*refs, *(r for _, r in uses)))
    del refs, uses

    def vjp(g: Array) -> tuple[Array | None, ...]:
        replay = _Replay(session, _generator(state, kind), recorded)
        leaves = [replay._leaf(v, rg) for v, rg in zip(values, needs)]
        b, bkw = _fill(template, replay, leaves)
        again = _output(fn(*b, **bkw), replay)
        if len(replay.leaves) != len(recorded):
            raise TapeError(
                f"checkpoint: recomputing the block made {len(replay.leaves)} parameter "
                f"uses, its forward {len(recorded)}: the block must use the same "
                "parameters in the same order every time it runs"
            )
        if again.shape != shape:
            raise ShapeError(
                f"checkpoint: recomputing the block gave shape {again.shape}, its forward {shape}"
            )
        every = (*leaves, *replay.leaves)
        wanted = [r.requires_grad for r in every]
        grads = replay.backward(again, g, retain=[r for r, w in zip(every, wanted) if w])
        return tuple(grads[r] if w else None for r, w in zip(every, wanted))

    return session._record(value, parents, vjp)


def checkpoint_if(recompute: bool, fn: Callable[..., TensorRef], *args: Any, **kwargs: Any) -> Any:
    """``checkpoint(fn, *args, **kwargs)`` when ``recompute``, else ``fn(*args, **kwargs)``:
    a model's block loop under its recomputation switch."""
    return checkpoint(fn, *args, **kwargs) if recompute else fn(*args, **kwargs)
