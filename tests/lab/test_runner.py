"""End to end on tiny corpora: what a run writes, resuming, interrupts, determinism and bad input."""

from __future__ import annotations

import copy
import csv
import dataclasses
import io
import json
import shutil
import statistics
import subprocess
import sys
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import pytest
import torch
from matplotlib.container import ErrorbarContainer
from safetensors import SafetensorError

from posenc.analysis.plots import FIGURES as ANALYSIS_FIGURES
from posenc.cli import main
from posenc.lab import runner, store
from posenc.lab import train as train_module
from posenc.lab.config import make_config
from posenc.lab.data import eval_text_needed, eval_window_ends, load_corpus
from posenc.lab.report import PLOTS, aggregate, figures, label, summary_tables, to_markdown
from posenc.lab.runner import Lab, plan
from posenc.testing import torch_threads

REQUIRED = ("encoding", "extension", "train_len", "eval_len", "seed", "bits_per_byte")


def rows_of(out):
    return list(csv.DictReader(io.StringIO((out / "results.csv").read_text())))


def quiet(config, out, **kwargs):
    """A Lab without progress bars that prints nothing (unless given an echo) and, unless asked (figures=True), leaves
    the nine analysis figures out of its report.html: most of a tiny run's time is drawing them, and only the tests
    of the page need them."""
    return Lab(config, out, **{"progress": False, "echo": lambda line: None, "figures": False, **kwargs})


@pytest.fixture(scope="module")
def finished(tmp_path_factory, corpus_dir):
    """One complete tiny run with every encoding, extension and a 2-step fine-tune."""
    config = make_config(
        "quick",
        corpus=str(corpus_dir),
        dim=16,
        layers=1,
        heads=2,
        train_len=8,
        steps=6,
        batch_size=4,
        eval_windows=4,
        finetune_steps=2,
    )
    out = tmp_path_factory.mktemp("run")
    results = quiet(config, out, command="posenc lab --test", figures=True).run()
    return config, out, results


def test_a_run_writes_csv_json_report_and_plots(finished):
    config, out, results = finished
    rows = rows_of(out)
    assert set(REQUIRED) <= set(rows[0])
    # 6 encodings x 4 lengths, 5 extensions x 3 lengths, pi, yarn and their control (plain rope, "none")
    # fine-tuned at each of 3 lengths
    assert len(rows) == 6 * 4 + 5 * 3 + 3 * 3 == len(results["rows"])
    assert {r["encoding"] for r in rows} == set(config.encodings)
    assert {r["extension"] for r in rows} == {"none", *config.extensions}
    assert {(r["encoding"], r["extension"], r["eval_len"]) for r in rows if r["finetune_steps"] == "2"} == {
        ("rope", e, str(n)) for e in ("none", "pi", "yarn") for n in (16, 32, 64)
    }
    for row in rows:
        if row["encoding"] == "learned" and int(row["eval_len"]) > 8:
            assert row["applicable"] == "False" and row["bits_per_byte"] == ""
            assert "max_positions=8" in row["reason"]
        else:
            assert row["applicable"] == "True" and 0 < float(row["bits_per_byte"]) < 12
            assert len(json.loads(row["entropy_by_layer"])) == 1
        # The factor is how far past training: eval_len / train_len (2 at 16 for train_len 8).
        assert float(row["factor"]) == int(row["eval_len"]) / config.train_len
    stored = json.loads((out / "results.json").read_text())
    assert stored["corpus"]["sha256"] == results["corpus"]["sha256"] and stored["seeds"] == [0]
    assert {"torch", "python", "posenc"} <= set(stored["versions"]) and stored["machine"]["cpu_count"] >= 1
    assert stored["timings"]["units_run"] == len(plan(config)) and stored["command"] == "posenc lab --test"
    report = (out / "report.md").read_text()
    assert "| learned | " in report and "n/a" in report and "rope+yarn+ft2" in report
    # The control is a row of the extensions' table, not of the encodings' (nor a curve of bpb_by_length.png).
    extensions_table = report.split("RoPE extensions")[1]
    assert "| rope+ft2 |" in extensions_table and "| rope+ft2 |" not in report.split("RoPE extensions")[0]
    for name in PLOTS:
        assert (out / name).read_bytes().startswith(b"\x89PNG\r\n\x1a\n"), name
        assert f"]({name})" in report
    page = (out / "report.html").read_text()  # the self-contained page of posenc.analysis, at every run's end
    assert "rope+yarn" in page and page.count("data:image/png;base64,") == len(PLOTS) + len(ANALYSIS_FIGURES)
    assert "How the encodings work" in page
    assert 'class="note"' not in page  # the run that holds the folder writes it: no "a run is writing it" note
    assert not list(out.rglob("*.tmp"))


def test_the_report_counts_in_the_singular_where_there_is_one(finished):
    # The quick preset's model read "1 layers" in report.md.
    _, _, results = finished
    ones, twos = copy.deepcopy(results), copy.deepcopy(results)
    counts = {"config": ("layers", "heads", "steps", "batch_size", "eval_windows", "score_len")}
    counts |= {"corpus": ("files",), "timings": ("units_run",), "machine": ("cpu_count", "torch_threads", "processes")}
    for part, keys in counts.items():
        for key in keys:
            ones[part][key], twos[part][key] = 1, 2
    one, two = to_markdown(ones), to_markdown(twos)
    assert "(1 file, " in one and "(2 files, " in two
    assert "- model: 1 layer, width 16, 1 head, trained at 8 bytes for 1 step of 1 window\n" in one
    assert "- model: 2 layers, width 16, 2 heads, trained at 8 bytes for 2 steps of 2 windows\n" in two
    assert "- evaluation: 1 window per length, the same final 1 byte of each scored" in one
    assert "- evaluation: 2 windows per length, the same final 2 bytes of each scored" in two
    assert "(1 unit run, " in one and ", 1 CPU, 1 torch thread, 1 process\n" in one
    assert "(2 units run, " in two and ", 2 CPUs, 2 torch threads, 2 processes\n" in two


def drawn(axis):
    """Legend name -> (x, y) of its curve; an errorbar's data line is the first element of its container."""
    curves = {}
    for handle, name in zip(*axis.get_legend_handles_labels(), strict=True):
        line = handle.lines[0] if isinstance(handle, ErrorbarContainer) else handle
        curves[name] = ([float(x) for x in line.get_xdata()], [float(y) for y in line.get_ydata()])
    return curves


def by_length(rows, value):
    """Model label -> (eval lengths ascending, mean of ``value`` over seeds at each), from results.csv's cells.

    Computed here, not with report.aggregate, which has no test of its own."""
    values = defaultdict(list)
    for row in rows:
        if row[value]:  # empty where the model is not applicable at that length
            values[(label(row), row["eval_len"])].append(float(row[value]))
    curves = defaultdict(lambda: ([], []))
    for (name, length), members in sorted(values.items()):
        curves[name][0].append(length)
        curves[name][1].append(statistics.fmean(members))
    return dict(curves)


def assert_curves(axis, expected):
    curves = drawn(axis)
    assert set(curves) == set(expected)
    for name, (xs, ys) in expected.items():
        assert curves[name][0] == xs, name
        assert curves[name][1] == pytest.approx(ys, rel=1e-12), name


def test_the_plots_draw_the_right_columns_of_results_csv(finished):
    # The PNG files only prove something was drawn: read the figures' data instead, from results.json alone.
    _, out, _ = finished
    stored = json.loads((out / "results.json").read_text())
    drawn_figures = figures(stored)
    assert set(drawn_figures) == set(PLOTS)
    # label() reads finetune_steps as a number; the CSV gives strings.
    rows = [{**r, "finetune_steps": int(r["finetune_steps"]), "eval_len": int(r["eval_len"])} for r in rows_of(out)]
    encodings = [r for r in rows if r["extension"] == "none" and not r["finetune_steps"]]
    rope = [r for r in rows if r["encoding"] == "rope"]
    (bpb,) = drawn_figures["bpb_by_length.png"].axes
    assert_curves(bpb, by_length(encodings, "bits_per_byte"))
    (extensions,) = drawn_figures["rope_extensions.png"].axes
    assert_curves(extensions, by_length(rope, "bits_per_byte"))
    entropy_encodings, entropy_extensions = drawn_figures["entropy_by_length.png"].axes
    assert_curves(entropy_encodings, by_length(encodings, "entropy"))
    assert_curves(entropy_extensions, by_length(rope, "entropy"))

    # loss_by_position is not in results.csv: the mean over seeds of results.json's rows in the longest windows.
    longest = max(r["eval_len"] for r in rows)
    at_longest = defaultdict(list)
    for row in stored["rows"]:
        if row["eval_len"] == longest and row["applicable"] and not row["finetune_steps"]:
            at_longest[label(row)].append(row)
    expected = {}
    for name, members in at_longest.items():
        losses = [statistics.fmean(column) for column in zip(*(m["loss_by_position"] for m in members), strict=True)]
        width = members[0]["position_bin"]
        expected[name] = ([(i + 0.5) * width for i in range(len(losses))], losses)
    assert "rope+yarn" in expected and "learned" not in expected  # learned stops at train_len
    (positions,) = drawn_figures["loss_by_position.png"].axes
    assert_curves(positions, expected)


