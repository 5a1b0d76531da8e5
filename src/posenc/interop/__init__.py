"""Bridges to other libraries' configs and models (Hugging Face ``transformers``)."""

from posenc.interop.hf import rope_from_config, rope_kwargs_from_config, rope_layer_types
from posenc.interop.patch import (
    SUPPORTED_ARCHITECTURES,
    VERIFIED_ARCHITECTURES,
    PatchReport,
    patch_model,
    tiny_model_from_config,
    unpatch_model,
)

__all__ = [
    "SUPPORTED_ARCHITECTURES",
    "VERIFIED_ARCHITECTURES",
    "PatchReport",
    "patch_model",
    "rope_from_config",
    "rope_kwargs_from_config",
    "rope_layer_types",
    "tiny_model_from_config",
    "unpatch_model",
]
