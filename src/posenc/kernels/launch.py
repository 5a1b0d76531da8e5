"""How a rotation reaches the fused kernels: cos/sin brought to the dtype and strides the kernels read (copying
only the rows that tokens read), each token's table row where rows are not consecutive, and the launches, Triton's
planned (``triton_plans``) or the CPU kernel's jobs. No autograd and no backend choice here (``posenc.kernels.ops``,
``posenc.kernels.backend``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from posenc.kernels.backend import triton_module_or_error
from posenc.kernels.cpu_rope import rope_cpu_jobs
from posenc.kernels.layout import KINDS, Kind, canonical, canonical_cos, consecutive_rows, token_positions
from posenc.kernels.recording import record


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
    """The Triton launches that rotating xs into outs makes (arguments as ``launch``'s): one for q and k
    together, or one each where their (batch, token) sizes differ (broadcast cos/sin allow that); none if empty.
    block_s, num_warps, heads_per_program, superblock: a configuration other than the default
    (``triton_rope.plan_launch``), for tuning.

    Needs no GPU: ``posenc.kernels.triton_targets`` compiles these plans for GPU architectures on any machine.
    """
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
    module, reason = triton_module_or_error()
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


def launch(
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
    """Rotate xs into outs (outs may be xs: in place) with the 'cpu' or 'triton' kernel; the other arguments as the
    ``posenc::rotary`` op's (``posenc.kernels.ops``); copy_tail: copy channels past r into outs too."""
    if backend == "triton":
        plans = triton_plans(
            xs, outs, cos, sin, positions, offsets, offset, cu_seqlens, kind, interleaved, conjugate, copy_tail
        )
        for plan in plans:
            triton_module_or_error()[0].launch(plan)  # type: ignore[union-attr]
            record(plan)  # what posenc.kernels.replay may repeat
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
