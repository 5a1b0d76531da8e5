"""apply_rotary and RoPE against the float64 reference, and the properties of a rotation."""

from __future__ import annotations

import copy
import math
import pickle

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import posenc
from posenc.rope.module import angles_to_cos_sin
from posenc.testing import DTYPES, assert_close, random_qk, rope_inv_freq_reference, rope_reference


def half_to_full_perm(rotary_dim: int) -> list[int]:
    """Channel order that turns a split-half layout into an interleaved one: pair i is (i, i + r/2)."""
    half = rotary_dim // 2
    return [c for i in range(half) for c in (i, i + half)]


@pytest.mark.parametrize("dtype", [torch.float64, *DTYPES])
@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize(("head_dim", "rotary_dim"), [(64, 64), (80, 32), (7, 4), (33, 32), (2, 2)])
@pytest.mark.parametrize("seq", [1, 7, 217])
def test_rope_module_matches_reference(dtype, interleaved, head_dim, rotary_dim, seq):
    rope = posenc.RoPE(head_dim, rotary_dim=rotary_dim, interleaved=interleaved, base=10000.0)
    q, k = random_qk(2, 4, 2, seq, head_dim, dtype=dtype)
    q_out, k_out = rope(q, k)
    positions = torch.arange(seq)[:, None]  # broadcast over (b, h, s) -> position per s
    for out, x in ((q_out, q), (k_out, k)):
        assert out.dtype == dtype and out.shape == x.shape
        ref = rope_reference(x, positions.squeeze(-1), rotary_dim=rotary_dim, interleaved=interleaved)
        assert_close(out, ref)


@pytest.mark.parametrize("dtype", DTYPES)
def test_large_positions_stay_exact(dtype):
    # bf16/fp16 positions cannot even represent 2**20 - 1; float32 angles would be off by ~0.06 rad there.
    rope = posenc.RoPE(128)
    q, k = random_qk(1, 2, 1, 3, 128, dtype=dtype)
    positions = torch.tensor([2**20 - 1, 2**20 - 2, 12345])
    q_out, _ = rope(q, k, positions=positions)
    assert_close(q_out, rope_reference(q, positions))


def test_float64_angles_at_far_positions_err_as_the_readme_says():
    """README, Precision: the float64 angle is off by about position * 2^-53, within the float32 tolerance up to about
    2^33, past it at 2^35, and 4e-5 to 1.7e-4 at 2^40 (it said 'up to about 2^35' and '4e-5 at 2^40', the least of
    the errors there, against 50-digit cos/sin)."""
    import mpmath  # torch's own dependency (through sympy)

    mpmath.mp.dps = 50
    atol, rtol = posenc.testing.TOLERANCES[torch.float32]

    def worst(exponent: int, base: float) -> float:
        rope = posenc.RoPE(128, base=base)
        positions = [2**exponent - 1, 2**exponent + 12345, int(2**exponent * 1.37)]
        cos, sin = rope.cos_sin(torch.tensor(positions), dtype=torch.float64)
        errors = []
        for row, position in enumerate(positions):
            for i in range(64):
                angle = position * mpmath.mpf(base) ** (-mpmath.mpf(2 * i) / 128)
                errors.append(abs(cos[row, i].item() - mpmath.cos(angle)))
                errors.append(abs(sin[row, i].item() - mpmath.sin(angle)))
        return float(max(errors))

    bases = (1e4, 5e8)
    assert max(worst(33, base) for base in bases) <= atol + rtol
    assert max(worst(35, base) for base in bases) > atol + rtol
    at_40 = [worst(40, base) for base in bases]
    assert min(at_40) >= 4e-5 and max(at_40) <= 1.7e-4


def test_apply_rotary_half_sized_cos_sin_and_partial_channels_untouched():
    x = torch.randn(2, 3, 5, 10)
    angles = torch.randn(5, 3)
    out = posenc.apply_rotary(x, angles.cos(), angles.sin())
    assert torch.equal(out[..., 6:], x[..., 6:])
    ref = rope_reference(x, torch.zeros(5), rotary_dim=6, inv_freq=[1.0, 1.0, 1.0])  # identity
    assert not torch.allclose(out.double(), ref)  # a real rotation happened
    # Rotating back (conjugate) returns the input.
    back = posenc.apply_rotary(out, angles.cos(), angles.sin(), conjugate=True)
    assert_close(back, x.double())


def test_the_reference_takes_its_rotary_dim_from_the_frequencies_it_is_given():
    # With inv_freq and no rotary_dim it paired channel i with i + d/2 across the whole head (off by 3.3 here).
    rope = posenc.RoPE(10, rotary_dim=6)
    x = torch.randn(1, 1, 4, 10, dtype=torch.float64)
    inv_freq, _ = rope.frequencies()
    torch.testing.assert_close(rope(x, x)[0], rope_reference(x, torch.arange(4), inv_freq=inv_freq))
    with pytest.raises(ValueError, match="inv_freq has 3 frequencies but rotary_dim=8 needs 4"):
        rope_reference(x, torch.arange(4), inv_freq=inv_freq, rotary_dim=8)
    with pytest.raises(ValueError, match="rotary_dim must be even"):
        rope_reference(x, torch.arange(4), rotary_dim=5)


def test_apply_rotary_does_not_modify_input():
    x = torch.randn(1, 2, 4, 8)
    before = x.clone()
    angles = torch.randn(4, 4)
    posenc.apply_rotary(x, angles.cos(), angles.sin(), interleaved=True)
    assert torch.equal(x, before)


@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
def test_layouts_agree(layout):
    rope = posenc.RoPE(16)
    q, k = random_qk(2, 4, 2, 9, 16, layout="bhsd")
    q_ref, k_ref = rope(q, k)
    if layout == "bshd":
        q_out, k_out = rope(q.transpose(1, 2), k.transpose(1, 2), layout="bshd")
        q_out, k_out = q_out.transpose(1, 2), k_out.transpose(1, 2)
    else:
        q_out, k_out = rope(q, k)
    assert torch.equal(q_out, q_ref) and torch.equal(k_out, k_ref)


def test_positions_forms_agree():
    rope = posenc.RoPE(8)
    q, k = random_qk(3, 2, 2, 5, 8)
    default = rope(q, k)
    explicit = rope(q, k, positions=torch.arange(5))
    assert all(torch.equal(a, b) for a, b in zip(default, explicit, strict=True))
    # An integer offset equals positions offset..offset+s-1, and per-batch offsets pick per-row positions.
    shifted = rope(q, k, offset=11)
    assert torch.equal(shifted[0], rope(q, k, positions=torch.arange(11, 16))[0])
    offsets = torch.tensor([0, 3, 100])
    per_batch = rope(q, k, offset=offsets)
    for i, off in enumerate(offsets.tolist()):
        assert torch.equal(per_batch[0][i], rope(q[i : i + 1], k[i : i + 1], offset=off)[0][0])


