"""Every bad rope_parameters raises (transformers only warns), naming the key and the valid range."""

from __future__ import annotations

import re

import pytest
import torch

from posenc import RoPE, rope_frequencies
from posenc.rope import frequencies
from posenc.rope.frequencies import SCALINGS
from posenc.rope.parameters import OPTIONAL_KEYS, REQUIRED_KEYS, compute_frequencies, parse_rope_parameters

LONG = {"rope_type": "longrope", "short_factor": [1.0] * 8, "long_factor": [2.0] * 8}


@pytest.mark.parametrize(
    ("params", "error", "match"),
    [
        (
            {"rope_type": "su_per"},
            ValueError,
            "unknown rope_type 'su_per'; known types: ",  # every one: test_unknown_type_lists_every_known_type
        ),
        ({"type": "nope"}, ValueError, "known types:"),
        ({"rope_type": "linear"}, ValueError, "needs the key(s) factor"),
        ({"rope_type": "llama3", "factor": 8.0}, ValueError, "needs the key(s) high_freq_factor, low_freq_factor"),
        ({"rope_type": "longrope", "short_factor": [1.0] * 8}, ValueError, "needs the key(s) long_factor"),
        ({"rope_type": "linear", "factor": None}, ValueError, "rope_parameters['factor'] is None"),
        ({"rope_type": "linear", "factor": 0.5}, ValueError, "rope_parameters['factor'] must be >= 1.0, got 0.5"),
        ({"rope_type": "ntk", "factor": 0.99}, ValueError, "rope_parameters['factor'] must be >= 1.0"),
        ({"rope_type": "dynamic", "factor": -2}, ValueError, "rope_parameters['factor'] must be >= 1.0"),
        ({"rope_type": "yarn", "factor": 0.25}, ValueError, "rope_parameters['factor'] must be >= 1.0"),
        ({"rope_type": "linear", "factor": "4"}, TypeError, "rope_parameters['factor'] must be a finite real"),
        ({"rope_type": "linear", "factor": True}, TypeError, "rope_parameters['factor'] must be a finite real"),
        ({"rope_type": "yarn", "factor": 4.0, "beta_fast": 1, "beta_slow": 2}, ValueError, "beta_fast'] must be >="),
        ({"rope_type": "yarn", "factor": 4.0, "beta_fast": 0.5}, ValueError, "beta_fast=0.5 and beta_slow=1.0"),
        ({"rope_type": "yarn", "factor": 4.0, "beta_slow": 0}, ValueError, "rope_parameters['beta_slow'] must be > 0"),
        # transformers reads a 0 beta as its default; the error says how to get that.
        ({"rope_type": "yarn", "factor": 4.0, "beta_fast": 0}, ValueError, "default 32: leave the key out"),
        ({"rope_type": "yarn", "factor": 4.0, "beta_slow": 0}, ValueError, "default 1: leave the key out"),
        # A zero saved as a tensor, which _real reads as a number, likewise (the hint was left off).
        ({"rope_type": "yarn", "factor": 4.0, "beta_fast": torch.tensor(0.0)}, ValueError, "default 32: leave the key"),
        ({"rope_type": "yarn", "factor": 4.0, "truncate": 1}, TypeError, "rope_parameters['truncate'] must be True"),
        ({"rope_type": "yarn", "factor": 4.0, "attention_factor": 0}, ValueError, "attention_factor'] must be > 0"),
        ({"rope_type": "yarn", "factor": 4.0, "mscale": -1.0}, ValueError, "rope_parameters['mscale'] must be >= 0"),
        (
            {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 4.0, "high_freq_factor": 2.0},
            ValueError,
            "rope_parameters['low_freq_factor'] must be <= rope_parameters['high_freq_factor']",
        ),
        (  # inverted by a little: a check that allowed some slack took it as a step at the low wavelength
            {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.2, "high_freq_factor": 1.0},
            ValueError,
            "got low_freq_factor=1.2 and high_freq_factor=1.0",
        ),
        ({**LONG, "short_factor": [1.0] * 7}, ValueError, "short_factor'] must hold rotary_dim / 2 = 8 factors"),
        ({**LONG, "long_factor": [1.0] * 16}, ValueError, "factors (one per rotated pair), got 16"),
        ({**LONG, "long_factor": [1.0] * 7 + [0.0]}, ValueError, "every entry of long_factor must be > 0"),
        ({**LONG, "short_factor": [1.0] * 7 + [-1.0]}, ValueError, "every entry of short_factor must be > 0"),
        ({**LONG, "long_factor": [2.0] * 7 + [0.0]}, ValueError, "rope_parameters['long_factor'][7] must be > 0"),
        ({**LONG, "long_factor": [2.0] * 7 + ["2"]}, TypeError, "['long_factor'][7] must be a finite real number"),
        ({**LONG, "short_factor": "1.0"}, TypeError, "short_factor'] must be a list of 8 positive numbers"),
        ({"partial_rotary_factor": 0.0}, ValueError, "partial_rotary_factor must be in (0, 1]"),
        ({"partial_rotary_factor": 1.5}, ValueError, "partial_rotary_factor must be in (0, 1]"),
        (  # an odd rotary dim is named as the factor's, which the caller gave, not as a rotary_dim to change
            {"partial_rotary_factor": 0.4375},
            ValueError,
            "partial_rotary_factor=0.4375 of head_dim=16 gives rotary_dim=int(16 * 0.4375) = 7, but channels rotate",
        ),
        ({"rope_type": "proportional", "partial_rotary_factor": -0.5}, ValueError, "must be in (0, 1]"),
        (
            {"rope_type": "linear", "factor": 2.0, "beta_fast": 3},
            ValueError,
            "key(s) beta_fast that rope_type 'linear'",
        ),
        ({"rope_theta": 1.0}, ValueError, "rope_theta'] must be a finite number > 1"),
    ],
)
def test_bad_parameters_raise_with_the_key_and_the_range(params: dict, error: type, match: str) -> None:
    with pytest.raises(error, match=re.escape(match)):
        RoPE(16, rope_parameters=params, max_position_embeddings=64)
    with pytest.raises(error, match=re.escape(match)):
        rope_frequencies(16, params, max_position_embeddings=64)


