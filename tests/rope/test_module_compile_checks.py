"""RoPE's checks under torch.compile(fullgraph=True), where no value may be read on the host, and seq_len's check."""

from __future__ import annotations

import contextlib
import copy
import functools
import gc
import threading
import weakref
from typing import Any

import pytest
import torch

import posenc
from posenc import _checks
from posenc.rope.frequencies import SCALINGS, SEQ_LEN_DEPENDENT
from posenc.testing import random_qk

HEAD_DIM, MAX_POS = 16, 32
PARAMS: dict[str, dict[str, Any]] = {
    "default": {"rope_type": "default"},
    "linear": {"rope_type": "linear", "factor": 2.0},
    "ntk": {"rope_type": "ntk", "factor": 2.0},
    "dynamic": {"rope_type": "dynamic", "factor": 2.0},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": MAX_POS},
    "longrope": {
        "rope_type": "longrope",
        "short_factor": [1.0 + 0.05 * i for i in range(HEAD_DIM // 2)],
        "long_factor": [1.0 + 0.9 * i for i in range(HEAD_DIM // 2)],
        "original_max_position_embeddings": MAX_POS,
    },
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0},
    "proportional": {"rope_type": "proportional", "partial_rotary_factor": 0.5},
}
# Past MAX_POS, so that dynamic and longrope scale: a seq_len dropped on the way would change the values.
SEQ_LEN = 200
# What failed was Dynamo's trace, which every backend shares; Inductor's code generation costs seconds per graph on
# the CPU, so it compiles only the test that reproduces the report (and the tests of its generated code), and Dynamo's
# eager backend the rest, which check what Dynamo traces (fullgraph, graph breaks, recompiles, guards) and run its
# graph as traced (asserts included), without AOTAutograd's second trace.
compile_traced = functools.partial(torch.compile, fullgraph=True, backend="eager")


@pytest.fixture(autouse=True)
def fresh_dynamo():
    """Each test's lambdas share code objects across parameters: without a reset their graphs pile up to Dynamo's
    recompile limit, past which it would quietly run eager code instead (made an error here)."""
    torch._dynamo.reset()
    with torch._dynamo.config.patch(fail_on_recompile_limit_hit=True):
        yield
    torch._dynamo.reset()


def make_rope(rope_type: str, mode: str = "hf") -> posenc.RoPE:
    return posenc.RoPE(HEAD_DIM, rope_parameters=PARAMS[rope_type], max_position_embeddings=MAX_POS, mode=mode)


def test_every_scaling_type_is_covered():
    assert set(PARAMS) == set(SCALINGS)


def test_dynamic_rope_with_seq_len_compiles_with_inductor():
    """The report: fullgraph=True failed with 'Could not guard on data-dependent expression u0 < 0' although
    seq_len= was given."""
    rope = make_rope("dynamic")
    q = torch.randn(1, 2, 5, HEAD_DIM)
    compiled = torch.compile(lambda q, p: rope(q, q, positions=p, seq_len=SEQ_LEN), fullgraph=True)
    positions = torch.arange(5) + 100
    for got, want in zip(compiled(q, positions), rope(q, q, positions=positions, seq_len=SEQ_LEN), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    with pytest.raises(RuntimeError, match="must be >= 0"):
        compiled(q, positions - 200)


@pytest.mark.parametrize("mode", ["hf", "consistent"])
@pytest.mark.parametrize("rope_type", sorted(SEQ_LEN_DEPENDENT))
def test_length_dependent_rope_compiles_with_seq_len(rope_type, mode):
    """dynamic and longrope with seq_len= under fullgraph=True: the negativity check read min(positions) on the host
    (a data-dependent guard that Dynamo refused, even though seq_len left nothing to derive from the positions)."""
    rope = make_rope(rope_type, mode)
    q, k = random_qk(2, 2, 1, 5, HEAD_DIM)
    ids = torch.tensor([[100, 101, 102, 103, 104], [0, 3, 1, 4, 1]])
    offsets = torch.tensor([3, 90])
    # One graph per argument structure; an int offset is a constant of its graph.
    compiled = compile_traced(lambda q, k, kw: rope(q, k, seq_len=SEQ_LEN, **kw))
    for kwargs in ({"offset": 150}, {"offset": offsets}, {"positions": ids, "offset": offsets}):
        want = rope(q, k, seq_len=SEQ_LEN, **kwargs)
        for got, expected in zip(compiled(q, k, kwargs), want, strict=True):
            torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-6)
    assert rope.hf_scaled_len == MAX_POS  # a given seq_len leaves 'hf' dynamic's state alone, compiled or not
    # Negative positions still refused: eagerly on the host, compiled by the assert that runs with the graph.
    for kwargs in ({"offset": torch.tensor([3, -95])}, {"positions": ids - 110, "offset": offsets}):
        with pytest.raises(ValueError, match="must be >= 0"):
            rope(q, k, seq_len=SEQ_LEN, **kwargs)
        with pytest.raises(RuntimeError, match="must be >= 0"):
            compiled(q, k, kwargs)


@pytest.mark.parametrize("rope_type", ["default", "linear", "yarn", "llama3", "dynamic", "longrope"])
def test_cos_sin_under_compile_matches_eager_and_refuses_negative_positions(rope_type):
    """cos_sin called directly (as rotate() does for cached keys) gets no check from resolve_positions: compiled, it
    rotated by negative positions for the types with a fixed table, where eager raises."""
    rope = make_rope(rope_type)
    compiled = compile_traced(lambda p: rope.cos_sin(p, seq_len=SEQ_LEN))
    positions = torch.tensor([[0, 7, 150, 3]])
    for got, want in zip(compiled(positions), rope.cos_sin(positions, seq_len=SEQ_LEN), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    with pytest.raises(ValueError, match=r"positions must be >= 0"):
        rope.cos_sin(positions - 5, seq_len=SEQ_LEN)
    with pytest.raises(RuntimeError, match=r"positions must be >= 0"):
        compiled(positions - 5)


@pytest.mark.parametrize("rope_type", ["linear", "llama3"])
def test_fixed_frequency_types_compile_with_position_tensors(rope_type):
    rope = make_rope(rope_type)
    q, k = random_qk(2, 2, 1, 5, HEAD_DIM)
    ids, offsets = torch.tensor([[3, 1, 4, 1, 5], [0, 1, 2, 3, 0]]), torch.tensor([5, 70])
    compiled = compile_traced(lambda q, k, p, o: rope(q, k, positions=p, offset=o))
    for got, want in zip(compiled(q, k, ids, offsets), rope(q, k, positions=ids, offset=offsets), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("mode", ["hf", "consistent"])
def test_a_length_that_cannot_be_read_is_asked_for(mode):
    """Without seq_len, dynamic scales for max(positions) + 1, a value that compiled code cannot read: the error
    says to pass seq_len= (it was Dynamo's 'Could not guard on data-dependent expression'). 'consistent' mode's
    forward, which keeps no state, reads it in an op of the graph (posenc::dynamic_inv_freq): no break, eager's
    numbers, within and past the trained length."""
    rope = make_rope("dynamic", mode)
    q, k = random_qk(1, 2, 1, 5, HEAD_DIM)
    forward = compile_traced(lambda q, k, p: rope(q, k, positions=p))
    if mode == "hf":
        # Dynamo reports an exception raised while tracing as unsupported, with the exception's message in its text.
        with pytest.raises(Exception, match=r"pass seq_len="):
            forward(q, k, torch.arange(5) + 100)
    else:
        for start in (0, 100):
            positions = torch.arange(5) + start
            for got, want in zip(forward(q, k, positions), rope(q, k, positions=positions), strict=True):
                torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    # cos_sin and rotate read no state in either mode: the graph reads the length itself.
    for start in (0, 100):
        positions = torch.arange(5) + start
        for got, want in zip(
            compile_traced(lambda p: rope.cos_sin(p))(positions), rope.cos_sin(positions), strict=True
        ):
            torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(
            compile_traced(lambda q, p: rope.rotate(q, p))(q, positions[None]),
            rope.rotate(q, positions[None]),
            rtol=1e-6,
            atol=1e-6,
        )
    # The meta device holds no values either, but shapes need none: a model built there (shape inference) runs,
    # CausalSelfAttention included, which cannot pass seq_len (it was this error), and no state advances.
    meta_q = q.to("meta")
    assert rope(meta_q, meta_q)[0].shape == rope(meta_q, meta_q, seq_len=SEQ_LEN)[0].shape == q.shape
    assert rope.hf_scaled_len == MAX_POS
    attention = posenc.CausalSelfAttention(4 * HEAD_DIM, 4, encoding=rope).to("meta")
    assert attention(torch.randn(1, 2 * MAX_POS, 4 * HEAD_DIM, device="meta")).shape == (1, 2 * MAX_POS, 4 * HEAD_DIM)
    # MRoPE's three axes on the meta device take the shapes (scaled for 1, as its cos_sin does there).
    mrope = posenc.MRoPE(
        HEAD_DIM, mrope_section=[2, 3, 3], rope_parameters=PARAMS["dynamic"], max_position_embeddings=MAX_POS
    )
    axes = torch.zeros(3, 1, 5, dtype=torch.long, device="meta")
    assert mrope(meta_q, meta_q, positions=axes)[0].shape == q.shape


@pytest.mark.parametrize("mode", ["hf", "consistent"])
def test_dynamic_ntk_compiles_one_graph_for_every_length_past_the_trained_one(mode):
    """Dynamo makes an int argument symbolic once it changes between calls. dynamic's frequencies past
    max_position_embeddings were computed from the length made a constant, one graph per length: a fullgraph
    decode loop past the trained length stopped at Dynamo's recompile limit on its 9th step. They are computed in
    the graph from the symbolic length now, to the same bits as eager."""
    torch._dynamo.utils.counters.clear()
    rope = make_rope("dynamic", mode)
    q, k = random_qk(1, 2, 1, 1, HEAD_DIM)
    compiled = compile_traced(lambda q, k, n: rope(q, k, offset=n - 1, seq_len=n))
    for seq_len in range(MAX_POS + 1, MAX_POS + 21):
        got, want = compiled(q, k, seq_len), rope(q, k, offset=seq_len - 1, seq_len=seq_len)
        assert all(map(torch.equal, got, want)), seq_len
    # The first length, then a symbolic one (one graph for all the others).
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] <= 2
    # Each length scales its own frequencies, so a graph that kept the first length's would have failed above.
    first, last = (rope(q, k, offset=MAX_POS, seq_len=n)[0] for n in (MAX_POS + 1, MAX_POS + 20))
    assert not torch.equal(first, last)


@pytest.mark.parametrize("rope_type", sorted(set(SCALINGS) - set(SEQ_LEN_DEPENDENT)))
def test_fixed_frequencies_compile_one_graph_for_every_int_offset_and_length(rope_type):
    """The cached table grew to the next power of two inside the traced graph, which was guarded on its size: a
    fullgraph decode loop with an int offset recompiled at 256, 512, ... and failed at Dynamo's limit (position
    16384 in the report), prefills of growing length likewise. Traced, the angles are computed in the graph now."""
    torch._dynamo.utils.counters.clear()
    rope = make_rope(rope_type)
    q, k = random_qk(1, 2, 1, 1, HEAD_DIM)
    decode = compile_traced(lambda q, k, n: rope(q, k, offset=n))
    for offset in (0, 1, 300, 700, 1500, 3000, 5000, 9000, 17000, 33000, 65535):
        assert all(map(torch.equal, decode(q, k, offset), rope(q, k, offset=offset))), offset
    prefill = compile_traced(lambda q, k: rope(q, k))
    for length in (5, 300, 600, 1200, 2500):
        q, k = random_qk(1, 2, 1, length, HEAD_DIM)
        assert all(map(torch.equal, prefill(q, k), rope(q, k))), length
    # each: the first call's constants, then one symbolic graph
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] <= 4


def test_longrope_compiles_one_graph_for_every_length_on_both_sides_of_its_original_length():
    """LongRoPE's frequencies change only where seq_len passes original_max_position_embeddings, but the length was
    specialized like dynamic's: a 'consistent' cache's decode steps (a new length each) recompiled every step until
    Dynamo's limit. Then the side was compared on the host, which guarded each graph on it: a graph per side (3 here).
    The graph chooses the factors itself now, one symbolic graph for both sides."""
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    rope = make_rope("longrope", "consistent")
    q, k = random_qk(1, 2, 1, 1, HEAD_DIM)
    compiled = compile_traced(lambda q, k, n: rope(q, k, offset=n - 1, seq_len=n))
    for seq_len in range(MAX_POS - 10, MAX_POS + 11):
        for got, want in zip(compiled(q, k, seq_len), rope(q, k, offset=seq_len - 1, seq_len=seq_len), strict=True):
            torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    # the first length, then a symbolic one for both sides
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] <= 2


@pytest.mark.parametrize("rope_type", sorted(SCALINGS))
def test_every_type_compiles_with_dynamic_true_and_fullgraph(rope_type):
    """dynamic=True makes the spec's Python floats symbolic: ntk's and dynamic's overflow check (math.isfinite)
    could not be traced, so both failed with fullgraph where eager worked."""
    rope = make_rope(rope_type)
    q, k = random_qk(1, 2, 1, 5, HEAD_DIM)
    compiled = torch.compile(lambda q, k, n: rope(q, k, seq_len=n), dynamic=True, fullgraph=True, backend="eager")
    for got, want in zip(compiled(q, k, SEQ_LEN), rope(q, k, seq_len=SEQ_LEN), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


def test_dynamic_ntk_compiles_one_graph_for_every_length_up_to_the_trained_one():
    """Its frequencies change only past max_position_embeddings, but every seq_len was a graph of its own: a
    fullgraph decode loop stopped at the recompile limit on its 9th step, inside the trained length."""
    torch._dynamo.utils.counters.clear()
    rope = make_rope("dynamic")
    q, k = random_qk(1, 2, 1, 1, HEAD_DIM)
    compiled = compile_traced(lambda q, k, n: rope(q, k, offset=n - 1, seq_len=n))
    for seq_len in range(2, MAX_POS + 1):
        for got, want in zip(compiled(q, k, seq_len), rope(q, k, offset=seq_len - 1, seq_len=seq_len), strict=True):
            torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] <= 2  # the first length, then a symbolic one


SEQ_LEN_MESSAGE = "seq_len must be a positive integer (a sequence length), got {}"


@pytest.mark.parametrize("rope_type", sorted(SCALINGS))
@pytest.mark.parametrize("bad", [-5, 0, "x", True, 2.5, 4.0])
def test_seq_len_is_checked_alike_by_every_type(rope_type, bad):
    """A seq_len that only some types read was silently ignored by the others, so a bad value surfaced only once a
    config switched to dynamic or longrope."""
    rope = make_rope(rope_type)
    q, k = random_qk(1, 2, 1, 5, HEAD_DIM)
    message = SEQ_LEN_MESSAGE.format(repr(bad))
    for call in (
        lambda: rope(q, k, seq_len=bad),
        lambda: rope(q, k, positions=torch.arange(5), seq_len=bad),
        lambda: rope.cos_sin(torch.arange(5), seq_len=bad),
        lambda: rope.rotate(q, torch.arange(5)[None], seq_len=bad),
        # the frequency functions, which share the check
        lambda: posenc.rope_frequencies(HEAD_DIM, PARAMS["dynamic"], max_position_embeddings=MAX_POS, seq_len=bad),
    ):
        with pytest.raises(ValueError) as raised:
            call()
        assert str(raised.value) == message
    assert all(torch.isfinite(t).all() for t in rope(q, k, seq_len=7))


def test_longrope_chooses_its_factors_inside_the_graph():
    """LongRoPE only picks its short or long factors by max(positions) + 1: compiled with fullgraph=True and no
    seq_len, the choice is made on the device, as transformers makes it (it was a graph break, an error here)."""
    rope = make_rope("longrope")
    q, k = random_qk(2, 2, 1, 5, HEAD_DIM)
    compiled = compile_traced(lambda q, k, p: rope(q, k, positions=p))
    outputs = []
    for last in (4, MAX_POS - 1, MAX_POS):  # short, short at the original length, long one past it
        ids = torch.arange(5) + last - 4
        outputs.append(compiled(q, k, ids))
        for got, want in zip(outputs[-1], rope(q, k, positions=ids), strict=True):
            torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    with pytest.raises(RuntimeError, match="positions must be >= 0"):
        compiled(q, k, torch.tensor([0, 1, -2, 3, 4]))
    empty_q, empty_k = q[:, :, :0], k[:, :, :0]
    assert compiled(empty_q, empty_k, torch.arange(0))[0].shape == empty_q.shape


@pytest.mark.parametrize("rope_type", ["dynamic", "longrope"])
def test_a_length_dependent_rope_compiles_with_a_graph_break_where_the_length_is_read(rope_type):
    """Without fullgraph, the length is read outside the graph (where transformers' dynamic_rope_update breaks it
    too), so a model with dynamic NTK or LongRoPE compiles; it used to raise, asking for a seq_len= that
    CausalSelfAttention and a patched transformers model cannot pass."""
    rope = make_rope(rope_type)
    attention = posenc.CausalSelfAttention(4 * HEAD_DIM, 4, num_kv_heads=2, encoding=rope)
    compiled = torch.compile(attention, backend="eager")
    for length in (5, 3 * MAX_POS // 2):  # below and past the trained length: other frequencies
        x = torch.randn(2, length, 4 * HEAD_DIM, generator=torch.Generator().manual_seed(length))
        torch.testing.assert_close(compiled(x), attention(x), rtol=1e-5, atol=1e-5)
    mrope = posenc.MRoPE(
        HEAD_DIM, mrope_section=[2, 3, 3], rope_parameters=PARAMS[rope_type], max_position_embeddings=MAX_POS
    )
    q, k = random_qk(1, 2, 1, 6, HEAD_DIM)
    axes = torch.stack((torch.arange(6), torch.arange(6) // 2, torch.arange(6) % 2))[:, None] + 2 * MAX_POS
    compiled_mrope = torch.compile(mrope, backend="eager")
    for got, want in zip(compiled_mrope(q, k, positions=axes), mrope(q, k, positions=axes), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("three_axes", [False, True], ids=["RoPE", "MRoPE"])
def test_hf_dynamic_ntk_breaks_the_graph_in_no_more_frames_than_forward_and_call_cos_sin(three_axes):
    """Dynamo compiles every frame between the compiled function and call_cos_sin's eager step as a frame of its own,
    each with a graph break and a guard check on every call. RoPE.forward and MRoPE.forward reached call_cos_sin
    through their shared _rotate_at, one frame more than before it (4 breaks and 5 frames per compile, not 3 and 4;
    measured ~10 us a call, ~0.15 s to compile 8 lengths on the CPU): they compute cos/sin themselves now."""
    from torch._dynamo.utils import counters

    params = PARAMS["dynamic"]
    if three_axes:
        rope: posenc.RoPE = posenc.MRoPE(
            HEAD_DIM, mrope_section=[2, 3, 3], rope_parameters=params, max_position_embeddings=MAX_POS
        )
    else:
        rope = make_rope("dynamic")
    eager = copy.deepcopy(rope)  # its own 'hf' state, advanced by the same calls
    q, k = random_qk(1, 2, 1, 2 * MAX_POS, HEAD_DIM)
    axes = torch.stack((torch.arange(2 * MAX_POS), torch.arange(2 * MAX_POS) // 2, torch.arange(2 * MAX_POS) % 2))
    positions = axes[:, None] if three_axes else None
    counters.clear()
    compiled = torch.compile(lambda q, k: rope(q, k, positions=positions), backend="eager")
    for got, want in zip(compiled(q, k), eager(q, k, positions=positions), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    # the compiled lambda, forward and call_cos_sin break; forward's rest is the fourth frame
    assert (sum(counters["graph_break"].values()), counters["frames"]["total"]) == (3, 4)


@pytest.mark.parametrize("rope_type", sorted(SEQ_LEN_DEPENDENT))
def test_a_consistent_cache_takes_the_shapes_on_the_meta_device(rope_type):
    """'consistent' mode's KVCache read max(positions) + 1 with int(): Tensor.item() failed on the meta device, where
    the same layer without a cache (or in 'hf' mode) takes the shapes. A prefill past the trained length, a step."""
    attention = posenc.CausalSelfAttention(4 * HEAD_DIM, 4, encoding=make_rope(rope_type, "consistent")).to("meta")
    x = torch.randn(2, 2 * MAX_POS, 4 * HEAD_DIM, device="meta")
    cache = posenc.KVCache()
    assert attention(x, cache=cache).shape == x.shape
    assert attention(x[:, :1], cache=cache).shape == (2, 1, 4 * HEAD_DIM)
    assert cache.k.shape == cache.unrotated_k.shape == (2, 4, 2 * MAX_POS + 1, HEAD_DIM)


@pytest.mark.parametrize("rope_type", sorted(SEQ_LEN_DEPENDENT))
def test_a_consistent_cache_under_fullgraph_says_to_compile_without_it(rope_type):
    """The cache's length is read on the host, and CausalSelfAttention takes no seq_len=: with fullgraph=True the
    error was Dynamo's 'Could not guard on data-dependent expression u0 + 1 <= 32', and is now posenc's reason,
    which says what to do. Without fullgraph the graph breaks there, and a step across the switch equals eager's."""
    attention = posenc.CausalSelfAttention(4 * HEAD_DIM, 4, encoding=make_rope(rope_type, "consistent"))
    x = torch.randn(1, MAX_POS + 1, 4 * HEAD_DIM, generator=torch.Generator().manual_seed(0))
    with pytest.raises(Exception, match=r"compile it without fullgraph=True") as caught:
        compile_traced(lambda x, cache: attention(x, cache=cache))(x[:, :5], posenc.KVCache())
    assert "data-dependent" not in str(caught.value)
    compiled = torch.compile(lambda x, cache: attention(x, cache=cache), backend="eager")
    eager_cache, compiled_cache = posenc.KVCache(), posenc.KVCache()
    # Below the trained length, then a step past it (the keys re-rotated): two of the frequencies.
    steps = [slice(0, MAX_POS), slice(MAX_POS, MAX_POS + 1)]
    for chunk in steps:
        want = attention(x[:, chunk], cache=eager_cache)
        torch.testing.assert_close(compiled(x[:, chunk], compiled_cache), want, rtol=1e-6, atol=1e-6)


def test_a_consistent_cache_where_no_value_may_be_read_asks_for_the_length(monkeypatch):
    """In a CUDA graph capture (values_readable False; here on the CPU, by hand) the cache read the length with a
    device sync, which a capture refuses; it now raises the error the call without a cache gives, before the cache
    changes."""
    import posenc.rope.module as module

    attention = posenc.CausalSelfAttention(4 * HEAD_DIM, 4, encoding=make_rope("dynamic", "consistent"))
    x = torch.randn(1, 6, 4 * HEAD_DIM)
    cache = posenc.KVCache()
    attention(x[:, :5], cache=cache)
    monkeypatch.setattr(module, "values_readable", lambda device: False)
    with pytest.raises(ValueError, match=r"pass seq_len=") as uncached:
        attention(x)
    with pytest.raises(ValueError, match=r"pass seq_len=") as cached:
        attention(x[:, 5:], cache=cache)
    assert str(cached.value) == str(uncached.value)
    assert cache.length == 5


@contextlib.contextmanager
def _capturing_a_cuda_graph(monkeypatch, *, readable: bool):
    """What a RoPE sees while a CUDA graph is captured (here on the CPU, by hand): a stream that captures and, unless
    ``readable``, no tensor value to read."""
    import posenc.rope.module as module

    with monkeypatch.context() as capture:
        capture.setattr(torch.cuda, "is_available", lambda: True)
        capture.setattr(torch.cuda, "is_initialized", lambda: True)  # a capture needs CUDA initialized
        capture.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
        if not readable:
            capture.setattr(module, "values_readable", lambda device: False)
        yield


@pytest.mark.parametrize("offset_kind", ["int", "tensor"])
def test_a_table_a_cuda_graph_captured_outlives_the_call_that_grows_it(monkeypatch, offset_kind):
    """A captured graph reads the kept table by address at every replay. A later eager call that grew the table
    (a longer prompt) freed the captured one, and replays rotated by whatever the allocator had written there since,
    without an error. The module now keeps every table a capture read."""
    rope = posenc.RoPE(HEAD_DIM)
    q, k = random_qk(1, 2, 1, 3, HEAD_DIM)
    offset = 4 if offset_kind == "int" else torch.tensor([4])
    want = rope(q, k, offset=offset)  # the warm-up a capture needs: the table of 256 rows
    (table,) = (cos for cos, _ in rope._tables.values())
    captured_table = weakref.ref(table)
    del table
    with _capturing_a_cuda_graph(monkeypatch, readable=offset_kind == "int"):
        got = rope(q, k, offset=offset)
        rope(q, k, offset=offset)  # another layer sharing the RoPE: the same table, held once
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert len(rope._captured) == 1
    # Derived state, as the tables are: a copy (deepcopy, a pickle) has no graph reading its memory.
    assert copy.deepcopy(rope)._captured == []
    rope(*random_qk(1, 2, 1, 1000, HEAD_DIM))  # grows the table to 1024 rows
    gc.collect()
    assert captured_table() is not None
    assert all(cos.shape[0] == 1024 for cos, _ in rope._tables.values())
    rope.to("meta")  # the device left: its tables, captured or not, go
    assert rope._captured == []


def test_a_table_or_window_built_while_a_cuda_graph_is_captured_is_not_kept(monkeypatch):
    """A capture's memory is written only when the graph replays: an eager call that read a table built while
    capturing, before that, would rotate by uninitialised rows. Nothing built there is kept."""
    rope = posenc.RoPE(HEAD_DIM)
    q, k = random_qk(1, 2, 1, 3, HEAD_DIM)
    with _capturing_a_cuda_graph(monkeypatch, readable=True):
        rope(q, k, offset=4)
        rope(q, k, offset=1 << 17)
    assert not rope._tables and not rope._windows


def test_a_table_no_cuda_graph_captured_is_freed_when_the_table_grows():
    """Only a capture holds a table past its use: eager calls that read the kept table and window hold nothing, so a
    grown table frees the one it replaced."""
    rope = posenc.RoPE(HEAD_DIM)
    q, k = random_qk(1, 2, 1, 3, HEAD_DIM)
    for _ in range(2):  # the second call reads the kept table and window
        rope(q, k, offset=4)
        rope(q, k, offset=1 << 17)
    (table,) = (cos for cos, _ in rope._tables.values())
    replaced = weakref.ref(table)
    del table
    rope(*random_qk(1, 2, 1, 1000, HEAD_DIM))
    gc.collect()
    assert replaced() is None and rope._captured == []


def test_a_far_window_a_cuda_graph_captured_outlives_its_eviction(monkeypatch):
    """Past the table, a capture reads a kept window by address. The capture took it out of the kept windows and did
    not put it back (nothing is kept while capturing), so it was freed as the call returned, and evicted windows
    likewise: the module now keeps every window a capture read, and the window stays in use."""
    rope = posenc.RoPE(HEAD_DIM)
    q, k = random_qk(1, 2, 1, 1, HEAD_DIM)
    far = 1 << 17
    want = rope(q, k, offset=far)
    (window,) = (cos for cos, _ in rope._windows.values())
    captured_window = weakref.ref(window)
    del window
    with _capturing_a_cuda_graph(monkeypatch, readable=True):
        got = rope(q, k, offset=far)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert len(rope._windows) == 1
    for step in range(1, 12):  # more windows than are kept: the first is evicted
        rope(q, k, offset=far + step * 4096)
    gc.collect()
    assert captured_window() is not None


def _graph_targets(fn, *args) -> list[str]:
    """The names of the calls in the FX graph Dynamo hands its backend for fn(*args): an op's qualified name
    ("posenc.angles_cos_sin.default"), a function's or method's own ("sin", "mul")."""
    targets: list[str] = []

    def backend(gm: torch.fx.GraphModule, example_inputs):
        for node in gm.graph.nodes:
            if node.op in ("call_function", "call_method"):
                target = node.target
                targets.append(
                    str(target)
                    if isinstance(target, torch._ops.OpOverload)
                    else getattr(target, "__name__", str(target))
                )
        return gm.forward

    torch.compile(fn, backend=backend, fullgraph=True)(*args)
    return targets


@pytest.mark.parametrize("rope_type", ["default", "yarn", "longrope", "dynamic"])
def test_traced_angles_reach_the_graph_as_one_opaque_op(rope_type):
    """Traced in the open, the angles' sin and cos were inlined by Inductor into the torch path's rotation: two float64
    sines per element of every head. A compiled RoPE forward took 6.6x a compiled rotation by a ready table on the
    CPU (2x on the fused CPU path). They are computed by one op now, (..., r/2) once, and equal eager's."""
    rope = posenc.RoPE(HEAD_DIM, rope_parameters=PARAMS[rope_type], max_position_embeddings=MAX_POS, backend="torch")
    q, k = random_qk(1, 4, 2, 7, HEAD_DIM)
    fn = (lambda q, k: rope(q, k, seq_len=SEQ_LEN)) if rope_type in SEQ_LEN_DEPENDENT else (lambda q, k: rope(q, k))
    targets = _graph_targets(fn, q, k)
    assert targets.count("posenc.angles_cos_sin.default") == 1, targets
    assert "sin" not in targets and "cos" not in targets, targets
    compiled = torch.compile(fn, fullgraph=True)  # Inductor: its code computes the rotation
    for got, want in zip(compiled(q, k), fn(q, k), strict=True):
        torch.testing.assert_close(got, want, rtol=2.5e-7, atol=2e-7)  # a float32 ulp or two


def test_an_exported_torch_path_rope_holds_no_posenc_op():
    """README: a package built with backend="torch" needs nothing but torch. The opaque angles op is for
    torch.compile's code generation only; torch.export keeps the angles in aten ops."""

    class Attention(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.rope = posenc.RoPE(HEAD_DIM, rope_parameters=PARAMS["yarn"], backend="torch")

        def forward(self, q, k, positions):
            return self.rope(q, k, positions=positions)

    q, k = random_qk(1, 2, 1, 5, HEAD_DIM)
    positions = torch.tensor([3, 0, 9, 40, 2])
    program = torch.export.export(Attention(), (q, k, positions))
    targets = [str(n.target) for n in program.graph.nodes if n.op == "call_function"]
    assert not [t for t in targets if "posenc" in t], targets
    for got, want in zip(program.module()(q, k, positions), Attention()(q, k, positions), strict=True):
        torch.testing.assert_close(got, want, rtol=2.5e-7, atol=2e-7)  # a float32 ulp or two


# Lengths on both sides of the switch, in numbers that are not powers of two: dynamic NTK's scale, factor * L / max -
# (factor - 1), is rounded at every step, so a graph that reordered the steps (0.0221 * L - 0.7) would show.
SWITCH_PARAMS = {
    "dynamic": ({"rope_type": "dynamic", "factor": 1.7, "rope_theta": 9999.5}, 77),
    "longrope": (PARAMS["longrope"], 4 * MAX_POS),
}


class _SeqLenRotation(torch.nn.Module):
    """A length-dependent RoPE given seq_len=positions.shape[-1], as an exported model passes it."""

    def __init__(self, rope_type: str, mode: str):
        super().__init__()
        params, max_positions = SWITCH_PARAMS[rope_type]
        self.rope = posenc.RoPE(
            HEAD_DIM, rope_parameters=params, max_position_embeddings=max_positions, mode=mode, backend="torch"
        )

    def forward(self, q, k, positions):
        return self.rope(q, k, positions=positions, seq_len=positions.shape[-1])


class _SeqLenTables(_SeqLenRotation):
    def forward(self, positions):
        length = positions.shape[-1]
        return (
            *self.rope.cos_sin(positions, seq_len=length),
            *self.rope.cos_sin(positions, seq_len=length, dtype=torch.float64),
        )


@pytest.mark.parametrize("mode", ["hf", "consistent"])
@pytest.mark.parametrize("rope_type", ["dynamic", "longrope"])
def test_a_length_dependent_rope_exports_one_program_for_lengths_on_both_sides_of_its_switch(rope_type, mode):
    """torch.export hands positions.shape[-1] as a torch.SymInt, which was refused as "seq_len must be a positive
    integer (a sequence length), got s80": dynamic NTK exported only with a constant length, its frequencies baked.
    Then the side of the switch (max_position_embeddings, LongRoPE's original_max_position_embeddings) was compared
    on the host, which guarded the program on the example's side: a Dim spanning both was refused ("Constraints
    violated ... satisfy the generated guard 78 <= s"), one program per side. Now one program chooses in the graph,
    to the bits of eager's tables at every length from 1 to 3x the switch (float32 and float64 cos/sin); the rotation
    by them is the traced formula's, an ulp from eager's fused one for every type."""
    tables, rotation = _SeqLenTables(rope_type, mode), _SeqLenRotation(rope_type, mode)
    switch = int(tables.rope.spec.params.get("original_max_position_embeddings", tables.rope.max_position_embeddings))
    seq = torch.export.Dim("s", min=1, max=3 * switch)
    example = torch.arange(switch + 5)  # past the switch: the program must still serve the lengths before it
    table_program = torch.export.export(tables, (example,), dynamic_shapes=({0: seq},)).module()
    q, k = random_qk(1, 2, 1, example.numel(), HEAD_DIM)
    rotation_program = torch.export.export(
        rotation, (q, k, example), dynamic_shapes=({2: seq}, {2: seq}, {0: seq})
    ).module()
    for length in range(1, 3 * switch + 1):
        positions = torch.arange(length)
        for got, want in zip(table_program(positions), tables(positions), strict=True):
            assert torch.equal(got, want), length
    outputs = {}
    for length in (1, switch - 1, switch, switch + 1, 3 * switch):
        q, k = random_qk(1, 2, 1, length, HEAD_DIM, seed=0)
        positions = torch.arange(length)
        outputs[length] = rotation_program(q, k, positions)
        for got, want in zip(outputs[length], rotation(q, k, positions), strict=True):
            torch.testing.assert_close(got, want, rtol=2.5e-7, atol=2e-7)  # a float32 ulp or two
    # The sides differ: a program that kept the example's frequencies would have failed above.
    assert not torch.equal(outputs[switch][0], outputs[switch + 1][0][:, :, :switch])


@pytest.mark.parametrize("rope_type", ["dynamic", "longrope"])
def test_mrope_axes_export_one_program_for_lengths_on_both_sides_of_the_switch(rope_type):
    """MRoPE's (3, b, s) axes take their frequencies from RoPE.frequencies(seq_len), which compared the length with
    the switch on the host as cos_sin did: a Dim across it was refused. One program now, to eager's bits."""
    params, max_positions = SWITCH_PARAMS[rope_type]
    mrope = posenc.MRoPE(
        HEAD_DIM, mrope_section=[2, 3, 3], rope_parameters=params, max_position_embeddings=max_positions
    )
    switch = int(params.get("original_max_position_embeddings", max_positions))

    class Tables(torch.nn.Module):
        def forward(self, axes):
            return mrope.cos_sin(axes, seq_len=axes.shape[-1])

    def axes(length):
        return torch.stack((torch.arange(length), torch.arange(length) // 2, torch.arange(length) % 2))[:, None]

    seq = torch.export.Dim("s", min=2, max=3 * switch)
    program = torch.export.export(Tables(), (axes(switch + 5),), dynamic_shapes=({2: seq},)).module()
    for length in range(2, 3 * switch + 1):
        for got, want in zip(program(axes(length)), Tables()(axes(length)), strict=True):
            assert torch.equal(got, want), length


@pytest.mark.parametrize("mode", ["hf", "consistent"])
@pytest.mark.parametrize("rope_type", ["dynamic", "longrope"])
def test_a_length_dependent_rope_compiles_one_dynamic_graph_for_lengths_on_both_sides_of_its_switch(rope_type, mode):
    """torch.compile(fullgraph=True, dynamic=True) with seq_len= compiled a graph per side of the switch (2 for the
    lengths below: the host's comparison guarded each), one now, giving eager's tables to the bit at every length."""
    tables, rotation = _SeqLenTables(rope_type, mode), _SeqLenRotation(rope_type, mode)
    switch = int(tables.rope.spec.params.get("original_max_position_embeddings", tables.rope.max_position_embeddings))
    compiled_tables = torch.compile(
        lambda p, n: tables.rope.cos_sin(p, seq_len=n), fullgraph=True, dynamic=True, backend="eager"
    )
    compiled_rotation = torch.compile(
        lambda q, k, n: rotation.rope(q, k, offset=n - 1, seq_len=n), fullgraph=True, dynamic=True, backend="eager"
    )
    q, k = random_qk(1, 2, 1, 1, HEAD_DIM)
    torch._dynamo.utils.counters.clear()
    for length in range(switch - 3, switch + 4):
        positions = torch.tensor([0, length // 2, length - 1])
        want = tables.rope.cos_sin(positions, seq_len=length)
        for got, want_one in zip(compiled_tables(positions, length), want, strict=True):
            assert torch.equal(got, want_one), length
        got = compiled_rotation(q, k, length)
        want = rotation.rope(q, k, offset=length - 1, seq_len=length)
        torch.testing.assert_close(got, want, rtol=2.5e-7, atol=2e-7)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 2  # one for each function


@pytest.mark.parametrize("rope_type", ["dynamic", "longrope"])
def test_a_length_dependent_rope_traced_by_make_fx_with_a_symbolic_seq_len_serves_both_sides_of_its_switch(rope_type):
    """make_fx(tracing_mode="symbolic") hands positions.shape[-1] as a torch.SymInt, which RoPE.frequencies compared
    with the switch on the host (and dynamic NTK's max(seq_len, max_position_embeddings) too): the graph kept the
    example's side, and gave its frequencies at every length, silently (LongRoPE's long factors below the switch,
    dynamic NTK the example's scale everywhere). Now the graph chooses, to eager's bits; MRoPE's axes too."""
    from torch.fx.experimental.proxy_tensor import make_fx

    tables, rotation = _SeqLenTables(rope_type, "consistent"), _SeqLenRotation(rope_type, "consistent")
    switch = int(tables.rope.spec.params.get("original_max_position_embeddings", tables.rope.max_position_embeddings))
    params, max_positions = SWITCH_PARAMS[rope_type]
    mrope = posenc.MRoPE(
        HEAD_DIM, mrope_section=[2, 3, 3], rope_parameters=params, max_position_embeddings=max_positions
    )

    def mrope_tables(axes):
        return mrope.cos_sin(axes, seq_len=axes.shape[-1])

    def axes(length):
        return torch.stack((torch.arange(length), torch.arange(length) // 2, torch.arange(length) % 2))[:, None]

    example = torch.arange(switch + 5)  # past the switch: the graph must still serve the lengths before it
    table_graph = make_fx(tables, tracing_mode="symbolic")(example)
    mrope_graph = make_fx(mrope_tables, tracing_mode="symbolic")(axes(switch + 5))
    q, k = random_qk(1, 2, 1, example.numel(), HEAD_DIM)
    rotation_graph = make_fx(rotation, tracing_mode="symbolic")(q, k, example)
    for length in (2, switch - 1, switch, switch + 1, 3 * switch):
        positions = torch.arange(length)
        for got, want in zip(table_graph(positions), tables(positions), strict=True):
            assert torch.equal(got, want), length
        for got, want in zip(mrope_graph(axes(length)), mrope_tables(axes(length)), strict=True):
            assert torch.equal(got, want), length
        q, k = random_qk(1, 2, 1, length, HEAD_DIM, seed=0)
        for got, want in zip(rotation_graph(q, k, positions), rotation(q, k, positions), strict=True):
            torch.testing.assert_close(got, want, rtol=2.5e-7, atol=2e-7)  # a float32 ulp or two


def _fresh_add_one():
    """x + 1 in a code object of its own: Dynamo keeps its compiles per code object, and each use must compile."""
    namespace: dict[str, Any] = {}
    exec("def add_one(x):\n    return x + 1\n", namespace)
    return namespace["add_one"]


@contextlib.contextmanager
def _another_thread_compiling(probe=None):
    """Another thread held inside a torch.compile (its backend waits) for the block: torch 2.13's
    ``torch.compiler.is_compiling()`` is one flag for the process, so it reads True here too. Yields what ``probe()``
    answered in the compiling thread, inside that compile but outside Dynamo's trace (its backend).

    Skipped where torch does not hold that flag across the compile: torch 2.12 sets it for Dynamo's trace and
    export's trace only, so it reads False here and in the backend, and the bug these tests guard cannot happen.
    The check is of the flag itself, not of a version number."""
    inside, done, seen = threading.Event(), threading.Event(), []

    def waiting_backend(gm, example_inputs):
        if probe is not None:
            seen.append(probe())
        inside.set()
        done.wait(timeout=120)
        return gm

    thread = threading.Thread(target=torch.compile(_fresh_add_one(), backend=waiting_backend), args=(torch.zeros(2),))
    thread.start()
    try:
        assert inside.wait(timeout=120), "the other thread never reached its backend"
        if not torch.compiler.is_compiling():  # what fooled posenc: the other thread's flag
            pytest.skip(
                f"torch {torch.__version__} does not hold torch.compiler.is_compiling() across a compile (it is False "
                "in another thread and in the backend): the other thread's flag that this test guards against does "
                "not exist"
            )
        yield seen
    finally:
        done.set()
        thread.join()


def test_an_eager_call_while_another_thread_compiles_takes_the_eager_path():
    """A threaded server: one thread compiles (a recompile for a new shape), another runs an eager step meanwhile (or
    a compiled model's graph break). The eager thread read torch's process-wide flag and took the traced path:
    dynamic NTK without seq_len= and a 'consistent' KVCache step raised the error meant for torch.compile, and a
    fixed type built no table (~6x the host time). Only the compiling thread counts as tracing now."""
    q, k = random_qk(1, 2, 2, 3, HEAD_DIM, seed=0)
    dynamic, default = make_rope("dynamic"), make_rope("default")
    attention = posenc.CausalSelfAttention(4 * HEAD_DIM, 4, encoding=make_rope("dynamic", "consistent"))
    x = torch.randn(1, MAX_POS + 1, 4 * HEAD_DIM, generator=torch.Generator().manual_seed(0))
    want_cache = posenc.KVCache()
    want = [dynamic(q, k), default(q, k), attention(x[:, :MAX_POS], cache=want_cache)]
    want.append(attention(x[:, MAX_POS:], cache=want_cache))
    dynamic, default = make_rope("dynamic"), make_rope("default")  # no table or frequencies kept yet
    cache = posenc.KVCache()
    with _another_thread_compiling():
        got = [dynamic(q, k), default(q, k), attention(x[:, :MAX_POS], cache=cache)]
        got.append(attention(x[:, MAX_POS:], cache=cache))  # past the trained length: the keys re-rotated
        assert default._tables, "the eager path keeps its cos/sin table; the traced one builds none"
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_a_fake_mode_call_while_another_thread_compiles_reads_no_values():
    """A FakeTensorMode (a memory or FLOP estimator) in one thread while another compiles: torch's process-wide flag
    is on there too, and posenc still skips the checks that read values, which fake tensors do not have (a read
    raised DataDependentOutputException)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with _another_thread_compiling(), FakeTensorMode():
        q, ids = torch.randn(1, 2, 3, HEAD_DIM), torch.tensor([[2, 0, 1]])
        cos, sin = torch.randn(10, HEAD_DIM // 2), torch.randn(10, HEAD_DIM // 2)
        assert posenc.apply_rotary(q, cos, sin, positions=ids).shape == q.shape


def test_a_make_fx_trace_while_another_thread_compiles_reads_no_example_values():
    """torch's process-wide flag is on while another thread compiles: a make_fx trace in this thread still records,
    and its graph must not have the example's ids (a table sized for them) baked in."""
    from torch.fx.experimental.proxy_tensor import make_fx

    q, k = random_qk(1, 2, 2, 3, HEAD_DIM, seed=0)
    ids, rope = torch.tensor([[0, 1, 2]]), posenc.RoPE(HEAD_DIM)
    with _another_thread_compiling():
        graph = make_fx(lambda q, k, p: rope(q, k, positions=p))(q, k, ids)
    torch.testing.assert_close(graph(q, k, ids + 300), rope(q, k, positions=ids + 300))


def test_only_the_compiling_thread_counts_as_tracing():
    """posenc's check: True in the compiling thread's eager code during the compile (a backend, AOTAutograd's
    make_fx), False in any other thread meanwhile, and False once the compile is over."""
    with _another_thread_compiling(_checks.compiling) as seen:
        assert not _checks.compiling()
    assert seen == [True]
    assert not _checks.compiling()


def test_replays_go_on_while_another_thread_compiles():
    """A decode loop's replayed steps (``posenc.kernels.replay``) in one thread while another compiles: they
    still replay (``plain_eager`` asks posenc's ``compiling()``, not the process-wide flag), with the same values;
    inside the compile itself (its backend) nothing is replayed."""
    from unittest import mock

    import posenc.rope.module as module
    from posenc.kernels import replay

    rope = make_rope("default")
    q, k = random_qk(1, 2, 2, 1, HEAD_DIM, seed=0)
    want = rope(q, k, offset=4)  # keeps the plan
    with _another_thread_compiling(replay.plain_eager) as seen:
        assert replay.plain_eager()
        with mock.patch.object(module, "rotate_tensors", side_effect=AssertionError("took the full path")):
            got = rope(q, k, offset=4)
    assert seen == [False]
    torch.testing.assert_close(got, want, rtol=0, atol=0)
