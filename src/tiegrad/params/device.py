"""Device group gradients and the device SGD step (C7, C8).

Seed ``000``: a group of one borrows its device gradient unchanged; only a storage
used several times needs an addition, and that sum is an owned temporary, released
on success and on failure. The input gradient map stays borrowed throughout, and the
action must not keep the temporary it is lent.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any, TypeVar

import numpy as np

from ..backend import NUMPY, Backend, backend_of
from ..errors import DeviceError
from .groups import (
    ParameterGroup,
    check_group_gradients,
    check_sgd_inputs,
    recorded_groups,
)

T = TypeVar("T")


def check_device_gradients(
    group: ParameterGroup, gradients: Mapping[int, Any], backend: Backend | None = None
) -> Backend:
    """Validate every leaf gradient of ``group`` and that all live on one device.

    Presence, shape and dtype are checked first (C6), then the device: a host array,
    or tensors on two devices (or not on ``backend`` when given), is a DeviceError.
    Returns the gradients' backend. With ``backend`` given, gradients that all fit
    (the common case) are accepted by a few comparisons; any that does not is explained
    by the full checks.
    """
    if backend is not None and _fit((group,), gradients, backend):
        return backend
    check_group_gradients(group, gradients)
    for leaf in group.leaves:
        bk = backend_of(gradients[leaf])
        if bk is NUMPY:
            raise DeviceError(
                f"group {group.id}: the gradient of leaf {leaf} is a host array, "
                "expected a device tensor"
            )
        if backend is None:
            backend = bk
        elif bk is not backend:
            raise DeviceError(
                f"group {group.id}: the gradient of leaf {leaf} is on {bk.device!r}, "
                f"expected {backend.device!r}"
            )
    return backend


def check_device_gradient_groups(
    groups: Sequence[ParameterGroup], gradients: Mapping[int, Any], backend: Backend
) -> None:
    """``check_device_gradients`` of every group on ``backend``: one pass of comparisons
    when all fit (a device step's common case), else the first misfit explained."""
    if not _fit(groups, gradients, backend):
        for group in groups:
            check_device_gradients(group, gradients, backend)


def _fit(groups: Sequence[ParameterGroup], gradients: Mapping[int, Any], backend: Backend) -> bool:
    """Whether every leaf gradient of ``groups`` is a tensor on device ``backend`` of its
    group's shape and dtype (what ``check_device_gradients`` checks, without messages)."""
    to_dtype = getattr(backend, "to_dtype", None)  # a device backend's (the host has none)
    if to_dtype is None:
        return False
    is_array = backend.is_array
    for group in groups:
        dtype = getattr(group.parameter, "dtype", None)
        if not isinstance(dtype, np.dtype):
            return False
        dtype, shape = to_dtype(dtype), group.shape
        for leaf in group.leaves:
            try:
                g = gradients[leaf]
            except (KeyError, IndexError):
                return False
            if not is_array(g) or g.dtype != dtype or g.shape != shape:
                return False
    return True


def with_device_group_gradient(
    group: ParameterGroup, gradients: Mapping[int, Any], action: Callable[[Any], T]
) -> T:
    """Run ``action`` on the summed device gradient of ``group`` and return its result (C8).

    A group of one lends its gradient: ``action`` receives the very tensor of
    ``gradients``. Otherwise the left-to-right sum ((g0 + g1) + g2) is one owned
    temporary of the backend's ``temporaries`` tracker, accumulated in place, so no
    intermediate outlives the next partial sum; it is released whether ``action``
    returns or raises. ``gradients`` is never written into nor released, and
    ``action`` must not keep its argument. Every leaf is validated before any work.
    """
    return with_device_group_gradients([group], gradients, lambda sums: action(sums[0]))


def with_device_group_gradients(
    groups: Sequence[ParameterGroup],
    gradients: Mapping[int, Any],
    action: Callable[[list[Any]], T],
) -> T:
    """``with_device_group_gradient`` for several groups at once: ``action(sums)`` (C8).

    ``sums`` holds one gradient per group, in order: borrowed for a group of one, an
    owned temporary otherwise (so a fused optimizer can update every storage in one
    call). Every leaf of every group is validated before any addition; all owned sums
    are released whether the additions or ``action`` return or raise.
    """
    bk = None
    for group in groups:
        bk = check_device_gradients(group, gradients, bk)
    if bk is None:
        return action([])
    with checked_device_sums(groups, gradients, bk) as sums:
        return action(sums)


@contextmanager
def checked_device_sums(
    groups: Sequence[ParameterGroup], gradients: Mapping[int, Any], bk: Backend
) -> Iterator[list[Any]]:
    """The summing part of ``with_device_group_gradients`` as a context, for gradients
    already checked on ``bk`` by ``check_device_gradients``: the sums are released when
    the block ends, whether it returns or raises (C8)."""
    tracker = bk.temporaries
    sums: list[Any] = []
    owned: list[Any] = []
    try:
        for group in groups:
            leaves = group.leaves
            total = gradients[leaves[0]]
            if len(leaves) > 1:
                total = tracker.own(total + gradients[leaves[1]])
                owned.append(total)
                for leaf in leaves[2:]:
                    total += gradients[leaf]
            sums.append(total)
        yield sums
    finally:
        sums.clear()
        for t in owned:
            tracker.release(t)
        owned.clear()


def sgd_step_device_groups(session: Any, lr: float, gradients: Mapping[int, Any] | None) -> None:
    """Plain SGD on a device session: ``p -= lr * sum`` once per storage, on its mirror.

    Everything is checked first (C6): the learning rate, the gradients' session,
    every leaf gradient (presence, shape, dtype, device) and every group's current
    device value (a stale host without a mirror raises). Each update starts from the
    current mirror, uploading only when there is none, and leaves the host stale (C3,
    C7); the summed gradient of a shared storage is a released temporary (C8).
    """
    lr = check_sgd_inputs(session, lr, gradients)
    bk = session.backend
    groups = recorded_groups(session, gradients)
    check_device_gradient_groups(groups, gradients, bk)
    for group in groups:
        group.current_device_value(bk)
    with checked_device_sums(groups, gradients, bk) as sums:
        _sgd_update(groups, bk, lr, sums)


def _sgd_update(groups: Sequence[ParameterGroup], bk: Backend, lr: float, sums: list[Any]) -> None:
    for group, grad in zip(groups, sums):
        storage = group.storage
        if storage is None:
            group.parameter.set(bk.download(group.current_device_value(bk) - lr * grad))
            continue
        cell = storage.rows_cell or storage  # a row mask: its rows alone (params.rows)
        p = cell.device_for_update(bk)
        p.sub_(lr * (grad if cell is storage else cell.gather(grad)))
        cell.commit_device(p)
