"""What a lab run writes: results.csv (long format), results.json, report.md and PNG plots.

Everything here reads the ``results`` dict that ``Lab.run`` builds (the content of results.json), so a report can
be rebuilt from results.json alone. Plots use matplotlib's object API with the Agg canvas: no pyplot, no global
backend switch, no display needed.
"""

from __future__ import annotations

import csv
import io
import json
import statistics
from collections import defaultdict
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from posenc.lab import store
from posenc.lab.evaluate import TASK_CHANCE

CSV_COLUMNS = (
    "encoding",
    "architecture",
    "extension",
    "finetune_steps",
    "train_len",
    "eval_len",
    "factor",
    "seed",
    "bits_per_byte",
    "applicable",
    "reason",
    "entropy",
    "entropy_by_layer",
    "task",
    "task_accuracy",
    "task_byte_accuracy",
    "scored_bytes",
)
PLOTS = {
    "bpb_by_length.png": "Bits per byte against context length, one line per encoding",
    "rope_extensions.png": "The trained RoPE model with each training-free extension (and fine-tunes)",
    "entropy_by_length.png": "Mean attention entropy of the scored queries against length",
    "loss_by_position.png": "Loss by position within the longest windows",
}


def plots_of(rows: list[dict[str, Any]]) -> dict[str, str]:
    """The PLOTS a run has: without a rope model there is nothing for rope_extensions.png to draw."""
    has_rope = any(row["encoding"] == "rope" for row in rows)
    return {name: title for name, title in PLOTS.items() if has_rope or name != "rope_extensions.png"}


def write_all(out: Path, results: dict[str, Any]) -> None:
    """results.csv, results.json, report.md and every plot of ``plots_of``, each written atomically."""
    store.write_text(out / "results.csv", to_csv(results["rows"]))
    store.write_json(out / "results.json", results)
    plot_all(out, results)
    store.write_text(out / "report.md", to_markdown(results))


def to_csv(rows: Iterable[dict[str, Any]]) -> str:
    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, fieldnames=CSV_COLUMNS, extrasaction="ignore", lineterminator="\n")
    writer.writeheader()
    for row in rows:
        writer.writerow({k: _csv_value(row.get(k)) for k in CSV_COLUMNS})
    return buffer.getvalue()


def _csv_value(value: Any) -> Any:
    # Lists (entropy by layer) as JSON, so one cell holds them and any CSV reader gets them back.
    if value is None:
        return ""
    return json.dumps(value) if isinstance(value, list) else value


# --- aggregation over seeds ---


def label(row: dict[str, Any]) -> str:
    """ "rope", "rope+yarn", "rope+pi+ft50": how a row's model is named in tables and legends."""
    name = row["encoding"] if row["extension"] == "none" else f"{row['encoding']}+{row['extension']}"
    return f"{name}+ft{row['finetune_steps']}" if row["finetune_steps"] else name


def aggregate(rows: Iterable[dict[str, Any]], value: str) -> dict[tuple[str, int], dict[str, Any]]:
    """(label, eval_len) -> {"mean", "spread" (sample std over seeds, None for one seed), "n", "of", "reason"}.

    n: the seeds with a value; of: the seeds where the model applies (n < of where some have no value, as units
    evaluated before task_byte_accuracy was measured). A model not applicable at a length has mean None and its
    reason."""
    groups: dict[tuple[str, int], list[dict[str, Any]]] = defaultdict(list)
    for row in rows:
        groups[(label(row), row["eval_len"])].append(row)
    table = {}
    for key, members in groups.items():
        values = [m[value] for m in members if m["applicable"] and m[value] is not None]
        table[key] = {
            "mean": statistics.fmean(values) if values else None,
            "spread": statistics.stdev(values) if len(values) > 1 else None,
            "n": len(values),
            "of": sum(1 for m in members if m["applicable"]),
            "reason": next((m["reason"] for m in members if not m["applicable"]), ""),
        }
    return table


