"""RoPE on q (b, 32, s, 128) and k (b, 8, s, 128): every provider against a plain copy of the same bytes.

Providers: posenc-cpu / posenc-triton (fused, one call for q and k; on a GPU also posenc-triton-bshd, the same call
on q and k stored (b, s, h, d), the memory Liger is given), posenc-torch (the pure-torch path), hf-eager (Hugging
Face's ``q * cos + rotate_half(q) * sin`` with full-width cos/sin in x's dtype), torch.compile(hf-eager), copy
(``clone()`` of q and k: the memory-bandwidth floor), copy-huge (on CPU where posenc asks for transparent huge pages
under its rotations' big new outputs: q and k cloned into buffers given huge pages the same way, the floor for the
pages the kernel writes; ``ratio_to_copy`` stays against ``copy``), copy-one-launch (the same bytes held in one
buffer and cloned by one launch: two clones pay a launch and a drain between them, which a rotation of q and k in
one launch does not, so on a GPU this is the stricter floor), and on a GPU liger (Liger-Kernel's rope) and
flash-attn (``apply_rotary_emb``) when installed, each given the inputs it is built for: Liger rotates q and k in
place and wants them as Hugging Face's attention leaves them, (b, s, h, d) in memory seen as (b, h, s, d) (from
contiguous (b, h, s, d) it first makes a transposed copy of each); flash-attn takes (b, s, h, d) views and cos/sin
(s, d/2) in x's dtype, as its ``RotaryEmbedding`` caches them. Modes: fwd, bwd (the backward alone, on a retained
graph), fwd+bwd; the backward modes take ``torch.autograd.grad`` of q and k. The copy of each mode moves the same
bytes as the op (for fwd+bwd, clones of q and k and then of two tensors shaped like them, as the backward reads its
gradients). On CUDA the times are the GPU's (``--clock device``: events, L2 flushed and the host's work hidden
before each call; ``common.measure_interleaved``), or the host's around each synchronized call (``--clock host``:
Python and launch overhead included). Before any timing, each provider's rotated q and k (and, where a backward mode
is asked for, their gradients) are compared once per length and dtype with the float64 reference (``check_values``):
a provider off by more than rounding, or one that raises, is reported as WRONG VALUES and its rows are left out, the
others are timed, and the exit status is then 1. The CSV is rewritten (atomically) after every mode: a run cut short
leaves the rows it measured, in place of the file's earlier contents. Without ``--csv`` the rows are printed only.
``--providers`` takes names from PROVIDERS; one measured on the other device only (posenc-cpu on CUDA;
posenc-triton, liger, flash-attn on CPU) is noted and left out. On CPU, ``--alloc`` pins where output buffers come
from (``common.set_allocation``): fresh pages every call (default; the OS zero-filling them is most of a copy's
time) or recycled heap memory (``--alloc reuse``).

    python benchmarks/rope.py --csv docs/results/rope_cpu.csv     # CPU defaults, a few minutes on 2 cores
    python benchmarks/rope.py --device cuda --seqs 1024 4096 16384 32768 --reps 50 --csv rope_gpu.csv
"""

from __future__ import annotations

import argparse
import sys
import traceback
from collections.abc import Callable
from pathlib import Path

import torch

from common import (
    add_allocation_argument,
    add_clock_argument,
    at_least,
    chosen_clock,
    environment,
    huge_page_clone,
    measure_interleaved,
    rows_against_copy,
    write_rows,
)
from posenc import apply_rotary_qk
from posenc.kernels import huge_pages
from posenc.testing import TOLERANCES, random_qk, rope_reference

