"""Context parallelism: which positions of one long sequence each rank holds.

Megatron-LM and TransformerEngine split a long sequence across ranks. With causal attention a contiguous split
leaves rank 0 almost idle (its queries see few keys) and the last rank doing most of the work; cutting the
sequence into 2W chunks and giving rank r chunks r and 2W-1-r evens the work out. RoPE itself needs nothing
special: each rank rotates its tokens by their true positions (and length-dependent scaling types must be told the
full length, not the shard's).
"""

from __future__ import annotations

import torch

from posenc._checks import flag, integer_offset, positive_int

__all__ = ["shard_positions"]


def shard_positions(
    seq_len: int, world_size: int, rank: int, *, load_balance: bool = True, device: torch.device | str | None = None
) -> torch.Tensor:
    """Position ids held by ``rank``, (seq_len // world_size,) int64, in the order the rank stores its tokens.

    load_balance: cut into 2 * world_size chunks and take chunks ``rank`` and ``2 * world_size - 1 - rank``;
    otherwise take the rank's contiguous slice. One rank holds the whole sequence, of any length (nothing to
    balance: generic code calling this with the world size of a single process needs no even length).
    """
    seq_len, world_size = positive_int("seq_len", seq_len), positive_int("world_size", world_size)
    rank = integer_offset(rank)  # numpy's integers too, as for the sizes
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < world_size:
        raise ValueError(f"rank must be an int in [0, {world_size}) for world_size={world_size}, got {rank!r}")
    chunks = 2 * world_size if flag("load_balance", load_balance) and world_size > 1 else world_size
    if seq_len % chunks:
        raise ValueError(
            f"seq_len={seq_len} must be divisible by {chunks} "
            f"({'2 * world_size, for load-balanced chunks' if load_balance else 'world_size'}); "
            f"pad the sequence to {seq_len + chunks - seq_len % chunks}"
        )
    size = seq_len // chunks
    if chunks == world_size:
        return torch.arange(rank * size, (rank + 1) * size, device=device)
    first = torch.arange(rank * size, (rank + 1) * size, device=device)
    mirror = chunks - 1 - rank
    second = torch.arange(mirror * size, (mirror + 1) * size, device=device)
    return torch.cat((first, second))
