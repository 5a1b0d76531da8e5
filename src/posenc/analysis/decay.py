"""RoFormer's long-term decay bound (Su et al., 2021, section 3.4.3), for any base, head dim and scaling type.

Write the score of RoPE as Re[sum_i h_i e^{i (m - n) theta_i}] with h_i = q_[2i:2i+2] k*_[2i:2i+2]. Abel summation
with S_j = sum_{k<j} e^{i (m - n) theta_k} gives

    |sum_i h_i e^{i (m - n) theta_i}| <= (max_i |h_{i+1} - h_i|) * sum_{j=1}^{r/2} |S_j|,

and (1 / (r/2)) sum_j |S_j| decays as |m - n| grows: that is the curve drawn here. The frequencies come from the
real ``RoPE`` module (so every scaling type is covered); cos and sin are multiplied by the type's attention
factor on both q and k, so the score and the bound carry attention_factor squared.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from collections.abc import Mapping
from typing import Any

import torch

from posenc._checks import float_tensor, int_tensor, positive_int
from posenc.rope.module import RoPE


@dataclasses.dataclass(frozen=True)
class DecayResult:
    """distances: (n,) int64 relative distances m - n >= 0; bound: (n,) float64, the mean of |S_j| over the r/2
    pairs times attention_factor**2; inv_freq: (r/2,) float64 used; attention_factor: the type's factor."""

    distances: torch.Tensor
    bound: torch.Tensor
    inv_freq: torch.Tensor
    attention_factor: float


def decay_bound(distances: torch.Tensor, inv_freq: torch.Tensor, attention_factor: float = 1.0) -> torch.Tensor:
    """distances: (n,) integer; inv_freq: (r/2,) float, moved to distances' device. Returns (n,) float64:
    attention_factor^2 * mean_j |sum_{k<j} e^{i d theta_k}|."""
    int_tensor("distances", distances)
    if distances.dim() != 1:
        raise ValueError(f"distances must be 1-D (n,), got shape {tuple(distances.shape)}")
    float_tensor("inv_freq", inv_freq)
    # An empty inv_freq gave a bound of NaN (the mean over no pairs) at every distance.
    if inv_freq.dim() != 1 or inv_freq.numel() == 0:
        raise ValueError(
            f"inv_freq must be a non-empty 1-D tensor (r/2,), one frequency per pair, got shape "
            f"{tuple(inv_freq.shape)}; RoPE.frequencies()[0] gives one"
        )
    if isinstance(attention_factor, bool) or not isinstance(attention_factor, numbers.Real):
        raise TypeError(f"attention_factor must be a real number, got {type(attention_factor).__name__}")
    if not math.isfinite(attention_factor):
        raise ValueError(f"attention_factor must be finite, got {attention_factor}")
    inv_freq = inv_freq.to(device=distances.device, dtype=torch.float64)
    angles = distances.to(torch.float64)[:, None] * inv_freq[None, :]  # (n, r/2)
    partial_sums = torch.polar(torch.ones_like(angles), angles).cumsum(dim=-1)  # S_1 .. S_{r/2}
    return partial_sums.abs().mean(dim=-1) * attention_factor**2


def long_term_decay(
    head_dim: int,
    *,
    base: float | None = None,
    rope_parameters: Mapping[str, Any] | None = None,
    max_distance: int = 256,
    distances: torch.Tensor | None = None,
    max_position_embeddings: int | None = None,
    seq_len: int | None = None,
) -> DecayResult:
    """The decay bound against relative distance for one RoPE configuration.

    head_dim: d; base / rope_parameters: as for ``posenc.RoPE`` (any scaling type in ``SCALINGS``);
    distances: (n,) integer distances, default 0..max_distance; max_position_embeddings: the training length,
    needed by the length-dependent types; seq_len: the length those types scale for (default: the largest
    distance + 1, the shortest sequence that holds it).
    """
    if distances is None:
        distances = torch.arange(positive_int("max_distance", max_distance) + 1)
    else:
        int_tensor("distances", distances)
        if distances.dim() != 1 or distances.numel() == 0 or bool((distances < 0).any()):
            raise ValueError(f"distances must be a non-empty 1-D tensor of values >= 0, got {tuple(distances.shape)}")
    rope = RoPE(head_dim, base=base, rope_parameters=rope_parameters, max_position_embeddings=max_position_embeddings)
    if seq_len is None:
        seq_len = int(distances.max()) + 1
    inv_freq, factor = rope.frequencies(positive_int("seq_len", seq_len))
    return DecayResult(
        distances=distances.to(torch.long),
        bound=decay_bound(distances, inv_freq, factor),
        inv_freq=inv_freq,
        attention_factor=float(factor),
    )
