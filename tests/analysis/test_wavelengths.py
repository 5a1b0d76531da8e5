"""wavelengths: 2 pi base^(2i/d) per pair, and which pairs the by-parts scalings leave alone."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

import posenc
from posenc.analysis import wavelengths


@settings(max_examples=25, deadline=None)
@given(half=st.integers(1, 64), base=st.floats(2.0, 1e7), train_len=st.integers(1, 1 << 17))
def test_wavelength_of_pair_i(half, base, train_len):
    d = 2 * half
    result = wavelengths(d, train_len, base=base)
    expected = torch.tensor([2 * math.pi * base ** (2 * i / d) for i in range(half)], dtype=torch.float64)
    torch.testing.assert_close(result.wavelength, expected, rtol=1e-12, atol=0)
    assert torch.equal(result.partial, expected > train_len)
    torch.testing.assert_close(result.rotations, train_len / expected, rtol=1e-12, atol=0)
    assert bool(result.unchanged.all())


def test_default_64_at_2048_by_hand():
    # lambda_i > 2048 <=> 2 pi 10000^(i/32) > 2048 <=> i > 32 log(2048 / 2 pi) / log(10000) = 20.1.
    result = wavelengths(64, 2048)
    assert result.partial.nonzero().flatten().tolist() == list(range(21, 32))


@settings(max_examples=30, deadline=None)
@given(
    half=st.integers(4, 64),
    base=st.floats(100.0, 1e6),
    train_len=st.integers(256, 1 << 15),
    beta_fast=st.floats(2.0, 32.0),
    factor=st.floats(1.5, 32.0),
    truncate=st.booleans(),
)
def test_yarn_leaves_alone_exactly_the_pairs_shorter_than_l_over_beta_fast(
    half, base, train_len, beta_fast, factor, truncate
):
    params = {"rope_type": "yarn", "rope_theta": base, "factor": factor, "beta_fast": beta_fast, "truncate": truncate}
    result = wavelengths(2 * half, train_len, rope_parameters=params)
    threshold = train_len / beta_fast
    # Exactly at the threshold the ramp is 0 as well (<=, not <): keep to the generic case.
    assume(not bool(torch.isclose(result.base_wavelength, torch.tensor(threshold, dtype=torch.float64)).any()))
    assert torch.equal(result.unchanged, result.base_wavelength < threshold)


def test_llama3_leaves_alone_the_pairs_shorter_than_l_over_high_freq_factor():
    params = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0}
    result = wavelengths(128, 8192, base=500000.0, rope_parameters=params)
    assert torch.equal(result.unchanged, result.base_wavelength < 8192 / 4.0)
    far = result.base_wavelength > 8192
    torch.testing.assert_close(result.inv_freq[far], result.base_inv_freq[far] / 8.0, rtol=1e-15, atol=0)


def test_unchanged_means_exactly_unchanged():
    # A factor a hair above 1 moves every frequency a little: none is left as plain RoPE has it.
    result = wavelengths(16, 64, rope_parameters={"rope_type": "linear", "factor": 1.0001})
    assert not bool(result.unchanged.any())
    assert bool(wavelengths(16, 64, rope_parameters={"rope_type": "linear", "factor": 1.0}).unchanged.all())


@pytest.mark.parametrize(
    "params",
    [
        {"rope_type": "yarn", "factor": 1.0},
        {"rope_type": "llama3", "factor": 1.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0},
    ],
    ids=["yarn", "llama3"],
)
def test_factor_one_leaves_every_pair_unchanged(params):
    """Their blends of theta / 1 and theta land an ulp off theta for some pairs, which figure 5 drew uncircled."""
    result = wavelengths(64, 2048, rope_parameters=params)
    assert bool(result.unchanged.all())
    assert not bool(wavelengths(64, 2048, rope_parameters={**params, "factor": 1.0 + 1e-12}).unchanged.all())


def test_bad_input_is_a_clear_error():
    with pytest.raises(ValueError, match="train_len must be a positive integer"):
        wavelengths(64, 0)
    with pytest.raises(ValueError, match="unknown rope_type 'nope'"):
        wavelengths(64, 2048, rope_parameters={"rope_type": "nope"})
    with pytest.raises(ValueError, match="needs the key"):
        wavelengths(64, 2048, rope_parameters={"rope_type": "linear"})
    # A model config's max_position_embeddings (the extended length) beside YaRN's original: the counts against L
    # were taken at the wrong length, with only a warning about the factor.
    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 2048}
    with pytest.raises(ValueError, match=r"train_len=8192 but .* original_max_position_embeddings=2048: .* pass "):
        wavelengths(64, 8192, rope_parameters=yarn)
    assert wavelengths(64, 2048, rope_parameters=yarn).train_len == 2048


@pytest.mark.parametrize("rope_parameters", ["linear", [("rope_type", "linear")]])
def test_rope_parameters_that_are_not_a_dict_are_named(rope_parameters):
    # A string failed with "AttributeError: 'str' object has no attribute 'get'".
    with pytest.raises(TypeError, match="rope_parameters must be a dict"):
        wavelengths(8, 64, rope_parameters=rope_parameters)


def test_an_original_length_above_train_len_is_refused_too():
    # The counts against L are wrong whichever way round the two lengths differ, not only when train_len is larger.
    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8192}
    with pytest.raises(ValueError, match=r"train_len=2048 but .* original_max_position_embeddings=8192: .* pass "):
        wavelengths(64, 2048, rope_parameters=yarn)


def test_a_length_dependent_type_takes_the_seq_len_it_is_given():
    # Dynamic NTK is plain RoPE up to train_len and scaled past it: seq_len must reach the frequencies.
    params = {"rope_type": "dynamic", "factor": 4.0}
    assert bool(wavelengths(64, 2048, rope_parameters=params).unchanged.all())
    past = wavelengths(64, 2048, rope_parameters=params, seq_len=8192)
    expected = posenc.RoPE(64, rope_parameters=params, max_position_embeddings=2048).frequencies(8192)[0]
    torch.testing.assert_close(past.inv_freq, expected, rtol=0, atol=0)
    assert not bool(past.unchanged[1:].any())  # pair 0 turns at 1 rad per position whatever the base


def test_a_pair_that_turns_exactly_once_within_l_is_not_partial():
    # Linear scaling by L / (2 pi) stretches pair 0 (theta = 1) to a wavelength of exactly L: one full turn.
    result = wavelengths(2, 64, rope_parameters={"rope_type": "linear", "factor": 64 / (2 * math.pi)})
    assert result.wavelength.tolist() == [64.0] and result.rotations.tolist() == [1.0]
    assert result.partial.tolist() == [False]
