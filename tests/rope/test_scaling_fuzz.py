"""Random valid rope_parameters against transformers, beside the fixed grid of test_scaling_conformance.py.

A seeded generator draws what transformers' configs carry: every type of ROPE_INIT_FUNCTIONS; factors from 1 to
64, fractional ones too; rope_theta from 1e2 to 1e7; head dims that are not hidden / heads; partial rotary factors
that leave a fraction (the ones giving an odd rotary dim are a documented refusal and are skipped); YaRN's optional
keys present or absent (equal betas, a null truncate, every attention-factor branch, an implicit factor); LongRoPE's
lists, factor and attention factor present or absent, originals above and below the model's length; Llama 3's band.
Frequencies are compared at lengths below, at, one past and far past the trained ones; a sample is then rotated
end to end by GPTNeoXRotaryEmbedding (stateful, as in a model) and RoPE's forward over positions up to 1e6.

Tolerances are those of the conformance tests: transformers' float32 pipeline against posenc's float64, with
dynamic NTK's length term added (its scale factor * L / max - (factor - 1) is computed in float32 from a tensor
seq_len and loses up to (2 factor L / max + factor) * 2^-24 absolute to cancellation; measured at most 45 * 2^-24
relative in inv_freq at factor 32 one token past the trained length).
"""

from __future__ import annotations

import math
import random
from typing import Any

import pytest
import torch

from posenc import RoPE
from posenc.rope.frequencies import float32_blend_rtol, yarn_ramp
from posenc.rope.parameters import compute_frequencies, parse_rope_parameters

SEED, CASES, ROTATED = 20261205, 140, 14
# Cases longer runs of the generator found, kept beside the 140 drawn here. Dynamic NTK at a factor of 53, whose
# float32 ulp is 64 * 2^-24: transformers' scale at or below the trained length (2,800 draws of SEED). YaRN
# truncated at a factor of 52.5 whose ramp, 32 to 102, rounds (1,000 draws of seed 5): see float32_blend_rtol. YaRN
# untruncated with equal betas, a ramp 0.001 wide from 9.0 (2,000 draws of seed 17): see _rtol.
FOUND = [
    (
        256,
        186791,
        {
            "rope_type": "dynamic",
            "rope_theta": 5671.977036465288,
            "partial_rotary_factor": 0.5,
            "factor": 53.48359768404208,
        },
    ),
    (
        256,
        64,
        {
            "rope_type": "yarn",
            "rope_theta": 619.7064987528333,
            "factor": 52.505,
            "mscale": 0.707,
            "original_max_position_embeddings": 1024,
        },
    ),
    (
        40,
        4096,
        {
            "rope_type": "yarn",
            "rope_theta": 30044.279404922392,
            "factor": 8.213,
            "beta_fast": 8,
            "beta_slow": 8,
            "truncate": False,
            "original_max_position_embeddings": 5203,
        },
    ),
]


def _factor(rng: random.Random) -> float:
    return rng.choice([1.0, 2, 8.0, 40, round(rng.uniform(1, 64), 3), rng.uniform(1, 64)])


