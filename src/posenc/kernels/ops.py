"""The fused kernels as ``torch.library`` custom ops, with fake and autograd registrations, and backend choice.

``posenc::rotary`` returns rotated copies of a list of tensors (q, or q and k: one launch); ``posenc::rotary_``
rotates them in place. Their fake implementations let ``torch.compile(fullgraph=True)`` trace through without
running a kernel; the backward is the same op with ``conjugate`` flipped (a rotation's inverse is its transpose),
so a kernel never needs a separate backward. The ops are what traced graphs hold; eager calls skip their
dispatch (~150 us a call): no autograd, the implementation directly; with autograd, ``torch.autograd.Function``s
doing the same. The fused kernels do not differentiate cos/sin: when cos or sin needs a gradient, "auto" picks the
pure-torch path and an explicit fused backend raises.
"""

from __future__ import annotations

import functools
import math
import sys
from collections.abc import Sequence

import torch
import torch.autograd.forward_ad as fwAD
from torch._subclasses.fake_tensor import FakeTensor

from posenc._checks import compiling, inplace_refused, is_dtensor, pre_dispatch_recording, runs_own_ops
from posenc._compile_marks import assume_constant_result
from posenc.kernels.cpu_rope import DTYPE_CODES, cpu_available, cpu_unavailable_reason, rope_cpu_jobs
from posenc.kernels.layout import KINDS, Kind, canonical, canonical_cos, consecutive_rows, token_positions

BACKENDS = ("auto", "torch", "triton", "cpu")


@functools.cache
def _triton_module_or_error() -> tuple[object | None, str]:
    try:
        from posenc.kernels import triton_rope
    except ModuleNotFoundError as error:
        # Triton itself missing, or a module it needs: install hints only for the first.
        hint = " (pip install 'posenc[triton]')" if error.name == "triton" else ""
        return None, f"importing triton failed: {error}{hint}"
    except Exception as error:  # triton failing to find a driver
        return None, f"importing triton failed: {error}"
    return triton_rope, ""


@assume_constant_result
def triton_available() -> bool:
    """True when Triton imports and a CUDA device is present (the auto backend's condition for CUDA tensors)."""
    return torch.cuda.is_available() and _triton_imports()


@assume_constant_result
def _triton_imports() -> bool:
    # Through assume_constant_result, as triton_available: dynamo warns on a call to a functools.cache'd function.
    return _triton_module_or_error()[0] is not None


@assume_constant_result
def _cpu_built() -> bool:
    return cpu_available()


def transformed(*tensors: torch.Tensor) -> bool:
    """Whether a ``torch.func`` transform (vmap, grad, jacrev, jvp, ...) is running, or a forward-mode AD tangent
    rides on one of ``tensors``. The fused kernels read raw storage and have neither a batching rule nor a
    forward-mode derivative: a batched tensor has no data pointer, and a tangent would be dropped without a word.
    Under torch.compile too: Dynamo answers both questions as it traces (a compiled vmap or grad failed in the fused
    op, and a compiled jvp dropped its tangent, until 2026-12-05); with a dual level open it cannot ask a tensor
    for its tangent, so any open level counts."""
    if torch._C._are_functorch_transforms_active():
        return True
    if fwAD._current_level < 0:
        return False
    return compiling() or any(fwAD.unpack_dual(t).tangent is not None for t in tensors)


def batched(*tensors: torch.Tensor) -> bool:
    """``transformed``, or one of ``tensors`` batched by autograd's own vmap, which ``jacobian(vectorize=True)``,
    ``hessian(vectorize=True)`` and ``grad(is_grads_batched=True)`` run backward passes under (no functorch level
    is active there; such a tensor has no storage either)."""
    return transformed(*tensors) or any(torch._C._functorch.is_legacy_batchedtensor(t) for t in tensors)


