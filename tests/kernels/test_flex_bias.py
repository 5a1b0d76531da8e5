"""ALiBi / T5 as FlexAttention score_mods against the materialized bias of posenc.attention."""

from __future__ import annotations

import pytest
import torch
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

from posenc import ALiBi, CausalSelfAttention, T5Bias
from posenc.attention import attend, causal_mask
from posenc.kernels import flex_bias
from posenc.testing import assert_close

ENCODINGS = {
    "alibi": lambda: ALiBi(4),
    "alibi-6-heads": lambda: ALiBi(6),
    "t5-causal": lambda: T5Bias(4, num_buckets=16, max_distance=20),
    "t5-bidirectional": lambda: T5Bias(4, num_buckets=16, max_distance=20, bidirectional=True),
}


@pytest.mark.parametrize("name", list(ENCODINGS))
@pytest.mark.parametrize("batched_positions", [False, True])
def test_score_mod_matches_the_materialized_bias(name, batched_positions):
    """Eager flex_attention runs the score_mod through its reference math: the score_mod itself is checked."""
    torch.manual_seed(0)
    encoding = ENCODINGS[name]()
    h = encoding.num_heads
    b, s, t, d = 2, 5, 37, 16  # 32 cached keys, then 5 queries
    q, k, v = torch.randn(b, h, s, d), torch.randn(b, h, t, d), torch.randn(b, h, t, d)
    k_pos = torch.arange(t)[None].expand(b if batched_positions else 1, t) + (
        torch.tensor([[0], [3]]) if batched_positions else 0
    )
    q_pos = k_pos[:, -s:]
    allowed = causal_mask(s, t, q.device)
    with torch.no_grad():
        expected, _ = attend(q, k, v, allowed, encoding.score_bias(q_pos, k_pos))
        score_mod = flex_bias.score_mod_for(encoding, q_pos, k_pos)
        block_mask = create_block_mask(lambda b_, h_, qi, ki: ki <= qi + (t - s), None, None, s, t, device="cpu")
        got = flex_attention(q, k, v, score_mod=score_mod, block_mask=block_mask)
    assert_close(got, expected.double(), reduction=True)


def test_causal_self_attention_routes_long_cpu_inference_to_flex(monkeypatch):
    """The compiled path, end to end: same output with and without FlexAttention."""
    torch.manual_seed(0)
    layer = CausalSelfAttention(32, 4, num_kv_heads=2, encoding=ALiBi(4)).eval()
    x = torch.randn(1, 40, 32)
    with torch.no_grad():
        materialized = layer(x)
        monkeypatch.setattr(flex_bias, "CPU_MIN_SCORES", 0)
        assert flex_bias.use_flex(layer.encoding, x[:, None], x[:, None], x[:, None], need_probs=False)
        flexed = layer(x)
    assert_close(flexed, materialized.double(), reduction=True)


def test_use_flex_rules():
    alibi = ALiBi(2)
    long = torch.randn(1, 2, 4096, 8)
    short = torch.randn(1, 2, 64, 8)
    with torch.no_grad():
        assert flex_bias.use_flex(alibi, long, long, long, need_probs=False)
        assert not flex_bias.use_flex(alibi, long, long, long, need_probs=True), "probabilities need the scores"
        assert not flex_bias.use_flex(alibi, short, short, short, need_probs=False), "short: materialize"
        assert not flex_bias.use_flex(torch.nn.Identity(), long, long, long, need_probs=False)
    grad = long.clone().requires_grad_()
    assert not flex_bias.use_flex(alibi, grad, long, long, need_probs=False), "no FlexAttention backward on CPU"
    assert not flex_bias.use_flex(T5Bias(2), long, long, long, need_probs=False), "the T5 table needs grad"
    with pytest.raises(ValueError, match="only ALiBi and T5Bias"):
        flex_bias.attend_flex(short, short, short, torch.nn.Identity(), torch.arange(64)[None], torch.arange(64)[None])
