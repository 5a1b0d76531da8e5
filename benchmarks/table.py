"""Markdown tables from a benchmark CSV, as docs/benchmarks.md shows them: one table per shape, a row per provider,
a column per (dtype, mode), each cell "p50 ms (ratio_to_copy)".

    python benchmarks/table.py docs/results/rope_cpu.csv
"""

from __future__ import annotations

import argparse
import csv
from pathlib import Path


def tables(rows: list[dict]) -> str:
    shapes = list(dict.fromkeys(row["shape"] for row in rows))
    out = []
    for shape in shapes:
        chosen = [row for row in rows if row["shape"] == shape]
        columns = list(dict.fromkeys((row["dtype"], row["mode"]) for row in chosen))
        providers = list(dict.fromkeys(row["provider"] for row in chosen))
        cells = {(row["provider"], row["dtype"], row["mode"]): row for row in chosen}
        size = next((part for part in shape.split(",") if part.startswith("s=")), shape)
        out.append("| " + " | ".join([size, *(f"{dtype} {mode}" for dtype, mode in columns)]) + " |")
        out.append("|" + "---|" * (len(columns) + 1))
        for provider in providers:
            line = [provider]
            for dtype, mode in columns:
                row = cells.get((provider, dtype, mode))
                line.append(f"{float(row['p50']):.2f} ms ({float(row['ratio_to_copy']):.2f})" if row else "")
            out.append("| " + " | ".join(line) + " |")
        out.append("")
    return "\n".join(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("csv", type=Path)
    args = parser.parse_args()
    with args.csv.open(newline="") as file:
        print(tables(list(csv.DictReader(file))))


if __name__ == "__main__":
    main()