HEADS_Q, HEADS_K, HEAD_DIM = 32, 8, 128
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
PROVIDERS = (
    "copy", "copy-huge", "copy-one-launch", "posenc-cpu", "posenc-triton", "posenc-triton-bshd", "posenc-torch",
    "hf-eager", "torch.compile(hf-eager)", "liger", "flash-attn",
)  # fmt: skip
# The floors: copies of the bytes a rotation moves, not rotations (no values to check; kept whatever --providers says).
COPIES = frozenset({"copy", "copy-huge", "copy-one-launch"})
# The providers measured on one device only (the rest run on both).
ONLY_ON = {
    "copy-huge": "cpu",
    "posenc-cpu": "cpu",
    "posenc-triton": "cuda",
    "posenc-triton-bshd": "cuda",
    "liger": "cuda",
    "flash-attn": "cuda",
}
# check_values allows TOLERANCES' atol + VALUE_SLACK x its rtol (two units of the dtype's rounding) x the largest
# input value. Hugging Face's formula in x's dtype (flash-attn and Liger are given cos/sin in x's dtype too) rounds
# cos/sin, two products and their sum: at most about 3 sqrt(2) half-units of the largest input, 2.1 rtol. A rotation
# left out, or garbage, is off by about the input's own size.
VALUE_SLACK = 4.0


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def hf_eager(q, k, cos, sin):
    """transformers' apply_rotary_pos_emb, as Llama calls it (cos/sin (1, 1, s, d) in x's dtype)."""
    return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin


def tables(seq: int, dtype: torch.dtype, device: str) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """cos/sin in each provider's form: "half" (s, d/2) float32 (posenc), "half_x" (s, d/2) in x's dtype
    (flash-attn), "full" (1, 1, s, d) in x's dtype (Hugging Face, Liger)."""
    inv_freq = 1.0 / 10000.0 ** (torch.arange(0, HEAD_DIM, 2, dtype=torch.float64) / HEAD_DIM)
    angles = torch.arange(seq, dtype=torch.float64)[:, None] * inv_freq
    full = torch.cat((angles, angles), dim=-1)
    return {
        "half": (angles.cos().float().to(device), angles.sin().float().to(device)),
        "half_x": (angles.cos().to(device, dtype), angles.sin().to(device, dtype)),
        "full": tuple(t.to(device=device, dtype=dtype)[None, None] for t in (full.cos(), full.sin())),
    }


def providers(device: str, seq: int, dtype: torch.dtype, names: list[str] | None = None) -> dict[str, Callable]:
    """name -> f(q, k) returning the rotated (q, k) (or the copies). names: where given, a torch.compile provider
    not among them is not made (making it imports Dynamo and Inductor, seconds on a CPU host)."""
    table = tables(seq, dtype, device)
    (half_cos, half_sin), (hf_cos, hf_sin) = table["half"], table["full"]
    result: dict[str, Callable] = {"copy": lambda q, k: (q.clone(), k.clone())}
    if device == "cpu" and huge_pages.asks():
        result["copy-huge"] = lambda q, k: (huge_page_clone(q), huge_page_clone(k))
    result["copy-one-launch"] = torch.clone
    fused = "posenc-cpu" if device == "cpu" else "posenc-triton"
    backend = "cpu" if device == "cpu" else "triton"
    result[fused] = lambda q, k: apply_rotary_qk(q, k, half_cos, half_sin, backend=backend)
    result["posenc-torch"] = lambda q, k: apply_rotary_qk(q, k, half_cos, half_sin, backend="torch")
    result["hf-eager"] = lambda q, k: hf_eager(q, k, hf_cos, hf_sin)
    # Dynamo keeps the compiled variants of hf_eager's code across torch.compile wrappers, 8 at most: past that it
    # runs the function eagerly without a word. Each (seq, dtype) has one or two (grad mode), so start afresh,
    # and compile for this shape only (after a second shape Dynamo would otherwise switch to dynamic shapes).
    if names is None or "torch.compile(hf-eager)" in names:
        torch._dynamo.reset()
        compiled = torch.compile(hf_eager, dynamic=False)
        result["torch.compile(hf-eager)"] = lambda q, k: compiled(q, k, hf_cos, hf_sin)
    if device == "cuda":
        # The fused kernel again, on the memory Liger is given (HF_LAYOUT): the layouts time differently (on an
        # H200, 0.91 of a copy for (b, h, s, d) against 0.99 for (b, s, h, d), bf16 at 16k).
        result["posenc-triton-bshd"] = result[fused]
        result.update(outside_providers(table))
    return result


