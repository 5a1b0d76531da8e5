"""The host cost of a decode call, this working tree against an earlier git revision: processes of the two take turns.

A decode step's RoPE call is mostly Python (checks, the table's rows, the CPU kernel's launch): a few microseconds
of difference between two revisions is lost in one process's noise, and both trees cannot be imported side by side
without renaming one. So the revision's ``src`` is unpacked (``git archive``) into a temporary folder and each tree
is timed in its own subprocess, with ``PYTHONPATH`` set to its ``src`` and ``OMP_NUM_THREADS=1``; ``--pairs`` pairs
of processes run, the two trees taking turns and alternating which goes first, so that load on a shared machine hits
both alike. Each process warms every case up, then takes the min over ``--rounds`` rounds of ``--calls`` calls
(the cases taking turns round by round), in microseconds per call of the thread's CPU time (``--clock wall``: the
wall clock). Cases, fp32, one torch thread, the CPU backend:

- ``RoPE(offset=100)``: ``posenc.RoPE(128)(q, k, offset=100)``, q (1, 32, 1, 128), k (1, 8, 1, 128);
- ``RoPE(offset=100) bf16``: the same with q and k in bfloat16;
- ``RoPE(offset=tensor([100]))``: the same with a (1,) tensor offset;
- ``RoPE(offset=100000)``: the same past the largest table (2**16 rows), where the rows are read from a window;
- ``apply_rotary_qk(cos, sin)``: cos/sin (1, 1, 1, 64) of position 100 given (broadcast), as a transformers model
  patched by ``posenc.interop`` calls it;
- ``apply_rotary_(q, k, offset=100)``: q and k each rotated in place by ``apply_rotary_`` with the 4096-row table
  (two calls: the in-place function takes one tensor);
- ``apply_rotary_qk(table, positions)``: a 4096-row cos/sin table and (1, 1) position ids;
- ``MRoPE(3-axis positions)``: ``MRoPE(128, mrope_section=[16, 24, 24])``, q (1, 16, 1, 128), k (1, 8, 1, 128),
  (3, 1, 1) positions that differ by axis (100, 7, 9: a token of an image);
- ``MRoPE(text on 3 axes)``: the same with 100 on every axis (a text token: every generated one);
- ``RoPE(longrope, offset=5000)``: LongRoPE (Phi-3's kind: short and long factors, original length 4096) past its
  original length, q (1, 32, 1, 128), k (1, 8, 1, 128); ``RoPE(longrope, positions=[[5000]])`` the same given
  (1, 1) position ids, as posenc's own attention gives them;
- ``RoPE(dynamic, offset=100)``: dynamic NTK (factor 4, max_position_embeddings 4096, mode 'hf') below its limit,
  where it is plain RoPE; ``RoPE(dynamic, offset=5000)``: past it (every call the same length, so the state and
  the frequencies stay: a decode loop's steps each scale for a new length, on top of this);
- ``call_cos_sin(dynamic, [[100]])``: the per-step accessor a patched transformers model's rotary embedding
  calls, (1, 1) ids below the limit;
- ``RoPE(dynamic) step past the limit, 4 layers``: a decode step past the limit as a model of four layers
  sharing the RoPE makes it: a new length each step (offsets 5000, 5001, ...: new frequencies, computed on the
  host), then four calls at it; the time is per step;
- ``RoPE(offset=100) prefill``: the same call with q (1, 32, s, 128), k (1, 8, s, 128), s = ``--prefill-tokens``
  (512), ``--prefill-rounds`` rounds of ``--prefill-calls`` calls; ``RoPE(dynamic, offset=100) prefill`` the same
  with dynamic NTK below its limit.

With ``--triton``, two more cases time the host side of ``backend='triton'`` with Triton's launch replaced by a
no-op (``posenc.kernels.triton_rope.launch``; Triton's own launcher and the GPU are not in them): the Python a
decode step costs before the launch, the same on any machine. The processes run with ``TRITON_INTERPRET=1`` so that
CPU tensors take the Triton path; q and k in bfloat16, as on a GPU:

- ``RoPE(offset=100) triton host``: ``posenc.RoPE(128, backend='triton')(q, k, offset=100)``;
- ``apply_rotary_qk(cos, sin) triton host``: float32 cos/sin (1, 1, 1, 64) given, as a patched model passes them.

Printed per case: each pair's old / new and the pairwise difference (new - old) range. Rows, long format: one per
case, pair and tree (provider ``old@<rev>`` or ``new@tree``; the commit column is that tree's).

    python benchmarks/decode_host_ab.py --baseline e00b500 --pairs 4 --csv docs/results/decode_host_ab.csv
    python benchmarks/decode_host_ab.py --baseline 2f7685b --pairs 6 --triton
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from common import add_allocation_argument, commit, device_name, set_allocation, write_rows

ROOT = Path(__file__).resolve().parents[1]
CASES = (
    "RoPE(offset=100)",
    "RoPE(offset=100) bf16",
    "RoPE(offset=tensor([100]))",
    "RoPE(offset=100000)",
    "apply_rotary_qk(cos, sin)",
    "apply_rotary_(q, k, offset=100)",
    "apply_rotary_qk(table, positions)",
    "MRoPE(3-axis positions)",
    "MRoPE(text on 3 axes)",
    "RoPE(longrope, offset=5000)",
    "RoPE(longrope, positions=[[5000]])",
    "RoPE(dynamic, offset=100)",
    "RoPE(dynamic, offset=5000)",
    "call_cos_sin(dynamic, [[100]])",
    "RoPE(dynamic) step past the limit, 4 layers",
    "RoPE(offset=100) prefill",
    "RoPE(dynamic, offset=100) prefill",
)
TRITON_CASES = ("RoPE(offset=100) triton host", "apply_rotary_qk(cos, sin) triton host")
SHAPES = {
    "RoPE(offset=100)": "b=1,hq=32,hk=8,s=1,d=128,offset=100",
    "RoPE(offset=100) bf16": "b=1,hq=32,hk=8,s=1,d=128,offset=100,bf16",
    "apply_rotary_qk(cos, sin)": "b=1,hq=32,hk=8,s=1,d=128,cos=(1,1,1,64)",
    "apply_rotary_(q, k, offset=100)": "b=1,hq=32,hk=8,s=1,d=128,rows=4096,in-place",
    "RoPE(offset=tensor([100]))": "b=1,hq=32,hk=8,s=1,d=128,offset=100",
    "RoPE(offset=100000)": "b=1,hq=32,hk=8,s=1,d=128,offset=100000,window",
    "apply_rotary_qk(table, positions)": "b=1,hq=32,hk=8,s=1,d=128,rows=4096",
    "MRoPE(3-axis positions)": "b=1,hq=16,hk=8,s=1,d=128,sections=16/24/24",
    "MRoPE(text on 3 axes)": "b=1,hq=16,hk=8,s=1,d=128,sections=16/24/24,text",
    "RoPE(longrope, offset=5000)": "b=1,hq=32,hk=8,s=1,d=128,offset=5000,original=4096",
    "RoPE(longrope, positions=[[5000]])": "b=1,hq=32,hk=8,s=1,d=128,positions=(1,1),original=4096",
    "RoPE(dynamic, offset=100)": "b=1,hq=32,hk=8,s=1,d=128,offset=100,max_positions=4096",
    "RoPE(dynamic, offset=5000)": "b=1,hq=32,hk=8,s=1,d=128,offset=5000,max_positions=4096",
    "call_cos_sin(dynamic, [[100]])": "positions=(1,1),r=128,max_positions=4096",
    "RoPE(dynamic) step past the limit, 4 layers": "b=1,hq=32,hk=8,s=1,d=128,offset=5000+,max_positions=4096,layers=4",
    "RoPE(offset=100) triton host": "b=1,hq=32,hk=8,s=1,d=128,offset=100,bf16,launch=no-op",
    "apply_rotary_qk(cos, sin) triton host": "b=1,hq=32,hk=8,s=1,d=128,cos=(1,1,1,64),bf16,launch=no-op",
}
BF16_CASES = ("RoPE(offset=100) bf16", *TRITON_CASES)
PREFILL = "RoPE(offset=100) prefill"
PREFILLS = (PREFILL, "RoPE(dynamic, offset=100) prefill")
TABLE_ROWS = 4096
FIELDS = ["op", "provider", "mode", "dtype", "shape", "pair", "order", "us", "device", "torch", "commit"]


def make_cases(prefill_tokens: int, triton: bool = False) -> dict[str, Callable[[], object]]:
    """name -> one call, built from the posenc on sys.path (the tree this process times); with ``triton``, the
    Triton cases too (this process must have TRITON_INTERPRET=1 and Triton's launch replaced by a no-op)."""
    import torch

    from posenc import MRoPE, RoPE, apply_rotary_, apply_rotary_qk

    torch.manual_seed(0)
    rope = RoPE(128)
    q, k = torch.randn(1, 32, 1, 128), torch.randn(1, 8, 1, 128)
    offset = torch.tensor([100])
    cos, sin = rope.cos_sin(torch.arange(TABLE_ROWS))  # (rows, 64) each
    positions = torch.tensor([[100]])
    far_ids = torch.tensor([[5000]])
    q16, k16 = q.bfloat16(), k.bfloat16()
    q_inplace, k_inplace = q.clone(), k.clone()  # rotated again at every call: timed, never read
    step_cos, step_sin = cos[100:101][None, None], sin[100:101][None, None]  # (1, 1, 1, 64)
    mrope = MRoPE(128, mrope_section=[16, 24, 24])
    mq, mk = torch.randn(1, 16, 1, 128), torch.randn(1, 8, 1, 128)
    axes = torch.tensor([100, 7, 9])[:, None, None]  # (3, 1, 1): temporal, height, width
    text = torch.tensor([100, 100, 100])[:, None, None]
    factors = {"short_factor": [1.0 + 0.01 * i for i in range(64)], "long_factor": [1.0 + 0.5 * i for i in range(64)]}
    longrope = RoPE(
        128,
        rope_parameters={"rope_type": "longrope", "original_max_position_embeddings": 4096, **factors},
        max_position_embeddings=131072,
    )
    # Three: one below the limit, one past it keeping its 'hf' state there, one stepping to a new length each call.
    ntk = {"rope_type": "dynamic", "factor": 4.0}
    dynamic, past, stepping = (RoPE(128, rope_parameters=ntk, max_position_embeddings=4096) for _ in range(3))
    steps = itertools.count(5000)

    def step_past_the_limit() -> None:
        # One decode step of a 4-layer model sharing the RoPE: a new length (new frequencies), the same rows per layer.
        offset = next(steps)
        for _ in range(4):
            stepping(q, k, offset=offset)

    pq, pk = torch.randn(1, 32, prefill_tokens, 128), torch.randn(1, 8, prefill_tokens, 128)
    triton_cases = {}
    if triton:
        triton_rope = RoPE(128, backend="triton")
        triton_cases = {
            "RoPE(offset=100) triton host": lambda: triton_rope(q16, k16, offset=100),
            "apply_rotary_qk(cos, sin) triton host": lambda: apply_rotary_qk(
                q16, k16, step_cos, step_sin, backend="triton"
            ),
        }
    return triton_cases | {
        "RoPE(offset=100)": lambda: rope(q, k, offset=100),
        "RoPE(offset=100) bf16": lambda: rope(q16, k16, offset=100),
        "RoPE(offset=tensor([100]))": lambda: rope(q, k, offset=offset),
        "RoPE(offset=100000)": lambda: rope(q, k, offset=100_000),
        "apply_rotary_qk(cos, sin)": lambda: apply_rotary_qk(q, k, step_cos, step_sin),
        "apply_rotary_(q, k, offset=100)": lambda: (
            apply_rotary_(q_inplace, cos, sin, offset=100),
            apply_rotary_(k_inplace, cos, sin, offset=100),
        ),
        "apply_rotary_qk(table, positions)": lambda: apply_rotary_qk(q, k, cos, sin, positions=positions),
        "MRoPE(3-axis positions)": lambda: mrope(mq, mk, positions=axes),
        "MRoPE(text on 3 axes)": lambda: mrope(mq, mk, positions=text),
        "RoPE(longrope, offset=5000)": lambda: longrope(q, k, offset=5000),
        "RoPE(longrope, positions=[[5000]])": lambda: longrope(q, k, positions=far_ids),
        "RoPE(dynamic, offset=100)": lambda: dynamic(q, k, offset=100),
        "RoPE(dynamic, offset=5000)": lambda: past(q, k, offset=5000),
        "call_cos_sin(dynamic, [[100]])": lambda: dynamic.call_cos_sin(positions),
        "RoPE(dynamic) step past the limit, 4 layers": step_past_the_limit,
        PREFILL: lambda: rope(pq, pk, offset=100),
        "RoPE(dynamic, offset=100) prefill": lambda: dynamic(pq, pk, offset=100),
    }


def time_cases(
    cases: dict[str, Callable[[], object]], *, calls: dict[str, int], rounds: dict[str, int], warmup: int, clock: str
) -> dict[str, float]:
    """name -> microseconds per call: the min over rounds[name] rounds of calls[name] calls, the cases taking turns
    round by round after ``warmup`` calls of each (at most one round's)."""
    now = time.thread_time if clock == "thread" else time.perf_counter
    for name, fn in cases.items():
        for _ in range(min(warmup, calls[name])):
            fn()
    best = dict.fromkeys(cases, float("inf"))
    for turn in range(max(rounds.values())):
        for name, fn in cases.items():
            if turn >= rounds[name]:
                continue
            start = now()
            for _ in range(calls[name]):
                fn()
            best[name] = min(best[name], (now() - start) / calls[name] * 1e6)
    return best


def worker(args: argparse.Namespace) -> None:
    """The timing process: its posenc comes from PYTHONPATH; prints one JSON line, case -> us."""
    import torch

    import posenc

    torch.set_num_threads(1)
    alloc = set_allocation(args.alloc)
    source = Path(posenc.__file__).resolve()
    if args.expect_src is not None and not source.is_relative_to(Path(args.expect_src).resolve()):
        raise SystemExit(f"posenc imported from {source}, not from {args.expect_src}: an install shadows PYTHONPATH")
    if args.triton:
        from posenc.kernels import triton_rope

        triton_rope.launch = lambda plan: None  # the host's Python alone: the kernel is not what is timed
    cases = make_cases(args.prefill_tokens, args.triton)
    calls = {name: args.prefill_calls if name in PREFILLS else args.calls for name in cases}
    rounds = {name: args.prefill_rounds if name in PREFILLS else args.rounds for name in cases}
    with torch.no_grad():
        times = time_cases(cases, calls=calls, rounds=rounds, warmup=args.warmup, clock=args.clock)
    device = f"{device_name('cpu')}, {alloc}, clock={args.clock}"
    print(json.dumps({"times": times, "device": device, "torch": torch.__version__}))


def resolve(revision: str) -> str:
    """The revision's short hash; a SystemExit naming it where git does not know it."""
    done = subprocess.run(
        ["git", "rev-parse", "--short", "--verify", f"{revision}^{{commit}}"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=30,
    )
    if done.returncode != 0:
        raise SystemExit(f"--baseline {revision!r} is not a commit of {ROOT}: {done.stderr.strip()}")
    return done.stdout.strip()


def unpack_src(revision: str, into: Path) -> Path:
    """The revision's src/ written under ``into`` (git archive: no worktree left to clean up); returns its src."""
    archive = subprocess.run(["git", "archive", revision, "src"], cwd=ROOT, capture_output=True, check=True, timeout=60)
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive.stdout, check=True, timeout=60)
    return into / "src"


def run_tree(src: Path, args: argparse.Namespace) -> dict:
    """One timing process of the tree whose package is in ``src``."""
    env = {**os.environ, "PYTHONPATH": str(src), "OMP_NUM_THREADS": "1"}
    env.pop("TRITON_INTERPRET", None)  # the CPU backend, as a CPU decode runs it
    if args.triton:
        env["TRITON_INTERPRET"] = "1"  # CPU tensors take the Triton path (its launch a no-op); the CPU cases do not
    command = [sys.executable, str(Path(__file__).resolve()), "--worker", "--expect-src", str(src)]
    command += ["--calls", str(args.calls), "--rounds", str(args.rounds), "--warmup", str(args.warmup)]
    command += ["--prefill-tokens", str(args.prefill_tokens), "--prefill-calls", str(args.prefill_calls)]
    command += ["--prefill-rounds", str(args.prefill_rounds)]
    command += ["--clock", args.clock, "--alloc", args.alloc] + (["--triton"] if args.triton else [])
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=3600)
    if done.returncode != 0:
        raise SystemExit(f"the timing process for {src} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def pairwise(old: list[float], new: list[float]) -> tuple[float, float]:
    """(min, max) of new - old over the pairs."""
    differences = [b - a for a, b in zip(old, new, strict=True)]
    return min(differences), max(differences)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--baseline", help="the git revision whose src/ is the old tree (required)")
    parser.add_argument("--pairs", type=int, default=4, help="pairs of processes, old and new taking turns (4)")
    parser.add_argument("--calls", type=int, default=2000, help="decode calls a round (2000)")
    parser.add_argument("--rounds", type=int, default=7, help="rounds per process; the min is kept (7)")
    parser.add_argument("--warmup", type=int, default=300, help="untimed calls of each case first (300)")
    parser.add_argument("--prefill-tokens", type=int, default=512)
    parser.add_argument("--prefill-calls", type=int, default=50, help="prefill calls a round (50)")
    parser.add_argument("--prefill-rounds", type=int, default=15, help="prefill rounds per process (15)")
    parser.add_argument("--clock", choices=["thread", "wall"], default="thread", help="the thread's CPU time or wall")
    parser.add_argument("--csv", type=Path, default=None)
    parser.add_argument(
        "--triton", action="store_true", help="also time backend='triton' calls' host side, the launch a no-op"
    )
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--expect-src", default=None, help=argparse.SUPPRESS)
    add_allocation_argument(parser, default="reuse")
    args = parser.parse_args(argv)
    for flag in ("pairs", "calls", "rounds", "prefill_tokens", "prefill_calls", "prefill_rounds"):
        if getattr(args, flag) < 1:
            parser.error(f"--{flag.replace('_', '-')} must be >= 1, got {getattr(args, flag)}")
    if args.warmup < 0:
        parser.error(f"--warmup must be >= 0, got {args.warmup}")
    if args.worker:
        worker(args)
        return
    if args.baseline is None:
        parser.error("--baseline is required: the git revision to time the working tree against")

    old_commit, new_commit = resolve(args.baseline), commit()
    old_name, new_name = f"old@{old_commit}", "new@tree"
    times: dict[str, list[dict]] = {old_name: [], new_name: []}
    with tempfile.TemporaryDirectory(prefix="decode_host_ab_") as tmp:
        trees = {old_name: unpack_src(old_commit, Path(tmp)), new_name: ROOT / "src"}
        for pair in range(args.pairs):
            # The first of a pair alternates: a process that runs right after another may find caches warmer.
            order = [old_name, new_name] if pair % 2 == 0 else [new_name, old_name]
            for name in order:
                times[name].append(run_tree(trees[name], args))
            print(f"pair {pair + 1}/{args.pairs} done", flush=True)

    first = times[new_name][0]
    prefill = f"b=1,hq=32,hk=8,s={args.prefill_tokens},d=128,offset=100"
    shapes = SHAPES | {PREFILL: prefill, PREFILLS[1]: f"{prefill},max_positions=4096"}
    rows = []
    for case in CASES + (TRITON_CASES if args.triton else ()):
        old = [t["times"][case] for t in times[old_name]]
        new = [t["times"][case] for t in times[new_name]]
        low, high = pairwise(old, new)
        median_old = statistics.median(old)
        print(f"{case} ({shapes[case]}), us per call, {old_name} / {new_name} in each pair:")
        print("    " + ", ".join(f"{a:.2f} / {b:.2f}" for a, b in zip(old, new, strict=True)))
        print(f"    new - old: {low:+.2f} .. {high:+.2f} us ({low / median_old:+.1%} .. {high / median_old:+.1%})")
        for pair in range(args.pairs):
            for name, values, stamp in ((old_name, old, old_commit), (new_name, new, new_commit)):
                rows.append({
                    "op": "decode-host",
                    "provider": name,
                    "mode": case,
                    "dtype": "bf16" if case in BF16_CASES else "fp32",
                    "shape": shapes[case],
                    "pair": pair + 1,
                    "order": 1 + ((name == new_name) != (pair % 2 == 1)),
                    "us": round(values[pair], 3),
                    "device": first["device"],
                    "torch": first["torch"],
                    "commit": stamp,
                })  # fmt: skip
    if args.csv is not None:
        command = shlex.join(sys.argv[1:] if argv is None else argv)
        write_rows(rows, args.csv, FIELDS, command=f"python benchmarks/decode_host_ab.py {command}")
        print(f"wrote {len(rows)} rows to {args.csv}")


if __name__ == "__main__":
    main()
