"""frequency_table: every registered scaling type side by side, computed by RoPE itself."""

from __future__ import annotations

import math

import pytest
import torch

import posenc
from posenc.analysis import EXAMPLE_ROPE_PARAMETERS, example_rope_parameters, frequency_table
from posenc.rope import frequencies as rope_frequencies_module
from posenc.rope.frequencies import SCALINGS, default_inv_freq


def test_covers_every_registered_type():
    table = frequency_table(64, train_len=1024, factor=4.0)
    assert table.rope_types == tuple(SCALINGS)
    assert table.inv_freq.shape == (len(SCALINGS), 32)
    assert table.seq_len == 4096
    for name, params, row, factor in zip(
        table.rope_types, table.parameters, table.inv_freq, table.attention_factor, strict=True
    ):
        # Each row is what a RoPE built with that type's parameters uses at seq_len.
        rope = posenc.RoPE(64, rope_parameters={"rope_type": name, **params}, max_position_embeddings=1024)
        expected, expected_factor = rope.frequencies(4096)
        assert torch.equal(row, expected), name
        assert factor.item() == expected_factor


def test_rows_by_hand():
    table = frequency_table(32, base=500.0, train_len=256, factor=8.0)
    plain = default_inv_freq(32, 500.0)
    row = dict(zip(table.rope_types, table.inv_freq, strict=True))
    assert torch.equal(row["default"], plain)
    torch.testing.assert_close(row["linear"], plain / 8.0, rtol=1e-15, atol=0)
    # Static NTK keeps the fastest pair and divides the slowest by exactly the factor.
    assert row["ntk"][0] == plain[0]
    assert row["ntk"][-1].item() == pytest.approx(plain[-1].item() / 8.0, rel=1e-12)
    ratio = table.ratio_to_default()
    assert torch.equal(ratio[table.rope_types.index("default")], torch.ones(16, dtype=torch.float64))


def test_rows_give_each_pairs_wavelength_in_positions():
    table = frequency_table(16, base=100.0, train_len=64, factor=4.0)
    rows = table.to_rows()
    assert rows and all(row["wavelength"] == 2 * math.pi / row["inv_freq"] for row in rows if row["inv_freq"])
    default = [row for row in rows if row["rope_type"] == "default"]
    assert [row["pair"] for row in default] == list(range(8))
    assert default[1]["wavelength"] == pytest.approx(2 * math.pi * 100.0 ** (2 / 16), rel=1e-12)


def test_longrope_example_ramps_from_kept_to_fully_interpolated():
    example = example_rope_parameters("longrope", rotary_dim=16, train_len=64, factor=4.0)
    assert example["short_factor"] == [1.0] * 8
    assert example["long_factor"][0] == 1.0 and example["long_factor"][-1] == 4.0
    # Past the original length the long factors apply: the fastest pair kept, the slowest divided by the factor.
    table = frequency_table(16, train_len=64, factor=4.0, rope_types=["default", "longrope"])
    ratio = table.ratio_to_default()[1]
    assert ratio[0] == 1.0 and ratio[-1].item() == pytest.approx(1 / 4.0, rel=1e-12)


def test_every_type_has_an_example_that_validates():
    assert set(SCALINGS) <= set(EXAMPLE_ROPE_PARAMETERS)
    for name in SCALINGS:
        params = example_rope_parameters(name, rotary_dim=64, train_len=2048)
        posenc.RoPE(64, rope_parameters={"rope_type": name, **params}, max_position_embeddings=2048)


def test_user_parameters_replace_the_example():
    yarn = {"factor": 8.0, "beta_fast": 16.0, "original_max_position_embeddings": 512}
    table = frequency_table(64, train_len=512, rope_types=["default", "yarn"], parameters={"yarn": yarn})
    assert table.rope_types == ("default", "yarn") and table.parameters[1] == yarn
    rope = posenc.RoPE(64, rope_parameters={"rope_type": "yarn", **yarn}, max_position_embeddings=512)
    assert torch.equal(table.inv_freq[1], rope.frequencies()[0])


def test_partial_rotation_pads_with_nan():
    # A type given its own partial rotation has fewer pairs than the others: NaN past them.
    table = frequency_table(64, train_len=512, parameters={"linear": {"factor": 2.0, "partial_rotary_factor": 0.5}})
    row = dict(zip(table.rope_types, table.inv_freq, strict=True))
    assert table.inv_freq.shape[1] == 32
    assert bool(row["linear"][16:].isnan().all()) and not bool(row["linear"][:16].isnan().any())
    assert bool((row["proportional"][8:] == 0).all()) and bool((row["proportional"][:8] > 0).all())
    rows = table.to_rows()
    assert len([r for r in rows if r["rope_type"] == "linear"]) == 16
    assert {"rope_type", "pair", "inv_freq", "wavelength", "attention_factor"} == set(rows[0])


