"""What 'consistent' mode costs: per-token decode latency of one attention layer, 'hf' vs 'consistent'.

Dynamic NTK and LongRoPE change their frequencies with the length. 'hf' keeps stale keys; 'consistent' keeps the
unrotated keys in the KVCache and rebuilds the rotated copy when the frequencies change: once for LongRoPE (at the
switch), every step past the trained length for dynamic NTK (each step's frequencies differ). Phases: steps before
the switch, the switch step, and the steps after it. Prints long-format CSV rows (one per type, mode, phase):

    python benchmarks/rope_consistent_cache.py [--device cpu] [--out docs/benchmarks/rope_consistent_cache.csv]
"""

from __future__ import annotations

import argparse
import csv
import io
import platform
import sys
import time
from pathlib import Path

import torch

from common import commit, percentiles
from posenc import CausalSelfAttention, KVCache, RoPE

FIELDS = ["op", "provider", "mode", "dtype", "shape", "p20", "p50", "p80", "ratio_to_hf", "device", "torch", "commit"]


def setup(rope_type: str, mode: str, *, head_dim: int, heads: int, kv_heads: int, max_pos: int, device: str):
    params = {"rope_type": rope_type, "factor": 4.0}
    if rope_type == "longrope":
        params = {
            "rope_type": "longrope",
            "short_factor": [1.0] * (head_dim // 2),
            "long_factor": [1.0 + i / 4 for i in range(head_dim // 2)],
            "factor": 4.0,
        }
    rope = RoPE(head_dim, rope_parameters=params, max_position_embeddings=max_pos, mode=mode)
    torch.manual_seed(0)
    return CausalSelfAttention(heads * head_dim, heads, num_kv_heads=kv_heads, encoding=rope).to(device)


def time_decode(attn: CausalSelfAttention, x: torch.Tensor, prefill: int) -> list[float]:
    """Seconds per decode step for positions prefill .. x.shape[1] - 1."""
    cache = KVCache()
    times = []
    with torch.no_grad():
        attn(x[:, :prefill], cache=cache)
        for t in range(prefill, x.shape[1]):
            if x.is_cuda:
                torch.cuda.synchronize()
            start = time.perf_counter()
            attn(x[:, t : t + 1], cache=cache)
            if x.is_cuda:
                torch.cuda.synchronize()
            times.append(time.perf_counter() - start)
    return times


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--max-pos", type=int, default=512, help="trained length: the switch happens past it")
    parser.add_argument("--prefill", type=int, default=384)
    parser.add_argument("--total", type=int, default=1024)
    parser.add_argument(
        "--repeats", type=int, default=3, help="timed runs per setting, after an untimed one; the best step kept"
    )
    parser.add_argument("--out", type=Path, default=None, help="also write the CSV here")
    args = parser.parse_args(argv)
    # Decode steps run at positions --prefill .. --total - 1; the phases need a step before position --max-pos, the
    # step at it (the switch) and one after it.
    if not 1 <= args.prefill < args.max_pos < args.total - 1:
        parser.error(
            f"need 1 <= --prefill < --max-pos < --total - 1 (a decode step before the switch at position --max-pos, "
            f"and one after it); got --prefill {args.prefill}, --max-pos {args.max_pos}, --total {args.total}"
        )
    if args.repeats < 1:
        parser.error(f"--repeats must be at least 1, got {args.repeats}")

    torch.set_num_threads(max(1, torch.get_num_threads()))
    dim = args.heads * args.head_dim
    x = torch.randn(1, args.total, dim, generator=torch.Generator().manual_seed(1)).to(args.device)
    switch = args.max_pos - args.prefill  # index of the step at position max_pos (seq_len max_pos + 1)
    rows = []
    for rope_type in ("dynamic", "longrope"):
        medians: dict[str, float] = {}
        sizes = dict(head_dim=args.head_dim, heads=args.heads, kv_heads=args.kv_heads, max_pos=args.max_pos)
        layers = {mode: setup(rope_type, mode, device=args.device, **sizes) for mode in ("hf", "consistent")}
        runs: dict[str, list[list[float]]] = {mode: [] for mode in layers}
        # The modes take turns run by run, after an untimed run of each: timed one after the other, the first
        # (cold) run and any load on the host fell on one mode alone (hf at 8 ms a step against 0.2 ms).
        for repeat in range(args.repeats + 1):
            for mode, attn in layers.items():
                run = time_decode(attn, x, args.prefill)
                if repeat:
                    runs[mode].append(run)
        for mode in layers:
            steps = [min(run[i] for run in runs[mode]) * 1e3 for i in range(len(runs[mode][0]))]  # ms, best run
            phases = {"before": steps[:switch], "switch": steps[switch : switch + 1], "after": steps[switch + 1 :]}
            for phase, values in phases.items():
                p20, p50, p80 = percentiles(values)
                key = f"{phase}"
                if mode == "hf":
                    medians[key] = p50
                rows.append(
                    {
                        "op": "decode_step",
                        "provider": f"rope-{rope_type}",
                        "mode": f"{mode}/{phase}",
                        "dtype": "float32",
                        "shape": f"b1 h{args.heads} g{args.kv_heads} d{args.head_dim} t{args.prefill}..{args.total}",
                        "p20": f"{p20:.4f}",
                        "p50": f"{p50:.4f}",
                        "p80": f"{p80:.4f}",
                        "ratio_to_hf": f"{p50 / medians[key]:.2f}",
                        "device": args.device if args.device != "cpu" else f"cpu:{platform.processor() or 'x86'}",
                        "torch": torch.__version__,
                        "commit": commit(),
                    }
                )
    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, fieldnames=FIELDS)
    writer.writeheader()
    writer.writerows(rows)
    sys.stdout.write(buffer.getvalue())
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(
            f"# python benchmarks/rope_consistent_cache.py {' '.join(argv or sys.argv[1:])}\n" + buffer.getvalue()
        )


if __name__ == "__main__":
    main()
