"""The Triton rotary kernel's configurations side by side: tokens (BLOCK_S) x warps x heads per program x the
grid's order (superblock: token blocks every head group covers before the next ones; 1 runs head groups fastest).

Every configuration rotates the same q (b, 32, s, 128) and k (b, 8, s, 128) (heads: ``--q-heads``, ``--k-heads``),
out of place (the forward), in one launch planned as ``apply_rotary_qk(q, k, cos, sin)`` plans it (cos, sin (s, d/2)
broadcast, as ``rope.py``'s posenc-triton gives them, so the kernel specialization that ``rope.py`` and
``scripts/gpu_goal.py`` judge) but with BLOCK_S, num_warps, heads_per_program and superblock given. q and k are
(b, h, s, d) tensors; with ``--layouts bshd`` views of (b, s, h, d) memory, as ``rope.py``'s posenc-triton-bshd.
Before anything is timed, each configuration's output must equal the default's bit for bit (the tiling does not
change the arithmetic) or, where the compiler rounds differently, be within the dtype's tolerance of the float64
reference (reported). The cases take turns rep by rep with ``copy`` (clone() of q and k) and the default plan, which
is also timed under its explicit configuration: the two rows differ by the run's noise. Rows as ``rope.py``'s,
provider "BLOCK_S=32 warps=4 heads=1" (" super=8" appended for superblock 8), mode "fwd-bhsd" or "fwd-bshd" (how q
and k lie in memory; "-adjacent" appended for adjacent pairs, ``--pairs adjacent``), gb_per_s the bytes a rotation
must move over the p50. On CUDA the GPU's clock by default (``common.measure_interleaved``).

    python benchmarks/triton_tune.py --device cuda --seq 16384 --csv docs/results/rope_gpu_tune.csv

On a machine without a GPU, ``TRITON_INTERPRET=1 python benchmarks/triton_tune.py --device cpu ...`` (the variable
set by the caller, before posenc is imported) runs it under the Triton interpreter on CPU tensors: that checks the
configurations and the script, and its times mean nothing.
"""

from __future__ import annotations

import argparse
import itertools
from pathlib import Path

import torch

from common import (
    add_clock_argument,
    at_least,
    chosen_clock,
    environment,
    measure_interleaved,
    rows_against_copy,
    write_rows,
)
from posenc.kernels.launch import triton_plans
from posenc.testing import assert_close, random_qk, rope_reference
from rope import DTYPES, HEAD_DIM, HEADS_K, HEADS_Q, tables


def rotation(
    q,
    k,
    cos,
    sin,
    interleaved: bool,
    block_s: int | None,
    num_warps: int | None,
    heads: int | None,
    superblock: int | None,
):
    """A timed function: q and k rotated into new tensors by one launch of the given configuration."""
    from posenc.kernels import triton_rope  # imports triton: only once a configuration is asked for

    def run() -> list[torch.Tensor]:
        outs = [torch.empty_like(q), torch.empty_like(k)]
        plans = triton_plans(
            [q, k], outs, cos, sin, None, None, 0, None, "broadcast", interleaved, False, True,
            block_s=block_s, num_warps=num_warps, heads_per_program=heads, superblock=superblock,
        )  # fmt: skip
        for plan in plans:
            triton_rope.launch(plan)
        return outs

    return run


