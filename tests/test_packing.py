"""Packed documents: document ids, the position and cu_seqlens forms they convert to, and attention that keeps
each document to itself. The defining property: a packed row gives each document what it gives run alone."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers.masking_utils import find_packed_sequence_indices

import posenc
from posenc import CausalSelfAttention, KVCache, add_input_encoding
from posenc.attention import attend, causal_mask
from posenc.lab.model import ByteLM, ModelSpec
from posenc.positions import resolve_document_ids
from posenc.testing import attention_reference

DIM, HEADS, KV_HEADS, HEAD_DIM = 32, 4, 2, 8

lengths_strategy = st.lists(st.integers(1, 9), min_size=1, max_size=5)


def make_encoding(name: str) -> torch.nn.Module:
    return posenc.build_for_model(name, dim=DIM, num_heads=HEADS, head_dim=HEAD_DIM, max_positions=64).double()


def layer_for(encoding: torch.nn.Module) -> CausalSelfAttention:
    inside = None if encoding.acts_on is posenc.ActsOn.INPUT else encoding
    return CausalSelfAttention(DIM, HEADS, num_kv_heads=KV_HEADS, encoding=inside).double()


def ids_for(lengths: list[int]) -> torch.Tensor:
    return torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))


# ---- the conversions


@given(lengths=st.lists(st.integers(1, 9), min_size=1, max_size=6), start=st.integers(0, 3))
def test_document_ids_from_positions_is_hugging_faces_rule(lengths, start):
    """Packed position ids (each document from 0, the first from ``start``) give back the documents, as
    transformers' find_packed_sequence_indices finds them; and the documents give back the positions."""
    positions = torch.cat([torch.arange(n) for n in lengths])
    positions[: lengths[0]] += start
    docs = posenc.document_ids_from_positions(positions[None])
    expected = find_packed_sequence_indices(positions[None])
    torch.testing.assert_close(docs, torch.zeros_like(docs) if expected is None else expected)
    torch.testing.assert_close(docs[0], ids_for(lengths))
    shifted = positions.clone()
    shifted[: lengths[0]] -= start
    torch.testing.assert_close(posenc.positions_from_document_ids(docs[0]), shifted)


@given(documents=st.lists(st.tuples(st.integers(1, 9), st.integers(0, 20)), min_size=1, max_size=6))
def test_documents_that_do_not_start_at_zero_are_split_by_hugging_faces_rule(documents):
    """Any step other than +1 starts a document, a jump forward included (transformers' rule, its own function as
    the oracle); only a document that happens to continue the last one's count merges with it."""
    positions = torch.cat([torch.arange(start, start + n) for n, start in documents])
    docs = posenc.document_ids_from_positions(positions[None])
    expected = find_packed_sequence_indices(positions[None])
    torch.testing.assert_close(docs, torch.zeros_like(docs) if expected is None else expected)
    jump = torch.tensor([[0, 1, 2, 5, 6, 7]])
    torch.testing.assert_close(posenc.document_ids_from_positions(jump), torch.tensor([[0, 0, 0, 1, 1, 1]]))


@given(lengths=st.lists(st.integers(0, 6), min_size=1, max_size=6))
def test_document_ids_from_cu_seqlens(lengths):
    cu_seqlens = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    docs = posenc.document_ids_from_cu_seqlens(cu_seqlens)
    expected = torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)])
    torch.testing.assert_close(docs, expected)
    # An empty sequence takes no tokens and its id is skipped; positions still restart at every other one.
    torch.testing.assert_close(posenc.positions_from_document_ids(docs), torch.cat([torch.arange(n) for n in lengths]))


def test_positions_from_document_ids_keeps_batch_rows_apart():
    docs = torch.tensor([[0, 0, 1, 1, 1], [3, 4, 4, 4, 4]])
    torch.testing.assert_close(
        posenc.positions_from_document_ids(docs), torch.tensor([[0, 1, 0, 1, 2], [0, 0, 1, 2, 3]])
    )


