"""Training throughput of ``posenc lab``: the lab's loop (``posenc.lab.train.train``: batch gathering, the
learning-rate schedule, gradient clipping, loss bookkeeping and the tqdm bar) against a plain loop of the same
model, optimizer and batches (forward, loss, backward, clip, step; nothing else).

Rows are long format (``benchmarks/common.py``); p20/p50/p80 are milliseconds per chunk of ``--steps`` steps, and
``ratio_to_copy`` is the plain loop's p50 over this provider's p50, i.e. the lab's tokens/s over the plain loop's
(1.0: the harness costs nothing). The two loops take turns chunk by chunk, so load on a shared machine slows both.

    python benchmarks/lab_throughput.py                  # default preset sizes, about a minute on 2 cores
    python benchmarks/lab_throughput.py --encodings rope --reps 10 --out docs/benchmarks/lab_throughput.csv
"""

from __future__ import annotations

import argparse
import copy
import sys
from pathlib import Path

import torch

from common import add_allocation_argument, at_least, environment, measure_interleaved, percentiles, write_rows
from posenc.lab.config import PRESETS
from posenc.lab.data import load_corpus, train_starts, windows_at
from posenc.lab.model import ByteLM, next_byte_loss
from posenc.lab.train import make_optimizer, train


def plain_loop(model: ByteLM, batches: torch.Tensor, *, lr: float, weight_decay: float, grad_clip: float) -> None:
    """The loop one would write by hand: batches (steps, b, s + 1) already gathered, a fixed rate."""
    optimizer = make_optimizer(model, lr=lr, weight_decay=weight_decay)
    for batch in batches:
        logits, _ = model(batch[:, :-1])
        loss = next_byte_loss(logits, batch[:, 1:]).mean()
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
        optimizer.step()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="default", choices=list(PRESETS), help="model and batch sizes")
    parser.add_argument("--encodings", nargs="+", default=None, help="default: every encoding of the preset")
    parser.add_argument("--steps", type=int, default=20, help="training steps per timed chunk")
    parser.add_argument("--reps", type=at_least(1), default=5, help="timed chunks per loop (after two warm-up chunks)")
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    parser.add_argument("--no-progress", dest="progress", action="store_false", help="lab loop without its bar")
    parser.add_argument("--out", type=Path, default=None, help="CSV to write (default: print only)")
    # glibc's defaults, as `posenc lab` runs: "fresh" (every block of 128 KiB or more mapped anew) halved both loops'
    # tokens/s here. Named in the device column.
    add_allocation_argument(parser, default="system")
    args = parser.parse_args()
    if args.threads is not None:  # first: the device column names the thread count
        torch.set_num_threads(args.threads)
    env = environment("cpu", args.alloc)  # before any tensor exists, as the other scripts do

    config = PRESETS[args.preset]
    spec = config.model_spec()
    corpus = load_corpus(max_bytes=4 << 20)
    starts = train_starts(
        corpus.train, seq_len=config.train_len, batch_size=config.batch_size, steps=args.steps, seed=0
    )
    batches = torch.stack([windows_at(corpus.train, row, config.train_len) for row in starts])
    tokens = args.steps * config.batch_size * config.train_len
    rows = []
    for encoding in args.encodings or config.encodings:
        torch.manual_seed(0)
        lab_model = ByteLM(spec, encoding)
        plain_model = copy.deepcopy(lab_model)
        cases = {
            "lab": (
                lambda m=lab_model: train(
                    m,
                    corpus.train,
                    seq_len=config.train_len,
                    batch_size=config.batch_size,
                    steps=args.steps,
                    lr=config.lr,
                    seed=0,
                    weight_decay=config.weight_decay,
                    grad_clip=config.grad_clip,
                    progress=args.progress,
                )
            ),
            "plain": (
                lambda m=plain_model: plain_loop(
                    m, batches, lr=config.lr, weight_decay=config.weight_decay, grad_clip=config.grad_clip
                )
            ),
        }
        times = measure_interleaved(cases, reps=args.reps, device="cpu")
        plain_p50 = percentiles(times["plain"])[1]
        for provider, samples in times.items():
            p20, p50, p80 = percentiles(samples)
            rows.append(
                {
                    "op": f"lab_train[{encoding}]",
                    "provider": provider,
                    "mode": "fwd+bwd+step",
                    "dtype": "fp32",
                    "shape": f"b{config.batch_size} s{config.train_len} dim{config.dim} l{config.layers} "
                    f"h{config.heads} x{args.steps} steps",
                    "p20": round(p20, 3),
                    "p50": round(p50, 3),
                    "p80": round(p80, 3),
                    "ratio_to_copy": round(plain_p50 / p50, 3),
                    **env,
                }
            )
            print(
                f"{encoding:>10} {provider:>5}: {tokens / (p50 / 1e3):>9,.0f} tokens/s (p50 of {args.reps}), "
                f"lab/plain tokens/s ratio {plain_p50 / p50:.3f}",
                file=sys.stdout,
                flush=True,
            )
    if args.out is not None:
        write_rows(rows, args.out)
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
