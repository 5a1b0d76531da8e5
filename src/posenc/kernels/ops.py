"""The fused kernels as ``torch.library`` custom ops, with fake and autograd registrations.

``posenc::rotary`` returns rotated copies of a list of tensors (q, or q and k: one launch); ``posenc::rotary_``
rotates them in place. Their fake implementations let ``torch.compile(fullgraph=True)`` trace through without
running a kernel; the backward is the same op with ``conjugate`` flipped (a rotation's inverse is its transpose),
so a kernel never needs a separate backward. The ops are what traced graphs hold; eager calls skip their
dispatch (~150 us a call): no autograd, the implementation directly; with autograd, ``torch.autograd.Function``s
doing the same. The fused kernels do not differentiate cos/sin: when cos or sin needs a gradient, "auto" picks the
pure-torch path and an explicit fused backend raises (``posenc.kernels.backend``). The launches themselves are
``posenc.kernels.launch``'s.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch._subclasses.fake_tensor import FakeTensor

from posenc._checks import compiling, inplace_refused, pre_dispatch_recording
from posenc.kernels.backend import batched, dense_gradient, storage_problem
from posenc.kernels.huge_pages import advised
from posenc.kernels.launch import launch


def _unit_last_stride(x: torch.Tensor) -> torch.Tensor:
    return x if x.shape[-1] <= 1 or x.stride(-1) == 1 else x.contiguous()


def _output_like(x: torch.Tensor) -> torch.Tensor:
    """A new tensor of x's shape and dtype for the kernels to write, x (..., d) with a unit last stride: x's strides
    where x is dense, else row-major. empty_like orders the strides of an x whose elements share memory (sliding
    windows, an as_strided gradient) by x's, which may put stride 1 on another dim: the kernels refuse that."""
    out = torch.empty_like(x)
    if out.shape[-1] > 1 and out.stride(-1) != 1:
        out = torch.empty_like(x, memory_format=torch.contiguous_format)
    return out


def _rotary_impl(
    xs: list[torch.Tensor],
    cos: torch.Tensor,
    sin: torch.Tensor,
    positions: torch.Tensor | None,
    offsets: torch.Tensor | None,
    offset: int,
    cu_seqlens: torch.Tensor | None,
    kind: str,
    interleaved: bool,
    conjugate: bool,
    backend: str,
) -> list[torch.Tensor]:
    """Rotated copies of xs (see ``posenc.apply_rotary``'s arguments); channels past r are copied."""
    xs = [_unit_last_stride(x) for x in xs]
    outs = [advised(_output_like(x)) for x in xs]
    launch(xs, outs, cos, sin, positions, offsets, offset, cu_seqlens, kind, interleaved, conjugate, backend, True)  # type: ignore[arg-type]
    return outs


rotary = torch.library.custom_op("posenc::rotary", mutates_args=())(_rotary_impl)


@rotary.register_fake
def _rotary_fake(xs, cos, sin, positions, offsets, offset, cu_seqlens, kind, interleaved, conjugate, backend):
    return [_output_like(_unit_last_stride(x)) for x in xs]


def _rotary_setup(ctx, inputs, output) -> None:
    _, cos, sin, positions, offsets, offset, cu_seqlens, kind, interleaved, conjugate, backend = inputs
    ctx.save_for_backward(cos, sin, positions, offsets, cu_seqlens)
    ctx.options = (offset, kind, interleaved, conjugate, backend)


