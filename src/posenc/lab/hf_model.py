"""The lab's rope model built as a Hugging Face architecture (``posenc lab --hf-config PATH``).

``HFByteLM`` wraps a small randomly initialised ``transformers`` causal LM of the config's architecture behind the
interface the lab's training and evaluation use for ``ByteLM``: ``forward(tokens, return_attention=...)`` returning
logits and per-layer attention probabilities, ``spec``, ``encoding``, safetensors weights through ``state_dict``.
A RoPE extension is applied with ``posenc.interop.patch_model``, so training and evaluation have no special case.

Importing this module does not import ``transformers``; building a model does. Shape key: b batch, s sequence,
v vocabulary (256 bytes), h heads.
"""

from __future__ import annotations

import importlib.util
import warnings
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from posenc.lab.model import VOCAB_SIZE, ModelSpec, _cpu_seed, byte_tokens
from posenc.positions import positions_from_document_ids, resolve_document_ids


def require_transformers() -> None:
    """Raise a ValueError saying how to install transformers if it is missing (found without importing it)."""
    if importlib.util.find_spec("transformers") is None:
        raise ValueError("--hf-config needs the transformers package, which is not installed; pip install transformers")


def read_hf_config(path: str, *, warn: bool = False) -> dict[str, Any]:
    """The dict in the config.json at ``path`` (a file, or a folder holding config.json), checked to name a
    supported architecture. Raises ValueError naming --hf-config and the fix; transformers is not imported.
    warn: say that the lab drops the file's RoPE scaling, if it has one (once, where the lab's config is checked:
    the file is read again for every unit's model)."""
    from posenc.interop.hf import read_config_json
    from posenc.interop.patch import SUPPORTED_ARCHITECTURES

    try:
        source = read_config_json(path)
    except FileNotFoundError:
        raise ValueError(f"hf_config (--hf-config) {path!r} is not a config.json or a folder holding one") from None
    except (OSError, ValueError) as error:  # unreadable, not JSON, not an object: the message names the file
        raise ValueError(f"hf_config (--hf-config) {error}") from error
    model_type = source.get("model_type")
    if model_type not in SUPPORTED_ARCHITECTURES:
        raise ValueError(
            f"hf_config (--hf-config) {path!r} has model_type {model_type!r}, which the lab cannot build; "
            f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    scalings = [source.get(key) for key in ("rope_parameters", "rope_scaling")]
    scaled = {str(s.get("rope_type") or s.get("type")) for s in scalings if isinstance(s, dict)} - {"None", "default"}
    if scaled and warn:
        warnings.warn(
            f"hf_config (--hf-config) {path!r} scales its RoPE ({', '.join(sorted(scaled))}); the lab drops that "
            "scaling and trains plain RoPE with the file's rope_theta and rotary fraction, then applies its own "
            "extensions (--extensions) at the longer lengths",
            stacklevel=2,
        )
    return source


def extended_length(trained: int, rope_parameters: Mapping[str, Any] | None) -> int:
    """The max_position_embeddings of a model trained at ``trained`` and extended by ``rope_parameters``.

    An extension that names the length it extends from (yarn, llama3: ``original_max_position_embeddings``) reaches
    ``factor`` times it, and transformers reads max_position_embeddings as that target: its llama3 check warns when
    the original is not below it (the lab's extended models claimed the trained length, so every llama3 model
    warned), and its yarn check compares max / original with factor. Neither reads it for the frequencies. The other
    types keep the trained length, which dynamic NTK scales past."""
    if rope_parameters is None or "original_max_position_embeddings" not in rope_parameters:
        return trained
    return round(rope_parameters["factor"] * rope_parameters["original_max_position_embeddings"])


class HFByteLM(nn.Module):
    """A byte-level ``transformers`` causal LM of the architecture in ``hf_config``, sized by ``spec``.

    spec: dim, layers, heads and max_positions (the training length, written as max_position_embeddings, or the
    length a yarn or llama3 extension reaches: ``extended_length``);
    hf_config: the config.json's path (architecture, rope_theta, rotary fraction, norms come from it; its rope
    scaling is dropped); rope_parameters: None for the plain RoPE the model trains with, or an extension's
    rope_parameters (``posenc.lab.config.extension_rope_parameters``) installed by ``patch_model``.
    The weights come from torch's global generator, like ``ByteLM``'s, so the caller's seed decides them.
    """

    def __init__(self, spec: ModelSpec, hf_config: str, rope_parameters: Mapping[str, Any] | None = None) -> None:
        super().__init__()
        require_transformers()
        from posenc.interop.patch import patch_model, tiny_model_from_config

        self.spec = spec
        source = read_hf_config(hf_config)
        self.architecture = source["model_type"]
        self.encoding_name = "rope"
        # ByteLM's shared encoding; here the RoPE lives inside the Hugging Face model.
        self.encoding = None
        # tiny_model_from_config seeds its own generator; draw that seed from the global one so the caller's
        # torch.manual_seed decides the weights, as it does for ByteLM (its range is older than ByteLM's).
        seed = _cpu_seed(2**31 - 1)
        # The lab's sizes replace the file's, also where the rotation is sized from them (its head_dim is dropped).
        max_positions = extended_length(spec.max_positions, rope_parameters)
        sized = {k: v for k, v in source.items() if k != "head_dim"}
        sized.update(hidden_size=spec.dim, num_attention_heads=spec.heads, max_position_embeddings=max_positions)
        self.hf = tiny_model_from_config(
            sized,
            hidden_size=spec.dim,
            num_layers=spec.layers,
            num_heads=spec.heads,
            vocab_size=VOCAB_SIZE,
            max_position_embeddings=max_positions,
            seed=seed,
            attn_implementation="eager",  # the only implementation that returns attention probabilities
        )
        self.patch_report = None if rope_parameters is None else patch_model(self.hf, rope_parameters=rope_parameters)

    def forward(
        self, tokens: torch.Tensor, *, document_ids: torch.Tensor | None = None, return_attention: bool = False
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """tokens: (b, s) int64 bytes; document_ids: (s,) or (b, s), one run of tokens per id, for documents packed
        into a row, as ``ByteLM`` takes them. Returns logits (b, s, v) and, with return_attention, one (b, h, s, s)
        float32 probability tensor per layer (else an empty list)."""
        tokens = byte_tokens(tokens)
        packed = {}
        if document_ids is not None:
            batch, seq_len = tokens.shape
            docs = resolve_document_ids(document_ids, batch=batch, seq_len=seq_len, device=tokens.device)
            # Position ids restarting at 0 per document are what transformers reads packing from (its masks keep
            # documents apart only without a cache and an attention_mask, as here) and what rotates each document.
            packed["position_ids"] = positions_from_document_ids(docs).expand(batch, seq_len)
        out = self.hf(input_ids=tokens, output_attentions=return_attention, use_cache=False, **packed)
        attentions = [a.float() for a in out.attentions] if return_attention else []
        return out.logits, attentions