def check(cases: dict, q: torch.Tensor, k: torch.Tensor, interleaved: bool, label: str) -> None:
    """The default's output against the float64 reference (the dtype's tolerance), and every configuration's
    against the default's, bit for bit; one off by more than rounding stops the run before anything is timed.
    q, k: (b, h, s, d)."""
    expected = cases["default"]()
    positions = torch.arange(q.shape[2], device=q.device)

    def reference(x: torch.Tensor) -> torch.Tensor:
        return rope_reference(x, positions, interleaved=interleaved)

    for x, out in zip((q, k), expected, strict=True):
        assert_close(out, reference(x), msg=f"default, {label}")
    for name, case in cases.items():
        if name in ("copy", "default"):
            continue
        outs = case()
        if not all(map(torch.equal, outs, expected)):
            for x, out in zip((q, k), outs, strict=True):
                assert_close(out, reference(x), msg=f"{name}, {label}")
            differ = sum(int((a != b).sum()) for a, b in zip(outs, expected, strict=True))
            print(f"{name} ({label}): {differ} values differ from the default's in rounding, within tolerance")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda", choices=["cpu", "cuda"])
    parser.add_argument("--seq", type=at_least(1), default=16384)
    parser.add_argument("--batch", type=at_least(1), default=1)
    parser.add_argument("--dtypes", nargs="+", default=["bf16", "fp32"], choices=list(DTYPES))
    parser.add_argument("--layouts", nargs="+", default=["bhsd", "bshd"], choices=["bhsd", "bshd"])
    parser.add_argument(
        "--pairs", nargs="+", default=["half"], choices=["half", "adjacent"], help="split-half or adjacent pairs"
    )
    parser.add_argument(
        "--block-s", type=at_least(1), nargs="+", default=[8, 16, 32, 64, 128], help="tokens per program"
    )
    parser.add_argument("--warps", type=at_least(1), nargs="+", default=[1, 2, 4, 8], help="warps per program")
    parser.add_argument(
        "--heads", type=at_least(1), nargs="+", default=[1], help="heads per program (sharing cos/sin loads)"
    )
    parser.add_argument(
        "--superblocks",
        type=at_least(1),
        nargs="+",
        default=[1],
        help="token blocks every head group covers before the next ones (1: head groups fastest)",
    )
    parser.add_argument("--q-heads", type=at_least(1), default=HEADS_Q, help=f"q heads ({HEADS_Q})")
    parser.add_argument("--k-heads", type=at_least(1), default=HEADS_K, help=f"k heads ({HEADS_K})")
    parser.add_argument("--reps", type=at_least(1), default=30)
    parser.add_argument(
        "--warmup",
        type=int,
        default=2,
        help="untimed rounds of every case before the timed ones (2; host clock only, the device clock runs 2)",
    )
    parser.add_argument("--csv", type=Path, default=None)
    add_clock_argument(parser)
    args = parser.parse_args()
    clock = chosen_clock(parser, args)
    if args.warmup < 0 or (clock == "device" and args.warmup != 2):
        parser.error(f"--warmup {args.warmup}: at least 0, and only with --clock host (the device clock runs 2)")

    env = environment(args.device, "system", clock)
    rows: list[dict] = []
    for dtype_name, layout, pairs in itertools.product(args.dtypes, args.layouts, args.pairs):
        dtype, interleaved = DTYPES[dtype_name], pairs == "adjacent"
        q, k = random_qk(
            args.batch, args.q_heads, args.k_heads, args.seq, HEAD_DIM, dtype=dtype, layout=layout, device=args.device
        )
        if layout == "bshd":
            q, k = q.transpose(1, 2), k.transpose(1, 2)  # (b, h, s, d) views, as Hugging Face's attention makes
        cos, sin = tables(args.seq, dtype, args.device)["half"]  # (s, d/2) float32, as RoPE keeps it
        cases = {
            "copy": lambda q=q, k=k: (q.clone(), k.clone()),
            "default": rotation(q, k, cos, sin, interleaved, None, None, None, None),
        }
        for block_s, warps, heads, superblock in itertools.product(
            args.block_s, args.warps, args.heads, args.superblocks
        ):
            name = f"BLOCK_S={block_s} warps={warps} heads={heads}" + (f" super={superblock}" if superblock > 1 else "")
            cases[name] = rotation(q, k, cos, sin, interleaved, block_s, warps, heads, superblock)
        mode = f"fwd-{layout}" + ("-adjacent" if interleaved else "")
        check(cases, q, k, interleaved, f"{dtype_name} {mode}")
        times = measure_interleaved(cases, reps=args.reps, device=args.device, clock=clock, warmup=args.warmup)
        shape = f"b={args.batch},hq={args.q_heads},hk={args.k_heads},s={args.seq},d={HEAD_DIM}"
        rows += rows_against_copy(
            times,
            op="rope",
            mode=mode,
            dtype=dtype_name,
            shape=shape,
            env=env,
            copy_bytes=2 * (q.nbytes + k.nbytes),
        )
        if args.csv is not None:
            write_rows(rows, args.csv)
    best = {}
    for row in rows:
        key = (row["dtype"], row["mode"])
        if row["provider"] not in ("copy", "default") and row["p50"] < best.get(key, {"p50": float("inf")})["p50"]:
            best[key] = row
    for (dtype_name, mode), row in best.items():
        default = next(r for r in rows if (r["dtype"], r["mode"], r["provider"]) == (dtype_name, mode, "default"))
        print(
            f"{dtype_name} {mode}: fastest {row['provider']} ({row['ratio_to_copy']:.2f} of a copy), "
            f"default {default['ratio_to_copy']:.2f}"
        )


if __name__ == "__main__":
    main()
