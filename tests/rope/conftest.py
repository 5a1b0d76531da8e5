"""Hugging Face ``transformers`` as the oracle for RoPE frequencies: build a real config object and call its code.

Exposed to the tests of this folder as the ``hf_oracle`` fixture (the suite imports test files with
``--import-mode=importlib``, so helpers travel as fixtures). transformers is a test dependency.
"""

from __future__ import annotations

import math
import types
from typing import Any

import pytest
import torch

EPS32 = 2.0**-24  # float32 unit roundoff


def hf_config(head_dim: int, rope_parameters: dict[str, Any], max_position_embeddings: int) -> Any:
    """A LlamaConfig whose only job is to carry the RoPE fields into transformers' functions."""
    from transformers import LlamaConfig

    return LlamaConfig(
        hidden_size=head_dim * 2,
        num_attention_heads=2,
        num_key_value_heads=2,
        head_dim=head_dim,
        max_position_embeddings=max_position_embeddings,
        rope_parameters=dict(rope_parameters),
    )


def hf_frequencies(
    head_dim: int, rope_parameters: dict[str, Any], max_position_embeddings: int, seq_len: int | None = None
) -> tuple[torch.Tensor, float]:
    """transformers' (inv_freq float32, attention_factor) for the same dict: ROPE_INIT_FUNCTIONS, or for 'default'
    the models' default that honours partial_rotary_factor (GPT-NeoX's, which Phi-3 and others share)."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    from transformers.models.gpt_neox.modeling_gpt_neox import GPTNeoXRotaryEmbedding

    config = hf_config(head_dim, rope_parameters, max_position_embeddings)
    rope_type = config.rope_parameters["rope_type"]
    if rope_type == "default":
        return GPTNeoXRotaryEmbedding.compute_default_rope_parameters(config)
    return ROPE_INIT_FUNCTIONS[rope_type](config, None, seq_len=seq_len)


def inv_freq_rtol(base: float) -> float:
    """How far transformers' float32 inv_freq may be from the exact value, relative.

    transformers rounds the exponent 2i/r to float32 (relative error u), and base**e then carries e * ln(base) * u;
    the power, the reciprocal, the division by a factor and the blends add up to 8 more roundings (llama3's
    (1 - s) * inv / factor + s * inv is the longest chain: measured 6.8 u over the grid).
    """
    return (math.log(base) + 8.0) * EPS32


def cos_sin_atol(angles: torch.Tensor, base: float, attention_factor: float) -> torch.Tensor:
    """Per-element bound on |cos_hf - cos_exact| for angles (float64): transformers multiplies position by a float32
    inv_freq in float32, so the angle is off by angle * (inv_freq_rtol + u); cos, sin and the factor add 2u."""
    return attention_factor * (angles.abs() * (inv_freq_rtol(base) + EPS32) + 4 * EPS32)


@pytest.fixture(scope="session")
def hf_oracle() -> types.SimpleNamespace:
    pytest.importorskip("transformers")
    return types.SimpleNamespace(
        EPS32=EPS32,
        config=hf_config,
        frequencies=hf_frequencies,
        inv_freq_rtol=inv_freq_rtol,
        cos_sin_atol=cos_sin_atol,
    )
