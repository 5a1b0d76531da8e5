"""Triton rotary kernel and its launcher (no autograd here; see ``posenc.kernels.ops``).

One launch rotates q and k together (GQA: different head counts). Each program rotates BLOCK_S tokens of HEADS
heads (2 by default, 1 where cos/sin differ by head) of q or of k: it loads the positions and cos/sin rows of those
tokens once, rotates the r/2 pairs of each head in float32 (float64 if cos is float64) and stores in x's dtype; with
COPY_TAIL it also copies channels r..d-1. The backward of a rotation is the same kernel with CONJUGATE (the rotation
by -angle is the transpose).

Positions, per token t of sequence i0: ``POS[i0, t]`` (HAS_POS) or t, plus ``OFFSETS[i0]`` (HAS_OFFSETS) plus
``offset``; with IS_VARLEN the tokens are packed (t is global), i0 is found by binary search in CU_SEQLENS and
the position restarts at 0 per sequence. The layout of x comes in as strides of the canonical (n0, n1, n2, d)
view (batch, head, token, channel) of ``posenc.kernels.layout``; only the channel stride must be 1.

Importing this module imports triton; set TRITON_INTERPRET=1 before importing it to run on CPU tensors.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import triton
import triton.language as tl

from posenc._checks import integer

_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


@triton.jit
def _narrow(v, out_ty: tl.constexpr, via_float32: tl.constexpr):
    """v in out_ty. float64 math stored into bf16/fp16 is rounded to float32 first (via_float32): torch's .to()
    rounds twice like that (its 16-bit types are built from a float), as the CPU kernel and the torch path do, so
    every backend gives the same bits; a direct float64 -> 16-bit rounding can differ where the float32 value is a
    tie. (The Triton interpreter also needs it: it casts float64 to bf16 as an integer.)"""
    if via_float32:
        v = v.to(tl.float32)
    return v.to(out_ty)


@triton.jit
def _rope_kernel(
    Q,
    K,
    OUT_Q,
    OUT_K,
    COS,
    SIN,
    POS,
    OFFSETS,
    CU_SEQLENS,
    offset,
    n_rows,
    n2,
    n_blocks,
    heads_q,
    heads_k,
    groups_q,
    n_groups,
    n_seq,
    search_steps,
    sq0,
    sq1,
    sq2,
    sk0,
    sk1,
    sk2,
    soq0,
    soq1,
    soq2,
    sok0,
    sok1,
    sok2,
    cq0,
    cq1,
    cq2,
    ck0,
    ck1,
    ck2,
    sp0,
    sp1,
    HALF: tl.constexpr,
    TAIL: tl.constexpr,
    DENSE_COS: tl.constexpr,
    BLOCK_S: tl.constexpr,
    SUPER_S: tl.constexpr,
    HEADS: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_T: tl.constexpr,
    INTERLEAVED: tl.constexpr,
    CONJUGATE: tl.constexpr,
    HAS_POS: tl.constexpr,
    HAS_OFFSETS: tl.constexpr,
    IS_VARLEN: tl.constexpr,
    COPY_TAIL: tl.constexpr,
    CHECK_ROWS: tl.constexpr,
    VIA_FLOAT32: tl.constexpr,
):
    # One flat grid of (i0, token block, head group), head groups fastest (within runs of SUPER_S token blocks,
    # below): CUDA caps grid dims 1 and 2 at 65535, which a batch, or the heads axis of a broadcast call given x as
    # (b * s, h, d), can pass. Head groups fastest so that the programs reading one token block's cos/sin rows run
    # together and all but the first find them in L2: with token blocks fastest each head group streamed the whole
    # table again, and on an H200 at s = 32k (16 MiB of float32 cos/sin against 640 MiB of q and k) that held the
    # forward to 0.74 of a copy's speed. n_blocks = cdiv(n2, BLOCK_S) comes from the host: computed here in i32,
    # n2 + BLOCK_S - 1 wraps near 2**31. A program rotates HEADS heads of one x (groups_q groups of q, then k's),
    # loading the tokens' positions and cos/sin rows once for all of them; the host keeps HEADS at 1 where cos/sin
    # differ between heads.
    pid = tl.program_id(0).to(tl.int64)
    if SUPER_S == 1:
        group = pid % n_groups
        pid_s = (pid // n_groups) % n_blocks
        i0 = pid // (n_groups * n_blocks)
    else:
        # Runs of SUPER_S token blocks: every head group covers a run's blocks before the next run starts, so a
        # head's tokens are read in stretches of SUPER_S * BLOCK_S, and a run's cos/sin rows (SUPER_S * BLOCK_S of
        # them) stay in L2 while all the head groups read them. The last run of a row i0 may be shorter.
        per_i0 = n_groups * n_blocks
        i0 = pid // per_i0
        rest = pid % per_i0
        run_first = (rest // (n_groups * SUPER_S)) * SUPER_S
        run_len = tl.minimum(n_blocks - run_first, SUPER_S)
        inner = rest - run_first * n_groups
        group = inner // run_len
        pid_s = run_first + inner % run_len
    # Groups past groups_q rotate k: the same code with k's pointers and strides, chosen by selects, not by an `if`:
    # triton 3.6 loses the pointers' 16-byte alignment at the join of an `if`'s branches and then stores one element
    # at a time (st.global.b16 for bf16, where a select keeps st.global.v4.b32; 3.9 vectorises both). The strides
    # are cast to one type: Triton passes an int argument as i32, or i64 past 2**31, or as the constant 1.
    is_q = group < groups_q
    first = tl.where(is_q, group, group - groups_q) * HEADS
    heads = tl.where(is_q, tl.cast(heads_q, tl.int64), tl.cast(heads_k, tl.int64))
    X = tl.where(is_q, Q + i0 * sq0, K + i0 * sk0)
    OUT = tl.where(is_q, OUT_Q + i0 * soq0, OUT_K + i0 * sok0)
    CS = tl.where(is_q, i0 * cq0 + first * cq1, i0 * ck0 + first * ck1)
    x_head = tl.where(is_q, tl.cast(sq1, tl.int64), tl.cast(sk1, tl.int64))
    out_head = tl.where(is_q, tl.cast(soq1, tl.int64), tl.cast(sok1, tl.int64))
    x_row = tl.where(is_q, tl.cast(sq2, tl.int64), tl.cast(sk2, tl.int64))
    out_row = tl.where(is_q, tl.cast(soq2, tl.int64), tl.cast(sok2, tl.int64))
    c_row = tl.where(is_q, tl.cast(cq2, tl.int64), tl.cast(ck2, tl.int64))

    t = pid_s * BLOCK_S + tl.arange(0, BLOCK_S).to(tl.int64)
    t_ok = t < n2
    if IS_VARLEN:
        # Sequence of each packed token: the number of cu_seqlens[1:] entries <= t, by binary search.
        lo = tl.zeros((BLOCK_S,), dtype=tl.int64)
        hi = tl.zeros((BLOCK_S,), dtype=tl.int64) + n_seq
        for _ in range(search_steps):
            active = lo < hi
            mid = (lo + hi) // 2
            edge = tl.load(CU_SEQLENS + mid + 1, mask=active & t_ok, other=0).to(tl.int64)
            right = active & (edge <= t)
            lo = tl.where(right, mid + 1, lo)
            hi = tl.where(active & (edge > t), mid, hi)
        seq = tl.minimum(lo, n_seq - 1)
        pos = t - tl.load(CU_SEQLENS + seq, mask=t_ok, other=0).to(tl.int64)
        if HAS_OFFSETS:
            pos += tl.load(OFFSETS + seq, mask=t_ok, other=0)
    else:
        pos = tl.load(POS + i0 * sp0 + t * sp1, mask=t_ok, other=0).to(tl.int64) if HAS_POS else t
        if HAS_OFFSETS:
            pos += tl.load(OFFSETS + i0)
    pos += offset

    pair = tl.arange(0, BLOCK_H)
    pair_ok = pair < HALF
    ok = t_ok[:, None] & pair_ok[None, :]
    if DENSE_COS:
        # Rows HALF apart (a contiguous table): a constant row stride lets the compiler vectorise the loads when
        # HALF is not a multiple of 16 (d = 80, 96), which a runtime stride cannot promise.
        c_row = HALF
    c_off = CS + pos[:, None] * c_row + pair[None, :]
    load_ok = ok
    if CHECK_ROWS:
        # The host checks positions against the table, but cannot where it may not read them (inside torch.compile
        # or a CUDA graph capture), and a kernel cannot raise: a token whose row is outside the table reads
        # nothing and comes out NaN, rather than rotated by whatever memory lies past the table.
        row_ok = (pos >= 0) & (pos < n_rows)
        load_ok = ok & row_ok[:, None]
    cos = tl.load(COS + c_off, mask=load_ok, other=0.0)
    sin = tl.load(SIN + c_off, mask=load_ok, other=0.0)
    if CHECK_ROWS:
        cos = tl.where(row_ok[:, None], cos, float("nan"))
    if CONJUGATE:
        sin = -sin
    for h in tl.static_range(HEADS):
        head = first + h
        # A group's last heads may lie past the x's head count: masked off. (A vector, not a scalar: the
        # interpreter refuses a mask made with a scalar.)
        head_ok = t_ok & (t * 0 + head < heads)
        x_base = X + head * x_head + t[:, None] * x_row
        out_base = OUT + head * out_head + t[:, None] * out_row
        if INTERLEAVED:
            # One contiguous load of all 2 * BLOCK_H channels, split into the even and odd ones in registers.
            channel = tl.arange(0, 2 * BLOCK_H)
            ok2 = head_ok[:, None] & (channel < 2 * HALF)[None, :]
            x = tl.load(x_base + channel[None, :], mask=ok2, other=0.0).to(cos.dtype)
            x1, x2 = tl.split(tl.reshape(x, (BLOCK_S, BLOCK_H, 2)))
            out = tl.join(x1 * cos - x2 * sin, x2 * cos + x1 * sin)
            out = _narrow(tl.reshape(out, (BLOCK_S, 2 * BLOCK_H)), OUT.dtype.element_ty, VIA_FLOAT32)
            tl.store(out_base + channel[None, :], out, mask=ok2)
        else:
            ok_h = head_ok[:, None] & pair_ok[None, :]
            x1 = tl.load(x_base + pair[None, :], mask=ok_h, other=0.0).to(cos.dtype)
            x2 = tl.load(x_base + HALF + pair[None, :], mask=ok_h, other=0.0).to(cos.dtype)
            o1 = _narrow(x1 * cos - x2 * sin, OUT.dtype.element_ty, VIA_FLOAT32)
            o2 = _narrow(x2 * cos + x1 * sin, OUT.dtype.element_ty, VIA_FLOAT32)
            tl.store(out_base + pair[None, :], o1, mask=ok_h)
            tl.store(out_base + HALF + pair[None, :], o2, mask=ok_h)
        if COPY_TAIL:
            # A name of its own: `range` compiles to a loop, whose variables may not change type (shape) inside
            # it, and the interleaved branch's `channel` has 2 * BLOCK_H lanes, not BLOCK_T. The interpreter
            # allowed it.
            for start in range(0, TAIL, BLOCK_T):
                tail_channel = 2 * HALF + start + tl.arange(0, BLOCK_T)
                ok_t = head_ok[:, None] & (tail_channel < 2 * HALF + TAIL)[None, :]
                tail = tl.load(x_base + tail_channel[None, :], mask=ok_t)
                tl.store(out_base + tail_channel[None, :], tail, mask=ok_t)


def interpreted() -> bool:
    """True when this module was imported under TRITON_INTERPRET=1 (the kernel then runs on CPU tensors)."""
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(_rope_kernel, InterpretedFunction)


def device_refusal(device: str) -> str:
    """Why the kernel cannot run on tensors of this device type, or '' where it can: CUDA, or the CPU when
    interpreted."""
    if device == "cuda" or (device == "cpu" and interpreted()):
        return ""
    return (
        f"backend='triton' needs CUDA tensors, got {device}; on CPU use backend='cpu' (Triton runs on CPU "
        "tensors only when TRITON_INTERPRET=1 was set before posenc.kernels.triton_rope was imported)"
    )


def _check(name: str, t: torch.Tensor, device: torch.device, shape: torch.Size, strides: tuple[int, ...]) -> None:
    """t (whose shape and strides the caller has read) is on x's device with unit stride in its last dim."""
    if t.device != device:
        raise ValueError(f"{name} is on {t.device} but x is on {device}; move both to one device")
    if shape and shape[-1] > 1 and strides[-1] != 1:
        raise ValueError(
            f"{name} must have unit stride in its last (channel) dim, got strides {strides}; "
            "any batch/head/token strides work, but pass .contiguous() for a transposed last dim"
        )


