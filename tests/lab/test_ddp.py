"""The lab under torchrun: 2 processes on gloo train like 1, only rank 0 writes or prints, and reruns resume.

Tolerance for the training losses: relative 1e-5 (about 80 float32 epsilons). Two ranks compute the same step
with other float additions: each rank's loss is a mean over half the batch and the two means are averaged, the
gradients are summed across ranks by gloo, and the ranks run 1 torch thread where the reference runs the
session's. Each reorder costs a few ulps (measured: at most 1.7e-7 relative over these steps), and AdamW carries
it forward, so the bound leaves room for that growth over a few steps. Mistakes are far larger (measured by
breaking train.py on purpose): both ranks taking the first half of each batch puts every step off, by up to 1e-1
relative; no gradient averaging (no DDP) leaves step 0 equal and puts the later steps off by up to 5e-3.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import socket
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from posenc.cli import main
from posenc.lab import report
from posenc.lab.config import make_config
from posenc.lab.dist import Ranks
from posenc.lab.lock import FolderLock
from posenc.lab.runner import Lab, assign_lengths
from posenc.testing import run_torchrun, torch_threads

pytestmark = pytest.mark.skipif(
    not dist.is_available() or not dist.is_gloo_available(), reason="torch built without gloo"
)

WORKER = Path(__file__).with_name("ddp_worker.py")
LOSS_RTOL = 1e-5
# Two layers share the t5 bias table (a parameter used twice per step); yarn is loaded from rank 0's rope
# weights on every rank; its fine-tunes at 16 and 32 use global batches of 4 and 2 windows.
TINY = {
    "dim": 16,
    "layers": 2,
    "heads": 2,
    "train_len": 8,
    "eval_lengths": (8, 16, 32),
    "steps": 6,
    "batch_size": 8,
    "eval_windows": 4,
    "encodings": ("rope", "t5"),
    "extensions": ("yarn",),
    "finetune_steps": 2,
}
FLAGS = [
    "--preset", "quick", "--dim", "16", "--layers", "2", "--heads", "2", "--train-len", "8",
    "--eval-lengths", "8,16,32", "--steps", "6", "--batch-size", "8", "--eval-windows", "4",
    "--encodings", "rope,t5", "--extensions", "yarn", "--finetune-steps", "2", "--no-figures",
]  # fmt: skip
TRAINED = ("rope", "t5", "rope+ft2-len16", "rope+ft2-len32", "rope+yarn+ft2-len16", "rope+yarn+ft2-len32")


def _worker_module():
    spec = importlib.util.spec_from_file_location("ddp_worker", WORKER)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def blank_plots():
    """The one-process runs here write the lab's plots empty, as the ranks do (see ddp_worker.blank_figures)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(report, "figures", _worker_module().blank_figures)
        yield


def torchrun_lab(logs: Path, *args: str, ok: bool = True) -> dict[int, dict]:
    """``posenc lab ARGS`` in 2 processes under torchrun; returns each rank's log (see ddp_worker.py).
    ok: whether torchrun must succeed (else it must fail)."""
    (logs,) = torchrun_labs([(logs, list(args))], ok=ok)
    return logs


def torchrun_labs(runs: list[tuple[Path, list[str]]], ok: bool = True) -> list[dict[int, dict]]:
    """Each ``posenc lab ARGS`` of ``runs`` in turn, in the same 2 processes under torchrun (ddp_worker.py's
    ``--then``: one process start and torch import for them all); returns each run's logs, by rank."""
    argv = []
    for logs, args in runs:
        logs.mkdir(parents=True)
        if argv:
            with socket.socket() as s:  # the later run's group meets here (see ddp_worker.py)
                s.bind(("127.0.0.1", 0))
                argv += ["--then", str(s.getsockname()[1])]
        argv += [str(logs), *args]
    result = run_torchrun(WORKER, *argv, timeout=120 * len(runs))
    assert (result.returncode == 0) == ok, result.stdout[-3000:] + result.stderr[-3000:]
    return [{rank: json.loads((logs / f"rank{rank}.json").read_text()) for rank in (0, 1)} for logs, _ in runs]


def train_info(out: Path, unit: str) -> dict:
    return json.loads((out / "runs" / unit / "seed0" / "train.json").read_text())


def metrics(out: Path, unit: str) -> dict:
    return json.loads((out / "runs" / unit / "seed0" / "metrics.json").read_text())


def assert_each_rank_evaluated_its_share(logs: dict[int, dict]) -> None:
    """Every evaluation was split as the runner's assign_lengths says, and rank 1 had work (not rank 0 doing all)."""
    for rank, log in logs.items():
        assert log["evals"], rank
        for unit in log["evals"]:
            assert unit["mine"] == assign_lengths(unit["lengths"], 2)[rank], (rank, unit)
    assert any(unit["mine"] for unit in logs[1]["evals"])


