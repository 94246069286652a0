"""Checkpoints that keep ties: one safetensors file with a JSON schema (C9).

``save`` stores each storage once plus the alias map, trainability mask, optimizer
state by canonical slot, schedule and RNG state; ``load`` validates all of it against
its targets before applying any of it; ``inspect`` summarizes a file.
"""

from .loading import LoadResult, load
from .saving import save
from .schema import FORMAT_VERSION, Schema, SlotRecord
from .summary import inspect

__all__ = [
    "FORMAT_VERSION",
    "LoadResult",
    "Schema",
    "SlotRecord",
    "inspect",
    "load",
    "save",
]
