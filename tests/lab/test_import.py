"""`posenc lab --import MODULE` (and report, plot, info): a user's module registers a family before the config is
checked, and the run folder records it for a resume."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

import posenc
from posenc.cli import main

FAMILY = """
import torch

import posenc
from posenc.encoding import ActsOn


class LogDistance(torch.nn.Module):
    acts_on = ActsOn.SCORE_BIAS

    def __init__(self, num_heads):
        super().__init__()
        self.num_heads = num_heads

    @classmethod
    def from_model_dims(cls, *, dim, num_heads, head_dim, max_positions):
        return cls(num_heads)

    def score_bias(self, q_positions, k_positions):
        distance = (q_positions[..., :, None] - k_positions[..., None, :]).abs().float()
        return -torch.log1p(distance).expand(1, self.num_heads, *distance.shape[-2:])


posenc.register("{name}", LogDistance)
"""


@pytest.fixture
def clean(monkeypatch, tmp_path):
    """The registry and sys.path as they were before the test's imports, and its modules (in tmp_path) gone."""
    encodings = posenc.registry.ENCODINGS
    before = dict(encodings)
    monkeypatch.setattr(sys, "path", list(sys.path))
    yield
    encodings.clear()
    encodings.update(before)
    for name, module in list(sys.modules.items()):
        if str(getattr(module, "__file__", None) or "").startswith(str(tmp_path)):
            del sys.modules[name]


def _tiny(corpus: Path, out: Path) -> list[str]:
    # The tiny_config fixture's sizes, as flags.
    return [
        "lab", "--preset", "quick", "--corpus", str(corpus), "--dim", "16", "--layers", "1", "--heads", "2",
        "--train-len", "8", "--steps", "6", "--batch-size", "4", "--eval-windows", "4", "--extensions", "none",
        "--no-progress", "--no-figures", "--out", str(out),
    ]  # fmt: skip


def test_lab_trains_a_family_its_import_registers_and_the_folder_names_the_module(clean, corpus_dir, tmp_path, capsys):
    module = tmp_path / "logdist_lab.py"
    module.write_text(FAMILY.format(name="logdist_lab"))
    out = tmp_path / "run"
    args = [*_tiny(corpus_dir, out), "--encodings", "logdist_lab"]
    assert main([*args, "--import", str(module)]) == 0
    results = json.loads((out / "results.json").read_text())
    assert results["imports"] == [str(module)]
    assert {row["encoding"] for row in results["rows"]} == {"logdist_lab"}
    assert f"--import {module}" in results["command"]
    assert json.loads((out / "config.json").read_text())["imports"] == [str(module)]
    assert f"Imported for their registrations: `{module}`" in (out / "report.md").read_text()

    # A resume without it: the config's error, and which --import the run was made with.
    del posenc.registry.ENCODINGS["logdist_lab"]
    del sys.modules["logdist_lab"]
    capsys.readouterr()
    assert main(args) == 2
    err = capsys.readouterr().err
    assert "unknown encodings: logdist_lab" in err and f"made with --import {module}; pass it again" in err
    assert main([*args, "--import", str(module)]) == 0  # and with it, the same run resumes


def test_a_run_without_imports_records_none_in_its_config_json(clean, corpus_dir, tmp_path):
    out = tmp_path / "run"
    assert main([*_tiny(corpus_dir, out), "--encodings", "nope"]) == 0
    # The claim of runs without --import is as before, so that their folders and ids stay as they were.
    assert set(json.loads((out / "config.json").read_text())) == {"config_id", "results_key", "corpus_sha256"}
    assert json.loads((out / "results.json").read_text())["imports"] == []


def test_a_dotted_name_is_imported_from_the_module_path(clean, tmp_path, monkeypatch, capsys):
    (tmp_path / "logdist_dotted.py").write_text(FAMILY.format(name="logdist_dotted"))
    monkeypatch.syspath_prepend(str(tmp_path))
    assert main(["info", "--import", "logdist_dotted"]) == 0
    assert "logdist_dotted" in capsys.readouterr().out


@pytest.mark.parametrize("command", [["info"], ["plot", "--out", "figs"], ["report", "run"], ["lab"]])
def test_a_module_that_is_not_found_or_raises_is_one_line_naming_it(command, clean, tmp_path, capsys, monkeypatch):
    assert main([*command, "--import", "no_such_module_here"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == (
        f"posenc {command[0]}: error: --import no_such_module_here: no module named 'no_such_module_here' on the "
        "module search path; add the folder that holds it to PYTHONPATH, or pass the path to its .py file "
        "(--import path/to/no_such_module_here.py)"
    )
    bad = tmp_path / "raises.py"
    bad.write_text("import posenc\n\nraise RuntimeError('kerple needs a bias table\\nsecond line')\n")
    assert main([*command, "--import", str(bad)]) == 2
    err = capsys.readouterr().err.strip()
    assert err == (
        f"posenc {command[0]}: error: --import {bad}: importing it raised RuntimeError: kerple needs a bias table "
        f"(at {bad}:3)"
    )
    assert main([*command, "--import", str(tmp_path / "missing.py")]) == 2
    assert "no such file" in capsys.readouterr().err
    # A folder: "no such file" by path before, and by name an import that ran nothing (a namespace package).
    (tmp_path / "plainfolder").mkdir()
    assert main([*command, "--import", str(tmp_path / "plainfolder")]) == 2
    assert f"{tmp_path / 'plainfolder'} is a folder; pass the path to a .py file in it" in capsys.readouterr().err
    (tmp_path / "realpackage").mkdir()
    (tmp_path / "realpackage" / "__init__.py").write_text("")
    assert main([*command, "--import", str(tmp_path / "realpackage")]) == 2
    assert "is a package; import it by name, --import realpackage, from its parent folder" in capsys.readouterr().err
    monkeypatch.chdir(tmp_path)
    assert main([*command, "--import", "plainfolder"]) == 2
    assert "--import plainfolder: a folder without __init__.py, whose import runs no code" in capsys.readouterr().err
