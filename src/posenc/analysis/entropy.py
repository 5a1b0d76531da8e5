"""Attention entropy against sequence length, per layer and head.

Entropy of one query's attention row is -sum_n p_n log p_n (nats); uniform attention over t keys gives log t.
The value at length L is the mean over the batch and over the L query rows of a length-L sequence. From a model,
every ``CausalSelfAttention`` inside it is asked for its probabilities (``return_attention=True``) while the
model runs at each length, so length-dependent scalings see the length they would see in use. From a tensor of
causal scores or probabilities, a length-L sequence is its top-left L x L block (causal rows never look ahead).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any, Literal

import torch
from torch import nn

from posenc._checks import float_tensor, positive_int
from posenc.attention import CausalSelfAttention


@dataclasses.dataclass(frozen=True)
class EntropyResult:
    """lengths: (n,) int64; entropy: (n, l, h) float64 in nats, the mean over batch and query rows for each
    length, layer and head; source: "model", "probs" or "scores"."""

    lengths: torch.Tensor
    entropy: torch.Tensor
    source: str

    def mean_over_heads(self) -> torch.Tensor:
        """(n, l): the mean entropy per layer."""
        return self.entropy.mean(dim=-1)


def _check_lengths(lengths: Sequence[int] | torch.Tensor) -> list[int]:
    values = lengths.tolist() if isinstance(lengths, torch.Tensor) else list(lengths)
    if not values:
        raise ValueError("lengths is empty; give the sequence lengths to measure, e.g. [64, 128, 256]")
    return [positive_int("each of lengths", v) for v in values]


def row_entropy(probs: torch.Tensor) -> torch.Tensor:
    """probs: (..., t) rows summing to 1. Returns (...) float64 entropy in nats (0 log 0 = 0)."""
    p = probs.to(torch.float64)
    return -torch.special.xlogy(p, p).sum(dim=-1)


def _causal_probs(values: torch.Tensor, kind: str) -> torch.Tensor:
    """values: (l, b, h, s, s). Returns float64 probabilities with the future masked out."""
    s = values.shape[-1]
    future = torch.ones(s, s, dtype=torch.bool, device=values.device).triu(diagonal=1)
    if kind == "scores":
        return values.to(torch.float64).masked_fill(future, float("-inf")).softmax(dim=-1)
    probs = values.to(torch.float64)
    if bool((probs < 0).any()) or not torch.allclose(probs.sum(dim=-1), torch.ones((), dtype=torch.float64), atol=1e-3):
        raise ValueError("probability rows must be >= 0 and sum to 1; pass values='scores' for pre-softmax logits")
    if bool((probs.masked_select(future) != 0).any()):
        raise ValueError(
            "the probabilities put weight on future keys (above the diagonal); attention_entropy reads a length-L "
            "sequence as the top-left L x L block, which holds only for causal attention"
        )
    return probs


def _from_tensor(values: torch.Tensor, lengths: list[int], kind: str) -> EntropyResult:
    float_tensor("scores or probabilities", values)
    if values.dim() == 4:
        values = values[None]
    if values.dim() != 5 or values.shape[-1] != values.shape[-2]:
        raise ValueError(
            "scores or probabilities must be (b, h, s, s) or (l, b, h, s, s): square, from position 0, "
            f"got shape {tuple(values.shape)}"
        )
    s = values.shape[-1]
    if max(lengths) > s:
        raise ValueError(f"lengths go up to {max(lengths)} but the tensor holds only s={s} positions")
    rows = row_entropy(_causal_probs(values, kind))  # (l, b, h, s)
    entropy = torch.stack([rows[..., :length].mean(dim=(1, 3)) for length in lengths])  # (n, l, h)
    return EntropyResult(lengths=torch.tensor(lengths), entropy=entropy, source=kind)


def _attention_layers(model: nn.Module) -> list[CausalSelfAttention]:
    layers = [m for m in model.modules() if isinstance(m, CausalSelfAttention)]
    if not layers:
        raise TypeError(
            f"{type(model).__name__} holds no posenc.attention.CausalSelfAttention; pass a model built from it, "
            "or a tensor of attention scores / probabilities with values='scores' or 'probs'"
        )
    return layers


def _from_model(model: nn.Module, lengths: list[int], inputs: torch.Tensor | None) -> EntropyResult:
    layers = _attention_layers(model)
    if inputs is None:
        if not isinstance(model, CausalSelfAttention):
            raise ValueError(
                f"pass inputs=... for a {type(model).__name__}: what its forward takes, (b, s, ...) with "
                f"s >= {max(lengths)} (token ids for a language model); it is cut to each length along dim 1"
            )
        generator = torch.Generator().manual_seed(0)
        dim = model.q_proj.in_features
        inputs = torch.randn(2, max(lengths), dim, generator=generator).to(model.q_proj.weight)
    if not isinstance(inputs, torch.Tensor) or inputs.dim() < 2:
        raise TypeError("inputs must be a tensor of shape (b, s, ...) that the model's forward takes")
    if inputs.shape[1] < max(lengths):
        raise ValueError(f"inputs hold {inputs.shape[1]} positions but lengths go up to {max(lengths)}")

    captured: list[torch.Tensor] = []
    asked: list[bool] = []

    def before(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[tuple, dict]:
        asked.append(bool(kwargs.get("return_attention", False)))
        return args, {**kwargs, "return_attention": True}

    def after(module: nn.Module, args: tuple, kwargs: dict, output: tuple[torch.Tensor, torch.Tensor]) -> Any:
        captured.append(output[1])
        # Hand the caller what it asked for, so the model runs exactly as it would without the hook.
        return output if asked.pop() else output[0]

    handles = []
    for layer in layers:
        handles.append(layer.register_forward_pre_hook(before, with_kwargs=True))
        handles.append(layer.register_forward_hook(after, with_kwargs=True))
    was_training = model.training
    per_length = []
    try:
        model.eval()
        with torch.no_grad():
            for length in lengths:
                captured.clear()
                model(inputs[:, :length])
                if len(captured) != len(layers):
                    raise RuntimeError(
                        f"{type(model).__name__} ran {len(captured)} attention calls for {len(layers)} attention "
                        "layers; attention_entropy needs each layer called once per forward"
                    )
                per_length.append(torch.stack([row_entropy(p).mean(dim=(0, 2)) for p in captured]))  # (l, h)
    finally:
        for handle in handles:
            handle.remove()
        model.train(was_training)
    return EntropyResult(lengths=torch.tensor(lengths), entropy=torch.stack(per_length), source="model")


def attention_entropy(
    model_or_scores: nn.Module | torch.Tensor,
    lengths: Sequence[int] | torch.Tensor,
    *,
    values: Literal["probs", "scores"] | None = None,
    inputs: torch.Tensor | None = None,
) -> EntropyResult:
    """Mean attention entropy per layer and head at each length.

    model_or_scores: a model holding ``CausalSelfAttention`` layers (a bare one too), run at each length; or a
    tensor (b, h, s, s) / (l, b, h, s, s) of causal attention, with ``values`` saying whether it holds
    probabilities ("probs") or pre-softmax logits ("scores", the causal mask is applied here).
    lengths: sequence lengths to measure (each <= s for a tensor).
    inputs: for a model, what its forward takes, (b, s, ...) with s >= max(lengths), cut along dim 1 for each
    length (token ids for ``posenc.lab`` models); a bare ``CausalSelfAttention`` defaults to seeded N(0, 1) x.
    Returns an ``EntropyResult`` with entropy (n, l, h) in nats.
    """
    lengths = _check_lengths(lengths)
    if isinstance(model_or_scores, torch.Tensor):
        if values not in ("probs", "scores"):
            raise ValueError(f"values must be 'probs' or 'scores' to say what the tensor holds, got {values!r}")
        if inputs is not None:
            raise ValueError("inputs is for a model; a tensor of scores or probabilities needs none")
        return _from_tensor(model_or_scores, lengths, values)
    if isinstance(model_or_scores, nn.Module):
        if values is not None:
            raise ValueError("values is for a tensor of scores or probabilities; a model gives probabilities itself")
        return _from_model(model_or_scores, lengths, inputs)
    raise TypeError(
        f"model_or_scores must be an nn.Module or a tensor of attention scores, got {type(model_or_scores).__name__}"
    )
