"""Every figure renders to a non-empty PNG with the Agg canvas, without pyplot and without touching the backend."""

from __future__ import annotations

import io
import math
import subprocess
import sys

import numpy as np
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
    left = [t.get_text() for t in fig.axes[0].get_legend().get_texts()]
    assert "longrope (example factors, attention factor" in left[list(SCALINGS).index("longrope")]
    # proportional turns a quarter of the 16 pairs; its other 12 cannot go on the log axis, and the legend says so.
    proportional = left[list(SCALINGS).index("proportional")]
    assert proportional == "proportional (attention factor 1, 12 pairs at θ = 0 not drawn)"
    assert sum("not drawn" in label for label in left) == 1


def test_dynamic_at_four_times_its_length_divides_the_slowest_pair_by_thirteen():
    """docs/figures.md: Hugging Face's dynamic NTK scales the base by alpha^(r/(r-2)), alpha = factor * s - (factor
    - 1) for s = length / trained length; at factor 4 and s = 4, alpha = 13 and the slowest pair turns 13x slower."""
    config = FigureConfig(rope_parameters={"rope_type": "yarn", "factor": 4.0}, train_len=2048)
    right = render("scaled_frequencies", FigureInputs(config=config)).axes[1]
    dynamic = next(line for line in right.get_lines() if line.get_label() == "dynamic")
    assert dynamic.get_ydata()[-1] == pytest.approx(1 / 13, rel=1e-12)


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


def test_wavelengths_of_a_length_dependent_type_are_drawn_at_the_evaluation_length():
    """Dynamic NTK equals default RoPE up to its trained length: drawn there it would look unchanged."""
    config = FigureConfig(head_dim=32, rope_parameters={"rope_type": "dynamic", "factor": 4.0}, train_len=256)
    ax = render("wavelengths", FigureInputs(config=config)).axes[0]
    plain, scaled = (torch.tensor(line.get_ydata()) for line in ax.get_lines()[:2])
    assert bool((scaled[1:] > plain[1:]).all()), "dynamic NTK stretches every pair but the first"
    assert "frequencies at length 1024" in ax.get_title()


def test_frequency_figures_keep_proportional_and_partial_rotation_apart():
    """'proportional' reads partial_rotary_factor as the fraction of pairs that turn: configured so, the other types
    still rotate the whole head, and every ratio to default is 1 (left alone) or 0 (stands still) or in between."""
    config = FigureConfig(rope_parameters={"rope_type": "proportional", "partial_rotary_factor": 0.25})
    right = render("scaled_frequencies", FigureInputs(config=config)).axes[1]
    ratios = torch.cat([torch.tensor(line.get_ydata(), dtype=torch.float64) for line in right.get_lines()])
    assert float(ratios[ratios.isfinite()].max()) <= 1.0 + 1e-12
    decay = render("long_term_decay", FigureInputs(config=config)).axes[0]
    labels = [line.get_label() for line in decay.get_lines() if not line.get_label().startswith("_")]
    assert labels[:3] == [f"default, base={b}" for b in (500, 10000, 500000)]
    assert decay.get_lines()[0].get_ydata()[0] > 15  # distance 1 on 32 pairs, not on 8: near 32 * ... / 32 = 16
    title = render("wavelengths", FigureInputs(config=config)).axes[0].get_title()
    assert "11 of 32 turn less than once within L;\nscaled, 24 turn less than once within 8192 (24 never turn)" in title


def test_bias_figure_shows_the_extreme_alibi_heads_and_is_reproducible():
    """For 12 heads ALiBi's slopes are not sorted (heads 8..11 interleave the next power of two's): the steepest is
    head 8, the flattest head 7. The T5 panel is seeded and masks the future like the ALiBi panels."""
    inputs = FigureInputs(config=FigureConfig(num_heads=12))
    fig = render("bias_matrices", inputs)
    titles = [ax.get_title() for ax in fig.axes if ax.get_label() != "<colorbar>"]
    assert titles[0].startswith("ALiBi head 8, the steepest") and titles[1].startswith("ALiBi head 7, the flattest")
    t5 = torch.tensor(fig.axes[2].get_images()[0].get_array().filled(float("nan")))
    assert bool(t5.triu(1).isnan()[torch.ones(32, 32, dtype=torch.bool).triu(1)].all())
    assert not bool(t5.tril().isnan().any())
    assert png_bytes(fig, dpi=40) == png_bytes(render("bias_matrices", inputs), dpi=40)


