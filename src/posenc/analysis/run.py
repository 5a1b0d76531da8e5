"""Reading a ``posenc lab`` run folder: its results and the attention entropy it measured.

``results.csv`` is long format with at least ``encoding, extension, train_len, eval_len, seed, bits_per_byte``.
Attention entropy is taken, in this order, from ``entropy.csv`` (``encoding, extension, length, layer, head,
entropy`` in nats, one row per measurement; ``write_entropy_csv`` writes it from ``attention_entropy`` results)
or from the ``entropy_by_layer`` column of results.csv (one list of per-layer means per row, as the lab writes).
"""

from __future__ import annotations

import csv
import datetime
import json
import math
import re
import statistics
from collections import defaultdict
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import torch

from posenc import _atomic
from posenc.analysis.config import FigureConfig
from posenc.analysis.entropy import EntropyResult
from posenc.lab.lock import holder
from posenc.rope.frequencies import turns_fraction_of_pairs
from posenc.rope.parameters import rotary_fraction

REQUIRED_COLUMNS = ("encoding", "extension", "train_len", "eval_len", "seed", "bits_per_byte")
# What tells one row of results.csv from another (architecture, finetune_steps and task where the file has them).
_ROW_KEY = ("encoding", "architecture", "extension", "finetune_steps", "train_len", "eval_len", "seed", "task")
ENTROPY_COLUMNS = ("encoding", "extension", "length", "layer", "head", "entropy")
# Extension values that mean "the model as trained".
_NO_EXTENSION = frozenset({"", "none", "-", "default"})


def finite_number(text: str | None) -> float | None:
    """A finite float, or None for 'n/a', empty, 'None' or non-finite cells (e.g. learned past its table)."""
    try:
        value = float(text)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return None
    return value if math.isfinite(value) else None


def run_label(row: Mapping[str, str]) -> str:
    """'rope', 'rope+yarn', 'rope+pi+ft50': one curve per trained or extended model, named as the lab names it."""
    extension = (row.get("extension") or "").strip()
    label = row["encoding"] if extension.lower() in _NO_EXTENSION else f"{row['encoding']}+{extension}"
    steps = finite_number(row.get("finetune_steps"))
    return f"{label}+ft{steps:g}" if steps else label


def read_results(run_dir: str | Path) -> list[dict[str, str]]:
    """Rows of ``run_dir/results.csv`` as dicts of strings. Raises ValueError if the folder has no results."""
    run = Path(run_dir)
    if not run.is_dir():
        raise ValueError(f"run folder {str(run)!r} does not exist; give the --out folder of a `posenc lab` run")
    path = run / "results.csv"
    if not path.is_file():
        running = in_progress(run)
        if running is not None:  # not "stopped": a rerun now would be refused, the folder being in use
            raise ValueError(f"run folder {str(run)!r} has no results yet: {running}")
        if (run / "config.json").is_file():  # a run that stopped before its first report: its units are kept
            raise ValueError(
                f"run folder {str(run)!r} holds a lab run that stopped before writing results.csv; rerun the same "
                "`posenc lab` command: it skips the units already finished and writes the report"
            )
        raise ValueError(
            f"run folder {str(run)!r} has no results.csv (no finished measurements); give the folder a "
            "`posenc lab --out DIR` run wrote"
        )
    with path.open(newline="") as handle:
        reader = csv.DictReader(handle)
        missing = [c for c in REQUIRED_COLUMNS if c not in (reader.fieldnames or [])]
        if missing:
            raise ValueError(
                f"{path} lacks the column(s) {', '.join(missing)}; a lab results.csv has at least "
                f"{', '.join(REQUIRED_COLUMNS)}"
            )
        rows = []
        seen: dict[tuple[str | None, ...], int] = {}
        for row in reader:
            # A row of fewer cells than the header (a copy cut short mid-row: "3.7945" of 3.79453...) or of more
            # would be read as values it does not hold; the lab writes every row whole.
            if None in row or None in row.values():
                raise ValueError(
                    f"{path}, line {reader.line_num}, has {_cells(row)} cells where the header names "
                    f"{len(reader.fieldnames or [])}: it was cut short or changed since `posenc lab` wrote it; rerun "
                    "that command (it skips the finished units and writes results.csv again)"
                )
            for column in ("train_len", "eval_len", "seed"):
                # float's own "could not convert string to float: 'xx'" named no file, line or column.
                number = finite_number(row[column])
                if number is None or not number.is_integer():
                    raise ValueError(
                        f"{path}, line {reader.line_num}: {column} is {row[column]!r}, not a whole number; it was "
                        "changed since `posenc lab` wrote it"
                    )
            # One row per measurement: a second one was counted as another seed of the same model.
            key = tuple(row.get(column) for column in _ROW_KEY)
            if key in seen:
                raise ValueError(
                    f"{path}, lines {seen[key]} and {reader.line_num}, measure the same model at the same length and "
                    "seed: the lab writes one row each; it was changed since `posenc lab` wrote it"
                )
            seen[key] = reader.line_num
            rows.append(row)
    if not rows:
        raise ValueError(f"{path} has a header but no rows; the run finished no measurement yet")
    return rows


