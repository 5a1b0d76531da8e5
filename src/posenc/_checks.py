"""Argument checks shared by every encoding: each error names the argument and what would be valid."""

from __future__ import annotations

import contextlib
import math
import numbers
import operator
import os
import sys
from typing import Any

import torch
from torch._guards import CompileContext, TracingContext
from torch._subclasses.fake_tensor import FakeTensor


def compiling() -> bool:
    """Whether this thread traces posenc's code for torch.compile or torch.export: what posenc asks instead of
    ``torch.compiler.is_compiling()``, which in torch 2.13 is one flag for the whole process, True in every thread
    while any thread compiles (another thread's eager call then took the traced path: ~6x the host time, and the
    errors meant for torch.compile, such as dynamic NTK's "pass seq_len=").

    Where Dynamo traces this function both of torch's queries fold to True, and the rest is never traced. Elsewhere
    the flag counts only in a thread that holds a compile's or an export's context, both thread-local: Dynamo's
    ``CompileContext`` for the whole compile (the backend, AOTAutograd, make_fx and fake implementations run inside
    it) and export's ``TracingContext`` around its make_fx trace. AOTAutograd traces the backward in the same
    thread (it turns autograd's worker threads off). Where the flag is off this costs one call more than torch's
    query; ~1 us where another thread holds it (a missing thread-local attribute is slow to look up)."""
    if not torch.compiler.is_compiling():
        return False
    return (
        torch.compiler.is_dynamo_compiling()
        or CompileContext.try_get() is not None
        or TracingContext.try_get() is not None
    )


def integer_offset(value: Any) -> Any:
    """numpy's integers (any ``numbers.Integral`` but bool and int) as a Python int, as ``integer`` takes them, for
    the arguments that also take a tensor (offsets), whose checks judge the rest; anything else unchanged."""
    if type(value) is int or value is None:  # every call's case: a type test where the ABC's costs ~0.3 us
        return value
    if isinstance(value, numbers.Integral) and not isinstance(value, (bool, int, torch.SymInt)):
        return operator.index(value)
    return value


def refuse_jit_trace(what: str) -> None:
    """Raise RuntimeError naming ``what`` while torch.jit.trace records (the TorchScript-based
    ``torch.onnx.export(..., dynamo=False)`` too): it hands Python code sizes as tensors, so the size checks and
    tables here failed deep inside (AttributeError: 'Tensor' object has no attribute 'bit_length'; "Unsupported
    value kind: UInt"), and decisions taken in Python would be baked into the trace."""
    if torch.jit.is_tracing():
        raise RuntimeError(
            f"{what} cannot be recorded by torch.jit.trace (nor by torch.onnx.export(..., dynamo=False), which "
            "traces with it): export with torch.export.export, or torch.onnx.export(..., dynamo=True) (the default), "
            "which take it, lengths and offsets included; apply_rotary and apply_rotary_qk given cos/sin do trace"
        )


def int64_int(name: str, value: int) -> None:
    """An int that becomes an int64 position: past 2**63 - 1 torch would raise OverflowError, or wrap it negative."""
    if not compiling() and not -(2**63) <= value < 2**63:
        raise ValueError(f"{name} must fit in int64 (below 2**63, a token position), got {value}")


def wrapped_positions(ids: torch.Tensor | None) -> ValueError | None:
    """Where offset + position ids came out negative, though every offset was checked >= 0: the error saying the sum
    wrapped past int64 when no id is negative either (``ids`` None: there are none), else None (a negative id). The
    ids whole where they are a DTensor: a rank whose shard held no negative id said "must fit in int64"."""
    if ids is not None and bool((replicated_values(ids) < 0).any()):
        return None
    return ValueError(
        "offset + position ids must fit in int64 (below 2**63, a token position), got a sum past 2**63 - 1"
    )


def host_min_max(t: torch.Tensor) -> tuple[int, int]:
    """(min, max) of a non-empty integer tensor, read on the host with one device sync, not two. A decode step's
    one id is read as it is (~0.2 us on the CPU, where aminmax, stack and tolist cost ~3 us of a ~100 us step)."""
    if t.numel() == 1:
        (value,) = host_list(replicated_values(t).reshape(1))
        return value, value
    low, high = host_list(replicated_values(torch.stack(torch.aminmax(t))))
    return low, high


