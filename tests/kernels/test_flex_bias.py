"""ALiBi / T5 as FlexAttention score_mods against the materialized bias of posenc.attention."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import warnings

import pytest
import torch
import torch.nn.functional as F
from hypothesis import example, given, settings
from hypothesis import strategies as st
from safetensors.torch import save_file
from torch import nn
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

from posenc import ALiBi, CausalSelfAttention, KVCache, T5Bias, attention
from posenc.attention import attend, causal_mask
from posenc.kernels import flex_bias
from posenc.positions import positions_from_document_ids
from posenc.testing import assert_close

ENCODINGS = {
    "alibi": lambda: ALiBi(4),
    "alibi-6-heads": lambda: ALiBi(6),
    "t5-causal": lambda: T5Bias(4, num_buckets=16, max_distance=20),
    "t5-bidirectional": lambda: T5Bias(4, num_buckets=16, max_distance=20, bidirectional=True),
}


# Two documents packed into one row of 37 tokens: ids restart at 0 at token 20.
PACKED = torch.cat((torch.arange(20), torch.arange(17)))


@pytest.mark.parametrize("name", list(ENCODINGS))
@pytest.mark.parametrize("positions", ["shared", "batched", "packed"])
def test_score_mod_matches_the_materialized_bias(name, positions):
    """Eager flex_attention runs the score_mod through its reference math: the score_mod itself is checked."""
    torch.manual_seed(0)
    encoding = ENCODINGS[name]()
    h = encoding.num_heads
    b, s, t, d = 2, 5, 37, 16  # 32 cached keys, then 5 queries
    q, k, v = torch.randn(b, h, s, d), torch.randn(b, h, t, d), torch.randn(b, h, t, d)
    k_pos = {
        "shared": torch.arange(t)[None],
        "batched": torch.arange(t)[None] + torch.tensor([[0], [3]]),
        "packed": PACKED[None],
    }[positions]
    q_pos = k_pos[:, -s:]
    allowed = causal_mask(s, t, q.device)
    with torch.no_grad():
        expected, _ = attend(q, k, v, allowed, encoding.score_bias(q_pos, k_pos))
        score_mod = flex_bias.score_mod_for(encoding, k_pos, t - s)
        block_mask = create_block_mask(lambda b_, h_, qi, ki: ki <= qi + (t - s), None, None, s, t, device="cpu")
        got = flex_attention(q, k, v, score_mod=score_mod, block_mask=block_mask)
    assert_close(got, expected.double(), reduction=True)


def _block_kinds(block_mask) -> torch.Tensor:
    """(b, nq, nk): 0 skipped, 1 partial (mask_mod applied), 2 full, from a BlockMask's index lists."""
    b, _, nq = block_mask.kv_num_blocks.shape
    kinds = torch.zeros(b, nq, block_mask.kv_indices.shape[-1], dtype=torch.long)
    for kind, counts, indices in (
        (1, block_mask.kv_num_blocks, block_mask.kv_indices),
        (2, block_mask.full_kv_num_blocks, block_mask.full_kv_indices),
    ):
        for row, i in ((row, i) for row in range(b) for i in range(nq)):
            chosen = indices[row, 0, i, : counts[row, 0, i]].long()
            assert (kinds[row, i, chosen] == 0).all(), "a key block listed twice"
            kinds[row, i, chosen] = kind
    return kinds


def _document_rows(draw, batch: int, t: int, sorted_ids: bool) -> torch.Tensor:
    ids = [draw(st.lists(st.integers(0, 3), min_size=t, max_size=t)) for _ in range(batch)]
    return torch.tensor([sorted(row) if sorted_ids else row for row in ids], dtype=torch.long).reshape(batch, t)


@st.composite
def _block_mask_cases(draw):
    t = draw(st.integers(1, 40))
    s = draw(st.integers(1, t))
    block = draw(st.sampled_from([1, 4, 8, 16]))
    documents = draw(st.sampled_from(["none", "sorted", "any"]))
    docs = None if documents == "none" else _document_rows(draw, draw(st.integers(1, 3)), t, documents == "sorted")
    return s, t, block, docs