def test_bias_figure_draws_a_single_alibi_head_once():
    """With one head the steepest head is the flattest: one ALiBi panel beside T5's, not the same one twice."""
    fig = render("bias_matrices", FigureInputs(config=FigureConfig(num_heads=1)))
    titles = [ax.get_title() for ax in fig.axes if ax.images]
    assert len(titles) == 2
    assert titles[0].startswith("ALiBi's one head (slope 0.00391)") and titles[1].startswith("T5 head 0")


def test_figures_leave_the_global_generator_alone():
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    render("attention_entropy")
    render("bias_matrices")
    assert torch.equal(torch.rand(3), expected)


def test_phase_title_states_the_angle_the_arrows_make():
    from matplotlib.text import Annotation

    ax = render("phase_difference").axes[0]
    q5, k2, q9, k6 = [a.xy for a in ax.texts if isinstance(a, Annotation)]

    def angle(q, k):
        return math.atan2(k[0] * q[1] - k[1] * q[0], k[0] * q[0] + k[1] * q[1]) % (2 * math.pi)

    assert angle(q5, k2) == pytest.approx(angle(q9, k6), abs=1e-9)
    assert f"→ {angle(q5, k2):.2f} rad in both" in ax.get_title()


# The figure's unrotated pair, q = (1, 0.25) and k = (0.8, -0.3), as one complex number each: for a 2-d pair
# RoPE(q at m) · RoPE(k at n) = Re[q e^{i m θ} conj(k e^{i n θ})] = Re[q conj(k) e^{i (m - n) θ}].
PHASE_Q, PHASE_K = complex(1.0, 0.25), complex(0.8, -0.3)


def test_phase_scores_lie_on_the_drawn_curve_of_their_own_phase():
    """Every dot sits on the curve at its own x, and the curve is Re[q conj(k) e^{ix}]: a phase drawn as (n - m)θ,
    or a curve turned the wrong way, moves the dots off it."""
    right = render("phase_difference").axes[1]
    grid, curve = right.get_lines()[0].get_xydata().T
    phase, scores = right.collections[0].get_offsets().T
    expected = PHASE_Q * PHASE_K.conjugate()
    assert np.abs(curve - (expected * np.exp(1j * grid)).real).max() < 1e-9
    assert np.abs(scores - (expected * np.exp(1j * phase)).real).max() < 1e-9
    assert phase.min() >= 0 and phase.max() < 2 * np.pi


def test_phase_title_turns_the_unrotated_angle_by_three_theta():
    title = render("phase_difference").axes[0].get_title()
    theta = 10000.0 ** (-2 / 64)  # pair 1 of d = 64, base 10000
    start = math.atan2(PHASE_Q.imag, PHASE_Q.real) - math.atan2(PHASE_K.imag, PHASE_K.real)  # from k to q
    assert title.startswith("pair 1:")
    assert (
        f"angle k→q: {start:.2f} rad unrotated, + 3θ = {3 * theta:.2f} → {(start + 3 * theta) % (2 * math.pi):.2f} rad"
        in title
    )


def test_uniform_causal_entropy_is_the_mean_log_over_rows():
    """Uniform attention over t keys has entropy ln t; row m of a causal sequence sees m + 1 keys, so a length-L
    sequence averages ln t over t = 1..L (1.917 at 16, 4.560 at 256)."""
    ax = render("attention_entropy").axes[0]
    reference = next(line for line in ax.get_lines() if line.get_label().startswith("uniform causal"))
    lengths, drawn = reference.get_xydata().T
    expected = [math.fsum(math.log(t) for t in range(1, int(length) + 1)) / length for length in lengths]
    assert np.abs(drawn - expected).max() < 1e-12
    assert drawn[lengths == 16][0] == pytest.approx(1.917, abs=5e-4)
    assert drawn[lengths == 256][0] == pytest.approx(4.560, abs=5e-4)


