"""Apply a rotation given cos/sin: the pure-torch path (both pair layouts, partial rotation) and the public
entry points that route to the fused kernels of ``posenc.kernels``.

Shape key: b batch, h heads, s sequence, d head dim, r rotary dim (even, <= d).
``cos``/``sin`` hold one value per pair, (..., r/2), and are float32 (or float64) whatever ``x`` is: the
rotation is done in the wider of the two dtypes and cast back to ``x.dtype`` once.
"""

from __future__ import annotations

from typing import Literal

import torch
from torch._subclasses.fake_tensor import FakeTensor

from posenc._checks import (
    angle_dtypes,
    assert_without_sync,
    compiling,
    first_dtensor,
    flag,
    float_tensor,
    index_values,
    inplace_refused,
    integer_offset,
    is_dtensor,
    may_overlap,
    replicated_like,
    replicated_values,
    same_device,
    size_in,
    values_readable,
)
from posenc.kernels.backend import batched, choose_backend, dense_gradient
from posenc.kernels.huge_pages import advised
from posenc.kernels.layout import check_table_call, consecutive_rows, hf_cos_hint, rotary_kind, token_positions
from posenc.kernels.ops import rotary_copy, rotary_inplace
from posenc.kernels.recording import recording_launches
from posenc.kernels.replay import Plans, plain_eager, plan_of, replay, rows_read, tensor_key

Backend = Literal["auto", "torch", "triton", "cpu"]


def check_cos_sin(cos: torch.Tensor, sin: torch.Tensor) -> int:
    """Validate cos and sin (once per call, for q and k alike) and return r/2; errors name the argument."""
    angle_dtypes(cos, sin)
    same_device(("cos", "sin"), cos, sin)
    if cos.shape != sin.shape:
        raise ValueError(f"cos and sin must have the same shape, got {tuple(cos.shape)} and {tuple(sin.shape)}")
    if cos.dim() == 0 or cos.shape[-1] == 0:
        raise ValueError(
            f"cos must have a last dimension of r/2 >= 1 (one value per rotated pair), got shape {tuple(cos.shape)}"
        )
    return cos.shape[-1]


def check_x_for(x: torch.Tensor, cos: torch.Tensor, half: int, name: str = "x") -> None:
    """Validate x (called ``name`` in errors) against checked cos/sin: dtype, device, channels for r/2 pairs, and
    cos broadcasting to its rows."""
    float_tensor(name, x)
    same_device((name, "cos"), x, cos)
    if x.dim() == 0:
        raise ValueError(f"{name} must have a last dimension of channels (..., d), got a scalar")
    if half == 0 or 2 * half > x.shape[-1]:
        raise ValueError(
            f"cos.shape[-1]={half} pairs needs 2*{half}={2 * half} channels but {name}.shape[-1]={x.shape[-1]}; "
            f"cos/sin hold one value per pair, (..., rotary_dim // 2){hf_cos_hint(half, x.shape[-1])}"
        )
    target = (*x.shape[:-1], half)
    # By hand: torch.broadcast_shapes was 40% of a small call's Python overhead.
    broadcasts = cos.dim() <= len(target) and all(
        size_in(size, (1, want)) for size, want in zip(reversed(cos.shape), reversed(target), strict=False)
    )
    if not broadcasts:
        raise ValueError(
            f"cos/sin of shape {tuple(cos.shape)} do not broadcast to {name}.shape[:-1] + (r/2,) = {target}; "
            f"for {name} in (b, h, s, d) pass cos of shape (s, r/2), (b, 1, s, r/2) or (1, 1, s, r/2); for {name} in "
            "(b, s, h, d), as flash-attention lays it out, pass cos[:, None] (s, 1, r/2), or the whole table "
            "with offset= or positions= and layout='bshd'"
        )


def compute_dtype(x: torch.Tensor, cos: torch.Tensor) -> torch.dtype:
    """float64 if either side is float64, else float32: bf16/fp16 never do the rotation in their own dtype."""
    return torch.float64 if torch.float64 in (x.dtype, cos.dtype) else torch.float32


