"""relative_invariance: RoPE and the score biases are functions of m - n only; absolute encodings are not."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import posenc
from posenc.analysis import relative_invariance
from posenc.encoding import ActsOn


def test_rope_spread_is_zero_and_sinusoidal_is_large():
    rope = relative_invariance(posenc.RoPE(64), 64)
    sinusoidal = relative_invariance(posenc.Sinusoidal(64), 64)
    assert rope.max_spread < 1e-5
    # The cross terms <q, p_n> + <p_m, k> have the size of |q| |p| / sqrt(d) = 0.5: far from zero.
    assert sinusoidal.max_spread > 0.1
    assert rope.scores.shape == (64, 64) and rope.offsets.tolist() == list(range(-63, 64))


@pytest.mark.parametrize("encoding", [posenc.Sinusoidal(16), posenc.LearnedAbsolute(9, 16)])
def test_each_spread_is_the_range_of_its_own_diagonal(encoding):
    """For an absolute encoding the spread differs from one side of the diagonal to the other (m - n = 1 is not
    m - n = -1), so each offsets[j] must be matched with its own entries, found here by brute force."""
    result = relative_invariance(encoding, 9)
    for offset, spread in zip(result.offsets.tolist(), result.spread.tolist(), strict=True):
        entries = [float(result.scores[m, n]) for m in range(9) for n in range(9) if m - n == offset]
        assert spread == pytest.approx(max(entries) - min(entries), abs=1e-12), offset
    assert result.spread[result.offsets == 1] != pytest.approx(float(result.spread[result.offsets == -1]))


def test_scores_are_the_rotated_dot_products():
    # Hand-derived for d = 2: q, k rotate by m and n radians (theta_0 = 1), so the score is |q||k| cos(angle).
    result = relative_invariance(posenc.RoPE(2), 5, seed=3)
    q, k = torch.randn(2, 2, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    q, k = q / q.norm(), k / k.norm()  # norm sqrt(d/2) = 1
    angle_q, angle_k = math.atan2(q[1], q[0]), math.atan2(k[1], k[0])
    for m in range(5):
        for n in range(5):
            expected = math.cos(angle_q + m - angle_k - n) / math.sqrt(2)
            assert result.scores[m, n].item() == pytest.approx(expected, abs=1e-6)


@settings(max_examples=20, deadline=None)
@given(
    half=st.integers(2, 48),  # ntk's exponent r / (r - 2) needs r >= 4
    base=st.floats(2.0, 1e6),
    interleaved=st.booleans(),
    rope_type=st.sampled_from(["default", "linear", "ntk", "yarn"]),
)
def test_rope_is_relative_for_any_config(half, base, interleaved, rope_type):
    params = {"rope_type": rope_type, "rope_theta": base}
    if rope_type != "default":
        params["factor"] = 4.0
    rope = posenc.RoPE(2 * half, interleaved=interleaved, rope_parameters=params, max_position_embeddings=64)
    assert relative_invariance(rope, 48).max_spread < 1e-5


@pytest.mark.parametrize("encoding", [posenc.ALiBi(4), posenc.T5Bias(4), posenc.NoPE()], ids=["alibi", "t5", "nope"])
def test_relative_biases_and_nope_have_no_spread(encoding):
    result = relative_invariance(encoding, 40, head_dim=16, head=0)
    assert result.max_spread < 1e-12


def test_learned_absolute_is_not_relative():
    assert relative_invariance(posenc.LearnedAbsolute(64, 32), 64).max_spread > 1e-3


def test_bad_input_is_a_clear_error():
    with pytest.raises(TypeError, match="posenc encoding module"):
        relative_invariance(torch.nn.Linear(2, 2))
    with pytest.raises(ValueError, match="head_dim is needed"):
        relative_invariance(posenc.ALiBi(4))
    with pytest.raises(ValueError, match="head must be an int in"):
        relative_invariance(posenc.ALiBi(4), head_dim=8, head=4)
    with pytest.raises(ValueError, match="disagrees with the encoding's width 64"):
        relative_invariance(posenc.RoPE(64), head_dim=32)
    with pytest.raises(ValueError, match="length must be a positive integer"):
        relative_invariance(posenc.RoPE(64), 0)


def test_a_length_past_a_learned_table_names_length_not_a_position():
    # The default length 64 against an 8-row table: the table's error said position 63 was outside it and to build
    # a larger table, naming a position the caller never gave.
    with pytest.raises(ValueError, match=r"length=64 .*\(max_positions=8\); pass length <= 8"):
        relative_invariance(posenc.LearnedAbsolute(8, 8))
    assert relative_invariance(posenc.LearnedAbsolute(8, 8), 8).scores.shape == (8, 8)


class _PaddingBias(torch.nn.Module):
    """A relative score bias that masks the first two keys (left padding) with -inf, as a user's bias may."""

    acts_on = ActsOn.SCORE_BIAS
    num_heads = 1

    def score_bias(self, q_positions: torch.Tensor, k_positions: torch.Tensor) -> torch.Tensor:
        distance = (k_positions[:, None, :] - q_positions[:, :, None]).double()  # (b, q, k)
        padded = (k_positions < 2)[:, None, :].expand_as(distance)
        return torch.where(padded, -math.inf, 0.1 * distance)[:, None]  # (b, 1, q, k)