def test_document_ids_in_any_order_count_as_the_ordered_ones():
    """Ids need only be one run each, in any order (as Hugging Face's packed masks take them): descending or
    shuffled ids give the positions and the attention that 0, 1, 2, ... give."""
    docs = torch.tensor([[2, 2, 0, 0, 0, 1], [5, 3, 3, 4, 4, 4]])
    ordered = torch.tensor([[0, 0, 1, 1, 1, 2], [0, 1, 1, 2, 2, 2]])
    expected = torch.tensor([[0, 1, 0, 1, 2, 0], [0, 0, 1, 0, 1, 2]])
    assert torch.equal(posenc.positions_from_document_ids(docs), expected)
    assert torch.equal(posenc.positions_from_document_ids(ordered), expected)
    torch.manual_seed(0)
    attn = layer_for(make_encoding("alibi"))
    x = torch.randn(2, 6, DIM, dtype=torch.float64)
    assert torch.equal(attn(x, document_ids=docs), attn(x, document_ids=ordered))


# ---- attention


@pytest.mark.parametrize("name", posenc.available())
@settings(max_examples=15, deadline=None)
@given(lengths=lengths_strategy, data=st.data())
def test_a_packed_row_gives_each_document_what_it_gives_alone(name, lengths, data):
    """Every encoding: documents packed into rows (two rows of their own lengths) attend within themselves and
    start at position 0, bit for bit as the same documents run one per call, to float64 rounding."""
    torch.manual_seed(0)
    encoding = make_encoding(name)
    attn = layer_for(encoding)
    other = data.draw(lengths_strategy)
    rows = [lengths, other]
    total = max(sum(lengths), sum(other))
    rows = [[*row, total - sum(row)] if sum(row) < total else row for row in rows]  # pad each row to one length
    xs = [[torch.randn(1, n, DIM, dtype=torch.float64) for n in row] for row in rows]
    alone = [
        torch.cat([attn(add_input_encoding(x, encoding, torch.arange(x.shape[1])[None])) for x in row], dim=1)
        for row in xs
    ]
    docs = torch.stack([ids_for(row) for row in rows])
    positions = posenc.positions_from_document_ids(docs)
    x = torch.cat([torch.cat(row, dim=1) for row in xs])
    packed, probs = attn(add_input_encoding(x, encoding, positions), document_ids=docs, return_attention=True)
    torch.testing.assert_close(packed, torch.cat(alone), atol=1e-12, rtol=1e-12)
    # No probability crosses a document, and the path without probabilities agrees.
    assert not probs.masked_select(~causal_mask(total, total, x.device, docs)).any()
    fast = attn(add_input_encoding(x, encoding, positions), document_ids=docs)
    torch.testing.assert_close(fast, packed, atol=1e-12, rtol=1e-12)


def test_positions_restart_at_each_document_where_an_encoding_can_tell():
    """Relative encodings give the same scores whether positions restart at each document or run on through the
    row; dynamic NTK does not: it scales for the largest position + 1. Two documents of 6 tokens with a trained
    length of 8 are each unscaled, as alone, though the row of 12 is past it."""
    torch.manual_seed(0)
    rope = posenc.RoPE(HEAD_DIM, rope_parameters={"rope_type": "dynamic", "factor": 2.0}, max_position_embeddings=8)
    attn = CausalSelfAttention(DIM, HEADS, encoding=rope).double()
    x = torch.randn(1, 12, DIM, dtype=torch.float64)
    alone = torch.cat([attn(x[:, :6]), attn(x[:, 6:])], dim=1)
    docs = ids_for([6, 6])[None]
    torch.testing.assert_close(attn(x, document_ids=docs), alone, atol=1e-12, rtol=1e-12)
    # Positions that run on through the row (given as such) scale both documents for 12.
    assert (attn(x, document_ids=docs, positions=torch.arange(12)) - alone).abs().max() > 1e-3


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_attend_with_document_mask_matches_the_float64_reference(dtype):
    """attend with a document mask against attention_reference run per document, with and without a bias."""
    torch.manual_seed(0)
    lengths = [7, 1, 12]
    b, h, s, d = 2, 4, sum(lengths), 16
    q, k, v = (torch.randn(b, h, s, d, dtype=torch.float64) for _ in range(3))
    bias = torch.randn(1, h, s, s, dtype=torch.float64)
    docs = ids_for(lengths)[None]
    for with_bias in (None, bias):
        expected = torch.zeros_like(q)
        start = 0
        for n in lengths:
            part = slice(start, start + n)
            sub_bias = None if with_bias is None else with_bias[..., part, part]
            expected[:, :, part] = attention_reference(q[:, :, part], k[:, :, part], v[:, :, part], bias=sub_bias)
            start += n
        got, _ = attend(
            q.to(dtype), k.to(dtype), v.to(dtype), causal_mask(s, s, q.device, docs), with_bias, need_probs=False
        )
        tolerance = {torch.float32: 1e-5, torch.bfloat16: 3e-2}[dtype]
        torch.testing.assert_close(got.double(), expected, atol=tolerance, rtol=tolerance)


