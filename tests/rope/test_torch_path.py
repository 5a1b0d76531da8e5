"""The pure-torch rotation: its two formulas (out= writes with the rotation's own backward, and the plain
differentiable one), and every autograd mode through every backend: torch.func transforms and forward-mode AD run
on the torch path, never silently through a kernel that drops them."""

from __future__ import annotations

import pytest
import torch
import torch.autograd.forward_ad as fwAD

import posenc
from posenc.rope.apply import apply_rotary_torch
from posenc.testing import DTYPES, assert_close

LAYOUTS = [False, True]


def angles(rows: int, half: int, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    theta = torch.randn(rows, half, dtype=torch.float64, generator=torch.Generator().manual_seed(1)) * 10
    return theta.cos().to(dtype), theta.sin().to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("interleaved", LAYOUTS)
@pytest.mark.parametrize("rotary", [16, 10])
@pytest.mark.parametrize("conjugate", [False, True])
def test_both_formulas_match_the_float64_rotation(dtype, interleaved, rotary, conjugate):
    # The out= formula (cos/sin constant) and the plain one (cos/sin needing grad) round differently inside float32
    # but must both be within the dtype's tolerance of the float64 rotation, and leave channels past r alone.
    x = torch.randn(2, 3, 5, 16, generator=torch.Generator().manual_seed(0)).to(dtype)
    cos, sin = angles(5, rotary // 2)
    fast = apply_rotary_torch(x, cos, sin, interleaved=interleaved, conjugate=conjugate)
    plain = apply_rotary_torch(
        x, cos.requires_grad_(), sin.requires_grad_(), interleaved=interleaved, conjugate=conjugate
    ).detach()
    reference = apply_rotary_torch(
        x.double(), cos.detach().double(), sin.detach().double(), interleaved=interleaved, conjugate=conjugate
    )
    for out in (fast, plain):
        assert out.dtype == dtype and out.shape == x.shape
        assert_close(out, reference)
        assert torch.equal(out[..., rotary:], x[..., rotary:])


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
@pytest.mark.parametrize("interleaved", LAYOUTS)
def test_the_out_formula_keeps_strides_and_takes_views(dtype, interleaved):
    # A transposed (b, s, h, d) view (Hugging Face's q) and a strided slice: out= writes follow empty_like's layout
    # of x, and the values are those of a contiguous x bit for bit. bf16 takes the float32 buffer cast into out.
    base = torch.randn(2, 5, 3, 32, dtype=torch.float64).to(dtype)
    cos, sin = angles(5, 6, torch.float64 if dtype == torch.float64 else torch.float32)
    for x in (base.transpose(1, 2), base.transpose(1, 2)[..., ::2]):
        got = apply_rotary_torch(x, cos, sin, interleaved=interleaved)
        assert got.stride() == torch.empty_like(x).stride()
        assert torch.equal(got, apply_rotary_torch(x.contiguous(), cos, sin, interleaved=interleaved))
        expected = apply_rotary_torch(
            x.contiguous(), cos.requires_grad_(), sin.requires_grad_(), interleaved=interleaved
        ).detach()
        cos, sin = cos.detach(), sin.detach()
        assert_close(got, expected)


@pytest.mark.parametrize("interleaved", LAYOUTS)
def test_gradients_first_and_second_order(interleaved):
    # The rotation's backward is its conjugate, called through the same Function: double backward works too.
    x = torch.randn(1, 2, 4, 12, dtype=torch.float64, requires_grad=True)
    cos, sin = angles(4, 5, torch.float64)
    fn = lambda x: apply_rotary_torch(x, cos, sin, interleaved=interleaved)  # noqa: E731
    assert type(fn(x).grad_fn).__name__ == "_RotateCopyBackward"  # the out= formula, not the plain one
    assert torch.autograd.gradcheck(fn, (x,))
    assert torch.autograd.gradgradcheck(fn, (x,))


def test_the_out_formula_binds_no_signature_per_call(monkeypatch):
    # torch's Function.apply runs inspect.signature on every call of a Function with setup_context: ~30 us, most of
    # a decode step's torch path (q and k). The rotation, its gradient and its double backward bind none.
    import inspect

    calls = []
    signature = inspect.signature
    monkeypatch.setattr(inspect, "signature", lambda *a, **k: calls.append(a) or signature(*a, **k))
    x = torch.randn(1, 2, 1, 16, dtype=torch.float64, requires_grad=True)
    cos, sin = angles(1, 8, torch.float64)
    q, _ = posenc.apply_rotary_qk(x, x.detach(), cos, sin, backend="torch")
    (grad,) = torch.autograd.grad(q.square().sum(), x, create_graph=True)
    grad.sum().backward()
    assert type(q.grad_fn).__name__ == "_RotateCopyBackward"
    assert calls == []


def test_learned_angles_still_get_gradients():
    x = torch.randn(1, 2, 4, 8, dtype=torch.float64)
    theta = torch.randn(4, 4, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda t: posenc.apply_rotary(x, t.cos(), t.sin(), backend="torch"), (theta,))


@pytest.mark.parametrize("backend", ["torch", "auto"])
@pytest.mark.parametrize("interleaved", LAYOUTS)
def test_torch_func_transforms(backend, interleaved):
    cos, sin = angles(3, 8)
    x = torch.randn(1, 2, 3, 16)
    f = lambda x: posenc.apply_rotary(x, cos, sin, interleaved=interleaved, backend=backend)  # noqa: E731
    batch = torch.randn(4, 1, 2, 3, 16)
    assert_close(torch.func.vmap(f)(batch), torch.stack([f(b) for b in batch]))
    # A rotation is linear: its Jacobian-vector product is the rotation of the vector, and the gradient of
    # <f(x), w> is the inverse rotation of w.
    tangent, w = torch.randn_like(x), torch.randn_like(x)
    _, jvp = torch.func.jvp(f, (x,), (tangent,))
    assert_close(jvp, f(tangent))
    grad = torch.func.grad(lambda x: (f(x) * w).sum())(x)
    assert_close(grad, posenc.apply_rotary(w, cos, sin, interleaved=interleaved, conjugate=True))
    jacobian = torch.func.jacrev(f)(x)
    assert jacobian.shape == x.shape + x.shape


TRANSFORMS = {
    "grad": lambda f, x: torch.func.grad(lambda x: f(x).sum())(x),
    "jacrev": lambda f, x: torch.func.jacrev(f)(x),
    "vjp": lambda f, x: torch.func.vjp(f, x)[0],
    "jvp": lambda f, x: torch.func.jvp(f, (x,), (torch.ones_like(x),))[0],
    "per-sample grad": lambda f, x: torch.func.vmap(torch.func.grad(lambda x: f(x[None]).sum()))(x),
}


@pytest.mark.parametrize("transform", list(TRANSFORMS))
@pytest.mark.parametrize("rope_parameters", [None, {"rope_type": "dynamic", "factor": 2.0}], ids=["rope", "dynamic"])
def test_a_rope_first_used_inside_a_torch_func_transform_serves_eager_calls_after_it(transform, rope_parameters):
    """The cos/sin table made by a RoPE's first call inside torch.func.grad (jacrev, vjp, jvp: per-sample gradients)
    was kept, though there even a fresh tensor is the transform's wrapper, which has no storage once the transform
    returns: every later eager call on the fused kernels raised "Cannot access data pointer of Tensor that doesn't
    have storage" (until 2026-12-05)."""
    rope = posenc.RoPE(8, rope_parameters=rope_parameters, max_position_embeddings=4)
    k = torch.randn(1, 2, 6, 8)
    q = torch.randn(1, 2, 6, 8)
    TRANSFORMS[transform](lambda x: rope(x, k)[0], q)
    expected = posenc.RoPE(8, rope_parameters=rope_parameters, max_position_embeddings=4)(q, k)
    for got, want in zip(rope(q, k), expected, strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    # And a table kept by an eager call serves a transform as a constant: the gradient is the inverse rotation.
    w = torch.randn_like(q)
    grad = torch.func.grad(lambda x: (rope(x, k)[0] * w).sum())(q)
    cos, sin = rope.cos_sin(torch.arange(6))
    assert_close(grad, posenc.apply_rotary(w, cos, sin, conjugate=True))


def test_a_window_made_inside_a_torch_func_transform_is_not_kept():
    # As the table above: positions past the table read a window, which a transform's call must not keep either.
    rope, far = posenc.RoPE(8), 1 << 16
    q, k = torch.randn(1, 2, 1, 8), torch.randn(1, 2, 1, 8)
    torch.func.grad(lambda x: rope(x, k, offset=far)[0].sum())(q)
    assert not rope._windows
    for got, want in zip(rope(q, k, offset=far), posenc.RoPE(8)(q, k, offset=far), strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


@pytest.mark.parametrize("backend", ["torch", "auto"])
def test_forward_mode_ad_carries_the_tangent(backend):
    # The fused kernels have no forward derivative: before "auto" routed around them, the tangent came out None.
    rope = posenc.RoPE(16, backend=backend)
    x, t = torch.randn(1, 2, 5, 16), torch.randn(1, 2, 5, 16)
    with fwAD.dual_level():
        q, k = rope(fwAD.make_dual(x, t), fwAD.make_dual(x, t), offset=3)
        tangents = fwAD.unpack_dual(q).tangent, fwAD.unpack_dual(k).tangent
    expected = rope(t, t, offset=3)
    for got, want in zip(tangents, expected, strict=True):
        assert got is not None
        assert_close(got, want)


@pytest.mark.parametrize("inplace", [False, True])
def test_torch_func_transforms_and_tangents_inside_torch_compile(inplace):
    """Compiled, "auto" took the fused op under transforms too: vmap and grad failed inside it, and jvp and
    forward-mode AD returned zeros or no tangent, without a word (until 2026-12-05)."""
    torch._dynamo.reset()
    cos, sin = angles(3, 8)
    rotate = posenc.apply_rotary_ if inplace else posenc.apply_rotary
    f = lambda x: rotate(x.clone(), cos, sin)  # noqa: E731
    reference = lambda x: posenc.apply_rotary(x, cos, sin, backend="torch")  # noqa: E731
    x, t, w = torch.randn(1, 2, 3, 16), torch.randn(1, 2, 3, 16), torch.randn(1, 2, 3, 16)
    batch = torch.randn(4, 1, 2, 3, 16)
    assert_close(torch.compile(torch.func.vmap(f), fullgraph=True)(batch), torch.func.vmap(reference)(batch))
    grad = torch.compile(torch.func.grad(lambda x: (f(x) * w).sum()), fullgraph=True)(x)
    assert_close(grad, posenc.apply_rotary(w, cos, sin, conjugate=True))
    _, jvp = torch.compile(lambda x, t: torch.func.jvp(f, (x,), (t,)), fullgraph=True)(x, t)
    assert_close(jvp, reference(t))

    def forward_mode(x, t):
        with fwAD.dual_level():
            return fwAD.unpack_dual(f(fwAD.make_dual(x, t))).tangent

    tangent = torch.compile(forward_mode)(x, t)
    assert tangent is not None
    assert_close(tangent, reference(t))


def test_explicit_fused_backend_refuses_transforms_and_tangents():
    cos, sin = angles(3, 8)
    x = torch.randn(1, 2, 3, 16)
    f = lambda x: posenc.apply_rotary(x, cos, sin, backend="cpu")  # noqa: E731
    with pytest.raises(ValueError, match=r"torch.func transforms .* use backend='torch'"):
        torch.func.vmap(f)(x[None])
    refused = pytest.raises(ValueError, match="forward-mode AD run on the torch path only; use backend='torch'")
    with fwAD.dual_level(), refused:
        f(fwAD.make_dual(x, torch.randn_like(x)))
    with fwAD.dual_level():  # a dual level alone, with no tangent on the inputs, is no reason to refuse
        assert_close(f(x), posenc.apply_rotary(x, cos, sin))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("rotary", [4, 8])
@pytest.mark.parametrize("learned", ["cos and sin", "cos", "sin"])
def test_learned_angles_get_gradients_through_the_in_place_rotation(dtype, rotary, learned):
    """apply_rotary_ with cos/sin that require grad: cos's gradient needs x as it was before the rotation, which
    the in-place write once overwrote (fp32 and fp64 failed in backward). Either of them alone requiring grad is
    recorded too, not written into x as a rotation with nothing to record."""
    gen = torch.Generator().manual_seed(0)
    angles = torch.rand(5, rotary // 2, generator=gen, dtype=torch.float64)
    cos, sin = (
        f(angles).float().requires_grad_(name in learned) for f, name in ((torch.cos, "cos"), (torch.sin, "sin"))
    )
    x = torch.randn(2, 3, 5, 8, generator=gen).to(dtype)
    expected_cos, expected_sin = (t.detach().clone().requires_grad_(t.requires_grad) for t in (cos, sin))
    posenc.apply_rotary(x, expected_cos, expected_sin).square().sum().backward()
    out = posenc.apply_rotary_(x.clone(), cos, sin)
    out.square().sum().backward()
    for got, expected in ((cos, expected_cos), (sin, expected_sin)):
        if expected.requires_grad:
            torch.testing.assert_close(got.grad, expected.grad)


def test_vmapped_positions_and_offsets_are_a_clear_error():
    """A vmapped index tensor cannot be checked on the host; shared ones work under vmap."""
    import torch.func as tf

    cos, sin = torch.randn(64, 4), torch.randn(64, 4)
    x = torch.randn(3, 1, 2, 5, 8)
    positions = torch.randint(0, 10, (3, 5))
    match = r"cannot be batched by torch.func.vmap: .* \(in_dims=None"
    with pytest.raises(ValueError, match="positions " + match):
        tf.vmap(lambda x, p: posenc.apply_rotary(x, cos, sin, positions=p, backend="torch"))(x, positions)
    with pytest.raises(ValueError, match="positions " + match):
        tf.vmap(lambda x, p: posenc.RoPE(8)(x, x, positions=p)[0])(x, positions)
    with pytest.raises(ValueError, match="offset " + match):
        tf.vmap(lambda x, o: posenc.apply_rotary(x, cos, sin, offset=o))(x, torch.randint(0, 3, (3, 1)))
    shared = tf.vmap(lambda x: posenc.apply_rotary(x, cos, sin, positions=positions[0]))(x)
    looped = torch.stack([posenc.apply_rotary(one, cos, sin, positions=positions[0]) for one in x])
    torch.testing.assert_close(shared, looped)
    # What reads no values takes vmapped positions: the bias encodings and the sinusoidal table.
    alibi = posenc.ALiBi(2)
    torch.testing.assert_close(
        tf.vmap(lambda p: alibi.score_bias(p, p))(positions), torch.stack([alibi.score_bias(p, p) for p in positions])
    )
    table = tf.vmap(lambda p: posenc.sinusoidal_table(p, 8))(positions)
    torch.testing.assert_close(table, torch.stack([posenc.sinusoidal_table(p, 8) for p in positions]))


def test_index_arguments_of_the_wrong_kind_name_themselves():
    q = torch.randn(1, 1, 5, 8)
    with pytest.raises(TypeError, match=r"positions must be an integer torch\.Tensor, got list"):
        posenc.RoPE(8)(q, q, positions=[0, 1, 2, 3, 4])
    with pytest.raises(TypeError, match=r"positions must be an integer torch\.Tensor, got list"):
        posenc.RoPE(8).rotate(q, [[0, 1, 2, 3, 4]])
    with pytest.raises(TypeError, match=r"positions must hold integer positions .*got dtype torch.bool$"):
        posenc.RoPE(8)(q, q, positions=torch.ones(5, dtype=torch.bool))
    cos = torch.randn(8, 4)
    with pytest.raises(TypeError, match="cu_seqlens must hold integer prefix sums"):
        posenc.apply_rotary(torch.randn(5, 1, 8), cos, cos, cu_seqlens=torch.tensor([0.0, 5.0]))


@pytest.mark.parametrize("requires_grad", [False, True])
def test_vmap_refusing_an_unbatched_inplace_rotation_is_said_as_vmaps(requires_grad):
    """x shared, cos/sin batched: vmap refuses the in-place write, which was reported as autograd refusing it."""
    x = torch.randn(2, 3, 4)
    source = x.clone().requires_grad_(requires_grad)

    def rotate(cos, sin):
        y = source.clone()
        posenc.apply_rotary_(y, cos, sin)
        return y.sum()

    before = x.clone()
    match = r"torch.func.vmap refuses the in-place rotation of x, and nothing was rotated: x is not batched"
    with pytest.raises(RuntimeError, match=match) as info:
        torch.func.vmap(rotate)(torch.randn(4, 3, 2), torch.randn(4, 3, 2))
    assert "autograd" not in str(info.value) and "apply_rotary instead" in str(info.value)
    assert torch.equal(x, before)


def _peak_bytes(fn) -> int:
    """The most bytes the CPU allocator held at once during fn(), above what it held before: every allocation and
    free, in order, from torch.profiler's memory events (exact, unlike a process's RSS)."""
    from torch.profiler import ProfilerActivity, profile

    allocation = getattr(getattr(torch._C, "_profiler", None), "_EventType", None)
    if allocation is None:
        pytest.skip("this torch's profiler has no event tree to read allocations from")
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events, stack = [], list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        node = stack.pop()
        stack += node.children
        if node.tag == allocation.Allocation:
            events.append((node.start_time_ns, node.extra_fields.alloc_size))
    live = peak = 0
    for _, size in sorted(events):
        live += size
        peak = max(peak, live)
    return peak


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("interleaved", LAYOUTS)
@pytest.mark.parametrize("rotary", [64, 48])
@pytest.mark.parametrize("call", ["copy", "copy+backward", "in place", "in place, x requiring grad"])
def test_the_torch_path_makes_its_temporaries_a_block_at_a_time(monkeypatch, dtype, interleaved, rotary, call):
    # Its float32 temporaries (a product per half; for bf16 x a float32 copy of it too) were as big as x's rotated
    # channels: a copy held 0.5x x's size above its output in float32, 3x in bf16, and in place 1.5x and 4x. Now
    # they come a block of rows at a time, ~_BLOCK_BYTES each: above what the call must hold (the output, the
    # gradient, and where x requires grad in place the rotated copy that autograd's copy_ records), about a block.
    import posenc.rope.apply as apply

    block = 32 << 10
    monkeypatch.setattr(apply, "_BLOCK_BYTES", block, raising=False)  # absent before blocks
    x = torch.randn(1, 4, 512, 64, generator=torch.Generator().manual_seed(0)).to(dtype)  # 512 KiB in float32
    cos, sin = angles(512, rotary // 2)
    grad = torch.randn_like(x)
    inplace, backward = call.startswith("in place"), call == "copy+backward"
    if call.endswith("grad"):
        x = x.requires_grad_().clone()
    elif backward:
        x.requires_grad_()
    held = x.nbytes * (call != "in place") + x.nbytes * backward

    def run():
        with torch.set_grad_enabled(x.requires_grad):
            out = (posenc.apply_rotary_ if inplace else posenc.apply_rotary)(
                x, cos, sin, interleaved=interleaved, backend="torch"
            )
            if backward:
                out.backward(grad)

    extra = _peak_bytes(run) - held
    assert extra <= 2 * block, f"{extra / x.nbytes:.2f}x x's size above what the call holds"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("interleaved", LAYOUTS)
@pytest.mark.parametrize("rotary", [64, 48])
@pytest.mark.parametrize(
    ("shape", "angle_shape"),
    [
        ((1, 3, 37, 64), (37,)),  # blocks along the sequence, the last of them a single row
        ((1, 37, 5, 64), (1, 1, 5)),  # along the heads, which cos/sin broadcast over (size 1 there)
        ((1, 37, 5, 64), (1, 37, 5)),  # along the heads, cos/sin given per head
    ],
)
def test_the_torch_path_rotates_a_block_of_rows_at_a_time_as_it_rotates_the_whole(
    monkeypatch, dtype, interleaved, rotary, shape, angle_shape
):
    """Above _BLOCK_BYTES the torch path rotates x a block of rows at a time (into a copy, straight into x in place,
    and in the conjugate of every backward): the same bits as below it, where x is rotated whole. Only the memory of
    the blocks was tested: rows cut off at a block boundary, or cos/sin taken from the wrong rows, went unnoticed."""
    import posenc.rope.apply as apply

    x = torch.randn(shape, generator=torch.Generator().manual_seed(0)).to(dtype)
    theta = torch.randn(*angle_shape, rotary // 2, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    cos, sin = (theta * 10).cos().float(), (theta * 10).sin().float()
    grad = torch.randn_like(x)

    def rotations(block: int) -> list[torch.Tensor]:
        monkeypatch.setattr(apply, "_BLOCK_BYTES", block)
        copied = posenc.apply_rotary(x, cos, sin, interleaved=interleaved, backend="torch")
        in_place = x.clone()
        with torch.no_grad():
            posenc.apply_rotary_(in_place, cos, sin, interleaved=interleaved, backend="torch")
        leaf = x.clone().requires_grad_()
        posenc.apply_rotary(leaf, cos, sin, interleaved=interleaved, backend="torch").backward(grad)
        return [copied, in_place, leaf.grad]

    whole = rotations(1 << 30)
    # 3000 bytes: ~10 blocks of 4 or 5 rows; 25000: more than the rotated channels of (1, 3, 37, 64) at r = 48
    # (21312 bytes) but less than all of x, so that x is split, into a single block.
    for block in (3000, 25000):
        blocked = rotations(block)
        for name, expected, got in zip(("copy", "in place", "backward"), whole, blocked, strict=True):
            assert torch.equal(got, expected), f"{name}, blocks of {block} bytes"
    assert_close(blocked[0], apply_rotary_torch(x.double(), cos.double(), sin.double(), interleaved=interleaved))
    if len(angle_shape) == 1:  # a single vector above the block size is rotated whole: it has no rows to split
        vector, angle = x[0, 0, 0], theta[0]
        monkeypatch.setattr(apply, "_BLOCK_BYTES", 16)
        rotated = posenc.apply_rotary(vector, angle.cos(), angle.sin(), interleaved=interleaved, backend="torch")
        monkeypatch.setattr(apply, "_BLOCK_BYTES", 1 << 30)
        expected = posenc.apply_rotary(vector, angle.cos(), angle.sin(), interleaved=interleaved, backend="torch")
        assert torch.equal(rotated, expected)
