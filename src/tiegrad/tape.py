"""The tape: ``Tape`` records every op as a node and runs sparse reverse sweeps.

A node is its index on the tape. Each node stores its forward value, its parents'
ids, whether it requires a gradient and, only if it does, its vector-Jacobian
product (a closure from the op that made it). Recording is append-only and costs a
few list appends: no per-op dictionaries on the hot path (docs/design.md: performance).

The tape knows nothing of parameters. ``EagerSession`` (``tiegrad.session``) adds
them through three hooks: ``_borrow`` records a leaf whose memory another owner may
write once the tape is reset (a storage's value, C2), ``_clear`` drops what it keeps
per tape, and ``_result`` makes the object ``backward`` returns. It reads the tape's
trainable leaves (``_grad_leaves``), whether a backward kept the tape
(``_retained_backward``) and the result of the one that released it (``_released``).
"""

from __future__ import annotations

import contextlib
import math
import threading
import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

import numpy as np

from ._hints import missing_attribute
from .backend import NUMPY, Array, Backend
from .errors import DeviceError, DTypeError, ShapeError, TapeError
from .params.groups import add_new

VJP = Any  # Callable[[Array], tuple[Array | None, ...]]


_DEVICE_HINT = (
    "a TensorRef lives on its session's device: EagerSession(device=...) records there, "
    "module.to(device) mirrors the parameters, ref.numpy() downloads the value"
)
_HINTS = {
    "grad": "a TensorRef keeps no gradient: index the result of backward (grads[ref]; "
    "session.backward(loss, retain=[ref]) keeps an inner one), or read param.grad",
    "data": "ref.value is the forward value (ref.numpy() as a NumPy array)",
    "detach": "ref.numpy() is the value as a NumPy array; session.constant(x) records it "
    "again without a gradient",
    "to": _DEVICE_HINT,
    "cuda": _DEVICE_HINT,
    "cpu": _DEVICE_HINT,
    "tolist": "ref.numpy().tolist()",
    "requires_grad_": "a recorded value's requires_grad is fixed when it is recorded: "
    "param.requires_grad_(False) or module.freeze(path) freezes a use",
    "retain_grad": "session.backward(loss, retain=[ref]) keeps ref's gradient",
    "zero_": "recorded values are immutable; record a new one (session.constant)",
}


class TensorRef:
    """A handle on one node of a session's tape.

    Carries its session, node id and forward value. Operators (``+ - * / @ **``,
    indexing, ``.T``, ``.reshape``, ``.sum``, ``.mean``) record new nodes through
    ``tiegrad.ops``. A ref is valid only in its own session and only until that
    session is reset; using it elsewhere raises ``TapeError``.
    """

    __slots__ = ("session", "id", "value", "_gen", "__weakref__")
    # NumPy must defer to TensorRef's reflected operators (``array * ref``) instead of
    # iterating over the ref element by element.
    __array_ufunc__ = None

    def __init__(self, session: Tape, id: int, value: Array, gen: int) -> None:
        self.session = session
        self.id = id
        self.value = value
        self._gen = gen

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.value.shape)

    @property
    def dtype(self) -> Any:
        return self.value.dtype

    @property
    def ndim(self) -> int:
        return self.value.ndim

    @property
    def size(self) -> int:
        return int(np.prod(self.shape))

    @property
    def requires_grad(self) -> bool:
        return self.session._rg[self.id]

    def numpy(self) -> np.ndarray:
        """The forward value as a NumPy array (downloads from a device)."""
        return self.session.backend.to_numpy(self.value)

    def item(self) -> float:
        return self.numpy().item()

    def backward(self, gradient: Any = None, retain_graph: bool = False) -> TapeGradients:
        """PyTorch's ``loss.backward()``: ``session.backward(self, gradient)``, returned.

        On an ``EagerSession`` the result is also the calling thread's latest gradients,
        which ``optimizer.step()`` and ``Param.grad`` read; see
        ``EagerSession.backward_from`` for what differs from PyTorch (no accumulation).
        """
        return self.session.backward_from(self, gradient, retain_graph)

    def __len__(self) -> int:
        return self.shape[0]

    def __getattr__(self, name: str) -> Any:
        """Only names found nowhere else: a PyTorch habit gets tiegrad's way in the error."""
        raise missing_attribute("TensorRef", name, _HINTS)

    def __repr__(self) -> str:
        return f"TensorRef(id={self.id}, shape={self.shape}, dtype={self.dtype})"


