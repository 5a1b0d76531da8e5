"""The nine figures of ``posenc plot``, each drawn from the analysis functions and so from the real modules.

Figures are ``matplotlib.figure.Figure`` objects made directly, never through pyplot: no backend is selected, no
global state changes and no window opens, and PNG/SVG come from matplotlib's Agg/SVG canvases. matplotlib is
imported when the first figure is drawn, not with this module. ``FIGURES`` maps each name to its drawing
function; ``render`` draws one, ``write_figures`` writes files, ``png_bytes`` gives the bytes the report embeds.
"""

from __future__ import annotations

import dataclasses
import io
import math
import textwrap
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from posenc import _atomic
from posenc._checks import integer
from posenc.absolute import Sinusoidal
from posenc.analysis.bias import bias_matrix
from posenc.analysis.config import FigureConfig
from posenc.analysis.decay import long_term_decay
from posenc.analysis.entropy import EntropyResult, attention_entropy
from posenc.analysis.frequencies import frequency_table
from posenc.analysis.invariance import relative_invariance
from posenc.analysis.layout import rotary_pairs
from posenc.analysis.run import run_entropy, run_figure_config
from posenc.analysis.wavelengths import wavelengths
from posenc.bias import ALiBi, T5Bias
from posenc.rope.frequencies import is_seq_len_dependent, turns_fraction_of_pairs
from posenc.rope.module import RoPE

if TYPE_CHECKING:
    from matplotlib.figure import Figure


@dataclasses.dataclass(frozen=True)
class FigureInputs:
    """config: what to draw; entropy: measured attention entropy for figure 8 (e.g. from a lab run) with a
    label saying where it came from, or None to compute it on a small random model."""

    config: FigureConfig = dataclasses.field(default_factory=FigureConfig)
    entropy: dict[str, EntropyResult] | None = None
    entropy_source: str = ""


def _new_figure(width: float, height: float) -> Figure:
    # Imported here so that the registry (and `posenc --help`) loads without matplotlib.
    from matplotlib.figure import Figure

    return Figure(figsize=(width, height), layout="constrained")


def figure_inputs(
    config: FigureConfig | None = None, run_dir: str | Path | None = None, *, need_entropy: bool = True
) -> FigureInputs:
    """Inputs for the figures; with ``run_dir``, figure 8 draws the attention entropy that lab run measured, and
    without a config the figures are drawn for the run's own model (see ``run_figure_config``). need_entropy:
    whether figure 8 is drawn (then a run that measured no entropy is an error; else it is not needed)."""
    if run_dir is None:
        return FigureInputs(config=config or FigureConfig())
    if not Path(run_dir).is_dir():  # a typo is an error, not the default figures
        raise ValueError(f"run folder {str(run_dir)!r} does not exist; give the --out folder of a `posenc lab` run")
    config = config or run_figure_config(run_dir) or FigureConfig()
    if not need_entropy:
        return FigureInputs(config=config)
    measured = run_entropy(run_dir)
    if measured is None:
        raise ValueError(
            f"run folder {str(run_dir)!r} has no measured attention entropy (no entropy.csv, no entropy_by_layer "
            "column in results.csv); leave out --run to compute entropy on a small random model"
        )
    return FigureInputs(config=config, entropy=measured[0], entropy_source=measured[1])


def _rope(config: FigureConfig) -> RoPE:
    return RoPE(config.head_dim, **config.rope_kwargs())


def _config_label(config: FigureConfig, *, full: bool = False) -> str:
    """'yarn, d=64, base=10000, factor=4'; with ``full`` all the type's scalar parameters (lists left out), on one
    line: a title that holds it wraps it with ``_fill``, together with the words around it."""
    label = f"{config.rope_type}, d={config.head_dim}, base={config.base:g}"
    if config.spec.rotary_dim != config.head_dim:
        label += f", r={config.spec.rotary_dim}"
    if config.interleaved:  # the channels figure 1 draws depend on it
        label += ", adjacent pairs"
    if not full and config.spec.params.get("factor"):
        label += f", factor={config.spec.params['factor']:g}"
    own = {k: v for k, v in config.spec.params.items() if not isinstance(v, (list, tuple))}
    if not full or not own:
        return label
    return label + ", " + ", ".join(f"{k}={v:g}" if isinstance(v, float) else f"{k}={v}" for k, v in own.items())


def _fill(line: str) -> str:
    """One title line wrapped to 100 characters, which the 10-11 inch figures hold at the title's font size.

    Long parameter lists go on more lines rather than off the figure; the whole line is wrapped, not the label alone,
    since words before or after it (a prefix, the length note) lengthen the line it ends up on."""
    return textwrap.fill(line, 100)


def _length_note(config: FigureConfig) -> str:
    """', frequencies at length 8192' for types whose frequencies depend on the length, else ''."""
    return f", frequencies at length {config.eval_len}" if is_seq_len_dependent(config.rope_type) else ""


