"""What posenc's traced path costs where it was taken wrongly or compiled badly: two before/after pairs, one run each.

``--case compiled`` (commit 12b9842): a compiled ``RoPE`` forward computes its angles in the graph. "angles-op" is
the code as it is, the angles' cos/sin one opaque op (``posenc::angles_cos_sin``, (..., r/2) once); "angles-inline"
swaps that op for its own implementation, traced in the open as before 12b9842, which Inductor inlined into the
rotation (two float64 sines per element of every head on the torch path). Both against "table": the same rotation
compiled with a cos/sin table made beforehand. One row per backend and provider; ratio_to_table is this p50 over
the table's:

    python benchmarks/rope_traced_path.py --case compiled --out docs/results/rope_traced_compiled.csv

``--case eager-decode`` (commit 6205331): an eager decode-sized call while another thread is held inside a
torch.compile (torch 2.13's ``torch.compiler.is_compiling()`` is then True in every thread). "eager" is the code as it
is (only the compiling thread counts as tracing); "traced-path" binds posenc's ``compiling()`` back to torch's flag,
as before 6205331, so the call takes the traced path: no cos/sin table, the angles computed on every call. One row
per type and provider; ratio_to_eager is this p50 over eager's:

    python benchmarks/rope_traced_path.py --case eager-decode --out docs/results/rope_traced_eager_decode.csv

Times are the thread's CPU time on one torch thread (``--threads``), providers taking turns call by call.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

from common import commit, device_name, measure_thread_time, percentiles, write_rows

CASES = ("compiled", "eager-decode")
# ratio: this provider's p50 over the p50 of the provider named in ratio_to (table or eager).
FIELDS = [
    "op",
    "provider",
    "mode",
    "dtype",
    "shape",
    "p20",
    "p50",
    "p80",
    "ratio",
    "ratio_to",
    "device",
    "torch",
    "commit",
]


@contextlib.contextmanager
def angles_inline() -> Iterator[None]:
    """The traced angles as plain aten ops, which Dynamo traces in the open (the code before 12b9842)."""
    from posenc.rope import module

    op = module._angles_cos_sin
    module._angles_cos_sin = module._angles_cos_sin_impl
    try:
        yield
    finally:
        module._angles_cos_sin = op


@contextlib.contextmanager
def torch_compiling_flag() -> Iterator[None]:
    """posenc's ``compiling()`` bound to ``torch.compiler.is_compiling`` in every posenc module that calls it: the
    check before 6205331, True in every thread while any thread compiles (before 6205331: the code as it is)."""
    from posenc import _checks

    ours = getattr(_checks, "compiling", None)
    if ours is None:  # a checkout before 6205331: it asks torch's flag already
        yield
        return
    bound = [
        m
        for name, m in list(sys.modules.items())
        if name.startswith("posenc") and getattr(m, "compiling", None) is ours
    ]
    for module in bound:
        module.compiling = torch.compiler.is_compiling
    try:
        yield
    finally:
        for module in bound:
            module.compiling = ours


@contextlib.contextmanager
def another_thread_compiling() -> Iterator[None]:
    """Another thread held inside a torch.compile (its backend waits) for the block."""
    inside, done = threading.Event(), threading.Event()

    def waiting_backend(gm: torch.fx.GraphModule, example_inputs: list) -> Callable:
        inside.set()
        done.wait(timeout=3600)
        return gm.forward

    def add_one(x: torch.Tensor) -> torch.Tensor:
        return x + 1

    thread = threading.Thread(target=torch.compile(add_one, backend=waiting_backend), args=(torch.zeros(2),))
    thread.start()
    try:
        if not inside.wait(timeout=300):
            raise RuntimeError("the compiling thread never reached its backend")
        yield
    finally:
        done.set()
        thread.join()


AROUND = {"angles-inline": angles_inline, "traced-path": torch_compiling_flag}  # the code a provider stands for


def within(provider: str) -> contextlib.AbstractContextManager:
    return AROUND.get(provider, contextlib.nullcontext)()


def random_qk(heads: int, kv_heads: int, seq: int, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return torch.randn(1, heads, seq, head_dim, generator=g), torch.randn(1, kv_heads, seq, head_dim, generator=g)


def compiled_cases(args: argparse.Namespace, backend: str) -> dict[str, Callable[[], object]]:
    """A compiled rotation by a ready table, and a compiled RoPE forward with the angles as an op or inline."""
    from posenc import RoPE, apply_rotary_qk

    q, k = random_qk(args.heads, args.kv_heads, args.seq, args.head_dim)
    table_rope = RoPE(args.head_dim, backend=backend)
    cos, sin = table_rope.cos_sin(torch.arange(args.seq))

    def by_table(q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return apply_rotary_qk(q, k, cos, sin, backend=backend)

    compile_ = {"backend": args.compiler, "fullgraph": True}
    compiled = {
        "table": torch.compile(by_table, **compile_),
        "angles-op": torch.compile(RoPE(args.head_dim, backend=backend), **compile_),
        "angles-inline": torch.compile(RoPE(args.head_dim, backend=backend), **compile_),
    }
    want = RoPE(args.head_dim, backend=backend)(q, k)
    for name, fn in compiled.items():
        with within(name):
            got = fn(q, k)  # compiles here, before the clock
        for x, y in zip(got, want, strict=True):
            torch.testing.assert_close(x, y, rtol=2.5e-7, atol=2e-6, msg=lambda m, name=name: f"{name}: {m}")

    return {name: functools.partial(fn, q, k) for name, fn in compiled.items()}


def eager_decode_cases(args: argparse.Namespace, rope_type: str) -> dict[str, Callable[[], object]]:
    """A decode-sized eager call (one token at --offset) of a fixed-frequency type, as it is and on the traced path."""
    from posenc import RoPE

    params = {"default": None, "linear": {"rope_type": "linear", "factor": 4.0}}.get(rope_type)
    if rope_type == "yarn":
        params = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 2048}
    rope = RoPE(args.head_dim, rope_parameters=params, max_position_embeddings=8192)
    q, k = random_qk(args.heads, args.kv_heads, 1, args.head_dim)
    want = rope(q, k, offset=args.offset)
    for name in ("eager", "traced-path"):
        with within(name):
            got = rope(q, k, offset=args.offset)
        for x, y in zip(got, want, strict=True):
            torch.testing.assert_close(x, y, rtol=2.5e-7, atol=2e-6, msg=lambda m, name=name: f"{name}: {m}")

    return {name: functools.partial(rope, q, k, offset=args.offset) for name in ("eager", "traced-path")}


def rows_for(times: dict[str, list[float]], base: str, common: dict) -> list[dict]:
    base_p50 = percentiles(times[base])[1]
    rows = []
    for name, samples in times.items():
        p20, p50, p80 = percentiles(samples)
        row = {"provider": name, "p20": round(p20, 4), "p50": round(p50, 4), "p80": round(p80, 4)}
        row |= {"ratio": round(p50 / base_p50, 3), "ratio_to": base, **common}
        rows.append(row)
        print(f"{row['mode']:>12} {name:>14}: p50 {row['p50']:9.4f} ms  {row['ratio']:.2f}x {base}", flush=True)
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__
    )
    parser.add_argument("--case", required=True, choices=CASES)
    parser.add_argument("--backends", nargs="+", default=["torch", "auto"], choices=["torch", "auto"],
                        help="compiled: posenc backends (torch auto)")  # fmt: skip
    parser.add_argument("--types", nargs="+", default=["default", "linear", "yarn"],
                        choices=["default", "linear", "yarn"], help="eager-decode: fixed-frequency types")  # fmt: skip
    parser.add_argument("--seq", type=int, default=2048, help="compiled: tokens (2048)")
    parser.add_argument("--heads", type=int, default=None, help="q heads (compiled 8, eager-decode 32)")
    parser.add_argument("--kv-heads", type=int, default=None, help="k heads (compiled 2, eager-decode 8)")
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--offset", type=int, default=100, help="eager-decode: the token's position (100)")
    parser.add_argument("--compiler", default="inductor", help="compiled: torch.compile's backend (inductor)")
    parser.add_argument("--reps", type=int, default=50, help="timed calls per provider (50)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (1)")
    parser.add_argument("--out", type=Path, default=None, help="also write the CSV here")
    args = parser.parse_args(argv)
    decode = args.case == "eager-decode"
    args.heads = (32 if decode else 8) if args.heads is None else args.heads
    args.kv_heads = (8 if decode else 2) if args.kv_heads is None else args.kv_heads
    checked = {"--seq": args.seq, "--reps": args.reps, "--threads": args.threads, "--heads": args.heads}
    for flag, value in (checked | {"--kv-heads": args.kv_heads}).items():
        if value < 1:
            parser.error(f"{flag} must be at least 1, got {value}")
    if args.head_dim < 2 or args.head_dim % 2:
        parser.error(f"--head-dim must be even and at least 2, got {args.head_dim}")
    torch.set_num_threads(args.threads)
    env = {"device": device_name("cpu"), "torch": torch.__version__, "commit": commit()}
    rows = []
    if decode:
        shape = f"q(1,{args.heads},1,{args.head_dim}) k(1,{args.kv_heads},1,{args.head_dim}) offset {args.offset}"
        with another_thread_compiling():
            for rope_type in args.types:
                times = measure_thread_time(eager_decode_cases(args, rope_type), reps=args.reps, around=AROUND)
                common = {"op": "rope_decode_step", "mode": rope_type, "dtype": "float32", "shape": shape, **env}
                rows += rows_for(times, "eager", common)
    else:
        shape = f"q(1,{args.heads},{args.seq},{args.head_dim}) k(1,{args.kv_heads},{args.seq},{args.head_dim})"
        for backend in args.backends:
            cases = compiled_cases(args, backend)
            with torch.compiler.set_stance("fail_on_recompile"):  # a recompile inside the clock would be timed
                times = measure_thread_time(cases, reps=args.reps, around=AROUND)
            common = {"op": "rope_compiled", "mode": f"{backend}/{args.compiler}", "dtype": "float32", "shape": shape}
            rows += rows_for(times, "table", common | env)
    if args.out is not None:
        command = " ".join(sys.argv[1:] if argv is None else argv)
        write_rows(rows, args.out, FIELDS, command=f"python benchmarks/rope_traced_path.py {command}")


if __name__ == "__main__":
    main()
