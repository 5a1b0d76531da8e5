"""Replaying a checked eager call of the fused kernels: a decode step's rotation without its Python.

At decode size (one token of 32 + 8 heads of 128 channels) the CPU kernel takes ~2 us, and a call through
``apply_rotary_qk`` or ``RoPE`` took 51-66 us (an Intel VM, 2026-12-07), nearly all of it Python: checks, the choice
of backend, the canonical views, ``struct Args``. All of that depends on the tensors' metadata (types, shapes,
strides, dtypes, devices, dispatch keys), on the call's options and on global state (modes, tracing, transforms,
grad, a CUDA graph capture), never on their values. So the first call with a given metadata goes the whole way, and
the launch it made is kept as a plan, keyed by that metadata; a later call with the same key puts its own tensors
into a copy of it and launches the kernel, allocating the outputs as the full path does. The CPU kernel's plans
(``Plan``, here) keep the ``struct Args`` it was handed and call the library; Triton's (``triton_replay``) keep the
planned launch and go through Triton's launcher.

A plan is kept only where replaying it is exactly what the full path would launch again (``plan_of``): the kernel
read the caller's own x, cos and sin, and ids or offsets (no copy was made on the way), and wrote the outputs
returned (in place, the xs themselves), and the angles' pointers moved with the offset alone. Replays run only in
plain eager (``plain_eager``) and without gradients to record, so every path that needs the full machinery
(autograd, torch.compile, modes, transforms, subclasses) never meets a plan; the callers build the key
(``tensor_key``) and check the offset's range (``replay`` returns None outside it, and the full path then raises or
grows its table as it would have).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any, NamedTuple

import torch
import torch.autograd.forward_ad as fwAD

from posenc._checks import compiling
from posenc.kernels import cpu_rope, triton_replay
from posenc.kernels.cpu_rope import _ARGS, _POINTERS, _SEQ_FIELD, Launch
from posenc.kernels.huge_pages import MIN_BYTES, advised
from posenc.kernels.recording import record
from posenc.kernels.triton_replay import TritonPlan


class Plan(NamedTuple):
    """A launch of the CPU kernel with the pointers left out: what ``replay`` fills in for a call of the same key."""

    tails: tuple[bytes, ...]  # each job's struct Args past its pointers
    code: int
    wide: int
    run: Any
    row_bytes: int  # how far cos/sin's pointers move per unit of offset (0 without an int offset, or one row)
    last_offset: int  # the largest int offset whose rows the angles hold (0 without an int offset: none but 0)
    inplace: bool  # the outputs are the xs themselves
    advise: bool  # an output is big enough to ask for huge pages under (posenc.kernels.huge_pages.advised)


_STRIDED = torch.strided


def plain_eager() -> bool:
    """Whether nothing but eager execution sees this call: this thread neither compiles nor exports (another
    thread's compile leaves it eager: ``posenc._checks.compiling``), no dispatch or function mode (FakeTensorMode,
    make_fx, a logging mode, ``with torch.device(...)``), no torch.jit.trace, no torch.func transform and no
    forward-AD level. ~0.5 us. (A CUDA graph capture: ``tensor_key`` refuses CUDA tensors during one.)"""
    return not (
        compiling()
        or torch._C._len_torch_dispatch_stack()
        or torch._C._len_torch_function_stack()
        or torch._C._get_tracing_state() is not None
        or torch._C._are_functorch_transforms_active()
        or fwAD._current_level >= 0
    )


def rows_read(positions: object, offset: object) -> tuple[Any, Any, str | None]:
    """(the table row of the first token: an int offset, or None; the tensor the kernel reads each token's row from:
    the position ids, or a decode step's per-sequence offsets, or None; how the rows are read, for the key:
    "positions", "offsets", "offset", or None for cos/sin given per token) of a call's ``positions`` and
    ``offset``. The last tells apart calls whose tensors look alike: ids from per-sequence offsets of one shape, a
    (rows, r/2) table read from an offset from the same tensor given as per-token cos/sin."""
    if positions is not None:
        return None, positions, "positions"
    if isinstance(offset, torch.Tensor):
        return None, offset, "offsets"
    return offset, None, None if offset is None else "offset"


def tensor_key(t: object, grad: bool) -> tuple | None:
    """What of a tensor the full path's checks and decisions read: shape, strides, dtype and dispatch keys (a
    negative view, an inference tensor, a wrapped or batched tensor each have their own), and a CUDA tensor's device
    index; None for one that replays do not take: anything but a plain strided CPU or CUDA torch.Tensor (a
    subclass, another device, sparse, nested), one that requires grad while ``grad`` (grad mode) is on, and a CUDA
    tensor while a CUDA graph is captured on the current stream (a capture's calls hold what they read for the
    graph's life and read no values: the full path's business)."""
    if type(t) is not torch.Tensor or t.layout is not _STRIDED or t.is_nested:
        return None
    if grad and t.requires_grad:
        return None
    if t.is_cpu:
        return t.shape, t.stride(), t.dtype, torch._C._dispatch_keys(t).raw_repr()
    if t.is_cuda and not torch.cuda.is_current_stream_capturing():
        return t.shape, t.stride(), t.dtype, torch._C._dispatch_keys(t).raw_repr(), t.get_device()
    return None


def plan_of(
    launches: Sequence[Launch],
    xs: Sequence[torch.Tensor],
    outs: Sequence[torch.Tensor],
    cos: torch.Tensor,
    sin: torch.Tensor,
    offset: int | None,
    index: torch.Tensor | None = None,
) -> Plan | TritonPlan | None:
    """A plan of the launches a full call made (the CPU kernel's one, or Triton's: ``triton_replay``), or None when
    replaying them could differ from the full path.

    xs, outs: the call's tensors to rotate and the outputs it returned, in order (the xs themselves in place); cos,
    sin: the angles it was given, broadcast or read at ``index`` (``offset`` None) or (rows, r/2) tables read from
    row ``offset``; index: the tensor the kernel read each token's row from (position ids, or a decode step's
    per-sequence offsets), or None."""
    if launches and triton_replay.is_launch(launches[0]):
        return triton_replay.plan_of(launches, xs, outs, cos, sin, offset, index)
    if len(launches) != 1:
        return None
    launch = launches[0]
    if type(launch) is not Launch or len(launch.jobs) != len(xs):
        return None
    if offset is None:
        row_bytes, last_offset = 0, 0
    else:
        rows = cos.shape[0]
        row_bytes = cos.stride(0) * cos.element_size() if rows > 1 else 0
        seq = max(_ARGS.unpack(job)[_SEQ_FIELD] for job in launch.jobs)
        last_offset = rows - seq
    skip = (offset or 0) * row_bytes
    expected = (cos.data_ptr() + skip, sin.data_ptr() + skip, 0 if index is None else index.data_ptr())
    inplace = all(out is x for x, out in zip(xs, outs, strict=True))
    for job, x, out in zip(launch.jobs, xs, outs, strict=True):
        x_ptr, out_ptr, *read = _POINTERS.unpack_from(job)
        if x_ptr != x.data_ptr() or out_ptr != out.data_ptr() or tuple(read) != expected:
            return None  # a copy of x, of the angles or of the rows read, or another output: not replayable
        if inplace:
            continue
        if out.shape != x.shape or out.dtype != x.dtype or out.stride() != torch.empty_like(x).stride():
            return None
    tails = tuple(job[_POINTERS.size :] for job in launch.jobs)
    advise = not inplace and any(x.nbytes >= MIN_BYTES for x in xs)
    return Plan(tails, launch.code, launch.wide, launch.run, row_bytes, last_offset, inplace, advise)


def replay(
    plan: Plan | TritonPlan,
    xs: Sequence[torch.Tensor],
    cos: torch.Tensor,
    sin: torch.Tensor,
    offset: int | None,
    index: torch.Tensor | None = None,
) -> list[torch.Tensor] | None:
    """Rotated copies of xs by ``plan`` (of a key that these tensors match), or the xs rotated in place by an in-place
    plan, reading cos/sin from row ``offset`` or at the rows in ``index``; None when the angles have no rows there
    (the full path says why, or grows its table): an offset past them, or a row in ``index`` outside the table,
    which the kernel finds before it writes; also where the package's kernel library is not the one the plan's
    launch called (the tests swap in builds for older x86 levels, or none), so that a call runs the library, or the
    fallback, that the full path would."""
    if type(plan) is TritonPlan:
        return triton_replay.replay(plan, xs, cos, sin, offset)  # never a plan of ids or offsets (plan_of)
    first = offset or 0
    if not 0 <= first <= plan.last_offset:
        return None
    library = cpu_rope._library()[0]  # looked up on the module: what the tests swap in
    if library is None or library.posenc_rope_jobs is not plan.run:
        return None
    skip = first * plan.row_bytes
    cos_ptr, sin_ptr = cos.data_ptr() + skip, sin.data_ptr() + skip
    index_ptr = 0 if index is None else index.data_ptr()
    if plan.inplace:
        outs = list(xs)
    else:  # the xs have the plan's shapes and dtypes: only a plan of big outputs asks (~0.2 us an output)
        outs = [advised(torch.empty_like(x)) for x in xs] if plan.advise else [torch.empty_like(x) for x in xs]
    pack = _POINTERS.pack
    jobs = tuple(
        pack(x.data_ptr(), out.data_ptr(), cos_ptr, sin_ptr, index_ptr) + tail
        for x, out, tail in zip(xs, outs, plan.tails, strict=True)
    )
    status = plan.run(b"".join(jobs), len(jobs), plan.code, plan.wide)
    if status == 2 and index is not None:
        return None
    if status != 0:  # the plan's launch returned 0 with these very arguments but the pointers
        raise RuntimeError(f"the CPU kernel refused a replayed call (status {status}); please report this")
    record(Launch(jobs, plan.code, plan.wide, plan.run))
    if plan.inplace:
        # As the in-place op does (kernels.ops): autograd does not see writes through pointers, and a graph that saved
        # x before them would compute its gradient from the rotated values instead of raising.
        for x in xs:
            if not x.is_inference():
                torch.autograd.graph.increment_version(x)
    return outs


class Plans:
    """Plans by key, the latest ``size`` kept (a prefill of each length makes one). Reads take no lock."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._plans: dict[Any, Any] = {}
        self._lock = threading.Lock()

    def get(self, key: Any) -> Any:
        return self._plans.get(key)

    def put(self, key: Any, plan: Any) -> None:
        with self._lock:
            self._plans.pop(key, None)
            self._plans[key] = plan
            while len(self._plans) > self.size:
                del self._plans[next(iter(self._plans))]

    def clear(self) -> None:
        with self._lock:
            self._plans.clear()

    def __len__(self) -> int:
        return len(self._plans)
