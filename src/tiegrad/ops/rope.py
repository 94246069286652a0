"""Rotary position embedding: the ``rotary`` op and the tables it reads (``rope_tables``).

``rotary`` is transformers' ``apply_rotary_pos_emb`` (the rotate-half layout of Llama,
Mistral, Qwen, Gemma, GPT-NeoX) for one tensor, with partial rotary: the first ``R``
features rotate and the rest pass through. ``rope_tables`` computes the ``cos`` and
``sin`` tables as transformers' rotary embedding modules do, for given positions (a
KV cache continues at position ``p`` by passing ``p, p + 1, ...``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from numbers import Integral, Real
from typing import Any

import numpy as np

from ..errors import ConfigError, DTypeError, ShapeError
from ..tape import TensorRef
from ._core import lift, needs_grad, session_of, unbroadcast, value_of

_OP = "rotary"


def rotary(x: Any, cos: Any, sin: Any) -> TensorRef:
    """``x_rot * cos + rotate_half(x_rot) * sin`` joined with the rest of ``x`` (last axis).

    ``x`` is (..., T, D), e.g. (B, H, T, D). ``cos`` and ``sin`` (arrays or refs, of
    one shape) are (T, R), or any shape that broadcasts to ``x[..., :R]`` without
    enlarging it, e.g. (B, 1, T, R); ``R`` is even and at most ``D``. The first ``R``
    features of ``x`` rotate (``rotate_half(y)`` is ``concat(-y2, y1)`` of ``y``'s two
    halves), the last ``D - R`` pass through unchanged, as transformers'
    ``apply_rotary_pos_emb`` with a ``partial_rotary_factor``. The output has the dtype
    of that formula (transformers passes the tables in ``x``'s dtype).

    One node. VJP: ``gx_rot = g * cos - rotate_half(g * sin)``, the pass-through part's
    cotangent unchanged; ``cos`` and ``sin``, where they are refs that take a gradient,
    get ``g * x_rot`` and ``g * rotate_half(x_rot)`` summed to their shapes. Operands
    that do not fit are a ``ShapeError``, non-floating ones a ``DTypeError`` (naming
    the operand); nothing is recorded then (C6).
    """
    s = session_of(x, cos, sin)
    bk = s.backend
    xv, cv, sv = value_of(s, x), value_of(s, cos), value_of(s, sin)
    for name, v in (("x", xv), ("cos", cv), ("sin", sv)):
        if not bk.is_floating(v.dtype):
            raise DTypeError(
                f"{_OP}: {name} has dtype {bk.dtype_name(v.dtype)}, expected a floating dtype"
            )
    xs, cs = tuple(xv.shape), tuple(cv.shape)
    if len(xs) < 2:
        raise ShapeError(f"{_OP}: x has shape {xs}, expected (..., T, D)")
    if tuple(sv.shape) != cs:
        raise ShapeError(f"{_OP}: sin has shape {tuple(sv.shape)}, expected cos's shape {cs}")
    r = cs[-1] if cs else 0
    if not cs or r % 2 or r > xs[-1] or not _fits(cs[:-1], xs[:-1]):
        raise ShapeError(
            f"{_OP}: cos and sin have shape {cs}, expected (T, R) or a shape that broadcasts "
            f"to x[..., :R] without enlarging it, with R even and <= D, for x of shape {xs}"
        )
    x, cos, sin = lift(s, x, xv), lift(s, cos, cv), lift(s, sin, sv)
    h = r // 2
    c1, c2, s1, s2 = cv[..., :h], cv[..., h:], sv[..., :h], sv[..., h:]
    x1, x2 = xv[..., :h], xv[..., h:r]
    lo, hi = x1 * c1 - x2 * s1, x2 * c2 + x1 * s2
    out = bk.empty(xs, lo.dtype)
    out[..., :h] = lo
    out[..., h:r] = hi
    out[..., r:] = xv[..., r:]
    wants = (needs_grad(s, x), needs_grad(s, cos), needs_grad(s, sin))
    x_dtype = xv.dtype
    # the input only for the tables' gradients: a model's constant tables keep no x alive
    rotated = (x1, x2) if wants[1] or wants[2] else None

    def vjp(g):
        g1, g2 = g[..., :h], g[..., h:r]
        gx = gc = gs = None
        if wants[0]:
            gx = bk.empty(xs, x_dtype)
            gx[..., :h] = g1 * c1 + g2 * s2
            gx[..., h:r] = g2 * c2 - g1 * s1
            gx[..., r:] = g[..., r:]
        if wants[1]:
            gc = unbroadcast(bk, bk.concat([g1 * rotated[0], g2 * rotated[1]], -1), cs)
        if wants[2]:
            gs = unbroadcast(bk, bk.concat([-(g1 * rotated[1]), g2 * rotated[0]], -1), cs)
        return gx, gc, gs

    return s._record(out, (x.id, cos.id, sin.id), vjp)


def _fits(table: tuple[int, ...], lead: tuple[int, ...]) -> bool:
    """Whether leading axes ``table`` broadcast to ``lead`` without enlarging it."""
    if len(table) > len(lead):
        return False
    return all(m == n or m == 1 for m, n in zip(reversed(table), reversed(lead)))


#: Rotary types implemented, with the keys each reads beside ``rope_type``/``rope_theta``.
ROPE_TYPES: dict[str, tuple[str, ...]] = {
    "default": (),
    "linear": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
}
_SHARED_KEYS = ("rope_type", "type", "rope_theta", "partial_rotary_factor")


def rope_tables(
    positions: Any,
    dim: int,
    theta: float = 10000.0,
    scaling: Mapping[str, Any] | None = None,
    partial_rotary_factor: float = 1.0,
    dtype: Any = np.float32,
) -> tuple[np.ndarray, np.ndarray]:
    """The ``(cos, sin)`` tables of ``rotary`` for integer ``positions``, as NumPy arrays.

    Each has shape ``positions.shape + (R,)`` with ``R = int(dim * partial_rotary_factor)``
    (even) rotating features of a head of ``dim``. They are transformers' rotary
    embedding (``LlamaRotaryEmbedding`` and ``ROPE_INIT_FUNCTIONS``) computed the same
    way in float32 (inverse frequencies ``1 / theta ** (2i / R)``, the angles
    ``position * inv_freq`` in float32), then cast to ``dtype``, as transformers casts
    them to the model's dtype.

    ``scaling`` is a model config's ``rope_scaling`` (or ``rope_parameters``): None or
    ``{"rope_type": "default"}``; ``"linear"`` with ``factor`` (frequencies divided by
    it); ``"llama3"`` with ``factor``, ``low_freq_factor``, ``high_freq_factor`` and
    ``original_max_position_embeddings`` (Llama 3.1's smoothing of the low frequencies).
    ``"type"`` is read as ``"rope_type"``, as transformers does; ``rope_theta`` and
    ``partial_rotary_factor`` may appear if they equal the arguments. Another type, a
    missing, invalid or unknown key is a ``ConfigError`` naming it; non-integer
    positions are a ``DTypeError``.
    """
    op = "rope_tables"
    pos = np.asarray(positions)
    if pos.dtype.kind not in "iu":
        raise DTypeError(f"{op}: positions must have an integer dtype, got {pos.dtype}")
    dim = _config_int(op, "dim", dim)
    theta = _config_positive(op, "theta", theta)
    prf = _config_positive(op, "partial_rotary_factor", partial_rotary_factor)
    rotated = int(dim * prf)
    if prf > 1.0 or rotated < 2 or rotated % 2:
        raise ConfigError(
            f"{op}: partial_rotary_factor={partial_rotary_factor!r} of dim={dim} rotates "
            f"{rotated} features, expected an even number in [2, {dim}]"
        )
    rope_type, params = _rope_parameters(op, scaling, theta, prf)
    exponents = np.arange(0, rotated, 2, dtype=np.int64).astype(np.float32) / np.float32(rotated)
    # theta ** e in float64 rounded once to float32: transformers' float32 power
    inv_freq = np.float32(1.0) / (np.float64(theta) ** exponents.astype(np.float64)).astype(
        np.float32
    )
    if rope_type == "linear":
        inv_freq = inv_freq / np.float32(params["factor"])
    elif rope_type == "llama3":
        inv_freq = _llama3_frequencies(inv_freq, **params)
    freqs = pos.astype(np.float32)[..., None] * inv_freq
    angles = np.concatenate([freqs, freqs], axis=-1)
    return np.cos(angles).astype(dtype), np.sin(angles).astype(dtype)


def _llama3_frequencies(
    inv_freq: np.ndarray,
    factor: float,
    low_freq_factor: float,
    high_freq_factor: float,
    original_max_position_embeddings: int,
) -> np.ndarray:
    """Llama 3.1's frequencies, in float32 and in transformers' order of operations:
    wavelengths above ``original / low_freq_factor`` are divided by ``factor``, those
    below ``original / high_freq_factor`` kept, those between interpolated."""
    old = original_max_position_embeddings
    low_wavelen, high_wavelen = old / low_freq_factor, old / high_freq_factor
    # torch divides a number by a tensor as the tensor's reciprocal times the number
    wavelen = (np.float32(1.0) / inv_freq) * np.float32(2 * math.pi)
    scaled = np.where(wavelen > low_wavelen, inv_freq / np.float32(factor), inv_freq)
    smooth = ((np.float32(1.0) / wavelen) * np.float32(old) - low_freq_factor) / (
        high_freq_factor - low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / np.float32(factor) + smooth * scaled
    medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return np.where(medium, smoothed, scaled).astype(np.float32)


def _rope_parameters(
    op: str, scaling: Mapping[str, Any] | None, theta: float, prf: float
) -> tuple[str, dict[str, Any]]:
    """The rope type of ``scaling`` and the parameters that type reads, checked."""
    if scaling is None:
        return "default", {}
    if not isinstance(scaling, Mapping):
        raise ConfigError(f"{op}: scaling must be a dict or None, got {type(scaling).__name__}")
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type not in ROPE_TYPES:
        raise ConfigError(
            f"{op}: rope type {rope_type!r} is not supported, expected one of "
            f"{', '.join(repr(t) for t in ROPE_TYPES)}"
        )
    wanted = ROPE_TYPES[rope_type]
    unknown = [str(k) for k in scaling if k not in wanted and k not in _SHARED_KEYS]
    if unknown:
        shown = ", ".join(repr(k) for k in unknown[:3])
        more = f" and {len(unknown) - 3} more" if len(unknown) > 3 else ""
        raise ConfigError(
            f"{op}: rope type {rope_type!r} reads {list(wanted)}, got unknown key(s) {shown}{more}"
        )
    for key, value in (("rope_theta", theta), ("partial_rotary_factor", prf)):
        if key in scaling and scaling[key] != value:
            raise ConfigError(f"{op}: scaling has {key}={scaling[key]!r}, the argument {value!r}")
    params = {}
    for key in wanted:
        if key not in scaling:
            raise ConfigError(f"{op}: rope type {rope_type!r} needs {key!r} in scaling")
        if key == "original_max_position_embeddings":
            params[key] = _config_int(op, key, scaling[key])
        else:
            params[key] = _config_positive(op, key, scaling[key])
    if rope_type == "llama3" and not params["low_freq_factor"] < params["high_freq_factor"]:
        raise ConfigError(
            f"{op}: llama3 needs low_freq_factor < high_freq_factor, got "
            f"{params['low_freq_factor']!r} and {params['high_freq_factor']!r}"
        )
    return rope_type, params


def _config_positive(op: str, name: str, value: Any) -> float:
    """A finite real number > 0 (bools refused), as a float, else a ``ConfigError``."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, Real):
        raise ConfigError(f"{op}: {name} must be a number > 0, got {value!r}")
    x = float(value)
    if not (math.isfinite(x) and x > 0):
        raise ConfigError(f"{op}: {name} must be a finite number > 0, got {value!r}")
    return x


def _config_int(op: str, name: str, value: Any) -> int:
    """An integer > 0 (bools refused), else a ``ConfigError``."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, Integral) or value <= 0:
        raise ConfigError(f"{op}: {name} must be an integer > 0, got {value!r}")
    return int(value)