@pytest.mark.parametrize("config", [FigureConfig(), YARN], ids=["default", "yarn"])
def test_decay_lines_are_the_bound_at_the_distances_they_are_drawn_at(config):
    """Faint: long_term_decay at every distance drawn; bold: their mean over log-spaced bins; for a type with an
    attention factor, dashed: the bold line divided by the factor squared."""
    from posenc.analysis import long_term_decay
    from posenc.analysis.plots import DECAY_BINS_PER_DECADE

    distances = torch.arange(1, config.eval_len + 1)
    expected = {
        f"default, base={base:g}": long_term_decay(
            config.head_dim, rope_parameters={"rope_theta": base}, distances=distances
        )
        for base in (500.0, 10000.0, 500000.0)
    }
    if config is YARN:
        expected["yarn, d=32, base=10000, factor=8"] = long_term_decay(
            32, rope_parameters=YARN.rope_parameters, distances=distances, max_position_embeddings=256, seq_len=2048
        )
    lines = {line.get_label(): line for line in render("long_term_decay", FigureInputs(config=config)).axes[0].lines}
    assert {label for label in lines if label.startswith("_")} == {f"_every distance: {label}" for label in expected}
    for label, result in expected.items():
        x, y = lines[f"_every distance: {label}"].get_xydata().T
        assert np.array_equal(x, distances.numpy()) and np.abs(y - result.bound.numpy()).max() < 1e-12, label
        # The bold line: the mean of the faint one's points over each bin [10^(b/B), 10^((b+1)/B)).
        # Bins by exact integer arithmetic: 10^(b/B) <= x  <=>  10^b <= x^B.
        bins = [max(b for b in range(0, 64) if 10**b <= int(d) ** DECAY_BINS_PER_DECADE) for d in x]
        _, index, counts = np.unique(bins, return_inverse=True, return_counts=True)
        binned_x, binned_y = lines[label].get_xydata().T
        assert np.abs(binned_x - np.bincount(index, x) / counts).max() < 1e-9, label
        assert np.abs(binned_y - np.bincount(index, y) / counts).max() < 1e-12, label
    if config is YARN:
        squared = (0.1 * np.log(8.0) + 1) ** 2  # YaRN's temperature at factor 8, on q and on k
        dashed = lines[f"the same ÷ attention factor² ({squared:.4g}): its frequencies alone"]
        assert (
            np.abs(dashed.get_ydata() * squared - lines["yarn, d=32, base=10000, factor=8"].get_ydata()).max() < 1e-12
        )


def test_entropy_curves_past_ten_differ_by_line_style():
    results = {
        f"encoding {i}": EntropyResult(lengths=torch.tensor([8, 16]), entropy=torch.rand(2, 1, 1).double(), source="")
        for i in range(12)
    }
    ax = render("attention_entropy", FigureInputs(entropy=results, entropy_source="test")).axes[0]
    styles = [(line.get_color(), line.get_linestyle()) for line in ax.get_lines()[:12]]
    assert len(set(styles)) == 12


def test_the_wavelength_count_says_what_training_saw_and_what_the_extension_keeps():
    """YaRN x4 at d = 64, L = 2048: 11 pairs never turned in training (plain RoPE's wavelengths against L), and
    YaRN keeps 11 such pairs against 8192; the title once counted scaled wavelengths against L (14)."""
    config = FigureConfig(
        rope_parameters={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 2048}
    )
    title = render("wavelengths", FigureInputs(config=config)).axes[0].get_title()
    assert "11 of 32 turn less than once within L;\nscaled, 11 turn less than once within 8192\n" in title