def outside_providers(table: dict[str, tuple[torch.Tensor, torch.Tensor]]) -> dict[str, Callable]:
    """Liger-Kernel's and flash-attention's rotary kernels, where importable (scripts/gpu_prepare.sh). Liger's
    takes q and k in its layout (``hf_layout``; make_case gives it those)."""
    result: dict[str, Callable] = {}
    try:
        from liger_kernel.ops.rope import LigerRopeFunction
    except ImportError as error:
        print(f"liger: not importable ({error}); skipped")
    else:
        liger_cos, liger_sin = (t[0] for t in table["full"])  # (1, s, d)
        result["liger"] = lambda q, k: LigerRopeFunction.apply(q, k, liger_cos, liger_sin)
    try:
        from flash_attn.layers.rotary import apply_rotary_emb
    except ImportError as error:
        print(f"flash-attn: not importable ({error}); skipped")
    else:
        # flash-attn wants (b, s, h, d): transposed views in (same bytes, strides it handles), and its outputs
        # seen as (b, h, s, d) again, as the gradients of the backward modes are shaped.
        half_cos, half_sin = table["half_x"]
        result["flash-attn"] = lambda q, k: tuple(
            apply_rotary_emb(x.transpose(1, 2), half_cos, half_sin).transpose(1, 2) for x in (q, k)
        )
    return result


# Providers given the (b, h, s, d) views of (b, s, h, d) memory that Hugging Face's attention makes (Liger rotates
# them in place).
HF_LAYOUT = frozenset({"liger", "posenc-triton-bshd"})


def hf_layout(x: torch.Tensor) -> torch.Tensor:
    """x's values, stored (b, s, h, d) and seen as (b, h, s, d), as q and k are after Hugging Face's
    ``view(...).transpose(1, 2)``."""
    return x.transpose(1, 2).contiguous().transpose(1, 2)


def make_case(name: str, fn: Callable, mode: str, q: torch.Tensor, k: torch.Tensor):
    """The timed function of one provider and mode; it returns what it made (freed after the clock)."""
    if name in HF_LAYOUT:
        q, k = hf_layout(q), hf_layout(k)
    if name in ("copy", "copy-huge"):
        # The floor for each mode: the bytes a rotation must read and write once (twice for fwd+bwd). Like the
        # op's, fwd+bwd's first outputs (the forward's) are freed inside the clock and the second (the gradients)
        # after it. The second half clones tensors of its own, as the op's backward reads the output gradients and
        # not q and k: cloning q and k again re-read what the first half had just pulled into the cache (a 32 MiB
        # L3 at s = 1024 bf16, reused buffers: 0.79-0.88 of the time of cloning distinct bytes; a GPU's L2, flushed
        # once per call by the device clock, holds q and k in bf16 up to s = 4k on an H200).
        if mode == "fwd+bwd":
            gq, gk = torch.randn_like(q), torch.randn_like(k)
            return lambda: (fn(q, k), fn(gq, gk))[1]
        return lambda: fn(q, k)
    if name == "copy-one-launch":
        # q's and k's bytes side by side in one buffer, one clone each pass (fwd+bwd: the forward's and then the
        # gradients', a buffer of their own as above). fn is torch.clone.
        flat = torch.cat([q.reshape(-1), k.reshape(-1)])
        if mode == "fwd+bwd":
            grads = torch.randn_like(flat)
            return lambda: (fn(flat), fn(grads))[1]
        return lambda: fn(flat)
    if mode == "fwd":

        def forward():
            with torch.no_grad():
                return fn(q, k)

        return forward
    qg, kg = q.detach().requires_grad_(), k.detach().requires_grad_()
    grads = (torch.randn_like(q), torch.randn_like(k))  # in q's and k's memory layout
    # The gradients are returned (autograd.grad), not accumulated into .grad: accumulating copies a gradient that is
    # referenced elsewhere, as an in-place provider's (Liger rotates `grads` itself) is, which would time a copy
    # for it alone; it also cost the out-of-place providers ~0.5 ms (bf16, s = 4096, CPU).
    if mode == "fwd+bwd":
        return lambda: torch.autograd.grad(fn(qg, kg), (qg, kg), grads)
    outs = fn(qg, kg)  # bwd alone: one graph, its backward replayed
    return lambda: torch.autograd.grad(outs, (qg, kg), grads, retain_graph=True)


