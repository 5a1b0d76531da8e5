"""``posenc report RUN_DIR``: one self-contained ``report.html`` for a lab run folder.

The page holds the lab's results as tables, the lab's own PNG plots and the nine analysis figures, every image
embedded as a base64 ``data:`` URI and all styling inline: it opens offline from any disk, with no server, no
network and no script. The lab calls ``write_report(run_dir)`` at the end of a run; anyone can call it again.

What a run folder holds (``posenc.lab`` writes it): ``results.csv`` in long format (at least ``encoding,
extension, train_len, eval_len, seed, bits_per_byte``; required), ``results.json`` (config, corpus, versions),
``report.md`` and PNG plots. Figure 9 (attention_entropy) draws the entropy the run measured (see
``posenc.analysis.run``) and falls back to a small random model, saying so, when the run has none.
"""

from __future__ import annotations

import base64
import datetime
import enum
import html
import json
import shlex
import statistics
from collections import defaultdict
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import posenc
from posenc import _atomic
from posenc.analysis.config import FigureConfig
from posenc.analysis.plots import FIGURES, FigureInputs, png_bytes
from posenc.analysis.run import finite_number, in_progress, read_results, run_entropy, run_figure_config

# What tells one measured model from another in results.csv (seeds are averaged over, lengths become columns).
KEY_COLUMNS = ("encoding", "extension", "finetune_steps", "train_len")


class _Probe(enum.Enum):
    """The default of ``running``: look at the folder's lock as the page is written."""

    LOCK = enum.auto()


def summary_table(rows: Sequence[Mapping[str, str]]) -> tuple[list[str], list[list[str]]]:
    """Bits per byte, mean over seeds (± sample std where there are several), one row per model (encoding,
    extension, finetune_steps where the column exists, train_len) and one column per eval_len.
    Returns (header, body) as strings: 'n/a' where results.csv has rows for that model and length but no finite
    value (e.g. learned positions past their table; the row's reason says why), '' where it has no row at all
    (e.g. the RoPE extensions, which are only evaluated past the training length), as report.md does. A value over
    fewer of the file's seeds than it holds says so ('3.1000 (1 of 2 seeds)'): a folder missing some seeds' rows
    for a model (not as the lab writes one) must not pass it off as the mean over all."""
    keys = [c for c in KEY_COLUMNS if rows and c in rows[0]]
    cells: dict[tuple[str, ...], dict[int, list[float | None]]] = defaultdict(lambda: defaultdict(list))
    lengths: set[int] = set()
    seeds = len({row.get("seed") for row in rows})
    for row in rows:
        eval_len = int(float(row["eval_len"]))
        lengths.add(eval_len)
        cells[tuple(row[c] or "none" for c in keys)][eval_len].append(finite_number(row["bits_per_byte"]))
    columns = sorted(lengths)
    header = [*keys, *(f"bpb @ {n}" for n in columns)]
    body = []
    for key, by_length in cells.items():
        line = list(key)
        for n in columns:
            values = [v for v in by_length.get(n, []) if v is not None]
            if n not in by_length:
                line.append("")
            elif not values:
                line.append("n/a")
            else:
                text = (
                    f"{values[0]:.4f}"
                    if len(values) == 1
                    else f"{statistics.mean(values):.4f} ± {statistics.stdev(values):.4f}"
                )
                line.append(text if len(values) >= seeds else f"{text} ({len(values)} of {seeds} seeds)")
        body.append(line)
    return header, body


_STYLE = """
body { font-family: system-ui, sans-serif; margin: 2rem auto; max-width: 72rem; padding: 0 1rem; color: #222; }
h1 { margin-bottom: 0.2rem; } h2 { border-bottom: 1px solid #ddd; padding-bottom: 0.2rem; margin-top: 2.2rem; }
table { border-collapse: collapse; margin: 0.8rem 0; font-size: 0.9rem; }
th, td { border: 1px solid #ccc; padding: 0.25rem 0.6rem; text-align: right; }
th { background: #f3f3f3; } td:first-child, td:nth-child(2) { text-align: left; }
figure { margin: 1.2rem 0; } figure img { max-width: 100%; border: 1px solid #eee; }
figcaption { color: #555; font-size: 0.9rem; } pre { background: #f7f7f7; padding: 0.8rem; overflow-x: auto; }
.meta { color: #666; font-size: 0.9rem; }
.note { background: #fff6d5; border: 1px solid #e0c050; padding: 0.5rem 0.8rem; }
"""


