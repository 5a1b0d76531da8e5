"""``posenc lab``: plan the units of a run, run the ones not done yet, and write the report.

A unit is one thing that finishes and is saved on its own: training and evaluating one encoding with one seed,
evaluating one training-free RoPE extension of the trained rope model, or fine-tuning one extension at one target
length. Each unit lives in ``OUT/runs/<name>/seed<seed>/``; its ``metrics.json`` is written last, atomically, so its
presence means the unit is done. Weights are saved (atomically) before evaluation starts, so an interrupted
evaluation resumes without retraining, and a unit in training saves a checkpoint about every minute, from which an
interrupted training resumes with the numbers of an uninterrupted one. Everything is checked before the first unit
starts.

Under torchrun (``Ranks`` of several processes) every rank runs every unit in lockstep: training splits each
global batch across ranks, evaluation splits the lengths, and rank 0 alone writes files and prints. Rank 0 also
decides which units are done and broadcasts it, so the ranks never disagree about what to run.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import hashlib
import json
import math
import os
import platform
import signal
import sys
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from safetensors import SafetensorError
from tqdm.auto import tqdm

from posenc._checks import integer
from posenc.lab import store
from posenc.lab.checkpoint import checkpoint_saver, load_checkpoint, settings_trained_with
from posenc.lab.config import FINETUNABLE, LabConfig, extension_rope_parameters, make_config
from posenc.lab.data import Corpus, eval_text_needed, eval_window_ends, load_corpus, windows_ending
from posenc.lab.dist import Ranks, process_group, rank_label
from posenc.lab.evaluate import LengthResult, evaluate_length, task_accuracy, task_samples
from posenc.lab.lock import FolderLock
from posenc.lab.model import ByteLM, encoding_for
from posenc.lab.train import TrainingDiverged, TrainResult, train

# Part of every config_id: raised when the same settings would give other numbers, so that a folder of an earlier
# posenc is refused rather than resumed into one report with units of the new kind. 2 (2026-12-04): T5's buckets
# sized to the training length, encodings' tables drawn apart from the shared weights, the fine-tunes' control.
FORMAT_VERSION = 2

# A unit in training saves its state about this often (wall time), so that an interrupt loses at most this much of it.
CHECKPOINT_SECONDS = 60.0


@dataclasses.dataclass(frozen=True)
class Unit:
    """encoding: the trained family; extension: "none" or a RoPE extension of the trained rope model;
    finetune_steps / target_len: for a fine-tune of the trained rope model, its steps and the one length it is
    tuned for; with extension "none" it is the fine-tunes' control, plain RoPE tuned the same way."""

    encoding: str
    seed: int
    extension: str = "none"
    finetune_steps: int = 0
    target_len: int | None = None

    @property
    def name(self) -> str:
        name = self.encoding if self.extension == "none" else f"{self.encoding}+{self.extension}"
        return f"{name}+ft{self.finetune_steps}-len{self.target_len}" if self.finetune_steps else name

    @property
    def reads_trained_rope(self) -> bool:
        """An extension or fine-tune of the seed's trained rope model (which loads its weights)."""
        return self.encoding == "rope" and (self.extension != "none" or self.finetune_steps > 0)

    def folder(self, out: Path) -> Path:
        return out / "runs" / self.name / f"seed{self.seed}"


def plan(config: LabConfig) -> list[Unit]:
    """Every unit of a run, in the order they run: per seed, the encodings, then the extensions, then fine-tunes:
    of each fine-tunable extension and, as their control, of plain RoPE ("none") with the same steps and data."""
    units = []
    # Extensions act past the training length only: with no eval length there, they have nothing to measure.
    extensions = config.extensions if config.extension_lengths else ()
    for seed in config.seeds:
        units += [Unit(encoding, seed) for encoding in config.encodings]
        units += [Unit("rope", seed, extension) for extension in extensions]
        tuned = [extension for extension in extensions if extension in FINETUNABLE]
        if config.finetune_steps and tuned:
            # Without the control, a fine-tune's gain could not be told from what tuning at the length does alone.
            units += [
                Unit("rope", seed, extension, config.finetune_steps, length)
                for extension in ("none", *tuned)
                for length in config.extension_lengths
            ]
    return units


def check_corpus(corpus: Corpus, config: LabConfig) -> None:
    """Raise a ValueError, before anything trains, if the corpus cannot feed this configuration."""
    longest, windows, score_len = max(config.eval_lengths), config.eval_windows, config.score_len
    # Window ends at least score_len apart, so that no byte is scored twice: overlapping scored bytes made
    # bits_per_byte a weighted mean over fewer distinct bytes than scored_bytes counted. eval_window_ends spreads
    # the ends that far apart whenever the text holds this much.
    val_needed = eval_text_needed(longest=longest, count=windows, score_len=score_len)
    # A preset that reads only the start of a corpus (quick: 1 MiB) is not helped by a larger one.
    capped = config.max_corpus_bytes is not None and corpus.size >= config.max_corpus_bytes
    more_text = (
        f"the preset reads at most {config.max_corpus_bytes} bytes of any corpus (max_corpus_bytes): use another preset"
        if capped
        else "use a larger corpus"
    )
    val = corpus.val.numel()
    if val < val_needed:
        fit = (val - longest - 1) // score_len + 1  # windows whose scored bytes fit apart; < 1: not one window
        fixes = f"at most {fit} --eval-windows, a shorter --score-len or " if fit > 0 else ""
        raise ValueError(
            f"corpus {corpus.source!r} holds too little text: {corpus.size} bytes, whose validation part "
            f"({config.val_fraction:.0%}) has {val} bytes, but {windows} eval windows at length {longest}, each "
            f"scoring its final {score_len} bytes (--score-len) and no byte twice, need {val_needed}; {more_text}, "
            f"{fixes}shorter --eval-lengths"
        )
    train_needed = (longest if config.finetune_steps and config.extensions else config.train_len) + 1
    if corpus.train.numel() < train_needed:
        raise ValueError(
            f"corpus {corpus.source!r} holds too little text: its training part has {corpus.train.numel()} bytes, "
            f"fewer than one window of {train_needed}; {more_text}"
        )


