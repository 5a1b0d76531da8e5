"""Learned absolute positions (GPT-2, BERT): a table of ``max_positions`` rows, and nothing past it."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from posenc._checks import assert_without_sync, float_dtype, int_tensor, positive_int, to_device, values_readable
from posenc._embedding import SmallInitEmbedding
from posenc.encoding import ActsOn


class LearnedAbsolute(nn.Module):
    """max_positions: rows in the table; dim: model width. Position >= max_positions is an error, never a clamp."""

    acts_on = ActsOn.INPUT

    def __init__(self, max_positions: int, dim: int) -> None:
        super().__init__()
        self.max_positions = positive_int("max_positions", max_positions)
        self.dim = positive_int("dim", dim)
        self.table = SmallInitEmbedding(max_positions, dim)

    @classmethod
    def from_model_dims(
        cls, *, dim: int, num_heads: int, head_dim: int, max_positions: int, **options: Any
    ) -> LearnedAbsolute:
        """``LearnedAbsolute(max_positions, dim)`` (``build_for_model``'s hook): a (max_positions, dim) table
        added to the token embeddings; num_heads and head_dim are not read."""
        return cls(max_positions, dim, **options)

    def forward(self, positions: torch.Tensor, *, dtype: torch.dtype | None = None) -> torch.Tensor:
        """positions: (...) integer in [0, max_positions). Returns (..., dim), in ``dtype`` (None: the table's)."""
        int_tensor("positions", positions, host_read=True)
        # A meta table given ids with values: they are checked by value below, and only the lookup is on meta (a
        # meta table looks up nothing).
        on_meta = self.table.weight.device.type == "meta" and values_readable(positions.device)
        if not on_meta:
            # Ids on another device are moved, as for RoPE; a meta table would read CPU ids as zeros.
            positions = to_device("positions", positions, self.table.weight.device, "the learned table")
        if dtype is not None:
            float_dtype("dtype", dtype)
        if positions.dtype not in (torch.int64, torch.int32):
            positions = positions.long()  # what embedding lookups take; int8/int16/uint8 ids are still row ids
        if positions.numel() and not values_readable(positions.device):
            # Compiling or capturing: the check runs with the lookup instead of reading values on the host.
            assert_without_sync(
                (positions >= 0) & (positions < self.max_positions),
                f"positions must be rows of the learned table, 0..{self.max_positions - 1}",
            )
            # Inductor checks the lookup's bounds itself, and its check could fail first with its own message
            # ("index out of bounds: tmp6 < 16L"); clamped, the lookup cannot, and the assert above speaks.
            positions = positions.clamp(0, self.max_positions - 1)
        elif positions.numel():
            low, high = int(positions.min()), int(positions.max())
            if low < 0:
                raise ValueError(f"positions must be >= 0 (row indices of the learned table), got {low}")
            if high >= self.max_positions:
                raise ValueError(
                    f"position {high} is outside the learned table of "
                    f"max_positions={self.max_positions} rows (valid: 0..{self.max_positions - 1}); a learned "
                    "absolute encoding has nothing to say past its table: build it with a larger max_positions"
                )
        out = self.table(positions.to("meta") if on_meta else positions)
        return out if dtype is None else out.to(dtype)

    def extra_repr(self) -> str:
        return f"max_positions={self.max_positions}, dim={self.dim}"
