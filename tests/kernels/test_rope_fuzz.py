"""Differential fuzzing of the rotary entry points on every backend.

Hypothesis draws whole calls: every way of giving the angles (broadcast cos/sin of several shapes, tables read at
default positions, int / per-sequence / 0-d offsets, (s,) and (b, s) position ids, packed sequences with
cu_seqlens), both layouts, views with padding, permuted strides or a transposed channel dim, q and k with
different head counts, partial rotation, both pair layouts, conjugation, in place and out of place, every dtype
with float32 or float64 tables, and gradients. Each result is checked against a float64 rotation written out
here from the cos/sin rows each token should read, independent of the library's own indexing and math. A second
test drives ``posenc.RoPE`` with random scalings: the fused backends agree with the torch path given the same
module's tables, and a sequence rotated in chunks at increasing offsets (a KV cache filled step by step) equals
one call bit for bit. A third draws unusual memory (strided and expanded views, slices of one fused projection, q
and k one tensor, empty dims, strided cos/sin and index tensors, odd incoming gradients) and checks which elements
of each buffer a call changes.

(This fuzz found that the Triton kernel stored float64 results into bf16/fp16 unlike torch: see
``test_float64_math_rounds_to_16_bits_through_float32_like_torch``.)
"""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

import posenc
from posenc import apply_rotary, apply_rotary_, apply_rotary_qk
from posenc.testing import TOLERANCES, assert_close

from .test_rope_kernels import DEVICE, table

NATIVE = DEVICE["triton"] == "cuda"  # scripts/gpu_check.sh: Triton compiled for the GPU
DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
# The interpreted Triton kernel is slow per element: smaller draws, fewer examples. Compiled, each new head dim or
# flag combination is a compile of a second or two, so the GPU run draws fewer still.
EXAMPLES = {"torch": 150, "cpu": 300, "triton": 20 if NATIVE else 100}
MAX_SEQ = {"torch": 40, "cpu": 40, "triton": 9}
MAX_HALF = {"torch": 40, "cpu": 70, "triton": 12}


def reference(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *, interleaved: bool, conjugate: bool, added: bool = False
):
    """x rotated in float64: pair i is channels (2i, 2i+1) or (i, i + r/2), turned by the angle whose cos and sin
    are given (by its negative when conjugate); channels past r are copied. ``added``: every term added instead
    (conjugate then means nothing): given |x|, |cos| and |sin| (and, through autograd, an |incoming gradient|),
    each output and each gradient is the sum of the magnitudes of the terms the rotation or its backward adds up
    for it, what the rounding of those terms and of their sums is relative to."""
    x = x.to(torch.float64)
    half = cos.shape[-1]
    sin = -sin if conjugate and not added else sin
    if interleaved:
        first, second = slice(0, 2 * half, 2), slice(1, 2 * half, 2)
    else:
        first, second = slice(0, half), slice(half, 2 * half)
    out = x.clone()
    out[..., first] = x[..., first] * cos + (1 if added else -1) * x[..., second] * sin
    out[..., second] = x[..., second] * cos + x[..., first] * sin
    return out


def _seed_torch(draw) -> None:
    """Seed torch's generator from the draw: hypothesis seeds ``random`` for each example but not torch, so the
    tensor values (and the incoming gradients) were new at each run of an example, and a failure that depended on
    them could be neither replayed nor shrunk (it was reported as flaky)."""
    torch.manual_seed(draw(st.integers(0, 2**32 - 1)))


@st.composite
def views(draw, shape: tuple[int, ...], dtype: torch.dtype, *, unit_channel_stride: bool = False) -> torch.Tensor:
    """Random values of ``shape``: contiguous, a slice of a padded buffer, leading dims stored in another order, or
    (unless unit_channel_stride) with the channel dim transposed."""
    forms = ["contiguous", "padded", "permuted"] + ([] if unit_channel_stride else ["channel-strided"])
    form = draw(st.sampled_from(forms))

    def values(size):
        return torch.randn(size, dtype=torch.float64).to(dtype)

    if form == "contiguous":
        return values(shape)
    if form == "padded":
        pads = [draw(st.integers(0, 2)) for _ in shape]
        starts = [draw(st.integers(0, p)) for p in pads]
        big = values([n + p for n, p in zip(shape, pads, strict=True)])
        return big[tuple(slice(a, a + n) for a, n in zip(starts, shape, strict=True))]
    if form == "permuted":
        order = draw(st.permutations(range(len(shape) - 1)))
        stored = values([shape[i] for i in order] + [shape[-1]])
        return stored.permute(*[order.index(i) for i in range(len(shape) - 1)], len(shape) - 1)
    return values([shape[-1], *shape[:-1]]).permute(*range(1, len(shape)), 0)


