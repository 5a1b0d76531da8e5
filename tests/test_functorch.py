"""torch.func transforms around posenc's calls that take index tensors (position ids, offsets, cu_seqlens), whose
values posenc reads on the host to check them and to size its tables: each transform gives eager's numbers or a
posenc error, never torch's bare one from deep inside a check."""

from __future__ import annotations

import pytest
import torch
from torch.func import functionalize
from torch.fx.experimental.proxy_tensor import make_fx

import posenc
from posenc.testing import assert_close

B, H, S, D = 2, 3, 5, 8
IDS = torch.tensor([[0, 1, 2, 3, 4], [5, 6, 7, 8, 9]])
CU_SEQLENS = torch.tensor([0, 2, 5, 9])


def _all_close(got: tuple[torch.Tensor, ...], want: tuple[torch.Tensor, ...]) -> None:
    for g, w in zip(got, want, strict=True):
        assert_close(g, w)


def _packed(q: torch.Tensor) -> torch.Tensor:
    """q (b, h, s, d) as 9 packed tokens (total_tokens, h, d), for CU_SEQLENS."""
    return q.transpose(1, 2).flatten(0, 1)[:9]


def _inputs() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(B, H, S, D, generator=g), torch.randn(B, H, S, D, generator=g)
    cos, sin = posenc.RoPE(D).cos_sin(torch.arange(32))
    return q, k, cos, sin


# Each call with the index tensors it takes as arguments (functionalize wraps those, not closed-over ones).
INDEX_KINDS = {
    "offset int": (lambda q, cos, sin: posenc.apply_rotary(q, cos, sin, offset=3), ()),
    "offset (b,)": (lambda q, cos, sin, o: posenc.apply_rotary(q, cos, sin, offset=o), (torch.tensor([2, 7]),)),
    "positions (s,)": (lambda q, cos, sin, p: posenc.apply_rotary(q, cos, sin, positions=p), (IDS[0].flip(0),)),
    "positions (b, s)": (lambda q, cos, sin, p: posenc.apply_rotary(q, cos, sin, positions=p), (IDS,)),
    "positions + offset (b,)": (
        lambda q, cos, sin, p, o: posenc.apply_rotary(q, cos, sin, positions=p, offset=o),
        (IDS[0], torch.tensor([1, 4])),
    ),
    "cu_seqlens": (
        lambda q, cos, sin, c: posenc.apply_rotary(_packed(q), cos, sin, cu_seqlens=c),
        (CU_SEQLENS,),
    ),
    "cu_seqlens + offset": (
        lambda q, cos, sin, c, o: posenc.apply_rotary(_packed(q), cos, sin, cu_seqlens=c, offset=o),
        (CU_SEQLENS, torch.tensor([1, 2, 3])),
    ),
}


@pytest.mark.parametrize("kind", list(INDEX_KINDS))
def test_functionalize_apply_rotary_with_index_tensors_equals_eager(kind):
    """Inside functionalize every tensor is a functional wrapper without storage, whose .tolist() raised torch's
    "tolist() shouldn't be called on a tensor with unallocated storage" from posenc's range checks."""
    q, _, cos, sin = _inputs()
    fn, indices = INDEX_KINDS[kind]
    assert_close(functionalize(fn)(q, cos, sin, *indices), fn(q, cos, sin, *indices))


@pytest.mark.parametrize(
    "positions, offset",
    [(None, torch.tensor([2, 7])), (IDS[0], 0), (IDS, 0), (IDS, torch.tensor([1, 3])), (IDS + 300, 0)],
    ids=["offset (b,)", "positions (s,)", "positions (b, s)", "positions + offset (b,)", "past the table"],
)
def test_functionalize_rope_forward_and_cos_sin_equal_eager(positions, offset):
    q, k, _, _ = _inputs()
    rope = posenc.RoPE(D)

    def forward(q, k, positions, offset):
        return rope(q, k, positions=positions, offset=offset)

    _all_close(functionalize(forward)(q, k, positions, offset), forward(q, k, positions, offset))
    if positions is not None:
        _all_close(functionalize(rope.cos_sin)(positions), rope.cos_sin(positions))
        _all_close(functionalize(rope.call_cos_sin)(positions), rope.call_cos_sin(positions))