def _cell(entry: dict[str, Any] | None, digits: int = 3) -> str:
    if entry is None:
        return ""
    if entry["mean"] is None:
        # Applicable but never measured (units evaluated before the value existed) is not "not applicable".
        return "not measured" if entry.get("of") else "n/a"
    text = f"{entry['mean']:.{digits}f}"
    text = text if entry["spread"] is None else f"{text} ± {entry['spread']:.{digits}f}"
    # A mean over fewer seeds than the run's, under the same label, must say so: it is another quantity.
    return f"{text} ({entry['n']} of {entry['of']} seeds)" if entry["n"] < entry.get("of", entry["n"]) else text


def _table(rows: list[dict[str, Any]], value: str, lengths: list[int], labels: list[str], digits: int = 3) -> str:
    table = aggregate(rows, value)
    header = "| model | " + " | ".join(str(n) for n in lengths) + " |"
    lines = [header, "|---" * (len(lengths) + 1) + "|"]
    for name in labels:
        lines.append(f"| {name} | " + " | ".join(_cell(table.get((name, n)), digits) for n in lengths) + " |")
    return "\n".join(lines)


def _labels(rows: list[dict[str, Any]], *, extensions: bool) -> list[str]:
    seen: dict[str, None] = {}
    for row in rows:
        # The fine-tunes' control (plain rope, tuned) goes with the extensions it is the control of.
        if (row["extension"] != "none" or bool(row["finetune_steps"])) == extensions:
            seen[label(row)] = None
    return list(seen)


def _lengths(rows: list[dict[str, Any]]) -> list[int]:
    return sorted({row["eval_len"] for row in rows})


def summary_tables(results: dict[str, Any]) -> str:
    """The tables printed at the end of a run: bits per byte by encoding, and by RoPE extension."""
    rows, train_len = results["rows"], results["config"]["train_len"]
    lengths = _lengths(rows)
    seeds = results["seeds"]
    spread = " (mean ± sample std over seeds)" if len(seeds) > 1 else ""
    parts = [
        f"Bits per byte, trained at {train_len}, by eval length{spread}:",
        _table(rows, "bits_per_byte", lengths, _labels(rows, extensions=False)),
    ]
    ext_labels = _labels(rows, extensions=True)
    if ext_labels:
        ext_lengths = [n for n in lengths if n > train_len]
        parts += [
            "",
            "RoPE extensions of the trained rope model, bits per byte:",
            _table(rows, "bits_per_byte", ext_lengths, ["rope", *ext_labels]),
        ]
    return "\n".join(parts)


def _count(n: int, noun: str, plural: str | None = None) -> str:
    """'1 layer', '2 layers': the quick preset's one layer read '1 layers'. ``plural``: where it is not noun + s."""
    return f"{n} {noun}" if n == 1 else f"{n} {plural or noun + 's'}"


def _imports_lines(results: dict[str, Any]) -> list[str]:
    """The --import modules the run needs, as a line of report.md; none for a run without (or made before them)."""
    imports = results.get("imports") or []
    if not imports:
        return []
    names = ", ".join(f"`{name}`" for name in imports)
    return [f"Imported for their registrations: {names} (a resume passes each to `--import` again)", ""]


