"""Sinusoidal absolute positions (Vaswani et al., 2017): PE(p, 2i) = sin(p / base^(2i/d)), PE(p, 2i+1) = cos."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from posenc._checks import (
    assert_without_sync,
    base_value,
    even_positive_int,
    float_dtype,
    int_tensor,
    values_readable,
)
from posenc.encoding import ActsOn


def sinusoidal_table(
    positions: torch.Tensor, dim: int, *, base: float = 10000.0, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """positions: (...) integer, any size (no table limit). Returns (..., dim) in ``dtype``.

    Angles in float64, then cast: float32 angles lose the phase of the fast channels past ~1e5 positions. The
    formula itself is defined for negative positions too (sin is odd, cos even); ``Sinusoidal`` refuses them.
    """
    int_tensor("positions", positions)
    dim = even_positive_int("dim", dim)
    # The number read: a one-element tensor base (base_value takes one) computed with gave a table that required
    # grad, or that took the base's extra dims (a (1, 1) base: a (1, s, dim) table).
    base = base_value("base", base)
    float_dtype("dtype", dtype)
    return _table(positions, dim, base, dtype)


def _table(positions: torch.Tensor, dim: int, base: float, dtype: torch.dtype) -> torch.Tensor:
    # Unchecked: Sinusoidal checked dim and base once, and under torch.compile(dynamic=True) its float base is
    # symbolic, which math.isfinite cannot take.
    inv_freq = base ** (-torch.arange(0, dim, 2, dtype=torch.float64, device=positions.device) / dim)
    angles = positions.to(torch.float64)[..., None] * inv_freq  # (..., dim/2)
    return torch.stack((angles.sin(), angles.cos()), dim=-1).flatten(-2).to(dtype)


class Sinusoidal(nn.Module):
    """dim: model width d (even); base: 10000 in the paper. No parameters and no maximum position."""

    acts_on = ActsOn.INPUT

    def __init__(self, dim: int, *, base: float = 10000.0) -> None:
        super().__init__()
        self.dim = even_positive_int("dim", dim)
        self.base = base_value("base", base)

    @classmethod
    def from_model_dims(
        cls, *, dim: int, num_heads: int, head_dim: int, max_positions: int, **options: Any
    ) -> Sinusoidal:
        """``Sinusoidal(dim, **options)`` (``build_for_model``'s hook): (..., dim) encodings added to the token
        embeddings; num_heads, head_dim and max_positions are not read."""
        return cls(dim, **options)

    def forward(self, positions: torch.Tensor, *, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """positions: (...) integer >= 0. Returns (..., dim) in ``dtype`` (computed in float64, then cast)."""
        int_tensor("positions", positions, host_read=True)
        # The table would give values (sin is odd), but no token sits before position 0: as LearnedAbsolute.
        if positions.numel() and not values_readable(positions.device):
            assert_without_sync(positions >= 0, "positions must be >= 0 (token positions count from 0)")
        elif positions.numel() and bool((positions < 0).any()):
            raise ValueError(
                f"positions must be >= 0 (token positions count from 0), got {int(positions.min())}; the sinusoidal "
                "encoding has no maximum, but no negative positions either"
            )
        return _table(positions, self.dim, self.base, float_dtype("dtype", dtype))

    def extra_repr(self) -> str:
        return f"dim={self.dim}, base={self.base}"