def check_world_size(config: LabConfig, world_size: int) -> None:
    """Raise a ValueError, before anything trains, if a global batch cannot be split evenly across the ranks."""
    if world_size == 1:
        return
    Ranks(0, world_size).batch_slice(config.batch_size, what="batch_size")
    if config.finetune_steps and any(e in FINETUNABLE for e in config.extensions):
        for length in config.extension_lengths:
            finetune_batch = finetune_batch_size(config, length)
            if finetune_batch % world_size:
                raise ValueError(
                    f"the fine-tune at length {length} uses a global batch of {finetune_batch} windows (max(1, "
                    f"batch_size * train_len // {length})), which {world_size} processes cannot split evenly; use "
                    "fewer processes, a larger --batch-size, or --finetune-steps 0"
                )


def finetune_batch_size(config: LabConfig, seq_len: int) -> int:
    """Windows per fine-tuning step at ``seq_len``: pretraining's bytes per step rounded down to whole windows, at
    least one (so a step may hold fewer bytes than pretraining's, or more where seq_len exceeds them all)."""
    return max(1, config.batch_size * config.train_len // seq_len)


def assign_lengths(lengths: list[int], world_size: int) -> list[list[int]]:
    """Eval lengths per rank, each rank's in the given order: longest first to the least loaded rank (the cost of
    a length is taken as its tokens, the same windows at every length). One rank gets them all."""
    load, assigned = [0] * world_size, [[] for _ in range(world_size)]
    for length in sorted(lengths, reverse=True):
        rank = load.index(min(load))
        load[rank] += length
        assigned[rank].append(length)
    return [[n for n in lengths if n in mine] for mine in assigned]


def config_id(config: LabConfig, corpus_sha256: str) -> str:
    """A short hash of everything that changes a unit's numbers."""
    key = {"config": config.results_key(), "corpus": corpus_sha256, "format": FORMAT_VERSION}
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]


def _settings(results_key: dict[str, Any]) -> dict[str, Any]:
    """A results key as stored in JSON (tuples compare equal to the lists they were stored as), without the corpus
    path that keys of format 1 hold: their corpus is judged by its bytes, and the refusal names the format."""
    key = json.loads(json.dumps(results_key))
    if key.get("corpus") is not None:
        del key["corpus"]
    return key


def claim_folder(out: Path, config: LabConfig, corpus: Corpus, ident: str, imports: Sequence[str] = ()) -> None:
    """Refuse a folder that holds results of another configuration or corpus (they would mix in one report).
    imports: the --import modules of the run, recorded in config.json (where there are any) for a resume to name."""
    path = out / "config.json"
    if path.exists():
        previous = store.read_json(path)
        if previous.get("config_id") == ident:
            return
        # A folder of nothing but config.json and .lock (a run stopped before its first checkpoint: a wrong flag,
        # Ctrl-C at once) holds nothing to mix with: it is claimed below as a new one.
        if not _holds_nothing_but_its_claim(out):
            old, new = _settings(previous.get("results_key", {})), _settings(config.results_key())
            changed = sorted(k for k in set(old) | set(new) if old.get(k) != new.get(k))
            if previous.get("corpus_sha256") != corpus.sha256:
                changed.append("corpus (different bytes)")
            # Nothing named: the same settings and text under another id, which only an earlier results format gives
            # (its models or measurements differ: format 2 changed the lab's T5 buckets and initial weights).
            raise ValueError(
                f"{out} holds a lab run with a different configuration (differs in: "
                f"{', '.join(changed) or 'format: made by an earlier posenc, whose models or measurements differ'}); "
                "pass another --out, or delete that folder to start over"
            )
    # No config.json, but finished units (it was deleted): they must be this configuration's too, or the folder
    # would be claimed for settings its units do not have.
    others = sorted(
        str(metrics.parent.relative_to(out))
        for metrics in out.glob("runs/*/seed*/metrics.json")
        if store.read_json(metrics).get("config_id") != ident
    )
    if others:
        raise ValueError(
            f"{out} has no config.json but holds finished units of another configuration ({', '.join(others[:3])}"
            f"{', ...' if len(others) > 3 else ''}); pass another --out, or delete that folder to start over"
        )
    claim = {"config_id": ident, "results_key": config.results_key(), "corpus_sha256": corpus.sha256}
    if imports:  # absent without: the folders of runs without --import stay as they were
        claim["imports"] = list(imports)
    store.write_json(path, claim)


def recorded_imports(out: Path) -> list[str]:
    """The --import modules the run in ``out`` was made with (its config.json), [] if none or unreadable."""
    try:
        imports = store.read_json(out / "config.json").get("imports", [])
    except (OSError, ValueError, AttributeError):
        return []
    return [name for name in imports if isinstance(name, str)] if isinstance(imports, list) else []


def _holds_nothing_but_its_claim(out: Path) -> bool:
    """True if ``out`` holds no file but its config.json and .lock (folders may be there, empty)."""
    return all(p.is_dir() or p in (out / "config.json", out / ".lock") for p in out.rglob("*"))


