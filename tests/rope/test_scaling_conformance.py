"""Every scaling type against transformers' own functions, over a grid chosen to hit every branch.

Grid: head_dim in {64, 96, 128} x rope_theta in {10000, 500000, 1e6} x partial_rotary_factor in {1, 0.5, 0.25}
(rotary dims 16..128), times per type the parameter sets in ``CASES`` (every optional key, every branch of YaRN's
attention factor, truncate on/off, LongRoPE short/long, implicit factors), times seq_len below, at, one past and
3x the original length. Tolerances: inv_freq relative ``inv_freq_rtol(base)`` = (ln(base) + 8) * 2^-24 (the error
of transformers' float32 pipeline; posenc is float64), attention_factor absolute 1e-9, cos/sin per element
``cos_sin_atol`` (angle * (inv_freq_rtol + 2^-24) + 4 * 2^-24, times the attention factor).
"""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any

import pytest
import torch

from posenc import RoPE
from posenc.rope.frequencies import float32_blend_rtol
from posenc.rope.parameters import compute_frequencies, parse_rope_parameters

HEAD_DIMS = (64, 96, 128)
THETAS = (10000.0, 500000.0, 1e6)
PARTIALS = (1.0, 0.5, 0.25)
MAX_POS = 4096


def _ramp(n: int, lo: float, hi: float) -> list[float]:
    return [lo + (hi - lo) * i / max(n - 1, 1) for i in range(n)]


# Per type: parameter sets (without rope_type / rope_theta / partial_rotary_factor). "{pairs}" lists are sized later.
CASES: dict[str, list[dict[str, Any]]] = {
    "default": [{}],
    "linear": [{"factor": 1.0}, {"factor": 2.5}, {"factor": 8}],
    "dynamic": [{"factor": 1.0}, {"factor": 2.0}, {"factor": 7.5}],
    "yarn": [
        {"factor": 4.0, "original_max_position_embeddings": 1024},
        {"factor": 40, "original_max_position_embeddings": 4096, "mscale": 1.0, "mscale_all_dim": 1.0},
        {"factor": 16.0, "original_max_position_embeddings": 1024, "mscale": 0.707, "mscale_all_dim": 1.0},
        {"factor": 8.0, "original_max_position_embeddings": 512, "mscale": 1.0},  # one of the two: plain mscale
        {"factor": 8.0, "original_max_position_embeddings": 512, "mscale": 1.0, "mscale_all_dim": 0.0},
        # A zero mscale counts as absent too (transformers tests truth): not 1 / mscale(factor, mscale_all_dim).
        {"factor": 8.0, "original_max_position_embeddings": 512, "mscale": 0.0, "mscale_all_dim": 0.707},
        # Only one of the two, not 1: transformers then ignores it (get_mscale(factor) alone).
        {"factor": 8.0, "original_max_position_embeddings": 512, "mscale": 0.707},
        {"factor": 8.0, "original_max_position_embeddings": 512, "mscale_all_dim": 0.707},
        # A long original length puts YaRN's high bound past the last pair: the ramp's clamp to r/2 - 1 decides.
        {"factor": 4.0, "original_max_position_embeddings": 131072},
        {"factor": 4.0, "original_max_position_embeddings": 2048, "attention_factor": 1.25},
        {"factor": 4.0, "original_max_position_embeddings": 1024, "beta_fast": 16, "beta_slow": 2, "truncate": False},
        {"factor": 4.0, "original_max_position_embeddings": 1024, "beta_fast": 64.0, "beta_slow": 0.5},
        # Equal betas: a step instead of a ramp, which transformers takes without a warning (posenc refused it).
        {"factor": 4.0, "original_max_position_embeddings": 1024, "beta_fast": 8, "beta_slow": 8},
        {"factor": 4.0, "original_max_position_embeddings": 1024, "beta_fast": 8, "beta_slow": 8, "truncate": False},
        {"factor": 1.0, "original_max_position_embeddings": 4096},
        # An original length below 2 pi * beta_slow: both ends of the ramp clamp to pair 0, a zero-width ramp that
        # transformers widens by 0.001 (without that, 0 / 0 made pair 0's frequency NaN).
        {"factor": 4.0, "original_max_position_embeddings": 6},
        {"factor": None, "original_max_position_embeddings": 1024},  # implicit factor max / original = 4
    ],
    "longrope": [
        {"short": (1.0, 1.3), "long": (1.0, 40.0), "original_max_position_embeddings": 1024},  # implicit factor 4
        {"short": (1.0, 1.0), "long": (1.2, 12.0), "original_max_position_embeddings": 1024, "factor": 8.0},
        {"short": (0.9, 1.5), "long": (2.0, 3.0), "original_max_position_embeddings": 2048, "attention_factor": 1.1},
        {"short": (1.0, 1.0), "long": (1.0, 4.0), "original_max_position_embeddings": 4096},  # factor 1: no factor
    ],
    "llama3": [
        {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 1024},
        {"factor": 32, "low_freq_factor": 2.0, "high_freq_factor": 8.0, "original_max_position_embeddings": 512},
        {"factor": 2.0, "low_freq_factor": 0.5, "high_freq_factor": 1.5, "original_max_position_embeddings": 2048},
        # Llama 4 Scout's: equal factors, no band (a step), which transformers takes with a warning; was refused.
        {"factor": 16.0, "low_freq_factor": 1.0, "high_freq_factor": 1.0, "original_max_position_embeddings": 1024},
    ],
    "proportional": [{}, {"factor": 2.0}],
}
SEQ_LENS = (None, 100, 1024, 1025, 2048, 4097, 3 * MAX_POS)


