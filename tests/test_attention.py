"""The reference attention with every encoding: against a float64 reference, and KV-cache decode = full pass."""

from __future__ import annotations

import copy
import gc
import pickle
import warnings

import numpy as np
import pytest
import torch

import posenc
from posenc.attention import CausalSelfAttention, KVCache, add_input_encoding, attend, causal_mask
from posenc.testing import assert_close, attention_reference, sinusoidal_reference, t5_bucket_reference

DIM, HEADS, KV_HEADS, HEAD_DIM = 32, 4, 2, 8


def make_encoding(name: str) -> torch.nn.Module:
    return posenc.build_for_model(name, dim=DIM, num_heads=HEADS, head_dim=HEAD_DIM, max_positions=64)


def layer_for(encoding: torch.nn.Module, **options) -> CausalSelfAttention:
    """The attention a model builds around an encoding: an input encoding stays outside, added to x by ``run``."""
    inside = None if encoding.acts_on is posenc.ActsOn.INPUT else encoding
    return CausalSelfAttention(DIM, HEADS, encoding=inside, **options).double()


def run(attn, encoding, x: torch.Tensor, positions: torch.Tensor, cache: KVCache | None = None):
    return attn(add_input_encoding(x, encoding, positions), positions=positions, cache=cache)


@pytest.mark.parametrize("name", posenc.available())
@pytest.mark.parametrize("kv_heads", [HEADS, KV_HEADS])
@pytest.mark.parametrize("start", [0, 9])
def test_kv_cache_decode_equals_full_forward(name, kv_heads, start):
    torch.manual_seed(0)
    encoding = make_encoding(name).double()
    attn = layer_for(encoding, num_kv_heads=kv_heads)
    x = torch.randn(2, 12, DIM, dtype=torch.float64)
    positions = torch.arange(start, start + 12)[None]
    full = run(attn, encoding, x, positions)

    cache = KVCache()
    pieces = [run(attn, encoding, x[:, :5], positions[:, :5], cache)]  # prefill
    for i in range(5, 12):  # then one token at a time
        pieces.append(run(attn, encoding, x[:, i : i + 1], positions[:, i : i + 1], cache))
    assert cache.length == 12
    torch.testing.assert_close(torch.cat(pieces, dim=1), full, atol=1e-12, rtol=1e-12)


@pytest.mark.parametrize("name", ["rope", "alibi", "t5"])
def test_a_step_of_shared_positions_continues_a_cache_of_per_row_positions(name):
    """A prefill with one row of positions per sequence, then a step whose (s,) positions every row shares: the
    cache keeps a row per sequence (not the step's single row) and the result is the full forward pass."""
    torch.manual_seed(0)
    attn = layer_for(make_encoding(name).double())
    x = torch.randn(2, 6, DIM, dtype=torch.float64)
    rows = torch.tensor([[0, 1, 2, 3, 4], [5, 6, 7, 8, 8]])
    full = attn(x, positions=torch.cat((rows, torch.tensor([[9], [9]])), dim=1))
    cache = KVCache()
    out = torch.cat(
        (attn(x[:, :5], positions=rows, cache=cache), attn(x[:, 5:], positions=torch.tensor([9]), cache=cache)), 1
    )
    assert cache.positions.shape == (2, 6) and cache.positions[:, -1].tolist() == [9, 9]
    torch.testing.assert_close(out, full, atol=1e-12, rtol=1e-12)


@pytest.mark.parametrize("name", ["rope", "nope", "alibi", "t5"])
def test_cache_continues_positions_by_default(name):
    torch.manual_seed(0)
    attn = CausalSelfAttention(DIM, HEADS, encoding=make_encoding(name)).double()
    x = torch.randn(1, 6, DIM, dtype=torch.float64)
    full = attn(x)
    cache = KVCache()
    out = torch.cat([attn(x[:, :4], cache=cache), attn(x[:, 4:5], cache=cache), attn(x[:, 5:], cache=cache)], 1)
    torch.testing.assert_close(out, full, atol=1e-12, rtol=1e-12)


@pytest.mark.parametrize("name", ["rope", "alibi", "t5"])
@pytest.mark.parametrize("starts", [[100], [100, 7]], ids=["shared", "per-sequence"])
def test_cache_continues_from_the_last_cached_position(name, starts):
    """A prefill at explicit positions, then decode steps without positions=, is the full forward at those
    positions: the default continues each sequence at its last cached position + 1, not at cache.length."""
    torch.manual_seed(0)
    attn = CausalSelfAttention(DIM, HEADS, num_kv_heads=KV_HEADS, encoding=make_encoding(name).double()).double()
    x = torch.randn(len(starts), 10, DIM, dtype=torch.float64)
    positions = torch.arange(10)[None] + torch.tensor(starts)[:, None]
    full = attn(x, positions=positions)
    cache = KVCache()
    pieces = [attn(x[:, :6], positions=positions[:, :6], cache=cache)]
    pieces += [attn(x[:, i : i + 1], cache=cache) for i in range(6, 10)]
    assert torch.equal(cache.positions, positions)
    torch.testing.assert_close(torch.cat(pieces, dim=1), full, atol=1e-12, rtol=1e-12)


def test_a_cache_fed_another_batch_size_is_a_clear_error():
    attn = CausalSelfAttention(DIM, HEADS, encoding=make_encoding("rope"))
    cache = KVCache()
    attn(torch.randn(2, 5, DIM), cache=cache)
    with pytest.raises(ValueError, match=r"KVCache holds a batch of 2 sequences but x has a batch of 1"):
        attn(torch.randn(1, 1, DIM), cache=cache)
    with pytest.raises(ValueError, match=r"batch of 2 sequences but k has a batch of 3"):
        cache.update(torch.randn(3, HEADS, 1, HEAD_DIM), torch.randn(3, HEADS, 1, HEAD_DIM), torch.tensor([[5]]))
    assert cache.length == 5  # nothing was appended


