"""``Progress``: a training run's progress (step, loss, learning rate, throughput).

On a terminal it is a tqdm bar; when stderr is not a terminal (a log file, CI, a
pipe) it is plain log lines every ``every`` steps, never ``\\r`` redraws. The first
step of a process may compile kernels (numba, once per install): until it is done the
bar says so, and the remaining-time estimate counts only the steps after it.
"""

from __future__ import annotations

import sys
import time
from typing import Any, TextIO

from tqdm import tqdm

FIRST_STEP = "compiling kernels (first run only)"


def log_interval(total: int) -> int:
    """Steps between two plain progress lines: a tenth of the run, at most 100."""
    return max(1, min(100, total // 10))


def _clock(seconds: float) -> str:
    minutes, secs = divmod(int(seconds), 60)
    return f"{minutes}m{secs:02d}s"


class Progress:
    """Shows the progress of steps ``initial + 1 .. total``; ``enabled=False`` shows
    nothing. ``tty`` (default: whether ``file`` is a terminal) picks the bar or the
    lines; ``message`` prints a line above the bar (or plainly)."""

    def __init__(
        self,
        total: int,
        initial: int = 0,
        unit: str = "tokens",
        enabled: bool = True,
        file: TextIO | None = None,
        tty: bool | None = None,
        every: int | None = None,
    ) -> None:
        self.unit = unit
        self.file = file if file is not None else sys.stderr
        self.total = total
        self.step = initial
        self.enabled = enabled
        self.tty = tty if tty is not None else bool(getattr(self.file, "isatty", bool)())
        self.every = every if every is not None else log_interval(total)
        self._first = True
        self._warm: tuple[float, int] | None = None  # (time, step) after the first step
        self.bar = None
        if enabled and self.tty:
            self.bar = tqdm(
                total=total,
                initial=initial,
                desc=f"train ({FIRST_STEP})",
                unit="step",
                dynamic_ncols=True,
                file=self.file,
                mininterval=0.5,
                smoothing=0,
            )

    def update(self, loss: float, lr: float | None, throughput: float | None) -> None:
        """Advance one step and show the numbers."""
        self.step += 1
        now = time.perf_counter()
        if self._first:
            self._first = False
            self._warm = (now, self.step)
            if self.bar is not None:  # the estimate starts after the first step
                self.bar.set_description("train", refresh=False)
                self.bar.update(1)
                self.bar.initial = self.bar.n
                self.bar.start_t = self.bar._time()
                return
        if self.bar is not None:
            post: dict[str, Any] = {"loss": f"{loss:.4f}"}
            if lr is not None:
                post["lr"] = f"{lr:.2e}"
            if throughput is not None:
                post[f"{self.unit}/s"] = f"{throughput:,.0f}"
            self.bar.set_postfix(post, refresh=False)
            self.bar.update(1)
        elif self.enabled and (self.step % self.every == 0 or self.step == self.total):
            self.file.write(self._line(loss, lr, throughput, now) + "\n")
            self.file.flush()

    def _line(self, loss: float, lr: float | None, throughput: float | None, now: float) -> str:
        parts = [f"step {self.step}/{self.total}", f"loss {loss:.4f}"]
        if lr is not None:
            parts.append(f"lr {lr:.2e}")
        if throughput is not None:
            parts.append(f"{throughput:,.0f} {self.unit}/s")
        if self._warm is not None and self.step > self._warm[1]:
            t0, s0 = self._warm
            left = (now - t0) / (self.step - s0) * (self.total - self.step)
            parts.append(f"eta {_clock(left)}")
        return "  ".join(parts)

    def message(self, text: str, out: TextIO | None = None) -> None:
        tqdm.write(text, file=out if out is not None else sys.stdout)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
