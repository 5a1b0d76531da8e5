from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import posenc
from posenc.testing import alibi_bias_reference, alibi_slopes_reference, attention_reference


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


@pytest.mark.parametrize(("q", "k"), [(range(5), range(5)), (range(7, 10), range(10))])
def test_the_public_causal_alibi_bias_masks_exactly_the_future(q, k):
    """alibi_bias(causal=True): -inf where the key comes after the query, the reference elsewhere, the query's own
    key (0) included: masking it too would leave the first query nothing to attend to (a NaN row)."""
    q, k = list(q), list(k)
    bias = posenc.alibi_bias(posenc.alibi_slopes(4), torch.tensor(q), torch.tensor(k), causal=True)[0]
    future = torch.tensor([[n > m for n in k] for m in q])
    assert torch.isneginf(bias[:, future]).all()
    torch.testing.assert_close(bias[:, ~future].double(), alibi_bias_reference(4, q, k)[:, ~future], rtol=1e-6, atol=0)
    assert torch.isfinite(bias.softmax(-1)).all()


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


def test_float64_attention_is_float64_exact():
    """A float64 module computes its bias in float64: it was float32, off by 2e-6 at s = 64 (1.7e-8 in the
    attention output) and by 0.5 at distance 2^25 + 1."""
    heads, s = 12, 64
    layer = posenc.CausalSelfAttention(8 * heads, heads, encoding=posenc.ALiBi(heads)).double()
    positions = list(range(s))
    bias = layer.encoding.score_bias(torch.arange(s), torch.arange(s))[0]
    assert bias.dtype == torch.float64
    torch.testing.assert_close(bias, alibi_bias_reference(heads, positions, positions), rtol=1e-15, atol=0)
    far = layer.encoding.score_bias(torch.tensor([2**25 + 1]), torch.tensor([0]))[0, :, 0, 0]
    torch.testing.assert_close(far, alibi_bias_reference(heads, [2**25 + 1], [0])[:, 0, 0], rtol=1e-15, atol=0)

    x = torch.randn(2, s, 8 * heads, dtype=torch.float64)
    b = x.shape[0]
    q = layer.q_proj(x).view(b, s, heads, 8).transpose(1, 2)
    k = layer.k_proj(x).view(b, s, heads, 8).transpose(1, 2)
    v = layer.v_proj(x).view(b, s, heads, 8).transpose(1, 2)
    heads_out = attention_reference(q, k, v, bias=alibi_bias_reference(heads, positions, positions))
    expected = layer.o_proj(heads_out.transpose(1, 2).reshape(b, s, 8 * heads))
    torch.testing.assert_close(layer(x), expected, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("cast", [torch.bfloat16, torch.float16, torch.float32])
def test_casting_the_module_never_rounds_the_slopes(cast):
    # model.to(bfloat16) rounded the slopes buffer: 2^-0.5 became 0.70703125, 0.6 off at distance 8192.
    alibi = posenc.ALiBi(12).to(cast)
    assert alibi.slopes.dtype == torch.float32 and alibi.bias(1, 8193).dtype == torch.float32
    reference = torch.tensor(alibi_slopes_reference(12), dtype=torch.float64)
    torch.testing.assert_close(alibi.slopes.double(), reference, rtol=2**-24, atol=0)
    # .double() after .float() recomputes them in float64, not float32's rounding upcast
    torch.testing.assert_close(posenc.ALiBi(12).float().double().slopes, reference, rtol=1e-15, atol=0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_the_public_alibi_bias_of_16_bit_slopes_is_float32(dtype):
    """alibi_bias never computes in 16 bits, whatever the slopes' dtype: a bf16 distance of 8191 is 8192, so a
    16-bit bias is off by a whole slope there. With 16-bit slopes every product is exact in float32."""
    slopes = posenc.alibi_slopes(4, dtype=dtype)
    bias = posenc.alibi_bias(slopes, torch.tensor([8191]), torch.tensor([0, 8190]), causal=False)
    assert bias.dtype == torch.float32
    assert torch.equal(bias[0, :, 0], -slopes.float()[:, None] * torch.tensor([8191.0, 1.0]))


def test_bias_offset_takes_numpy_integers():
    import numpy as np

    torch.testing.assert_close(posenc.ALiBi(4).bias(2, 5, offset=np.int64(3)), posenc.ALiBi(4).bias(2, 5, offset=3))


def test_share_memory_shares_the_slopes_too():
    # The cast-proof _apply replaced the buffer after share_memory_ had moved it, leaving it unshared.
    alibi = posenc.ALiBi(8)
    alibi.share_memory()
    assert alibi.slopes.is_shared()


@pytest.mark.parametrize("move", ["cpu", "float", "to_cpu"])
def test_a_module_built_or_cast_in_inference_mode_can_be_moved_after_it(move):
    # Slopes made inside torch.inference_mode are inference tensors; a move or cast that changes nothing returns
    # the buffer itself, and the in-place refresh of its values raised "Inplace update to inference tensor outside
    # InferenceMode is not allowed" from model.cpu() or model.float(), which a plain module takes without a word.
    apply = {"cpu": lambda m: m.cpu(), "float": lambda m: m.float(), "to_cpu": lambda m: m.to("cpu")}[move]
    reference = torch.tensor(alibi_slopes_reference(12), dtype=torch.float64)
    with torch.inference_mode():
        built = posenc.CausalSelfAttention(24, 12, encoding=posenc.ALiBi(12))
    cast = posenc.CausalSelfAttention(24, 12, encoding=posenc.ALiBi(12))
    with torch.inference_mode():
        cast.half()  # fp16 slopes are replaced by float32 ones, made in inference mode
    cast.float()
    for layer in (built, cast):
        apply(layer)
        torch.testing.assert_close(layer.encoding.slopes.double(), reference, rtol=2**-24, atol=0)
    built(torch.randn(1, 5, 24))
    x = torch.randn(1, 5, 24)
    # The cast one's weights are ordinary tensors again (made by .float() outside inference mode): it trains.
    x.requires_grad_()
    cast(x).sum().backward()
    assert x.grad is not None


@pytest.mark.parametrize("learned", [True, False])
def test_a_cast_or_move_keeps_slopes_that_are_not_the_head_counts(learned):
    # _apply recomputed the slopes from the head count on every cast and move: learned slopes (an nn.Parameter) or
    # assigned ones went back to 1/4, 1/16, ... on .to("cpu", torch.float32), .double() or .cuda(), without a word.
    alibi = posenc.ALiBi(4)
    custom = torch.tensor([0.5, 0.3, 0.2, 0.1])
    alibi.slopes = nn.Parameter(custom.clone()) if learned else custom.clone()
    for cast in (lambda m: m.to("cpu", torch.float32), lambda m: m.double(), lambda m: m.float()):
        cast(alibi)
        torch.testing.assert_close(alibi.slopes.detach().float(), custom, rtol=0, atol=0)
    assert isinstance(alibi.slopes, nn.Parameter) == learned
    if learned:  # a 16-bit cast rounds a Parameter as it rounds every other one, and keeps it a Parameter
        alibi.bfloat16()
        assert isinstance(alibi.slopes, nn.Parameter) and alibi.slopes.dtype == torch.bfloat16
        assert not dict(alibi.named_buffers())
    else:  # an assigned buffer stays float32, unrounded, as the head count's do
        alibi.bfloat16()
        assert alibi.slopes.dtype == torch.float32
        torch.testing.assert_close(alibi.slopes, custom, rtol=0, atol=0)


def test_slopes_assigned_for_another_head_count_are_refused_on_every_path():
    """ALiBi(4) given 8 slopes returned an 8-head bias, which attention met with a bare size mismatch, and the flex
    score_mod read the first 4 slopes without a word."""
    from posenc.kernels.flex_bias import score_mod_for

    alibi = posenc.ALiBi(4)
    alibi.slopes = posenc.alibi_slopes(8)
    match = r"ALiBi.slopes has shape \(8,\), but this ALiBi has num_heads=4.*alibi_slopes\(h\)\[i:j\]"
    with pytest.raises(ValueError, match=match):
        alibi.bias(3, 3)
    with pytest.raises(ValueError, match=match):
        score_mod_for(alibi, torch.arange(3)[None], 0)
    alibi.slopes = posenc.alibi_slopes(8)[4:]  # a tensor-parallel rank's heads 4..7
    assert torch.equal(alibi.bias(3, 3), posenc.ALiBi(8).bias(3, 3)[4:])


def test_an_alibi_built_on_the_meta_device_gets_the_head_counts_slopes_from_to_empty():
    """to_empty leaves memory uninitialised; the slopes, which have no values on meta to compare, are taken to be
    the head count's and recomputed (a meta buffer read as learned slopes cannot be copied from)."""
    with torch.device("meta"):
        alibi = posenc.ALiBi(3)
    alibi.to_empty(device="cpu")
    assert torch.equal(alibi.slopes, posenc.alibi_slopes(3))


def test_a_parameter_holding_the_head_counts_slopes_is_recomputed_in_float64_by_double():
    """Slopes equal to the head count's are compared before the cast: a Parameter's data is swapped by it, so
    comparing after it saw float32's rounding of 2^-0.5 in float64, took the slopes for custom ones and kept it."""
    alibi = posenc.ALiBi(16)
    alibi.slopes = nn.Parameter(posenc.alibi_slopes(16))
    alibi.double()
    assert isinstance(alibi.slopes, nn.Parameter)
    assert torch.equal(alibi.slopes.detach(), posenc.alibi_slopes(16, dtype=torch.float64))


def test_repr_names_the_settings():
    assert repr(posenc.ALiBi(4, causal=False)) == "ALiBi(num_heads=4, causal=False)"


def test_assigned_slopes_are_saved_and_loaded_the_head_counts_are_not():
    """A tensor-parallel rank's slopes (README: ALiBi(j - i) with alibi_slopes(h)[i:j]) were a non-persistent buffer:
    a model reloaded from its state dict attended with the slopes of a model of j - i heads, without a word."""
    torch.manual_seed(0)
    rank = posenc.ALiBi(2)
    rank.slopes = posenc.alibi_slopes(8)[2:4]
    saved = posenc.CausalSelfAttention(16, 2, encoding=rank)
    x = torch.randn(1, 6, 16)
    for state in (saved.state_dict(), {k: v.clone() for k, v in saved.state_dict().items()}):
        loaded = posenc.CausalSelfAttention(16, 2, encoding=posenc.ALiBi(2))
        loaded.load_state_dict(state)
        assert torch.equal(loaded.encoding.slopes, rank.slopes) and torch.equal(loaded(x), saved(x))
    assert torch.equal(saved.state_dict()["encoding.slopes"], posenc.alibi_slopes(8)[2:4])
    # The head count's own stay out of the state, as before: states saved before this load, and none changes.
    assert "slopes" not in posenc.ALiBi(4).state_dict() and "slopes" not in posenc.ALiBi(4).double().state_dict()
    kept = posenc.ALiBi(2)
    kept.slopes = posenc.alibi_slopes(8)[2:4].clone()
    kept.load_state_dict(posenc.ALiBi(2).state_dict())
    assert torch.equal(kept.slopes, posenc.alibi_slopes(8)[2:4])  # nothing saved: assigned slopes stay
    # Into a float64 module: the saved float32 values, in float64; another head count is refused by name.
    wide = posenc.ALiBi(2).double()
    wide.load_state_dict(rank.state_dict())
    assert wide.slopes.dtype == torch.float64 and torch.equal(wide.slopes, rank.slopes.double())
    with pytest.raises(RuntimeError, match="ALiBi slopes saved with shape \\(2,\\), but this ALiBi has num_heads=3"):
        posenc.ALiBi(3).load_state_dict(rank.state_dict())
    # A learned Parameter's state loads into assigned-slope buffers and back.
    learned = posenc.ALiBi(2)
    learned.slopes = torch.nn.Parameter(torch.tensor([0.5, 0.25]))
    plain = posenc.ALiBi(2)
    plain.load_state_dict(learned.state_dict())
    assert torch.equal(plain.slopes, torch.tensor([0.5, 0.25]))
    learned.load_state_dict(rank.state_dict())
    assert torch.equal(learned.slopes.detach(), rank.slopes)


def test_assigned_slopes_save_through_safetensors_and_load_into_tensors_of_their_own(tmp_path):
    """Saved as they were assigned, a view of part of alibi_slopes(8), safetensors' save_model refused them; loaded
    into the assigned tensor in place, the caller's whole alibi_slopes(8) changed, and a module built under
    inference_mode could not load them."""
    from safetensors.torch import load_model, save_model

    whole = posenc.alibi_slopes(8)
    rank = posenc.ALiBi(2)
    rank.slopes = whole[2:4]
    layers = torch.nn.ModuleList(posenc.CausalSelfAttention(16, 2, encoding=rank) for _ in range(2))  # shared
    save_model(layers, str(tmp_path / "m.safetensors"))
    loaded = torch.nn.ModuleList(posenc.CausalSelfAttention(16, 2, encoding=posenc.ALiBi(2)) for _ in range(2))
    load_model(loaded, str(tmp_path / "m.safetensors"))
    assert all(torch.equal(layer.encoding.slopes, whole[2:4]) for layer in loaded)
    other = posenc.ALiBi(2)
    other.slopes = whole[4:6]
    state = {"slopes": torch.tensor([0.5, 0.25])}
    other.load_state_dict(state)
    assert torch.equal(whole, posenc.alibi_slopes(8)) and torch.equal(other.slopes, torch.tensor([0.5, 0.25]))
    assert other.slopes.data_ptr() != state["slopes"].data_ptr()  # not the source's tensor either
    # Shared memory (share_memory() before the load): written in place, so other processes see the loaded slopes.
    shared = posenc.ALiBi(2)
    shared.slopes = whole[2:4].clone()
    shared.share_memory()
    shared.load_state_dict(state)
    assert shared.slopes.is_shared() and torch.equal(shared.slopes, state["slopes"])
    with torch.inference_mode():
        built = posenc.ALiBi(2)
    built.load_state_dict(rank.state_dict())
    assert torch.equal(built.slopes, whole[2:4])
    # assign=True onto a meta-built module: the saved slopes themselves, so to_empty has them.
    with torch.device("meta"):
        meta = posenc.ALiBi(2)
    meta.load_state_dict(rank.state_dict(), assign=True)
    assert torch.equal(meta.slopes, whole[2:4])


def test_a_head_count_past_any_model_is_refused_not_computed_without_end():
    # The slopes are built in a Python list: ALiBi(2**62) ran without end.
    for n in (2**24 + 1, 2**62):
        with pytest.raises(ValueError, match=r"num_heads must be at most 2\*\*24"):
            posenc.ALiBi(n)
    assert posenc.alibi_slopes(2**12).shape == (4096,)
