"""Every bad input is a ValueError/TypeError that names the argument and what would be valid."""

from __future__ import annotations

import math
import warnings

import pytest
import torch

import posenc
from posenc import testing
from posenc.bias.alibi import alibi_bias
from posenc.distributed import shard_positions
from posenc.rope.mrope import MRoPE

x = torch.randn(1, 2, 4, 8)
q = torch.randn(1, 2, 4, 8)


@pytest.mark.parametrize(
    ("make", "error", "match"),
    [
        (lambda: posenc.RoPE(0), ValueError, "head_dim must be a positive integer"),
        (lambda: posenc.RoPE(8, rotary_dim=10), ValueError, r"rotary_dim=10 must be <= head_dim=8"),
        (lambda: posenc.RoPE(8, rotary_dim=5), ValueError, r"rotary_dim must be even.*use 4 or 6"),
        (lambda: posenc.RoPE(7), ValueError, r"head_dim=7 is odd .* pass rotary_dim=6 to rotate 6 of the 7 channels"),
        # Said "pass rotary_dim=0", which is refused.
        (lambda: posenc.RoPE(1), ValueError, r"head_dim=1 leaves nothing to rotate: .* use head_dim >= 2"),
        (lambda: posenc.RoPE(8, rotary_dim=0), ValueError, "rotary_dim must be a positive integer"),
        (lambda: posenc.RoPE(8, base=1.0), ValueError, r"base must be a finite number > 1"),
        (lambda: posenc.RoPE(8, base=math.inf), ValueError, r"base must be a finite number > 1"),
        (lambda: posenc.RoPE(8, base=math.nan), ValueError, r"base must be a finite number > 1"),
        # A float of the wrong value (nan, inf) is a ValueError, as base's is; it was a TypeError.
        (
            lambda: posenc.RoPE(8, rope_parameters={"rope_type": "linear", "factor": math.nan}),
            ValueError,
            r"rope_parameters\['factor'\] must be a finite real number, got nan",
        ),
        (
            lambda: posenc.RoPE(8, rope_parameters={"rope_type": "linear", "factor": torch.tensor(math.inf)}),
            ValueError,
            r"rope_parameters\['factor'\] must be a finite real number, got inf",
        ),
        (lambda: posenc.RoPE(8, base="1e4"), TypeError, r"base must be a real number"),
        (
            lambda: posenc.RoPE(8, rope_parameters={"rope_type": "warp"}),
            ValueError,
            r"unknown rope_type 'warp'; known types: .*default",
        ),
        (
            lambda: posenc.RoPE(8, rope_parameters=[("rope_type", "default")]),
            TypeError,
            r"rope_parameters must be a dict",
        ),
        (
            lambda: posenc.RoPE(8, rope_parameters={"rope_theta": 0.5}),
            ValueError,
            r"rope_parameters\['rope_theta'\] must be a finite number > 1",
        ),
        (
            lambda: posenc.RoPE(8, rope_parameters={"partial_rotary_factor": 1.5}),
            ValueError,
            r"partial_rotary_factor must be in \(0, 1\]",
        ),
        (
            lambda: posenc.RoPE(8, rotary_dim=4, rope_parameters={"partial_rotary_factor": 1.0}),
            ValueError,
            r"rotary_dim=4 disagrees with partial_rotary_factor",
        ),
        (
            lambda: posenc.RoPE(8, base=500.0, rope_parameters={"rope_theta": 10000.0}),
            ValueError,
            r"base=500.0 disagrees with rope_parameters\['rope_theta'\]",
        ),
        (
            lambda: posenc.RoPE(8, max_position_embeddings=0),
            ValueError,
            "max_position_embeddings must be a positive integer",
        ),
        (lambda: posenc.ALiBi(0), ValueError, "num_heads must be a positive integer"),
        (lambda: posenc.ALiBi(-3), ValueError, "num_heads must be a positive integer"),
        (lambda: posenc.T5Bias(0), ValueError, "num_heads must be a positive integer"),
        (
            lambda: posenc.T5Bias(4, num_buckets=32, max_distance=16),
            ValueError,
            r"max_distance=16 is too small for num_buckets=32: it must be > 16",
        ),
        (
            lambda: posenc.T5Bias(4, num_buckets=2, bidirectional=True),
            ValueError,
            r"num_buckets=2 is too small: need at least 4",
        ),
        (lambda: posenc.Sinusoidal(7), ValueError, r"dim must be even"),
        (lambda: posenc.Sinusoidal(0), ValueError, r"dim must be a positive integer"),
        (lambda: posenc.Sinusoidal(8, base=-2.0), ValueError, r"base must be a finite number > 1"),
        (lambda: posenc.LearnedAbsolute(0, 8), ValueError, "max_positions must be a positive integer"),
        (lambda: posenc.build("xpos"), ValueError, r"unknown encoding 'xpos'; known encodings: learned, .*rope"),
        (
            lambda: posenc.build_for_model("alibi", dim=8, num_heads=2, head_dim=4, max_positions=8, base=3.0),
            TypeError,
            r"encoding 'alibi' takes no option 'base'; its options: causal \(its sizes come from dim",
        ),
        (
            lambda: posenc.build_for_model("nope", dim=8, num_heads=2, head_dim=4, max_positions=8, causal=False),
            TypeError,
            r"encoding 'nope' takes no option 'causal'; its options: none",
        ),
        (
            # It replaced max_positions without a word.
            lambda: posenc.build_for_model(
                "rope", dim=8, num_heads=2, head_dim=4, max_positions=64, max_position_embeddings=4096
            ),
            TypeError,
            r"max_position_embeddings=4096 is the training length that max_positions=64 already gives",
        ),
        (lambda: posenc.CausalSelfAttention(30, 4), ValueError, r"dim=30 must be divisible by num_heads=4"),
        (
            lambda: posenc.CausalSelfAttention(32, 4, num_kv_heads=3),
            ValueError,
            r"num_heads=4 must be a multiple of num_kv_heads=3",
        ),
    ],
)
def test_constructor_errors(make, error, match):
    with pytest.raises(error, match=match):
        make()


rope = posenc.RoPE(8)
angles = torch.randn(4, 4)


def _meta_layer_loaded_by_assignment(make_encoding):
    """A layer built on the meta device and given its weights by load_state_dict(assign=True), as checkpoint loaders
    do: what is not in the state dict (ALiBi's slopes, a buffer that is not saved) stays on meta."""
    source = posenc.CausalSelfAttention(32, 4, encoding=make_encoding())
    with torch.device("meta"):
        layer = posenc.CausalSelfAttention(32, 4, encoding=make_encoding())
    layer.load_state_dict(source.state_dict(), assign=True)
    return layer


