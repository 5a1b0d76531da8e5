"""The benchmark scripts still run and write what docs/benchmarks.md says they write (tiny sizes, no timing asserted).

Each runs in a subprocess: they pin glibc's allocation regime with mallopt, which would outlast them in this one.
"""

from __future__ import annotations

import csv
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _run(script: str, *args: str) -> None:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}
    env.pop("TRITON_INTERPRET", None)  # CPU providers only; the benchmarks never run interpreted Triton
    done = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / script), *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]


def _rows(path: Path) -> list[dict[str, str]]:
    with path.open() as f:
        return list(csv.DictReader(f))


@pytest.mark.parametrize("alloc", ["fresh", "reuse"])
def test_rope_benchmark_writes_every_provider_mode_and_dtype(tmp_path: Path, alloc: str) -> None:
    out = tmp_path / "rope.csv"
    _run(
        "rope.py",
        *("--seqs", "16", "--dtypes", "fp32", "bf16", "--reps", "2", "--alloc", alloc),
        *("--providers", "posenc-cpu", "posenc-torch", "hf-eager", "--csv", str(out)),
    )
    rows = _rows(out)
    assert {(r["provider"], r["mode"], r["dtype"]) for r in rows} == {
        (provider, mode, dtype)
        for provider in ("copy", "posenc-cpu", "posenc-torch", "hf-eager")
        for mode in ("fwd", "bwd", "fwd+bwd")
        for dtype in ("fp32", "bf16")
    }
    assert all(float(r["p20"]) <= float(r["p50"]) <= float(r["p80"]) and float(r["ratio_to_copy"]) > 0 for r in rows)
    assert all(f"alloc={alloc}" in r["device"] for r in rows)
    assert not out.with_name(out.name + ".partial").exists()


def _in_git() -> bool:
    return subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True).returncode == 0


@pytest.mark.skipif(not _in_git(), reason="cpu_kernel_ab.py reads the baseline's source from git")
def test_kernel_ab_builds_a_revision_and_runs_it_beside_the_tree(tmp_path: Path) -> None:
    out = tmp_path / "ab.csv"
    _run("cpu_kernel_ab.py", "--baseline", "HEAD", "--seq", "16", "--dtypes", "bf16", "--reps", "2", "--csv", str(out))
    assert {r["provider"] for r in _rows(out)} == {"copy", "kernel@HEAD", "kernel@tree"}
