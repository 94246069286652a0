"""``AttributeError``s that name tiegrad's way for a PyTorch attribute it spells otherwise.

A PyTorch user reaches for ``tensor.data``, ``param.cuda()`` or ``model.zero_grad()``
first; where tiegrad has no attribute of that name, the error says what to call instead,
as ``module(X)`` without a session already does. The error stays an ``AttributeError``,
so ``hasattr`` and ``getattr(obj, name, default)`` keep working.
"""

from __future__ import annotations

from collections.abc import Mapping


def missing_attribute(label: str, name: str, hints: Mapping[str, str]) -> AttributeError:
    """The ``AttributeError`` for ``label.name``, with ``hints[name]`` when there is one."""
    hint = hints.get(name)
    message = f"{label} has no attribute {name!r}"
    return AttributeError(f"{message}; {hint}" if hint else message)
