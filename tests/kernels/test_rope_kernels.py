"""The fused rotary backends (cpu: compiled C++; triton: interpreted on CPU here, native on a GPU through
scripts/gpu_check.sh) and the torch path, against the float64 reference with the shared tolerance table.

The exhaustive grid runs on the cpu backend; the interpreted Triton kernel gets a representative one.
"""

from __future__ import annotations

import functools
import mmap
import os
import platform
import re
import stat
import subprocess
import sys
import tempfile
import warnings
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import posenc
import posenc.kernels.backend
import posenc.kernels.launch
from posenc import apply_rotary, apply_rotary_, apply_rotary_qk
from posenc.kernels import choose_backend, cpu_rope, ops
from posenc.kernels.cpu_rope import rope_cpu
from posenc.rope.apply import rotate_pairs
from posenc.testing import TOLERANCES, assert_close, rope_inv_freq_reference, rope_reference, torch_threads

TRITON_DEVICE = "cuda" if os.environ.get("POSENC_TRITON_NATIVE") == "1" else "cpu"
DEVICE = {"cpu": "cpu", "torch": "cpu", "triton": TRITON_DEVICE}
ALL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
KINDS = ("broadcast", "offset", "per_sequence", "position_ids", "varlen")


def table(rotary_dim: int, n: int, *, factor: float = 1.0, dtype: torch.dtype = torch.float32):
    """(n, r/2) cos/sin tables from float64 angles, like RoPE's."""
    inv_freq = torch.tensor(rope_inv_freq_reference(rotary_dim, 10000.0), dtype=torch.float64)
    angles = torch.arange(n, dtype=torch.float64)[:, None] * inv_freq
    return (angles.cos() * factor).to(dtype), (angles.sin() * factor).to(dtype)