@pytest.mark.parametrize(
    ("call", "error", "match"),
    [
        (lambda: rope(q.long(), q), TypeError, r"q must be a floating-point tensor, got dtype torch.int64"),
        (lambda: rope(q, q.double()), TypeError, r"q and k must have the same dtype"),
        (lambda: rope(torch.randn(1, 2, 4, 6), q), ValueError, r"q must be 4-D .* d = head_dim = 8"),
        (lambda: rope(q[0], q[0]), ValueError, r"q must be 4-D"),
        (lambda: rope(q, q[:, :, :3]), ValueError, "q and k must share batch and sequence sizes"),
        (  # GQA's q and k as (b, s, h, d) without layout=: the sizes that differ are the head counts
            lambda: rope(torch.randn(2, 6, 4, 8), torch.randn(2, 6, 2, 8)),
            ValueError,
            r"got \(2, 6, 4, 8\) and \(2, 6, 2, 8\) \(layout 'bhsd'\); if they are stored \(b, s, h, d\) \(GQA: 4 "
            r"and 2 heads\), pass layout='bshd'$",
        ),
        (
            lambda: rope(torch.randn(2, 4, 6, 8), torch.randn(2, 2, 6, 8), layout="bshd"),
            ValueError,
            r"\(layout 'bshd'\); if they are stored \(b, h, s, d\) \(GQA: 4 and 2 heads\), pass layout='bhsd'$",
        ),
        (  # a decode step's q against k of more tokens also matches as (b, s, h, d): no hint, it would mislead
            lambda: rope(torch.randn(1, 8, 1, 8), torch.randn(1, 8, 10, 8)),
            ValueError,
            r"got \(1, 8, 1, 8\) and \(1, 8, 10, 8\) \(layout 'bhsd'\)$",
        ),
        (
            lambda: rope(q, q, positions=torch.arange(5)),
            ValueError,
            r"positions must have shape \(4,\) or \(1, 4\) to match the sequence of q read as \(b, h, s, d\) "
            r"\(layout 'bhsd', the default\), got \(5,\); for q in \(b, s, h, d\) pass layout='bshd'",
        ),
        (lambda: rope(q, q, positions=torch.arange(4.0)), TypeError, r"positions must hold integer positions"),
        (lambda: rope(q, q, positions=torch.tensor([0, -1, 2, 3])), ValueError, "positions must be >= 0"),
        (lambda: rope(q, q, offset=-1), ValueError, r"offset must be >= 0"),
        # A table read at -1 would wrap around to its last row; past its start, a bare IndexError.
        (lambda: rope.cos_sin(torch.tensor([-1])), ValueError, r"positions must be >= 0, got a negative entry \(-1\)"),
        (lambda: rope.cos_sin(torch.tensor([3, -1000])), ValueError, r"positions must be >= 0"),
        (lambda: posenc.apply_rotary(torch.tensor(1.0), *rope.cos_sin(torch.arange(4))), ValueError, "got a scalar"),
        (lambda: rope(q, q, offset=torch.tensor([-2])), ValueError, r"offset must be >= 0"),
        (lambda: rope(q, q, offset=torch.tensor([1, 2, 3])), ValueError, r"offset must be an int or a tensor of shape"),
        (lambda: rope(q, q, offset=1.5), TypeError, r"offset must be an int"),
        (lambda: rope(q, q, layout="sbhd"), ValueError, r"layout must be 'bhsd' or 'bshd'"),
        (
            lambda: posenc.apply_rotary(x, angles.cos()[:, :3], angles.sin()),
            ValueError,
            "cos and sin must have the same shape",
        ),
        (
            lambda: posenc.apply_rotary(x, torch.ones(4, 5), torch.ones(4, 5)),
            ValueError,
            r"cos.shape\[-1\]=5 pairs needs 2\*5=10 channels but x.shape\[-1\]=8",
        ),
        (  # Hugging Face's cos/sin, each pair's value twice (b, s, d): the error says how to take posenc's from them
            lambda: posenc.apply_rotary(x, torch.ones(1, 4, 8), torch.ones(1, 4, 8)),
            ValueError,
            r"pairs needs 2\*8=16 channels .*Hugging Face's cos/sin \(\.\.\., rotary_dim\) hold each pair's value "
            r"twice: pass cos\[\.\.\., :4\] and sin\[\.\.\., :4\] where the model concatenates .*cos\[\.\.\., ::2\] "
            r"and sin\[\.\.\., ::2\] where it interleaves them \(torch.repeat_interleave\(freqs, 2, -1\): Cohere\)$",
        ),
        (  # the same as a table read at an offset
            lambda: posenc.apply_rotary(x, torch.ones(9, 8), torch.ones(9, 8), offset=0),
            ValueError,
            r"one value per pair, \(n_positions, rotary_dim // 2\); Hugging Face's .*pass cos\[\.\.\., :4\]",
        ),
        (
            lambda: posenc.apply_rotary(x, torch.ones(3, 4), torch.ones(3, 4)),
            ValueError,
            r"do not broadcast to x.shape\[:-1\] \+ \(r/2,\) .* for x in \(b, s, h, d\), as flash-attention "
            r"lays it out, pass cos\[:, None\] \(s, 1, r/2\), or the whole table with offset= or positions= and "
            r"layout='bshd'",
        ),
        (
            lambda: posenc.apply_rotary(x, torch.ones(2, 1, 4, 4), torch.ones(2, 1, 4, 4)),
            ValueError,
            "do not broadcast",
        ),
        (
            lambda: posenc.apply_rotary(x.int(), angles.cos(), angles.sin()),
            TypeError,
            "x must be a floating-point tensor",
        ),
        (
            lambda: posenc.apply_rotary(x, angles.cos().half().long(), angles.sin()),
            TypeError,
            "cos must be a floating-point tensor",
        ),
        (
            lambda: posenc.apply_rotary(x, angles.cos(), angles.sin(), backend="cuda-magic"),
            ValueError,
            "backend must be one of",
        ),
        (
            lambda: posenc.apply_rotary(x, angles.cos().to("meta"), angles.sin()),
            ValueError,
            r"cos is on meta but sin is on cpu",
        ),
        (lambda: posenc.ALiBi(4).bias(0, 3), ValueError, "q_len must be a positive integer"),
        (lambda: posenc.ALiBi(4).bias(2, 3, offset=-1), ValueError, "offset must be an int >= 0"),
        (lambda: posenc.ALiBi(4).bias(2, 3, offset=1.0), TypeError, "offset must be an int >= 0"),
        (lambda: posenc.T5Bias(4).bias(2, 3, offset=torch.tensor(1)), TypeError, "offset must be an int >= 0"),
        (
            lambda: posenc.t5_relative_bucket(torch.tensor([1.0]), bidirectional=False),
            TypeError,
            "relative_position must hold integer positions",
        ),
        (lambda: posenc.Sinusoidal(8)(torch.tensor([0.5])), TypeError, "positions must hold integer positions"),
        (lambda: posenc.CausalSelfAttention(32, 4)(torch.randn(2, 32)), ValueError, r"x must be \(b, s, dim=32\)"),
    ],
)
def test_call_errors(call, error, match):
    with pytest.raises(error, match=match):
        call()


def _overlapping() -> torch.Tensor:
    return torch.randn(1, 4, 23).unfold(-1, 16, 2)  # (1, 4, 4, 16): rows 2 apart, 16 wide


_pairs = torch.rand(4, 8)