def _rotate_grads(ctx, grads: Sequence[torch.Tensor | None], rotate, saved: Sequence) -> list[torch.Tensor | None]:
    """The gradients of xs: each incoming gradient rotated back by ``rotate`` (the op, or ``rotary_copy``), with
    ``saved`` = (cos, sin, positions, offsets, cu_seqlens)."""
    cos, sin, positions, offsets, cu_seqlens = saved
    offset, kind, interleaved, conjugate, backend = ctx.options
    grads = [dense_gradient(g) for g in grads]
    present = [i for i, g in enumerate(grads) if g is not None]
    result: list[torch.Tensor | None] = [None] * len(grads)
    given = [grads[i] for i in present]
    if present and (batched(*given) or (not compiling() and storage_problem(given, cos, sin))):  # type: ignore[arg-type]
        # Batched gradients (jacobian(vectorize=True), grad(is_grads_batched=True)) have no storage for a kernel
        # to read ("Cannot access data pointer"): the torch path's formula, which vmap batches. So for gradients the
        # forward's checks never saw: a ZeroTensor or a __torch_dispatch__ subclass (the CPU kernel crashed, SIGSEGV)
        # and a negative view (its storage read: the gradient's sign flipped).
        from posenc.rope.apply import rotate_tensors  # that module imports this one

        rotated = rotate_tensors(
            {f"the gradient of output {i}": grads[i] for i in present},  # type: ignore[misc]
            cos,
            sin,
            interleaved=interleaved,
            conjugate=not conjugate,
            positions=positions,
            offset=None if kind == "broadcast" else (offsets if offsets is not None else offset),
            cu_seqlens=cu_seqlens,
            layout=kind if kind in ("bhsd", "bshd") else None,
            backend="torch",
            inplace=False,
            rows_checked=True,
        )
    elif present:
        rotated = rotate(
            given,
            cos,
            sin,
            positions,
            offsets,
            offset,
            cu_seqlens,
            kind,
            interleaved,
            not conjugate,
            backend,
        )
    if present:
        for i, g in zip(present, rotated, strict=True):
            result[i] = g
    return result


def _rotary_backward(ctx, grads):
    return _rotate_grads(ctx, grads, rotary, ctx.saved_tensors), *([None] * 10)


rotary.register_autograd(_rotary_backward, setup_context=_rotary_setup)


def _rotary_inplace_impl(
    xs: list[torch.Tensor],
    cos: torch.Tensor,
    sin: torch.Tensor,
    positions: torch.Tensor | None,
    offsets: torch.Tensor | None,
    offset: int,
    cu_seqlens: torch.Tensor | None,
    kind: str,
    interleaved: bool,
    conjugate: bool,
    backend: str,
) -> None:
    """Rotate xs in place: only channels 0..r-1 are written."""
    launch(xs, xs, cos, sin, positions, offsets, offset, cu_seqlens, kind, interleaved, conjugate, backend, False)  # type: ignore[arg-type]
    # The kernels write through pointers, which autograd does not see: without the bump, a graph that saved x
    # before this call would compute its gradient from the rotated values instead of raising.
    for x in xs:
        if not x.is_inference():
            torch.autograd.graph.increment_version(x)


rotary_ = torch.library.custom_op("posenc::rotary_", mutates_args=("xs",))(_rotary_inplace_impl)


@rotary_.register_fake
def _rotary_inplace_fake(xs, cos, sin, positions, offsets, offset, cu_seqlens, kind, interleaved, conjugate, backend):
    return None


# The trailing inputs of the eager autograd Functions, after the rotated tensors: options, cos, sin, positions,
# offsets, cu_seqlens (never differentiated here).
_TRAILING = 6


