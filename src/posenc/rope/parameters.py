"""Hugging Face-style ``rope_parameters`` dicts: parse, validate (raise, never warn), and normalise.

The math in ``frequencies`` takes plain values; this module is the only place that knows the dict keys.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import torch

from posenc._checks import base_value, even_positive_int
from posenc.rope.frequencies import SCALINGS

# Per rope_type: keys that must be present and keys that may be present (beyond the common ones).
REQUIRED_KEYS: dict[str, frozenset[str]] = {"default": frozenset()}
OPTIONAL_KEYS: dict[str, frozenset[str]] = {"default": frozenset()}
COMMON_KEYS = frozenset({"rope_type", "type", "rope_theta", "partial_rotary_factor"})


@dataclasses.dataclass(frozen=True)
class RopeSpec:
    """A validated RoPE configuration with plain values.

    rotary_dim: channels rotated per head (even, <= head_dim); base: rope_theta;
    params: the type's own parameters, keyed as in Hugging Face configs.
    """

    head_dim: int
    rotary_dim: int
    base: float
    rope_type: str = "default"
    params: Mapping[str, Any] = dataclasses.field(default_factory=dict)


def parse_rope_parameters(
    head_dim: int,
    rope_parameters: Mapping[str, Any] | None = None,
    *,
    base: float | None = None,
    rotary_dim: int | None = None,
) -> RopeSpec:
    """Validate a Hugging Face-style dict and resolve the rotary dim and base.

    ``base`` / ``rotary_dim`` given explicitly must agree with ``rope_theta`` / ``partial_rotary_factor``.
    """
    if isinstance(head_dim, bool) or not isinstance(head_dim, int) or head_dim <= 0:
        raise ValueError(f"head_dim must be a positive integer, got {head_dim!r}")
    if rope_parameters is None:
        rope_parameters = {}
    if not isinstance(rope_parameters, Mapping):
        raise TypeError(
            "rope_parameters must be a dict like {'rope_type': 'default', 'rope_theta': 10000.0}, "
            f"got {type(rope_parameters).__name__}"
        )
    params = dict(rope_parameters)
    rope_type = params.pop("rope_type", None) or params.pop("type", None) or "default"
    params.pop("type", None)
    if rope_type not in SCALINGS:
        raise ValueError(f"unknown rope_type {rope_type!r}; known types: {', '.join(sorted(SCALINGS))}")

    theta = params.pop("rope_theta", None)
    if theta is not None and base is not None and float(theta) != float(base):
        raise ValueError(f"base={base} disagrees with rope_parameters['rope_theta']={theta}; give one of them")
    if theta is not None:
        theta = base_value("rope_parameters['rope_theta']", theta)
    else:
        theta = base_value("base", 10000.0 if base is None else base)

    factor = params.pop("partial_rotary_factor", None)
    if factor is not None:
        if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not (0.0 < factor <= 1.0):
            raise ValueError(f"partial_rotary_factor must be in (0, 1], got {factor!r}")
        from_factor = int(head_dim * factor)
        if rotary_dim is not None and rotary_dim != from_factor:
            raise ValueError(
                f"rotary_dim={rotary_dim} disagrees with partial_rotary_factor={factor} "
                f"(which gives {from_factor} of head_dim={head_dim}); give one of them"
            )
        rotary_dim = from_factor
    if rotary_dim is None:
        rotary_dim = head_dim
    even_positive_int("rotary_dim", rotary_dim)
    if rotary_dim > head_dim:
        raise ValueError(f"rotary_dim={rotary_dim} must be <= head_dim={head_dim}")

    required = REQUIRED_KEYS.get(rope_type, frozenset())
    missing = sorted(required - params.keys())
    if missing:
        raise ValueError(f"rope_type {rope_type!r} needs the key(s) {', '.join(missing)} in rope_parameters")
    allowed = required | OPTIONAL_KEYS.get(rope_type, frozenset())
    unknown = sorted(params.keys() - allowed)
    if unknown:
        raise ValueError(
            f"rope_parameters has key(s) {', '.join(unknown)} that rope_type {rope_type!r} does not use; "
            f"it accepts {', '.join(sorted(allowed | COMMON_KEYS)) or 'none'}"
        )
    return RopeSpec(head_dim=head_dim, rotary_dim=rotary_dim, base=theta, rope_type=rope_type, params=params)


def compute_frequencies(
    spec: RopeSpec, *, max_position_embeddings: int | None = None, seq_len: int | None = None
) -> tuple[torch.Tensor, float]:
    """(inv_freq (r/2,) float64, attention_factor) for a validated spec."""
    return SCALINGS[spec.rope_type](
        rotary_dim=spec.rotary_dim,
        base=spec.base,
        seq_len=seq_len,
        max_position_embeddings=max_position_embeddings,
        **spec.params,
    )


def rope_frequencies(
    head_dim: int,
    rope_parameters: Mapping[str, Any] | None = None,
    *,
    max_position_embeddings: int | None = None,
    seq_len: int | None = None,
) -> tuple[torch.Tensor, float]:
    """Inverse frequencies and attention factor for a Hugging Face-style config.

    Returns (inv_freq, attention_factor): inv_freq is (rotary_dim // 2,) float32, computed in float64 and rounded
    once; attention_factor multiplies cos and sin (1.0 except for YaRN / LongRoPE).
    """
    spec = parse_rope_parameters(head_dim, rope_parameters)
    inv_freq, factor = compute_frequencies(spec, max_position_embeddings=max_position_embeddings, seq_len=seq_len)
    return inv_freq.to(torch.float32), float(factor)