@pytest.mark.parametrize(
    ("call", "error", "match"),
    [
        # Silent wrong answers before: each now raises.
        (
            lambda: posenc.apply_rotary_(_overlapping(), _pairs.cos(), _pairs.sin()),
            ValueError,
            r"x has shape \(1, 4, 4, 16\) and strides \(92, 23, 2, 1\), so some of its elements may share memory",
        ),
        (
            lambda: posenc.apply_rotary(torch.randn(4, 16), _pairs.cos(), _pairs.sin(), interleaved="False"),
            TypeError,
            "interleaved must be True or False, got 'False'",
        ),
        (
            lambda: posenc.apply_rotary(torch.randn(4, 16), _pairs.cos(), _pairs.sin(), conjugate=None),
            TypeError,
            "conjugate must be True or False, got None",
        ),
        (lambda: posenc.RoPE(16, interleaved=1), TypeError, "interleaved must be True or False"),
        (lambda: posenc.T5Bias(4, bidirectional="no"), TypeError, "bidirectional must be True or False"),
        (lambda: posenc.ALiBi(4, causal="yes"), TypeError, "causal must be True or False"),
        (
            lambda: shard_positions(8, 2, 0, load_balance="no"),
            TypeError,
            "load_balance must be True or False",
        ),
        (
            lambda: posenc.CausalSelfAttention(32, 4, encoding=posenc.ALiBi(1)),
            ValueError,
            r"encoding ALiBi has num_heads=1 but the attention has num_heads=4; build the encoding with 4 heads",
        ),
        (
            lambda: posenc.CausalSelfAttention(32, 4, encoding=posenc.T5Bias(8)),
            ValueError,
            "encoding T5Bias has num_heads=8 but the attention has num_heads=4",
        ),
        (
            lambda: posenc.CausalSelfAttention(256, 8, encoding=posenc.RoPE(64)),
            ValueError,
            r"encoding RoPE has head_dim=64 but the attention's heads have dim / num_heads = 256 / 8 = 32 channels",
        ),
        (
            lambda: posenc.CausalSelfAttention(32, 4)(torch.randn(1, 3, 32), return_attention="no"),
            TypeError,
            "return_attention must be True or False, got 'no'",
        ),
        (
            lambda: posenc.add_input_encoding(torch.zeros(2, 5, 16), posenc.Sinusoidal(16), torch.tensor([3])),
            ValueError,
            r"positions must have shape \(5,\) or \(2, 5\) to match the sequence, got \(1,\)",
        ),
        (
            lambda: posenc.add_input_encoding(torch.zeros(1, 5, 16), posenc.Sinusoidal(16), torch.zeros(4, 5).long()),
            ValueError,
            r"positions must have shape \(5,\) or \(1, 5\) to match the sequence, got \(4, 5\)",
        ),
        (
            lambda: posenc.add_input_encoding(torch.zeros(1, 5, 16), posenc.Sinusoidal(16), None),
            TypeError,
            r"add_input_encoding needs positions: torch.arange\(s\) .* cache.next_positions\(s\)",
        ),
        (lambda: posenc.CausalSelfAttention(32, 4, bias="False"), TypeError, "bias must be True or False, got 'False'"),
        (
            lambda: posenc.CausalSelfAttention(32, 4, encoding=torch.nn.Identity()),
            TypeError,
            r"encoding Identity does not declare where it acts: .*acts_on = posenc.ActsOn.QK",
        ),
        (
            lambda: posenc.CausalSelfAttention(32, 4)(torch.randn(1, 0, 32), cache=posenc.KVCache()),
            ValueError,
            r"x has no new tokens \(shape \(1, 0, 32\)\); the first step into a KV cache must add at least one",
        ),
        (
            lambda: posenc.T5Bias(2).score_bias(torch.arange(3, device="meta"), torch.arange(3, device="meta")),
            ValueError,
            "q_positions is on meta but the T5 bias table on cpu: a meta tensor has no values to move",
        ),
        (lambda: posenc.Sinusoidal(16)(torch.arange(3), dtype=torch.long), TypeError, "dtype must be a floating-point"),
        (lambda: posenc.LearnedAbsolute(8, 16)(torch.arange(3), dtype=torch.int32), TypeError, "dtype must be a"),
        (lambda: posenc.RoPE(16).cos_sin(torch.arange(3), dtype=torch.long), TypeError, "dtype must be a floating"),
        (
            lambda: posenc.KVCache().update(torch.randn(1, 2, 3, 8), torch.randn(1, 2, 5, 8), torch.arange(3)[None]),
            ValueError,
            r"k and v must be \(b, g, s, d\) with the same b, g and s",
        ),
        (
            lambda: posenc.KVCache().update(torch.randn(1, 2, 3, 8), torch.randn(1, 2, 3, 8), torch.arange(7)[None]),
            ValueError,
            r"positions must be \(b or 1, s\) = \(1 or 1, 3\)",
        ),
        (
            lambda: posenc.rope_frequencies(
                16, {"rope_type": "dynamic", "factor": 2.0}, max_position_embeddings=8, seq_len=-5
            ),
            ValueError,
            "seq_len must be a positive integer",
        ),
        (
            lambda: posenc.rope_frequencies(
                16, {"rope_type": "dynamic", "factor": 2.0}, max_position_embeddings=8, seq_len=100.5
            ),
            ValueError,
            "seq_len must be a positive integer",
        ),
        (
            lambda: posenc.rope_frequencies(16, {"rope_type": "linear", "type": "yarn", "factor": 2.0}),
            ValueError,
            r"rope_type='linear' and type='yarn'",
        ),
        # Errors from deep inside torch or Python before: each now names the argument.
        (
            lambda: posenc.RoPE(16, rope_parameters={"rope_type": "ntk", "factor": 1e300}),
            ValueError,
            r"the NTK base, .* overflows float64; use a smaller rope_parameters\['factor'\]",
        ),
        (
            lambda: posenc.rope_frequencies(
                16,
                {
                    "rope_type": "longrope",
                    "short_factor": [1.0] * 8,
                    "long_factor": [1.0] * 8,
                    "factor": 2.0,
                    "original_max_position_embeddings": 1,
                },
            ),
            ValueError,
            r"original_max_position_embeddings'\] must be >= 2 for longrope",
        ),
        (
            lambda: posenc.RoPE(16, base=1e4, rope_parameters={"rope_theta": "abc"}),
            TypeError,
            r"rope_parameters\['rope_theta'\] must be a real number > 1, got str",
        ),
        (lambda: posenc.CausalSelfAttention(32, 4)(torch.randn(1, 5, 16)), ValueError, r"x must be \(b, s, dim=32\)"),
        (
            lambda: posenc.CausalSelfAttention(32, 4)(torch.randn(1, 5, 32).double()),
            TypeError,
            "x is torch.float64 but the layer's weights are torch.float32",
        ),
        (
            lambda: posenc.CausalSelfAttention(32, 4).to("meta")(torch.randn(1, 5, 32)),
            ValueError,
            r"x is on cpu but the layer's weights are on meta; .* layer.to_empty\(device=...\)",
        ),
        (
            lambda: _meta_layer_loaded_by_assignment(lambda: posenc.ALiBi(4))(torch.randn(1, 5, 32)),
            ValueError,
            r"the layer's encoding ALiBi is on meta but x is on cpu; .* layer.to_empty\(device=...\), which "
            "recomputes ALiBi's slopes",
        ),
        (lambda: posenc.CausalSelfAttention(32, 4)(torch.randn(1, 5, 32), cache={}), TypeError, "cache must be a"),
        (
            lambda: posenc.CausalSelfAttention(32, 4, encoding="rope"),
            TypeError,
            r"encoding must be an nn.Module or None, got str; build one by name with posenc.build_for_model\('rope'",
        ),
        (
            lambda: posenc.ALiBi(4).score_bias(torch.arange(3), torch.arange(3, device="meta")),
            ValueError,
            "k_positions is on meta but the ALiBi slopes on cpu: a meta tensor has no values to move",
        ),
        (lambda: posenc.RoPE(16).cos_sin([1, 2]), TypeError, "positions must be an integer torch.Tensor, got list"),
        # Messages that named the wrong thing before.
        (
            lambda: posenc.RoPE(16, rope_parameters={"partial_rotary_factor": 0.01}),
            ValueError,
            r"partial_rotary_factor=0.01 of head_dim=16 gives rotary_dim=int\(16 \* 0.01\) = 0",
        ),
        (
            lambda: posenc.rope_frequencies(
                16, {"rope_type": "longrope", "short_factor": dict.fromkeys(range(8), 1.0), "long_factor": [1.0] * 8}
            ),
            TypeError,
            r"rope_parameters\['short_factor'\] must be a list of 8 positive numbers",
        ),
        (lambda: alibi_bias([0.5, 0.25], torch.arange(3), torch.arange(3)), TypeError, "slopes must be a torch.Tensor"),
        (lambda: alibi_bias(torch.ones(2, 2), torch.arange(3), torch.arange(3)), ValueError, r"slopes must be \(h,\)"),
        # Checks no test reached (found by a hand mutation pass: each could be dropped with every test passing).
        (lambda: alibi_bias(torch.tensor(0.5), torch.arange(3), torch.arange(3)), ValueError, r"slopes must be \(h,\)"),
        (
            lambda: alibi_bias(torch.ones(2), torch.arange(3), torch.arange(3), causal="yes"),
            TypeError,
            "causal must be True or False",
        ),
        (lambda: posenc.alibi_slopes(4, dtype=torch.int64), TypeError, "dtype must be a floating-point torch.dtype"),
        (
            lambda: posenc.T5Bias(2, num_buckets=8, max_distance=16).set_extra_state(torch.tensor([8, 16])),
            RuntimeError,
            r"must be an integer tensor \[num_buckets, max_distance, bidirectional\]",
        ),
        (
            lambda: posenc.apply_rotary(torch.randn(2, 0), torch.randn(2, 0), torch.randn(2, 0)),
            ValueError,
            r"cos must have a last dimension of r/2 >= 1 \(one value per rotated pair\), got shape \(2, 0\)",
        ),
        (
            lambda: MRoPE(64, mrope_section=[8, 12, 12])(
                torch.randn(2, 4, 5, 64), torch.randn(1, 2, 5, 64), positions=torch.zeros(3, 2, 5, dtype=torch.long)
            ),
            ValueError,
            r"q and k must share batch and sequence sizes, got \(2, 4, 5, 64\) and \(1, 2, 5, 64\)",
        ),
    ],
)
def test_errors_found_by_the_bad_input_audit(call, error, match):
    with pytest.raises(error, match=match):
        call()


_cpu_x = torch.randn(1, 2, 5, 8)
_meta_ids = torch.arange(5, device="meta")
_i = torch.arange(5)