@pytest.mark.parametrize("rope_parameters", [None, {"rope_type": "dynamic", "factor": 2.0}], ids=["rope", "dynamic"])
def test_a_step_that_cannot_continue_the_cache_changes_nothing(rope_parameters):
    """Another dtype, another layer, or keys of another head count, is a clear error raised before the cache
    changes, so the corrected retry equals the full forward (a float32 step into a float64 cache once appended its
    key and then failed in attention; in consistent mode a head mismatch left the unrotated keys as the rotated
    ones)."""
    torch.manual_seed(0)
    rope = posenc.RoPE(HEAD_DIM, rope_parameters=rope_parameters, max_position_embeddings=4, mode="consistent")
    attn = CausalSelfAttention(DIM, HEADS, num_kv_heads=KV_HEADS, encoding=rope).double()
    other = CausalSelfAttention(DIM, HEADS, encoding=rope).double()  # 4 key/value heads, not 2
    x = torch.randn(1, 6, DIM, dtype=torch.float64)
    full = attn(x)
    cache = KVCache()
    attn(x[:, :5], cache=cache)
    state = lambda: (cache.k, cache.v, cache.positions, cache.unrotated_k, cache.rotated_with)  # noqa: E731
    held = state()
    with pytest.raises(TypeError, match=r"KVCache holds torch.float64 keys .* new ones are torch.float32"):
        attn.float()(x[:, 5:].float(), cache=cache)
    attn.double()
    with pytest.raises(ValueError, match=r"one KVCache per layer"):
        other(x[:, 5:], cache=cache)
    k4 = torch.zeros(1, HEADS, 1, HEAD_DIM, dtype=torch.float64)  # 4 heads, appended by hand
    with pytest.raises(ValueError, match=r"holds keys of 2 heads x 8 channels but the new keys have 4 x 8"):
        if cache.unrotated_k is None:
            cache.update(k4, k4, torch.tensor([[5]]))
        else:
            cache.update_rotating(k4, k4, torch.tensor([[5]]), rope)
    assert all(a is b for a, b in zip(held, state(), strict=True))
    torch.testing.assert_close(attn(x[:, 5:], cache=cache), full[:, 5:], atol=1e-12, rtol=1e-12)


def test_a_cache_deep_copied_with_its_layer_belongs_to_the_layers_copy():
    """copy.deepcopy((model, caches)) kept each cache's owner pointing at the original layer, so the copied model
    refused its own copied cache ("holds the keys of another layer")."""
    torch.manual_seed(0)
    layer = CausalSelfAttention(DIM, HEADS, encoding=make_encoding("rope")).double()
    x = torch.randn(1, 6, DIM, dtype=torch.float64)
    cache = KVCache()
    with torch.no_grad():
        layer(x[:, :5], cache=cache)
        twin, twin_cache = copy.deepcopy((layer, cache))
        torch.testing.assert_close(twin(x[:, 5:], cache=twin_cache), layer(x)[:, 5:], atol=1e-12, rtol=1e-12)
        with pytest.raises(ValueError, match=r"one KVCache per layer"):  # and the original layer is another one
            layer(x[:, 5:], cache=copy.deepcopy((twin, twin_cache))[1])


@pytest.mark.parametrize(("first", "second"), [("rope", "rope"), ("rope", "alibi"), ("t5", "nope")])
def test_one_kv_cache_per_layer(first, second):
    """A second layer handed a filled cache raises before anything is appended: it once appended its keys to the
    first layer's, so 5 tokens made a cache of 10 and each layer attended to the other's keys, whatever their
    encodings. A copy (a beam) keeps its owner and refuses the other layer from its first use; a cache pickled and
    loaded again belongs to the first layer that uses it, here its own, and then refuses the other one."""
    torch.manual_seed(0)
    encodings = {name: make_encoding(name).double() for name in (first, second)}  # rope, rope: one shared RoPE
    owner = CausalSelfAttention(DIM, HEADS, encoding=encodings[first]).double()
    other = CausalSelfAttention(DIM, HEADS, encoding=encodings[second]).double()
    x = torch.randn(1, 6, DIM, dtype=torch.float64)
    full = owner(x)
    cache = KVCache()
    with torch.no_grad():  # deepcopy takes only tensors that are leaves of no graph, as a decoding cache's are
        h = owner(x[:, :5], cache=cache)
    described = rf"another layer \(CausalSelfAttention with {type(encodings[first]).__name__}\)"
    with pytest.raises(ValueError, match=rf"one KVCache per layer: this KVCache holds the keys of {described}"):
        other(h, cache=cache)
    assert cache.length == 5

    for branch in (copy.copy(cache), copy.deepcopy(cache)):  # the other layer first: it was accepted
        with pytest.raises(ValueError, match=r"one KVCache per layer"):
            other(h[:, :1], cache=branch)
        assert branch.length == 5
    branch = copy.deepcopy(cache)
    torch.testing.assert_close(owner(x[:, 5:], cache=branch), full[:, 5:], atol=1e-12, rtol=1e-12)
    assert cache.length == 5 and branch.k is not cache.k

    restored = pickle.loads(pickle.dumps(cache))
    torch.testing.assert_close(owner(x[:, 5:], cache=restored), full[:, 5:], atol=1e-12, rtol=1e-12)
    with pytest.raises(ValueError, match=r"one KVCache per layer"):
        other(h[:, :1], cache=restored)
    del owner
    gc.collect()
    with pytest.raises(ValueError, match=r"one KVCache per layer: .* of a layer that no longer exists"):
        other(h[:, :1], cache=restored)


def test_a_float64_model_gets_the_sinusoidal_encoding_in_float64():
    x = torch.zeros(1, 300, 64, dtype=torch.float64)
    got = add_input_encoding(x, posenc.Sinusoidal(64), torch.arange(300))
    want = sinusoidal_reference(torch.arange(300), 64).double()
    torch.testing.assert_close(got[0], want, atol=1e-13, rtol=0)  # float32 values were off by 3e-8


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("name", ["sinusoidal", "learned"])
def test_a_half_precision_model_gets_the_sum_rounded_once(name, dtype):
    """The encoding in float32 added to x in float32, then one rounding: rounding the encoding first and the sum
    again made a fifth of bf16 sums another value (max error 0.023 against 0.016 for one rounding)."""
    torch.manual_seed(0)
    encoding = posenc.build_for_model(name, dim=256, num_heads=4, head_dim=64, max_positions=64)
    x, positions = torch.randn(4, 64, 256).to(dtype), torch.arange(64)
    want = (x.float() + encoding(positions[None], dtype=torch.float32)).to(dtype)
    assert torch.equal(add_input_encoding(x, encoding, positions), want)


@pytest.mark.parametrize(
    ("encoding", "width"),
    [(posenc.Sinusoidal(32), 64), (posenc.LearnedAbsolute(16, 16), 32), (posenc.LearnedAbsolute(16, 1), 32)],
    ids=["sinusoidal", "learned", "learned-one-channel"],
)
def test_an_input_encoding_of_another_width_is_a_clear_error(encoding, width):
    """It was a raw broadcasting error, or with one channel no error: that channel added to every channel of x."""
    name, dim = type(encoding).__name__, encoding.dim
    message = (
        rf"{name} has dim={dim} but x's last dim \(the model width\) is {width}; build the encoding with dim={width}"
    )
    with pytest.raises(ValueError, match=message):
        add_input_encoding(torch.randn(1, 3, width), encoding, torch.arange(3))