def _materialise(rope_type: str, case: dict[str, Any], rotary_dim: int) -> dict[str, Any]:
    params = {key: value for key, value in case.items() if key not in ("short", "long")}
    if rope_type == "longrope":
        params["short_factor"] = _ramp(rotary_dim // 2, *case["short"])
        params["long_factor"] = _ramp(rotary_dim // 2, *case["long"])
    return {"rope_type": rope_type, **params}


def _grid(rope_type: str):
    for head_dim, theta, partial, case in itertools.product(HEAD_DIMS, THETAS, PARTIALS, CASES[rope_type]):
        rotary_dim = head_dim if rope_type == "proportional" else int(head_dim * partial)
        params = _materialise(rope_type, case, rotary_dim)
        params.update(rope_theta=theta, partial_rotary_factor=partial)
        yield head_dim, params


# The grid pairs factors and original lengths freely: the mismatch warning is expected here.
@pytest.mark.filterwarnings(r"ignore:rope_parameters\['factor'\]=.* differs from max_position_embeddings")
@pytest.mark.parametrize("rope_type", list(CASES))
def test_frequencies_match_transformers(rope_type: str, hf_oracle) -> None:
    checked = 0
    for head_dim, params in _grid(rope_type):
        spec = parse_rope_parameters(head_dim, params, max_position_embeddings=MAX_POS)
        seq_lens = SEQ_LENS if rope_type in ("dynamic", "longrope") else (None,)
        for seq_len in seq_lens:
            hf_inv, hf_factor = hf_oracle.frequencies(head_dim, params, MAX_POS, seq_len=seq_len)
            inv, factor = compute_frequencies(spec, seq_len=seq_len)
            context = f"{rope_type} head_dim={head_dim} seq_len={seq_len} {params}"
            assert inv.dtype == torch.float64 and inv.shape == hf_inv.shape, context
            torch.testing.assert_close(
                inv, hf_inv.double(), rtol=hf_oracle.inv_freq_rtol(params["rope_theta"]), atol=0.0, msg=context
            )
            assert abs(factor - float(hf_factor)) <= 1e-9, context
            checked += 1
    assert checked >= 27 * len(CASES[rope_type])


def test_the_docs_count_the_yarn_parameter_sets() -> None:
    # docs/scaling.md says how many; it said thirteen after two more cases had made fifteen.
    docs = (Path(__file__).parents[2] / "docs" / "scaling.md").read_text()
    assert f"yarn alone has {len(CASES['yarn'])}," in " ".join(docs.split())


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize(
    "params",
    [
        *(
            {"rope_type": "yarn", "factor": f, "original_max_position_embeddings": 4096, "truncate": False}
            for f in (40.0, 100.0, 256.0, 1000.0)
        ),
        {"rope_type": "yarn", "factor": 1000.0, "original_max_position_embeddings": 4096},  # truncated: exact weight
        {
            "rope_type": "llama3",
            "factor": 7.9,
            "low_freq_factor": 1.44,
            "high_freq_factor": 1.56,
            "original_max_position_embeddings": 256,
        },
        {
            "rope_type": "llama3",
            "factor": 40.0,
            "low_freq_factor": 0.9428,
            "high_freq_factor": 1.0628,
            "original_max_position_embeddings": 2048,
        },
    ],
)
@pytest.mark.parametrize("theta", [10000.0, 500000.0])
def test_float32_blends_at_large_factors(head_dim: int, params: dict[str, Any], theta: float, hf_oracle) -> None:
    # Past the pow's roundings: transformers' float32 blend weight, its error scaled by up to factor - 1 (1.3e-5
    # relative for YaRN untruncated at factor 256, theta 1e4, d = 128). posenc blends in float64.
    params = {**params, "rope_theta": theta}
    max_pos = int(params["original_max_position_embeddings"] * params["factor"])
    hf_inv, _ = hf_oracle.frequencies(head_dim, params, max_pos)
    inv, _ = compute_frequencies(parse_rope_parameters(head_dim, params, max_position_embeddings=max_pos))
    rtol = hf_oracle.inv_freq_rtol(theta) + float32_blend_rtol(params["rope_type"], params, theta)  # the shipped bound
    torch.testing.assert_close(inv, hf_inv.double(), rtol=rtol, atol=0.0)


def test_llama3_with_equal_factors_blends_nothing() -> None:
    """Llama 4 Scout's factors (1 and 1) are a step: no blend weight, so no float32 blend error (the band's gain,
    high / (high - low), would divide by zero in patch_model's frequency check)."""
    scout = {"rope_type": "llama3", "factor": 16.0, "low_freq_factor": 1.0, "high_freq_factor": 1.0}
    assert float32_blend_rtol("llama3", scout, 500000.0) == 0.0
    assert float32_blend_rtol("llama3", {**scout, "high_freq_factor": 4.0}, 500000.0) > 0.0


def test_yarn_without_a_truncate_key_gets_the_truncated_ramps_blend_bound() -> None:
    """YaRN truncates its ramp unless told not to (transformers' get("truncate", True)): params without the key are
    bounded as the truncated ramp is, one rounding of the weight, (factor - 1) * 2^-24; untruncated, three."""
    yarn = {"rope_type": "yarn", "factor": 4.0}
    assert float32_blend_rtol("yarn", yarn, 10000.0) == float32_blend_rtol("yarn", {**yarn, "truncate": True}, 10000.0)
    assert float32_blend_rtol("yarn", yarn, 10000.0) == 3.0 * 2.0**-24
    assert float32_blend_rtol("yarn", {**yarn, "truncate": False}, 10000.0) == 9.0 * 2.0**-24


def test_dynamic_with_a_tensor_seq_len_matches_transformers(hf_oracle) -> None:
    # transformers' dynamic_rope_update passes seq_len as a tensor, which moves the base computation to float32.
    params = {"rope_type": "dynamic", "factor": 4.0, "rope_theta": 500000.0}
    for seq_len in (10, 4096, 4097, 9000, 40000):
        hf_inv, _ = hf_oracle.frequencies(128, params, MAX_POS, seq_len=torch.tensor(seq_len))
        inv, _ = compute_frequencies(
            parse_rope_parameters(128, params, max_position_embeddings=MAX_POS), seq_len=seq_len
        )
        # the float32 base (u) turns into e * u of the power, e <= 1: one more unit of roundoff than a Python int
        torch.testing.assert_close(
            inv, hf_inv.double(), rtol=hf_oracle.inv_freq_rtol(500000.0) + 2 * hf_oracle.EPS32, atol=0.0
        )


@pytest.mark.parametrize(
    "params",
    [
        {"rope_type": "linear", "factor": 4.0, "rope_theta": 10000.0},
        {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 512, "rope_theta": 1e6},
        {"rope_type": "yarn", "factor": 40, "mscale": 1.0, "mscale_all_dim": 0.707, "rope_theta": 10000.0},
        {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "rope_theta": 5e5},
        {"rope_type": "default", "partial_rotary_factor": 0.5, "rope_theta": 10000.0},
        {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1e6, "factor": 2.0},
    ],
    ids=lambda p: p["rope_type"],
)
def test_cos_sin_and_rotation_match_transformers(params: dict[str, Any], hf_oracle) -> None:
    """The rotary classes end to end: cos/sin (attention factor applied) and the rotated q, k in float32."""
    from transformers.models.gpt_neox.modeling_gpt_neox import GPTNeoXRotaryEmbedding
    from transformers.models.gpt_neox.modeling_gpt_neox import apply_rotary_pos_emb as neox_apply

    head_dim, max_pos = 64, 4096
    config = hf_oracle.config(head_dim, params, max_pos)
    hf_rotary = GPTNeoXRotaryEmbedding(config)  # the generic class: any rope_type, partial rotary
    positions = torch.tensor([[0, 1, 2, 7, 217, 4095, 4096, 9000, 65537]])
    x = torch.zeros(1, len(positions[0]), head_dim)
    hf_cos, hf_sin = hf_rotary(x, positions)  # (1, s, r) = cat(freqs, freqs)

    rope = RoPE(head_dim, rope_parameters=params, max_position_embeddings=max_pos)
    cos, sin = rope.cos_sin(positions)  # (1, s, r/2)
    inv, factor = rope.frequencies()
    tol = hf_oracle.cos_sin_atol(positions[..., None].double() * inv, params["rope_theta"], factor)
    half = rope.rotary_dim // 2
    for ours, theirs in ((cos, hf_cos), (sin, hf_sin)):
        assert torch.equal(theirs[..., :half], theirs[..., half:])
        assert bool(((ours.double() - theirs[..., :half].double()).abs() <= tol).all()), params

    gen = torch.Generator().manual_seed(0)
    q = torch.randn(1, 2, positions.shape[1], head_dim, generator=gen)
    k = torch.randn(1, 2, positions.shape[1], head_dim, generator=gen)
    hf_q, hf_k = neox_apply(q, k, hf_cos, hf_sin)
    our_q, our_k = rope(q, k, positions=positions)
    for ours, theirs, x in ((our_q, hf_q, q), (our_k, hf_k, k)):
        # |x1| + |x2| of each pair times the cos/sin bound, plus float32 rounding of the result
        pair = x[..., :half].abs() + x[..., half : 2 * half].abs()
        bound = torch.cat((pair * tol, pair * tol, torch.zeros_like(x[..., 2 * half :])), dim=-1)
        bound = bound + 4 * hf_oracle.EPS32 * (x.abs() + theirs.abs())
        assert bool(((ours - theirs).abs() <= bound).all()), params


@pytest.mark.parametrize(("head_dim", "partial", "rotary_dim"), [(128, 0.35, 44), (32, 0.4, 12), (100, 0.57, 56)])
def test_a_partial_factor_that_leaves_a_fraction_truncates_like_transformers(
    head_dim: int, partial: float, rotary_dim: int, hf_oracle
) -> None:
    """transformers rotates int(head_dim * partial_rotary_factor) channels: 44.8 -> 44, 12.8 -> 12, and
    0.57 * 100 = 56.99999999999999 -> 56. Rounding instead would give 45, 13 and 57, odd, and refuse the config."""
    params = {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": partial}
    spec = parse_rope_parameters(head_dim, params)
    hf_inv, _ = hf_oracle.frequencies(head_dim, params, MAX_POS)
    assert spec.rotary_dim == rotary_dim == 2 * hf_inv.shape[0]
    inv, _ = compute_frequencies(spec)
    torch.testing.assert_close(inv, hf_inv.double(), rtol=hf_oracle.inv_freq_rtol(10000.0), atol=0.0)