class Lab:
    """One run of the lab: ``Lab(config, out).run()``.

    progress: tqdm bars with tokens/s; device: where models run ("cpu", "cuda"); echo: where status lines go;
    command: the command line, recorded in results.json and report.md (and the folder's lock).
    imports: the modules imported for their registrations (``posenc lab --import``), recorded in config.json and
    results.json: the run's encodings or extensions may exist only once they are imported.
    ranks: this process among several (torchrun); None = the default process group if one is initialised, else
    one process. Only rank 0 shows progress, echoes and writes; every rank's ``run`` returns the same results.
    figures: draw the analysis figures (how the encodings work, for the run's RoPE) into report.html; False leaves
    them out (``posenc lab --no-figures``), the results, tables and the lab's plots being the same either way.
    """

    def __init__(
        self,
        config: LabConfig,
        out: str | Path,
        *,
        progress: bool = True,
        device: str = "cpu",
        command: str = "",
        echo: Callable[[str], None] = print,
        ranks: Ranks | None = None,
        imports: Sequence[str] = (),
        figures: bool = True,
    ) -> None:
        self.config = config
        self.out = Path(out)
        self.ranks = ranks or Ranks.current()
        self.progress = progress and self.ranks.is_main
        self.device = torch.device(device)
        self.command = command
        self.imports = list(imports)
        self.figures = figures
        self.echo = echo if self.ranks.is_main else _silent
        self.spec = config.model_spec()
        self.prepared = False
        self._planned: list[Unit] = []  # this run's units, once run() plans them
        self._lock: FolderLock | None = None  # rank 0's, from prepare() to the end of run()

    def release(self) -> None:
        """Give up the folder's lock, which prepare() takes and run() gives up when it ends: for a Lab prepared and
        then not run, so that another run may use its folder before this object is collected."""
        if self._lock is not None:
            self._lock.release()
            self._lock = None
        self.prepared = False  # a second run() takes the lock again, and sees the folder as it is then

    def prepare(self) -> None:
        """Read and check the corpus, the task and the output folder. Raises before any training starts."""
        config, ranks = self.config, self.ranks
        self.release()  # a second prepare() takes the lock again rather than meet its own
        start = time.perf_counter()
        check_world_size(config, ranks.world_size)
        _check_report_rope_types()
        self.corpus = load_corpus(config.corpus, val_fraction=config.val_fraction, max_bytes=config.max_corpus_bytes)
        check_corpus(self.corpus, config)
        self.ends = eval_window_ends(self.corpus.val, longest=max(config.eval_lengths), count=config.eval_windows)
        if config.task is not None:  # fails now if the task does not fit the shortest window
            shortest = min(config.eval_lengths)  # tasks run at the eval lengths only
            task_samples(config.task, windows_ending(self.corpus.val, self.ends[:1], shortest), seed=0)
        if config.hf_config is not None:
            self._check_hf_model()
        self.config_id = config_id(config, self.corpus.sha256)
        if ranks.world_size > 1:
            self._check_ranks_agree()

        def claim() -> None:
            if self.out.exists() and not self.out.is_dir():
                raise ValueError(f"--out {self.out} exists and is not a folder")
            if config.corpus is not None and Path(config.corpus).expanduser().resolve() == self.out.resolve():
                # A run folder inside the corpus is skipped when the corpus is read; the corpus itself cannot be.
                raise ValueError(
                    f"--out {self.out} is the --corpus folder itself: the lab's files would become part of the corpus "
                    "and change it; pass another --out (a folder inside the corpus is fine, it is not read as text)"
                )
            try:
                self.out.mkdir(parents=True, exist_ok=True)
                # Before the folder is read: a run that claims it writes its config.json.
                self._lock = FolderLock(self.out, self.command)
                claim_folder(self.out, config, self.corpus, self.config_id, self.imports)
            except OSError as error:  # a parent that is a file, a read-only or missing mount
                why = error.strerror or error
                # Which file, where it is one inside the folder (its .lock, of another user or a folder itself).
                inside = error.filename is not None and Path(error.filename).parent == self.out
                raise ValueError(
                    f"--out {self.out} cannot be made the run folder: {error.filename + ': ' if inside else ''}{why}"
                ) from error
            store.remove_stale_temporaries(self.out)

        try:
            ranks.decide(claim)
            if ranks.world_size > 1:
                self._check_out_shared()
        except BaseException:
            self.release()
            raise
        self.prepared = True
        self.prepare_seconds = time.perf_counter() - start

    def _check_hf_model(self) -> None:
        """Build the Hugging Face model once, plain and with each extension, and posenc's RoPE for its config, before
        anything is written: the file's values (a rope_theta of "abc", an unknown activation, a rotary fraction of
        0, which would train a "rope" model that rotates nothing) show here, not at the first unit or after
        training."""
        from posenc.interop import rope_from_config
        from posenc.lab.hf_model import HFByteLM

        path = self.config.hf_config
        longest = max(self.config.eval_lengths)
        names = list(self.config.extensions) if longest > self.config.train_len else []
        refused: dict[str, Exception] = {}
        with torch.random.fork_rng(devices=[]):  # the units' weights must not depend on this check
            try:
                rope_from_config(HFByteLM(self.spec, path).hf.config)
            except Exception as error:
                raise ValueError(
                    f"hf_config (--hf-config) {path!r}: the model cannot be built from it: {type(error).__name__}: "
                    f"{error}"
                ) from error
            for name in names:
                try:
                    HFByteLM(self.spec, path, self._rope_parameters(name, longest))
                except Exception as error:
                    refused[name] = error
        if refused:
            # An architecture whose config class takes only some rope types (Phi-3: 'default' and 'longrope'):
            # say which extensions it can hold, so that the rerun is one flag away.
            held = [name for name in names if name not in refused]
            first, error = next(iter(refused.items()))
            raise ValueError(
                f"hf_config (--hf-config) {path!r}: this {self.config.architecture} model cannot take the extension(s) "
                f"{', '.join(refused)} ({first}: {error}); pass --extensions "
                f"{','.join(held) if held else 'none'} (the ones it takes)"
            ) from error

    def _check_ranks_agree(self) -> None:
        # Every rank reads the corpus itself; on several machines they could read different files. And every rank
        # imports the --import modules itself: one that registered other encodings or rope types (another file
        # there, or none) would train other models under the same names, which rank 0's results would not show.
        seen = self.ranks.all_gather((self.corpus.sha256, _registrations(), self.imports))
        if len({sha for sha, _, _ in seen}) > 1:
            raise ValueError(
                "the ranks read different corpora (sha256 by rank: "
                + ", ".join(f"{r}: {h[:12]}" for r, (h, _, _) in enumerate(seen))
                + "); pass --corpus with a path that holds the same text on every machine"
            )
        first = seen[0][1]
        odd = [rank for rank, (_, registered, _) in enumerate(seen) if registered != first]
        if odd:
            differ = sorted({(kind, name) for kind, name, _ in set(first) ^ set(seen[odd[0]][1])})
            imports = ", ".join(f"{rank}: {' '.join(names) or 'none'}" for rank, (_, _, names) in enumerate(seen))
            raise ValueError(
                f"rank(s) {', '.join(map(str, odd))} registered other encodings or rope types than rank 0 (rank "
                f"{odd[0]} and rank 0 differ in {', '.join(f'{kind} {name!r}' for kind, name in differ)}; --import by "
                f"rank: {imports}): every rank must import the same modules, with the same content"
            )

    def _check_out_shared(self) -> None:
        # The other ranks load the weights rank 0 saves, so they must see its folder.
        self.ranks.barrier()
        path = self.out / "config.json"
        sees = path.exists() and store.read_json(path).get("config_id") == self.config_id
        blind = [r for r, ok in enumerate(self.ranks.all_gather(sees)) if not ok]
        if blind:
            raise ValueError(
                f"rank(s) {', '.join(map(str, blind))} cannot see {path}, which rank 0 wrote: every process must see "
                "the same --out folder (one machine, or a shared filesystem)"
            )

    def run(self) -> dict[str, Any]:
        """Run every unit not done yet and write results.csv, results.json, report.md, the plots and report.html.

        Returns the results.json content."""
        start_wall, start_cpu = time.perf_counter(), time.process_time()
        ran_prepare = not self.prepared
        if ran_prepare:
            self.prepare()
        try:
            return self._run(start_wall, start_cpu, ran_prepare)
        finally:
            self.release()

    def _run(self, start_wall: float, start_cpu: float, ran_prepare: bool) -> dict[str, Any]:
        from posenc.lab import report

        units = plan(self.config)
        self._planned = units
        if self.config.extensions and not self.config.extension_lengths:
            self.echo(
                f"note: no eval length is past train_len={self.config.train_len}, so the RoPE extensions "
                f"({', '.join(self.config.extensions)}) have nothing to measure and are not run"
            )
        tunable = [e for e in self.config.extensions if e in FINETUNABLE]
        if self.config.finetune_steps and self.config.extension_lengths and not tunable:
            self.echo(
                f"note: --finetune-steps fine-tunes only {' and '.join(FINETUNABLE)}, so "
                + (
                    f"{', '.join(self.config.extensions)} run without a fine-tune"
                    if self.config.extensions
                    else "with no extension asked for (--extensions none) nothing is fine-tuned"
                )
            )
        if self.ranks.is_main:
            # A narrower rerun into a folder (fewer encodings, another seed) rewrites the report for its own
            # selection; the other finished units stay on disk, and saying so keeps that from looking like a loss.
            planned = {unit.folder(self.out) for unit in units}
            others = [m.parent for m in (self.out / "runs").glob("*/seed*/metrics.json") if m.parent not in planned]
            if others:
                self.echo(
                    f"note: {len(others)} finished unit(s) in {self.out} are outside this selection and left out of "
                    "its report; the command that selects them reports them again"
                )
        metrics, ran = [], 0
        for index, unit in enumerate(units, 1):
            unit_metrics = self.ranks.decide(lambda unit=unit: self._finished(unit))
            if unit_metrics is not None:
                self.echo(f"[{index}/{len(units)}] {unit.name} seed {unit.seed}: done earlier, skipped")
            else:
                self.echo(f"[{index}/{len(units)}] {unit.name} seed {unit.seed}")
                unit_metrics = self._run_unit(unit)
                ran += 1
            metrics.append(unit_metrics)
        timings = {
            # Reading the corpus counts even when prepare() ran before run().
            "wall_seconds": time.perf_counter() - start_wall + (0.0 if ran_prepare else self.prepare_seconds),
            "cpu_seconds": time.process_time() - start_cpu,
            "units_run": ran,
            "units_skipped": len(units) - ran,
        }
        results = self._results(metrics, timings)
        if self.ranks.is_main:
            from posenc.analysis import write_report

            report.write_all(self.out, results)
            # The self-contained page: the tables and plots above plus the figures of this run's RoPE config (most of
            # the page's drawing time at the quick sizes; `posenc report` draws them later for a run without them).
            html = write_report(self.out, figures=None if self.figures else [])
        self.echo(report.summary_tables(results))
        if self.ranks.is_main:
            self.echo(f"report: {html}")
        # So that run() returning means the report exists, on every rank.
        self.ranks.barrier()
        return results

    def _finished(self, unit: Unit) -> dict[str, Any] | None:
        """The metrics of ``unit`` if an earlier invocation finished it, else None."""
        done = unit.folder(self.out) / "metrics.json"
        if not done.exists():
            return None
        unit_metrics = store.read_json(done)
        if unit_metrics.get("config_id") != self.config_id:
            raise store.RunFolderError(f"{done} belongs to another configuration; delete it or use another --out")
        # The unit it describes: the rows are built from it, so another unit's file (copied by hand) put its
        # rows where this unit's belong, under its own name. And its results, which met a bare KeyError.
        if unit_metrics.get("unit") != dataclasses.asdict(unit):
            held = unit_metrics.get("unit")
            other = (
                f"{held.get('encoding')} {held.get('extension')} seed {held.get('seed')}"
                if isinstance(held, dict)
                else "another unit"
            )
            raise store.RunFolderError(
                f"{done} holds the metrics of {other} ({unit_metrics.get('name')!r}), not of {unit.name!r} seed "
                f"{unit.seed}, whose folder it is in; delete it and the unit is evaluated again"
            )
        evals = unit_metrics.get("eval")
        rows_whole = isinstance(evals, list) and all(isinstance(r, dict) and r.keys() >= _EVAL_KEYS for r in evals)
        if not rows_whole:
            raise store.RunFolderError(
                f"{done} has no list of whole results by length under \"eval\", which the lab writes; it was cut "
                "short or changed since: delete it and the unit is evaluated again"
            )
        weights = done.parent / "model.safetensors"
        if unit.encoding == "rope" and not unit.reads_trained_rope and not weights.exists():
            # Unfinished extensions of this seed rebuild this model from its weights: it is trained again for them
            # (same numbers).
            waiting = [
                other.name
                for other in self._planned
                if other.reads_trained_rope
                and other.seed == unit.seed
                and not (other.folder(self.out) / "metrics.json").exists()
            ]
            if waiting:
                self.echo(f"  {weights} is missing and {', '.join(waiting)} read it: {unit.name} is trained again")
                return None
        return unit_metrics

    # --- units ---

    def _run_unit(self, unit: Unit) -> dict[str, Any]:
        folder = unit.folder(self.out)
        if unit.finetune_steps:
            n = unit.target_len
            assert n is not None
            lengths = [n]
            # The control ("none") is tuned with the RoPE it trained with, which metrics.json records as null.
            rope_parameters = {n: None if unit.extension == "none" else self._rope_parameters(unit.extension, n)}
            model, train_info = self._trained(unit, lambda: self._extended(unit.seed, rope_parameters[n]), seq_len=n)
            models = {n: model}
        elif unit.extension == "none":
            model, train_info = self._trained(unit, lambda: self._build(unit.encoding), seq_len=self.config.train_len)
            lengths = list(self.config.eval_lengths)
            models = {n: model for n in lengths}
            rope_parameters = {}
        else:
            train_info = None
            lengths = list(self.config.extension_lengths)
            rope_parameters = {n: self._rope_parameters(unit.extension, n) for n in lengths}
            models = {n: self._extended(unit.seed, rope_parameters[n]) for n in lengths}
        results = self._evaluate(unit, models, lengths)
        unit_metrics = {
            "config_id": self.config_id,
            "unit": dataclasses.asdict(unit),
            "name": unit.name,
            "train": train_info,
            "rope_parameters": {str(n): p for n, p in rope_parameters.items()},
            "eval": [dataclasses.asdict(r) for r in results],
            # The thread count, the device and the number of processes change float sums in the last bits, and a
            # folder may be resumed with others of each: a resumed run says which units ran with which.
            **self._run_settings(),
        }
        if self.ranks.is_main:
            store.write_json(folder / "metrics.json", unit_metrics)
        return unit_metrics

    def _trained_rope(self) -> dict[str, Any]:
        """The RoPE the rope model trains with, as results.json records it for the report's figures: head_dim,
        rotary_dim, interleaved and rope_parameters (type, theta and the type's own). An --hf-config model's comes
        from its config (its rope_theta, rotary fraction, layout), the lab's own model's from its encoding."""
        if self.config.hf_config is None:
            rope = encoding_for(self.spec, "rope")
        else:
            from posenc.interop import rope_from_config

            with torch.random.fork_rng(devices=[]):  # weights drawn here must not move the global generator
                rope = rope_from_config(self._build("rope").hf.config)
        return {
            "head_dim": rope.head_dim,
            "rotary_dim": rope.rotary_dim,
            "interleaved": rope.interleaved,
            "rope_parameters": {"rope_type": rope.rope_type, "rope_theta": rope.base, **rope.spec.params},
        }

    def _rope_parameters(self, extension: str, length: int) -> dict[str, Any]:
        return extension_rope_parameters(
            extension, length / self.config.train_len, self.config.train_len, rotary_dim=self.spec.head_dim
        )

    def _extended(self, seed: int, rope_parameters: dict[str, Any] | None) -> ByteLM:
        """The trained rope model of ``seed`` with its RoPE rebuilt from ``rope_parameters`` (same weights; None:
        as it trained)."""
        model = self._build("rope", rope_parameters)
        store.load_weights(model, Unit("rope", seed).folder(self.out) / "model.safetensors")
        return model.to(self.device)

    def _build(self, encoding: str, rope_parameters: dict[str, Any] | None = None) -> ByteLM:
        """A fresh model of ``encoding``: the config's Hugging Face architecture (rope only) or a ``ByteLM``."""
        if self.config.hf_config is not None:
            from posenc.lab.hf_model import HFByteLM

            return HFByteLM(self.spec, self.config.hf_config, rope_parameters)  # type: ignore[return-value]
        options = None if rope_parameters is None else {"rope_parameters": rope_parameters}
        return ByteLM(self.spec, encoding, options)

    def _trained(self, unit: Unit, build: Callable[[], ByteLM], *, seq_len: int) -> tuple[ByteLM, dict[str, Any]]:
        """Train the model that ``build`` makes for ``unit`` and save it, or load it if an earlier invocation saved
        it. A fresh model's initial weights depend on the unit's seed alone, whatever ran before in this process."""
        torch.manual_seed(unit.seed)
        model = build()
        folder = unit.folder(self.out)
        weights, info_path = folder / "model.safetensors", folder / "train.json"
        # Training's state while the unit trains: deleted once the weights and train.json are saved.
        checkpoint = folder / "checkpoint.safetensors"

        def saved_info() -> dict[str, Any] | None:
            if weights.exists() and info_path.exists():
                info = store.read_json(info_path)
                if info.get("config_id") == self.config_id:
                    return info
            return None

        info = self.ranks.decide(saved_info)
        if info is not None:
            store.load_weights(model, weights)
            self.echo(f"  weights saved earlier, loaded from {weights}")
            if self.ranks.is_main:  # killed between train.json and the checkpoint's deletion
                checkpoint.unlink(missing_ok=True)
            return model.to(self.device), info
        config = self.config
        if unit.finetune_steps:
            steps, lr, seed = unit.finetune_steps, config.resolved_finetune_lr, unit.seed
            # Pretraining's bytes per step in whole windows; the rate stays constant after warmup, as in PI and YaRN.
            batch_size, min_lr_fraction = finetune_batch_size(config, seq_len), 1.0
        else:
            steps, lr, seed = config.steps, config.lr, unit.seed
            batch_size, min_lr_fraction = config.batch_size, config.min_lr_fraction
        options = {
            "seq_len": seq_len,
            "batch_size": batch_size,
            "steps": steps,
            "lr": lr,
            "seed": seed,
            "warmup_fraction": config.warmup_fraction,
            "min_lr_fraction": min_lr_fraction,
            "weight_decay": config.weight_decay,
            "grad_clip": config.grad_clip,
        }
        # What a checkpoint must have been saved under to be resumed: everything that sets the unit's numbers.
        identity = {"config_id": self.config_id, "unit": unit.name, **options}
        # Read by rank 0 and sent to the others, so that every rank resumes the same state, or none.
        resume = self.ranks.decide(lambda: load_checkpoint(checkpoint, identity, model, echo=self.echo))
        # The thread count, the device and the process count change float sums in their last bits, and metrics.json
        # records this run's: a unit resumed under others ran with several, which its train.json names (trained_with).
        here = self._run_settings()
        trained_with = settings_trained_with(resume, here, steps=steps, path=checkpoint, echo=self.echo)
        save = checkpoint_saver(checkpoint, identity, trained_with, is_main=self.ranks.is_main, echo=self.echo)

        model = model.to(self.device)
        result: TrainResult = train(
            model,
            self.corpus.train,
            **options,
            desc=f"train {unit.name} seed {unit.seed}",
            progress=self.progress,
            ranks=self.ranks,
            resume=resume,
            save=save,
            save_every=CHECKPOINT_SECONDS,
        )
        info = {
            "config_id": self.config_id,
            "steps": result.steps,
            "batch_size": batch_size,
            "seq_len": seq_len,
            "lr": lr,
            "tokens": result.tokens,
            "seconds": round(result.seconds, 3),
            "tokens_per_second": round(result.tokens_per_second, 1),
            "final_loss_bits_per_byte": result.final_loss / math.log(2),
            "loss_curve": result.loss_curve,
            "losses": result.losses,
        }
        if len(trained_with) > 1:  # absent when one setting trained it all, as in a run never interrupted
            info["trained_with"] = trained_with
        if self.ranks.is_main:
            # Weights first, then train.json: train.json present means the weights beside it are complete.
            store.save_weights(model, weights, metadata={"unit": unit.name})
            store.write_json(info_path, info)
            checkpoint.unlink(missing_ok=True)
        # The other ranks may load these weights next (an extension of the rope model): not before they exist.
        self.ranks.barrier()
        self.echo(
            f"  trained {result.tokens:,} tokens in {result.seconds:.1f} s ({result.tokens_per_second:,.0f} tokens/s), "
            f"final loss {info['final_loss_bits_per_byte']:.3f} bits/byte"
        )
        return model, info

    def _run_settings(self) -> dict[str, Any]:
        """What this process runs with that changes float sums in their last bits: the thread count, the device and
        the number of processes."""
        threads, processes = torch.get_num_threads(), self.ranks.world_size
        return {"torch_threads": threads, "device": str(self.device), "processes": processes}

    def _evaluate(self, unit: Unit, models: dict[int, ByteLM], lengths: list[int]) -> list[LengthResult]:
        config = self.config
        # Each length is evaluated whole by one rank, exactly as one process would, so splitting changes no number.
        mine = assign_lengths(lengths, self.ranks.world_size)[self.ranks.rank]
        total = sum(config.eval_windows * n for n in mine)
        local: dict[int, LengthResult] = {}
        with tqdm(
            total=total,
            unit="tok",
            unit_scale=True,
            desc=f"eval {unit.name} seed {unit.seed}",
            disable=not self.progress,
            leave=False,
        ) as bar:
            for n in mine:
                result = evaluate_length(
                    models[n],
                    self.corpus.val,
                    self.ends,
                    n,
                    score_len=config.score_len,
                    batch_size=config.eval_batch_size,
                    bar=bar,
                )
                if config.task is not None and result.applicable:
                    filler = windows_ending(self.corpus.val, self.ends[: config.task_samples], n)
                    samples = task_samples(config.task, filler, seed=unit.seed)
                    score = task_accuracy(models[n], samples, batch_size=config.eval_batch_size)
                    result = dataclasses.replace(result, task_accuracy=score.exact, task_byte_accuracy=score.per_byte)
                local[n] = result
        gathered = {n: r for part in self.ranks.all_gather(local) for n, r in part.items()}
        results = [gathered[n] for n in lengths]
        shown = ", ".join(
            f"{r.eval_len}: {r.bits_per_byte:.3f}" if r.applicable else f"{r.eval_len}: n/a" for r in results
        )
        self.echo(f"  bits/byte by length: {shown}")
        return results

    # --- results ---

    def _results(self, metrics: list[dict[str, Any]], timings: dict[str, Any]) -> dict[str, Any]:
        config = self.config
        architecture = config.architecture
        rows = []
        for unit_metrics in metrics:
            unit = unit_metrics["unit"]
            for r in unit_metrics["eval"]:
                entropy = r["entropy_by_layer"]
                rows.append(
                    {
                        "encoding": unit["encoding"],
                        "architecture": architecture,
                        "extension": unit["extension"],
                        "finetune_steps": unit["finetune_steps"],
                        "train_len": config.train_len,
                        "eval_len": r["eval_len"],
                        "factor": r["eval_len"] / config.train_len,
                        "seed": unit["seed"],
                        "bits_per_byte": r["bits_per_byte"],
                        "applicable": r["applicable"],
                        "reason": r["reason"],
                        "entropy": sum(entropy) / len(entropy) if entropy else None,
                        "entropy_by_layer": entropy,
                        "task": config.task or "",
                        "task_accuracy": r["task_accuracy"],
                        # Absent from units evaluated before it was measured (2026-12-04): blank, not 0.
                        "task_byte_accuracy": r.get("task_byte_accuracy"),
                        "scored_bytes": r["scored_bytes"],
                        "loss_by_position": r["loss_by_position"],
                        "position_bin": r["position_bin"],
                    }
                )
        units = {
            f"{m['name']}/seed{m['unit']['seed']}": {
                "train": None
                if m["train"] is None
                else {k: v for k, v in m["train"].items() if k not in ("loss_curve", "losses")},
                "eval_seconds": round(sum(r["seconds"] for r in m["eval"]), 3),
                "rope_parameters": m["rope_parameters"],
                # None: finished before it was recorded
                "torch_threads": m.get("torch_threads"),
                "device": m.get("device"),
                "processes": m.get("processes"),
            }
            for m in metrics
        }
        return {
            "command": self.command,
            "imports": self.imports,
            "config": dataclasses.asdict(config),
            "config_id": self.config_id,
            "architecture": architecture,
            "rope": self._trained_rope() if "rope" in config.encodings else None,
            "corpus": {
                "source": self.corpus.source,
                "sha256": self.corpus.sha256,
                "files": self.corpus.files,
                "bytes": self.corpus.size,
                "train_bytes": self.corpus.train.numel(),
                "val_bytes": self.corpus.val.numel(),
            },
            "seeds": list(config.seeds),
            "versions": _versions(),
            "machine": {
                "platform": platform.platform(),
                "processor": platform.processor() or platform.machine(),
                "cpu_count": _cpu_count(),
                **self._run_settings(),
                "backend": dist.get_backend() if self.ranks.world_size > 1 else None,
            },
            "timings": {**timings, "units": units},
            "rows": rows,
        }