def test_a_common_partial_rotation_leaves_proportional_out():
    """partial_rotary_factor is a fraction of channels for every type but 'proportional', where it is the fraction
    of the whole head's pairs that turn: that row would hold other frequencies, so it is left out (or refused)."""
    table = frequency_table(64, partial_rotary_factor=0.5, train_len=512)
    assert "proportional" not in table.rope_types and table.inv_freq.shape[1] == 16
    assert not bool(table.inv_freq.isnan().any())
    linear = table.ratio_to_default()[table.rope_types.index("linear")]
    torch.testing.assert_close(linear, torch.full((16,), 0.25, dtype=torch.float64))
    with pytest.raises(ValueError, match="'proportional' turns pairs of the whole head"):
        frequency_table(64, partial_rotary_factor=0.5, rope_types=["default", "proportional"])


def test_a_new_type_without_an_example_is_named(monkeypatch):
    monkeypatch.setitem(rope_frequencies_module.SCALINGS, "brand_new", rope_frequencies_module.default)
    with pytest.raises(ValueError, match="'brand_new' is registered in SCALINGS but has no example parameters"):
        frequency_table(64)


def test_bad_input_is_a_clear_error():
    with pytest.raises(ValueError, match="factor must be a number >= 1"):
        frequency_table(64, factor=0.5)
    with pytest.raises(ValueError, match="unknown rope_type 'warp'"):
        frequency_table(64, rope_types=["default", "warp"])
    with pytest.raises(ValueError, match="parameters names unknown rope_type"):
        frequency_table(64, parameters={"warp": {}})
    with pytest.raises(ValueError, match="rope_types is empty"):
        frequency_table(64, rope_types=[])
    with pytest.raises(ValueError, match="names a different rope_type"):
        frequency_table(64, parameters={"linear": {"rope_type": "ntk", "factor": 2.0}})
    with pytest.raises(ValueError, match="needs the key"):
        frequency_table(64, parameters={"linear": {}})


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        # A string was read as its letters ("unknown rope_type 'l'"); the others failed in dict() with "dictionary
        # update sequence element #0 ...", naming no argument.
        ({"rope_types": "linear"}, r"rope_types must be a list of type names, e.g. \['linear'\]"),
        ({"parameters": "linear"}, "parameters must map a rope_type to its rope_parameters"),
        ({"parameters": {"linear": "factor"}}, "parameters must map a rope_type to its rope_parameters"),
        ({"parameters": {"linear": None}}, "parameters must map a rope_type to its rope_parameters"),
    ],
)
def test_arguments_of_the_wrong_kind_are_named(kwargs, match):
    with pytest.raises(TypeError, match=match):
        frequency_table(8, **kwargs)


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"factor": 0}, ValueError, "factor must be a number >= 1"),
        ({"factor": float("nan")}, ValueError, "factor must be a number >= 1"),
        ({"factor": "2"}, ValueError, "factor must be a number >= 1"),
        ({"rotary_dim": 0}, ValueError, "rotary_dim must be a positive integer"),
        ({"rotary_dim": 7}, ValueError, "rotary_dim must be even"),
        ({"train_len": 0}, ValueError, "train_len must be a positive integer"),
    ],
)
def test_example_rope_parameters_refuses_bad_arguments(kwargs, error, match):
    """They were handed back unchecked ({'factor': 0}), as parameters no RoPE accepts."""
    given = {"rotary_dim": 8, "train_len": 64, "factor": 4.0, **kwargs}
    with pytest.raises(error, match=match):
        example_rope_parameters("linear", **given)


def test_factor_one_is_every_types_identity():
    # An extension ratio of 1 extends nothing: every type keeps plain RoPE's frequencies.
    table = frequency_table(16, train_len=64, factor=1.0, rope_types=["default", "linear", "ntk", "yarn", "llama3"])
    assert table.seq_len == 64
    torch.testing.assert_close(table.ratio_to_default(), torch.ones(5, 8, dtype=torch.float64), rtol=1e-15, atol=0)


def test_a_head_of_one_pair_leaves_out_the_types_that_need_two():
    from posenc.rope.parameters import NEEDS_FOUR_CHANNELS

    table = frequency_table(2, train_len=64)
    assert "default" in table.rope_types and not set(table.rope_types) & set(NEEDS_FOUR_CHANNELS)


@pytest.mark.parametrize("head_dim", [2, 4])
def test_proportional_turns_at_least_one_pair_of_a_small_head(head_dim):
    table = frequency_table(head_dim, train_len=64, rope_types=["default", "proportional"])
    assert table.inv_freq[1, 0] == table.inv_freq[0, 0] > 0


def test_the_default_seq_len_is_the_extended_context_to_the_nearest_token():
    assert frequency_table(8, train_len=3, factor=1.25, rope_types=["default"]).seq_len == 4  # 3.75 tokens