@dataclass
class Call:
    xs: dict[str, torch.Tensor]
    cos: torch.Tensor
    sin: torch.Tensor
    # The cos and sin each token must be turned by, float64, broadcastable to every x's shape[:-1] + (r/2,).
    token_cos: torch.Tensor
    token_sin: torch.Tensor
    kwargs: dict = field(default_factory=dict)
    interleaved: bool = False
    conjugate: bool = False
    inplace: bool = False
    grad: bool = False

    def expected(self, x: torch.Tensor, *, inverse: bool = False) -> torch.Tensor:
        """x rotated as this call rotates (inverse: rotated back), in float64."""
        conjugate = self.conjugate != inverse
        return reference(x.cpu(), self.token_cos, self.token_sin, interleaved=self.interleaved, conjugate=conjugate)


@st.composite
def calls(draw, backend: str) -> Call:
    _seed_torch(draw)
    dtype = draw(st.sampled_from(DTYPES))
    table_dtype = torch.float64 if dtype == torch.float64 or draw(st.booleans()) else torch.float32
    half = draw(st.integers(1, MAX_HALF[backend]))
    d = 2 * half + draw(st.integers(0, 5))
    inplace = draw(st.booleans())
    names = ["x"] if inplace or draw(st.booleans()) else ["q", "k"]
    heads = {name: draw(st.integers(1, 3)) for name in names}
    b, s = draw(st.integers(1, 3)), draw(st.integers(1, MAX_SEQ[backend]))
    rows = draw(st.integers(s, 3 * s + 10))
    cos_t, sin_t = table(2 * half, rows, dtype=table_dtype)
    mode = draw(st.sampled_from(["broadcast", "bhsd", "bshd", "varlen"]))
    kwargs: dict = {}

    if mode == "broadcast":
        shapes = {name: (b, h, s, d) for name, h in heads.items()}
        form = draw(st.sampled_from(["(s, r/2)", "(1, s, r/2)", "(1, 1, s, r/2)", "(b, 1, s, r/2)", "(b, h, s, r/2)"]))
        if form == "(b, h, s, r/2)":
            h = draw(st.integers(1, 3))
            shapes = {name: (b, h, s, d) for name in names}  # one h for all: cos has it
            angle = torch.rand(b, h, s, half, dtype=torch.float64) * 100  # any angle per (batch, head, token)
            cos, sin = angle.cos().to(table_dtype), angle.sin().to(table_dtype)
        elif form == "(b, 1, s, r/2)":
            starts = [draw(st.integers(0, rows - s)) for _ in range(b)]
            cos = torch.stack([cos_t[a : a + s] for a in starts])[:, None]
            sin = torch.stack([sin_t[a : a + s] for a in starts])[:, None]
        else:
            start = draw(st.integers(0, rows - s))
            cos, sin = cos_t[start : start + s], sin_t[start : start + s]
            lead = form.count("1,")
            cos, sin = cos[(None,) * lead], sin[(None,) * lead]
        token_cos, token_sin = cos.double(), sin.double()
    elif mode == "varlen":
        lengths = draw(st.lists(st.integers(0, s), min_size=1, max_size=4).filter(lambda ls: sum(ls) > 0))
        cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
        kwargs["cu_seqlens"] = cu.to(draw(st.sampled_from([torch.int32, torch.int64])))
        room = rows - max(lengths)
        starts = [draw(st.integers(0, room)) for _ in lengths]
        how = draw(st.sampled_from(["none", "int", "per-sequence", "0-d"]))
        if how == "int":
            kwargs["offset"], starts = starts[0], [starts[0]] * len(lengths)
        elif how == "0-d":
            kwargs["offset"], starts = torch.tensor(starts[0]), [starts[0]] * len(lengths)
        elif how == "per-sequence":
            kwargs["offset"] = torch.tensor(starts)
        else:
            starts = [0] * len(lengths)
        pos = torch.cat([torch.arange(n) + a for n, a in zip(lengths, starts, strict=True)])
        shapes = {name: (int(cu[-1]), h, d) for name, h in heads.items()}
        token_cos, token_sin = cos_t.double()[pos][:, None], sin_t.double()[pos][:, None]
        cos, sin = cos_t, sin_t
    else:
        if mode == "bshd" or draw(st.booleans()):
            kwargs["layout"] = mode
        ids = draw(st.sampled_from(["default", "(s,)", "(b, s)", "(1, s)"]))
        if ids == "default":
            pos = torch.arange(s).expand(b, s)
        else:
            n = 1 if ids in ("(s,)", "(1, s)") else b
            drawn = torch.tensor([[draw(st.integers(0, rows - 1)) for _ in range(s)] for _ in range(n)])
            kwargs["positions"] = drawn[0] if ids == "(s,)" else drawn
            pos = drawn.expand(b, s)
        room = rows - 1 - int(pos.max())
        assume(room >= 0)
        how = draw(st.sampled_from(["int", "per-sequence", "0-d"] + (["none"] if ids != "default" else [])))
        if how == "int":
            kwargs["offset"] = draw(st.integers(0, room))
            pos = pos + kwargs["offset"]
        elif how == "0-d":
            shift = draw(st.integers(0, room))
            kwargs["offset"], pos = torch.tensor(shift), pos + shift
        elif how == "per-sequence":
            shifts = torch.tensor([draw(st.integers(0, room)) for _ in range(b)])
            kwargs["offset"], pos = shifts, pos + shifts[:, None]
        shapes = {name: (b, h, s, d) if mode == "bhsd" else (b, s, h, d) for name, h in heads.items()}
        head_axis = 1 if mode == "bhsd" else 2
        token_cos = cos_t.double()[pos].unsqueeze(head_axis)
        token_sin = sin_t.double()[pos].unsqueeze(head_axis)
        cos, sin = cos_t, sin_t

    # In place needs a unit channel stride on the fused backends (they refuse otherwise: tested elsewhere).
    unit = inplace and backend != "torch"
    xs = {name: draw(views(shapes[name], dtype, unit_channel_stride=unit)) for name in names}
    return Call(
        xs=xs,
        cos=cos,
        sin=sin,
        token_cos=token_cos,
        token_sin=token_sin,
        kwargs=kwargs,
        interleaved=draw(st.booleans()),
        conjugate=draw(st.booleans()),
        inplace=inplace,
        grad=not inplace and dtype in (torch.float32, torch.float64) and draw(st.booleans()),
    )