def test_mrope_figure_draws_each_layouts_axes():
    """Each strip is mrope_axis_of_pair of its example, and its title counts the pairs each axis gets."""
    from posenc.analysis.plots import MROPE_EXAMPLES
    from posenc.rope.mrope import mrope_axis_of_pair

    fig = render("mrope_layouts", FigureInputs(config=FigureConfig(rope_parameters={"rope_theta": 500000.0})))
    assert "base=500000" in fig.get_suptitle()
    for ax, (layout, section, _) in zip(fig.axes, MROPE_EXAMPLES, strict=True):
        drawn = torch.as_tensor(ax.get_images()[0].get_array()).long()[0]
        assert torch.equal(drawn, mrope_axis_of_pair(section, layout=layout))
        counts = [int(part.split(": ")[1].split()[0]) for part in ax.get_title().split("\n")[1].split("; ")]
        assert counts == torch.bincount(drawn, minlength=3).tolist()


def test_figures_do_not_mislead_where_a_teacher_found_them_to():
    # The steepest and flattest ALiBi heads on one colour scale (each on its own, a 128x flatter slope drew the same
    # picture).
    alibi = [ax.images[0].get_clim() for ax in render("bias_matrices").axes if ax.images][:2]
    assert alibi[0] == alibi[1]
    # The outermost diagonals hold one cell each: a spread of 0 there says nothing, and is not drawn.
    invariance = render("relative_invariance")
    for line in invariance.axes[2].get_lines():
        assert min(line.get_ydata()) > 1e-10 or line.get_label().startswith("RoPE"), line.get_label()
    # Rounding noise is stated as a bound, so that the figure is the same on every run.
    assert invariance.axes[0].get_title().endswith("max spread along m - n: < 1e-14")
    # Every heatmap puts query 0 at the top, as attention matrices are drawn.
    heatmaps = [ax.images[0] for fig in (invariance, render("bias_matrices")) for ax in fig.axes if ax.images]
    assert len(heatmaps) == 5 and {image.origin for image in heatmaps} == {"upper"}
    # What the figure teaches, in its data: RoPE's scores are constant along each diagonal, sinusoidal's are not.
    for ax, flat in zip(invariance.axes[:2], (True, False), strict=True):
        scores = np.asarray(ax.images[0].get_array())
        spread = max(np.ptp(np.diagonal(scores, offset)) for offset in range(1 - len(scores), len(scores)))
        assert (spread < 1e-10) == flat and ax.get_title().startswith("RoPE") == flat, (ax.get_title(), spread)
    # The uniform-attention reference is drawn over the curves that lie on it.
    entropy = render("attention_entropy").axes[0]
    reference = next(line for line in entropy.get_lines() if line.get_label().startswith("uniform causal"))
    assert reference.get_zorder() > max(line.get_zorder() for line in entropy.get_lines() if line is not reference)


def test_pair_layouts_grey_the_pairs_proportional_rope_stands_still():
    config = FigureConfig(rope_parameters={"rope_type": "proportional", "partial_rotary_factor": 0.25})
    for ax in render("pair_layouts", FigureInputs(config=config)).axes[:2]:
        labels = [t.get_text() for t in ax.texts if t.get_text().startswith("θ") or t.get_text() == "-"]
        assert labels.count("-") == 12 and {label for label in labels if label != "-"} == {"θ0", "θ1"}


def test_pair_layouts_of_a_large_base_turn_every_pair():
    """Base 1e30: the slow pairs turn by under 1e-12 rad per position, but they turn (they were drawn grey, '-')."""
    for ax in render("pair_layouts", FigureInputs(config=FigureConfig(rope_parameters={"rope_theta": 1e30}))).axes[:2]:
        labels = [t.get_text() for t in ax.texts if t.get_text().startswith("θ") or t.get_text() == "-"]
        assert sorted(labels) == sorted(f"θ{i}" for i in range(8) for _ in range(2))


def test_an_odd_head_rotated_as_its_error_advises_draws_every_figure():
    """FigureConfig's error for head_dim=7 advises partial_rotary_factor=0.928571; the invariance figure then failed
    (sinusoidal needs an even width) after three figures were written. Sinusoidal is compared at d=6, and says so."""
    config = FigureConfig(head_dim=7, rope_parameters={"partial_rotary_factor": 0.928571})
    fig = render("relative_invariance", FigureInputs(config=config))
    assert fig.axes[0].get_title().startswith("RoPE (default)\nmax spread along m - n: < 1e-14")
    assert fig.axes[1].get_title().startswith("sinusoidal (added to q and k, d=6)\n")
    assert np.asarray(fig.axes[0].images[0].get_array()).shape == (64, 64)


