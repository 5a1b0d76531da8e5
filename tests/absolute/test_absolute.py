from __future__ import annotations

import pytest
import torch

import posenc
from posenc.testing import assert_close, sinusoidal_reference


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("dim", "base"), [(2, 10000.0), (64, 10000.0), (30, 500.0)])
def test_sinusoidal_matches_reference(dtype, dim, base):
    positions = torch.tensor([0, 1, 7, 217, 4095, 2**20 - 1])
    out = posenc.Sinusoidal(dim, base=base)(positions, dtype=dtype)
    assert out.shape == (6, dim) and out.dtype == dtype
    assert_close(out, sinusoidal_reference(positions, dim, base=base))


def test_sinusoidal_any_position_and_batched_shape():
    enc = posenc.Sinusoidal(8)
    out = enc(torch.arange(12).view(3, 4) + 10**7)
    assert out.shape == (3, 4, 8)
    assert_close(out[0, 0], sinusoidal_reference(torch.tensor([10**7]), 8)[0])


def test_sinusoidal_keeps_positions_past_float32s_integers():
    # 2**24 + 1 is the first integer float32 cannot hold: read through float32 it would be encoded as 2**24,
    # whose fastest channel sin(p) differs by ~1.
    positions = torch.tensor([2**24 + 1, 2**31 + 3])
    assert_close(posenc.Sinusoidal(8)(positions), sinusoidal_reference(positions, 8))


def test_learned_table_lookup_and_bounds():
    enc = posenc.LearnedAbsolute(16, 8)
    positions = torch.tensor([[0, 5, 15]])
    torch.testing.assert_close(enc(positions), enc.table.weight[positions])
    with pytest.raises(ValueError, match=r"position 16 is outside the learned table of max_positions=16"):
        enc(torch.tensor([3, 16]))
    # A negative position is not a reason to build a larger table (the message said so).
    with pytest.raises(ValueError, match=r"positions must be >= 0 \(row indices of the learned table\), got -1"):
        enc(torch.tensor([-1, 16]))


def test_a_learned_table_gives_the_dtype_asked_for():
    """forward(dtype=) casts the rows: add_input_encoding asks for x's dtype (float32 at least), so a float32 table
    added to float64 activations keeps their float64 bits (rows in float32 would round x to float32 first)."""
    enc = posenc.LearnedAbsolute(8, 4)
    rows = enc.table.weight.detach()[:3].double()
    out = enc(torch.arange(3), dtype=torch.float64)
    assert out.dtype == torch.float64 and torch.equal(out, rows)
    x = torch.randn(1, 3, 4, dtype=torch.float64)
    assert torch.equal(posenc.add_input_encoding(x, enc, torch.arange(3)), x + rows)


def test_sinusoidal_refuses_negative_positions():
    enc = posenc.Sinusoidal(8)
    with pytest.raises(ValueError, match=r"positions must be >= 0 \(token positions count from 0\), got -5"):
        enc(torch.tensor([3, -5, 2]))
    assert enc(torch.zeros(0, dtype=torch.long)).shape == (0, 8)
    # The pure table function stays defined for any integer: sin is odd, cos even.
    table = posenc.sinusoidal_table(torch.tensor([-5, 5]), 8)
    torch.testing.assert_close(table[0, 0::2], -table[1, 0::2])
    torch.testing.assert_close(table[0, 1::2], table[1, 1::2])


def test_sinusoidal_table_reads_a_one_element_tensor_base_as_its_number():
    """base_value takes a one-element tensor (as Sinusoidal's base); sinusoidal_table checked it, then computed with
    the tensor: a (1, 1) base gave a (1, s, dim) table, and one that requires grad a table that required grad."""
    positions = torch.arange(5)
    want = posenc.sinusoidal_table(positions, 8, base=500.0)
    for base in (torch.tensor([[500.0]]), torch.tensor(500.0, requires_grad=True)):
        table = posenc.sinusoidal_table(positions, 8, base=base)
        assert table.shape == want.shape and not table.requires_grad
        torch.testing.assert_close(table, want, rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [torch.int8, torch.int16, torch.uint8, torch.int32])
def test_narrow_integer_positions_are_row_ids(dtype):
    """Every integer dtype the shared check accepts is looked up like int64 (embedding takes only int32/int64)."""
    learned, sinusoidal = posenc.LearnedAbsolute(16, 8), posenc.Sinusoidal(8)
    ids = torch.tensor([[0, 5, 15]])
    torch.testing.assert_close(learned(ids.to(dtype)), learned(ids))
    torch.testing.assert_close(sinusoidal(ids.to(dtype)), sinusoidal(ids))


@pytest.mark.parametrize(
    ("make", "past_the_end"),
    [(lambda: posenc.LearnedAbsolute(16, 8), "rows of the learned table, 0..15"), (lambda: posenc.Sinusoidal(8), None)],
)
@pytest.mark.parametrize("dynamic", [False, True])
def test_input_encodings_compile_with_fullgraph_and_run_on_meta(make, past_the_end, dynamic):
    """No host read of the positions while compiling: the range checks run in the graph instead."""
    enc = make()
    compiled = torch.compile(enc, fullgraph=True, dynamic=dynamic, backend="aot_eager")
    torch.testing.assert_close(compiled(torch.arange(5)), enc(torch.arange(5)))
    with pytest.raises(RuntimeError, match="count from 0" if past_the_end is None else "rows of the learned table"):
        compiled(torch.arange(5) - 1)
    if past_the_end is not None:
        with pytest.raises(RuntimeError, match=past_the_end):
            compiled(torch.arange(5) + 14)
    x = torch.randn(2, 5, 8)
    added = torch.compile(lambda x, p: posenc.add_input_encoding(x, enc, p), fullgraph=True, backend="aot_eager")
    torch.testing.assert_close(added(x, torch.arange(5)), x + enc(torch.arange(5)))
    # Shape inference on meta reads no values.
    assert enc.to("meta")(torch.arange(5, device="meta")).shape == (5, 8)


def test_a_learned_table_on_meta_checks_host_ids_it_is_given():
    """Shape inference with a table built on the meta device: CPU ids past the table were moved to meta, where no
    value is read, and the lookup came back with their shape instead of the error (the README: never a clamp)."""
    with torch.device("meta"):
        table = posenc.LearnedAbsolute(8, 4)
    assert table(torch.arange(8, dtype=torch.int8)).shape == (8, 4)
    with pytest.raises(ValueError, match="position 8 is outside the learned table of max_positions=8 rows"):
        table(torch.arange(9))
    assert table(torch.arange(9, device="meta")).shape == (9, 4)  # meta ids have no values to check


def test_a_learned_table_overrun_under_inductor_says_posencs_message():
    """Inductor checks an embedding lookup's bounds itself; in a training step its check fired before posenc's
    assert, with 'index out of bounds: tmp6 < 16L' instead of the message the README promises."""
    torch.manual_seed(0)
    table, attention = posenc.LearnedAbsolute(16, 32), posenc.CausalSelfAttention(32, 4)
    embedding, head = torch.nn.Embedding(50, 32), torch.nn.Linear(32, 50)

    def step(tokens):
        x = posenc.add_input_encoding(embedding(tokens), table, torch.arange(tokens.shape[1]))
        head(x + attention(x)).square().mean().backward()

    compiled = torch.compile(step, dynamic=True)
    for length in (10, 13):
        compiled(torch.randint(0, 50, (2, length)))
    with pytest.raises(RuntimeError, match=r"positions must be rows of the learned table, 0..15"):
        compiled(torch.randint(0, 50, (2, 17)))
