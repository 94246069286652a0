"""``EagerSession``: a tape (``tiegrad.tape``) on which parameters are used.

Parameters enter a session through ``use`` (C2): every call records a new leaf
holding the value the storage has at that moment and registers the parameter and
its storage for that leaf, so optimizers can group uses by storage (C4). The
registrations are per tape; the ``Gradients`` a backward returns keep those of its
recording, and ``latest_gradients`` gives ``optimizer.step()`` the calling thread's
latest.
"""

from __future__ import annotations

import threading
import warnings
import weakref
from collections.abc import Mapping
from typing import Any

import numpy as np

from .backend import NUMPY, Array, Backend
from .errors import ShapeError
from .params.groups import dense_group_gradient, group_parameter_registrations
from .tape import Tape, TapeGradients, TensorRef

__all__ = ["EagerSession", "Gradients", "TensorRef", "latest_gradients"]


class Gradients(TapeGradients):
    """The read-only result of ``EagerSession.backward``: node id -> gradient array.

    Keys may be ids or ``TensorRef``s of the recording that produced it. It keeps that
    recording's parameter registrations, so ``parameter_groups()`` still groups the
    uses by storage (C4) after the session is reset: the fast path is backward, reset
    (unpinning every storage), then an in-place optimizer step.
    """

    __slots__ = ("_params", "_storages", "_trainable", "_by_storage")

    def __init__(
        self,
        session: EagerSession,
        grads: dict[int, Array],
        params: dict[int, Any],
        storages: dict[int, Any],
        trainable: frozenset[int],
    ) -> None:
        super().__init__(session, grads)
        self._params = params
        self._storages = storages
        self._trainable = trainable
        self._by_storage: dict[int, Array] | None = None

    def parameter_groups(self) -> list[Any]:
        """The uses recorded as trainable, grouped by storage identity (C4).

        Trainability is the one each use was recorded with: a use of a frozen handle or
        one recorded under ``no_grad`` is in no group, and freezing a handle after the
        recording does not change the groups (its recorded gradient is still summed).
        """
        return group_parameter_registrations(self._params, self._storages, self._trainable)

    def storage_gradient(self, storage: Any) -> Array | None:
        """The summed gradient of ``storage``'s trainable uses (C4), or None if none was
        recorded; read-only on the host. A storage used once gets the very array the
        sweep produced (as a read-only view); the sums are made once per result."""
        if self._by_storage is None:
            self._by_storage = {
                id(g.storage): _read_only(dense_group_gradient(g, self))
                for g in self.parameter_groups()
                if g.storage is not None
            }
        return self._by_storage.get(id(storage))


def _read_only(gradient: Array) -> Array:
    """A read-only view of a NumPy gradient; a device tensor as it is."""
    if isinstance(gradient, np.ndarray):
        gradient = gradient.view()
        gradient.flags.writeable = False
    return gradient


# .session: a weak reference to the session of this thread's latest backward;
# .unstepped: a ``loss.backward()`` result that no step has read and no zero_grad cleared.
_latest = threading.local()


def latest_gradients() -> Gradients | None:
    """The result of the latest ``backward`` run by the calling thread (``optimizer.step()``).

    Per thread: a backward in another thread is never seen. The session is held weakly,
    so this keeps neither a session nor its tape alive; None when no backward has run in
    this thread since ``forget_latest_gradients``, or its session is gone.
    """
    ref = getattr(_latest, "session", None)
    session = None if ref is None else ref()
    return None if session is None else session.last_gradients


def forget_latest_gradients() -> None:
    """Make ``latest_gradients()`` None in the calling thread (``optimizer.zero_grad``).

    The session of that latest backward lets go of them too (its ``last_gradients``
    becomes None), so their memory is freed unless the caller holds the result, as
    ``zero_grad(set_to_none=True)`` frees PyTorch's ``.grad``.
    """
    ref = getattr(_latest, "session", None)
    session = None if ref is None else ref()
    if session is not None:
        session.last_gradients = None
    _latest.session = None
    _latest.unstepped = False


def note_step() -> None:
    """Record that an optimizer step has read the calling thread's latest gradients."""
    _latest.unstepped = False