@pytest.mark.parametrize(
    ("call", "error", "match"),
    [
        # Silent before: a learned table read meta ids as zeros on the CPU, and skipped its range check.
        (
            lambda: posenc.LearnedAbsolute(8, 16)(torch.tensor([100, 5, 3], device="meta")),
            ValueError,
            "positions is on meta but the learned table on cpu: a meta tensor has no values",
        ),
        # Failed inside torch ("Cannot copy out of meta tensor") before.
        (
            lambda: posenc.RoPE(8)(_cpu_x, _cpu_x, positions=_meta_ids),
            ValueError,
            "positions is on meta but q on cpu",
        ),
        (
            lambda: posenc.RoPE(8)(_cpu_x, _cpu_x, offset=torch.zeros(1, dtype=torch.long, device="meta")),
            ValueError,
            "offset is on meta but q on cpu",
        ),
        (
            lambda: posenc.CausalSelfAttention(32, 4)(torch.randn(1, 5, 32), document_ids=_meta_ids * 0),
            ValueError,
            "document_ids is on meta but the activations on cpu",
        ),
        (
            lambda: posenc.add_input_encoding(torch.randn(1, 5, 16, device="meta"), posenc.LearnedAbsolute(8, 16), _i),
            ValueError,
            r"the encoding LearnedAbsolute is on cpu but x is on meta; move it with encoding.to\(x.device\)",
        ),
        # Silent before: dynamic NTK / LongRoPE scaled for the shorter length given.
        (
            lambda: posenc.RoPE(16, rope_parameters={"rope_type": "dynamic", "factor": 4.0}, max_position_embeddings=8)(
                torch.randn(1, 2, 100, 16), torch.randn(1, 2, 100, 16), seq_len=10
            ),
            ValueError,
            r"seq_len is shorter than the positions .*got seq_len=10 for positions up to 99",
        ),
        (
            lambda: posenc.RoPE(16).cos_sin(torch.arange(5), seq_len=4),
            ValueError,
            "got seq_len=4 for positions up to 4",
        ),
        # Silent before: the rotation ran on 16-bit angles (errors of 5e-4 to 3e-3), or on cos and sin of two dtypes.
        (
            lambda: posenc.apply_rotary(_cpu_x, torch.ones(5, 4).half(), torch.ones(5, 4).half()),
            TypeError,
            r"cos/sin must be float32 or float64 \(whatever x's dtype\), got torch.float16",
        ),
        (  # float8 (a quantized model's dtype) was called 16-bit
            lambda: posenc.apply_rotary(
                _cpu_x, torch.ones(5, 4).to(torch.float8_e4m3fn), torch.ones(5, 4).to(torch.float8_e4m3fn)
            ),
            TypeError,
            r"got torch.float8_e4m3fn: 8-bit cos/sin lose the angles' precision",
        ),
        (
            lambda: posenc.apply_rotary(_cpu_x, torch.ones(8, 4).bfloat16(), torch.ones(8, 4).bfloat16(), offset=0),
            TypeError,
            "cos/sin must be float32 or float64",
        ),
        (
            lambda: posenc.apply_rotary(_cpu_x, torch.ones(5, 4), torch.ones(5, 4).double()),
            TypeError,
            "cos and sin must share a dtype, got torch.float32 and torch.float64",
        ),
        # Silent before: frequencies of 0, nothing rotated.
        (
            lambda: posenc.rope_frequencies(16, {"rope_type": "proportional", "partial_rotary_factor": 0.01}),
            ValueError,
            r"turns int\(0.01 \* 16 // 2\) = 0 pairs .* choose a factor >= 0.125",
        ),
        (
            lambda: posenc.rope_frequencies(16, {"rope_type": "linear", "factor": 1e50}),
            ValueError,
            r"rope_type 'linear' .* gives frequencies that are 0 or infinite in float32",
        ),
        # Bare errors from deep code before.
        (
            lambda: posenc.rope_frequencies(16, {"rope_type": ["yarn"]}),
            TypeError,
            r"rope_parameters\['rope_type'\] must be a string naming the type",
        ),
        (
            lambda: posenc.rope_frequencies(16, {"partial_rotary_factor": "0.5"}),
            TypeError,
            "partial_rotary_factor must be a number in",
        ),
        (lambda: posenc.apply_rotary_([[1.0, 2.0]], torch.ones(1, 1), torch.ones(1, 1)), TypeError, "x must be a"),
        (
            lambda: posenc.CausalSelfAttention(32, 4)(torch.randn(1, 3, 32), cache=posenc.KVCache(3)),
            TypeError,
            "KVCache.k must be a torch.Tensor or None, got int; start with KVCache()",
        ),
        (
            lambda: posenc.KVCache(k=torch.zeros(1, 4, 2, 8), v=torch.zeros(1, 4, 2, 8)),
            ValueError,
            "KVCache needs k, v and positions together .*got only k, v",
        ),
        (
            lambda: posenc.KVCache().update(torch.zeros(1, 4, 2, 8), torch.zeros(1, 4, 2, 8), torch.tensor([[0.5, 1]])),
            TypeError,
            "positions must hold integer positions",
        ),
        # Negative key positions were cached (next_positions continued from them); the attention refused them only
        # at a forward call that resolved its own positions.
        (
            lambda: posenc.KVCache(torch.zeros(1, 2, 5, 8), torch.zeros(1, 2, 5, 8), (torch.arange(5) - 3)[None]),
            ValueError,
            r"positions must be >= 0 \(the cached keys' token positions\), got a negative entry",
        ),
        (
            lambda: posenc.KVCache().update(torch.zeros(1, 2, 2, 8), torch.zeros(1, 2, 2, 8), torch.tensor([[0, -1]])),
            ValueError,
            r"positions must be >= 0 \(the cached keys' token positions\), got a negative entry",
        ),
        # ids + offset past 2**63 - 1 wrapped negative: "positions must be >= 0, got a negative entry (-2**63)".
        (
            lambda: MRoPE(16, mrope_section=[2, 3, 3])(
                torch.randn(1, 2, 4, 16),
                torch.randn(1, 2, 4, 16),
                positions=torch.arange(4).expand(3, 1, 4),
                offset=2**63 - 1,
            ),
            ValueError,
            r"offset \+ position ids must fit in int64 .*offset=9223372036854775807 with ids up to 3",
        ),
        (
            lambda: posenc.RoPE(16)(q16 := torch.randn(1, 2, 4, 16), q16, offset=torch.tensor([2**63 - 1])),
            ValueError,
            r"the last position, offset \+ seq_len - 1, must fit in int64",
        ),
        # Meta values: torch's bare "Tensor.item() cannot be called on meta tensors" from deep inside before.
        (
            lambda: testing.assert_close(torch.randn(3, device="meta"), torch.randn(3, device="meta")),
            ValueError,
            "assert_close compares values, and actual is on the meta device",
        ),
        (  # a meta reference beside a real actual (mutation pass 13: only both on meta was tried)
            lambda: testing.assert_close(torch.ones(3), torch.ones(3, device="meta")),
            ValueError,
            "assert_close compares values, and reference is on the meta device",
        ),
        (
            lambda: testing.assert_close(torch.ones(3), torch.ones(3), scale=torch.tensor(1.0, device="meta")),
            ValueError,
            "assert_close compares values, and scale is on the meta device",
        ),
        (
            lambda: posenc.rope_frequencies(8, {"rope_type": "linear", "factor": torch.tensor(2.0, device="meta")}),
            TypeError,
            r"rope_parameters\['factor'\] is a meta tensor, which holds no value to read",
        ),
    ],
)
def test_errors_found_by_the_second_bad_input_audit(call, error, match):
    with pytest.raises(error, match=match):
        call()


_cos4 = torch.randn(4, 4)
_longrope = {"rope_type": "longrope", "short_factor": [1.0] * 4, "original_max_position_embeddings": 16, "factor": 2.0}


def _view_made_under_no_grad() -> torch.Tensor:
    activations = torch.randn(1, 4, 2, 8, requires_grad=True) * 1
    with torch.no_grad():
        return activations.transpose(1, 2)


def _byte_lm():
    from posenc.lab.model import ByteLM, ModelSpec

    return ByteLM(ModelSpec(dim=16, layers=1, heads=2, max_positions=8), "rope")


@pytest.mark.parametrize(
    ("call", "error", "match"),
    [
        # Silent before: k's channels past q's head dim passed through unrotated.
        (
            lambda: posenc.apply_rotary_qk(torch.randn(1, 2, 4, 8), torch.randn(1, 2, 4, 16), _cos4, _cos4),
            ValueError,
            r"q and k must share a head dim \(their last dim\), got 8, 16",
        ),
        # Silent before: cos and sin times 1e39 are infinite in float32, and 1e-50 rounds them to 0.
        (
            lambda: posenc.RoPE(
                8,
                rope_parameters={"rope_type": "yarn", "factor": 2.0, "attention_factor": 1e39},
                max_position_embeddings=16,
            ),
            ValueError,
            r"gives an attention factor of 1e\+39, which cos and sin cannot carry in float32",
        ),
        (
            lambda: posenc.rope_frequencies(
                8, {"rope_type": "yarn", "factor": 2.0, "attention_factor": 1e-50}, max_position_embeddings=16
            ),
            ValueError,
            r"gives an attention factor of 1e-50",
        ),
        # Silent before: the length-dependent types skipped the float32 range check of their frequencies.
        (
            lambda: posenc.rope_frequencies(
                8, {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e300}, max_position_embeddings=16
            ),
            ValueError,
            r"rope_type 'dynamic' .* gives frequencies that are 0 or infinite in float32",
        ),
        (
            lambda: posenc.rope_frequencies(8, {**_longrope, "long_factor": [1e-300] * 4}, max_position_embeddings=32),
            ValueError,
            r"rope_type 'longrope' .* gives frequencies that are 0 or infinite in float32",
        ),
        # Silent before: sizes a family does not read went unchecked until the name changed.
        (
            lambda: posenc.build_for_model("rope", dim=-1, num_heads=2, head_dim=8, max_positions=8),
            ValueError,
            "dim must be a positive integer, got -1",
        ),
        (
            lambda: posenc.build_for_model("alibi", dim=16, num_heads=2, head_dim=8, max_positions=0),
            ValueError,
            "max_positions must be a positive integer, got 0",
        ),
        # Bare errors from deep code before.
        (
            lambda: posenc.apply_rotary_(torch.randn(1, 2, 4, 8, requires_grad=True), _cos4, _cos4, backend="torch"),
            RuntimeError,
            "x is a leaf tensor that requires grad, .* use apply_rotary for a rotated copy",
        ),
        (
            lambda: posenc.apply_rotary_(torch.randn(1, 2, 4, 8, requires_grad=True), _cos4, _cos4, backend="cpu"),
            RuntimeError,
            "x is a leaf tensor that requires grad",
        ),
        # Called a leaf (it has no grad_fn), or torch's "a leaf Variable" on the fused backends.
        (
            lambda: posenc.apply_rotary_(_view_made_under_no_grad(), _cos4, _cos4, backend="cpu"),
            RuntimeError,
            r"x is a view made under torch\.no_grad\(\) of a tensor that requires grad, .* rotate a copy with "
            "apply_rotary",
        ),
        (
            lambda: posenc.RoPE(8)(q, q, offset=2**63),
            ValueError,
            r"the last position, offset \+ seq_len - 1, must fit in int64 \(below 2\*\*63, a token position\), "
            r"got 9223372036854775811",
        ),
        (lambda: posenc.RoPE(8)(q, q, offset=2**63 - 2), ValueError, r"offset \+ seq_len - 1, must fit in int64"),
        (lambda: posenc.RoPE(8)(q, q, offset=2**64), ValueError, r"offset \+ seq_len - 1, must fit in int64"),
        (lambda: posenc.ALiBi(2).bias(2, 2, offset=2**63 - 1), ValueError, r"offset \+ q_len - 1, must fit in int64"),
        # offset + position ids past 2**63 - 1 wrapped negative and was reported as a negative position.
        (
            lambda: posenc.RoPE(8)(q, q, offset=5, positions=torch.tensor([0, 1, 2, 2**63 - 1])),
            ValueError,
            r"offset \+ position ids must fit in int64 \(below 2\*\*63, a token position\), got a sum past 2\*\*63 - 1",
        ),
        (
            lambda: posenc.RoPE(8)(q, q, offset=torch.tensor([2**63 - 2]), positions=torch.arange(4)),
            ValueError,
            r"offset \+ position ids must fit in int64",
        ),
        (
            lambda: posenc.apply_rotary(
                q, _cos4, _cos4, offset=torch.tensor([5]), positions=torch.tensor([0, 1, 2, 2**63 - 1]), backend="cpu"
            ),
            ValueError,
            r"offset \+ position ids must fit in int64",
        ),
        (
            lambda: MRoPE(8, mrope_section=[2, 1, 1])(
                q, q, offset=2**64, positions=torch.zeros(3, 1, 4, dtype=torch.long)
            ),
            ValueError,
            "offset must fit in int64",
        ),
        (
            lambda: MRoPE(8, mrope_section=[2, 1, 1])(
                q, q, positions=torch.zeros(3, 1, 4, dtype=torch.long, device="meta")
            ),
            ValueError,
            "positions is on meta but the activations on cpu",
        ),
        (
            lambda: posenc.add_input_encoding(torch.randn(1, 4, 8), "learned", torch.arange(4)),
            TypeError,
            r"encoding must be an nn.Module or None, got str; build one by name with posenc.build_for_model",
        ),
        (lambda: _byte_lm()(torch.tensor([[256]])), ValueError, r"tokens must be byte ids in 0..255, got ids from 256"),
        (
            lambda: _byte_lm()(torch.tensor([[-1, 3]])),
            ValueError,
            r"tokens must be byte ids in 0..255, got ids from -1",
        ),
        (lambda: _byte_lm()(torch.tensor([[1.0]])), TypeError, "tokens must be an integer tensor of byte ids"),
    ],
)
def test_errors_found_by_the_third_bad_input_audit(call, error, match):
    with pytest.raises(error, match=match):
        call()


