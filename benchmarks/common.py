"""Shared by the benchmark scripts: timing percentiles, the environment stamped on every row, CSV output.

Rows are long format: op, provider, mode, dtype, shape, p20, p50, p80 (milliseconds), ratio_to_copy (the copy
provider's p50 over this provider's p50, so 1.0 is the bandwidth floor), gb_per_s (the bytes the copy case moves
over this provider's p50, where the script gives them), device, torch, commit.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import ctypes
import hashlib
import os
import platform
import statistics
import subprocess
import time
import warnings
from collections.abc import Callable
from pathlib import Path

import torch

COLUMNS = (
    "op",
    "provider",
    "mode",
    "dtype",
    "shape",
    "p20",
    "p50",
    "p80",
    "ratio_to_copy",
    "gb_per_s",
    "device",
    "torch",
    "commit",
)


ALLOCATION_MODES = ("fresh", "reuse", "system")
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD, _M_MMAP_MAX = -1, -3, -4  # glibc's mallopt parameters


def set_allocation(mode: str) -> str:
    """Pin how glibc hands out the large CPU buffers (torch's CPU allocator sits on malloc); returns a label.

    An out-of-place op's time on CPU depends on whether its output comes from fresh pages (the OS zero-fills
    each 4 KiB page on first touch, which dominates a copy) or from heap memory freed by an earlier call. With
    glibc's defaults that depends on sizes and on what ran before (its mmap threshold adapts to freed blocks), so
    providers taking turns in one run would see different regimes. "fresh": every block of 128 KiB or more is
    mapped and unmapped, so every call faults its pages; "reuse": nothing is unmapped or trimmed, so buffers are
    recycled; "system": glibc's defaults.
    """
    if mode == "system":
        return "alloc=system"
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return "alloc=system (no mallopt)"
    if mode == "fresh":
        ok = mallopt(_M_MMAP_THRESHOLD, 128 * 1024)
    elif mode == "reuse":
        ok = mallopt(_M_MMAP_MAX, 0) and mallopt(_M_TRIM_THRESHOLD, 2**30)
    else:
        raise ValueError(f"allocation mode must be one of {ALLOCATION_MODES}, got {mode!r}")
    return f"alloc={mode}" if ok else "alloc=system (mallopt refused)"


def huge_pages_label() -> str:
    """The device column's word on huge pages (``posenc.kernels.huge_pages.asks``): "huge pages asked" where posenc
    asks for them under its rotations' big new outputs, else why not."""
    from posenc.kernels import huge_pages

    reason = huge_pages.why_not()
    return f"huge pages not asked ({reason})" if reason else "huge pages asked"


def huge_page_clone(x: torch.Tensor) -> torch.Tensor:
    """``x.clone()`` into a new buffer given huge pages as posenc gives its rotations' outputs
    (``posenc.kernels.huge_pages.advised``): the floor of an out-of-place op that writes the same pages (copy-huge
    in rope.py)."""
    from posenc.kernels import huge_pages

    return huge_pages.advised(torch.empty_like(x, memory_format=torch.contiguous_format)).copy_(x)


