"""long_term_decay: RoFormer's bound, checked against cases worked by hand."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import posenc
from posenc.analysis import decay_bound, long_term_decay


@settings(max_examples=20, deadline=None)
@given(half=st.integers(1, 64), base=st.floats(10.0, 1e6))
def test_distance_zero_is_the_mean_of_1_to_half(half, base):
    # At distance 0 every e^{i 0} = 1, so |S_j| = j and the mean over j = 1..r/2 is (r/2 + 1) / 2.
    result = long_term_decay(2 * half, base=base, max_distance=3)
    assert result.bound[0].item() == pytest.approx((half + 1) / 2, rel=1e-12)


def test_two_pairs_by_hand():
    # r = 4: theta = (1, base^-1/2); |S_1| = |e^{i d}| = 1 and |S_2| = |e^{i d} + e^{i d theta_1}|
    # = 2 |cos(d (1 - theta_1) / 2)|.
    base = 100.0
    result = long_term_decay(4, base=base, max_distance=50)
    theta_1 = base**-0.5
    expected = [(1 + 2 * abs(math.cos(d * (1 - theta_1) / 2))) / 2 for d in range(51)]
    torch.testing.assert_close(result.bound, torch.tensor(expected, dtype=torch.float64), rtol=1e-12, atol=1e-12)
    # One pair: |S_1| = 1 at every distance.
    assert torch.equal(long_term_decay(2, max_distance=9).bound, torch.ones(10, dtype=torch.float64))


def test_the_bound_decays():
    # RoFormer Fig. 2 (d = 128, base 10000): the average falls from 32.5 towards a few units by distance 250.
    bound = long_term_decay(128, max_distance=250).bound
    assert bound[0] == pytest.approx(32.5)
    assert bound[200:].max() < bound[0] / 3


def test_scaling_types_use_their_frequencies_and_attention_factor():
    params = {"rope_type": "yarn", "factor": 4.0}
    result = long_term_decay(64, rope_parameters=params, max_distance=10, max_position_embeddings=512)
    assert result.attention_factor == pytest.approx(0.1 * math.log(4.0) + 1)
    assert result.bound[0].item() == pytest.approx(result.attention_factor**2 * 16.5)
    torch.testing.assert_close(result.bound, decay_bound(result.distances, result.inv_freq, result.attention_factor))
    linear = long_term_decay(64, rope_parameters={"rope_type": "linear", "factor": 2.0}, max_distance=80)
    plain = long_term_decay(64, max_distance=40)
    # Linear interpolation by 2 at distance 2j is plain RoPE at distance j.
    torch.testing.assert_close(linear.bound[::2], plain.bound, rtol=1e-12, atol=1e-12)


def test_a_length_dependent_type_scales_for_the_shortest_sequence_that_holds_the_distances():
    """Distances 0..256 need 257 positions: dynamic NTK past a trained length of 256 scales for 257, not 256."""
    params = {"rope_type": "dynamic", "factor": 2.0}
    result = long_term_decay(64, rope_parameters=params, max_position_embeddings=256, max_distance=256)
    rope = posenc.RoPE(64, rope_parameters=params, max_position_embeddings=256)
    torch.testing.assert_close(result.inv_freq, rope.frequencies(257)[0])
    assert not torch.equal(result.inv_freq, rope.frequencies(256)[0])


def test_bad_input_is_a_clear_error():
    with pytest.raises(ValueError, match="distances must be a non-empty 1-D tensor"):
        long_term_decay(64, distances=torch.tensor([-1, 2]))
    with pytest.raises(TypeError, match="integer positions"):
        long_term_decay(64, distances=torch.tensor([1.0]))
    with pytest.raises(ValueError, match="max_distance must be a positive integer"):
        long_term_decay(64, max_distance=0)
    with pytest.raises(ValueError, match="needs max_position_embeddings"):
        long_term_decay(64, rope_parameters={"rope_type": "dynamic", "factor": 2.0})


@pytest.mark.parametrize(
    ("distances", "inv_freq", "factor", "error", "match"),
    [
        # An empty inv_freq gave NaN at every distance without a word; the others failed deep inside torch.
        (torch.arange(4), torch.ones(0, dtype=torch.float64), 1.0, ValueError, "inv_freq must be a non-empty 1-D"),
        (torch.arange(4), torch.ones(2, 2), 1.0, ValueError, "inv_freq must be a non-empty 1-D"),
        (torch.arange(4), [1.0, 0.1], 1.0, TypeError, "inv_freq must be a torch.Tensor"),
        (torch.arange(4), torch.arange(2), 1.0, TypeError, "inv_freq must be a floating-point tensor"),
        (torch.arange(6).view(2, 3), torch.ones(2), 1.0, ValueError, r"distances must be 1-D \(n,\)"),
        (torch.arange(4), torch.ones(2), float("nan"), ValueError, "attention_factor must be finite"),
        (torch.arange(4), torch.ones(2), "1.0", TypeError, "attention_factor must be a real number"),
    ],
)
def test_decay_bound_refuses_what_it_cannot_average(distances, inv_freq, factor, error, match):
    with pytest.raises(error, match=match):
        decay_bound(distances, inv_freq, factor)


def test_decay_bound_takes_a_float32_inv_freq_and_a_numpy_factor():
    numpy = pytest.importorskip("numpy")
    inv_freq = posenc.rope_frequencies(8)[0]  # float32
    bound = decay_bound(torch.arange(3), inv_freq, numpy.float64(1.5))
    torch.testing.assert_close(bound, decay_bound(torch.arange(3), inv_freq.double(), 1.5))