def _silent(line: str) -> None:
    """The echo of ranks other than 0."""


def _cpu_count() -> int | None:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count()


def _versions() -> dict[str, str]:
    import matplotlib
    import numpy
    import safetensors

    import posenc

    return {
        "posenc": posenc.__version__,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "numpy": numpy.__version__,
        "safetensors": safetensors.__version__,
        "matplotlib": matplotlib.__version__,
        "executable": sys.executable,
    }


def _registrations() -> tuple[tuple[str, str, str], ...]:
    """What this process has registered, sorted: ("encoding" or "rope_type", name, the class's or function's
    qualified name). Not its module's name, which for an --import of a file is made from its path, and the
    path may differ from machine to machine."""
    from posenc.registry import ENCODINGS
    from posenc.rope.frequencies import SCALINGS

    def qualname(registered: object) -> str:
        return str(getattr(registered, "__qualname__", type(registered).__qualname__))

    encodings = [("encoding", name, qualname(family)) for name, family in ENCODINGS.items()]
    return tuple(sorted(encodings + [("rope_type", name, qualname(fn)) for name, fn in SCALINGS.items()]))


def _check_report_rope_types() -> None:
    # The run's report.html draws every rope_type in SCALINGS (its scaled_frequencies figure) with its example
    # parameters: a type added to SCALINGS without them failed there, with a traceback after every unit had trained.
    from posenc.analysis.frequencies import EXAMPLE_ROPE_PARAMETERS
    from posenc.rope.frequencies import SCALINGS
    from posenc.rope.scaling import WITHOUT_EXAMPLE

    # One registered without them (register_scaling(example=None)) is left out of the figure, as intended there.
    missing = [name for name in SCALINGS if name not in EXAMPLE_ROPE_PARAMETERS and name not in WITHOUT_EXAMPLE]
    if missing:
        raise ValueError(
            f"rope_type(s) {', '.join(missing)} are registered in SCALINGS without example parameters, which the run's "
            "report.html draws every type with: add a line for each to "
            "posenc.analysis.frequencies.EXAMPLE_ROPE_PARAMETERS"
        )