@pytest.mark.parametrize("name", posenc.available())
def test_return_attention_keeps_float64(name):
    """Asking for the probabilities must not change the output: float64 stays float64 (it was run in float32)."""
    torch.manual_seed(0)
    encoding = make_encoding(name).double()
    attn = layer_for(encoding, num_kv_heads=KV_HEADS)
    x = torch.randn(2, 9, DIM, dtype=torch.float64)
    positions = torch.arange(9)[None]
    out, probs = attn(add_input_encoding(x, encoding, positions), return_attention=True)
    plain = attn(add_input_encoding(x, encoding, positions))
    assert out.dtype == probs.dtype == torch.float64
    torch.testing.assert_close(out, plain, atol=1e-12, rtol=1e-12)
    torch.testing.assert_close(probs.sum(-1), torch.ones(2, HEADS, 9, dtype=torch.float64), atol=1e-14, rtol=0)


@pytest.mark.parametrize("name", ["nope", "rope", "alibi", "t5"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_attention_matches_float64_reference(name, dtype):
    torch.manual_seed(1)
    encoding = make_encoding(name)
    attn = CausalSelfAttention(DIM, HEADS, num_kv_heads=KV_HEADS, encoding=encoding)
    x = torch.randn(2, 10, DIM)
    out = attn.to(dtype)(x.to(dtype))

    # The same computation written out in float64.
    attn64 = attn.double()
    x64 = x.to(dtype).double()
    b, s, _ = x64.shape
    q = attn64.q_proj(x64).view(b, s, HEADS, HEAD_DIM).transpose(1, 2)
    k = attn64.k_proj(x64).view(b, s, KV_HEADS, HEAD_DIM).transpose(1, 2)
    v = attn64.v_proj(x64).view(b, s, KV_HEADS, HEAD_DIM).transpose(1, 2)
    bias = None
    if name == "rope":
        q, k = posenc.testing.rope_reference(q, torch.arange(s)), posenc.testing.rope_reference(k, torch.arange(s))
    elif name == "alibi":  # from the reference slopes, not the encoding's own bias
        bias = posenc.testing.alibi_bias_reference(HEADS, list(range(s)), list(range(s))).double()
    elif name == "t5":  # the encoding's learned table, read at the reference's buckets (key - query)
        options = dict(bidirectional=encoding.bidirectional, num_buckets=encoding.num_buckets)
        buckets = [
            [t5_bucket_reference(n - m, max_distance=encoding.max_distance, **options) for n in range(s)]
            for m in range(s)
        ]
        bias = encoding.table.weight.double()[torch.tensor(buckets)].permute(2, 0, 1)  # (h, s, s)
    if bias is not None:  # future keys are masked by the reference; their bias is never read
        bias = bias.masked_fill(torch.ones(s, s, dtype=torch.bool).triu(1), 0)
    heads = attention_reference(q, k, v, bias=bias)
    expected = attn64.o_proj(heads.transpose(1, 2).reshape(b, s, DIM))
    assert_close(out, expected, reduction=True)


@pytest.mark.parametrize("need_probs", [False, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_score_bias_is_added_in_float32_for_16_bit_inputs(dtype, need_probs):
    """ALiBi's bias at long distances has no exact 16-bit value: -2048.25 and -2048 (slope 1/4, keys 8193 and 8192
    back) are one value in bf16 and fp16, which would weigh the two keys alike. ``attend`` adds the bias in float32,
    so the nearer key keeps its weight sigmoid(slope), as in float64."""
    alibi = posenc.ALiBi(HEADS)
    bias = alibi.score_bias(torch.tensor([8193]), torch.tensor([0, 1]))  # (1, h, 1, 2), float32
    q, k = torch.zeros(1, HEADS, 1, HEAD_DIM, dtype=dtype), torch.zeros(1, HEADS, 2, HEAD_DIM, dtype=dtype)
    v = torch.zeros(1, HEADS, 2, HEAD_DIM, dtype=dtype)
    v[:, :, 1] = 1  # the output is the weight of the nearer key
    out, probs = attend(q, k, v, torch.ones(1, 2, dtype=torch.bool), bias, need_probs=need_probs)
    nearer = torch.sigmoid(posenc.alibi_slopes(HEADS, dtype=torch.float64))  # (h,)
    assert out.dtype == dtype
    torch.testing.assert_close(out[0, :, 0].double(), nearer[:, None].expand(HEADS, HEAD_DIM), atol=2**-8, rtol=0)
    if need_probs:
        torch.testing.assert_close(probs[0, :, 0, 1].double(), nearer, atol=1e-6, rtol=0)


def test_return_attention_probabilities_sum_to_one_and_are_causal():
    attn = CausalSelfAttention(DIM, HEADS, encoding=make_encoding("alibi"))
    x = torch.randn(1, 7, DIM)
    out, probs = attn(x, return_attention=True)
    torch.testing.assert_close(out, attn(x), atol=1e-5, rtol=1e-5)
    assert probs.shape == (1, HEADS, 7, 7)
    torch.testing.assert_close(probs.sum(-1), torch.ones(1, HEADS, 7))
    assert (probs[..., torch.ones(7, 7, dtype=torch.bool).triu(1)] == 0).all()


def test_one_encoding_shared_by_layers():
    rope = make_encoding("rope")
    layers = [CausalSelfAttention(DIM, HEADS, encoding=rope) for _ in range(3)]
    x = torch.randn(1, 5, DIM)
    for layer in layers:
        x = x + layer(x)
    assert len(rope._tables) == 1  # one cos/sin table served every layer


def test_projections_that_are_not_plain_linears_are_not_held_to_a_weight_dtype() -> None:
    """The x-dtype check reads a plain Linear's weight only: a dynamically quantized projection (int8 weights behind
    a packed-params function) takes float32 x, and the layer runs as before."""
    quantize_dynamic = pytest.importorskip("torch.ao.quantization").quantize_dynamic
    torch.manual_seed(0)
    layer = posenc.CausalSelfAttention(64, 4, encoding=posenc.RoPE(16)).eval()
    x = torch.randn(1, 5, 64)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # torch.ao.quantization is deprecated, not gone
        quantized = quantize_dynamic(layer, {torch.nn.Linear}, dtype=torch.qint8)
    with torch.no_grad():
        torch.testing.assert_close(quantized(x), layer(x), atol=0.05, rtol=0.0)


@pytest.mark.parametrize("which", ["q_proj", "k_proj", "v_proj"])
def test_a_projection_giving_fewer_features_than_the_heads_is_refused_by_name(which) -> None:
    """A projection that returns only some heads' features (one rank's shard under tensor parallelism with
    ColwiseParallel's default use_local_output=True; tests/distributed covers that case) is named, with the fix,
    where view() said only "shape ... is invalid for input of size ..."."""
    layer = CausalSelfAttention(DIM, HEADS, num_kv_heads=KV_HEADS)
    setattr(layer, which, torch.nn.Linear(DIM, HEAD_DIM))  # one head's features
    heads = HEADS if which == "q_proj" else KV_HEADS
    match = rf"{which} gave {HEAD_DIM} features where the layer's {heads} heads of {HEAD_DIM} take {heads * HEAD_DIM}"
    with pytest.raises(ValueError, match=match + r".*ColwiseParallel\(use_local_output=False\)"):
        layer(torch.randn(1, 3, DIM))


@pytest.mark.parametrize("name", ["learned", "sinusoidal"])
def test_an_input_encoding_given_to_the_attention_is_refused(name):
    """The layer never adds it: it used to run as if it had no encoding, even past a learned table."""
    with pytest.raises(ValueError, match=r"acts on the input, not in attention: add it to the embeddings once"):
        CausalSelfAttention(DIM, HEADS, encoding=make_encoding(name))


def test_an_encoding_assigned_after_construction_is_checked_as_the_constructor_checks_it():
    """forward attends unchecked: an ALiBi of 8 heads assigned to a 4-head layer gave FlexAttention's score_mod the
    first 4 heads' slopes without an error."""
    layer = CausalSelfAttention(32, 4, encoding=posenc.ALiBi(4))
    refused = [
        (posenc.ALiBi(8), ValueError, r"encoding ALiBi has num_heads=8 but the attention has num_heads=4"),
        (posenc.T5Bias(1), ValueError, r"encoding T5Bias has num_heads=1 but the attention has num_heads=4"),
        (posenc.RoPE(16), ValueError, r"encoding RoPE has head_dim=16 but the attention's heads"),
        (posenc.Sinusoidal(32), ValueError, r"acts on the input, not in attention"),
        ("alibi", TypeError, r"encoding must be an nn.Module or None, got str; build one by name"),
    ]
    for encoding, error, message in refused:
        with pytest.raises(error, match=message):
            layer.encoding = encoding
        with pytest.raises(error, match=message):
            layer.add_module("encoding", encoding)
        with pytest.raises(error, match=message):
            layer.register_module("encoding", encoding)
        assert isinstance(layer.encoding, posenc.ALiBi) and layer.encoding.num_heads == 4, "a refused one is kept"
    for encoding in (posenc.T5Bias(4), None, posenc.RoPE(8)):
        layer.encoding = encoding
        assert layer.encoding is encoding
        layer(torch.randn(1, 5, 32))


def test_next_positions_starts_at_zero_on_an_empty_cache_and_feeds_input_encodings():
    """A decoding loop of a learned-table model: add_input_encoding takes cache.next_positions(s) at every step,
    the first included, and matches the full forward pass."""
    torch.manual_seed(0)
    enc = posenc.LearnedAbsolute(16, 32)
    attn = posenc.CausalSelfAttention(32, 4).double()
    x = torch.randn(1, 7, 32, dtype=torch.float64)
    full = attn(posenc.add_input_encoding(x, enc.double(), torch.arange(7)))
    cache = posenc.KVCache()
    assert cache.next_positions(3).tolist() == [[0, 1, 2]]
    steps = []
    for chunk in (x[:, :4], x[:, 4:5], x[:, 5:]):
        positions = cache.next_positions(chunk.shape[1])
        steps.append(attn(posenc.add_input_encoding(chunk, enc, positions), cache=cache))
    torch.testing.assert_close(torch.cat(steps, dim=1), full)
    assert cache.next_positions(2).tolist() == [[7, 8]] and cache.next_positions(np.int64(1)).tolist() == [[7]]
    assert cache.next_positions(0).shape == (1, 0)
    # An empty step after the first changes nothing (only an empty first step is refused: nothing to continue).
    assert attn(x[:, :0], cache=cache).shape == (1, 0, 32) and cache.length == 7


def test_cache_positions_broadcast_when_a_shared_prefill_meets_per_row_steps() -> None:
    """A prefill at shared positions (1, t), then a step with per-row positions (2, 1): every row keeps its own."""
    cache = KVCache()
    k = torch.randn(2, 1, 4, 8)
    cache.update(k, k, torch.arange(4)[None])
    _, _, positions = cache.update(k[:, :, :1], k[:, :, :1], torch.tensor([[4], [9]]))
    assert positions.tolist() == [[0, 1, 2, 3, 4], [0, 1, 2, 3, 9]]


def test_next_positions_after_an_empty_update_starts_at_zero() -> None:
    cache = KVCache()
    cache.update(torch.randn(1, 1, 0, 8), torch.randn(1, 1, 0, 8), torch.zeros(1, 0, dtype=torch.long))
    assert cache.next_positions(3).tolist() == [[0, 1, 2]]


def test_attend_refuses_by_name_what_torch_would_fail_on_deep_inside_or_take_silently() -> None:
    torch.manual_seed(0)
    b, h, s, t, d = 2, 3, 5, 7, 4
    q, k, v = torch.randn(b, h, s, d), torch.randn(b, h, t, d), torch.randn(b, h, t, d)
    allowed, bias = causal_mask(s, t, q.device), torch.randn(b, h, s, t)
    to = r"broadcast to \(b, h, s, t\) = \(2, 3, 5, 7\)"
    cases = [
        ((q, k, v, allowed, bias[:, :2]), ValueError, rf"bias must {to}.* got \(2, 2, 5, 7\)"),
        ((q, k, v, allowed, torch.randn(3, h, s, t)), ValueError, rf"bias must {to}.* got \(3, 3, 5, 7\)"),
        ((q, k, v, allowed, bias[..., :6]), ValueError, rf"bias must {to}.* got \(2, 3, 5, 6\)"),
        ((q, k, v, allowed, bias[:, :, :4]), ValueError, rf"bias must {to}.* got \(2, 3, 4, 7\)"),
        ((q, k, v, allowed, bias[None]), ValueError, rf"bias must {to}.* got \(1, 2, 3, 5, 7\)"),
        ((q, k, v, allowed, bias.long()), TypeError, r"bias must be a floating-point tensor"),
        ((q, k, v, allowed, bias.to("meta")), ValueError, r"q is on cpu but bias is on meta"),
        ((q, k, v, allowed.float(), bias), TypeError, r"allowed must be a bool tensor.* got torch\.float32"),
        ((q, k, v, allowed.long(), None), TypeError, r"allowed must be a bool tensor.* got torch\.int64"),
        ((q, k, v, None, None), TypeError, r"allowed must be a bool tensor.* got NoneType"),
        ((q, k, v, allowed.to("meta"), None), ValueError, r"q is on cpu but allowed is on meta"),
        ((q, k, v, allowed[:, :6], None), ValueError, rf"allowed must {to}.* got \(5, 6\)"),
        ((q, k, v, allowed[:4], None), ValueError, rf"allowed must {to}.* got \(4, 7\)"),
        ((q, k, v, allowed.expand(3, 1, s, t), None), ValueError, rf"allowed must {to}.* got \(3, 1, 5, 7\)"),
        ((q, k, v, allowed.expand(b, 2, s, t), None), ValueError, rf"allowed must {to}.* got \(2, 2, 5, 7\)"),
        ((q, k[:, :1], v[:, :1], allowed, None), ValueError, r"k and v must have q's batch and heads \(2, 3\)"),
        ((q, k, v[:, :, :6], allowed, None), ValueError, r"k and v must hold the same keys, got 7 and 6"),
        ((q, k[..., :3], v, allowed, None), ValueError, r"k's head_dim must be q's, got 3 and 4"),
        ((q[0], k, v, allowed, None), ValueError, r"q must have shape \(b, h, s, head_dim\), got \(3, 5, 4\)"),
        ((q, k.long(), v, allowed, None), TypeError, r"k must be a floating-point tensor"),
        ((q, k.to("meta"), v, allowed, None), ValueError, r"q is on cpu but k is on meta"),
        ((q, k, v.to("meta"), allowed, None), ValueError, r"q is on cpu but v is on meta"),
        # Without a bias SDPA refused the mix in its own words; with one, k was cast to q's dtype silently.
        ((q, k.double(), v, allowed, None), TypeError, r"one dtype \(outside autocast.*got q torch\.float32, k torch"),
        ((q, k.double(), v, allowed, bias), TypeError, r"q, k and v must have one dtype"),
        ((q, k, v.bfloat16(), allowed, bias), TypeError, r"v torch\.bfloat16; cast k and v with k\.to\(q\.dtype\)"),
    ]
    for args, error, message in cases:
        with pytest.raises(error, match=message):
            attend(*args)
    # Under autocast the mix is autocast's to cast, as for SDPA (bf16 queries beside a float32 cache).
    with torch.autocast("cpu", dtype=torch.bfloat16):
        for extra in (None, bias):
            out, _ = attend(q.bfloat16(), k, v, allowed, extra)
            assert out.dtype == torch.bfloat16 and out.shape == q.shape
            with pytest.raises(TypeError, match="float64 beside others under it too"):  # autocast never casts it
                attend(q, k.double(), v, allowed, extra)


def test_causal_mask_refuses_by_name_what_would_give_queries_no_key_or_fail_in_torch() -> None:
    ids = torch.tensor([0, 0, 1, 1, 1])
    assert torch.equal(causal_mask(3, 5, "cpu", ids), causal_mask(3, 5, "cpu", ids[None]))
    assert causal_mask(0, 0, "cpu").shape == (0, 0) and causal_mask(0, 4, "cpu").shape == (0, 4)
    cases = [
        ((5, 3, "cpu"), ValueError, r"q_len=5 must be <= k_len=3: the queries are the last q_len of the keys"),
        ((-1, 3, "cpu"), ValueError, r"q_len must be an integer >= 0, got -1"),
        ((2.0, 3, "cpu"), ValueError, r"q_len must be an integer >= 0, got 2\.0; pass the int 2"),
        ((3, 5, "cpu", ids[:4]), ValueError, r"must be \(k_len,\) or \(b or 1, k_len\) with k_len=5.* got \(4,\)"),
        ((3, 5, "cpu", ids[None, None]), ValueError, r"got \(1, 1, 5\)"),
        ((3, 5, "cpu", ids.float()), TypeError, r"document_ids"),
    ]
    for args, error, message in cases:
        with pytest.raises(error, match=message):
            causal_mask(*args)
    # Traced, sizes are 0-d tensors: taken as they were.
    rows = ids[None]
    traced = torch.jit.trace(lambda x, d: causal_mask(x.shape[1], d.shape[1], x.device, d), (torch.zeros(1, 3), rows))
    assert torch.equal(traced(torch.zeros(1, 3), rows), causal_mask(3, 5, "cpu", rows))


def test_attend_takes_every_mask_and_bias_that_broadcasts_as_its_whole_shape() -> None:
    """torch's broadcasting, as before the checks: an encoding's bias(s, t, offset) is (h, s, t), a padding mask
    (b, 1, 1, t)."""
    torch.manual_seed(0)
    b, h, s, t, d = 2, 3, 5, 7, 4
    q, k, v = torch.randn(b, h, s, d), torch.randn(b, h, t, d), torch.randn(b, h, t, d)
    allowed = causal_mask(s, t, q.device) & (torch.rand(b, 1, 1, t) > 0.2)
    allowed[..., 0] = True  # a key for every query
    whole = allowed.expand(b, h, s, t)
    alibi = posenc.ALiBi(h)
    shared = alibi.bias(s, t, offset=t - s)  # (h, s, t)
    assert shared.shape == (h, s, t)
    for bias in (shared, shared[None], torch.randn(b, 1, s, t), torch.randn(1, h, 1, t), torch.randn(b, h, s, 1), None):
        want = None if bias is None else bias.expand(b, h, s, t)
        for need_probs in (False, True):
            got = attend(q, k, v, allowed, bias, need_probs=need_probs)
            full = attend(q, k, v, whole, want, need_probs=need_probs)
            assert torch.equal(got[0], full[0])
    # The layer's bias from the same ALiBi, for positions t - s .. t - 1 of t keys: equal to the shared one.
    score = alibi.score_bias(torch.arange(t - s, t)[None], torch.arange(t)[None])
    assert torch.equal(attend(q, k, v, allowed, shared)[0], attend(q, k, v, allowed, score)[0])


def test_attend_honours_a_square_mask_that_is_not_causal() -> None:
    """SDPA's is_causal (the layer's own causal_mask, s == t) ignored a caller's (s, s) mask: an all-True one
    attended causally without an error."""
    torch.manual_seed(0)
    q, k, v = torch.randn(3, 1, 2, 5, 4).unbind()
    every = torch.ones(5, 5, dtype=torch.bool)
    causal = causal_mask(5, 5, q.device)
    for mask in (every, causal):
        scores = (q.double() @ k.double().transpose(-1, -2) / 2).masked_fill(~mask, float("-inf"))
        want = scores.softmax(-1) @ v.double()
        assert_close(attend(q, k, v, mask, None)[0], want)
        assert_close(attend(q, k, v, mask, None, need_probs=True)[0], want)


def test_attend_refuses_a_query_that_may_attend_no_key() -> None:
    """A row of False had no softmax: SDPA gave it zeros and need_probs NaN, with nothing said, so the answer hung
    on an option. Refused eagerly, and in a compiled graph by an assert that runs with it."""
    torch.manual_seed(0)
    q, k, v = torch.randn(3, 2, 1, 3, 4).unbind()
    blind = causal_mask(3, 3, q.device).clone()
    blind[1] = False
    bias = posenc.build("alibi", 1).bias(3, 3)
    for extra in ({}, {"need_probs": True}):
        for mask in (blind, blind.expand(2, 1, 3, 3)):
            with pytest.raises(ValueError, match="allowed leaves a query with no key"):
                attend(q, k, v, mask, None, **extra)
            with pytest.raises(ValueError, match="allowed leaves a query with no key"):
                attend(q, k, v, mask, bias, **extra)
    with pytest.raises(ValueError, match="allowed leaves a query with no key"):
        attend(q, k[:, :, :0], v[:, :, :0], torch.ones(3, 1, dtype=torch.bool), None)
    compiled = torch.compile(lambda m: attend(q, k, v, m, None)[0], backend="eager", fullgraph=True)
    with pytest.raises(RuntimeError, match="allowed leaves a query with no key"):
        compiled(blind)
    assert_close(compiled(causal_mask(3, 3, q.device)), attend(q, k, v, causal_mask(3, 3, q.device), None)[0])
    # No queries: nothing to refuse.
    assert attend(q[:, :, :0], k, v, causal_mask(0, 3, q.device), None)[0].shape == (2, 1, 0, 4)
    # A mask batched by vmap has no values to read there: attended as before, not refused by torch's "data-dependent
    # control flow" error; a plain mask beside vmapped q is still checked.
    masks = causal_mask(3, 3, q.device).expand(5, 3, 3)
    batched = torch.func.vmap(lambda m: attend(q, k, v, m, None)[0])(masks)
    assert torch.equal(batched[2], attend(q, k, v, causal_mask(3, 3, q.device), None)[0])
    with pytest.raises(ValueError, match="allowed leaves a query with no key"):
        torch.func.vmap(lambda x: attend(x, k, v, blind, None)[0])(q.expand(5, *q.shape))
    # Under grad alone the mask's values are readable: still refused.
    with pytest.raises(ValueError, match="allowed leaves a query with no key"):
        torch.func.grad(lambda x: attend(x, x, x, (x[0, 0, :, :1] > 1e9).expand(3, 3), None)[0].sum())(q)


def test_a_step_past_the_int64_limit_says_the_position_wrapped() -> None:
    """The step after a cached position 2**63 - 1 wraps negative, and the layer said only "got a negative entry"."""
    attention, cache = CausalSelfAttention(16, 2, encoding=posenc.build("rope", 8)), KVCache()
    attention(torch.randn(1, 2, 16), cache=cache, positions=torch.tensor([2**63 - 3, 2**63 - 2]))
    assert cache.next_positions(1).tolist() == [[2**63 - 1]]
    with pytest.raises(ValueError, match=r"wrap negative past 2\*\*63 - 1"):
        attention(torch.randn(1, 2, 16), cache=cache)
    with pytest.raises(ValueError, match=r"wrap negative past 2\*\*63 - 1"):
        cache.update(torch.randn(1, 2, 2, 4), torch.randn(1, 2, 2, 4), torch.tensor([[-(2**63), -(2**63) + 1]]))
    # A negative position of the caller's own, far from the limit: no word of wrapping.
    own = r"got a negative entry; number the tokens from 0 \(posenc\.[a-z_]+ for [a-z ]+\)$"
    with pytest.raises(ValueError, match=own):
        KVCache().update(torch.randn(1, 2, 1, 4), torch.randn(1, 2, 1, 4), torch.tensor([[-1]]))


def test_update_rotating_names_an_encoding_that_is_not_a_rope() -> None:
    # AttributeError: 'ALiBi' object has no attribute 'call_scaling_length' before.
    for encoding in (posenc.ALiBi(2), "rope"):
        with pytest.raises(TypeError, match="update_rotating rotates keys with a RoPE"):
            KVCache().update_rotating(torch.randn(1, 1, 2, 4), torch.randn(1, 1, 2, 4), torch.arange(2)[None], encoding)


def test_a_cache_left_empty_by_a_refused_step_serves_another_layer() -> None:
    """Layer a is refused before it adds anything: the cache stays empty, and layer b may fill it and continue."""
    a, b = (CausalSelfAttention(16, 2, encoding=posenc.build("rope", 8)) for _ in range(2))
    cache = KVCache()
    with pytest.raises(ValueError, match="positions must be >= 0"):
        a(torch.randn(1, 3, 16), cache=cache, positions=torch.tensor([-1, 0, 1]))
    assert cache.length == 0
    b(torch.randn(1, 3, 16), cache=cache)
    b(torch.randn(1, 1, 16), cache=cache)
    assert cache.length == 4


@pytest.mark.parametrize("name", ["t5", "nope", "alibi", "rope"])
def test_negative_positions_are_refused_by_every_encoding(name) -> None:
    layer = CausalSelfAttention(16, 2, encoding=posenc.build_for_model(name, dim=16, num_heads=2, head_dim=8,
                                                                      max_positions=16))  # fmt: skip
    with pytest.raises(ValueError, match="positions must be >= 0"):
        layer(torch.randn(1, 3, 16), positions=torch.tensor([-1, 0, 1]))


def test_a_consistent_step_below_the_cached_maximum_rotates_for_the_whole_sequence() -> None:
    """'consistent' mode rotates every key and query for max(all positions) + 1, the length the full pass scales for:
    a step whose position lies below the cached maximum (ids out of order) is scaled for the whole sequence, not for
    its own position + 1 (whose frequencies differ here: dynamic NTK scales past 4)."""
    torch.manual_seed(0)
    dynamic = {"rope_type": "dynamic", "factor": 2.0}
    rope = posenc.RoPE(HEAD_DIM, rope_parameters=dynamic, max_position_embeddings=4, mode="consistent")
    attn = CausalSelfAttention(DIM, HEADS, num_kv_heads=KV_HEADS, encoding=rope).double()
    x = torch.randn(1, 11, DIM, dtype=torch.float64)
    positions = torch.tensor([[0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 6]])
    full = attn(x, positions=positions)
    cache = KVCache()
    prefill = attn(x[:, :10], positions=positions[:, :10], cache=cache)
    step = attn(x[:, 10:], positions=positions[:, 10:], cache=cache)
    torch.testing.assert_close(torch.cat((prefill, step), dim=1), full, atol=1e-12, rtol=1e-12)


def test_a_consistent_rope_refuses_a_cache_whose_keys_it_did_not_keep_unrotated() -> None:
    """A cache built from rotated keys holds none unrotated to re-rotate: a 'consistent' dynamic RoPE refuses it
    rather than starting over from the new tokens (which would drop every cached key without a word)."""
    dynamic = {"rope_type": "dynamic", "factor": 2.0}
    rope = posenc.RoPE(HEAD_DIM, rope_parameters=dynamic, max_position_embeddings=4, mode="consistent")
    attn = CausalSelfAttention(DIM, HEADS, encoding=rope)
    k = torch.randn(1, HEADS, 3, HEAD_DIM)
    cache = KVCache(k=k, v=k.clone(), positions=torch.arange(3)[None])
    with pytest.raises(ValueError, match="holds keys rotated by another encoding; start a new KVCache"):
        attn(torch.randn(1, 1, DIM), cache=cache)
    assert cache.length == 3 and cache.k is k


def test_cache_update_refuses_keys_and_positions_on_different_devices() -> None:
    """KVCache.update checks the devices of what it is handed (meta keys stand in for CUDA ones here): keys on one
    device and positions on another would be cached apart and fail at a later step, far from the cause."""
    cache = KVCache()
    k = torch.empty(1, 2, 3, 8, device="meta")
    with pytest.raises(ValueError, match="k, v and positions must be on one device, got meta, meta and cpu"):
        cache.update(k, k, torch.arange(3)[None])
    assert cache.length == 0


@pytest.mark.parametrize("name", posenc.available())
def test_a_cropped_cache_continues_as_if_the_dropped_tokens_were_never_fed(name):
    """Speculative decoding: a draft of 4 tokens fed, 1 kept; then other tokens. Equal to a full forward of what
    was kept and what came after, with the positions following the kept ones."""
    torch.manual_seed(0)
    encoding = make_encoding(name).double()
    attn = layer_for(encoding, num_kv_heads=KV_HEADS)
    x, draft = torch.randn(2, 9, DIM, dtype=torch.float64), torch.randn(2, 4, DIM, dtype=torch.float64)
    cache = KVCache()
    first = run(attn, encoding, x[:, :5], torch.arange(5)[None], cache)
    run(attn, encoding, draft, cache.next_positions(4), cache)
    cache.crop(-3)  # the draft's first token kept
    assert cache.length == 6 and cache.next_positions(1).tolist() == [[6]]
    rest = [run(attn, encoding, x[:, i : i + 1], cache.next_positions(1), cache) for i in range(5, 9)]
    kept = torch.cat((x[:, :5], draft[:, :1], x[:, 5:]), dim=1)
    full = run(attn, encoding, kept, torch.arange(10)[None])
    got = torch.cat((first, full[:, 5:6], *rest), dim=1)
    torch.testing.assert_close(got[:, :5], full[:, :5], atol=1e-12, rtol=1e-12)
    torch.testing.assert_close(got[:, 6:], full[:, 6:], atol=1e-12, rtol=1e-12)


@pytest.mark.parametrize("rope_type", ["dynamic", "longrope"])
def test_a_consistent_cache_cropped_back_below_the_switch_rotates_for_the_kept_length(rope_type):
    """Grown past the trained length (scaled frequencies) and cropped back below it: the next step's keys and
    query use the frequencies of the kept sequence, as a full forward of it does."""
    torch.manual_seed(0)
    parameters = {"rope_type": "dynamic", "factor": 2.0}
    if rope_type == "longrope":
        half = HEAD_DIM // 2
        parameters = {"rope_type": "longrope", "long_factor": [2.0] * half, "short_factor": [1.0] * half}
        parameters["original_max_position_embeddings"] = 4
    rope = posenc.RoPE(HEAD_DIM, rope_parameters=parameters, max_position_embeddings=4, mode="consistent").double()
    attn = CausalSelfAttention(DIM, HEADS, num_kv_heads=KV_HEADS, encoding=rope).double()
    x = torch.randn(1, 9, DIM, dtype=torch.float64)
    cache = KVCache()
    attn(x, positions=torch.arange(9)[None], cache=cache)  # 9 > 4: scaled
    cache.crop(3)
    step = attn(x[:, 3:4], positions=cache.next_positions(1), cache=cache)  # length 4: not scaled
    full = attn(x[:, :4], positions=torch.arange(4)[None])
    torch.testing.assert_close(step, full[:, 3:], atol=1e-12, rtol=1e-12)


def test_a_cache_keeps_its_own_document_ids_checks_them_and_is_hashed_by_identity():
    torch.manual_seed(0)
    layer = CausalSelfAttention(32, 4, encoding=posenc.RoPE(8))
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])
    cache = KVCache()
    layer(torch.randn(2, 5, 32), cache=cache, document_ids=mask)
    mask.fill_(1)  # the caller's buffer, refilled: the cache had kept it, and row 0 then attended its pads
    assert cache.document_ids.tolist() == [[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]]
    # update() itself refuses an id that comes back, as a forward call does.
    direct, k = KVCache(), torch.randn(1, 2, 3, 8)
    direct.update(k, k, torch.tensor([[0, 1, 2]]), document_ids=torch.tensor([[0, 0, 1]]))
    with pytest.raises(ValueError, match="each document one run of tokens"):
        direct.update(k, k, torch.tensor([[3, 4, 5]]), document_ids=torch.tensor([[0, 0, 0]]))
    assert direct.length == 3 and direct.document_ids.tolist() == [[0, 0, 1]]
    with pytest.raises(ValueError, match="document_ids must be on the keys' device cpu, got meta"):
        meta_ids = torch.zeros(1, 3, dtype=torch.long, device="meta")
        KVCache().update(k, k, torch.tensor([[0, 1, 2]]), document_ids=meta_ids)
    # Refused before the encoding ran: a dynamic 'hf' RoPE's scaled length had advanced to 7, and the next valid step
    # scaled for it.
    rope = posenc.RoPE(8, rope_parameters={"rope_type": "dynamic", "factor": 2.0}, max_position_embeddings=4)
    dynamic, held = CausalSelfAttention(32, 4, encoding=rope), KVCache()
    dynamic(torch.randn(1, 5, 32), cache=held, document_ids=torch.tensor([[0, 1, 1, 1, 1]]))
    state = rope.hf_scaled_len
    with pytest.raises(ValueError, match="each document one run of tokens"):
        dynamic(torch.randn(1, 4, 32), cache=held, document_ids=torch.tensor([[1, 1, 1, 0]]))
    assert rope.hf_scaled_len == state and held.length == 5
    with torch.autocast("cpu", dtype=torch.bfloat16), pytest.raises(TypeError, match=r"holds torch\.float32 keys"):
        dynamic(torch.randn(1, 3, 32), cache=held, document_ids=torch.ones(1, 3, dtype=torch.long))  # another dtype
    assert rope.hf_scaled_len == state and held.length == 5
    # The constructor keeps a copy too.
    ids = torch.tensor([[0, 0, 1]])
    built = KVCache(k=k, v=k, positions=torch.tensor([[0, 1, 2]]), document_ids=ids)
    ids.fill_(1)
    assert built.document_ids.tolist() == [[0, 0, 1]]
    # Identity, not dataclass field equality: hashable, and == never compares tensors.
    assert len({cache, direct}) == 2 and cache != direct and cache == cache
    with pytest.raises(ValueError, match="drops tokens from an empty KVCache, which holds none to drop"):
        KVCache().crop(-1)


def test_a_deep_copy_of_a_cropped_cache_holds_only_the_kept_tokens():
    """crop keeps views of the cached tensors (as DynamicCache.crop does), and a deep copy (a beam, a branch from a
    shared prefix) copied the views' whole storage: a cache of 4096 tokens cropped to 16 gave every copy the keys
    and values of 4096 tokens. Copies hold their own kept tokens, and continue as the cache does."""
    torch.manual_seed(0)
    attn = CausalSelfAttention(DIM, HEADS, encoding=posenc.RoPE(HEAD_DIM)).double()
    x = torch.randn(1, 4096, DIM, dtype=torch.float64)
    cache = KVCache()
    with torch.no_grad():
        attn(x, cache=cache)
        cache.crop(16)
        branch = copy.deepcopy(cache)
        for name in ("k", "v", "positions"):
            held, kept = getattr(branch, name), getattr(cache, name)
            assert held.untyped_storage().nbytes() == kept.nbytes and torch.equal(held, kept)
        torch.testing.assert_close(attn(x[:, 16:17], cache=branch), attn(x[:, 16:17], cache=cache), atol=0, rtol=0)
        # Tensors shared before the copy are shared after it, as deepcopy does: a shallow branch copied with its
        # cache is not a second copy of the keys.
        twin, shallow = copy.deepcopy((cache, copy.copy(cache)))
        assert all(getattr(twin, name) is getattr(shallow, name) for name in ("k", "v", "positions"))


def test_crop_keeps_drops_and_refuses_as_transformers_does():
    cache = KVCache()
    cache.crop(0)  # an empty cache: nothing to drop
    k = torch.randn(1, 2, 5, 4)
    cache.update(k, k, torch.arange(5)[None])
    cache.crop(7)  # past the length: unchanged, as DynamicCache.crop
    assert cache.length == 5
    with pytest.raises(ValueError, match=r"length=-6 drops more tokens than this KVCache holds \(5\); pass 0..5"):
        cache.crop(-6)
    with pytest.raises(TypeError, match="length must be an int"):
        cache.crop(2.0)
    with pytest.raises(TypeError, match="length must be an int"):
        cache.crop(True)  # not 1
    cache.crop(np.int64(-5))
    assert cache.length == 0 and cache.k is None and cache.next_positions(2).tolist() == [[0, 1]]


def test_crop_to_zero_empties_a_consistent_cache_as_if_nothing_was_fed():
    """crop(0) keeps no token (not all of them, as a negative length's count from the end would): a consistent
    cache's unrotated keys and their frequencies go with the rest, and decoding starts over from position 0."""
    torch.manual_seed(0)
    rope = posenc.RoPE(HEAD_DIM, rope_parameters={"rope_type": "dynamic", "factor": 2.0}, max_position_embeddings=4,
                       mode="consistent").double()  # fmt: skip
    attn = CausalSelfAttention(DIM, HEADS, num_kv_heads=KV_HEADS, encoding=rope).double()
    x = torch.randn(1, 6, DIM, dtype=torch.float64)
    cache = KVCache()
    attn(x, positions=torch.arange(6)[None], cache=cache)  # 6 > 4: scaled
    cache.crop(0)
    assert cache.length == 0 and cache.unrotated_k is None and cache.rotated_with is None
    step = attn(x[:, :3], positions=cache.next_positions(3), cache=cache)
    torch.testing.assert_close(step, attn(x[:, :3], positions=torch.arange(3)[None]), atol=0, rtol=0)


def test_a_layer_with_float32_weights_takes_bf16_x_under_autocast():
    # Autocast casts the projections' inputs itself: x in another dtype than the weights is refused outside it only.
    attn = CausalSelfAttention(DIM, HEADS, encoding=posenc.RoPE(HEAD_DIM))
    x = torch.randn(1, 5, DIM, dtype=torch.bfloat16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert attn(x).dtype == torch.bfloat16
    with pytest.raises(TypeError, match=r"x is torch\.bfloat16 but the layer's weights are torch\.float32"):
        attn(x)


@pytest.mark.parametrize("name", ["alibi", "t5", "rope"])
def test_biased_attention_and_probabilities_stay_float32_under_autocast(name):
    """A score bias is attended in float32 and the probabilities are float32; autocast cast the matmuls and SDPA
    (its attn_mask, the bias) back to bf16, and the probabilities under autocast were off by ~4e-3 from those of the
    same bf16 q/k/v outside it. Now autocast changes nothing in them: the projections alone run in bf16."""
    torch.manual_seed(0)
    encoding = posenc.build_for_model(name, dim=DIM, num_heads=HEADS, head_dim=HEAD_DIM, max_positions=64)
    q, k, v = (torch.randn(2, HEADS, 12, HEAD_DIM).bfloat16() for _ in range(3))
    positions = torch.arange(12)[None]
    bias = encoding.score_bias(positions, positions) if name != "rope" else None
    allowed = torch.ones(12, 12, dtype=torch.bool).tril()
    for need_probs in (True, False):
        if bias is None and not need_probs:
            continue  # attended in the activations' dtype, as autocast would have it
        expected = attend(q, k, v, allowed, bias, need_probs=need_probs)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            got = attend(q, k, v, allowed, bias, need_probs=need_probs)
        for g, e in zip(got, expected, strict=True):
            if e is not None:
                assert g.dtype == e.dtype
                assert torch.equal(g, e)


def test_dtype_mismatch_on_the_meta_device_is_named():
    """Shape inference on the meta device with x in another dtype than the weights: posenc's TypeError, not
    torch's 'unknown device type for autocast' from asking whether autocast was on for meta."""
    with torch.device("meta"):
        attn = CausalSelfAttention(16, 2, encoding=posenc.RoPE(head_dim=8))
    with pytest.raises(TypeError, match=r"x is torch\.bfloat16 but the layer's weights are torch\.float32"):
        attn(torch.empty(1, 3, 16, device="meta", dtype=torch.bfloat16))
