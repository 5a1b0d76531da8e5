"""A tiny pre-norm decoder-only byte-level language model that takes any registered encoding by name.

One encoding instance is built by ``posenc.registry.build_for_model`` and shared by every layer that uses it, and
the model reads only its ``acts_on`` declaration (an input encoding goes through ``add_input_encoding`` once, the
others into every ``CausalSelfAttention``), so there is no special case for any family. Shape key: b batch,
s sequence, v vocabulary (256 bytes), l layers, h heads.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch._subclasses.fake_tensor import unset_fake_temporarily

from posenc._checks import host_min_max, positive_int, values_readable
from posenc.attention import CausalSelfAttention, add_input_encoding
from posenc.encoding import ActsOn
from posenc.positions import positions_from_document_ids, resolve_document_ids
from posenc.registry import build_for_model

VOCAB_SIZE = 256  # bytes


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    """dim: model width; layers: blocks; heads: attention heads (dim % heads == 0; RoPE refuses an odd head_dim,
    sinusoidal an odd dim, and the other encodings take either);
    max_positions: the training length (the learned table's size, the length RoPE extensions extend from)."""

    dim: int
    layers: int
    heads: int
    max_positions: int
    mlp_ratio: int = 4

    def __post_init__(self) -> None:
        for name in ("dim", "layers", "heads", "max_positions", "mlp_ratio"):
            object.__setattr__(self, name, positive_int(f"ModelSpec.{name}", getattr(self, name)))
        if self.dim % self.heads:
            raise ValueError(f"ModelSpec.dim={self.dim} must be divisible by heads={self.heads}")

    @property
    def head_dim(self) -> int:
        return self.dim // self.heads


def encoding_for(spec: ModelSpec, encoding: str, options: Mapping[str, Any] | None = None) -> nn.Module:
    """The encoding ``ByteLM(spec, encoding, options)`` shares among its layers, built alone (the lab checks and
    records a rope model's RoPE without building the model). Its sizes come from ``spec``: T5's buckets, too, are
    sized to the training length (``T5Bias.from_model_dims``)."""
    return build_for_model(
        encoding,
        dim=spec.dim,
        num_heads=spec.heads,
        head_dim=spec.head_dim,
        max_positions=spec.max_positions,
        **dict(options or {}),
    )


def _cpu_seed(high: int = 2**62) -> int:
    """A seed in [0, high) drawn from the CPU generator and read on the host, whatever device context or
    FakeTensorMode the model is built under: under ``torch.device("meta")`` the draw was a meta tensor, which ``int``
    cannot read (the model could not be built on the meta device), and under ``torch.device("cuda")`` it came from
    (and moved) a CUDA generator that ``fork_rng(devices=[])`` does not restore. The same draw as before on the CPU."""
    with unset_fake_temporarily():
        return int(torch.randint(high, (), device="cpu"))


class Block(nn.Module):
    """x + attn(norm(x)), then x + mlp(norm(x))."""

    def __init__(self, spec: ModelSpec, encoding: nn.Module) -> None:
        super().__init__()
        self.attn_norm = nn.LayerNorm(spec.dim)
        # An input encoding is added once by ByteLM; the attention takes the ones that act in it.
        self.attn = CausalSelfAttention(
            spec.dim, spec.heads, encoding=None if encoding.acts_on is ActsOn.INPUT else encoding
        )
        self.mlp_norm = nn.LayerNorm(spec.dim)
        self.mlp = nn.Sequential(
            nn.Linear(spec.dim, spec.mlp_ratio * spec.dim), nn.GELU(), nn.Linear(spec.mlp_ratio * spec.dim, spec.dim)
        )

    def forward(
        self,
        x: torch.Tensor,
        positions: torch.Tensor,
        *,
        document_ids: torch.Tensor | None = None,
        return_attention: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """x: (b, s, dim); positions, document_ids (b or 1, s). Returns (b, s, dim) and, with return_attention,
        probabilities (b, h, s, s) float32."""
        attend = {"positions": positions, "document_ids": document_ids}
        if return_attention:
            out, probs = self.attn(self.attn_norm(x), **attend, return_attention=True)
        else:
            out, probs = self.attn(self.attn_norm(x), **attend), None
        x = x + out
        return x + self.mlp(self.mlp_norm(x)), probs


def byte_tokens(tokens: torch.Tensor) -> torch.Tensor:
    """Check a batch of byte ids for a model of the lab: (b, s) integer ids in 0..255. Returns them as int64 (what
    embedding tables take; bytes come as uint8). Raises ValueError / TypeError naming tokens, since the embedding's
    own error for an id outside its table names neither the tokens nor the range."""
    if not isinstance(tokens, torch.Tensor) or tokens.dim() != 2:
        shape = tuple(tokens.shape) if isinstance(tokens, torch.Tensor) else type(tokens).__name__
        raise ValueError(f"tokens must be a (b, s) tensor of byte ids, got {shape}")
    if tokens.dtype.is_floating_point or tokens.dtype.is_complex or tokens.dtype == torch.bool:
        raise TypeError(f"tokens must be an integer tensor of byte ids (uint8 or int64), got {tokens.dtype}")
    tokens = tokens.long()
    if tokens.numel() and values_readable(tokens.device):
        low, high = host_min_max(tokens)
        if low < 0 or high >= VOCAB_SIZE:
            raise ValueError(f"tokens must be byte ids in 0..{VOCAB_SIZE - 1}, got ids from {low} to {high}")
    return tokens


class ByteLM(nn.Module):
    """Byte-level decoder-only transformer.

    spec: sizes; encoding: a registered encoding name; encoding_options: that family's constructor options (e.g.
    ``{"rope_parameters": {"rope_type": "yarn", "factor": 4.0, ...}}``), passed to ``build_for_model``.

    The byte embedding E is initialised N(0, 1/dim) and scaled by sqrt(dim) on input (Vaswani et al.; fairseq, whose
    language models the ALiBi paper compares), so bytes enter at unit scale, as large as a sinusoidal encoding,
    and the tied output head starts with unit-scale logits.
    """

    def __init__(self, spec: ModelSpec, encoding: str, encoding_options: Mapping[str, Any] | None = None) -> None:
        super().__init__()
        self.spec = spec
        self.encoding_name = encoding
        # The encoding's own weights (learned, t5) come from a stream of their own, drawn from the caller's without
        # moving it: every encoding's model then starts from the same shared weights for a seed, so that encodings
        # are compared in pairs (before, learned and t5 shifted every weight drawn after theirs).
        with torch.random.fork_rng(devices=[]):
            # The CPU generator only: torch.manual_seed would reseed the CUDA ones too, which fork_rng did not save.
            torch.default_generator.manual_seed(_cpu_seed())
            self.encoding = encoding_for(spec, encoding, encoding_options)
        self.embed = nn.Embedding(VOCAB_SIZE, spec.dim)
        self.blocks = nn.ModuleList(Block(spec, self.encoding) for _ in range(spec.layers))
        self.norm = nn.LayerNorm(spec.dim)
        # GPT-2's init for the projections; encodings with parameters (learned, t5) keep their class's init.
        for module in self.blocks.modules():
            if isinstance(module, nn.Linear):
                nn.init.normal_(module.weight, std=0.02)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)
        nn.init.normal_(self.embed.weight, std=spec.dim**-0.5)
        self.embed_scale = math.sqrt(spec.dim)

    def forward(
        self, tokens: torch.Tensor, *, document_ids: torch.Tensor | None = None, return_attention: bool = False
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """tokens: (b, s) int64 bytes; document_ids: (s,) or (b, s), one run of tokens per id, for documents packed
        into a row (each then starts at position 0 and attends only within itself). Returns logits (b, s, v) and, with
        return_attention, one (b, h, s, s) float32 probability tensor per layer (else an empty list)."""
        tokens = byte_tokens(tokens)
        b, s = tokens.shape
        if document_ids is None:
            positions = torch.arange(s, device=tokens.device)[None]
        else:
            document_ids = resolve_document_ids(document_ids, batch=b, seq_len=s, device=tokens.device)
            positions = positions_from_document_ids(document_ids)
        x = add_input_encoding(self.embed(tokens) * self.embed_scale, self.encoding, positions)
        attentions = []
        for block in self.blocks:
            x, probs = block(x, positions, document_ids=document_ids, return_attention=return_attention)
            if probs is not None:
                attentions.append(probs)
        return F.linear(self.norm(x), self.embed.weight), attentions


def next_byte_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """logits: (b, s, v); targets: (b, s) the next bytes. Returns per-position losses (b, s) in nats, float32."""
    return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(), reduction="none").view(targets.shape)