def run_command(
    *,
    preset: str,
    out: str | Path | None,
    overrides: dict[str, Any],
    threads: int | None = None,
    device: str = "cpu",
    progress: bool = True,
    command: str = "",
    imports: Sequence[str] = (),
    figures: bool = True,
) -> int:
    """What ``posenc lab`` does once its flags are parsed. Returns the exit status: 0 done, 1 training diverged or the
    run folder could not be written (a full disk; finished units are kept), 2 bad input (said on stderr before anything
    trains) or a damaged file met in the run folder (a RunFolderError, said when it is met), 130 interrupted (finished
    units are kept; rerun to resume).

    Started by torchrun (WORLD_SIZE > 1), the process joins torchrun's group for the run and leaves it at the end;
    only rank 0 prints. Without torchrun nothing distributed is touched."""
    # Under lab-runs/, which the repository's .gitignore already leaves out.
    out = out or Path("lab-runs") / preset
    # torchrun sets RANK for every process; read here so that an error joining the group is said once too.
    speaks = os.environ.get("RANK", "0") == "0"
    with contextlib.ExitStack() as group:
        # SIGTERM (kill, Slurm's scancel, docker stop) ends the run as Ctrl-C does: temporaries removed, a message.
        # One process only: a rank waiting in a collective would run no Python handler until the collective timed
        # out, where SIGTERM's default ends it at once (torchrun sends it to every worker when one fails).
        alone = os.environ.get("WORLD_SIZE", "1") in ("", "1")
        main_thread = threading.current_thread() is threading.main_thread()
        _interrupted.clear()
        # SIGINT as Python's own handler takes it, remembered (where that handler is the one in place: one the
        # parent set to ignored, a job started in the background, stays so): raised inside safetensors' read, the
        # interrupt came out as torch's "ValueError: could not determine the shape of object type
        # 'torch.storage.UntypedStorage'" (a third of tries), a traceback or another error's advice where Ctrl-C's
        # message belongs (_interrupt_first).
        if main_thread and signal.getsignal(signal.SIGINT) is signal.default_int_handler:
            group.callback(signal.signal, signal.SIGINT, signal.signal(signal.SIGINT, _interrupt))
        if alone and main_thread:
            group.callback(signal.signal, signal.SIGTERM, signal.signal(signal.SIGTERM, _interrupt))
        try:
            return _run_lab(group, preset, out, overrides, threads, device, progress, command, speaks, imports, figures)
        except Exception:
            if not _interrupted.is_set():
                raise
            return _said_interrupted(out, speaks)
        except KeyboardInterrupt:
            return _said_interrupted(out, speaks)


