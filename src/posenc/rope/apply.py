"""Apply a rotation given cos/sin: the pure-torch path, for both pair layouts and partial rotation.

Shape key: b batch, h heads, s sequence, d head dim, r rotary dim (even, <= d).
``cos``/``sin`` hold one value per pair, (..., r/2), and are float32 (or float64) whatever ``x`` is: the
rotation is done in the wider of the two dtypes and cast back to ``x.dtype`` once.
"""

from __future__ import annotations

import torch

from posenc._checks import float_tensor, same_device


def check_rotary_args(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> int:
    """Validate and return r/2. Raises with the argument's name and the fix."""
    float_tensor("x", x)
    float_tensor("cos", cos)
    float_tensor("sin", sin)
    same_device(("x", "cos"), x, cos)
    same_device(("x", "sin"), x, sin)
    if cos.shape != sin.shape:
        raise ValueError(f"cos and sin must have the same shape, got {tuple(cos.shape)} and {tuple(sin.shape)}")
    if cos.dim() == 0:
        raise ValueError("cos must have a last dimension of r/2 (one value per rotated pair), got a scalar")
    half = cos.shape[-1]
    if half == 0 or 2 * half > x.shape[-1]:
        raise ValueError(
            f"cos.shape[-1]={half} pairs needs 2*{half}={2 * half} channels but x.shape[-1]={x.shape[-1]}; "
            "cos/sin hold one value per pair, (..., rotary_dim // 2)"
        )
    target = (*x.shape[:-1], half)
    try:
        broadcast = torch.broadcast_shapes(cos.shape, target)
    except RuntimeError:
        broadcast = None
    if broadcast != torch.Size(target):
        raise ValueError(
            f"cos/sin of shape {tuple(cos.shape)} do not broadcast to x.shape[:-1] + (r/2,) = {target}; "
            "for x in (b, h, s, d) pass cos of shape (s, r/2), (b, 1, s, r/2) or (1, 1, s, r/2)"
        )
    return half


def compute_dtype(x: torch.Tensor, cos: torch.Tensor) -> torch.dtype:
    """float64 if either side is float64, else float32: bf16/fp16 never do the rotation in their own dtype."""
    return torch.float64 if torch.float64 in (x.dtype, cos.dtype) else torch.float32


def rotate_pairs(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *, interleaved: bool, conjugate: bool = False
) -> torch.Tensor:
    """Rotate all channels of ``x`` (..., r) pairwise; no validation, no dtype handling.

    split-half pairs channel i with i + r/2 (Llama's ``rotate_half``); interleaved pairs 2i with 2i + 1
    (RoFormer, GPT-J). ``conjugate`` rotates by -angle: the inverse, and the backward of the forward.
    """
    if conjugate:
        sin = -sin
    if interleaved:
        x1, x2 = x.unflatten(-1, (-1, 2)).unbind(-1)
        return torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).flatten(-2)
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def apply_rotary_torch(
    x: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    *,
    interleaved: bool = False,
    conjugate: bool = False,
) -> torch.Tensor:
    """Pure-torch rotation, differentiable, any float dtype. Validates nothing (see ``check_rotary_args``).

    x: (..., d); cos, sin: broadcastable to (..., r/2). Returns x's shape and dtype; channels r.. are copied.
    """
    rotary = 2 * cos.shape[-1]
    wide = compute_dtype(x, cos)
    rotated = rotate_pairs(
        x[..., :rotary].to(wide), cos.to(wide), sin.to(wide), interleaved=interleaved, conjugate=conjugate
    ).to(x.dtype)
    if rotary == x.shape[-1]:
        return rotated
    return torch.cat((rotated, x[..., rotary:]), dim=-1)


def apply_rotary(
    x: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    *,
    interleaved: bool = False,
    conjugate: bool = False,
    backend: str = "auto",
) -> torch.Tensor:
    """Rotate the first ``2 * cos.shape[-1]`` channels of ``x``; the rest pass through unchanged.

    x: (..., d) any float dtype; cos, sin: float32 (or float64), broadcastable to x.shape[:-1] + (r/2,).
    interleaved: adjacent pairs (x0, x1), (x2, x3), ... if True, else split-half pairs (i, i + r/2).
    conjugate: rotate by the negative angle (the inverse rotation).
    backend: "auto" or "torch".
    Returns a new tensor with x's shape and dtype; ``x`` is not modified.
    """
    check_rotary_args(x, cos, sin)
    if backend not in ("auto", "torch"):
        raise ValueError(f"backend must be one of 'auto', 'torch', got {backend!r}")
    return apply_rotary_torch(x, cos, sin, interleaved=interleaved, conjugate=conjugate)
