"""``Progress``: the tqdm bar of a training run (step, loss, learning rate, throughput)."""

from __future__ import annotations

import sys
from typing import Any, TextIO

from tqdm import tqdm


class Progress:
    """A step bar that shows loss, learning rate and items per second; ``enabled=False``
    turns it off. ``message`` prints a line above the bar (or plainly when off)."""

    def __init__(
        self,
        total: int,
        initial: int = 0,
        unit: str = "tokens",
        enabled: bool = True,
        file: TextIO | None = None,
    ) -> None:
        self.unit = unit
        self.file = file if file is not None else sys.stderr
        self.bar = tqdm(
            total=total,
            initial=initial,
            desc="train",
            unit="step",
            dynamic_ncols=True,
            disable=not enabled,
            file=self.file,
            mininterval=0.5,
        )

    def update(self, loss: float, lr: float | None, throughput: float | None) -> None:
        """Advance one step and refresh the numbers shown."""
        post: dict[str, Any] = {"loss": f"{loss:.4f}"}
        if lr is not None:
            post["lr"] = f"{lr:.2e}"
        if throughput is not None:
            post[f"{self.unit}/s"] = f"{throughput:,.0f}"
        self.bar.set_postfix(post, refresh=False)
        self.bar.update(1)

    def message(self, text: str, out: TextIO | None = None) -> None:
        tqdm.write(text, file=out if out is not None else sys.stdout)

    def close(self) -> None:
        self.bar.close()