def test_functionalize_reads_ids_updated_in_place_and_keeps_posenc_errors():
    """The values read are the wrapper's current ones (an in-place update inside the function counts), and ids the
    checks refuse are refused with posenc's error, as in eager."""
    q, _, cos, sin = _inputs()

    def shifted(q, ids):
        ids.add_(3)
        return posenc.apply_rotary(q, cos, sin, positions=ids)

    assert_close(functionalize(shifted)(q, IDS.clone()), posenc.apply_rotary(q, cos, sin, positions=IDS + 3))
    with pytest.raises(ValueError, match=r"positions reach 30 \.\. 39 but the cos/sin table has 32 rows"):
        functionalize(shifted)(q, IDS + 27)
    with pytest.raises(ValueError, match="positions must be >= 0"):
        functionalize(lambda q, p: posenc.RoPE(D)(q, q, positions=p))(q, -IDS)


# jvp loads torch's jvp decompositions on first use, which script them (torch warns inside torch: a
# DeprecationWarning on 2.13, a FutureWarning on 2.15).
@pytest.mark.filterwarnings("ignore:`torch.jit.script` is deprecated")
def test_functionalize_around_grad_and_jvp_equals_eager_autograd():
    """Under functionalize(grad(f)) the values read are a grad wrapper around a functional one."""
    q, k, _, _ = _inputs()
    q, k, w = q.double(), k.double(), torch.randn(q.shape, dtype=torch.float64)
    rope = posenc.RoPE(D)

    def loss(q, ids):
        return (rope(q, k, positions=ids)[0] * w).sum()

    leaf = q.clone().requires_grad_(True)
    (want,) = torch.autograd.grad(loss(leaf, IDS), leaf)
    assert_close(functionalize(torch.func.grad(loss))(q, IDS), want)
    assert_close(torch.func.grad(functionalize(loss))(q, IDS), want)
    tangent = torch.randn(q.shape, dtype=torch.float64)
    _, jvp = functionalize(lambda q, t: torch.func.jvp(lambda x: rope(x, k, positions=IDS)[0], (q,), (t,)))(q, tangent)
    assert_close(jvp, rope(tangent, k, positions=IDS)[0])  # a rotation is linear: its jvp is the tangent rotated


def test_batched_index_tensors_inside_functionalize_are_refused_by_name():
    """vmap(functionalize(f)) batches the tensor functionalize's wrapper holds: the refusal of batched ids did not see
    through the wrapper, and torch's bare "Cannot access data pointer of Tensor that doesn't have storage" (or "tolist()
    shouldn't be called ...") came from the range checks."""
    q, _, cos, sin = _inputs()
    rope = posenc.RoPE(D)
    match = r"cannot be batched by torch.func.vmap: .* \(in_dims=None"
    with pytest.raises(ValueError, match="positions " + match):
        torch.func.vmap(functionalize(lambda p: rope.cos_sin(p)))(IDS)
    with pytest.raises(ValueError, match="positions " + match):
        torch.func.vmap(functionalize(lambda x, p: rope(x[None], x[None], positions=p)[0]))(q, IDS)
    with pytest.raises(ValueError, match="offset " + match):
        torch.func.vmap(functionalize(lambda x, o: rope(x[None], x[None], offset=o)[0]))(q, torch.tensor([1, 2]))
    packed = torch.stack([_packed(q), _packed(q.flip(0))])
    with pytest.raises(ValueError, match="cu_seqlens " + match):
        torch.func.vmap(functionalize(lambda x, c: posenc.apply_rotary(x, cos, sin, cu_seqlens=c)))(
            packed, torch.stack([CU_SEQLENS, torch.tensor([0, 4, 5, 9])])
        )
    shared = torch.func.vmap(functionalize(lambda x: posenc.apply_rotary(x[None], cos, sin, positions=IDS[:1])[0]))(q)
    assert_close(shared, posenc.apply_rotary(q, cos, sin, positions=IDS[:1]))


