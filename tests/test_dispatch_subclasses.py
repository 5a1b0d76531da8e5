"""The fused kernels read raw storage: tensor subclasses that run torch's operations themselves (DTensor, wrappers),
negative views, dispatch modes (make_fx, logging, selective checkpointing) and jit.trace, which see only what passes
torch's dispatcher, must get the right numbers all the same."""

import subprocess
import sys
import textwrap

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx
from torch.utils._python_dispatch import TorchDispatchMode

import posenc
from posenc.rope.apply import apply_rotary_torch


def _cos_sin(rows: int, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    inv = 1.0 / 10000.0 ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim)
    angles = torch.arange(rows, dtype=torch.float64)[:, None] * inv
    return angles.cos().float(), angles.sin().float()


# In a process of its own: the CPU kernel read and wrote through the data pointer of a wrapper subclass (which has no
# storage of its own) and of a DTensor: a segmentation fault, with "auto" as with "cpu".
SUBCLASSES = textwrap.dedent(
    """
    import torch, torch.distributed as dist, posenc
    from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
    from torch.distributed.device_mesh import init_device_mesh
    from torch.utils._pytree import tree_map

    class Wrapped(torch.Tensor):  # the smallest wrapper subclass: every op runs on the wrapped tensor
        @staticmethod
        def __new__(cls, inner):
            return torch.Tensor._make_wrapper_subclass(cls, inner.shape, dtype=inner.dtype, strides=inner.stride())

        def __init__(self, inner):
            self.inner = inner

        @classmethod
        def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
            unwrap = lambda t: t.inner if isinstance(t, Wrapped) else t
            out = func(*tree_map(unwrap, args), **tree_map(unwrap, kwargs or {}))
            return tree_map(lambda t: Wrapped(t) if type(t) is torch.Tensor else t, out)

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    mesh = init_device_mesh("cpu", (1,))
    torch.manual_seed(0)
    x = torch.randn(2, 3, 5, 8)
    angles = torch.arange(16.0)[:, None] * 10000.0 ** (-torch.arange(0, 8, 2) / 8)
    cos, sin = angles.cos(), angles.sin()
    want = posenc.apply_rotary(x, cos[:5], sin[:5], backend="torch")
    dcos, dsin = (distribute_tensor(t[:5], mesh, [Replicate()]) for t in (cos, sin))
    cases = {
        "wrapped": (lambda: Wrapped(x.clone()), cos[:5], sin[:5], lambda out: out.inner),
        "wrapped cos": (lambda: x.clone(), Wrapped(cos[:5]), Wrapped(sin[:5]), lambda out: out),
        "dtensor": (lambda: distribute_tensor(x.clone(), mesh, [Shard(2)]), dcos, dsin, DTensor.full_tensor),
    }
    for name, (make, c, s, plain) in cases.items():
        for rotate in (posenc.apply_rotary, posenc.apply_rotary_):
            got = plain(rotate(make(), c, s))
            assert torch.allclose(got, want, atol=1e-6), (name, rotate.__name__, (got - want).abs().max())
            try:
                rotate(make(), c, s, backend="cpu")
            except ValueError as error:
                assert "tensor subclass" in str(error) and "backend='torch'" in str(error), str(error)
            else:
                raise AssertionError(f"{name}: backend='cpu' took a tensor subclass")
        leaf = make().requires_grad_(True) if name != "wrapped cos" else x.clone().requires_grad_(True)
        posenc.apply_rotary(leaf, c, s).square().sum().backward()
        assert torch.allclose(plain(leaf.grad), 2 * x, atol=1e-5), name
    dist.destroy_process_group()
    print("ok")
    """
)


