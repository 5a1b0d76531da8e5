"""A PyTorch-only reproducer of the CPU FlexAttention bug behind ``posenc.kernels.flex_bias.CPU_MIN_KEYS``, to attach
to an upstream report: ``torch.compile(flex_attention)`` on CPU, a plain causal block mask and no score_mod,
against eager ``flex_attention`` (the same math, unfused) in float32. On torch 2.13.0 on an AMD EPYC
host with AVX2 and no AVX-512, keys t < 128 with t = 8 mod 16 gave wrong rows among the first 8 queries in most fresh
processes (0.1-2.6 off), and t >= 128 none. Each trial runs in a fresh process: the failure came and went between
processes of the same code.

    python scripts/flex_cpu_short_keys.py                       # t = 24, 40, 128; 3 processes each (minutes)
    python scripts/flex_cpu_short_keys.py --keys 8 24 120 136 --trials 5

Prints one line per process (t, worst |compiled - eager|, the first query rows that differ) and a summary; exit
status 1 where any process at any t was off by more than --tol.
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys


def one(t: int, heads: int, dim: int, seed: int, tol: float) -> dict:
    import torch
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    torch.manual_seed(seed)
    q, k, v = (torch.randn(1, heads, t, dim) for _ in range(3))
    mask = create_block_mask(lambda b, h, qi, ki: qi >= ki, None, None, t, t, device="cpu")
    compiled = torch.compile(flex_attention)(q, k, v, block_mask=mask)
    eager = flex_attention(q, k, v, block_mask=mask)
    off = (compiled - eager).abs().amax(dim=(0, 1, 3))  # per query row
    bad = [int(i) for i in torch.nonzero(off > tol).flatten()[:8]]  # the rows the verdict counts
    return {"t": t, "max_abs": float(off.max()), "rows": bad}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--keys", type=int, nargs="+", default=[24, 40, 128], help="sequence lengths (q = k)")
    parser.add_argument("--trials", type=int, default=3, help="fresh processes per length")
    parser.add_argument("--heads", type=int, default=2)
    parser.add_argument("--dim", type=int, default=16)
    parser.add_argument("--tol", type=float, default=1e-4)
    parser.add_argument("--one", nargs=2, type=int, metavar=("T", "SEED"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.one:
        print(json.dumps(one(args.one[0], args.heads, args.dim, args.one[1], args.tol)))
        return 0
    import torch

    print(f"torch {torch.__version__}, {platform.processor() or platform.machine()}, "
          f"CPU capability {torch.backends.cpu.get_cpu_capability()}", flush=True)  # fmt: skip
    failed = {}
    for t in args.keys:
        for trial in range(args.trials):
            command = [sys.executable, __file__, "--heads", str(args.heads), "--dim", str(args.dim)]
            command += ["--tol", repr(args.tol)]
            done = subprocess.run([*command, "--one", str(t), str(trial)], capture_output=True, text=True)
            if done.returncode != 0:
                print(f"t={t} trial {trial}: the process failed\n{done.stderr[-2000:]}", flush=True)
                failed[t] = failed.get(t, 0) + 1
                continue
            row = json.loads(done.stdout.strip().splitlines()[-1])
            wrong = row["max_abs"] > args.tol
            failed[t] = failed.get(t, 0) + wrong
            rows = f", rows {row['rows']}" if wrong else ""
            print(f"t={t:>4} trial {trial}: max |compiled - eager| {row['max_abs']:.3g}{rows}", flush=True)
    for t in args.keys:
        print(f"t={t}: {failed.get(t, 0)} of {args.trials} processes off by more than {args.tol}")
    return 1 if any(failed.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
