"""Shared-parameter groups of a session: uses grouped by storage identity (C4).

Seed ``000``: each use records the value observed at that call; optimizers combine
the cotangents of leaves whose storage is shared and update that storage once,
starting from its current value (C3), never from a leaf snapshot.
"""

from __future__ import annotations

import math
from collections.abc import Container, Mapping
from typing import Any, NamedTuple

import numpy as np

from ..backend import NUMPY, Backend, backend_of, device_backend, dtype_name
from ..errors import (
    DeviceError,
    DTypeError,
    HyperparameterError,
    MissingGradientError,
    ShapeError,
    TapeError,
    TiegradError,
)
from .canonical import canonical_indices
from .rows import subtract_scaled
from .storage import ParameterStorage


class ParameterGroup(NamedTuple):
    """The trainable leaves of one storage, in recording order (C4).

    ``id`` is the first leaf and keys the optimizer slot. ``storage`` is None for a
    registration without a storage descriptor; such a group always has one leaf.
    Immutable; a named tuple, since every step of every optimizer makes its groups.
    """

    id: int
    parameter: Any
    leaves: tuple[int, ...]
    storage: ParameterStorage | None

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.parameter.shape)

    def current_host_value(self) -> np.ndarray:
        """The value an update starts from (C3): synced storage, or the handle's ``get()``."""
        if self.storage is not None:
            return self.storage.current_host_value()
        value = np.asarray(self.parameter.get())
        if value.shape != self.shape:
            raise ShapeError(
                f"group {self.id}: the getter returned shape {value.shape}, expected {self.shape}"
            )
        return value

    def current_device_value(self, device: str | Backend | None = None) -> Any:
        """The value a device update starts from (C3, C7).

        With a storage: its current mirror, uploaded only when there is none (a stale
        host without a mirror raises). Without one: the handle's ``get()`` uploaded,
        shape checked. ``device`` (a name or a backend) defaults to the mirror's device.
        """
        if isinstance(device, Backend):
            bk = device
        elif device is not None:
            bk = device_backend(device)
        elif self.storage is not None and self.storage.mirror is not None:
            bk = backend_of(self.storage.mirror)
        else:
            raise DeviceError(
                f"group {self.id}: no device mirror to read; pass the device to upload to"
            )
        if bk is NUMPY:
            raise DeviceError(f"group {self.id}: {bk.device!r} is the host, not a device")
        if self.storage is not None:
            return self.storage.device_value(bk)
        value = bk.upload(self.parameter.get())
        if tuple(value.shape) != self.shape:
            raise ShapeError(
                f"group {self.id}: the getter returned shape {tuple(value.shape)}, "
                f"expected {self.shape}"
            )
        return value


def group_parameter_registrations(
    parameters: Mapping[int, Any],
    storages: Mapping[int, ParameterStorage],
    trainable: Container[int] | None = None,
) -> list[ParameterGroup]:
    """Group trainable registrations by storage identity without reading tensor data.

    ``trainable``: the leaves recorded as requiring a gradient (a session's); a
    registration outside it (a frozen use, a use under ``no_grad``) is left out. Without
    it, registrations whose handle is frozen now are left out. A storage whose shape
    differs from its handle's raises before any grouping. Entries without a storage stay
    separate, even when they are the same handle. Groups come in order of first leaf.
    """
    if trainable is None:
        regs = sorted((i, p) for i, p in parameters.items() if p.requires_grad)
    else:
        regs = sorted((i, p) for i, p in parameters.items() if i in trainable)
    descs = []
    for i, p in regs:
        st = storages.get(i)
        if st is not None and tuple(st.shape) != tuple(p.shape):
            raise ShapeError(
                f"leaf {i}: its storage has shape {tuple(st.shape)}, the parameter {tuple(p.shape)}"
            )
        descs.append(st)
    canon = canonical_indices(descs)
    groups: list[list[Any]] = []
    by_position: dict[int, list[Any]] = {}
    for pos, ((leaf, p), st, c) in enumerate(zip(regs, descs, canon)):
        if c is None or c == pos:
            entry = [leaf, p, [leaf], st]
            groups.append(entry)
            by_position[pos] = entry
        elif c < pos:
            by_position[c][2].append(leaf)
        else:
            raise TiegradError(f"internal: canonical index {c} after position {pos}")
    return [ParameterGroup(g[0], g[1], tuple(g[2]), g[3]) for g in groups]