def _factor(config: FigureConfig) -> float:
    factor = config.spec.params.get("factor")
    return float(factor) if factor else max(config.eval_len / config.train_len, 1.0)


# -- 1 ---------------------------------------------------------------------------------------------------------
def _spread_angles(angles: Sequence[float], *, min_gap: float) -> list[float]:
    """The angles (radians), each moved as little as needed so that neighbours on the circle are min_gap apart.

    Needs len(angles) * min_gap < 2π. Returned in the given order, in [0, 2π) before moving.
    """
    tau = 2 * math.pi
    order = sorted(range(len(angles)), key=lambda i: angles[i] % tau)
    placed = [angles[i] % tau for i in order]
    count = len(placed)
    for _ in range(500):  # Pairwise pushes: a cluster of k angles settles in about k² rounds.
        moved = False
        for j in range(count if count > 1 else 0):
            after = (j + 1) % count
            gap = placed[after] - placed[j] + (0.0 if after else tau)  # the last pair wraps round
            if gap < min_gap - 1e-9:
                push = (min_gap - gap) / 2
                placed[j] -= push
                placed[after] += push
                moved = True
        if not moved:
            break
    result = [0.0] * count
    for slot, index in enumerate(order):
        result[index] = placed[slot]
    return result


def phase_difference(inputs: FigureInputs) -> Figure:
    """Two vectors rotated by m theta and n theta: their score depends only on (m - n) theta."""
    config = inputs.config
    rope = _rope(config)
    layout = rotary_pairs(rope)
    generator = torch.Generator().manual_seed(0)
    m = torch.randint(0, 200, (400,), generator=generator)
    n = torch.randint(0, 200, (400,), generator=generator)
    positions = torch.cat((torch.tensor([5, 2, 9, 6]), m, n))
    s = positions.shape[0]
    # The frequencies RoPE's forward uses for these positions (length-dependent types scale for max + 1).
    inv_freq, _ = rope.frequencies(int(positions.max()) + 1)
    pair = 1 if inv_freq.shape[0] > 1 and inv_freq[1] > 0 else 0
    a = int(torch.nonzero(layout.pair == pair)[0])
    b = int(layout.partner[a])
    theta = float(inv_freq[pair])

    d = config.head_dim
    q = torch.zeros(d, dtype=torch.float64)
    k = torch.zeros(d, dtype=torch.float64)
    q[a], q[b] = 1.0, 0.25
    k[a], k[b] = 0.8, -0.3
    rotated_q, rotated_k = rope(q.expand(1, 1, s, d), k.expand(1, 1, s, d), positions=positions)
    rq, rk = rotated_q[0, 0][:, [a, b]], rotated_k[0, 0][:, [a, b]]  # (s, 2): the chosen pair's plane

    fig = _new_figure(11, 4.8)
    left, right = fig.subplots(1, 2, width_ratios=[1, 1.4])
    circle = torch.linspace(0, 2 * math.pi, 200)
    left.plot(circle.cos(), circle.sin(), color="0.85", lw=1)
    # YaRN and LongRoPE scale cos/sin by their attention factor: the vectors grow past the unit circle with it.
    longest = max(1.0, float(torch.cat((rq, rk)).norm(dim=-1).max()))
    reach = 1.5 * longest  # room past the tips for the labels
    arrows = []
    for (iq, ik), style, (mm, nn) in (((0, 1), "-", (5, 2)), ((2, 3), "--", (9, 6))):
        for row, color, name, pos in ((rq[iq], "C0", "q", mm), (rk[ik], "C3", "k", nn)):
            left.annotate(
                "",
                xy=(float(row[0]), float(row[1])),
                xytext=(0, 0),
                arrowprops={"arrowstyle": "-|>", "color": color, "ls": style, "lw": 1.8},
            )
            arrows.append((math.atan2(float(row[1]), float(row[0])), color, f"{name} at {pos}"))
    # Arrows can point almost the same way (q at 5 and k at 6 do for some θ): each label sits on a ring outside every
    # tip, in its arrow's direction moved just far enough from its neighbours', growing outward so none overlap.
    spread = _spread_angles([angle for angle, _, _ in arrows], min_gap=math.radians(32))
    for angle, (_, color, label) in zip(spread, arrows, strict=True):
        cos, sin = math.cos(angle), math.sin(angle)
        ha = "left" if cos > 0.3 else "right" if cos < -0.3 else "center"
        va = "bottom" if sin > 0.3 else "top" if sin < -0.3 else "center"
        left.text(1.08 * longest * cos, 1.08 * longest * sin, label, color=color, ha=ha, va=va)
    left.set_aspect("equal")
    left.set_xlim(-reach, reach)
    left.set_ylim(-reach, reach)
    left.set_xlabel(f"channel {a}")
    left.set_ylabel(f"channel {b}")
    # The angle from k to q: the unrotated pair's own angle, turned by (m - n)θ = 3θ; the same for both (m, n).
    start = math.atan2(q[b] * k[a] - q[a] * k[b], q[a] * k[a] + q[b] * k[b])
    angle = math.atan2(rq[0, 1] * rk[1, 0] - rq[0, 0] * rk[1, 1], rq[0, 0] * rk[1, 0] + rq[0, 1] * rk[1, 1])
    left.set_title(
        f"pair {pair}: (m, n) = (5, 2) and (9, 6), the same m - n = 3\nangle k→q: {start:.2f} rad unrotated, "
        f"+ 3θ = {3 * theta:.2f} → {angle % (2 * math.pi):.2f} rad in both",
        fontsize=10,
    )

    count = m.shape[0]
    scores = (rq[4 : 4 + count] * rk[4 + count :]).sum(dim=-1)  # q at m_j against k at n_j
    phase = ((m - n).double() * theta) % (2 * math.pi)
    right.scatter(phase, scores, s=8, color="C0", label="RoPE(q at m) · RoPE(k at n), 400 random (m, n)")
    grid = torch.linspace(0, 2 * math.pi, 200, dtype=torch.float64)
    # The same score written as a function of the angle alone: Re[(q_a + i q_b)(k_a - i k_b) e^{i(m-n)θ}].
    z = complex(float(rq[0, 0]), float(rq[0, 1])) * complex(float(rk[1, 0]), -float(rk[1, 1]))
    z *= complex(math.cos(-3 * theta), math.sin(-3 * theta))
    curve = [(z * complex(math.cos(g), math.sin(g))).real for g in grid.tolist()]
    right.plot(grid, curve, color="C1", lw=1, label=r"$\mathrm{Re}[q\,\bar{k}\,e^{i(m-n)\theta}]$")
    right.set_xlabel("(m - n) θ mod 2π  [rad]")
    right.set_ylabel("score of the pair (dot product)")
    right.set_title(f"the score depends on m - n only (θ_{pair} = {theta:.3g} rad / position)")
    # Room above the curve for the legend, which would otherwise cover its low end.
    low, high = min(curve), max(curve)
    right.set_ylim(low - 0.08 * (high - low), high + 0.45 * (high - low))
    right.legend(loc="upper center", fontsize=8)
    fig.suptitle(_fill(f"RoPE phase difference ({_config_label(config, full=True)})"))
    return fig


