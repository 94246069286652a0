"""Peak memory of the training process, for the run's metrics.

``peak_rss_mb`` is the process's peak resident set size so far, in MiB, as the operating
system reports it (``resource.getrusage(RUSAGE_SELF).ru_maxrss``: kibibytes on Linux,
bytes on macOS); None where the ``resource`` module is missing (Windows). It never
decreases: the process's peak, the model, optimizer state and each step's transient
memory included. ``device_peak_mb`` is the peak of the tensors allocated on a CUDA device
so far (``torch.cuda.max_memory_allocated``, in MiB), None on the host, torch's CPU and
MPS, which report no such peak.
"""

from __future__ import annotations

import sys
from typing import Any

_MIB = 1024 * 1024


def peak_rss_mb() -> float | None:
    """The process's peak resident set size so far, in MiB (None where unknown)."""
    try:
        import resource
    except ImportError:  # Windows
        return None
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / _MIB if sys.platform == "darwin" else peak / 1024


def device_peak_mb(backend: Any) -> float | None:
    """The peak of the memory allocated on ``backend``'s CUDA device so far, in MiB; None
    for any other backend (the host's NumPy, torch's CPU, MPS)."""
    device = getattr(backend, "torch_device", None)
    if device is None or device.type != "cuda":
        return None
    import torch

    return torch.cuda.max_memory_allocated(device) / _MIB


def peak_memory(backend: Any) -> dict[str, float | None]:
    """``{"peak_rss_mb": ..., "device_peak_mb": ...}`` for a session on ``backend``: the
    fields a training record carries (``tiegrad.train.metrics``)."""
    return {"peak_rss_mb": peak_rss_mb(), "device_peak_mb": device_peak_mb(backend)}
