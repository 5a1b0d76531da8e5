"""Run HERE, on the CPU, after scripts/gpu_prepare.sh: the comparison providers that only the GPU run uses (Liger's
rope, flash-attention's apply_rotary_emb) through every mode of benchmarks/rope.py, as that script calls them, on CPU
tensors with Triton interpreted. So a call mistake (a layout, a dtype, a shape the backward cannot take) shows here
and not as a failed step of the few GPU minutes a session may get.

    TRITON_INTERPRET=1 python scripts/gpu_providers_check.py      # seconds; exit status 1 if anything is wrong

float32: the forward and the gradients against float64 autograd through Hugging Face's formula. bf16: every mode
runs, but the values are not checked: the interpreter computes Liger's bf16 arithmetic wrongly (as it casts float64
to bf16 wrongly), which the GPU does not.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

if os.environ.get("TRITON_INTERPRET") != "1":
    sys.exit("set TRITON_INTERPRET=1: Triton reads it when imported")
ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "benchmarks"), str(ROOT / ".gpu" / "site"), str(ROOT / "src")]

import contextlib  # noqa: E402

import torch  # noqa: E402

# flash-attn enters torch.cuda.device(x.device.index), which a CPU tensor's None index cannot.
torch.cuda.device = lambda *args, **kwargs: contextlib.nullcontext()

import rope  # noqa: E402
from posenc.testing import random_qk  # noqa: E402

SEQ = 8  # the interpreter runs a program per block in Python: keep it small


def main() -> int:
    failures = []
    for dtype in (torch.float32, torch.bfloat16):
        q, k = random_qk(1, rope.HEADS_Q, rope.HEADS_K, SEQ, rope.HEAD_DIM, dtype=dtype, device="cpu")
        table = rope.tables(SEQ, dtype, "cpu")
        found = rope.outside_providers(table)
        if set(found) != {"liger", "flash-attn"}:
            failures.append(f"providers found: {sorted(found)}; run scripts/gpu_prepare.sh first")
        cos64, sin64 = (t.double() for t in table["full"])
        q64, k64 = q.double().requires_grad_(), k.double().requires_grad_()
        grads = (torch.randn_like(q), torch.randn_like(k))
        torch.autograd.backward(rope.hf_eager(q64, k64, cos64, sin64), [g.double() for g in grads])
        for name, fn in found.items():
            for mode in ("fwd", "bwd", "fwd+bwd"):
                try:
                    for _ in range(2):  # twice, as the benchmark's warm-up does (in place rotates again)
                        rope.make_case(name, fn, mode, q, k)()
                except Exception as error:  # every failure is reported, then the exit status
                    failures.append(f"{name} {mode} {dtype}: {type(error).__name__}: {error}")
            if dtype != torch.float32:
                continue
            layout = rope.hf_layout if name in rope.HF_LAYOUT else torch.clone
            qq, kk = (layout(x).detach().requires_grad_() for x in (q, k))
            try:
                outs = fn(qq, kk)
                got = torch.autograd.grad(outs, (qq, kk), tuple(layout(g) for g in grads))
            except Exception as error:
                failures.append(f"{name} float32 values: {type(error).__name__}: {error}")
                continue
            ref_q, ref_k = rope.hf_eager(q64, k64, cos64, sin64)
            for what, ours, ref in (
                ("q", outs[0], ref_q),
                ("k", outs[1], ref_k),
                ("dq", got[0], q64.grad),
                ("dk", got[1], k64.grad),
            ):
                error = (ours.double() - ref).abs().max().item() if ours.shape == ref.shape else float("inf")
                status = "ok" if error <= 1e-5 else "WRONG"
                print(f"{name:>10} float32 {what:>2}: shape {tuple(ours.shape)}, max error {error:.2e} {status}")
                if status != "ok":
                    failures.append(f"{name} {what}: max error {error:.2e} (shape {tuple(ours.shape)})")
    for failure in failures:
        print("FAILED:", failure)
    print("every mode of every provider ran" if not failures else f"{len(failures)} failure(s)")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