class _EagerRotation(torch.autograd.Function):
    """What the eager autograd Functions share: the inputs' order, (*xs, options, cos, sin, positions, offsets,
    cu_seqlens), the saved tensors and options, and the backward, which rotates the wanted gradients back through
    ``rotary_copy`` (so it is itself differentiable: double backward).

    The rotated tensors come first because, when x is a view rotated in place (q sliced out of a fused qkv
    projection), autograd's CopySlices routes the gradient of the view's base through the Function's first input:
    with x anywhere else, every other channel of the base got a gradient of zero."""

    @staticmethod
    def _unpack(ctx, args: tuple) -> tuple:
        """Save what the backward needs; returns (xs, options, cos, sin, positions, offsets, cu_seqlens)."""
        xs, (options, cos, sin, positions, offsets, cu_seqlens) = args[:-_TRAILING], args[-_TRAILING:]
        # Indices, which the torch path never saves: one made under inference mode, which autograd refuses to save,
        # is copied (a few ints), so that it serves here as it does there.
        positions, offsets, cu_seqlens = (
            t.clone() if t is not None and t.is_inference() else t for t in (positions, offsets, cu_seqlens)
        )
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(cos, sin, positions, offsets, cu_seqlens)
        # Also kept on ctx: one node rotates q and k, and save_for_backward frees its tensors in the node's first
        # backward, so a backward through q alone would leave a later one through k nothing to read (on the torch
        # path they are separate graphs, and "auto" must not make that depend on the device). They are inputs, so
        # no reference cycle; they live as long as the graph (cos/sin are a table's rows, positions a few ints),
        # and only this second backward reads them, past saved-tensor hooks, with save_for_backward's check that
        # they are unchanged made by hand.
        ctx.kept = (cos, sin, positions, offsets, cu_seqlens)
        ctx.versions = [None if t is None or t.is_inference() else t._version for t in ctx.kept]
        ctx.backpropagated = set()  # the outputs a freeing backward has gone through
        ctx.options = options
        return list(xs), options, cos, sin, positions, offsets, cu_seqlens

    @staticmethod
    def _tables(ctx, present: set[int]) -> Sequence[torch.Tensor | None]:
        """The saved tensors, or, after a backward that freed them, the kept ones if none of the outputs ``present``
        (those with a gradient now) was gone through (the same output again without retain_graph=True raises
        torch's own error, as on the torch path)."""
        try:
            return ctx.saved_tensors
        except RuntimeError:  # freed by an earlier backward, or torch's refusal of what was saved (inference tensors)
            if not ctx.backpropagated or present & ctx.backpropagated:
                raise
        names = ("cos", "sin", "positions", "offsets", "cu_seqlens")
        for name, t, version in zip(names, ctx.kept, ctx.versions, strict=True):
            if version is not None and t._version != version:
                raise RuntimeError(
                    f"the {name} tensor given to the rotation was modified in place after it ran (version {version}, "
                    f"now {t._version}), and its backward reads it: change a clone of it instead"
                )
        return ctx.kept

    @staticmethod
    def backward(ctx, *grads):
        # One gradient per rotated tensor, which come first among the inputs.
        wanted = [g if need else None for g, need in zip(grads, ctx.needs_input_grad[: len(grads)], strict=True)]
        present = {i for i, g in enumerate(wanted) if g is not None}
        tables = _EagerRotation._tables(ctx, present)
        # Every backward is counted as freeing: one with retain_graph=True leaves saved_tensors readable, and the
        # set is then never consulted.
        ctx.backpropagated |= present
        return (*_rotate_grads(ctx, wanted, rotary_copy, tables), *([None] * _TRAILING))


class _RotaryCopy(_EagerRotation):
    """Eager autograd for the out-of-place rotation: what ``posenc::rotary`` registers, without the custom op's
    dispatch, which cost 0.3-0.9 ms of a forward+backward of q and k (measured against this class side by side).
    Traced calls use the op, which graphs can hold."""

    @staticmethod
    def forward(ctx, *args):
        xs, (offset, kind, interleaved, conjugate, backend), cos, sin, positions, offsets, cu_seqlens = (
            _EagerRotation._unpack(ctx, args)
        )
        outs = _rotary_impl(xs, cos, sin, positions, offsets, offset, cu_seqlens, kind, interleaved, conjugate, backend)
        # An output whose input needs no gradient (k beside a q that does) does not need one either.
        ctx.mark_non_differentiable(*(out for x, out in zip(xs, outs, strict=True) if not x.requires_grad))
        return tuple(outs)


class _RotaryInPlace(_EagerRotation):
    """Autograd for the in-place rotation (torch.library cannot register autograd for a mutating op). It records
    the rotation and writes nothing: ``rotary_inplace`` launches the kernel once ``apply`` has returned.

    Autograd checks a dirty tensor (a leaf's view, one of unbind's views, a view made under no_grad: torch's
    in-place errors) and the saved ones (no inference tensors) after ``forward`` returns: a kernel launched in
    ``forward`` had rotated x by then, so a caught error left x changed (the torch backend refuses before writing).
    """

    @staticmethod
    def forward(ctx, *args):
        xs = _EagerRotation._unpack(ctx, args)[0]
        ctx.mark_dirty(*xs)
        return tuple(xs)


def _dispatched(*tensors: torch.Tensor) -> bool:
    """Whether the call must go through torch's dispatcher as the custom ops rather than launch the kernels directly:
    one of ``tensors`` is a FakeTensor (a FakeTensorMode's shape inference: a data pointer with no memory behind it,
    which the kernels wrote through, a segmentation fault on the CPU; the ops' fake implementations give the
    outputs' shapes, as they do for torch.compile), or a ``TorchDispatchMode`` is on. A mode (make_fx's tracing, a
    logging or FLOP-counting mode, selective checkpointing) sees only what passes the dispatcher: a direct launch was
    missing from it, so a make_fx graph returned the uninitialized output without the rotation. The op runs the same
    kernels once the mode has seen it. (``torch.jit.trace`` never gets here: ``choose_backend`` sends it to the torch
    path.) make_fx(pre_dispatch=True) keeps its mode on a stack of its own: asked too (its graph held only the empty
    outputs)."""
    if torch._C._len_torch_dispatch_stack() or pre_dispatch_recording():
        return True
    # A plain loop: this runs on every call, and a generator costs a microsecond.
    for t in tensors:  # noqa: SIM110
        if type(t) is not torch.Tensor and isinstance(t, FakeTensor):
            return True
    return False