class TapeGradients(Mapping):
    """The read-only result of a backward sweep: node id -> gradient array.

    Keys may be ids or ``TensorRef``s of the recording that produced it, also after
    the tape was reset or released.
    """

    __slots__ = ("session", "_grads", "_gen")

    def __init__(self, session: Tape, grads: dict[int, Array]) -> None:
        self.session = session
        self._grads = grads
        self._gen = session._generation

    def _key(self, key: object) -> object:
        if isinstance(key, TensorRef):
            if key.session is not self.session or key._gen != self._gen:
                raise TapeError(
                    f"ref {key.id} was not recorded by the tape these gradients came from"
                )
            return key.id
        return key

    def __getitem__(self, key: TensorRef | int) -> Array:
        return self._grads[self._key(key)]

    def __iter__(self) -> Iterator[int]:
        return iter(self._grads)

    def __len__(self) -> int:
        return len(self._grads)

    def __contains__(self, key: object) -> bool:
        try:
            return self._key(key) in self._grads
        except TapeError:
            return False

    def __repr__(self) -> str:
        return f"{type(self).__name__}({len(self)} ids: {sorted(self._grads)})"


def _numbers(data: Any) -> np.ndarray:
    """``data`` as a plain ndarray of bool, integer or floating numbers, else ``DTypeError``."""
    try:
        arr = np.asarray(data)
    except (TypeError, ValueError) as e:  # ragged lists, objects NumPy cannot read
        raise DTypeError(
            f"expected array data, got a {type(data).__name__} that is no array ({e})"
        ) from None
    if arr.dtype.kind not in "biuf":
        raise DTypeError(
            f"expected numbers (a bool, integer or floating array), got dtype {arr.dtype}"
        )
    return arr