def test_subclasses_that_run_their_own_ops_take_the_torch_path():
    done = subprocess.run([sys.executable, "-c", SUBCLASSES], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.strip() == "ok", (done.returncode, done.stderr[-2000:])


@pytest.mark.parametrize("inplace", [False, True], ids=["copy", "in_place"])
@pytest.mark.parametrize("negated", ["x", "cos"])
def test_negative_views_are_rotated_with_their_sign(negated, inplace):
    # The negative bit marks a view whose storage holds -x (torch._neg_view, z.conj().imag): the CPU kernel read the
    # storage, and a copy came out rotated with the wrong sign, without an error.
    x, (cos, sin) = torch.randn(2, 3, 5, 8), _cos_sin(5, 8)
    want = apply_rotary_torch(x, cos, sin)
    if negated == "x":
        x_in, cos_in, want = torch.ops.aten._neg_view(x.clone()), cos, -want
    else:
        x_in, cos_in = x.clone(), torch.ops.aten._neg_view(-cos)
    assert (x_in if negated == "x" else cos_in).is_neg()
    rotate = posenc.apply_rotary_ if inplace else posenc.apply_rotary
    torch.testing.assert_close(rotate(x_in, cos_in, sin), want)
    with pytest.raises(ValueError, match=r"negative view .*resolve_neg"):
        rotate(x.clone() if negated == "cos" else torch.ops.aten._neg_view(x.clone()), cos_in, sin, backend="cpu")


@pytest.mark.parametrize("backend", ["torch", "cpu", "triton"])
@pytest.mark.parametrize("negated", ["positions", "offset", "decode offset", "cu_seqlens"])
def test_negative_views_of_ids_offsets_and_cu_seqlens_are_read_by_value(negated, backend):
    """An index tensor with the negative bit holds -values in storage, which torch's own indexing (cos[ids]) and the
    kernels read: the torch path and Triton rotated by the wrong rows (max error 4.1) or NaN rows (Triton), or the
    wrong sequences' rows (Triton, cu_seqlens), without an error; the CPU kernel refused ids 0..9 as "outside the
    table"."""
    cos, sin = _cos_sin(40, 8)
    x, packed = torch.randn(2, 2, 5, 8), torch.randn(9, 2, 8)
    values = {
        "positions": torch.tensor([[4, 0, 2, 1, 3], [7, 6, 5, 9, 8]]),
        "offset": torch.tensor([3, 11]),
        "decode offset": torch.tensor([3, 11]),
        "cu_seqlens": torch.tensor([0, 3, 3, 7, 9]),
    }[negated]
    given = torch.ops.aten._neg_view(-values)
    assert given.is_neg() and torch.equal(given, values)
    target = {"cu_seqlens": packed, "decode offset": x[:, :, :1]}.get(negated, x)
    key = negated.split()[-1]
    want = posenc.apply_rotary(target, cos, sin, backend="torch", **{key: values})
    for rotate in (posenc.apply_rotary, posenc.apply_rotary_):
        got = rotate(target.clone(), cos, sin, backend=backend, **{key: given})
        torch.testing.assert_close(got, want, msg=rotate.__name__)


def test_rope_cos_sin_of_a_negative_view_of_ids_reads_their_rows():
    """RoPE.cos_sin gathered its table at a negative view's storage (-ids, rows from the end): max error 1.8."""
    rope, ids = posenc.RoPE(8), torch.tensor([[4, 0, 2], [7, 6, 5]])
    got, want = rope.cos_sin(torch.ops.aten._neg_view(-ids)), rope.cos_sin(ids)
    torch.testing.assert_close(got, want, rtol=0, atol=0)


@pytest.mark.parametrize("negated", ["positions", "decode offset"])
def test_negative_views_of_ids_are_read_by_value_under_torch_compile(negated):
    """Traced, index_values skipped the negative bit (Dynamo cannot ask is_neg()), and the backends eager and
    aot_eager run the torch path's cos[ids] as eager does, at the storage: max error 7.8 (positions) and 2.7 (a
    decode step's offsets, a view of them), without an error. fullgraph: the fix must add no graph break."""
    cos, sin = _cos_sin(40, 8)
    x = torch.randn(2, 2, 5, 8)
    if negated == "positions":
        values, key = torch.tensor([[4, 0, 2, 1, 3], [7, 6, 5, 9, 8]]), "positions"
    else:
        values, key, x = torch.tensor([3, 11]), "offset", x[:, :, :1]
    want = posenc.apply_rotary(x, cos, sin, backend="torch", **{key: values})
    torch._dynamo.reset()
    rotate = torch.compile(
        lambda ids: posenc.apply_rotary(x, cos, sin, backend="torch", **{key: ids}), backend="aot_eager", fullgraph=True
    )
    torch.testing.assert_close(rotate(torch.ops.aten._neg_view(-values)), want)


@pytest.mark.parametrize("zero", ["q", "k", "cos", "sin"])
def test_zero_tensors_take_the_torch_path(zero):
    """A ZeroTensor (torch's zeros with no storage, made by some derivative formulas and forward-mode AD) has a data
    pointer of 0, which the CPU kernel read: the process died (SIGSEGV), with "auto" as with "cpu"."""
    q, k = torch.randn(1, 4, 5, 8), torch.randn(1, 2, 5, 8)
    cos, sin = _cos_sin(5, 8)
    given = {"q": q, "k": k, "cos": cos, "sin": sin}
    want = posenc.apply_rotary_qk(
        *(torch.zeros_like(t) if name == zero else t for name, t in given.items()), backend="torch"
    )
    given[zero] = torch._efficientzerotensor(given[zero].shape, dtype=given[zero].dtype)
    assert given[zero]._is_zerotensor()
    for out, expected in zip(posenc.apply_rotary_qk(*given.values()), want, strict=True):
        torch.testing.assert_close(out, expected, rtol=0, atol=0)
    if zero in ("cos", "sin"):
        # In place (a ZeroTensor cannot be written: only the angles can be one).
        x = q.clone()
        posenc.apply_rotary_(x, given["cos"], given["sin"])
        torch.testing.assert_close(x, want[0], rtol=0, atol=0)
    if zero in ("q", "k"):
        # RoPE's own table read from an int offset, twice (the second call may replay a plain call's plan); the
        # whole call takes the torch path, whose rounding the expected values have.
        rope, reference = posenc.RoPE(8), posenc.RoPE(8, backend="torch")
        zeros = {name: torch.zeros_like(given[name]) if name == zero else given[name] for name in "qk"}
        for _ in range(2):
            rope(q, k, offset=3)  # a plain call's plan first
            expected = reference(zeros["q"], zeros["k"], offset=3)
            for out, plain in zip(rope(given["q"], given["k"], offset=3), expected, strict=True):
                torch.testing.assert_close(out, plain, rtol=0, atol=0)
    with pytest.raises(
        ValueError, match=rf": {zero} is a ZeroTensor \(torch's zeros with no storage\), which {zero}\.clone"
    ):
        posenc.apply_rotary_qk(*given.values(), backend="cpu")


def _grad_of_x(entry, backend, x0, cos, sin, grad_output):
    """The gradient of x0 (1, 4, 5, 8) through ``entry`` (rotated from offset 2 by the table cos/sin, or by RoPE(8)
    beside a k of x0's dtype) on ``backend``, given ``grad_output``."""
    x = x0.clone().requires_grad_()
    if entry == "apply_rotary":
        y = posenc.apply_rotary(x, cos, sin, offset=2, backend=backend)
    elif entry == "apply_rotary_":
        y = posenc.apply_rotary_(x * 1, cos, sin, offset=2, backend=backend)
    else:
        y, _ = posenc.RoPE(8, backend=backend)(x, torch.randn(1, 2, 5, 8, dtype=x0.dtype), offset=2)
    (got,) = torch.autograd.grad(y, x, grad_output)
    return got


@pytest.mark.parametrize("backend", ["auto", "cpu", "triton"])
@pytest.mark.parametrize("entry", ["apply_rotary", "apply_rotary_", "RoPE"])
@pytest.mark.parametrize("kind", ["ZeroTensor", "TwoTensor", "negative view", "sparse"])
def test_unusual_incoming_gradients_are_rotated_by_value(kind, entry, backend):
    """The backward's incoming gradients never passed the forward's checks: a ZeroTensor or a __torch_dispatch__
    wrapper as the gradient killed the process in the CPU kernel (SIGSEGV), and a negative view came back with its
    sign flipped (max error 8). They get the torch path's formula, as batched gradients do. A sparse one (which
    torch's own ops take) stopped every backward with torch's bare "unsupported memory format option" or "Cannot
    access storage of SparseTensorImpl": its dense values are rotated."""
    from torch.testing._internal.two_tensor import TwoTensor

    cos, sin = _cos_sin(16, 8)
    x0, w = torch.randn(1, 4, 5, 8), torch.randn(1, 4, 5, 8)
    given = {
        "ZeroTensor": torch._efficientzerotensor(w.shape, dtype=w.dtype),
        "TwoTensor": TwoTensor(w, w.clone()),
        "negative view": torch._neg_view(-w),
        "sparse": w.to_sparse(),
    }[kind]
    want = _grad_of_x(entry, "torch", x0, cos, sin, torch.zeros_like(w) if kind == "ZeroTensor" else w)
    got = _grad_of_x(entry, backend, x0, cos, sin, given)
    for part in (got.a, got.b) if kind == "TwoTensor" else (got,):
        torch.testing.assert_close(part, want)


@pytest.mark.parametrize("entry", ["apply_rotary", "RoPE"])
def test_a_sparse_incoming_gradient_on_the_torch_path_is_rotated_by_value(entry):
    """The torch path's backward (its autograd.Function) stopped on a sparse gradient with torch's bare "Cannot
    access storage of SparseTensorImpl"; it rotates the dense values. (In place, the torch path's slice copy_ is
    torch's own CopySlices, whose backward refuses a sparse gradient as it does for any x[..., :r].copy_().)"""
    cos, sin = (t.double() for t in _cos_sin(16, 8))
    x0, w = torch.randn(1, 4, 5, 8, dtype=torch.float64), torch.randn(1, 4, 5, 8, dtype=torch.float64)
    w[:, :, 1:3] = 0  # some rows of zeros, as a sparse gradient has
    got = _grad_of_x(entry, "torch", x0, cos, sin, w.to_sparse())
    torch.testing.assert_close(got, _grad_of_x(entry, "torch", x0, cos, sin, w), rtol=0, atol=0)


@pytest.mark.parametrize("backend", ["torch", "auto", "cpu"])
@pytest.mark.parametrize("given", ["positions", "offsets", "RoPE positions", "RoPE offsets"])
def test_zero_tensor_ids_are_read_as_zeros(given, backend):
    """int64 position ids or offsets as a ZeroTensor (no storage, data pointer 0): the CPU kernel read no ids and
    rotated by rows 0, 1, 2, ... (max error 5.2), and torch's own table[ids] on the torch path crashed (SIGSEGV)."""
    q, k = torch.randn(1, 4, 5, 8), torch.randn(1, 2, 5, 8)
    cos, sin = _cos_sin(16, 8)
    shape = (1, 5) if given.endswith("positions") else (1,)
    name = "positions" if given.endswith("positions") else "offset"

    def rotate(ids):
        if given.startswith("RoPE"):
            return posenc.RoPE(8, backend=backend)(q, k, **{name: ids})
        return posenc.apply_rotary_qk(q, k, cos, sin, backend=backend, **{name: ids})

    zero = torch._efficientzerotensor(shape, dtype=torch.long)
    assert zero._is_zerotensor()
    for got, want in zip(rotate(zero), rotate(torch.zeros(shape, dtype=torch.long)), strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_a_refused_negative_view_is_named_as_the_caller_named_it():
    """apply_rotary_qk's refusal named k "xs[1]" (and its fix "xs[1].resolve_neg()"), a name the caller never used."""
    q, k = torch.randn(1, 4, 5, 8), torch.randn(1, 2, 5, 8)
    cos, sin = _cos_sin(5, 8)
    with pytest.raises(ValueError, match=r": k is a negative view \(its storage holds -k\), which k\.resolve_neg\(\)"):
        posenc.apply_rotary_qk(q, torch.ops.aten._neg_view(k), cos, sin, backend="cpu")
    with pytest.raises(
        ValueError, match=r": cos is a negative view \(its storage holds -cos\), which cos\.resolve_neg"
    ):
        posenc.apply_rotary_qk(q, k, torch.ops.aten._neg_view(-cos), sin, backend="cpu")
    with pytest.raises(
        ValueError, match=r": sin is a negative view \(its storage holds -sin\), which sin\.resolve_neg"
    ):
        posenc.apply_rotary(q, cos, torch.ops.aten._neg_view(-sin), backend="cpu")


def test_a_parameter_is_rotated_by_the_fused_kernels():
    """nn.Parameter is a subclass with __torch_function__ alone: its storage holds its values, so the fused kernels
    take it, an explicit fused backend too (only subclasses that run torch's operations themselves are refused)."""
    x, (cos, sin) = torch.randn(2, 3, 5, 8), _cos_sin(5, 8)
    weight = torch.nn.Parameter(x.clone())
    cos_p, sin_p = (torch.nn.Parameter(t, requires_grad=False) for t in (cos, sin))
    got = posenc.apply_rotary(weight, cos_p, sin_p, backend="cpu")
    torch.testing.assert_close(got, apply_rotary_torch(x, cos, sin))
    got.square().sum().backward()
    torch.testing.assert_close(weight.grad, 2 * x)


class _Recording(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


# Any category: torch.jit.trace's deprecation is a DeprecationWarning on torch 2.13, a FutureWarning on 2.15.
@pytest.mark.filterwarnings("ignore:`torch.jit.trace` is deprecated")
@pytest.mark.parametrize("backend", ["auto", "cpu"])
def test_make_fx_and_jit_trace_record_the_fused_rotation(backend):
    # A direct launch is missed by a dispatch mode and by the tracer: make_fx's graph and jit.trace's returned the
    # uninitialized output of empty_like, and an in-place call's graph returned x unrotated.
    table = _cos_sin(16, 8)

    def rotated(x):
        return posenc.apply_rotary(x, *table, offset=3, backend=backend)

    def rotated_in_place(x):
        x = x.clone()
        posenc.apply_rotary_(x, *table, offset=3, backend=backend)
        return x

    def rotated_in_place_with_grad(x):
        x = x * 1  # a gradient wanted: the in-place call goes through the copy op and copy_
        posenc.apply_rotary_(x, *table, offset=3, backend=backend)
        return x

    example, x = torch.randn(2, 3, 5, 8), torch.randn(2, 3, 5, 8)
    want = apply_rotary_torch(x, table[0][3:8], table[1][3:8])
    for fn in (rotated, rotated_in_place):
        torch.testing.assert_close(make_fx(fn)(example)(x), want)
    traced = make_fx(rotated_in_place_with_grad)(example.clone().requires_grad_(True))
    torch.testing.assert_close(traced(x), want)
    if backend == "cpu":  # a trace holds no fused kernel (tests/test_jit_and_onnx.py): refused, naming the fix
        with pytest.raises(ValueError, match=r"torch\.jit\.trace records no call of the fused kernels.*'torch'"):
            torch.jit.trace(rotated, (example,))
        return
    with pytest.warns(torch.jit.TracerWarning):  # posenc's checks read sizes, which the tracer fixes as constants
        traced = torch.jit.trace(rotated, (example,))
    torch.testing.assert_close(traced(x), want)


@pytest.mark.parametrize("backend", ["auto", "cpu"])
def test_a_dispatch_mode_sees_the_rotation_and_gradients_stay_right(backend):
    x, (cos, sin) = torch.randn(2, 3, 5, 8), _cos_sin(5, 8)
    leaf = x.clone().requires_grad_(True)
    with _Recording() as mode:
        out = posenc.apply_rotary(leaf, cos, sin, backend=backend)
        moved = leaf * 1
        posenc.apply_rotary_(moved, cos, sin, backend=backend)
        (out.square().sum() + moved.square().sum()).backward()
    assert "posenc.rotary.default" in mode.ops, mode.ops
    torch.testing.assert_close(out, apply_rotary_torch(x, cos, sin))
    torch.testing.assert_close(moved, apply_rotary_torch(x, cos, sin))
    torch.testing.assert_close(leaf.grad, 4 * x)


@pytest.mark.parametrize("given", ["positions", "offset", "cu_seqlens", "RoPE", "RoPE.cos_sin", "LearnedAbsolute"])
def test_a_wrapper_subclass_as_ids_is_refused_naming_the_argument(given):
    """Position ids, offsets or cu_seqlens given as a __torch_dispatch__ wrapper (here torch's TwoTensor) failed deep
    inside the range checks with torch's ".tolist() is not supported for tensor subclasses"; they are refused at the
    call, naming the argument and a plain tensor."""
    from torch.testing._internal.two_tensor import TwoTensor

    def wrapped(t):
        return TwoTensor(t, t.clone())

    cos, sin = _cos_sin(10, 8)
    x, ids = torch.randn(1, 2, 3, 8), torch.tensor([3, 4, 5])
    calls = {
        "positions": ("positions", lambda: posenc.apply_rotary(x, cos, sin, positions=wrapped(ids))),
        "offset": ("offset", lambda: posenc.apply_rotary(x, cos, sin, offset=wrapped(torch.tensor([2])))),
        "cu_seqlens": (
            "cu_seqlens",
            lambda: posenc.apply_rotary(torch.randn(3, 2, 8), cos, sin, cu_seqlens=wrapped(torch.tensor([0, 3]))),
        ),
        "RoPE": ("positions", lambda: posenc.RoPE(8)(x, x, positions=wrapped(ids))),
        "RoPE.cos_sin": ("positions", lambda: posenc.RoPE(8).cos_sin(wrapped(ids))),
        "LearnedAbsolute": ("positions", lambda: posenc.LearnedAbsolute(16, 8)(wrapped(ids))),
    }
    name, call = calls[given]
    with pytest.raises(TypeError, match=rf"^{name} is a TwoTensor, a tensor subclass .* pass {name} as a plain"):
        call()


@pytest.mark.parametrize("given", ["positions", "offset", "cu_seqlens", "RoPE.cos_sin"])
def test_ids_traced_by_aot_function_are_not_refused_as_wrapper_subclasses(given):
    """functorch.compile's aot_function traces under a FakeTensorMode, handing plain ids in as FunctionalTensors
    (wrapper subclasses, with no values to check): they were refused as "a tensor subclass ... pass positions as a
    plain integer tensor", though the caller had, and rotated before that refusal was added."""
    from functorch.compile import aot_function, nop

    cos, sin = _cos_sin(10, 8)
    x, packed = torch.randn(1, 2, 3, 8), torch.randn(3, 2, 8)
    ids, rope = torch.tensor([3, 4, 5]), posenc.RoPE(8)
    calls = {  # cos/sin as arguments: aot_function refuses real tensors closed over
        "positions": (lambda x, c, s, i: posenc.apply_rotary(x, c, s, positions=i), (x, cos, sin, ids)),
        "offset": (lambda x, c, s, o: posenc.apply_rotary(x, c, s, offset=o), (x, cos, sin, torch.tensor([2]))),
        "cu_seqlens": (
            lambda x, c, s, cu: posenc.apply_rotary(x, c, s, cu_seqlens=cu),
            (packed, cos, sin, torch.tensor([0, 1, 3])),
        ),
        "RoPE.cos_sin": (lambda i: rope.cos_sin(i)[0], (ids,)),
    }
    fn, args = calls[given]
    torch.testing.assert_close(aot_function(fn, fw_compiler=nop)(*args), fn(*args))


def test_a_wrapper_subclass_is_taken_where_no_value_is_read_on_the_host():
    """Only calls that check ids' values on the host refuse a __torch_dispatch__ wrapper: the document-id helpers run
    torch's operations on it, which the wrapper serves, and return one."""
    from torch.testing._internal.two_tensor import TwoTensor

    docs, positions = torch.tensor([[0, 0, 1, 1, 1, 2]]), torch.tensor([[0, 1, 0, 1, 2, 0]])
    got = posenc.positions_from_document_ids(TwoTensor(docs, docs.clone()))
    assert type(got) is TwoTensor and torch.equal(got.a, positions) and torch.equal(got.b, positions)
    got = posenc.document_ids_from_positions(TwoTensor(positions, positions.clone()))
    assert type(got) is TwoTensor and torch.equal(got.a, docs) and torch.equal(got.b, docs)


def test_wrapper_subclass_ids_are_taken_under_torch_compile():
    """Compiled, the checks read no values, so a wrapper subclass as position ids is not refused (eager refuses it,
    above): Dynamo traces through the wrapper, and the rotation equals the one by the plain ids."""
    from torch.testing._internal.two_tensor import TwoTensor

    cos, sin = _cos_sin(10, 8)
    x, ids = torch.randn(1, 2, 3, 8), torch.tensor([2, 0, 1])
    rotate = lambda x, c, s, i: posenc.apply_rotary(x, c, s, positions=i)  # noqa: E731
    got = torch.compile(rotate, backend="aot_eager", fullgraph=True)(x, cos, sin, TwoTensor(ids, ids.clone()))
    torch.testing.assert_close(got, rotate(x, cos, sin, ids), rtol=0, atol=0)
