"""Bridges to other libraries' configs and models (Hugging Face ``transformers``)."""

from posenc.interop.hf import rope_from_config, rope_kwargs_from_config

__all__ = ["rope_from_config", "rope_kwargs_from_config"]
