"""Turn the ways a caller can say "where are these tokens" into one (b or 1, s) int64 tensor.

Accepted: nothing (0..s-1), an integer ``offset`` (KV-cache decoding), per-batch offsets (a (b,) tensor), or
explicit position ids of shape (s,) or (b, s) (packed sequences that restart at 0 per document).
"""

from __future__ import annotations

import torch

from posenc._checks import assert_without_sync, int_tensor, values_readable


def resolve_positions(
    seq_len: int,
    *,
    batch: int,
    positions: torch.Tensor | None = None,
    offset: int | torch.Tensor = 0,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """Returns int64 positions of shape (1, s) or (b, s).

    positions: (s,) or (b, s) integer tensor, or None for ``offset + arange(s)``.
    offset: int >= 0, or an integer tensor of shape (b,) (one offset per sequence). Added to ``positions``.
    No offset or position may be negative: checked on the host, or, under torch.compile and CUDA graph capture
    (where reading a value would break the graph or the capture), by an assert that runs with the graph.
    """
    tensors = [t for t in (positions, offset) if isinstance(t, torch.Tensor)]
    check_data = values_readable(device if device is not None else (tensors[0].device if tensors else None))
    if isinstance(offset, torch.Tensor):
        int_tensor("offset", offset)
        if offset.dim() == 0:
            offset = offset.reshape(1)
        if offset.dim() != 1 or offset.shape[0] not in (1, batch):
            raise ValueError(
                f"offset must be an int or a tensor of shape ({batch},) (one per sequence), "
                f"got shape {tuple(offset.shape)}"
            )
        if check_data and bool((offset < 0).any()):
            raise ValueError("offset must be >= 0 (it counts tokens already in the cache), got a negative entry")
        offset = offset.to(device=device, dtype=torch.long)[:, None]
    elif isinstance(offset, bool) or not isinstance(offset, int):
        raise TypeError(f"offset must be an int or an integer tensor, got {type(offset).__name__}")
    elif offset < 0:
        raise ValueError(f"offset must be >= 0 (it counts tokens already in the cache), got {offset}")

    if positions is None:
        pos = torch.arange(seq_len, device=device, dtype=torch.long)[None, :]
    else:
        int_tensor("positions", positions)
        as_given = tuple(positions.shape)
        if positions.dim() == 1:
            positions = positions[None, :]
        if positions.dim() != 2 or positions.shape[-1] != seq_len or positions.shape[0] not in (1, batch):
            raise ValueError(
                f"positions must have shape ({seq_len},) or ({batch}, {seq_len}) to match the sequence, got {as_given}"
            )
        pos = positions.to(device=device, dtype=torch.long)
    pos = pos + offset
    if check_data and positions is not None and pos.numel() and bool((pos < 0).any()):
        raise ValueError("positions must be >= 0, got a negative entry")
    if not check_data and isinstance(offset, torch.Tensor):
        assert_without_sync(offset >= 0, "offset must be >= 0 (it counts tokens already in the cache)")
    if not check_data and positions is not None:  # without ids, pos >= 0 follows from the offset's assert
        assert_without_sync(pos >= 0, "positions must be >= 0 (offset + position ids), got a negative entry")
    return pos