@pytest.mark.parametrize(
    ("call", "error", "match"),
    [
        # Silent before: the last column of an odd dim was torch.empty's, never written (any values memory held).
        (lambda: testing.sinusoidal_reference(torch.arange(3), 7), ValueError, "dim must be even"),
        # Silent before: any layout but 'bhsd' was read as 'bshd'.
        (lambda: testing.random_qk(1, 2, 2, 3, 8, layout="bhds"), ValueError, "layout must be 'bhsd' or 'bshd'"),
    ],
)
def test_errors_found_by_the_fourth_bad_input_audit(call, error, match):
    with pytest.raises(error, match=match):
        call()


def _consistent_step(cache: posenc.KVCache) -> None:
    rope = posenc.RoPE(
        8, rope_parameters={"rope_type": "dynamic", "factor": 2.0}, max_position_embeddings=4, mode="consistent"
    )
    posenc.CausalSelfAttention(32, 4, num_kv_heads=2, encoding=rope)(torch.randn(2, 1, 32), cache=cache)


_k5 = torch.randn(2, 2, 5, 8)
_p5 = torch.arange(5)[None]


@pytest.mark.parametrize(
    ("call", "error", "match"),
    [
        # An empty AssertionError from KVCache._check_new at the first step before.
        (
            lambda: _consistent_step(posenc.KVCache(unrotated_k=_k5)),
            ValueError,
            r"KVCache.unrotated_k belongs to the cached keys k .* give it with k, v and positions",
        ),
        (
            lambda: posenc.KVCache(rotated_with=torch.ones(4, dtype=torch.float64)),
            ValueError,
            r"KVCache.rotated_with belongs to the cached keys k",
        ),
        # An error about the rotation's shapes ("x must be (b, h, t, d=8) and positions (b or 1, t)") before.
        (
            lambda: _consistent_step(posenc.KVCache(_k5, _k5, _p5, unrotated_k=_k5[:, :, :3])),
            ValueError,
            r"KVCache.unrotated_k must be the keys k before rotation, of k's shape \(2, 2, 5, 8\), dtype "
            r"torch.float32 and device cpu; got \(2, 2, 3, 8\)",
        ),
        # Silent before: integer unrotated keys kept, a 2-D rotated_with kept.
        (
            lambda: posenc.KVCache(_k5, _k5, _p5, unrotated_k=_k5.long()),
            TypeError,
            "KVCache.unrotated_k must be a floating-point tensor",
        ),
        (
            lambda: posenc.KVCache(_k5, _k5, _p5, unrotated_k=_k5, rotated_with=torch.ones(4, 1)),
            ValueError,
            r"KVCache.rotated_with must be the \(r/2,\) frequencies the keys were rotated with, got shape \(4, 1\)",
        ),
        # Mutation pass 13: unrotated keys of k's shape in another dtype (re-rotated in float64, then cast into k's
        # float32), and a 0-d rotated_with, passed the checks as long as the shape matched / was not 2-D.
        (
            lambda: posenc.KVCache(_k5, _k5, _p5, unrotated_k=_k5.double()),
            ValueError,
            r"KVCache.unrotated_k must be the keys k before rotation, of k's shape \(2, 2, 5, 8\), dtype "
            r"torch.float32 .* got \(2, 2, 5, 8\), torch.float64",
        ),
        (
            lambda: posenc.KVCache(_k5, _k5, _p5, unrotated_k=_k5, rotated_with=torch.tensor(1.0)),
            ValueError,
            r"KVCache.rotated_with must be the \(r/2,\) frequencies the keys were rotated with, got shape \(\)",
        ),
        # "len() of a 0-d tensor" from inside torch before.
        *(
            (
                lambda factor=factor: posenc.rope_frequencies(
                    8, {**_longrope, "long_factor": [1.0] * 4, "short_factor": factor}
                ),
                TypeError,
                r"rope_parameters\['short_factor'\] must be a list of 4 positive numbers",
            )
            for factor in (torch.tensor(1.0), torch.tensor(1.0).numpy())
        ),
        # An AttributeError ("'list' object has no attribute 'dim'") before.
        (
            lambda: posenc.KVCache().next_positions(3, document_ids=[0, 0, 1]),
            TypeError,
            "document_ids must be an integer torch.Tensor, got list",
        ),
    ],
)
def test_errors_found_by_the_fifth_bad_input_audit(call, error, match):
    with pytest.raises(error, match=match):
        call()


def test_a_cache_built_with_its_unrotated_keys_decodes_as_one_filled_by_the_attention() -> None:
    rope = posenc.RoPE(
        8, rope_parameters={"rope_type": "dynamic", "factor": 2.0}, max_position_embeddings=4, mode="consistent"
    )
    torch.manual_seed(0)
    layer = posenc.CausalSelfAttention(32, 4, num_kv_heads=2, encoding=rope)
    x = torch.randn(2, 6, 32)
    filled = posenc.KVCache()
    layer(x[:, :5], cache=filled)
    rebuilt = posenc.KVCache(
        filled.k, filled.v, filled.positions, unrotated_k=filled.unrotated_k, rotated_with=filled.rotated_with
    )
    torch.testing.assert_close(layer(x[:, 5:], cache=rebuilt), layer(x[:, 5:], cache=filled), rtol=0, atol=0)


def test_byte_ids_may_come_as_uint8():
    """A byte corpus read as uint8 (nn.Embedding takes int32/int64 only): the same logits as int64 ids."""
    model, ids = _byte_lm(), torch.tensor([[104, 105, 0, 255]])
    assert torch.equal(model(ids.to(torch.uint8))[0], model(ids)[0])


def test_numpy_numbers_are_numbers() -> None:
    np = pytest.importorskip("numpy")
    rope = posenc.RoPE(16, rope_parameters={"partial_rotary_factor": np.float32(0.5), "rope_theta": np.float32(500.0)})
    assert (rope.rotary_dim, rope.spec.base) == (8, 500.0)
    # Sizes too: "must be a positive integer, got np.int64(16)" before.
    dynamic = {"rope_type": "dynamic", "factor": 2.0}
    rope = posenc.RoPE(np.int64(16), rope_parameters=dynamic, max_position_embeddings=np.int64(8))
    q = torch.randn(1, 2, 20, 16)
    assert type(rope.head_dim) is int and torch.equal(rope(q, q, seq_len=np.int64(20))[0], rope(q, q, seq_len=20)[0])
    assert type(posenc.ALiBi(np.int64(4)).num_heads) is int