def check_group_gradients(group: ParameterGroup, gradients: Mapping[int, Any]) -> None:
    """Validate every leaf gradient of ``group`` (presence, shape, dtype) without summing."""
    shape = group.shape
    dtype = getattr(group.parameter, "dtype", None)
    for leaf in group.leaves:
        try:
            g = gradients[leaf]
        except (KeyError, IndexError):
            g = None
        if type(g) is np.ndarray and g.shape == shape and g.dtype == dtype:
            continue  # the common case: every check below passes
        if g is None:
            raise MissingGradientError(
                f"group {group.id}: no gradient for leaf {leaf} (expected shape {shape})"
            )
        if not hasattr(g, "shape") or not hasattr(g, "dtype"):
            raise DTypeError(
                f"group {group.id}: gradient of leaf {leaf} is a {type(g).__name__}, "
                f"expected an array of shape {shape}"
            )
        if tuple(g.shape) != shape:
            raise ShapeError(
                f"group {group.id}: gradient of leaf {leaf} has shape {tuple(g.shape)}, "
                f"expected {shape}"
            )
        if dtype is not None and g.dtype != dtype and dtype_name(g) != np.dtype(dtype).name:
            raise DTypeError(
                f"group {group.id}: gradient of leaf {leaf} has dtype {g.dtype}, expected {dtype}"
            )


def dense_group_gradient(group: ParameterGroup, gradients: Mapping[int, Any]) -> Any:
    """The summed gradient of a group, in leaf order: ((g0 + g1) + g2) (C4).

    A group of one returns its gradient object itself: no copy, no arithmetic.
    Every leaf is validated before the first addition; ``gradients`` is never
    written into.
    """
    check_group_gradients(group, gradients)
    total = gradients[group.leaves[0]]
    if len(group.leaves) == 1:
        return total
    total = add_new(total, gradients[group.leaves[1]])
    for leaf in group.leaves[2:]:
        total += gradients[leaf]
    return total


def add_new(a: Any, b: Any) -> Any:
    """``a + b`` as a new array: NumPy gives a scalar for two 0-d arrays, made a 0-d
    array here so that the next contribution adds into it (C4)."""
    total = a + b
    return np.asarray(total) if isinstance(total, np.generic) else total


def check_learning_rate(lr: Any) -> float:
    """``lr`` as a float, or a HyperparameterError unless it is a finite number >= 0.

    Strings and bools are refused even though ``float()`` would convert them (C6).
    """
    if isinstance(lr, (str, bytes, bool, np.bool_, complex, np.complexfloating)):
        raise HyperparameterError(f"lr: expected a real number, got {lr!r}")
    try:
        value = float(lr)
    except OverflowError:  # an int or Fraction beyond float's range
        value = math.inf
    except (TypeError, ValueError):
        raise HyperparameterError(f"lr: expected a number, got {lr!r}") from None
    if not math.isfinite(value) or value < 0:
        raise HyperparameterError(f"lr: expected a finite value >= 0, got {lr!r}")
    return value


def check_sgd_inputs(session: Any, lr: Any, gradients: Mapping[int, Any] | None) -> float:
    """The first checks of a session's SGD step (C6): ``lr`` as a float, and gradients
    that exist and, when they say (``Gradients.session``), come from ``session``."""
    lr = check_learning_rate(lr)
    if gradients is None:
        raise MissingGradientError("sgd_step: no gradients given and no backward has run")
    if getattr(gradients, "session", session) is not session:
        raise TapeError("sgd_step: the gradients were computed by another session")
    return lr


def recorded_groups(session: Any, gradients: Mapping[int, Any]) -> list[ParameterGroup]:
    """The groups of the recording ``gradients`` came from (C4): the registrations a
    ``Gradients`` keeps, so gradients of a released or earlier tape update the storages
    they were computed for; a plain mapping is keyed by the session's current tape."""
    of_recording = getattr(gradients, "parameter_groups", None)
    return of_recording() if of_recording is not None else session.parameter_groups()


def write_group_value(group: ParameterGroup, value: np.ndarray) -> None:
    """Write a new host value for a group's storage (or through its handle's ``set``)."""
    if group.storage is not None:
        group.storage.commit_host(value)
    else:
        group.parameter.set(value)


def sgd_step_groups(session: Any, lr: float, gradients: Mapping[int, Any] | None) -> None:
    """Plain SGD over a session's groups: ``p -= lr * sum`` once per storage (C3, C4, C6).

    Everything is checked before the first write: the learning rate, that the
    gradients come from this session, every leaf gradient (presence, shape, dtype),
    every mirror sync and every storage-less getter. Each update starts from the
    group's current value (C3), read in the write loop so that a storage-less handle
    used twice (two groups, C1) receives both updates.
    """
    lr = check_sgd_inputs(session, lr, gradients)
    groups = recorded_groups(session, gradients)
    sums = [session.backend.to_numpy(dense_group_gradient(g, gradients)) for g in groups]
    for group in groups:
        group.current_host_value()
    for group, g in zip(groups, sums):
        if group.storage is not None:
            arr = group.storage.host_for_update()
            subtract_scaled(group.storage, arr, lr, g)
        else:
            arr = group.current_host_value() - lr * g
        write_group_value(group, arr)
