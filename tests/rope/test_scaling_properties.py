"""Properties every scaling type must have, for any head dim, base and factor (hypothesis), plus snapshots."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from posenc import rope_frequencies
from posenc.rope.frequencies import SCALINGS, SEQ_LEN_DEPENDENT, default_inv_freq
from posenc.rope.parameters import compute_frequencies, parse_rope_parameters

SNAPSHOTS = Path(__file__).parents[1] / "fixtures" / "rope_snapshots.json"

rotary_dims = st.integers(2, 128).map(lambda n: 2 * n)  # 4..256, even
bases = st.sampled_from([100.0, 10000.0, 500000.0, 1e6])
factors = st.floats(1.0, 64.0)
lengths = st.integers(16, 1 << 17)


def freqs(rotary_dim: int, params: dict, *, max_pos: int | None = None, seq_len: int | None = None) -> torch.Tensor:
    spec = parse_rope_parameters(rotary_dim, params, max_position_embeddings=max_pos)
    return compute_frequencies(spec, seq_len=seq_len)[0]


@settings(max_examples=40, deadline=None)
@given(rotary_dims, bases, factors)
def test_linear_is_default_over_factor(r: int, base: float, factor: float) -> None:
    inv = freqs(r, {"rope_type": "linear", "factor": factor, "rope_theta": base})
    torch.testing.assert_close(inv, default_inv_freq(r, base) / factor, rtol=1e-15, atol=0.0)


def test_default_inv_freq_takes_a_tensor_base_differentiably() -> None:
    """A 0-d tensor base gives the float base's bits, its gradient d/db sum(b^(-2i/r)) = sum(-2i/r * b^(-2i/r - 1)),
    and vmap over bases: from 2026-12-06 the base went through torch.scalar_tensor, which reads a tensor with .item()
    and refused one that requires grad (TypeError) and any under torch.func's vmap or grad."""
    base = torch.tensor(5e5, dtype=torch.float64, requires_grad=True)
    inv = default_inv_freq(16, base)
    assert torch.equal(inv.detach(), default_inv_freq(16, 5e5))
    (grad,) = torch.autograd.grad(inv.sum(), base)
    exponents = torch.arange(0, 16, 2, dtype=torch.float64) / 16
    torch.testing.assert_close(grad, (-exponents * 5e5 ** (-exponents - 1)).sum(), rtol=1e-12, atol=0.0)
    assert torch.equal(torch.func.grad(lambda b: default_inv_freq(16, b).sum())(base.detach()), grad)
    several = torch.tensor([1e4, 5e5, 1e6], dtype=torch.float64)
    assert torch.equal(
        torch.func.vmap(lambda b: default_inv_freq(16, b))(several),
        torch.stack([default_inv_freq(16, float(b)) for b in several]),
    )


@settings(max_examples=40, deadline=None)
@given(rotary_dims.filter(lambda r: r >= 4), bases, factors, lengths, st.integers(1, 1 << 17))
def test_dynamic_is_default_up_to_max_length(r: int, base: float, factor: float, max_pos: int, seq_len: int) -> None:
    params = {"rope_type": "dynamic", "factor": factor, "rope_theta": base}
    inv = freqs(r, params, max_pos=max_pos, seq_len=seq_len)
    plain = default_inv_freq(r, base)
    if seq_len <= max_pos:
        torch.testing.assert_close(inv, plain, rtol=1e-14, atol=0.0)
    else:  # past the max: every frequency but the first is lowered, and more for longer sequences
        assert inv[0] == plain[0] and bool((inv[1:] <= plain[1:]).all())
        longer = freqs(r, params, max_pos=max_pos, seq_len=2 * seq_len)
        assert bool((longer[1:] <= inv[1:]).all())


@settings(max_examples=40, deadline=None)
@given(rotary_dims, bases, factors, lengths, st.booleans())
def test_yarn_lies_between_interpolation_and_extrapolation(
    r: int, base: float, factor: float, original: int, truncate: bool
) -> None:
    params = {"rope_type": "yarn", "factor": factor, "rope_theta": base, "truncate": truncate}
    inv = freqs(r, {**params, "original_max_position_embeddings": original})
    plain = default_inv_freq(r, base)
    assert bool((inv <= plain * (1 + 1e-15)).all()) and bool((inv >= plain / factor * (1 - 1e-15)).all())
    # monotone blend: the fraction interpolated never decreases towards the low frequencies
    # (the fraction is 0/0-conditioned as factor -> 1: with factor = 1 + 2e-16 it is rounding noise)
    if factor > 1.0 + 1e-6:
        interpolated = (plain - inv) / (plain - plain / factor)
        assert bool((interpolated.diff() >= -1e-12).all())


