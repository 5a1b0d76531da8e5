"""The additive score bias of a score-bias encoding (ALiBi, T5) as a plain matrix, for tables and heatmaps."""

from __future__ import annotations

import torch
from torch import nn

from posenc._checks import positive_int
from posenc.encoding import ActsOn


def bias_matrix(encoding: nn.Module, q_len: int, k_len: int | None = None) -> torch.Tensor:
    """The bias the encoding adds to the logits, from its own ``bias(q_len, k_len, offset=...)``.

    encoding: a score-bias module (``posenc.ALiBi``, ``posenc.T5Bias``); q_len queries, k_len keys (default
    q_len). The queries are the last q_len of the k_len tokens, as in causal decoding with a cache.
    Returns (h, q_len, k_len) float64; a causal ALiBi marks future keys -inf (a causal T5 bias has values there,
    bucket 0's, which the attention's mask hides).
    """
    if getattr(encoding, "acts_on", None) is not ActsOn.SCORE_BIAS or not isinstance(encoding, nn.Module):
        acts_on = getattr(encoding, "acts_on", None)
        where = f"it acts on {acts_on.value}" if isinstance(acts_on, ActsOn) else f"got {type(encoding).__name__}"
        raise TypeError(
            f"bias_matrix needs a score-bias encoding such as posenc.ALiBi(num_heads) or posenc.T5Bias(num_heads); "
            f"{where}"
        )
    q_len = positive_int("q_len", q_len)
    k_len = q_len if k_len is None else positive_int("k_len", k_len)
    if q_len > k_len:
        raise ValueError(f"q_len={q_len} must be <= k_len={k_len}: the queries are the last q_len of the keys")
    with torch.no_grad():
        return encoding.bias(q_len, k_len, offset=k_len - q_len).to(torch.float64)