def test_real_parameters_take_one_element_tensors_alike() -> None:
    """Every real number of rope_parameters is read alike from a one-element tensor: a tensor factor was taken while
    rope_theta, RoPE's base and partial_rotary_factor were refused ("must be a real number > 1, got Tensor")."""
    plain = posenc.RoPE(16, rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 500.0})
    as_tensors = {"rope_type": "linear", "factor": torch.tensor(2.0), "rope_theta": torch.tensor(500.0)}
    assert posenc.RoPE(16, rope_parameters=as_tensors).spec == plain.spec
    assert posenc.RoPE(16, rope_parameters={**as_tensors, "partial_rotary_factor": torch.tensor(0.5)}).rotary_dim == 8
    assert posenc.RoPE(16, base=torch.tensor(500)).spec.base == 500.0
    assert type(posenc.RoPE(16, base=torch.tensor(500.0)).spec.base) is float
    with pytest.raises(TypeError, match="base is a meta tensor, which holds no value to read"):
        posenc.RoPE(16, base=torch.tensor(500.0, device="meta"))
    with pytest.raises(TypeError, match=r"base must be a real number > 1, got bool"):
        posenc.RoPE(16, base=torch.tensor(True))
    with pytest.raises(ValueError, match=r"partial_rotary_factor must be in \(0, 1\]"):
        posenc.RoPE(16, rope_parameters={"partial_rotary_factor": torch.tensor(1.5)})


def test_configs_transformers_warns_about_are_warned_about() -> None:
    llama3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0}
    with pytest.warns(UserWarning, match="original_max_position_embeddings..=8192 is above max_position_embeddings"):
        posenc.rope_frequencies(16, llama3 | {"original_max_position_embeddings": 8192}, max_position_embeddings=4096)
    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 4096}
    with pytest.warns(UserWarning, match=r"factor..=4.0 differs from max_position_embeddings / .* = 1024 / 4096"):
        posenc.rope_frequencies(16, yarn, max_position_embeddings=1024)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the usual configs, and an original defaulted to the maximum
        posenc.rope_frequencies(16, yarn, max_position_embeddings=16384)
        posenc.rope_frequencies(16, llama3, max_position_embeddings=8192)
        posenc.rope_frequencies(16, yarn | {"original_max_position_embeddings": 1024}, max_position_embeddings=1024)


def test_meta_activations_take_real_ids_and_seq_len_is_checked_on_every_path() -> None:
    """Shape inference on meta with CPU ids works (only meta ids for real activations are refused); a seq_len
    that does not cover the positions is refused for fixed types too, whose table path skipped the check."""
    meta = torch.empty(1, 2, 5, 16, device="meta")
    assert posenc.RoPE(16)(meta, meta, positions=torch.arange(5))[0].device.type == "meta"
    layer = posenc.CausalSelfAttention(32, 4, encoding=posenc.build("rope", 8)).to("meta")
    x = torch.empty(1, 5, 32, device="meta")
    assert layer(x, positions=torch.arange(5), document_ids=torch.zeros(5, dtype=torch.long)).device.type == "meta"
    q = torch.randn(1, 2, 10, 16)
    with pytest.raises(ValueError, match="got seq_len=2 for positions up to 9"):
        posenc.RoPE(16)(q, q, seq_len=2)
    with pytest.raises(ValueError, match="got seq_len=12 for positions up to 12"):
        posenc.RoPE(16)(q, q, offset=torch.tensor([3]), seq_len=12)
    assert torch.equal(posenc.RoPE(16)(q, q, offset=3, seq_len=13)[0], posenc.RoPE(16)(q, q, offset=3)[0])
    with pytest.raises(ValueError, match="rope_type 'proportional' turns all channels in pairs; head_dim=5 is odd"):
        posenc.rope_frequencies(5, {"rope_type": "proportional"})
    assert posenc.rope_frequencies(98, {"rope_type": "proportional", "partial_rotary_factor": 0.0205})[0][0] == 1


def test_warnings_point_at_the_callers_line() -> None:
    with pytest.warns(UserWarning, match="transformers warns") as caught:
        posenc.RoPE(
            64,
            rope_parameters={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024},
            max_position_embeddings=2048,
        )
    assert caught[0].filename == __file__


def test_the_command_line_refuses_what_its_types_cannot_hold(capsys) -> None:
    from posenc.cli import _comma_names, build_parser

    for argv in (["lab", "--lr", "nan"], ["plot", "--out", "x", "--rope-param", "=4"]):
        with pytest.raises(SystemExit):
            build_parser().parse_args(argv)
    assert _comma_names("none") == ()
    # An empty item was dropped without a word, and --extensions '' read as none.
    for argv in (["lab", "--encodings", "rope,,alibi"], ["lab", "--extensions", ""], ["lab", "--eval-lengths", "64,"]):
        with pytest.raises(SystemExit):
            build_parser().parse_args(argv)
        assert "with no empty item" in capsys.readouterr().err


def test_a_cache_filled_with_grad_enabled_deep_copies() -> None:
    """torch refuses to deepcopy a tensor with history: copy.deepcopy(cache) failed after a training-mode step."""
    import copy

    attn = posenc.CausalSelfAttention(32, 4, encoding=posenc.build("rope", 8))
    cache = posenc.KVCache()
    attn(torch.randn(1, 3, 32), cache=cache)
    twin = copy.deepcopy(cache)
    assert twin.k is not cache.k and torch.equal(twin.k, cache.k) and twin.k.grad_fn is not None
    x = torch.randn(1, 1, 32)
    assert torch.equal(attn(x, cache=twin), attn(x, cache=cache))


def test_in_place_rotation_still_takes_a_slice_of_a_fused_projection() -> None:
    """The overlap test lets gaps through: q cut out of a (b, s, 3, h, d) qkv projection is rotated in place."""
    qkv = torch.randn(2, 5, 3, 4, 16)
    q = qkv[:, :, 0].transpose(1, 2)  # (b, h, s, d), strides with gaps
    angles = torch.rand(5, 8)
    expected = posenc.apply_rotary(q, angles.cos(), angles.sin())
    posenc.apply_rotary_(q, angles.cos(), angles.sin())
    torch.testing.assert_close(qkv[:, :, 0].transpose(1, 2), expected)


def test_rope_type_and_its_legacy_spelling_may_both_be_given_when_they_agree() -> None:
    """Qwen2-VL configs carry type 'mrope' beside rope_type 'default': transformers reads both as 'default'."""
    rope = posenc.RoPE(64, rope_parameters={"type": "mrope", "rope_type": "default"})
    assert rope.spec.rope_type == "default"
    su = {"type": "su", "short_factor": [1.0] * 32, "long_factor": [2.0] * 32}
    assert posenc.RoPE(64, rope_parameters=su, max_position_embeddings=4096).spec.rope_type == "longrope"


def test_numpy_integers_are_offsets_everywhere_as_for_the_bias_encodings() -> None:
    """ALiBi took np.int64(3) as an offset while RoPE, MRoPE and apply_rotary refused it as 'got int64'."""
    np = pytest.importorskip("numpy")
    rope, mrope = posenc.RoPE(8), MRoPE(8, mrope_section=[2, 1, 1])
    q, k = torch.randn(1, 2, 3, 8), torch.randn(1, 2, 3, 8)
    cos, sin = rope.cos_sin(torch.arange(10))
    axes = torch.arange(3).expand(3, 1, 3)
    for offset in (np.int64(3), np.int32(3), np.uint8(3)):
        assert torch.equal(rope(q, k, offset=offset)[0], rope(q, k, offset=3)[0])
        assert torch.equal(posenc.apply_rotary(q, cos, sin, offset=offset), posenc.apply_rotary(q, cos, sin, offset=3))
        assert torch.equal(mrope(q, k, positions=axes, offset=offset)[0], mrope(q, k, positions=axes, offset=3)[0])
    with pytest.raises(ValueError, match="offset must be >= 0"):
        rope(q, k, offset=np.int64(-1))
    with pytest.raises(TypeError, match="offset must be an int"):
        rope(q, k, offset=np.float32(3))


def test_testing_assert_close_compares_integers_exactly():
    """Integer tensors (positions, buckets) raised KeyError: torch.int64, from the tolerance table."""
    testing.assert_close(torch.tensor([1, 2**60 + 1]), torch.tensor([1, 2**60 + 1]))
    testing.assert_close(torch.tensor([0, 3]), torch.tensor([0.0, 3.0], dtype=torch.float64))
    with pytest.raises(AssertionError):
        testing.assert_close(torch.tensor([2**60 + 1]), torch.tensor([2**60]))  # equal once in float64
    with pytest.raises(TypeError, match=r"has tolerances for .* got actual of dtype torch.complex64"):
        testing.assert_close(torch.zeros(2, dtype=torch.complex64), torch.zeros(2))


def test_testing_references_name_mismatched_shapes():
    """Both raised torch's broadcast RuntimeError, naming tensors a and b."""
    q, kv = torch.randn(1, 3, 4, 8), torch.randn(1, 2, 4, 8)
    with pytest.raises(ValueError, match="q's heads must be a multiple of k's"):
        testing.attention_reference(q, kv, kv)
    with pytest.raises(ValueError, match=r"positions must be \(s,\) or broadcastable to x.shape\[:-1\] = \(1, 4\)"):
        testing.rope_reference(torch.randn(1, 4, 8), torch.arange(5))
    broadcast = testing.rope_reference(torch.ones(2, 3, 4, 8), torch.arange(4).expand(3, 4))
    torch.testing.assert_close(broadcast, testing.rope_reference(torch.ones(2, 3, 4, 8), torch.arange(4)))


