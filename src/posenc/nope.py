"""NoPE: no positional encoding; a causal decoder still infers order from the mask (Kazemnejad et al., 2023)."""

from __future__ import annotations

from typing import Any

from torch import nn

from posenc.encoding import ActsOn


class NoPE(nn.Module):
    """Holds nothing and does nothing; present so "no encoding" goes through the same interface as the rest."""

    acts_on = ActsOn.NONE

    @classmethod
    def from_model_dims(cls, *, dim: int, num_heads: int, head_dim: int, max_positions: int, **options: Any) -> NoPE:
        """``NoPE()`` (``build_for_model``'s hook): the sizes are not read."""
        return cls(**options)