def _pair_views(t: torch.Tensor, interleaved: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The first and second members of each pair of t (..., r), as views (..., r/2)."""
    if interleaved:
        return t[..., 0::2], t[..., 1::2]
    half = t.shape[-1] // 2
    return t[..., :half], t[..., half:]


def rotate_pairs(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *, interleaved: bool, conjugate: bool = False
) -> torch.Tensor:
    """Rotate all channels of ``x`` (..., r) pairwise; no validation, no dtype handling.

    split-half pairs channel i with i + r/2 (Llama's ``rotate_half``); interleaved pairs 2i with 2i + 1
    (RoFormer, GPT-J). ``conjugate`` rotates by -angle: the inverse, and the backward of the forward.
    """
    if conjugate:
        sin = -sin
    x1, x2 = _pair_views(x, interleaved)
    o1, o2 = x1 * cos - x2 * sin, x2 * cos + x1 * sin
    return torch.stack((o1, o2), dim=-1).flatten(-2) if interleaved else torch.cat((o1, o2), dim=-1)


def rotate_pairs_into(
    out: torch.Tensor, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *, interleaved: bool, conjugate: bool
) -> None:
    """``out[...] = rotate_pairs(x, cos, sin)`` for out (..., r) of any float dtype, not overlapping x.

    Two products and two fused multiply-adds, each result rounded once into out's dtype: four passes over half of
    x where ``rotate_pairs`` and a cast back make eight and a concatenation (2x faster on the CPU in float32).
    """
    # The conjugate flips the sign of the products with sin, not sin itself: the same bits (a sign flip of a factor
    # is exact) without a negated copy of sin, as big as x where cos/sin are given per token and head.
    sign = 1 if conjugate else -1
    x1, x2 = _pair_views(x, interleaved)
    o1, o2 = _pair_views(out, interleaved)
    if out.dtype == x.dtype:
        torch.addcmul(x1 * cos, x2, sin, value=sign, out=o1)
        torch.addcmul(x2 * cos, x1, sin, value=-sign, out=o2)
        return
    # A narrower out (bf16 x rotated in float32): addcmul(out=) would compute into a row-major temporary of x's
    # dtype and then cast it into out, a transposing copy where out is a transposed view (Hugging Face's q, (b, s, h,
    # d) memory seen as (b, h, s, d)): 2x the time of the same write into a contiguous out. The product's own
    # buffer, laid out like x, takes the sum in place and is cast once; the same ops, so the same bits.
    for o, first, second, value in ((o1, x1, x2, sign), (o2, x2, x1, -sign)):
        product = first * cos
        o.copy_(torch.addcmul(product, second, sin, value=value, out=product))
        del product  # before the next one is made: one product at a time


# The out= formula's temporaries (a product per half, and for 16-bit x its float32 copy) are made a block of rows at
# a time: whole, they were 0.5x x's size in float32 and 3x in bf16 (its float32 copy and a float32 product), on top
# of the output. About this many bytes of float32 rows a block: a few blocks' Python (~30 us each) is under 1% of a
# call this big, and the temporaries stay in cache and are served again by malloc instead of fresh pages.
_BLOCK_BYTES = 4 << 20


def _block_rows(x: torch.Tensor, rotary: int, wide: torch.dtype) -> tuple[int, int]:
    """(dim, rows) to split x (..., d) along, so that r channels of a block in ``wide`` take about _BLOCK_BYTES; (0,
    0) where x fits in one block. The dim is x's longest but the last (the sequence, for q and k)."""
    size = x.numel() * wide.itemsize
    if size <= _BLOCK_BYTES or x.dim() < 2:  # all of x, to be quick where it is small (a decode step)
        return 0, 0
    size = size // x.shape[-1] * rotary
    dim = max(range(x.dim() - 1), key=lambda i: x.shape[i])
    blocks = min(x.shape[dim], -(-size // _BLOCK_BYTES))
    return dim, -(-x.shape[dim] // blocks)


def _block_of(t: torch.Tensor, ndim: int, dim: int, start: int, length: int) -> torch.Tensor:
    """Rows start..start+length along dim of an x with ndim dims, of t (x itself, or cos/sin broadcastable to it)."""
    own = dim - (ndim - t.dim())
    return t if own < 0 or t.shape[own] == 1 else t.narrow(own, start, length)


def _rotate_blocks(
    out: torch.Tensor,
    x: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    interleaved: bool,
    conjugate: bool,
    dim: int,
    rows: int,
    in_place: bool,
) -> None:
    """``out[..., :r] = rotate_pairs(x[..., :r])`` rows blocks along dim at a time (``_block_rows``); with
    ``in_place`` out is x (each block of x is copied before it is written). cos/sin already in the wide dtype."""
    rotary, ndim, size = 2 * cos.shape[-1], x.dim(), x.shape[dim]
    for start in range(0, size, rows):
        out_block, x_block, cos_block, sin_block = (
            _block_of(t, ndim, dim, start, min(rows, size - start)) for t in (out, x, cos, sin)
        )
        # The source inline, not in a variable, so that it is freed before the next block's is made.
        rotate_pairs_into(
            out_block[..., :rotary],
            x_block[..., :rotary].to(cos.dtype, copy=in_place),
            cos_block,
            sin_block,
            interleaved=interleaved,
            conjugate=conjugate,
        )


def _rotate_copy(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool, conjugate: bool):
    """x (..., d) rotated on its first r channels into a new tensor of x's dtype; cos/sin already in the wide dtype."""
    rotary = 2 * cos.shape[-1]
    out = advised(torch.empty_like(x))  # written whole below
    dim, rows = _block_rows(x, rotary, cos.dtype)
    if rows:
        _rotate_blocks(out, x, cos, sin, interleaved, conjugate, dim, rows, in_place=False)
    else:  # whole (a decode step): no blocks' bookkeeping, ~1 us of a ~25 us call
        source = x[..., :rotary].to(cos.dtype)
        rotate_pairs_into(out[..., :rotary], source, cos, sin, interleaved=interleaved, conjugate=conjugate)
    if rotary < x.shape[-1]:
        out[..., rotary:] = x[..., rotary:]
    return out


class _RotateCopy(torch.autograd.Function):
    """``_rotate_copy`` with its gradient: the backward of a rotation is the conjugate rotation (cos/sin constant)."""

    # forward(ctx, ...), not forward + setup_context: for a Function with setup_context, torch's apply binds the
    # arguments with inspect.signature on every call, ~30 us, which was most of a decode step's torch path (q and k:
    # two calls). setup_context serves torch.func transforms only, and those take the plain formula
    # (apply_rotary_torch), never this Function.
    @staticmethod
    def forward(ctx, x, cos, sin, interleaved, conjugate):  # type: ignore[override]
        ctx.interleaved, ctx.conjugate = interleaved, conjugate
        ctx.save_for_backward(cos, sin)
        return _rotate_copy(x, cos, sin, interleaved, conjugate)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        cos, sin = ctx.saved_tensors
        grad = dense_gradient(grad)
        # Through apply again (apply_rotary_torch takes it), so that a double backward (create_graph=True) is a
        # rotation too; batched gradients (jacobian(vectorize=True)) take the plain formula, which vmap batches.
        grad = apply_rotary_torch(grad, cos, sin, interleaved=ctx.interleaved, conjugate=not ctx.conjugate)
        return grad, None, None, None, None


def _recorded() -> bool:
    """Whether this call is being traced into a graph (torch.compile, torch.export, torch.jit.trace), where the torch
    path's out= writes into slices are not taken: Inductor does not fuse them, and the TorchScript-based ONNX exporter
    dropped them (its model returned the empty output's memory, or x unrotated in place, ~4 off, without an error)."""
    return compiling() or torch.jit.is_tracing()


def apply_rotary_torch(
    x: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    *,
    interleaved: bool = False,
    conjugate: bool = False,
) -> torch.Tensor:
    """Pure-torch rotation, differentiable, any float dtype. Validates nothing (see ``check_cos_sin`` and
    ``check_x_for``).

    x: (..., d); cos, sin: broadcastable to (..., r/2). Returns x's shape and dtype; channels r.. are copied.
    """
    rotary = 2 * cos.shape[-1]
    wide = compute_dtype(x, cos)
    cos, sin = cos.to(wide), sin.to(wide)
    if not (cos.requires_grad or sin.requires_grad or _recorded() or batched(x, cos, sin) or is_dtensor(x)):
        # out= writes can be differentiated by no autograd mode, batched by no vmap, nor fused by Inductor: the
        # rotation's own backward serves x; the plain formula below serves learned angles, compiled graphs,
        # torch.func transforms and forward-mode AD. And DTensors: writes into slices of a DTensor sharded on its
        # channels (k of tensor parallelism with fewer key heads than ranks) were lost (max error 5e35, from
        # uninitialised memory), and DTensor's out= rules failed on a shard that holds nothing.
        return _RotateCopy.apply(x, cos, sin, interleaved, conjugate)
    if rotary == x.shape[-1]:
        # No slice of the whole: autograd's own vmap (jacobian(vectorize=True)) has no batching rule for the alias.
        return rotate_pairs(x.to(wide), cos, sin, interleaved=interleaved, conjugate=conjugate).to(x.dtype)
    rotated = rotate_pairs(x[..., :rotary].to(wide), cos, sin, interleaved=interleaved, conjugate=conjugate).to(x.dtype)
    return torch.cat((rotated, x[..., rotary:]), dim=-1)


def _refuse_shared_memory(name: str, x: torch.Tensor) -> None:
    """Raise where rotating x in place would rotate some element twice or mix two of them."""
    strides = zip(x.shape, x.stride(), strict=True)
    shared = [dim for dim, (size, step) in enumerate(strides) if size > 1 and not step]
    if shared:
        raise ValueError(
            f"{name} repeats its memory along dim {shared[0]} (stride 0: an expanded view), so rotating it in place "
            f"would rotate those elements more than once; rotate a copy ({name}.clone()) or use apply_rotary"
        )
    # Dynamo cannot sort symbolic strides: traced calls go without this test (the expanded one above stays).
    if not compiling() and may_overlap(x):
        raise ValueError(
            f"{name} has shape {tuple(x.shape)} and strides {x.stride()}, so some of its elements may share memory (an "
            f"unfold or as_strided view; posenc's test cannot rule it out for these strides) and rotating it in place "
            f"would mix them; rotate a copy ({name}.clone()) or use apply_rotary"
        )


def _storage_span(t: torch.Tensor) -> tuple[int, int] | None:
    """The bytes [start, end) of t's storage, or None where it has none of its own (a wrapper subclass: DTensor,
    FakeTensor; a functorch-batched or functional tensor) or none at all (empty, meta). By the bytes, not the
    storage: two storages may cover one buffer (``torch.from_numpy`` of two views of one array, ``frombuffer``,
    ``from_dlpack``), and an ``nn.Parameter``, or a subclass made by ``_make_subclass`` that dispatches in Python,
    has a storage like any tensor's."""
    if type(t) is not torch.Tensor and isinstance(t, FakeTensor):
        return None  # its data pointer means nothing (and torch warns of it)
    try:
        storage = t.untyped_storage()
        start, size = storage.data_ptr(), storage.nbytes()
    except (RuntimeError, NotImplementedError):  # a wrapper subclass's "invalid python storage", a batched tensor
        return None
    return (start, start + size) if start and size else None


def _meet(a: tuple[int, int], b: tuple[int, int]) -> bool:
    """Whether the byte ranges [start, end) a and b share a byte."""
    return a[0] < b[1] and b[0] < a[1]


def _byte_span(t: torch.Tensor) -> tuple[int, int]:
    """The bytes [first, end) of memory that t's elements lie in (t plain and not empty)."""
    last = sum((size - 1) * step for size, step in zip(t.shape, t.stride(), strict=True))
    first = t.data_ptr()
    return first, first + (last + 1) * t.element_size()


def _inputs_apart(
    xs: list[torch.Tensor], cos: torch.Tensor, sin: torch.Tensor, index: torch.Tensor | None = None
) -> bool:
    """Whether cos, sin and the ids or offsets read (``index``, if any) lie in memory that none of the xs' storages
    (rotated in place) covers, so that no byte of theirs can be overwritten by the rotation (else ``_apart_from``
    compares their bytes). Every tensor of type torch.Tensor (the replays' keys take no other): ``_storage_span``'s
    test, written out for a replayed decode step (0.9 us for two xs and three reads, against 2.2 through it)."""
    spans = []
    try:
        for x in xs:
            storage = x.untyped_storage()
            start = storage.data_ptr()
            spans.append((start, start + storage.nbytes()))
        for t in (cos, sin) if index is None else (cos, sin, index):
            storage = t.untyped_storage()
            start = storage.data_ptr()
            end = start + storage.nbytes()
            for low, high in spans:
                if start < high and low < end:
                    return False
    except RuntimeError:  # no storage to read (a ZeroTensor): the full path decides
        return False
    return True


def _apart_from(xs: list[torch.Tensor], *reads: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
    """``reads`` (cos, sin, and the ids, offsets and cu_seqlens: None where absent), each copied where its memory may
    overlap one of the xs rotated in place. Angles in a view of x itself (one buffer holding activations and
    angles) were read after the rotation had overwritten part of them, on every backend (max error 8-12 for a (2,
    3, 5, 8) x), without an error; ids there killed the process in the CPU kernel (SIGSEGV), which checks them
    before it rotates and reads them again as it does. The storages' bytes are compared first; only a read in
    memory an x's storage covers has its bytes compared with that x's, so a slice beside x in one buffer (columns of
    a fused tensor, an arena) is copied where its byte range meets x's, and not otherwise. Until 2026-12-07 the
    storages were compared by where they start, and subclasses not at all, which missed an x that is an
    ``nn.Parameter`` and two storages over one buffer (``from_numpy``): the same SIGSEGV, and angles read after
    they were overwritten (max error 1.4-2.8). Not while Dynamo traces (no data pointers there): a graph that
    Inductor or aot_eager compiles functionalizes the in-place op, which reads its inputs first, but the "eager"
    backend runs it as it is."""
    spans = [_storage_span(x) for x in xs]
    apart = []
    for t in reads:
        span = None if t is None or not t.numel() else _storage_span(t)
        if span is not None:
            low, high = _byte_span(t)
            if any(
                at is not None and x.numel() and _meet(span, at) and _meet((low, high), _byte_span(x))
                for x, at in zip(xs, spans, strict=True)
            ):
                t = t.clone()
        apart.append(t)
    return tuple(apart)


def _dtensors_beside_plain(xs: dict[str, torch.Tensor], others: tuple) -> bool:
    """Whether one of ``others`` (cos, sin, ids, offset, cu_seqlens) is a DTensor and none of the activations xs is."""
    return first_dtensor(*others) is not None and not any(is_dtensor(x) for x in xs.values())


# Eager calls of the fused kernels that posenc.kernels.replay repeats, by key (``_replay_key``); _FULL_PATH for a key
# whose calls cannot be replayed (a copy of x or of the angles on the way, the torch backend, position ids on
# Triton), which every such call's metadata decides.
_PLANS = Plans(64)
_FULL_PATH = object()


def _replay_key(
    xs: dict[str, torch.Tensor],
    cos: torch.Tensor,
    sin: torch.Tensor,
    options: tuple,
    positions: torch.Tensor | None,
    offset: object,
    index: torch.Tensor | None,
    rows: str | None,
    cu_seqlens: torch.Tensor | None,
    backend: str,
    inplace: bool,
) -> tuple | None:
    """The key under which a ``rotate_tensors`` call may be replayed (``posenc.kernels.replay``), or None for
    a call that must take the full path: packed sequences, positions beside an offset, the torch backend, a
    non-bool flag or a layout neither None nor a str (refused there; a list could not be part of the key), anything
    but plain CPU or CUDA tensors, a gradient to record, or anything but plain eager. options: the rest of the
    call's arguments, (interleaved, conjugate, layout, rows_checked, vouched); index, rows: ``rows_read``'s. In place,
    inference mode is part of the key (inference tensors may change in place only inside it); angles that share
    storage with an x are left to the full path at each call (``_inputs_apart``), as are ids and offsets there."""
    if cu_seqlens is not None or backend not in ("auto", "cpu", "triton"):
        return None
    if type(options[0]) is not bool or type(options[1]) is not bool:
        return None
    if options[2] is not None and type(options[2]) is not str:
        return None
    if positions is not None and offset is not None:
        return None
    if index is None and not (offset is None or type(offset) is int):
        return None
    if not plain_eager():
        return None
    grad = torch.is_grad_enabled()
    keys = []
    for t in (*xs.values(), cos, sin) if index is None else (*xs.values(), cos, sin, index):
        key = tensor_key(t, grad)
        if key is None:
            return None
        keys.append(key)
    inference = inplace and torch.is_inference_mode_enabled()
    return (*keys, len(xs), rows, backend, *options, inplace, inference, torch.get_num_threads())


def rotate_tensors(
    xs: dict[str, torch.Tensor],
    cos: torch.Tensor,
    sin: torch.Tensor,
    *,
    interleaved: bool,
    conjugate: bool,
    positions: torch.Tensor | None,
    offset: int | torch.Tensor | None,
    cu_seqlens: torch.Tensor | None,
    layout: str | None,
    backend: str,
    inplace: bool,
    rows_checked: bool = False,
    vouched: bool = False,
) -> list[torch.Tensor]:
    """The one path behind apply_rotary, apply_rotary_qk, apply_rotary_ and RoPE: check, pick a backend, rotate.

    xs: name (for errors) -> tensor. rows_checked: the caller has made sure that every position is >= 0 and a
    row of the table (RoPE sizes its table for them), so the table-mode range check is skipped. vouched (RoPE's
    table calls): the caller has checked every x as ``float_tensor`` does, passes its own float32 or float64 (n, r/2)
    table as cos/sin, and nothing traces the call (neither ``compiling()`` nor torch.jit.trace), so those checks are
    not made again further down (~2 us of a decode step's ~45).

    An eager call of a fused kernel whose metadata has been through here before replays that call's launch
    (``posenc.kernels.replay``: on an Intel VM a decode step of q and k on the CPU kernel took 51-66 us through the
    full path and 15-17 us replayed).
    """
    options = (interleaved, conjugate, layout, rows_checked, vouched)
    first, index, rows = rows_read(positions, offset)
    key = _replay_key(xs, cos, sin, options, positions, offset, index, rows, cu_seqlens, backend, inplace)
    plan = None if key is None else _PLANS.get(key)
    if key is None or plan is _FULL_PATH:
        return _rotate_tensors(xs, cos, sin, positions, offset, cu_seqlens, backend, inplace, *options)
    tensors = list(xs.values())
    if inplace and not _inputs_apart(tensors, cos, sin, index):
        # Decided per call, not by the key: the full path, unrecorded (its copy of the angles would not replay).
        return _rotate_tensors(xs, cos, sin, positions, offset, cu_seqlens, backend, inplace, *options)
    if plan is not None:
        outs = replay(plan, tensors, cos, sin, first, index)
        if outs is not None:
            return outs
    with recording_launches() as launches:
        outs = _rotate_tensors(xs, cos, sin, positions, offset, cu_seqlens, backend, inplace, *options)
    _PLANS.put(key, plan_of(launches, tensors, outs, cos, sin, first, index) or _FULL_PATH)
    return outs


def _rotate_tensors(
    xs: dict[str, torch.Tensor],
    cos: torch.Tensor,
    sin: torch.Tensor,
    positions: torch.Tensor | None,
    offset: int | torch.Tensor | None,
    cu_seqlens: torch.Tensor | None,
    backend: str,
    inplace: bool,
    interleaved: bool,
    conjugate: bool,
    layout: str | None,
    rows_checked: bool,
    vouched: bool,
) -> list[torch.Tensor]:
    """``rotate_tensors``' full path: every check, the backend's choice, the rotation."""
    flag("interleaved", interleaved)
    offset = integer_offset(offset)
    flag("conjugate", conjugate)
    tensor = torch.Tensor
    if isinstance(positions, tensor) or isinstance(offset, tensor) or isinstance(cu_seqlens, tensor):
        # Broadcast calls and int offsets skip it: ~0.3 us a tensor, on every call (a decode step takes ~45 us).
        # Negative views (their storage holds -ids) by value: the table lookups below and the kernels read storage. A
        # copy of a few ints, unlike one of x or cos/sin (sent to torch or refused by choose_backend).
        positions, offset, cu_seqlens = index_values(positions), index_values(offset), index_values(cu_seqlens)
    if _dtensors_beside_plain(xs, (cos, sin, positions, offset, cu_seqlens)):
        # DTensor angles, ids, offsets or cu_seqlens beside plain (whole) activations: their whole values. The fused
        # kernels read raw storage, which a DTensor's is not, and are chosen by the activations and cos/sin alone:
        # DTensor position ids came out rotated by the wrong rows (max error 4.6) without an error.
        cos, sin, positions, offset, cu_seqlens = (
            replicated_values(t) for t in (cos, sin, positions, offset, cu_seqlens)
        )
    kind = rotary_kind(layout, positions, offset, cu_seqlens)
    offsets, offset_int = None, 0
    if kind == "broadcast":
        half = check_cos_sin(cos, sin)
        for name, x in xs.items():
            check_x_for(x, cos, half, name)
    else:
        offsets, offset_int = check_table_call(
            xs,
            cos,
            sin,
            kind,
            positions=positions,
            offset=offset,
            cu_seqlens=cu_seqlens,
            rows_checked=rows_checked,
            vouched=vouched,
        )
    tensors = list(xs.values())
    if len({x.dtype for x in tensors}) > 1:
        raise TypeError(f"{' and '.join(xs)} must share a dtype, got {', '.join(str(x.dtype) for x in tensors)}")
    # Compared, not gathered in a set: torch.jit.trace gives sizes as tensors, which a set holds by identity.
    if any(x.shape[-1] != tensors[0].shape[-1] for x in tensors[1:]):
        # Attention takes q . k over the head dim; a wider k would also keep its extra channels unrotated unseen.
        raise ValueError(
            f"{' and '.join(xs)} must share a head dim (their last dim), got "
            f"{', '.join(str(x.shape[-1]) for x in tensors)}"
        )
    # RoPE's own tables (vouched) are never inference tensors; Dynamo cannot trace is_inference(). ~0.5 us with grad
    # mode on, ~0.1 us off.
    if not vouched and torch.is_grad_enabled() and not compiling() and (cos.is_inference() or sin.is_inference()):
        cos, sin = _saveable_cos_sin(cos, sin, tensors)
    if inplace:
        for name, x in xs.items():
            # A contiguous tensor shares no memory between elements: the common case skips the stride checks (the
            # overlap test costs ~1.4 us a tensor in Python, a few % of a decode-size call).
            if not x.is_contiguous():
                _refuse_shared_memory(name, x)
            # torch's own in-place ops refuse this, so the torch backend would; the fused ones must agree. (Dynamo
            # cannot trace is_inference(), so traced calls go unchecked here.)
            if not compiling() and x.is_inference() and not torch.is_inference_mode_enabled():
                raise RuntimeError(
                    f"{name} was made under torch.inference_mode() and may be updated in place only inside it; "
                    f"call this inside torch.inference_mode(), or use apply_rotary for a rotated copy"
                )
            # Under torch.compile too (Dynamo reads is_leaf and _base as it traces): there the in-place copy failed
            # in Dynamo's fake-tensor run, with torch's message wrapped in Dynamo's, even without fullgraph=True.
            if torch.is_grad_enabled() and x.requires_grad:
                _refuse_untracked_change(name, x, cos, sin)
        if not compiling():
            cos, sin, positions, offsets, cu_seqlens = _apart_from(tensors, cos, sin, positions, offsets, cu_seqlens)
    chosen = choose_backend(backend, tensors, cos, sin, kind, inplace=inplace, names=list(xs), eager=vouched)
    if chosen != "torch":
        args = (cos, sin, positions, offsets, offset_int, cu_seqlens, kind, interleaved, conjugate, chosen)
        if inplace:
            rotary_inplace(tensors, *args, names=" and ".join(xs))
            return tensors
        return rotary_copy(tensors, *args, eager=vouched)

    first = tensors[0]
    if is_dtensor(first):
        # Plain cos/sin, ids, offsets or cu_seqlens beside DTensor activations (RoPE's own tables, say): DTensor
        # refuses to mix them in one operation, so they join x's mesh, replicated (each the whole value).
        cos, sin = replicated_like(cos, first), replicated_like(sin, first)
        positions, offsets, cu_seqlens = (
            None if t is None else replicated_like(t, first) for t in (positions, offsets, cu_seqlens)
        )
    if kind != "broadcast":
        # The table rows of the tokens, (b or 1, s, r/2): a slice when they are consecutive, else gathered once per
        # token; then a head axis where x has one.
        batch = cu_seqlens.shape[0] - 1 if cu_seqlens is not None else first.shape[0]
        seq = first.shape[{"bhsd": 2, "bshd": 1, "varlen": 0}[kind]]
        if consecutive_rows(kind, positions, offsets):
            cos, sin = cos[None, offset_int : offset_int + seq], sin[None, offset_int : offset_int + seq]
        else:
            pos = token_positions(
                kind,
                batch,
                seq,
                positions=positions,
                offsets=offsets,
                offset=offset_int,
                cu_seqlens=cu_seqlens,
                device=first.device,
            )
            if not rows_checked and not values_readable(first.device):
                # check_table_call could not read the positions; a gather would wrap a negative one to the table's
                # last rows (on CUDA too), so check them with the graph.
                # Saying what eager's check and the CPU kernel's say: the fix. Not the row count: formatting it
                # specialized a table passed in under dynamic shapes to its size while tracing.
                assert_without_sync(
                    (pos >= 0) & (pos < cos.shape[0]),
                    "positions must be rows of the cos/sin table (every offset + position id >= 0 and below the "
                    "table's row count): build the table for more positions, or look for a negative id or offset "
                    "(checked as the graph runs, where nothing could read the positions before: torch.compile, "
                    "make_fx, CUDA graph capture)",
                )
            cos, sin = cos[pos], sin[pos]
        if kind == "varlen":
            cos, sin = cos[0, :, None], sin[0, :, None]
        else:
            head_axis = 1 if kind == "bhsd" else 2
            cos, sin = cos.unsqueeze(head_axis), sin.unsqueeze(head_axis)
    outs = []
    for name, x in xs.items():
        if inplace:
            _rotate_in_place(name, x, cos, sin, interleaved, conjugate)
            outs.append(x)
        else:
            outs.append(apply_rotary_torch(x, cos, sin, interleaved=interleaved, conjugate=conjugate))
    return outs


def _rotate_in_place(
    name: str, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool, conjugate: bool
) -> None:
    """The torch path's in-place rotation of x (..., d), called ``name`` in errors, with cos/sin broadcastable to
    x.shape[:-1] + (r/2,)."""
    rotary_dim = 2 * cos.shape[-1]
    if not (torch.is_grad_enabled() and (x.requires_grad or cos.requires_grad or sin.requires_grad)) and not (
        _recorded() or batched(x, cos, sin) or is_dtensor(x)  # a DTensor: as apply_rotary_torch says
    ):
        # Nothing to record: straight into x, a block of rows at a time, with no rotated copy of the whole.
        wide = compute_dtype(x, cos)
        cos, sin = cos.to(wide), sin.to(wide)
        dim, rows = _block_rows(x, rotary_dim, wide)
        if rows:
            _rotate_blocks(x, x, cos, sin, interleaved, conjugate, dim, rows, in_place=True)
        else:
            source = x[..., :rotary_dim].to(wide, copy=True)
            rotate_pairs_into(x[..., :rotary_dim], source, cos, sin, interleaved=interleaved, conjugate=conjugate)
        return
    # A slice of a DTensor sharded on its channels is a new DTensor, not a view of x: a copy_ into it was lost, and
    # x came back unrotated without an error. The whole rotated copy goes into x instead.
    whole = is_dtensor(x) and rotary_dim < x.shape[-1]
    part = x if whole else x[..., :rotary_dim]
    if torch.is_grad_enabled() and (cos.requires_grad or sin.requires_grad):
        # cos's gradient needs x as it was: autograd saves it, and the copy_ below would overwrite it.
        part = part.clone()
    rotated = apply_rotary_torch(part, cos, sin, interleaved=interleaved, conjugate=conjugate)
    try:
        if whole:
            x.copy_(rotated)
        else:
            # A slice, not narrow(), and written where it is made: the TorchScript ONNX exporter drops a copy_ into
            # a narrow() view of x, or into the slice bound to a name first (its model came back as one Identity).
            x[..., :rotary_dim].copy_(rotated)
    except RuntimeError as error:  # autograd's in-place checks, made before the copy writes: x is as it was
        raise inplace_refused(name, error) from error


def _saveable_cos_sin(
    cos: torch.Tensor, sin: torch.Tensor, xs: list[torch.Tensor]
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin as the rotation of ``xs`` (grad mode on) may save them for its backward: copies of those made under
    torch.inference_mode() (cached by an evaluation pass before training, say) when an x requires grad, since
    autograd refuses to save an inference tensor ("Inference tensors cannot be saved for backward", from deep inside
    torch). A copy per call: tables made outside inference mode are saved as they are."""
    if not any(x.requires_grad for x in xs):
        return cos, sin
    return (cos.clone() if cos.is_inference() else cos), (sin.clone() if sin.is_inference() else sin)


def _refuse_untracked_change(name: str, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """Raise, before anything is written, where autograd cannot record rotating x (which requires grad, with grad
    mode on) in place, in the cases torch's own error would misname or whose fix is not apply_rotary. The other
    refusals (a view of a leaf, one of unbind's views) are torch's own, raised before the write too; a view of a leaf
    is named here too while traced, as eager names it."""
    if x.is_leaf and x._base is not None and x._base.requires_grad:
        # No grad_fn, though a view of a tensor that requires grad: made under no_grad. torch's error for it differs
        # between the backends, one of them calling x a leaf.
        raise RuntimeError(
            f"{name} is a view made under torch.no_grad() of a tensor that requires grad, and autograd does not let "
            f"such a view change in place with grad mode on (it cannot tell whether to record the change); make the "
            f"view outside torch.no_grad(), rotate it inside torch.no_grad() too, or rotate a copy with apply_rotary"
        )
    if compiling() and x._base is not None and x._base.is_leaf and x._base.requires_grad:
        # Eager, torch's own refusal is caught before the write and reworded (inplace_refused); traced, it came from
        # Dynamo's fake-tensor run ("RuntimeError when making fake tensor call"), which no except clause here sees.
        message = "a view of a leaf Variable that requires grad is being used in an in-place operation."
        raise inplace_refused(name, RuntimeError(message))
    if x.is_leaf:
        # torch's own message comes from deep inside the rotation, and differs between the backends.
        raise RuntimeError(
            f"{name} is a leaf tensor that requires grad, which autograd does not let change in place; use "
            f"apply_rotary for a rotated copy, or rotate it under torch.no_grad()"
        )


def apply_rotary(
    x: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    *,
    interleaved: bool = False,
    conjugate: bool = False,
    positions: torch.Tensor | None = None,
    offset: int | torch.Tensor | None = None,
    cu_seqlens: torch.Tensor | None = None,
    layout: Literal["bhsd", "bshd"] | None = None,
    backend: Backend = "auto",
) -> torch.Tensor:
    """Rotate the first ``2 * cos.shape[-1]`` channels of ``x``; the rest pass through unchanged.

    x: (..., d) any float dtype. Two ways to give the angles (see ``posenc.kernels.layout``):

    * cos, sin: float32 (or float64), broadcastable to x.shape[:-1] + (r/2,) (positions, offset, cu_seqlens
      and layout left None);
    * cos, sin: (n_positions, r/2) tables, read at each token's position: ``positions`` (s,) or (b, s) ids,
      plus ``offset`` (int, or (b,) per sequence; default 0..s-1 + offset); x is (b, h, s, d) for
      ``layout="bhsd"`` (default) or (b, s, h, d) for "bshd"; with ``cu_seqlens`` (n_seq + 1,) x is packed
      (total_tokens, h, d) and positions restart at 0 in every sequence (plus ``offset``). Give ``layout`` for x in
      (b, s, h, d) (flash-attention's layout): read at an ``offset`` alone, such an x fits "bhsd" too, as s heads of
      h tokens, and would be rotated by the wrong positions without an error.

    From Hugging Face's cos/sin, (b, s, r) with each pair's value twice, pass ``cos[..., : r // 2]`` where the model
    concatenates them (``torch.cat((freqs, freqs), -1)``: Llama, GLM and most) and ``cos[..., ::2]`` where it
    interleaves them (``torch.repeat_interleave(freqs, 2, -1)``: Cohere); whole, they would rotate 2r channels by the
    wrong angles where 2r <= d (partial rotation), which no shape check can see.

    interleaved: adjacent pairs (x0, x1), (x2, x3), ... if True, else split-half pairs (i, i + r/2).
    conjugate: rotate by the negative angle (the inverse rotation).
    backend: "auto" (Triton on CUDA tensors, the compiled CPU kernel on CPU tensors, else torch), "torch",
    "triton" or "cpu". The fused backends do not differentiate cos/sin; "auto" uses torch when those need grad.
    cos/sin made under torch.inference_mode() serve an x that requires grad too: autograd refuses to save them for
    the backward, so each such call copies them (make them outside inference mode to spare the
    copy; under torch.compile, which cannot ask is_inference(), they must be).
    Returns a new tensor with x's shape and dtype; ``x`` is not modified.
    """
    (out,) = rotate_tensors(
        {"x": x},
        cos,
        sin,
        interleaved=interleaved,
        conjugate=conjugate,
        positions=positions,
        offset=offset,
        cu_seqlens=cu_seqlens,
        layout=layout,
        backend=backend,
        inplace=False,
    )
    return out


def apply_rotary_qk(
    q: torch.Tensor,
    k: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    *,
    interleaved: bool = False,
    conjugate: bool = False,
    positions: torch.Tensor | None = None,
    offset: int | torch.Tensor | None = None,
    cu_seqlens: torch.Tensor | None = None,
    layout: Literal["bhsd", "bshd"] | None = None,
    backend: Backend = "auto",
) -> tuple[torch.Tensor, torch.Tensor]:
    """``apply_rotary`` of q and k with the same angles, in one kernel launch on the fused backends.

    q: (b, h_q, s, d), k: (b, h_k, s, d) (or as the layout says); h_q may differ from h_k (GQA). Returns (q, k).
    """
    q_out, k_out = rotate_tensors(
        {"q": q, "k": k},
        cos,
        sin,
        interleaved=interleaved,
        conjugate=conjugate,
        positions=positions,
        offset=offset,
        cu_seqlens=cu_seqlens,
        layout=layout,
        backend=backend,
        inplace=False,
    )
    return q_out, k_out


def apply_rotary_(
    x: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    *,
    interleaved: bool = False,
    conjugate: bool = False,
    positions: torch.Tensor | None = None,
    offset: int | torch.Tensor | None = None,
    cu_seqlens: torch.Tensor | None = None,
    layout: Literal["bhsd", "bshd"] | None = None,
    backend: Backend = "auto",
) -> torch.Tensor:
    """In-place ``apply_rotary``: writes channels 0..r-1 of x and no others; returns x. Differentiable."""
    rotate_tensors(
        {"x": x},
        cos,
        sin,
        interleaved=interleaved,
        conjugate=conjugate,
        positions=positions,
        offset=offset,
        cu_seqlens=cu_seqlens,
        layout=layout,
        backend=backend,
        inplace=True,
    )
    return x
