"""The benchmark scripts still run and write what docs/benchmarks.md says they write (tiny sizes, no timing asserted).

A script that pins glibc's allocation regime with mallopt runs in a subprocess (the pin would outlast it in this
one), as does one that must import Triton interpreted; the others run through their main here, where a subprocess
would only import torch again.
"""

from __future__ import annotations

import ast
import csv
import importlib
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import ClassVar

import pytest
import torch

from posenc import apply_rotary_qk
from posenc.kernels import huge_pages
from posenc.testing import torch_threads

ROOT = Path(__file__).resolve().parents[1]


def _run(script: str, *args: str, interpret: bool = False) -> str:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}
    # CPU providers only: the benchmarks run interpreted Triton only where asked (triton_tune.py's check on CPU).
    env.pop("TRITON_INTERPRET", None)
    if interpret:
        env["TRITON_INTERPRET"] = "1"
    done = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / script), *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def _rows(path: Path) -> list[dict[str, str]]:
    with path.open() as f:  # a first line of "# command" where a script records the command that made it
        return list(csv.DictReader(line for line in f if not line.startswith("#")))


def _main_in_process(monkeypatch: pytest.MonkeyPatch, script: str, *args: str) -> None:
    """``script ARGS`` through its main() in this process (its sys.argv patched, torch's thread count put back): for
    the scripts that pin no allocator here (run with glibc's defaults, "system"), where a subprocess would only
    import torch again."""
    monkeypatch.setattr(sys, "argv", [script, *args])
    with torch_threads():
        _benchmark(script.removesuffix(".py")).main()


def _benchmark(name: str) -> ModuleType:
    """A benchmark script imported here, for the tests that stand in for its subprocesses or providers (run with
    ``--alloc system``: no mallopt in this process)."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        return importlib.import_module(name)
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))


def cpu_copies() -> tuple[str, ...]:
    """rope.py's floors on this CPU, in its order: copy-huge where posenc asks for huge pages."""
    return ("copy", "copy-huge", "copy-one-launch") if huge_pages.asks() else ("copy", "copy-one-launch")


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
        for provider in (*cpu_copies(), "posenc-cpu", "posenc-torch", "hf-eager")
        for mode in ("fwd", "bwd", "fwd+bwd")
        for dtype in ("fp32", "bf16")
    }
    assert all(float(r["p20"]) <= float(r["p50"]) <= float(r["p80"]) and float(r["ratio_to_copy"]) > 0 for r in rows)
    # Each ratio is against the copy of its own mode and dtype (p50 is written to 0.1 us, hence the tolerance).
    copy_p50 = {(r["mode"], r["dtype"]): float(r["p50"]) for r in rows if r["provider"] == "copy"}
    for r in rows:
        expected = 1.0 if r["provider"] == "copy" else copy_p50[r["mode"], r["dtype"]] / float(r["p50"])
        assert float(r["ratio_to_copy"]) == pytest.approx(expected, rel=0.05, abs=1e-3), r
    assert all(f"alloc={alloc}" in r["device"] for r in rows)
    assert not out.with_name(out.name + ".partial").exists()


