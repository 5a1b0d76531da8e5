"""Rotary position embedding: frequencies (and their scaling types), the rotation, and the module."""

from posenc.rope.apply import apply_rotary
from posenc.rope.module import RoPE
from posenc.rope.parameters import RopeSpec, parse_rope_parameters, rope_frequencies

__all__ = ["RoPE", "RopeSpec", "apply_rotary", "parse_rope_parameters", "rope_frequencies"]