@pytest.mark.parametrize("name", posenc.available())
def test_byte_lm_packs_documents(name):
    """The lab model with document_ids: each document's logits as when it is the whole input, in two rows packed
    differently, and the gradients of a loss over them as those of the documents run one by one (an absolute
    encoding restarts at each document too)."""
    torch.manual_seed(0)
    model = ByteLM(ModelSpec(dim=32, layers=2, heads=4, max_positions=32), name).double()
    rows = [[11, 3, 16], [1, 20, 9]]
    tokens = torch.randint(0, 256, (2, 30))
    packed, _ = model(tokens, document_ids=torch.stack([ids_for(row) for row in rows]))
    packed.square().mean().backward()
    grads = {key: param.grad for key, param in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    alone = torch.cat(
        [
            torch.cat([model(part)[0] for part in row_tokens.split(row, dim=1)], dim=1)
            for row_tokens, row in zip(tokens.split(1), rows, strict=True)
        ]
    )
    alone.square().mean().backward()
    torch.testing.assert_close(packed, alone, atol=1e-12, rtol=1e-12)
    for key, param in model.named_parameters():
        torch.testing.assert_close(grads[key], param.grad, atol=1e-12, rtol=1e-10, msg=key)


@pytest.mark.parametrize("name", ["rope", "alibi", "t5"])
def test_positions_given_with_document_ids_are_used_as_given(name):
    """Explicit positions win over the ones document ids imply (for documents that continue earlier text): a
    document shifted as a whole attends alike (these encodings are relative), one stretched does not."""
    torch.manual_seed(0)
    attn = layer_for(make_encoding(name))
    x = torch.randn(1, 10, DIM, dtype=torch.float64)
    docs = ids_for([4, 6])
    implied = attn(x, document_ids=docs)
    same = attn(x, document_ids=docs, positions=posenc.positions_from_document_ids(docs))
    torch.testing.assert_close(same, implied, atol=0, rtol=0)
    shifted = attn(x, document_ids=docs, positions=torch.arange(10))
    torch.testing.assert_close(shifted, implied, atol=1e-12, rtol=1e-12)
    stretched = attn(x, document_ids=docs, positions=5 * posenc.positions_from_document_ids(docs))
    alone = attn(x[:, 4:], positions=5 * torch.arange(6))
    torch.testing.assert_close(stretched[:, 4:], alone, atol=1e-12, rtol=1e-12)
    assert not torch.allclose(stretched[:, 4:], implied[:, 4:])


def test_length_scaled_rope_scales_a_packed_call_for_its_longest_document():
    """The documented exception: dynamic NTK (as in transformers) scales for the call's largest position + 1, so a
    short document packed beside a long one turns as it would alone at the long one's length."""
    parameters = {"rope_type": "dynamic", "factor": 2.0}
    # 'consistent': each call scales for itself ('hf' would also keep the largest length seen for later calls).
    rope = posenc.RoPE(8, rope_parameters=parameters, max_position_embeddings=8, mode="consistent")
    q = torch.randn(1, 2, 24, 8, dtype=torch.float64)
    positions = posenc.positions_from_document_ids(ids_for([4, 20]))
    packed, _ = rope(q, q, positions=positions)
    as_long, _ = rope(q[:, :, :4], q[:, :, :4], seq_len=20)
    short, _ = rope(q[:, :, :4], q[:, :, :4])
    torch.testing.assert_close(packed[:, :, :4], as_long, atol=0, rtol=0)
    assert not torch.allclose(packed[:, :, :4], short)


def test_document_ids_compile_with_fullgraph():
    """No host read of the ids under torch.compile(fullgraph=True): the one-run-per-id check runs in the graph."""
    torch.manual_seed(0)
    attn = CausalSelfAttention(DIM, HEADS, encoding=make_encoding("rope").float()).eval()
    x = torch.randn(1, 12, DIM)
    docs = ids_for([5, 7])
    compiled = torch.compile(lambda x, d: attn(x, document_ids=d), fullgraph=True, backend="aot_eager")
    with torch.no_grad():
        torch.testing.assert_close(compiled(x, docs), attn(x, document_ids=docs))
        torch.testing.assert_close(compiled(x, docs.flip(0)), attn(x, document_ids=docs.flip(0)))  # ids in any order
        with pytest.raises(RuntimeError, match="document_ids must give each document one run of tokens"):
            compiled(x, torch.tensor([0, 0, 1, 1, 1, 0, 0, 1, 1, 1, 1, 1]))


# ---- left padding with a KV cache


def _padded_cache_layer(name: str) -> tuple[torch.nn.Module, CausalSelfAttention]:
    if name == "rope-consistent-dynamic":
        dynamic = {"rope_type": "dynamic", "factor": 2.0}
        encoding = posenc.RoPE(HEAD_DIM, rope_parameters=dynamic, max_position_embeddings=64, mode="consistent")
        return encoding, layer_for(encoding.double())
    encoding = make_encoding(name)
    return encoding, layer_for(encoding)


@pytest.mark.parametrize("name", [*posenc.available(), "rope-consistent-dynamic"])
@settings(max_examples=10, deadline=None)
@given(
    prompts=st.lists(st.integers(1, 6), min_size=1, max_size=3),
    steps=st.lists(st.tuples(st.integers(1, 3), st.booleans()), min_size=1, max_size=4),
    data=st.data(),
)
def test_a_left_padded_batch_decodes_each_row_as_alone(name, prompts, steps, data):
    """Every encoding, grouped-query heads: prompts of different lengths left-padded with garbage (id 0, the text
    id 1, as transformers' attention_mask), prefilled into a KVCache and decoded in chunks (with the ids given
    again or left to continue the row's document), then a draft cropped off and decoded again, give each row what
    the row alone gives in one call without padding or cache, to float64 rounding."""
    torch.manual_seed(0)
    encoding, attn = _padded_cache_layer(name)
    longest, new = max(prompts), sum(n for n, _ in steps)
    texts = [torch.randn(1, n + new, DIM, dtype=torch.float64) for n in prompts]
    alone = torch.cat([attn(add_input_encoding(x, encoding, torch.arange(x.shape[1])[None]))[:, -new:] for x in texts])
    alone_prompts = [
        attn(add_input_encoding(x[:, :n], encoding, torch.arange(n)[None])) for x, n in zip(texts, prompts, strict=True)
    ]
    pads = torch.randn(len(prompts), longest, DIM, dtype=torch.float64) * 3
    x = torch.cat(
        [
            torch.cat((pads[i : i + 1, : longest - n], t[:, :n]), dim=1)
            for i, (t, n) in enumerate(zip(texts, prompts, strict=True))
        ]
    )
    ids = (torch.arange(longest)[None] >= longest - torch.tensor(prompts)[:, None]).long()

    def step(cache: KVCache, x: torch.Tensor, ids: torch.Tensor | None) -> torch.Tensor:
        positions = cache.next_positions(x.shape[1], document_ids=ids)  # for the input encodings, taken before
        return attn(add_input_encoding(x, encoding, positions), document_ids=ids, cache=cache)

    cache = KVCache()
    prefill = step(cache, x, ids)
    for row, (n, expected) in enumerate(zip(prompts, alone_prompts, strict=True)):
        torch.testing.assert_close(prefill[row : row + 1, longest - n :], expected, atol=1e-12, rtol=1e-12)
    decoded, done = [], 0
    for size, give_ids in steps:
        chunk = torch.cat([t[:, n + done : n + done + size] for t, n in zip(texts, prompts, strict=True)])
        decoded.append(step(cache, chunk, torch.ones(len(prompts), size, dtype=torch.long) if give_ids else None))
        done += size
    torch.testing.assert_close(torch.cat(decoded, dim=1), alone, atol=1e-12, rtol=1e-12)
    # A rejected draft: crop the last chunk and decode it again, token by token.
    size = steps[-1][0]
    cache.crop(-size)
    assert cache.document_ids.shape[1] == cache.length
    chunk = torch.cat([t[:, n + new - size :] for t, n in zip(texts, prompts, strict=True)])
    again = torch.cat([step(cache, chunk[:, i : i + 1], None) for i in range(size)], dim=1)
    torch.testing.assert_close(again, alone[:, new - size :], atol=1e-12, rtol=1e-12)


def test_a_left_padded_consistent_rope_scales_for_the_batch_and_keeps_its_pads_out():
    """'consistent' dynamic NTK past its original length: every step rotates the whole batch's keys for the
    batch's largest position + 1 (as transformers scales a padded batch), so each cached step equals a full
    forward of the padded batch so far, its pads kept out by the ids; the longest row equals itself alone."""
    torch.manual_seed(0)
    dynamic = {"rope_type": "dynamic", "factor": 2.0}
    rope = posenc.RoPE(HEAD_DIM, rope_parameters=dynamic, max_position_embeddings=4, mode="consistent")
    attn = layer_for(rope.double())
    x = torch.randn(2, 9, DIM, dtype=torch.float64)
    ids = torch.tensor([[0, 0, 0, 1, 1, 1, 1, 1, 1], [1] * 9])
    cache = KVCache()
    steps = [attn(x[:, :6], document_ids=ids[:, :6], cache=cache)[:, -1:]]
    steps += [attn(x[:, i : i + 1], cache=cache) for i in range(6, 9)]
    full = [attn(x[:, :i], document_ids=ids[:, :i])[:, -1:] for i in range(6, 10)]
    torch.testing.assert_close(torch.cat(steps, dim=1), torch.cat(full, dim=1), atol=1e-12, rtol=1e-12)
    alone = torch.cat([attn(x[1:, :i])[:, -1:] for i in range(6, 10)], dim=1)
    torch.testing.assert_close(torch.cat(steps, dim=1)[1:], alone, atol=1e-12, rtol=1e-12)


LENGTH_SCALED = {
    "dynamic": {"rope_type": "dynamic", "factor": 2.0},
    "longrope": {
        "rope_type": "longrope",
        "short_factor": [1.0, 1.2, 1.5, 2.0],
        "long_factor": [2.0, 3.0, 6.0, 9.0],
        "original_max_position_embeddings": 8,
    },
}


@pytest.mark.parametrize("mode", ["hf", "consistent"])
@pytest.mark.parametrize("rope_type", ["dynamic", "longrope"])
def test_a_left_padded_batch_scales_for_its_longest_text_with_its_pads_at_position_0(rope_type, mode):
    """The pads are a document of their own, at positions 0..p-1 by default, so a pad run longer than every row's
    text scaled the batch for it: rows whose text fits the trained length (8) got other frequencies than alone
    (dynamic NTK, and LongRoPE's long factors). transformers' generate puts every pad at 0; positions so, (ids.
    cumsum(-1) - 1).clamp(min=0) as README.md says, scale for the longest text, in one call or chunk by chunk, and
    decoding goes on from each row's last position, the longest row as alone."""

    def layer() -> CausalSelfAttention:
        torch.manual_seed(0)
        rope = posenc.RoPE(HEAD_DIM, rope_parameters=LENGTH_SCALED[rope_type], max_position_embeddings=8, mode=mode)
        return CausalSelfAttention(DIM, HEADS, num_kv_heads=KV_HEADS, encoding=rope).double()

    pads = (11, 7)  # of 14 tokens: texts of 3 and 7
    x = torch.randn(2, 14, DIM, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    ids = (torch.arange(14)[None] >= torch.tensor(pads)[:, None]).long()
    positions = (ids.cumsum(-1) - 1).clamp(min=0)
    assert positions[0].tolist() == [0] * 12 + [1, 2] and positions[1].tolist() == [0] * 8 + [1, 2, 3, 4, 5, 6]
    alone = [layer()(x[row : row + 1, pad:]) for row, pad in enumerate(pads)]
    padded = layer()(x, document_ids=ids)  # the pads' 11 positions count: past 8
    assert (padded[:1, pads[0] :] - alone[0]).abs().max() > 1e-5
    for cut in ([14], [5, 6, 3]):  # the whole prompt in one call, and in chunks
        attn, cache, start, chunks = layer(), KVCache(), 0, []
        for size in cut:
            end = start + size
            chunks.append(
                attn(x[:, start:end], document_ids=ids[:, start:end], positions=positions[:, start:end], cache=cache)
            )
            start = end
        prefill = torch.cat(chunks, dim=1)
        for row, pad in enumerate(pads):
            torch.testing.assert_close(prefill[row : row + 1, pad:], alone[row], atol=1e-12, rtol=1e-12)
    more = torch.randn(2, 3, DIM, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    for i in range(3):  # the longest row to 8, 9, 10 tokens: past 8 from the second step on
        step = attn(more[:, i : i + 1], cache=cache)
        if mode == "consistent" or i == 0:  # 'hf' keeps cached keys at the frequencies they were rotated with
            full = layer()(torch.cat((x[1:, pads[1] :], more[1:, : i + 1]), dim=1))[:, -1:]
            torch.testing.assert_close(step[1:], full, atol=1e-12, rtol=1e-12)
    assert torch.equal(cache.positions[:, -1], torch.tensor([5, 9]))


def test_a_step_may_start_a_new_document_in_the_cache():
    """Ids given at a step that differ from the row's last cached id start a document there: its tokens restart
    at position 0 and see only each other, as the same document run alone."""
    torch.manual_seed(0)
    attn = layer_for(make_encoding("rope"))
    x = torch.randn(1, 7, DIM, dtype=torch.float64)
    cache = KVCache()
    attn(x[:, :4], document_ids=torch.zeros(1, 4, dtype=torch.long), cache=cache)
    assert torch.equal(cache.next_positions(3, document_ids=torch.tensor([0, 5, 5])), torch.tensor([[4, 0, 1]]))
    out = attn(x[:, 4:], document_ids=torch.tensor([0, 5, 5]), cache=cache)
    torch.testing.assert_close(out[:, 1:], attn(x[:, 5:]), atol=1e-12, rtol=1e-12)
    torch.testing.assert_close(out[:, :1], attn(x[:, :5])[:, 4:], atol=1e-12, rtol=1e-12)
    assert torch.equal(cache.positions, torch.tensor([[0, 1, 2, 3, 4, 0, 1]]))


def test_one_row_of_step_ids_continues_each_cached_row_by_its_own_last_document():
    """Step ids (s,) for a cache of 2 rows apply to both: a row whose last cached token is of that document
    continues its positions, the other starts the document at 0."""
    attn = layer_for(make_encoding("rope"))
    cache = KVCache()
    attn(torch.randn(2, 3, DIM, dtype=torch.float64), document_ids=torch.tensor([[0, 0, 0], [0, 1, 1]]), cache=cache)
    assert torch.equal(cache.next_positions(2, document_ids=torch.tensor([1, 1])), torch.tensor([[0, 1], [2, 3]]))


# ---- errors


def test_document_ids_on_a_cache_filled_without_them_are_refused():
    """The cached keys' documents are unknown: guessing would attend to padding or hide text."""
    attn = layer_for(make_encoding("rope"))
    cache = KVCache()
    attn(torch.randn(1, 4, DIM, dtype=torch.float64), cache=cache)
    with pytest.raises(ValueError, match=r"holds 4 tokens filled without document_ids.*from the first step on"):
        attn(torch.randn(1, 1, DIM, dtype=torch.float64), document_ids=torch.ones(1, 1, dtype=torch.long), cache=cache)
    with pytest.raises(ValueError, match=r"filled without document_ids"):
        cache.next_positions(1, document_ids=torch.ones(1, 1, dtype=torch.long))
    assert cache.length == 4 and cache.document_ids is None


def test_document_ids_with_a_cache_are_checked_against_it():
    """Step ids of the wrong shape, and an id that comes back after the cache moved on to another, are named
    errors that leave the cache as it was."""
    attn = layer_for(make_encoding("alibi"))
    cache = KVCache()
    attn(
        torch.randn(2, 4, DIM, dtype=torch.float64),
        document_ids=torch.tensor([[0, 0, 1, 1], [1, 1, 1, 1]]),
        cache=cache,
    )
    step = torch.randn(2, 1, DIM, dtype=torch.float64)
    with pytest.raises(ValueError, match=r"document_ids must have shape \(1,\) or \(2, 1\)"):
        attn(step, document_ids=torch.ones(2, 2, dtype=torch.long), cache=cache)
    with pytest.raises(ValueError, match=r"one run of tokens"):
        attn(step, document_ids=torch.tensor([[0], [1]]), cache=cache)
    k = torch.randn(2, KV_HEADS, 1, HEAD_DIM, dtype=torch.float64)
    with pytest.raises(ValueError, match=r"document_ids must be \(b or 1, s\) = \(2 or 1, 1\)"):
        cache.update(k, k, torch.tensor([[4]]), document_ids=torch.ones(3, 1, dtype=torch.long))
    with pytest.raises(ValueError, match=r"document_ids are the cached keys' ids"):
        KVCache(document_ids=torch.zeros(1, 4, dtype=torch.long))
    assert cache.length == 4 and torch.equal(cache.document_ids, torch.tensor([[0, 0, 1, 1], [1, 1, 1, 1]]))


@pytest.mark.parametrize(
    ("ids", "error", "message"),
    [
        (torch.tensor([0, 1, 1, 0]), ValueError, r"each document one run of tokens.*document_ids_from_positions"),
        (torch.zeros(5, dtype=torch.long), ValueError, r"document_ids must have shape \(4,\) or \(2, 4\).*got \(5,\)"),
        (torch.zeros(3, 4, dtype=torch.long), ValueError, r"shape \(4,\) or \(2, 4\).*got \(3, 4\)"),
        (torch.zeros(4), TypeError, r"document_ids must hold integer document ids \(torch.long"),
        ([0, 0, 1, 1], TypeError, r"document_ids must be an integer torch.Tensor, got list"),
    ],
)
def test_bad_document_ids_are_clear_errors(ids, error, message):
    with pytest.raises(error, match=message):
        resolve_document_ids(ids, batch=2, seq_len=4)
    attn = layer_for(make_encoding("alibi"))
    with pytest.raises(error, match=message):
        attn(torch.randn(2, 4, DIM, dtype=torch.float64), document_ids=ids)


def test_ids_without_a_sequence_dimension_are_clear_errors():
    for convert in (posenc.positions_from_document_ids, posenc.document_ids_from_positions):
        with pytest.raises(ValueError, match=r"must have a sequence dimension, \(s,\) or \(b, s\), got a 0-d"):
            convert(torch.tensor(3))


def test_causal_mask_takes_one_row_of_ids():
    docs = ids_for([2, 3])
    mask = causal_mask(5, 5, docs.device, docs)
    assert torch.equal(mask, causal_mask(5, 5, docs.device, docs[None]))
    assert mask.shape == (1, 1, 5, 5) and mask[0, 0].sum() == 3 + 6
    # Fewer queries than keys: the queries are the last tokens, and their rows of the full mask.
    assert torch.equal(causal_mask(2, 5, docs.device, docs), mask[..., 3:, :])


@pytest.mark.parametrize(
    ("cu_seqlens", "message"),
    [
        (torch.tensor([1, 3]), r"cu_seqlens must start at 0.*got 1"),
        (torch.tensor([0, 4, 2]), r"non-decreasing.*entry 2 \(2\) is below entry 1 \(4\)"),
        (torch.tensor([0, 3, 2, 5]), r"non-decreasing.*entry 2 \(2\) is below entry 1 \(3\)"),
        (torch.tensor([0]), r"cu_seqlens must hold n_seq \+ 1 >= 2 prefix sums .*got shape \(1,\)"),
        (torch.tensor([0, 4], device="meta"), "cu_seqlens is on the meta device, which holds no values"),
    ],
)
def test_bad_cu_seqlens_are_clear_errors(cu_seqlens, message):
    with pytest.raises(ValueError, match=message):
        posenc.document_ids_from_cu_seqlens(cu_seqlens)


def test_resolve_positions_forms_and_dtype() -> None:
    """One offset (1,) for a batch of 2 applies to both rows; the result is int64 whatever the ids' dtype (an int32
    result would wrap past 2**31)."""
    from posenc.positions import resolve_positions

    assert resolve_positions(4, batch=2, offset=torch.tensor([3])).tolist() == [[3, 4, 5, 6]]
    # One offset per sequence shifts its own row, with or without ids.
    assert resolve_positions(3, batch=2, offset=torch.tensor([0, 5])).tolist() == [[0, 1, 2], [5, 6, 7]]
    rows = torch.tensor([[2, 3, 4], [0, 1, 2]])
    shifted = resolve_positions(3, batch=2, positions=rows, offset=torch.tensor([1, 10]))
    assert shifted.tolist() == [[3, 4, 5], [10, 11, 12]]
    ids = torch.tensor([0, 1], dtype=torch.int32)
    resolved = resolve_positions(2, batch=1, positions=ids, offset=2**31)
    assert resolved.dtype == torch.int64 and resolved.tolist() == [[2**31, 2**31 + 1]]


def test_resolve_positions_refuses_negative_ids_inside_torch_compile() -> None:
    from posenc.positions import resolve_positions

    compiled = torch.compile(lambda p: resolve_positions(3, batch=1, positions=p), backend="eager", fullgraph=True)
    assert compiled(torch.tensor([4, 5, 6])).tolist() == [[4, 5, 6]]
    with pytest.raises(RuntimeError, match="positions must be >= 0"):
        compiled(torch.tensor([-5, 0, 1]))


def test_resolve_positions_refuses_a_negative_tensor_offset_inside_torch_compile() -> None:
    """Where values cannot be read, a negative per-sequence offset is refused by the assert that runs with the graph,
    also where position ids lift every row above 0 (as eager refuses it); the positions' own assert cannot see it."""
    from posenc.positions import resolve_positions

    alone = torch.compile(lambda o: resolve_positions(3, batch=2, offset=o), backend="eager", fullgraph=True)
    assert alone(torch.tensor([0, 5])).tolist() == [[0, 1, 2], [5, 6, 7]]
    lifted = torch.compile(
        lambda o: resolve_positions(3, batch=2, positions=torch.arange(1, 4), offset=o), backend="eager", fullgraph=True
    )
    for compiled in (alone, lifted):
        with pytest.raises(RuntimeError, match=r"offset must be >= 0 \(it counts tokens already in the cache\)"):
            compiled(torch.tensor([0, -1]))


def test_resolve_positions_refuses_offsets_that_leave_no_valid_position() -> None:
    """A negative per-sequence offset, and an offset whose last position (offset + seq_len - 1, or the offset itself
    for an empty sequence) is past int64, are refused; the last position at 2**63 - 1 is accepted."""
    from posenc.positions import resolve_positions

    with pytest.raises(ValueError, match=r"offset must be >= 0 \(it counts tokens already in the cache\)"):
        resolve_positions(3, batch=2, offset=torch.tensor([0, -1]))
    assert resolve_positions(2, batch=1, offset=torch.tensor([2**63 - 2])).tolist() == [[2**63 - 2, 2**63 - 1]]
    for offset in (torch.tensor([2**63 - 1]), 2**63 - 1):
        with pytest.raises(ValueError, match=r"the last position, offset \+ seq_len - 1, must fit in int64"):
            resolve_positions(2, batch=1, offset=offset)
    with pytest.raises(
        ValueError, match=r"the last position, offset \+ seq_len - 1, must fit in int64.*got 9223372036854775808"
    ):
        resolve_positions(0, batch=1, offset=2**63)