def _recorded_without_fused_kernels(traced: bool) -> str:
    """Why a graph being recorded now cannot hold the fused kernels, or "" when none is (or one can). traced: this
    thread traces for torch.compile or torch.export (``compiling()``, asked once by the caller).

    torch.jit.trace records only dispatched ops: the kernels write through raw pointers (ctypes, Triton launches), so
    the trace kept the empty output and returned unwritten memory at every replay, without an error. The ONNX
    exporters have no ONNX function for posenc's ops ("No ONNX function found for posenc.rotary"); the torch path
    exports to ONNX operators."""
    if torch.jit.is_tracing():  # also the TorchScript-based torch.onnx.export(..., dynamo=False)
        return "torch.jit.trace records no call of the fused kernels, which write through raw pointers"
    # Traced by torch.export inside torch.onnx.export: non-strict first, then, when that fails, strict (Dynamo).
    if traced and _onnx_exporting():
        return "torch.onnx.export has no ONNX function for posenc's fused-kernel ops"
    return ""


@assume_constant_result  # Dynamo (the strict export's retry) reads the exporter's flag as it traces
def _onnx_exporting() -> bool:
    # torch.onnx is imported by the exporter: a process that never imported it is not exporting.
    onnx = sys.modules.get("torch.onnx")
    return onnx is not None and onnx.is_in_onnx_export()


def _call_name(i: int, xs: Sequence[torch.Tensor], names: Sequence[str] | None) -> str:
    """The name errors give the i-th of (*xs, cos, sin); names: xs as the caller calls them (q, k), else x or xs[i]."""
    if i >= len(xs):
        return ("cos", "sin")[i - len(xs)]
    return names[i] if names is not None else f"xs[{i}]" if len(xs) > 1 else "x"


def _storage_problem(
    xs: Sequence[torch.Tensor], cos: torch.Tensor, sin: torch.Tensor, names: Sequence[str] | None = None
) -> str:
    """Why the fused kernels cannot read these tensors' values from their storage, or "" when they can (names: as
    ``_call_name``'s)."""
    tensors = (*xs, cos, sin)
    # Every call runs this: plain tensors pass a loop of two cheap tests (a generator, or a call per tensor, cost a
    # microsecond or more of a decode-size call's ~70), torch.Tensor looked up once.
    plain = torch.Tensor
    for t in tensors:
        if type(t) is not plain or t.is_neg():
            break
    else:
        return ""
    for i, t in enumerate(tensors):
        # The negative bit (torch._neg_view, z.conj().imag) marks a view whose storage holds the negated values:
        # the kernels read the storage, so a copy came out with the wrong sign.
        if runs_own_ops(t) or t.is_neg():
            name = _call_name(i, xs, names)
            if t.is_neg():
                return f"{name} is a negative view (its storage holds -{name}), which {name}.resolve_neg() materializes"
            return (
                f"{name} is a {type(t).__name__}, a tensor subclass that runs torch's operations itself "
                "(__torch_dispatch__), and the fused kernels read raw storage"
            )
    return ""


def _traced_dtensor_problem(
    xs: Sequence[torch.Tensor], cos: torch.Tensor, sin: torch.Tensor, names: Sequence[str] | None = None
) -> str:
    """Why a traced call (torch.compile, torch.export) cannot hold the fused ops: a DTensor among its tensors, or "".

    The ops have no sharding strategy, and ``register_sharding`` cannot give them one (it builds one output spec, and
    ``posenc::rotary`` returns a list): compiled, a DTensor call failed with "Operator posenc.rotary.default does not
    have a sharding strategy registered". Nor would running the kernels on each rank's shard be right in general: a
    shard of the sequence reads table rows from its local token index (offset, offsets, cu_seqlens), not its global
    one. The torch path's ops each have DTensor's own sharding rules, as in eager (``_storage_problem``)."""
    tensors = (*xs, cos, sin)
    for i, t in enumerate(tensors):
        if is_dtensor(t):
            name = _call_name(i, xs, names)
            return (
                f"{name} is a DTensor, and posenc's fused-kernel ops have no DTensor sharding strategy (the torch "
                "path's operations have DTensor's own)"
            )
    return ""