@pytest.mark.parametrize(
    "call",
    [
        lambda nested, cos, sin: posenc.apply_rotary(nested, cos[:1], sin[:1]),
        lambda nested, cos, sin: posenc.apply_rotary(nested, cos, sin, offset=0, layout="bshd"),
        lambda nested, cos, sin: posenc.apply_rotary_(nested, cos, sin, offset=0, layout="bshd"),
        lambda nested, cos, sin: posenc.RoPE(8)(nested, nested),
    ],
    ids=["broadcast", "table", "in place", "RoPE"],
)
def test_a_nested_tensor_is_refused_with_the_packed_form_that_works(call):
    """A jagged nested tensor (a natural way to hold packed sequences) broke deep inside torch ("'NestedIntNode'
    object has no attribute 'add'"); it is refused, naming the packed call, which rotates each sequence from 0."""
    sequences = [torch.randn(3, 2, 8), torch.randn(2, 2, 8)]
    nested = torch.nested.nested_tensor(sequences, layout=torch.jagged)
    angles = torch.arange(16.0)[:, None] * torch.rand(4)
    cos, sin = angles.cos(), angles.sin()
    with pytest.raises(TypeError, match=r"is a nested tensor.*\.values\(\) \(total_tokens, h, d\) with cu_seqlens="):
        call(nested, cos, sin)
    packed = posenc.apply_rotary(nested.values(), cos, sin, cu_seqlens=nested.offsets())
    one_by_one = [posenc.apply_rotary(s, cos, sin, offset=0, layout="bshd") for s in (x[None] for x in sequences)]
    torch.testing.assert_close(packed, torch.cat(one_by_one, dim=1)[0], rtol=0, atol=0)


@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors is in prototype stage:UserWarning")
def test_a_strided_nested_tensor_is_refused_with_a_conversion_that_works():
    """torch.nested.nested_tensor's default layout (torch.strided) has no offsets() and its values() is a flat
    buffer: the advice given for a jagged tensor failed with AttributeError. The message names the jagged
    conversion, and what it names rotates each sequence from 0."""
    sequences = [torch.randn(3, 2, 8), torch.randn(2, 2, 8)]
    x = torch.nested.nested_tensor(sequences)
    angles = torch.arange(16.0)[:, None] * torch.rand(4)
    cos, sin = angles.cos(), angles.sin()
    with pytest.raises(TypeError, match=r"layout=torch\.jagged\)\) as jagged\.values\(\).*to_padded_tensor") as info:
        posenc.apply_rotary(x, cos, sin, offset=0, layout="bshd")
    assert "x.offsets()" not in str(info.value)
    jagged = torch.nested.nested_tensor(list(x.unbind()), layout=torch.jagged)  # as the message says
    packed = posenc.apply_rotary(jagged.values(), cos, sin, cu_seqlens=jagged.offsets())
    one_by_one = [posenc.apply_rotary(s, cos, sin, offset=0, layout="bshd") for s in (s[None] for s in sequences)]
    torch.testing.assert_close(packed, torch.cat(one_by_one, dim=1)[0], rtol=0, atol=0)


@pytest.mark.filterwarnings("ignore:Sparse CSR tensor support is in beta state:UserWarning")
@pytest.mark.parametrize("layout", ["coo", "csr"])
@pytest.mark.parametrize(
    "call",
    [
        lambda x, cos, sin, sparse: posenc.apply_rotary(sparse(x), cos[:5], sin[:5]),
        lambda x, cos, sin, sparse: posenc.apply_rotary(x, sparse(cos[:5]), sin[:5]),
        lambda x, cos, sin, sparse: posenc.apply_rotary_(sparse(x), cos, sin, offset=0),
        lambda x, cos, sin, sparse: posenc.RoPE(8)(sparse(x), x),
    ],
    ids=["x", "cos", "in place", "RoPE"],
)
def test_a_sparse_tensor_is_refused_naming_to_dense(call, layout):
    """A sparse x or cos broke deep inside torch ("unsupported memory format option Contiguous", "copy_() between
    dense and sparse Tensors is not implemented", "Could not run 'aten::addcmul.out' ... 'SparseCPU' backend")."""
    x = torch.randn(2, 3, 5, 8)
    angles = torch.arange(16.0)[:, None] * torch.rand(4)
    sparse = torch.Tensor.to_sparse if layout == "coo" else lambda t: t.to_sparse_csr(dense_dim=t.dim() - 2)
    refusal = r"is a torch\.sparse_\w+ tensor, which posenc does not take: pass \w+\.to_dense\(\)"
    with pytest.raises(TypeError, match=refusal):
        call(x, angles.cos(), angles.sin(), sparse)


@pytest.mark.parametrize("model", [None, 3, (1, 2)], ids=["None", "int", "tuple"])
def test_is_patched_and_unpatch_model_take_an_object_that_is_no_module(model):
    """An object without a __dict__ made is_patched raise TypeError ("vars() argument must have __dict__ attribute")
    where it answered False; unpatch_model raised that bare error rather than saying what model must be."""
    from posenc.interop.patch import is_patched, unpatch_model

    assert is_patched(model) is False
    with pytest.raises(ValueError, match=r"not patched by posenc: model must be the nn\.Module that patch_model"):
        unpatch_model(model)


@pytest.mark.parametrize(
    "call",
    [
        lambda x, freqs_cis: posenc.apply_rotary(x, freqs_cis[:5, None], freqs_cis[:5, None], interleaved=True),
        lambda x, freqs_cis: posenc.apply_rotary(x, freqs_cis, freqs_cis, offset=0, layout="bshd", interleaved=True),
        lambda x, freqs_cis: posenc.apply_rotary_(x, freqs_cis, freqs_cis, offset=0, layout="bshd", interleaved=True),
    ],
    ids=["broadcast", "table", "in place"],
)
def test_a_complex_freqs_cis_is_refused_naming_its_real_and_imaginary_parts(call):
    """Meta's complex freqs_cis as cos/sin was refused with "cast it with .float()", which drops the imaginary part:
    followed, cos and sin both became cos(angle) and q and k were rotated wrongly without an error. The message names
    .real and .imag with adjacent pairs, and that call is Meta's complex product."""
    x = torch.randn(2, 5, 3, 8, dtype=torch.float64)
    angles = torch.arange(16.0, dtype=torch.float64)[:, None] * torch.rand(4, dtype=torch.float64)
    freqs_cis = torch.polar(torch.ones_like(angles), angles)
    with pytest.raises(TypeError, match=r"cos is complex .*\.float\(\) would drop its imaginary part") as info:
        call(x, freqs_cis)
    assert "cos=freqs_cis.real, sin=freqs_cis.imag, with interleaved=True" in str(info.value)
    out = posenc.apply_rotary(x, freqs_cis.real, freqs_cis.imag, offset=0, layout="bshd", interleaved=True)
    meta = torch.view_as_real(torch.view_as_complex(x.reshape(2, 5, 3, 4, 2)) * freqs_cis[:5, None]).flatten(3)
    torch.testing.assert_close(out, meta, rtol=1e-15, atol=1e-15)


def test_a_complex_x_is_refused_naming_its_real_view():
    angles = torch.arange(16.0)[:, None] * torch.rand(4)
    pairs = torch.view_as_complex(torch.randn(2, 3, 5, 4, 2))
    with pytest.raises(TypeError, match=r"x is complex .*torch\.view_as_real\(x\)\.flatten\(-2\)\), rotated with "):
        posenc.apply_rotary(pairs, angles.cos()[:5], angles.sin()[:5])
    with pytest.raises(TypeError, match=r"q is complex .*torch\.view_as_real\(q\)\.flatten\(-2\)\)"):
        posenc.RoPE(8)(pairs, pairs)


