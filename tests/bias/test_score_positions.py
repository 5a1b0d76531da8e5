"""ALiBi and T5 take positions alike: (s,) is one sequence shared by the batch, (b, s) one row per sequence;
anything else is a clear error, the same for both."""

from __future__ import annotations

import pytest
import torch

import posenc

BIASES = {"alibi": lambda: posenc.ALiBi(4), "t5": lambda: posenc.T5Bias(4, num_buckets=8, max_distance=16)}


@pytest.mark.parametrize("name", list(BIASES))
def test_one_dimensional_positions_are_a_batch_of_one(name):
    encoding = BIASES[name]()
    q, k = torch.arange(2, 5), torch.arange(5)
    with torch.no_grad():
        flat = encoding.score_bias(q, k)  # T5 raised a raw IndexError here
        rows = encoding.score_bias(q[None], k[None])
        mixed = encoding.score_bias(q, torch.stack((k, k + 3)))
    assert flat.shape == (1, 4, 3, 5) and torch.equal(flat, rows)
    assert mixed.shape == (2, 4, 3, 5) and torch.equal(mixed[:1], flat)
    # Either side may be the shared one: a batch of queries against one row of keys (a prefix) broadcasts too.
    with torch.no_grad():
        queries = encoding.score_bias(torch.stack((q, q + 1)), k)
    assert queries.shape == (2, 4, 3, 5) and torch.equal(queries[:1], flat)


@pytest.mark.parametrize("name", list(BIASES))
@pytest.mark.parametrize(
    ("q", "k", "error", "message"),
    [
        # ALiBi silently accepted float positions.
        (torch.arange(3.0), torch.arange(5), TypeError, "q_positions must hold integer positions"),
        (torch.arange(3), torch.arange(5.0), TypeError, "k_positions must hold integer positions"),
        ([0, 1, 2], torch.arange(5), TypeError, "q_positions must be an integer torch.Tensor"),
        (torch.zeros(1, 1, 3, dtype=torch.long), torch.arange(5), ValueError, r"q_positions must have shape \(n,\)"),
        (torch.zeros(2, 3, dtype=torch.long), torch.zeros(3, 5, dtype=torch.long), ValueError, "batch 2 but"),
    ],
)
def test_bad_positions_are_the_same_clear_error_for_both(name, q, k, error, message):
    with pytest.raises(error, match=message):
        BIASES[name]().score_bias(q, k)


@pytest.mark.parametrize("name", list(BIASES))
@pytest.mark.parametrize("dtype", [torch.uint8, torch.int8, torch.int16, torch.int32])
def test_narrow_integer_positions_do_not_wrap(name, dtype):
    """Distances are taken in int64: uint8 0 - 5 is 251, int8 100 - (-100) and int16 30000 - (-30000) overflow."""
    enc = BIASES[name]()
    q, k = torch.tensor([5, 100]), torch.tensor([0, 3, 5, 7, 100])
    torch.testing.assert_close(enc.score_bias(q.to(dtype), k.to(dtype)), enc.score_bias(q, k))
    if dtype is not torch.uint8:
        far = torch.iinfo(dtype).max - 7  # 120, 32760, about 2.1e9: twice that wraps in the dtype itself
        q, k = torch.tensor([far]), torch.tensor([-far, 0])
        torch.testing.assert_close(enc.score_bias(q.to(dtype), k.to(dtype)), enc.score_bias(q, k))


@pytest.mark.parametrize("name", list(BIASES))
def test_positions_move_to_the_encoding_like_ropes_do(name):
    # Positions are index tensors: RoPE and the learned table move them to the activations' device, and the biases
    # refused them ("q_positions is on cpu but ... on meta") until 2026-12-05. Meta stands in for a second device.
    encoding = BIASES[name]().to("meta")
    q, k = torch.arange(2, 5), torch.arange(5)
    for pair in ((q, k), (q, k.to("meta")), (q.to("meta"), k)):
        bias = encoding.score_bias(*pair)
        assert bias.device.type == "meta" and bias.shape == (1, 4, 3, 5)
    assert encoding.bias(3, 5, offset=2).device.type == "meta"


@pytest.mark.parametrize("name", list(BIASES))
def test_bias_takes_queries_up_to_the_int64_limit(name):
    """The last query at 2**63 - 1 passed the offset's check, then arange(offset, offset + q_len) failed inside torch
    ("value cannot be converted to type int64_t without overflow"): its end is one past the last query."""
    last = 2**63 - 1
    for enc in (BIASES[name](), *([posenc.ALiBi(4, causal=True)] if name == "alibi" else [])):
        want = enc.score_bias(torch.tensor([last - 1, last]), torch.arange(3))[0]
        assert torch.equal(enc.bias(2, 3, offset=last - 1), want)  # every key before the queries: nothing masked
        assert torch.equal(enc.bias(1, 3, offset=last), want[:, 1:])
        with pytest.raises(ValueError, match="must fit in int64"):
            enc.bias(2, 3, offset=last)