def _fused_problem(
    xs: Sequence[torch.Tensor],
    cos: torch.Tensor,
    sin: torch.Tensor,
    kind: str,
    inplace: bool,
    names: Sequence[str] | None = None,
    eager: bool = False,
) -> str:
    """Why the fused kernels cannot take this call, or "" when they can (names: as ``_call_name``'s; eager: as
    ``choose_backend``'s)."""
    traced = False if eager else compiling()
    recorded = "" if eager else _recorded_without_fused_kernels(traced)
    if recorded:
        return recorded
    problem = _traced_dtensor_problem(xs, cos, sin, names) if traced else _storage_problem(xs, cos, sin, names)
    if problem:
        return problem
    if torch.is_grad_enabled() and (cos.requires_grad or sin.requires_grad):
        return "cos/sin require grad and the fused kernels do not differentiate them"
    if transformed(*xs, cos, sin):
        return "torch.func transforms (vmap, grad, jacrev, ...) and forward-mode AD run on the torch path only"
    if kind == "broadcast" and any(x.dim() > 4 or x.dim() == 0 for x in xs):
        return "with broadcast cos/sin the fused kernels take x of 1 to 4 dims; reshape x or pass a table"
    dtypes = {x.dtype for x in xs}  # gathered once for both tests (each a generator cost ~0.3 us a call)
    if not dtypes <= DTYPE_CODES.keys():
        return f"the fused kernels take {list(DTYPE_CODES)}, got {xs[0].dtype}"
    if len(dtypes) > 1:
        return "q and k have different dtypes"
    if inplace and any(x.shape[-1] > 1 and x.stride(-1) != 1 for x in xs):
        return "in place needs unit stride in the last dim"
    return ""