def _case(rng: random.Random) -> tuple[int, int, dict[str, Any]] | None:
    """(head_dim, max_position_embeddings, rope_parameters), or None for an odd rotary dim."""
    rope_type = rng.choice(["default", "linear", "proportional", "llama3", *(["dynamic", "yarn", "longrope"] * 2)])
    head_dim = rng.choice([16, 40, 44, 64, 96, 100, 128, 192, 256])
    max_pos = rng.choice([64, 2048, 4096, 32768, rng.randint(16, 200_000)])
    params: dict[str, Any] = {"rope_type": rope_type, "rope_theta": 10 ** rng.uniform(2, 7)}
    if rng.random() < 0.4:
        params["partial_rotary_factor"] = rng.choice([0.5, 0.25, 0.35, 0.4, 0.57, round(rng.uniform(0.1, 1), 3)])
    rotary_dim = int(head_dim * params.get("partial_rotary_factor", 1.0))
    if rope_type != "proportional" and (rotary_dim % 2 or rotary_dim < 4):
        return None
    original = rng.choice([None, 16, 1024, 4096, rng.randint(8, 100_000)])
    if rope_type in ("linear", "dynamic") or (rope_type == "proportional" and rng.random() < 0.5):
        params["factor"] = _factor(rng)
    elif rope_type == "yarn":
        params["factor"] = _factor(rng) if original is None or max_pos < original or rng.random() < 0.8 else None
        optional = {
            "beta_fast": rng.choice([32, 16.0, 8, rng.uniform(2, 128)]),
            "beta_slow": rng.choice([1, 2.0, 8, rng.uniform(0.1, 4)]),
            "mscale": rng.choice([0.0, 0.707, 1, rng.uniform(0, 2)]),
            "mscale_all_dim": rng.choice([0.0, 0.707, 1, rng.uniform(0, 2)]),
            "attention_factor": rng.choice([None, rng.uniform(0.5, 2)]),
            "truncate": rng.choice([True, False, None]),
        }
        params.update({key: value for key, value in optional.items() if rng.random() < 0.4})
        if params.get("beta_fast", 32) < params.get("beta_slow", 1) or rng.random() < 0.2:
            params["beta_fast"] = params.get("beta_slow", 1)  # equal: a step, which transformers takes
    elif rope_type == "longrope":
        params["short_factor"] = [rng.uniform(0.8, 3) for _ in range(rotary_dim // 2)]
        params["long_factor"] = sorted(rng.uniform(1, 64) for _ in range(rotary_dim // 2))
        if rng.random() < 0.5:
            params["factor"] = _factor(rng)
        if rng.random() < 0.3:
            params["attention_factor"] = rng.uniform(0.5, 2)
        original = original or rng.choice([None, 2048])
    elif rope_type == "llama3":
        low = rng.choice([1.0, 0.5, rng.uniform(0.1, 4)])
        params.update(factor=_factor(rng), low_freq_factor=low, high_freq_factor=low + rng.uniform(0.05, 8))
    if original is not None and rope_type in ("yarn", "longrope", "llama3"):
        params["original_max_position_embeddings"] = original
    return head_dim, max_pos, params


def _cases() -> list[tuple[int, int, dict[str, Any]]]:
    rng = random.Random(SEED)
    drawn: list[tuple[int, int, dict[str, Any]]] = []
    while len(drawn) < CASES:
        case = _case(rng)
        if case is not None:
            drawn.append(case)
    return drawn


def _rtol(spec: Any, hf_oracle: Any, seq_len: int | None) -> float:
    """transformers' float32 error, relative: the pow over the base it raises (dynamic's grows with the length),
    the blends of YaRN / Llama 3, and dynamic's scale computed in float32.

    Given a tensor seq_len, transformers' dynamic NTK clamps it to the trained length with torch.maximum and computes
    factor * L / max - (factor - 1) in float32 at every length, so at or below the trained length (where the scale is
    exactly 1 and posenc's frequencies are the default ones) it still carries the rounding of factor * L / max: up to
    one float32 ulp of factor, 64 * 2^-24 relative at factor 53 (measured 65 * 2^-24 in inv_freq)."""
    params, max_pos = spec.params, spec.max_position_embeddings
    rtol = float32_blend_rtol(spec.rope_type, params, spec.base)
    if spec.rope_type == "yarn" and not params.get("truncate", True):
        # transformers rounds the ramp's start to float32 in (i - low) / (high - low): u * low / (high - low) absolute
        # in the weight, past float32_blend_rtol's 3 roundings where the ramp is narrower than its start (equal
        # betas: 0.001 wide, a weight off by 9000 u). patch_model refuses such a model, whose float32 frequencies
        # rotate visibly off the exact ones at long positions; here they are checked against this model.
        original = params["original_max_position_embeddings"]  # the parser fills the betas' defaults too
        low, high = yarn_ramp(spec.rotary_dim, spec.base, original, params["beta_fast"], params["beta_slow"], False)
        rtol += (params["factor"] - 1) * low / (high - low) * hf_oracle.EPS32
    if spec.rope_type == "dynamic" and seq_len is not None:
        factor, r, seq_len = params["factor"], spec.rotary_dim, max(seq_len, max_pos)
        scale = factor * seq_len / max_pos - (factor - 1)
        rtol += 2 * (r / (r - 2)) * (2 * factor * seq_len / max_pos + factor) / scale * hf_oracle.EPS32
        return rtol + hf_oracle.inv_freq_rtol(spec.base * scale ** (r / (r - 2))) + 2 * hf_oracle.EPS32
    return rtol + hf_oracle.inv_freq_rtol(spec.base)


def _describe(head_dim: int, max_pos: int, params: dict[str, Any]) -> str:
    short = {key: value for key, value in params.items() if key not in ("short_factor", "long_factor")}
    return f"head_dim={head_dim} max_position_embeddings={max_pos} {short}"


@pytest.mark.filterwarnings("ignore::UserWarning")  # the yarn / llama3 length warnings transformers gives too
def test_random_parameters_give_transformers_frequencies(hf_oracle) -> None:
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    from transformers.models.gpt_neox.modeling_gpt_neox import GPTNeoXRotaryEmbedding

    for head_dim, max_pos, params in [*FOUND, *_cases()]:
        config = hf_oracle.config(head_dim, params, max_pos)
        rope_type, context = params["rope_type"], _describe(head_dim, max_pos, params)
        spec = parse_rope_parameters(head_dim, params, max_position_embeddings=max_pos)
        original = spec.params.get("original_max_position_embeddings", max_pos)
        for seq_len in (None, 1, original, original + 1, max_pos, max_pos + 1, 3 * max_pos):
            if rope_type == "default":
                hf_inv, hf_factor = GPTNeoXRotaryEmbedding.compute_default_rope_parameters(config)
            else:  # a tensor seq_len, as the rotary classes pass it
                length = None if seq_len is None else torch.tensor(seq_len)
                hf_inv, hf_factor = ROPE_INIT_FUNCTIONS[rope_type](config, None, seq_len=length)
            inv, factor = compute_frequencies(spec, seq_len=seq_len)
            rtol = _rtol(spec, hf_oracle, seq_len)
            message = f"{context} seq_len={seq_len}"
            torch.testing.assert_close(inv, hf_inv.double(), rtol=rtol, atol=0.0, msg=message)
            assert math.isclose(factor, float(hf_factor), rel_tol=1e-12), message


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_random_parameters_rotate_as_transformers_with_its_state(hf_oracle) -> None:
    """A model's rotary module keeps dynamic NTK's longest length and LongRoPE's switch: one module and one RoPE
    over a shuffled series of calls, each ending below, at, past and far past the trained lengths."""
    from transformers.models.gpt_neox.modeling_gpt_neox import GPTNeoXRotaryEmbedding
    from transformers.models.gpt_neox.modeling_gpt_neox import apply_rotary_pos_emb as neox_apply

    rng = random.Random(SEED)
    cases = _cases()
    stateful = [case for case in cases if case[2]["rope_type"] in ("dynamic", "longrope")][:ROTATED]
    stateless = [case for case in cases if case[2]["rope_type"] not in ("dynamic", "longrope")][:ROTATED]
    for index, (head_dim, max_pos, params) in enumerate(stateful + stateless):
        context = _describe(head_dim, max_pos, params)
        hf_rotary = GPTNeoXRotaryEmbedding(hf_oracle.config(head_dim, params, max_pos))
        rope = RoPE(head_dim, rope_parameters=params, max_position_embeddings=max_pos)
        original = rope.spec.params.get("original_max_position_embeddings", max_pos)
        ends = [2, max_pos // 2 + 1, max_pos, max_pos + 1, original, original + 1, 4 * max_pos, 10**6]
        rng.shuffle(ends)
        gen = torch.Generator().manual_seed(index)
        for end in ends:
            positions = torch.tensor([[0, 1, end // 3, end - 2, end - 1]])
            q = torch.randn(1, 2, 5, head_dim, generator=gen)
            k = torch.randn(1, 2, 5, head_dim, generator=gen)
            hf_cos, hf_sin = hf_rotary(q, positions)
            hf_q, hf_k = neox_apply(q, k, hf_cos, hf_sin)
            our_q, our_k = rope(q, k, positions=positions)
            # the frequencies the module holds now (its state after this call), at transformers' float32 angles
            inv = hf_rotary.inv_freq.double()
            seq_len = rope.hf_scaled_len if rope.spec.rope_type == "dynamic" else end
            rtol = _rtol(rope.spec, hf_oracle, seq_len)
            scaling = float(hf_rotary.attention_scaling)
            angles = (positions[..., None].double() * inv).abs()
            tol = scaling * (angles * (rtol + hf_oracle.EPS32) + 4 * hf_oracle.EPS32)
            half = rope.rotary_dim // 2
            for ours, theirs, x in ((our_q, hf_q, q), (our_k, hf_k, k)):
                pair = x[..., :half].abs() + x[..., half : 2 * half].abs()
                bound = torch.cat((pair * tol, pair * tol, torch.zeros_like(x[..., 2 * half :])), dim=-1)
                bound = bound + 4 * hf_oracle.EPS32 * (x.abs() + theirs.abs())
                excess = ((ours - theirs).abs() - bound).max().item()
                assert excess <= 0, f"{context} positions up to {end - 1}: {excess:.3g} past the bound"