def host_list(t: torch.Tensor) -> Any:
    """``t.tolist()``, also inside ``torch.func.functionalize``: there every tensor is a C++ functional wrapper
    without storage, whose ``.tolist()`` raised torch's bare "tolist() shouldn't be called on a tensor with
    unallocated storage" (its ``.item()`` works, and so does this), also inside a grad or jvp level under it
    (``functionalize(grad(f))``: a grad wrapper around a functional one). The wrapped tensor holds the same values,
    read once pending in-place updates are applied (``torch._sync``). Nothing is asked of a plain tensor: the
    wrappers are unwrapped only where ``.tolist()`` refused (~0.1 us a query on every eager call otherwise)."""
    try:
        return t.tolist()
    except RuntimeError:
        if not (torch._is_functional_tensor(t) or torch._C._functorch.is_gradtrackingtensor(t)):
            raise
    return _value_holder(t).tolist()


def _value_holder(t: torch.Tensor) -> torch.Tensor:
    """t without the functional and grad (or jvp) wrappers of torch.func's levels around it, outermost first: the
    tensor that holds its values (a batched one where vmap batches it)."""
    functorch = torch._C._functorch
    while True:
        if torch._is_functional_tensor(t):
            torch._sync(t)
            t = torch._from_functional_tensor(t)
        elif functorch.is_gradtrackingtensor(t):
            t = functorch.get_unwrapped(t)
        else:
            return t


def is_dtensor(t: torch.Tensor) -> bool:
    """Whether t is a DTensor. DTensor's module is in sys.modules wherever a DTensor exists, so posenc does not import
    it (that costs posenc's import ~0.3 s). Dynamo traces the check (the type test and isinstance fold as it traces)."""
    if type(t) is torch.Tensor:
        return False
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and isinstance(t, module.DTensor)


def first_dtensor(*tensors: Any) -> torch.Tensor | None:
    """The first DTensor among tensors (None and ints allowed), or None. Plain tensors, ints and None pass with a type
    test each: this runs on every rotation."""
    plain = torch.Tensor
    for t in tensors:
        if t is not None and type(t) is not plain and type(t) is not int and is_dtensor(t):
            return t
    return None


def replicated_values(t: torch.Tensor) -> torch.Tensor:
    """t, or where t is a DTensor (position ids, offsets or cu_seqlens distributed with x) its whole value as a plain
    tensor on every rank: DTensor refuses ``.tolist()`` and has no sharding strategy for ``torch._assert_async``."""
    return t.full_tensor() if is_dtensor(t) else t


# Index dtypes int_tensor takes that torch's indexing reads as something else (uint8: a mask) or refuses.
_NARROW_INDEX_DTYPES = (torch.uint8, torch.int8, torch.int16)


def index_values(t: Any) -> Any:
    """t, or where t is a tensor with the negative bit (``torch._neg_view``) a copy holding its values; anything else
    (None, an int) as it is. Such an index tensor's storage holds the negated values, which torch's own indexing
    (``table[ids]``, torch 2.13) and the fused kernels read: position ids, offsets or cu_seqlens given so picked the
    wrong table rows without an error.

    Traced (torch.compile, torch.export), every index tensor gets a ``resolve_neg()``: Dynamo cannot ask ``is_neg()``
    (a graph break, an error under fullgraph), and the backends eager and aot_eager run ``table[ids]`` as eager does
    (max error 6.6 for apply_rotary's positions on the torch path). Where the bit is clear AOTAutograd drops it (no op
    in the compiled graph), as ``run_decompositions`` does (ONNX, AOTInductor); torch.export's own graph shows it.
    Inductor still reads a negative view's storage, whatever posenc does (pytorch/pytorch#145093); posenc's range
    checks then fail on the negated ids.

    A ZeroTensor (torch's zeros without storage) comes back as a tensor of zeros.

    A uint8 tensor comes back as int64: torch reads a uint8 index as a boolean mask (``table[ids]`` of the ids
    0..255 gave the 255 rows of the nonzero ones, without an error). So do int8 and int16, which ``int_tensor``
    takes but torch refuses as an index ("tensors used as indices must be long, int, byte or bool tensors", from
    ``RoPE.cos_sin``'s table lookup)."""
    if not isinstance(t, torch.Tensor):
        return t
    if t.dtype in _NARROW_INDEX_DTYPES:
        return t.long()  # a copy, which holds the values whatever the negative bit said
    if compiling():
        return t.resolve_neg()
    if t._is_zerotensor():
        # torch's storage-less zeros (data pointer 0): the fused kernels read no ids there and rotated by rows
        # 0, 1, 2, ... (max error 5.2), and torch's own table[ids] crashed (torch 2.13). clone() materializes them.
        return t.clone()
    return t.resolve_neg() if t.is_neg() else t


