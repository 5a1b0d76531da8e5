"""ALiBi (Press et al., 2022): a per-head linear penalty on the query-key distance, no position embeddings."""

from __future__ import annotations

import math
from typing import Any

import torch

from posenc._checks import positive_int
from posenc.bias.base import ScoreBias


def _geometric_slopes(n: int) -> list[float]:
    # For a power of two n the slopes are 2^(-8/n), 2^(-16/n), ..., 2^(-8).
    start = 2.0 ** (-8.0 / n)
    return [start ** (i + 1) for i in range(n)]


def alibi_slopes(num_heads: int) -> torch.Tensor:
    """Per-head slopes, (h,) float32, computed in float64.

    For h not a power of two, the published rule: the slopes of the closest lower power of two p, then every other
    slope of 2p (the odd powers) for the remaining h - p heads, as in the paper's code and BLOOM.
    """
    positive_int("num_heads", num_heads)
    closest = 2 ** math.floor(math.log2(num_heads))
    slopes = _geometric_slopes(closest)
    if closest != num_heads:
        slopes += _geometric_slopes(2 * closest)[0::2][: num_heads - closest]
    return torch.tensor(slopes, dtype=torch.float64).to(torch.float32)


def alibi_bias(
    slopes: torch.Tensor, q_positions: torch.Tensor, k_positions: torch.Tensor, *, causal: bool = True
) -> torch.Tensor:
    """-slope * |m - n| for query position m and key position n.

    slopes: (h,); q_positions: (b, sq) or (sq,); k_positions: (b, sk) or (sk,). Returns (b, h, sq, sk) float32
    (b = 1 for 1-D positions). With ``causal`` the future (n > m) is -inf, so the bias alone is a full mask.
    """
    q_positions = q_positions if q_positions.dim() == 2 else q_positions[None]
    k_positions = k_positions if k_positions.dim() == 2 else k_positions[None]
    distance = (q_positions[:, :, None] - k_positions[:, None, :]).to(torch.float32)  # (b, sq, sk)
    bias = -slopes.to(torch.float32)[None, :, None, None] * distance.abs()[:, None]
    if causal:
        bias = bias.masked_fill((distance < 0)[:, None], float("-inf"))
    return bias


class ALiBi(ScoreBias):
    """num_heads: h; causal: -inf on future keys (False: symmetric -slope * |m - n|, for encoders)."""

    def __init__(self, num_heads: int, *, causal: bool = True) -> None:
        super().__init__()
        self.num_heads = positive_int("num_heads", num_heads)
        self.causal = bool(causal)
        self.register_buffer("slopes", alibi_slopes(num_heads), persistent=False)

    @classmethod
    def from_model_dims(cls, *, dim: int, num_heads: int, head_dim: int, max_positions: int, **options: Any) -> ALiBi:
        return cls(num_heads, **options)

    def score_bias(self, q_positions: torch.Tensor, k_positions: torch.Tensor) -> torch.Tensor:
        """q_positions: (b, sq), k_positions: (b, sk) integer. Returns (b, h, sq, sk) float32."""
        return alibi_bias(self.slopes, q_positions, k_positions, causal=self.causal)

    def extra_repr(self) -> str:
        return f"num_heads={self.num_heads}, causal={self.causal}"