def check_values(chosen: dict[str, Callable], q: torch.Tensor, k: torch.Tensor, modes: list[str]) -> dict[str, str]:
    """Each provider once against the float64 reference (``posenc.testing.rope_reference``), before any timing:
    its forward as "fwd" calls it (no grad) where ``modes`` has it, and its forward and the gradients of q and k
    where a backward mode is asked for. q (b, h_q, s, d), k (b, h_k, s, d), contiguous. Returns name -> what is wrong,
    for the providers off by more than rounding (``VALUE_SLACK``) or that raised; "copy" is not a rotation."""
    backward = bool({"bwd", "fwd+bwd"} & set(modes))
    calls = [(False, "fwd")] if "fwd" in modes else []
    calls += [(True, "fwd and its gradients")] if backward else []
    positions = torch.arange(q.shape[2], device=q.device)
    inputs, grads = {"q": q, "k": k}, None
    expected = {what: rope_reference(x, positions) for what, x in inputs.items()}
    if backward:
        b, h_q, s, d = q.shape
        grads = random_qk(b, h_q, k.shape[1], s, d, dtype=q.dtype, seed=1, device=q.device)
        inputs |= {"dq": grads[0], "dk": grads[1]}
        # A rotation's gradient is the rotation back: the output gradients turned by -position.
        expected |= {"dq": rope_reference(grads[0], -positions), "dk": rope_reference(grads[1], -positions)}
    wrong: dict[str, str] = {}
    for name, fn in chosen.items():
        if name in COPIES:
            continue
        for with_grads, label in calls:
            try:
                outputs = provider_values(name, fn, q, k, grads if with_grads else None)
            except Exception as error:  # reported with the other faults: the remaining providers are still timed
                traceback.print_exc()
                wrong[name] = f"{label} raised {type(error).__name__}: {error}"
                break
            faults = [value_fault(outputs[what], expected[what], inputs[what]) for what in outputs]
            faults = [f"{what} {fault}" for what, fault in zip(outputs, faults, strict=True) if fault]
            if faults:
                wrong[name] = f"{label}: " + "; ".join(faults)
                break
    return wrong


def provider_values(
    name: str, fn: Callable, q: torch.Tensor, k: torch.Tensor, grads: tuple[torch.Tensor, torch.Tensor] | None
) -> dict[str, torch.Tensor]:
    """One call of a provider on copies of q and k in the memory it is given (``HF_LAYOUT``; Liger rotates them, and
    the output gradients, in place): {"q", "k"} rotated, and with ``grads`` also {"dq", "dk"}."""
    layout = hf_layout if name in HF_LAYOUT else torch.clone
    qq, kk = layout(q), layout(k)
    if grads is None:
        with torch.no_grad():
            return dict(zip("qk", fn(qq, kk), strict=True))
    qq, kk = qq.detach().requires_grad_(), kk.detach().requires_grad_()  # leaves, as make_case gives them
    outs = fn(qq, kk)
    dq, dk = torch.autograd.grad(outs, (qq, kk), tuple(layout(g) for g in grads))
    return {"q": outs[0].detach(), "k": outs[1].detach(), "dq": dq, "dk": dk}


