"""Peak memory and time of causal attention with ALiBi / T5 biases: the materialized (b, h, s, t) mask versus
FlexAttention's score_mod, at s = t = 8192 (inference, float32). The "compiled-layer" paths time a whole
``torch.compile``d ``CausalSelfAttention`` (projections included) with the bias materialized or through FlexAttention,
which on CPU runs as a graph of its own inside the caller's graph.

Each case runs in a fresh process, so the peak resident memory (ru_maxrss) of that process, minus its size
after building the inputs, is what the attention itself added; on CUDA the peak allocated memory is used. The peak
covers a first call (which compiles, where a path compiles) and a second one; the time is the second call's. Any
UserWarning a path raised (FlexAttention giving up and materializing the bias, say) is kept in the row's
``warnings`` column and printed, so a fallback is not reported under the flex path's name. The CSV is rewritten
(atomically) after every case, so a run cut short keeps the rows it measured; a case that fails (an OOM, say) has its
stderr printed, the others still run, and the exit status is then 1.

    python benchmarks/bias_memory.py --csv docs/results/bias_memory_cpu.csv   # CPU, s = 8192, 8 heads: minutes
    python benchmarks/bias_memory.py --device cuda --seq 16384
    python benchmarks/bias_memory.py --documents 8      # 8 packed documents: the mask keeps each to itself

With ``--documents N`` the row holds N equal documents (``document_ids``): the materialized path masks the other
documents in its (b, h, s, t) mask, FlexAttention's block mask skips their blocks. With ``--batch B`` (and
documents) there are B rows whose documents start at other tokens (row r's boundaries 37 * r tokens later), so
the ids are per row, (B, s):

    python benchmarks/bias_memory.py --documents 8 --batch 4 --paths flex
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
import warnings
from pathlib import Path

import torch

from common import write_rows

PATHS = ("materialized", "flex", "compiled-layer-materialized", "compiled-layer-flex")
COLUMNS = (
    "encoding", "path", "seq", "documents", "batch", "heads", "head_dim", "device", "peak_mib", "seconds", "torch",
    "warnings",
)  # fmt: skip
STDERR_CHARS = 6000  # of a failed case's stderr, printed: its traceback, not every warning before it


def run_one(
    encoding_name: str, path: str, seq: int, heads: int, head_dim: int, device: str, documents: int, batch: int
) -> dict:
    from posenc import ALiBi, CausalSelfAttention, T5Bias
    from posenc.attention import attend, causal_mask
    from posenc.kernels import flex_bias
    from posenc.positions import positions_from_document_ids

    torch.manual_seed(0)
    encoding = (ALiBi(heads) if encoding_name == "alibi" else T5Bias(heads)).to(device)
    q, k, v = (torch.randn(batch, heads, seq, head_dim, device=device) for _ in range(3))
    docs = None
    if documents > 1:
        tokens = torch.arange(seq, device=device)
        shifts = 37 * torch.arange(batch, device=device)[:, None]
        docs = ((tokens + shifts) // (seq // documents)).clamp(max=documents - 1)  # (batch, s), ids per row
        docs = docs[:1] if batch == 1 else docs
    pos = torch.arange(seq, device=device)[None] if docs is None else positions_from_document_ids(docs)
    layer = x = None
    if path.startswith("compiled-layer"):
        if path.endswith("materialized"):
            flex_bias.CPU_MIN_SCORES = flex_bias.CUDA_MIN_SCORES = 2**62
        layer = torch.compile(CausalSelfAttention(heads * head_dim, heads, encoding=encoding).to(device).eval())
        x = torch.randn(batch, seq, heads * head_dim, device=device)

    def call() -> None:
        if layer is not None:
            layer(x, document_ids=docs)
        elif path == "flex":
            flex_bias.attend_flex(q, k, v, encoding, pos, pos, document_ids=docs)
        else:
            attend(q, k, v, causal_mask(seq, seq, q.device, docs), encoding.score_bias(pos, pos))

    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
    else:
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    with torch.no_grad(), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        # The first call compiles where the path compiles; its peak counts (compilation is part of what flex costs
        # on first use). Every path makes it, so the timed call is each one's second.
        call()
        sync()
        start = time.perf_counter()
        call()
        sync()
        seconds = time.perf_counter() - start
    if device == "cuda":
        peak = torch.cuda.max_memory_allocated() - before
    else:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - before
    return {
        "encoding": encoding_name,
        "path": path,
        "seq": seq,
        "documents": documents,
        "batch": batch,
        "heads": heads,
        "head_dim": head_dim,
        "device": device,
        "peak_mib": round(peak / 2**20, 1),
        "seconds": round(seconds, 3),
        "torch": torch.__version__,
        # UserWarnings only: posenc's fallbacks and torch's "unfused flex_attention" are; deprecations are noise.
        "warnings": " | ".join(
            dict.fromkeys(f"{w.category.__name__}: {w.message}" for w in caught if issubclass(w.category, UserWarning))
        ),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--seq", type=int, default=8192)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=64)
    # Print-only unless asked, so that a trial run does not overwrite the committed docs/results/bias_memory_cpu.csv.
    parser.add_argument("--csv", type=Path, default=None, help="CSV to write (default: print only)")
    parser.add_argument("--paths", nargs="+", default=list(PATHS), choices=PATHS)
    parser.add_argument("--encodings", nargs="+", default=["alibi", "t5"], choices=["alibi", "t5"])
    parser.add_argument("--documents", type=int, default=1, help="equal documents packed into the row (default 1)")
    parser.add_argument("--batch", type=int, default=1, help="rows, with documents of their own (default 1)")
    parser.add_argument("--one", nargs=2, metavar=("ENCODING", "PATH"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    check_sizes(parser, args)
    if args.one:
        print(
            json.dumps(run_one(*args.one, args.seq, args.heads, args.head_dim, args.device, args.documents, args.batch))
        )
        return
    cases = [(encoding, path) for encoding in args.encodings for path in args.paths]
    rows, failed = [], []
    for encoding, path in cases:
        done = subprocess.run(case_command(args, encoding, path), capture_output=True, text=True)
        if done.returncode != 0:
            # The case's own error (an OOM, a compile failure) and then the next case: one case must not cost the
            # others' rows.
            failed.append(f"{encoding} {path}")
            print(f"{encoding:>6} {path:>26}: FAILED (exit {done.returncode}), its stderr:", file=sys.stderr)
            print(done.stderr[-STDERR_CHARS:], file=sys.stderr, flush=True)
            continue
        row = json.loads(done.stdout.strip().splitlines()[-1])
        rows.append(row)
        # After every case, so that a run cut short (gpu_check.sh's step limit) keeps the rows it measured.
        if args.csv is not None:
            write_rows(rows, args.csv, COLUMNS)
        print(f"{encoding:>6} {path:>26}: peak +{row['peak_mib']:>9.1f} MiB, {row['seconds']:.2f} s", flush=True)
        if row["warnings"]:
            print(f"{'':>34} warned: {row['warnings']}", flush=True)
    if rows and args.csv is not None:
        print(f"wrote {len(rows)} rows to {args.csv}")
    if failed:
        sys.exit(f"{len(failed)} of {len(cases)} cases failed ({', '.join(failed)}); their stderr is above")


def check_sizes(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Refuse sizes every case would fail on, before a process is started for any."""
    for name in ("seq", "heads", "head_dim", "documents", "batch"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    if args.seq % args.documents:
        parser.error(f"--seq {args.seq} must be a multiple of --documents {args.documents} (documents of equal length)")


def case_command(args: argparse.Namespace, encoding: str, path: str) -> list[str]:
    """This script again, measuring one (encoding, path) in a process of its own."""
    sizes = ("--seq", args.seq, "--heads", args.heads, "--head-dim", args.head_dim, "--documents", args.documents)
    return [
        sys.executable, __file__, "--one", encoding, path, "--device", args.device, "--batch", str(args.batch),
        *map(str, sizes),
    ]  # fmt: skip


if __name__ == "__main__":
    main()