def test_rope_benchmark_leaves_out_a_provider_with_wrong_values(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Before timing: a provider that leaves q and k unrotated, one whose forward is right and whose gradients are
    not, and one that raises are each reported and their rows left out; the right one is timed; exit status 1."""
    rope = _benchmark("rope")
    real_providers = rope.providers

    def providers(device: str, seq: int, dtype: torch.dtype, names: list[str] | None = None) -> dict:
        cos, sin = rope.tables(seq, dtype, device)["full"]

        def rotated_forward_identity_backward(q, k):
            return tuple(x + (r - x).detach() for x, r in zip((q, k), rope.hf_eager(q, k, cos, sin), strict=True))

        def raises(q, k):
            raise RuntimeError("no kernel for this shape")

        # The real compiled provider is not made (Dynamo's and Inductor's imports, seconds): one that raises
        # stands in for it below.
        chosen = real_providers(device, seq, dtype, ["posenc-cpu", "posenc-torch", "hf-eager"])
        chosen |= {"posenc-torch": lambda q, k: (q.clone(), k.clone()), "posenc-cpu": rotated_forward_identity_backward}
        return chosen | {"torch.compile(hf-eager)": raises}

    monkeypatch.setattr(rope, "providers", providers)
    out = tmp_path / "rope.csv"
    names = ["posenc-cpu", "posenc-torch", "hf-eager", "torch.compile(hf-eager)"]
    argv = ["rope.py", "--seqs", "7", "--dtypes", "bf16", "--modes", "fwd", "bwd", "--reps", "1", "--alloc", "system"]
    monkeypatch.setattr(sys, "argv", [*argv, "--providers", *names, "--csv", str(out)])
    with pytest.raises(SystemExit) as exited:
        rope.main()
    wrong = ("posenc-cpu", "posenc-torch", "torch.compile(hf-eager)")
    assert str(exited.value.code) == "wrong values, rows left out: " + ", ".join(f"{n} (s=7 bf16)" for n in wrong)
    printed = capsys.readouterr().out
    assert "WRONG VALUES: posenc-cpu at s=7 bf16, fwd and its gradients: dq is off by up to" in printed
    assert "WRONG VALUES: posenc-torch at s=7 bf16, fwd: q is off by up to" in printed
    assert "torch.compile(hf-eager) at s=7 bf16, fwd raised RuntimeError: no kernel for this shape" in printed
    assert {(r["provider"], r["mode"]) for r in _rows(out)} == {
        (p, m) for p in (*cpu_copies(), "hf-eager") for m in ("fwd", "bwd")
    }


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_rope_value_check_passes_the_cpu_providers(dtype: torch.dtype) -> None:
    """The tolerance leaves room for every real provider's rounding (Hugging Face's formula in x's dtype rounds
    most), at an odd length (torch.compile left out: its first compile takes most of a minute here)."""
    rope = _benchmark("rope")
    q, k = rope.random_qk(1, rope.HEADS_Q, rope.HEADS_K, 217, rope.HEAD_DIM, dtype=dtype)
    chosen = {
        name: fn for name, fn in rope.providers("cpu", 217, dtype).items() if not name.startswith("torch.compile")
    }
    assert rope.check_values(chosen, q, k, ["fwd", "bwd"]) == {}


def test_rope_copy_floor_reads_what_each_mode_of_a_rotation_reads() -> None:
    """The copy moves the bytes the op moves, and the same ones: fwd+bwd's backward half reads the output gradients,
    tensors of their own, so its floor clones a second pair shaped like q and k rather than q and k again (which the
    first half had just brought into the cache, a floor under the real one where q and k fit there)."""
    rope = _benchmark("rope")
    q, k = rope.random_qk(1, 4, 2, 8, 16, dtype=torch.bfloat16)
    read: list[tuple[torch.Tensor, torch.Tensor]] = []

    def clone(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        read.append((a, b))
        return a.clone(), b.clone()

    rope.make_case("copy", clone, "fwd", q, k)()
    assert len(read) == 1 and read[0][0] is q and read[0][1] is k
    # The one-launch copy: one buffer of q's and k's bytes (their values), one clone a pass.
    flat: list[torch.Tensor] = []
    rope.make_case("copy-one-launch", lambda x: flat.append(x) or x.clone(), "fwd", q, k)()
    assert len(flat) == 1 and flat[0].nbytes == q.nbytes + k.nbytes
    assert torch.equal(flat[0], torch.cat([q.reshape(-1), k.reshape(-1)]))
    flat.clear()
    rope.make_case("copy-one-launch", lambda x: flat.append(x) or x.clone(), "fwd+bwd", q, k)()
    assert [x.nbytes for x in flat] == [q.nbytes + k.nbytes] * 2
    assert flat[0].data_ptr() != flat[1].data_ptr()
    read.clear()
    rope.make_case("copy", clone, "fwd+bwd", q, k)()
    assert len(read) == 2 and read[0][0] is q and read[0][1] is k
    for second, first in zip(read[1], (q, k), strict=True):
        assert (second.shape, second.stride(), second.dtype) == (first.shape, first.stride(), first.dtype)
        assert not any(second.untyped_storage().data_ptr() == x.untyped_storage().data_ptr() for x in (q, k))


def test_rope_benchmark_names_the_providers_it_knows(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A misspelled name is an error listing the known ones; a GPU provider on a CPU run is a note, not a crash."""
    rope = _benchmark("rope")
    argv = ["rope.py", "--seqs", "8", "--dtypes", "fp32", "--modes", "fwd", "--reps", "1", "--alloc", "system"]
    monkeypatch.setattr(sys, "argv", [*argv, "--providers", "posenc-torhc", "--csv", str(tmp_path / "a.csv")])
    with pytest.raises(SystemExit) as exited:
        rope.main()
    assert exited.value.code == 2
    assert f"--providers: unknown posenc-torhc; known: {', '.join(rope.PROVIDERS)}" in capsys.readouterr().err
    monkeypatch.setattr(sys, "argv", [*argv, "--providers", "liger", "hf-eager", "--csv", str(tmp_path / "b.csv")])
    rope.main()
    assert "note: liger runs on --device cuda only; not measured on this --device cpu run" in capsys.readouterr().out
    assert [r["provider"] for r in _rows(tmp_path / "b.csv")] == [*cpu_copies(), "hf-eager"]
    # Every provider a CPU run makes is a known name, measured on the CPU (copy-huge where posenc asks for huge
    # pages).
    made = set(rope.providers("cpu", 8, torch.float32))
    known = {name for name in rope.PROVIDERS if rope.ONLY_ON.get(name, "cpu") == "cpu"}
    assert made == known - ({"copy-huge"} - set(cpu_copies()))
    # A run that names its providers makes no torch.compile one it did not name (nor leaves out any other).
    assert set(rope.providers("cpu", 8, torch.float32, ["hf-eager"])) == made - {"torch.compile(hf-eager)"}


def test_benchmarks_without_csv_print_and_write_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Without ``--csv``, rope.py and bias_memory.py print their rows and write no file: they used to default to
    docs/results/rope_cpu.csv and bias_memory_cpu.csv, so a trial run replaced the committed results (from the
    repository's root, where the docs tell one to run them)."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "docs" / "results").mkdir(parents=True)
    argv = ["--seqs", "8", "--dtypes", "fp32", "--modes", "fwd", "--reps", "1", "--alloc", "system"]
    _main_in_process(monkeypatch, "rope.py", *argv, "--providers", "hf-eager")
    printed = capsys.readouterr().out
    assert "hf-eager" in printed and "wrote" not in printed
    bias_memory = _benchmark("bias_memory")

    def run(command: list[str], *, capture_output: bool = False, text: bool = False, check: bool = False):
        encoding, path = command[command.index("--one") + 1 : command.index("--one") + 3]
        return subprocess.CompletedProcess(command, 0, json.dumps(_bias_row(encoding, path)), "")

    monkeypatch.setattr(bias_memory.subprocess, "run", run)
    _main_in_process(monkeypatch, "bias_memory.py", "--seq", "64", "--paths", "materialized", "--encodings", "t5")
    printed = capsys.readouterr().out
    assert "t5" in printed and "materialized" in printed and "wrote" not in printed
    assert [p.relative_to(tmp_path) for p in tmp_path.rglob("*") if p.is_file()] == []


def _in_git() -> bool:
    return subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True).returncode == 0


def test_every_script_calls_its_main_when_run_as_one() -> None:
    """Most scripts run here only through their main, in this process (since 2026-12-06; as `python benchmarks/X.py`
    in a subprocess before), which leaves their `if __name__ == "__main__": main()` unrun: checked as written, as
    the script's last statement (a script without it runs nothing and exits 0)."""
    scripts = [
        path
        for path in sorted((ROOT / "benchmarks").glob("*.py"))
        if re.search(r"^def main\(", path.read_text(encoding="utf-8"), re.MULTILINE)
    ]
    assert len(scripts) >= 10, [path.name for path in scripts]
    for path in scripts:
        last = ast.unparse(ast.parse(path.read_text(encoding="utf-8")).body[-1])
        assert last == "if __name__ == '__main__':\n    main()", f"{path.name} ends with {last.splitlines()[0]!r}"


