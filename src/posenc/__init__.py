"""posenc: positional encodings for transformers, exact against references, fast, and measured."""

import importlib
from typing import TYPE_CHECKING, Any

from posenc.absolute import LearnedAbsolute, Sinusoidal, sinusoidal_table
from posenc.attention import CausalSelfAttention, KVCache, add_input_encoding
from posenc.bias import ALiBi, T5Bias, alibi_bias, alibi_slopes, t5_relative_bucket
from posenc.encoding import ActsOn
from posenc.kernels import cpu_available, triton_available
from posenc.nope import NoPE
from posenc.positions import document_ids_from_cu_seqlens, document_ids_from_positions, positions_from_document_ids
from posenc.registry import available, build, build_for_model, register
from posenc.rope import (
    MRoPE,
    RoPE,
    apply_rotary,
    apply_rotary_,
    apply_rotary_qk,
    register_scaling,
    rope_frequencies,
)

__version__ = "0.1.0"


def available_backends() -> list[str]:
    """Rotation backends usable in this process: "torch" always; "cpu" once the fused CPU kernel has built and
    loaded (the first call builds it, about a second); "triton" when Triton imports and a CUDA device is present."""
    return ["torch"] + ["cpu"] * cpu_available() + ["triton"] * triton_available()


# Loaded on first use, so that `import posenc` stays light (no matplotlib, no lab) and `posenc.interop.patch_model`
# still works after it alone; `posenc.cli.main([...])` too, which the docs give for a lab run of a registered family.
_SUBPACKAGES = ("analysis", "cli", "distributed", "interop", "lab", "testing")

if TYPE_CHECKING:  # what __getattr__ returns, for type checkers (which would see Any)
    from posenc import analysis as analysis
    from posenc import cli as cli
    from posenc import distributed as distributed
    from posenc import interop as interop
    from posenc import lab as lab
    from posenc import testing as testing


def __getattr__(name: str) -> Any:
    if name in _SUBPACKAGES:
        return importlib.import_module(f"posenc.{name}")
    raise AttributeError(f"module 'posenc' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *_SUBPACKAGES})


__all__ = [
    "ALiBi",
    "ActsOn",
    "CausalSelfAttention",
    "KVCache",
    "LearnedAbsolute",
    "MRoPE",
    "NoPE",
    "RoPE",
    "Sinusoidal",
    "T5Bias",
    "__version__",
    "add_input_encoding",
    "alibi_bias",
    "alibi_slopes",
    "apply_rotary",
    "apply_rotary_",
    "apply_rotary_qk",
    "available",
    "available_backends",
    "build",
    "build_for_model",
    "document_ids_from_cu_seqlens",
    "document_ids_from_positions",
    "positions_from_document_ids",
    "register",
    "register_scaling",
    "rope_frequencies",
    "sinusoidal_table",
    "t5_relative_bucket",
]
