"""Relative invariance: is the score of a fixed query and key a function of m - n alone?

For RoPE, <R_m q, R_n k> = <q, R_(n-m) k>, so every diagonal m - n = const of the score matrix is constant. An
absolute encoding adds p_m to q and p_n to k; the cross terms <q, p_n> + <p_m, k> depend on m and n separately.
The scores here go through the encoding's own code path (its rotation, its table, its bias), not a re-derivation.
"""

from __future__ import annotations

import dataclasses
import math

import torch
from torch import nn

from posenc._checks import integer, positive_int
from posenc.encoding import ActsOn


@dataclasses.dataclass(frozen=True)
class InvarianceResult:
    """scores: (L, L) float64, scores[m, n] for the query at position m and the key at n (no causal mask);
    offsets: (2L - 1,) int64, m - n from -(L - 1) to L - 1; spread: (2L - 1,) float64, max - min of the scores
    along the diagonal m - n = offsets[j]."""

    scores: torch.Tensor
    offsets: torch.Tensor
    spread: torch.Tensor

    @property
    def max_spread(self) -> float:
        """The largest spread over all diagonals: ~0 for a relative encoding."""
        return float(self.spread.max())


def _encoding_dim(encoding: nn.Module, head_dim: int | None) -> int:
    acts_on = getattr(encoding, "acts_on", None)
    own = getattr(encoding, "head_dim", None) if acts_on is ActsOn.QK else getattr(encoding, "dim", None)
    if acts_on in (ActsOn.QK, ActsOn.INPUT) and own is not None:
        if head_dim is not None and head_dim != own:
            raise ValueError(f"head_dim={head_dim} disagrees with the encoding's width {own}; leave head_dim out")
        return own
    if head_dim is None:
        raise ValueError(f"head_dim is needed for an encoding that acts on {acts_on.value}: pass head_dim=64")
    return positive_int("head_dim", head_dim)


@torch.no_grad()
def relative_invariance(
    encoding: nn.Module, length: int = 64, *, head_dim: int | None = None, head: int = 0, seed: int = 0
) -> InvarianceResult:
    """Scores of one fixed pair of random vectors q, k (norm sqrt(d/2)) placed at every (m, n) in [0, length)^2.

    encoding: any posenc encoding module. Its ``acts_on`` decides the path: QK encodings rotate q and k
    (``encoding(q, k, positions=...)``); INPUT encodings add ``encoding(positions)`` to both; SCORE_BIAS encodings
    add ``score_bias`` of head ``head``; NONE adds nothing. The score is q.k / sqrt(d), as in attention.
    head_dim: d, needed only where the encoding has no width of its own (score biases, NoPE). seed: q and k's.
    Computed in float64 wherever the encoding allows it (RoPE's cos/sin tables may be float32).
    """
    length = positive_int("length", length)
    acts_on = getattr(encoding, "acts_on", None)
    if not isinstance(encoding, nn.Module) or not isinstance(acts_on, ActsOn):
        raise TypeError(
            f"encoding must be a posenc encoding module (e.g. posenc.RoPE(64)), got {type(encoding).__name__}"
        )
    d = _encoding_dim(encoding, head_dim)
    # torch's "manual_seed expected a long" (1.5, True) or "Overflow when unpacking long long" named no argument.
    seed = integer("seed", seed, low=-(2**63), high=2**64, type_error=TypeError)  # what manual_seed takes
    generator = torch.Generator().manual_seed(seed)
    q, k = torch.randn(2, d, generator=generator, dtype=torch.float64)
    # Norm sqrt(d/2), the norm of a sinusoidal position vector: content and position weigh the same.
    q, k = q * math.sqrt(d / 2) / q.norm(), k * math.sqrt(d / 2) / k.norm()
    positions = torch.arange(length)

    bias = None
    if acts_on is ActsOn.QK:
        rotated_q, rotated_k = encoding(
            q.expand(1, 1, length, d), k.expand(1, 1, length, d), positions=positions
        )  # (1, 1, L, d) each: q and k at every position
        qs, ks = rotated_q[0, 0].double(), rotated_k[0, 0].double()
    elif acts_on is ActsOn.INPUT:
        limit = getattr(encoding, "max_positions", None)
        if isinstance(limit, int) and length > limit:
            # The table's own error named position length - 1 and said to build a larger table, though the caller
            # gave no positions, only a length (64 by default).
            raise ValueError(
                f"length={length} places q and k at positions up to {length - 1}, past the rows of "
                f"{type(encoding).__name__}'s table (max_positions={limit}); pass length <= {limit}"
            )
        table = encoding(positions, dtype=torch.float64)  # (L, d)
        qs, ks = q + table, k + table
    else:
        qs, ks = q.expand(length, d), k.expand(length, d)
        if acts_on is ActsOn.SCORE_BIAS:
            num_heads = getattr(encoding, "num_heads", 1)
            head = integer("head", head, low=0, high=num_heads, expected=f"an int in [0, {num_heads})")
            bias = encoding.score_bias(positions[None], positions[None])[0, head].double()  # (L, L)
    scores = qs @ ks.T / math.sqrt(d)
    if bias is not None:
        # A bias that masks with -inf (none of posenc's score biases does) is compared only where it is finite.
        scores = scores + bias

    offsets = torch.arange(-(length - 1), length)
    spread = torch.empty(offsets.shape, dtype=torch.float64)
    for j, offset in enumerate(offsets.tolist()):
        # torch.diagonal(offset=o) walks the entries (i, i + o): key position minus query position is o.
        diagonal = scores.diagonal(offset=-offset)
        finite = diagonal[torch.isfinite(diagonal)]
        spread[j] = (finite.max() - finite.min()) if finite.numel() else 0.0
    return InvarianceResult(scores=scores, offsets=offsets, spread=spread)