def test_extensions_really_change_the_rope_model(finished):
    config, out, _ = finished
    by = {(r["extension"], r["finetune_steps"], r["eval_len"]): r["bits_per_byte"] for r in rows_of(out)}
    for extension in ("pi", "ntk", "yarn", "llama3"):
        assert by[(extension, "0", "64")] != by[("none", "0", "64")], extension
    # Each length is extended by its own factor s = n / train_len (docs/lab.md), not the longest length's.
    units = json.loads((out / "results.json").read_text())["timings"]["units"]
    scaled = {
        k: u["rope_parameters"]
        for k, u in units.items()
        if k.startswith("rope+") and "dynamic" not in k and not k.startswith("rope+ft")
    }
    assert len(scaled) == 4 + 2 * 3  # pi, ntk, yarn, llama3, and pi and yarn fine-tuned at 3 lengths
    # The control is tuned with the RoPE the model trained with, and differs from the untuned model.
    control = {k: u["rope_parameters"] for k, u in units.items() if k.startswith("rope+ft")}
    assert sorted(control) == [f"rope+ft2-len{n}/seed0" for n in (16, 32, 64)]
    assert all(list(p.values()) == [None] for p in control.values())
    for n in ("16", "32", "64"):
        assert by[("none", "2", n)] != by[("none", "0", n)], n
    for name, parameters in scaled.items():
        assert {int(n): p["factor"] for n, p in parameters.items()} == {
            int(n): int(n) / config.train_len for n in parameters
        }, name
        assert "+ft" in name or sorted(map(int, parameters)) == [16, 32, 64], name


def test_rerun_skips_everything_it_finished(finished, monkeypatch):
    config, out, _ = finished
    before = (out / "results.csv").read_text()
    monkeypatch.setattr(runner, "train", lambda *a, **k: pytest.fail("a finished unit was trained again"))
    again = quiet(config, out).run()
    assert again["timings"]["units_run"] == 0 and (out / "results.csv").read_text() == before


def test_each_unit_records_its_threads_device_and_processes(tiny_config, tmp_path, monkeypatch):
    # Under torchrun a unit's timings are one rank's share, and the device and the process count change float sums
    # in the last bits: a resumed run that mixed settings showed threads per unit but neither of these. Units
    # written before they were recorded load as None (not recorded).
    config = tiny_config(encodings=("rope", "alibi"))
    out = tmp_path / "run"
    first = quiet(config, out).run()
    for unit in first["timings"]["units"].values():
        assert unit["torch_threads"] == torch.get_num_threads() and (unit["device"], unit["processes"]) == ("cpu", 1)
    assert first["machine"]["processes"] == 1
    older = out / "runs" / "alibi" / "seed0" / "metrics.json"
    stored = json.loads(older.read_text())
    assert (stored["device"], stored["processes"]) == ("cpu", 1)
    del stored["processes"], stored["torch_threads"], stored["device"]
    store.write_json(older, stored)
    monkeypatch.setattr(runner, "train", lambda *a, **k: pytest.fail("a finished unit was trained again"))
    again = quiet(config, out).run()
    units = again["timings"]["units"]
    assert [units["alibi/seed0"][key] for key in ("torch_threads", "device", "processes")] == [None] * 3
    assert units["rope/seed0"]["processes"] == 1 and again["rows"] == first["rows"]


def _interrupted_at_call(n: int, real: Callable[..., Any]) -> Callable[..., Any]:
    """``real``, but its n-th call raises KeyboardInterrupt (a Ctrl-C at that point) instead."""
    calls = 0

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        nonlocal calls
        calls += 1
        if calls == n:
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    return wrapper


def test_ctrl_c_keeps_finished_units_and_resuming_gives_the_same_numbers(tiny_config, tmp_path, monkeypatch):
    config = tiny_config(encodings=("learned", "sinusoidal", "rope"), extensions=("pi",), finetune_steps=2)
    reference = tmp_path / "reference"
    quiet(config, reference).run()
    out = tmp_path / "interrupted"
    real_train = runner.train
    monkeypatch.setattr(runner, "train", _interrupted_at_call(3, real_train))
    with pytest.raises(KeyboardInterrupt):
        quiet(config, out).run()
    done = sorted(p.parent.parent.name for p in out.rglob("metrics.json"))
    assert done == ["learned", "sinusoidal"]
    assert not list(out.rglob("*.tmp")) and not (out / "results.csv").exists()
    monkeypatch.setattr(runner, "train", real_train)
    resumed = quiet(config, out).run()
    assert resumed["timings"]["units_skipped"] == 2
    # Same seed, same numbers: trained in another order of process states, the results are byte-identical.
    assert (out / "results.csv").read_text() == (reference / "results.csv").read_text()
    # So are the weights files, header included: safetensors writes metadata keys in a random order (a Rust
    # HashMap), and with two keys the same weights differed by their header from run to run.
    weights = sorted(path.relative_to(reference) for path in reference.rglob("model.safetensors"))
    assert len(weights) == 9  # learned, sinusoidal, rope, and the fine-tunes of none and pi at 3 lengths
    for path in weights:
        assert (out / path).read_bytes() == (reference / path).read_bytes(), path


def without_timing(path):
    info = json.loads(path.read_text())
    return {k: v for k, v in info.items() if k not in ("seconds", "tokens_per_second")}


def test_an_interrupt_mid_training_resumes_from_the_checkpoint_bit_for_bit(tiny_config, tmp_path, monkeypatch):
    """A unit interrupted in training goes on from its last checkpoint, not from step 0, and ends with the files of
    a run never interrupted: the same weights (byte for byte), train.json losses and results.csv."""
    config = tiny_config(encodings=("t5",), extensions=(), steps=45)
    reference = tmp_path / "reference"
    quiet(config, reference).run()  # saves no checkpoint: it ends in well under CHECKPOINT_SECONDS
    # One setting trained it all: train.json names none (the resumed one, compared with it below, neither).
    assert "trained_with" not in json.loads((reference / "runs" / "t5" / "seed0" / "train.json").read_text())
    out = tmp_path / "interrupted"
    folder = out / "runs" / "t5" / "seed0"
    monkeypatch.setattr(runner, "CHECKPOINT_SECONDS", 0.0)  # at every check: after steps 1 and 21
    real_windows_at, batches, interrupt = train_module.windows_at, [], [True]

    def counted(*args, **kwargs):  # the batches trained on; the first run is interrupted at step 30
        batches.append(1)
        if interrupt[0] and len(batches) == 31:
            raise KeyboardInterrupt
        return real_windows_at(*args, **kwargs)

    monkeypatch.setattr(train_module, "windows_at", counted)
    with pytest.raises(KeyboardInterrupt):
        quiet(config, out).run()
    interrupt[0] = False
    assert sorted(p.name for p in folder.iterdir()) == ["checkpoint.safetensors"] and not list(out.rglob("*.tmp"))
    # One run saved this under another configuration (another lr): it is not resumed, and not lost either.
    tensors, metadata = store.load_tensors(folder / "checkpoint.safetensors")
    other = json.loads(metadata["posenc_train_state"])
    other["identity"]["lr"] *= 2
    other_folder = tmp_path / "other"
    shutil.copytree(out, other_folder)
    store.save_tensors(
        other_folder / "runs" / "t5" / "seed0" / "checkpoint.safetensors",
        tensors,
        {"posenc_train_state": json.dumps(other)},
    )
    for folder_, resumed_at, trained in ((out, 21, 45 - 21), (other_folder, None, 45)):
        batches.clear()
        lines = []
        quiet(config, folder_, echo=lines.append).run()
        assert len(batches) == trained, folder_
        said = [line for line in lines if "resumed at step" in line or "not resumed" in line]
        if resumed_at is None:
            assert len(said) == 1 and "saved by another configuration or posenc, not resumed" in said[0]
        else:
            assert len(said) == 1 and f"resumed at step {resumed_at} of 45 from a checkpoint" in said[0]
        unit = folder_ / "runs" / "t5" / "seed0"
        assert sorted(p.name for p in unit.iterdir()) == ["metrics.json", "model.safetensors", "train.json"]
        expected = reference / "runs" / "t5" / "seed0"
        assert (unit / "model.safetensors").read_bytes() == (expected / "model.safetensors").read_bytes()
        assert without_timing(unit / "train.json") == without_timing(expected / "train.json")
        assert (folder_ / "results.csv").read_text() == (reference / "results.csv").read_text()
    # The resumed unit's seconds are those of both runs: its first 21 steps' time is kept, not lost.
    assert json.loads((folder / "train.json").read_text())["seconds"] > other["seconds"] > 0


