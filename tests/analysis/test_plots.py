"""Every figure renders to a non-empty PNG with the Agg canvas, without pyplot and without touching the backend."""

from __future__ import annotations

import io
import subprocess
import sys

import pytest
import torch

from posenc.analysis import FIGURES, FigureConfig, FigureInputs, figure_inputs, render, write_entropy_csv, write_figures
from posenc.analysis.entropy import EntropyResult
from posenc.analysis.plots import check_names, png_bytes

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def is_png(data: bytes) -> bool:
    # Decoding proves it is a real image, not just a header.
    from matplotlib.image import imread

    return data.startswith(PNG_SIGNATURE) and imread(io.BytesIO(data), format="png").shape[0] > 100


@pytest.mark.parametrize("name", list(FIGURES))
def test_each_figure_renders(name):
    fig = render(name)
    if name == "attention_entropy":  # no run given: it says where its numbers come from
        assert "random model" in fig.axes[0].get_title()
    assert fig.axes and all(ax.get_title() or fig.get_suptitle() for ax in fig.axes if ax.get_label() != "<colorbar>")
    assert is_png(png_bytes(fig, dpi=60))


YARN = FigureConfig(head_dim=32, rope_parameters={"rope_type": "yarn", "factor": 8.0}, train_len=256)
PARTIAL = FigureConfig(head_dim=48, rope_parameters={"rope_theta": 500.0, "partial_rotary_factor": 0.5})
LONG = FigureConfig(head_dim=128, rope_parameters={"rope_type": "dynamic", "factor": 4.0}, eval_len=65536)


@pytest.mark.parametrize("config", [YARN, PARTIAL, LONG], ids=["yarn", "partial", "dynamic-long"])
@pytest.mark.parametrize("name", ["phase_difference", "pair_layouts", "long_term_decay", "wavelengths"])
def test_figures_follow_the_config(config, name):
    assert is_png(png_bytes(render(name, FigureInputs(config=config)), dpi=50))


def test_frequency_figure_shows_every_scaling_type():
    from posenc.rope.frequencies import SCALINGS

    fig = render("scaled_frequencies", FigureInputs(config=YARN))
    labels = [t.get_text() for t in fig.axes[1].get_legend().get_texts()] if fig.axes[1].get_legend() else []
    labels = labels or [line.get_label() for line in fig.axes[1].get_lines()]
    assert labels == list(SCALINGS)


def test_write_figures_png_and_svg(tmp_path):
    paths = write_figures(tmp_path / "out", ["wavelengths", "pair_layouts"], svg=True, dpi=50)
    assert [p.name for p in paths] == ["wavelengths.png", "wavelengths.svg", "pair_layouts.png", "pair_layouts.svg"]
    assert is_png(paths[0].read_bytes())
    assert paths[1].read_text().lstrip().startswith("<?xml") and "<svg" in paths[1].read_text()


def test_entropy_from_a_run(tmp_path):
    measured = EntropyResult(lengths=torch.tensor([8, 16]), entropy=torch.rand(2, 2, 2).double(), source="model")
    write_entropy_csv(tmp_path / "entropy.csv", {("alibi", "none"): measured})
    inputs = figure_inputs(FigureConfig(), tmp_path)
    fig = render("attention_entropy", inputs)
    assert "measured in" in fig.axes[0].get_title()
    assert fig.axes[0].get_lines()[0].get_label() == "alibi"


def test_no_pyplot_and_no_backend_change():
    code = (
        "import sys, posenc, posenc.analysis\n"
        "assert 'matplotlib' not in sys.modules, 'importing posenc loaded matplotlib'\n"
        "from posenc.analysis.plots import render, png_bytes\n"
        "png_bytes(render('wavelengths'), dpi=30)\n"
        "assert 'matplotlib.pyplot' not in sys.modules, 'pyplot was imported'\n"
        "import matplotlib\n"
        "assert matplotlib.rcParams._get_backend_or_none() is None, matplotlib.rcParams._get_backend_or_none()\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True)


def test_bad_input_is_a_clear_error(tmp_path):
    with pytest.raises(ValueError, match="unknown figure\\(s\\) 'spiral'; known figures: phase_difference"):
        render("spiral")
    with pytest.raises(ValueError, match="unknown figure"):
        write_figures(tmp_path, ["wavelengths", "spiral"])
    assert check_names([]) == list(FIGURES)
    (tmp_path / "file").write_text("")
    with pytest.raises(ValueError, match="is a file; give a directory"):
        write_figures(tmp_path / "file", ["wavelengths"])
    with pytest.raises(ValueError, match=r"has no results\.csv"):
        figure_inputs(FigureConfig(), tmp_path)
