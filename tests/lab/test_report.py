"""report.md's tables from hand-made rows: what each cell says when seeds lack a value."""

from posenc.lab.report import summary_tables, to_markdown


def _row(seed, per_byte, *, eval_len=16):
    return {
        "encoding": "rope", "extension": "none", "finetune_steps": 0, "eval_len": eval_len, "seed": seed,
        "bits_per_byte": 2.0 + seed, "applicable": True, "reason": "", "entropy": 1.0,
        "task_accuracy": 0.0, "task_byte_accuracy": per_byte,
    }  # fmt: skip


def _results(rows, seeds):
    config = {"train_len": 16, "val_fraction": 0.1, "layers": 1, "dim": 8, "heads": 1, "steps": 1, "batch_size": 1,
              "eval_windows": 1, "score_len": 1, "task": "passkey"}  # fmt: skip
    return {
        "rows": rows, "config": config, "seeds": seeds, "command": "", "corpus": {"source": "x", "files": 1,
        "bytes": 1, "sha256": "0" * 64}, "timings": {"wall_seconds": 0.0, "units_run": 0, "units_skipped": 0},
        "versions": {"torch": "t"}, "machine": {"cpu_count": 1, "torch_threads": 1, "processes": 1},
    }  # fmt: skip


def _per_byte_cell(report):
    table = report.split("per-byte accuracy")[1]
    return next(line for line in table.splitlines() if line.startswith("| rope |")).split("|")[2].strip()


def test_a_mean_over_fewer_seeds_than_the_run_says_how_many():
    # Seed 0 evaluated before task_byte_accuracy existed (blank), seeds 1 and 2 after: the cell is their mean,
    # which must not pass for the mean over the three seeds the report's header names.
    rows = [_row(0, None), _row(1, 0.25), _row(2, 0.75)]
    report = to_markdown(_results(rows, [0, 1, 2]))
    assert _per_byte_cell(report) == "0.500 ± 0.354 (2 of 3 seeds)"
    # Every seed measured bits per byte: no mark there.
    assert "| rope | 3.000 ± 1.000 |" in report and "3.000 ± 1.000 (" not in report


def test_a_value_no_seed_measured_is_not_called_not_applicable():
    report = to_markdown(_results([_row(0, None)], [0]))
    assert _per_byte_cell(report) == "not measured"
    learned = {**_row(0, None), "encoding": "learned", "applicable": False, "reason": "past", "bits_per_byte": None}
    text = summary_tables(_results([_row(0, None), learned], [0]))
    assert "| learned | n/a |" in text
