"""docs/porting.md's DeepSeek rows against transformers' own DeepSeek-V2/V3 code (tiny configs, no downloads).

The page's example checks posenc against the formulas written out; here the same mappings meet the functions and
modules they name: the rotary embeddings (frequencies and attention factor), ``apply_rotary_pos_emb_interleave``
(evens then odds), ``apply_rotary_pos_emb`` (``rope_interleave=False``), DeepSeek-V2's complex ``apply_rotary_emb``,
the attention's softmax scale, and ``rope_from_config`` for the same config.
"""

from __future__ import annotations

import importlib
import inspect
import math
from typing import Any

import pytest
import torch

import posenc
from posenc.interop import rope_from_config

transformers = pytest.importorskip("transformers")
v2 = importlib.import_module("transformers.models.deepseek_v2.modeling_deepseek_v2")
v3 = importlib.import_module("transformers.models.deepseek_v3.modeling_deepseek_v3")

NOPE, R, BASE = 24, 16, 10000.0
# mscale and mscale_all_dim differ, so that both the cos/sin factor and the softmax factor are not 1.
YARN = {
    "rope_type": "yarn",
    "factor": 40.0,
    "original_max_position_embeddings": 32,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "mscale": 1.0,
    "mscale_all_dim": 0.8,
}
MLA_SIZES = dict(
    hidden_size=64,
    num_attention_heads=4,
    num_key_value_heads=4,
    qk_rope_head_dim=R,
    qk_nope_head_dim=NOPE,
    v_head_dim=16,
    kv_lora_rank=32,
    q_lora_rank=None,
    max_position_embeddings=1280,
    num_hidden_layers=1,
    intermediate_size=64,
    moe_intermediate_size=32,
    n_routed_experts=4,
    num_experts_per_tok=2,
    n_group=1,
    topk_group=1,
    vocab_size=64,
)
PERM = torch.cat((torch.arange(0, R, 2), torch.arange(1, R, 2)))  # evens then odds
POSITIONS = torch.tensor([[0, 3, 100, 900, 1279], [7, 8, 9, 10, 11]])