def choose_backend(
    backend: str,
    xs: Sequence[torch.Tensor],
    cos: torch.Tensor,
    sin: torch.Tensor,
    kind: str,
    *,
    inplace: bool = False,
    names: Sequence[str] | None = None,
    eager: bool = False,
) -> str:
    """Resolve "auto" to "triton" (CUDA tensors), "cpu" (CPU tensors) or "torch"; check an explicit choice.

    xs: a list of the tensors to rotate (x, or q and k); names: what errors call them (default x, or xs[i]). Raises
    ValueError naming what is wrong when an explicit fused backend cannot take the call. eager: the caller has made
    sure that nothing traces the call (neither ``posenc._checks.compiling()`` nor ``torch.jit.is_tracing()``), which
    is then not asked again.
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {', '.join(repr(b) for b in BACKENDS)}, got {backend!r}")
    # Checked here, where it is public: an empty xs failed with IndexError, a list cos with AttributeError.
    if not isinstance(xs, (list, tuple)):
        raise TypeError(f"xs must be a list of tensors (x, or q and k), got {type(xs).__name__}")
    if not xs:
        raise ValueError("xs must hold at least one tensor (x, or q and k), got an empty list")
    # The names are formatted only for an error: building them on every call cost ~1 us of a decode step.
    for i, value in enumerate((*xs, cos, sin)):
        if not isinstance(value, torch.Tensor):
            name = f"xs[{i}]" if i < len(xs) else ("cos", "sin")[i - len(xs)]
            raise TypeError(f"{name} must be a torch.Tensor, got {type(value).__name__}")
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
    if backend == "torch":
        return "torch"
    problem = _fused_problem(xs, cos, sin, kind, inplace, names, eager)
    device = xs[0].device.type
    if backend == "auto":
        if problem:
            return "torch"
        if device == "cuda" and triton_available():
            return "triton"
        if device == "cpu" and _cpu_built():
            return "cpu"
        return "torch"
    if problem:
        raise ValueError(f"backend={backend!r} cannot take this call: {problem}; use backend='torch'")
    if backend == "cpu":
        if device != "cpu":
            raise ValueError(f"backend='cpu' needs CPU tensors, got {device}; use 'auto' or 'triton' for CUDA")
        if not _cpu_built():
            raise RuntimeError(f"backend='cpu' is unavailable: {cpu_unavailable_reason()}; use backend='torch'")
        return "cpu"
    if not _triton_imports():
        reason = _triton_module_or_error()[1]
        raise RuntimeError(f"backend='triton' is unavailable: {reason}; use backend='torch' or 'cpu'")
    return "triton"


def _kernel_table(xs: Sequence[torch.Tensor], cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.dtype, bool, bool]:
    """The dtype the kernels read cos/sin in, and whether reaching it takes a conversion, and a copy for strides."""
    wide = torch.float64 if torch.float64 in (xs[0].dtype, cos.dtype) else torch.float32
    restride = cos.stride() != sin.stride() or (cos.shape[-1] > 1 and cos.stride(-1) != 1)
    return wide, cos.dtype != wide or sin.dtype != wide, restride


def _wide_cos_sin(
    xs: Sequence[torch.Tensor],
    cos: torch.Tensor,
    sin: torch.Tensor,
    kind: Kind,
    positions: torch.Tensor | None,
    offsets: torch.Tensor | None,
    offset: int,
    rows: torch.Tensor | None = None,
    *,
    outside: str = "keep",
) -> tuple[torch.Tensor, torch.Tensor, int, torch.Tensor | None]:
    """cos/sin as the kernels read them: float32 (float64 when x or cos is), one set of strides, unit last stride;
    the offset to read them at; and ``rows``, each token's table row (``token_positions``) where tokens do not read
    consecutive rows, or None.

    Where that takes a copy (a float32 table for float64 x, Meta's ``view_as_real(freqs_cis)[..., 0]`` with a pair
    stride), only the rows that tokens read take it: a decode step reads one row of a table that may hold 128k.
    Consecutive rows are a slice (the offset becomes 0); other rows are gathered in token order, and ``rows`` becomes
    each token's index there. A token outside the table: ``outside="keep"`` copies the whole table instead, so the
    kernel refuses the call (the CPU kernel's message; this reads positions on the host); ``"nan"`` gathers a NaN
    row for it, as the Triton kernel gives such a token, without reading positions on the host (no sync).
    """
    wide, convert, restride = _kernel_table(xs, cos, sin)
    if convert or restride:
        if consecutive_rows(kind, positions, offsets):
            end = offset + max(canonical(x, kind).shape[2] for x in xs)
            if offset >= 0 and end <= cos.shape[0]:  # else the full table, for the launchers' message on rows
                cos, sin, offset = cos[offset:end], sin[offset:end], 0
        elif rows is not None and 0 < rows.numel() < cos.shape[0]:
            cos, sin, rows = _gathered_rows(cos, sin, rows, outside)
        # New row-major tensors, not .contiguous(), which returns a table of 0 or 1 rows as it is (torch counts it
        # contiguous whatever its row stride): cos and sin could keep different strides.
        cos, sin = (torch.empty(t.shape, dtype=wide, device=t.device).copy_(t) for t in (cos, sin))
    return cos, sin, offset, rows


def _gathered_rows(
    cos: torch.Tensor, sin: torch.Tensor, rows: torch.Tensor, outside: str
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The table rows that tokens read, in token order, and each token's index there (``_wide_cos_sin``)."""
    flat = rows.reshape(-1)
    n = cos.shape[0]
    inside = (flat >= 0) & (flat < n)
    if outside == "keep":
        if not bool(inside.all()):
            return cos, sin, rows
        cos, sin = cos.index_select(0, flat), sin.index_select(0, flat)
    else:
        # Clamped, so that no read leaves the table; the rows of tokens outside it are then made NaN.
        safe = flat.clamp(0, n - 1)
        cos, sin = (t.index_select(0, safe).masked_fill_(~inside[:, None], math.nan) for t in (cos, sin))
    return cos, sin, torch.arange(flat.numel(), device=rows.device).view(rows.shape)


def triton_plans(
    xs: Sequence[torch.Tensor],
    outs: Sequence[torch.Tensor],
    cos: torch.Tensor,
    sin: torch.Tensor,
    positions: torch.Tensor | None,
    offsets: torch.Tensor | None,
    offset: int,
    cu_seqlens: torch.Tensor | None,
    kind: Kind,
    interleaved: bool,
    conjugate: bool,
    copy_tail: bool,
    *,
    block_s: int | None = None,
    num_warps: int | None = None,
    heads_per_program: int | None = None,
    superblock: int | None = None,
) -> list:  # of posenc.kernels.triton_rope.Launch (imported lazily: importing it imports triton)
    """The Triton launches that rotating xs into outs makes (arguments as ``_rotary_impl``'s): one for q and k
    together, or one each where their (batch, token) sizes differ (broadcast cos/sin allow that); none if empty.
    block_s, num_warps, heads_per_program, superblock: a configuration other than the default
    (``triton_rope.plan_launch``), for tuning.

    Needs no GPU: ``posenc.kernels.triton_targets`` compiles these plans for GPU architectures on any machine.
    """
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
    module, reason = _triton_module_or_error()
    if module is None:
        raise RuntimeError(f"backend='triton' is unavailable: {reason}")
    rows = None
    if kind != "broadcast" and not consecutive_rows(kind, positions, offsets) and any(_kernel_table(xs, cos, sin)[1:]):
        # The table needs a copy: of the tokens' rows only, gathered on the device (rows computed there too).
        rows = _token_rows(xs, kind, positions, offsets, offset, cu_seqlens)
    cos, sin, offset, gathered = _wide_cos_sin(xs, cos, sin, kind, positions, offsets, offset, rows, outside="nan")
    if gathered is not rows:  # each token reads its own row of the gathered table: no offsets nor varlen to add
        positions, offsets, offset, cu_seqlens = gathered, None, 0, None
    if positions is not None:
        positions = (positions[None] if positions.dim() == 1 else positions).contiguous()
    # The kernel indexes offsets and cu_seqlens as dense arrays.
    offsets = offsets.contiguous() if offsets is not None else None
    cu_seqlens = cu_seqlens.contiguous() if cu_seqlens is not None else None
    pairs = [(canonical(x, kind), canonical(o, kind), x) for x, o in zip(xs, outs, strict=True) if x.numel()]
    if not pairs:  # nothing to rotate: an empty batch, heads or sequence
        return []
    first = pairs[0][0].shape
    together = all(v.shape[0] == first[0] and v.shape[2] == first[2] for v, _, _ in pairs)
    groups = [pairs] if together else [[pair] for pair in pairs]
    plans = []
    for group in groups:
        plan = module.plan_launch(  # type: ignore[attr-defined]
            [v for v, _, _ in group],
            [o for _, o, _ in group],
            [canonical_cos(cos, x, kind) for _, _, x in group],
            [canonical_cos(sin, x, kind) for _, _, x in group],
            positions=positions,
            offsets=offsets,
            offset=offset,
            cu_seqlens=cu_seqlens,
            interleaved=interleaved,
            conjugate=conjugate,
            copy_tail=copy_tail,
            table_rows=None if kind == "broadcast" else cos.shape[0],
            block_s=block_s,
            num_warps=num_warps,
            heads_per_program=heads_per_program,
            superblock=superblock,
        )
        if plan is not None:
            plans.append(plan)
    return plans


def _launch(
    xs: Sequence[torch.Tensor],
    outs: Sequence[torch.Tensor],
    cos: torch.Tensor,
    sin: torch.Tensor,
    positions: torch.Tensor | None,
    offsets: torch.Tensor | None,
    offset: int,
    cu_seqlens: torch.Tensor | None,
    kind: Kind,
    interleaved: bool,
    conjugate: bool,
    backend: str,
    copy_tail: bool,
) -> None:
    if backend == "triton":
        plans = triton_plans(
            xs, outs, cos, sin, positions, offsets, offset, cu_seqlens, kind, interleaved, conjugate, copy_tail
        )
        for plan in plans:
            _triton_module_or_error()[0].launch(plan)  # type: ignore[union-attr]
        return
    if backend != "cpu":
        raise ValueError(f"the rotary ops run backend 'cpu' or 'triton', got {backend!r}")
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
    # Nothing to rotate in an empty tensor, whose strides can be anything: the gradient of an empty output's sum
    # comes expanded (stride 0), which .contiguous() leaves as it is and the kernel's stride check refused.
    pairs = [(x, o) for x, o in zip(xs, outs, strict=True) if x.numel()]
    if not pairs:
        return
    xs, outs = [x for x, _ in pairs], [o for _, o in pairs]
    pos, first_row = None, 0
    if kind == "broadcast":
        # The CPU kernel broadcasts size-1 dims itself (stride 0): cos padded to 4-D, not expanded per x.
        cos, sin, _, _ = _wide_cos_sin(xs, cos, sin, kind, positions, offsets, offset)
        cos, sin = canonical(cos, kind), canonical(sin, kind)
    elif consecutive_rows(kind, positions, offsets):
        # The kernel enters the (n, r/2) table at row offset.
        cos, sin, first_row, _ = _wide_cos_sin(xs, cos, sin, kind, positions, offsets, offset)
    else:
        pos = _token_rows(xs, kind, positions, offsets, offset, cu_seqlens)
        cos, sin, _, pos = _wide_cos_sin(xs, cos, sin, kind, positions, offsets, offset, pos)
    jobs = [(canonical(x, kind), canonical(o, kind), cos, sin) for x, o in zip(xs, outs, strict=True)]
    rope_cpu_jobs(jobs, pos, first_row=first_row, interleaved=interleaved, conjugate=conjugate, copy_tail=copy_tail)


def _token_rows(
    xs: Sequence[torch.Tensor],
    kind: Kind,
    positions: torch.Tensor | None,
    offsets: torch.Tensor | None,
    offset: int,
    cu_seqlens: torch.Tensor | None,
) -> torch.Tensor:
    """Each token's table row, (b or 1, s) or (1, total_tokens) for varlen, computed on x's device."""
    batch = cu_seqlens.shape[0] - 1 if cu_seqlens is not None else xs[0].shape[0]
    return token_positions(
        kind,
        batch,
        canonical(xs[0], kind).shape[2],
        positions=positions,
        offsets=offsets,
        offset=offset,
        cu_seqlens=cu_seqlens,
        device=xs[0].device,
    )


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
    outs = [_output_like(x) for x in xs]
    _launch(xs, outs, cos, sin, positions, offsets, offset, cu_seqlens, kind, interleaved, conjugate, backend, True)  # type: ignore[arg-type]
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
    present = [i for i, g in enumerate(grads) if g is not None]
    result: list[torch.Tensor | None] = [None] * len(grads)
    if present and batched(*(grads[i] for i in present)):  # type: ignore[misc]
        # Batched gradients (jacobian(vectorize=True), grad(is_grads_batched=True)) have no storage for a kernel
        # to read ("Cannot access data pointer"): the torch path's formula, which vmap batches.
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
            [grads[i] for i in present],
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
    _launch(xs, xs, cos, sin, positions, offsets, offset, cu_seqlens, kind, interleaved, conjugate, backend, False)  # type: ignore[arg-type]
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
    kernels once the mode has seen it. (``torch.jit.trace`` never gets here: ``_fused_problem`` sends it to the torch
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
    torch.jit.trace never gets here, ``_fused_problem`` sends it to the torch path); in eager, ``_RotaryCopy`` when
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
