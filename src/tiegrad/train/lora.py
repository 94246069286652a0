"""The LoRA adapters of a run: the ``--lora`` specification, read, written and attached.

A specification is comma-separated ``key=value`` items: ``rank`` (an integer >= 1,
default 8), ``alpha`` (> 0, default 16), ``dropout`` (in [0, 1), default 0),
``share_tied`` (``true`` or ``false``, default false: ``add_lora``'s, one adapter for
every use of a targeted tied storage) and ``targets``, required: patterns of the layers
to adapt, as ``add_lora`` takes them, separated by ``+``. A bare item (no ``=``) after
``targets=`` is one more target, so ``rank=8,targets=c_attn,c_proj`` and
``targets=c_attn+c_proj,rank=8`` say the same.
A key given twice, an unknown key, a value out of range, a bare item before
``targets=`` or an empty target is a ``ConfigError`` naming the item and the expected
form, raised before anything is built (C6).

A run stores its specification in its checkpoints' ``extra`` (``KEY``, in the form
``LoraSpec.text`` writes), so ``resume``, ``sample`` and ``export`` rebuild the adapted
model from a checkpoint alone.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..errors import AliasError, ConfigError, HyperparameterError, SlotError

#: The checkpoint ``extra`` key holding a run's specification.
KEY = "lora"
FORM = (
    "rank=N,alpha=A,dropout=P,share_tied=true|false,targets=NAME[+NAME...] (targets "
    "required; bare NAMEs after it are more targets)"
)
_DEFAULTS = {"rank": 8, "alpha": 16.0, "dropout": 0.0, "share_tied": False}
_KINDS = {int: "an integer", float: "a number", bool: "true or false"}


@dataclass(frozen=True)
class LoraSpec:
    """What ``--lora`` asks for: ``add_lora``'s arguments."""

    targets: tuple[str, ...]
    rank: int
    alpha: float
    dropout: float
    share_tied: bool = False

    def text(self) -> str:
        """The specification in the form ``parse_lora`` reads (``parse_lora(s.text()) == s``;
        ``share_tied`` written only when set, so older runs' texts read the same)."""
        shared = ",share_tied=true" if self.share_tied else ""
        return (
            f"rank={self.rank},alpha={self.alpha!r},dropout={self.dropout!r}{shared},"
            f"targets={'+'.join(self.targets)}"
        )

    def attach(self, model: Any, label: str) -> list[str]:
        """``add_lora`` on ``model``: adapters on the targets, every other use frozen;
        returns the adapted weight paths. A target naming no adaptable layer is a
        ``ConfigError`` prefixed with ``label``, and ``model`` is unchanged (C6)."""
        from ..adapters import add_lora

        try:
            return add_lora(
                model, self.targets, self.rank, self.alpha, self.dropout,
                share_tied=self.share_tied,
            )  # fmt: skip
        except (SlotError, AliasError) as e:
            raise ConfigError(f"{label}: {e}") from None


def parse_lora(text: str, label: str = "--lora") -> LoraSpec:
    """The specification ``text`` (see the module docstring); errors name ``label``."""
    from .._checks import count, decay_rate, positive

    def refuse(what: str) -> ConfigError:
        return ConfigError(f"{label} {text!r}: {what}; expected {FORM}")

    values: dict[str, Any] = {}
    targets: list[str] | None = None
    for item in text.split(","):
        key, sep, value = item.partition("=")
        key = key.strip()
        if not sep:
            if targets is None:
                raise refuse(f"{item!r} is not key=value (only targets= takes more items)")
            targets.append(key)
            continue
        if key in values or (key == "targets" and targets is not None):
            raise refuse(f"{key!r} is given twice")
        if key == "targets":
            targets = [t.strip() for t in value.split("+")]
        elif key in _DEFAULTS:
            values[key] = value.strip()
        else:
            raise refuse(f"unknown key {key!r} (known: {', '.join(_DEFAULTS)}, targets)")
    if not targets:
        raise refuse("targets= is missing")
    if not all(targets):
        raise refuse("an empty target")
    numbers = {}
    for key, default in _DEFAULTS.items():
        kind = type(default)
        try:
            numbers[key] = _value(kind, values[key]) if key in values else default
        except ValueError:
            raise refuse(f"{key}={values[key]!r} is not {_KINDS[kind]}") from None
    try:
        rank = count(label, "rank", numbers["rank"], minimum=1)
        alpha = positive(label, "alpha", numbers["alpha"])
        dropout = decay_rate(label, "dropout", numbers["dropout"])
    except HyperparameterError as e:
        raise ConfigError(f"{e}; expected {FORM}") from None
    return LoraSpec(tuple(targets), rank, alpha, dropout, numbers["share_tied"])


def _value(kind: type, text: str) -> Any:
    """``text`` as a value of ``kind``: ``int``, ``float``, or ``bool`` from ``true`` or
    ``false`` alone (ValueError otherwise)."""
    if kind is not bool:
        return kind(text)
    if text not in ("true", "false"):
        raise ValueError(text)
    return text == "true"