def _cells(row: dict[Any, Any]) -> int:
    """How many cells a csv.DictReader row had: its named values, less those it lacked (None), plus any extra."""
    extra = row.get(None) or []
    return sum(1 for key, value in row.items() if key is not None and value is not None) + len(extra)


def in_progress(run_dir: str | Path) -> str | None:
    """None, or what a reader of ``run_dir`` must be told: a lab run is writing it now, so the results read there may
    be an earlier run's (or there are none yet) until that run finishes and rewrites them."""
    run = Path(run_dir)
    running = holder(run)
    if running is None:
        return None
    try:
        written = datetime.datetime.fromtimestamp((run / "results.csv").stat().st_mtime, datetime.timezone.utc)
    except OSError:
        return f"{running} is writing {run} now; it writes results.csv and report.html when it finishes"
    # Not "an earlier run's": the run writes results.csv a few seconds before it finishes and lets the folder go.
    return (
        f"{running} is writing {run} now: its results.csv was last written at {written:%Y-%m-%d %H:%M:%S} UTC, and "
        "the run rewrites it and report.html when it finishes"
    )


def write_entropy_csv(path: str | Path, results: Mapping[tuple[str, str], EntropyResult]) -> Path:
    """Write measured entropy for figure 8: ``results`` maps (encoding, extension) to a result of
    ``attention_entropy``. One row per (encoding, extension, length, layer, head), entropy in nats."""
    path = Path(path)
    with _atomic.atomic_path(path) as temporary, temporary.open("w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(ENTROPY_COLUMNS)
        for (encoding, extension), result in results.items():
            for i, length in enumerate(result.lengths.tolist()):
                for layer, heads in enumerate(result.entropy[i].tolist()):
                    for head, value in enumerate(heads):
                        writer.writerow([encoding, extension, length, layer, head, repr(value)])
    return path


def _grid(measured: Mapping[tuple[int, int, int], list[float]], where: str) -> EntropyResult:
    """(length, layer, head) -> samples, averaged, as an EntropyResult; every combination must be present."""
    lengths = sorted({k[0] for k in measured})
    layers = 1 + max(k[1] for k in measured)
    heads = 1 + max(k[2] for k in measured)
    grid = torch.full((len(lengths), layers, heads), float("nan"), dtype=torch.float64)
    for (length, layer, head), samples in measured.items():
        grid[lengths.index(length), layer, head] = statistics.mean(samples)
    if bool(grid.isnan().any()):
        raise ValueError(f"{where} lacks some (length, layer, head) rows; every combination is needed")
    return EntropyResult(lengths=torch.tensor(lengths), entropy=grid, source="model")


def read_entropy_csv(path: str | Path) -> dict[str, EntropyResult]:
    """Read ``entropy.csv`` into one ``EntropyResult`` per run label (repeated rows, e.g. seeds, are averaged)."""
    path = Path(path)
    with path.open(newline="") as handle:
        reader = csv.DictReader(handle)
        missing = [c for c in ENTROPY_COLUMNS if c not in (reader.fieldnames or [])]
        if missing:
            raise ValueError(f"{path} lacks the column(s) {', '.join(missing)}; it needs {', '.join(ENTROPY_COLUMNS)}")
        values: dict[str, dict[tuple[int, int, int], list[float]]] = defaultdict(lambda: defaultdict(list))
        for row in reader:
            value = finite_number(row["entropy"])
            if value is None:
                raise ValueError(f"{path}: entropy {row['entropy']!r} is not a finite number")
            key = tuple(_index(path, row, column, low) for column, low in (("length", 1), ("layer", 0), ("head", 0)))
            values[run_label(row)][key].append(value)
    if not values:
        raise ValueError(f"{path} has a header but no rows")
    return {label: _grid(measured, f"{path}: {label}") for label, measured in values.items()}


def _index(path: Path, row: Mapping[str, str], column: str, low: int) -> int:
    """An integer cell of entropy.csv, >= low. A layer of -1 wrote over the last layer's value (Python's negative
    index) and a length of 'abc' was int()'s message, naming neither the file nor the column."""
    cell = row[column]
    try:
        value = int(cell)
    except (TypeError, ValueError):
        value = None
    if value is None or value < low:
        raise ValueError(f"{path}: {column} {cell!r} is not an integer >= {low}")
    return value


def _layer_list(cell: str, where: str) -> list[float] | None:
    """A per-layer list written as JSON ('[2.1, 2.3]') or separated by ';', ',' or spaces; None if empty."""
    text = cell.strip()
    if text.lower() in ("", "none", "null", "nan", "n/a"):
        return None
    try:
        parsed = json.loads(text)
    except json.JSONDecodeError:
        parsed = [p for p in re.split(r"[;,\s]+", text.strip("[]()")) if p]
    values = parsed if isinstance(parsed, list) else [parsed]
    numbers = [finite_number(str(v)) for v in values]
    if not numbers or any(n is None for n in numbers):
        raise ValueError(f"{where}: entropy_by_layer {cell!r} is not a list of finite numbers")
    return numbers  # type: ignore[return-value]


def entropy_from_results(rows: Iterable[Mapping[str, str]], where: str = "results.csv") -> dict[str, EntropyResult]:
    """Entropy per run label from results rows with an ``entropy_by_layer`` column: lengths are the eval lengths,
    one value per layer (the lab averages over heads, so h = 1); seeds are averaged. Rows without it are skipped."""
    values: dict[str, dict[tuple[int, int, int], list[float]]] = defaultdict(lambda: defaultdict(list))
    for row in rows:
        layers = _layer_list(row.get("entropy_by_layer") or "", where)
        if layers is None:
            continue
        for layer, value in enumerate(layers):
            values[run_label(row)][(int(float(row["eval_len"])), layer, 0)].append(value)
    return {label: _grid(measured, f"{where}: {label}") for label, measured in values.items()}


def run_figure_config(run_dir: str | Path) -> FigureConfig | None:
    """The figure config of the run's own model, from results.json: the RoPE its rope model trained with
    (``rope``: head_dim, rotary_dim, interleaved, rope_parameters; an --hf-config model's theta, rotary fraction
    and layout), and the lengths and heads of its ``config`` (train_len, eval_lengths, heads). Runs written
    before ``rope`` was recorded, and runs without rope: head_dim = dim / heads (rounded up to even), plain RoPE
    with base 10000, as the lab's own model trains. None if absent."""
    path = Path(run_dir) / "results.json"
    if not path.is_file():
        return None
    try:
        results = json.loads(path.read_text())
        config = results.get("config")
    except (json.JSONDecodeError, AttributeError) as err:
        raise ValueError(f"{path} is not a JSON object: {err}") from err
    if not isinstance(config, Mapping) or not {"dim", "heads", "train_len", "eval_lengths"} <= config.keys():
        return None
    sizes = dict(train_len=config["train_len"], eval_len=max(config["eval_lengths"]), num_heads=config["heads"])
    rope = results.get("rope")
    if not isinstance(rope, Mapping):
        head_dim = config["dim"] // config["heads"]
        # A run without rope may have heads of an odd size; RoPE's figures need pairs.
        return FigureConfig(head_dim=head_dim + head_dim % 2, **sizes)
    missing = [key for key in ("head_dim", "rotary_dim", "interleaved", "rope_parameters") if key not in rope]
    if missing or not isinstance(rope["rope_parameters"], Mapping):
        # A bare KeyError traceback (posenc plot --run, posenc report) before.
        what = f"lacks {', '.join(missing)}" if missing else "has rope_parameters that are not a JSON object"
        raise ValueError(f"{path}'s rope {what}: it is not the results.json the lab writes; run the lab again")
    parameters = dict(rope["rope_parameters"])
    if rope["rotary_dim"] != rope["head_dim"] and not turns_fraction_of_pairs(parameters.get("rope_type")):
        parameters["partial_rotary_factor"] = rotary_fraction(rope["rotary_dim"], rope["head_dim"])
    # The scaling's original length is the figures' training length; the run's own trained length says it here.
    parameters.pop("original_max_position_embeddings", None)
    return FigureConfig(
        head_dim=rope["head_dim"], rope_parameters=parameters, interleaved=bool(rope["interleaved"]), **sizes
    )


def run_entropy(run_dir: str | Path) -> tuple[dict[str, EntropyResult], str] | None:
    """The attention entropy a run folder holds and where it came from, or None if it measured none. A folder with
    no results at all is a ValueError (as ``read_results``)."""
    run = Path(run_dir)
    if (run / "entropy.csv").is_file():
        return read_entropy_csv(run / "entropy.csv"), f"measured in {run.name}/entropy.csv"
    rows = read_results(run)
    if "entropy_by_layer" in rows[0]:
        measured = entropy_from_results(rows, str(run / "results.csv"))
        if measured:
            return measured, f"measured in {run.name}/results.csv (entropy_by_layer: mean over heads)"
    return None