def value_fault(actual: torch.Tensor, expected: torch.Tensor, source: torch.Tensor) -> str:
    """What is off in ``actual`` against the float64 ``expected``; empty where it is within rounding (the tolerance
    scaled by ``source``'s largest value, see ``VALUE_SLACK``)."""
    if actual.shape != expected.shape:
        return f"has shape {tuple(actual.shape)}, not {tuple(expected.shape)}"
    atol, rtol = TOLERANCES[actual.dtype]
    allowed = atol + VALUE_SLACK * rtol * source.abs().max().item()
    error = (actual.double() - expected).abs().nan_to_num(float("inf")).max().item()
    return "" if error <= allowed else f"is off by up to {error:.3g} (allowed {allowed:.3g})"


def chosen_providers(parser: argparse.ArgumentParser, names: list[str] | None, device: str) -> list[str] | None:
    """``--providers`` checked: an unknown name is an error, one measured on the other device only is noted."""
    if not names:
        return None
    unknown = [name for name in names if name not in PROVIDERS]
    if unknown:
        parser.error(f"--providers: unknown {', '.join(unknown)}; known: {', '.join(PROVIDERS)}")
    for name in names:
        if ONLY_ON.get(name, device) != device:
            print(f"note: {name} runs on --device {ONLY_ON[name]} only; not measured on this --device {device} run")
    return names


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--seqs", type=at_least(1), nargs="+", default=[1024, 4096])
    parser.add_argument("--dtypes", nargs="+", default=["fp32", "bf16"], choices=list(DTYPES))
    parser.add_argument("--modes", nargs="+", default=["fwd", "bwd", "fwd+bwd"], choices=["fwd", "bwd", "fwd+bwd"])
    parser.add_argument("--providers", nargs="*", default=None, help="subset of provider names (default: all)")
    parser.add_argument("--batch", type=at_least(1), default=1)
    parser.add_argument("--reps", type=at_least(1), default=10)
    # Print-only unless asked: a default path would overwrite the committed results (docs/results/rope_cpu.csv) with
    # whatever a quick run measured, on a GPU machine too.
    parser.add_argument("--csv", type=Path, default=None, help="CSV to write (default: print only)")
    add_clock_argument(parser)
    add_allocation_argument(parser)
    args = parser.parse_args()
    clock = chosen_clock(parser, args)
    names = chosen_providers(parser, args.providers, args.device)

    env = environment(args.device, args.alloc, clock if args.device == "cuda" else None)
    rows, failed = [], []
    for seq in args.seqs:
        for dtype_name in args.dtypes:
            dtype = DTYPES[dtype_name]
            q, k = random_qk(args.batch, HEADS_Q, HEADS_K, seq, HEAD_DIM, dtype=dtype, device=args.device)
            chosen = providers(args.device, seq, dtype, names)
            if names:
                chosen = {n: f for n, f in chosen.items() if n in names or n in COPIES}
            for name, what in check_values(chosen, q, k, args.modes).items():
                print(f"WRONG VALUES: {name} at s={seq} {dtype_name}, {what}; its rows are left out", flush=True)
                failed.append(f"{name} (s={seq} {dtype_name})")
                del chosen[name]
            checked = ", ".join(name for name in chosen if name not in COPIES)
            print(f"values at s={seq} {dtype_name} within rounding of float64: {checked}", flush=True)
            shape = f"b={args.batch},hq={HEADS_Q},hk={HEADS_K},s={seq},d={HEAD_DIM}"
            for mode in args.modes:
                cases = {name: make_case(name, fn, mode, q, k) for name, fn in chosen.items()}
                times = measure_interleaved(cases, reps=args.reps, device=args.device, clock=clock)
                copy_bytes = 2 * (q.nbytes + k.nbytes) * (2 if mode == "fwd+bwd" else 1)
                rows += rows_against_copy(
                    times, op="rope", mode=mode, dtype=dtype_name, shape=shape, env=env, copy_bytes=copy_bytes
                )
                if args.csv is not None:
                    write_rows(rows, args.csv)
    if args.csv is not None:
        print(f"wrote {len(rows)} rows to {args.csv}")
    if failed:
        sys.exit(f"wrong values, rows left out: {', '.join(failed)}")


if __name__ == "__main__":
    main()