class Tape:
    """An append-only tape with sparse reverse-mode differentiation.

    ``device=None`` (or ``"cpu"``) records on the NumPy host backend. ``seed`` seeds
    the generator ``rng``, the only source of randomness of the ops (dropout).
    ``backward`` returns gradients by node id; like PyTorch's ``retain_graph=False``
    it then releases the tape (``backward(..., retain_graph=True)`` keeps it), so a
    loop of ``opt.step(session.backward(loss))`` holds flat memory.

    A tape is single-threaded: the thread that records its first node after
    construction or ``reset`` is its recorder, and recording or ``backward`` from
    another thread raises ``TapeError`` (use one session per thread).
    """

    def __init__(self, device: str | None = None, seed: int = 0, backend: Backend | None = None):
        if backend is None:
            backend = _backend_for(device)
        self.backend = backend
        self._memory_owner = backend.memory_owner  # read by every op (``_record``)
        self.device = backend.device
        self.rng = np.random.default_rng(seed)
        self.grad_enabled = True
        self._generation = 0
        self._clear()

    def _clear(self) -> None:
        """Start an empty tape (a subclass also drops what it keeps per tape)."""
        # A leaf keeps its array; an op node only a weak reference to its output, so an
        # output that neither a ref nor a VJP holds is freed at once (memory is reused).
        self._values: list[Array | weakref.ref] = []
        self._meta: list[tuple[tuple[int, ...], Any]] = []  # (shape, dtype) per node
        self._parents: list[tuple[int, ...] | None] = []
        self._vjps: list[VJP | None] = []
        self._rg: list[bool] = []
        self._grad_leaves: list[int] = []
        self._recorder: int | None = None  # the thread recording since the last reset
        # C2 after the tape: id -> the owner of every borrowed memory (``_borrow``), and
        # weak references to the refs whose value lies in that memory (``_keep_snapshots``)
        self._owners: dict[int, Any] = {}
        self._holders: list[weakref.ref] = []
        self._retained_backward = False  # a backward kept this tape (retain_graph=True)
        # the result of the backward that released the previous tape (None after reset)
        self._released: TapeGradients | None = None

    def _claim(self) -> None:
        """Make the calling thread the recorder, or refuse a second thread (``TapeError``)."""
        me = _thread_id()
        if self._recorder is None:
            self._recorder = me
        elif self._recorder != me:
            raise TapeError(
                f"this session is recording in thread {self._recorder}, not in the calling "
                f"thread {me}: a session is single-threaded (use one session per thread, or "
                f"reset it before handing it to another thread)"
            )

    # -- recording -----------------------------------------------------------------
    def __len__(self) -> int:
        return len(self._values)

    def _leaf(self, value: Array, requires_grad: bool) -> TensorRef:
        if self._recorder != _thread_id():
            self._claim()
        i = len(self._values)
        rg = requires_grad and self.grad_enabled
        self._values.append(value)
        self._meta.append((tuple(value.shape), value.dtype))
        self._parents.append(None)
        self._vjps.append(None)
        self._rg.append(rg)
        if rg:
            self._grad_leaves.append(i)
        return TensorRef(self, i, value, self._generation)

    def _borrow(self, value: Array, requires_grad: bool) -> TensorRef:
        """Record a leaf holding ``value`` itself, memory that its owner may write in
        place once this tape is reset (a storage's array, C2).

        Every ref whose value lies in that memory (the leaf, an op's view of it) is
        given its own copy at ``reset``, so it still reads the value it recorded.
        """
        ref = self._leaf(value, requires_grad)
        owner = self._memory_owner(value)
        self._owners[id(owner)] = owner
        self._holders.append(_weak(ref))
        return ref

    def _record(self, value: Array, parents: tuple[int, ...], vjp: VJP) -> TensorRef:
        """Append an op node; ``vjp(g)`` returns one cotangent (or None) per parent.

        The hot path of every op (docs/design.md: performance): a few appends and one lookup, which
        notes an output lying in borrowed memory (a view of a use) for ``reset`` (C2).
        """
        if self._recorder != _thread_id():
            self._claim()
        rg = self._rg
        i = len(rg)
        try:
            self._values.append(_weak(value))
        except TypeError:  # a NumPy scalar (a 0-d result) has no weak references; it is tiny
            self._values.append(value)
        self._meta.append((value.shape, value.dtype))
        if self.grad_enabled:
            for p in parents:
                if rg[p]:
                    self._parents.append(parents)
                    self._vjps.append(vjp)
                    rg.append(True)
                    break
        if len(rg) == i:
            self._parents.append(None)
            self._vjps.append(None)
            rg.append(False)
        ref = TensorRef(self, i, value, self._generation)
        if self._owners and id(self._memory_owner(value)) in self._owners:
            self._holders.append(_weak(ref))
        return ref

    def _array(self, data: Any) -> Array:
        """Convert input data; Python numbers and lists of floats become float32.

        NumPy data must be numbers (bool, integer or floating: else a ``DTypeError``,
        before anything is recorded). An array in non-native byte order (``'>f4'``,
        ``'>i8'`` on a little-endian machine) becomes the same values in native order (a
        copy), as every kernel reads; an ndarray subclass (``np.matrix``, ``np.memmap``) a
        plain array.
        """
        bk = self.backend
        if isinstance(data, np.ndarray):
            if data.dtype.kind not in "biuf" or type(data) is not np.ndarray:
                data = _numbers(data)
            if not data.dtype.isnative:
                data = data.astype(data.dtype.newbyteorder("="))
            return data if bk.is_array(data) else bk.asarray(data)
        if bk.is_array(data):
            return data
        if isinstance(data, TensorRef):
            raise TapeError("expected array data, got a TensorRef; use the ref directly")
        arr = _numbers(data)
        if arr.dtype.kind == "f":
            arr = arr.astype(np.float32)
        return bk.asarray(arr)

    def constant(self, data: Any) -> TensorRef:
        """Record a leaf that never requires a gradient (inputs, targets, masks)."""
        return self._leaf(self._array(data), False)

    def leaf(self, data: Any, requires_grad: bool = True) -> TensorRef:
        """Record a leaf; a differentiable leaf must have a floating dtype."""
        arr = self._array(data)
        if requires_grad and not self.backend.is_floating(arr.dtype):
            raise DTypeError(
                f"leaf: a leaf that requires grad needs a floating dtype, got {arr.dtype}"
            )
        return self._leaf(arr, requires_grad)

    def reset(self) -> None:
        """Clear the tape; refs recorded so far become stale.

        A stale ref still reads the value it recorded (C2): one that lies in borrowed
        memory (a use, a view of one) is given a copy here, before the owner is free to
        write it in place (docs/design.md: snapshots). The generator is kept.
        """
        self._keep_snapshots()
        self._generation += 1
        self._clear()

    def _keep_snapshots(self) -> None:
        """Give every live ref whose value lies in borrowed memory its own copy (C2).

        A training loop keeps none of them past the tape, and copies nothing.
        """
        copy = self.backend.copy
        for weak in self._holders:
            ref = weak()
            if ref is not None:
                ref.value = copy(ref.value)

    @contextlib.contextmanager
    def no_grad(self) -> Iterator[None]:
        """Record without gradients inside the block (evaluation)."""
        prev = self.grad_enabled
        self.grad_enabled = False
        try:
            yield
        finally:
            self.grad_enabled = prev

    # -- references ------------------------------------------------------------------
    def check(self, ref: TensorRef) -> int:
        """The id of ``ref`` after checking it belongs to this session and is not stale."""
        if not isinstance(ref, TensorRef):
            raise TapeError(f"expected a TensorRef, got {type(ref).__name__}")
        if ref.session is not self:
            if ref.session.backend is not self.backend:
                raise DeviceError(
                    f"ref {ref.id} lives on device {ref.session.device!r}, this session on "
                    f"{self.device!r}: host and device values do not mix (C7)"
                )
            raise TapeError(f"ref {ref.id} belongs to another session")
        if ref._gen != self._generation:
            raise TapeError(
                f"ref {ref.id} is stale: its session was reset, or backward released its "
                "tape, after it was recorded (backward(..., retain_graph=True) keeps the tape)"
            )
        return ref.id

    def _resolve_id(self, key: TensorRef | int) -> int:
        if isinstance(key, TensorRef):
            return self.check(key)
        if isinstance(key, (int, np.integer)) and not isinstance(key, bool):
            if 0 <= key < len(self._values):
                return int(key)
            raise TapeError(f"id {key} is not on the tape (tape has {len(self._values)} nodes)")
        raise TapeError(f"expected a TensorRef or a node id, got {type(key).__name__}")

    def value(self, key: TensorRef | int) -> Array:
        """The forward value of a node.

        An op node's output lives as long as its ``TensorRef`` or a VJP holds it; asking
        for a released one by id is a ``TapeError``.
        """
        if isinstance(key, TensorRef):
            self.check(key)
            return key.value
        i = self._resolve_id(key)
        v = self._values[i]
        if type(v) is weakref.ref:
            v = v()
            if v is None:
                raise TapeError(
                    f"value of node {i} was released: no TensorRef or VJP holds it any more"
                )
        return v

    # -- backward --------------------------------------------------------------------
    def backward(
        self,
        out: TensorRef,
        seed: Any = None,
        retain: Iterable[TensorRef | int] | None = None,
        *,
        retain_graph: bool = False,
        on_final: Sequence[tuple[int, Callable[[Mapping[int, Array]], None]]] = (),
    ) -> TapeGradients:
        """Sparse reverse sweep from ``out``; returns a read-only map id -> gradient.

        The tape is then released (``reset``), as PyTorch frees the graph: refs
        recorded so far keep their values (``loss.item()``) and remain keys of the
        result, but new ops on them raise ``TapeError``. ``retain_graph=True`` keeps
        the tape for another backward or further recording. Without it the sweep
        frees each VJP, and the forward values only it held, as soon as it has run, as
        PyTorch frees saved tensors; so an error raised during the sweep (by a VJP or
        a callback) also releases the tape, and the refs become stale.

        A node's VJP runs only if it received a cotangent; each cotangent is dropped
        once propagated unless its id is retained. ``retain`` defaults to every leaf
        that requires grad. A retained node that requires grad but is not reached
        gets zeros (its gradient is zero). Contributions from several uses of one
        node are summed (a value used by two ops receives both cotangents). Each
        gradient has its node's dtype: a cotangent promoted by a mixed-dtype op (a float32
        parameter times a float64 array) is cast back, as PyTorch does.

        ``on_final`` lists ``(node, callback)`` pairs: the sweep calls each callback
        once, as soon as every node from ``node`` up has been differentiated, with the
        gradients found so far; those of the retained nodes >= ``node`` are final (an
        unreached one is absent until the sweep has ended: its gradient is zeros; the
        callbacks of node 0 run then). Callbacks read, never write.
        Data-parallel training reduces gradients during the sweep through it.
        """
        bk = self.backend
        oid = self.check(out)
        if self._recorder != _thread_id():
            self._claim()
        ov = out.value
        if seed is None:
            if math.prod(tuple(ov.shape)) != 1:
                raise TapeError(
                    f"backward: output {oid} has shape {tuple(ov.shape)}; a non-scalar "
                    "output needs a seed of the same shape"
                )
            seed = bk.ones(tuple(ov.shape), ov.dtype)
        else:
            seed = self._array(seed)
            if tuple(seed.shape) != tuple(ov.shape):
                raise TapeError(
                    f"backward: seed has shape {tuple(seed.shape)}, expected the output's "
                    f"shape {tuple(ov.shape)}"
                )
            # Our own copy: a gradient may pass the seed on, and the caller's later writes
            # must not reach it (PyTorch copies too).
            seed = bk.copy(seed) if seed.dtype == ov.dtype else bk.astype(seed, ov.dtype)
        keep = set(self._grad_leaves) if retain is None else {self._resolve_id(r) for r in retain}
        meta, rg = self._meta, self._rg
        result: dict[int, Array] = {}
        cot: dict[int, Array] = {oid: seed} if rg[oid] or oid in keep else {}
        hooks = sorted(on_final, key=lambda h: -h[0])
        try:
            k = self._sweep(oid, cot, keep, result, hooks, retain_graph)
        except BaseException:
            if not retain_graph:  # VJPs already run have freed what they saved
                self.reset()
            raise
        for i in keep:
            if i not in result and rg[i]:
                shape, dtype = meta[i]
                result[i] = bk.zeros(tuple(shape), dtype)
        for _, callback in hooks[k:]:
            callback(result)
        _hand_out(bk, result)
        grads = self._result(result, retain_graph)
        if retain_graph:
            self._retained_backward = True
        else:
            self.reset()
            self._released = grads
        return grads

    def _sweep(
        self,
        oid: int,
        cot: dict[int, Array],
        keep: set[int],
        result: dict[int, Array],
        hooks: list[tuple[int, Callable[[Mapping[int, Array]], None]]],
        retain_graph: bool,
    ) -> int:
        """The reverse sweep of ``backward`` from node ``oid``: fills ``result`` with the
        gradients of the ``keep`` nodes; returns how many ``hooks`` it called.

        Memory is freed as PyTorch frees it during a backward: a cotangent is dropped
        once its node's VJP has propagated it, and without ``retain_graph`` each VJP is
        dropped once it has run, and with it the forward values it saved (a value that
        no other VJP or ref holds is freed at once, so the step's activations go as the
        sweep reaches them instead of all at the end).
        """
        bk = self.backend
        meta, parents, vjps, rg = self._meta, self._parents, self._vjps, self._rg
        made: set[int] = set()  # cotangents that are sums this sweep made: added in place
        k = 0
        due = hooks[0][0] if hooks else -1
        for i in range(oid, -1, -1):
            while i < due:  # every node >= due is done
                hooks[k][1](result)
                k += 1
                due = hooks[k][0] if k < len(hooks) else -1
            g = cot.pop(i, None)
            if g is None:
                continue
            if i in keep:
                result[i] = g if g.dtype == meta[i][1] else bk.astype(g, meta[i][1])
            vjp = vjps[i]
            if vjp is None:
                continue
            if not retain_graph:
                vjps[i] = None
            sent = vjp(g)
            del vjp, g
            for pid, pg in zip(parents[i], sent):
                if pg is None or not rg[pid]:
                    continue
                if pg.shape != meta[pid][0]:
                    raise ShapeError(
                        f"backward: node {i} sent a cotangent of shape {tuple(pg.shape)} to "
                        f"node {pid} of shape {tuple(meta[pid][0])}"
                    )
                prev = cot.get(pid)
                if prev is None:
                    cot[pid] = pg
                elif pid in made:
                    prev += pg
                else:
                    cot[pid] = add_new(prev, pg)
                    made.add(pid)
            del sent
        return k

    def backward_from(self, out: TensorRef, seed: Any, retain_graph: bool) -> TapeGradients:
        """``out.backward(seed)``, PyTorch's habit: ``backward(out, seed)``."""
        return self.backward(out, seed, retain_graph=retain_graph)

    def _result(self, grads: dict[int, Array], retain_graph: bool) -> TapeGradients:
        """What ``backward`` returns for ``grads`` (node id -> gradient), before the tape
        is released; ``retain_graph``: the tape records on."""
        return TapeGradients(self, grads)

    def grad(self, grads: Mapping[int, Array], ref: TensorRef) -> Array:
        """The gradient of ``ref`` in ``grads`` (checked to be present); ``ref`` may come
        from the tape that ``backward`` released when it returned ``grads``."""
        if isinstance(grads, TapeGradients) and isinstance(ref, TensorRef) and ref.session is self:
            i = grads._key(ref)
        else:
            i = self.check(ref)
        if i not in grads:
            raise TapeError(
                f"no gradient for node {i}: it was not retained or does not require grad"
            )
        return grads[i]


_weak = weakref.ref
_thread_id = threading.get_ident


def _hand_out(bk: Backend, result: dict[int, Array]) -> None:
    """Make the gradients ``backward`` returns safe to hand out: none writes another.

    Ops hand one cotangent to several operands (``a + b``) or a view of it to a parent,
    so two gradients may share memory. On the host each becomes a read-only view
    (``g * c`` or ``g.copy()`` give a writable one); a device tensor cannot be read-only,
    so one handed to several nodes is copied for all but the first, as PyTorch's
    ``.grad`` are distinct tensors. A group of one still passes its gradient through as
    the same object (C4).
    """
    seen: set[int] = set()
    for i, g in result.items():
        if isinstance(g, np.ndarray):
            g = g.view()
            g.setflags(write=False)
        elif id(g) in seen:
            g = bk.copy(g)
        seen.add(id(g))
        result[i] = g


def _backend_for(device: str | None) -> Backend:
    if device in (None, "cpu", "host", "numpy"):
        return NUMPY
    from .backend import device_backend

    return device_backend(device)
