"""What every encoding declares: where in the transformer it acts.

The reference attention and the lab's model read only this declaration, so a new family needs no special case
anywhere else:

* ``INPUT``: ``encoding(positions, dtype=...) -> (..., s, dim)`` is added to the token embeddings (computed in the
  wider of float32 and the embeddings' dtype, so that a float64 model gets float64 values).
* ``QK``: ``encoding(q, k, positions=...) -> (q, k)`` rotates queries and keys.
* ``SCORE_BIAS``: ``encoding.score_bias(q_positions, k_positions) -> (b, h, sq, sk)`` is added to the logits.
* ``NONE``: nothing; order comes from the causal mask alone.
"""

from __future__ import annotations

import enum


class ActsOn(str, enum.Enum):
    """Where an encoding puts position, which is all ``CausalSelfAttention`` reads of it: INPUT (added to the
    embeddings: ``forward(positions)``), QK (rotates queries and keys: ``forward(q, k, positions=...)``),
    SCORE_BIAS (added to the attention scores: ``score_bias(q_positions, k_positions)``), NONE (causal masking
    only)."""

    INPUT = "input"
    QK = "queries_and_keys"
    SCORE_BIAS = "score_bias"
    NONE = "nothing"
