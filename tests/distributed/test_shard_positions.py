from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import posenc
from posenc.distributed import shard_packed_positions, shard_positions


def test_load_balanced_chunks():
    # 2 ranks, 8 tokens -> 4 chunks of 2: rank 0 takes chunks 0 and 3, rank 1 takes 1 and 2.
    assert shard_positions(8, 2, 0).tolist() == [0, 1, 6, 7]
    assert shard_positions(8, 2, 1).tolist() == [2, 3, 4, 5]
    assert shard_positions(8, 2, 1, load_balance=False).tolist() == [4, 5, 6, 7]


@settings(max_examples=40, deadline=None)
@given(world=st.integers(1, 8), per_chunk=st.integers(1, 16), balance=st.booleans())
def test_shards_partition_the_sequence_and_balance_causal_work(world, per_chunk, balance):
    seq_len = per_chunk * 2 * world
    shards = [shard_positions(seq_len, world, r, load_balance=balance) for r in range(world)]
    assert torch.equal(torch.cat(shards).sort().values, torch.arange(seq_len))
    if balance:
        # Causal work of a token at position p is p + 1 keys: every rank gets the same total.
        work = {int((s + 1).sum()) for s in shards}
        assert len(work) == 1


@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("balance", [False, True])
def test_rope_on_a_shard_equals_rows_of_the_whole(interleaved, balance):
    rope = posenc.RoPE(16, rotary_dim=12, interleaved=interleaved)
    q, k = torch.randn(2, 4, 24, 16), torch.randn(2, 2, 24, 16)
    full_q, full_k = rope(q, k)
    for rank in range(3):
        pos = shard_positions(24, 3, rank, load_balance=balance)
        shard_q, shard_k = rope(q[:, :, pos], k[:, :, pos], positions=pos, seq_len=24)
        assert torch.equal(shard_q, full_q[:, :, pos]) and torch.equal(shard_k, full_k[:, :, pos])


def test_a_packed_row_on_shards_as_the_readme_says():
    """README, "Several processes": a rank rotates by the whole row's position ids at its indices, scaled for the
    row's largest position id + 1 (not the row length, nor the shard's maximum); the chunks balance the row's causal
    work, not the documents'."""
    docs = posenc.document_ids_from_cu_seqlens(torch.tensor([0, 5, 19, 24]))  # documents of 5, 14 and 5 tokens
    positions = posenc.positions_from_document_ids(docs)
    dynamic = {"rope_type": "dynamic", "factor": 2.0}
    q, k = torch.randn(1, 2, 24, 16), torch.randn(1, 2, 24, 16)
    full_q, full_k = posenc.RoPE(16, rope_parameters=dynamic, max_position_embeddings=8)(q, k, positions=positions)
    for seq_len, same in ((int(positions.max()) + 1, True), (24, False), (None, False)):
        shards = []
        for rank in range(3):
            idx = shard_positions(24, 3, rank)
            rope = posenc.RoPE(16, rope_parameters=dynamic, max_position_embeddings=8)
            shard_q, shard_k = rope(q[:, :, idx], k[:, :, idx], positions=positions[idx], seq_len=seq_len)
            shards.append(torch.equal(shard_q, full_q[:, :, idx]) and torch.equal(shard_k, full_k[:, :, idx]))
        assert all(shards) if same else not all(shards), seq_len
    idx = [shard_positions(24, 3, rank) for rank in range(3)]
    assert [int((i + 1).sum()) for i in idx] == [100] * 3
    assert [int((positions[i] + 1).sum()) for i in idx] == [24, 51, 60]


@pytest.mark.parametrize(
    ("args", "kwargs", "match"),
    [
        ((10, 2, 0), {}, r"seq_len=10 must be divisible by 4 \(2 \* world_size.*pad the sequence to 12"),
        ((10, 4, 0), {"load_balance": False}, r"seq_len=10 must be divisible by 4 \(world_size\)"),
        ((8, 2, 2), {}, r"rank must be an int in \[0, 2\)"),
        ((8, 0, 0), {}, "world_size must be a positive integer"),
        ((0, 2, 0), {}, "seq_len must be a positive integer"),
    ],
)
def test_errors(args, kwargs, match):
    with pytest.raises(ValueError, match=match):
        shard_positions(*args, **kwargs)


def test_numpy_integers_are_taken_for_every_size() -> None:
    np = pytest.importorskip("numpy")
    want = shard_positions(8, 2, 1)
    assert torch.equal(shard_positions(np.int64(8), np.int64(2), np.int64(1)), want)


def test_shards_are_int64_in_both_layouts() -> None:
    for load_balance in (True, False):
        assert shard_positions(8, 2, 1, load_balance=load_balance).dtype == torch.int64