def test_unknown_type_lists_every_known_type() -> None:
    with pytest.raises(ValueError) as info:
        RoPE(16, rope_parameters={"rope_type": "magic"})
    for name in SCALINGS:
        assert name in str(info.value)


def test_every_registered_type_has_its_key_lines() -> None:
    assert set(REQUIRED_KEYS) == set(OPTIONAL_KEYS) == set(SCALINGS)


def test_a_type_registered_without_its_keys_is_named(monkeypatch) -> None:
    """A type added to SCALINGS alone (the function and its registry line) raised a bare KeyError: 'brand_new'."""
    monkeypatch.setitem(frequencies.SCALINGS, "brand_new", frequencies.default)
    with pytest.raises(ValueError, match=r"'brand_new' is registered in SCALINGS .* REQUIRED_KEYS and OPTIONAL_KEYS"):
        RoPE(16, rope_parameters={"rope_type": "brand_new"})
    for given, other in ((REQUIRED_KEYS, OPTIONAL_KEYS), (OPTIONAL_KEYS, REQUIRED_KEYS)):  # a line in one of them only
        with monkeypatch.context() as line:
            line.setitem(given, "brand_new", frozenset())
            assert "brand_new" not in other
            with pytest.raises(ValueError, match=r"'brand_new' is registered in SCALINGS .* both REQUIRED_KEYS"):
                RoPE(16, rope_parameters={"rope_type": "brand_new"})


@pytest.mark.parametrize("bad", [[("rope_type", "linear")], "linear", 4.0])
def test_non_dict_rope_parameters_is_a_type_error(bad: object) -> None:
    with pytest.raises(TypeError, match=r"rope_parameters must be a dict like \{'rope_type'"):
        RoPE(16, rope_parameters=bad)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("params", "match"),
    [
        ({"rope_type": "dynamic", "factor": 2.0}, "rope_type 'dynamic' needs max_position_embeddings"),
        ({"rope_type": "yarn", "factor": 2.0}, "give rope_parameters['original_max_position_embeddings'] or max_pos"),
        ({**LONG, "factor": 4.0}, "['original_max_position_embeddings'] or max_position_embeddings"),
        ({"rope_type": "llama3", "factor": 8, "low_freq_factor": 1, "high_freq_factor": 4}, "needs the trained length"),
        ({"rope_type": "yarn", "factor": None, "original_max_position_embeddings": 64}, "give a factor >= 1"),
        ({**LONG, "original_max_position_embeddings": 64}, "needs rope_parameters['factor'] >= 1"),
    ],
)
def test_length_dependent_types_need_the_trained_length(params: dict, match: str) -> None:
    with pytest.raises(ValueError, match=re.escape(match)):
        RoPE(16, rope_parameters=params)