# What _results reads of each length's results in a unit's metrics.json (a bare KeyError from there before).
_EVAL_KEYS = frozenset(
    {
        "applicable",
        "bits_per_byte",
        "entropy_by_layer",
        "eval_len",
        "loss_by_position",
        "position_bin",
        "reason",
        "scored_bytes",
        "seconds",
        "task_accuracy",
    }
)

# Set by _interrupt, the lab's SIGINT and SIGTERM handler, for the errors an interrupt may come out as.
_interrupted = threading.Event()


def _interrupt(signum: int, frame: Any) -> None:
    _interrupted.set()
    raise KeyboardInterrupt


def _interrupt_first(error: BaseException) -> None:
    """Raise KeyboardInterrupt where ``error`` came after the run was interrupted: a read cut by Ctrl-C is not a
    damaged file to delete, nor a full disk."""
    if _interrupted.is_set():
        raise KeyboardInterrupt from error


def _said_interrupted(out: Path, speaks: bool) -> int:
    if speaks:
        print(
            f"\nposenc lab: interrupted; every finished run is saved in {out}. "
            "Run the same command again to continue where it stopped.",
            file=sys.stderr,
        )
    return 130


def _run_lab(
    group: contextlib.ExitStack,
    preset: str,
    out: str | Path,
    overrides: dict[str, Any],
    threads: int | None,
    device: str,
    progress: bool,
    command: str,
    speaks: bool,
    imports: Sequence[str],
    figures: bool,
) -> int:
    try:
        ranks, resolved = group.enter_context(process_group(device))
    except (ValueError, TypeError) as error:
        _interrupt_first(error)
        # Said by every rank that meets it: before the group exists a rank's own device (its GPU) may be the one
        # that fails, and rank 0, waiting for the group, would say nothing before torchrun ends it.
        print(f"posenc lab: error{rank_label()}: {error}", file=sys.stderr)
        return 2
    try:
        config = make_config(preset, **overrides)
        if threads is not None:
            # 100,000 threads crashed the process (SIGSEGV) when torch could not start them.
            high = f"a positive integer up to {_MAX_THREADS} (this machine has {os.cpu_count()} cores)"
            torch.set_num_threads(integer("--threads", threads, low=1, high=_MAX_THREADS + 1, expected=high))
        lab = Lab(
            config,
            out,
            progress=progress,
            device=str(resolved),
            command=command,
            ranks=ranks,
            imports=imports,
            figures=figures,
        )
        lab.prepare()
    except (ValueError, TypeError) as error:
        _interrupt_first(error)
        if speaks:
            print(f"posenc lab: error: {error}{_missing_imports(Path(out), imports)}", file=sys.stderr)
        return 2
    except (MemoryError, RuntimeError) as error:
        _interrupt_first(error)
        if not _out_of_memory(error):
            raise
        print(f"posenc lab: error{rank_label()}: {_memory_advice(error)}", file=sys.stderr)  # maybe one rank's own
        return 2
    try:
        lab.run()
    except (MemoryError, RuntimeError) as error:
        _interrupt_first(error)
        if not _out_of_memory(error):
            raise
        # Said by the rank that met it: it may be the only one (a rank's own GPU), and rank 0 would say nothing.
        print(
            f"posenc lab: error{rank_label()}: {_memory_advice(error)}; the units finished before it are saved in "
            f"{out}",
            file=sys.stderr,
        )
        return 1
    except store.RunFolderError as error:
        _interrupt_first(error)
        if speaks:
            print(f"posenc lab: error: {error}", file=sys.stderr)
        return 2
    except TrainingDiverged as error:
        _interrupt_first(error)
        if speaks:
            print(
                f"posenc lab: error: {error}; the units finished before it are saved in {out}, which holds this "
                "configuration only: run the new --lr with another --out",
                file=sys.stderr,
            )
        return 1
    except (OSError, SafetensorError) as error:
        _interrupt_first(error)
        if isinstance(error, OSError) and error.errno not in _WRITE_REFUSALS:
            raise  # a closed stdout (`posenc lab ... | head`), a file gone: no room or permission would help
        # A full disk or quota, or a folder made read-only since prepare(): every write is atomic, so what was written
        # before it is whole, and the rerun resumes there (a unit's training from its last checkpoint).
        if speaks:
            print(
                f"posenc lab: error: {out}: {_write_failure(error)}; the units finished before it are saved there: "
                "make room (a full disk or quota) or make the folder writable, and run the same command again to "
                "continue",
                file=sys.stderr,
            )
        return 1
    return 0


