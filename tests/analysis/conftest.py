"""A lab run folder made here, laid out as posenc.lab writes one, so the report is tested without running the lab."""

from __future__ import annotations

import csv
import json
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from posenc.analysis import EntropyResult, write_entropy_csv
from posenc.analysis.plots import png_bytes, render

ROWS = [
    # encoding, extension, train_len, eval_len, seed, bits_per_byte
    ("rope", "none", 64, 64, 0, "2.5"),
    ("rope", "none", 64, 64, 1, "2.7"),
    ("rope", "none", 64, 128, 0, "3.1"),
    ("rope", "yarn", 64, 128, 0, "2.6"),
    ("learned", "none", 64, 64, 0, "2.8"),
    ("learned", "none", 64, 128, 0, ""),
]


def _make_run(folder: Path, *, entropy: bool = True, lab_png: bool = True) -> Path:
    """A run folder laid out as posenc.lab writes one (results.csv, results.json, report.md, PNGs, entropy)."""
    folder.mkdir(parents=True, exist_ok=True)
    with (folder / "results.csv").open("w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(["encoding", "extension", "train_len", "eval_len", "seed", "bits_per_byte", "note"])
        for row in ROWS:
            writer.writerow([*row, "past the learned table" if row[5] == "" else ""])
    (folder / "results.json").write_text(json.dumps({"config": {"preset": "quick"}, "corpus_sha256": "ab12"}))
    (folder / "report.md").write_text("| encoding | bpb |\n|---|---|\n| rope <b> | 2.5 |\n")
    if lab_png:
        (folder / "bpb_by_length.png").write_bytes(png_bytes(render("wavelengths"), dpi=40))
    if entropy:
        measured = EntropyResult(lengths=torch.tensor([16, 32]), entropy=torch.rand(2, 2, 2).double(), source="model")
        write_entropy_csv(folder / "entropy.csv", {("rope", "none"): measured})
    return folder


@pytest.fixture
def make_run() -> Callable[..., Path]:
    """make_run(folder, *, entropy=True, lab_png=True) -> folder holding results.csv, results.json, report.md, a
    lab PNG and entropy.csv."""
    return _make_run
