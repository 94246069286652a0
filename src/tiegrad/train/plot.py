"""``plot_losses``: ``loss.png``, train and validation loss against the step.

matplotlib is optional (the ``plot`` extra). Without it the plot is skipped with a
single notice per process, and training goes on.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

_notified = [False]


def plot_losses(
    records: Sequence[dict[str, Any]],
    path: str | os.PathLike,
    unit: str = "token",
    title: str = "tiegrad training",
    notify: Callable[[str], None] = print,
) -> Path | None:
    """Draw the ``train_loss`` and ``val_loss`` of ``records`` into ``path`` (a PNG).

    Returns the path, or ``None`` when matplotlib is missing (``notify`` is called
    with the reason the first time only) or when there is nothing to plot.
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        if not _notified[0]:
            _notified[0] = True
            notify(
                "matplotlib is not installed: no loss plot (pip install matplotlib, the "
                "'plot' extra)"
            )
        return None
    train = [(r["step"], r["train_loss"]) for r in records if "train_loss" in r]
    val = [(r["step"], r["val_loss"]) for r in records if "val_loss" in r]
    if not train and not val:
        return None
    fig, ax = plt.subplots(figsize=(7, 4.2), dpi=100)
    if train:
        ax.plot(*zip(*train), label="train", linewidth=1, alpha=0.8)
    if val:
        ax.plot(*zip(*val), label="validation", marker="o", markersize=3, linewidth=1.5)
    ax.set_xlabel("step")
    ax.set_ylabel(f"loss (nats per {unit})")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp.png")
    fig.savefig(tmp)
    plt.close(fig)
    os.replace(tmp, path)
    return path
