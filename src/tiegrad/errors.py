"""The error hierarchy. Every error tiegrad raises on bad input is a ``TiegradError``.

Messages name the slot, op or file involved and both the expected and the actual
value (contract C6). Raising one of these guarantees nothing was mutated.
"""

from __future__ import annotations


class TiegradError(Exception):
    """Base class of every error tiegrad raises for bad input or misuse."""


class ShapeError(TiegradError, ValueError):
    """A shape differs from the one required (names the op or slot and both shapes)."""


class DTypeError(TiegradError, TypeError):
    """A dtype differs from the one required."""


class IndexRangeError(TiegradError, IndexError):
    """Integer data (class targets, embedding ids) lies outside its valid range."""


class TapeError(TiegradError):
    """Misuse of a session's tape: foreign or stale refs, ids not on the tape, bad seeds."""


class SlotError(TiegradError, IndexError):
    """A parameter slot, canonical index or trainability mask is invalid (C5)."""


class AliasError(TiegradError):
    """An alias (tie) layout is invalid or does not match the one required (C1, C5, C9)."""


class MissingGradientError(TiegradError, KeyError):
    """A trainable storage has no gradient where one is required (C4)."""

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0]) if self.args else ""


class HyperparameterError(TiegradError, ValueError):
    """A hyperparameter is non-finite or out of range."""


class NonFiniteError(TiegradError, FloatingPointError):
    """A gradient holds NaN or infinity and the optimizer was asked to raise."""


class DeviceError(TiegradError):
    """A device is unavailable, or host and device values were mixed (C7)."""


class CheckpointError(TiegradError):
    """A checkpoint file is malformed or does not match its target (C9)."""


class ConfigError(TiegradError, ValueError):
    """A configuration key or value is invalid (a model's, the trainer's, the command line's)."""


class DistributedError(TiegradError):
    """A process group cannot start, the ranks disagree (layout, checksum), or a rank failed."""