def to_markdown(results: dict[str, Any]) -> str:
    """report.md: the run's provenance, every table, the not-applicable reasons and the plots."""
    rows, config = results["rows"], results["config"]
    train_len, lengths = config["train_len"], _lengths(rows)
    enc_labels, ext_labels = _labels(rows, extensions=False), _labels(rows, extensions=True)
    corpus, timings = results["corpus"], results["timings"]
    lines = [
        "# posenc lab report",
        "",
        f"Command: `{results['command'] or 'posenc.lab.runner.Lab(...).run()'}`",
        "",
        *_imports_lines(results),
        f"- corpus: {corpus['source']} ({_count(corpus['files'], 'file')}, {corpus['bytes']:,} bytes, sha256 "
        f"`{corpus['sha256'][:16]}…`; last {config['val_fraction']:.0%} held out)",
        f"- model: {_count(config['layers'], 'layer')}, width {config['dim']}, {_count(config['heads'], 'head')}, "
        f"trained at {train_len} bytes for {_count(config['steps'], 'step')} of "
        f"{_count(config['batch_size'], 'window')}",
        f"- evaluation: {_count(config['eval_windows'], 'window')} per length, the same final "
        f"{_count(config['score_len'], 'byte')} of each scored at every length (sliding window)",
        f"- seeds: {', '.join(str(s) for s in results['seeds'])}; wall time of this invocation "
        f"{timings['wall_seconds']:.1f} s ({_count(timings['units_run'], 'unit')} run, {timings['units_skipped']} "
        f"skipped as done); torch {results['versions']['torch']}, {_count(results['machine']['cpu_count'], 'CPU')}, "
        f"{_count(results['machine']['torch_threads'], 'torch thread')}, "
        f"{_count(results['machine']['processes'], 'process', 'processes')}",
        "",
        "## Bits per byte by context length",
        "",
        _table(rows, "bits_per_byte", lengths, enc_labels),
        "",
    ]
    if ext_labels:
        ext_lengths = [n for n in lengths if n > train_len]
        lines += [
            "## RoPE extensions (no training unless +ft)",
            "",
            _table(rows, "bits_per_byte", ext_lengths, ["rope", *ext_labels]),
            "",
        ]
    lines += [
        "## Attention entropy (nats, mean over layers and heads, scored queries)",
        "",
        _table(rows, "entropy", lengths, [*enc_labels, *ext_labels]),
        "",
    ]
    if config["task"]:
        lines += [
            f"## {config['task']} task: exact-match accuracy",
            "",
            _table(rows, "task_accuracy", lengths, [*enc_labels, *ext_labels], digits=2),
            "",
            f"## {config['task']} task: per-byte accuracy (chance: {TASK_CHANCE[config['task']]})",
            "",
            _table(rows, "task_byte_accuracy", lengths, [*enc_labels, *ext_labels], digits=3),
            "",
        ]
    reasons = sorted({(label(r), r["eval_len"], r["reason"]) for r in rows if not r["applicable"]})
    if reasons:
        lines += ["## Not applicable", ""]
        lines += [f"- {name} at {n}: {reason}" for name, n, reason in reasons]
        lines.append("")
    lines += ["## Plots", ""]
    lines += [f"![{title}]({name})" for name, title in plots_of(rows).items()]
    return "\n".join(lines) + "\n"


# --- plots ---


def _figure(columns: int = 1):  # matplotlib is imported only when a report is drawn
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure(figsize=(5.5 * columns, 4.0), layout="constrained")
    FigureCanvasAgg(figure)
    return figure, figure.subplots(1, columns, squeeze=False)[0]


def _save(figure: Any, path: Path) -> None:
    buffer = io.BytesIO()
    # No "Software" stamp: the same numbers make the same bytes across matplotlib patch releases.
    figure.savefig(buffer, format="png", dpi=110, metadata={"Software": None})
    store.write_bytes(path, buffer.getvalue())


def _lines(axis: Any, rows: list[dict[str, Any]], value: str, labels: list[str], train_len: int, ylabel: str) -> None:
    table = aggregate(rows, value)
    for name in labels:
        points = sorted((n, e) for (lab, n), e in table.items() if lab == name and e["mean"] is not None)
        if not points:
            continue
        xs = [n for n, _ in points]
        ys = [e["mean"] for _, e in points]
        errs = [e["spread"] or 0.0 for _, e in points]
        axis.errorbar(xs, ys, yerr=errs if any(errs) else None, marker="o", label=name, capsize=3)
    axis.axvline(train_len, color="grey", linestyle=":", linewidth=1)
    axis.set_xscale("log", base=2)
    axis.set_xlabel("context length (bytes)")
    axis.set_ylabel(ylabel)
    axis.grid(alpha=0.3)
    if axis.get_legend_handles_labels()[0]:
        axis.legend(fontsize=8)