def on_device(device: str, kwargs: dict) -> dict:
    """kwargs with their tensors on ``device``; views stay views where they are there already."""
    return {key: v.to(device) if isinstance(v, torch.Tensor) else v for key, v in kwargs.items()}


def moved(call: Call, device: str) -> tuple[dict[str, torch.Tensor], torch.Tensor, torch.Tensor, dict]:
    """The call's tensors on ``device``."""
    xs, cos, sin = on_device(device, call.xs), call.cos.to(device), call.sin.to(device)
    return xs, cos, sin, on_device(device, call.kwargs)


@pytest.mark.parametrize("backend", ["torch", "cpu", "triton"])
def test_entry_points_match_the_float64_reference(backend):
    device = DEVICE[backend]

    @settings(max_examples=EXAMPLES[backend], deadline=None, suppress_health_check=list(HealthCheck))
    @given(calls(backend))
    def check(call: Call):
        xs, cos, sin, kwargs = moved(call, device)
        options = dict(interleaved=call.interleaved, conjugate=call.conjugate, backend=backend, **kwargs)
        before = {name: x.clone() for name, x in xs.items()}
        if call.inplace:
            (x,) = xs.values()
            assert apply_rotary_(x, cos, sin, **options) is x
            outs = {"x": x}
        else:
            for x in xs.values():
                x.requires_grad_(call.grad)
            if "q" in xs:
                outs = dict(zip("qk", apply_rotary_qk(xs["q"], xs["k"], cos, sin, **options), strict=True))
            else:
                outs = {"x": apply_rotary(xs["x"], cos, sin, **options)}
            for name, x in xs.items():  # out of place leaves the inputs bit-identical
                assert torch.equal(x.detach(), before[name])
        half = cos.shape[-1]
        for name, out in outs.items():
            assert out.dtype == before[name].dtype and out.shape == before[name].shape
            assert_close(out.detach().cpu(), call.expected(before[name]), msg=f"{name} ({backend})")
            # Channels past r are copied bit for bit (or, in place, left alone).
            assert torch.equal(out.detach()[..., 2 * half :], before[name][..., 2 * half :])
        if call.grad:
            weights = {name: torch.randn(out.shape, dtype=torch.float64).to(out.dtype) for name, out in outs.items()}
            loss = sum((out * weights[name].to(device)).sum() for name, out in outs.items())
            grads = torch.autograd.grad(loss, [xs[name] for name in outs])
            for name, grad in zip(outs, grads, strict=True):
                # The gradient of a rotation is the rotation back.
                assert_close(grad.cpu(), call.expected(weights[name], inverse=True), msg=f"gradient of {name}")

    check()