@settings(max_examples=40, deadline=None)
@given(rotary_dims, bases, factors, st.sampled_from([(1.0, 4.0), (2.0, 8.0), (0.5, 1.5)]), lengths)
def test_llama3_keeps_high_and_divides_low_frequencies(
    r: int, base: float, factor: float, bands: tuple[float, float], original: int
) -> None:
    low, high = bands
    params = {"rope_type": "llama3", "factor": factor, "low_freq_factor": low, "high_freq_factor": high}
    inv = freqs(r, {**params, "rope_theta": base, "original_max_position_embeddings": original})
    plain = default_inv_freq(r, base)
    wavelen = 2 * math.pi / plain
    short, long = wavelen < original / high, wavelen > original / low
    torch.testing.assert_close(inv[short], plain[short], rtol=0.0, atol=0.0)
    torch.testing.assert_close(inv[long], plain[long] / factor, rtol=1e-15, atol=0.0)
    middle = ~short & ~long
    slack = 1e-15  # the smooth blend rounds twice
    assert bool((inv[middle] <= plain[middle] * (1 + slack)).all())
    assert bool((inv[middle] >= plain[middle] / factor * (1 - slack)).all())


@pytest.mark.parametrize("factor", [2.0, 8.0])
def test_llama3_is_continuous_at_both_band_edges(factor: float) -> None:
    """A pair whose wavelength is exactly an edge of the band (pair 0's, 2 pi, with the edge put there) gets the
    value both sides of that edge agree on: divided by factor at original / low_freq_factor, kept at original /
    high_freq_factor. The band includes its edges, as transformers' does; outside it the low edge kept the pair."""
    original = 8
    edge = original / (2 * math.pi)
    assert original / edge == 2 * math.pi  # exactly pair 0's wavelength in float64
    common = {"rope_type": "llama3", "factor": factor, "rope_theta": 1e4, "original_max_position_embeddings": original}
    at_low = freqs(8, {**common, "low_freq_factor": edge, "high_freq_factor": 4.0})
    at_high = freqs(8, {**common, "low_freq_factor": 0.5, "high_freq_factor": edge})
    assert at_low[0].item() == 1.0 / factor
    assert at_high[0].item() == 1.0


@pytest.mark.parametrize("factor", [2.0, 8.0])
def test_llama3_with_equal_factors_divides_the_pair_at_the_step(factor: float) -> None:
    """Equal factors (Llama 4's) are a step with no band: a pair whose wavelength is exactly the step's is divided
    by factor, as at the low edge of a band, where transformers' 0 / 0 weight gives NaN; the pairs past it are too."""
    original = 8
    edge = original / (2 * math.pi)
    params = {"rope_type": "llama3", "factor": factor, "rope_theta": 1e4, "original_max_position_embeddings": original}
    inv = freqs(8, {**params, "low_freq_factor": edge, "high_freq_factor": edge})
    assert inv.tolist() == (default_inv_freq(8, 1e4) / factor).tolist()


@settings(max_examples=40, deadline=None)
@given(rotary_dims.filter(lambda r: r >= 4), bases, factors)
def test_ntk_keeps_highest_and_divides_lowest_by_factor(r: int, base: float, factor: float) -> None:
    inv = freqs(r, {"rope_type": "ntk", "factor": factor, "rope_theta": base})
    plain = default_inv_freq(r, base)
    assert inv[0] == plain[0] == 1.0
    torch.testing.assert_close(inv[-1], plain[-1] / factor, rtol=1e-12, atol=0.0)
    assert bool((inv <= plain * (1 + 1e-15)).all()) and bool((inv >= plain / factor * (1 - 1e-12)).all())