def make_case(kind: str, *, b: int, hq: int, hk: int, s: int, d: int, dtype: torch.dtype, seed: int = 0):
    """Inputs and call arguments for one way of giving positions, plus the reference positions per token.

    Returns (q, k, kwargs for apply_rotary minus cos/sin, ref_positions broadcastable to q.shape[:-1],
    a function making cos/sin of the right form from (n, r/2) tables).
    """
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64).to(dtype)

    if kind == "varlen":
        lengths = [s, max(s // 3, 1), 0, 2][: max(b, 2)]
        cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
        total = int(cu[-1])
        offsets = torch.arange(len(lengths)) * 5
        q, k = randn(total, hq, d), randn(total, hk, d)
        ref = torch.cat([torch.arange(n) + int(o) for n, o in zip(lengths, offsets, strict=True)])[:, None]
        return q, k, {"cu_seqlens": cu, "offset": offsets}, ref, lambda c: c
    layout = "bshd" if kind == "per_sequence" else "bhsd"
    shape = (lambda h: (b, s, h, d)) if layout == "bshd" else (lambda h: (b, h, s, d))
    q, k = randn(*shape(hq)), randn(*shape(hk))
    if kind == "broadcast":
        # (s, r/2) broadcast against (b, h, s, r/2): token i uses row i.
        return q, k, {}, torch.arange(s)[None, None], lambda c: c[:s]
    if kind == "offset":
        return q, k, {"offset": 11}, (torch.arange(s) + 11)[None, None], lambda c: c
    if kind == "per_sequence":
        offsets = torch.arange(b) * 13 + 2
        ref = (torch.arange(s)[None] + offsets[:, None])[:, :, None]  # (b, s, 1) against (b, s, h)
        return q, k, {"offset": offsets, "layout": "bshd"}, ref, lambda c: c
    positions = torch.randint(0, 300, (b, s), generator=gen)
    return q, k, {"positions": positions}, positions[:, None], lambda c: c


def rotate(backend, q, k, cos, sin, kwargs, **extra):
    device = DEVICE[backend]
    moved = {key: (v.to(device) if isinstance(v, torch.Tensor) else v) for key, v in kwargs.items()}
    outs = apply_rotary_qk(
        q.to(device), k.to(device), cos.to(device), sin.to(device), backend=backend, **moved, **extra
    )
    return tuple(o.cpu() for o in outs)


def check_forward_backward(backend, kind, *, b, hq, hk, s, d, r, dtype, interleaved, factor=1.0):
    q, k, kwargs, ref_pos, form = make_case(kind, b=b, hq=hq, hk=hk, s=s, d=d, dtype=dtype)
    cos, sin = (form(t) for t in table(r, 320, factor=factor))
    # The kernel's own inputs are checked for being left untouched: on a GPU, a .to() inside rotate would be a copy.
    q, k = q.to(DEVICE[backend]), k.to(DEVICE[backend])
    q_in, k_in = q.clone(), k.clone()
    q_out, k_out = rotate(backend, q, k, cos, sin, kwargs, interleaved=interleaved)
    assert q_out.dtype == dtype and q_out.shape == q.shape and k_out.shape == k.shape
    for x, out in ((q.cpu(), q_out), (k.cpu(), k_out)):
        expected = rope_reference(x, ref_pos, rotary_dim=r, interleaved=interleaved, attention_factor=factor)
        assert_close(out, expected, msg=f"{backend} {kind} {dtype} d={d} r={r} s={s}")
    assert torch.equal(q, q_in) and torch.equal(k, k_in), "out-of-place must leave its inputs untouched"
    # The backward rotates the incoming gradient by -angle (times the attention factor).
    if backend != "torch":
        device = DEVICE[backend]
        qg, kg = (x.to(device).requires_grad_() for x in (q, k))
        moved = {key: (v.to(device) if isinstance(v, torch.Tensor) else v) for key, v in kwargs.items()}
        outs = apply_rotary_qk(
            qg, kg, cos.to(device), sin.to(device), interleaved=interleaved, backend=backend, **moved
        )
        grads = [torch.randn(o.shape, dtype=torch.float64).to(dtype) for o in outs]
        torch.autograd.backward(outs, [g.to(device) for g in grads])
        for x, g in ((qg, grads[0]), (kg, grads[1])):
            expected = rope_reference(g, -ref_pos, rotary_dim=r, interleaved=interleaved, attention_factor=factor)
            assert_close(x.grad.cpu(), expected, msg=f"backward {backend} {kind} {dtype}")


# The exhaustive grid on the compiled CPU kernel: every way of giving positions x dtypes x layouts x sizes.
# The kernel walks s in blocks of 32 rows (cpu_rope.cpp's BLOCK): s = 217 (d = 64) is seven blocks with a ragged
# last one, and d = 256 takes s = 73 (two whole blocks and a ragged one): the cost grows with s * d and the row
# kernel does not depend on s, so the widest head at 217 rows (30 cases at about 1.4 s in CI) checked nothing more.
ROWS_OF_BLOCKS = 73


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", ALL_DTYPES)
@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize(
    ("d", "r", "s"), [(64, 64, 217), (80, 80, 7), (96, 48, 1), (72, 44, 3), (128, 96, 7), (256, 256, ROWS_OF_BLOCKS)]
)
def test_cpu_matches_reference(kind, dtype, interleaved, d, r, s):
    check_forward_backward("cpu", kind, b=2, hq=4, hk=2, s=s, d=d, r=r, dtype=dtype, interleaved=interleaved)


# Interpreted Triton: each feature at least once, with the odd sizes, both layouts and every dtype. The interpreter's
# cost grows with the tokens: one case keeps s = 217 (seven 32-token programs a head group, the last ragged), the
# other long ones take s = 73 (two to five programs of 64 to 16 tokens, the last ragged too).
@pytest.mark.parametrize(
    ("kind", "dtype", "interleaved", "d", "r", "s"),
    [
        ("broadcast", torch.float32, False, 64, 64, 217),
        ("broadcast", torch.bfloat16, True, 80, 80, 7),
        ("offset", torch.float16, False, 96, 48, 7),
        ("offset", torch.float32, True, 128, 96, 1),
        ("per_sequence", torch.bfloat16, False, 64, 32, ROWS_OF_BLOCKS),
        ("per_sequence", torch.float32, True, 256, 256, 7),
        ("position_ids", torch.float16, True, 64, 64, 7),
        ("position_ids", torch.float32, False, 80, 64, ROWS_OF_BLOCKS),
        ("varlen", torch.bfloat16, False, 64, 64, 7),
        ("varlen", torch.float32, True, 96, 96, ROWS_OF_BLOCKS),
    ],
)
def test_triton_matches_reference(kind, dtype, interleaved, d, r, s):
    check_forward_backward("triton", kind, b=2, hq=3, hk=1, s=s, d=d, r=r, dtype=dtype, interleaved=interleaved)


@pytest.mark.parametrize("backend", ["cpu", "triton"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("interleaved", [False, True])
def test_16_bit_x_with_float64_tables(backend, dtype, interleaved):
    """float64 cos/sin make the math float64 whatever x is; the result is rounded to x's dtype at the end (through
    float32, as torch's .to() does; the next test pins that)."""
    check_float64_tables(backend, dtype, interleaved)


@pytest.mark.parametrize("backend", ["torch", "cpu", "triton"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("interleaved", [False, True])
def test_float64_math_rounds_to_16_bits_through_float32_like_torch(backend, dtype, interleaved):
    """A float64 result just above the midpoint of two 16-bit values, by less than float32 resolves: rounded to
    float32 first it is the midpoint, which ties to even (down), as torch's own float64 -> bf16/fp16 .to() gives;
    rounded once it would go up. x = 1 and sin = 0 make the rotated value cos itself. Every backend must give
    torch's bits (the Triton interpreter used to cast float64 to bf16 as integers: zeros)."""
    mantissa = 7 if dtype == torch.bfloat16 else 10
    value = 1 + 2.0 ** -(mantissa + 1) + 2.0**-40
    assert torch.tensor(value, dtype=torch.float64).to(dtype).item() == 1.0  # torch rounds through float32
    device = DEVICE[backend]
    cos = torch.full((4, 3), value, dtype=torch.float64, device=device)
    sin = torch.zeros(4, 3, dtype=torch.float64, device=device)
    x = torch.ones(2, 1, 4, 7, dtype=dtype, device=device)
    out = apply_rotary(x, cos, sin, offset=0, interleaved=interleaved, backend=backend).cpu()
    assert torch.equal(out, torch.ones(2, 1, 4, 7, dtype=dtype))


@pytest.mark.parametrize("backend", ["torch", "cpu", "triton"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("interleaved", [False, True])
def test_16_bit_x_with_float64_tables_keeps_what_float32_tables_lose(backend, dtype, interleaved):
    """Within a 16-bit tolerance float32 math would pass: cos = 1/2 + 2^-27 and sin = 1/2 - 2^-27 are both 1/2 in
    float32, so x1 cos - x2 sin with x1 = x2 = 2^10 is 0 there and 2^-16 in float64 math, which both dtypes hold."""
    device = DEVICE[backend]
    cos = torch.full((4, 4), 0.5 + 2.0**-27, dtype=torch.float64, device=device)
    sin = torch.full((4, 4), 0.5 - 2.0**-27, dtype=torch.float64, device=device)
    x = torch.full((2, 1, 4, 8), 2.0**10, dtype=dtype, device=device)
    out = apply_rotary(x, cos, sin, offset=0, interleaved=interleaved, backend=backend).cpu().double()
    first = out[..., 0::2] if interleaved else out[..., :4]  # x1 cos - x2 sin, per pair
    second = out[..., 1::2] if interleaved else out[..., 4:]  # x2 cos + x1 sin
    assert (first == 2.0**-16).all() and (second == 2.0**10).all(), out[0, 0, 0]


@pytest.mark.parametrize("backend", ["torch", "cpu", "triton"])
def test_float32_x_with_float64_tables_is_float64_math_rounded_once(backend):
    """Within float32's tolerance a float32 rotation would pass too: bit for bit, against float64 math rounded."""
    device = DEVICE[backend]
    angles = torch.rand(64, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(0)) * 1000
    cos, sin = angles.cos().to(device), angles.sin().to(device)
    x = torch.randn(1, 2, 64, 32, generator=torch.Generator().manual_seed(1)).to(device)
    expected = apply_rotary(x.double(), cos, sin, offset=0, backend="torch").float()
    assert torch.equal(apply_rotary(x, cos, sin, offset=0, backend=backend), expected)


def test_positions_at_the_table_edge_and_of_the_wrong_batch_are_named():
    cos, sin = torch.ones(8, 4), torch.zeros(8, 4)
    x = torch.randn(2, 2, 3, 8)
    for backend in ("torch", "cpu"):
        assert apply_rotary(x, cos, sin, positions=torch.tensor([5, 6, 7]), backend=backend).shape == x.shape
        for kwargs in ({"positions": torch.tensor([5, 6, 8])}, {"offset": torch.tensor([6, 0])}):
            with pytest.raises(ValueError, match=r"positions reach .* but the cos/sin table has 8 rows"):
                apply_rotary(x, cos, sin, backend=backend, **kwargs)
        with pytest.raises(ValueError, match=r"positions must have shape \(3,\) or \(2, 3\)"):
            apply_rotary(x, cos, sin, positions=torch.arange(9).view(3, 3), backend=backend)
        with pytest.raises(TypeError, match=r"positions has dtype torch\.uint16"):
            apply_rotary(x, cos, sin, positions=torch.tensor([0, 1, 2], dtype=torch.uint16), backend=backend)


def test_the_fake_of_a_fused_call_has_the_strides_of_its_output():
    """x dense but with channels not innermost: a compiled graph that views the output flat needs the fake to
    give the real output's strides (empty_like(x) kept x's and failed to compile)."""
    x = torch.randn(1, 1, 8, 6).transpose(-1, -2)
    cos, sin = torch.randn(16, 4), torch.randn(16, 4)
    compiled = torch.compile(
        lambda x: apply_rotary(x, cos, sin, offset=0, backend="cpu").view(-1), backend="aot_eager", fullgraph=True
    )
    assert torch.equal(compiled(x), apply_rotary(x, cos, sin, offset=0, backend="cpu").reshape(-1))


def check_float64_tables(backend, dtype, interleaved):
    device = DEVICE[backend]
    cos, sin = (t.to(device) for t in table(64, 64, dtype=torch.float64))
    q = torch.randn(2, 3, 17, 80, dtype=torch.float64).to(dtype)
    out = apply_rotary(q.to(device), cos, sin, offset=5, interleaved=interleaved, backend=backend).cpu()
    expected = rope_reference(q, (torch.arange(17) + 5)[None, None], rotary_dim=64, interleaved=interleaved)
    assert out.dtype == dtype
    assert_close(out, expected)


@pytest.mark.parametrize("backend", ["torch", "cpu", "triton"])
@pytest.mark.parametrize("kind", ["broadcast", "varlen"])
def test_attention_factor_is_folded_in(backend, kind):
    check_forward_backward(
        backend, kind, b=2, hq=2, hk=1, s=7, d=64, r=64, dtype=torch.float32, interleaved=False, factor=1.2
    )


@pytest.mark.parametrize("backend", ["torch", "cpu"])
@pytest.mark.parametrize("kind", KINDS)
def test_gradcheck_float64(backend, kind):
    # One head: the positions vary over b and s (two sequences, per-sequence offsets, varlen's two lengths), and
    # gradgradcheck's cost grows with the elements it perturbs one by one.
    q, _, kwargs, _, form = make_case(kind, b=2, hq=1, hk=1, s=5, d=8, dtype=torch.float64)
    cos, sin = (form(t) for t in table(6, 320, dtype=torch.float64))
    x = q.clone().requires_grad_()
    assert torch.autograd.gradcheck(lambda t: apply_rotary(t, cos, sin, backend=backend, **kwargs), (x,))
    # The backward is the rotation by -angle through the same path, so it is differentiable too.
    assert torch.autograd.gradgradcheck(lambda t: apply_rotary(t, cos, sin, backend=backend, **kwargs), (x,))
    in_place = lambda t: apply_rotary_(t.clone(), cos, sin, backend=backend, **kwargs)  # noqa: E731
    assert torch.autograd.gradcheck(in_place, (x,)) and torch.autograd.gradgradcheck(in_place, (x,))


def test_gradcheck_float64_through_cos_sin_on_the_torch_path():
    x = torch.randn(1, 2, 5, 8, dtype=torch.float64, requires_grad=True)
    angles = torch.randn(5, 3, dtype=torch.float64)
    cos, sin = angles.cos().requires_grad_(), angles.sin().requires_grad_()
    assert choose_backend("auto", [x], cos, sin, "broadcast") == "torch"
    assert torch.autograd.gradcheck(lambda a, c, s: apply_rotary(a, c, s), (x, cos, sin))
    # Either table alone needing a gradient keeps the call there too: the fused kernels would give it none.
    for cos_grad, sin_grad in ((True, False), (False, True)):
        cos, sin = angles.cos().requires_grad_(cos_grad), angles.sin().requires_grad_(sin_grad)
        assert choose_backend("auto", [x], cos, sin, "broadcast") == "torch"
        assert torch.autograd.gradcheck(lambda a, c, s: apply_rotary(a, c, s), (x, cos, sin))


@pytest.mark.parametrize("backend", ["torch", "cpu", "triton"])
@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("kind", ["broadcast", "per_sequence", "varlen"])
def test_in_place_writes_exactly_the_rotated_channels(backend, interleaved, kind):
    device = DEVICE[backend]
    q, _, kwargs, _, form = make_case(kind, b=2, hq=3, hk=1, s=7, d=80, dtype=torch.bfloat16)
    cos, sin = (form(t).to(device) for t in table(48, 320))
    kwargs = {key: (v.to(device) if isinstance(v, torch.Tensor) else v) for key, v in kwargs.items()}
    q = q.to(device)
    expected = apply_rotary(q, cos, sin, interleaved=interleaved, backend=backend, **kwargs)
    x = q.clone()
    returned = apply_rotary_(x, cos, sin, interleaved=interleaved, backend=backend, **kwargs)
    assert returned is x
    assert torch.equal(x[..., 48:], q[..., 48:]), "channels past rotary_dim must not be written"
    assert torch.equal(x, expected)


@pytest.mark.parametrize("backend", ["torch", "cpu", "triton"])
def test_in_place_backward_matches_out_of_place(backend):
    device = DEVICE[backend]
    cos, sin = (t.to(device) for t in table(32, 16))
    leaf = torch.randn(2, 3, 7, 40, device=device, requires_grad=True)
    grad = torch.randn(2, 3, 7, 40, device=device)
    apply_rotary(leaf * 1.0, cos, sin, offset=4, backend=backend).backward(grad)
    expected, leaf.grad = leaf.grad, None
    x = leaf * 1.0  # a non-leaf, as activations are
    apply_rotary_(x, cos, sin, offset=4, backend=backend).backward(grad)
    assert_close(leaf.grad.double(), expected.double())


@pytest.mark.parametrize("backend", ["torch", "cpu", "triton"])
def test_in_place_on_views_of_a_fused_projection_keeps_every_gradient(backend):
    """q and k rotated in place as slices of one qkv projection: the gradient reaches all of the projection (q, k
    and v rows) as on the torch path. (The fused Functions once took x after cos/sin, and autograd routes a view's
    base gradient through the first input: the whole projection got a gradient of zero.)"""
    device = DEVICE[backend]
    cos, sin = (t.to(device).double() for t in table(8, 16))

    def projection_grad(backend: str) -> torch.Tensor:
        weight = torch.randn(3 * 2 * 8, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
        weight = weight.to(device).requires_grad_()
        x = torch.randn(2, 5, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(1)).to(device)
        qkv = (x @ weight.t()).view(2, 5, 3, 2, 8)  # (b, s, 3, h, d)
        q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
        apply_rotary_(q, cos, sin, layout="bshd", offset=0, backend=backend)
        apply_rotary_(k, cos, sin, layout="bshd", offset=0, backend=backend)
        scores = torch.einsum("bshd,bthd->bhst", q, k)
        torch.einsum("bhst,bthd->bshd", scores.softmax(-1), v).square().sum().backward()
        return weight.grad.cpu()

    got, expected = projection_grad(backend), projection_grad("torch")
    assert bool((got.view(3, -1).norm(dim=1) > 0).all())
    torch.testing.assert_close(got, expected, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("backend", ["torch", "cpu", "triton"])
def test_in_place_bumps_the_version_so_stale_saved_tensors_raise(backend):
    """A graph that saved x before an in-place rotation must refuse to backward, as for any in-place op."""
    device = DEVICE[backend]
    cos, sin = (t.to(device) for t in table(8, 16))
    weight = torch.randn(3, 8, device=device, requires_grad=True)
    x = torch.randn(3, 8, device=device)
    product = (x * weight).sum()  # saves x for weight's gradient
    version = x._version
    apply_rotary_(x, cos[:3], sin[:3], backend=backend)
    assert x._version > version
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        product.backward()


@pytest.mark.parametrize("backend", ["torch", "cpu", "triton"])
def test_q_and_k_backward_one_after_the_other(backend):
    """One fused node rotates q and k. A backward through q alone, then one through k, each give their gradient,
    as the torch path's two graphs do ("auto" must not make this depend on the device); the fused node once freed
    its tables in the first backward and the second raised "backward through the graph a second time". Through
    the same output twice it still raises, as on the torch path (unless retain_graph=True). This holds for q and k
    that are leaves: where they come from other operations (projections), the first backward also runs k's
    upstream nodes with no gradient and frees what they saved, so the second needs retain_graph=True on the fused
    backends (README, "Fast RoPE"; one node per tensor would cost a second launch in every backward)."""
    device = DEVICE[backend]
    cos, sin = (t.to(device) for t in table(16, 8))
    gen = torch.Generator().manual_seed(0)
    q0, k0, gq, gk = (torch.randn(shape, generator=gen).to(device) for shape in [(1, 3, 5, 16), (1, 1, 5, 16)] * 2)
    grads = {}
    for name in ("torch", backend):
        q, k = q0.clone().requires_grad_(), k0.clone().requires_grad_()
        out_q, out_k = apply_rotary_qk(q, k, cos, sin, offset=2, backend=name)
        out_q.backward(gq)
        assert k.grad is None
        out_k.backward(gk)
        grads[name] = (q.grad, k.grad)
        with pytest.raises(RuntimeError, match="backward through the graph a second time"):
            out_q.backward(gq)
        out_q, _ = apply_rotary_qk(q, k, cos, sin, offset=2, backend=name)
        q.grad = None
        out_q.backward(gq, retain_graph=True)
        out_q.backward(gq)
        assert_close(q.grad, 2 * grads[name][0])
    for got, expected in zip(grads[backend], grads["torch"], strict=True):
        assert_close(got, expected)  # float32's tolerance: two float32 computations


@pytest.mark.parametrize("backend", ["cpu", "triton"])
@pytest.mark.parametrize("changed", ["cos", "positions"])
@pytest.mark.parametrize("when", ["before the first backward", "between the backwards of q and k"])
def test_tables_changed_in_place_before_a_backward_are_refused(backend, changed, when):
    """A fused backward reads the table and positions the forward read, so changing them in between is refused:
    by save_for_backward's check in the first backward, and by the same check made by hand in a later one through
    k (the tables kept on ctx for it). The torch path saves the rows it gathered, so there such a change cannot
    alter the gradient."""
    device = DEVICE[backend]
    cos, sin = (t.to(device) for t in table(16, 8))
    positions = torch.tensor([[3, 1, 4, 1, 5]], device=device)
    q, k = (torch.randn(1, h, 5, 16, device=device, requires_grad=True) for h in (2, 1))
    tables = {"cos": cos.clone(), "positions": positions.clone()}
    out_q, out_k = apply_rotary_qk(q * 1.0, k * 1.0, tables["cos"], sin, positions=tables["positions"], backend=backend)
    if when == "before the first backward":
        tables[changed].add_(1)
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            out_q.sum().backward()
    else:
        out_q.sum().backward()
        tables[changed].add_(1)
        with pytest.raises(RuntimeError, match=f"the {changed} tensor given to the rotation was modified in place"):
            out_k.sum().backward()


@pytest.mark.parametrize("backend", ["auto", "torch", "cpu", "triton"])
def test_in_place_refuses_memory_shared_by_an_expanded_view(backend):
    device = DEVICE.get(backend, "cpu")
    cos, sin = (t.to(device) for t in table(8, 16))
    x = torch.randn(1, 1, 5, 8, device=device).expand(1, 3, 5, 8)
    with pytest.raises(ValueError, match=r"x repeats its memory along dim 1 .* rotate a copy \(x.clone\(\)\)"):
        apply_rotary_(x, cos[:5], sin[:5], backend=backend)


@pytest.mark.parametrize("backend", ["auto", "cpu", "triton"])
def test_in_place_on_channels_of_stride_two(backend):
    """A view whose channels are every other element: the fused kernels write unit-stride channels, so an explicit
    fused backend refuses it, naming x and its stride (the refusal said neither), and "auto" rotates it on the
    torch path, equal to rotating a copy."""
    device = DEVICE.get(backend, "cpu")
    cos, sin = (t.to(device) for t in table(8, 16))
    storage = torch.randn(1, 2, 5, 16, device=device)
    x = storage[..., ::2]
    expected = apply_rotary(x.contiguous(), cos[:5], sin[:5], backend="torch")
    if backend != "auto":
        with pytest.raises(ValueError, match=r"in place needs unit stride in the last dim, but x has stride 2 there"):
            apply_rotary_(x, cos[:5], sin[:5], backend=backend)
        return
    untouched = storage[..., 1::2].clone()
    apply_rotary_(x, cos[:5], sin[:5], backend=backend)
    assert torch.equal(x, expected) and torch.equal(storage[..., 1::2], untouched)


@pytest.mark.parametrize("backend", ["auto", "torch", "cpu", "triton"])
def test_in_place_on_an_inference_tensor_follows_torch(backend):
    """torch refuses in-place updates to an inference tensor outside inference mode; every backend agrees (the fused
    ones once wrote it through pointers), and inside inference mode every backend rotates it."""
    device = DEVICE.get(backend, "cpu")
    cos, sin = (t.to(device) for t in table(8, 16))
    with torch.inference_mode():
        x = torch.randn(1, 2, 5, 8, device=device)
    with pytest.raises(RuntimeError, match=r"made under torch\.inference_mode"):
        apply_rotary_(x, cos, sin, offset=0, backend=backend)
    expected = apply_rotary(x, cos, sin, offset=0, backend="torch")
    with torch.inference_mode():
        apply_rotary_(x, cos, sin, offset=0, backend=backend)
    assert_close(x.cpu(), expected.cpu().double())


def _refused_in_place(case: str, device: str):
    """(the tensor that must stay unchanged, x to rotate in place, cos, sin, the error's pattern) for one way of
    giving an x that autograd cannot record rotating in place."""
    cos, sin = (t.to(device) for t in table(8, 16))
    weight = torch.randn(2, 4, 3, 8, device=device, requires_grad=True)  # a leaf, (b, s, h, d)
    if case == "view_of_a_leaf":
        return weight, weight.transpose(1, 2), cos, sin, "a view of a leaf Variable"
    product = weight * 1
    if case == "unbind_view":
        return product, product.unbind(2)[0][:, :, None], cos, sin, "function that returns multiple views"
    with torch.no_grad():
        x = product.transpose(1, 2)
    return product, x, cos, sin, r"x is a view made under torch\.no_grad\(\) of a tensor that requires grad"


@pytest.mark.parametrize("backend", ["torch", "auto", "cpu", "triton"])
@pytest.mark.parametrize("case", ["view_of_a_leaf", "unbind_view", "view_made_under_no_grad"])
def test_in_place_refused_by_autograd_leaves_x_as_it_was(backend, case):
    """Every backend refuses before writing, as torch's own in-place ops do: the fused ones wrote x through
    pointers and autograd refused it afterwards (a Parameter's view, or unbind's, was left rotated by a caught
    error). The error names x and what to do instead."""
    watched, x, cos, sin, pattern = _refused_in_place(case, DEVICE.get(backend, "cpu"))
    before = watched.detach().clone()
    with pytest.raises(RuntimeError, match=pattern) as error:
        apply_rotary_(x, cos, sin, offset=0, layout="bshd", backend=backend)
    assert torch.equal(watched.detach(), before)
    message = str(error.value)
    assert re.search(r"\bx\b", message) and ("apply_rotary" in message or "clone()" in message)


@pytest.mark.parametrize("backend", ["torch", "cpu"])
@pytest.mark.parametrize("case", ["leaf", "view_made_under_no_grad", "view_of_a_leaf"])
def test_in_place_on_a_leaf_is_refused_with_posencs_message_under_torch_compile_too(backend, case):
    """Compiled, the leaf checks were skipped: the copy into x then failed in Dynamo's fake-tensor run, with torch's
    message wrapped in Dynamo's ("RuntimeError when making fake tensor call"), with or without fullgraph=True.
    Dynamo reads is_leaf and _base as it traces, so the refusal is eager's (for a view of a leaf, eager's rewording
    of torch's own)."""
    torch._dynamo.reset()
    cos, sin = table(8, 16)
    if case == "leaf":
        watched = x = torch.randn(2, 3, 4, 8, requires_grad=True)
        pattern = "x is a leaf tensor that requires grad"
    else:
        watched, x, cos, sin, pattern = _refused_in_place(case, "cpu")
        if case == "view_of_a_leaf":
            pattern = "refuses to let the rotation change x in place, and nothing was rotated: a view of a leaf"
    before = watched.detach().clone()
    compiled = torch.compile(lambda x: apply_rotary_(x, cos, sin, offset=0, backend=backend), backend="eager")
    with pytest.raises(RuntimeError, match=pattern):
        compiled(x)
    assert torch.equal(watched.detach(), before)


@pytest.mark.parametrize("backend", ["torch", "cpu", "triton"])
@pytest.mark.parametrize("inplace", [False, True])
@pytest.mark.parametrize("kind", ["broadcast", "offset", "varlen"])
def test_cos_sin_made_under_inference_mode_serve_a_rotation_that_needs_grad(backend, inplace, kind):
    """cos/sin made under torch.inference_mode() (cached by an evaluation pass before training) for an x that
    requires grad: every backend saves them for backward, which autograd refuses for inference tensors, so every such
    call failed, with torch's own error from deep inside the rotation (in place, with posenc's refusal). They are
    copied instead; the gradient is the one of tables made outside inference mode."""
    device = DEVICE[backend]
    q, _, kwargs, _, form = make_case(kind, b=2, hq=2, hk=1, s=5, d=8, dtype=torch.float64)
    kwargs = {key: (v.to(device) if isinstance(v, torch.Tensor) else v) for key, v in kwargs.items()}
    cos, sin = (form(t).to(device).double() for t in table(8, 40))
    with torch.inference_mode():
        kept = cos.clone(), sin.clone()
    grads = []
    for angles in ((cos, sin), kept):
        leaf = q.to(device).requires_grad_()
        rotate = apply_rotary_ if inplace else apply_rotary
        rotate(leaf * 1, *angles, backend=backend, **kwargs).square().mul(leaf).sum().backward()
        grads.append(leaf.grad)
    torch.testing.assert_close(grads[1], grads[0], rtol=0, atol=0)
    assert kept[0].is_inference() and kept[1].is_inference()  # the caller's tables are left as they were


@pytest.mark.parametrize("backend", ["cpu", "triton"])
@pytest.mark.parametrize("inplace", [False, True])
@pytest.mark.parametrize("kind", ["position_ids", "per_sequence", "varlen"])
def test_indices_made_under_inference_mode_serve_a_rotation_that_needs_grad(backend, inplace, kind):
    """Position ids, offsets or cu_seqlens made under torch.inference_mode() (kept from an evaluation pass), for an
    x that requires grad: the torch path never saves them; the fused ones saved them for backward, which autograd
    refuses for inference tensors, so every such call failed there."""
    device = DEVICE[backend]
    q, _, kwargs, _, _ = make_case(kind, b=2, hq=2, hk=1, s=5, d=8, dtype=torch.float64)
    cos, sin = (t.to(device).double() for t in table(8, 400))
    with torch.inference_mode():
        kwargs = {key: (v.to(device).clone() if isinstance(v, torch.Tensor) else v) for key, v in kwargs.items()}
    grads = []
    for name in ("torch", backend):
        leaf = q.to(device).requires_grad_()
        rotate = apply_rotary_ if inplace else apply_rotary
        rotate(leaf * 1, cos, sin, backend=name, **kwargs).square().mul(leaf).sum().backward()
        grads.append(leaf.grad)
    torch.testing.assert_close(grads[1], grads[0], rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("backend", ["cpu", "triton"])
def test_empty_inputs_and_gradient_flags(backend):
    """All-empty q and k (an empty batch or prefill) rotate to empty outputs; an output whose input needs no
    gradient does not need one (k beside a q that does)."""
    device = DEVICE[backend]
    cos, sin = (t.to(device) for t in table(8, 16))
    for shape in ((0, 2, 5, 8), (2, 0, 5, 8), (2, 2, 0, 8)):
        q, k = torch.randn(shape, device=device), torch.randn(shape, device=device)
        q_out, k_out = apply_rotary_qk(q, k, cos, sin, offset=0, backend=backend)
        assert q_out.shape == shape and k_out.shape == shape
    q = torch.randn(1, 2, 5, 8, device=device, requires_grad=True)
    q_out, k_out = apply_rotary_qk(q, torch.randn(1, 1, 5, 8, device=device), cos, sin, offset=0, backend=backend)
    assert q_out.requires_grad and not k_out.requires_grad


@pytest.mark.parametrize("backend", ["cpu", "triton"])
def test_empty_inputs_have_empty_gradients(backend):
    """The gradient of an empty output's sum comes expanded (stride 0), which .contiguous() leaves as it is: the
    CPU kernel refused it ("unit stride in their last dim"), so backward through an empty batch failed."""
    device = DEVICE[backend]
    cos, sin = (t.to(device) for t in table(8, 16))
    for shape in ((0, 2, 5, 8), (2, 0, 5, 8), (2, 2, 0, 8)):
        q = torch.randn(shape, device=device, requires_grad=True)
        k = torch.randn(shape[0], 1, shape[2], 8, device=device, requires_grad=True)  # not empty beside h = 0
        q_out, k_out = apply_rotary_qk(q, k, cos, sin, offset=3, backend=backend)
        (q_out.sum() + k_out.sum()).backward()
        assert q.grad.shape == shape and k.grad.shape == k.shape
    if backend == "cpu":
        x = torch.randn(0, 3, 5, 8, requires_grad=True)
        torch.library.opcheck(ops.rotary, ([x], cos, sin, None, None, 2, None, "bhsd", False, False, "cpu"))


@pytest.mark.parametrize("backend", ["auto", "cpu", "triton"])
def test_inputs_and_gradients_whose_elements_share_memory(backend):
    """x as sliding windows (strides (1, 1)), and a gradient made by as_strided with stride 1 on its batch dim, rotate
    as on the torch path: the output's layout copied x's (empty_like), which put stride 1 on another dim than the
    channels, and the kernels refused it ("unit stride in their last dim"). The op's fake gives the same strides."""
    device = DEVICE.get(backend, "cpu")
    cos, sin = (t.to(device) for t in table(8, 16))
    windows = torch.randn(12, dtype=torch.float64).to(device).requires_grad_()
    x = windows.unfold(0, 8, 1)  # (5, 8), rows 1 apart
    grad_storage = torch.randn(100, dtype=torch.float64).to(device)
    q = torch.randn(2, 3, 4, 8, dtype=torch.float64).to(device).requires_grad_()
    results = {}
    for name in ("torch", backend):
        windows.grad, q.grad = None, None
        out = apply_rotary(x, cos[:5], sin[:5], backend=name)
        out.backward(grad_storage[:12].unfold(0, 8, 1))
        q_out = apply_rotary(q, cos, sin, offset=3, backend=name)
        q_out.backward(grad_storage.as_strided((2, 3, 4, 8), (1, 9, 2, 1)))
        results[name] = (out.detach(), windows.grad, q_out.detach(), q.grad)
    for got, expected in zip(results[backend], results["torch"], strict=True):
        torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-12)
    if backend == "cpu":
        torch.library.opcheck(
            ops.rotary, ([x.detach()], cos[:5], sin[:5], None, None, 0, None, "broadcast", False, False, "cpu")
        )


@pytest.mark.parametrize("backend", ["torch", "cpu", "triton"])
def test_empty_calls_with_position_ids(backend):
    """Position ids of an empty sequence ((b, 0) or (0,)) or of an empty batch, against a table shorter than s:
    no row is read, so nothing fails (torch and cpu once failed to reshape (b, 0) ids, and cpu took an empty ids
    tensor for none and checked rows 0..s-1 against the table)."""
    device = DEVICE[backend]
    cos, sin = (t.to(device) for t in table(8, 4))
    calls = [
        (torch.randn(2, 3, 0, 8), torch.zeros(2, 0, dtype=torch.long)),
        (torch.randn(2, 3, 0, 8), torch.zeros(0, dtype=torch.long)),
        (torch.randn(0, 2, 7, 8), torch.zeros(0, 7, dtype=torch.long)),
    ]
    for x, positions in calls:
        out = apply_rotary(x.to(device), cos, sin, positions=positions.to(device), backend=backend)
        assert out.shape == x.shape


@pytest.mark.parametrize("backend", ["torch", "cpu", "triton"])
def test_strided_cu_seqlens_rotate_without_a_warning_from_inside_torch(backend):
    """int64 cu_seqlens that are a strided view (a column of a bigger tensor) rotate as their contiguous copy does,
    without torch.searchsorted's warning that a "boundary tensor is non-contiguous" (raised from inside torch, once
    per process: warn_always makes it show on every call here, whatever ran before)."""
    device = DEVICE[backend]
    cos, sin = (t.to(device) for t in table(8, 10))
    x = torch.randn(5, 2, 8, device=device)
    cu_seqlens = torch.tensor([[0, 9], [2, 9], [5, 9]], device=device)[:, 0]
    assert not cu_seqlens.is_contiguous()
    offsets = torch.tensor([1, 3], device=device)
    always = torch.is_warn_always_enabled()
    torch.set_warn_always(True)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            out = apply_rotary(x, cos, sin, cu_seqlens=cu_seqlens, offset=offsets, backend=backend)
    finally:
        torch.set_warn_always(always)
    expected = apply_rotary(x, cos, sin, cu_seqlens=cu_seqlens.contiguous(), offset=offsets, backend=backend)
    assert torch.equal(out, expected)


@pytest.mark.parametrize("backend", ["torch", "cpu", "triton"])
def test_index_arguments_outside_what_torch_can_add_are_refused(backend):
    """An int offset at or past the table is refused before it is added to position ids (past 2**63 the int64 sum
    wrapped around into the table); uint16/32/64 index tensors, which torch cannot compare, are refused by name."""
    device = DEVICE[backend]
    cos, sin = (t.to(device) for t in table(8, 16))
    x, ids = torch.randn(1, 2, 3, 8, device=device), torch.tensor([3, 4, 5], device=device)
    for offset in (16, 2**64 - 3):
        with pytest.raises(ValueError, match=f"offset={offset} is past the cos/sin table's 16 rows"):
            apply_rotary(x, cos, sin, positions=ids, offset=offset, backend=backend)
    packed, cu_seqlens = torch.randn(3, 2, 8, device=device), torch.tensor([0, 3], device=device)
    for dtype in (torch.uint16, torch.uint32, torch.uint64):
        for name, kwargs, y in (
            ("positions", {"positions": ids.to(dtype)}, x),
            ("offset", {"offset": torch.tensor([1], device=device).to(dtype)}, x),
            ("cu_seqlens", {"cu_seqlens": cu_seqlens.to(dtype)}, packed),
        ):
            with pytest.raises(TypeError, match=f"{name} has dtype {dtype}.*pass it as torch.long"):
                apply_rotary(y, cos, sin, backend=backend, **kwargs)
    with pytest.raises(TypeError, match=r"offset has dtype torch\.uint16"):
        posenc.RoPE(8, backend=backend)(x, x, offset=torch.tensor([1], device=device).to(torch.uint16))


def test_table_calls_infer_shapes_on_meta_tensors():
    """Meta tensors have shapes and no values: table-mode calls skip the checks that read values, as they do under
    torch.compile, instead of failing inside torch ("Cannot copy out of meta tensor")."""
    x, cos = torch.empty(2, 3, 5, 8, device="meta"), torch.empty(16, 4, device="meta")
    for kwargs in (
        {"positions": torch.arange(5, device="meta")},
        {"offset": torch.zeros(2, dtype=torch.long, device="meta")},
    ):
        assert apply_rotary(x, cos, cos, **kwargs).shape == x.shape
    packed = torch.empty(5, 3, 8, device="meta")
    cu_seqlens = torch.tensor([0, 5], device="meta")
    assert apply_rotary(packed, cos, cos, cu_seqlens=cu_seqlens).device.type == "meta"
    q, k = posenc.RoPE(8)(x, x, positions=torch.arange(5, device="meta"))
    assert q.shape == k.shape == x.shape and q.device.type == "meta"
    # The fused kernels need values: named, where the interpreted Triton kernel used to fail inside torch.
    with pytest.raises(ValueError, match="backend='triton' needs CUDA tensors, got meta"):
        apply_rotary(x, cos, cos, offset=0, backend="triton")


def test_triton_refuses_a_device_before_an_in_place_call_records_its_gradient():
    """The device was refused at the launch, after an in-place call with grad had recorded its autograd node: x
    kept its values under a graph that said they were rotated, and backward raised the same error from inside
    the engine. Meta stands in for a device the kernel cannot run on (the CPU, uninterpreted)."""
    leaf = torch.empty(1, 2, 3, 8, device="meta", requires_grad=True)
    x, cos = leaf * 1, torch.empty(3, 4, device="meta")
    with pytest.raises(ValueError, match="backend='triton' needs CUDA tensors, got meta"):
        apply_rotary_(x, cos, cos, backend="triton")
    assert type(x.grad_fn).__name__ == "MulBackward0" and x._version == 0


@pytest.mark.parametrize("backend", ["cpu", "triton"])
def test_strided_views_and_single_tensor(backend):
    """Non-contiguous inputs (a slice of a fused qkv projection) rotate like contiguous ones."""
    device = DEVICE[backend]
    cos, sin = (t.to(device) for t in table(64, 16))
    qkv = torch.randn(2, 7, 3, 4, 64, device=device)  # (b, s, 3, h, d)
    q = qkv[:, :, 0]  # (b, s, h, d), not contiguous
    out = apply_rotary(q, cos, sin, layout="bshd", offset=0, backend=backend)
    expected = apply_rotary(q.contiguous(), cos, sin, layout="bshd", offset=0, backend="torch")
    assert_close(out.cpu(), expected.cpu().double())


def test_cpu_launcher_enters_a_table_at_first_row_and_checks_the_rows_it_reads():
    """The int-offset fast path: the C kernel reads rows first_row.. of the (n, r/2) table with no positions
    tensor; a 4-D view of the same rows gives the same bits, and rows past the table are refused, not read."""
    x = torch.randn(2, 3, 5, 20)
    cos, sin = table(16, 40)
    out, out_view = torch.empty_like(x), torch.empty_like(x)
    rope_cpu(x, out, cos, sin, None, first_row=30, interleaved=True, conjugate=False, copy_tail=True)
    expected = rope_reference(x, (torch.arange(5) + 30)[None, None], rotary_dim=16, interleaved=True)
    assert_close(out, expected)
    view_cos, view_sin = cos[30:35][None, None], sin[30:35][None, None]
    rope_cpu(x, out_view, view_cos, view_sin, None, interleaved=True, conjugate=False, copy_tail=True)
    assert torch.equal(out, out_view)
    for first_row in (36, -1):
        with pytest.raises(ValueError, match=f"tokens read rows {first_row} .. {first_row + 4} but cos/sin have 40"):
            rope_cpu(x, out, cos, sin, None, first_row=first_row, interleaved=True, conjugate=False, copy_tail=True)
    with pytest.raises(ValueError, match="first_row=3 applies only without positions"):
        positions = torch.zeros(1, 5, dtype=torch.long)
        rope_cpu(x, out, cos, sin, positions, first_row=3, interleaved=True, conjugate=False, copy_tail=True)
    with pytest.raises(ValueError, match=r"tokens read rows 0 .. 4 but cos/sin have 1 rows"):
        rope_cpu(x, out, cos[:1], sin[:1], None, interleaved=True, conjugate=False, copy_tail=True)
    # A 4-D view of one row broadcasts it over the tokens only entered at row 0: past it there is no row to read.
    one_cos, one_sin = cos[:1][None, None], sin[:1][None, None]
    with pytest.raises(ValueError, match=r"tokens read rows 1 .. 5 but cos/sin have 1 rows"):
        rope_cpu(x, out, one_cos, one_sin, None, first_row=1, interleaved=True, conjugate=False, copy_tail=True)


def test_cpu_jobs_of_one_call_read_and_check_their_own_cos_sin():
    """The launcher checks cos/sin once for the jobs that share them (q and k): jobs with tables of their own still
    read their own rows, and a table fit for the first job does not vouch for another job's."""
    x, y = torch.randn(1, 2, 3, 16), torch.randn(1, 1, 3, 16)
    cos, sin = table(16, 8)
    other_cos, other_sin = (t[2:].clone() for t in (cos, sin))  # rows 2.. of the same angles, elsewhere in memory
    outs = [torch.empty_like(x), torch.empty_like(y)]
    jobs = [(x, outs[0], cos, sin), (y, outs[1], other_cos, other_sin)]
    cpu_rope.rope_cpu_jobs(jobs, None, first_row=1, interleaved=False, conjugate=False, copy_tail=True)
    assert_close(outs[0], rope_reference(x, (torch.arange(3) + 1)[None, None], rotary_dim=16))
    assert_close(outs[1], rope_reference(y, (torch.arange(3) + 3)[None, None], rotary_dim=16))
    pair_strided = torch.stack((cos, cos), -1)[..., 0], torch.stack((sin, sin), -1)[..., 0]
    with pytest.raises(ValueError, match="unit stride in their last dim"):
        cpu_rope.rope_cpu_jobs(
            [jobs[0], (y, outs[1], *pair_strided)], None, interleaved=False, conjugate=False, copy_tail=True
        )
    # A job sharing the first one's cos but not its sin reads its own sin (here -sin: the inverse rotation).
    options = dict(first_row=1, interleaved=False, conjugate=False, copy_tail=True)
    shared, alone = [torch.empty_like(x), torch.empty_like(y)], torch.empty_like(y)
    cpu_rope.rope_cpu_jobs([(x, shared[0], cos, sin), (y, shared[1], cos, -sin)], None, **options)
    cpu_rope.rope_cpu_jobs([(y, alone, cos, -sin)], None, **options)
    assert torch.equal(shared[1], alone)


def test_cpu_kernel_checks_cos_sin_themselves():
    """The C code trusts cos/sin's device, dtype and last stride: each refused by name, also with two pairs."""
    x = torch.randn(1, 2, 3, 16)
    cos, sin = table(16, 8)
    options = dict(interleaved=False, conjugate=False, copy_tail=True)
    with pytest.raises(ValueError, match=r"reads CPU tensors only, got .*cos on meta, sin on meta"):
        rope_cpu(x, torch.empty_like(x), cos.to("meta"), sin.to("meta"), None, **options)
    with pytest.raises(TypeError, match="float64 x needs float64 cos/sin"):
        wide = x.double()
        rope_cpu(wide, torch.empty_like(wide), cos, sin, None, **options)
    two_pairs = (t[:, :2].t().contiguous().t() for t in (cos, sin))  # (8, 2), strides (1, 8)
    with pytest.raises(ValueError, match="unit stride in their last dim"):
        rope_cpu(x, torch.empty_like(x), *two_pairs, None, **options)


@pytest.mark.parametrize("backend", ["cpu", "triton"])
def test_fused_backends_take_what_the_torch_path_takes(backend):
    """Calls the fused kernels once refused or mishandled: strided position ids and offsets, broadcast cos/sin
    with (b, s, h, d) GQA tensors (q and k differ in their third axis), an empty q beside a non-empty k."""
    device = DEVICE[backend]
    cos, sin = (t.to(device) for t in table(16, 64))
    q, k = torch.randn(2, 3, 5, 16, device=device), torch.randn(2, 2, 5, 16, device=device)
    calls = [
        (q, k, cos, sin, {"offset": torch.tensor([3, 0, 7, 0], device=device)[::2]}),
        (q, k, cos, sin, {"offset": torch.tensor(4, device=device).expand(2)}),
        (q, k, cos, sin, {"positions": torch.arange(10, device=device)[::2]}),
        (q, k, cos, sin, {"positions": torch.arange(10, device=device).reshape(5, 2).t()}),
        (q.transpose(1, 2), k.transpose(1, 2), cos[:5, None], sin[:5, None], {}),
        (q[:, :0], k, cos[:5], sin[:5], {}),
    ]
    for q_in, k_in, c, s, kwargs in calls:
        expected = apply_rotary_qk(q_in, k_in, c, s, backend="torch", **kwargs)
        got = apply_rotary_qk(q_in, k_in, c, s, backend=backend, **kwargs)
        for a, b in zip(got, expected, strict=True):
            assert a.shape == b.shape
            assert_close(a.cpu(), b.cpu().double(), msg=f"{backend} {kwargs}")
    # One offset for all sequences as a 0-d or (1,) tensor reads the rows an int offset reads, packed batches too.
    by_int = apply_rotary_qk(q, k, cos, sin, offset=4, backend=backend)
    packed, cu_seqlens = torch.randn(7, 2, 16, device=device), torch.tensor([0, 3, 7], device=device)
    packed_by_int = apply_rotary(packed, cos, sin, cu_seqlens=cu_seqlens, offset=4, backend=backend)
    for single in (torch.tensor(4, device=device), torch.tensor([4], device=device)):
        got = apply_rotary_qk(q, k, cos, sin, offset=single, backend=backend)
        assert all(torch.equal(a, b) for a, b in zip(got, by_int, strict=True)), single.shape
        got = apply_rotary(packed, cos, sin, cu_seqlens=cu_seqlens, offset=single, backend=backend)
        assert torch.equal(got, packed_by_int), single.shape


@pytest.mark.parametrize("backend", ["cpu", "triton"])
@pytest.mark.parametrize("kind", ["offset", "per_sequence", "position_ids", "varlen"])
@pytest.mark.parametrize("table_form", ["pair_stride", "float32_for_float64_x"])
def test_a_table_the_kernels_cannot_read_as_is_is_copied_only_where_tokens_read_it(
    backend, table_form, kind, monkeypatch
):
    """A table with a pair stride (Meta's view_as_real(freqs_cis)[..., 0]) or a float32 table for float64 x is
    copied into the form the kernels read. That copy was of the whole table at every call: a decode step (q and k
    of one token) against 128k rows took 48 ms (pair stride) and 81 ms (float64 x) on the CPU kernel, 0.1 ms on the
    torch path; now 0.04 ms. Rows that are not consecutive are gathered on the device (the Triton launcher reads
    no positions on the host)."""
    dtype = torch.float64 if table_form == "float32_for_float64_x" else torch.float32
    q, k, kwargs, ref_pos, _ = make_case(kind, b=2, hq=3, hk=1, s=5, d=16, dtype=dtype)
    cos, sin = table(16, 320, dtype=torch.float64)
    if table_form == "pair_stride":
        # (n, r/2, 2): freqs_cis seen as real, made on the kernel's device: .to() another device would copy the
        # view into a contiguous table, and on a GPU the test would then have no pair stride to check.
        pairs = torch.stack([cos, sin], -1).float().to(DEVICE[backend])
        cos, sin = pairs[..., 0], pairs[..., 1]
        assert cos.stride(-1) == 2
    else:
        cos, sin = cos.float(), sin.float()
    copied = []
    wide_cos_sin = posenc.kernels.launch._wide_cos_sin
    monkeypatch.setattr(
        posenc.kernels.launch,
        "_wide_cos_sin",
        lambda *a, **kw: copied.append(wide_cos_sin(*a, **kw)[0].shape[0]) or wide_cos_sin(*a, **kw),
    )
    got = rotate(backend, q, k, cos, sin, kwargs)
    expected = rotate("torch", q, k, cos, sin, kwargs)
    for a, b, x in zip(got, expected, (q, k), strict=True):
        assert_close(a, b.double(), msg=f"{backend} {kind} {table_form}")
        if table_form == "pair_stride":  # (a float32 table is float32's angles, not the float64 reference's)
            reference = rope_reference(x.double(), ref_pos, rotary_dim=16, interleaved=False)
            assert_close(a, reference, msg=f"{backend} {kind} {table_form}")
    tokens = {"offset": 5, "per_sequence": 10, "position_ids": 10, "varlen": q.shape[0]}[kind]
    assert copied and max(copied) <= tokens < cos.shape[0], copied


@pytest.mark.parametrize("backend", ["cpu", "triton"])
@pytest.mark.parametrize("seq", [0, 1])
def test_a_copied_slice_of_no_row_or_one_gets_one_set_of_strides(backend, seq):
    """.contiguous() returns a tensor of 0 or 1 rows as it is, so a slice of a pair-strided table (or of cos and
    sin with different row strides) reached the launchers with strides they refuse."""
    cos, sin = table(8, 32)
    pairs = torch.stack([cos, sin], -1)
    tables = {
        "pair stride": (pairs[..., 0], pairs[..., 1]),
        "row strides differ": (cos, torch.cat([sin, sin], 1)[:, :4]),
    }
    q, k = torch.randn(2, 3, seq, 8), torch.randn(2, 1, seq, 8)
    for name, (c, s) in tables.items():
        got = rotate(backend, q, k, c, s, {"offset": 10})
        expected = rotate("torch", q, k, c.contiguous(), s.contiguous(), {"offset": 10})
        for a, b in zip(got, expected, strict=True):
            assert a.shape == b.shape, name
            assert_close(a, b.double(), msg=f"{backend} {name}")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("half", [1, 8, 40, 64])
@pytest.mark.parametrize("scale", [0.7, 1.0])
@pytest.mark.parametrize("backend", ["cpu", "triton"])
def test_16_bit_conversions_are_exact(backend, dtype, interleaved, half, scale):
    """With sin = 0 every product is exact until the one rounding of x * c (or a NaN where the partner is
    infinite), so the kernel must give torch's float32 result bit for bit, for every 16-bit x: subnormals,
    infinities and NaNs included. The pair counts reach every step kind of the CPU vector path, in both layouts:
    AVX-512's 32-pair and 16-pair steps and masked tails, AVX2's 16-pair and 8-pair steps, and (one pair) the
    portable loop. Triton's bfloat16 only on a GPU: its interpreter truncates float32 to bfloat16 where the
    compiled kernel (cvt.rn) rounds to nearest even, as torch does."""
    if backend == "triton" and DEVICE["triton"] == "cpu" and dtype == torch.bfloat16:
        pytest.skip("the Triton interpreter truncates to bfloat16; run natively (scripts/gpu_check.sh)")
    check_16_bit_exact(backend, dtype, interleaved, half, scale)


def check_16_bit_exact(backend, dtype, interleaved, half, scale):
    x = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(dtype)
    x = x[torch.randperm(x.numel(), generator=torch.Generator().manual_seed(half))]
    x = torch.cat([x, x[: -x.numel() % (2 * half)]]).reshape(1, 1, -1, 2 * half)
    c = torch.full((x.shape[2], half), scale, dtype=torch.float32)
    expected = rotate_pairs(x.float(), c, torch.zeros_like(c), interleaved=interleaved).to(dtype)
    x, c = x.to(DEVICE[backend]), c.to(DEVICE[backend])
    out = apply_rotary(x, c, torch.zeros_like(c), interleaved=interleaved, backend=backend).cpu()
    same = (out.float() == expected.float()) | (out.isnan() & expected.isnan())
    assert bool(same.all()), f"{int((~same).sum())} of {same.numel()} values differ"


# The CPU kernel as other CPUs build it. The package compiles for -march=native, so on this machine the tests above
# check only the code this CPU selects (AVX-512 with BF16 here); the portable loops that CPUs without AVX-512 run,
# and the mix a CPU with AVX-512 but without BF16 gets (Skylake-X, Ice Lake), would otherwise never be tested.
# Each level is built for real and its library put in the package's place, for every level this CPU can execute.
ISA_LEVELS = {
    # level: the /proc/cpuinfo flags it needs beyond the baseline (gcc's x86-64 micro-architecture levels)
    "x86-64": (),  # SSE2 only, no FMA: the multiply-subtract rounds twice
    "x86-64-v3": ("avx2", "fma", "f16c", "bmi1", "bmi2", "movbe", "sse4_2", "popcnt"),  # no AVX-512
    "x86-64-v4": ("avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512cd"),  # AVX-512 without BF16
}


@functools.cache
def isa_library(level: str):
    """(library built for ``level``, "") or (None, why this machine cannot test it)."""
    if platform.machine() not in ("x86_64", "AMD64"):
        return None, f"{level} is an x86 level; this machine is {platform.machine()}"
    try:
        flags = next(line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags"))
    except (OSError, StopIteration):
        return None, "no /proc/cpuinfo flags to tell what this CPU executes"
    missing = set(ISA_LEVELS[level]) - set(flags.split(":", 1)[1].split())
    if missing:
        return None, f"this CPU lacks {sorted(missing)} for {level}"
    library, reason = cpu_rope.build_library(cpu_rope.SOURCE.read_bytes(), arch=level)
    if library is None:
        pytest.fail(f"building the CPU kernel for {level} failed: {reason}")
    return library, ""


def use_isa_level(level: str, monkeypatch) -> str:
    library, reason = isa_library(level)
    if library is None:
        pytest.skip(reason)
    monkeypatch.setattr(cpu_rope, "_library", lambda: (library, ""))
    return level


@pytest.fixture(params=list(ISA_LEVELS))
def isa_level(request, monkeypatch):
    return use_isa_level(request.param, monkeypatch)


# The baseline level's portable loops store plainly (test_the_baseline_x86_build_has_no_streaming_stores): its
# streaming cases were skipped on every machine.
@pytest.fixture(params=[level for level in ISA_LEVELS if level != "x86-64"])
def streaming_isa_level(request, monkeypatch):
    return use_isa_level(request.param, monkeypatch)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", ALL_DTYPES)
@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize(("d", "r", "s"), [(96, 48, 7), (72, 44, 3), (256, 256, ROWS_OF_BLOCKS)])
def test_cpu_builds_for_older_x86_levels_match_reference(isa_level, kind, dtype, interleaved, d, r, s):
    check_forward_backward("cpu", kind, b=2, hq=4, hk=2, s=s, d=d, r=r, dtype=dtype, interleaved=interleaved)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("half", [1, 13, 40, 64])
def test_cpu_builds_for_older_x86_levels_convert_16_bit_exactly(isa_level, dtype, interleaved, half):
    check_16_bit_exact("cpu", dtype, interleaved, half, 0.7)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float64])
def test_cpu_builds_for_older_x86_levels_with_float64_tables(isa_level, dtype):
    check_float64_tables("cpu", dtype, interleaved=False)


def skip_unless_streaming(library=None):
    if not cpu_rope.can_stream(library):
        pytest.skip("this build of the CPU kernel has no streaming stores (no AVX2 or AVX-512 rows, or not Linux)")


@pytest.fixture
def streaming_stores(request):
    """Every out-of-place call of the CPU kernel (the package's, or the ``streaming_isa_level`` one in its place)
    streams its stores, as calls larger than the last-level cache do. Skips where the build has no streaming stores."""
    library = cpu_rope._library()[0]
    skip_unless_streaming(library)
    previous = cpu_rope.set_stream_threshold(0, library=library)
    yield
    cpu_rope.set_stream_threshold(previous, library=library)


@pytest.mark.parametrize("kind", ["offset", "position_ids", "varlen"])
@pytest.mark.parametrize("dtype", ALL_DTYPES)
@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize(("d", "r", "s"), [(80, 80, 7), (128, 96, 33), (256, 256, ROWS_OF_BLOCKS)])
def test_cpu_streaming_stores_match_reference(streaming_stores, kind, dtype, interleaved, d, r, s):
    """Non-temporal stores take aligned lines only (d = 80 mixes aligned and unaligned rows); the rest of each row is
    stored plainly."""
    x = torch.randn(2, 4, s, d).to(dtype)
    assert cpu_rope.streams(x, torch.empty_like(x), *table(r, s)), "the fixture should make every call stream"
    check_forward_backward("cpu", kind, b=2, hq=4, hk=2, s=s, d=d, r=r, dtype=dtype, interleaved=interleaved)


@pytest.mark.parametrize("dtype", ALL_DTYPES)
@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize(("d", "r", "s"), [(80, 80, 7), (128, 96, 33)])
def test_cpu_builds_for_older_x86_levels_stream_stores(
    streaming_isa_level, streaming_stores, dtype, interleaved, d, r, s
):
    x = torch.randn(2, 4, s, d).to(dtype)
    assert cpu_rope.streams(x, torch.empty_like(x), *table(r, s)), f"the {streaming_isa_level} build should stream"
    check_forward_backward("cpu", "offset", b=2, hq=4, hk=2, s=s, d=d, r=r, dtype=dtype, interleaved=interleaved)


def test_the_baseline_x86_build_has_no_streaming_stores(monkeypatch):
    """Why streaming_isa_level leaves x86-64 out: SSE2 only, no vector rows, so nothing to stream."""
    use_isa_level("x86-64", monkeypatch)
    assert not cpu_rope.can_stream(cpu_rope._library()[0])


def test_cpu_streams_only_large_out_of_place_writes_into_resident_pages():
    skip_unless_streaming()
    cos, sin = table(128, 1024)
    x = torch.randn(1, 2, 8, 128)
    assert not cpu_rope.streams(x, torch.empty_like(x), cos, sin), "smaller than the last-level cache"
    # The default threshold is the last-level cache; past 64 MiB a lower one keeps this test's tensors small.
    limit = min(cpu_rope.last_level_cache_bytes(), 64 << 20)
    default = cpu_rope.set_stream_threshold(limit)
    try:
        big = torch.randn(1, limit // (1024 * 128 * 2) + 1, 1024, 128, dtype=torch.bfloat16)
        # A new anonymous mapping, as glibc gives a big block: no page of it is in memory until it is written.
        region = mmap.mmap(-1, big.numel() * 2)
        fresh = torch.frombuffer(region, dtype=torch.bfloat16).view(big.shape)
        # (A shared mapping, which takes 4 KiB pages unless the OS's shmem_enabled says otherwise; into huge pages
        # the kernel does stream: test_cpu_huge_pages.py.)
        assert not cpu_rope.streams(big, fresh, cos, sin), "a fresh mapping faults in cached zero pages: store plainly"
        assert not cpu_rope.streams(big, big, cos, sin), "in place, each line is read before it is written"
        fresh.zero_()
        assert cpu_rope.streams(big, fresh, cos, sin)
        rope_cpu(big, fresh, cos, sin, None, interleaved=False, conjugate=False, copy_tail=True)
        cpu_rope.set_stream_threshold(2**62)
        assert not cpu_rope.streams(big, fresh, cos, sin)
        plain = torch.empty_like(big)
        rope_cpu(big, plain, cos, sin, None, interleaved=False, conjugate=False, copy_tail=True)
    finally:
        cpu_rope.set_stream_threshold(default)
    assert torch.equal(fresh, plain), "streamed and plain stores must write the same bits"


def join_pairs(x1, x2, interleaved):
    """(..., half) first and second halves of the pairs -> (..., 2 * half) in the pair layout."""
    return torch.stack([x1, x2], -1).flatten(-2) if interleaved else torch.cat([x1, x2], -1)


def split_pairs(out, interleaved):
    """(..., 2 * half) in the pair layout -> the pairs' first and second halves, (..., half) each."""
    half = out.shape[-1] // 2
    return (out[..., 0::2], out[..., 1::2]) if interleaved else (out[..., :half], out[..., half:])


def check_fp16_nan_bits(interleaved):
    """A NaN keeps its sign and the top of its payload through the rotation, quieted, as vcvtps2ph (and so torch's
    conversion) keeps them, in every pair of a row: vector steps and the last pairs, which the AVX2 rows leave to the
    portable loop. With x2 finite, cos = 1 and sin = 0, x1's NaN is the only one in both outputs of its pair."""
    half = 9
    bits = torch.tensor([0x7C01, 0xFD55, 0x7E00, 0xFFFF, 0x7C3F, 0xFC01, 0x7DAA, 0xFE01, 0x7FFF], dtype=torch.int32)
    x1, x2 = bits.to(torch.int16).view(torch.float16), torch.full((half,), 0.5, dtype=torch.float16)
    x = join_pairs(x1, x2, interleaved).reshape(1, 1, 1, 2 * half)
    c = torch.ones(1, half)
    out = apply_rotary(x, c, torch.zeros_like(c), interleaved=interleaved, backend="cpu").view(torch.int16).flatten()
    quiet = (bits | 0x0200).to(torch.int16)
    o1, o2 = split_pairs(out, interleaved)
    assert torch.equal(o1, quiet) and torch.equal(o2, quiet), (o1, o2, quiet)
    # torch's own conversion of those floats agrees
    assert torch.equal(x1.float().to(torch.float16).view(torch.int16), quiet)


@pytest.mark.parametrize("interleaved", [False, True])
def test_cpu_fp16_nan_bits_survive(interleaved):
    check_fp16_nan_bits(interleaved)


@pytest.mark.parametrize("interleaved", [False, True])
def test_cpu_builds_for_older_x86_levels_keep_fp16_nan_bits(isa_level, interleaved):
    check_fp16_nan_bits(interleaved)


def check_bf16_nan_bits(interleaved):
    """A NaN is truncated to bfloat16 with its quiet bit set (its sign and the top of its payload kept), never
    rounded: rounding carries a payload of ones into the sign (0x7FFFFFFF + 0x8000 is -0.0 in bfloat16's bits). A
    bfloat16 x has no low bits to round, so the NaNs come from the float32 table: cos = NaN, sin = 0, x = 1 (and 0.5)
    puts the table's payload in both outputs of a pair. Row 0 has a NaN in every pair (the vector steps and the last
    pairs); row j + 1 in pair j alone, its other pairs finite, as the vector rows test a step for NaNs at once.
    25 pairs: split halves take one 16-pair step (both of its vectors), an 8-pair one and a last pair on AVX2, one
    16-pair step and a masked one on AVX-512; adjacent pairs three 8-pair steps and a last pair on AVX2."""
    half = 25
    kinds = [0x7FFFFFFF, 0xFFFFFFFF, 0x7FC0FFFF, 0x7F80FFFF, 0xFFBF8000, 0x7FC08000, 0x7FFF7FFF, 0xFF800001, 0x7FA5A5A5]
    payloads = (kinds * 3)[:half]
    nan = torch.tensor(payloads, dtype=torch.int64).to(torch.int32).view(torch.float32)
    lone = torch.eye(half, dtype=torch.bool)
    c = torch.cat([nan[None], torch.where(lone, nan, 1.0)])  # (1 + half, half)
    x1, x2 = torch.ones(half, dtype=torch.bfloat16), torch.full((half,), 0.5, dtype=torch.bfloat16)
    x = join_pairs(x1, x2, interleaved).expand(1, 1, 1 + half, 2 * half)
    out = apply_rotary(x, c, torch.zeros_like(c), interleaved=interleaved, backend="cpu").view(torch.int16)[0, 0]
    quiet = torch.tensor([(p >> 16) | 0x40 for p in payloads], dtype=torch.int32).to(torch.int16).expand(1 + half, half)
    is_nan = torch.cat([torch.ones(1, half, dtype=torch.bool), lone])
    o1, o2 = split_pairs(out, interleaved)
    for got, finite in ((o1, x1), (o2, x2)):
        expected = torch.where(is_nan, quiet, finite.view(torch.int16))
        assert torch.equal(got, expected), (got, expected)
    # torch reads them as NaN. Its own conversions give other bits, and disagree with each other: its vectorized
    # CPU loop 0xFFFF for every NaN, a 0-d tensor's 0x7FC0 (torch 2.13). The rule pinned here is that of
    # vcvtneps2bf16, which the AVX-512 BF16 rows use, so every build of the kernel gives one result.
    both = join_pairs(is_nan, is_nan, interleaved)
    assert torch.equal(out.view(torch.bfloat16).isnan(), both)


def check_bf16_rounding_of_every_high_half(interleaved):
    """Every float32 with a given top 16 bits rounds to bfloat16 as torch rounds a number (to nearest, ties to even)
    and a NaN as vcvtneps2bf16 does (truncated and quieted; torch's NaN bits differ, see check_bf16_nan_bits): for
    each of the 65536 top halves, the low halves 0, 1, 0x7FFF, 0x8000 (a tie), 0x8001 and 0xFFFF, put through the
    kernel as cos with x1 = 1, x2 = 0 and sin = 0, so x1's output is cos itself. Ties at every exponent and sign,
    carries into the exponent (to infinity), subnormals, infinities and NaNs."""
    lows = torch.tensor([0, 1, 0x7FFF, 0x8000, 0x8001, 0xFFFF], dtype=torch.int64)
    bits = ((torch.arange(1 << 16, dtype=torch.int64)[:, None] << 16) | lows).flatten()
    half = 24  # AVX2: split, a 16-pair step and an 8-pair one; adjacent, three 8-pair steps. AVX-512: 16 + masked 8
    c = bits.to(torch.int32).view(torch.float32).reshape(-1, half)
    x1, x2 = torch.ones(half, dtype=torch.bfloat16), torch.zeros(half, dtype=torch.bfloat16)
    x = join_pairs(x1, x2, interleaved)
    out = apply_rotary(
        x.expand(1, 1, c.shape[0], 2 * half), c, torch.zeros_like(c), interleaved=interleaved, backend="cpu"
    ).view(torch.int16)[0, 0]
    got = split_pairs(out, interleaved)[0].flatten().to(torch.int64) & 0xFFFF
    high = bits >> 16
    expected = torch.where(c.flatten().isnan(), high | 0x40, ((bits + 0x7FFF + (high & 1)) >> 16) & 0xFFFF)
    wrong = (got != expected).nonzero().flatten()
    assert wrong.numel() == 0, [(hex(int(bits[i])), hex(int(got[i])), hex(int(expected[i]))) for i in wrong[:8]]


@pytest.mark.parametrize("interleaved", [False, True])
def test_cpu_bf16_rounding_and_nan_bits(interleaved):
    check_bf16_rounding_of_every_high_half(interleaved)
    check_bf16_nan_bits(interleaved)


@pytest.mark.parametrize("interleaved", [False, True])
def test_cpu_builds_for_older_x86_levels_round_to_bf16_and_keep_nan_bits(isa_level, interleaved):
    check_bf16_rounding_of_every_high_half(interleaved)
    check_bf16_nan_bits(interleaved)


@pytest.mark.parametrize(("n0", "n1"), [(1, 1), (1, 3), (2, 4), (3, 17)])
@pytest.mark.parametrize("interleaved", [False, True])
def test_cpu_work_split_between_threads(n0, n1, interleaved):
    """Large enough for every thread: whole heads per thread where they split evenly (2 x 4, 3 x 17 on 2 threads),
    blocks of tokens otherwise (one head, three heads). Two threads whatever the session runs (one per pytest-xdist
    worker on 2 cores)."""
    d, s = 128, 1100
    x = torch.randn(n0, n1, s, d, dtype=torch.float64).to(torch.bfloat16)
    cos, sin = table(d, s)
    with torch_threads(2):
        out = apply_rotary(x, cos, sin, interleaved=interleaved, backend="cpu")
    expected = rope_reference(x, torch.arange(s)[None, None], rotary_dim=d, interleaved=interleaved)
    assert_close(out, expected, msg=f"{n0} x {n1} lanes on 2 threads")


@pytest.mark.parametrize("table_dtype", [torch.float32, torch.float64], ids=["fp32-tables", "fp64-tables"])
@pytest.mark.parametrize(("n0", "n1"), [(1, 2), (2, 3)])
def test_cpu_whole_heads_walked_in_chunks_of_positions(table_dtype, n0, n1):
    """Threads owning whole heads walk them in chunks of positions whose cos/sin fill 4 MiB: 2048 positions at
    d = 512 with float32 tables, 1024 with float64 ones, so s = 4133 ends in a partial chunk and a partial block."""
    d, s = 512, 4133
    x = torch.randn(n0, n1, s, d, dtype=torch.float64).to(torch.bfloat16)
    cos, sin = table(d, s, dtype=table_dtype)
    out = apply_rotary(x, cos, sin, backend="cpu")
    expected = rope_reference(x, torch.arange(s)[None, None], rotary_dim=d)
    assert_close(out, expected, msg=f"{n0} x {n1} lanes, {table_dtype} tables")


@pytest.mark.parametrize("positions", ["per_sequence_offset", "per_sequence_ids", "per_head_tables"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_heads_walked_in_groups_read_their_own_table_rows(positions, dtype):
    """A thread owning whole heads walks up to four of one sequence together, position by position, reading one
    cos/sin row for the group. 3 x 6 lanes on 2 threads (s = 77: 88704 elements, two grains): 0-8 and 9-17, so
    groups end at a sequence's last head (lanes 4-5, 9-11, 16-17) and at a thread's last lane (lane 8: 6-8) as
    well as after four. In place too, where a group running past its thread's lanes would rotate lane 9 twice.
    The positions differ per sequence (an offset each, or ids each), or the tables differ per head, where no two
    heads may share a row."""
    n0, n1, s, d = 3, 6, 77, 64
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(n0, n1, s, d, generator=gen, dtype=torch.float64).to(dtype)
    cos, sin = table(d, 4 * s)
    kwargs = {}
    if positions == "per_sequence_offset":
        kwargs["offset"] = torch.tensor([0, 37, 101])
        ids = torch.arange(s)[None, :] + kwargs["offset"][:, None]
    elif positions == "per_sequence_ids":
        ids = torch.randint(0, 4 * s, (n0, s), generator=gen)
        kwargs["positions"] = ids
    else:
        ids = torch.randint(0, 4 * s, (n0, n1, s), generator=gen)
        cos, sin = cos[ids], sin[ids]  # (n0, n1, s, d/2): a table of its own for every head
    with torch_threads(2):
        out = apply_rotary(x, cos, sin, backend="cpu", **kwargs)
        in_place = apply_rotary_(x.clone(), cos, sin, backend="cpu", **kwargs)
    expected = rope_reference(x, ids if ids.dim() == 3 else ids[:, None], rotary_dim=d)
    assert_close(out, expected, msg=positions)
    assert torch.equal(in_place, out), f"{positions}: in place"


def test_loading_the_kernel_again_keeps_the_streaming_threshold():
    previous = cpu_rope.set_stream_threshold(12345)
    try:
        library, _ = cpu_rope.build_library(cpu_rope.SOURCE.read_bytes())
        assert library is not None
        assert cpu_rope.set_stream_threshold(None) == 12345, "a second load must not reset what a caller set"
        assert cpu_rope.set_stream_threshold(None) == cpu_rope.last_level_cache_bytes()
    finally:
        cpu_rope.set_stream_threshold(previous)


def test_a_kernel_that_builds_but_cannot_load_falls_back_to_torch(monkeypatch):
    """A cache folder on a filesystem mounted noexec compiles the library but cannot map it: ctypes raises OSError.
    That made every CPU RoPE call (backend "auto"), `posenc info` and the lab fail with a bare OSError; now the
    kernel is unavailable with the reason and the fix, and "auto" takes the torch path."""
    source = cpu_rope.SOURCE.read_bytes()
    assert cpu_rope.build_library(source)[0] is not None  # built and cached: the next call only loads it

    def refuse(path, *args, **kwargs):
        raise OSError(f"{path}: failed to map segment from shared object")

    monkeypatch.setattr(cpu_rope.ctypes, "CDLL", refuse)
    library, reason = cpu_rope.build_library(source)
    assert library is None and "failed to map segment" in reason and "XDG_CACHE_HOME" in reason
    monkeypatch.setattr(cpu_rope, "_library", functools.cache(lambda: cpu_rope.build_library(source)))
    q = torch.randn(1, 2, 5, 8)
    cos, sin = table(8, 5)
    assert choose_backend("auto", [q], cos, sin, "broadcast") == "torch"
    assert_close(apply_rotary(q, cos, sin), rope_reference(q, torch.arange(5)[None, None], rotary_dim=8))
    with pytest.raises(RuntimeError, match="XDG_CACHE_HOME"):
        apply_rotary(q, cos, sin, backend="cpu")


@pytest.mark.parametrize(
    "failure",
    [OSError(28, "No space left on device"), subprocess.TimeoutExpired("c++", 300)],
    ids=["disk full", "compiler past its time limit"],
)
def test_a_build_that_fails_midway_makes_the_kernel_unavailable(monkeypatch, tmp_path, failure):
    """A full disk under the cache, or a compiler past its time limit, raised out of the build: every CPU RoPE call
    with backend "auto" failed with it. Now the kernel is unavailable with the reason, and nothing is left behind."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))  # an empty cache: the build runs
    real_run = subprocess.run

    def run(args, *rest, **kwargs):
        if "-o" in args:  # the compile, not `c++ --version`
            raise failure
        return real_run(args, *rest, **kwargs)

    monkeypatch.setattr(cpu_rope.subprocess, "run", run)
    library, reason = cpu_rope.build_library(cpu_rope.SOURCE.read_bytes())
    assert library is None and reason.startswith("building cpu_rope.cpp in ") and str(failure) in reason
    assert list((tmp_path / "posenc").iterdir()) == []


@pytest.mark.skipif(not hasattr(os, "getuid"), reason="POSIX owners and modes")
def test_the_kernel_cache_in_the_temp_dir_is_this_users_alone(monkeypatch, tmp_path):
    """Where the user's cache folder cannot be written, the library is built in the temp dir, which other users
    share: a posenc-UID folder there that anyone may write into, or that another user owns, could hold their library
    under the name this process loads (a hash of public facts), and was used as it was."""
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("")
    monkeypatch.setenv("XDG_CACHE_HOME", str(blocker))  # mkdir under a file fails: the temp dir's turn
    shared_tmp = tmp_path / "tmp"
    shared_tmp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(shared_tmp))
    shared = shared_tmp / f"posenc-{os.getuid()}"
    shared.mkdir()
    for mode in (0o777, 0o770):  # as another user could have made it, or one of the group may write into
        shared.chmod(mode)
        private = cpu_rope._cache_dir()
        assert private != shared and private.parent == shared_tmp
        assert private.stat().st_uid == os.getuid() and stat.S_IMODE(private.stat().st_mode) == 0o700
    if os.getuid() == 0:  # only root can give a folder away
        shared.chmod(0o700)
        os.chown(shared, 65534, -1)
        assert cpu_rope._cache_dir() != shared
    shared.rmdir()
    assert cpu_rope._cache_dir() == shared and stat.S_IMODE(shared.stat().st_mode) == 0o700  # made private, reused
    assert cpu_rope._cache_dir() == shared


def test_the_kernel_cache_tells_cpus_with_one_name_apart(monkeypatch, tmp_path):
    """A -march=native library is keyed by the CPU's feature flags, not only its model name: a cache shared by two
    VMs that both call themselves "AMD EPYC" must not hand one the other's instructions."""
    cpuinfo = "processor\t: 0\nmodel name\t: AMD EPYC\nflags\t\t: fpu sse2 {}\n"
    seen = []
    for flags in ("avx2", "avx2 avx512f"):
        monkeypatch.setattr(cpu_rope.Path, "read_text", lambda self, flags=flags: cpuinfo.format(flags))
        seen.append(cpu_rope._cpu_model())
    assert seen[0] != seen[1] and all("AMD EPYC" in model for model in seen)


def test_torch_compile_fullgraph_matches_eager():
    cos, sin = table(64, 32)

    def attention_inputs(q, k):
        q, k = apply_rotary_qk(q, k, cos, sin, offset=3)
        return apply_rotary(q * 2.0, cos[:7], sin[:7]) + 1.0, k

    q, k = torch.randn(2, 4, 7, 64), torch.randn(2, 2, 7, 64)
    compiled = torch.compile(attention_inputs, fullgraph=True)
    for got, want in zip(compiled(q, k), attention_inputs(q, k), strict=True):
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("backend", ["cpu", "triton"])
def test_an_explicit_fused_backend_compiles_without_warnings(backend, recwarn):
    """Choosing the backend reads cached facts (does triton import, is the CPU kernel built) through
    assume_constant_result: dynamo warned about the functools.cache it met on backend='triton'."""
    device = DEVICE[backend]
    cos, sin = (t.to(device) for t in table(8, 16))
    compiled = torch.compile(
        lambda x: apply_rotary(x, cos, sin, offset=1, backend=backend), fullgraph=True, backend="aot_eager"
    )
    x = torch.randn(1, 2, 5, 8, device=device)
    torch.testing.assert_close(compiled(x), apply_rotary(x, cos, sin, offset=1, backend="torch"))
    assert not [str(w.message) for w in recwarn]


def test_torch_compile_fullgraph_backward():
    cos, sin = table(64, 32)
    q = torch.randn(2, 4, 7, 64, requires_grad=True)
    compiled = torch.compile(
        lambda x: apply_rotary(x, cos, sin, offset=2, backend="cpu").square().sum(), fullgraph=True, backend="aot_eager"
    )
    compiled(q).backward()
    want = torch.autograd.grad(apply_rotary(q, cos, sin, offset=2, backend="torch").square().sum(), q)[0]
    torch.testing.assert_close(q.grad, want, atol=1e-5, rtol=1e-5)
    q.grad = None
    in_place = torch.compile(
        lambda x: apply_rotary_(x * 1.0, cos, sin, offset=2, backend="cpu").square().sum(),
        fullgraph=True,
        backend="aot_eager",
    )
    in_place(q).backward()
    torch.testing.assert_close(q.grad, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("backend", ["cpu", "triton"])
@pytest.mark.parametrize("use", ["alias", "views", "graph_input"])
def test_in_place_backward_under_torch_compile_wherever_x_is_read_after(backend, use):
    """Traced, the in-place rotation's gradient must not depend on reading apply_rotary_'s result rather than x
    itself. Through an autograd.Function with ctx.mark_dirty, Dynamo before torch 2.13 dropped the mark
    (pytorch/pytorch#184113): later reads of x skipped the Function and its gradient was 2*R*x, not 2*x; a graph
    input rotated in place got a wrong gradient on 2.13 too. The values match eager's in-place kernel exactly."""
    torch._dynamo.reset()  # one lambda per case below: keep within dynamo's recompile limit
    device = DEVICE[backend]
    cos, sin = (t.to(device) for t in table(32, 16))
    scale = torch.arange(1.0, 41.0, device=device)  # so that no gradient is a plain multiple of x

    def alias(x, backend):
        y = x * 1.0
        apply_rotary_(y, cos, sin, offset=2, backend=backend)
        return y

    def views(x, backend):  # q and k slices of one qkv tensor, v not rotated
        # Elementwise, not a projection: a GPU's matmul may round differently inside the graph than outside it,
        # and the outputs are compared bit for bit.
        qkv = torch.stack([x, 2 * x, 3 * x], dim=-2)
        apply_rotary_(qkv[..., 0, :], cos, sin, offset=2, backend=backend)
        apply_rotary_(qkv[..., 1, :], cos, sin, offset=2, backend=backend)
        return qkv

    leaf = torch.randn(2, 3, 7, 40, device=device, requires_grad=True)
    if use == "graph_input":
        compiled = torch.compile(
            lambda t: apply_rotary_(t, cos, sin, offset=2, backend=backend), fullgraph=True, backend="aot_eager"
        )
        run = {b: (lambda x, b=b: alias(x, b)) for b in ("torch", backend)}
        run["compiled"] = lambda x: (y := x * 1.0, compiled(y))[0]
    else:
        fn = alias if use == "alias" else views
        compiled = torch.compile(lambda t: fn(t, backend), fullgraph=True, backend="aot_eager")
        run = {"torch": lambda x: fn(x, "torch"), backend: lambda x: fn(x, backend), "compiled": compiled}
    outs, grads = {}, {}
    for name, f in run.items():
        out = f(leaf)
        outs[name] = out.detach()
        grads[name] = torch.autograd.grad((out * (scale if use != "views" else 1.0)).square().sum(), leaf)[0]
    assert torch.equal(outs["compiled"], outs[backend])
    torch.testing.assert_close(grads["compiled"], grads["torch"], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(grads[backend], grads["torch"], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("backend", ["cpu", "triton"])
@pytest.mark.parametrize("kind", ["position_ids", "per_sequence", "varlen"])
@pytest.mark.parametrize("table_form", ["as_is", "pair_stride"])
def test_positions_outside_the_table_never_read_past_it_under_torch_compile(backend, kind, table_form):
    """Inside torch.compile nothing reads positions before the custom op runs, so the kernels bound the rows
    themselves: the CPU kernel raises before writing anything; the Triton kernel (which cannot raise) gives NaN in
    the rotated channels of exactly the tokens outside the table and the right values everywhere else. A table
    with a pair stride is copied first, of the tokens' rows only (8 tokens, 16 rows): the gather must keep both."""
    torch._dynamo.reset()  # the lambdas below are one code object in every case: 12 compiles pass dynamo's limit
    device = DEVICE[backend]
    cos, sin = (t.to(device) for t in table(8, 16))
    if table_form == "pair_stride":
        pairs = torch.stack([cos, sin], -1)
        cos, sin = pairs[..., 0], pairs[..., 1]
    q = torch.randn(2, 3, 4, 10, device=device)  # r = 8 of d = 10: the tail is copied in every token
    calls = {
        # tokens 2 and 3 of sequence 1 outside: one past the table, one negative
        "position_ids": ({"positions": torch.tensor([[0, 1, 2, 3], [4, 5, 16, -1]], device=device)}, q),
        # sequence 1 starts at row 14, so its tokens 2 and 3 read rows 16 and 17
        "per_sequence": ({"offset": torch.tensor([0, 14], device=device)}, q),
        # packed: sequence 1 (tokens 4..7) at offset 14
        "varlen": (
            {"cu_seqlens": torch.tensor([0, 4, 8], device=device), "offset": torch.tensor([0, 14], device=device)},
            q.transpose(1, 2).reshape(8, 3, 10),
        ),
    }
    kwargs, x = calls[kind]
    with pytest.raises(ValueError, match=r"table has 16 rows|must be >= 0"):  # eager: checked before the call
        apply_rotary(x, cos, sin, backend=backend, **kwargs)
    compiled = torch.compile(
        lambda x, kw: apply_rotary(x, cos, sin, backend=backend, **kw), fullgraph=True, backend="aot_eager"
    )
    if backend == "cpu":
        before = x.clone()
        with pytest.raises(ValueError, match=r"the cos/sin table has 16 rows: each must be in 0 \.\. 15"):
            compiled(x, kwargs)
        in_place = torch.compile(
            lambda x, kw: apply_rotary_(x, cos, sin, backend=backend, **kw), fullgraph=True, backend="aot_eager"
        )
        with pytest.raises(ValueError, match="table has 16 rows"):
            in_place(x, kwargs)
        assert torch.equal(x, before)  # refused before any write
        return
    out = compiled(x, kwargs).cpu()
    out = out.reshape(2, 4, 3, 10).transpose(1, 2) if kind == "varlen" else out
    outside = torch.zeros(2, 1, 4, 1, dtype=torch.bool)
    outside[1, :, 2:] = True
    assert bool(out[..., :8].isnan().eq(outside).all()), "NaN in exactly the tokens outside the table"
    assert torch.equal(out[..., 8:], q[..., 8:].cpu())
    inside = apply_rotary(q[:1], cos, sin, positions=torch.arange(4, device=device), backend="torch").cpu()
    torch.testing.assert_close(out[:1], inside)


@pytest.mark.parametrize("backend", ["torch", "cpu", "triton"])
@pytest.mark.parametrize("cu_seqlens", [[0, 2, 5], [0, 5, 3, 7], [2, 4, 7]], ids=["ends-early", "falls", "starts-late"])
def test_bad_cu_seqlens_are_refused_under_torch_compile_too(backend, cu_seqlens):
    """Eager reads and refuses them; inside a graph they cannot be read, so a check runs with the graph (each
    backend would otherwise read them its own way: the torch and CPU paths restarted the last tokens at 0, Triton
    went on counting)."""
    device = DEVICE[backend]
    cos, sin = (t.to(device) for t in table(8, 64))
    x, cu = torch.randn(7, 1, 8, device=device), torch.tensor(cu_seqlens, device=device)
    with pytest.raises(ValueError, match="cu_seqlens must"):
        apply_rotary(x, cos, sin, cu_seqlens=cu, backend=backend)
    compiled = torch.compile(
        lambda x, cu: apply_rotary(x, cos, sin, cu_seqlens=cu, backend=backend), fullgraph=True, backend="aot_eager"
    )
    message = "cu_seqlens must start at 0, end at total_tokens and be non-decreasing"
    if device == "cuda":
        # A device-side assert: the process's CUDA context is unusable after it, so it fires in a process of its own.
        script = (
            "import torch; from posenc import apply_rotary\n"
            "cos, sin = torch.ones(64, 4, device='cuda'), torch.zeros(64, 4, device='cuda')\n"
            "f = torch.compile(lambda x, cu: apply_rotary(x, cos, sin, cu_seqlens=cu, backend='triton'),\n"
            "                  fullgraph=True, backend='aot_eager')\n"
            f"f(torch.randn(7, 1, 8, device='cuda'), torch.tensor({cu_seqlens}, device='cuda'))\n"
            "torch.cuda.synchronize()\n"
        )
        run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
        assert run.returncode != 0 and message in run.stderr, run.stderr[-2000:]
    else:
        with pytest.raises(RuntimeError, match=message):
            compiled(x, cu)
    good = torch.tensor([0, 2, 7], device=device)
    torch.testing.assert_close(compiled(x, good), apply_rotary(x, cos, sin, cu_seqlens=good, backend=backend))


@settings(max_examples=25, deadline=None)
@given(
    s=st.integers(1, 40),
    half=st.integers(1, 24),
    extra=st.integers(0, 5),
    heads=st.integers(1, 3),
    interleaved=st.booleans(),
    dtype=st.sampled_from(ALL_DTYPES),
)
def test_cpu_inverse_and_norm_properties(s, half, extra, heads, interleaved, dtype):
    """Rotating back with conjugate recovers x; a rotation keeps every pair's length."""
    d = 2 * half + 2 * extra
    x = torch.randn(1, heads, s, d, dtype=torch.float64)
    cos, sin = table(2 * half, s + 8, dtype=torch.float64)
    out = apply_rotary(x, cos, sin, offset=8, backend="cpu")
    back = apply_rotary(out, cos, sin, offset=8, conjugate=True, backend="cpu")
    torch.testing.assert_close(back, x, atol=1e-12, rtol=1e-12)
    lowp = apply_rotary(x.to(dtype), cos.float(), sin.float(), offset=8, interleaved=interleaved, backend="cpu")
    pairs = (
        (lambda t: t[..., : 2 * half].unflatten(-1, (half, 2)))
        if interleaved
        else (lambda t: torch.stack((t[..., :half], t[..., half : 2 * half]), dim=-1))
    )
    atol, rtol = TOLERANCES[dtype]
    torch.testing.assert_close(
        pairs(lowp.double()).norm(dim=-1), pairs(x.to(dtype).double()).norm(dim=-1), atol=4 * atol, rtol=4 * rtol
    )


def test_auto_picks_the_fused_cpu_kernel_and_falls_back_to_torch():
    x = torch.randn(1, 2, 3, 8)
    cos, sin = table(8, 3)
    assert "cpu" in posenc.available_backends()
    assert choose_backend("auto", [x], cos, sin, "broadcast") == "cpu"
    assert choose_backend("auto", [x], cos.requires_grad_(), sin, "broadcast") == "torch"
    assert choose_backend("auto", [x.reshape(1, 1, 2, 3, 8)], cos.detach(), sin, "broadcast") == "torch"


@pytest.mark.parametrize(
    ("xs", "cos", "kind", "error", "match"),
    [
        ([], None, "broadcast", ValueError, "xs must hold at least one tensor"),
        (None, None, "broadcast", TypeError, "xs must be a list of tensors"),
        ([torch.zeros(1, 3, 8)], [1.0], "broadcast", TypeError, "cos must be a torch.Tensor, got list"),
        ([torch.zeros(1, 3, 8)], None, "bsd", ValueError, "kind must be one of"),
    ],
)
@pytest.mark.parametrize("backend", ["auto", "torch"])
def test_choose_backend_names_a_bad_argument(backend, xs, cos, kind, error, match):
    """An empty xs raised IndexError from xs[0], a list cos AttributeError from cos.requires_grad."""
    table_cos, sin = table(8, 3)
    xs = torch.zeros(1, 3, 8) if xs is None else xs
    with pytest.raises(error, match=match):
        choose_backend(backend, xs, table_cos if cos is None else cos, sin, kind)


def test_rope_module_passes_backend_through():
    q, k = torch.randn(2, 4, 9, 64), torch.randn(2, 2, 9, 64)
    fused = posenc.RoPE(64, rotary_dim=48, backend="cpu")(q, k, offset=torch.tensor([0, 5]))
    plain = posenc.RoPE(64, rotary_dim=48, backend="torch")(q, k, offset=torch.tensor([0, 5]))
    for a, b in zip(fused, plain, strict=True):
        assert_close(a, b.double())
    with pytest.raises(ValueError, match="backend must be one of"):
        posenc.RoPE(64, backend="cuda")


def test_errors_name_the_argument_and_the_fix():
    x = torch.randn(2, 3, 5, 16)
    cos, sin = table(16, 8)
    with pytest.raises(ValueError, match="backend must be one of"):
        apply_rotary(x, cos[:5], sin[:5], backend="fast")
    with pytest.raises(ValueError, match="layout='bshd' only applies"):
        apply_rotary(x, cos[:5], sin[:5], layout="bshd")
    with pytest.raises(ValueError, match="layout must be 'bhsd' or 'bshd'"):
        apply_rotary(x, cos, sin, offset=0, layout="sbhd")
    with pytest.raises(ValueError, match="tables of shape"):
        apply_rotary(x, cos[None], sin[None], offset=0)
    with pytest.raises(ValueError, match="table has 8 rows"):
        apply_rotary(x, cos, sin, offset=4)
    with pytest.raises(ValueError, match="must be 4-D"):
        apply_rotary(x[0], cos, sin, offset=0)
    with pytest.raises(ValueError, match=r"offset must be an int, a \(2,\) tensor .* or a 0-d tensor"):
        apply_rotary(x, cos, sin, offset=torch.tensor([0, 1, 2]))
    with pytest.raises(ValueError, match=r"offset must be an int, a \(2,\) tensor .* or a 0-d tensor"):
        apply_rotary(x, cos, sin, offset=torch.tensor([[1]]))
    with pytest.raises(ValueError, match="table has 8 rows"):
        apply_rotary(x, cos, sin, offset=torch.tensor(4))
    with pytest.raises(ValueError, match="offset must be >= 0"):
        apply_rotary(x, cos, sin, offset=-1)
    # A negative per-sequence offset too, where the position ids make up for it (rows 0..4): as resolve_positions.
    with pytest.raises(ValueError, match="offset must be >= 0, got a negative entry"):
        apply_rotary(x, cos, sin, positions=torch.arange(1, 6), offset=torch.tensor([0, -1]))
    with pytest.raises(TypeError, match="offset must be an int"):
        apply_rotary(x, cos, sin, offset=1.5)
    with pytest.raises(ValueError, match=r"positions must have shape \(5,\) or \(2, 5\)"):
        apply_rotary(x, cos, sin, positions=torch.arange(4))
    packed = torch.randn(6, 2, 16)
    with pytest.raises(ValueError, match="end at total_tokens=6"):
        apply_rotary(packed, cos, sin, cu_seqlens=torch.tensor([0, 2, 5]))
    with pytest.raises(ValueError, match="non-decreasing"):
        apply_rotary(packed, cos, sin, cu_seqlens=torch.tensor([0, 4, 2, 6]))
    with pytest.raises(ValueError, match="cannot be combined with cu_seqlens"):
        apply_rotary(packed, cos, sin, cu_seqlens=torch.tensor([0, 6]), positions=torch.arange(6))
    with pytest.raises(ValueError, match="drop layout"):
        apply_rotary(packed, cos, sin, cu_seqlens=torch.tensor([0, 6]), layout="bhsd")
    with pytest.raises(TypeError, match="must share a dtype"):  # like cos/sin's, the cache's and the weights'
        apply_rotary_qk(x, x.double(), cos[:5], sin[:5])
    with pytest.raises(ValueError, match="share their batch and token sizes"):
        apply_rotary_qk(x, x[:, :, :4], cos, sin, offset=0)
    with pytest.raises(ValueError, match="cos/sin require grad"):
        apply_rotary(x, cos[:5].clone().requires_grad_(), sin[:5], backend="cpu")
    with pytest.raises(ValueError, match=r"cos/sin of shape \(8, 8\) do not broadcast to x.shape"):
        apply_rotary(x, cos, sin)


@pytest.mark.parametrize("backend", ["torch", "cpu"])
def test_per_sequence_offsets_alone_are_checked_from_their_min_and_max(backend):
    # Without position ids the rows' range is read from the offsets (no positions tensor built for the check):
    # every refusal of the positions built and read is kept, with its message.
    x = torch.randn(2, 3, 5, 16)
    cos, sin = table(16, 8)
    with pytest.raises(ValueError, match="offset must be >= 0, got a negative entry"):
        apply_rotary(x, cos, sin, offset=torch.tensor([0, -1]), backend=backend)
    with pytest.raises(ValueError, match="offset must be >= 0, got a negative entry"):  # an empty sequence too
        apply_rotary(x[:, :, :0], cos, sin, offset=torch.tensor([0, -1]), backend=backend)
    with pytest.raises(ValueError, match=r"positions reach 1 \.\. 8 but the cos/sin table has 8 rows"):
        apply_rotary(x, cos, sin, offset=torch.tensor([4, 1], dtype=torch.int32), backend=backend)
    with pytest.raises(ValueError, match=r"offset \+ position ids must fit in int64"):
        apply_rotary(x, cos, sin, offset=torch.tensor([0, 2**63 - 3]), backend=backend)
    rows = torch.tensor([[3], [0]]) + torch.arange(5)
    assert torch.equal(
        apply_rotary(x, cos, sin, offset=torch.tensor([3, 0]), backend=backend),
        apply_rotary(x, cos, sin, positions=rows, backend=backend),
    )


def test_triton_launches_on_the_tensors_gpu(monkeypatch):
    """Triton launches on the current CUDA device: tensors on another GPU must make theirs current first (as
    flash-attention's and Liger's launchers do). Checked with a stand-in kernel; no GPU needed."""
    import contextlib

    from posenc.kernels import triton_rope

    entered: list[torch.device] = []

    @contextlib.contextmanager
    def device_guard(device):
        entered.append(device)
        yield

    launched: list[int] = []

    class Kernel:
        def __getitem__(self, grid):
            return lambda *args, **constants: launched.append(len(entered))

    class OnSecondGpu:
        device = torch.device("cuda", 1)

    monkeypatch.setattr(torch.cuda, "device", device_guard)
    monkeypatch.setattr(triton_rope, "_rope_kernel", Kernel())
    triton_rope.launch(triton_rope.Launch((1,), [OnSecondGpu()], {}))
    assert entered == [torch.device("cuda", 1)] and launched == [1], "the kernel ran outside the device guard"


# Every pair of (positions, layout, partial or whole head) in four interpreted cases instead of all eight.
@pytest.mark.parametrize(
    ("kind", "interleaved", "d", "r"),
    [
        ("position_ids", False, 128, 128),
        ("position_ids", True, 80, 64),
        ("varlen", False, 80, 64),
        ("varlen", True, 128, 128),
    ],
)
def test_triton_configurations_give_the_default_bits(kind, interleaved, d, r):
    """BLOCK_S, num_warps and heads per program (what benchmarks/triton_tune.py sweeps) change the tiling, not the
    arithmetic: every configuration writes the default's bits, tail channels included, for q and k of different
    head counts (5 and 3: head groups of 2 and 4 end part-filled)."""
    triton = pytest.importorskip("triton")
    from posenc.kernels import triton_rope
    from posenc.kernels.launch import triton_plans

    # 13 tokens a row: the interpreter's cost grows with the token blocks a configuration walks (BLOCK_S=1 walks
    # every token), and 13 (varlen: 17) keeps what 21 showed: a ragged last block for every BLOCK_S but 1.
    q, k, kwargs, _, _ = make_case(kind, b=2, hq=5, hk=3, s=13, d=d, dtype=torch.bfloat16)
    cos, sin = table(r, 320)
    q, k, cos, sin = (t.to(TRITON_DEVICE) for t in (q, k, cos, sin))
    if kind == "varlen":  # (total, h, d) tokens of several sequences, each with its offset
        where = {"offsets": kwargs["offset"].to(TRITON_DEVICE), "cu_seqlens": kwargs["cu_seqlens"].to(TRITON_DEVICE)}
        where |= {"positions": None, "offset": 0}
        n0, tokens = 1, q.shape[0]
    else:
        where = {"positions": kwargs["positions"].to(TRITON_DEVICE), "offsets": None, "offset": 0, "cu_seqlens": None}
        n0, tokens = q.shape[0], q.shape[2]

    def run(**config):
        outs = [torch.full_like(q, float("nan")), torch.full_like(k, float("nan"))]
        plans = triton_plans(
            [q, k], outs, cos, sin, where["positions"], where["offsets"], where["offset"], where["cu_seqlens"],
            "varlen" if kind == "varlen" else "bhsd", interleaved, False, True, **config,
        )  # fmt: skip
        assert len(plans) == 1
        triton_rope.launch(plans[0])
        return outs, plans[0]

    expected, default = run()
    # The default (from the H200 run): two heads a program where cos/sin are the same for every head, as here.
    assert default.options == {"enable_fp_fusion": True} and default.constants["HEADS"] == 2
    assert not any(o.isnan().any() for o in expected)
    assert default.constants["SUPER_S"] == 1
    # superblock: runs of token blocks, each covered by every head group before the next; with BLOCK_S=4 there are
    # 4 blocks a row (13 tokens) or 5 (varlen's 17), so runs of 3 leave a short last run (and runs of 4 in varlen,
    # one whole run a row), with BLOCK_S=2 runs of 7 in varlen's 9 blocks too, and 100 means one run.
    configs = [(1, 1, 1, 1), (4, 2, 2, 1), (16, 8, 1, 1), (64, 4, 4, 1), (8, 4, 8, 1)]
    configs += [(4, 1, 2, 3), (4, 2, 1, 4), (2, 1, 4, 7), (4, 4, 2, 100)]
    for block_s, num_warps, heads, superblock in configs:
        outs, plan = run(block_s=block_s, num_warps=num_warps, heads_per_program=heads, superblock=superblock)
        assert plan.constants["BLOCK_S"] == block_s and plan.options["num_warps"] == num_warps
        n_blocks = triton.cdiv(tokens, block_s)
        assert plan.constants["SUPER_S"] == min(superblock, n_blocks)
        groups = triton.cdiv(5, heads) + triton.cdiv(3, heads)
        assert plan.grid == (n_blocks * n0 * groups,)
        config = f"BLOCK_S={block_s} num_warps={num_warps} heads={heads} superblock={superblock}"
        assert all(map(torch.equal, outs, expected)), config


@pytest.mark.parametrize("heads", [2, 3, 8])
def test_triton_head_groups_in_place_q_only_conjugate_and_rows_outside_the_table(heads):
    """Head groups on the other paths: q alone, rotated in place by -angle, a broadcast-over-heads cos/sin view,
    and positions past the table (those tokens NaN in every head of a group, the rest equal to one head a
    program)."""
    pytest.importorskip("triton")
    from posenc.kernels import triton_rope
    from posenc.kernels.launch import triton_plans

    gen = torch.Generator().manual_seed(3)
    q = torch.randn(2, 5, 9, 64, generator=gen).to(TRITON_DEVICE)
    cos, sin = (t.to(TRITON_DEVICE) for t in table(64, 16))
    positions = torch.tensor([[0, 3, 15, 16, 2, 40, 7, 1, 9], [5, 5, 5, 5, 5, 5, 5, 5, 5]]).to(TRITON_DEVICE)

    def run(kind, cos_arg, sin_arg, where, **config):
        x = q.clone()
        (plan,) = triton_plans([x], [x], cos_arg, sin_arg, where, None, 0, None, kind, False, True, False, **config)
        triton_rope.launch(plan)
        return x

    # A table read at positions, two of them past its 16 rows: those tokens NaN in every head, and only those.
    expected = run("bhsd", cos, sin, positions, heads_per_program=1)
    got = run("bhsd", cos, sin, positions, heads_per_program=heads)
    outside = (positions >= 16)[:, None, :, None].expand_as(q)
    assert torch.equal(got.isnan(), outside) and torch.equal(expected.isnan(), outside)
    assert torch.equal(got.nan_to_num(), expected.nan_to_num())
    # (s, r/2) cos/sin broadcast over batch and heads.
    expected = run("broadcast", cos[:9], sin[:9], None, heads_per_program=1)
    assert torch.equal(run("broadcast", cos[:9], sin[:9], None, heads_per_program=heads), expected)


def test_host_side_power_of_two_matches_tritons():
    triton = pytest.importorskip("triton")
    from posenc.kernels.triton_rope import _next_power_of_2

    assert [_next_power_of_2(n) for n in range(70000)] == [triton.next_power_of_2(n) for n in range(70000)]


def test_triton_configurations_are_checked():
    pytest.importorskip("triton")
    from posenc.kernels.launch import triton_plans

    x, cos = torch.zeros(1, 2, 8, 16), torch.zeros(8, 8)

    def plan(**config):
        return triton_plans([x], [torch.empty_like(x)], cos, cos, None, None, 0, None, "bhsd", False, False, True,
                            **config)  # fmt: skip

    for bad in (0, 3, 48, -4, 2.0, True):
        with pytest.raises(ValueError, match=r"block_s must be a power of two \(tokens per program\)"):
            plan(block_s=bad)
    for bad in (0, 3, 64, True):
        with pytest.raises(ValueError, match=r"num_warps must be one of \(1, 2, 4, 8, 16, 32\)"):
            plan(num_warps=bad)
    for bad in (0, 65, 2.0, True):
        with pytest.raises(ValueError, match=r"heads_per_program must be an int in 1..64"):
            plan(heads_per_program=bad)
    for bad in (0, -1, 2**20 + 1, 4.0, True):
        with pytest.raises(ValueError, match=r"superblock must be an int in 1..2\*\*20 \(token blocks a run\)"):
            plan(superblock=bad)
    # cos/sin given per head (a broadcast 4-D view whose head axis is not 1): one load cannot serve two heads.
    per_head = torch.zeros(1, 2, 8, 8)
    with pytest.raises(ValueError, match="these cos/sin differ by head; pass heads_per_program=1"):
        triton_plans([x], [torch.empty_like(x)], per_head, per_head, None, None, 0, None, "broadcast", False, False,
                     True, heads_per_program=2)  # fmt: skip
    assert triton_plans([x], [torch.empty_like(x)], per_head, per_head, None, None, 0, None, "broadcast", False,
                        False, True, heads_per_program=1)  # fmt: skip
    # By default: one head a program for such cos/sin, two where every head reads the same rows.
    (own,) = triton_plans([x], [torch.empty_like(x)], per_head, per_head, None, None, 0, None, "broadcast", False,
                          False, True)  # fmt: skip
    (shared,) = plan()
    assert own.constants["HEADS"] == 1 and shared.constants["HEADS"] == 2


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graph capture needs a CUDA device")
def test_table_calls_capture_into_a_cuda_graph():
    """A decode step with tensor offsets, position ids or cu_seqlens captures into a CUDA graph: no check reads a
    value while capturing (it would sync, which a capture refuses), and the replay equals the eager result."""
    device = "cuda"
    cos, sin = (t.to(device) for t in table(64, 256))
    q, k = torch.randn(2, 4, 1, 64, device=device), torch.randn(2, 2, 1, 64, device=device)
    offsets, ids = torch.tensor([5, 70], device=device), torch.tensor([[3], [9]], device=device)
    packed, cu_seqlens = torch.randn(5, 2, 64, device=device), torch.tensor([0, 2, 5], device=device)
    rope = posenc.RoPE(64)
    calls = {
        "offsets": lambda: apply_rotary_qk(q, k, cos, sin, offset=offsets),
        "position ids": lambda: apply_rotary_qk(q, k, cos, sin, positions=ids),
        "cu_seqlens": lambda: (apply_rotary(packed, cos, sin, cu_seqlens=cu_seqlens, offset=offsets),),
        "RoPE": lambda: rope(q, k, positions=ids, offset=offsets),
    }
    for name, call in calls.items():
        expected = call()  # also warms up: RoPE builds its table here, before the capture
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            call()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = call()
        graph.replay()
        torch.cuda.synchronize()
        for got, want in zip(captured, expected, strict=True):
            torch.testing.assert_close(got, want, rtol=0, atol=0, msg=name)
    # A longer call grows RoPE's table; the graph still reads the old one, which must outlive it (not be handed to
    # the garbage written here).
    rope(torch.randn(1, 1, 2000, 64, device=device), torch.randn(1, 1, 2000, 64, device=device))
    # A cast (model.float(), here a no-op one) keeps them too: it dropped every table but the CPU's until stop 43.
    rope.float()
    garbage = [torch.full((256, 32), float("nan"), device=device) for _ in range(64)]
    graph.replay()
    torch.cuda.synchronize()
    for got, want in zip(captured, expected, strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=0, msg="RoPE after its table grew")
    del garbage


def test_values_are_read_only_outside_tracing_and_capture(monkeypatch):
    from posenc._checks import values_readable

    assert values_readable(torch.device("cpu")) and values_readable(None)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    assert values_readable("cpu") and not values_readable(torch.device("cuda", 0))


def test_triton_not_installed_names_the_install_command(monkeypatch):
    """Without triton, backend='triton' said only "No module named 'triton'"."""
    posenc.kernels.backend.triton_module_or_error.cache_clear()
    monkeypatch.setitem(sys.modules, "triton", None)  # importing it raises ModuleNotFoundError, name "triton"
    monkeypatch.delitem(sys.modules, "posenc.kernels.triton_rope", raising=False)
    monkeypatch.delattr(posenc.kernels, "triton_rope", raising=False)  # else `from` finds the attribute
    try:
        x, cos, sin = torch.randn(1, 2, 3, 8), torch.ones(3, 4), torch.zeros(3, 4)
        with pytest.raises(RuntimeError, match=r"backend='triton' is unavailable: .*pip install 'posenc\[triton\]'"):
            apply_rotary(x, cos, sin, backend="triton")
    finally:
        monkeypatch.undo()
        posenc.kernels.backend.triton_module_or_error.cache_clear()


@pytest.mark.parametrize("backend", ["torch", "cpu", "triton"])
@pytest.mark.parametrize("rotary_dim", [8, 6])
@pytest.mark.parametrize("call", ["broadcast", "offset", "offsets", "positions", "varlen", "qk", "in place"])
def test_batched_backward_passes_match_one_by_one(backend, rotary_dim, call):
    """jacobian(vectorize=True) and grad(is_grads_batched=True) run the backward under autograd's own vmap, whose
    gradients have no storage: every backend failed there ("Cannot access data pointer", or no batching rule for
    the torch path's alias). They take the torch formula now, with the numbers of one backward at a time."""
    torch.manual_seed(0)
    half = rotary_dim // 2
    x = torch.randn(1, 2, 3, 8)
    cos, sin = torch.randn(3, half), torch.randn(3, half)
    table = torch.randn(10, half), torch.randn(10, half)
    calls = {
        "broadcast": lambda x: apply_rotary(x, cos, sin, backend=backend),
        "offset": lambda x: apply_rotary(x, *table, offset=2, backend=backend),
        "offsets": lambda x: apply_rotary(x, *table, offset=torch.tensor([3]), backend=backend),
        "positions": lambda x: apply_rotary(x, *table, positions=torch.tensor([5, 1, 7]), backend=backend),
        "varlen": lambda x: apply_rotary(
            x[0].transpose(0, 1).reshape(3, 2, 8), *table, cu_seqlens=torch.tensor([0, 1, 3]), backend=backend
        ),
        "qk": lambda x: torch.cat(apply_rotary_qk(x, x[:, :1] * 2, *table, offset=1, backend=backend), dim=1),
        "in place": lambda x: apply_rotary_(x * 1, *table, offset=4, backend=backend),
    }
    f = calls[call]
    one_by_one = torch.autograd.functional.jacobian(f, x)
    assert torch.equal(torch.autograd.functional.jacobian(f, x, vectorize=True), one_by_one)
    x.requires_grad_(True)
    out = f(x)
    grads = torch.randn(4, *out.shape)
    (batched,) = torch.autograd.grad(out, x, grads, is_grads_batched=True, retain_graph=True)
    for g, got in zip(grads, batched, strict=True):
        # The fused backward rounds its multiply-adds once, the batched torch formula twice: float32's tolerance.
        assert_close(got, torch.autograd.grad(out, x, g, retain_graph=True)[0].double())


def test_choose_backend_names_a_bad_sin_or_x_and_sends_mixed_dtypes_to_torch():
    """sin and every x are checked as cos is, each named; q and k of two dtypes go to the torch path ("auto") or are
    refused by a fused backend, which rotates one dtype per call."""
    cos, sin = table(8, 3)
    x = torch.zeros(1, 3, 8)
    with pytest.raises(TypeError, match=r"^sin must be a torch\.Tensor, got list"):
        choose_backend("auto", [x], cos, [1.0], "broadcast")
    with pytest.raises(TypeError, match=r"^xs\[1\] must be a torch\.Tensor, got NoneType"):
        choose_backend("auto", [x, None], cos, sin, "broadcast")
    assert choose_backend("auto", [x, x.double()], cos, sin, "broadcast") == "torch"
    with pytest.raises(ValueError, match="q and k have different dtypes"):
        choose_backend("cpu", [x, x.double()], cos, sin, "broadcast")
