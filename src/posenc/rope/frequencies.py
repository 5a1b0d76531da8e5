"""RoPE frequencies: the base inverse frequencies and one pure function per scaling type.

Every function here works in float64 and returns ``(inv_freq, attention_factor)`` with ``inv_freq`` of shape
(r/2,), where r is the rotary dim. Positions times these frequencies give the rotation angles; keeping them in
float64 until the cos/sin table is built is what makes position 2**20 as exact as position 20.

A scaling type is one function plus one line in ``SCALINGS``. Kernels never change for it: they consume cos/sin.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

ScalingFn = Callable[..., tuple[torch.Tensor, float]]


def default_inv_freq(rotary_dim: int, base: float) -> torch.Tensor:
    """theta_i = base^(-2i/r) for i in [0, r/2). Returns (r/2,) float64."""
    return 1.0 / base ** (torch.arange(0, rotary_dim, 2, dtype=torch.float64) / rotary_dim)


def default(*, rotary_dim: int, base: float, **_: object) -> tuple[torch.Tensor, float]:
    """Plain RoPE (Su et al., 2021)."""
    return default_inv_freq(rotary_dim, base), 1.0


# name -> function(*, rotary_dim, base, seq_len, max_position_embeddings, **type_parameters)
SCALINGS: dict[str, ScalingFn] = {
    "default": default,
}

# Types whose frequencies change with the current sequence length (they cannot be tabulated once).
SEQ_LEN_DEPENDENT: frozenset[str] = frozenset()