@pytest.mark.parametrize("balance", [True, False])
def test_one_rank_holds_a_sequence_of_any_length(balance) -> None:
    """With one rank there is nothing to balance: an odd length was refused ("must be divisible by 2"), so generic
    code calling shard_positions(L, world_size, rank) broke in single-process runs."""
    assert torch.equal(shard_positions(7, 1, 0, load_balance=balance), torch.arange(7))


@settings(max_examples=40, deadline=None)
@given(
    world=st.integers(1, 4),
    chunks_per_sequence=st.lists(st.integers(0, 4), min_size=1, max_size=5),
    balance=st.booleans(),
    dtype=st.sampled_from([torch.int32, torch.int64]),
)
def test_packed_shards_cut_every_sequence_as_shard_positions_cuts_one(world, chunks_per_sequence, balance, dtype):
    chunks = 2 * world if balance and world > 1 else world
    lengths = [n * chunks for n in chunks_per_sequence]
    cu_seqlens = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=dtype)
    whole = posenc.positions_from_document_ids(posenc.document_ids_from_cu_seqlens(cu_seqlens))
    held = []
    for rank in range(world):
        shard = shard_packed_positions(cu_seqlens, world, rank, load_balance=balance)
        want = [shard_positions(n, world, rank, load_balance=balance) for n in lengths if n]
        assert torch.equal(shard.positions, torch.cat(want) if want else torch.zeros(0, dtype=torch.int64))
        assert torch.equal(shard.positions, whole[shard.index])  # the held rows sit at those positions
        assert shard.cu_seqlens.dtype == dtype and torch.equal(shard.cu_seqlens, cu_seqlens // world)
        assert shard.positions.dtype == shard.index.dtype == torch.int64
        held.append(shard.index)
    assert torch.equal(torch.cat(held).sort().values, torch.arange(int(cu_seqlens[-1])))  # a partition


@pytest.mark.parametrize("interleaved", [False, True])
def test_rope_on_a_packed_shard_equals_rows_of_the_whole(interleaved):
    """TransformerEngine's "thd" with context parallelism: each rank rotates its rows of every packed sequence."""
    cu_seqlens = torch.tensor([0, 8, 12, 24], dtype=torch.int32)
    packed = torch.randn(24, 2, 16)
    cos, sin = posenc.RoPE(16, rotary_dim=12).cos_sin(torch.arange(24))
    whole = posenc.apply_rotary(packed, cos, sin, cu_seqlens=cu_seqlens, interleaved=interleaved)
    for rank in range(2):
        shard = shard_packed_positions(cu_seqlens, 2, rank)
        local = posenc.apply_rotary(
            packed[shard.index][None], cos, sin, positions=shard.positions, layout="bshd", interleaved=interleaved
        )[0]
        assert torch.equal(local, whole[shard.index])


@pytest.mark.parametrize(
    ("cu_seqlens", "args", "kwargs", "error", "match"),
    [
        ([0, 8, 14], (2, 0), {}, ValueError, r"sequence 1 of cu_seqlens has length 6, .*divisible by 4 .*to 8"),
        ([0, 6], (4, 0), {"load_balance": False}, ValueError, r"length 6, which must be divisible by 4 \(world_size\)"),
        ([0, 8], (2, 2), {}, ValueError, r"rank must be an int in \[0, 2\)"),
        ([0, 8], (2, True), {}, ValueError, r"rank must be an int in \[0, 2\) for world_size=2, got True"),
        ([2, 8], (2, 0), {}, ValueError, "cu_seqlens must start at 0"),
        ([0, 8, 4], (2, 0), {}, ValueError, "cu_seqlens must be non-decreasing"),
        ([[0, 8]], (2, 0), {}, ValueError, r"cu_seqlens must be 1-D \(n_seq \+ 1,\)"),
        ([0], (2, 0), {}, ValueError, r"cu_seqlens must hold n_seq \+ 1 >= 2 prefix sums .*got shape \(1,\)"),
        ([0.0, 8.0], (2, 0), {}, TypeError, "cu_seqlens must hold integer prefix sums"),
    ],
)
def test_packed_errors(cu_seqlens, args, kwargs, error, match):
    with pytest.raises(error, match=match):
        shard_packed_positions(torch.tensor(cu_seqlens), *args, **kwargs)


def test_one_rank_holds_packed_sequences_of_any_length() -> None:
    shard = shard_packed_positions(torch.tensor([0, 3, 3, 10]), 1, 0)
    assert shard.positions.tolist() == [0, 1, 2, 0, 1, 2, 3, 4, 5, 6] and shard.index.tolist() == list(range(10))


def test_packed_prefix_sums_on_the_meta_device_are_a_clear_error() -> None:
    # Neither the shard's length nor its rows can be known without the values (a bare error from repeat_interleave).
    with pytest.raises(ValueError, match="cu_seqlens is on the meta device, which holds no values"):
        shard_packed_positions(torch.tensor([0, 4, 8], device="meta"), 2, 1)