def _needs_grad(xs: Sequence[torch.Tensor]) -> bool:
    if not torch.is_grad_enabled():
        return False
    # A plain loop: this runs on every call, and a generator costs ~0.3 us.
    for x in xs:  # noqa: SIM110
        if x.requires_grad:
            return True
    return False


def rotary_copy(
    xs: Sequence[torch.Tensor],
    cos: torch.Tensor,
    sin: torch.Tensor,
    positions: torch.Tensor | None,
    offsets: torch.Tensor | None,
    offset: int,
    cu_seqlens: torch.Tensor | None,
    kind: str,
    interleaved: bool,
    conjugate: bool,
    backend: str,
    *,
    eager: bool = False,
) -> list[torch.Tensor]:
    """``posenc::rotary`` when traced (torch.compile) or dispatched (``_dispatched``: FakeTensors, a dispatch mode;
    torch.jit.trace never gets here, ``choose_backend`` sends it to the torch path); in eager, ``_RotaryCopy`` when
    autograd is involved, else the implementation directly (the op's dispatch costs ~150 us a call, more than a
    decode step's kernel). eager: the caller knows that torch.compile does not trace the call (``choose_backend``'s)."""
    args = (cos, sin, positions, offsets, offset, cu_seqlens, kind, interleaved, conjugate, backend)
    if (not eager and compiling()) or _dispatched(*xs, cos, sin):
        return rotary(list(xs), *args)
    if _needs_grad(xs):
        options = (offset, kind, interleaved, conjugate, backend)
        return list(_RotaryCopy.apply(*xs, options, cos, sin, positions, offsets, cu_seqlens))
    return _rotary_impl(list(xs), *args)


def rotary_inplace(
    xs: Sequence[torch.Tensor],
    cos: torch.Tensor,
    sin: torch.Tensor,
    positions: torch.Tensor | None,
    offsets: torch.Tensor | None,
    offset: int,
    cu_seqlens: torch.Tensor | None,
    kind: str,
    interleaved: bool,
    conjugate: bool,
    backend: str,
    *,
    names: str = "x",
) -> None:
    """``rotary_`` with autograd when any x requires grad (the gradient is rotated back, like the copy's).
    names: xs as errors call them.

    In eager, autograd's refusals (torch's in-place errors, an inference tensor to save) come before the kernel
    writes anything (``_RotaryInPlace``), raised naming xs and the fix.

    Traced with a gradient wanted, x is overwritten (``copy_``) with ``posenc::rotary``'s rotated copy: the same
    values bit for bit (the copy kernel's tail is x's own), through an in-place op that Dynamo and autograd track.
    ``_RotaryInPlace`` is not traced: Dynamo before torch 2.13 drops its ``ctx.mark_dirty`` (pytorch/pytorch#184113),
    later reads of x skip the Function, and x's gradient missed the rotation without a word (2*R*x, not 2*x, for
    x.square().sum()); a compiled function's input rotated in place lost it on 2.13 too.
    """
    traced = compiling() or _dispatched(*xs, cos, sin)  # the ops' fake implementations serve both
    if _needs_grad(xs):
        if traced:
            outs = rotary(
                list(xs), cos, sin, positions, offsets, offset, cu_seqlens, kind, interleaved, conjugate, backend
            )
            for x, out in zip(xs, outs, strict=True):
                x.copy_(out)
        else:
            options = (offset, kind, interleaved, conjugate, backend)
            try:
                _RotaryInPlace.apply(*xs, options, cos, sin, positions, offsets, cu_seqlens)
            except RuntimeError as error:
                raise inplace_refused(names, error) from error
            # Outside any graph, as in a Function's forward: the launch's views and copies of x and cos need none.
            with torch.no_grad():
                _rotary_inplace_impl(
                    list(xs), cos, sin, positions, offsets, offset, cu_seqlens, kind, interleaved, conjugate, backend
                )
    elif traced:
        rotary_(list(xs), cos, sin, positions, offsets, offset, cu_seqlens, kind, interleaved, conjugate, backend)
    else:
        _rotary_inplace_impl(
            list(xs), cos, sin, positions, offsets, offset, cu_seqlens, kind, interleaved, conjugate, backend
        )
