"""ALiBi and T5 biases as FlexAttention ``score_mod`` functions: attention without a (b, h, s, t) float mask.

The materialized path (``posenc.attention.attend``) builds the bias and a mask of s * t floats per head; at
s = t = 8192 and 8 heads that is 2 GiB before attention starts. ``score_mod`` computes each bias entry inside
the compiled attention kernel instead. Where it is used (``use_flex``):

* CUDA: always for ALiBi and T5 when FlexAttention imports (forward and backward, including the T5 table's
  gradient);
* CPU: inference only (PyTorch has no CPU backward for FlexAttention) and only for long sequences, where the
  mask's memory matters more than the one-time compile (about 20 s per shape on 2 cores); see
  docs/benchmarks.md for the measured peak memory.

Shape key: b batch, h query heads, s queries, t keys, d head dim.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
from torch import nn

from posenc.bias import ALiBi, T5Bias, t5_relative_bucket

# Below this many scores per head the materialized mask is small (64 MiB in float32) and not worth a compile.
CPU_MIN_SCORES = 4096 * 4096

ScoreMod = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


@functools.cache
def _flex() -> tuple[Callable | None, Callable | None]:
    try:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    except ImportError:
        return None, None
    # Compiled once per process; FlexAttention only saves memory when compiled (eager is the reference math).
    return torch.compile(flex_attention, dynamic=False), create_block_mask


def flex_available() -> bool:
    return _flex()[0] is not None


def _per_batch(positions: torch.Tensor) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """positions: (b or 1, n). Returns index(b, i) -> position, broadcasting a batch of 1."""
    if positions.shape[0] == 1:
        row = positions[0]
        return lambda b, i: row[i]
    return lambda b, i: positions[b, i]


def alibi_score_mod(slopes: torch.Tensor, q_positions: torch.Tensor, k_positions: torch.Tensor) -> ScoreMod:
    """score - slope_h * |m - n|; slopes (h,), q_positions (b or 1, s), k_positions (b or 1, t). The causal -inf
    comes from the block mask, as in the materialized path it comes from the ``allowed`` mask."""
    q_at, k_at = _per_batch(q_positions), _per_batch(k_positions)
    slopes = slopes.float()

    def score_mod(score, b, h, q_idx, kv_idx):
        return score - slopes[h] * (q_at(b, q_idx) - k_at(b, kv_idx)).abs().float()

    return score_mod


def t5_score_mod(encoding: T5Bias, q_positions: torch.Tensor, k_positions: torch.Tensor) -> ScoreMod:
    """score + table[bucket(n - m), h], the bucket computed by ``t5_relative_bucket`` (Hugging Face's)."""
    q_at, k_at = _per_batch(q_positions), _per_batch(k_positions)
    weight = encoding.table.weight

    def score_mod(score, b, h, q_idx, kv_idx):
        bucket = t5_relative_bucket(
            k_at(b, kv_idx) - q_at(b, q_idx),
            bidirectional=encoding.bidirectional,
            num_buckets=encoding.num_buckets,
            max_distance=encoding.max_distance,
        )
        return score + weight[bucket, h].float()

    return score_mod


def score_mod_for(encoding: nn.Module, q_positions: torch.Tensor, k_positions: torch.Tensor) -> ScoreMod | None:
    """The score_mod of a known bias encoding, or None (then the caller materializes the bias)."""
    if isinstance(encoding, ALiBi):
        return alibi_score_mod(encoding.slopes, q_positions, k_positions)
    if isinstance(encoding, T5Bias):
        return t5_score_mod(encoding, q_positions, k_positions)
    return None


def use_flex(encoding: nn.Module, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, need_probs: bool) -> bool:
    """Whether ``attend_flex`` should replace the materialized bias for this call (see the module docstring)."""
    # Cheap checks first: flex_available() imports dynamo, which costs seconds on a process's first call.
    if need_probs or not isinstance(encoding, (ALiBi, T5Bias)):
        return False
    if q.device.type == "cuda":
        return flex_available()
    if q.device.type != "cpu":
        return False
    needs_grad = torch.is_grad_enabled() and (
        any(t.requires_grad for t in (q, k, v)) or any(p.requires_grad for p in encoding.parameters())
    )
    return not needs_grad and q.shape[2] * k.shape[2] >= CPU_MIN_SCORES and flex_available()


def attend_flex(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    encoding: nn.Module,
    q_positions: torch.Tensor,
    k_positions: torch.Tensor,
) -> torch.Tensor:
    """Causal attention with the encoding's bias as a score_mod. q: (b, h, s, d); k, v: (b, h, t, d) (heads
    already repeated for GQA); positions (b or 1, s) and (b or 1, t). The last s of t keys are the queries.

    Computed in float32 for bf16/fp16 inputs, as the materialized path does. Returns (b, h, s, d) in q's dtype.
    """
    flex, create_block_mask = _flex()
    if flex is None:
        raise RuntimeError("FlexAttention is unavailable in this PyTorch; use posenc.attention.attend")
    score_mod = score_mod_for(encoding, q_positions, k_positions)
    if score_mod is None:
        raise ValueError(f"no score_mod for {type(encoding).__name__}; only ALiBi and T5Bias have one")
    s, t = q.shape[2], k.shape[2]
    past = t - s

    def causal(b, h, q_idx, kv_idx):
        return kv_idx <= q_idx + past

    block_mask = create_block_mask(causal, None, None, s, t, device=q.device)
    dtype = torch.promote_types(q.dtype, torch.float32)
    out = flex(q.to(dtype), k.to(dtype), v.to(dtype), score_mod=score_mod, block_mask=block_mask)
    return out.to(q.dtype)