def replicated_like(t: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """t as a DTensor replicated on ``like``'s mesh where ``like`` is a DTensor and t a plain tensor, else t: a plain
    cos/sin, position ids, offsets or cu_seqlens given with DTensor activations, taken as the whole value (the same on
    every rank, as the same call on plain full tensors reads it). DTensor refuses to mix the two in one operation
    ("got mixed torch.Tensor and DTensor"); replicated, its own sharding rules pick each rank's rows."""
    if not is_dtensor(like) or is_dtensor(t):
        return t
    module = sys.modules["torch.distributed.tensor"]
    mesh = like.device_mesh
    return module.DTensor.from_local(t, mesh, [module.Replicate()] * mesh.ndim, run_check=False)


def laid_out_as(t: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """t, computed from the whole values of the DTensor ``like`` and of its shape, as a DTensor laid out as ``like`` is
    (each rank keeps its own rows of the replicated value, no communication): what posenc returns for DTensor ids
    where the computation itself needs the whole (a run that crosses shards, a plain table indexed by them)."""
    return replicated_like(t, like).redistribute(like.device_mesh, like.placements)


def user_stacklevel() -> int:
    """The ``stacklevel`` for ``warnings.warn`` that points at the first frame outside posenc: the user's call,
    however deep inside posenc the warning is raised (Python 3.12's ``skip_file_prefixes``, by hand)."""
    package = os.path.dirname(os.path.abspath(__file__)) + os.sep
    frame, level = sys._getframe(1), 1  # level 1: the caller of this function, which calls warnings.warn
    while frame is not None and os.path.abspath(frame.f_code.co_filename).startswith(package):
        frame, level = frame.f_back, level + 1
    return level


# Looked up once: these run on every call, where each attribute lookup on torch costs ~20 ns.
_dispatch_mode = torch._C._get_dispatch_mode
_dispatch_modes_on = torch._C._len_torch_dispatch_stack  # counts the fake and proxy modes too
_FAKE_MODE = torch._C._TorchDispatchModeKey.FAKE
_PROXY_MODE = torch._C._TorchDispatchModeKey.PROXY
_function_modes_on = torch._C._is_torch_function_mode_enabled  # make_fx(pre_dispatch=True) pushes one
_pre_dispatch_mode = torch._ops._get_dispatch_mode_pre_dispatch
_STRIDED = torch.strided


def fake_mode_active() -> bool:
    """Whether a ``FakeTensorMode`` is on (shape inference by torch's memory and FLOP estimators, say): its tensors,
    on any device, have shapes but no values, as on the meta device, and the tensors it makes are fake too. False
    while torch.compile traces (its own fake mode, which the traced paths serve; Dynamo cannot trace the query)."""
    if not torch.compiler.is_compiling():  # eager, every call: the query alone (~0.2 us less)
        return _dispatch_mode(_FAKE_MODE) is not None
    return not compiling() and _dispatch_mode(_FAKE_MODE) is not None


def recording() -> bool:
    """Whether make_fx records a graph in this thread (its proxy mode is on; functorch.compile's aot_function runs
    it too). A value read on the host there is not in the graph: a check passed on the example and never ran again,
    and a table sized, or a dynamic NTK length scaled, from the example's ids was baked in (at replay ids past the
    256-row table raised torch's IndexError, a negative id read the table's last rows, and dynamic NTK scaled every
    call for the example's length, all without a posenc error). In "real" mode the example's values were read
    (``.tolist()`` slips past make_fx's refusal of data-dependent reads, ``.item()`` raised it from deep inside).
    make_fx(pre_dispatch=True) keeps its proxy mode on a stack of its own, which the dispatch-mode query misses."""
    return _dispatch_mode(_PROXY_MODE) is not None or pre_dispatch_recording()


def pre_dispatch_recording() -> bool:
    """Whether make_fx(pre_dispatch=True) records: its proxy mode sits on the pre-dispatch stack (process-wide), asked
    only where a torch function mode is on in this thread (its PreDispatchTorchFunctionMode is; ~50 ns otherwise)."""
    return _function_modes_on() and _pre_dispatch_mode(_PROXY_MODE) is not None


def values_readable(device: torch.device | str | None) -> bool:
    """Whether a check may read tensor values on the host (a device sync): not while torch.compile traces (the
    graph would break), while make_fx records (``recording``: the graph would hold the example's values) nor while a
    CUDA graph captures on the current stream (the capture would fail). Checks of values are skipped there (or run
    with the graph), and on the meta device and under a FakeTensorMode, which have none (shape inference: a read
    raised torch's DataDependentOutputException); shapes, dtypes and devices are still checked."""
    # torch's process-wide flag asked once (~0.1 us a query): when it is off, compiling() is False and
    # fake_mode_active() is the dispatch mode's query alone.
    if torch.compiler.is_compiling():
        if compiling() or fake_mode_active() or recording():
            return False
    elif _dispatch_modes_on() and (_dispatch_mode(_FAKE_MODE) is not None or _dispatch_mode(_PROXY_MODE) is not None):
        return False  # the count first: with no mode on (every eager call) one query, ~2x faster than one by key
    elif pre_dispatch_recording():
        return False
    # A torch.device as it is: torch.device(device) costs ~0.4 us of a decode-size call.
    if isinstance(device, torch.device):
        kind = device.type
    else:
        kind = torch.device(device).type if device is not None else None
    return kind != "meta" and not (kind == "cuda" and torch.cuda.is_current_stream_capturing())


def autocast_on(device: torch.device) -> bool:
    """Whether autocast is enabled for ``device``'s type. False for a type autocast does not know (meta), for which
    ``torch.is_autocast_enabled`` raises."""
    return torch.amp.is_autocast_available(device.type) and torch.is_autocast_enabled(device.type)


def autocast_off(device: torch.device) -> contextlib.AbstractContextManager:
    """A context with autocast disabled for ``device``'s type where it is on: float32 computations meant as float32
    (a score bias, attention probabilities), which autocast would cast to bf16/fp16."""
    return torch.autocast(device.type, enabled=False) if autocast_on(device) else contextlib.nullcontext()


def assert_without_sync(condition: torch.Tensor, message: str) -> None:
    """Where values may not be read (``values_readable`` is False), still refuse what eager refuses: a check that
    runs with the computation, not on the host. A RuntimeError with ``message`` when the graph runs on the CPU, a
    device-side assert on CUDA; nothing on the meta device. condition: a bool tensor, true where valid."""
    torch._assert_async(replicated_values(condition.all()), message)


def size_in(size: Any, allowed: tuple) -> bool:
    """``size in allowed``, written out as comparisons: torch.compile (2.13) evaluates ``in`` over a tuple that holds
    a symbolic size wrongly (``2 in (1, s0)`` came out False with s0 = 2, so a dynamic batch refused a right shape)."""
    return any(size == value for value in allowed)


def integer(
    name: str,
    value: Any,
    *,
    low: int | None = None,
    high: int | None = None,
    expected: str | None = None,
    type_error: type[Exception] = ValueError,
    symbolic: bool = False,
    fix: bool = True,
) -> Any:
    """The one rule for an integer argument: any ``numbers.Integral`` but bool (numpy's integers too) is taken and
    returned as a plain Python int (``operator.index``), so that what is stored, handed to torch or written to JSON
    is an int; bool, float, str and tensors (a 0-d tensor is not read as an int here: arguments that take tensors,
    such as offsets, take them before this check) are refused with ``type_error``, and values outside
    [low, high) with ValueError: "{name} must be {expected}, got {value!r}", with the fix where there is one.

    expected: the wording of the errors (default from low/high: "a positive integer" for low=1, "an integer >= 0",
    "an integer in [low, high)"). symbolic: a ``torch.SymInt`` (what torch.export hands for a size taken from a
    dynamic shape) passes as it is, checked against low/high (a guard), as Dynamo's symbolic ints, which are ints.
    fix: say what to pass instead of a whole float, a bool or a one-element tensor (False: the message ends at the
    value, where callers pin it whole).
    """
    if type(value) is not int:  # every call's case is a plain int: one type test (the ABC's costs ~0.3 us)
        if isinstance(value, int) and not isinstance(value, bool):
            pass  # an int's subclass, or a symbolic int as Dynamo shows it: read as it is (no guard on its value)
        elif symbolic and isinstance(value, torch.SymInt):
            if (low is not None and value < low) or (high is not None and value >= high):
                # An int that varies between compiled calls cannot be formatted; its value (a guard) can.
                raise ValueError(f"{name} must be {_expected(expected, low, high)}, got {operator.index(value)!r}")
            return value
        elif isinstance(value, bool) or not isinstance(value, numbers.Integral):
            raise type_error(
                f"{name} must be {_expected(expected, low, high)}, got {value!r}{int_fix(value) if fix else ''}"
            )
        else:
            value = operator.index(value)  # numpy's integers
    if (low is not None and value < low) or (high is not None and value >= high):
        raise ValueError(f"{name} must be {_expected(expected, low, high)}, got {value!r}")
    return value


def _expected(expected: str | None, low: int | None, high: int | None) -> str:
    if expected is not None:
        return expected
    if high is not None:
        return f"an integer in [{0 if low is None else low}, {high})"
    if low is None:
        return "an integer"
    return "a positive integer" if low == 1 else f"an integer >= {low}"


def int_fix(value: Any) -> str:
    """What to pass instead of a value that is no integer, where one is meant: a whole float or a one-element
    integer tensor as int(...) (neither is read as an int silently: a float may have been rounded, and a tensor's
    value lives on its device); a bool is no count."""
    if isinstance(value, bool):
        return " (a bool); pass an int"
    if isinstance(value, float) and value.is_integer():
        return f"; pass the int {int(value)}"
    if isinstance(value, torch.Tensor) and value.numel() == 1 and not value.is_floating_point():
        return "; pass a Python int (tensor.item())"
    return ""


def positive_int(name: str, value: Any) -> int:
    """A count or size >= 1, as a plain int (numpy's integers too): ``integer`` with low=1."""
    return integer(name, value, low=1)


def sequence_length(name: str, value: Any) -> int | None:
    """None (a length derived from the positions) or a positive int, refused alike by encodings that ignore it, so
    that a bad value shows before a config switches to one that reads it. torch.export hands a length taken from a
    dynamic size (positions.shape[-1]) as a torch.SymInt, which is no int: taken as it is (it was refused as "must be
    a positive integer, got s80", and dynamic NTK could not be exported with any seq_len but a constant)."""
    if value is None:  # the common case, asked on every call
        return None
    # The message is pinned whole for every scaling type (tests/rope/test_module_compile_checks.py): no fix added.
    return integer(name, value, low=1, expected="a positive integer (a sequence length)", symbolic=True, fix=False)


def even_positive_int(name: str, value: Any) -> int:
    value = positive_int(name, value)
    if value % 2:
        raise ValueError(
            f"{name} must be even (channels are rotated or encoded in pairs), got {value}; "
            f"use {value - 1} or {value + 1}"
        )
    return value


def float_dtype(name: str, value: Any) -> torch.dtype:
    """A dtype for encoding values: a floating-point one (an integer dtype would truncate them to 0 and +-1)."""
    if not isinstance(value, torch.dtype) or not value.is_floating_point:
        raise TypeError(f"{name} must be a floating-point torch.dtype (torch.float32, bfloat16...), got {value!r}")
    return value


def flag(name: str, value: Any) -> bool:
    """A True/False argument: anything else (the string "False" is truthy) is refused, not read by its truth."""
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be True or False, got {value!r}")
    return value


def may_overlap(x: torch.Tensor) -> bool:
    """Whether two indices of x may address the same element: with its dims of size > 1 ordered by stride, each
    stride must reach past the whole extent of the dims before it. Slices with gaps (q cut out of a fused qkv
    projection) pass; expanded (stride 0) and unfolded views do not. A few exotic layouts that do not overlap fail
    this sufficient test too; they are refused rather than risked."""
    reach = 1
    for stride, size in sorted((abs(st), sz) for st, sz in zip(x.stride(), x.shape, strict=True) if sz > 1):
        if stride < reach:
            return True
        reach = stride * size
    return False


def inplace_refused(names: str, error: RuntimeError) -> RuntimeError:
    """autograd's refusal (``error``, raised before anything was written) to let an in-place rotation change
    ``names``, saying so and what to do instead. torch's own message says why (a view of a leaf, one of several
    views made by one op: unbind, split). torch.func.vmap refuses too, before writing, where x is not batched but
    cos/sin are (each batch entry would write its own rotation into the one x): that is said as vmap's."""
    if str(error).startswith("vmap:"):
        return RuntimeError(
            f"torch.func.vmap refuses the in-place rotation of {names}, and nothing was rotated: {names} is not "
            f"batched but cos/sin are, so each batch entry would write its own rotation into the one tensor. Rotate a "
            f"copy with apply_rotary instead, or batch {names} too. (vmap said: {error})"
        )
    return RuntimeError(
        f"autograd refuses to let the rotation change {names} in place, and nothing was rotated: {error} Rotate a "
        "copy with apply_rotary instead (or, where no gradient should flow through the rotation, rotate under "
        "torch.no_grad())"
    )


def real_scalar(name: str, value: Any) -> Any:
    """A one-element real tensor as its Python number, anything else unchanged for the caller's checks: a real
    parameter (rope_theta, a scaling factor, an entry of a factor list saved as a tensor) is taken as a number of any
    kind, Python's, numpy's or torch's. Integer arguments (``integer``) stay refused as tensors, with the fix."""
    if isinstance(value, torch.Tensor) and value.numel() == 1 and not value.dtype.is_complex:
        if value.device.type == "meta":  # torch's bare "Tensor.item() cannot be called on meta tensors" before
            raise TypeError(
                f"{name} is a meta tensor, which holds no value to read; pass a number, or a tensor on the CPU"
            )
        return value.item()
    return value


def base_value(name: str, value: Any) -> float:
    value = real_scalar(name, value)
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a real number > 1, got {type(value).__name__}")
    value = float(value)
    if not math.isfinite(value) or value <= 1.0:
        raise ValueError(f"{name} must be a finite number > 1 (10000 is the usual choice), got {value}")
    return value


def float_tensor(name: str, x: Any) -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.is_nested:  # its ragged dim broke deep inside torch ("'NestedIntNode' object has no attribute 'add'")
        packed, jagged = "", name
        if x.layout is _STRIDED:
            # torch.nested's default layout has no offsets(), and its values() is a flat buffer (total_tokens*h*d,).
            packed, jagged = (
                f"(jagged = torch.nested.nested_tensor(list({name}.unbind()), layout=torch.jagged)) ",
                "jagged",
            )
        raise TypeError(
            f"{name} is a nested tensor, which posenc does not take: pass packed sequences {packed}as "
            f"{jagged}.values() (total_tokens, h, d) with cu_seqlens={jagged}.offsets() to apply_rotary, or pad "
            f"them to (b, s, ...) ({name}.to_padded_tensor(0.0))"
        )
    if x.layout is not _STRIDED:  # sparse: broke deep inside torch ("unsupported memory format option Contiguous")
        raise TypeError(f"{name} is a {x.layout} tensor, which posenc does not take: pass {name}.to_dense()")
    if x.is_complex():
        raise TypeError(_complex_refused(name, x.dtype))
    if not x.is_floating_point():
        raise TypeError(f"{name} must be a floating-point tensor, got dtype {x.dtype}; cast it with .float()")
    return x


def _complex_refused(name: str, dtype: torch.dtype) -> str:
    """The error for a complex tensor: the integer dtypes' fix, .float(), would drop its imaginary part (a complex
    ``freqs_cis`` passed as cos and sin so rotated by cos(angle) twice, without an error)."""
    if name in ("cos", "sin"):
        fix = (
            "Meta's complex freqs_cis (s, r/2) is cos=freqs_cis.real, sin=freqs_cis.imag, with interleaved=True "
            "(its pairs are adjacent channels)"
        )
    else:
        fix = f"pass real values (a tensor viewed as complex pairs is torch.view_as_real({name}).flatten(-2))"
        if name in ("x", "q", "k"):
            fix += ", rotated with interleaved=True"
    refused = f"{name} is complex ({dtype}), which posenc does not take; {name}.float() would drop its imaginary part"
    return f"{refused}: {fix}"


# Integer dtypes that torch supports in arithmetic and comparisons; its uint16/32/64 lack most kernels (even `<`).
INDEX_DTYPES = (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8)


def int_tensor(name: str, x: Any, *, what: str = "positions", host_read: bool = False) -> torch.Tensor:
    """x itself if it is an integer tensor of a dtype torch computes with; ``what`` it holds names it in errors.
    host_read: the caller reads its values on the host (to check them), which a tensor vmap batches cannot give."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be an integer torch.Tensor, got {type(x).__name__}")
    if host_read and type(x) is not torch.Tensor and _unreadable_subclass(x):
        # Refused here, naming the argument: torch's own ".tolist() is not supported for tensor subclasses" came from
        # deep inside the range checks, which read the values on the host.
        raise TypeError(
            f"{name} is a {type(x).__name__}, a tensor subclass that runs torch's operations itself, whose values "
            f"posenc cannot read on the host to check them; pass {name} as a plain integer tensor (a DTensor is taken)"
        )
    if host_read and vmapped(x):
        # Its values are checked on the host (rows of a table, >= 0), which a vmapped tensor cannot give.
        raise ValueError(
            f"{name} cannot be batched by torch.func.vmap: posenc reads its values to check them; vmap over the "
            f"activations with {name} shared (in_dims=None for it), or loop over its batch"
        )
    if x.is_floating_point() or x.is_complex() or x.dtype == torch.bool:
        why = f"; float {what} lose integers above 256 in bf16/fp16" if x.is_floating_point() else ""
        raise TypeError(f"{name} must hold integer {what} (torch.long, or any integer dtype), got dtype {x.dtype}{why}")
    if x.dtype not in INDEX_DTYPES:
        raise TypeError(
            f"{name} has dtype {x.dtype}, which torch cannot compare or add on most devices; pass it as torch.long "
            "(or torch.int32)"
        )
    return x


def prefix_sums(cu_seqlens: Any) -> torch.Tensor:
    """cu_seqlens itself if it is flash-attention's (n_seq + 1,) integer prefix sums by type and shape (values are the
    caller's to check: ``posenc.positions.sequence_lengths``)."""
    int_tensor("cu_seqlens", cu_seqlens, what="prefix sums", host_read=True)
    if cu_seqlens.dim() != 1:
        raise ValueError(f"cu_seqlens must be 1-D (n_seq + 1,), got shape {tuple(cu_seqlens.shape)}")
    if cu_seqlens.shape[0] < 2:
        # It is 1-D: "must be 1-D (n_seq + 1,)" alone left the reader to work out that one entry is too few.
        raise ValueError(
            f"cu_seqlens must hold n_seq + 1 >= 2 prefix sums (0, then the end of each sequence: [0, total_tokens] "
            f"for one sequence), got shape {tuple(cu_seqlens.shape)}"
        )
    return cu_seqlens


def vmapped(x: torch.Tensor) -> bool:
    """Whether torch.func.vmap batches x, itself or inside its functional or grad wrappers: no values to read on
    the host, nor a batching rule for an assert. Plain and grad-wrapped tensors are readable."""
    if torch._C._functorch.is_batchedtensor(x):
        return True
    # Or inside functionalize's wrapper (vmap(functionalize(f)) batches the tensor it wraps), asked only where a
    # transform runs (~35 ns where none does) and not while Dynamo traces, which cannot trace the unwrapping.
    return torch._C._are_functorch_transforms_active() and not compiling() and _batched_inside(x)


def _batched_inside(x: torch.Tensor) -> bool:
    """Whether vmap batches the tensor inside x's functional (or grad) wrappers."""
    return torch._C._functorch.is_batchedtensor(_value_holder(x))


def runs_own_ops(t: torch.Tensor) -> bool:
    """Whether t is a tensor subclass that runs torch's operations itself (``__torch_dispatch__``: DTensor, a wrapper
    such as a logging or two-tensor subclass), other than a FakeTensor (the custom ops serve those: kernels.ops'
    ``_dispatched``). Its data pointer is not its values (a wrapper has no storage of its own): the fused kernels,
    which read raw storage, crashed on it. A subclass with ``__torch_function__`` alone (nn.Parameter) has plain
    storage and is not one."""
    return (
        type(t) is not torch.Tensor
        and torch._C._dispatch_keys(t).has(torch._C.DispatchKey.Python)
        and not isinstance(t, FakeTensor)
    )


def _unreadable_subclass(x: torch.Tensor) -> bool:
    """Whether x is such a subclass (``runs_own_ops``) other than a DTensor (read whole, ``replicated_values``); not
    asked while torch.compile traces, which cannot trace the dispatch-key query, nor under a FakeTensorMode, whose
    checks read no values: functorch.compile's aot_function and aot_module hand plain ids in as FunctionalTensors
    there."""
    return not (compiling() or fake_mode_active() or is_dtensor(x)) and runs_own_ops(x)


def same_device(names: tuple[str, str], a: torch.Tensor, b: torch.Tensor) -> None:
    if a.device != b.device:
        raise ValueError(f"{names[0]} is on {a.device} but {names[1]} is on {b.device}; move both to one device")


def attention_inputs(q: Any, k: Any, v: Any) -> None:
    """q (b, h, s, d), k (b, h, t, d), v (b, h, t, e): floating tensors on one device, k and v with q's batch and
    heads (grouped-query heads repeated), as posenc.attention.attend and attend_flex take them. Shapes only: no values
    are read, so it costs the same eager, compiled or on DTensors."""
    for name, x, rows in (("q", q, "s"), ("k", k, "t"), ("v", v, "t")):
        float_tensor(name, x)
        if x.dim() != 4:
            raise ValueError(f"{name} must have shape (b, h, {rows}, head_dim), got {tuple(x.shape)}")
    same_device(("q", "k"), q, k)
    same_device(("q", "v"), q, v)
    dtypes = {q.dtype, k.dtype, v.dtype}
    if len(dtypes) > 1 and (torch.float64 in dtypes or not autocast_on(q.device)):
        # Unchecked, SDPA refused the mix in its own words without a bias, and the bias and flex paths cast k and
        # v to q's silently. Under autocast, a float32 cache beside bf16 queries is autocast's to cast (as SDPA's),
        # float64 never.
        raise TypeError(
            f"q, k and v must have one dtype (outside autocast; float64 beside others under it too), got q "
            f"{q.dtype}, k {k.dtype}, v {v.dtype}; cast k and v with k.to(q.dtype), v.to(q.dtype)"
        )
    if k.shape[:2] != q.shape[:2] or v.shape[:2] != q.shape[:2]:
        raise ValueError(
            f"k and v must have q's batch and heads {tuple(q.shape[:2])}, got k {tuple(k.shape)} and v "
            f"{tuple(v.shape)}; with fewer key/value heads (grouped-query attention) repeat them to q's first: "
            "k.repeat_interleave(h // g, dim=1)"
        )
    if v.shape[2] != k.shape[2]:
        raise ValueError(f"k and v must hold the same keys, got {k.shape[2]} and {v.shape[2]} (dim 2)")
    if k.shape[3] != q.shape[3]:
        raise ValueError(f"k's head_dim must be q's, got {k.shape[3]} and {q.shape[3]} (dim 3)")


def encoding_heads(encoding: object, heads: int, holder: str) -> None:
    """Refuses a per-head encoding (one with ``num_heads``: ALiBi's slopes, T5's table) of another head count than
    the attention's ``heads``; holder: what has them, for the error. A bias of one head broadcasts over every head
    without a word, any other count fails deep in attention, and FlexAttention's score_mod read the first heads'
    bias (or indexed past the slopes inside the compiled kernel): all are the wrong model."""
    own = getattr(encoding, "num_heads", None)
    if own is not None and own != heads:
        raise ValueError(
            f"encoding {type(encoding).__name__} has num_heads={own} but {holder}; build the encoding with "
            f"{heads} heads"
        )


def movable(name: str, x: torch.Tensor, device: torch.device | str, what: str = "the activations") -> None:
    """Index tensors (positions, offsets, document ids) may come from another device than the activations, as CPU
    ids for CUDA activations do, and real ids may serve meta activations (shape inference), but meta ids, which
    have no values, cannot serve real activations."""
    device = torch.device(device)
    if x.device.type == "meta" and device.type != "meta":
        raise ValueError(
            f"{name} is on {x.device} but {what} on {device}: a meta tensor has no values to move; put both on "
            "one device"
        )


def to_device(name: str, x: torch.Tensor, device: torch.device | str, what: str = "the activations") -> torch.Tensor:
    """x moved to ``device``, where ``movable`` allows it."""
    movable(name, x, device, what)
    return x.to(device)


def angle_dtypes(cos: Any, sin: Any) -> None:
    """cos and sin: tensors in float32 or float64, one dtype. In bf16 / fp16 they carry 3-4 significant digits, an
    error of 1e-3 to 1e-2 in every rotated channel that the float32 math after them cannot take back."""
    float_tensor("cos", cos)
    float_tensor("sin", sin)
    if cos.dtype != sin.dtype:
        raise TypeError(f"cos and sin must share a dtype, got {cos.dtype} and {sin.dtype}")
    if cos.dtype not in (torch.float32, torch.float64):
        raise TypeError(
            f"cos/sin must be float32 or float64 (whatever x's dtype), got {cos.dtype}: "
            f"{torch.finfo(cos.dtype).bits}-bit cos/sin lose the angles' precision; build them in float32 "
            "(posenc.RoPE.cos_sin does) or pass cos.float(), sin.float()"
        )
