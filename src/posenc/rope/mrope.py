"""Multimodal RoPE (M-RoPE, Qwen2-VL): three position ids per token (temporal, height, width).

The r/2 frequency pairs are cut into contiguous sections (``mrope_section``, e.g. [16, 24, 24] for r = 128); the
pairs of section i turn by the position id of axis i % 3. Text tokens carry the same id on all three axes, which
makes M-RoPE equal to plain RoPE for them. Numerically identical to ``transformers``' Qwen2-VL rotary embedding and
``apply_rotary_pos_emb`` (``mrope_section`` there counts pairs, too; 4.x's ``apply_multimodal_rotary_pos_emb``
doubled it to count channels of the duplicated cos/sin).

Shape key: a axes (3), b batch, h heads, s sequence, d head dim, r rotary dim.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from posenc._checks import float_tensor, int_tensor, positive_int
from posenc.rope.apply import apply_rotary_qk
from posenc.rope.module import Layout, RoPE

AXES = 3


def check_mrope_section(mrope_section: Sequence[int], rotary_dim: int) -> tuple[int, ...]:
    """Validate that the sections are positive ints summing to r/2. Returns them as a tuple."""
    if isinstance(mrope_section, (str, bytes)) or not isinstance(mrope_section, Sequence) or not mrope_section:
        raise TypeError(f"mrope_section must be a list of positive ints, e.g. [16, 24, 24], got {mrope_section!r}")
    sections = tuple(positive_int(f"mrope_section[{i}]", n) for i, n in enumerate(mrope_section))
    if sum(sections) != rotary_dim // 2:
        raise ValueError(
            f"mrope_section {list(sections)} must sum to rotary_dim / 2 = {rotary_dim // 2} (it counts frequency "
            f"pairs), but sums to {sum(sections)}"
        )
    return sections


def mrope_axis_of_pair(mrope_section: Sequence[int]) -> torch.Tensor:
    """(r/2,) int64: which position axis (0 temporal, 1 height, 2 width) turns each pair."""
    axes = torch.arange(len(mrope_section)) % AXES
    return axes.repeat_interleave(torch.tensor(list(mrope_section)))


def mrope_cos_sin(
    positions: torch.Tensor,
    inv_freq: torch.Tensor,
    mrope_section: Sequence[int],
    attention_factor: float = 1.0,
    dtype: torch.dtype = torch.float32,
) -> tuple[torch.Tensor, torch.Tensor]:
    """positions: (3, b, s) integer; inv_freq: (r/2,) float64. Returns cos, sin: (b, s, r/2) in ``dtype``.

    Angles are taken in float64, as in ``angles_to_cos_sin``; each pair reads its own axis' positions.
    """
    axis = mrope_axis_of_pair(mrope_section).to(positions.device)  # (r/2,)
    pos = positions.to(torch.float64).index_select(0, axis)  # (r/2, b, s): pair j's positions
    angles = pos.movedim(0, -1) * inv_freq.to(device=positions.device, dtype=torch.float64)
    cos, sin = angles.cos(), angles.sin()
    if attention_factor != 1.0:
        cos, sin = cos * attention_factor, sin * attention_factor
    return cos.to(dtype), sin.to(dtype)


class MRoPE(RoPE):
    """RoPE with Qwen2-VL's three position axes. Accepts every ``RoPE`` option (scaling types included).

    mrope_section: pairs per section, summing to rotary_dim / 2 (Qwen2-VL: [16, 24, 24]).
    ``forward`` takes positions of shape (3, b, s); (s,) or (b, s) ids (text only) behave like plain RoPE.
    """

    def __init__(
        self,
        head_dim: int,
        *,
        mrope_section: Sequence[int],
        rope_parameters: Mapping[str, Any] | None = None,
        **options: Any,
    ) -> None:
        super().__init__(head_dim, rope_parameters=rope_parameters, **options)
        self.mrope_section = check_mrope_section(mrope_section, self.rotary_dim)

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        *,
        positions: torch.Tensor | None = None,
        offset: int | torch.Tensor = 0,
        layout: Layout = "bhsd",
        seq_len: int | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """q: (b, h_q, s, d), k: (b, h_k, s, d) for "bhsd" ((b, s, h, d) for "bshd"); positions: (3, b, s) or
        (3, 1, s) integer ids, or anything ``RoPE.forward`` takes. Returns new (q, k) with the input dtypes."""
        if positions is None or positions.dim() != 3:
            return super().forward(q, k, positions=positions, offset=offset, layout=layout, seq_len=seq_len)
        int_tensor("positions", positions)
        float_tensor("q", q)
        float_tensor("k", k)
        if layout not in ("bhsd", "bshd"):
            raise ValueError(f"layout must be 'bhsd' or 'bshd', got {layout!r}")
        head_axis = 1 if layout == "bhsd" else 2
        if (
            q.dim() != 4
            or k.dim() != 4
            or [n for i, n in enumerate(q.shape) if i != head_axis]
            != [n for i, n in enumerate(k.shape) if i != head_axis]
        ):
            raise ValueError(
                f"q and k must be 4-D ({layout}) with the same batch, length and head dim (head counts may differ), "
                f"got {tuple(q.shape)} and {tuple(k.shape)}"
            )
        if not isinstance(offset, int) or isinstance(offset, bool) or offset < 0:
            raise TypeError("offset must be an int >= 0 with (3, b, s) positions; add per-row offsets to positions")
        seq_axis = 2 if layout == "bhsd" else 1
        if (
            positions.shape[0] != AXES
            or positions.shape[2] != q.shape[seq_axis]
            or positions.shape[1]
            not in (
                1,
                q.shape[0],
            )
        ):
            raise ValueError(
                f"positions must have shape (3, b, s) = (3, {q.shape[0]}, {q.shape[seq_axis]}) (temporal, height, "
                f"width ids), got {tuple(positions.shape)}"
            )
        pos = positions.to(device=q.device, dtype=torch.long) + offset
        if bool((pos < 0).any()):
            raise ValueError("positions must be >= 0, got a negative entry")
        if seq_len is None:
            seq_len = self.scaling_length(pos)
        inv_freq, factor = self.frequencies(seq_len)
        dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
        cos, sin = mrope_cos_sin(pos, inv_freq, self.mrope_section, factor, dtype)  # (b or 1, s, r/2)
        cos, sin = cos.unsqueeze(head_axis), sin.unsqueeze(head_axis)
        return apply_rotary_qk(q, k, cos, sin, interleaved=self.interleaved, backend=self.backend)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, mrope_section={list(self.mrope_section)}"