def _out_of_memory(error: BaseException) -> bool:
    """Whether an error is an allocation that failed: Python's MemoryError, torch's CPU allocator ("can't allocate
    memory") or a GPU's OutOfMemoryError. Anything else is a bug, whose traceback is kept."""
    if isinstance(error, (MemoryError, torch.OutOfMemoryError)):
        return True
    # Linux's and macOS's allocator, and Windows' ("DefaultCPUAllocator: not enough memory").
    return any(words in str(error) for words in ("can't allocate memory", "DefaultCPUAllocator: not enough memory"))


def _memory_advice(error: BaseException) -> str:
    """One line for an allocation that failed, naming what sizes it (a traceback from nn.Linear before)."""
    first = (str(error).strip().splitlines() or [type(error).__name__])[0]
    first = first.split("DefaultCPUAllocator: ")[-1]  # torch's "[enforce fail at alloc_cpu.cpp:127] err == 0." first
    return (
        f"out of memory ({first}); the run as configured does not fit this machine: make the model or the batches "
        "smaller (--dim, --layers, --batch-size, --train-len, --eval-lengths) or run fewer seeds (--seeds)"
    )


_MAX_THREADS = 4096
# What a file system that stops taking writes raises: full, over quota, read-only, refused, too big, failing.
_WRITE_REFUSALS = frozenset(
    getattr(errno, name)
    for name in ("ENOSPC", "EDQUOT", "EROFS", "EACCES", "EPERM", "EFBIG", "EIO")
    if hasattr(errno, name)
)


def _missing_imports(out: Path, imports: Sequence[str]) -> str:
    """For a refused resume: the --import modules the run in ``out`` was made with that this command lacks (its
    encodings or extensions may be theirs), as a note for the error; '' if none."""
    missing = [name for name in recorded_imports(out) if name not in imports]
    if not missing:
        return ""
    return f" (the run in {out} was made with {' '.join(f'--import {name}' for name in missing)}; pass it again)"


def _write_failure(error: OSError | SafetensorError) -> str:
    """What went wrong, naming the file where the error does (safetensors' errors name none)."""
    if isinstance(error, OSError) and error.strerror:
        return f"{error.filename}: {error.strerror}" if error.filename else error.strerror
    return str(error)
