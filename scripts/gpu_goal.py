"""The GPU goal of the fused RoPE kernel, read from a benchmark CSV: a verdict per dtype, printed last by gpu_check.sh.

Goal: the forward at s = 16k reaches at least 90% of the memory bandwidth (the bytes of q and k read and written
once, over the p50; measured against the copy of the same bytes in the same run, and against the GPU's nominal
HBM bandwidth where the name is known), and posenc-triton is not slower than Liger's or flash-attention's kernel,
each compared on the memory it is given: Liger rotates q and k stored (b, s, h, d), against posenc-triton-bshd
where the run has that row; flash-attention reads (b, h, s, d) memory as posenc-triton does. bf16 and fp32 are
judged (``--dtypes``): one the CSV lacks is UNKNOWN, which fails the verdict. The copy is the faster of the run's
two (``copy``, two clones, and ``copy-one-launch``, one clone of the same bytes in one buffer, where the CSV has it):
a rotation of q and k in one launch must not be credited with the gap between two launches.

    python scripts/gpu_goal.py docs/results/rope_gpu_16k.csv
"""

from __future__ import annotations

import argparse
import csv
import sys
from pathlib import Path

# Datasheet HBM bandwidth, TB/s, by a substring of torch.cuda.get_device_name(); leads, not measurements.
NOMINAL_TB_S = {"H200": 4.8, "H100 80GB HBM3": 3.35, "H100 PCIe": 2.0, "A100-SXM4-80GB": 2.04, "A100-SXM4-40GB": 1.56}
GOAL = 0.9
# Each rival against the posenc row given the same memory layout (benchmarks/rope.py's HF_LAYOUT), where present.
RIVALS = {"liger": "posenc-triton-bshd", "flash-attn": "posenc-triton"}
OURS = ("posenc-triton", "posenc-triton-bshd")
# The dtypes gpu_check.sh measures the goal in (the is bf16): one missing from the CSV is UNKNOWN, not passed.
DTYPES = ("bf16", "fp32")


def verdicts(
    rows: list[dict[str, str]], *, seq: int = 16384, mode: str = "fwd", dtypes: tuple[str, ...] = DTYPES
) -> list[tuple[str, bool | None]]:
    """(line, met) per check, met None where the run has no row to decide it; rows as benchmarks/rope.py writes.
    Every dtype of ``dtypes`` is judged, whether or not the CSV has it (a run cut short may lack one), and any other
    the CSV has."""
    lines: list[tuple[str, bool | None]] = []
    chosen = [r for r in rows if r["mode"] == mode and f"s={seq}," in r["shape"] + ","]
    for dtype in sorted(set(dtypes) | {r["dtype"] for r in chosen}):
        by = {r["provider"]: r for r in chosen if r["dtype"] == dtype}
        # The stricter floor: the faster copy (an older CSV has the two-clone copy alone).
        copies = [by[name] for name in ("copy", "copy-one-launch") if name in by]
        copy = min(copies, key=lambda r: float(r["p50"])) if "copy" in by else None
        label = f"s={seq} {dtype} {mode}"
        if not by:
            lines.append((f"{label}: no rows", None))
            continue
        if "posenc-triton" not in by or copy is None:
            lines.append((f"{label}: no posenc-triton or copy row", None))
            continue
        for name in (n for n in OURS if n in by):
            ours = by[name]
            plain = copy is by["copy"]
            ratio = float(ours["ratio_to_copy"]) if plain else round(float(copy["p50"]) / float(ours["p50"]), 3)
            tb_s = float(ours["gb_per_s"]) / 1000 if ours.get("gb_per_s") else None
            # Three places, as the CSV rounds it: 0.897 is not met, which "0.90" would hide.
            which = "the copy" if plain else "the one-launch copy"
            detail = f"{ratio:.3f} of {which} ({float(copy['gb_per_s']) / 1000:.2f} TB/s)" if tb_s else f"{ratio:.3f}"
            nominal = next((v for k, v in NOMINAL_TB_S.items() if k in ours["device"]), None)
            if tb_s is not None and nominal is not None:
                detail += f"; {tb_s:.2f} TB/s = {tb_s / nominal:.2f} of the nominal {nominal} TB/s"
            lines.append((f"{label}: {name} at {detail} (goal >= {GOAL} of the copy)", ratio >= GOAL))
        for rival, mine_name in RIVALS.items():
            if rival not in by:
                lines.append((f"{label}: no {rival} row", None))
                continue
            mine_name = mine_name if mine_name in by else "posenc-triton"
            mine, theirs = float(by[mine_name]["p50"]), float(by[rival]["p50"])
            lines.append((f"{label}: {mine_name} p50 {mine:.4f} ms, {rival} {theirs:.4f} ms", mine <= theirs))
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("csv", type=Path)
    parser.add_argument("--seq", type=int, default=16384)
    parser.add_argument("--dtypes", nargs="+", default=list(DTYPES), help="judged even where the CSV lacks them")
    args = parser.parse_args(argv)
    if not args.csv.exists():
        print(f"goal: {args.csv} is missing (its benchmark step did not finish)")
        return 1
    with args.csv.open() as f:
        lines = verdicts(list(csv.DictReader(f)), seq=args.seq, dtypes=tuple(args.dtypes))
    for line, met in lines:
        print(f"goal: {'MET ' if met else 'NOT MET ' if met is False else 'UNKNOWN '}{line}")
    return 0 if all(met for _, met in lines) else 1


if __name__ == "__main__":
    sys.exit(main())