@st.composite
def rope_modules(draw) -> tuple[dict, int, int]:
    """(rope_parameters, head_dim, max_position_embeddings) of a random valid scaling, partial rotation included."""
    head_dim = draw(st.integers(4, 40))
    rotary_dim = 2 * draw(st.integers(2, head_dim // 2))
    rope_type = draw(st.sampled_from(["default", "linear", "dynamic", "yarn", "llama3", "longrope"]))
    params: dict = {"rope_type": rope_type, "rope_theta": draw(st.sampled_from([100.0, 10000.0, 5e5]))}
    original = draw(st.sampled_from([16, 32, 64]))
    if rope_type != "default":
        params["factor"] = draw(st.floats(1.0, 16.0))
    if rope_type in ("yarn", "llama3", "longrope"):
        params["original_max_position_embeddings"] = original
    if rope_type == "llama3":
        params |= {"low_freq_factor": 1.0, "high_freq_factor": draw(st.sampled_from([2.0, 4.0]))}
    if rope_type == "longrope":
        params["short_factor"] = draw(st.lists(st.floats(1.0, 3.0), min_size=rotary_dim // 2, max_size=rotary_dim // 2))
        params["long_factor"] = draw(st.lists(st.floats(1.0, 30.0), min_size=rotary_dim // 2, max_size=rotary_dim // 2))
    if rotary_dim != head_dim:
        params["partial_rotary_factor"] = rotary_dim / head_dim
    max_positions = int(original * params["factor"]) if rope_type == "longrope" else original
    return params, head_dim, max_positions


@pytest.mark.parametrize("backend", ["cpu", "triton"])
def test_rope_module_backends_agree_and_chunked_calls_equal_one_call(backend):
    device = DEVICE[backend]

    @settings(max_examples=EXAMPLES[backend] // 2, deadline=None, suppress_health_check=list(HealthCheck))
    @given(rope_modules(), st.data())
    def check(module, data):
        _seed_torch(data.draw)
        params, head_dim, max_positions = module
        dtype = data.draw(st.sampled_from(DTYPES))
        layout = data.draw(st.sampled_from(["bhsd", "bshd"]))
        b, s = data.draw(st.integers(1, 3)), data.draw(st.integers(1, MAX_SEQ[backend]))
        hq, hk = data.draw(st.integers(1, 3)), data.draw(st.integers(1, 3))
        options = dict(
            rope_parameters=params,
            interleaved=data.draw(st.booleans()),
            max_position_embeddings=max_positions,
            mode=data.draw(st.sampled_from(["hf", "consistent"])),
        )
        kwargs: dict = {"layout": layout}
        how = data.draw(st.sampled_from(["default", "int", "per-sequence", "(s,) ids", "(b, s) ids"]))
        if how == "int":
            kwargs["offset"] = data.draw(st.integers(0, 100))
        elif how == "per-sequence":
            kwargs["offset"] = torch.tensor(data.draw(st.lists(st.integers(0, 100), min_size=b, max_size=b)))
        elif how != "default":
            n = (s,) if how == "(s,) ids" else (b, s)
            kwargs["positions"] = torch.randint(0, 120, n)
        if params["rope_type"] in ("dynamic", "longrope"):
            kwargs["seq_len"] = 200  # the same scaling for every call, whatever its positions
        shape = (lambda h: (b, h, s, head_dim)) if layout == "bhsd" else (lambda h: (b, s, h, head_dim))
        q, k = (torch.randn(shape(h), dtype=torch.float64).to(dtype) for h in (hq, hk))
        # The torch path with the module's own tables (float32 ones for all but float64 x, computed as the mode
        # says): the backends differ only in the rotation's float32 roundings, one unit in the last place at most.
        expected = posenc.RoPE(head_dim, backend="torch", **options)(q, k, **kwargs)
        rope = posenc.RoPE(head_dim, backend=backend, **options).to(device)
        device_kwargs = on_device(device, kwargs)
        q_on, k_on = q.to(device), k.to(device)
        outs = rope(q_on, k_on, **device_kwargs)
        atol, rtol = TOLERANCES[dtype]
        for out, ref in zip(outs, expected, strict=True):
            assert out.dtype == dtype
            torch.testing.assert_close(out.cpu(), ref, atol=atol, rtol=rtol)
        if "positions" in kwargs or s == 1:
            return
        # A KV cache filled in steps: each chunk rotated at its offset gives the full call's bits.
        cuts = sorted(set(data.draw(st.lists(st.integers(1, s - 1), min_size=1, max_size=3))))
        axis = 2 if layout == "bhsd" else 1
        start = device_kwargs.get("offset", 0)
        pieces = []
        for a, z in zip([0, *cuts], [*cuts, s], strict=True):
            chunk = (x.narrow(axis, a, z - a) for x in (q_on, k_on))
            pieces.append(rope(*chunk, **(device_kwargs | {"offset": start + a})))
        for i, full in enumerate(outs):
            assert torch.equal(torch.cat([p[i] for p in pieces], axis), full)

    check()


# Unusual memory: what the draws above leave out. Tiny sizes and few examples (the whole test runs in seconds).
ODD_EXAMPLES = {"torch": 100, "cpu": 80, "auto": 50, "triton": 8 if NATIVE else 20}


def _stored(draw, shape: tuple[int, ...], dtype: torch.dtype, form: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(x of ``shape``, the buffer it is a view of) for a memory form: every other element along one dim (the
    channels included), a dim expanded from size 1 (stride 0), or the leading dims stored in another order."""
    n = len(shape)
    if form == "step":
        dim = draw(st.integers(0, n - 1))
        buffer = torch.randn([2 * m if i == dim else m for i, m in enumerate(shape)], dtype=torch.float64).to(dtype)
        return buffer[(slice(None),) * dim + (slice(None, None, 2),)], buffer
    if form == "expanded" and n > 1:
        dim = draw(st.integers(0, n - 2))
        buffer = torch.randn([1 if i == dim else m for i, m in enumerate(shape)], dtype=torch.float64).to(dtype)
        return buffer.expand(shape), buffer
    if form == "permuted":
        order = draw(st.permutations(range(n - 1)))
        buffer = torch.randn([shape[i] for i in order] + [shape[-1]], dtype=torch.float64).to(dtype)
        return buffer.permute(*[order.index(i) for i in range(n - 1)], n - 1), buffer
    buffer = torch.randn(shape, dtype=torch.float64).to(dtype)
    return buffer, buffer


@dataclass
class OddCall:
    xs: dict[str, torch.Tensor]  # views of buffers (q and k may share one, or be one tensor)
    buffers: dict[str, torch.Tensor]  # name -> the whole memory its x is a view of, in x's dtype
    cos: torch.Tensor
    sin: torch.Tensor
    token_rows: object  # (cos, sin) float64 -> each token's (cos, sin), broadcastable to x.shape[:-1] + (r/2,)
    kwargs: dict
    interleaved: bool
    conjugate: bool
    inplace: bool
    grad: str  # "none", "first" (q alone), "last" (k alone), "all", "angles" (cos and sin)
    seed: str  # the backward's incoming gradient: "random", "ones" (expanded, stride 0) or "transposed"


@st.composite
def odd_calls(draw) -> OddCall:
    """A call in unusual memory (``test_unusual_memory_matches_the_float64_reference`` lists the forms)."""
    _seed_torch(draw)
    dtype = draw(st.sampled_from(DTYPES))
    table_dtype = draw(st.sampled_from([torch.float32, torch.float64]))
    half = draw(st.integers(1, 5))
    d = 2 * half + draw(st.integers(0, 3))
    inplace = draw(st.booleans())
    names = ["x"] if inplace or draw(st.booleans()) else ["q", "k"]
    low = 0 if draw(st.integers(0, 5)) == 0 else 1  # sometimes an empty batch, sequence or head count
    b, s = draw(st.integers(low, 3)), draw(st.integers(low, 5))
    heads = {name: draw(st.integers(low, 3)) for name in names}
    rows = s + draw(st.integers(1, 6))
    cos_t, sin_t = table(2 * half, rows, dtype=table_dtype)
    kwargs: dict = {}
    mode = draw(st.sampled_from(["broadcast", "bhsd", "bshd", "varlen"]))
    if mode == "broadcast":
        shapes = {name: (b, h, s, d) for name, h in heads.items()}
        angle = torch.rand(b, 1, s, half, dtype=torch.float64) * 100
        cos, sin = angle.cos().to(table_dtype), angle.sin().to(table_dtype)
        form = draw(st.sampled_from(["expanded", "every-other", "transposed", "strides-differ"]))
        if form == "expanded":  # stride 0 across the heads
            cos, sin = (t.expand(b, max(heads.values()), s, half) for t in (cos, sin))
            shapes = {name: (b, max(heads.values()), s, d) for name in names}
        elif form == "every-other":  # unit stride nowhere
            cos, sin = (torch.stack((t, t), -1)[..., 0] for t in (cos, sin))
        elif form == "transposed":
            cos, sin = (t.transpose(-1, -2).contiguous().transpose(-1, -2) for t in (cos, sin))
        else:
            sin = sin.transpose(-1, -2).contiguous().transpose(-1, -2)

        def token_rows(c, s_):
            return c, s_
    elif mode == "varlen":
        lengths = draw(st.lists(st.integers(0, s), min_size=1, max_size=3))
        cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
        starts = [draw(st.integers(0, rows - max(lengths))) for _ in lengths]
        kwargs["cu_seqlens"], kwargs["offset"] = cu, torch.tensor(starts)
        pos = torch.cat([torch.arange(n) + a for n, a in zip(lengths, starts, strict=True)]).long()
        shapes = {name: (int(cu[-1]), h, d) for name, h in heads.items()}
        cos, sin = cos_t, sin_t

        def token_rows(c, s_):
            return c[pos][:, None], s_[pos][:, None]
    else:
        if mode == "bshd" or draw(st.booleans()):
            kwargs["layout"] = mode
        drawn = [[draw(st.integers(0, rows - 1)) for _ in range(s)] for _ in range(b)]
        ids = torch.tensor(drawn, dtype=torch.long).reshape(b, s)
        kwargs["positions"] = ids
        shapes = {name: (b, h, s, d) if mode == "bhsd" else (b, s, h, d) for name, h in heads.items()}
        head_axis = 1 if mode == "bhsd" else 2
        cos, sin = cos_t, sin_t
        if draw(st.booleans()):  # a table that is a column slice of a wider one, with a row stride of its own
            cos, sin = (torch.cat((t, t), -1)[:, :half] for t in (cos, sin))

        def token_rows(c, s_):
            return c[ids].unsqueeze(head_axis), s_[ids].unsqueeze(head_axis)

    # Index tensors in other memory and dtypes: every other element of a wider tensor, or int32.
    for key in ("positions", "offset", "cu_seqlens"):
        value = kwargs.get(key)
        if value is not None and draw(st.booleans()):
            kwargs[key] = torch.stack((value, value), -1)[..., 0] if draw(st.booleans()) else value.int()

    form = draw(st.sampled_from(["contiguous", "step", "expanded", "permuted", "fused"]))
    if form == "fused" and mode != "varlen":  # q and k cut out of one (b, s, heads * d) projection
        heads_of = {name: shape[1 if mode in ("broadcast", "bhsd") else 2] for name, shape in shapes.items()}
        buffer = torch.randn(b, s, (sum(heads_of.values()) + 1) * d, dtype=torch.float64).to(dtype)
        xs, start = {}, 0
        for name, h in heads_of.items():
            x = buffer[..., start * d : (start + h) * d].view(b, s, h, d)
            xs[name], start = (x.transpose(1, 2) if mode in ("broadcast", "bhsd") else x), start + h
        buffers = dict.fromkeys(names, buffer)
    else:
        xs, buffers = {}, {}
        for name in names:
            xs[name], buffers[name] = _stored(draw, shapes[name], dtype, form)
    if len(names) == 2 and shapes["q"] == shapes["k"] and draw(st.integers(0, 4)) == 0:
        xs["k"], buffers["k"] = xs["q"], buffers["q"]  # one tensor as q and k
    return OddCall(
        xs=xs,
        buffers=buffers,
        cos=cos,
        sin=sin,
        token_rows=token_rows,
        kwargs=kwargs,
        interleaved=draw(st.booleans()),
        conjugate=draw(st.booleans()),
        inplace=inplace,
        grad=draw(st.sampled_from(["none", "first", "last", "all", "angles"])),
        seed=draw(st.sampled_from(["random", "ones", "transposed"])),
    )


def _view_on(base: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """x's view (shape, strides, offset into its contiguous buffer) on base, a contiguous tensor of that buffer's
    shape: the same memory layout in another tensor (one on the device, or one that requires grad)."""
    return base.as_strided(x.shape, x.stride(), base.storage_offset() + x.storage_offset())


def _seed(out: torch.Tensor, form: str) -> torch.Tensor:
    """The incoming gradient of ``out`` for the backward, in a memory form of its own."""
    if form == "ones":
        return torch.ones((), dtype=out.dtype, device=out.device).expand(out.shape)
    seed = torch.randn(out.shape, dtype=torch.float64).to(out.dtype).to(out.device)
    if form == "transposed" and out.dim() >= 2:
        return seed.transpose(-1, -2).contiguous().transpose(-1, -2)
    return seed


def _rotated_elements(buffer: torch.Tensor, x: torch.Tensor, rotary: int) -> torch.Tensor:
    """A bool mask over buffer: the elements that are rotated channels (0..r-1) of x, a view of it."""
    index = torch.arange(buffer.numel()).view(buffer.shape)
    mask = torch.zeros(buffer.numel(), dtype=torch.bool)
    mask[_view_on(index, x)[..., :rotary].reshape(-1)] = True
    return mask.view(buffer.shape)


def _rotate(xs: dict[str, torch.Tensor], cos, sin, inplace: bool, options: dict) -> dict[str, torch.Tensor]:
    """name -> rotated x through the entry point for xs (apply_rotary_, apply_rotary_qk or apply_rotary)."""
    if inplace:
        ((name, x),) = xs.items()
        assert apply_rotary_(x, cos, sin, **options) is x
        return {name: x}
    if len(xs) == 2:
        return dict(zip(xs, apply_rotary_qk(*xs.values(), cos, sin, **options), strict=True))
    return {name: apply_rotary(x, cos, sin, **options) for name, x in xs.items()}


@pytest.mark.parametrize("backend", ["torch", "cpu", "triton", "auto"])
def test_unusual_memory_matches_the_float64_reference(backend):
    """Views of every other element (the channels too), dims expanded from size 1 (stride 0), q and k cut out of one
    fused projection, one tensor as both q and k, empty batches, sequences and heads; cos/sin expanded, strided, or
    of differing strides; position ids, offsets and cu_seqlens strided or int32; gradients for q alone, k alone, both,
    or cos/sin, seeded with expanded or transposed incoming gradients. Out of place leaves every buffer
    bit-identical; in place changes exactly the rotated channels of x in its buffer and returns x; where a backend
    refuses (an expanded x in place, a strided channel dim in place or angles that need grad on a fused backend), it
    says so by name and writes nothing."""
    device = DEVICE["triton"] if backend == "triton" else "cpu"
    fused = backend in ("cpu", "triton")

    @settings(max_examples=ODD_EXAMPLES[backend], deadline=None, suppress_health_check=list(HealthCheck))
    @given(odd_calls())
    def check(call: OddCall):
        names = list(call.xs)
        wanted = {"all": names, "first": names[:1], "last": names[-1:]}.get(call.grad, [])
        bases, leaves = {}, {}  # id(buffer) -> its copy on the device, and the leaf that copy is made of
        for name in names:
            buffer = call.buffers[name]
            if id(buffer) not in bases:
                moved = buffer.to(device)
                if any(call.buffers[n] is buffer for n in wanted):
                    leaves[id(buffer)] = moved.requires_grad_()
                    bases[id(buffer)] = moved * 1  # not a leaf: may change in place
                else:
                    bases[id(buffer)] = moved.clone()
        xs = {name: _view_on(bases[id(call.buffers[name])], x) for name, x in call.xs.items()}
        cos, sin = call.cos.to(device), call.sin.to(device)
        if call.grad == "angles":
            cos, sin = cos.detach().requires_grad_(), sin.detach().requires_grad_()
        options = dict(interleaved=call.interleaved, conjugate=call.conjugate, backend=backend)
        options |= on_device(device, call.kwargs)
        rotary = 2 * cos.shape[-1]
        before = {key: base.detach().clone() for key, base in bases.items()}

        # The refusals expected, in the order they are checked.
        (x, *_) = xs.values()
        refusals = [
            (
                call.inplace
                and x.numel()
                and any(n > 1 and not step for n, step in zip(x.shape, x.stride(), strict=True)),
                "repeats its memory along dim",
            ),
            (fused and call.grad == "angles", "cos/sin require grad and the fused kernels do not differentiate them"),
            (
                fused and call.inplace and x.shape[-1] > 1 and x.stride(-1) != 1,
                "in place needs unit stride in the last dim",
            ),
        ]
        refusal = next((message for refused, message in refusals if refused), None)
        if refusal:
            with pytest.raises(ValueError, match=refusal):
                _rotate(xs, cos, sin, call.inplace, options)
            for key, base in bases.items():
                assert torch.equal(base.detach(), before[key])
            return
        outs = _rotate(xs, cos, sin, call.inplace, options)

        token_cos, token_sin = call.token_rows(call.cos.double(), call.sin.double())
        olds = {name: _view_on(before[id(call.buffers[name])], x) for name, x in call.xs.items()}
        for name, out in outs.items():
            assert out.shape == olds[name].shape and out.dtype == olds[name].dtype
            expected = reference(
                olds[name].cpu(), token_cos, token_sin, interleaved=call.interleaved, conjugate=call.conjugate
            )
            assert_close(out.detach().cpu(), expected, msg=f"{name} ({backend})")
            assert torch.equal(out.detach()[..., rotary:], olds[name][..., rotary:])
        for name in names:
            key = id(call.buffers[name])
            now, then = bases[key].detach().cpu(), before[key].cpu()
            if call.inplace:  # exactly the rotated channels of x changed
                kept = ~_rotated_elements(then, call.xs[name], rotary)
                assert torch.equal(now[kept], then[kept])
            else:
                assert torch.equal(now, then)

        differentiable = {name: out for name, out in outs.items() if out.requires_grad}
        targets = [cos, sin] if call.grad == "angles" else list(leaves.values())
        if not targets:
            return
        assert differentiable, "no output requires grad"
        seeds = {name: _seed(out, call.seed) for name, out in differentiable.items()}
        grads = torch.autograd.grad(
            list(differentiable.values()), targets, grad_outputs=list(seeds.values()), allow_unused=True
        )

        def float64_gradients(value, rotate) -> tuple[torch.Tensor | None, ...]:
            """The gradients of sum(rotate(x) * seed) through the same views of float64 buffers, every tensor
            passed through ``value`` first."""
            if call.grad == "angles":
                wide = [value(t.detach().cpu().double()).requires_grad_() for t in (cos, sin)]
                rows_cos, rows_sin = call.token_rows(*wide)
                olds64 = {name: value(old.cpu().double()) for name, old in olds.items()}
            else:
                rows_cos, rows_sin = value(token_cos), value(token_sin)
                wide = [value(before[key].cpu().double()).requires_grad_() for key in leaves]
                copies = dict(zip(leaves, (w * 1 for w in wide), strict=True))
                olds64 = {
                    name: _view_on(copies[id(call.buffers[name])], x) if id(call.buffers[name]) in copies else None
                    for name, x in call.xs.items()
                }
            loss = sum(
                (rotate(olds64[name], rows_cos, rows_sin) * value(seeds[name].cpu().double())).sum()
                for name in differentiable
                if olds64[name] is not None
            )
            return torch.autograd.grad(loss, wide, allow_unused=True)

        expected = float64_gradients(
            lambda t: t,
            lambda x, c, s: reference(x, c, s, interleaved=call.interleaved, conjugate=call.conjugate),
        )
        # Sums over broadcast or shared elements (cos/sin's gradient, an expanded x) add terms each rounded to x's
        # dtype, then round the sum: the error is a few units of that dtype relative to the sum of the terms'
        # magnitudes, which is far above |sum| where the terms cancel (two heads of an expanded fp16 x: 0.0773
        # from terms near 1, off by 0.0008 = 1.6 fp16 units of them; the row's largest |gradient| allowed 0.0003).
        sizes = float64_gradients(
            torch.abs, lambda x, c, s: reference(x, c, s, interleaved=call.interleaved, conjugate=False, added=True)
        )
        for got, want, size in zip(grads, expected, sizes, strict=True):
            got = torch.zeros_like(want) if got is None else got.cpu()
            want = torch.zeros_like(got, dtype=torch.float64) if want is None else want
            size = torch.zeros_like(want) if size is None else size
            assert_close(got, want, scale=size, reduction=True, msg=f"gradient ({backend}, {call.grad})")

    check()
