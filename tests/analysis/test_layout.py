"""rotary_pairs: the pairing read off the RoPE module matches both documented layouts."""

from __future__ import annotations

import pytest

import posenc
from posenc.analysis import rotary_pairs


@pytest.mark.parametrize(("head_dim", "rotary_dim"), [(8, 8), (12, 8), (64, 64), (2, 2)])
def test_layouts(head_dim, rotary_dim):
    half = rotary_dim // 2
    adjacent = rotary_pairs(posenc.RoPE(head_dim, rotary_dim=rotary_dim, interleaved=True))
    split = rotary_pairs(posenc.RoPE(head_dim, rotary_dim=rotary_dim, interleaved=False))
    passthrough = [-1] * (head_dim - rotary_dim)
    assert adjacent.partner.tolist() == [c ^ 1 for c in range(rotary_dim)] + passthrough
    assert adjacent.pair.tolist() == [c // 2 for c in range(rotary_dim)] + passthrough
    assert split.partner.tolist() == [(c + half) % rotary_dim for c in range(rotary_dim)] + passthrough
    assert split.pair.tolist() == [c % half for c in range(rotary_dim)] + passthrough


@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("base", [1e14, 1e30])
def test_the_slow_pairs_of_a_large_base_still_rotate(base, interleaved):
    """sin(theta_i) of the slowest pairs lies far below 1e-12 here; they turn all the same, and the layout says so
    (a 1e-12 threshold called them pass-through channels, which figure 2 drew grey)."""
    layout = rotary_pairs(posenc.RoPE(16, base=base, interleaved=interleaved))
    partner = [c ^ 1 for c in range(16)] if interleaved else [(c + 8) % 16 for c in range(16)]
    pair = [c // 2 for c in range(16)] if interleaved else [c % 8 for c in range(16)]
    assert layout.partner.tolist() == partner
    assert layout.pair.tolist() == pair


@pytest.mark.parametrize("interleaved", [False, True])
def test_a_frequency_above_half_pi_names_its_own_pair(interleaved):
    """A LongRoPE short factor of 0.3 turns pair 0 by 3.33 rad per position: |sin| against |cos| read it as 0.19 rad,
    pair 1's 0.1 being nearest, and the layout (and the phase figure's channels) named the wrong pair."""
    params = {
        "rope_type": "longrope",
        "short_factor": [0.3, 1.0, 1.0, 1.0],
        "long_factor": [1.0] * 4,
        "factor": 2.0,
        "original_max_position_embeddings": 64,
    }
    layout = rotary_pairs(posenc.RoPE(8, rope_parameters=params, max_position_embeddings=128, interleaved=interleaved))
    assert layout.pair.tolist() == ([c // 2 for c in range(8)] if interleaved else [c % 4 for c in range(8)])


def test_zero_frequency_pairs_pass_through():
    rope = posenc.RoPE(16, rope_parameters={"rope_type": "proportional", "partial_rotary_factor": 0.5})
    layout = rotary_pairs(rope)
    # Pairs 0..3 turn; pairs 4..7 (channels 4..7 and 12..15) have frequency 0.
    assert layout.pair.tolist() == [0, 1, 2, 3, -1, -1, -1, -1, 0, 1, 2, 3, -1, -1, -1, -1]


def test_needs_a_rope():
    with pytest.raises(TypeError, match=r"needs a posenc\.RoPE"):
        rotary_pairs(posenc.ALiBi(2))
