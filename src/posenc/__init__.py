"""posenc: positional encodings for transformers, exact against references, fast, and measured."""

from posenc.absolute import LearnedAbsolute, Sinusoidal, sinusoidal_table
from posenc.attention import CausalSelfAttention, KVCache, add_input_encoding
from posenc.bias import ALiBi, T5Bias, alibi_bias, alibi_slopes, t5_relative_bucket
from posenc.encoding import ActsOn
from posenc.nope import NoPE
from posenc.registry import available, build, build_for_model
from posenc.rope import RoPE, apply_rotary, rope_frequencies

__version__ = "0.1.0"


def available_backends() -> list[str]:
    """Rotation backends usable in this process."""
    return ["torch"]


__all__ = [
    "ALiBi",
    "ActsOn",
    "CausalSelfAttention",
    "KVCache",
    "LearnedAbsolute",
    "NoPE",
    "RoPE",
    "Sinusoidal",
    "T5Bias",
    "__version__",
    "add_input_encoding",
    "alibi_bias",
    "alibi_slopes",
    "apply_rotary",
    "available",
    "available_backends",
    "build",
    "build_for_model",
    "rope_frequencies",
    "sinusoidal_table",
    "t5_relative_bucket",
]
