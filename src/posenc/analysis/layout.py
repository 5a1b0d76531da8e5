"""Which channels RoPE rotates together, read off the module itself rather than restated.

Each basis vector e_c is rotated at position 1, where pair i turns by theta_i (sin != 0), so the output of e_c is
nonzero exactly on c and its partner; the angle it turned by, modulo 2 pi, names the frequency pair.
"""

from __future__ import annotations

import dataclasses

import torch

from posenc.rope.module import RoPE


@dataclasses.dataclass(frozen=True)
class PairLayout:
    """partner: (d,) int64, the channel that rotates with channel c (-1 if c passes through unrotated);
    pair: (d,) int64, the frequency pair i of channel c (theta_i = inv_freq[i]; -1 if unrotated)."""

    partner: torch.Tensor
    pair: torch.Tensor


@torch.no_grad()
def rotary_pairs(rope: RoPE) -> PairLayout:
    """The channel pairing of ``rope`` (its layout, rotary dim and frequencies), found by rotating basis vectors."""
    if not isinstance(rope, RoPE):
        raise TypeError(f"rotary_pairs needs a posenc.RoPE, got {type(rope).__name__}")
    d = rope.head_dim
    basis = torch.eye(d, dtype=torch.float64)[None, None]  # (1, 1, d, d): token c holds e_c
    rotated, _ = rope(basis, basis, positions=torch.ones(d, dtype=torch.long))
    rotated = rotated[0, 0]  # row c: e_c turned by its pair's angle
    off_diagonal = rotated.abs().clone()
    off_diagonal.fill_diagonal_(0.0)
    # Exactly 0 off the diagonal only for a channel that does not turn (pass-through, or a pair of frequency 0): every
    # other entry is the partner's sin(theta_i), however small (a threshold like 1e-12 called the slow pairs of a
    # large base, theta below it, unrotated).
    moved = off_diagonal.amax(dim=-1) > 0
    partner = torch.where(moved, off_diagonal.argmax(dim=-1), torch.full((d,), -1))
    # The angle each rotated channel turned by, matched to the nearest frequency; zero-frequency pairs (e.g.
    # proportional RoPE's tail) do not move and count as pass-through.
    inv_freq, _ = rope.frequencies()
    # The signed angle: the lower channel of a pair is its x (e_x turns to (cos, sin)), the higher its y (e_y turns to
    # (-sin, cos)). A frequency above pi/2 (LongRoPE's factors below 1) read as |sin| against |cos| aliased onto a slow
    # pair's; compared modulo 2 pi it does not.
    index = torch.arange(d)
    towards = rotated[index, partner.clamp(min=0)] * torch.where(partner > index, 1.0, -1.0)
    angle = torch.atan2(towards, rotated.diagonal())
    gap = angle[:, None] - inv_freq[None, :]
    # Whole turns come off by rounding, not remainder(gap + pi, 2 pi): adding pi rounds tiny thetas (base 1e30) alike.
    gap = gap - 2 * torch.pi * torch.round(gap / (2 * torch.pi))
    nearest = gap.abs().argmin(dim=-1)
    pair = torch.where(moved, nearest, torch.full((d,), -1))
    return PairLayout(partner=partner, pair=pair)
