"""Reading a lab run folder: results, and the attention entropy it measured in either format."""

from __future__ import annotations

import csv
import json

import pytest
import torch

from posenc.analysis import figure_inputs, read_results, run_entropy
from posenc.analysis.report import render_html
from posenc.analysis.run import entropy_from_results, run_label

HEADER = [
    "encoding",
    "extension",
    "finetune_steps",
    "train_len",
    "eval_len",
    "seed",
    "bits_per_byte",
    "entropy_by_layer",
]


def write_results(folder, rows):
    folder.mkdir(parents=True, exist_ok=True)
    with (folder / "results.csv").open("w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(HEADER)
        writer.writerows(rows)
    return folder


def test_labels():
    assert run_label({"encoding": "rope", "extension": "none"}) == "rope"
    assert run_label({"encoding": "rope", "extension": "yarn", "finetune_steps": "0"}) == "rope+yarn"
    assert run_label({"encoding": "rope", "extension": "pi", "finetune_steps": "50"}) == "rope+pi+ft50"


def test_entropy_by_layer_column_as_the_lab_writes_it(tmp_path):
    run = write_results(
        tmp_path / "run",
        [
            ["rope", "none", 0, 64, 64, 0, 2.5, "[1.0, 2.0]"],
            ["rope", "none", 0, 64, 64, 1, 2.6, "[3.0, 4.0]"],  # a second seed: averaged
            ["rope", "none", 0, 64, 128, 0, 2.9, "1.5;2.5"],
            ["learned", "none", 0, 64, 128, 0, "", ""],  # not applicable: no entropy, skipped
        ],
    )
    measured, source = run_entropy(run)
    assert list(measured) == ["rope"] and "entropy_by_layer" in source
    assert measured["rope"].lengths.tolist() == [64, 128]
    expected = torch.tensor([[[2.0], [3.0]], [[1.5], [2.5]]], dtype=torch.float64)
    assert torch.equal(measured["rope"].entropy, expected)


def test_a_run_without_entropy(tmp_path):
    run = write_results(tmp_path / "run", [["rope", "none", 0, 64, 64, 0, 2.5, ""]])
    assert run_entropy(run) is None
    assert len(read_results(run)) == 1


def test_bad_entropy_cells_are_clear_errors():
    rows = [{"encoding": "rope", "extension": "none", "eval_len": "64", "entropy_by_layer": "[1.0, oops]"}]
    with pytest.raises(ValueError, match="is not a list of finite numbers"):
        entropy_from_results(rows)
    rows = [
        {"encoding": "rope", "extension": "none", "eval_len": "64", "entropy_by_layer": "[1.0, 2.0]"},
        {"encoding": "rope", "extension": "none", "eval_len": "128", "entropy_by_layer": "[1.0]"},
    ]
    with pytest.raises(ValueError, match="lacks some \\(length, layer, head\\) rows"):
        entropy_from_results(rows)


def test_figures_follow_the_runs_model(tmp_path):
    from posenc.analysis.run import run_figure_config

    run = write_results(tmp_path / "run", [["rope", "none", 0, 64, 64, 0, 2.5, "[1.0]"]])
    assert run_figure_config(run) is None  # no results.json
    lab = {"dim": 96, "heads": 3, "train_len": 64, "eval_lengths": [64, 128, 512], "steps": 10}
    (run / "results.json").write_text(json.dumps({"config": lab}))
    config = run_figure_config(run)
    assert (config.head_dim, config.num_heads, config.train_len, config.eval_len) == (32, 3, 64, 512)
    assert figure_inputs(None, run).config == config
    page = render_html(run, figures=[])
    assert "head_dim=32" not in page  # no figures, no description
    page = render_html(run, figures=["wavelengths"])
    assert "head_dim=32" in page and "train_len=64" in page
    (run / "results.json").write_text("[")
    with pytest.raises(ValueError, match="is not a JSON object"):
        run_figure_config(run)


def test_a_run_that_stopped_before_its_report_says_to_rerun(tmp_path):
    # A SIGKILLed first run: finished units on disk, no results.csv yet. "No finished measurements" was wrong.
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ValueError, match=r"stopped before writing results\.csv; rerun the same `posenc lab` command"):
        read_results(tmp_path)