def test_functionalize_mrope_and_its_construction():
    q, k, _, _ = _inputs()
    mrope = posenc.MRoPE(D, mrope_section=[2, 1, 1])
    axes = torch.stack([IDS, IDS.flip(1), IDS // 2])
    _all_close(functionalize(lambda q, k, p: mrope(q, k, positions=p))(q, k, axes), mrope(q, k, positions=axes))

    def built_inside(q, k, p):  # the section check counts pairs per axis with a tensor made inside
        return posenc.MRoPE(D, mrope_section=[2, 1, 1], mrope_layout="interleaved")(q, k, positions=p)

    _all_close(functionalize(built_inside)(q, k, axes), built_inside(q, k, axes))


MODES = ["real", "fake", "symbolic"]
# make_fx(pre_dispatch=True) keeps its proxy mode on a stack of its own: it recorded the example's reads as before.
PRE_DISPATCH = pytest.mark.parametrize("pre_dispatch", [False, True], ids=["dispatch", "pre_dispatch"])


@PRE_DISPATCH
@pytest.mark.parametrize("mode", MODES)
def test_make_fx_graphs_of_rope_read_the_ids_they_are_given(mode, pre_dispatch):
    """make_fx recorded the example's host reads: a 256-row table sized from its ids (other ids past it raised
    torch's IndexError at replay, a negative id read the last rows without an error) and, in "real" mode, range
    checks that never ran again. The graph computes from the ids it is called with and checks them itself."""
    q, k, _, _ = _inputs()
    rope = posenc.RoPE(D)
    cos_sin = make_fx(lambda p: rope.cos_sin(p), tracing_mode=mode, pre_dispatch=pre_dispatch)(IDS)
    forward = make_fx(lambda q, k, p: rope(q, k, positions=p), tracing_mode=mode, pre_dispatch=pre_dispatch)(q, k, IDS)
    for ids in (IDS + 300, IDS + 5000):
        _all_close(cos_sin(ids), rope.cos_sin(ids))
        _all_close(forward(q, k, ids), rope(q, k, positions=ids))
    with pytest.raises(RuntimeError, match="positions must be >= 0"):
        cos_sin(IDS - 3)
    with pytest.raises(RuntimeError, match="positions must be >= 0"):
        forward(q, k, IDS - 3)


@PRE_DISPATCH
@pytest.mark.parametrize("mode", MODES)
def test_make_fx_of_dynamic_ntk_asks_for_seq_len(mode, pre_dispatch):
    """The length dynamic NTK scales for was the example's ("real") or 1 (fake): every replay scaled for it."""
    q, k, _, _ = _inputs()
    rope = posenc.RoPE(D, rope_parameters={"rope_type": "dynamic", "factor": 2.0}, max_position_embeddings=16)
    with pytest.raises(ValueError, match=r"make_fx's trace.*pass seq_len="):
        make_fx(lambda q, k, p: rope(q, k, positions=p), tracing_mode=mode, pre_dispatch=pre_dispatch)(q, k, IDS)
    # cos_sin reads no state: its graph reads the length (posenc::dynamic_inv_freq) at every replay.
    graph = make_fx(lambda p: rope.cos_sin(p), tracing_mode=mode, pre_dispatch=pre_dispatch)(IDS)
    for ids in (IDS, IDS + 40):
        _all_close(graph(ids), rope.cos_sin(ids))
    graph = make_fx(lambda q, k, p: rope(q, k, positions=p, seq_len=64), tracing_mode=mode, pre_dispatch=pre_dispatch)(
        q, k, IDS
    )
    _all_close(graph(q, k, IDS + 40), rope(q, k, positions=IDS + 40, seq_len=64))


@PRE_DISPATCH
@pytest.mark.parametrize("mode", MODES)
def test_make_fx_of_longrope_chooses_its_factors_in_the_graph(mode, pre_dispatch):
    """As under torch.compile: the short or long factors for max(positions) + 1, chosen by the graph at each call
    (the example's choice was baked in, or a bare torch error came from reading the length)."""
    q, k, _, _ = _inputs()
    factors = {"short_factor": [1.0, 1.1, 1.2, 1.3], "long_factor": [2.0, 3.0, 4.0, 5.0], "factor": 4.0}
    params = {"rope_type": "longrope", "original_max_position_embeddings": 16, **factors}
    rope = posenc.RoPE(D, rope_parameters=params, max_position_embeddings=64)
    graph = make_fx(lambda q, k, p: rope(q, k, positions=p), tracing_mode=mode, pre_dispatch=pre_dispatch)(q, k, IDS)
    for ids in (IDS, IDS + 30):  # max 9 (short factors) and 39 (long ones)
        _all_close(graph(q, k, ids), rope(q, k, positions=ids))


def test_make_fx_real_mode_traces_cu_seqlens():
    """Its checks read cu_seqlens[0] with .item(), which make_fx refuses: torch's bare "trying to get value out of a
    tracing tensor" came from inside posenc's checks."""
    q, _, cos, sin = _inputs()
    fn = INDEX_KINDS["cu_seqlens"][0]
    graph = make_fx(fn)(q, cos, sin, CU_SEQLENS)
    other = torch.tensor([0, 4, 5, 9])
    assert_close(graph(q, cos, sin, other), fn(q, cos, sin, other))


def test_host_list_reads_a_view_of_ids_updated_in_place_inside_functionalize():
    """A functional wrapper holds its current values only once its base's pending in-place updates are applied
    (``torch._sync``): a view read without them had the values from before the update."""

    def read(ids):
        view = ids[:1]
        ids.add_(3)
        return torch.tensor(posenc._checks.host_list(view))

    assert functionalize(read)(torch.tensor([1, 2])).tolist() == [4]


@pytest.mark.parametrize("mode", MODES)
def test_make_fx_of_a_rope_that_built_its_table_reads_the_ids_it_is_given(mode):
    """A RoPE that built its table eagerly, then traced: the graph must not read the kept table as a CUDA graph
    capture does (its 256 rows baked in: ids past them raised torch's IndexError at replay)."""
    q, k, _, _ = _inputs()
    rope = posenc.RoPE(D)
    rope(q, k, positions=IDS)  # builds the table
    graph = make_fx(lambda q, k, p: rope(q, k, positions=p), tracing_mode=mode)(q, k, IDS)
    for ids in (IDS + 300, IDS + 5000):
        _all_close(graph(q, k, ids), rope(q, k, positions=ids))


def test_a_torch_function_mode_is_not_make_fx_recording():
    """``with torch.device(...)`` pushes a torch function mode, as make_fx(pre_dispatch=True) does; only the latter
    records. Under the former values are read as in eager: checks run and dynamic NTK scales for the ids' length."""
    q, k, cos, sin = _inputs()
    rope = posenc.RoPE(D, rope_parameters={"rope_type": "dynamic", "factor": 2.0}, max_position_embeddings=4)
    want = rope(q, k, positions=IDS + 20)
    with torch.device("cpu"):
        assert not posenc._checks.recording()
        torch.testing.assert_close(rope(q, k, positions=IDS + 20), want, rtol=0, atol=0)
        with pytest.raises(ValueError, match=r"positions reach 30 \.\. 39 but the cos/sin table has 32 rows"):
            posenc.apply_rotary(q, cos, sin, positions=IDS + 30)