def test_implicit_factor_below_one_raises() -> None:
    params = {"rope_type": "yarn", "factor": None, "original_max_position_embeddings": 128}
    with pytest.raises(ValueError, match=re.escape("64 / 128 = 0.5 < 1; give a factor >= 1")):
        RoPE(16, rope_parameters=params, max_position_embeddings=64)


def test_original_length_must_be_a_positive_int() -> None:
    params = {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 10.5}
    with pytest.raises(ValueError, match=re.escape("original_max_position_embeddings'] must be a positive integer")):
        RoPE(16, rope_parameters=params)


@pytest.mark.parametrize("rope_type", ["yarn", "llama3", "longrope"])
def test_an_original_length_written_as_a_whole_float_is_that_length(rope_type: str, hf_oracle) -> None:
    """transformers computes with 2048.0 as with 2048 (llama3 warns, yarn and longrope do not): the same numbers."""
    params = {"rope_type": rope_type, "factor": 4.0}
    if rope_type == "longrope":
        params |= {"short_factor": [1.0] * 8, "long_factor": [2.0] * 8}
    if rope_type == "llama3":
        params |= {"low_freq_factor": 1.0, "high_freq_factor": 4.0}
    as_float = {**params, "original_max_position_embeddings": 32.0, "rope_theta": 10000.0}
    spec = parse_rope_parameters(16, as_float, max_position_embeddings=128)
    assert spec == parse_rope_parameters(
        16, {**as_float, "original_max_position_embeddings": 32}, max_position_embeddings=128
    )
    for seq_len in (16, 128):
        inv, factor = compute_frequencies(spec, seq_len=seq_len)
        hf_inv, hf_factor = hf_oracle.frequencies(16, as_float, 128, seq_len=seq_len)
        torch.testing.assert_close(inv, hf_inv.double(), rtol=hf_oracle.inv_freq_rtol(10000.0), atol=0.0)
        assert abs(factor - float(hf_factor)) <= 1e-9


@pytest.mark.parametrize("rope_type", ["ntk", "dynamic"])
def test_ntk_types_need_four_rotary_channels(rope_type: str) -> None:
    with pytest.raises(ValueError, match=re.escape("needs rotary_dim >= 4 (its exponent is r/(r-2)), got 2")):
        RoPE(2, rope_parameters={"rope_type": rope_type, "factor": 2.0}, max_position_embeddings=8)


def test_proportional_rotates_every_channel() -> None:
    with pytest.raises(ValueError, match="rotates all head_dim=16 channels; drop rotary_dim"):
        RoPE(16, rotary_dim=8, rope_parameters={"rope_type": "proportional"})


def test_bad_mode_and_max_length() -> None:
    with pytest.raises(ValueError, match="mode must be 'hf'"):
        RoPE(16, mode="stateless")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="max_position_embeddings must be a positive integer"):
        RoPE(16, max_position_embeddings=0)


def test_legacy_type_key_and_nulls_are_accepted() -> None:
    legacy = RoPE(16, rope_parameters={"type": "linear", "factor": 2.0, "attention_factor": None})
    assert legacy.rope_type == "linear"


def test_factor_lists_may_be_tensors_or_numpy() -> None:
    """Factors read from a checkpoint or computed with numpy give the frequencies the Python list gives."""
    import numpy as np

    expected = RoPE(16, rope_parameters={**LONG, "original_max_position_embeddings": 8, "factor": 4.0}).frequencies(64)
    for convert in (torch.tensor, np.array, lambda v: list(np.array(v, dtype=np.float32))):
        params = {**LONG, "short_factor": convert(LONG["short_factor"]), "long_factor": convert(LONG["long_factor"])}
        got = RoPE(16, rope_parameters={**params, "original_max_position_embeddings": 8, "factor": 4.0}).frequencies(64)
        assert torch.equal(got[0], expected[0]) and got[1] == expected[1]


def test_rotary_fraction_gives_back_every_even_rotary_dim() -> None:
    """rotary_dim / head_dim lands an ulp low for 2256 of these pairs (30 / 44 * 44 = 29.999...), and the parser's
    int() then sized an odd rotation; the fraction that interop and the figures write must size it exactly."""
    from posenc.rope.parameters import rotary_fraction

    for head_dim in range(2, 513):
        for rotary_dim in range(2, head_dim + 1, 2):
            fraction = rotary_fraction(rotary_dim, head_dim)
            assert int(head_dim * fraction) == rotary_dim, (rotary_dim, head_dim)
            if fraction != rotary_dim / head_dim:  # the pairs the plain quotient sized wrong
                assert RoPE(head_dim, rope_parameters={"partial_rotary_factor": fraction}).rotary_dim == rotary_dim