def without_seconds(eval_results: list[dict]) -> list[dict]:
    return [{k: v for k, v in r.items() if k != "seconds"} for r in eval_results]


@pytest.fixture(scope="module")
def runs(tmp_path_factory, corpus_dir, blank_plots):
    """A one-process run, a two-process run of the same command, and a two-process rerun of it after the
    rope+yarn unit's metrics were deleted (as if its evaluation had been interrupted). In the rerun's processes,
    after it, the two runs that must stop on every rank (see the refusal tests) and the first half of the
    interrupted-and-resumed test (its resumed run starts processes of its own), each a torchrun of its own before."""
    root = tmp_path_factory.mktemp("ddp")
    flags = [*FLAGS, "--corpus", str(corpus_dir)]
    assert main(["lab", *flags, "--out", str(root / "one"), "--no-progress"]) == 0
    first = torchrun_lab(root / "logs-first", *flags, "--out", str(root / "two"))
    before = {p: p.read_bytes() for p in (root / "two" / "runs").rglob("*") if p.is_file()}
    yarn = root / "two" / "runs" / "rope+yarn" / "seed0" / "metrics.json"
    yarn_metrics = json.loads(yarn.read_text())
    yarn.unlink()
    refused = [*flags, "--steps", "7", "--out", str(root / "two"), "--no-progress"]  # two's config has 6 steps
    # A finished run folder of the same configuration, locked by this process for the whole torchrun (the others'
    # folder is two, which the rerun needs unlocked).
    in_use = [*flags, "--out", str(root / "one"), "--no-progress"]
    interrupted = ["--interrupt-at-batch", "4", *flags, "--out", str(root / "resumed"), "--no-progress"]
    held = FolderLock(root / "one", "the test")
    try:
        again, refusal, lock, stopped = torchrun_labs(
            [
                (root / "logs-again", [*flags, "--out", str(root / "two")]),
                (root / "logs-refused", refused),
                (root / "logs-in-use", in_use),
                (root / "logs-interrupted", interrupted),
            ],
            ok=False,  # the exit status is the interrupted run's 130
        )
    finally:
        held.release()
    assert again[0]["status"] == again[1]["status"] == 0
    return {"root": root, "first": first, "again": again, "before": before, "yarn_metrics": yarn_metrics} | {
        "refused": refusal,
        "in_use": lock,
        "interrupted": stopped,
    }


def test_two_ranks_give_the_one_process_losses(runs):
    one, two = runs["root"] / "one", runs["root"] / "two"
    for unit in TRAINED:
        reference, split = train_info(one, unit), train_info(two, unit)
        assert len(split["losses"]) == split["steps"] and split["batch_size"] == reference["batch_size"]
        assert split["tokens"] == reference["tokens"]  # tokens of the whole global batch, not one rank's
        torch.testing.assert_close(
            torch.tensor(split["losses"]),
            torch.tensor(reference["losses"]),
            rtol=LOSS_RTOL,
            atol=0,
            msg=lambda m, unit=unit: f"{unit}: {m}",
        )
    results = json.loads((two / "results.json").read_text())
    assert results["machine"]["processes"] == 2
    assert {unit["processes"] for unit in results["timings"]["units"].values()} == {2}  # each unit says so too
    # Equal losses also come from every rank training on the whole batch (DDP averages identical gradients), so
    # check the rows: the same global batches on both ranks, and rank r trained on the r-th half of each.
    batches = {rank: log["batches"] for rank, log in runs["first"].items()}
    assert len(batches[0]) == len(TRAINED)
    assert [b["global"] for b in batches[0]] == [b["global"] for b in batches[1]]
    for rank, calls in batches.items():
        for call in calls:
            starts = torch.tensor(call["global"])
            half = starts.shape[1] // 2
            assert call["used"] == starts[:, rank * half : (rank + 1) * half].tolist(), rank


def test_only_rank_0_writes_files_and_prints(runs):
    rank0, rank1 = runs["first"][0], runs["first"][1]
    assert rank0["status"] == rank1["status"] == 0
    assert rank0["left_the_group"] and rank1["left_the_group"]
    assert rank1["written"] == [] and rank1["stdout"] == "" and "tok" not in rank1["stderr"]
    out = runs["root"] / "two"
    written = {Path(p).relative_to(out).as_posix() for p in rank0["written"]}
    assert {"config.json", "results.csv", "report.md", "bpb_by_length.png"} <= written
    assert {f"runs/{u}/seed0/model.safetensors" for u in TRAINED} <= written
    assert "Bits per byte, trained at 8" in rank0["stdout"] and "train rope seed 0" in rank0["stderr"]
    assert not list(out.rglob("*.tmp"))