def test_ntk_equals_dynamic_where_its_scale_reaches_factor() -> None:
    # dynamic's scale is factor * L / max - (factor - 1); it equals factor at L = max * (2 - 1 / factor) = 896
    ntk = freqs(64, {"rope_type": "ntk", "factor": 4.0})
    dyn = freqs(64, {"rope_type": "dynamic", "factor": 4.0}, max_pos=512, seq_len=896)
    torch.testing.assert_close(ntk, dyn, rtol=1e-14, atol=0.0)


def test_longrope_switches_to_long_factors_past_the_original_length() -> None:
    params = {"rope_type": "longrope", "short_factor": [1.0] * 8, "long_factor": [2.0] * 8}
    spec = parse_rope_parameters(16, params, max_position_embeddings=4096)  # original falls back to 4096
    plain = default_inv_freq(16, 10000.0)
    for seq_len, expected in ((None, plain), (4096, plain), (4097, plain / 2)):
        torch.testing.assert_close(compute_frequencies(spec, seq_len=seq_len)[0], expected, rtol=1e-15, atol=0.0)


def test_proportional_zeroes_the_tail_pairs() -> None:
    inv = freqs(64, {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1e6})
    assert inv.shape == (32,) and bool((inv[8:] == 0).all())
    # the rotated pairs keep the full head's exponents (over 64, not over 16)
    torch.testing.assert_close(inv[:8], default_inv_freq(64, 1e6)[:8], rtol=0.0, atol=0.0)


def test_proportional_without_a_fraction_turns_every_pair() -> None:
    # partial_rotary_factor defaults to 1: every pair turns, at plain RoPE's frequencies.
    inv = freqs(64, {"rope_type": "proportional", "rope_theta": 1e6})
    torch.testing.assert_close(inv, default_inv_freq(64, 1e6), rtol=0.0, atol=0.0)


def test_yarns_own_defaults_are_the_ones_the_parser_fills_in() -> None:
    # SCALINGS["yarn"] is callable without the parser: its beta_fast / beta_slow defaults must be the parser's (32, 1).
    spec = parse_rope_parameters(64, {"rope_type": "yarn", "factor": 8.0}, max_position_embeddings=8192)
    bare = SCALINGS["yarn"](rotary_dim=64, base=spec.base, factor=8.0, original_max_position_embeddings=8192)
    parsed = compute_frequencies(spec)
    assert torch.equal(bare[0], parsed[0]) and bare[1] == parsed[1]


def test_seq_len_dependent_types_are_the_ones_that_read_seq_len() -> None:
    params = {
        "dynamic": {"factor": 4.0},
        "longrope": {"short_factor": [1.0] * 8, "long_factor": [3.0] * 8},
    }
    for rope_type in SCALINGS:
        extra = params.get(rope_type, {"factor": 2.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0})
        if rope_type in ("default", "proportional"):
            extra = {}
        elif rope_type != "llama3" and rope_type not in params:
            extra = {"factor": 2.0}
        spec = parse_rope_parameters(16, {"rope_type": rope_type, **extra}, max_position_embeddings=64)
        changes = not torch.equal(compute_frequencies(spec, seq_len=10)[0], compute_frequencies(spec, seq_len=1000)[0])
        assert changes == (rope_type in SEQ_LEN_DEPENDENT), rope_type


def _snapshot_cases() -> list[dict]:
    return json.loads(SNAPSHOTS.read_text())["cases"]


@pytest.mark.parametrize("case", _snapshot_cases(), ids=lambda c: c["name"])
def test_whole_vector_snapshots(case: dict) -> None:
    """Regenerate with `python scripts/regen_rope_snapshots.py` (it records transformers' vectors beside ours)."""
    inv, factor = rope_frequencies(
        case["head_dim"],
        case["rope_parameters"],
        max_position_embeddings=case["max_position_embeddings"],
        seq_len=case["seq_len"],
    )
    expected = torch.tensor(case["inv_freq"], dtype=torch.float64)
    torch.testing.assert_close(inv.double(), expected.float().double(), rtol=0.0, atol=0.0)
    assert abs(factor - case["attention_factor"]) <= 1e-12
    # transformers' float32 vector, recorded by the script, stays within float32 rounding of ours
    torch.testing.assert_close(
        torch.tensor(case["transformers_inv_freq"], dtype=torch.float64), expected, rtol=2e-6, atol=0.0
    )
