"""torch.export with dynamic shapes, then the ExportedProgram run at other sizes, as deployments do.

Posenc's own code must not narrow a user's ``Dim``: a size read in a way that guards makes export refuse the range
("Constraints violated ... satisfy the generated guard 3 <= s") or specialize it. Compared with eager at the sizes
that a narrowing excluded (seq 1 and 2, a single packed sequence) and past the example's.
"""

from __future__ import annotations

import pytest
import torch
from torch.export import Dim

import posenc

HEAD_DIM = 16


class _DocumentAttention(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.attention = posenc.CausalSelfAttention(4 * HEAD_DIM, 4, encoding=posenc.RoPE(HEAD_DIM, backend="torch"))

    def forward(self, x, document_ids):
        return self.attention(x, document_ids=document_ids)


def test_attention_with_document_ids_exports_for_every_length_from_one():
    """Document ids were compared as slices ids[:, 1:] and ids[:, :-1], whose (b, s - 1) metadata torch guarded away
    from 1: a Dim from 1 (a decode step) was refused with "satisfy the generated guard 3 <= s"."""
    torch.manual_seed(0)
    model = _DocumentAttention().eval()
    batch, seq = Dim("b", min=1, max=64), Dim("s", min=1, max=4096)
    example = (torch.randn(2, 8, 4 * HEAD_DIM), torch.tensor([[0] * 4 + [1] * 4] * 2))
    shapes = ({0: batch, 1: seq}, {0: batch, 1: seq})
    program = torch.export.export(model, example, dynamic_shapes=shapes).module()
    for ids in ([[0]], [[0, 1], [3, 3]], [[0] * 20 + [1] * 30] * 3):
        ids = torch.tensor(ids)
        x = torch.randn(ids.shape[0], ids.shape[1], 4 * HEAD_DIM)
        torch.testing.assert_close(program(x, ids), model(x, ids), rtol=1e-6, atol=1e-6)
    with pytest.raises(RuntimeError, match="document_ids must give each document one run"):
        program(torch.randn(1, 3, 4 * HEAD_DIM), torch.tensor([[0, 1, 0]]))  # refused, as eager refuses it


def test_positions_from_document_ids_unchanged_at_the_edges():
    for ids, want in (([], []), ([5], [0]), ([2, 2], [0, 1]), ([0, 1, 1, 0], [0, 0, 1, 0])):
        got = posenc.positions_from_document_ids(torch.tensor(ids, dtype=torch.long))
        assert got.tolist() == want
    assert posenc.document_ids_from_positions(torch.tensor([0, 1, 0, 5, 6])).tolist() == [0, 0, 1, 2, 2]


class _Varlen(torch.nn.Module):
    def __init__(self):
        super().__init__()
        cos, sin = posenc.RoPE(HEAD_DIM).cos_sin(torch.arange(512))
        self.register_buffer("cos", cos)
        self.register_buffer("sin", sin)

    def forward(self, x, cu_seqlens):
        return posenc.apply_rotary(x, self.cos, self.sin, cu_seqlens=cu_seqlens, backend="torch")


def test_apply_rotary_with_cu_seqlens_exports_for_a_single_sequence():
    """cu_seqlens was read as slices cu[1:] (searchsorted, and the non-decreasing check), whose (n_seq,) metadata
    torch guarded away from 1: a Dim allowing one packed sequence (n_seq + 1 = 2) was refused with "3 <= n"."""
    torch.manual_seed(0)
    model = _Varlen()
    tokens, boundaries = Dim("t", min=1, max=4096), Dim("n", min=2, max=64)
    example = (torch.randn(10, 2, HEAD_DIM), torch.tensor([0, 3, 10]))
    program = torch.export.export(model, example, dynamic_shapes=({0: tokens}, {0: boundaries})).module()
    for cu in ([0, 1], [0, 7], [0, 50, 50, 51, 200]):
        cu = torch.tensor(cu)
        x = torch.randn(int(cu[-1]), 2, HEAD_DIM)
        torch.testing.assert_close(program(x, cu), model(x, cu), rtol=2.5e-7, atol=2e-7)  # a float32 ulp or two
    with pytest.raises(RuntimeError, match="cu_seqlens must start at 0, end at total_tokens and be non-decreasing"):
        program(torch.randn(9, 2, HEAD_DIM), torch.tensor([0, 6, 3, 9]))