@pytest.mark.parametrize(
    "rope_parameters",
    [
        {"rope_type": "default"},
        {"rope_type": "linear", "factor": 4.0},
        {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64},
        {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
    ],
)
@pytest.mark.parametrize("dtype", [torch.float64, *DTYPES])
@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
@pytest.mark.parametrize("interleaved", [False, True])
def test_table_read_equals_gathered_cos_sin(rope_parameters, dtype, layout, interleaved):
    """With frequencies that do not depend on the length, RoPE hands the kernels its cached table and the tokens'
    positions (an int offset: a slice of it). That reads the same float values as cos/sin gathered per token first
    and passed for broadcasting, so the results agree bit for bit, partial rotation included."""
    rope = posenc.RoPE(12, rotary_dim=8, interleaved=interleaved, rope_parameters=rope_parameters)
    q, k = random_qk(2, 4, 2, 9, 12, dtype=dtype, layout=layout)
    ids = torch.tensor([[3, 1, 4, 1, 5, 9, 2, 6, 5], [0, 1, 2, 3, 0, 1, 2, 3, 4]])
    calls = [
        ({"offset": 0}, torch.arange(9)[None]),
        ({"offset": 37}, torch.arange(37, 46)[None]),
        ({"offset": torch.tensor(37)}, torch.arange(37, 46)[None]),
        ({"positions": ids, "offset": torch.tensor([11])}, ids + 11),
        ({"offset": torch.tensor([5, 70])}, torch.arange(9) + torch.tensor([[5], [70]])),
        ({"positions": ids[0]}, ids[:1]),
        ({"positions": ids, "offset": 11}, ids + 11),
        ({"positions": ids, "offset": torch.tensor([0, 3])}, ids + torch.tensor([[0], [3]])),
        # Negative ids that the offsets lift to valid rows: the cheap bounds cannot tell, the full check runs.
        ({"positions": ids - 3, "offset": torch.tensor([3, 5])}, ids + torch.tensor([[0], [2]])),
    ]
    head_axis = 1 if layout == "bhsd" else 2
    table_dtype = torch.float64 if dtype == torch.float64 else torch.float32
    for kwargs, positions in calls:
        cos, sin = (t.unsqueeze(head_axis) for t in rope.cos_sin(positions, dtype=table_dtype))
        expected = posenc.apply_rotary_qk(q, k, cos, sin, interleaved=interleaved)
        got = rope(q, k, layout=layout, **kwargs)
        assert all(torch.equal(a, b) for a, b in zip(got, expected, strict=True)), kwargs


@settings(max_examples=30, deadline=None)
@given(
    batch=st.integers(1, 3),
    seq=st.integers(1, 40),
    how=st.sampled_from(["int", "per_sequence", "ids", "ids+int", "ids+per_sequence"]),
    layout=st.sampled_from(["bhsd", "bshd"]),
    interleaved=st.booleans(),
    backend=st.sampled_from(["auto", "torch"]),
    seed=st.integers(0, 2**16),
)
def test_rope_table_path_equals_gathered_cos_sin_for_any_positions(batch, seq, how, layout, interleaved, backend, seed):
    """Property form of the test above: any batch, length and way of giving positions, on both backends."""
    gen = torch.Generator().manual_seed(seed)
    rope = posenc.RoPE(10, rotary_dim=8, interleaved=interleaved, backend=backend)
    q, k = random_qk(batch, 3, 1, seq, 10, layout=layout, seed=seed)
    offsets = torch.randint(0, 500, (batch,), generator=gen)
    ids = torch.randint(0, 300, (batch, seq), generator=gen)
    kwargs, positions = {
        "int": ({"offset": int(offsets[0])}, torch.arange(seq)[None] + int(offsets[0])),
        "per_sequence": ({"offset": offsets}, torch.arange(seq)[None] + offsets[:, None]),
        "ids": ({"positions": ids}, ids),
        "ids+int": ({"positions": ids[0], "offset": 7}, ids[:1] + 7),
        "ids+per_sequence": ({"positions": ids, "offset": offsets}, ids + offsets[:, None]),
    }[how]
    head_axis = 1 if layout == "bhsd" else 2
    cos, sin = (t.unsqueeze(head_axis) for t in rope.cos_sin(positions))
    expected = posenc.apply_rotary_qk(q, k, cos, sin, interleaved=interleaved, backend=backend)
    got = rope(q, k, layout=layout, **kwargs)
    assert all(torch.equal(a, b) for a, b in zip(got, expected, strict=True))


@pytest.mark.parametrize("rope_type", ["default", "yarn"])
def test_rope_with_position_tensors_compiles_without_graph_breaks(rope_type):
    """Packed position ids and per-sequence offsets under torch.compile(fullgraph=True): no data-dependent step
    (no table sized by the largest position, no range check), the same values as eager. A tracing check: AOT
    Autograd's eager backend runs the graph Inductor would be given (Inductor's code for a positions gather and its
    assert: test_negative_positions_are_refused_under_torch_compile_too)."""
    params = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32} if rope_type == "yarn" else {}
    rope = posenc.RoPE(16, rotary_dim=12, rope_parameters=params or None)
    q, k = random_qk(2, 4, 2, 7, 16)
    ids = torch.tensor([[3, 1, 4, 1, 5, 9, 2], [0, 1, 2, 3, 0, 1, 2]])
    offsets = torch.tensor([5, 70])
    compiled = torch.compile(lambda q, k, p, o: rope(q, k, positions=p, offset=o), fullgraph=True, backend="aot_eager")
    for got, want in zip(compiled(q, k, ids, offsets), rope(q, k, positions=ids, offset=offsets), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


def test_negative_positions_are_refused_under_torch_compile_too():
    """Compiled code cannot read positions on the host, so an assert runs with the graph: without it the torch
    path's gather wrapped a negative position to the table's last rows, and RoPE, ALiBi and T5 rotated or biased by
    negative positions, where eager raises. Inductor compiles the table's gather and its assert (the assert must
    survive Inductor's code generation); the other calls assert with the same op (posenc._checks.assert_without_sync)
    and are traced by AOT Autograd's eager backend, which runs the graph Inductor would be given."""
    torch.manual_seed(0)
    ang = torch.arange(8.0)[:, None] * torch.tensor([1.0, 0.1])
    cos, sin = ang.cos(), ang.sin()
    q, k = random_qk(1, 2, 1, 4, 4)
    ids, bad_ids, bad_offset = torch.tensor([0, 1, 2, 3]), torch.tensor([0, 1, 2, -1]), torch.tensor([-3])
    table_call = torch.compile(lambda x, kw: posenc.apply_rotary(x, cos, sin, backend="torch", **kw), fullgraph=True)
    torch.testing.assert_close(table_call(q, {"positions": ids}), posenc.apply_rotary(q, cos[:4], sin[:4]))
    for kwargs in ({"positions": bad_ids}, {"positions": ids, "offset": bad_offset}):
        with pytest.raises(RuntimeError, match="positions must be rows of the cos/sin table"):
            table_call(q, kwargs)
    rope = posenc.RoPE(4)
    compiled_rope = torch.compile(lambda q, k, kw: rope(q, k, **kw), fullgraph=True, backend="aot_eager")
    for kwargs in ({"positions": bad_ids}, {"offset": bad_offset}, {"positions": ids + 5, "offset": bad_offset}):
        with pytest.raises(ValueError, match="must be >= 0"):
            rope(q, k, **kwargs)
        with pytest.raises(RuntimeError, match=r"(positions|offset) must be >= 0"):
            compiled_rope(q, k, kwargs)
    for encoding in (posenc.ALiBi(2), posenc.T5Bias(2, num_buckets=8, max_distance=16)):
        layer = posenc.CausalSelfAttention(8, 2, encoding=encoding)
        x = torch.randn(1, 4, 8)
        with pytest.raises(RuntimeError, match="positions must be >= 0"):
            torch.compile(layer, backend="aot_eager")(x, positions=bad_ids)


def test_the_torch_paths_compiled_row_check_says_what_to_do():
    """Eager and the CPU kernel under torch.compile say to build the table for more positions; the torch path's
    check in the graph said only "positions must be rows of the cos/sin table"."""
    cos, sin = torch.ones(8, 2), torch.zeros(8, 2)
    q = torch.randn(1, 2, 2, 4)
    with pytest.raises(ValueError, match="table has 8 rows; build the table for at least 9 positions"):
        posenc.apply_rotary(q, cos, sin, positions=torch.tensor([7, 8]), backend="torch")
    compiled = torch.compile(
        lambda x, p: posenc.apply_rotary(x, cos, sin, positions=p, backend="torch"), fullgraph=True, backend="aot_eager"
    )
    with pytest.raises(RuntimeError, match=r"rows of the cos/sin table .*: build the table for more positions"):
        compiled(q, torch.tensor([7, 8]))


@pytest.mark.parametrize("backend", ["auto", "torch"])
@pytest.mark.parametrize("with_ids", [False, True])
def test_a_table_built_in_inference_mode_serves_training_later(backend, with_ids):
    """A validation pass under torch.inference_mode() before training: the table RoPE caches then is an ordinary
    tensor, so a later training call can save it for backward (with the fused CPU kernel every later call failed,
    eager and compiled)."""
    rope = posenc.RoPE(8, backend=backend)
    q, k = random_qk(1, 2, 1, 5, 8)
    kwargs = {"positions": torch.arange(5)} if with_ids else {}
    with torch.inference_mode():
        rope(q, k, **kwargs)
    q = q.clone().requires_grad_()
    q_out, _ = rope(q, k, **kwargs)
    q_out.square().sum().backward()
    assert q.grad is not None and torch.isfinite(q.grad).all()


def test_empty_batch_with_per_sequence_offsets():
    rope = posenc.RoPE(8)
    q, k = torch.randn(0, 2, 5, 8), torch.randn(0, 1, 5, 8)
    for kwargs in ({"offset": torch.zeros(0, dtype=torch.long)}, {"positions": torch.arange(5), "offset": 3}):
        q_out, k_out = rope(q, k, **kwargs)
        assert q_out.shape == q.shape and k_out.shape == k.shape
    # apply_rotary reads the offsets' range on the host (RoPE has checked them): an empty batch has none to read.
    cos, sin = torch.randn(4, 4), torch.randn(4, 4)
    assert posenc.apply_rotary(q, cos, sin, offset=torch.zeros(0, dtype=torch.long)).shape == q.shape


def test_packed_positions_restart_per_document():
    # Two documents packed in one row: the second restarts at 0 and must rotate like a fresh sequence.
    rope = posenc.RoPE(8)
    q, k = random_qk(1, 2, 2, 7, 8)
    packed = torch.tensor([[0, 1, 2, 3, 0, 1, 2]])
    q_out, _ = rope(q, k, positions=packed)
    alone, _ = rope(q[:, :, 4:], k[:, :, 4:])
    assert torch.equal(q_out[:, :, 4:], alone)


def test_cache_grows_lazily_and_is_reused():
    rope = posenc.RoPE(8)
    q, k = random_qk(1, 1, 1, 4, 8)
    rope(q, k)
    size = rope._tables[(torch.device("cpu"), torch.float32)][0].shape[0]
    rope(q, k, offset=size + 10)  # past the table: it grows instead of failing
    assert rope._tables[(torch.device("cpu"), torch.float32)][0].shape[0] > size + 13
    table = rope._tables[(torch.device("cpu"), torch.float32)][0]
    rope(q, k, offset=3)
    assert rope._tables[(torch.device("cpu"), torch.float32)][0] is table


@pytest.mark.parametrize("backend", ["auto", "torch", "cpu", "triton"])
@pytest.mark.parametrize("call", [{}, {"offset": 3}, {"positions": torch.tensor([[4, 0, 2, 2, 9, 1, 3]])}])
def test_checkpointed_call_backpropagates_after_a_longer_call_grew_the_table(backend, call):
    """Activation checkpointing recomputes a call in the backward, and the non-reentrant kind checks that it saves
    tensors of the shapes the forward saved. The fused backward saves the table it reads: a longer call in between
    (a second micro-batch whose loss is summed with the first before one backward) grew the shared table, and the
    recompute raised CheckpointError on "different metadata". Each call now saves its own rows, as the torch path
    does; the gradients are those of the call without checkpointing."""
    from torch.utils.checkpoint import checkpoint

    rope = posenc.RoPE(8, backend=backend)
    w = torch.randn(8, 8, generator=torch.Generator().manual_seed(2))

    def rotated(x, options):
        q, k = rope(x @ w, x[:, :1] @ w, **options)
        return (q.sin() * k.cos()).sum()

    x = torch.randn(1, 2, 7, 8, generator=torch.Generator().manual_seed(3), requires_grad=True)
    longer = torch.randn(1, 1, 300, 8, requires_grad=True)  # past the first table's 256 rows
    loss = checkpoint(rotated, x, call, use_reentrant=False)
    checkpoint(rotated, longer, {}, use_reentrant=False)
    loss.backward()
    expected = x.detach().clone().requires_grad_()
    rotated(expected, call).backward()
    assert torch.equal(x.grad, expected.grad)


@pytest.mark.parametrize("backend", ["auto", "cpu"])
def test_checkpointed_call_with_only_k_requiring_grad_backpropagates_after_the_table_grew(backend):
    """As above, with q a constant (a cross-attention query, or keys alone trained): its rows are cut too."""
    from torch.utils.checkpoint import checkpoint

    rope = posenc.RoPE(8, backend=backend)
    q = torch.randn(1, 1, 7, 8, generator=torch.Generator().manual_seed(1))

    def rotated(x):
        return (rope(q[:, :, : x.shape[2]], x)[1].sin()).sum()

    x = torch.randn(1, 1, 7, 8, generator=torch.Generator().manual_seed(3), requires_grad=True)
    loss = checkpoint(rotated, x, use_reentrant=False)
    rope(torch.randn(1, 1, 300, 8), torch.randn(1, 1, 300, 8))  # past the first table's 256 rows
    loss.backward()
    expected = x.detach().clone().requires_grad_()
    rotated(expected).backward()
    assert torch.equal(x.grad, expected.grad)


def test_meta_device_construction():
    with torch.device("meta"):
        rope = posenc.RoPE(64)
        q = torch.empty(1, 2, 5, 64)
    out, _ = rope(q, q)
    assert out.device.type == "meta" and out.shape == q.shape


def test_position_tensors_on_the_meta_device_are_not_read():
    """The meta device has no values: position ids and per-sequence offsets there are checked for shapes only, as
    under torch.compile (reading them raised "Cannot copy out of meta tensor")."""
    x, table = torch.empty(2, 3, 5, 8, device="meta"), torch.empty(16, 4, device="meta")
    positions, offsets = torch.arange(5, device="meta"), torch.tensor([0, 3], device="meta")
    for where in ({"positions": positions}, {"offset": offsets}):
        assert posenc.apply_rotary(x, table, table, backend="torch", **where).shape == x.shape
        assert posenc.RoPE(8)(x, x[:, :1], **where)[1].shape == (2, 1, 5, 8)


def test_matches_hugging_face_llama_apply_rotary_pos_emb():
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

    config = LlamaConfig(hidden_size=256, num_attention_heads=4, rope_theta=500000.0)
    hf_rope = LlamaRotaryEmbedding(config)
    q, k = random_qk(2, 4, 4, 33, 64, seed=3)
    position_ids = torch.arange(7, 40)[None].expand(2, -1)
    cos, sin = hf_rope(q, position_ids)
    hf_q, hf_k = apply_rotary_pos_emb(q, k, cos, sin)
    rope = posenc.RoPE(64, base=500000.0)
    ours_q, ours_k = rope(q, k, positions=position_ids)
    # HF multiplies positions by inv_freq in float32 (angle error ~ position * 2**-24 rad); ours takes the
    # product in float64. Both are within that bound of each other, and ours is the closer to float64.
    torch.testing.assert_close(ours_q, hf_q, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ours_k, hf_k, atol=1e-5, rtol=1e-5)
    ref = rope_reference(q, position_ids[:, None, :], base=500000.0)
    assert (ours_q.double() - ref).abs().max() <= (hf_q.double() - ref).abs().max()

    # Given the same cos/sin, the rotation itself is HF's rotate_half formula.
    our_cos, our_sin = rope.cos_sin(position_ids)
    full_cos, full_sin = torch.cat((our_cos, our_cos), -1), torch.cat((our_sin, our_sin), -1)
    hf_q2, hf_k2 = apply_rotary_pos_emb(q, k, full_cos, full_sin)
    torch.testing.assert_close(ours_q, hf_q2, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(ours_k, hf_k2, atol=1e-6, rtol=1e-6)


def test_rope_frequencies_default():
    inv_freq, factor = posenc.rope_frequencies(64, {"rope_type": "default", "rope_theta": 10000.0})
    assert inv_freq.dtype == torch.float32 and inv_freq.shape == (32,) and factor == 1.0
    expected = torch.tensor(rope_inv_freq_reference(64, 10000.0), dtype=torch.float64)
    torch.testing.assert_close(inv_freq, expected.float(), atol=0, rtol=0)
    partial, _ = posenc.rope_frequencies(80, {"rope_theta": 10000.0, "partial_rotary_factor": 0.5})
    assert partial.shape == (20,)


# --- properties ---------------------------------------------------------------------------------------------

_settings = settings(max_examples=40, deadline=None)
dims = st.sampled_from([(2, 2), (8, 8), (10, 6), (16, 16), (33, 32)])
positions_st = st.integers(min_value=0, max_value=100_000)


@_settings
@given(
    dims=dims, m=positions_st, n=positions_st, shift=positions_st, interleaved=st.booleans(), seed=st.integers(0, 2**16)
)
def test_scores_depend_only_on_relative_position(dims, m, n, shift, interleaved, seed):
    head_dim, rotary_dim = dims
    rope = posenc.RoPE(head_dim, rotary_dim=rotary_dim, interleaved=interleaved)
    q, k = random_qk(1, 1, 1, 1, head_dim, dtype=torch.float64, seed=seed)

    def score(pq: int, pk: int) -> float:
        q_rot, _ = rope(q, q, positions=torch.tensor([pq]))
        _, k_rot = rope(k, k, positions=torch.tensor([pk]))
        return float((q_rot * k_rot).sum())

    # float64 inputs get float64 cos/sin; angles up to 2e5 rad keep ~1e-11 absolute accuracy.
    assert math.isclose(score(m, n), score(m + shift, n + shift), rel_tol=1e-9, abs_tol=1e-9)


@_settings
@given(dims=dims, p=positions_st, interleaved=st.booleans(), seed=st.integers(0, 2**16))
def test_rotation_keeps_norms_and_inverse_undoes_it(dims, p, interleaved, seed):
    head_dim, rotary_dim = dims
    rope = posenc.RoPE(head_dim, rotary_dim=rotary_dim, interleaved=interleaved)
    x = torch.randn(2, 3, 4, head_dim, dtype=torch.float64, generator=torch.Generator().manual_seed(seed))
    positions = torch.arange(p, p + 4)
    out, _ = rope(x, x, positions=positions)
    torch.testing.assert_close(out.norm(dim=-1), x.norm(dim=-1), atol=1e-12, rtol=1e-12)
    cos, sin = rope.cos_sin(positions, dtype=torch.float64)
    back = posenc.apply_rotary(out, cos, sin, interleaved=interleaved, conjugate=True)
    torch.testing.assert_close(back, x, atol=1e-12, rtol=1e-12)


@_settings
@given(rotary=st.sampled_from([2, 4, 8, 32]), extra=st.sampled_from([0, 1, 6]), p=positions_st)
def test_layouts_agree_under_channel_permutation(rotary, extra, p):
    head_dim = rotary + extra
    perm = half_to_full_perm(rotary) + list(range(rotary, head_dim))
    x = torch.randn(1, 2, 3, head_dim, dtype=torch.float64)
    positions = torch.arange(p, p + 3)
    split, _ = posenc.RoPE(head_dim, rotary_dim=rotary)(x, x, positions=positions)
    inter, _ = posenc.RoPE(head_dim, rotary_dim=rotary, interleaved=True)(
        x[..., perm], x[..., perm], positions=positions
    )
    torch.testing.assert_close(inter, split[..., perm], atol=0, rtol=0)


def test_a_move_drops_the_tables_of_other_devices():
    """The tables were kept after model.cpu() (64 MiB on the GPU for a 128k-row table): a move keeps only those of
    the device moved to; a cast keeps them (they are float32 or float64 whatever the module's dtype)."""
    rope = posenc.RoPE(16, backend="torch")
    q = torch.randn(1, 2, 5, 16)
    expected, _ = rope(q, q)
    rope(q.double(), q.double())
    cpu = {(torch.device("cpu"), torch.float32), (torch.device("cpu"), torch.float64)}
    assert set(rope._tables) == cpu
    torch.nn.Sequential(rope).half().cpu()
    assert set(rope._tables) == cpu
    meta = torch.empty(1, 1, 4, 16, device="meta")
    rope(meta, meta)
    # A cast keeps every device's tables, not only the CPU's (a GPU's, which a CUDA graph may read by address, went).
    torch.nn.Sequential(rope).float()
    assert set(rope._tables) == cpu | {(torch.device("meta"), torch.float32)}
    torch.nn.Sequential(rope).cpu()  # the meta table goes
    assert set(rope._tables) == cpu
    rope.to("meta")
    assert not rope._tables
    rope.to_empty(device="cpu")
    assert torch.equal(rope(q, q)[0], expected)


def test_a_move_drops_the_windows_of_other_devices():
    """The windows far past the table (4096 rows each, up to 8 per device and dtype) go with a move as the tables do,
    and stay with a cast."""
    rope = posenc.RoPE(16, backend="torch")
    q = torch.randn(1, 2, 5, 16)
    rope(q, q, offset=100_000)  # past the table's limit: a window
    assert {key[0] for key in rope._windows} == {torch.device("cpu")}
    torch.nn.Sequential(rope).half()
    assert {key[0] for key in rope._windows} == {torch.device("cpu")}
    torch.nn.Sequential(rope).to("meta")
    assert rope._windows == {}


def test_a_pickled_rope_leaves_its_tables_behind_and_rebuilds_them():
    """pickle / torch.save(model) / deepcopy of a RoPE that had served offset 60000 in two dtypes carried ~100 MB
    of derived tables (769 bytes fresh); a spawned process received the same."""
    rope = posenc.RoPE(128, backend="torch")
    q = torch.randn(1, 2, 3, 128)
    want = [rope(x, x, offset=60000)[0] for x in (q, q.double())]
    assert rope._tables
    for copied in (pickle.loads(pickle.dumps(rope)), copy.deepcopy(rope)):
        assert not copied._tables and not copied._frequencies and rope._tables
        assert len(pickle.dumps(copied)) < 10_000
        for x, expected in zip((q, q.double()), want, strict=True):
            assert torch.equal(copied(x, x, offset=60000)[0], expected)


def test_frequencies_evicted_by_another_thread_first_are_no_error():
    """The cache of recent lengths evicts its oldest entry; a thread sharing the RoPE could evict it in between
    (KeyError, or 'dictionary changed size during iteration', 1-3 times in 24k calls of 8 threads)."""

    class EvictedMeanwhile(dict):
        def __iter__(self):  # the first key, already gone by the time it is popped
            keys = list(super().__iter__())
            if keys:
                super().pop(keys[0])
            return iter(keys)

    def make():
        return posenc.RoPE(16, rope_parameters={"rope_type": "dynamic", "factor": 2.0}, max_position_embeddings=8)

    rope = make()
    rope._frequencies = EvictedMeanwhile()
    for length in range(1, 30):
        assert torch.equal(rope.frequencies(length)[0], make().frequencies(length)[0])


def test_tables_are_kept_per_device_and_dtype_and_grow_past_powers_of_two():
    """A float64 call builds its own table and leaves the float32 one alone; a meta call its own (shape inference
    after a CPU call); 257 tokens need a table of more than 256 rows."""
    torch.manual_seed(0)
    rope = posenc.RoPE(64, backend="torch")
    q = torch.randn(1, 2, 300, 64)
    first, _ = rope(q, q)
    rope(q.double(), q.double())
    assert torch.equal(rope(q, q)[0], first)
    meta = torch.empty(1, 1, 4, 64, device="meta")
    assert rope(meta, meta)[0].device.type == "meta"
    for s in (257, 513, 1025):
        x = torch.randn(1, 1, s, 64)
        last, _ = posenc.RoPE(64, backend="torch")(x, x)
        alone, _ = posenc.RoPE(64, backend="torch")(x[:, :, -1:], x[:, :, -1:], offset=s - 1)
        torch.testing.assert_close(last[:, :, -1:], alone, rtol=0, atol=0)


FAR = 1 << 16  # the first position past a RoPE's table


@pytest.mark.parametrize("backend", ["torch", "cpu", "triton"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize(
    "call",
    [
        {"offset": FAR},
        {"offset": FAR + 2047},  # the window's last start for a one-token step
        {"offset": 2**40 + 5},
        {"offset": torch.tensor([FAR + 1, FAR + 1500])},
        {"positions": torch.tensor([[FAR + 3], [FAR + 900]])},
        {"positions": torch.tensor([[3], [900]], dtype=torch.int32), "offset": FAR + 4000},
        # Moved back by the window's start, 8-bit ids wrapped (uint8 200 read row 44): the shift is taken in int64.
        {"positions": torch.tensor([[200], [3]], dtype=torch.uint8), "offset": FAR + 100},
        {"positions": torch.tensor([[3], [-5]], dtype=torch.int8), "offset": FAR + 4000},
        {"positions": torch.tensor([FAR + 7, FAR + 8, FAR + 2])},
    ],
)
def test_far_positions_read_a_window_with_the_bits_of_their_own_angles(backend, dtype, call):
    """Past the table a RoPE computed each call's angles (2.7x the time of a one-token call); it now keeps a window
    of rows, and every position reads the bits angles_to_cos_sin gives it alone. The expected values go through the
    same backend, so Triton's interpreter (which rounds bf16 down) runs the bf16 cases too: they were skipped for a
    GPU run that scripts/gpu_check.sh never made (it runs tests/kernels only)."""
    rope = posenc.RoPE(16, backend=backend)
    seq = 1 if "positions" not in call else call["positions"].shape[-1]
    q, k = random_qk(2, 3, 2, seq, 16, seed=1)
    q, k = q.to(dtype), k.to(dtype)
    table_dtype = torch.float64 if dtype == torch.float64 else torch.float32
    positions = call.get("positions", torch.arange(seq)).long() + (
        call["offset"][:, None] if isinstance(call.get("offset"), torch.Tensor) else call.get("offset", 0)
    )
    cos, sin = angles_to_cos_sin(positions.expand(2, seq), rope.frequencies()[0], dtype=table_dtype)
    expected = posenc.apply_rotary_qk(q, k, cos[:, None], sin[:, None], backend=backend)
    got = rope(q, k, **call)
    assert rope._windows, "the call took the window"
    for g, e in zip(got, expected, strict=True):
        assert torch.equal(g, e)


@pytest.mark.parametrize("offset", [100, torch.tensor([100])])
def test_a_table_call_checks_each_tensor_once(monkeypatch, offset):
    """A decode step's host cost is Python checks (~40 of ~45 us on one CPU thread): RoPE's table calls checked q and
    k as float tensors twice and its own table as angles, and the CPU launcher read and checked cos/sin once for q
    and again for k. Each is checked once now; every refusal stays (tests/test_errors.py)."""
    from posenc import _checks
    from posenc.kernels import cpu_rope, layout
    from posenc.rope import module

    checked, angles = [], []
    float_tensor, read_angles = _checks.float_tensor, getattr(cpu_rope, "_angles", None)  # new on 2026-12-05

    def counting(name, x):
        checked.append(name)
        return float_tensor(name, x)

    for where in (_checks, module, layout):
        monkeypatch.setattr(where, "float_tensor", counting)
    monkeypatch.setattr(cpu_rope, "_angles", lambda cos, sin: angles.append(1) or read_angles(cos, sin), raising=False)
    rope = posenc.RoPE(16, backend="cpu")
    q, k = random_qk(1, 4, 2, 1, 16)
    expected = posenc.RoPE(16, backend="torch")(q, k, offset=offset)
    checked.clear()
    got = rope(q, k, offset=offset)
    assert sorted(checked) == ["k", "q"]
    assert angles == [1]
    for g, e in zip(got, expected, strict=True):
        assert_close(g, e)


@pytest.mark.parametrize("replayed", [True, False])
def test_a_decode_loop_far_out_reuses_its_window_and_moves_it(replayed):
    """The full path reads a window while the call's rows lie in its first half, and moves it by halves; replayed
    calls (posenc.kernels.replay: no gradient to record) read it to its last row. The same values either way."""
    rope = posenc.RoPE(8)
    q, k = random_qk(1, 1, 1, 1, 8)
    if not replayed:
        q.requires_grad_()
    cpu = (torch.device("cpu"), torch.float32)
    rope(q, k, offset=FAR + 10)
    window = rope._windows[(*cpu, FAR)]
    last = FAR + (4095 if replayed else 2047)
    for step in range(FAR + 11, last + 1):
        rope(q, k, offset=step)
        assert rope._windows[(*cpu, FAR)] is window
    rope(q, k, offset=last + 1)
    assert list(rope._windows) == [(*cpu, FAR), (*cpu, last + 1)]
    for step in (FAR + 5, last + 1, last + 100):
        assert torch.equal(rope(q, k, offset=step)[0], posenc.RoPE(8)(q, k, offset=step)[0])


def test_streams_far_apart_keep_their_own_windows_up_to_the_limit():
    """Two requests far out sharing a RoPE rebuilt the one kept window on every call (4.0 ms a call against
    0.42 ms before windows); each keeps its own now, the latest eight used."""
    from posenc.rope import module

    rope = posenc.RoPE(8)
    q, k = random_qk(1, 1, 1, 1, 8)
    cpu = (torch.device("cpu"), torch.float32)
    starts = [FAR + 2048 * 3 * i for i in range(module._WINDOWS_KEPT + 1)]
    for _ in range(3):
        for first in starts[:2]:
            rope(q, k, offset=first + 5)
    assert list(rope._windows) == [(*cpu, first) for first in starts[:2]]
    kept = dict(rope._windows)
    for first in reversed(starts[:2]):  # the first one built is now the latest used
        rope(q, k, offset=first + 6)
        assert rope._windows[(*cpu, first)] is kept[(*cpu, first)]
    for first in starts[2:]:
        rope(q, k, offset=first)
    # The least recently used went, not the oldest built.
    assert list(rope._windows) == [(*cpu, first) for first in (starts[0], *starts[2:])]
    rope(q.double(), k.double(), offset=FAR)
    assert len(rope._windows) == module._WINDOWS_KEPT + 1  # other dtypes count apart
    assert not posenc.RoPE(8).__getstate__()["_windows"] and not pickle.loads(pickle.dumps(rope))._windows


def test_a_window_added_by_another_thread_while_one_is_evicted_stops_no_call():
    """Threads of a server sharing a RoPE far out: one thread's call adding its window while another's new window
    looked for the windows to evict raised "dictionary changed size during iteration" (2 of 300 rounds of six
    threads). Here the other thread's insertion is made at that very moment, from a key the scan compares."""
    from posenc.rope import module

    rope = posenc.RoPE(8)
    q, k = random_qk(1, 1, 1, 1, 8)
    cpu = (torch.device("cpu"), torch.float32)
    window = rope._rows(cpu[0], FAR, module._WINDOW, cpu[1])

    class OtherThread:
        """A key's device slot: when the scan compares it, another thread's call adds its window."""

        def __eq__(self, other: object) -> bool:
            rope._windows.setdefault((*cpu, FAR + 2048 * 100), window)
            return False

        __hash__ = object.__hash__

    rope._windows[(OtherThread(), cpu[1], 0)] = window
    got = rope(q, k, offset=FAR + 5)
    expected = posenc.RoPE(8)(q, k, offset=FAR + 5)
    for g, e in zip(got, expected, strict=True):
        assert torch.equal(g, e)
    assert (*cpu, FAR) in rope._windows and (*cpu, FAR + 2048 * 100) in rope._windows


def test_far_positions_that_do_not_fit_a_window_or_go_negative_take_the_general_path():
    rope = posenc.RoPE(8)
    q, k = random_qk(2, 1, 1, 1, 8)
    # Farther apart than half a window: more than a window, or less, past the rows a window from FAR holds.
    for spread in (torch.tensor([FAR, FAR + 5000]), torch.tensor([FAR + 2047, FAR + 5047])):
        expected = rope_reference(q, spread[:, None, None])
        assert_close(rope(q, k, offset=spread)[0], expected)
        assert not rope._windows
    # A window's last rows would pass int64's maximum.
    assert_close(rope(q, k, offset=2**63 - 10)[0], rope_reference(q, torch.tensor(2**63 - 10)))
    assert not rope._windows
    with pytest.raises(ValueError, match="positions must be >= 0"):
        rope(q, k, positions=torch.tensor([[FAR], [-1]]))


def test_an_int_offset_with_position_ids_is_bounded_by_what_is_added():
    """With ids, an int offset's last position is offset + max(ids): it was checked as offset + seq_len - 1, which
    refused ids that restart at 0 near 2**63 (packed sequences) and let ids past seq_len through to the sum."""
    rope = posenc.RoPE(8)
    q, k = random_qk(1, 1, 1, 4, 8)
    top = 2**63 - 1
    # Four tokens at ids 0, 1, 0, 1: offset + 1 is the last position, at int64's maximum and one below it.
    ids = torch.tensor([0, 1, 0, 1])
    for offset in (top - 1, top - 2):
        expected = rope_reference(q, offset + ids)
        assert_close(rope(q, k, positions=ids, offset=offset)[0], expected)
    # Ids past seq_len: offset + 3 would fit, offset + 9 does not.
    with pytest.raises(ValueError, match=r"offset \+ position ids must fit in int64"):
        rope(q, k, positions=torch.tensor([9, 0, 0, 0]), offset=top - 5)
    with pytest.raises(ValueError, match=r"offset must fit in int64 \(below 2\*\*63, a token position\), got"):
        rope(q, k, positions=torch.zeros(4, dtype=torch.long), offset=top + 1)


def test_far_position_ids_with_per_sequence_offsets_take_the_general_path():
    # Position ids (b, s) and offsets (b,) would be moved back by broadcasting (b,) over s, rotating each token by
    # another sequence's offset (silently where s equals b): that pairing keeps the general path.
    rope = posenc.RoPE(8)
    q, k = random_qk(2, 1, 2, 2, 8)
    positions, offset = torch.tensor([[3, 4], [900, 901]]), torch.tensor([FAR, FAR + 5])
    expected = rope_reference(q, (positions + offset[:, None])[:, None])
    assert_close(rope(q, k, positions=positions, offset=offset)[0], expected)
    assert not rope._windows


@pytest.mark.parametrize(
    ("form", "recipe"),
    [
        ("torch.cat((freqs, freqs), -1)", slice(None, 4)),
        ("torch.repeat_interleave(freqs, 2, -1)", slice(None, None, 2)),
    ],
)
def test_the_error_for_hugging_faces_cos_names_the_slice_that_fits_each_of_its_forms(form, recipe):
    """Cohere's rotary embedding repeats each angle in place (repeat_interleave), not in two halves (cat): the hint
    said only cos[..., :r // 2], which for it rotates by the first quarter of the angles, each twice (max error 3.8),
    silently. The slice the error names for each form gives posenc's cos/sin."""
    freqs = torch.arange(5.0)[:, None] * posenc.rope_frequencies(8)[0][None]  # (s, r/2) angles
    hf_cos = torch.cat((freqs, freqs), -1).cos() if "cat" in form else torch.repeat_interleave(freqs, 2, -1).cos()
    x = torch.randn(1, 2, 5, 8)
    with pytest.raises(ValueError) as error:
        posenc.apply_rotary(x, hf_cos, hf_cos)
    named = "cos[..., :4]" if recipe.step is None else "cos[..., ::2]"
    assert f"{named} and sin" in str(error.value) and form in str(error.value)
    torch.testing.assert_close(hf_cos[..., recipe], freqs.cos(), rtol=0, atol=0)


@pytest.mark.parametrize("backend", ["torch", "cpu"])
@pytest.mark.parametrize("cut", ["sin shorter", "1-D", "3-D"])
def test_table_calls_refuse_cos_sin_that_are_not_one_table_shape(backend, cut):
    """With position ids cos and sin are one (n, r/2) table: a shorter sin was read by the torch path unchecked."""
    cos, sin = posenc.RoPE(8).cos_sin(torch.arange(16))
    cos, sin = {"sin shorter": (cos, sin[:10]), "1-D": (cos[:, 0], sin[:, 0]), "3-D": (cos[None], sin[None])}[cut]
    x, ids = torch.randn(1, 2, 3, 8), torch.tensor([[1, 2, 3]])
    with pytest.raises(ValueError, match=r"cos and sin are tables of shape \(n_positions, r/2\)"):
        posenc.apply_rotary(x, cos, sin, positions=ids, backend=backend)


def test_a_table_call_whose_rows_are_checked_still_checks_cu_seqlens():
    """rows_checked (RoPE's table, the batched backward) vouches for the rows only: prefix sums are still read and
    refused with posenc's error, not an assertion from the device."""
    from posenc.kernels.layout import check_table_call

    cos, sin = posenc.RoPE(8).cos_sin(torch.arange(16))
    with pytest.raises(ValueError, match="cu_seqlens must be non-decreasing"):
        check_table_call(
            {"x": torch.randn(9, 2, 8)},
            cos,
            sin,
            "varlen",
            positions=None,
            offset=None,
            cu_seqlens=torch.tensor([0, 6, 3, 9]),
            rows_checked=True,
        )


def _held(values: torch.Tensor, holder: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(x, twin): x holding ``values``, to be rotated in place, and a plain tensor over the same bytes, to cut the
    angles or ids from: x itself ("view"), an nn.Parameter x beside a plain tensor of its storage ("parameter"), or
    two storages over one buffer ("frombuffer", as torch.from_numpy of two views of one array makes)."""
    if holder == "view":
        return values, values
    if holder == "parameter":
        return torch.nn.Parameter(values, requires_grad=False), values
    # x's storage starts 8 bytes into the buffer (int64 views stay aligned), the twin's at its start: two storages,
    # one set of bytes.
    pad = 8 // values.element_size()
    raw = bytearray((values.numel() + pad) * values.element_size())
    x = torch.frombuffer(raw, dtype=values.dtype, offset=8).view(values.shape)
    x.copy_(values)
    return x, torch.frombuffer(raw, dtype=values.dtype)[pad:].view(values.shape)


HOLDERS = ["view", "parameter", "frombuffer"]


@pytest.mark.parametrize("holder", HOLDERS)
@pytest.mark.parametrize("backend", ["torch", "cpu", "triton"])
@pytest.mark.parametrize("layout", ["broadcast", "table"])
def test_in_place_rotation_by_angles_in_x_own_memory_reads_them_before_writing(backend, layout, holder):
    """cos/sin that are views of x itself (one buffer holding activations and angles): rotated in place, x was
    overwritten before the angles were read, on every backend (max error 8-12), without an error. The angles are
    now copied first where their bytes meet x's, and the result is the rotation by the angles as they were. Until
    2026-12-07 an x that is an nn.Parameter, or a storage of its own over the angles' bytes, was not compared."""
    buffer, twin = _held(torch.randn(2, 3, 5, 8, generator=torch.Generator().manual_seed(0)), holder)
    cos, sin = twin[0, 0, :, :4], twin[0, 1, :, :4]  # rows of x's own first heads
    expected_cos, expected_sin = cos.clone(), sin.clone()
    expected = posenc.apply_rotary(buffer.double(), expected_cos.double(), expected_sin.double(), backend="torch")
    call = {} if layout == "broadcast" else {"offset": 0}
    with torch.no_grad():
        posenc.apply_rotary_(buffer, cos, sin, backend=backend, **call)
    assert_close(buffer, expected)


class _Unwrapping(torch.Tensor):
    """A subclass made by _make_subclass (the plain tensor's storage) that runs torch's ops on the plain tensor."""

    @staticmethod
    def __new__(cls, plain: torch.Tensor) -> _Unwrapping:
        made = torch.Tensor._make_subclass(cls, plain)
        made.plain = plain
        return made

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        def plain(a):
            return a.plain if isinstance(a, _Unwrapping) else a

        return func(*map(plain, args), **{key: plain(value) for key, value in (kwargs or {}).items()})


@pytest.mark.parametrize("which", ["angles", "x"])
def test_in_place_rotation_compares_the_memory_of_a_subclass_that_dispatches_in_python(which):
    """A subclass with a storage of its own and __torch_dispatch__ (which "auto" sends to the torch formula) was not
    compared: angles in x's memory were read after the rotation had overwritten them (max error 5.7-9.1)."""
    buffer = torch.randn(2, 3, 5, 8, generator=torch.Generator().manual_seed(0))
    cos, sin = buffer[0, 0, :, :4], buffer[0, 1, :, :4]
    expected = posenc.apply_rotary(buffer.double(), cos.double(), sin.double(), backend="torch")
    if which == "angles":
        cos, sin = _Unwrapping(cos), _Unwrapping(sin)
        x = buffer
    else:
        x = _Unwrapping(buffer)
    posenc.apply_rotary_(x, cos, sin)
    assert_close(buffer, expected)


@pytest.mark.parametrize("holder", HOLDERS)
@pytest.mark.parametrize("backend", ["torch", "cpu", "triton"])
@pytest.mark.parametrize("kind", ["positions", "offset", "cu_seqlens"])
def test_in_place_rotation_by_ids_in_x_own_memory_reads_them_before_writing(backend, kind, holder):
    """Position ids, per-sequence offsets or cu_seqlens stored in x's own bytes (an int64 view of its first
    elements): rotated in place, the CPU kernel checked them, then read them again after the rotation had
    overwritten them, and killed the process (SIGSEGV). They are copied first where their bytes meet x's, as angles
    are, and the result is the rotation by the values they had."""
    cos, sin = posenc.RoPE(8).cos_sin(torch.arange(64))
    shape, values = {
        "positions": ((1, 2, 4, 8), [3, 2, 1, 0]),  # (b, h, s, d), ids (s,)
        "offset": ((2, 2, 3, 8), [5, 1]),  # per-sequence offsets (b,)
        "cu_seqlens": ((6, 2, 8), [0, 2, 6]),  # packed (total, h, d)
    }[kind]
    buffer, twin = _held(torch.randn(shape, generator=torch.Generator().manual_seed(0)), holder)
    ints = twin.view(-1).view(torch.int64)[: len(values)]
    ints.copy_(torch.tensor(values))
    expected = posenc.apply_rotary(
        buffer.double(), cos.double(), sin.double(), backend="torch", **{kind: torch.tensor(values)}
    )
    with torch.no_grad():
        posenc.apply_rotary_(buffer, cos, sin, backend=backend, **{kind: ints})
    assert_close(buffer, expected)


@pytest.mark.parametrize("cu_seqlens", [[0], [5]])
def test_a_single_entry_cu_seqlens_is_refused_as_too_few_prefix_sums(cu_seqlens):
    """cu_seqlens of one entry is 1-D, so the refusal "cu_seqlens must be 1-D (n_seq + 1,), got shape (1,)" contradicted
    itself; it now says that n_seq + 1 >= 2 sums are needed and what they are."""
    cos, sin = posenc.RoPE(8).cos_sin(torch.arange(16))
    with pytest.raises(ValueError, match=r"cu_seqlens must hold n_seq \+ 1 >= 2 prefix sums .*got shape \(1,\)"):
        posenc.apply_rotary(torch.randn(0, 2, 8), cos, sin, cu_seqlens=torch.tensor(cu_seqlens))


@pytest.mark.parametrize("shape", [(256,), (2, 128)])
def test_rope_cos_sin_reads_uint8_positions_as_ids_not_as_a_mask(shape):
    """torch reads a uint8 index as a boolean mask: RoPE.cos_sin of 256 uint8 ids 0..255 gave the 255 rows of the
    nonzero ids without an error, and of (2, 128) such ids an IndexError about a mask's shape. They are ids, as
    int_tensor accepts them: the rows equal those of the same ids in int64."""
    rope = posenc.RoPE(8)
    ids = torch.arange(256).view(shape)
    cos, sin = rope.cos_sin(ids.to(torch.uint8))
    expected_cos, expected_sin = rope.cos_sin(ids)
    assert cos.shape == (*shape, 4)
    assert torch.equal(cos, expected_cos) and torch.equal(sin, expected_sin)


@pytest.mark.parametrize("dtype", [torch.int8, torch.int16])
@pytest.mark.parametrize("shape", [(4,), (2, 2)])
def test_rope_cos_sin_takes_int8_and_int16_positions(dtype, shape):
    """int_tensor takes them, as apply_rotary and RoPE's forward do; RoPE.cos_sin's table lookup raised torch's bare
    "IndexError: tensors used as indices must be long, int, byte or bool tensors" (compiled, it worked)."""
    rope = posenc.RoPE(8)
    ids = torch.tensor([0, 5, 100, 3]).view(shape)
    cos, sin = rope.cos_sin(ids.to(dtype))
    expected_cos, expected_sin = rope.cos_sin(ids)
    assert torch.equal(cos, expected_cos) and torch.equal(sin, expected_sin)


@pytest.mark.parametrize("backend", ["torch", "cpu"])
def test_table_calls_read_no_row_for_no_token_and_take_one_row_of_ids_for_the_batch(backend):
    """An empty sequence reads no row, so an offset past the table is no error (an int, or one per sequence); an
    offset at the table's end with tokens to read is refused by name; (1, s) position ids apply to every row."""
    x = torch.randn(2, 1, 3, 8)
    cos, sin = torch.randn(8, 4), torch.randn(8, 4)
    for offset in (100, torch.tensor([100, 100])):
        assert posenc.apply_rotary(x[:, :, :0], cos, sin, offset=offset, backend=backend).shape == (2, 1, 0, 8)
    with pytest.raises(ValueError, match=r"^offset=8 is past the cos/sin table's 8 rows"):
        posenc.apply_rotary(x, cos, sin, offset=8, backend=backend)
    ids = torch.tensor([4, 2, 0])
    one_row = posenc.apply_rotary(x, cos, sin, positions=ids[None], backend=backend)
    assert torch.equal(one_row, posenc.apply_rotary(x, cos, sin, positions=ids, backend=backend))