def _table(header: Sequence[str], body: Sequence[Sequence[str]]) -> str:
    head = "".join(f"<th>{html.escape(h)}</th>" for h in header)
    rows = "".join("<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in line) + "</tr>" for line in body)
    return f"<table><thead><tr>{head}</tr></thead><tbody>{rows}</tbody></table>"


def _figure(png: bytes, alt: str, caption: str) -> str:
    data = base64.b64encode(png).decode("ascii")
    return (
        f'<figure><img alt="{html.escape(alt, quote=True)}" src="data:image/png;base64,{data}">'
        f"<figcaption>{html.escape(caption)}</figcaption></figure>"
    )


def render_html(
    run_dir: str | Path,
    *,
    config: FigureConfig | None = None,
    figures: Sequence[str] | None = None,
    running: str | _Probe | None = _Probe.LOCK,
) -> str:
    """The report page as a string. run_dir: a lab run folder (results.csv required); config: what figures 1-8
    are drawn for (default: the run's own model from results.json, else ``FigureConfig()``); figures: which
    analysis figures (default all, ``[]`` for none). On a folder that another lab run is writing now, a note at the
    top names that run: the results shown may be an earlier run's. running: that note, as
    ``posenc.analysis.run.in_progress(run_dir)`` words it, or None for none; by default the folder is looked at
    as the page is written. A caller that also tells its user passes the one it showed, so the two agree."""
    run = Path(run_dir)
    if run.is_file():  # read_results would call it missing: say what it is instead
        raise ValueError(f"{str(run)!r} is a file, not a run folder; give the --out folder of a `posenc lab` run")
    rows = read_results(run)
    if running is _Probe.LOCK:
        running = in_progress(run)
    names = list(FIGURES) if figures is None else list(figures)
    unknown = [n for n in names if n not in FIGURES]
    if unknown:
        raise ValueError(f"unknown figure(s) {', '.join(map(repr, unknown))}; known figures: {', '.join(FIGURES)}")

    parts = [
        "<!DOCTYPE html>",
        '<html lang="en"><head><meta charset="utf-8">',
        f"<title>posenc report: {html.escape(run.resolve().name)}</title>",
        f"<style>{_STYLE}</style></head><body>",
        f"<h1>posenc report: {html.escape(run.resolve().name)}</h1>",
        f'<p class="meta">{html.escape(str(run.resolve()))}; written '
        f"{datetime.datetime.now(datetime.timezone.utc).strftime('%Y-%m-%d %H:%M UTC')} by posenc "
        f"{html.escape(posenc.__version__)}. Self-contained: every image is embedded.</p>",
        *([f'<p class="note">As this page was written: {html.escape(running)}.</p>'] if running else []),
        "<h2>Bits per byte by evaluation length</h2>",
        "<p>Mean over seeds (± sample standard deviation where a run has several); n/a where a model was run at "
        "that length but has no value there (its rows of results.csv, below, give the reason); blank where it was "
        "not run at that length (the RoPE extensions start past the training length); (k of N seeds) where a value "
        "stands on fewer of the file's N seeds.</p>",
        _table(*summary_table(rows)),
        f"<details><summary>All {len(rows)} rows of results.csv</summary>",
        _table(list(rows[0].keys()), [[row.get(k) or "" for k in rows[0]] for row in rows]),
        "</details>",
    ]
    meta_path = run / "results.json"
    if meta_path.is_file():
        try:
            meta = json.dumps(json.loads(meta_path.read_text()), indent=2)
        except json.JSONDecodeError as err:
            raise ValueError(f"{meta_path} is not valid JSON: {err}") from err
        parts.append(f"<details><summary>results.json</summary><pre>{html.escape(meta)}</pre></details>")
    markdown = run / "report.md"
    if markdown.is_file():
        parts.append(f"<details><summary>report.md</summary><pre>{html.escape(markdown.read_text())}</pre></details>")

    lab_images = sorted(run.glob("*.png"))
    if lab_images:
        parts.append("<h2>Plots from the lab run</h2>")
        parts.extend(_figure(p.read_bytes(), p.stem, p.name) for p in lab_images)

    if names:
        # Read only for figures: a run whose results.json the figures cannot read still gets its tables.
        config = config or run_figure_config(run) or FigureConfig()
        # Figure 9 draws the run's own entropy when it measured some, else a random model's (and says so).
        measured = run_entropy(run)
        if measured is None:
            inputs = FigureInputs(config=config)
        else:
            inputs = FigureInputs(config=config, entropy=measured[0], entropy_source=measured[1])
        parts.append("<h2>How the encodings work</h2>")
        parts.append(
            f"<p>Drawn from the posenc code itself for: {html.escape(_describe(config))}. Reproduce with "
            f"<code>{html.escape(plot_command(config, run if measured else None))}</code></p>"
        )
        for name in names:
            fig = FIGURES[name](inputs)
            doc = " ".join((FIGURES[name].__doc__ or name).strip().split("\n\n")[0].split())  # first paragraph
            if name == "attention_entropy":
                source = inputs.entropy_source or "computed on a small random model (the run measured none)"
                doc += f" Here: {source}."
            parts.append(_figure(png_bytes(fig), name, f"{name}: {doc}"))
    parts.append("</body></html>")
    return "\n".join(parts)


def plot_command(config: FigureConfig, run: Path | None = None) -> str:
    """The ``posenc plot`` command line that draws the figures for ``config`` (and ``run``'s entropy)."""
    params = dict(config.rope_parameters)
    words = ["posenc", "plot", "--out", "figures", "--head-dim", str(config.head_dim)]
    words += ["--rope-type", str(params.pop("rope_type", params.pop("type", "default")))]
    # Always: left out, --run would fill in the run's own base. repr: exact, where :g rounds to 6 digits.
    words += ["--base", repr(float(config.base))]
    params.pop("rope_theta", None)
    for key, value in params.items():
        words += ["--rope-param", shlex.quote(f"{key}={json.dumps(value, separators=(',', ':'))}")]
    words += ["--train-len", str(config.train_len), "--eval-len", str(config.eval_len)]
    words += ["--num-heads", str(config.num_heads)]
    try:
        own = run_figure_config(run) if run is not None else None
    except ValueError:  # a results.json the figures did not need (an explicit config): nothing for --run to fill in
        own = None
    if config.interleaved:
        words += ["--interleaved"]
    elif own is not None and own.interleaved:  # --run would otherwise fill in its model's adjacent pairs
        words += ["--no-interleaved"]
    if run is not None:
        words += ["--run", shlex.quote(str(run))]
    return " ".join(words)


def _describe(config: FigureConfig) -> str:
    params: dict[str, Any] = dict(config.rope_parameters)
    return (
        f"head_dim={config.head_dim}, rope_parameters={json.dumps(params)}, train_len={config.train_len}, "
        f"eval_len={config.eval_len}, num_heads={config.num_heads}"
    )


def write_report(
    run_dir: str | Path,
    *,
    out: str | Path | None = None,
    config: FigureConfig | None = None,
    figures: Sequence[str] | None = None,
    running: str | _Probe | None = _Probe.LOCK,
) -> Path:
    """Write the self-contained report page; returns its path (default ``run_dir/report.html``). config,
    figures and running: as for ``render_html``.

    The file is written to a temporary name and renamed, so an interrupted run never leaves half a page.
    """
    path = Path(out) if out is not None else Path(run_dir) / "report.html"
    if path.is_dir():
        raise ValueError(f"--out {str(path)!r} is a directory; give the path of the .html file to write")
    page = render_html(run_dir, config=config, figures=figures, running=running)
    with _atomic.atomic_path(path) as temporary:
        temporary.write_text(page, encoding="utf-8")
    return path
