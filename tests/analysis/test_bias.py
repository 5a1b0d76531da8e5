"""bias_matrix: the additive bias of ALiBi and T5 as a matrix, from the modules' own score_bias."""

from __future__ import annotations

import pytest
import torch

import posenc
from posenc.analysis import bias_matrix


def test_alibi_by_hand():
    # 2 heads: slopes 2^-4, 2^-8; queries are the last 3 of 5 keys (positions 2, 3, 4).
    bias = bias_matrix(posenc.ALiBi(2), 3, 5)
    assert bias.shape == (2, 3, 5) and bias.dtype == torch.float64
    for h, slope in enumerate((2.0**-4, 2.0**-8)):
        for i, m in enumerate((2, 3, 4)):
            for n in range(5):
                expected = -slope * (m - n) if n <= m else float("-inf")
                assert bias[h, i, n].item() == expected


def test_t5_is_its_table_at_the_buckets():
    t5 = posenc.T5Bias(3, num_buckets=8, max_distance=16)
    bias = bias_matrix(t5, 20)
    buckets = posenc.t5_relative_bucket(
        torch.arange(20)[None, :] - torch.arange(20)[:, None], bidirectional=False, num_buckets=8, max_distance=16
    )
    expected = t5.table.weight.detach().double()[buckets].permute(2, 0, 1)
    assert torch.equal(bias, expected)


def test_bad_input_is_a_clear_error():
    with pytest.raises(TypeError, match=r"needs a score-bias encoding.*acts on queries_and_keys"):
        bias_matrix(posenc.RoPE(8), 4)
    with pytest.raises(TypeError, match="got str"):
        bias_matrix("alibi", 4)
    with pytest.raises(ValueError, match="q_len=5 must be <= k_len=4"):
        bias_matrix(posenc.ALiBi(2), 5, 4)
    with pytest.raises(ValueError, match="q_len must be a positive integer"):
        bias_matrix(posenc.ALiBi(2), 0)