def test_a_bias_masking_with_minus_infinity_is_compared_where_finite():
    # A diagonal crosses the masked keys and the unmasked ones: its spread is the range of its finite scores (0 for
    # a relative bias), not max - (-inf) = inf.
    result = relative_invariance(_PaddingBias(), 12, head_dim=8)
    assert bool(torch.isinf(result.scores[:, :2]).all()) and bool(torch.isfinite(result.scores[:, 2:]).all())
    assert result.max_spread < 1e-12


def test_the_score_bias_added_is_the_one_of_the_head_asked_for():
    # ALiBi's slopes for 4 heads are 2^-2, 2^-4, 2^-6, 2^-8: head h's scores are head 0's plus (2^-2 - slope_h)|m - n|.
    first = relative_invariance(posenc.ALiBi(4), 6, head_dim=8, head=0)
    distance = (torch.arange(6)[:, None] - torch.arange(6)[None, :]).abs().double()
    for head, slope in enumerate([2**-2, 2**-4, 2**-6, 2**-8]):
        scores = relative_invariance(posenc.ALiBi(4), 6, head_dim=8, head=head).scores
        torch.testing.assert_close(scores - first.scores, (2**-2 - slope) * distance, rtol=0, atol=1e-12)


def test_sinusoidal_scores_are_content_plus_position_dot_products():
    # (q + p_m) . (k + p_n) / sqrt(d), with the paper's PE(p, 2i) = sin(p / 10000^(2i/d)), PE(p, 2i+1) = cos: the
    # same position table on both sides (a spread computed from the wrong scores is still their own diagonals' range).
    d, length = 8, 5
    result = relative_invariance(posenc.Sinusoidal(d), length, seed=2)
    q, k = torch.randn(2, d, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    q, k = q * math.sqrt(d / 2) / q.norm(), k * math.sqrt(d / 2) / k.norm()
    pe = torch.zeros(length, d, dtype=torch.float64)
    for p in range(length):
        for i in range(d // 2):
            pe[p, 2 * i] = math.sin(p / 10000 ** (2 * i / d))
            pe[p, 2 * i + 1] = math.cos(p / 10000 ** (2 * i / d))
    torch.testing.assert_close(result.scores, (q + pe) @ (k + pe).T / math.sqrt(d), rtol=0, atol=1e-12)


@pytest.mark.parametrize(
    ("seed", "error"), [(1.5, TypeError), (True, TypeError), (2**70, ValueError), (-(2**63) - 1, ValueError)]
)
def test_a_bad_seed_is_named(seed, error):
    """torch's "manual_seed expected a long" and "Overflow when unpacking long long" named no argument."""
    with pytest.raises(error, match=r"^seed must be an integer in \[-9223372036854775808, 18446744073709551616\)"):
        relative_invariance(posenc.RoPE(8), 4, seed=seed)
    for taken in (2**64 - 1, -1, -(2**63)):  # what torch's manual_seed takes
        assert relative_invariance(posenc.RoPE(8), 4, seed=taken) is not None
