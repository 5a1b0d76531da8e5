"""Batch invariance of the rotation: a sequence's bits do not depend on what else is rotated with it.

Inference engines batch requests, and RL training compares a sequence's log-probabilities computed in one batch
with those computed in another, so a rotation must give a row the same bits alone, inside a batch of other rows,
in either layout, as a strided view, packed with cu_seqlens, by position ids or by an offset, and under any thread
count. The rotation is elementwise, so this holds within each backend; between backends the roundings differ (the
fused kernels use fused multiply-adds, README "Precision").
"""

from __future__ import annotations

import os

import pytest
import torch

import posenc
from posenc.testing import torch_threads

TRITON_DEVICE = "cuda" if os.environ.get("POSENC_TRITON_NATIVE") == "1" else "cpu"
DEVICE = {"cpu": "cpu", "torch": "cpu", "triton": TRITON_DEVICE}
HEADS, SEQ, HEAD_DIM, ROTARY_DIM, OFFSET = 2, 5, 12, 8, 7


def rotations(backend: str, dtype: torch.dtype, interleaved: bool):
    """The one sequence rotated alone at positions OFFSET.., and every other way of handing it to the backend among
    other sequences: (name, rotated copy of that sequence as (1, h, s, d))."""
    device = DEVICE[backend]
    gen = torch.Generator().manual_seed(0)
    wide = torch.float64 if dtype == torch.float64 else torch.float32
    rope = posenc.RoPE(HEAD_DIM, rotary_dim=ROTARY_DIM)
    cos, sin = (t.to(device) for t in rope.cos_sin(torch.arange(64), dtype=wide))
    kw = {"interleaved": interleaved, "backend": backend}
    x0 = torch.randn(1, HEADS, SEQ, HEAD_DIM, generator=gen).to(device, dtype)
    alone = posenc.apply_rotary(x0, cos, sin, offset=OFFSET, **kw)
    batch = 3  # the sequence is row 1 of the batch
    xs = torch.randn(batch, HEADS, SEQ, HEAD_DIM, generator=gen).to(device, dtype)
    xs[1] = x0[0]
    ids = torch.arange(SEQ).expand(batch, SEQ).to(device) + OFFSET
    offsets = torch.tensor([30, OFFSET, 2], device=device)
    bshd = xs.transpose(1, 2).contiguous()
    others = [
        ("batch", posenc.apply_rotary(xs, cos, sin, offset=OFFSET, **kw)[1:2]),
        ("broadcast cos", posenc.apply_rotary(xs, cos[OFFSET : OFFSET + SEQ], sin[OFFSET : OFFSET + SEQ], **kw)[1:2]),
        ("position ids", posenc.apply_rotary(xs, cos, sin, positions=ids, **kw)[1:2]),
        ("per-sequence offsets", posenc.apply_rotary(xs, cos, sin, offset=offsets, **kw)[1:2]),
        ("bshd", posenc.apply_rotary(bshd, cos, sin, offset=OFFSET, layout="bshd", **kw)[1:2].transpose(1, 2)),
        ("strided view", posenc.apply_rotary(bshd.transpose(1, 2), cos, sin, offset=OFFSET, **kw)[1:2]),
    ]
    in_place = xs.clone()
    posenc.apply_rotary_(in_place, cos, sin, offset=OFFSET, **kw)
    others.append(("in place", in_place[1:2]))
    k = torch.randn(batch, 1, SEQ, HEAD_DIM, generator=gen).to(device, dtype)
    others.append(("with k (GQA)", posenc.apply_rotary_qk(xs, k, cos, sin, offset=OFFSET, **kw)[0][1:2]))
    lengths = [3, SEQ, 9]
    cu_seqlens = torch.tensor([0, 3, 3 + SEQ, 3 + SEQ + 9], device=device)
    packed = torch.randn(sum(lengths), HEADS, HEAD_DIM, generator=gen).to(device, dtype)
    packed[3 : 3 + SEQ] = x0[0].transpose(0, 1)
    varlen = posenc.apply_rotary(packed, cos, sin, cu_seqlens=cu_seqlens, offset=OFFSET, **kw)
    others.append(("varlen", varlen[3 : 3 + SEQ].transpose(0, 1)[None]))
    return alone, others


@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("backend", ["torch", "cpu", "triton"])
def test_a_sequence_rotates_to_the_same_bits_alone_and_among_others(backend, dtype, interleaved):
    alone, others = rotations(backend, dtype, interleaved)
    for name, got in others:
        assert torch.equal(got, alone), name


@pytest.mark.parametrize("backend", ["torch", "cpu"])
def test_the_thread_count_changes_no_bit_of_a_rotation(backend):
    """Past the CPU kernel's and torch's grain (32768 elements a thread) the work is split between threads: a
    row's bits stay the same, at any batch size."""
    gen = torch.Generator().manual_seed(0)
    rope = posenc.RoPE(40, rotary_dim=32, backend=backend)
    q, k = torch.randn(3, 4, 700, 40, generator=gen), torch.randn(3, 1, 700, 40, generator=gen)
    rows = []  # (q, k) of row 1, rotated in the batch and alone, at each thread count
    for threads in (1, 2, 3):
        with torch_threads(threads):
            rows.append(tuple(t[1:2] for t in rope(q, k, offset=5)))
            rows.append(rope(q[1:2], k[1:2], offset=5))
    for got in rows[1:]:
        assert torch.equal(got[0], rows[0][0]) and torch.equal(got[1], rows[0][1])


@pytest.mark.parametrize("position", [20, 65_530, 65_546, 200_000])
def test_a_position_rotates_alike_whatever_table_or_window_serves_it(position):
    """The row of a position is the same whether a short or a long table holds it, or a window past the table, or
    angles computed for the call (per-sequence offsets that span more than a window)."""
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(1, 1, 1, 8, generator=gen)
    alone, _ = posenc.RoPE(8)(q, q, offset=position)
    rope = posenc.RoPE(8)
    rope(q, q, offset=100_000 if position < 65_536 else 3)  # another table (or window) first
    batch = torch.randn(2, 1, 40, 8, generator=gen)
    batch[1, 0, 17] = q[0, 0, 0]
    for how in (
        {"offset": position - 17},
        {"positions": torch.arange(position - 17, position + 23)},
        {"offset": torch.tensor([0, position - 17])},
    ):
        got, _ = rope(batch, batch, **how)
        assert torch.equal(got[1, 0, 17], alone[0, 0, 0]), how
