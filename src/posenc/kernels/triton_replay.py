"""Replaying a checked eager call's Triton launch: ``posenc.kernels.replay`` for ``backend='triton'``.

The host side of a Triton call is Python of the same kind as the CPU kernel's (checks, the choice of backend, the
canonical views, ``triton_rope.plan_launch``): 72-92 us of a decode step on an Intel VM, before Triton's own
launcher runs. A ``TritonPlan`` keeps the launches a full call planned (one, or one each for q and k) with their
tensors left out; a later call of the same key (``replay.tensor_key``: shapes, strides, dtypes, device) puts its
own q, k, outputs and cos/sin in their places, and its int offset where the table is read from one, and launches
through ``triton_rope.launch`` as the full path does (Triton's launcher then specializes on the new pointers'
alignment, and on the offset's value, as on any call).

Replayed only where nothing the full path checks depends on values it would read: cos/sin given per token
(broadcast) or a table read from an int offset, whose range is a host comparison. Calls with position ids, offset
tensors or ``cu_seqlens`` always take the full path: on the GPU their rows are checked on the host there (one sync),
where the kernel alone would give a token outside the table NaN instead of the full path's error or grown table.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import Any, NamedTuple

import torch

from posenc.kernels.recording import record

# Where plan_launch puts things in a launch's positional arguments (posenc.kernels.triton_rope): q, k, q's output,
# k's output, cos, sin, then positions, offsets and cu_seqlens (q stands in for the absent ones), then the int
# offset the table is read from.
_TENSOR_ARGS = 9
_OFFSET_ARG = 9


class Part(NamedTuple):
    """One planned launch with its tensors and int offset left out: which of the call's xs it rotates (``x``, and
    ``k`` for its second tensor: ``x`` again where it rotates one), and the rest as planned."""

    x: int
    k: int
    grid: tuple[int]
    rest: tuple[object, ...]  # the positional arguments after the tensors and the offset: ints of the key
    constants: dict[str, Any]
    options: dict[str, Any]


class TritonPlan(NamedTuple):
    """The Triton launches of a call (one for q and k together, or one each where their batch or token counts
    differ) with the call's tensors left out: what ``replay`` fills in."""

    parts: tuple[Part, ...]
    last_offset: int  # the largest int offset whose rows the table holds (0 for cos/sin given per token)
    inplace: bool  # the outputs are the xs themselves
    module: Any  # posenc.kernels.triton_rope, imported by the full call (importing it imports triton)


def is_launch(launch: object) -> bool:
    """Whether ``launch`` is a planned Triton launch (``triton_rope.Launch``; not imported unless Triton is)."""
    return type(launch).__module__ == "posenc.kernels.triton_rope" and type(launch).__name__ == "Launch"


def plan_of(
    launches: Sequence[Any],
    xs: Sequence[torch.Tensor],
    outs: Sequence[torch.Tensor],
    cos: torch.Tensor,
    sin: torch.Tensor,
    offset: int | None,
    index: torch.Tensor | None,
) -> TritonPlan | None:
    """The plan of a full call's Triton launches, or None where replaying them could differ from the full path: ids
    or offset tensors read (``index``), a copy of an x or of the angles on the way, other outputs than the ones
    returned, an x rotated twice or a non-empty one not at all."""
    if index is not None or not launches or not all(is_launch(launch) for launch in launches):
        return None
    pointers = [x.data_ptr() for x in xs]
    parts, covered, seq = [], set(), 0
    for launch in launches:
        args = launch.args
        if len(args) <= _OFFSET_ARG + 2 or args[_OFFSET_ARG] != (offset or 0):
            return None
        if not all(isinstance(arg, torch.Tensor) for arg in args[:_TENSOR_ARGS]):
            return None
        got = [arg.data_ptr() for arg in args[:_TENSOR_ARGS]]
        if got[0] not in pointers or got[1] not in pointers:
            return None
        i, j = pointers.index(got[0]), pointers.index(got[1])
        x = xs[i]
        expected = (x, xs[j], outs[i], outs[j], cos, sin, x, x, x)
        if got != [t.data_ptr() for t in expected] or {i, j} & covered:
            return None
        covered |= {i, j}
        seq = max(seq, args[_OFFSET_ARG + 2])  # n2: the tokens the launch reads rows for
        rest = tuple(args[_OFFSET_ARG + 1 :])
        parts.append(Part(i, j, launch.grid, rest, dict(launch.constants), dict(launch.options)))
    if any(i not in covered and xs[i].numel() for i in range(len(xs))):
        return None
    inplace = all(out is x for x, out in zip(xs, outs, strict=True))
    if not inplace:
        for x, out in zip(xs, outs, strict=True):
            if out.shape != x.shape or out.dtype != x.dtype or out.stride() != torch.empty_like(x).stride():
                return None
    last_offset = 0 if offset is None else cos.shape[0] - seq
    module = sys.modules[type(launches[0]).__module__]
    return TritonPlan(tuple(parts), last_offset, inplace, module)


def replay(
    plan: TritonPlan,
    xs: Sequence[torch.Tensor],
    cos: torch.Tensor,
    sin: torch.Tensor,
    offset: int | None,
) -> list[torch.Tensor] | None:
    """Rotated copies of xs by ``plan`` (of a key that these tensors match), or the xs rotated in place by an in-place
    plan; None where the table has no rows at ``offset`` (the full path says why, or grows its table)."""
    first = offset or 0
    if not 0 <= first <= plan.last_offset:
        return None
    outs = list(xs) if plan.inplace else [torch.empty_like(x) for x in xs]
    module = plan.module
    for part in plan.parts:
        x, k = xs[part.x], xs[part.k]
        args = (x, k, outs[part.x], outs[part.k], cos, sin, x, x, x, first, *part.rest)
        launch = module.Launch(part.grid, args, part.constants, part.options)
        module.launch(launch)  # looked up on the module: what the tests stub
        record(launch)
    if plan.inplace:
        # As the in-place op does (kernels.ops): autograd does not see a kernel's writes.
        for x in xs:
            if not x.is_inference():
                torch.autograd.graph.increment_version(x)
    return outs
