"""Context parallelism: which positions of one long sequence each rank holds.

Megatron-LM and TransformerEngine split a long sequence across ranks. With causal attention a contiguous split
leaves rank 0 almost idle (its queries see few keys) and the last rank doing most of the work; cutting the
sequence into 2W chunks and giving rank r chunks r and 2W-1-r evens the work out. RoPE itself needs nothing
special: each rank rotates its tokens by their true positions (and length-dependent scaling types must be told the
full length, not the shard's).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from posenc._checks import flag, integer, is_dtensor, positive_int, prefix_sums, values_readable
from posenc.positions import sequence_lengths

__all__ = ["PackedShard", "shard_packed_positions", "shard_positions"]


def _split(world_size: int, rank: int, load_balance: bool) -> tuple[int, int, int]:
    """The checked world size and rank, and how many chunks each sequence is cut into."""
    world_size = positive_int("world_size", world_size)
    rank = integer(
        "rank", rank, low=0, high=world_size, expected=f"an int in [0, {world_size}) for world_size={world_size}"
    )
    return world_size, rank, 2 * world_size if flag("load_balance", load_balance) and world_size > 1 else world_size


def shard_positions(
    seq_len: int, world_size: int, rank: int, *, load_balance: bool = True, device: torch.device | str | None = None
) -> torch.Tensor:
    """Position ids held by ``rank``, (seq_len // world_size,) int64, in the order the rank stores its tokens.

    load_balance: cut into 2 * world_size chunks and take chunks ``rank`` and ``2 * world_size - 1 - rank``;
    otherwise take the rank's contiguous slice. One rank holds the whole sequence, of any length (nothing to
    balance: generic code calling this with the world size of a single process needs no even length).
    """
    seq_len = positive_int("seq_len", seq_len)
    world_size, rank, chunks = _split(world_size, rank, load_balance)
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


class PackedShard(NamedTuple):
    """What one rank holds of packed sequences under context parallelism (see ``shard_packed_positions``).

    index: (total // world_size,) int64, the rows of the packed (total_tokens, ...) tensor the rank holds, in order.
    positions: (total // world_size,) int64, each held token's position within its own sequence (RoPE's angle).
    cu_seqlens: (n + 1,) the rank's own prefix sums (``cu_seqlens // world_size``), in cu_seqlens' dtype.
    """

    index: torch.Tensor
    positions: torch.Tensor
    cu_seqlens: torch.Tensor


def shard_packed_positions(
    cu_seqlens: torch.Tensor, world_size: int, rank: int, *, load_balance: bool = True
) -> PackedShard:
    """Split every packed sequence of ``cu_seqlens`` (n + 1,) across ranks on its own, as TransformerEngine's "thd"
    format and Megatron's ``get_batch_on_this_cp_rank`` do: sequence i is cut as ``shard_positions(length_i,
    world_size, rank)`` cuts one sequence, and the rank's pieces are concatenated in sequence order.

    ``cu_seqlens`` are the padded prefix sums (TransformerEngine's ``cu_seqlens_padded``): every length divisible by
    2 * world_size (world_size without ``load_balance``). Rotate the rank's tokens by ``positions``, e.g.
    ``apply_rotary(t[None], cos, sin, positions=shard.positions, layout="bshd")[0]`` for t (total // world_size, h,
    d): ``cu_seqlens=`` would count positions from 0 in each local piece, which is not where the tokens are.
    """
    prefix_sums(cu_seqlens)
    if is_dtensor(cu_seqlens):
        raise TypeError("cu_seqlens must be a plain tensor here (every rank's whole prefix sums): pass .full_tensor()")
    world_size, rank, chunks = _split(world_size, rank, load_balance)
    lengths = sequence_lengths(cu_seqlens)
    uneven = (lengths % chunks).nonzero() if values_readable(cu_seqlens.device) else ()
    if len(uneven):
        at = int(uneven[0, 0])
        length = int(lengths[at])
        raise ValueError(
            f"sequence {at} of cu_seqlens has length {length}, which must be divisible by {chunks} "
            f"({'2 * world_size, for load-balanced chunks' if chunks != world_size else 'world_size'}); pad every "
            f"sequence to a multiple of {chunks} (TransformerEngine's cu_seqlens_padded): this one to "
            f"{length + chunks - length % chunks}"
        )
    device = cu_seqlens.device
    local = lengths // world_size  # tokens of each sequence the rank holds
    sequence = torch.repeat_interleave(torch.arange(lengths.shape[0], device=device), local)
    starts = torch.cumsum(local, 0) - local
    j = torch.arange(sequence.shape[0], device=device) - starts[sequence]  # index within the rank's piece
    size = (lengths // chunks)[sequence]  # each token's chunk size
    if chunks == world_size:
        positions = rank * size + j
    else:
        second = j >= size
        positions = torch.where(second, (chunks - 1 - rank) * size + j - size, rank * size + j)
    index = cu_seqlens.long()[:-1][sequence] + positions
    return PackedShard(index, positions, torch.div(cu_seqlens, world_size, rounding_mode="floor"))