def test_a_rerun_under_torchrun_resumes_what_is_missing_and_skips_the_rest(runs):
    rank0, rank1 = runs["again"][0], runs["again"][1]
    out = runs["root"] / "two"
    assert rank1["written"] == [] and rank1["stdout"] == ""
    # Nothing trained again: rope+yarn re-evaluated from the saved rope weights, every other unit skipped.
    runs_written = sorted(Path(p).relative_to(out).as_posix() for p in rank0["written"] if "/runs/" in p)
    assert runs_written == ["runs/rope+yarn/seed0/metrics.json"]
    assert runs["again"][0]["batches"] == runs["again"][1]["batches"] == []
    assert rank0["stdout"].count("done earlier, skipped") == len(TRAINED)
    for path, content in runs["before"].items():
        if path.name != "metrics.json" or path.parent.parent.name != "rope+yarn":
            assert path.read_bytes() == content, path
    # The resumed evaluation (split across the ranks again) gives the same numbers as the first.
    assert_each_rank_evaluated_its_share(runs["again"])
    assert without_seconds(metrics(out, "rope+yarn")["eval"]) == without_seconds(runs["yarn_metrics"]["eval"])
    assert json.loads((out / "results.json").read_text())["timings"]["units_skipped"] == len(TRAINED)


def test_a_unit_interrupted_in_training_resumes_from_rank_0s_checkpoint_on_every_rank(runs, corpus_dir):
    """Interrupted at rope's step 3 (checkpoint after step 1), the rerun resumes there on both ranks and ends with
    the uninterrupted two-process run's files: with two ranks each gradient and loss is one a + b either way.
    (The interrupted run is the fixture's; the rerun starts processes of its own, as after a real Ctrl-C.)"""
    root, out = runs["root"], runs["root"] / "resumed"
    flags = [*FLAGS, "--corpus", str(corpus_dir), "--out", str(out), "--no-progress"]
    stopped = runs["interrupted"]
    assert stopped[0]["status"] == stopped[1]["status"] == 130 and stopped[1]["written"] == []
    assert sorted(p.name for p in (out / "runs" / "rope" / "seed0").iterdir()) == ["checkpoint.safetensors"]
    logs = torchrun_lab(root / "logs-resumed", *flags)
    assert "resumed at step 1 of 6 from a checkpoint" in logs[0]["stdout"] and logs[1]["stdout"] == ""
    assert [len(logs[rank]["batches"][0]["used"]) for rank in (0, 1)] == [5, 5]  # steps 1 to 5 of rope, on each
    two, timing = root / "two", ("seconds", "tokens_per_second")
    for unit in TRAINED:
        folder, expected = out / "runs" / unit / "seed0", two / "runs" / unit / "seed0"
        assert not (folder / "checkpoint.safetensors").exists(), unit
        assert (folder / "model.safetensors").read_bytes() == (expected / "model.safetensors").read_bytes(), unit
        resumed, uninterrupted = train_info(out, unit), train_info(two, unit)
        assert {k: v for k, v in resumed.items() if k not in timing} == {
            k: v for k, v in uninterrupted.items() if k not in timing
        }, unit
    assert (out / "results.csv").read_text() == (two / "results.csv").read_text()


def test_evaluation_split_across_ranks_equals_one_process(runs, corpus_dir, tmp_path, blank_plots):
    """The two-process run's saved weights, evaluated again by one process: identical numbers, every unit."""
    assert_each_rank_evaluated_its_share(runs["first"])  # else rank 0 alone evaluating would pass the comparison
    copy = tmp_path / "copy"
    shutil.copytree(runs["root"] / "two", copy)
    for path in copy.rglob("metrics.json"):
        path.unlink()
    with torch_threads(1):  # as the ranks ran, so that the same weights give the same bits
        config = make_config("quick", corpus=str(corpus_dir), **TINY)
        Lab(config, copy, progress=False, echo=lambda line: None, ranks=Ranks(), figures=False).run()
    for unit in (*TRAINED, "rope+yarn"):
        split = metrics(runs["root"] / "two", unit)["eval"]
        assert without_seconds(metrics(copy, unit)["eval"]) == without_seconds(split), unit


def test_a_refusal_seen_by_rank_0_stops_every_rank_once(runs):
    """Rank 0 reads the folder and refuses it; rank 1 must stop with it (not wait), and the reason is said once.
    (Run by the fixture, --steps 7 against the 6 two was run with.)"""
    logs = runs["refused"]
    assert logs[0]["status"] == logs[1]["status"] == 2
    assert "different configuration (differs in: steps)" in logs[0]["stderr"] and logs[1]["stderr"] == ""
    assert logs[0]["written"] == logs[1]["written"] == []


def test_a_folder_in_use_stops_every_rank_once(runs):
    """Rank 0 takes the folder's lock; another run holding it (this test process) stops both ranks, said once.
    (Run by the fixture, on the one-process run's folder.)"""
    logs = runs["in_use"]
    assert logs[0]["status"] == logs[1]["status"] == 2
    assert f"is in use by another posenc lab run (pid {os.getpid()} on " in logs[0]["stderr"]
    assert logs[1]["stderr"] == "" and logs[0]["written"] == logs[1]["written"] == []
