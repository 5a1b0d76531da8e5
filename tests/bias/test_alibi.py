from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import posenc
from posenc.testing import alibi_bias_reference, alibi_slopes_reference


@pytest.mark.parametrize("num_heads", [1, 2, 3, 5, 6, 8, 12, 16, 20, 24, 32, 40, 64, 71, 80, 112])
def test_slopes_match_reference_and_bloom(num_heads):
    from transformers.models.bloom.modeling_bloom import build_alibi_tensor

    slopes = posenc.alibi_slopes(num_heads)
    expected = torch.tensor(alibi_slopes_reference(num_heads), dtype=torch.float64)
    torch.testing.assert_close(slopes, expected.float(), atol=0, rtol=0)
    # BLOOM's tensor for a row of ones is slope * (0, 1, ..., s-1): position 1 exposes the slopes. BLOOM rounds
    # the base to float32 and raises it to powers up to 2h - 1, so its slopes carry up to ~2h float32 roundings;
    # ours are the float64 values rounded once.
    bloom = build_alibi_tensor(torch.ones(1, 2), num_heads, torch.float32)[:, 0, 1]
    torch.testing.assert_close(slopes, bloom, atol=0, rtol=(2 * num_heads + 1) * 2.0**-24)


def test_published_values():
    # Press et al.: 8 heads -> 1/2, 1/4, ..., 1/256.
    assert posenc.alibi_slopes(8).tolist() == [2.0**-i for i in range(1, 9)]
    # 12 heads: the 8 slopes of 8 heads, then every other slope of 16 heads (2^-0.5, 2^-1.5, 2^-2.5, 2^-3.5).
    twelve = posenc.alibi_slopes(12).double()
    torch.testing.assert_close(
        twelve[8:], torch.tensor([2 ** -(i + 0.5) for i in range(4)], dtype=torch.float64), atol=0, rtol=1e-7
    )


def test_bias_matches_reference_with_offset():
    alibi = posenc.ALiBi(6, causal=False)
    bias = alibi.bias(3, 10, offset=7)
    assert bias.shape == (6, 3, 10)
    expected = alibi_bias_reference(6, list(range(7, 10)), list(range(10)))
    torch.testing.assert_close(bias.double(), expected, atol=1e-6, rtol=1e-6)


def test_causal_bias_masks_the_future():
    bias = posenc.ALiBi(4).bias(5, 5)
    future = torch.ones(5, 5, dtype=torch.bool).triu(1)
    assert torch.isinf(bias[:, future]).all() and torch.isfinite(bias[:, ~future]).all()


@settings(max_examples=30, deadline=None)
@given(heads=st.integers(1, 40), m=st.integers(0, 5000), n=st.integers(0, 5000), shift=st.integers(0, 5000))
def test_bias_depends_only_on_distance(heads, m, n, shift):
    alibi = posenc.ALiBi(heads, causal=False)
    one = alibi.score_bias(torch.tensor([[m]]), torch.tensor([[n]]))
    two = alibi.score_bias(torch.tensor([[m + shift]]), torch.tensor([[n + shift]]))
    assert torch.equal(one, two)


def test_score_bias_never_hides_keys_by_position_id():
    """Packed documents: ids restart at token 3, so keys 1 and 2 of the first document have larger ids than the
    query at token 3 (id 0). They are earlier tokens: score_bias gives them -slope * |m - n|, not -inf; the
    attention's causal mask (token order) is what hides the future, on the materialized and FlexAttention paths."""
    packed = torch.tensor([0, 1, 2, 0, 1])
    bias = posenc.ALiBi(4).score_bias(packed, packed)
    assert bias.shape == (1, 4, 5, 5) and torch.isfinite(bias).all()
    expected = alibi_bias_reference(4, packed.tolist(), packed.tolist())
    torch.testing.assert_close(bias[0].double(), expected, atol=1e-6, rtol=1e-6)
    # The convenience view, where positions are token indices, still masks the future when causal.
    view = posenc.ALiBi(4).bias(3, 5, offset=2)
    future = torch.ones(3, 5, dtype=torch.bool).triu(3)
    assert torch.isinf(view[:, future]).all()
    reference = alibi_bias_reference(4, [2, 3, 4], list(range(5)))
    torch.testing.assert_close(view[:, ~future].double(), reference[:, ~future], atol=1e-6, rtol=1e-6)
