"""Rotary position embedding: frequencies (and their scaling types), the rotation, and the module."""

from posenc.rope.apply import apply_rotary, apply_rotary_, apply_rotary_qk
from posenc.rope.module import RoPE
from posenc.rope.mrope import MRoPE
from posenc.rope.parameters import RopeSpec, parse_rope_parameters, rope_frequencies
from posenc.rope.scaling import register_scaling

__all__ = [
    "MRoPE",
    "RoPE",
    "RopeSpec",
    "apply_rotary",
    "apply_rotary_",
    "apply_rotary_qk",
    "parse_rope_parameters",
    "register_scaling",
    "rope_frequencies",
]