def test_a_unit_resumed_with_another_thread_count_records_both_in_train_json(tiny_config, tmp_path, monkeypatch):
    """The thread count changes float sums in their last bits and metrics.json records the last run's: a unit whose
    checkpoint's steps ran with 1 thread and the rest with 2 says so (its numbers are those of neither setting)."""
    config = tiny_config(encodings=("alibi",), extensions=(), steps=30)
    out = tmp_path / "run"
    monkeypatch.setattr(runner, "CHECKPOINT_SECONDS", 0.0)  # saves after steps 1 and 21
    real_windows_at = train_module.windows_at
    monkeypatch.setattr(train_module, "windows_at", _interrupted_at_call(25, real_windows_at))
    with torch_threads(1), pytest.raises(KeyboardInterrupt):
        quiet(config, out).run()
    monkeypatch.setattr(train_module, "windows_at", real_windows_at)
    lines = []
    with torch_threads(2):
        results = quiet(config, out, echo=lines.append).run()
    assert any("resumed at step 21 of 30" in line for line in lines)
    said = [line for line in lines if "earlier steps ran with" in line]
    assert len(said) == 1 and "1 torch thread(s) on cpu in 1 process(es), these with 2 torch thread(s)" in said[0]
    expected = [
        {"from_step": 0, "torch_threads": 1, "device": "cpu", "processes": 1},
        {"from_step": 21, "torch_threads": 2, "device": "cpu", "processes": 1},
    ]
    assert json.loads((out / "runs" / "alibi" / "seed0" / "train.json").read_text())["trained_with"] == expected
    assert results["timings"]["units"]["alibi/seed0"]["train"]["trained_with"] == expected


def test_a_checkpoint_that_cannot_be_written_is_said_once_and_training_goes_on(tiny_config, tmp_path, monkeypatch):
    """A full disk or quota ended the unit's training with a bare SafetensorError / OSError from the checkpoint,
    which only saves time; the unit now finishes with the numbers of a run that saved none."""
    config = tiny_config(encodings=("rope",), extensions=(), steps=45)
    reference = tmp_path / "reference"
    quiet(config, reference).run()
    monkeypatch.setattr(runner, "CHECKPOINT_SECONDS", 0.0)
    real, refused = store.save_tensors, []

    def full(path, *args, **kwargs):  # room for the weights at the end, not for a checkpoint
        if path.name == "checkpoint.safetensors":
            refused.append(path)  # safetensors' own error (its write), then an OSError (the rename)
            raise SafetensorError("No space left on device") if len(refused) == 1 else OSError(28, "No space left")
        return real(path, *args, **kwargs)

    monkeypatch.setattr(store, "save_tensors", full)
    lines: list[str] = []
    quiet(config, tmp_path / "full", echo=lines.append).run()
    said = [line for line in lines if "could not write a checkpoint" in line]
    assert len(said) == 1 and "No space left" in said[0] and "training goes on without" in said[0]
    assert len(refused) == 3  # after steps 1, 21 and 41
    assert (tmp_path / "full" / "results.csv").read_text() == (reference / "results.csv").read_text()


@pytest.mark.parametrize("target", ["model.safetensors", "results.csv"])
def test_a_full_disk_is_one_error_line_and_the_rerun_resumes(target, tiny_config, tmp_path, monkeypatch, capsys):
    """A full disk (or quota, or a folder made read-only) while the run wrote a unit's weights or the report
    escaped run_command as a bare SafetensorError / OSError traceback; it is now one line that says the finished
    units are kept, and the same command, rerun once there is room, finishes as an uninterrupted run."""
    overrides = vars(tiny_config(encodings=("rope",), extensions=("pi",)))
    reference = tmp_path / "reference"
    assert runner.run_command(preset="quick", out=reference, overrides=overrides, progress=False, figures=False) == 0
    real_tensors, real_text = store.save_tensors, store.write_text

    def save_tensors(path, *args, **kwargs):
        if path.name == target:
            raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")
        return real_tensors(path, *args, **kwargs)

    def write_text(path, *args, **kwargs):
        if path.name == target:
            raise OSError(28, "No space left on device", str(path.parent / f".{path.name}.tmp"))
        return real_text(path, *args, **kwargs)

    monkeypatch.setattr(store, "save_tensors", save_tensors)
    monkeypatch.setattr(store, "write_text", write_text)
    out = tmp_path / "run"
    capsys.readouterr()
    assert runner.run_command(preset="quick", out=out, overrides=overrides, progress=False, figures=False) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"posenc lab: error: {out}: ") and "No space left on device" in err[0]
    assert "run the same command again to continue" in err[0]
    monkeypatch.setattr(store, "save_tensors", real_tensors)
    monkeypatch.setattr(store, "write_text", real_text)
    assert runner.run_command(preset="quick", out=out, overrides=overrides, progress=False, figures=False) == 0
    assert (out / "results.csv").read_text() == (reference / "results.csv").read_text()


def test_a_closed_stdout_is_not_said_to_be_a_full_disk(tiny_config, tmp_path, monkeypatch, capsys):
    """The run's lines on a pipe its reader closed (``posenc lab ... | head -1``) raise BrokenPipeError, an OSError,
    which run_command said was the run folder refusing writes: "make room (a full disk or quota) or make the folder
    writable". Only a write refused by the file system is said so; this error is raised as it is."""
    overrides = vars(tiny_config(encodings=("rope",), extensions=()))

    class ClosedPipe(io.StringIO):
        def write(self, text: str) -> int:
            raise BrokenPipeError(32, "Broken pipe")

    monkeypatch.setattr("sys.stdout", ClosedPipe())
    with pytest.raises(BrokenPipeError):
        runner.run_command(preset="quick", out=tmp_path / "run", overrides=overrides, progress=False)
    assert "make room" not in capsys.readouterr().err