def test_scaled_frequencies_of_a_one_pair_head_are_visible():
    """d=2: each type has one point, and a line of one point is not drawn; the figure was two empty panels."""
    fig = render("scaled_frequencies", FigureInputs(config=FigureConfig(head_dim=2)))
    for ax in fig.axes[:2]:
        lines = ax.get_lines()
        assert lines
        assert all(len(line.get_xdata()) == 1 and line.get_marker() not in (None, "None", "") for line in lines)


def test_phase_figure_of_a_pair_turning_past_half_pi():
    """A LongRoPE short factor of 0.1 turns pair 1 by 7.5 rad per position. The layout matched no channel to pair 1
    (|sin| against |cos| read another angle) and the figure raised IndexError; its scores lie on its curve."""
    short = [1.0, 0.1] + [1.0] * 30
    params = {"rope_type": "longrope", "short_factor": short, "long_factor": [1.0] * 32, "factor": 2.0}
    fig = render("phase_difference", FigureInputs(config=FigureConfig(rope_parameters=params, train_len=2048)))
    right = fig.axes[1]
    assert "θ_1 = 7.5 rad" in right.get_title()
    phase, score = np.asarray(right.collections[0].get_offsets()).T
    curve = np.interp(phase, right.get_lines()[0].get_xdata(), right.get_lines()[0].get_ydata())
    assert np.abs(curve - score).max() < 1e-3  # the curve is drawn at 200 points: linear interpolation's error


# Long parameter lists (DeepSeek-style YaRN; Phi-3's LongRoPE at its 32x length): the wrapped label came before the
# prefix or the length note was added, so the line they ended on ran off both sides of the figure.
@pytest.mark.parametrize(
    "rope_parameters",
    [
        {
            "rope_type": "yarn",
            "factor": 40.0,
            "original_max_position_embeddings": 4096,
            "beta_fast": 32,
            "beta_slow": 1,
            "mscale": 1.0,
            "mscale_all_dim": 1.0,
        },
        {
            "rope_type": "longrope",
            "factor": 32.0,
            "original_max_position_embeddings": 4096,
            "short_factor": [1.0] * 48,
            "long_factor": [1.0 + 0.05 * i for i in range(48)],
        },
    ],
    ids=["yarn", "longrope"],
)
@pytest.mark.parametrize("name", ["phase_difference", "wavelengths"])
def test_titles_with_every_parameter_stay_on_the_figure(rope_parameters, name):
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    fig = render(name, FigureInputs(config=FigureConfig(head_dim=96, rope_parameters=rope_parameters)))
    renderer = FigureCanvasAgg(fig).get_renderer()
    fig.draw(renderer)
    titles = [fig._suptitle, *(ax.title for ax in fig.axes)]
    for title in (t for t in titles if t is not None and t.get_text()):
        box = title.get_window_extent(renderer)
        assert box.x0 >= 0 and box.x1 <= fig.bbox.width, title.get_text()


@pytest.mark.parametrize(
    "parameters",
    [
        {"rope_type": "dynamic", "factor": 2.0, "partial_rotary_factor": 0.5},  # q at 5 and k at 6 point alike
        {"rope_type": "linear", "factor": 8.0, "rope_theta": 500000.0},  # a slow pair at a large factor
    ],
)
def test_phase_difference_labels_do_not_overlap(parameters):
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    fig = render("phase_difference", FigureInputs(config=FigureConfig(rope_parameters=parameters)))
    canvas = FigureCanvasAgg(fig)
    canvas.draw()
    left = fig.axes[0]
    boxes = [text.get_window_extent(canvas.get_renderer()) for text in left.texts if text.get_text()]
    assert len(boxes) == 4
    assert not any(a.overlaps(b) for i, a in enumerate(boxes) for b in boxes[i + 1 :])
    frame = left.get_window_extent(canvas.get_renderer())
    assert all(frame.x0 <= box.x0 and box.x1 <= frame.x1 and frame.y0 <= box.y0 and box.y1 <= frame.y1 for box in boxes)
