"""Differential fuzzing of the rotary entry points on every backend.

Hypothesis draws whole calls: every way of giving the angles (broadcast cos/sin of several shapes, tables read at
default positions, int / per-sequence / 0-d offsets, (s,) and (b, s) position ids, packed sequences with
cu_seqlens), both layouts, views with padding, permuted strides or a transposed channel dim, q and k with
different head counts, partial rotation, both pair layouts, conjugation, in place and out of place, every dtype
with float32 or float64 tables, and gradients. Each result is checked against a float64 rotation written out
here from the cos/sin rows each token should read, independent of the library's own indexing and math. A second
test drives ``posenc.RoPE`` with random scalings: the fused backends agree with the torch path given the same
module's tables, and a sequence rotated in chunks at increasing offsets (a KV cache filled step by step) equals
one call bit for bit.

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


def reference(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *, interleaved: bool, conjugate: bool):
    """x rotated in float64: pair i is channels (2i, 2i+1) or (i, i + r/2), turned by the angle whose cos and sin
    are given (by its negative when conjugate); channels past r are copied."""
    x = x.to(torch.float64)
    half = cos.shape[-1]
    sin = -sin if conjugate else sin
    if interleaved:
        first, second = slice(0, 2 * half, 2), slice(1, 2 * half, 2)
    else:
        first, second = slice(0, half), slice(half, 2 * half)
    out = x.clone()
    out[..., first] = x[..., first] * cos - x[..., second] * sin
    out[..., second] = x[..., second] * cos + x[..., first] * sin
    return out


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
