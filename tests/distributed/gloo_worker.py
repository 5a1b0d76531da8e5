"""Run by torchrun (2 processes, gloo) from test_gloo.py; not collected by pytest (no test_ prefix).

Each rank builds RoPE from the same config, computes its shard's cos/sin and rotations, and checks with
collectives that (1) inv_freq and the cos/sin table are bitwise equal on every rank, (2) the shard's rotated rows
equal the rows of the whole-sequence rotation. Writes ok-<rank> to the output folder on success.
"""

from __future__ import annotations

import json
import os
import sys

import torch
import torch.distributed as dist

import posenc
from posenc.distributed import shard_positions


def main(out_dir: str, configs: list[dict]) -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    seq_len = 64
    for params in configs:
        rope = posenc.RoPE(16, rope_parameters=params or None, max_position_embeddings=16)
        positions = torch.arange(seq_len)
        cos, sin = rope.cos_sin(positions, seq_len=seq_len)
        inv_freq, _ = rope.frequencies(seq_len)
        for mine in (cos, sin, inv_freq):
            gathered = [torch.empty_like(mine) for _ in range(world)]
            dist.all_gather(gathered, mine.contiguous())
            assert all(torch.equal(g, gathered[0]) for g in gathered), f"ranks differ for {params}"

        gen = torch.Generator().manual_seed(0)  # same q, k on every rank: the whole sequence
        q, k = torch.randn(1, 2, seq_len, 16, generator=gen), torch.randn(1, 2, seq_len, 16, generator=gen)
        full_q, full_k = rope(q, k, seq_len=seq_len)
        pos = shard_positions(seq_len, world, rank)
        shard_q, shard_k = rope(q[:, :, pos], k[:, :, pos], positions=pos, seq_len=seq_len)
        assert torch.equal(shard_q, full_q[:, :, pos]) and torch.equal(shard_k, full_k[:, :, pos]), params
    dist.barrier()
    dist.destroy_process_group()
    with open(os.path.join(out_dir, f"ok-{rank}"), "w") as f:
        f.write("ok")


if __name__ == "__main__":
    main(sys.argv[1], json.loads(sys.argv[2]))