# -- 2 ---------------------------------------------------------------------------------------------------------
def pair_layouts(inputs: FigureInputs) -> Figure:
    """Which channels are rotated together in adjacent-pair (interleaved) and split-half RoPE."""
    config = inputs.config
    d = config.head_dim if config.head_dim <= 16 else 16
    fraction = config.spec.rotary_dim / config.head_dim
    rotary = max(2, round(d * fraction / 2) * 2)
    from matplotlib.patches import Arc, Rectangle

    fig = _new_figure(11, 4.6)
    axes = fig.subplots(2, 1)
    for ax, interleaved, name in (
        (axes[0], True, "adjacent pairs (interleaved=True: RoFormer, GPT-J)"),
        (
            axes[1],
            False,
            "split half (interleaved=False: rotate_half of Hugging Face's Llama)\nMeta's own Llama code rotates "
            "adjacent pairs; HF's conversion script permutes the q/k projection weights so the two agree",
        ),
    ):
        # Which channels pair depends on the layout alone; proportional RoPE also stands some pairs still, which
        # the schematic head shows in the same proportion (drawn plain, every pair looked rotated).
        proportional = turns_fraction_of_pairs(config.spec.rope_type)
        params = {"rope_type": "proportional", **config.spec.params} if proportional else None
        rope = RoPE(d, rotary_dim=rotary, base=config.base, interleaved=interleaved, rope_parameters=params)
        layout = rotary_pairs(rope)
        colors = [f"C{i % 10}" for i in range(rotary // 2)]
        for c in range(d):
            i = int(layout.pair[c])
            ax.add_patch(Rectangle((c, 0), 0.9, 0.9, color=colors[i] if i >= 0 else "0.85"))
            ax.text(c + 0.45, 0.45, str(c), ha="center", va="center", fontsize=9)
            ax.text(c + 0.45, -0.35, f"θ{i}" if i >= 0 else "-", ha="center", va="center", fontsize=8)
            partner = int(layout.partner[c])
            if partner > c:
                width = partner - c
                ax.add_patch(
                    Arc((c + 0.45 + width / 2, 0.9), width, 0.5 + 0.25 * width, theta1=0, theta2=180, color=colors[i])
                )
        ax.set_xlim(-0.2, d + 0.1)
        ax.set_ylim(-0.7, 0.9 + 0.3 + 0.15 * d)
        ax.set_xticks([])  # the boxes carry the channel numbers
        ax.set_yticks([])
        ax.set_xlabel("channel index within a head (below: the frequency θ_i it turns with)")
        ax.set_title(name, fontsize=10)
        for side in ("top", "right", "left"):
            ax.spines[side].set_visible(False)
    passthrough = f", channels {rotary}..{d - 1} pass through" if rotary < d else ""
    fig.suptitle(f"Which channels rotate together: d={d} shown, r={rotary}{passthrough}; colour = frequency pair")
    return fig


# Real models' M-RoPE layouts at head dim 128 (64 pairs): (layout, mrope_section, who uses it).
MROPE_EXAMPLES = (
    ("sections", (16, 24, 24), "Qwen2-VL, Qwen2.5-VL (GLM-4V: [8, 12, 12] at r = 64)"),
    ("interleaved", (24, 20, 20), "Qwen3-VL (Qwen3.5: [11, 11, 10] at r = 64)"),
    ("alternating", (22, 22, 20), "ERNIE-4.5-VL, sections in the order h, w, t"),
)
_AXIS_NAMES = ("t (time)", "h (height)", "w (width)")


def mrope_layouts(inputs: FigureInputs) -> Figure:
    """Which position axis turns each frequency pair in the three M-RoPE layouts, and the wavelengths each axis
    gets: contiguous sections give time only the fast pairs; interleaved spreads every axis over fast and slow ones;
    ERNIE's alternation gives height and width the fast pairs and time the slow ones."""
    from matplotlib.colors import ListedColormap
    from matplotlib.patches import Patch

    from posenc.rope.mrope import mrope_axis_of_pair

    base = inputs.config.base
    wavelength = 2 * math.pi / RoPE(128, base=base).frequencies()[0]
    fig = _new_figure(12, 5.2)
    axes = fig.subplots(len(MROPE_EXAMPLES), 1)
    colors = ListedColormap(["C0", "C1", "C2"])
    for ax, (layout, section, who) in zip(axes, MROPE_EXAMPLES, strict=True):
        axis = mrope_axis_of_pair(section, layout=layout)
        ax.imshow(axis[None].numpy(), cmap=colors, vmin=0, vmax=2, aspect="auto")
        spans = []
        for a, name in enumerate(_AXIS_NAMES):
            mine = wavelength[axis == a]
            spans.append(f"{name.split()[0]}: {mine.numel()} pairs, λ {mine.min():.3g}..{mine.max():.3g}")
        ax.set_yticks([])
        ax.set_title(f"mrope_layout='{layout}', mrope_section={list(section)}: {who}\n" + "; ".join(spans), fontsize=9)
    # The titles' λ ranges need a definition and a unit: this label is the figure's only key to them.
    axes[-1].set_xlabel(
        "frequency pair i (θ_i = base^(-2i/r): fast on the left, slow on the right; λ = 2π/θ_i, the wavelength in "
        "positions)"
    )
    fig.legend(
        handles=[Patch(color=f"C{a}", label=name) for a, name in enumerate(_AXIS_NAMES)],
        loc="outside lower center",
        ncol=3,
        fontsize=9,
    )
    fig.suptitle(f"M-RoPE: which position id turns each pair (r = 128, base={base:g}; text tokens: all three equal)")
    return fig


# -- 3 ---------------------------------------------------------------------------------------------------------
def invariance_heatmaps(inputs: FigureInputs) -> Figure:
    """Score of a fixed q, k over positions (m, n): constant along diagonals for RoPE, not for sinusoidal."""
    config = inputs.config
    length = 64
    # Sinusoidal vectors are (sin, cos) pairs: an odd head (RoPE turning all but one channel, as FigureConfig's error
    # for an odd head_dim advises) is compared with sinusoidal at the even width below it, which the panel names.
    width = config.head_dim - config.head_dim % 2
    sinusoidal = "sinusoidal (added to q and k" + (f", d={width})" if width != config.head_dim else ")")
    results = {
        f"RoPE ({config.rope_type})": relative_invariance(_rope(config), length),
        sinusoidal: relative_invariance(Sinusoidal(width, base=config.base), length),
    }
    fig = _new_figure(14, 4.6)
    axes = fig.subplots(1, 3)
    for ax, (name, result) in zip(axes[:2], results.items(), strict=True):
        image = ax.imshow(result.scores.numpy(), origin="upper", cmap="viridis")
        ax.set_xlabel("key position n")
        ax.set_ylabel("query position m")
        # Rounding noise differs between machines and builds in its last digits: a bound keeps the image the same.
        spread = "< 1e-14" if result.max_spread < 1e-14 else f"{result.max_spread:.2g}"
        ax.set_title(f"{name}\nmax spread along m - n: {spread}", fontsize=10)
        fig.colorbar(image, ax=ax, label="q·k / √d")
    for name, result in results.items():
        # Spread 0 cannot go on a log axis; the floor is far below float32 resolution. The two outermost diagonals
        # hold one cell each, whose spread is 0 whatever the encoding: left out, not drawn as "relative".
        inner = slice(1, -1) if result.offsets.numel() > 2 else slice(None)
        axes[2].semilogy(result.offsets[inner], result.spread[inner].clamp(min=1e-17), label=name)
    axes[2].set_xlabel("relative position m - n")
    axes[2].set_ylabel("max - min of the score along the diagonal")
    axes[2].set_title("spread per diagonal (0 = relative)", fontsize=10)
    axes[2].legend(fontsize=8)
    fig.suptitle(f"Relative invariance: one fixed q and k (norm √(d/2)) at every (m, n), d={config.head_dim}")
    return fig


# -- 4 ---------------------------------------------------------------------------------------------------------
DECAY_BINS_PER_DECADE = 10


def _log_binned_mean(x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x: (n,) increasing, >= 1; y: (n,). The mean x and mean y of the points in each bin
    10^(b/B) <= x < 10^((b+1)/B), B = DECAY_BINS_PER_DECADE, that holds any, in order."""
    # An integer distance lies at least 2.6e-4 from any edge but the powers of ten, where log10 may be a bit short.
    bins = torch.floor(torch.log10(x.double()) * DECAY_BINS_PER_DECADE + 1e-9).long()
    _, index, counts = torch.unique_consecutive(bins, return_inverse=True, return_counts=True)
    x_mean, y_mean = (
        torch.zeros(counts.shape[0], dtype=torch.float64).index_add_(0, index, v.double()) / counts for v in (x, y)
    )
    return x_mean, y_mean


def decay_curves(inputs: FigureInputs) -> Figure:
    """RoFormer's long-term decay bound for several bases (and the configured scaling type)."""
    config = inputs.config
    # Every distance up to 16k; past that a log-spaced sample, which the log axis shows just as well.
    if config.eval_len <= 1 << 14:
        distances = torch.arange(config.eval_len + 1)
    else:
        distances = torch.logspace(0, math.log10(config.eval_len), 4096).round().long().unique()
    keep = distances > 0  # distance 0 has no place on the log axis
    fig = _new_figure(9, 5)
    ax = fig.subplots()

    def draw(bound: torch.Tensor, **style: object) -> None:
        # Past ~100 positions the bound oscillates faster than the log axis can show, and the curves turn into
        # overlapping bands: a mean over log-spaced bins is drawn over the bound itself, which stays faint behind.
        x, y = distances[keep], bound[keep]
        (line,) = ax.plot(*_log_binned_mean(x, y), **style)
        ax.plot(x, y, lw=0.5, alpha=0.25, color=line.get_color(), label=f"_every distance: {line.get_label()}")

    bases = sorted({500.0, 10000.0, 500000.0, config.base})
    # The comparison curves rotate the configured channels; 'proportional' reads partial_rotary_factor as the
    # fraction of pairs that turn, over the whole head, so beside it they rotate the whole head.
    partial = {}
    if not turns_fraction_of_pairs(config.rope_type) and "partial_rotary_factor" in config.rope_parameters:
        partial = {"partial_rotary_factor": config.rope_parameters["partial_rotary_factor"]}
    for base in bases:
        result = long_term_decay(config.head_dim, rope_parameters={"rope_theta": base, **partial}, distances=distances)
        rotary = f", r={2 * result.inv_freq.shape[0]}" if 2 * result.inv_freq.shape[0] != config.head_dim else ""
        draw(result.bound, lw=1.4, label=f"default, base={base:g}{rotary}")
    if config.rope_type != "default":
        result = long_term_decay(
            config.head_dim,
            rope_parameters=config.rope_parameters,
            distances=distances,
            max_position_embeddings=config.train_len,
            seq_len=config.eval_len,  # the length the other figures scale for (distance eval_len needs eval_len + 1)
        )
        draw(result.bound, lw=1.8, color="k", label=_config_label(config))
        squared = result.attention_factor**2
        if squared != 1.0:
            # The temperature scales every score alike; what is left changes with distance: the frequencies' part.
            ax.plot(
                *_log_binned_mean(distances[keep], result.bound[keep] / squared),
                lw=1.4,
                ls="--",
                color="k",
                label=f"the same ÷ attention factor² ({squared:.4g}): its frequencies alone",
            )
    ax.axvline(config.train_len, color="0.5", ls=":", label=f"training length L={config.train_len}")
    ax.set_xscale("log")
    ax.set_xlabel("relative distance |m - n|  [positions]")
    ax.set_ylabel(r"bound: mean over $j = 1..r/2$ of $|\sum_{k<j} e^{i(m-n)\theta_k}|$  (× attention factor²)")
    ax.set_title(
        f"Long-term decay (Su et al. §3.4.3), d={config.head_dim}{_length_note(config)}\n"
        f"bold: mean over log-spaced bins ({DECAY_BINS_PER_DECADE} per decade); faint: the bound itself",
        fontsize=10,
    )
    ax.legend(fontsize=8)
    return fig


# -- 5 ---------------------------------------------------------------------------------------------------------
def wavelength_bars(inputs: FigureInputs) -> Figure:
    """Wavelength 2π/θ_i of every pair against the training length."""
    config = inputs.config
    # Length-dependent types (dynamic, longrope) drawn as they stand at the evaluation length, as in figure 6.
    result = wavelengths(
        config.head_dim, config.train_len, rope_parameters=config.rope_parameters, seq_len=config.eval_len
    )
    fig = _new_figure(10, 5)
    ax = fig.subplots()
    pairs = result.pair
    finite = torch.isfinite(result.base_wavelength)
    plain = f"default RoPE (base={config.base:g}" + (
        f", r={2 * pairs.shape[0]})" if 2 * pairs.shape[0] != config.head_dim else ")"
    )
    ax.semilogy(pairs[finite], result.base_wavelength[finite], "o-", ms=3, color="C0", label=plain)
    if result.rope_type != "default":
        shown = torch.isfinite(result.wavelength)
        ax.semilogy(pairs[shown], result.wavelength[shown], "s-", ms=3, color="C3", label=_config_label(config))
        kept = result.unchanged & shown
        ax.semilogy(pairs[kept], result.wavelength[kept], "o", mfc="none", ms=9, color="k", label="left unchanged")
    ax.axhline(config.train_len, color="k", ls="--", label=f"training length L={config.train_len}")
    ax.axhline(config.eval_len, color="0.5", ls=":", label=f"evaluation length {config.eval_len}")
    # In training the pairs turned at plain RoPE's frequencies: those count against L. A scaled model's pairs are
    # counted against the length it is extended to. A pair of frequency 0 (proportional's still pairs) has an
    # infinite wavelength: it never turns at all.
    trained = int((result.base_wavelength > config.train_len).sum())
    counts = f"{trained} of {pairs.shape[0]} turn less than once within L"
    if result.rope_type != "default":
        extended = int((result.wavelength > config.eval_len).sum())
        still = int(torch.isinf(result.wavelength).sum())
        counts += f";\nscaled, {extended} turn less than once within {config.eval_len}" + (
            f" ({still} never turn)" if still else ""
        )
    ax.set_xlabel("frequency pair i")
    ax.set_ylabel("wavelength 2π/θ_i  [positions]")
    label = _config_label(config, full=True) if result.rope_type != "default" else plain
    ax.set_title(f"Wavelengths per frequency pair: {counts}\n" + _fill(f"({label}{_length_note(config)})"))
    ax.legend(fontsize=8)
    return fig


# -- 6 ---------------------------------------------------------------------------------------------------------
def scaled_frequencies(inputs: FigureInputs) -> Figure:
    """inv_freq per pair under every registered scaling type, for one base, head dim and length."""
    config = inputs.config
    own = {k: v for k, v in config.rope_parameters.items() if k not in ("rope_type", "type", "rope_theta")}
    parameters = {config.rope_type: own} if config.rope_type != "default" else {}
    # 'proportional' reads partial_rotary_factor as its own (the fraction of pairs that turn): it stays in `own`.
    whole_head = turns_fraction_of_pairs(config.rope_type)
    channels = None if whole_head else config.rope_parameters.get("partial_rotary_factor")
    table = frequency_table(
        config.head_dim,
        base=config.base,
        partial_rotary_factor=channels,
        train_len=config.train_len,
        factor=_factor(config),
        seq_len=config.eval_len,
        parameters=parameters,
    )
    fig = _new_figure(13, 5)
    left, right = fig.subplots(1, 2)
    ratio = table.ratio_to_default()
    pairs = torch.arange(table.inv_freq.shape[1])
    # A head of one pair (d=2) gives each type one point, which a line alone does not draw: mark the points.
    marker = "o" if pairs.numel() == 1 else None
    for t, name in enumerate(table.rope_types):
        style = "-" if t < 10 else "--"
        # LongRoPE's factors are searched per model: unless configured, the figure's are an example ramp.
        example = "example factors, " if name == "longrope" and config.rope_type != "longrope" else ""
        positive = table.inv_freq[t] > 0  # zero-frequency pairs cannot go on a log axis
        # proportional's still pairs have θ = 0: without a word its line just stops (and, where it turns, lies under
        # default's).
        still = int((~positive).sum())
        zeros = f", {still} pairs at θ = 0 not drawn" if still else ""
        label = f"{name} ({example}attention factor {float(table.attention_factor[t]):.3g}{zeros})"
        left.semilogy(pairs[positive], table.inv_freq[t][positive], style, lw=1.2, marker=marker, label=label)
        right.plot(pairs, ratio[t], style, lw=1.2, marker=marker, label=name)
    left.set_xlabel("frequency pair i")
    left.set_ylabel("θ_i  [rad / position]")
    left.set_title("inverse frequencies", fontsize=10)
    left.legend(fontsize=7)
    right.set_xlabel("frequency pair i")
    right.set_ylabel("θ_i / θ_i(default)")
    right.set_title("ratio to default (1 = pair left alone)", fontsize=10)
    rotary = f", r={config.spec.rotary_dim}" if config.spec.rotary_dim != config.head_dim else ""
    fig.suptitle(
        f"RoPE scaling types: d={config.head_dim}{rotary}, base={config.base:g}, L={table.train_len}, "
        f"factor={_factor(config):g}, frequencies for a sequence of {table.seq_len}"
    )
    return fig


# -- 7 ---------------------------------------------------------------------------------------------------------
def bias_heatmaps(inputs: FigureInputs) -> Figure:
    """ALiBi's and T5's additive score bias as (query, key) matrices."""
    config = inputs.config
    length = 32
    h = config.num_heads
    slopes = ALiBi(h).slopes
    alibi = bias_matrix(ALiBi(h), length)
    # Seeded, and without touching the global generator: the same figure on every run.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        t5_bias = T5Bias(h, num_buckets=32, max_distance=128)
    t5 = bias_matrix(t5_bias, length)
    # A causal T5 bias has a value for future keys too (bucket 0's); the causal mask hides them, so does the figure.
    future = torch.ones(length, length, dtype=torch.bool).triu(1)
    t5 = t5.masked_fill(future, float("-inf"))
    # For a head count that is not a power of two the slopes are not sorted: find the extremes.
    steep, flat = int(slopes.argmax()), int(slopes.argmin())
    if h == 1:  # one head is both the steepest and the flattest: drawn once
        alibi_panels = [(alibi[0], f"ALiBi's one head (slope {float(slopes[0]):.3g})")]
    else:
        alibi_panels = [
            (alibi[steep], f"ALiBi head {steep}, the steepest (slope {float(slopes[steep]):.3g})"),
            (alibi[flat], f"ALiBi head {flat}, the flattest (slope {float(slopes[flat]):.3g})"),
        ]
    panels = [*alibi_panels, (t5[0], "T5 head 0 (random init, seed 0;\nequal values share a bucket)")]
    fig = _new_figure(14 * len(panels) / 3, 4.6)
    axes = fig.subplots(1, len(panels))
    # The two ALiBi heads share one colour scale: each on its own range, a slope 128x flatter drew the same picture.
    alibi_low = float(alibi[steep][torch.isfinite(alibi[steep])].min())
    for index, (ax, (matrix, title)) in enumerate(zip(axes, panels, strict=True)):
        shown = matrix.masked_fill(~torch.isfinite(matrix), float("nan"))
        limits = {"vmin": alibi_low, "vmax": 0.0} if index < len(alibi_panels) else {}
        image = ax.imshow(shown.numpy(), origin="upper", cmap="magma", **limits)
        ax.set_xlabel("key position n")
        ax.set_ylabel("query position m")
        ax.set_title(title, fontsize=10)
        fig.colorbar(image, ax=ax, label="bias added to the logit")
    fig.suptitle(f"Score-bias encodings, {length} x {length}, h={h} (blank: masked future, -inf)")
    return fig


# -- 8 ---------------------------------------------------------------------------------------------------------
ENTROPY_LENGTHS = (16, 32, 64, 128, 256)
ENTROPY_ENCODINGS = ("rope", "alibi", "nope", "sinusoidal")


def random_model_entropy(
    config: FigureConfig, lengths: Sequence[int] = ENTROPY_LENGTHS, encodings: Sequence[str] = ENTROPY_ENCODINGS
) -> dict[str, EntropyResult]:
    """Entropy of the lab's byte model at initialisation (2 layers, 2 heads of config.head_dim, MLP ratio 1).

    RoPE uses ``config.rope_parameters``; the others their defaults. Inputs are seeded random bytes.
    """
    from posenc.lab.model import VOCAB_SIZE, ByteLM, ModelSpec

    spec = ModelSpec(
        dim=2 * config.head_dim, layers=2, heads=2, max_positions=max(config.train_len, max(lengths)), mlp_ratio=1
    )
    tokens = torch.randint(0, VOCAB_SIZE, (1, max(lengths)), generator=torch.Generator().manual_seed(0))
    results = {}
    for name in encodings:
        options = {"rope_parameters": config.rope_parameters} if name == "rope" else {}
        with torch.random.fork_rng(devices=[]):  # seeded weights, the caller's generator state left as it was
            torch.manual_seed(0)
            model = ByteLM(spec, name, options)
        results[name] = attention_entropy(model, lengths, inputs=tokens)
    return results


_MARKERS, _DASHES = ("o", "s", "^", "D", "v"), ("-", "--", "-.", ":")


def entropy_curves(inputs: FigureInputs) -> Figure:
    """Mean attention entropy against length, per encoding (from a run, or a small random model)."""
    from matplotlib import patheffects

    config = inputs.config
    if inputs.entropy is not None:
        results, source = inputs.entropy, inputs.entropy_source or "measured"
    else:
        results = random_model_entropy(config)
        source = "computed on a small random model (untrained lab ByteLM, random bytes): no run given"
    fig = _new_figure(9, 5)
    ax = fig.subplots()
    longest = 1
    for index, (name, result) in enumerate(results.items()):
        mean = result.entropy.mean(dim=(1, 2))
        # Curves can coincide (at initialisation RoPE, NoPE and sinusoidal attend alike) and past matplotlib's 10
        # colours the cycle repeats: markers, sizes and dashes differ per curve, so each stays visible.
        marker, dashes = _MARKERS[index % len(_MARKERS)], _DASHES[index % len(_DASHES)]
        ax.plot(result.lengths, mean, marker=marker, ls=dashes, ms=9 - 1.5 * (index % 4), mfc="none", label=name)
        longest = max(longest, int(result.lengths.max()))
    shortest = min(int(r.lengths.min()) for r in results.values())
    grid = torch.arange(shortest, longest + 1, dtype=torch.float64)
    # No query of a length-L sequence can spread over more than L keys: log L bounds every definition.
    ax.plot(grid, grid.log(), color="0.5", ls="--", lw=1, label="log L: uniform over all L keys (the maximum)")
    if inputs.entropy is None:
        # What attention_entropy averages (every query row, row m over m + 1 keys) when attention is uniform.
        rows = torch.arange(1, longest + 1, dtype=torch.float64).log().cumsum(0) / torch.arange(1, longest + 1)
        # On top, in black round dots with a white edge: the curves of encodings that attend about uniformly lie
        # over it, and a grey dotted line vanished among their colours (and beside the grey log L line).
        ax.plot(
            grid,
            rows[shortest - 1 :],
            color="k",
            ls=(0, (0.1, 2.2)),
            lw=3,
            dash_capstyle="round",
            path_effects=[patheffects.Stroke(linewidth=4.5, foreground="w"), patheffects.Normal()],
            zorder=5,
            label="uniform causal attention, mean over rows",
        )
    ax.set_xscale("log", base=2)
    ax.set_xlabel("sequence length  [tokens]")
    ax.set_ylabel("mean attention entropy  [nats]")
    ax.set_title(f"Attention entropy against length\n{source}", fontsize=10)
    # Beside the axes: a lab run's dozen curves fill the plot, and a legend inside would hide some of them.
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1), borderaxespad=0)
    return fig


FIGURES: dict[str, Callable[[FigureInputs], Figure]] = {
    "phase_difference": phase_difference,
    "pair_layouts": pair_layouts,
    "mrope_layouts": mrope_layouts,
    "relative_invariance": invariance_heatmaps,
    "long_term_decay": decay_curves,
    "wavelengths": wavelength_bars,
    "scaled_frequencies": scaled_frequencies,
    "bias_matrices": bias_heatmaps,
    "attention_entropy": entropy_curves,
}


def check_names(names: Sequence[str] | None) -> list[str]:
    """The figure names to draw (all when None or empty); an unknown name is a ValueError listing the known."""
    if not names:
        return list(FIGURES)
    unknown = [n for n in names if n not in FIGURES]
    if unknown:
        raise ValueError(f"unknown figure(s) {', '.join(map(repr, unknown))}; known figures: {', '.join(FIGURES)}")
    return list(dict.fromkeys(names))


def render(name: str, inputs: FigureInputs | None = None) -> Figure:
    """Draw one figure by name."""
    (name,) = check_names([name])
    return FIGURES[name](inputs or FigureInputs())


def png_bytes(fig: Figure, *, dpi: int = 110) -> bytes:
    """The figure as PNG bytes (matplotlib's Agg canvas)."""
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=dpi)
    return buffer.getvalue()


def write_figures(
    out_dir: str | Path,
    names: Sequence[str] | None = None,
    inputs: FigureInputs | None = None,
    *,
    svg: bool = False,
    dpi: int = 110,
) -> list[Path]:
    """Write ``<name>.png`` (and ``<name>.svg`` with ``svg``) for each figure into ``out_dir``. Returns the paths.

    names: figures of ``FIGURES`` (None: all); inputs: what they are drawn for (None: ``FigureInputs()``); dpi: the
    PNGs' resolution, 10 to 1200."""
    names = check_names(names)
    dpi = integer("dpi", dpi, low=10, high=1201, expected="an integer in [10, 1200]")
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out {str(out)!r} is a file; give a directory for the figures")
    out.mkdir(parents=True, exist_ok=True)
    inputs = inputs or FigureInputs()
    written = []
    for name in names:
        fig = FIGURES[name](inputs)
        for suffix in ("png", "svg") if svg else ("png",):
            path = out / f"{name}.{suffix}"
            with _atomic.atomic_path(path) as temporary:  # an interrupted run leaves no half-written image
                fig.savefig(temporary, format=suffix, dpi=dpi)
            written.append(path)
    return written
