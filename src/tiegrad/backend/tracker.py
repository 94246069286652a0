"""A live-temporary counter: the allocation tracker behind contract C8.

A device backend owns one ``TemporaryTracker``. Code that creates a temporary it
must release (a group-gradient sum, C8) registers it with ``own`` and hands it back
with ``release``. Releasing drops the tracker's reference: the array is freed by its
library once nothing else holds it, and is never freed in place, since others may
share it (C7). The counters let tests prove that every temporary is released on
success and on failure.
"""

from __future__ import annotations

from typing import Any

from ..errors import TiegradError


class TemporaryTracker:
    """Counts owned temporaries: ``live`` now, ``peak`` since ``reset_peak``, ``total`` ever."""

    __slots__ = ("peak", "total", "_owned")

    def __init__(self) -> None:
        self.peak = 0
        self.total = 0
        self._owned: set[int] = set()

    @property
    def live(self) -> int:
        """How many owned temporaries have not been released."""
        return len(self._owned)

    def own(self, x: Any) -> Any:
        """Register ``x`` as an owned temporary and return it."""
        key = id(x)
        if key in self._owned:
            raise TiegradError(f"temporary tracker: {type(x).__name__} 0x{key:x} is already owned")
        self._owned.add(key)
        self.total += 1
        if self.live > self.peak:
            self.peak = self.live
        return x

    def release(self, x: Any) -> None:
        """Give back an owned temporary; releasing a borrowed array is an error (C8)."""
        key = id(x)
        if key not in self._owned:
            raise TiegradError(
                f"temporary tracker: {type(x).__name__} 0x{key:x} is not an owned temporary "
                "(borrowed arrays are never released)"
            )
        self._owned.remove(key)

    def owns(self, x: Any) -> bool:
        return id(x) in self._owned

    def reset_peak(self) -> int:
        """Set ``peak`` to the current ``live`` count and return it."""
        self.peak = self.live
        return self.live

    def __repr__(self) -> str:
        return f"TemporaryTracker(live={self.live}, peak={self.peak}, total={self.total})"