def test_interrupted_evaluation_resumes_without_retraining(tiny_config, tmp_path, monkeypatch):
    # Heads of 3 channels: no rope, so an odd head size trains, and the report draws its RoPE figures at 4.
    config = tiny_config(encodings=("alibi",), extensions=(), dim=12, heads=4)
    out = tmp_path / "run"
    real = runner.evaluate_length

    def interrupt(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(runner, "evaluate_length", interrupt)
    with pytest.raises(KeyboardInterrupt):
        quiet(config, out).run()
    folder = out / "runs" / "alibi" / "seed0"
    assert sorted(p.name for p in folder.iterdir()) == ["model.safetensors", "train.json"]
    monkeypatch.setattr(runner, "evaluate_length", real)
    monkeypatch.setattr(runner, "train", lambda *a, **k: pytest.fail("trained again"))
    # As a run killed between writing train.json and deleting its checkpoint leaves it: deleted when the unit resumes.
    (folder / "checkpoint.safetensors").write_bytes(b"left over")
    results = quiet(config, out, figures=True).run()
    assert len(results["rows"]) == 4 and (folder / "metrics.json").exists()
    assert not (folder / "checkpoint.safetensors").exists()
    # Without a rope model there is no extensions plot to draw, nor one named in the report.
    assert not (out / "rope_extensions.png").exists() and "rope_extensions.png" not in (out / "report.md").read_text()
    assert (out / "entropy_by_length.png").exists() and (out / "report.html").exists()


def test_run_command_reports_an_interrupt(tiny_config, tmp_path, monkeypatch, capsys):
    def interrupt(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(runner, "train", interrupt)
    overrides = {k: v for k, v in vars(tiny_config(encodings=("nope",), extensions=())).items()}
    status = runner.run_command(preset="quick", out=tmp_path / "r", overrides=overrides, progress=False)
    assert status == 130
    assert "interrupted; every finished run is saved" in capsys.readouterr().err


@pytest.mark.parametrize("where", ["reading the corpus", "SIGTERM while training"])
def test_run_command_reports_an_interrupt_anywhere(where, tiny_config, tmp_path, monkeypatch, capsys):
    """Ctrl-C while the corpus was read escaped run_command as a traceback; SIGTERM (kill, scancel, docker stop)
    ended the run with no message, its temporaries left for the next run to remove."""
    import os
    import signal

    def interrupt(*args, **kwargs):
        if where == "reading the corpus":
            raise KeyboardInterrupt
        os.kill(os.getpid(), signal.SIGTERM)
        pytest.fail("SIGTERM did not stop the run")

    def unhandled(signum, frame):  # where the lab does not take SIGTERM itself: a failure, not a killed pytest
        raise AssertionError("SIGTERM was not handled by the lab")

    monkeypatch.setattr(runner, "load_corpus" if where == "reading the corpus" else "train", interrupt)
    before = signal.signal(signal.SIGTERM, unhandled)
    try:
        overrides = {k: v for k, v in vars(tiny_config(encodings=("nope",), extensions=())).items()}
        try:
            status = runner.run_command(preset="quick", out=tmp_path / "r", overrides=overrides, progress=False)
        except KeyboardInterrupt:  # (pytest would take it for the user's and stop the session)
            pytest.fail("the interrupt escaped run_command")
        assert signal.getsignal(signal.SIGTERM) is unhandled  # given back
    finally:
        signal.signal(signal.SIGTERM, before)
    assert status == 130
    assert "interrupted; every finished run is saved" in capsys.readouterr().err


def test_missing_rope_weights_retrain_rope_for_the_extensions(tiny_config, tmp_path):
    """The extensions rebuild the trained rope model from its weights: with them deleted (or a damaged file deleted
    as its message said) and rope's metrics kept, resuming failed with a FileNotFoundError traceback every time."""
    config = tiny_config(encodings=("rope",), extensions=("pi",))
    out = tmp_path / "run"
    quiet(config, out).run()
    reference = (out / "results.csv").read_text()
    (out / "runs" / "rope" / "seed0" / "model.safetensors").unlink()
    (out / "runs" / "rope+pi" / "seed0" / "metrics.json").unlink()
    lines = []
    resumed = quiet(config, out, echo=lines.append).run()
    assert resumed["timings"]["units_run"] == 2
    assert any("model.safetensors is missing and rope+pi read it: rope is trained again" in x for x in lines)
    assert (out / "results.csv").read_text() == reference
    # With every extension finished nothing reads them: a deleted weights file is left deleted.
    (out / "runs" / "rope" / "seed0" / "model.safetensors").unlink()
    assert quiet(config, out).run()["timings"]["units_run"] == 0


def test_a_registered_rope_type_is_an_extension_in_the_process_that_registered_it(tiny_config, tmp_path):
    """posenc.rope.register_scaling adds the type to the lab's EXTENSIONS with its example parameters for the lab's
    rotary dim (here the last r / 4 pairs divided by the factor), and the report draws it with them."""
    import posenc.rope.frequencies as fr
    import posenc.rope.parameters as pa
    from posenc.analysis.frequencies import EXAMPLE_ROPE_PARAMETERS
    from posenc.lab.config import EXTENSIONS
    from posenc.rope import register_scaling
    from posenc.rope.scaling import WITHOUT_EXAMPLE

    def tail(*, rotary_dim: int, base: float, factor: float, pairs: int, **_: Any) -> tuple[torch.Tensor, float]:
        inv_freq = fr.default_inv_freq(rotary_dim, base)
        return torch.cat((inv_freq[:-pairs], inv_freq[-pairs:] / factor)), 1.0

    tables = [fr.SCALINGS, pa.REQUIRED_KEYS, pa.OPTIONAL_KEYS, EXAMPLE_ROPE_PARAMETERS, EXTENSIONS]
    saved = [dict(table) for table in tables], set(fr.SEQ_LEN_DEPENDENT), set(WITHOUT_EXAMPLE)
    try:
        register_scaling(
            "tail",
            tail,
            required=("factor", "pairs"),
            example=lambda r, length, factor: {"factor": factor, "pairs": r // 4},
        )
        out = tmp_path / "run"
        quiet(tiny_config(encodings=("rope",), extensions=("tail",)), out, figures=True).run()
        units = json.loads((out / "results.json").read_text())["timings"]["units"]
        # tiny_config: dim 16 over 2 heads, so a rotary dim of 8; one target per length past train_len 8.
        assert units["rope+tail/seed0"]["rope_parameters"] == {
            str(n): {"rope_type": "tail", "factor": n / 8, "pairs": 2} for n in (16, 32, 64)
        }
        by = {(r["extension"], r["eval_len"]): r["bits_per_byte"] for r in rows_of(out)}
        assert by[("tail", "64")] != by[("none", "64")]
        assert (out / "report.html").exists()  # whose scaled_frequencies figure drew every type, tail too
    finally:
        for table, before in zip(tables, saved[0], strict=True):
            table.clear()
            table.update(before)
        fr.SEQ_LEN_DEPENDENT.clear()
        fr.SEQ_LEN_DEPENDENT.update(saved[1])
        WITHOUT_EXAMPLE.clear()
        WITHOUT_EXAMPLE.update(saved[2])


def test_ctrl_c_a_library_turns_into_another_error_is_still_an_interrupt(tiny_config, tmp_path, monkeypatch, capsys):
    """Ctrl-C inside safetensors' read came out as torch's "ValueError: could not determine the shape of object type
    'torch.storage.UntypedStorage'" (a third of tries): a traceback and exit 1, where the interrupt's message and 130
    belong. The same error with no Ctrl-C stays an error."""
    import os
    import signal

    def turned(*args, **kwargs):
        try:
            os.kill(os.getpid(), signal.SIGINT)
            pytest.fail("SIGINT did not reach the run")
        except KeyboardInterrupt:
            raise ValueError("could not determine the shape of object type 'torch.storage.UntypedStorage'") from None

    def plain(*args, **kwargs):
        raise ValueError("a bug")

    before = signal.getsignal(signal.SIGINT)
    overrides = {k: v for k, v in vars(tiny_config(encodings=("nope",), extensions=())).items()}
    monkeypatch.setattr(runner, "train", turned)
    assert runner.run_command(preset="quick", out=tmp_path / "r", overrides=overrides, progress=False) == 130
    assert "interrupted; every finished run is saved" in capsys.readouterr().err
    assert signal.getsignal(signal.SIGINT) is before  # given back
    # Errors the lab itself explains are an interrupt too when they follow one: a read cut short by Ctrl-C is not a
    # damaged file to delete ("not a whole safetensors file; delete it") nor a full disk ("make room").
    from safetensors import SafetensorError

    for error in (store.RunFolderError("model.safetensors is not a whole safetensors file"), SafetensorError("x")):

        def explained(*args, error=error, **kwargs):
            try:
                os.kill(os.getpid(), signal.SIGINT)
                pytest.fail("SIGINT did not reach the run")
            except KeyboardInterrupt:
                raise error from None

        monkeypatch.setattr(runner, "train", explained)
        assert runner.run_command(preset="quick", out=tmp_path / "r", overrides=overrides, progress=False) == 130
        assert "interrupted; every finished run is saved" in capsys.readouterr().err
    monkeypatch.setattr(runner, "train", plain)
    with pytest.raises(ValueError, match="a bug"):
        runner.run_command(preset="quick", out=tmp_path / "r", overrides=overrides, progress=False)
    # SIGINT ignored by the parent (a job started in the background) stays ignored.
    seen = []
    monkeypatch.setattr(runner, "train", lambda *a, **k: seen.append(signal.getsignal(signal.SIGINT)) or plain())
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        with pytest.raises(ValueError, match="a bug"):
            runner.run_command(preset="quick", out=tmp_path / "r", overrides=overrides, progress=False)
    finally:
        signal.signal(signal.SIGINT, before)
    assert seen == [signal.SIG_IGN]


def test_sigterm_is_left_to_its_default_under_torchrun(tiny_config, tmp_path, monkeypatch):
    """A rank blocked in a collective runs no Python handler until the collective times out (30 min for gloo):
    SIGTERM's default, which ends it at once, stays under torchrun (WORLD_SIZE > 1)."""
    import contextlib
    import signal

    import torch

    from posenc.lab.dist import Ranks

    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setattr(runner, "process_group", lambda device: contextlib.nullcontext((Ranks(), torch.device("cpu"))))
    seen = []

    def interrupt(*args, **kwargs):
        seen.append(signal.getsignal(signal.SIGTERM))
        raise KeyboardInterrupt

    monkeypatch.setattr(runner, "train", interrupt)
    overrides = {k: v for k, v in vars(tiny_config(encodings=("nope",), extensions=())).items()}
    assert runner.run_command(preset="quick", out=tmp_path / "r", overrides=overrides, progress=False) == 130
    assert seen == [signal.getsignal(signal.SIGTERM)] and seen[0] is not runner._interrupt


def test_a_folder_of_another_configuration_is_refused(finished):
    config, out, _ = finished
    changed = make_config("quick", **{**vars(config), "steps": 7})
    with pytest.raises(ValueError, match=r"different configuration \(differs in: steps\)"):
        quiet(changed, out).prepare()
    # Selecting fewer units of the same configuration is fine.
    quiet(make_config("quick", **{**vars(config), "encodings": ("alibi",), "extensions": ()}), out).prepare()


def test_a_folder_of_a_run_stopped_before_anything_was_saved_is_taken_by_another_configuration(tiny_config, tmp_path):
    """Ctrl-C at once after a wrong flag left only config.json (and .lock): the corrected command was refused as
    "a different configuration", though the folder held nothing of that run; it is now taken, and the refusal stays
    for a folder that holds anything more (a checkpoint, a finished unit)."""
    out, config = tmp_path / "r", tiny_config()
    wrong = make_config("quick", **{**vars(config), "steps": 7})
    quiet(wrong, out).prepare()
    assert sorted(p.name for p in out.iterdir() if p.is_file()) == [".lock", "config.json"]
    (out / "runs" / "rope").mkdir(parents=True)  # an empty folder is nothing either
    quiet(config, out).prepare()
    assert json.loads((out / "config.json").read_text())["results_key"]["steps"] == config.steps != 7
    (out / "runs" / "rope" / "checkpoint.safetensors").write_bytes(b"progress of this configuration")
    with pytest.raises(ValueError, match=r"different configuration \(differs in: steps\)"):
        quiet(wrong, out).prepare()


def test_a_folder_whose_config_json_was_deleted_is_claimed_only_by_its_units_configuration(finished, tmp_path):
    # It was claimed by other settings (config.json rewritten), then failed with a traceback at the first unit.
    config, out, _ = finished
    copy = tmp_path / "copy"
    shutil.copytree(out, copy)
    (copy / "config.json").unlink()
    changed = make_config("quick", **{**vars(config), "steps": 7})
    with pytest.raises(ValueError, match=r"no config.json but holds finished units of another configuration \(runs/"):
        quiet(changed, copy).prepare()
    assert not (copy / "config.json").exists()
    quiet(config, copy).prepare()  # its own configuration takes it back
    assert (copy / "config.json").exists()


def test_a_run_folder_inside_its_corpus_resumes_and_the_corpus_itself_is_refused(tiny_config, corpus_dir, tmp_path):
    corpus = tmp_path / "project"
    shutil.copytree(corpus_dir, corpus)
    config = tiny_config(corpus=str(corpus), encodings=("nope",), extensions=())
    out = corpus / "lab-runs" / "quick"
    first = quiet(config, out).run()
    again = quiet(config, out)
    again.prepare()  # its own files were not read as corpus: same bytes, same configuration
    rerun = again.run()
    assert rerun["rows"] == first["rows"] and rerun["timings"]["units_skipped"] == 1
    with pytest.raises(ValueError, match=r"--out .* is the --corpus folder itself: .* pass another --out"):
        quiet(config, corpus).prepare()


def test_the_same_corpus_by_another_path_resumes_the_same_units(tiny_config, corpus_dir, tmp_path, monkeypatch):
    # The path was part of config_id: `--corpus data` after `--corpus /abs/data` was refused as "differs in: corpus".
    shutil.copytree(corpus_dir, tmp_path / "data")
    out = tmp_path / "out"
    first = quiet(tiny_config(corpus=str(tmp_path / "data"), encodings=("nope",), extensions=()), out).run()
    monkeypatch.chdir(tmp_path)
    shutil.copytree(corpus_dir, tmp_path / "copy")
    for spelling in ("data", "./data/", "copy"):  # the same bytes elsewhere are the same corpus too
        again = quiet(tiny_config(corpus=spelling, encodings=("nope",), extensions=()), out).run()
        assert again["rows"] == first["rows"] and again["timings"]["units_skipped"] == 1, spelling
    (tmp_path / "copy" / "extra.txt").write_text("other bytes\n" * 50)
    with pytest.raises(ValueError, match=r"differs in: corpus \(different bytes\)\)"):
        quiet(tiny_config(corpus="copy", encodings=("nope",), extensions=()), out).prepare()


def test_a_folder_of_another_format_is_refused_and_left_as_it_was(finished, tmp_path, monkeypatch):
    config, out, _ = finished
    copy = tmp_path / "copy"
    shutil.copytree(out, copy)

    def files():
        return {p: p.read_bytes() for p in copy.rglob("*") if p.is_file() and p.name != ".lock"}

    before = files()
    # The same settings and corpus under another results format: every id differs, no setting does.
    monkeypatch.setattr(runner, "FORMAT_VERSION", runner.FORMAT_VERSION + 1)
    with pytest.raises(ValueError, match=r"different configuration \(differs in: format: made by an earlier posenc"):
        quiet(config, copy).prepare()
    assert files() == before
    # As posenc wrote a --corpus run before 5535ae7 (format 1): the corpus path in the key, which is not a difference.
    previous = store.read_json(copy / "config.json")
    store.write_json(copy / "config.json", previous | {"results_key": previous["results_key"] | {"corpus": "/old"}})
    with pytest.raises(ValueError, match=r"different configuration \(differs in: format: made by an earlier posenc"):
        quiet(config, copy).prepare()
    (copy / "config.json").unlink()
    with pytest.raises(ValueError, match=r"has no config.json but holds finished units of another configuration"):
        quiet(config, copy).prepare()
    assert files() == {p: b for p, b in before.items() if p.name != "config.json"}


@pytest.mark.parametrize("damage", ["cut short", "a list"])
@pytest.mark.parametrize("name", ["runs/nope/seed0/metrics.json", "config.json"])
def test_a_damaged_file_found_during_the_run_is_one_line_naming_it(finished, tmp_path, capsys, damage, name):
    """A file cut short, or valid JSON that is no object (which met a .get() as a bare AttributeError)."""
    config, out, _ = finished
    copy = tmp_path / "copy"
    shutil.copytree(out, copy)
    damaged = copy / name
    damaged.write_text(damaged.read_text()[:20] if damage == "cut short" else "[1, 2]")
    status = runner.run_command(preset="quick", out=copy, overrides=vars(config), progress=False)
    assert status == 2
    assert capsys.readouterr().err.startswith(f"posenc lab: error: {damaged} is not the JSON the lab writes")


def test_a_copied_unit_of_other_settings_is_refused_by_name(finished, tmp_path, capsys):
    # A unit folder brought from a run of another configuration, into a folder whose config.json is this one's: its
    # numbers must not enter this run's tables as this configuration's.
    config, out, _ = finished
    copy = tmp_path / "copy"
    shutil.copytree(out, copy)
    metrics = copy / "runs" / "alibi" / "seed0" / "metrics.json"
    store.write_json(metrics, {**store.read_json(metrics), "config_id": "0123456789abcdef"})
    status = runner.run_command(preset="quick", out=copy, overrides=vars(config), progress=False)
    assert status == 2
    assert f"posenc lab: error: {metrics} belongs to another configuration" in capsys.readouterr().err


def test_another_units_metrics_or_a_file_without_results_is_refused_by_name(finished, tmp_path, capsys):
    """alibi's metrics.json copied into nope's folder put alibi's rows in the tables where nope's belong (the rows
    are built from the unit the file names); a file without "eval" met a bare KeyError."""
    config, out, _ = finished
    copy = tmp_path / "copy"
    shutil.copytree(out, copy)
    metrics = copy / "runs" / "nope" / "seed0" / "metrics.json"
    shutil.copyfile(copy / "runs" / "alibi" / "seed0" / "metrics.json", metrics)
    assert runner.run_command(preset="quick", out=copy, overrides=vars(config), progress=False) == 2
    said = capsys.readouterr().err
    assert f"error: {metrics} holds the metrics of alibi none seed 0 ('alibi'), not of 'nope' seed 0" in said
    fine = store.read_json(out / "runs" / "nope" / "seed0" / "metrics.json")
    # Another seed's, of the same name: named by its seed.
    store.write_json(metrics, {**fine, "unit": {**fine["unit"], "seed": 1}})
    assert runner.run_command(preset="quick", out=copy, overrides=vars(config), progress=False) == 2
    assert "holds the metrics of nope none seed 1 ('nope'), not of 'nope' seed 0" in capsys.readouterr().err
    row = fine["eval"][0]
    for broken in (
        {k: v for k, v in fine.items() if k != "eval"},
        {**fine, "eval": {"64": 1}},
        {**fine, "eval": [{}]},
        {**fine, "eval": [{k: v for k, v in row.items() if k != "entropy_by_layer"}]},
    ):
        store.write_json(metrics, broken)
        assert runner.run_command(preset="quick", out=copy, overrides=vars(config), progress=False) == 2
        assert f'{metrics} has no list of whole results by length under "eval"' in capsys.readouterr().err


def test_a_fine_tune_asked_for_extensions_that_take_none_is_noted(tiny_config, tmp_path):
    lines = []
    config = tiny_config(encodings=("rope",), extensions=("ntk",), finetune_steps=2)
    quiet(config, tmp_path / "r", echo=lines.append).run()
    assert "note: --finetune-steps fine-tunes only pi and yarn, so ntk run without a fine-tune" in lines
    lines.clear()
    quiet(
        tiny_config(encodings=("rope",), extensions=("ntk", "pi"), finetune_steps=2), tmp_path / "s", echo=lines.append
    ).run()
    assert not [line for line in lines if "fine-tunes only" in line]
    lines.clear()
    # Silent until 2026-12-05: the steps were taken and nothing was tuned, not even the control.
    config = tiny_config(encodings=("rope",), extensions=(), finetune_steps=2)
    quiet(config, tmp_path / "t", echo=lines.append).run()
    expected = "with no extension asked for (--extensions none) nothing is fine-tuned"
    assert f"note: --finetune-steps fine-tunes only pi and yarn, so {expected}" in lines


def test_multiple_seeds_report_mean_and_spread(tiny_config, tmp_path):
    config = tiny_config(encodings=("rope",), extensions=("pi",), num_seeds=2)
    results = quiet(config, tmp_path).run()
    assert {r["seed"] for r in results["rows"]} == {0, 1}
    # Each cell of rope's row is the mean ± sample std of both seeds at that cell's length, as printed. Entropy
    # too: it grows with the length, where these tiny models' bits per byte hardly change.
    report = (tmp_path / "report.md").read_text()
    rope = [r for r in rows_of(tmp_path) if r["extension"] == "none"]
    for title, column in (("## Bits per byte by context length", "bits_per_byte"), ("## Attention entropy", "entropy")):
        table = report.split(title)[1].split("\n\n")[1].splitlines()
        lengths, shown = (line.strip("| ").split(" | ")[1:] for line in (table[0], table[2]))
        assert lengths == [str(n) for n in config.eval_lengths] and table[2].startswith("| rope |")
        for n, cell in zip(lengths, shown, strict=True):
            values = [float(r[column]) for r in rope if r["eval_len"] == n]
            assert len(values) == 2
            assert cell == f"{statistics.fmean(values):.3f} ± {statistics.stdev(values):.3f}", (column, n)
    # The plot too: each point the mean of both seeds, each error bar the sample std either side of it.
    (bpb,) = figures(json.loads((tmp_path / "results.json").read_text()))["bpb_by_length.png"].axes
    rope = [{**r, "finetune_steps": int(r["finetune_steps"]), "eval_len": int(r["eval_len"])} for r in rope]
    assert_curves(bpb, by_length(rope, "bits_per_byte"))
    (container,) = [h for h in bpb.get_legend_handles_labels()[0] if isinstance(h, ErrorbarContainer)]
    (bars,) = container.lines[2]
    for n, ((_, low), (_, high)) in zip(config.eval_lengths, bars.get_segments(), strict=True):
        values = [float(r["bits_per_byte"]) for r in rope if r["eval_len"] == n]
        assert (high - low) / 2 == pytest.approx(statistics.stdev(values), rel=1e-9), n


def test_every_length_is_scored_on_windows_ending_at_the_same_offsets(tiny_config, tmp_path, monkeypatch):
    # The same final score_len bytes at every length: the ends come from the longest length, once.
    config = tiny_config(encodings=("nope",), extensions=(), eval_lengths=(8, 16, 32))
    seen = {}
    real = runner.evaluate_length

    def spy(model, val, ends, length, **kwargs):
        seen[length] = ends.clone()
        return real(model, val, ends, length, **kwargs)

    monkeypatch.setattr(runner, "evaluate_length", spy)
    lab = quiet(config, tmp_path)
    lab.run()
    expected = eval_window_ends(lab.corpus.val, longest=32, count=config.eval_windows)
    assert sorted(seen) == [8, 16, 32]
    for length, ends in seen.items():
        assert torch.equal(ends, expected), length


def test_a_rows_entropy_is_the_mean_of_its_layers(tiny_config, tmp_path):
    # Two layers, so the mean over layers is neither layer's own value.
    config = tiny_config(encodings=("alibi",), extensions=(), layers=2, eval_lengths=(8, 16))
    rows = quiet(config, tmp_path).run()["rows"]
    assert len(rows) == 2
    for row in rows:
        first, second = row["entropy_by_layer"]
        assert first != second and row["entropy"] == (first + second) / 2


def test_summary_tables_by_hand():
    def row(encoding, extension, n, bpb, applicable=True):
        return {"encoding": encoding, "extension": extension, "finetune_steps": 0, "eval_len": n,
                "bits_per_byte": bpb, "applicable": applicable, "reason": "" if applicable else "past"}  # fmt: skip

    rows = [row("rope", "none", 8, 2.0), row("rope", "none", 16, 3.0), row("learned", "none", 8, 2.5)]
    rows += [row("learned", "none", 16, None, applicable=False), row("rope", "pi", 16, 2.75)]
    text = summary_tables({"rows": rows, "config": {"train_len": 8}, "seeds": [0]})
    # The extensions' table shows only lengths past training, with the unextended model beside them.
    assert text == "\n".join(
        [
            "Bits per byte, trained at 8, by eval length:",
            "| model | 8 | 16 |",
            "|---|---|---|",
            "| rope | 2.000 | 3.000 |",
            "| learned | 2.500 | n/a |",
            "",
            "RoPE extensions of the trained rope model, bits per byte:",
            "| model | 16 |",
            "|---|---|",
            "| rope | 3.000 |",
            "| rope+pi | 2.750 |",
        ]
    )


def test_aggregate_is_the_mean_and_sample_std_of_the_applicable_seeds():
    # Three seeds, skewed: the mean (3) is not the median (2), the sample std (sqrt 7) not the population one.
    row = {"encoding": "rope", "extension": "pi", "finetune_steps": 0, "eval_len": 16, "applicable": True}
    rows = [{**row, "seed": s, "bits_per_byte": v, "reason": ""} for s, v in enumerate([1.0, 2.0, 6.0])]
    rows.append({**row, "seed": 3, "bits_per_byte": None, "applicable": False, "reason": "past the table"})
    table = aggregate(rows, "bits_per_byte")
    assert table.keys() == {("rope+pi", 16)}
    cell = table["rope+pi", 16]
    assert cell["mean"] == 3.0 and cell["spread"] == pytest.approx(7**0.5, rel=1e-12)
    assert cell["n"] == 3 and cell["reason"] == "past the table"


def test_task_accuracy_is_reported_by_length(tiny_config, tmp_path, monkeypatch):
    config = tiny_config(
        encodings=("learned", "rope"), extensions=("yarn",), task="passkey", train_len=40, eval_lengths=(40, 80)
    )
    seen = []
    real = runner.task_accuracy

    def spy(model, samples, **kwargs):
        seen.append(tuple(samples.inputs.shape))
        return real(model, samples, **kwargs)

    monkeypatch.setattr(runner, "task_accuracy", spy)
    rows = quiet(config, tmp_path).run()["rows"]
    # Every applicable length gets its own samples: n bytes of input, the answer predicted from n back.
    assert sorted(seen) == sorted((config.task_samples, r["eval_len"]) for r in rows if r["task_accuracy"] is not None)
    measured = {(r["encoding"], r["extension"], r["eval_len"]): r["task_accuracy"] for r in rows}
    per_byte = {(r["encoding"], r["extension"], r["eval_len"]): r["task_byte_accuracy"] for r in rows}
    assert measured[("learned", "none", 80)] is None and per_byte[("learned", "none", 80)] is None  # past the table
    assert all(0.0 <= measured[k] <= per_byte[k] <= 1.0 for k in measured if k != ("learned", "none", 80))
    report = (tmp_path / "report.md").read_text()
    assert "passkey task: exact-match accuracy" in report and "passkey task: per-byte accuracy (chance: 1/10" in report
    # Three decimals: per-byte accuracy moves in steps of 1/(samples * digits), e.g. 0.025, which two decimals
    # rounded unevenly (0.025 -> 0.03, 0.075 -> 0.07).
    per_byte_table = report.split("passkey task: per-byte accuracy")[1]
    shown = next(v for k, v in per_byte.items() if v is not None and k[0] == "rope" and k[1] == "none")
    assert f"{shown:.3f}" in per_byte_table
    csv_rows = list(csv.DictReader(io.StringIO((tmp_path / "results.csv").read_text())))
    assert [float(r["task_byte_accuracy"]) for r in csv_rows if r["task_byte_accuracy"]] == [
        r["task_byte_accuracy"] for r in rows if r["task_byte_accuracy"] is not None
    ]


def test_units_evaluated_before_the_per_byte_accuracy_report_it_blank(tiny_config, tmp_path):
    config = tiny_config(encodings=("nope",), extensions=(), task="passkey", train_len=40, eval_lengths=(40,))
    quiet(config, tmp_path).run()
    metrics = tmp_path / "runs" / "nope" / "seed0" / "metrics.json"
    data = store.read_json(metrics)
    store.write_json(
        metrics, data | {"eval": [{k: v for k, v in r.items() if k != "task_byte_accuracy"} for r in data["eval"]]}
    )
    rows = quiet(config, tmp_path).run()["rows"]
    assert [r["task_byte_accuracy"] for r in rows] == [None] and rows[0]["task_accuracy"] is not None
    assert next(csv.DictReader(io.StringIO((tmp_path / "results.csv").read_text())))["task_byte_accuracy"] == ""


@pytest.mark.parametrize(
    ("setup", "message"),
    [
        (lambda tmp, cfg: cfg(corpus=str(tmp / "nowhere")), "does not exist"),
        (lambda tmp, cfg: cfg(corpus=_small_file(tmp)), "holds too little text"),
        (lambda tmp, cfg: cfg(task="copy"), "the copy task needs windows of"),
        (lambda tmp, cfg: cfg(eval_windows=10**6), "holds too little text"),
    ],
)
def test_bad_input_fails_before_any_training(tiny_config, tmp_path, monkeypatch, setup, message):
    monkeypatch.setattr(runner, "train", lambda *a, **k: pytest.fail("training started"))
    with pytest.raises(ValueError, match=message):
        quiet(setup(tmp_path, tiny_config), tmp_path / "out").run()


def test_out_must_be_a_folder(tiny_config, tmp_path):
    (tmp_path / "file").write_text("x")
    with pytest.raises(ValueError, match="exists and is not a folder"):
        quiet(tiny_config(), tmp_path / "file").prepare()
    # Below a file: an OSError from deep in the store (a traceback at the command line) before.
    with pytest.raises(ValueError, match=r"--out .*file/run cannot be made the run folder: Not a directory"):
        quiet(tiny_config(), tmp_path / "file" / "run").prepare()


def _small_file(tmp):
    path = tmp / "small.txt"
    path.write_text("print('hello')\n" * 4)
    return str(path)


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--encodings", "rope,xpos"], "unknown encodings: xpos"),
        (["--eval-lengths", "4,8"], "eval length 4 is shorter than train_len=16"),
        (["--extensions", "pi", "--encodings", "alibi"], "add rope to encodings"),
        (["--threads", "0"], "--threads must be a positive integer"),
        # torch could not start them, and the process died with SIGSEGV.
        (["--threads", "100000"], "--threads must be a positive integer up to 4096 (this machine has"),
        (["--train-len", "1"], "train_len (--train-len) must be >= 2"),
        (["--device", "meta"], "--device meta holds no values"),
    ],
)
def test_cli_bad_input_exits_2_with_the_reason(corpus_dir, tmp_path, capsys, flags, message):
    status = main(["lab", "--preset", "quick", "--corpus", str(corpus_dir), "--out", str(tmp_path), *flags])
    assert status == 2
    err = capsys.readouterr().err
    assert err.startswith("posenc lab: error:") and message in err
    assert not (tmp_path / "runs").exists()


def test_task_samples_without_a_task_is_noted(corpus_dir, tmp_path, capsys, monkeypatch):
    """Taken without a word before; part of the folder's configuration, so a rerun resumes only with it."""
    from posenc.lab.runner import Lab

    monkeypatch.setattr(Lab, "run", lambda self: None)
    words = ["lab", "--preset", "quick", "--corpus", str(corpus_dir), "--out", str(tmp_path / "out"), "--no-progress"]
    assert main([*words, "--task-samples", "5"]) == 0
    assert (
        "posenc lab: note: --task-samples sets how many samples --task scores, and no task runs here, so it "
        "changes no number;" in capsys.readouterr().err
    )
    main([*words, "--task-samples", "5", "--task", "copy"])  # with a task (run, or refused for its length): no note
    assert "no task runs here" not in capsys.readouterr().err


def test_an_empty_out_is_refused_not_read_as_the_default_folder(capsys):
    with pytest.raises(SystemExit):
        main(["lab", "--preset", "quick", "--out", ""])
    assert "argument --out: expected a folder, got ''; leave --out out for lab-runs/PRESET" in capsys.readouterr().err


@pytest.mark.parametrize("stage", ["prepare", "run"])
@pytest.mark.parametrize(
    "error",
    [
        MemoryError(),
        RuntimeError(
            "[enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: can't allocate memory: you "
            "tried to allocate 4000000000000 bytes. Error code 12 (Cannot allocate memory)"
        ),
        RuntimeError("DefaultCPUAllocator: not enough memory: you tried to allocate 4000000000000 bytes."),  # Windows
    ],
)
def test_running_out_of_memory_is_one_line_naming_the_sizes(corpus_dir, tmp_path, capsys, monkeypatch, stage, error):
    """--dim 1000000 ended in a traceback from nn.Linear, --seeds 10**11 in one from building the seeds."""
    from posenc.lab.runner import Lab

    def fails(self):
        raise error

    monkeypatch.setattr(Lab, stage, fails)
    words = ["lab", "--preset", "quick", "--corpus", str(corpus_dir), "--no-progress", "--out"]
    assert main([*words, str(tmp_path / "a")]) == (2 if stage == "prepare" else 1)
    err = capsys.readouterr().err
    assert err.startswith("posenc lab: error: out of memory (") and "Traceback" not in err
    assert "smaller (--dim, --layers, --batch-size, --train-len, --eval-lengths) or run fewer seeds (--seeds)" in err
    if isinstance(error, RuntimeError):
        assert "memory: you tried to allocate 4000000000000 bytes" in err and "enforce" not in err
    # Any other RuntimeError is a bug: its traceback stays.
    monkeypatch.setattr(Lab, stage, lambda self: (_ for _ in ()).throw(RuntimeError("a bug")))
    with pytest.raises(RuntimeError, match="a bug"):
        main([*words, str(tmp_path / "b")])


def test_a_rope_type_without_example_parameters_is_refused_before_anything_trains(
    corpus_dir, tmp_path, capsys, monkeypatch
):
    # The run's report.html draws every type in SCALINGS with its example parameters: a type of a user's own added to
    # SCALINGS (and to the parameter tables) without them made `posenc lab` end in a traceback from the report, after
    # every unit had trained. It is refused at prepare, with or without a rope model (the figure is drawn either way),
    # and importing posenc.lab with such a type registered still works (its presets are built on import).
    from posenc.rope import parameters
    from posenc.rope.frequencies import SCALINGS

    monkeypatch.setitem(SCALINGS, "halved", SCALINGS["linear"])
    monkeypatch.setitem(parameters.REQUIRED_KEYS, "halved", parameters.REQUIRED_KEYS["linear"])
    monkeypatch.setitem(parameters.OPTIONAL_KEYS, "halved", parameters.OPTIONAL_KEYS["linear"])
    for encodings in ("rope", "alibi"):
        flags = ["--corpus", str(corpus_dir), "--out", str(tmp_path / encodings), "--encodings", encodings]
        assert main(["lab", "--preset", "quick", "--extensions", "none", *flags]) == 2
        err = capsys.readouterr().err
        assert err.startswith("posenc lab: error: rope_type(s) halved ") and "EXAMPLE_ROPE_PARAMETERS" in err
        assert not (tmp_path / encodings).exists()
    code = (
        "from posenc.rope import frequencies as f, parameters as p; f.SCALINGS['halved'] = f.SCALINGS['linear']; "
        "p.REQUIRED_KEYS['halved'] = p.OPTIONAL_KEYS['halved'] = frozenset(); import posenc.lab"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_quick_preset_from_the_command_line(corpus_dir, tmp_path, capsys):
    out = tmp_path / "quick"
    flags = ["--preset", "quick", "--corpus", str(corpus_dir), "--out", str(out), "--no-progress", "--no-figures"]
    assert main(["lab", *flags]) == 0
    printed = capsys.readouterr().out
    assert "Bits per byte, trained at 16" in printed and "| rope+yarn |" in printed
    stored = json.loads((out / "results.json").read_text())
    assert stored["command"] == f"posenc lab --preset quick --corpus {corpus_dir} --out {out} --no-figures"
    assert stored["config"]["steps"] == 40
    # --no-figures: report.html holds the tables and the lab's plots, not the analysis figures.
    page = (out / "report.html").read_text()
    assert page.count("data:image/png;base64,") == len(PLOTS) and "How the encodings work" not in page


def test_a_diverging_run_stops_at_once_and_says_to_lower_the_lr(corpus_dir, tmp_path, capsys):
    """A huge learning rate turns the loss to nan: the run stops at the next check (every 20 steps) with exit status
    1 and the advice, instead of evaluating a nan model and failing on its results."""
    status = main(
        [
            "lab",
            "--preset",
            "quick",
            "--corpus",
            str(corpus_dir),
            "--out",
            str(tmp_path),
            "--lr",
            "1e10",
            "--no-progress",
        ]
    )
    assert status == 1
    err = capsys.readouterr().err
    assert "posenc lab: error: training diverged: the loss is nan" in err and "lower the learning rate (--lr)" in err
    assert "run the new --lr with another --out" in err


@pytest.mark.parametrize("value", ["nan", "inf"])
def test_cli_float_options_must_be_finite(tmp_path, capsys, value):
    with pytest.raises(SystemExit) as exit_info:
        main(["lab", "--preset", "quick", "--out", str(tmp_path), "--lr", value])
    assert exit_info.value.code == 2
    assert f"argument --lr: expected a finite number, got '{value}'" in capsys.readouterr().err


def test_a_task_needs_to_fit_the_shortest_eval_length_not_the_training_length(tiny_config, tmp_path):
    # Tasks run at the eval lengths only; prepare refused this, checking the task against train_len = 8.
    quiet(tiny_config(task="passkey", eval_lengths=(64, 128)), tmp_path / "out").prepare()


def test_a_validation_split_too_short_for_distinct_scored_bytes_is_refused(tiny_config, corpus_dir):
    # 1944 validation bytes; windows of 65 bytes scoring their final 4 fit apart 470 times ((1944 - 65) // 4 + 1).
    # 600 passed before (it needs only 600 distinct ends) and scored each byte about 1.3 times.
    corpus = load_corpus(corpus_dir, val_fraction=0.1)
    assert corpus.val.numel() == 1944
    runner.check_corpus(corpus, tiny_config(eval_windows=470))
    ends = eval_window_ends(corpus.val, longest=64, count=470)
    assert int(ends.diff().min()) >= 4
    with pytest.raises(
        ValueError, match=r"600 eval windows at length 64, each scoring its final 4 bytes \(--score-len\)"
    ) as refused:
        runner.check_corpus(corpus, tiny_config(eval_windows=600))
    assert "need 2461; use a larger corpus, at most 470 --eval-windows, a shorter --score-len" in str(refused.value)
    assert "has 1944 bytes" in str(refused.value)


def test_check_corpus_takes_exactly_the_text_it_needs(tiny_config, corpus_dir):
    # One byte less would pass prepare() and fail only after training, in the evaluation of the first unit.
    corpus = load_corpus(corpus_dir, val_fraction=0.1)
    config = tiny_config(eval_windows=100)
    longest, score_len = max(config.eval_lengths), config.score_len
    needed = eval_text_needed(longest=longest, count=100, score_len=score_len)
    runner.check_corpus(dataclasses.replace(corpus, val=corpus.val[:needed]), config)
    assert int(eval_window_ends(corpus.val[:needed], longest=longest, count=100).diff().min()) >= score_len
    with pytest.raises(ValueError, match=f"need {needed};"):
        runner.check_corpus(dataclasses.replace(corpus, val=corpus.val[: needed - 1]), config)
    # Fine-tunes train on windows of the longest eval length, pretraining on windows of train_len.
    tuned = tiny_config(finetune_steps=2, extensions=("pi",))
    longest = max(tuned.eval_lengths)
    assert longest > tuned.train_len
    runner.check_corpus(dataclasses.replace(corpus, train=corpus.train[: longest + 1]), tuned)
    with pytest.raises(ValueError, match=f"fewer than one window of {longest + 1};"):
        runner.check_corpus(dataclasses.replace(corpus, train=corpus.train[:longest]), tuned)


def test_a_first_run_counts_every_unit_as_run_none_skipped(finished):
    # The fixture's results, not its report.md: a later test reruns that folder, and its report counts the skips.
    config, _, results = finished
    assert results["timings"]["units_run"] == len(plan(config)) and results["timings"]["units_skipped"] == 0
    assert f"({len(plan(config))} units run, 0 skipped as done)" in to_markdown(results)


def test_the_default_preset_on_a_small_corpus_is_refused_not_scored_over_and_over(
    corpus_dir, tmp_path, capsys, monkeypatch
):
    # It ran: 256 windows 5 or 6 bytes apart, each scoring its final 32 bytes, so results.csv said 8192 scored bytes
    # where 1463 distinct ones were scored about 5.6 times each, and bits_per_byte weighted them so.
    monkeypatch.setattr(runner, "train", lambda *a, **k: pytest.fail("training started"))
    status = main(["lab", "--corpus", str(corpus_dir), "--out", str(tmp_path / "out"), "--no-progress"])
    assert status == 2
    err = capsys.readouterr().err
    assert err.startswith("posenc lab: error:") and "256 eval windows at length 512" in err
    assert "at most 45 --eval-windows, a shorter --score-len or shorter --eval-lengths" in err
    assert not (tmp_path / "out" / "runs").exists()


def test_a_corpus_a_preset_caps_is_not_told_to_grow(tmp_path):
    # quick reads at most 1 MiB of any corpus: "use a larger corpus" could not help.
    config = make_config("quick", eval_windows=200_000)
    with pytest.raises(ValueError, match=r"the preset reads at most 1048576 bytes of any corpus .*use another preset"):
        quiet(config, tmp_path / "out").prepare()


def test_a_narrower_rerun_says_which_finished_units_its_report_leaves_out(finished, tmp_path, monkeypatch):
    import dataclasses
    import shutil

    config, out, _ = finished
    copy = tmp_path / "copy"
    shutil.copytree(out, copy)  # the fixture's folder is shared by the other tests
    monkeypatch.setattr(runner, "train", lambda *a, **k: pytest.fail("a finished unit was trained again"))
    lines = []
    narrow = dataclasses.replace(config, encodings=("rope",), extensions=(), finetune_steps=0)
    quiet(narrow, copy, echo=lines.append).run()
    others = len(plan(config)) - len(plan(narrow))
    assert any(f"note: {others} finished unit(s) in {copy} are outside this selection" in line for line in lines)
    assert {r["encoding"] for r in rows_of(copy)} == {"rope"}


def test_fine_tunes_keep_the_bytes_per_step_and_a_constant_rate(tiny_config, tmp_path, monkeypatch):
    """Pretraining takes the config's batch and schedule; a fine-tune at L takes max(1, batch * train_len // L)
    windows (pretraining's bytes per step in whole windows, docs/lab.md) at the fine-tune rate, constant after
    warmup (min_lr_fraction 1), as PI and YaRN do."""
    config = tiny_config(encodings=("rope",), extensions=("pi",), finetune_steps=2, eval_lengths=(8, 16, 32))
    calls = []
    real = runner.train

    def spy(model, data, **kwargs):
        calls.append(kwargs)
        return real(model, data, **kwargs)

    monkeypatch.setattr(runner, "train", spy)
    quiet(config, tmp_path / "run").run()
    pretrain, *finetunes = sorted(calls, key=lambda kwargs: kwargs["seq_len"])
    assert (pretrain["batch_size"], pretrain["min_lr_fraction"], pretrain["lr"]) == (
        config.batch_size, config.min_lr_fraction, config.lr
    )  # fmt: skip
    # pi and its control at each length
    assert [(k["seq_len"], k["batch_size"]) for k in finetunes] == [(16, config.batch_size // 2)] * 2 + [(32, 1)] * 2
    assert all(k["min_lr_fraction"] == 1.0 and k["lr"] == config.resolved_finetune_lr for k in finetunes)
    assert all(k["grad_clip"] == config.grad_clip and k["steps"] == 2 for k in finetunes)


def test_weights_of_another_configuration_are_retrained_not_loaded(tiny_config, tmp_path, monkeypatch):
    """A folder whose config.json and unit metrics were deleted is claimed by another configuration; the weights
    still there were trained with other settings, so the unit trains again instead of loading them."""
    out = tmp_path / "run"
    quiet(tiny_config(encodings=("nope",), extensions=()), out).run()
    (out / "config.json").unlink()
    (out / "runs" / "nope" / "seed0" / "metrics.json").unlink()
    old_id = store.read_json(out / "runs" / "nope" / "seed0" / "train.json")["config_id"]
    trained = []
    real = runner.train
    monkeypatch.setattr(runner, "train", lambda *a, **k: trained.append(k) or real(*a, **k))
    other = tiny_config(encodings=("nope",), extensions=(), lr=2e-3)
    quiet(other, out).run()
    assert len(trained) == 1 and trained[0]["lr"] == 2e-3
    assert store.read_json(out / "runs" / "nope" / "seed0" / "train.json")["config_id"] != old_id