@pytest.mark.parametrize("flat", [False, True], ids=["(n, h, d)", "(n, h * d)"])
def test_tokens_laid_out_one_after_another_are_refused_naming_the_view_that_reads_them(flat):
    """vLLM's q, (n_tokens, h * d) or (n_tokens, h, d) read at position ids (n_tokens,), was refused with "x must be
    4-D (b, h, s, d)" alone; the message names the view and layout that take it, and that call is per-token
    rotation."""
    n, h, d = 6, 4, 8
    angles = torch.arange(32.0)[:, None] * torch.rand(d // 2)
    cos, sin = angles.cos(), angles.sin()
    positions = torch.tensor([3, 4, 5, 0, 1, 17])
    q = torch.randn(n, h * d) if flat else torch.randn(n, h, d)
    view = r"x\.view\(1, n_tokens, -1, head_dim\)" if flat else r"x\[None\]"
    with pytest.raises(ValueError, match=rf"x must be 4-D \(b, h, s, d\) .*vLLM's q and k.* pass {view} with layout"):
        posenc.apply_rotary(q, cos, sin, positions=positions)
    out = posenc.apply_rotary(q.view(1, n, -1, d), cos, sin, positions=positions, layout="bshd")
    expected = posenc.apply_rotary(q.view(n, -1, d), cos[positions, None], sin[positions, None])
    torch.testing.assert_close(out.reshape(q.shape), expected.reshape(q.shape), rtol=0, atol=0)


def test_one_sequence_without_its_batch_axis_is_refused_naming_x_none_in_the_default_layout() -> None:
    """An (h, s, d) x read at position ids in the default (b, h, s, d) layout is one sequence without its batch axis:
    the message named only the token-major view with layout='bshd', which reads its heads as tokens. It names x[None]
    in the default layout first, and that call equals the 4-D one."""
    h, s, d = 4, 6, 8
    angles = torch.arange(32.0)[:, None] * torch.rand(d // 2)
    cos, sin = angles.cos(), angles.sin()
    positions = torch.arange(s) + 3
    x = torch.randn(h, s, d)
    with pytest.raises(
        ValueError, match=r"x must be 4-D \(b, h, s, d\) .*; for one sequence laid out \(h, s, d\), pass x\[None\];"
    ):
        posenc.apply_rotary(x, cos, sin, positions=positions)
    out = posenc.apply_rotary(x[None], cos, sin, positions=positions)
    expected = posenc.apply_rotary(x, cos[positions], sin[positions])
    torch.testing.assert_close(out[0], expected, rtol=0, atol=0)


@pytest.mark.parametrize("offset", [10, torch.tensor([10, 3, 5, 7])], ids=["int", "(b,)"])
@pytest.mark.parametrize("flat", [False, True], ids=["(b, h, d)", "(b, h * d)"])
def test_one_token_per_sequence_read_at_an_offset_is_refused_naming_a_view_of_b_sequences(offset, flat):
    """A decode step's q, one token of each of b sequences, (b, h, d) or (b, h * d), read at offset=: the message
    named only x[None], which read at that offset put token i at offset + i (max error 3.5, without an error), or, with
    a (b,) offset, failed again. It names the (b, 1, h, d) view first, and that call rotates each token at its
    sequence's offset."""
    b, h, d = 4, 3, 8
    angles = torch.arange(32.0)[:, None] * torch.rand(d // 2)
    cos, sin = angles.cos(), angles.sin()
    q = torch.randn(b, h * d) if flat else torch.randn(b, h, d)
    view = r"x\.view\(b, 1, -1, head_dim\)" if flat else r"x\[:, None\]"
    with pytest.raises(
        ValueError,
        match=rf"x must be 4-D \(b, s, h, d\) .*one token of each sequence at offset .*"
        rf"pass {view} with layout='bshd'",
    ):
        posenc.apply_rotary(q, cos, sin, offset=offset, layout="bshd")
    out = posenc.apply_rotary(q.view(b, 1, -1, d), cos, sin, offset=offset, layout="bshd")
    rows = torch.as_tensor(offset).expand(b)
    expected = posenc.apply_rotary(q.view(b, -1, d), cos[rows, None], sin[rows, None])
    torch.testing.assert_close(out.reshape(q.shape), expected.reshape(q.shape), rtol=0, atol=0)


def test_a_complex_sin_beside_a_real_cos_is_refused_naming_freqs_cis():
    """sin complex alone (cos=freqs_cis.real, sin=freqs_cis, the .imag forgotten): the freqs_cis fix too, not the one
    for complex activations (view_as_real), which would make sin twice as wide as cos."""
    angles = torch.arange(16.0, dtype=torch.float64)[:, None] * torch.rand(4, dtype=torch.float64)
    freqs_cis = torch.polar(torch.ones_like(angles), angles)
    x = torch.randn(2, 5, 3, 8, dtype=torch.float64)
    with pytest.raises(TypeError, match=r"^sin is complex .*cos=freqs_cis\.real, sin=freqs_cis\.imag"):
        posenc.apply_rotary(x, freqs_cis.real, freqs_cis, offset=0, layout="bshd", interleaved=True)


def test_a_table_on_another_device_than_x_is_refused_naming_both_devices():
    """cos on x's device but sin on another: refused at the call, not deep inside the kernel or torch ("Tensor on
    device meta is not on the expected device cpu!")."""
    x, cos = torch.randn(2, 3, 5, 8), torch.randn(32, 4)
    for backend in ("auto", "torch"):
        with pytest.raises(ValueError, match=r"^x is on cpu but cos/sin on cpu/meta; move all to one device"):
            posenc.apply_rotary(x, cos, cos.to("meta"), offset=0, backend=backend)


@pytest.mark.parametrize(
    ("call", "name", "x_name"),
    [
        (lambda x, t: posenc.apply_rotary(x, t, t, positions=torch.arange(5)), "positions", "x"),
        (lambda x, t: posenc.apply_rotary_qk(x, x, t, t, offset=torch.tensor([3])), "offset", "q"),
        (
            lambda x, t: posenc.apply_rotary(x[0].transpose(0, 1), t, t, cu_seqlens=torch.tensor([0, 2, 5])),
            "cu_seqlens",
            "x",
        ),
    ],
    ids=["positions", "offset", "cu_seqlens"],
)
def test_index_tensors_on_another_device_than_x_are_refused_with_the_move(call, name, x_name):
    """A table call's positions, offset or cu_seqlens elsewhere than x (meta stands in for a second device): the error
    names the tensor as the caller calls it (q, not x) and the move that fixes it; it said "positions is on cpu but x
    on meta" and no fix."""
    x, table = torch.empty(1, 2, 5, 8, device="meta"), torch.empty(16, 4, device="meta")
    expected = rf"^{name} is on cpu but {x_name} on meta; move it there: {name}\.to\({x_name}\.device\)$"
    with pytest.raises(ValueError, match=expected):
        call(x, table)


@pytest.mark.parametrize(
    ("call", "match"),
    [
        (  # as broadcast cos/sin: it said "0 pairs needs 0 channels" and to pass Hugging Face's cos[..., :0]
            lambda x, t: posenc.apply_rotary(x, t[:, :0], t[:, :0], offset=0),
            r"^cos must have a last dimension of r/2 >= 1 \(one value per rotated pair\), got shape \(16, 0\)$",
        ),
        (
            lambda x, t: posenc.apply_rotary(x, t, t, offset=torch.zeros(2, 1, dtype=torch.long)),
            r"offset must be an int, a \(2,\) tensor \(one per sequence\) or a 0-d tensor, got shape \(2, 1\)",
        ),
        (
            lambda x, t: posenc.apply_rotary(torch.randn(0, 2, 8), t, t, cu_seqlens=torch.tensor([0])),
            r"cu_seqlens must hold n_seq \+ 1 >= 2 prefix sums .*got shape \(1,\)",
        ),
        (
            lambda x, t: posenc.apply_rotary(torch.randn(6, 2, 8), t, t, cu_seqlens=torch.tensor([0, 3, 5])),
            r"cu_seqlens must start at 0 and end at total_tokens=6, got 0 \.\. 5",
        ),
        (  # falling by one: the smallest fall
            lambda x, t: posenc.apply_rotary(torch.randn(6, 2, 8), t, t, cu_seqlens=torch.tensor([0, 3, 2, 6])),
            r"cu_seqlens must be non-decreasing",
        ),
    ],
    ids=["no pairs", "(b, 1) offset", "no sequences", "ends early", "falls by one"],
)
def test_table_calls_refuse_tables_offsets_and_prefix_sums_at_their_edges(call, match) -> None:
    with pytest.raises(ValueError, match=match):
        call(torch.randn(2, 1, 3, 8), torch.randn(16, 4))


def test_hints_are_left_out_where_they_do_not_fit() -> None:
    """An odd table width cannot be Hugging Face's cos/sin (each value twice): no hint to halve it. A 3-D x with
    layout='bshd' is not an (h, s, d) sequence for the default layout: no hint to pass x[None] in it."""
    x = torch.randn(1, 2, 3, 8)
    exactly = r"x.shape\[-1\]=8; the table holds one value per pair, \(n_positions, rotary_dim // 2\)$"
    with pytest.raises(ValueError, match=exactly):
        posenc.apply_rotary(x, torch.ones(9, 5), torch.ones(9, 5), offset=0)
    cos, sin = torch.randn(16, 4), torch.randn(16, 4)
    with pytest.raises(ValueError, match=r"x must be 4-D \(b, s, h, d\)") as info:
        posenc.apply_rotary(torch.randn(2, 3, 8), cos, sin, positions=torch.arange(2), layout="bshd")
    assert "one sequence laid out (h, s, d)" not in str(info.value)


@pytest.mark.parametrize("flat", [False, True], ids=["(n, h, d)", "(n, h * d)"])
def test_the_token_major_hint_names_only_views_that_fit_the_call(flat):
    """x of too few dims: the hint names only views that fit the call. Not (h, s, d) for a 2-D x; not a decode
    step's (b, 1, h, d) view where position ids are given (x is then read at them, the offset added to each); none
    for cu_seqlens, whose x is (total_tokens, h, d) and whose positions restart per sequence."""
    n, h, d = 6, 4, 8
    cos, sin = torch.randn(32, d // 2), torch.randn(32, d // 2)
    q = torch.randn(n, h * d) if flat else torch.randn(n, h, d)
    with pytest.raises(ValueError, match=r"x must be 4-D .*vLLM's q and k") as info:
        posenc.apply_rotary(q, cos, sin, positions=torch.arange(n), offset=2)
    assert "a decode step" not in str(info.value)
    assert ("one sequence laid out (h, s, d)" in str(info.value)) is not flat
    if flat:
        exactly = r"^x must be 3-D \(total_tokens, h, d\) for this call, got shape \(6, 32\)$"
        with pytest.raises(ValueError, match=exactly):
            posenc.apply_rotary(q, cos, sin, cu_seqlens=torch.tensor([0, n]))