def test_decode_and_lab_throughput_benchmarks_run_with_one_rep(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """One timed sample is a row too (p20 = p50 = p80), not a StatisticsError. Both in this process: neither pins the
    allocator (lab_throughput.py's default is glibc's, "system")."""
    with torch_threads():
        _benchmark("rope_consistent_cache").main([
            *("--head-dim", "16", "--heads", "2", "--kv-heads", "1", "--max-pos", "8", "--prefill", "4"),
            *("--total", "12", "--repeats", "1", "--out", str(tmp_path / "cache.csv")),
        ])  # fmt: skip
    rows = _rows(tmp_path / "cache.csv")
    assert {(r["provider"], r["mode"]) for r in rows} == {
        (f"rope-{t}", f"{m}/{w}") for t in ("dynamic", "longrope") for m in ("hf", "consistent") for w in
        ("before", "switch", "after")
    }  # fmt: skip
    _main_in_process(monkeypatch, "lab_throughput.py", *("--preset", "quick", "--encodings", "rope", "--steps", "1"),
                     "--reps", "1", "--threads", "3", "--no-progress", "--out", str(tmp_path / "lab.csv"))  # fmt: skip
    rows = _rows(tmp_path / "lab.csv")
    assert [r["provider"] for r in rows] == ["lab", "plain"] and rows[0]["p20"] == rows[0]["p50"] == rows[0]["p80"]
    # The device column names the threads the run used (--threads 3), not torch's count before it applied them.
    assert all(r["device"].split(",")[0].endswith(" x3") for r in rows), rows[0]["device"]


def test_consistent_model_decode_benchmark_times_both_providers_and_counts_graph_ops(tmp_path: Path) -> None:
    """docs/scaling.md's decode-cost table and its Dynamo op counts come from this script: one timed step of a
    1-layer model per provider, and the ops of a compiled 1-layer decode step (backend: a counter, no Inductor;
    dynamic only, a compile being the slow part). Run here through its main(argv), not in two subprocesses that
    import torch and transformers again (it pins no allocator; its torch thread count is restored)."""
    decode = _benchmark("consistent_model_decode")
    try:
        with torch_threads():
            decode.main(["--layers", "1", "--keys", "2", "20", "--steps", "1", "--out", str(tmp_path / "decode.csv")])
            decode.main(
                ["--nodes", "--types", "dynamic", "--layers", "1", "--keys", "4", "--out", str(tmp_path / "nodes.csv")]
            )
    finally:
        torch._dynamo.reset()  # the --nodes run's compiled forwards
    rows = _rows(tmp_path / "decode.csv")
    assert [(r["provider"], r["mode"], r["shape"].split()[-1]) for r in rows] == [
        (provider, f"consistent/{rope_type}", f"keys{keys}")
        for rope_type in ("dynamic", "longrope")
        for keys in (2, 20)
        for provider in ("per-layer", "shared")
    ]
    assert all(r["min"] == r["p20"] == r["p50"] == r["p80"] for r in rows)
    assert all(float(r["ratio_to_per_layer"]) == 1.0 for r in rows if r["provider"] == "per-layer")
    rows = _rows(tmp_path / "nodes.csv")
    assert [(r["mode"], r["provider"]) for r in rows] == [("dynamic", "hf"), ("dynamic", "consistent")]
    # consistent mode rotates the cached keys in the graph: more ops than hf's for the same layer.
    assert 0 < int(rows[0]["ops_largest"]) < int(rows[1]["ops_largest"]), rows
    assert all(int(r["graphs"]) >= 1 and int(r["ops_all"]) >= int(r["ops_largest"]) for r in rows)


def test_rope_traced_path_benchmark_runs_both_cases(tmp_path: Path) -> None:
    """README's "~6x the host time" and "6.6x ... 1.6x now" come from this script: each case at the smallest size
    (the compiled case with Dynamo's eager backend: Inductor's first compile takes most of a minute here). Run here
    through its main(argv), not in two subprocesses that import torch again: it pins no allocator, puts back what
    its providers swap (test_rope_traced_path_stands_in_for_the_older_code_only_inside_its_block), joins its
    compiling thread, and its thread count and compiled functions are undone after."""
    traced = _benchmark("rope_traced_path")
    sizes = ["--heads", "2", "--kv-heads", "1", "--head-dim", "8", "--reps", "1"]
    torch._dynamo.reset()  # no RoPE forward another test compiled counts against the compiled case's fullgraph
    try:
        with torch_threads():
            traced.main(["--case", "eager-decode", *sizes, "--out", str(tmp_path / "eager.csv")])
            compiled = ["--case", "compiled", "--compiler", "eager", "--seq", "5"]
            traced.main([*compiled, *sizes, "--out", str(tmp_path / "compiled.csv")])
    finally:
        torch._dynamo.reset()
    rows = _rows(tmp_path / "eager.csv")
    assert [(r["mode"], r["provider"]) for r in rows] == [
        (t, p) for t in ("default", "linear", "yarn") for p in ("eager", "traced-path")
    ]
    assert all(r["ratio_to"] == "eager" and float(r["ratio"]) > 0 for r in rows)
    rows = _rows(tmp_path / "compiled.csv")
    assert [(r["mode"], r["provider"]) for r in rows] == [
        (f"{b}/eager", p) for b in ("torch", "auto") for p in ("table", "angles-op", "angles-inline")
    ]
    assert all(r["ratio_to"] == "table" and float(r["ratio"]) > 0 for r in rows)


def test_rope_traced_path_stands_in_for_the_older_code_only_inside_its_block() -> None:
    """The providers that stand for older code swap posenc's functions for the block and put them back: the traced
    path's check reads torch's process-wide flag there, and the angles are plain aten ops."""
    from posenc import _checks
    from posenc.rope import module

    traced = _benchmark("rope_traced_path")
    ours, op = _checks.compiling, module._angles_cos_sin
    with traced.within("traced-path"):
        assert _checks.compiling is torch.compiler.is_compiling and module.compiling is torch.compiler.is_compiling
    with traced.within("angles-inline"):
        assert module._angles_cos_sin is module._angles_cos_sin_impl
    assert _checks.compiling is ours and module.compiling is ours and module._angles_cos_sin is op


@pytest.mark.parametrize(
    ("prefill", "max_pos", "total"),
    [(80, 64, 120), (8, 64, 64), (8, 64, 65), (0, 64, 120)],
    ids=["prefill-past-max-pos", "max-pos-at-total", "no-step-after-the-switch", "no-prefill"],
)
def test_decode_benchmark_refuses_lengths_without_its_three_phases(
    prefill: int, max_pos: int, total: int, capsys: pytest.CaptureFixture[str]
) -> None:
    """A step before the switch, the switch at --max-pos, one after it: else an error naming the flags, not mislabeled
    phases or a StatisticsError."""
    consistent_cache = _benchmark("rope_consistent_cache")
    argv = ["--head-dim", "16", "--heads", "2", "--kv-heads", "1", "--repeats", "1"]
    with pytest.raises(SystemExit) as exited:
        consistent_cache.main([*argv, "--prefill", str(prefill), "--max-pos", str(max_pos), "--total", str(total)])
    assert exited.value.code == 2
    error = capsys.readouterr().err
    assert f"--prefill {prefill}, --max-pos {max_pos}, --total {total}" in error and "--prefill < --max-pos" in error


def test_rope_memory_prints_a_row_per_case_with_its_floor(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    _main_in_process(monkeypatch, "rope_memory.py", "--seq", "256", "--dtypes", "bf16", "--backends", "torch")
    out = capsys.readouterr().out
    rows = [line.strip("|").split("|") for line in out.splitlines() if line.startswith("| torch")]
    assert len(rows) == 16  # pairs x rotary x copy/in place x fwd/fwd+bwd
    q_and_k = (32 + 8) * 256 * 128 * 2 / 2**20
    for *_, call, mode, peak, floor, extra, _ in (map(str.strip, r) for r in rows):
        kept = (call == "copy") + (mode == "fwd+bwd")
        assert float(floor) == pytest.approx(kept * q_and_k, abs=0.05)
        assert float(extra) == pytest.approx(float(peak) - float(floor), abs=0.15)


def test_bias_memory_packs_documents(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The materialized path only (FlexAttention's first compile would take a minute here); the flex path with
    document ids is tested against it in tests/kernels/test_flex_bias.py. The script's main runs here: it measures
    each case in a process of its own, which it starts."""
    out = tmp_path / "bias.csv"
    _main_in_process(
        monkeypatch, "bias_memory.py", "--seq", "64", "--heads", "2", "--head-dim", "8", "--paths", "materialized",
        "--encodings", "alibi", "t5", "--documents", "4", "--batch", "2", "--csv", str(out),
    )  # fmt: skip
    rows = _rows(out)
    assert [(r["encoding"], r["path"], r["documents"], r["batch"]) for r in rows] == [
        ("alibi", "materialized", "4", "2"),
        ("t5", "materialized", "4", "2"),
    ]
    assert all(not r["warnings"] and float(r["peak_mib"]) >= 0 for r in rows)


def _bias_row(encoding: str, path: str) -> dict:
    return {"encoding": encoding, "path": path, "seq": 64, "documents": 1, "batch": 1, "heads": 2, "head_dim": 8,
            "device": "cuda", "peak_mib": 1.5, "seconds": 0.01, "torch": torch.__version__, "warnings": ""}  # fmt: skip


def test_bias_memory_keeps_every_row_when_a_case_fails(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Each case's process stood in for: the CSV is on disk with the cases done when the next one starts (a step
    limit that cuts the run keeps them), a failing case's stderr is printed, the cases after it still run, and the
    exit status says one failed."""
    bias_memory = _benchmark("bias_memory")
    out = tmp_path / "bias.csv"
    on_disk = []

    def run(command: list[str], *, capture_output: bool = False, text: bool = False, check: bool = False):
        encoding, path = command[command.index("--one") + 1 : command.index("--one") + 3]
        on_disk.append([(r["encoding"], r["path"]) for r in _rows(out)] if out.exists() else [])
        if (encoding, path) == ("alibi", "flex"):
            done = subprocess.CompletedProcess(command, 1, "", "torch.OutOfMemoryError: CUDA out of memory.\n")
        else:
            done = subprocess.CompletedProcess(command, 0, "compiling\n" + json.dumps(_bias_row(encoding, path)), "")
        if check:
            done.check_returncode()
        return done

    monkeypatch.setattr(bias_memory.subprocess, "run", run)
    sizes = ["--seq", "64", "--heads", "2", "--head-dim", "8"]
    argv = ["bias_memory.py", "--device", "cuda", *sizes, "--paths", "materialized", "flex", "--csv", str(out)]
    monkeypatch.setattr(sys, "argv", argv)
    with pytest.raises(SystemExit) as exited:
        bias_memory.main()
    assert "1 of 4 cases failed (alibi flex)" in str(exited.value.code)
    assert "torch.OutOfMemoryError: CUDA out of memory." in capsys.readouterr().err
    done = [("alibi", "materialized"), ("t5", "materialized"), ("t5", "flex")]
    assert on_disk == [[], done[:1], done[:1], done[:2]]
    assert [(r["encoding"], r["path"]) for r in _rows(out)] == done
    assert list(_rows(out)[0]) == list(bias_memory.COLUMNS)


def test_bias_memory_refuses_sizes_before_starting_a_case(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    bias_memory = _benchmark("bias_memory")
    started = []
    monkeypatch.setattr(bias_memory.subprocess, "run", lambda command, **kwargs: started.append(command))
    monkeypatch.setattr(
        sys, "argv", ["bias_memory.py", "--seq", "30", "--documents", "4", "--csv", str(tmp_path / "b")]
    )
    with pytest.raises(SystemExit) as exited:
        bias_memory.main()
    assert exited.value.code == 2 and not started
    assert "--seq 30 must be a multiple of --documents 4" in capsys.readouterr().err


def _git(repo: Path, *args: str) -> str:
    command = ["git", "-c", "user.name=t", "-c", "user.email=t@t", "-c", "commit.gpgsign=false", *args]
    return subprocess.run(command, cwd=repo, check=True, capture_output=True, text=True).stdout.strip()


def _load_common(where: Path) -> ModuleType:
    """benchmarks/common.py copied to ``where``/benchmarks and imported from there: its commit() reads that tree."""
    (where / "benchmarks").mkdir(parents=True, exist_ok=True)
    shutil.copy(ROOT / "benchmarks" / "common.py", where / "benchmarks" / "common.py")
    spec = importlib.util.spec_from_file_location(f"common_in_{where.name}", where / "benchmarks" / "common.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.skipif(shutil.which("git") is None, reason="git is not installed")
def test_commit_stamp_marks_a_tree_that_differs_from_head(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The GPU runs copy a working tree: rows of uncommitted code say so, and two such trees differ; the benchmarks'
    own CSVs under docs/ do not count."""
    monkeypatch.setenv("GIT_CEILING_DIRECTORIES", str(tmp_path))  # neither tree is inside another checkout
    for name in ("GIT_DIR", "GIT_WORK_TREE", "GIT_INDEX_FILE"):
        monkeypatch.delenv(name, raising=False)
    repo = tmp_path / "repo"
    (repo / "src").mkdir(parents=True)
    (repo / "docs").mkdir()
    (repo / "src" / "kernel.py").write_text("x = 1\n")
    (repo / "docs" / "results.csv").write_text("a\n")
    common = _load_common(repo)
    _git(repo, "init", "-q")
    _git(repo, "add", ".")
    _git(repo, "commit", "-qm", "first")
    head = _git(repo, "rev-parse", "--short", "HEAD")
    assert common.commit() == head
    (repo / "docs" / "results.csv").write_text("b\n")
    assert common.commit() == head
    (repo / "src" / "kernel.py").write_text("x = 2\n")
    first = common.commit()
    (repo / "src" / "kernel.py").write_text("x = 3\n")
    second = common.commit()
    assert re.fullmatch(rf"{head}\+dirty\.[0-9a-f]{{8}}", first) and second.startswith(f"{head}+dirty.")
    assert first != second
    (repo / "src" / "kernel.py").write_text("x = 1\n")
    (repo / "src" / "new.py").write_text("")
    empty = common.commit()
    assert empty.startswith(f"{head}+dirty.")
    # An untracked file's contents count, not its name alone: git's diff leaves them out.
    (repo / "src" / "new.py").write_text("y = 1\n")
    one = common.commit()
    assert one.startswith(f"{head}+dirty.") and one != empty
    (repo / "src" / "new.py").write_text("y = 2\n")  # the same size: read, not sized
    assert common.commit() not in (one, empty)
    # docs/ and what git ignores do not count, untracked or not.
    (repo / "docs" / "new.csv").write_text("a\n")
    (repo / ".git" / "info" / "exclude").write_text("*.log\n")
    (repo / "src" / "run.log").write_text("1\n")
    two = common.commit()
    (repo / "docs" / "new.csv").write_text("b\n")
    (repo / "src" / "run.log").write_text("2\n")
    assert common.commit() == two
    # A file above UNTRACKED_READ_BYTES counts by its size, unread.
    monkeypatch.setattr(common, "UNTRACKED_READ_BYTES", 4)
    big = common.commit()
    (repo / "src" / "new.py").write_text("y = 3\n")
    assert common.commit() == big
    (repo / "src" / "new.py").write_text("y = 30\n")
    assert common.commit() != big
    assert _load_common(tmp_path / "plain").commit() == "unknown"


@pytest.mark.skipif(not _in_git(), reason="cpu_kernel_ab.py reads the baseline's source from git")
def test_kernel_ab_builds_a_revision_and_runs_it_beside_the_tree(tmp_path: Path) -> None:
    out = tmp_path / "ab.csv"
    _run("cpu_kernel_ab.py", "--baseline", "HEAD", "--seq", "16", "--dtypes", "bf16", "--reps", "2", "--csv", str(out))
    # Labelled by hash, as decode_host_ab.py labels its rows: "kernel@HEAD" named no kernel once HEAD moved.
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout
    assert {r["provider"] for r in _rows(out)} == {"copy", f"kernel@{head.strip()}", "kernel@tree"}
    refused = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "cpu_kernel_ab.py"), "--baseline", "no-such-revision"],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT / "src")},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert refused.returncode != 0 and "--baseline 'no-such-revision' is not a commit" in refused.stderr


@pytest.mark.skipif(not _in_git(), reason="decode_host_ab.py unpacks the baseline's src from git")
def test_decode_host_ab_times_both_trees_in_turns(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """docs/benchmarks.md's decode host-cost numbers (2026-12-06 on) come from this script: each case, each pair's
    two processes (HEAD's src unpacked, the working tree's), in alternating order. The script runs here through its
    main(argv): it only starts the timing processes (they pin the allocator), so a process of its own would only
    import torch once more. With Triton installed, its host-side cases too (``--triton``)."""
    out = tmp_path / "ab.csv"
    triton = importlib.util.find_spec("triton") is not None
    _benchmark("decode_host_ab").main([
        *("--baseline", "HEAD", "--pairs", "2", "--calls", "2", "--rounds", "1", "--warmup", "1"),
        *("--prefill-tokens", "4", "--prefill-calls", "1", "--prefill-rounds", "2", "--csv", str(out)),
        *(["--triton"] if triton else []),
    ])  # fmt: skip
    printed = capsys.readouterr().out
    rows = _rows(out)
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    old = f"old@{head.stdout.strip()}"
    module = _benchmark("decode_host_ab")
    cases = module.CASES + (module.TRITON_CASES if triton else ())
    assert [(r["mode"], r["pair"], r["provider"], r["order"]) for r in rows] == [
        (case, str(pair), provider, str(order))
        for case in cases
        for pair in (1, 2)
        for provider, order in ((old, 1 + (pair == 2)), ("new@tree", 2 - (pair == 2)))
    ]
    assert all(float(r["us"]) > 0 and "x1" in r["device"] for r in rows)
    assert {r["commit"] for r in rows if r["provider"] == old} == {head.stdout.strip()}
    prefill = {r["shape"] for r in rows if r["mode"] == "RoPE(offset=100) prefill"}
    assert prefill == {"b=1,hq=32,hk=8,s=4,d=128,offset=100"}
    assert {r["dtype"] for r in rows if "bf16" in r["mode"] or "triton" in r["mode"]} == {"bf16"}
    assert {r["dtype"] for r in rows if "bf16" not in r["mode"] and "triton" not in r["mode"]} == {"fp32"}
    assert printed.count("new - old: ") == len(cases)
    with pytest.raises(SystemExit, match="'no-such-rev' is not a commit"):
        _benchmark("decode_host_ab").main(["--baseline", "no-such-rev"])


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
def test_triton_tune_checks_and_times_every_configuration(tmp_path: Path) -> None:
    out = tmp_path / "tune.csv"
    _run(
        "triton_tune.py",
        *("--device", "cpu", "--seq", "8", "--dtypes", "bf16", "--layouts", "bhsd", "bshd", "--pairs", "half"),
        *("adjacent", "--block-s", "4", "--warps", "2", "--heads", "2", "4", "--superblocks", "1", "2"),
        *("--q-heads", "8", "--k-heads", "4", "--reps", "1", "--warmup", "0", "--csv", str(out)),
        interpret=True,
    )  # no warm-up rounds: the value check has run every case once, and interpreted times mean nothing
    rows = _rows(out)
    # Interpreted, a call's time grows with its programs: two of the four dimensions vary, and 8 q and 4 k heads (not
    # 32 and 8) still make several head groups of 2 or 4 per tensor, with k's fewer than q's. 8 tokens make 2 blocks
    # of 4, so superblock 2 is a run of both (the grid's other order).
    configs = {f"BLOCK_S=4 warps=2 heads={h}" + (" super=2" if sb == 2 else "") for h in (2, 4) for sb in (1, 2)}
    modes = ("fwd-bhsd", "fwd-bshd", "fwd-bhsd-adjacent", "fwd-bshd-adjacent")
    assert {(r["provider"], r["mode"]) for r in rows} == {(p, m) for p in {"copy", "default"} | configs for m in modes}
    assert all("clock=host" in r["device"] and r["gb_per_s"] != "" for r in rows)
    assert {r["shape"] for r in rows} == {"b=1,hq=8,hk=4,s=8,d=128"}


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
def test_triton_tune_times_the_launch_that_rope_py_times(monkeypatch: pytest.MonkeyPatch) -> None:
    """The tuner planned its launches for a table read at offset 0 (the kernel specialized with CHECK_ROWS, a bound
    on every cos/sin row), where rope.py's posenc-triton, which the goal judges, calls apply_rotary_qk(q, k, cos,
    sin) with broadcast cos/sin: its default row was another kernel than the one it is the baseline of."""
    from posenc.kernels import triton_rope
    from posenc.testing import random_qk

    tune, rope = _benchmark("triton_tune"), _benchmark("rope")
    plans: list = []
    monkeypatch.setattr(triton_rope, "launch", plans.append)
    for layout in ("bhsd", "bshd"):
        q, k = random_qk(1, 2, 1, 8, 128, dtype=torch.bfloat16, layout=layout)
        if layout == "bshd":
            q, k = q.transpose(1, 2), k.transpose(1, 2)  # as triton_tune.py and rope.py's posenc-triton-bshd
        cos, sin = rope.tables(8, torch.bfloat16, "cpu")["half"]
        plans.clear()
        apply_rotary_qk(q, k, cos, sin, backend="triton")
        tune.rotation(q, k, cos, sin, False, None, None, None, None)()
        (ours, tuned) = plans
        assert (ours.grid, ours.constants, ours.options) == (tuned.grid, tuned.constants, tuned.options)
        assert not tuned.constants["CHECK_ROWS"]


def test_counts_of_zero_are_refused_by_the_parser() -> None:
    """--reps 0 passed the parser and failed in statistics after the setup; rope_module.py's --prefill 0 decoded at
    offset -1."""
    for script, args in (
        ("rope.py", ["--reps", "0"]),
        ("rope_module.py", ["--prefill", "0"]),
        ("rope_module.py", ["--reps", "30", "0"]),
        ("lab_throughput.py", ["--reps", "0"]),
    ):
        done = subprocess.run(
            [sys.executable, str(ROOT / "benchmarks" / script), *args],
            cwd=ROOT,
            env={**os.environ, "PYTHONPATH": str(ROOT / "src")},
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert done.returncode == 2 and "must be at least 1, got 0" in done.stderr, (script, done.stderr[-500:])


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
def test_rope_module_times_every_case_and_a_triton_calls_parts(tmp_path: Path) -> None:
    """The cases docs/benchmarks.md reads, and the parts of a Triton call that the GPU run takes apart (interpreted
    here: the script's path, not its times). 4 q and 2 k heads, not Llama's 32 and 8: the interpreter runs the
    kernel's programs one by one, a program per head group and token block, and the cases' paths do not depend on
    the count (k's heads fewer than q's still)."""
    out = tmp_path / "module.csv"
    _run(
        "rope_module.py",
        *("--prefill", "8", "--reps", "1", "1", "--dtypes", "bf16", "--heads", "4", "--kv-heads", "2"),
        "--launch-parts",
        *("--warmup", "0", "--csv", str(out)),  # one call of each case: interpreted times mean nothing
        interpret=True,
    )
    rows = _rows(out)
    cases = {"copy", "apply_rotary_qk", "RoPE(offset=...)", "RoPE(positions=...)"}
    cases |= {"apply_rotary_qk(freqs_cis table, offset=...)", "apply_rotary_pos_emb", "hf-llama"}
    cases |= {"apply_rotary_qk(backend='triton')", "apply_rotary_qk(backend='triton'), launch a no-op"}
    cases |= {"triton launch (planned once)", "triton kernel[grid] (planned once)"}
    assert {(r["provider"], r["mode"]) for r in rows} == {(c, m) for c in cases for m in ("prefill", "decode")}
    assert {r["shape"] for r in rows} == {"b=1,hq=4,hk=2,s=8,d=128,offset=0", "b=1,hq=4,hk=2,s=1,d=128,offset=7"}


class _FakeEvent:
    """torch.cuda.Event's timing interface: record() logs, elapsed_time() counts the log's entries in between."""

    log: ClassVar[list[str]] = []

    def __init__(self, enable_timing: bool) -> None:
        assert enable_timing
        self.at = 0.0

    def record(self) -> None:
        _FakeEvent.log.append("event")
        self.at = float(len(_FakeEvent.log))

    def elapsed_time(self, end: _FakeEvent) -> float:
        return end.at - self.at


def test_device_clock_hides_host_work_behind_a_flush_and_a_sleep(monkeypatch: pytest.MonkeyPatch) -> None:
    """The order that makes events time the GPU alone: flush L2, sleep the GPU, start event, the call, end event;
    one synchronize per round, two warm-up rounds dropped, outputs freed after the end event."""
    common = _benchmark("common")
    log = _FakeEvent.log = []

    class Flush:
        def sum(self) -> None:
            log.append("flush")

    monkeypatch.setattr(torch, "zeros", lambda *args, **kwargs: Flush())
    monkeypatch.setattr(torch.cuda, "Event", _FakeEvent)
    monkeypatch.setattr(torch.cuda, "_sleep", lambda cycles: log.append(f"sleep {cycles}"))
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: log.append("sync"))
    monkeypatch.setattr(common, "FLUSH_BYTES", 64)

    class Output:
        def __del__(self) -> None:
            log.append("freed")

    def case(name: str):
        def call() -> Output:
            log.append(name)
            return Output()

        return call

    # measure_interleaved(..., device="cuda", clock="device") calls this; the L2 flush buffer lives on `device`.
    times = common._device_clock({"a": case("a"), "b": case("b")}, reps=3, device="cpu")
    # One event between the start and end of a call: elapsed_time counts log entries, so the call's own entry.
    assert times == {"a": [2.0] * 3, "b": [2.0] * 3}
    sleep = f"sleep {common.SLEEP_CYCLES}"
    first_round = ["flush", sleep, "event", "a", "event", "freed", "flush", sleep, "event", "b", "event", "freed"]
    second_round = ["flush", sleep, "event", "b", "event", "freed", "flush", sleep, "event", "a", "event", "freed"]
    assert log[:26] == [*first_round, "sync", *second_round, "sync"]
    assert log.count("sync") == 5 and log.count(sleep) == log.count("flush") == 10
    # measure_interleaved hands CUDA's device clock to _device_clock, and nothing else.
    routed = []
    monkeypatch.setattr(common, "_device_clock", lambda cases, reps, device: routed.append((reps, device)) or {})
    assert common.measure_interleaved({"a": case("a")}, reps=4, device="cuda", clock="device") == {}
    assert routed == [(4, "cuda")]
    with pytest.raises(ValueError, match="clock='device'"):
        common.measure_interleaved({"a": case("a")}, reps=1, device="cpu", clock="device")
    with pytest.raises(ValueError, match="clock must be one of"):
        common.measure_interleaved({"a": case("a")}, reps=1, device="cpu", clock="wall")


def test_measure_interleaved_runs_its_warmup_rounds_untimed() -> None:
    """Two warm-up rounds unless told (triton_tune.py --warmup): each case runs warmup + reps times and reps are
    timed; the device clock refuses another count rather than ignore it."""
    common = _benchmark("common")
    for warmup, calls in ((None, 5), (0, 3), (1, 4)):
        ran: list[str] = []
        cases = {name: (lambda name=name, ran=ran: ran.append(name)) for name in ("a", "b")}
        options = {} if warmup is None else {"warmup": warmup}
        times = common.measure_interleaved(cases, reps=3, device="cpu", **options)
        assert [len(t) for t in times.values()] == [3, 3] and ran.count("a") == ran.count("b") == calls, warmup
    with pytest.raises(ValueError, match="warmup must be >= 0, got -1"):
        common.measure_interleaved({"a": lambda: None}, reps=1, device="cpu", warmup=-1)
    with pytest.raises(ValueError, match="warmup=0: clock='device' always runs two warm-up rounds"):
        common.measure_interleaved({"a": lambda: None}, reps=1, device="cuda", clock="device", warmup=0)


def test_gpu_goal_verdicts_from_benchmark_rows() -> None:
    spec = importlib.util.spec_from_file_location("gpu_goal", ROOT / "scripts" / "gpu_goal.py")
    gpu_goal = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gpu_goal)

    def row(provider: str, dtype: str, p50: float, ratio: float, gb_per_s: float, seq: int = 16384) -> dict:
        shape = f"b=1,hq=32,hk=8,s={seq},d=128"
        return {
            "provider": provider,
            "mode": "fwd",
            "dtype": dtype,
            "shape": shape,
            "p50": str(p50),
            "ratio_to_copy": str(ratio),
            "gb_per_s": str(gb_per_s),
            "device": "NVIDIA H200, clock=device",
        }

    rows = [
        row("copy", "bf16", 0.080, 1.0, 4200.0),
        row("posenc-triton", "bf16", 0.085, 0.94, 3950.0),
        row("liger", "bf16", 0.090, 0.89, 3730.0),
        row("flash-attn", "bf16", 0.084, 0.95, 4000.0),
        row("copy", "fp32", 0.160, 1.0, 4200.0),
        row("posenc-triton", "fp32", 0.200, 0.80, 3360.0),
        row("posenc-triton", "bf16", 0.001, 9.0, 1.0, seq=1024),  # another length: not read
        row("posenc-triton-bshd", "bf16", 0.095, 0.84, 3530.0),  # Liger's layout: compared with Liger
    ]
    assert dict(gpu_goal.verdicts(rows)) == {
        "s=16384 bf16 fwd: posenc-triton at 0.940 of the copy (4.20 TB/s); 3.95 TB/s = 0.82 of the nominal 4.8 TB/s "
        "(goal >= 0.9 of the copy)": True,
        "s=16384 bf16 fwd: posenc-triton-bshd at 0.840 of the copy (4.20 TB/s); 3.53 TB/s = 0.74 of the nominal 4.8 "
        "TB/s (goal >= 0.9 of the copy)": False,
        "s=16384 bf16 fwd: posenc-triton-bshd p50 0.0950 ms, liger 0.0900 ms": False,
        "s=16384 bf16 fwd: posenc-triton p50 0.0850 ms, flash-attn 0.0840 ms": False,
        "s=16384 fp32 fwd: posenc-triton at 0.800 of the copy (4.20 TB/s); 3.36 TB/s = 0.70 of the nominal 4.8 TB/s "
        "(goal >= 0.9 of the copy)": False,
        "s=16384 fp32 fwd: no liger row": None,
        "s=16384 fp32 fwd: no flash-attn row": None,
    }


def test_gpu_goal_judges_against_the_faster_copy() -> None:
    """Two clones pay a launch boundary that a rotation of q and k in one launch does not (Liger at 1.34 of the
    two-clone copy at 1k on the H200): where the run has the one-launch copy and it is faster, the goal is judged
    against it; where it is slower, against the two clones."""
    spec = importlib.util.spec_from_file_location("gpu_goal", ROOT / "scripts" / "gpu_goal.py")
    gpu_goal = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gpu_goal)
    shape = "b=1,hq=32,hk=8,s=16384,d=128"

    def rows(one_launch_p50: str) -> list[dict[str, str]]:
        made = (("copy", "0.0800", "1.0"), ("copy-one-launch", one_launch_p50, ""), ("posenc-triton", "0.0870", "0.92"))
        return [
            {"provider": name, "mode": "fwd", "dtype": "bf16", "shape": shape, "p50": p50, "ratio_to_copy": ratio}
            | {"device": "NVIDIA H200, clock=device"}
            for name, p50, ratio in made
        ]

    def goal(rows: list[dict[str, str]]) -> tuple[str, bool | None]:
        ((line, met),) = [(l, m) for l, m in gpu_goal.verdicts(rows, dtypes=("bf16",)) if "goal >=" in l]
        return line, met

    line, met = goal(rows("0.0770"))  # one launch faster: 0.077 / 0.087 = 0.885
    assert "posenc-triton at 0.885 (goal" in line and met is False
    line, met = goal(rows("0.0820"))  # one launch slower: the two clones' 0.92 stands
    assert "posenc-triton at 0.920 (goal" in line and met is True


def test_gpu_goal_is_unknown_for_a_dtype_the_run_lacks(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A CSV with fp32 rows alone, every check met, does not pass the goal: bf16 (the issue's dtype) was not
    measured. And a ratio just under the goal is not printed as the goal itself."""
    spec = importlib.util.spec_from_file_location("gpu_goal", ROOT / "scripts" / "gpu_goal.py")
    gpu_goal = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gpu_goal)
    shape = "b=1,hq=32,hk=8,s=16384,d=128"
    rows = [
        {"provider": name, "mode": "fwd", "dtype": "fp32", "shape": shape, "p50": p50, "ratio_to_copy": ratio}
        | {"gb_per_s": "", "device": "GPU"}
        for name, p50, ratio in (
            ("copy", "0.16", "1.0"),
            ("posenc-triton", "0.17", "0.95"),
            *((rival, "0.18", "0.9") for rival in gpu_goal.RIVALS),
        )
    ]
    path = tmp_path / "fp32_only.csv"
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    assert gpu_goal.main([str(path)]) == 1
    out = capsys.readouterr().out
    assert "goal: UNKNOWN s=16384 bf16 fwd: no rows" in out
    assert "goal: MET s=16384 fp32 fwd: posenc-triton at 0.950 (goal >= 0.9 of the copy)" in out
    assert gpu_goal.main([str(path), "--dtypes", "fp32"]) == 0
    rows[1]["ratio_to_copy"] = "0.897"
    ((line, met),) = [(line, met) for line, met in gpu_goal.verdicts(rows, dtypes=("fp32",)) if "goal >=" in line]
    assert "at 0.897 " in line and met is False


def test_gpu_goal_meets_at_the_goal_and_at_a_tie_and_reads_only_the_named_length_and_copy() -> None:
    """The goal is ">= 0.9 of the copy" and "not slower than" a rival: exactly 0.900, and a p50 equal to the
    rival's, are met. s=1638 is not a prefix match of s=16384's rows; a run with the one-launch copy but not the
    two-clone one is UNKNOWN; a dtype beyond the judged ones that the CSV has is judged too."""
    spec = importlib.util.spec_from_file_location("gpu_goal", ROOT / "scripts" / "gpu_goal.py")
    gpu_goal = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gpu_goal)

    def rows(dtype: str, providers: tuple[str, ...]) -> list[dict[str, str]]:
        p50 = {"copy": "0.090", "copy-one-launch": "0.095", "posenc-triton": "0.100", "liger": "0.100"}
        ratio = {"copy": "1.0", "posenc-triton": "0.900"}
        return [
            {"provider": name, "mode": "fwd", "dtype": dtype, "shape": "b=1,hq=32,hk=8,s=16384,d=128"}
            | {"p50": p50[name], "ratio_to_copy": ratio.get(name, ""), "gb_per_s": "", "device": "GPU"}
            for name in providers
        ]

    judged = dict(gpu_goal.verdicts(rows("fp16", ("copy", "copy-one-launch", "posenc-triton", "liger")), dtypes=()))
    assert judged["s=16384 fp16 fwd: posenc-triton at 0.900 (goal >= 0.9 of the copy)"] is True
    assert judged["s=16384 fp16 fwd: posenc-triton p50 0.1000 ms, liger 0.1000 ms"] is True
    assert gpu_goal.verdicts(rows("bf16", ("copy", "posenc-triton")), seq=1638, dtypes=("bf16",)) == [
        ("s=1638 bf16 fwd: no rows", None)
    ]
    assert gpu_goal.verdicts(rows("bf16", ("copy-one-launch", "posenc-triton")), dtypes=("bf16",)) == [
        ("s=16384 bf16 fwd: no posenc-triton or copy row", None)
    ]


@pytest.mark.skipif(shutil.which("timeout") is None, reason="gpu_check.sh runs each step under coreutils' timeout")
def test_gpu_check_runs_every_step_and_exits_1_where_one_failed(tmp_path: Path) -> None:
    """gpu_check.sh with a stand-in for python that says CUDA is there and succeeds at every step but the one named
    in FAIL: every step runs, the log is saved, and the exit status is the verdict (the log is piped into tee, whose
    status would be 0). Its step limits fit the 560 s its header promises."""
    script = (ROOT / "scripts" / "gpu_check.sh").read_text()
    limits = [int(limit) for limit in re.findall(r"^\s*step (\d+) ", script, re.MULTILINE)]
    assert sum(limits) <= 560
    python = tmp_path / "python"
    python.write_text('#!/bin/sh\ncase "$*" in *"$FAIL"*) exit 3 ;; esac\nexit 0\n')
    python.chmod(0o755)
    for fail, status in (("scripts/gpu_goal.py", 1), ("no step runs this", 0)):
        results = tmp_path / f"results-{status}"
        env = {**os.environ, "PYTHON": str(python), "RESULTS": str(results), "FAIL": fail}
        env["TRITON_CACHE_DIR"] = str(tmp_path / "triton")
        done = subprocess.run(
            ["bash", str(ROOT / "scripts" / "gpu_check.sh")], env=env, capture_output=True, text=True, timeout=60
        )
        assert done.returncode == status, done.stdout[-2000:]
        log = (results / "gpu_check.log").read_text()
        assert log.count("(limit ") == len(limits) and log.count("FAILED") == status, log
