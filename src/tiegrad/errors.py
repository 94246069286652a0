"""The error hierarchy. Every error tiegrad raises on bad input is a ``TiegradError``.

Messages name the slot, op or file involved and both the expected and the actual
value (contract C6). Raising one of these guarantees nothing was mutated. A message is
bounded whatever the input: values go through ``shown`` and lists of names through
``shown_list``.
"""

from __future__ import annotations

from collections.abc import Iterable


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


def shown(value: object, width: int = 60) -> str:
    """``repr(value)`` cut to ``width`` characters, so that an error message naming a value
    read from a file stays short; an integer too long for ``repr`` is given by its size."""
    try:
        r = repr(value)
    except ValueError:  # an int beyond Python's digit limit for conversion to text
        return f"an integer of {value.bit_length()} bits"  # type: ignore[attr-defined]
    return r if len(r) <= width else r[: width - 3] + "..."


def shown_list(items: Iterable[object], limit: int = 3) -> str:
    """At most ``limit`` of ``items`` (an iterable), each ``shown``, then how many more:
    ``'a', 'b', 'c' and 7 more``; ``none`` when there are none. Every list of names that
    goes into an error message goes through here, so a file of a million names gives a
    message of a line."""
    names = list(items)
    head = ", ".join(shown(n) for n in names[:limit]) or "none"
    return head if len(names) <= limit else f"{head} and {len(names) - limit} more"
