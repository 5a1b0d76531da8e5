"""Which backend rotates a call: "auto" resolved to Triton (CUDA tensors), the CPU kernel or the torch path, an
explicit choice checked, and the reasons a fused kernel is refused (a trace that cannot hold it, storage it cannot
read, a gradient of cos/sin, a torch.func transform, a dtype or layout it does not take), in words.

Imports no Triton until asked (``triton_module_or_error``), and nothing above ``posenc.kernels``.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Sequence

import torch
import torch.autograd.forward_ad as fwAD

from posenc._checks import compiling, is_dtensor, runs_own_ops
from posenc._compile_marks import assume_constant_result
from posenc.kernels.cpu_rope import DTYPE_CODES, cpu_available, cpu_unavailable_reason
from posenc.kernels.layout import KINDS

BACKENDS = ("auto", "torch", "triton", "cpu")
_FUSED_DTYPES = frozenset(DTYPE_CODES)


@functools.cache
def triton_module_or_error() -> tuple[object | None, str]:
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
    return triton_module_or_error()[0] is not None


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


def dense_gradient(grad: torch.Tensor | None) -> torch.Tensor | None:
    """An incoming gradient as a strided tensor: a sparse one (``y.backward(g.to_sparse())``, which torch's own ops
    take) stopped every path's backward with torch's bare "Cannot access storage of SparseTensorImpl" or
    "unsupported memory format option". Its dense values; the rotation mixes each pair's two channels, so x's
    gradient is no sparser."""
    return grad if grad is None or grad.layout is torch.strided else grad.to_dense()


def storage_problem(
    xs: Sequence[torch.Tensor], cos: torch.Tensor, sin: torch.Tensor, names: Sequence[str] | None = None
) -> str:
    """Why the fused kernels cannot read these tensors' values from their storage, or "" when they can (names: as
    ``_call_name``'s)."""
    tensors = (*xs, cos, sin)
    # Every call runs this: plain tensors pass a loop of two cheap tests (a generator, or a call per tensor, cost a
    # microsecond or more of a decode-size call's ~70), torch.Tensor looked up once.
    plain = torch.Tensor
    for t in tensors:
        if type(t) is not plain or t.is_neg() or t._is_zerotensor():
            break
    else:
        return ""
    for i, t in enumerate(tensors):
        # The negative bit (torch._neg_view, z.conj().imag) marks a view whose storage holds the negated values:
        # the kernels read the storage, so a copy came out with the wrong sign.
        if runs_own_ops(t) or t.is_neg() or t._is_zerotensor():
            name = _call_name(i, xs, names)
            if t.is_neg():
                return f"{name} is a negative view (its storage holds -{name}), which {name}.resolve_neg() materializes"
            if t._is_zerotensor():
                # torch's efficient zeros (some derivative formulas, forward-mode AD) have no storage: the kernels
                # read address 0, and the process died (SIGSEGV) where the torch path's operations take them.
                return f"{name} is a ZeroTensor (torch's zeros with no storage), which {name}.clone() materializes"
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
    one. The torch path's ops each have DTensor's own sharding rules, as in eager (``storage_problem``)."""
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
    problem = _traced_dtensor_problem(xs, cos, sin, names) if traced else storage_problem(xs, cos, sin, names)
    if problem:
        return problem
    if torch.is_grad_enabled() and (cos.requires_grad or sin.requires_grad):
        return "cos/sin require grad and the fused kernels do not differentiate them"
    if transformed(*xs, cos, sin):
        return "torch.func transforms (vmap, grad, jacrev, ...) and forward-mode AD run on the torch path only"
    if kind == "broadcast" and any(x.dim() > 4 or x.dim() == 0 for x in xs):
        return "with broadcast cos/sin the fused kernels take x of 1 to 4 dims; reshape x or pass a table"
    dtypes = {x.dtype for x in xs}  # gathered once for both tests (each a generator cost ~0.3 us a call)
    # issubset, not <=: Dynamo before torch 2.12 cannot trace a set's comparison operators (an "Observed exception"
    # under torch.compile of any fused call), and the GPU machines lent to this project run torch 2.11.
    if not dtypes.issubset(_FUSED_DTYPES):
        return f"the fused kernels take {list(DTYPE_CODES)}, got {xs[0].dtype}"
    if len(dtypes) > 1:
        return "q and k have different dtypes"
    if inplace:
        for i, x in enumerate(xs):
            if x.shape[-1] > 1 and x.stride(-1) != 1:
                name = _call_name(i, xs, names)
                return (
                    f"in place needs unit stride in the last dim, but {name} has stride {x.stride(-1)} there (a "
                    "channels-last or transposed view, or a slice with a step), which the fused kernels do not write"
                )
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
        reason = triton_module_or_error()[1]
        raise RuntimeError(f"backend='triton' is unavailable: {reason}; use backend='torch' or 'cpu'")
    refusal = _triton_device_refusal(device)
    if refusal:
        # Here, not at the launch: an in-place call with grad had recorded its autograd node by then, so x kept
        # its values under a graph that said they were rotated, and backward raised the same error again.
        raise ValueError(refusal)
    return "triton"


# device type -> device_refusal's answer, which cannot change once Triton is imported (interpreted or not).
_DEVICE_REFUSALS: dict[str, str] = {}


@assume_constant_result
def _triton_device_refusal(device: str) -> str:
    refusal = _DEVICE_REFUSALS.get(device)
    if refusal is None:
        refusal = _DEVICE_REFUSALS[device] = triton_module_or_error()[0].device_refusal(device)  # type: ignore[union-attr]
    return refusal