def plot_all(out: Path, results: dict[str, Any]) -> None:
    """Write every figure of ``figures`` as its PNG, atomically, in PLOTS order."""
    drawn = figures(results)
    for name in PLOTS:
        if name in drawn:
            _save(drawn[name], out / name)
        else:
            # A narrower rerun in a folder that had rope would otherwise keep showing its old plot.
            (out / name).unlink(missing_ok=True)


def figures(results: dict[str, Any]) -> dict[str, Any]:
    """The figures of ``plots_of(results["rows"])`` by file name, drawn but not saved (so tests can read their data).

    - bpb_by_length.png: per encoding (extension "none", not fine-tuned), bits_per_byte against eval_len, mean over
      seeds.
    - rope_extensions.png (only with rope rows): the same for "rope" and each rope extension and fine-tune (with
      the fine-tunes' control, "rope+ft<steps>").
    - entropy_by_length.png: entropy the same way; encodings on the left, rope extensions on the right (if any).
    - loss_by_position.png: per model not fine-tuned, loss_by_position at the longest eval_len, mean over seeds,
      against the bin centres (i + 0.5) * position_bin.
    Error bars are the sample std over seeds; models not applicable at a length have no point there.
    """
    rows, train_len = results["rows"], results["config"]["train_len"]
    enc_labels, ext_labels = _labels(rows, extensions=False), _labels(rows, extensions=True)
    drawn = {}

    figure, (axis,) = _figure()
    _lines(axis, rows, "bits_per_byte", enc_labels, train_len, "bits per byte")
    axis.set_title(f"trained at {train_len} (dotted)")
    drawn["bpb_by_length.png"] = figure

    rope_rows = [r for r in rows if r["encoding"] == "rope"]
    if rope_rows:
        figure, (axis,) = _figure()
        _lines(axis, rope_rows, "bits_per_byte", ["rope", *ext_labels], train_len, "bits per byte")
        axis.set_title("RoPE extensions of the trained rope model")
        drawn["rope_extensions.png"] = figure

    figure, axes = _figure(2 if rope_rows else 1)
    _lines(axes[0], rows, "entropy", enc_labels, train_len, "attention entropy (nats)")
    axes[0].set_title("encodings")
    if rope_rows:
        _lines(axes[1], rope_rows, "entropy", ["rope", *ext_labels], train_len, "attention entropy (nats)")
        axes[1].set_title("RoPE extensions")
    drawn["entropy_by_length.png"] = figure

    drawn["loss_by_position.png"] = _loss_by_position(rows, train_len)
    return drawn


def _loss_by_position(rows: list[dict[str, Any]], train_len: int) -> Any:
    figure, (axis,) = _figure()
    longest = max(r["eval_len"] for r in rows)
    curves: dict[str, list[list[float]]] = defaultdict(list)
    bins: dict[str, float] = {}  # positions per bin (length / bins)
    for row in rows:
        if row["eval_len"] == longest and row["applicable"] and not row["finetune_steps"]:
            curves[label(row)].append(row["loss_by_position"])
            bins[label(row)] = row["position_bin"]
    for name, members in curves.items():
        mean = [statistics.fmean(values) for values in zip(*members, strict=True)]
        centers = [(i + 0.5) * bins[name] for i in range(len(mean))]
        axis.plot(centers, mean, label=name, linewidth=1.2, linestyle="-" if "+" not in name else "--")
    axis.axvline(train_len, color="grey", linestyle=":", linewidth=1)
    axis.set_xlabel(f"position in a window of {longest} bytes")
    axis.set_ylabel("bits per byte")
    axis.set_title("loss by position (past the dotted line: beyond training)")
    axis.grid(alpha=0.3)
    if curves:
        axis.legend(fontsize=7, ncol=2)
    return figure
