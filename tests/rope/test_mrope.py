"""M-RoPE against transformers' Qwen2-VL rotary embedding and rotation, and its own properties."""

from __future__ import annotations

import re
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from posenc.rope.apply import apply_rotary
from posenc.rope.module import RoPE
from posenc.rope.mrope import MRoPE, mrope_axis_of_pair, mrope_cos_sin


def _qwen2_vl(head_dim: int, section: list[int], rope_parameters: dict[str, Any], max_pos: int = 4096) -> Any:
    pytest.importorskip("transformers")
    from transformers.models.qwen2_vl.configuration_qwen2_vl import Qwen2VLTextConfig
    from transformers.models.qwen2_vl.modeling_qwen2_vl import Qwen2VLRotaryEmbedding

    config = Qwen2VLTextConfig(
        hidden_size=2 * head_dim,
        num_attention_heads=2,
        num_key_value_heads=2,
        head_dim=head_dim,
        max_position_embeddings=max_pos,
        rope_parameters={**rope_parameters, "mrope_section": section},
    )
    return Qwen2VLRotaryEmbedding(config)


@pytest.mark.parametrize(
    ("head_dim", "section", "rope_parameters"),
    [
        (128, [16, 24, 24], {"rope_type": "default", "rope_theta": 1000000.0}),
        (64, [8, 12, 12], {"rope_type": "default", "rope_theta": 10000.0}),
        (32, [2, 4, 6, 4], {"rope_type": "default", "rope_theta": 10000.0}),  # a 4th section cycles back to t
        (
            64,
            [8, 12, 12],
            {"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0, "original_max_position_embeddings": 1024},
        ),
    ],
)
def test_matches_qwen2_vl(head_dim: int, section: list[int], rope_parameters: dict[str, Any]) -> None:
    from transformers.models.qwen2_vl.modeling_qwen2_vl import apply_rotary_pos_emb

    hf_rotary = _qwen2_vl(head_dim, section, rope_parameters)
    gen = torch.Generator().manual_seed(1)
    b, s = 2, 23
    t_ids = torch.arange(s).expand(b, s)
    positions = torch.stack(
        (t_ids, torch.randint(0, 50, (b, s), generator=gen), torch.randint(0, 3000, (b, s), generator=gen))
    )
    q = torch.randn(b, 3, s, head_dim, generator=gen)
    k = torch.randn(b, 1, s, head_dim, generator=gen)
    hf_cos, hf_sin = hf_rotary(q, positions)
    hf_q, hf_k = apply_rotary_pos_emb(q, k, hf_cos, hf_sin)

    rope = MRoPE(head_dim, mrope_section=section, rope_parameters=rope_parameters, max_position_embeddings=4096)
    our_q, our_k = rope(q, k, positions=positions)
    inv, factor = rope.frequencies()
    cos, sin = mrope_cos_sin(positions, inv, rope.mrope_section, factor)
    # float32 angles in transformers: positions up to 3000 times float32 inv_freq, ~1e-7 relative each
    angle_tol = factor * (positions.max().item() * 2e-6 + 1e-6)
    half = head_dim // 2
    torch.testing.assert_close(cos, hf_cos[..., :half], rtol=0.0, atol=angle_tol)
    torch.testing.assert_close(sin, hf_sin[..., :half], rtol=0.0, atol=angle_tol)
    for ours, theirs, x in ((our_q, hf_q, q), (our_k, hf_k, k)):
        torch.testing.assert_close(ours, theirs, rtol=0.0, atol=2 * angle_tol * x.abs().max().item())


def test_text_positions_equal_plain_rope() -> None:
    rope = MRoPE(64, mrope_section=[8, 12, 12], rope_parameters={"rope_theta": 1e6})
    plain = RoPE(64, rope_parameters={"rope_theta": 1e6})
    q = torch.randn(1, 2, 9, 64, dtype=torch.float64)
    ids = torch.arange(5, 14)[None]
    three = ids.expand(3, 1, 9)
    for a, b in zip(rope(q, q, positions=three), plain(q, q, positions=ids), strict=True):
        torch.testing.assert_close(a, b, rtol=0.0, atol=0.0)
    for a, b in zip(rope(q, q, positions=ids), plain(q, q, positions=ids), strict=True):  # 2-D ids: plain RoPE
        torch.testing.assert_close(a, b, rtol=0.0, atol=0.0)


def test_each_section_reads_its_axis() -> None:
    axis = mrope_axis_of_pair([2, 3, 1, 2])
    assert axis.tolist() == [0, 0, 1, 1, 1, 2, 0, 0]
    inv = torch.ones(8, dtype=torch.float64)
    positions = torch.tensor([5, 7, 11]).view(3, 1, 1)
    cos, _ = mrope_cos_sin(positions, inv, [2, 3, 1, 2])
    torch.testing.assert_close(cos[0, 0], torch.tensor([5, 5, 7, 7, 7, 11, 5, 5.0]).cos())


@pytest.mark.parametrize(
    ("section", "error", "match"),
    [
        ([16, 24, 23], ValueError, "mrope_section [16, 24, 23] must sum to rotary_dim / 2 = 64"),
        ([16, -1, 49], ValueError, "mrope_section[1] must be an integer >= 0"),
        ([16, 24.0, 24], ValueError, "mrope_section[1] must be an integer >= 0"),
        ([16, True, 47], ValueError, "mrope_section[1] must be an integer >= 0"),  # a bool is no count of pairs
        ("16,24,24", TypeError, "mrope_section must be a list of non-negative ints"),
        ([], TypeError, "mrope_section must be a list of non-negative ints"),
    ],
)
def test_bad_sections(section: Any, error: type, match: str) -> None:
    with pytest.raises(error, match=re.escape(match)):
        MRoPE(128, mrope_section=section)


def test_bad_positions() -> None:
    rope = MRoPE(16, mrope_section=[2, 3, 3])
    q = torch.randn(2, 1, 5, 16)
    with pytest.raises(ValueError, match=re.escape("positions must have shape (3, b, s) = (3, 2, 5)")):
        rope(q, q, positions=torch.zeros(2, 2, 5, dtype=torch.long))
    with pytest.raises(TypeError, match="positions must hold integer positions"):
        rope(q, q, positions=torch.zeros(3, 2, 5))
    with pytest.raises(ValueError, match="positions must be >= 0"):
        rope(q, q, positions=-torch.ones(3, 2, 5, dtype=torch.long))


def test_cos_sin_function_checks_its_positions_as_the_module_does() -> None:
    """mrope_cos_sin read the first three rows of transformers 5's (4, b, s) ids (text first) as t, h, w: wrong
    angles, no error. Negative and float ids passed; text ids (n, 1) came back (1, r/2) and failed later."""
    inv = MRoPE(16, mrope_section=[2, 3, 3]).frequencies(None)[0]
    ids = torch.randint(0, 30, (3, 1, 10))
    with_text = torch.cat([torch.arange(10)[None, None], ids])
    for bad in (with_text, ids[:2], torch.arange(10)[:, None], ids[0], ids[None]):
        with pytest.raises(ValueError, match=re.escape("positions must be (3, b, s) or (3, s)")):
            mrope_cos_sin(bad, inv, [2, 3, 3])
    assert torch.equal(mrope_cos_sin(with_text[1:], inv, [2, 3, 3])[0], mrope_cos_sin(ids, inv, [2, 3, 3])[0])
    # vLLM's (3, n) ids, as docs/porting.md passes them: (n, r/2).
    assert torch.equal(mrope_cos_sin(ids[:, 0], inv, [2, 3, 3])[0], mrope_cos_sin(ids, inv, [2, 3, 3])[0][0])
    with pytest.raises(ValueError, match="positions must be >= 0"):
        mrope_cos_sin(ids - 100, inv, [2, 3, 3])
    with pytest.raises(TypeError, match="positions must hold integer positions"):
        mrope_cos_sin(ids + 0.5, inv, [2, 3, 3])
    with pytest.raises(ValueError, match=re.escape("inv_freq must be (r/2,)")):
        mrope_cos_sin(ids, inv[None], [2, 3, 3])
    compiled = torch.compile(lambda p: mrope_cos_sin(p, inv, [2, 3, 3])[0], backend="eager", fullgraph=True)
    with pytest.raises(RuntimeError, match="positions must be >= 0"):
        compiled(ids - 100)
    assert torch.equal(compiled(ids), mrope_cos_sin(ids, inv, [2, 3, 3])[0])


def test_interleaved_axes_cycle_until_their_sections_run_out() -> None:
    """Qwen3-VL's layout: t, h, w, t, h, w, ... until h's and w's pairs are spent, t for the rest."""
    assert mrope_axis_of_pair([2, 1, 1], layout="interleaved").tolist() == [0, 1, 2, 0]
    assert mrope_axis_of_pair([4, 2, 2], layout="interleaved").tolist() == [0, 1, 2, 0, 1, 2, 0, 0]
    axis = mrope_axis_of_pair([24, 20, 20], layout="interleaved")
    assert torch.bincount(axis).tolist() == [24, 20, 20] and axis[:6].tolist() == [0, 1, 2, 0, 1, 2]
    # Sections the cycle cannot give each axis exactly, or that do not sum to r/2, are laid out all the same, as
    # transformers' Qwen3-VL does (h and w capped by theirs, t every other pair); posenc refused them.
    rope = MRoPE(16, mrope_section=[1, 3, 4], mrope_layout="interleaved")
    assert mrope_axis_of_pair(rope.mrope_section, layout="interleaved", pairs=8).tolist() == [0, 1, 2, 0, 1, 2, 0, 1]
    assert mrope_axis_of_pair([9, 1, 1], layout="interleaved", pairs=8).tolist() == [0, 1, 2, 0, 0, 0, 0, 0]
    # h's section caps h and w's caps w (transformers' slice(1, 3 * h, 3) and slice(2, 3 * w, 3)), not the other way
    assert mrope_axis_of_pair([0, 1, 3], layout="interleaved", pairs=8).tolist() == [0, 1, 2, 0, 0, 2, 0, 0]
    assert mrope_axis_of_pair([0, 3, 1], layout="interleaved", pairs=8).tolist() == [0, 1, 2, 0, 1, 0, 0, 1]
    positions = torch.tensor([5, 7, 11]).view(3, 1, 1)
    cos, _ = rope.cos_sin(positions, dtype=torch.float64)
    angles = torch.tensor([5, 7, 11, 5, 7, 11, 5, 7.0], dtype=torch.float64) * rope.frequencies()[0]
    torch.testing.assert_close(cos[0, 0], angles.cos())
    # A fourth section, which transformers drops without a word, names an axis that is not there.
    with pytest.raises(ValueError, match="interleaved M-RoPE takes 3 sections"):
        MRoPE(16, mrope_section=[2, 2, 2, 2], mrope_layout="interleaved")
    with pytest.raises(ValueError, match="mrope_layout must be one of 'sections', 'interleaved', 'alternating'"):
        MRoPE(16, mrope_section=[4, 2, 2], mrope_layout=True)


def test_alternating_axes_turn_h_and_w_in_turn_then_t() -> None:
    """ERNIE-4.5-VL's layout, sections in the order h, w, t: h, w, h, w, ..., then t."""
    assert mrope_axis_of_pair([2, 2, 3], layout="alternating").tolist() == [1, 2, 1, 2, 0, 0, 0]
    with pytest.raises(ValueError, match=re.escape("(so h and w need equal sections)")):
        MRoPE(16, mrope_section=[3, 1, 4], mrope_layout="alternating")
    with pytest.raises(ValueError, match=re.escape("gives t the rest (at least one pair)")):
        MRoPE(16, mrope_section=[4, 4, 0], mrope_layout="alternating")


def test_sections_of_another_sum_than_the_pairs_are_refused_where_they_count_every_pair() -> None:
    """mrope_cos_sin with an inv_freq of other than sum(sections) pairs: 'sections' and 'alternating' sections count
    every pair, so there is no layout of them to give (an 'alternating' [2, 2, 0] over 8 pairs gave t 4 pairs, and
    'sections' ignored pairs=); 'interleaved' ones are laid out over any number of pairs."""
    inv_freq = 10000.0 ** (-torch.arange(0, 16, 2, dtype=torch.float64) / 16)  # 8 pairs
    positions = torch.tensor([5, 7, 11]).view(3, 1, 1)
    for layout, section in (("alternating", [2, 2, 0]), ("alternating", [4, 4, 2]), ("sections", [1])):
        with pytest.raises(ValueError, match=re.escape(f"{layout} mrope_section {section} lays out")):
            mrope_cos_sin(positions, inv_freq, section, layout=layout)
        with pytest.raises(ValueError, match=re.escape("but there are 8 (rotary_dim / 2)")):
            mrope_axis_of_pair(section, layout=layout, pairs=8)
    cos, _ = mrope_cos_sin(positions, inv_freq, [9, 1, 1], dtype=torch.float64, layout="interleaved")
    torch.testing.assert_close(
        cos[0, 0], (torch.tensor([5, 7, 11, 5, 5, 5, 5, 5.0], dtype=torch.float64) * inv_freq).cos()
    )


@pytest.mark.parametrize("layout", ["sections", "interleaved", "alternating"])
def test_cos_sin_takes_three_axes(layout: str) -> None:
    """cos_sin of (3, b, s) ids is M-RoPE's, not plain RoPE's per axis."""
    section = [3, 3, 2] if layout == "alternating" else [4, 2, 2]
    rope = MRoPE(16, mrope_section=section, mrope_layout=layout)
    positions = torch.stack([torch.arange(5), torch.arange(5) * 3, torch.arange(5) + 9])[:, None]
    inv, factor = rope.frequencies()
    cos, sin = rope.cos_sin(positions)
    expected = mrope_cos_sin(positions, inv, section, factor, layout=layout)
    torch.testing.assert_close((cos, sin), expected, rtol=0, atol=0)
    assert cos.shape == (1, 5, 8)
    with pytest.raises(ValueError, match=r"positions must be \(3, b, s\).*got shape \(2, 1, 5\)"):
        rope.cos_sin(positions[:2])


def test_three_axis_positions_get_the_checks_of_plain_positions() -> None:
    rope = MRoPE(16, mrope_section=[2, 3, 3])
    positions = torch.arange(5).expand(3, 1, 5)
    wide = torch.randn(1, 1, 5, 32)
    with pytest.raises(ValueError, match="d = head_dim = 16, got shape"):  # not a silent partial rotation
        rope(wide, wide, positions=positions)
    q = torch.randn(1, 1, 5, 16)
    with pytest.raises(ValueError, match="offset must be >= 0"):
        rope(q, q, positions=positions, offset=-1)
    with pytest.raises(TypeError, match=r"offset must be an int or a 0-d integer tensor with .*shape \(1,\)"):
        rope(q, q, positions=positions, offset=torch.tensor([1]))
    with pytest.raises(ValueError, match="offset must be >= 0"):
        rope(q, q, positions=positions, offset=torch.tensor(-1))
    meta = q.to("meta")
    assert rope(meta, meta, positions=positions.to("meta"))[0].shape == q.shape  # shapes only, nothing read


def test_three_axis_positions_take_a_0d_tensor_offset_as_rope_does() -> None:
    """offset=torch.tensor(n) rotates as offset=n, eagerly and where its value cannot be read (torch.compile with
    fullgraph=True, the meta device); it was refused ("must be an int, got Tensor") while RoPE takes it."""
    rope = MRoPE(16, mrope_section=[2, 3, 3])
    positions = torch.randint(0, 9, (3, 2, 5))
    q, k = torch.randn(2, 2, 5, 16), torch.randn(2, 1, 5, 16)
    expected = rope(q, k, positions=positions, offset=7)
    torch.testing.assert_close(rope(q, k, positions=positions, offset=torch.tensor(7)), expected, rtol=0, atol=0)
    compiled = torch.compile(lambda q, k, o: rope(q, k, positions=positions, offset=o), backend="eager", fullgraph=True)
    torch.testing.assert_close(compiled(q, k, torch.tensor(7)), expected, rtol=0, atol=0)
    meta = q.to("meta")
    assert rope(meta, meta, positions=positions.to("meta"), offset=torch.tensor(7, device="meta"))[0].shape == q.shape


def test_three_axis_positions_compile_with_fullgraph() -> None:
    """No value read on the host under torch.compile(fullgraph=True); a negative id fails as the graph runs."""
    rope = MRoPE(16, mrope_section=[2, 3, 3], mrope_layout="sections")
    q = torch.randn(1, 2, 5, 16)
    positions = torch.stack([torch.arange(5), torch.arange(5) * 2, torch.arange(5) + 4])[:, None]
    compiled = torch.compile(lambda q, p: rope(q, q, positions=p), fullgraph=True, backend="aot_eager")
    torch.testing.assert_close(compiled(q, positions), rope(q, q, positions=positions))
    with pytest.raises(RuntimeError, match="positions must be >= 0"):
        compiled(q, positions - 3)


@pytest.mark.parametrize(
    ("layout", "section"), [("sections", [2, 3, 3]), ("interleaved", [4, 2, 2]), ("alternating", [3, 3, 2])]
)
def test_three_axis_decode_steps_compile_into_one_graph_without_breaks(layout: str, section: list[int]) -> None:
    """Without fullgraph=True (generate's compile, a user's torch.compile(model)), the pairs' axes were laid out with
    a repeat_interleave by section sizes ('sections') or a boolean index ('alternating'), whose output shape depends
    on values: a graph break on every call, in every decode step of a patched Qwen2-VL or ERNIE-4.5-VL, whose
    unpatched model compiles whole. The axes are a constant of the graph now."""
    from torch._dynamo.testing import CompileCounter

    rope = MRoPE(16, mrope_section=section, mrope_layout=layout)
    q, k = torch.randn(2, 2, 1, 16), torch.randn(2, 1, 1, 16)
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    counter = CompileCounter()
    compiled = torch.compile(lambda q, k, p: rope(q, k, positions=p), backend=counter)
    try:
        for step in range(4):
            positions = torch.tensor([step, step // 2 + 5, step % 2 + 9])[:, None, None].expand(3, 2, 1)
            for got, want in zip(compiled(q, k, positions), rope(q, k, positions=positions), strict=True):
                assert torch.equal(got, want)
        breaks = sum(torch._dynamo.utils.counters["graph_break"].values())
        assert (breaks, counter.frame_count) == (0, 1)
    finally:
        torch._dynamo.reset()


def test_three_rows_of_ids_for_another_batch_size_name_both_forms() -> None:
    rope = MRoPE(16, mrope_section=[4, 2, 2])
    q = torch.randn(2, 1, 5, 16)
    with pytest.raises(ValueError, match=re.escape("neither text ids (s,) or (b, s) for a batch of 2 nor three axes")):
        rope(q, q, positions=torch.zeros(3, 5, dtype=torch.long))


def test_attention_refuses_three_axis_ids_with_the_reason() -> None:
    from posenc import CausalSelfAttention

    attn = CausalSelfAttention(32, 2, encoding=MRoPE(16, mrope_section=[4, 2, 2]))
    with pytest.raises(ValueError, match=r"three-axis \(3, b, s\) M-RoPE ids are taken by posenc.MRoPE"):
        attn(torch.randn(1, 5, 32), positions=torch.zeros(3, 1, 5, dtype=torch.long))


def _three_axes(s: int) -> torch.Tensor:
    """(3, 1, s) ids of one sequence: time, height and width of a 2-wide image."""
    return torch.stack([torch.arange(s), torch.arange(s) // 2, torch.arange(s) % 2])[:, None]


def test_offset_and_shared_rows_with_three_axes() -> None:
    """offset is added to every axis; (3, 1, s) ids are shared by every row of the batch."""
    torch.manual_seed(0)
    rope = MRoPE(16, mrope_section=[2, 3, 3])
    q, k = torch.randn(2, 2, 4, 16), torch.randn(2, 2, 4, 16)
    pos = _three_axes(4)
    for got, want in zip(rope(q, k, positions=pos, offset=5), rope(q, k, positions=pos + 5), strict=True):
        assert torch.equal(got, want)
    for got, want in zip(rope(q, k, positions=pos), rope(q, k, positions=pos.expand(3, 2, 4)), strict=True):
        assert torch.equal(got, want)


def test_three_axes_scale_for_the_seq_len_given() -> None:
    """dynamic NTK with seq_len = 32 for ids that reach 3: the frequencies of 32 tokens, as RoPE's, on both the
    cos_sin and the forward paths."""
    kwargs = dict(rope_parameters={"rope_type": "dynamic", "factor": 4.0}, max_position_embeddings=8)
    mrope, rope = MRoPE(16, mrope_section=[2, 3, 3], **kwargs), RoPE(16, **kwargs)
    same = torch.arange(4).expand(3, 1, 4)  # every axis the text position: M-RoPE is then RoPE
    assert torch.equal(mrope.cos_sin(same, seq_len=32)[0], rope.cos_sin(torch.arange(4)[None], seq_len=32)[0])
    q, k = torch.randn(1, 2, 4, 16), torch.randn(1, 2, 4, 16)
    for got, want in zip(mrope(q, k, positions=same, seq_len=32), rope(q, k, seq_len=32), strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
    assert not torch.allclose(mrope(q, k, positions=same, seq_len=32)[0], mrope(q, k, positions=same)[0])


def test_fullgraph_longrope_with_three_axes_says_what_to_pass():
    """The graph break's reason spoke of dynamic NTK and CausalSelfAttention, neither of which was involved."""
    rope = MRoPE(
        8,
        mrope_section=[2, 1, 1],
        rope_parameters={
            "rope_type": "longrope",
            "factor": 4.0,
            "original_max_position_embeddings": 4,
            "short_factor": [1.0] * 4,
            "long_factor": [2.0] * 4,
        },
    )
    q = torch.randn(1, 2, 6, 8)
    positions = torch.arange(6).expand(3, 1, 6)
    compiled = torch.compile(lambda q: rope(q, q, positions=positions)[0], backend="eager", fullgraph=True)
    with pytest.raises(Exception, match=r"reason: rope_type 'longrope' with position ids of more than 2 dims") as info:
        compiled(q)
    assert "dynamic NTK" not in str(info.value) and "CausalSelfAttention" not in str(info.value)
    assert "pass seq_len= to MRoPE.forward" in str(info.value)
    # What it advises compiles, and rotates as eager does.
    given = torch.compile(lambda q: rope(q, q, positions=positions, seq_len=6)[0], backend="eager", fullgraph=True)
    torch.testing.assert_close(given(q), rope(q, q, positions=positions)[0])


@st.composite
def _layout_and_sections(draw: st.DrawFn) -> tuple[str, int, list[int]]:
    """A layout, a number of pairs and sections that layout takes for them (transformers runs them all)."""
    layout = draw(st.sampled_from(["sections", "interleaved", "alternating"]))
    pairs = draw(st.integers(1, 12))
    if layout == "interleaved":  # any three, of any sum
        return layout, pairs, draw(st.lists(st.integers(0, pairs + 3), min_size=3, max_size=3))
    if layout == "alternating":  # equal h and w, t the rest (at least one)
        hw = draw(st.integers(0, (pairs - 1) // 2))
        return layout, pairs, [hw, hw, pairs - 2 * hw]
    cuts = sorted(draw(st.lists(st.integers(0, pairs), min_size=2, max_size=3)))
    return layout, pairs, [b - a for a, b in zip([0, *cuts], [*cuts, pairs], strict=True)]


@settings(max_examples=60, deadline=None)
@given(_layout_and_sections(), st.lists(st.integers(-40, 40), min_size=3, max_size=3), st.integers(0, 2**32 - 1))
def test_every_layout_is_relative_per_axis_and_plain_rope_on_one_axis(
    case: tuple[str, int, list[int]], shift: list[int], seed: int
) -> None:
    """For any sections a layout takes (zero sections, interleaved ones of any sum): rotation keeps norms, q . k
    depends only on each axis' position difference (each axis shifted by its own amount leaves every score as it
    was), and three equal axes rotate as plain RoPE."""
    layout, pairs, sections = case
    head_dim = 2 * pairs
    rope = MRoPE(head_dim, mrope_section=sections, mrope_layout=layout, backend="torch")
    gen = torch.Generator().manual_seed(seed)
    b, s = 2, 5
    q = torch.randn(b, 2, s, head_dim, generator=gen, dtype=torch.float64)
    k = torch.randn(b, 2, s, head_dim, generator=gen, dtype=torch.float64)
    positions = torch.randint(40, 200, (3, b, s), generator=gen)
    rq, rk = rope(q, k, positions=positions)
    torch.testing.assert_close(rq.norm(dim=-1), q.norm(dim=-1), rtol=1e-12, atol=1e-12)
    moved = positions + torch.tensor(shift).view(3, 1, 1)
    mq, mk = rope(q, k, positions=moved)
    torch.testing.assert_close(mq @ mk.transpose(-1, -2), rq @ rk.transpose(-1, -2), rtol=1e-10, atol=1e-10)
    plain = RoPE(head_dim, backend="torch")
    for ours, theirs in zip(
        rope(q, k, positions=positions[:1].expand(3, b, s)), plain(q, k, positions=positions[0]), strict=True
    ):
        torch.testing.assert_close(ours, theirs, rtol=0.0, atol=1e-12)


def test_axis_of_pair_refuses_what_the_module_refuses() -> None:
    """mrope_axis_of_pair (which the M-RoPE figure and mrope_cos_sin call) read an unknown layout as 'alternating' and
    took negative or unequal alternating sections, giving axes with no error."""
    with pytest.raises(ValueError, match="mrope_layout must be one of"):
        mrope_axis_of_pair([2, 3, 3], layout="foo")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=re.escape("mrope_section[1] must be an integer >= 0")):
        mrope_axis_of_pair([2, -1, 3])
    with pytest.raises(ValueError, match="alternating M-RoPE alternates h and w"):
        mrope_axis_of_pair([3, 1, 4], layout="alternating")
    with pytest.raises(ValueError, match="interleaved M-RoPE takes 3 sections"):
        mrope_axis_of_pair([4, 4], layout="interleaved")
    assert mrope_axis_of_pair([2, 2, 4], layout="alternating").tolist() == [1, 2, 1, 2, 0, 0, 0, 0]


def test_module_lays_out_its_axes_once_and_again_where_its_sections_change(monkeypatch: pytest.MonkeyPatch) -> None:
    """A decode step built the (r/2,) axis tensor from a list and checked the sections on every call (~15 us of
    ~150); now once per sections and layout, the same rotation, and new sections or layout are checked again."""
    from posenc.rope import mrope

    rope = MRoPE(16, mrope_section=[2, 3, 3], backend="torch")
    q, k = torch.randn(1, 2, 1, 16, dtype=torch.float64), torch.randn(1, 1, 1, 16, dtype=torch.float64)
    positions = torch.tensor([5, 2, 7])[:, None, None]
    inv, factor = rope.frequencies()
    expected = [
        apply_rotary(q, cos[:, None], sin[:, None])
        for cos, sin in (
            mrope_cos_sin(positions, inv, [2, 3, 3], factor, torch.float64),
            mrope_cos_sin(positions, inv, [2, 2, 4], factor, torch.float64, layout="alternating"),
        )
    ]
    calls = []
    checked = mrope.mrope_axis_of_pair
    monkeypatch.setattr(mrope, "mrope_axis_of_pair", lambda *a, **kw: calls.append(a) or checked(*a, **kw))
    first = rope(q, k, positions=positions)[0]
    torch.testing.assert_close(first, expected[0])
    for _ in range(2):
        torch.testing.assert_close(rope(q, k, positions=positions)[0], first, rtol=0.0, atol=0.0)
    assert len(calls) == 1
    # Not read under a FakeTensorMode (it refuses real tensors), nor kept from there for a real call.
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode() as fake:
        shape = rope(fake.from_tensor(q), fake.from_tensor(k), positions=fake.from_tensor(positions))[0].shape
    assert shape == q.shape
    torch.testing.assert_close(rope(q, k, positions=positions)[0], first, rtol=0.0, atol=0.0)
    rope.mrope_section = (2, 2, 4)  # unchecked assignments: the next call checks and lays them out
    rope.mrope_layout = "alternating"
    torch.testing.assert_close(rope(q, k, positions=positions)[0], expected[1])
    assert len(calls) == 3
    rope.mrope_layout = "foo"
    with pytest.raises(ValueError, match="mrope_layout must be one of"):
        rope(q, k, positions=positions)
    rope.mrope_layout, rope.mrope_section = "sections", [2, -1, 5]
    with pytest.raises(ValueError, match=re.escape("mrope_section[1] must be an integer >= 0")):
        rope(q, k, positions=positions)
    # A list is laid out at every call, not kept: changed in place it is the same object with other sections
    # (mutation pass 13: keeping it served the first call's axes after the change).
    rope.mrope_section = sections = [2, 3, 3]
    torch.testing.assert_close(rope(q, k, positions=positions)[0], expected[0])
    sections[1:] = [2, 4]
    cos, sin = mrope_cos_sin(positions, inv, [2, 2, 4], factor, torch.float64)
    torch.testing.assert_close(rope(q, k, positions=positions)[0], apply_rotary(q, cos[:, None], sin[:, None]))


ROPE_TYPES = (
    {},
    {"rope_type": "linear", "factor": 2.0},
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16},
    {"rope_type": "dynamic", "factor": 2.0},
)


@settings(max_examples=60, deadline=None)
@given(
    layout_section=st.sampled_from([("sections", [2, 3, 3]), ("interleaved", [4, 2, 2]), ("alternating", [3, 3, 2])]),
    rope_parameters=st.sampled_from(ROPE_TYPES),
    dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float64]),
    backend=st.sampled_from(["auto", "torch"]),
    qk_layout=st.sampled_from(["bhsd", "bshd"]),
    b=st.integers(1, 2),
    s=st.integers(1, 6),
    shared=st.booleans(),
    ids_dtype=st.sampled_from([torch.int64, torch.int32]),
    start=st.integers(0, 40),
    interleaved=st.booleans(),
)
def test_text_ids_on_three_axes_rotate_as_ropes_ids_bit_for_bit(
    layout_section, rope_parameters, dtype, backend, qk_layout, b, s, shared, ids_dtype, start, interleaved
) -> None:
    """(3, b, s) ids that are the same on every axis (text tokens: every decode step's) go through RoPE's path with
    the first axis' ids (its table, its replayed calls): the same bits as the three axes' cos/sin per call, for every
    axes layout, scaling type (YaRN's attention factor, dynamic NTK past its length), dtype, backend and layout."""
    from unittest import mock

    import posenc.rope.mrope as mrope_module

    layout, section = layout_section
    options = {"rope_parameters": rope_parameters or None, "max_position_embeddings": 16}
    rope = MRoPE(16, mrope_section=section, mrope_layout=layout, backend=backend, interleaved=interleaved, **options)
    other = MRoPE(16, mrope_section=section, mrope_layout=layout, backend=backend, interleaved=interleaved, **options)
    generator = torch.Generator().manual_seed(start)
    shape = (b, 2, s, 16) if qk_layout == "bhsd" else (b, s, 2, 16)
    q, k = (torch.randn(shape, generator=generator, dtype=torch.float64).to(dtype) for _ in range(2))
    rows = (torch.randperm(s + start, generator=generator)[:s] if s > 1 else torch.tensor([start])).to(ids_dtype)
    ids = rows.expand(1 if shared else b, s)
    positions = ids.expand(3, *ids.shape)
    taken, real = [], mrope_module._text_only
    with mock.patch.object(mrope_module, "_text_only", lambda *args: taken.append(real(*args)) or taken[-1]):
        got = rope(q, k, positions=positions, layout=qk_layout)
    assert taken == [True]
    with mock.patch.object(mrope_module, "_text_only", return_value=False):
        want = other(q, k, positions=positions, layout=qk_layout)
    for g, w in zip(got, want, strict=True):
        assert g.dtype == w.dtype and torch.equal(g, w)


def test_only_ids_the_same_on_every_axis_take_ropes_path() -> None:
    """Ids that differ on one axis, an offset, ids on the meta device or a tracing compile take M-RoPE's own path;
    a decode loop of text ids replays RoPE's call from its second step (no full path)."""
    from unittest import mock

    import posenc.rope.module as module
    import posenc.rope.mrope as mrope_module

    rope = MRoPE(16, mrope_section=[2, 3, 3])
    q, k = torch.randn(1, 4, 1, 16), torch.randn(1, 2, 1, 16)
    taken = []
    real = mrope_module._text_only

    def spy(*args):
        taken.append(real(*args))
        return taken[-1]

    with mock.patch.object(mrope_module, "_text_only", spy):
        for axis in range(3):
            positions = torch.full((3, 1, 1), 7)
            positions[axis] += 1
            rope(q, k, positions=positions)
        rope(q, k, positions=torch.full((3, 1, 1), 7), offset=1)
        rope(q.to("meta"), k.to("meta"), positions=torch.full((3, 1, 1), 7, device="meta"))
        torch.compile(lambda q, k, p: rope(q, k, positions=p), backend="eager", fullgraph=True)(
            q, k, torch.full((3, 1, 1), 7)
        )
        assert taken == [False] * 6
        # Equal ids that do not fit q: M-RoPE's own message, which names the (3, b, s) form.
        for wrong in (torch.full((3, 1, 2), 7), torch.full((3, 3, 1), 7)):
            with pytest.raises(ValueError, match=re.escape("positions must have shape (3, b, s) = (3, 1, 1)")):
                rope(q, k, positions=wrong)
        with pytest.raises(TypeError, match="positions must hold integer positions"):
            rope(q, k, positions=torch.ones(3, 1, 1, dtype=torch.bool))
        taken.clear()
        with mock.patch.object(module, "rotate_tensors", wraps=module.rotate_tensors) as full:
            for step in range(4):
                rope(q, k, positions=torch.full((3, 1, 1), 20 + step))
        assert taken == [True] * 4 and full.call_count == 1
        # A prefill's ids, past the few a decode step compares as Python ints: text, then one image token in them.
        taken.clear()
        long_q, long_k = torch.randn(1, 4, 100, 16), torch.randn(1, 2, 100, 16)
        text = torch.arange(100).expand(3, 1, 100)
        image = text.clone()
        image[2, 0, 50] += 1
        for positions in (text, image):
            with mock.patch.object(mrope_module, "_text_only", return_value=False):
                want = rope(long_q, long_k, positions=positions)
            assert same_bits(rope(long_q, long_k, positions=positions), want)
        assert taken == [True, False]


def same_bits(got, want) -> bool:
    return all(g.dtype == w.dtype and torch.equal(g, w) for g, w in zip(got, want, strict=True))


def _m_ropes_error(rope, *args, **kwargs) -> BaseException:
    """The error M-RoPE's own path (``_text_only`` False) raises for the call."""
    from unittest import mock

    import posenc.rope.mrope as mrope_module

    with mock.patch.object(mrope_module, "_text_only", return_value=False), pytest.raises(Exception) as want:
        rope(*args, **kwargs)
    return want.value


@pytest.mark.parametrize(
    "case",
    [
        "layout a list",
        "layout unknown",
        "q 2-D",
        "q a list",
        "two axes",
        "negative id",
        "negative id, prefill",
        "complex ids",
        "complex ids, prefill",
    ],
)
@pytest.mark.parametrize("rope_parameters", [None, {"rope_type": "dynamic", "factor": 2.0}])
def test_text_ids_that_rope_would_refuse_get_m_ropes_own_error(case, rope_parameters) -> None:
    """Ids the same on every axis beside arguments M-RoPE refuses get the error its own path gives, type and
    message: the text check asks nothing it cannot ask of them (a list layout is unhashable, a 2-D q has no axis 2,
    a list has no dim, two axes do not unpack into three, complex ids have no order), and negative ids keep
    M-RoPE's message (RoPE's names its table rows)."""
    rope = MRoPE(16, mrope_section=[2, 3, 3], rope_parameters=rope_parameters, max_position_embeddings=16)
    q, k = torch.randn(1, 2, 1, 16), torch.randn(1, 2, 1, 16)
    positions, layout = torch.full((3, 1, 1), 7), "bhsd"
    if case == "layout a list":
        layout = ["bhsd"]
    elif case == "layout unknown":
        layout = "sbhd"
    elif case == "q 2-D":
        q = q[0, 0]
    elif case == "q a list":
        q = q.tolist()
    elif case == "two axes":
        positions = positions[:2]
    elif case == "negative id":
        positions = torch.full((3, 1, 1), -1)
    elif case == "complex ids":
        positions = positions.to(torch.complex64)
    else:
        q, k = torch.randn(1, 2, 100, 16), torch.randn(1, 2, 100, 16)
        positions = (torch.arange(100) - 1).expand(3, 1, 100)
        if case == "complex ids, prefill":
            positions = positions.abs().to(torch.complex64)
    want = _m_ropes_error(rope, q, k, positions=positions, layout=layout)
    with pytest.raises(type(want)) as got:
        rope(q, k, positions=positions, layout=layout)
    assert str(got.value) == str(want)