def at_least(low: int) -> Callable[[str], int]:
    """An argparse type: an int >= ``low``. A count of 0 (``--reps 0``) passed the parser and failed after the setup,
    in statistics ("must have at least two data points") or a negative offset."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"must be at least {low}, got {value}")
        return value

    return parse


def add_allocation_argument(parser, default: str = "fresh") -> None:
    """``--alloc`` for the CPU benchmarks (see ``set_allocation``)."""
    parser.add_argument(
        "--alloc",
        default=default,
        choices=ALLOCATION_MODES,
        help=f"CPU output buffers: fresh pages every call, recycled heap memory or glibc's defaults ({default})",
    )


def add_clock_argument(parser) -> None:
    """``--clock`` for the scripts that time CUDA (see ``measure_interleaved``); read it with ``chosen_clock``."""
    parser.add_argument(
        "--clock",
        choices=CLOCKS,
        default=None,
        help="CUDA: device (default; the GPU's time, events) or host (each call synchronized, host work included)",
    )


def chosen_clock(parser, args) -> str:
    """The clock ``--clock`` asks for: by default the GPU's on CUDA and the host's elsewhere."""
    clock = args.clock or ("device" if args.device == "cuda" else "host")
    if clock == "device" and args.device != "cuda":
        parser.error("--clock device needs --device cuda")
    return clock


def environment(device: str, alloc: str, clock: str | None = None) -> dict:
    """The columns every row carries (device, torch, commit); on CPU this pins the allocation regime first
    (``set_allocation``) and names it in the device column, as it names the clock where one is given."""
    name = device_name(device)
    if device == "cpu":
        name = f"{name}, {set_allocation(alloc)}"
        # PyTorch's own switch: its CPU allocator then asks for transparent huge pages (2 MiB) on every buffer of
        # 2 MiB or more, so fresh output faults a huge page at a time instead of 512 small ones. Read by torch at
        # its first allocation, so it can only come from the environment the script starts in.
        if os.environ.get("THP_MEM_ALLOC_ENABLE") == "1":
            name += ", THP_MEM_ALLOC_ENABLE=1"
        name += f", {huge_pages_label()}"
    if clock is not None:
        name += f", clock={clock}"
    return {"device": name, "torch": torch.__version__, "commit": commit()}


def rows_against_copy(
    times: dict[str, list[float]],
    *,
    op: str,
    mode: str,
    dtype: str,
    shape: str,
    env: dict,
    copy_bytes: int | None = None,
) -> list[dict]:
    """One long-format row per case of ``times`` (which has a "copy" case), printed as it is made.

    copy_bytes: bytes the copy case reads plus writes; each row's gb_per_s is then that over its p50, the effective
    bandwidth of an op that moves only what it must (against a GPU's HBM peak, or the copy's own row).
    """
    copy_p50 = percentiles(times["copy"])[1]
    rows = []
    for name, samples in times.items():
        p20, p50, p80 = percentiles(samples)
        row = {
            "op": op,
            "provider": name,
            "mode": mode,
            "dtype": dtype,
            "shape": shape,
            "p20": round(p20, 4),
            "p50": round(p50, 4),
            "p80": round(p80, 4),
            "ratio_to_copy": round(copy_p50 / p50, 3),
            "gb_per_s": round(copy_bytes / (p50 * 1e-3) / 1e9, 1) if copy_bytes else "",
            **env,
        }
        rows.append(row)
        print_row(row)
    return rows


UNTRACKED_READ_BYTES = 1 << 20  # untracked files up to this size are hashed whole by commit()


def commit() -> str:
    """HEAD's short hash, "unknown" outside a git checkout. Where files other than docs/ differ from HEAD (tracked
    changes or untracked files), "+dirty." and a hash of those changes follow (untracked files' contents too: git's
    diff leaves them out): the GPU runs copy an uncommitted working tree, and rows of different code must not share
    one stamp. docs/ is left out because the benchmarks rewrite their own CSVs there."""
    here = Path(__file__).parent  # the checkout the script lives in, wherever it is run from
    head = _git(here, "rev-parse", "--short", "HEAD").decode().strip()
    if not head:
        return "unknown"
    code = (":(top)", ":(top,exclude)docs")  # the whole tree but docs/, wherever `here` is in it
    status = _git(here, "status", "--porcelain", "--untracked-files=normal", "--", *code)
    if not status:
        return head
    diff = _git(here, "diff", "--no-color", "--no-ext-diff", "--binary", "HEAD", "--", *code)
    digest = hashlib.sha1(status + diff)
    top = Path(_git(here, "rev-parse", "--show-toplevel").decode().strip())
    untracked = _git(here, "ls-files", "--others", "--exclude-standard", "--full-name", "-z", "--", *code)
    for name in sorted(filter(None, untracked.split(b"\0"))):
        digest.update(name + b"\0")
        with contextlib.suppress(OSError):  # gone since git listed it, or unreadable: its name still counts
            path = top / name.decode()
            size = path.stat().st_size
            # Source is small; a large untracked file (a data set, a cache) counts by its size, unread.
            digest.update(path.read_bytes() if size <= UNTRACKED_READ_BYTES else str(size).encode())
    return f"{head}+dirty.{digest.hexdigest()[:8]}"


def _git(where: Path, *args: str) -> bytes:
    """git's stdout, run in ``where``; empty where git, the checkout or HEAD is missing."""
    try:
        out = subprocess.run(["git", "-C", str(where), *args], capture_output=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return b""
    return out.stdout if out.returncode == 0 else b""


def device_name(device: str) -> str:
    """The GPU's name, or "cpu <model> x<threads>": the sessions' VMs have changed CPUs, and ratios with them."""
    if device == "cuda":
        return torch.cuda.get_device_name()
    model = platform.processor()
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
        model = next((line.split(":", 1)[1].strip() for line in lines if line.startswith("model name")), model)
    except OSError:
        pass
    return f"cpu {model} x{torch.get_num_threads()}".replace("  ", " ")


CLOCKS = ("host", "device")
FLUSH_BYTES = 256 << 20  # read before each timed call on CUDA's device clock: more than any GPU's L2 (H200: 60 MB)
SLEEP_CYCLES = 2_000_000  # ~1 ms of GPU clock, in which the host prepares the timed call


def measure_interleaved(
    cases: dict[str, Callable[[], object]], *, reps: int, device: str, clock: str = "host", warmup: int = 2
) -> dict[str, list[float]]:
    """Milliseconds per case, name -> fn, taking turns rep by rep: on a shared machine a burst
    of load then slows every provider alike instead of whichever ran during it, which keeps ratios honest. The
    order rotates each rep, so no case always runs right after the same one: on CPU the case after a copy ran
    40-100 us slower at s = 1024 than the same call placed elsewhere (caches and the OpenMP pool it inherits).

    The clock covers the call, which allocates and writes its outputs; what ``fn`` returns is dropped after the
    clock stops. Freeing a 32 MiB output hands its pages back to the OS, 2-4 ms on the CPU VMs here, so every case
    returns its outputs rather than keeping them (or dropping them inside the clock): before 2026-12-01 a
    backward's gradients, kept in .grad, were freed untimed while the copy's clones were freed inside the clock.

    clock: "host" times each call from the host, synchronizing before and after (on CUDA that includes the host's
    work: Python, checks, launches); "device" (CUDA only) times what the GPU spends, with events (``_device_clock``).
    warmup: untimed rounds of every case before the timed ones (the host clock; the device clock keeps its two).
    """
    if clock not in CLOCKS:
        raise ValueError(f"clock must be one of {CLOCKS}, got {clock!r}")
    if warmup < 0:
        raise ValueError(f"warmup must be >= 0, got {warmup}")
    if clock == "device":
        if warmup != 2:
            raise ValueError(f"warmup={warmup}: clock='device' always runs two warm-up rounds; leave warmup at 2")
        if device != "cuda":
            raise ValueError(f"clock='device' times CUDA work with events; device is {device!r}: use clock='host'")
        return _device_clock(cases, reps=reps, device=device)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    times: dict[str, list[float]] = {name: [] for name in cases}
    for rep, name in _turns(list(cases), reps, warmup):
        sync()
        start = time.perf_counter()
        result = cases[name]()
        sync()
        if rep >= 0:
            times[name].append((time.perf_counter() - start) * 1e3)
        del result
    return times


def measure_thread_time(
    cases: dict[str, Callable[[], object]],
    *,
    reps: int,
    around: dict[str, Callable[[], contextlib.AbstractContextManager]] | None = None,
) -> dict[str, list[float]]:
    """Milliseconds of this thread's CPU time per case, name -> fn, taking turns as ``measure_interleaved`` does.

    For host-bound CPU work run on one torch thread (a decode step of a tiny model, Python and dispatch): on a
    shared machine another process's load stretches the wall clock 2-4x there, and the thread's CPU time much less.
    Work on other threads (torch's pool beyond one thread, a GPU) is not counted: use ``measure_interleaved``.

    around: name -> a context manager each call of that case runs in, entered and left outside the clock (a case
    that stands for older code by swapping a function: the swap is not the code's cost)."""
    around = around or {}
    times: dict[str, list[float]] = {name: [] for name in cases}
    for rep, name in _turns(list(cases), reps):
        with around.get(name, contextlib.nullcontext)():
            start = time.thread_time()
            result = cases[name]()
            elapsed = (time.thread_time() - start) * 1e3
        if rep >= 0:
            times[name].append(elapsed)
        del result
    return times


def _turns(names: list[str], reps: int, warmup: int = 2):
    """(rep, name) in the order cases take turns: ``warmup`` warm-up rounds (rep -warmup to -1, not recorded) and
    then reps rounds, each starting one case further along, so no case always runs right after the same one."""
    for rep in range(-warmup, reps):
        shift = (rep + warmup) % len(names)
        for name in names[shift:] + names[:shift]:
            yield rep, name


def _device_clock(cases: dict[str, Callable[[], object]], *, reps: int, device: str) -> dict[str, list[float]]:
    """``measure_interleaved`` on CUDA with the GPU's own clock: milliseconds between two events around each call.

    Before each call the GPU reads FLUSH_BYTES (so the call reads its inputs from HBM, not from L2 where the
    previous call left them; a read, not a write like triton's do_bench, so that L2 is left clean and the call does
    not pay for writing the flush's dirty lines back) and then sleeps SLEEP_CYCLES, while the host runs the call's
    Python and queues its kernels: the events then time the kernels back to back, as in a model whose host runs
    ahead of the GPU, and not the host's overhead. (A call that waits for the GPU itself, by reading a value on the
    host, brings its host time back into the measurement.) The queue is drained once per round."""
    flush = torch.zeros(FLUSH_BYTES // 4, dtype=torch.int32, device=device)
    sleep = getattr(torch.cuda, "_sleep", None)  # private, long-standing (torch.cuda tests use it)
    if sleep is None:
        warnings.warn(
            "torch.cuda._sleep is gone: the host's work per call may leak into the device clock", stacklevel=2
        )
    pairs: dict[str, list[tuple[torch.cuda.Event, torch.cuda.Event]]] = {name: [] for name in cases}
    names = list(cases)
    for turn, (rep, name) in enumerate(_turns(names, reps), start=1):
        flush.sum()
        if sleep is not None:
            sleep(SLEEP_CYCLES)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        result = cases[name]()
        end.record()
        if rep >= 0:
            pairs[name].append((start, end))
        del result  # freed in stream order, after the clock
        if turn % len(names) == 0:  # the queue is drained once per round
            torch.cuda.synchronize()
    return {name: [start.elapsed_time(end) for start, end in events] for name, events in pairs.items()}


def percentiles(times: list[float]) -> tuple[float, float, float]:
    """(p20, p50, p80); one sample is all three (statistics.quantiles needs two)."""
    if len(times) == 1:
        return times[0], times[0], times[0]
    q = statistics.quantiles(times, n=10, method="inclusive")
    return q[1], statistics.median(times), q[7]


def write_rows(
    rows: list[dict], path: Path, columns: tuple[str, ...] | list[str] = COLUMNS, *, command: str | None = None
) -> None:
    """The CSV, replaced atomically: a run interrupted mid-write leaves the previous file whole. command: written as
    a first line "# <command>", the command that made it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + ".partial")
    with partial.open("w", newline="") as f:
        if command is not None:
            f.write(f"# {command}\n")
        writer = csv.DictWriter(f, fieldnames=columns)
        writer.writeheader()
        writer.writerows(rows)
    os.replace(partial, path)


def print_row(row: dict) -> None:
    print(
        f"{row['op']:>6} {row['provider']:>24} {row['mode']:>7} {row['dtype']:>8} {row['shape']:>32} "
        f"p50 {row['p50']:9.3f} ms  ratio_to_copy {row['ratio_to_copy']:.2f}"
        + (f"  {row['gb_per_s']:7.1f} GB/s" if row.get("gb_per_s") not in (None, "") else ""),  # 0.0 too
        flush=True,
    )
