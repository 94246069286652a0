"""``Interrupt``: Ctrl-C (SIGINT) and SIGTERM during ``Trainer.fit``.

The first signal sets a flag: the loop finishes its step, writes a checkpoint and
returns ``status == "interrupted"``, so a run stopped by a user, a scheduler or a
container can be resumed. A second signal aborts at once (``KeyboardInterrupt``).
"""

from __future__ import annotations

import signal
import sys
import threading
from typing import Any

SIGNALS = (signal.SIGINT, signal.SIGTERM)


class Interrupt:
    """The handlers of ``SIGNALS`` for the duration of a ``with`` block, installed on the
    main thread only (elsewhere the block runs without them) and restored on exit.

    ``signal`` is the first signal received, or ``None``. ``announce``: whether the
    first one says on stderr what happens next (rank 0 alone in a data-parallel run:
    torchrun passes the signal to every rank).
    """

    def __init__(self, announce: bool = True) -> None:
        self.announce = announce
        self.signal: int | None = None
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> Interrupt:
        if threading.current_thread() is threading.main_thread():
            for sig in SIGNALS:
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum: int, frame: Any) -> None:
        if self.signal is not None:
            raise KeyboardInterrupt
        self.signal = signum
        if self.announce:
            name = signal.Signals(signum).name
            print(
                f"\n{name}: finishing the current step, then saving a checkpoint", file=sys.stderr
            )

    def __exit__(self, *exc: Any) -> None:
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)
