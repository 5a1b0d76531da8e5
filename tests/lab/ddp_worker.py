"""Run by torchrun from test_ddp.py; not collected by pytest (no test_ prefix).

Runs ``posenc lab`` with the given arguments, exactly as the command line does, and records what this process
did to LOG_DIR/rank<RANK>.json: the exit status, every file it wrote (every write, the lab's and the report's,
goes through ``posenc._atomic.atomic_path``), everything it printed to stdout and stderr (progress bars
included), what it trained on and what it evaluated (see ``spy_on_work``). A run whose arguments start with
``--interrupt-at-batch N`` has its training interrupted at its N-th batch (see ``interrupt_training``); it must be
the last run. The lab's plots are written empty (see ``blank_figures``).

Usage: python ddp_worker.py LOG_DIR lab-arguments... [--then PORT LOG_DIR lab-arguments...]...

Each ``--then`` runs one more ``posenc lab`` in the same processes when the one before it has returned (a process
start and torch's import saved per run), its log in its own LOG_DIR. A later run's group meets on PORT, a store of
its own that rank 0 serves (as ``init_process_group``'s env:// does outside torchrun): torchrun's store cannot be
joined twice (a second ``init_process_group`` on it hung or failed here). The exit status is the largest of the runs'.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import sys
from pathlib import Path

import torch.distributed as dist

from posenc import _atomic
from posenc.cli import main
from posenc.lab import report, runner, train


class _BlankFigure:
    """Stands in for a matplotlib figure: saves as no bytes."""

    def savefig(self, buffer, **options) -> None:
        pass


def blank_figures(results: dict) -> dict[str, _BlankFigure]:
    """Stands in for ``report.figures``: the lab's plots (report.plot_all, as a run calls it) are each written,
    as empty PNGs, instead of drawn.

    Drawing them (matplotlib's import and four figures, ~6 s a run here) is most of a tiny run's time and has no
    bearing on the ranks: what they draw is tested in test_runner.py. Each PNG is still written, through the same
    atomic path on the same rank, so a rank other than 0 writing one would show in its "written"."""
    return {name: _BlankFigure() for name in report.plots_of(results["rows"])}


def spy_on_work() -> dict[str, list]:
    """Record, without changing what runs, the work this rank did: the losses alone cannot show it (every rank
    training on the whole batch averages identical gradients into the one-process step).

    "batches": per ``train`` call, the global batches' window starts (steps, batch) and the starts this rank
    trained on at each step. "evals": per unit evaluated, the lengths asked for and those this rank scored."""
    work: dict[str, list] = {"batches": [], "evals": []}
    real_train_starts, real_windows_at = train.train_starts, train.windows_at
    real_evaluate, real_evaluate_length = runner.Lab._evaluate, runner.evaluate_length

    def train_starts(*args, **kwargs):
        starts = real_train_starts(*args, **kwargs)
        work["batches"].append({"global": starts.tolist(), "used": []})
        return starts

    def windows_at(data, starts, length):
        work["batches"][-1]["used"].append(starts.tolist())
        return real_windows_at(data, starts, length)

    def evaluate(self, unit, models, lengths):
        work["evals"].append({"lengths": list(lengths), "mine": []})
        return real_evaluate(self, unit, models, lengths)

    def evaluate_length(model, val, ends, length, **options):
        work["evals"][-1]["mine"].append(length)
        return real_evaluate_length(model, val, ends, length, **options)

    train.train_starts, train.windows_at = train_starts, windows_at
    runner.Lab._evaluate, runner.evaluate_length = evaluate, evaluate_length
    return work


def interrupt_training(at: int) -> None:
    """Raise KeyboardInterrupt (Ctrl-C) on every rank at the same point, the ``at``-th batch trained on (from 1),
    with a checkpoint saved at every chance before it."""
    runner.CHECKPOINT_SECONDS = 0.0
    spied, batches = train.windows_at, []

    def windows_at(*args, **kwargs):
        batches.append(1)
        if len(batches) == at:
            raise KeyboardInterrupt
        return spied(*args, **kwargs)

    train.windows_at = windows_at


def commands(argv: list[str]) -> list[tuple[str | None, str, list[str]]]:
    """(port or None for torchrun's own, log dir, lab arguments) of each run, from the command line."""
    runs, port = [], None
    while "--then" in argv:
        at = argv.index("--then")
        runs.append((port, argv[0], argv[1:at]))
        port, argv = argv[at + 1], argv[at + 2 :]
    return [*runs, (port, argv[0], argv[1:])]


def run(argv: list[str]) -> int:
    rank = int(os.environ.get("RANK", "0"))
    written: list[str] = []
    real_atomic_path = _atomic.atomic_path

    @contextlib.contextmanager
    def recording(path: Path, **options):
        written.append(str(path))
        with real_atomic_path(path, **options) as tmp:
            yield tmp

    _atomic.atomic_path = recording
    report.figures = blank_figures
    work = spy_on_work()
    statuses = []
    for port, log_dir, lab_argv in commands(argv):
        if port is not None:
            os.environ |= {"MASTER_PORT": port, "TORCHELASTIC_USE_AGENT_STORE": "False"}
        written.clear()
        for records in work.values():
            records.clear()
        if lab_argv[:1] == ["--interrupt-at-batch"]:
            interrupt_training(int(lab_argv[1]))  # from here on: the last run
            lab_argv = lab_argv[2:]
        stdout, stderr = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
            status = main(["lab", *lab_argv])
        log = {"status": status, "written": written, "stdout": stdout.getvalue(), "stderr": stderr.getvalue(), **work}
        log["left_the_group"] = not dist.is_initialized()  # the lab joins the group for the run, then leaves it
        Path(log_dir, f"rank{rank}.json").write_text(json.dumps(log))
        statuses.append(status)
    return max(statuses)


if __name__ == "__main__":
    sys.exit(run(sys.argv[1:]))