@settings(max_examples=80, deadline=None)
@given(_block_mask_cases())
# Packed documents whose last block is cut (10 = 2 * 4 + 2) and holds the last document only: padded with another
# column than the last, its id range would reach back to document 0, and block 0 would be computed, not skipped.
@example((10, 10, 4, torch.tensor([[0, 0, 0, 0, 1, 1, 1, 1, 2, 2]])))
@example((6, 10, 4, torch.tensor([[0, 0, 0, 0, 1, 1, 1, 1, 2, 2]])))
def test_causal_block_mask_skips_only_empty_blocks_and_marks_only_whole_ones_full(case):
    """Built from index and id ranges, never from the mask: every allowed (query, key) pair lies in a block that is
    computed, a full block (mask_mod not applied) holds only allowed pairs, and for non-decreasing ids (packed
    documents) the blocks are create_block_mask's, which evaluates the mask pair by pair. Random ids too."""
    s, t, block, docs = case
    past = t - s
    row = (lambda b, i: i * 0) if docs is None else flex_bias._per_batch(docs)

    def allowed(b, h, q_idx, kv_idx):
        return (kv_idx <= q_idx + past) & (row(b, q_idx + past) == row(b, kv_idx))

    got = flex_bias.causal_block_mask(allowed, s, t, past, docs, block=block)
    batch = 1 if docs is None else docs.shape[0]
    q_idx, kv_idx = torch.arange(s)[:, None], torch.arange(t)[None, :]
    dense = torch.stack([allowed(b, 0, q_idx, kv_idx) for b in range(batch)])
    nq, nk = -(-s // block), -(-t // block)
    padded = torch.zeros(batch, nq * block, nk * block, dtype=torch.bool)
    padded[:, :s, :t] = dense
    per_block = padded.view(batch, nq, block, nk, block)
    # Padding pairs are masked: a block cut by the end is never full, as in create_block_mask.
    some, every = per_block.any(dim=(2, 4)), per_block.all(dim=(2, 4))
    kinds = _block_kinds(got)
    assert not (some & (kinds == 0)).any(), "a block with allowed pairs was skipped"
    assert every[kinds == 2].all(), "a block marked full holds a masked pair"
    if docs is None or bool((docs[:, 1:] >= docs[:, :-1]).all()):
        expected = create_block_mask(allowed, batch, None, s, t, device="cpu", BLOCK_SIZE=block)
        assert torch.equal(kinds, _block_kinds(expected))


def test_causal_block_mask_costs_blocks_not_pairs():
    """Per-row document ids at s = t = 8192 for 4 rows: create_block_mask would evaluate 4 * 8192^2 pairs (5 GiB
    at 8 rows); the block mask is (4, 64, 64) and its mask_mod is never called while it is built."""
    t = 8192
    docs = torch.sort(torch.randint(0, 9, (4, t)), dim=1).values

    def never(b, h, q_idx, kv_idx):
        raise AssertionError("the mask was evaluated pair by pair")

    got = flex_bias.causal_block_mask(never, t, t, 0, docs)
    assert got.kv_indices.shape == (4, 1, 64, 64) and got.seq_lengths == (t, t)


@pytest.fixture
def compiled_flex(monkeypatch):
    """Long-sequence CPU inference routed to the compiled FlexAttention for every length, from a clean dynamo
    state: compiled variants of other tests count toward dynamo's recompile limit, past which posenc falls back."""
    torch._dynamo.reset()
    monkeypatch.setattr(flex_bias, "CPU_MIN_SCORES", 0)
    monkeypatch.setattr(flex_bias, "_GIVEN_UP", set())
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # a fallback to the materialized bias warns: fail on it
        yield


@pytest.fixture
def flex_calls(monkeypatch) -> list[int]:
    """The calls CausalSelfAttention routes to FlexAttention, one entry each: without it, a layer that never routed
    there would compare the materialized path with itself (with compiled_flex, a routed call that fell back warns)."""
    calls: list[int] = []

    def counted(*args, **kwargs):
        calls.append(1)
        return flex_bias.attend_flex(*args, **kwargs)

    monkeypatch.setattr(attention, "attend_flex", counted)
    return calls


def _materialized(layer, monkeypatch, *args, **kwargs):
    with monkeypatch.context() as materialize:
        materialize.setattr(flex_bias, "CPU_MIN_SCORES", 2**62)
        return layer(*args, **kwargs)


@pytest.mark.parametrize("name", ["alibi", "t5-causal"])
def test_packed_documents_get_one_semantics_on_every_path(name, monkeypatch, compiled_flex, flex_calls):
    """Compiled FlexAttention, the materialized bias and return_attention agree when position ids restart
    mid-row. ALiBi's materialized bias used to hide the earlier document's keys whose ids exceed the query's
    (0.47 apart); causality is by token order on every path, and every earlier key gets -slope * |m - n|."""
    torch.manual_seed(0)
    layer = CausalSelfAttention(32, 4, num_kv_heads=2, encoding=ENCODINGS[name]()).eval()
    x = torch.randn(1, 140, 32)  # CPU flex takes 128 keys or more (flex_bias.CPU_MIN_KEYS)
    packed = torch.cat((torch.arange(124), torch.arange(16)))
    with torch.no_grad():
        materialized = _materialized(layer, monkeypatch, x, positions=packed)
        _, probs = layer(x, positions=packed, return_attention=True)
        flexed = layer(x, positions=packed)
    assert flex_calls == [1]
    assert_close(flexed, materialized.double(), reduction=True)
    # The second document's first token (id 0, token 124) still sees every key of the first document.
    assert (probs[0, :, 124, :125] > 0).all()


@pytest.mark.parametrize("name", ["alibi", "t5-causal"])
def test_document_ids_keep_documents_apart_on_every_path(name, monkeypatch, compiled_flex, flex_calls):
    """With document ids the compiled FlexAttention's block mask, the materialized mask and return_attention agree,
    for ids per sequence of a batch and shared by it, and each document attends as if alone. 300 tokens: the block
    mask (128-token blocks) skips whole blocks between documents.
    Ids shared by the batch for ALiBi only: which form the ids take changes the mask_mod and the block mask alone,
    which are the encoding's business in neither form (the score_mod reads (b, t) positions in both), so T5 with
    ids per sequence and ALiBi with both forms cover each part, and T5's shared form would cost one more compile."""
    torch.manual_seed(0)
    layer = CausalSelfAttention(32, 4, num_kv_heads=2, encoding=ENCODINGS[name]()).eval()
    x = torch.randn(2, 300, 32)
    rows = [torch.repeat_interleave(torch.arange(3), torch.tensor(n)) for n in ([130, 40, 130], [3, 250, 47])]
    for docs in (torch.stack(rows), rows[0][None])[: 2 if name == "alibi" else 1]:
        flex_calls.clear()
        with torch.no_grad():
            flexed = layer(x, document_ids=docs)
            materialized = _materialized(layer, monkeypatch, x, document_ids=docs)
            _, probs = layer(x, document_ids=docs, return_attention=True)
            alone = _materialized(layer, monkeypatch, x[:1, 170:], document_ids=None)
        assert flex_calls == [1]
        assert_close(flexed, materialized.double(), reduction=True)
        assert_close(flexed[:1, 170:], alone.double(), reduction=True)
        assert (probs[0, :, 170:, :170] == 0).all() and (probs[:, :, 130:170, :130] == 0).all() == (docs.shape[0] == 1)


@pytest.mark.parametrize("name", ["alibi", "t5-causal"])
def test_a_left_padded_chunked_prefill_keeps_its_pads_out_on_every_path(name, monkeypatch, compiled_flex, flex_calls):
    """A left-padded batch prefilled into a KVCache in two chunks: the second chunk's queries follow cached keys,
    whose document ids (kept by the cache) the compiled FlexAttention's block mask and the materialized mask read
    alike, and each row's text attends as that row alone, unpadded, in one call. The first chunk's flex kernel is
    test_document_ids_keep_documents_apart_on_every_path's (300 tokens, ids per row) and the second chunk's is
    test_attend_flex_keeps_documents_apart_for_queries_after_cached_keys's: inductor's cache serves each once made."""
    torch.manual_seed(0)
    layer = CausalSelfAttention(32, 4, num_kv_heads=2, encoding=ENCODINGS[name]()).eval()
    x = torch.randn(2, 350, 32)
    ids = torch.tensor([[0] * 13 + [1] * 337, [1] * 350])
    outs = []
    for flex in (True, False):
        cache = KVCache()
        with torch.no_grad(), monkeypatch.context() as materialize:
            if not flex:
                materialize.setattr(flex_bias, "CPU_MIN_SCORES", 2**62)
            first = layer(x[:, :300], document_ids=ids[:, :300], cache=cache)
            outs.append(torch.cat((first, layer(x[:, 300:], cache=cache)), dim=1))
    assert flex_calls == [1, 1]
    assert_close(outs[0], outs[1].double(), reduction=True)
    with torch.no_grad():
        alone = _materialized(layer, monkeypatch, x[:1, 13:])
    assert_close(outs[0][:1, 13:], alone.double(), reduction=True)


def _packed_chunk() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """q (2, 4, 50, 8), a view of (b, s, h, d); k, v (2, 4, 350, 8); document ids (2, 350) of three documents per row,
    with a boundary among the last 50 keys of each (320 and 343)."""
    torch.manual_seed(0)
    b, s, t, d = 2, 50, 350, 8
    q, k, v = torch.randn(b, s, 4, d).transpose(1, 2), torch.randn(b, 4, t, d), torch.randn(b, 4, t, d)
    lengths = ([100, 220, 30], [3, 340, 7])
    docs = torch.stack([torch.repeat_interleave(torch.arange(3), torch.tensor(n)) for n in lengths])
    return q, k, v, docs


def test_attend_flex_keeps_documents_apart_for_queries_after_cached_keys(compiled_flex):
    """attend_flex called directly with s < t and document ids (a layer whose KVCache keeps the keys' ids gets here
    too, as the left-padded prefill's second chunk does): the block mask places query i at key index t - s + i, per
    row, as the materialized mask does.
    Shapes and layout are those of test_a_left_padded_chunked_prefill_keeps_its_pads_out_on_every_path's second chunk
    (q a view of (b, s, h, d) as CausalSelfAttention makes it; k, v repeated for GQA, contiguous), whose flex kernel
    inductor's cache then serves; each row has a document boundary among the queries (320 and 343)."""
    encoding = ALiBi(4)
    q, k, v, docs = _packed_chunk()
    s, t = q.shape[2], k.shape[2]
    k_pos = positions_from_document_ids(docs)
    with torch.no_grad():
        got = flex_bias.attend_flex(q, k, v, encoding, k_pos[:, t - s :], k_pos, document_ids=docs)
        expected, _ = attend(q, k, v, causal_mask(s, t, q.device, docs), encoding.score_bias(k_pos[:, t - s :], k_pos))
    assert_close(got, expected.double(), reduction=True)


def test_attend_flex_names_more_queries_than_keys():
    """The queries are the last s of the t keys: with s > t the positions check compared shapes that do not broadcast,
    and torch's "The size of tensor a (7) must match the size of tensor b (2)" was the error."""
    q, k = torch.randn(1, 4, 7, 8), torch.randn(1, 4, 5, 8)
    with pytest.raises(ValueError, match=r"q has 7 queries but k has 5 keys: the queries must be the last s"):
        flex_bias.attend_flex(q, k, k, ALiBi(4), torch.arange(7)[None], torch.arange(5)[None])


def test_attend_flex_names_q_k_v_of_different_dtypes():
    """A float64 k was cast to q's float32 without a word."""
    q, k, pos = torch.randn(1, 4, 5, 8), torch.randn(1, 4, 5, 8), torch.arange(5)[None]
    for other in (k.double(), k.bfloat16()):
        with pytest.raises(TypeError, match=r"q, k and v must have one dtype .* got q torch\.float32, k torch"):
            flex_bias.attend_flex(q, other, other, ALiBi(4), pos, pos)


def test_attend_flex_is_float32_under_autocast_too(compiled_flex, flex_calls):
    """Autocast cast flex_attention's float32 q, k and v back to bf16, so a layer routed to FlexAttention (CUDA from
    1M scores, CPU inference from 16M) gave other numbers under autocast than outside it (max 0.016 at s = 128), and
    than the materialized path, which is float32 under autocast. Now the same bits inside autocast as outside.
    Every flex call here has test_packed_documents_get_one_semantics_on_every_path's shapes and layout (140 tokens,
    two kv heads; q a view of (b, s, h, d) as the layer makes it), whose kernel inductor's cache serves."""
    torch.manual_seed(0)
    layer = CausalSelfAttention(32, 4, num_kv_heads=2, encoding=ALiBi(4)).eval()
    x = torch.randn(1, 140, 32)
    with torch.no_grad():
        q = torch.randn(1, 140, 4, 8, dtype=torch.bfloat16).transpose(1, 2)
        k, v = (torch.randn(1, 4, 140, 8, dtype=torch.bfloat16) for _ in range(2))
        positions = torch.arange(140)[None]
        outside = flex_bias.attend_flex(q, k, v, layer.encoding, positions, positions)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            inside = flex_bias.attend_flex(q, k, v, layer.encoding, positions, positions)
            routed = layer(x)
        expected = layer.bfloat16()(x.bfloat16())  # the projections in bf16, as autocast runs them
    assert torch.equal(inside, outside)
    assert len(flex_calls) == 2 and torch.equal(routed, expected)


def test_flex_serves_several_lengths_and_position_forms(monkeypatch, compiled_flex, flex_calls):
    """Lengths, batch sizes, and shared then per-sequence positions in one process, each through the compiled
    kernel (a fallback would warn): with dynamic lengths on CPU, a call that switched the score_mod's form made a
    recompile that failed inside inductor, and static compiles once hit dynamo's limit and went unfused."""
    torch.manual_seed(0)
    layer = CausalSelfAttention(32, 4, num_kv_heads=2, encoding=ALiBi(4)).eval()
    x = torch.randn(2, 192, 32)
    per_sequence = torch.arange(192).repeat(2, 1) + torch.tensor([[0], [5]])
    # 140 tokens of one row are test_packed_documents_get_one_semantics_on_every_path's shapes: dynamo recompiles
    # for it here (the limit counts it), and inductor's cache serves the kernel compiled there. The length changes
    # with the batch size (140 -> 192) and within it (192 -> 150), and the positions' form at 192: one more length
    # of one row (157, a compile of its own) checked nothing these do not.
    calls = [(x[:1, :140], None), (x, None), (x, per_sequence), (x[:, :150], None)]
    with torch.no_grad():
        for routed, (inputs, positions) in enumerate(calls, start=1):
            flexed = layer(inputs, positions=positions)
            expected = _materialized(layer, monkeypatch, inputs, positions=positions)
            assert len(flex_calls) == routed
            assert_close(flexed, expected.double(), reduction=True)


def _flex_at_its_limit(monkeypatch) -> None:
    """Route every CPU call to FlexAttention, whose compiled kernel then fails as at dynamo's recompile limit."""
    from torch._dynamo.exc import FailOnRecompileLimitHit

    def at_the_limit(*args, **kwargs):
        raise FailOnRecompileLimitHit("recompile_limit reached")

    monkeypatch.setattr(flex_bias, "CPU_MIN_SCORES", 0)
    monkeypatch.setattr(flex_bias, "_GIVEN_UP", set())
    monkeypatch.setattr(flex_bias, "_flex", lambda device_type="cuda": at_the_limit)


def test_a_call_flex_cannot_serve_materializes_with_a_warning(monkeypatch):
    """Past dynamo's recompile limit torch would quietly run an unfused flex_attention that builds the scores;
    posenc turns that (and a failed compile) into a warning and the materialized path, with the same result, and
    stops trying on that device type."""
    torch.manual_seed(0)
    layer = CausalSelfAttention(32, 4, encoding=T5Bias(4)).eval()
    x = torch.randn(1, 140, 32)
    with torch.no_grad():
        expected = layer(x)
        _flex_at_its_limit(monkeypatch)
        # The cause is in the warning itself: a warning shows no exception chain.
        cause = r"FlexAttention cannot serve this call \(FailOnRecompileLimitHit: recompile_limit reached\)"
        with pytest.warns(UserWarning, match=cause):
            got = layer(x)
        assert not flex_bias.use_flex(layer.encoding, x[:, None], x[:, None], x[:, None], need_probs=False)
    torch.testing.assert_close(got, expected)


@pytest.mark.parametrize("name", ["alibi", "t5-causal"])
def test_a_compiled_layer_runs_flex_in_a_graph_of_its_own_on_cpu(name, monkeypatch, compiled_flex):
    """torch.compile of a whole layer: inductor's CPU flex lowering fails on q, k, v made in the same graph
    (NoValidChoicesError), so on CPU the flex call is a graph of its own, still compiled. Same output as the
    materialized eager layer; the compiled kernel ran (a fallback would warn, which the fixture fails on).
    The flex call's shapes are test_packed_documents_get_one_semantics_on_every_path's: inductor's cache serves its
    kernel, compiled there (the lowering failed on the caller's graph, whatever the batch)."""
    torch.manual_seed(0)
    layer = CausalSelfAttention(32, 4, num_kv_heads=2, encoding=ENCODINGS[name]()).eval()
    x = torch.randn(1, 140, 32)
    real_flex, calls = flex_bias._flex("cpu"), []

    def counted(*args, **kwargs):
        calls.append(1)
        return real_flex(*args, **kwargs)

    monkeypatch.setattr(flex_bias, "_flex", lambda device_type="cuda": counted)
    with torch.no_grad():
        got = torch.compile(layer)(x)
        expected = _materialized(layer, monkeypatch, x)
    assert calls == [1]
    assert_close(got, expected.double(), reduction=True)
    with torch.no_grad(), pytest.raises(Exception, match=r"raise posenc\.kernels\.flex_bias\.CPU_MIN_SCORES"):
        torch.compile(layer, fullgraph=True)(x[:, :130])


def test_a_layer_compiled_before_any_eager_call_warns_nothing_and_keeps_eager_calls_compiled(monkeypatch):
    """The flex lookup runs inside the caller's graph. As a functools.cache, dynamo traced through it with a warning
    that it might be silently wrong; a plain cache that the traced call filled left later eager calls an unfused
    flex_attention (with torch's warning). Compiled first, from an empty cache: no warning, the same output eager.
    The layer is test_a_compiled_layer_runs_flex_in_a_graph_of_its_own_on_cpu's (two kv heads), whose graphs
    inductor's cache then serves: what is checked here is dynamo's tracing of the lookup, not a new compile."""
    torch.manual_seed(0)
    torch._dynamo.reset()
    monkeypatch.setattr(flex_bias, "CPU_MIN_SCORES", 0)
    monkeypatch.setattr(flex_bias, "_GIVEN_UP", set())
    monkeypatch.setattr(flex_bias, "_FLEX", {})
    layer = CausalSelfAttention(32, 4, num_kv_heads=2, encoding=ALiBi(4)).eval()
    x = torch.randn(1, 140, 32)
    with torch.no_grad(), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        compiled = torch.compile(layer)(x)
        eager = layer(x)
        expected = _materialized(layer, monkeypatch, x)
    assert [str(w.message) for w in caught if issubclass(w.category, UserWarning)] == []
    assert not flex_bias._GIVEN_UP
    assert_close(compiled, expected.double(), reduction=True)
    assert_close(eager, expected.double(), reduction=True)


def test_a_compiled_layer_falls_back_to_unfused_flex_with_a_warning(monkeypatch):
    """Inside a caller's compiled graph there is no materialized path to fall back to: where the compiled kernel
    cannot serve, flex_attention's unfused math gives the same result, with a warning. The layer is
    test_a_compiled_layer_runs_flex_in_a_graph_of_its_own_on_cpu's (two kv heads), whose graphs around the flex call
    inductor's cache serves."""
    torch.manual_seed(0)
    torch._dynamo.reset()
    layer = CausalSelfAttention(32, 4, num_kv_heads=2, encoding=ALiBi(4)).eval()
    x = torch.randn(1, 140, 32)
    with torch.no_grad():
        expected = layer(x)
        _flex_at_its_limit(monkeypatch)
        with pytest.warns(UserWarning, match="runs FlexAttention unfused"):
            got = torch.compile(layer)(x)
    assert {"cpu"} == flex_bias._GIVEN_UP
    assert_close(got, expected.double(), reduction=True)


def test_causal_self_attention_routes_long_cpu_inference_to_flex(monkeypatch, flex_calls):
    """The compiled path, end to end: same output with and without FlexAttention."""
    torch.manual_seed(0)
    layer = CausalSelfAttention(32, 4, num_kv_heads=2, encoding=ALiBi(4)).eval()
    x = torch.randn(1, 140, 32)
    with torch.no_grad():
        materialized = layer(x)
        monkeypatch.setattr(flex_bias, "CPU_MIN_SCORES", 0)
        monkeypatch.setattr(flex_bias, "_GIVEN_UP", set())
        assert flex_bias.use_flex(layer.encoding, x[:, None], x[:, None], x[:, None], need_probs=False)
        assert flex_calls == []
        flexed = layer(x)
    assert flex_calls == [1]
    assert_close(flexed, materialized.double(), reduction=True)


def test_use_flex_rules():
    alibi = ALiBi(2)
    long = torch.randn(1, 2, 4096, 8)
    short = torch.randn(1, 2, 64, 8)
    with torch.no_grad():
        assert flex_bias.use_flex(alibi, long, long, long, need_probs=False)
        assert not flex_bias.use_flex(alibi, long, long, long, need_probs=True), "probabilities need the scores"
        assert not flex_bias.use_flex(alibi, short, short, short, need_probs=False), "short: materialize"
        assert not flex_bias.use_flex(torch.nn.Identity(), long, long, long, need_probs=False)
        step = long[:, :, -1:]
        assert not flex_bias.use_flex(alibi, step, long, long, need_probs=False), "decode: (h, 1, t) is small"
    assert not flex_bias.use_flex(alibi, long.double(), long, long, need_probs=False), "no compiled float64 flex"
    grad = long.clone().requires_grad_()
    assert not flex_bias.use_flex(alibi, grad, long, long, need_probs=False), "no FlexAttention backward on CPU"
    assert not flex_bias.use_flex(T5Bias(2), long, long, long, need_probs=False), "the T5 table needs grad"
    with pytest.raises(ValueError, match="only ALiBi and T5Bias"):
        flex_bias.attend_flex(short, short, short, torch.nn.Identity(), torch.arange(64)[None], torch.arange(64)[None])
    with pytest.raises(ValueError, match=r"k_positions must have shape \(b or 1, 64\) with b = 1, got \(1, 63\)"):
        flex_bias.attend_flex(short, short, short, alibi, torch.arange(64)[None], torch.arange(63)[None])
    with pytest.raises(ValueError, match="q_positions must be the last s columns of k_positions"):
        flex_bias.attend_flex(short, short, short, alibi, torch.arange(64)[None] + 1, torch.arange(64)[None])


@pytest.mark.parametrize("make", [ALiBi, T5Bias], ids=["alibi", "t5"])
def test_attend_flex_refuses_by_name_what_its_score_mod_would_misread(make):
    """The score_mod reads slopes[h] / table[bucket, h] and the key positions by index: an encoding of other heads
    gave q the first heads' bias silently (or indexed past the slopes in the compiled kernel), float positions gave
    ALiBi fractional distances, and ids of another batch met torch's expand."""
    torch.manual_seed(0)
    q = torch.randn(2, 4, 64, 8)
    ids = torch.arange(64)[None]
    with torch.no_grad():
        for heads in (8, 3):
            with pytest.raises(ValueError, match=rf"has num_heads={heads} but q has 4 heads \(dim 1\)"):
                flex_bias.attend_flex(q, q, q, make(heads), ids, ids)
        with pytest.raises(TypeError, match=r"q_positions must hold integer positions .* got dtype torch\.float32"):
            flex_bias.attend_flex(q, q, q, make(4), ids * 0.5, ids)
        with pytest.raises(ValueError, match=r"k_positions must have shape \(b or 1, 64\) with b = 2, got \(3, 64\)"):
            flex_bias.attend_flex(q, q, q, make(4), ids, ids.expand(3, 64))
        with pytest.raises(TypeError, match=r"document_ids must hold integer document ids"):
            flex_bias.attend_flex(q, q, q, make(4), ids, ids, document_ids=torch.zeros(1, 64))
        with pytest.raises(ValueError, match=r"document_ids must have shape \(b or 1, 64\) with b = 2"):
            flex_bias.attend_flex(q, q, q, make(4), ids, ids, document_ids=torch.zeros(3, 64, dtype=torch.long))
        with pytest.raises(ValueError, match=r"k and v must have q's batch and heads \(2, 4\).*repeat_interleave"):
            flex_bias.attend_flex(q, q[:, :2], q[:, :2], make(4), ids, ids)


def test_cpu_flex_takes_128_keys_or_more(monkeypatch):
    """Inductor's CPU FlexAttention gave wrong rows for fewer than 128 keys (t = 8 mod 16, in most fresh processes on
    an AVX2 host): a lowered CPU_MIN_SCORES still materializes those calls."""
    monkeypatch.setattr(flex_bias, "CPU_MIN_SCORES", 0)
    alibi = ALiBi(2)
    with torch.no_grad():
        for t, routed in ((8, False), (40, False), (127, False), (128, True), (136, True)):
            x = torch.randn(1, 2, t, 8)
            assert flex_bias.use_flex(alibi, x, x, x, need_probs=False) == routed, t
            assert flex_bias.use_flex(alibi, x[:, :, -5:], x, x, need_probs=False) == routed, t


def test_decode_steps_stay_materialized_even_when_flex_is_forced(monkeypatch):
    monkeypatch.setattr(flex_bias, "CPU_MIN_SCORES", 0)
    monkeypatch.setattr(attention, "attend_flex", lambda *a, **k: pytest.fail("a decode step went to FlexAttention"))
    layer = CausalSelfAttention(32, 4, encoding=ALiBi(4)).eval()
    x = torch.randn(1, 8, 32)
    cache = KVCache()
    with torch.no_grad():
        layer(x[:, :1], cache=cache)
        for i in range(1, 8):
            layer(x[:, i : i + 1], cache=cache)


class _LogALiBi(ALiBi):
    """A user's variant: -slope * log(1 + |m - n|), ALiBi's slopes with its own score_bias."""

    def score_bias(self, q_positions, k_positions):
        slopes = self.head_slopes().float()[None, :, None, None]
        return -slopes * torch.log1p(-super().score_bias(q_positions, k_positions) / slopes)


class _ShiftedT5(T5Bias):
    def score_bias(self, q_positions, k_positions):
        return super().score_bias(q_positions, k_positions) + 1.0


class _ParityBucketT5(T5Bias):
    """A user's own bucketing, through T5Bias.score_bias: t5_score_mod computes T5's buckets, not these."""

    def buckets(self, q_positions, k_positions):
        return super().buckets(q_positions, k_positions) % 2


def _with_doubled_score_bias(encoding):
    """The encoding with score_bias replaced on the instance (an experiment's patch), not in a subclass."""
    plain = encoding.score_bias
    encoding.score_bias = lambda q_positions, k_positions: 2 * plain(q_positions, k_positions)
    return encoding


class _LoraTable(nn.Module):
    """What peft's LoRA does to an nn.Embedding: the base weight exposed as .weight, a low-rank delta in forward."""

    def __init__(self, base: nn.Embedding, rank: int = 2) -> None:
        super().__init__()
        self.base_layer = base
        # Deterministic, and different per bucket (a delta equal for every key would not change the softmax).
        self.lora_a = nn.Parameter(torch.linspace(-1.0, 1.0, rank * base.num_embeddings).view(rank, -1))
        self.lora_b = nn.Parameter(torch.full((base.embedding_dim, rank), 0.5))

    @property
    def weight(self) -> torch.Tensor:
        return self.base_layer.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.base_layer(ids) + F.embedding(ids, (self.lora_b @ self.lora_a).T)


def _with_lora_table(encoding: T5Bias) -> T5Bias:
    encoding.table = _LoraTable(encoding.table)
    return encoding


@pytest.mark.parametrize(
    "encoding",
    [
        _LogALiBi(4),
        _ShiftedT5(4),
        _ParityBucketT5(4),
        _with_doubled_score_bias(ALiBi(4)),
        _with_lora_table(T5Bias(4)),
    ],
    ids=["alibi-subclass", "t5-subclass", "t5-buckets-subclass", "alibi-instance-score-bias", "t5-lora-table"],
)
def test_a_subclass_with_its_own_score_bias_is_attended_with_it(encoding, monkeypatch, flex_calls):
    """FlexAttention's score_mods compute ALiBi's and T5's formulas: a subclass that overrides score_bias was
    attended there with its parent's bias (a log-distance ALiBi came out as plain ALiBi, off by 0.23) once a call
    was long enough for FlexAttention. It is materialized from its own score_bias at every length."""
    torch.manual_seed(0)
    layer = CausalSelfAttention(32, 4, encoding=encoding).eval()
    x = torch.randn(1, 64, 32)
    with torch.no_grad():
        expected = _materialized(layer, monkeypatch, x)
        monkeypatch.setattr(flex_bias, "CPU_MIN_SCORES", 0)
        monkeypatch.setattr(flex_bias, "_GIVEN_UP", set())
        got = layer(x)
    assert flex_calls == []
    assert flex_bias.score_mod_for(encoding, torch.arange(64)[None], 0) is None
    assert_close(got, expected)


# In a process of its own: a one-rank gloo world (the process group is global to the process).
DTENSOR_IDS = textwrap.dedent(
    """
    import sys, torch, torch.distributed as dist, posenc
    from safetensors.torch import load_file
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor
    from posenc.kernels import flex_bias
    from posenc.positions import positions_from_document_ids

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    mesh = init_device_mesh("cpu", (1,))
    case = load_file(sys.argv[1])
    q, k, v, docs = case["q"].transpose(1, 2), case["k"], case["v"], case["docs"]
    s, t = q.shape[2], k.shape[2]
    k_pos = positions_from_document_ids(docs)
    with torch.no_grad():
        want = flex_bias.attend_flex(q, k, v, posenc.ALiBi(4), k_pos[:, t - s :], k_pos, document_ids=docs)
        given = (distribute_tensor(x, mesh, [Shard(1)]) for x in (k_pos[:, t - s :], k_pos, docs))
        q_ids, k_ids, doc_ids = given
        got = flex_bias.attend_flex(q, k, v, posenc.ALiBi(4), q_ids, k_ids, document_ids=doc_ids)
    assert type(got) is torch.Tensor and torch.equal(got, want), (got - want).abs().max()
    # A DTensor k or v beside a plain q is refused by name too, as a DTensor q is.
    for i in (1, 2):
        given = [q, k, v]
        given[i] = distribute_tensor(given[i], mesh, [Replicate()])
        try:
            flex_bias.attend_flex(*given, posenc.ALiBi(4), k_pos[:, t - s :], k_pos)
        except ValueError as error:
            assert "not DTensors" in str(error), error
        else:
            raise AssertionError(f"a DTensor {'qkv'[i]} beside a plain q was not refused")
    dist.destroy_process_group()
    print("ok")
    """
)


def test_attend_flex_reads_dtensor_ids_beside_plain_qkv_whole(tmp_path):
    """attend_flex refused DTensor q, k, v by name, but DTensor position and document ids beside plain q, k, v (read
    whole everywhere else in posenc) failed inside torch: "aten.bitwise_and.Tensor got mixed torch.Tensor and
    DTensor" in the ids' check, then Dynamo's fake run of the score_mod. Now read whole: the plain ids' output. A
    DTensor k or v beside a plain q is refused by name too."""
    q, k, v, docs = _packed_chunk()
    case = tmp_path / "case.safetensors"
    save_file({"q": q.transpose(1, 2).contiguous(), "k": k, "v": v, "docs": docs}, str(case))
    done = subprocess.run([sys.executable, "-c", DTENSOR_IDS, str(case)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.strip() == "ok", (done.returncode, done.stderr[-2000:])
