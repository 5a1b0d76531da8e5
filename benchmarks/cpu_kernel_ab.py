"""The CPU rotary kernel of this working tree against the one of an earlier git revision, side by side in one run.

Both kernels are built from source (cached like the package's own) and called on the same tensors, taking turns
rep by rep with ``copy`` (``clone()`` of q and k, the floor of an out-of-place op) so that load on a shared machine
hits them alike. Forward, out-of-place, q (1, 32, s, 128) and k (1, 8, s, 128), split-half (``--interleaved``: adjacent
pairs); ``--inplace`` times the in-place variant against ``copy_`` into preallocated tensors instead. ``--arch`` builds
both for an older x86 level than this CPU's (``x86-64-v3``: the AVX2 machines without AVX-512), which this CPU must be
able to execute. Outputs are allocated as the package allocates them (``torch.empty_like``, given huge pages by
``posenc.kernels.huge_pages.advised`` where it would), for every kernel alike; builds of 94d6c93..61b791c, which asked
for huge pages themselves, are told not to.

    python benchmarks/cpu_kernel_ab.py --baseline 2978b28
    python benchmarks/cpu_kernel_ab.py --baseline 00a9cf7 --arch x86-64-v3 --dtypes bf16 fp16
"""

from __future__ import annotations

import argparse
import subprocess
from pathlib import Path

import torch

from common import (
    add_allocation_argument,
    at_least,
    environment,
    measure_interleaved,
    rows_against_copy,
    write_rows,
)
from posenc.kernels.cpu_rope import SOURCE, build_library, rope_cpu
from posenc.kernels.huge_pages import advised
from posenc.testing import random_qk

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def source_at(revision: str) -> tuple[str, bytes]:
    """(the revision's short hash, cpu_rope.cpp as committed there). The hash labels the rows, as decode_host_ab.py
    labels its: "kernel@HEAD" named no kernel once HEAD moved."""
    root = Path(__file__).resolve().parents[1]
    path = SOURCE.resolve().relative_to(root).as_posix()
    done = subprocess.run(
        ["git", "rev-parse", "--short", "--verify", f"{revision}^{{commit}}"], cwd=root, capture_output=True, timeout=30
    )
    if done.returncode != 0:
        raise SystemExit(f"--baseline {revision!r} is not a commit of {root}: {done.stderr.decode().strip()}")
    commit_hash = done.stdout.decode().strip()
    source = subprocess.run(
        ["git", "show", f"{commit_hash}:{path}"], cwd=root, capture_output=True, check=True, timeout=30
    ).stdout
    return commit_hash, source


def make_cases(libraries: dict, dtype: torch.dtype, seq: int, *, inplace: bool, interleaved: bool) -> dict:
    """name -> timed function: copy, then each library's kernel on the same q and k."""
    q, k = random_qk(1, 32, 8, seq, 128, dtype=dtype)
    angles = torch.arange(seq, dtype=torch.float64)[:, None] / 10000.0 ** (
        torch.arange(0, 128, 2, dtype=torch.float64) / 128
    )
    cos, sin = (t.float()[None, None] for t in (angles.cos(), angles.sin()))
    targets = (q.clone(), k.clone())

    def run(library) -> list[torch.Tensor]:
        outs = []  # returned, so that measure_interleaved frees them after the clock, as it does the copy's
        for x, target in zip((q, k), targets, strict=True):
            # In place the targets are rotated again each rep (norms are kept, so the values stay tame).
            source, out = (target, target) if inplace else (x, advised(torch.empty_like(x)))
            rope_cpu(
                source,
                out,
                cos,
                sin,
                None,
                interleaved=interleaved,
                conjugate=False,
                copy_tail=not inplace,
                library=library,
            )
            outs.append(out)
        return outs

    def copy() -> tuple[torch.Tensor, ...]:
        if inplace:
            return tuple(target.copy_(x) for target, x in zip(targets, (q, k), strict=True))
        return q.clone(), k.clone()

    return {"copy": copy} | {name: (lambda lib=lib: run(lib)) for name, lib in libraries.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--baseline", required=True, help="git revision whose cpu_rope.cpp is the baseline")
    parser.add_argument("--seq", type=at_least(1), default=4096)
    parser.add_argument("--dtypes", nargs="+", default=["fp32", "bf16", "fp16"], choices=list(DTYPES))
    parser.add_argument("--reps", type=at_least(1), default=40)
    parser.add_argument("--inplace", action="store_true")
    parser.add_argument("--interleaved", action="store_true", help="adjacent pairs instead of split halves")
    parser.add_argument("--arch", default="native", help="the compiler's -march for both kernels (default native)")
    parser.add_argument("--csv", type=Path, default=None)
    add_allocation_argument(parser)
    args = parser.parse_args()

    libraries = {}
    baseline, baseline_source = source_at(args.baseline)
    for name, source in ((f"kernel@{baseline}", baseline_source), ("kernel@tree", SOURCE.read_bytes())):
        library, reason = build_library(source, arch=args.arch)
        if library is None:
            raise SystemExit(f"{name}: {reason}")
        libraries[name] = library

    env = environment("cpu", args.alloc)
    if args.arch != "native":
        env["device"] += f", -march={args.arch}"
    mode = ("fwd-inplace" if args.inplace else "fwd") + ("-interleaved" if args.interleaved else "")
    rows = []
    for dtype_name in args.dtypes:
        cases = make_cases(libraries, DTYPES[dtype_name], args.seq, inplace=args.inplace, interleaved=args.interleaved)
        times = measure_interleaved(cases, reps=args.reps, device="cpu")
        shape = f"b=1,hq=32,hk=8,s={args.seq},d=128"
        rows += rows_against_copy(times, op="rope", mode=mode, dtype=dtype_name, shape=shape, env=env)
    if args.csv is not None:
        write_rows(rows, args.csv)
        print(f"wrote {len(rows)} rows to {args.csv}")


if __name__ == "__main__":
    main()