def get_mscale(scale: float, m: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0


def config(model_type: str, **overrides: object):
    configs = {"deepseek_v3": transformers.DeepseekV3Config, "deepseek_v2": transformers.DeepseekV2Config}
    return configs[model_type](**MLA_SIZES, rope_parameters={"rope_theta": BASE, **YARN}, **overrides)


def page_rope(interleaved: bool) -> posenc.RoPE:
    """The page's mapping: RoPE over qk_rope_head_dim channels, the config's YaRN keys as they are."""
    return posenc.RoPE(R, base=BASE, interleaved=interleaved, rope_parameters=YARN)


def q_and_k(generator_seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(generator_seed)
    q = torch.randn(2, 4, 5, NOPE + R, dtype=torch.float64, generator=g)  # (b, h, s, nope + r)
    k_rot = torch.randn(2, 1, 5, R, dtype=torch.float64, generator=g)  # one shared head
    return q, k_rot


@pytest.mark.parametrize("model_type", ["deepseek_v3", "deepseek_v2"])
def test_frequencies_and_attention_factor_are_the_rotary_embeddings(model_type):
    rotary_class = {"deepseek_v3": v3.DeepseekV3RotaryEmbedding, "deepseek_v2": v2.DeepseekV2RotaryEmbedding}
    rotary = rotary_class[model_type](config(model_type))
    inv_freq, attention_factor = page_rope(True).frequencies()
    # transformers computes its inv_freq in float32; posenc's is float64
    torch.testing.assert_close(rotary.inv_freq.double(), inv_freq, rtol=1e-6, atol=0)
    assert attention_factor == pytest.approx(rotary.attention_scaling, rel=1e-12)
    assert attention_factor == pytest.approx(get_mscale(40.0, 1.0) / get_mscale(40.0, 0.8), rel=1e-12)


@pytest.mark.parametrize("rope_interleave", [True, False])
def test_deepseek_v3_rotation_is_the_pages_mapping(rope_interleave):
    cfg = config("deepseek_v3", rope_interleave=rope_interleave)
    q, k_rot = q_and_k()
    q_rot = q[..., NOPE:]
    cos, sin = v3.DeepseekV3RotaryEmbedding(cfg)(q, POSITIONS)  # (b, s, r), cat((freqs, freqs), -1)
    apply = v3.apply_rotary_pos_emb_interleave if rope_interleave else v3.apply_rotary_pos_emb
    expected_q, expected_k = apply(q_rot, k_rot, cos, sin)

    # the table row: its cos/sin, one value per pair, a head axis; evens then odds for rope_interleave
    half_cos, half_sin = cos[:, None, :, : R // 2], sin[:, None, :, : R // 2]
    q_out, k_out = posenc.apply_rotary_qk(q_rot, k_rot, half_cos, half_sin, interleaved=rope_interleave)
    order = PERM if rope_interleave else torch.arange(R)
    torch.testing.assert_close(q_out[..., order], expected_q, rtol=0, atol=1e-12)
    torch.testing.assert_close(k_out[..., order], expected_k, rtol=0, atol=1e-12)

    # posenc's own tables (float64 angles) against transformers' float32 ones: angles up to 1279 rad, each
    # off by about 2^-24 of itself, times the attention factor
    for rope in (page_rope(rope_interleave), rope_from_config(cfg)):
        assert rope.rotary_dim == R and rope.interleaved == rope_interleave
        q_out, k_out = rope(q_rot, k_rot, positions=POSITIONS)
        torch.testing.assert_close(q_out[..., order], expected_q, rtol=0, atol=1e-4)
        torch.testing.assert_close(k_out[..., order], expected_k, rtol=0, atol=1e-4)


def test_deepseek_v2_complex_rotation_is_adjacent_pairs_in_place():
    q, k_rot = q_and_k(1)
    q_pe = q[..., NOPE:]
    freqs_cis = v2.DeepseekV2RotaryEmbedding(config("deepseek_v2"))(q, POSITIONS)  # (b, s, r/2) complex
    expected_q, expected_k = v2.apply_rotary_emb(q_pe, k_rot, freqs_cis)
    q_out, k_out = posenc.apply_rotary_qk(
        q_pe, k_rot, freqs_cis.real[:, None], freqs_cis.imag[:, None], interleaved=True
    )
    # its apply_rotary_emb multiplies in float32 (xq.float()), whatever q's dtype
    torch.testing.assert_close(q_out, expected_q, rtol=0, atol=1e-5)
    torch.testing.assert_close(k_out, expected_k, rtol=0, atol=1e-5)


@pytest.mark.parametrize("model_type", ["deepseek_v3", "deepseek_v2"])
def test_softmax_scale_is_the_pages_formula(model_type):
    attention = {"deepseek_v3": v3.DeepseekV3Attention, "deepseek_v2": v2.DeepseekV2Attention}[model_type]
    scaling = attention(config(model_type), 0).scaling
    assert scaling == pytest.approx((NOPE + R) ** -0.5 * get_mscale(40.0, 0.8) ** 2, rel=1e-12)


# DeepSeek-V3.2's indexer and DeepSeek-V4: the page's section against the functions and modules it names.
v32 = importlib.import_module("transformers.models.deepseek_v32.modeling_deepseek_v32")
v4 = importlib.import_module("transformers.models.deepseek_v4.modeling_deepseek_v4")
INDEX_HEAD_DIM, INDEX_HEADS = 24, 2


def test_deepseek_v32_indexer_rotates_its_first_channels_split_half(monkeypatch):
    """The indexer's own q and k, captured in a forward of transformers' DeepseekV32Indexer, and what its
    apply_rotary_pos_emb made of them, against the page's RoPE(index_head_dim, rotary_dim=r) on whole heads."""
    sizes = {**MLA_SIZES, "q_lora_rank": 16, "index_head_dim": INDEX_HEAD_DIM, "index_n_heads": INDEX_HEADS}
    cfg = transformers.DeepseekV32Config(**sizes, rope_parameters={"rope_theta": BASE, **YARN}, index_topk=4)
    indexer = v32.DeepseekV32Indexer(cfg, 0).double()
    seen: dict[str, torch.Tensor] = {}
    indexer.wq_b.register_forward_hook(lambda module, args, out: seen.__setitem__("q", out))
    indexer.k_norm.register_forward_hook(lambda module, args, out: seen.__setitem__("k", out))
    rotate = v32.apply_rotary_pos_emb

    def recorded(q_rot, k_rot, cos, sin, unsqueeze_dim=1):
        seen["q_rot"], seen["k_rot"] = rotate(q_rot, k_rot, cos, sin, unsqueeze_dim=unsqueeze_dim)
        return seen["q_rot"], seen["k_rot"]

    monkeypatch.setattr(v32, "apply_rotary_pos_emb", recorded)
    g = torch.Generator().manual_seed(2)
    hidden = torch.randn(2, 5, cfg.hidden_size, dtype=torch.float64, generator=g)
    q_resid = torch.randn(2, 5, cfg.q_lora_rank, dtype=torch.float64, generator=g)
    cos, sin = v32.DeepseekV32RotaryEmbedding(cfg)(hidden, POSITIONS)  # (b, s, r), the attention's own
    mask = torch.zeros(2, 5, 5, dtype=torch.float64)
    indexer(hidden, q_resid, (cos, sin), mask, POSITIONS)

    q = seen["q"].view(2, 5, INDEX_HEADS, INDEX_HEAD_DIM)  # (b, s, heads, index_head_dim)
    k = seen["k"].unsqueeze(2)  # one key head
    half_cos, half_sin = cos[:, :, None, : R // 2], sin[:, :, None, : R // 2]
    q_out, k_out = posenc.apply_rotary_qk(q, k, half_cos, half_sin)
    torch.testing.assert_close(q_out[..., :R], seen["q_rot"], rtol=0, atol=1e-12)
    torch.testing.assert_close(k_out[..., :R], seen["k_rot"], rtol=0, atol=1e-12)
    torch.testing.assert_close(q_out[..., R:], q[..., R:], rtol=0, atol=0)

    rope = posenc.RoPE(INDEX_HEAD_DIM, rotary_dim=R, base=BASE, rope_parameters=YARN)
    torch.testing.assert_close(rope.frequencies()[0], page_rope(False).frequencies()[0], rtol=0, atol=0)
    q_out, k_out = rope(q, k, positions=POSITIONS, layout="bshd")
    torch.testing.assert_close(q_out[..., :R], seen["q_rot"], rtol=0, atol=1e-4)  # float32 angles up to 1279 rad
    torch.testing.assert_close(k_out[..., :R], seen["k_rot"], rtol=0, atol=1e-4)
    # ...which DeepSeek-V3.2's attention rotates interleaved, evens then odds, whatever its config says
    assert "apply_rotary_pos_emb_interleave" in inspect.unwrap(v32.DeepseekV32Attention.forward).__code__.co_names


def v4_config() -> Any:
    yarn = {key: value for key, value in YARN.items() if not key.startswith("mscale")}
    return transformers.DeepseekV4Config(
        hidden_size=64,
        num_attention_heads=4,
        head_dim=NOPE + R,
        partial_rotary_factor=R / (NOPE + R),
        max_position_embeddings=1280,
        rope_theta=BASE,
        compress_rope_theta=16 * BASE,
        rope_parameters=yarn,
    )


def v4_page_rope(kind: str) -> posenc.RoPE:
    """The page's rows for V4's rope dicts: 'main' plain over r channels, 'compress' YaRN with attention_factor 1."""
    if kind == "main":
        return posenc.RoPE(R, base=BASE, interleaved=True)
    yarn = {key: value for key, value in YARN.items() if not key.startswith("mscale")}
    return posenc.RoPE(R, base=16 * BASE, interleaved=True, rope_parameters={**yarn, "attention_factor": 1.0})


@pytest.mark.parametrize("kind", ["main", "compress"])
def test_deepseek_v4_rotates_its_last_channels_in_adjacent_pairs(kind):
    cfg = v4_config()
    rotary = v4.DeepseekV4RotaryEmbedding(cfg)
    inv_freq, attention_factor = v4_page_rope(kind).frequencies()
    torch.testing.assert_close(getattr(rotary, f"{kind}_inv_freq").double(), inv_freq, rtol=1e-6, atol=0)
    assert attention_factor == getattr(rotary, f"{kind}_attention_scaling") == 1.0

    x = q_and_k(3)[0]  # (b, h, s, d), d = nope + r
    d = x.shape[-1]
    cos, sin = rotary(x, POSITIONS, layer_type=kind)  # (b, s, r/2)
    expected = v4.apply_rotary_pos_emb(x, cos, sin)
    rotated = posenc.apply_rotary(x[..., d - R :], cos[:, None], sin[:, None], interleaved=True)
    # its apply_rotary_pos_emb multiplies in float32 (rope.float()), whatever x's dtype
    torch.testing.assert_close(torch.cat((x[..., : d - R], rotated), -1), expected, rtol=0, atol=1e-5)
    # the attention output's rope part rotated back by the query's angle: (cos, -sin) is conjugate=True
    back = posenc.apply_rotary(rotated, cos[:, None], sin[:, None], interleaved=True, conjugate=True)
    undone = v4.apply_rotary_pos_emb(torch.cat((x[..., : d - R], rotated), -1), cos, -sin)
    torch.testing.assert_close(back, undone[..., d - R :], rtol=0, atol=1e-5)
    torch.testing.assert_close(back, x[..., d - R :], rtol=0, atol=1e-6)  # its float32 cos/sin: cos^2 + sin^2 ~ 1

    q_rope, _ = v4_page_rope(kind)(x[..., d - R :], x[..., d - R :], positions=POSITIONS)
    torch.testing.assert_close(q_rope, expected[..., d - R :], rtol=0, atol=1e-4)
