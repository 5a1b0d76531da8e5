"""Shape checks under torch.compile when one size is symbolic and the size it is checked against is a plain int.

torch.compile evaluated ``2 in (1, s0)`` as False with s0 = 2 (torch 2.13), so every check written as
``size not in (1, batch)`` refused a right shape, with a message that contradicts itself ("positions must have shape
(4,) or (2, 4) ..., got (2, 4)"). Such calls arise after a recompilation has made x's batch dynamic while
positions, offsets or document ids stay static; ``torch._dynamo.maybe_mark_dynamic`` makes it happen at once.
"""

from __future__ import annotations

import pytest
import torch

import posenc
from posenc.bias.base import score_positions


def _table(half: int = 4, rows: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    angles = torch.arange(rows, dtype=torch.float64)[:, None] / (10000.0 ** (torch.arange(half) / half))
    return angles.cos().float(), angles.sin().float()


def _apply_positions(x):
    cos, sin = _table()
    return posenc.apply_rotary(x, cos, sin, positions=torch.tensor([[0, 1, 2, 3], [5, 6, 7, 8]]))


def _apply_offsets(x):
    cos, sin = _table()
    return posenc.apply_rotary(x, cos, sin, offset=torch.tensor([0, 5]))


def _apply_broadcast(x):
    cos, sin = _table()
    per_sequence = torch.stack([cos[:4], cos[5:9]])[:, None]  # (2, 1, s, r/2): one table row per sequence
    return posenc.apply_rotary(x, per_sequence, torch.stack([sin[:4], sin[5:9]])[:, None])


ROPE = posenc.RoPE(10, rotary_dim=8, backend="torch")
MROPE = posenc.MRoPE(10, rotary_dim=8, mrope_section=[2, 1, 1])


def _rope_offsets(x):
    return torch.cat(ROPE(x, x, offset=torch.tensor([0, 5])))


def _mrope_positions(x):
    return torch.cat(MROPE(x, x, positions=torch.arange(8).view(1, 2, 4).expand(3, 2, 4)))


def _score_positions(x):
    q, k = score_positions(
        torch.tensor([[0, 1, 2, 3], [5, 6, 7, 8]]), torch.arange(4) + x.shape[0], device=x.device, what="x"
    )
    return x + (q.sum() + k.sum())


torch.manual_seed(0)
LAYER = posenc.CausalSelfAttention(40, 4, encoding=ROPE)


def _attention(kwargs):
    def call(x):
        return LAYER(x.transpose(1, 2).reshape(x.shape[0], 4, 40), **kwargs)

    return call


CALLS = {
    "apply_rotary positions": _apply_positions,
    "apply_rotary offset tensor": _apply_offsets,
    "apply_rotary broadcast cos": _apply_broadcast,
    "RoPE offset tensor": _rope_offsets,
    "MRoPE three-axis positions": _mrope_positions,
    "score positions": _score_positions,
    "CausalSelfAttention positions": _attention({"positions": torch.tensor([[0, 1, 2, 3], [5, 6, 7, 8]])}),
    "CausalSelfAttention document_ids": _attention({"document_ids": torch.tensor([[0, 0, 1, 1], [0, 1, 1, 1]])}),
}


@pytest.mark.parametrize("name", list(CALLS))
def test_a_dynamic_batch_accepts_a_static_size_equal_to_it(name):
    call = CALLS[name]
    x = torch.randn(2, 4, 4, 10)  # (b, h, s, d); the other tensors have b = 2 and s = 4, static
    expected = call(x)
    torch._dynamo.reset()
    marked = x.clone()
    torch._dynamo.maybe_mark_dynamic(marked, 0)
    got = torch.compile(call, fullgraph=True, backend="aot_eager")(marked)
    torch.testing.assert_close(got, expected)


def test_a_bad_shape_is_refused_with_posencs_message_when_sizes_are_symbolic():
    """The message was built by adding two strings, one holding symbolic sizes, which Dynamo cannot do: fullgraph
    reported 'missing sq_concat' instead of the ValueError."""
    cos, sin = _table()
    bad = torch.zeros(3, 4, dtype=torch.long)  # three rows of positions for a batch of 2
    torch._dynamo.reset()
    torch._dynamo.maybe_mark_dynamic(bad, 0)
    call = torch.compile(
        lambda x, p: posenc.apply_rotary(x, cos, sin, positions=p), fullgraph=True, backend="aot_eager"
    )
    with pytest.raises(Exception, match=r"positions must have shape \(4,\) or \(2, 4\)"):
        call(torch.randn(2, 2, 4, 10), bad)