class EagerSession(Tape):
    """A tape (``Tape``: recording, ``backward``, ``reset``) that parameters are used on.

    ``device=None`` (or ``"cpu"``) records on the NumPy host backend; ``seed`` seeds
    ``rng``, the only source of randomness of its ops (dropout). ``backward`` returns
    ``Gradients`` and also keeps them as ``last_gradients`` for ``optimizer.step()``,
    then releases the tape unless ``retain_graph=True``. One session per thread.
    """

    _growth_warned = False  # per session: ``_warn_growth`` warns once

    def __init__(self, device: str | None = None, seed: int = 0, backend: Backend | None = None):
        super().__init__(device, seed, backend)
        self.last_gradients: Gradients | None = None

    def _clear(self) -> None:
        """An empty tape, and no parameter registered on it."""
        super()._clear()
        self._params: dict[int, Any] = {}
        self._storages: dict[int, Any] = {}
        # storage id -> the value its first use on this tape snapshotted; set when a
        # backward keeps the tape, to notice a tape that spans optimizer steps.
        self._first_values: dict[int, Any] = {}

    def use(self, param: Any) -> TensorRef:
        """Record a use of ``param`` (C2): a new leaf holding its current value.

        ``param`` is a ``tiegrad.Param`` (or any handle with a ``storage``), or any
        object with ``get()``, ``set(array)``, ``shape``, ``dtype`` and
        ``requires_grad``; the latter has no storage descriptor and is never grouped
        with anything (C1). The registration is kept even when the use is frozen or
        gradients are disabled; only uses recorded as trainable (a trainable handle,
        gradients enabled) are grouped (C4), whatever the handle's flag is later.
        """
        storage = getattr(param, "storage", None)
        if storage is not None:
            value = storage._value_for(self)
        else:
            value = self.backend.asarray(param.get())
            if tuple(value.shape) != tuple(param.shape):
                raise ShapeError(
                    f"use: the getter of {param!r} returned shape {tuple(value.shape)}, "
                    f"expected {tuple(param.shape)}"
                )
        self._released = None
        if storage is None:
            ref = self._leaf(value, bool(param.requires_grad))
            self._params[ref.id] = param
            return ref
        ref = self._borrow(value, bool(param.requires_grad))
        self._params[ref.id] = param
        self._storages[ref.id] = storage
        first = self._first_values.setdefault(id(storage), value)
        if first is not value and self._retained_backward:
            self._warn_growth(param)
        return ref

    def backward_from(self, out: TensorRef, seed: Any, retain_graph: bool) -> Gradients:
        """``loss.backward()``: ``backward(out, seed)``, kept as the thread's latest.

        PyTorch adds a second ``loss.backward()`` into the ``.grad`` of the first; here
        each backward's gradients replace the latest ones. So that accumulation written
        the PyTorch way is not silently lost, a ``loss.backward()`` whose predecessor no
        optimizer step read and no ``zero_grad`` cleared warns (RuntimeWarning).
        """
        if getattr(_latest, "unstepped", False):
            warnings.warn(
                "loss.backward(): the gradients of the previous loss.backward() were "
                "neither stepped nor cleared, and tiegrad does not add them up as PyTorch "
                "does: they are replaced. To accumulate, sum the losses before one "
                "backward, or collect optimizer.canonical_gradients(session.backward(loss), "
                "allow_missing=True) per micro-batch and step on their sum.",
                RuntimeWarning,
                stacklevel=3,
            )
        result = self.backward(out, seed, retain_graph=retain_graph)
        _latest.unstepped = True
        return result

    def _warn_growth(self, param: Any) -> None:
        """Warn once per session: a kept tape now spans a parameter update (a step)."""
        if self._growth_warned:
            return
        self._growth_warned = True
        warnings.warn(
            f"EagerSession: this tape was kept by backward(..., retain_graph=True) and now "
            f"records {param!r} again after it was updated: the tape grows every step and "
            "holds every step's values. Call session.reset() after each step, or drop "
            "retain_graph=True so that backward releases the tape.",
            RuntimeWarning,
            stacklevel=3,
        )

    def _result(self, grads: dict[int, Array], retain_graph: bool) -> Gradients:
        """The gradients with the registrations of their recording; the latest (C4)."""
        params, storages = self._params, self._storages
        if retain_graph:  # the tape records on: the result keeps the registrations so far
            params, storages = dict(params), dict(storages)
        result = Gradients(self, grads, params, storages, frozenset(self._grad_leaves))
        self.last_gradients = result
        _latest.session = weakref.ref(self)
        return result

    def parameter_registrations(self) -> dict[int, Any]:
        """Leaf id -> registered parameter, for every ``use`` since the last reset (those
        of the tape ``backward`` released, until the next ``use``)."""
        if self._released is not None:
            return dict(self._released._params)
        return dict(self._params)

    def storage_registrations(self) -> dict[int, Any]:
        """Leaf id -> storage descriptor, for every ``use`` of a handle with a storage."""
        if self._released is not None:
            return dict(self._released._storages)
        return dict(self._storages)

    def parameter_groups(self) -> list[Any]:
        """Uses recorded as trainable grouped by storage identity, in order of first use (C4).

        As ``Gradients.parameter_groups``: a use recorded under ``no_grad`` or through a
        frozen handle is in no group. After ``backward`` released the tape, the groups of
        the released tape, until the next ``use``.
        """
        if self._released is not None:
            return self._released.parameter_groups()
        return group_parameter_registrations(
            self._params, self._storages, frozenset(self._grad_leaves)
        )

    def sgd_step(self, lr: float, gradients: Mapping[int, Array] | None = None) -> None:
        """One plain SGD update of every used storage from its summed gradient (C3, C4)."""
        from .params.device import sgd_step_device_groups
        from .params.groups import sgd_step_groups

        step = sgd_step_groups if self.backend is NUMPY else sgd_step_device_groups
        step(self, lr, self.last_gradients if gradients is None else gradients)