def _next_power_of_2(n: int) -> int:
    """triton.next_power_of_2 in plain Python: triton's host helpers go through its JIT wrapper, ~2 us a call,
    which a plan's three calls (and two of triton.cdiv, now inline) cannot afford where a decode step's whole
    launch is tens of microseconds."""
    return 1 << (n - 1).bit_length() if n > 0 else 0


@dataclass(frozen=True)
class Launch:
    """One launch of ``_rope_kernel``: its grid, positional arguments, constexpr keyword arguments, and launch
    options (``enable_fp_fusion``, ``num_warps``; one left out takes Triton's default)."""

    grid: tuple[int]
    args: tuple[object, ...]
    constants: dict[str, int | bool]
    options: dict[str, int | bool] = field(default_factory=dict)


WARPS = (1, 2, 4, 8, 16, 32)


def plan_launch(
    xs: Sequence[torch.Tensor],
    outs: Sequence[torch.Tensor],
    coss: Sequence[torch.Tensor],
    sins: Sequence[torch.Tensor],
    *,
    positions: torch.Tensor | None,
    offsets: torch.Tensor | None,
    offset: int,
    cu_seqlens: torch.Tensor | None,
    interleaved: bool,
    conjugate: bool,
    copy_tail: bool,
    table_rows: int | None,
    block_s: int | None = None,
    num_warps: int | None = None,
    heads_per_program: int | None = None,
    superblock: int | None = None,
) -> Launch | None:
    """Check a call and lay out the kernel's arguments: one launch for q, or q and k; None if there is nothing to do.

    xs, outs: canonical (n0, n_heads, n2, d) views of one dtype, q and k may differ in n_heads only;
    coss, sins: per x, (c0, c1, rows, r/2) views with unit last stride and the same strides for cos and sin;
    positions: (n0 or 1, n2) integer or None; offsets: (n0,) int64 (n_seq for varlen) or None;
    cu_seqlens: (n_seq + 1,) int32/int64 for packed tokens (then n0 = 1 and n2 = total tokens) or None;
    table_rows: the rows of the (rows, r/2) table that positions index, or None for cos/sin views read per token;
    a token whose position falls outside the table comes out NaN (the kernel cannot raise);
    block_s, num_warps, heads_per_program, superblock: tokens per program (a power of two), warps per program,
    heads per program (1 to 64; above 1 only where cos/sin are the same for every head), and the token blocks
    every head group covers before the grid moves on to the next ones (1 to 2**20; 1, the default, runs the head
    groups fastest), in place of the defaults (``benchmarks/triton_tune.py`` times them against each other; the
    results do not depend on them).
    Nothing here needs a GPU, so ``posenc.kernels.triton_targets`` compiles the very launch a call makes.
    """
    if len(xs) not in (1, 2) or not len(xs) == len(outs) == len(coss) == len(sins):
        raise ValueError(f"pass one or two tensors with one out and cos/sin each, got {len(xs)} and {len(outs)}")
    # Each tensor's metadata is read once (shape, strides, dtype, device): on a decode step this function is a
    # good part of the host's time per launch.
    q, cos0, sin0 = xs[0], coss[0], sins[0]
    device, dtype, q_shape, cos_dtype = q.device, q.dtype, q.shape, cos0.dtype
    cos_ptr, sin_ptr = cos0.data_ptr(), sin0.data_ptr()
    x_strides, out_strides, cos_strides = [], [], []
    for i, (x, out, cos, sin) in enumerate(zip(xs, outs, coss, sins, strict=True)):
        name = "q" if i == 0 else "k"
        shape, out_shape = x.shape, out.shape
        if len(shape) != 4 or out_shape != shape:
            raise ValueError(
                f"{name} and its output must be (n0, heads, tokens, d) views of one shape, got {tuple(shape)} "
                f"and {tuple(out_shape)}"
            )
        if shape[0] != q_shape[0] or shape[2] != q_shape[2]:
            raise ValueError(f"q and k must share batch and token sizes, got {tuple(q_shape)} and {tuple(shape)}")
        if x.dtype not in _DTYPES or x.dtype != dtype or out.dtype != dtype:
            raise TypeError(f"q, k and outputs must share one dtype among {_DTYPES}, got {x.dtype} / {out.dtype}")
        if cos.dtype not in (torch.float32, torch.float64) or sin.dtype != cos.dtype or cos.dtype != cos_dtype:
            raise TypeError(f"cos and sin must be float32 (or float64), one dtype, got {cos.dtype} and {sin.dtype}")
        cos_shape, cos_stride = cos.shape, cos.stride()
        if len(cos_shape) != 4 or cos_stride != sin.stride() or cos_shape != sin.shape:
            raise ValueError(f"cos and sin must be 4-D views of one shape and strides, got {tuple(cos_shape)}")
        if cos.data_ptr() != cos_ptr or sin.data_ptr() != sin_ptr:
            raise ValueError("q and k must read views of the same cos/sin tensors")
        x_stride, out_stride = x.stride(), out.stride()
        for label, t, t_shape, t_stride in (
            (name, x, shape, x_stride),
            (f"{name}'s output", out, shape, out_stride),
            ("cos", cos, cos_shape, cos_stride),
            ("sin", sin, cos_shape, cos_stride),
        ):
            _check(label, t, device, t_shape, t_stride)
        x_strides.append(x_stride[:3])
        out_strides.append(out_stride[:3])
        # A size-1 batch or head axis of cos/sin broadcasts: stride 0 there.
        cos_strides.append(tuple(0 if cos_shape[a] == 1 else cos_stride[a] for a in range(3)))
    half = cos0.shape[-1]
    n0, heads_q, n2, d = q_shape
    if 2 * half > d:
        raise ValueError(f"cos has {half} pairs, more than d={d} channels hold")
    for name, t in (("positions", positions), ("offsets", offsets), ("cu_seqlens", cu_seqlens)):
        if t is not None:
            _check(name, t, device, t.shape, t.stride())
    n_seq = cu_seqlens.shape[0] - 1 if cu_seqlens is not None else 1
    if offsets is not None and tuple(offsets.shape) != ((n_seq if cu_seqlens is not None else q_shape[0]),):
        # The kernel reads one offset per sequence (per batch row, or per packed sequence) without bounds.
        raise ValueError(
            f"offsets must be 1-D with one entry per sequence ({n_seq if cu_seqlens is not None else q_shape[0]}), "
            f"got shape {tuple(offsets.shape)}"
        )
    two = len(xs) == 2
    if q.numel() == 0:
        if two and xs[1].numel():
            raise ValueError("q is empty but k is not: plan k alone (posenc.kernels.launch.triton_plans does)")
        return None
    k, out_k = (xs[1], outs[1]) if two else (q, outs[0])
    heads_k = xs[1].shape[1] if two else 0
    q_cos_strides, k_cos_strides = cos_strides[0], cos_strides[-1]
    tail = d - 2 * half

    pos_strides = (0, 0)
    if positions is not None:
        pos_strides = (0 if positions.shape[0] == 1 else positions.stride(0), positions.stride(1))
    block_h = _next_power_of_2(half)
    # The defaults, from benchmarks/triton_tune.py on an H200 (docs/benchmarks.md, "GPU"): at d = 128, 16 tokens
    # and 2 heads a program on 4 warps ran at 0.91 to 0.99 of a copy's speed over bf16/fp32 and (b, h, s, d)/(b, s, h,
    # d) at s = 16k, where the 32 tokens and 1 head used before ran at 0.89 to 0.98 (0.93 against 0.90 at 32k, bf16).
    # 8 tokens did as well, within the runs' noise, but leave bf16 with 8-byte rather than 16-byte accesses.
    if block_s is None:
        block_s = max(1, min(_next_power_of_2(n2), 2048 // (2 * block_h)))
    else:
        power_of_two = "a power of two (tokens per program)"
        block_s = integer("block_s", block_s, low=1, expected=power_of_two)
        if block_s & (block_s - 1):
            raise ValueError(f"block_s must be {power_of_two}, got {block_s!r}")
    if num_warps is not None:
        num_warps = integer("num_warps", num_warps, expected=f"one of {WARPS}")
        if num_warps not in WARPS:
            raise ValueError(f"num_warps must be one of {WARPS}, got {num_warps!r}")
    per_head_cos = bool(q_cos_strides[1] or k_cos_strides[1])
    if heads_per_program is None:
        heads_per_program = 1 if per_head_cos else 2
    else:
        heads_per_program = integer("heads_per_program", heads_per_program, low=1, high=65, expected="an int in 1..64")
    if heads_per_program > 1 and per_head_cos:
        raise ValueError(
            f"heads_per_program={heads_per_program} shares one load of cos/sin between heads, but these cos/sin "
            "differ by head; pass heads_per_program=1"
        )
    if superblock is None:
        superblock = 1
    else:
        superblock = integer(
            "superblock", superblock, low=1, high=2**20 + 1, expected="an int in 1..2**20 (token blocks a run)"
        )
    n_blocks = -(-n2 // block_s)
    groups_q, groups_k = -(-heads_q // heads_per_program), -(-heads_k // heads_per_program)
    dummy = q  # stands in for absent optional pointers; never read (the matching constexpr is False)
    args = (
        q,
        k,
        outs[0],
        out_k,
        cos0,
        sin0,
        positions if positions is not None else dummy,
        offsets if offsets is not None else dummy,
        cu_seqlens if cu_seqlens is not None else dummy,
        offset,
        table_rows if table_rows is not None else 0,
        n2,
        n_blocks,
        heads_q,
        heads_k,
        groups_q,
        groups_q + groups_k,
        n_seq,
        n_seq.bit_length() + 1,  # binary-search steps over n_seq + 1 edges
        *x_strides[0],
        *x_strides[-1],
        *out_strides[0],
        *out_strides[-1],
        *q_cos_strides,
        *k_cos_strides,
        *pos_strides,
    )
    constants = {
        "HALF": half,
        "TAIL": tail,
        "DENSE_COS": q_cos_strides[2] == half and k_cos_strides[2] == half,
        "BLOCK_S": block_s,
        # More than the blocks there are is the same order as all of them: one constexpr, one compile.
        "SUPER_S": min(superblock, n_blocks),
        "HEADS": heads_per_program,
        "BLOCK_H": block_h,
        "BLOCK_T": min(64, _next_power_of_2(max(tail, 1))),
        "INTERLEAVED": interleaved,
        "CONJUGATE": conjugate,
        "HAS_POS": positions is not None,
        "HAS_OFFSETS": offsets is not None,
        "IS_VARLEN": cu_seqlens is not None,
        "COPY_TAIL": copy_tail and tail > 0,
        "CHECK_ROWS": table_rows is not None,
        "VIA_FLOAT32": cos_dtype == torch.float64 and dtype in (torch.bfloat16, torch.float16),
    }
    programs = n_blocks * n0 * (groups_q + groups_k)
    if programs > 2**31 - 1:
        raise ValueError(
            f"this call needs {programs} Triton programs, past CUDA's grid limit of 2**31 - 1; split the batch"
        )
    # Fused multiply-adds asked for by name: Triton 3.9 warns that its default turns them off in 3.10, and the
    # rounding of a rotation should not change with the Triton version (the CPU kernel fuses them too).
    options = {"enable_fp_fusion": True} | ({} if num_warps is None else {"num_warps": num_warps})
    return Launch((programs,), args, constants, options)


def launch(plan: Launch) -> None:
    """Run a planned launch. The tensors must be on CUDA, or on the CPU when interpreted."""
    device = plan.args[0].device  # type: ignore[attr-defined]
    refusal = device_refusal(device.type)
    if refusal:
        raise ValueError(refusal)
    if device.type != "cuda":
        _rope_kernel[plan.grid](*plan.args, **plan.constants, **plan.options)
        return
    # Triton launches on the current device and its stream: for tensors on another GPU (cuda:1 while cuda:0 is
    # current) the kernel would run on the wrong device with foreign pointers. Make theirs current for the launch.
    with torch.cuda.device(device):
        _rope_kernel[plan.grid](*plan.args, **plan.constants, **plan.options)
