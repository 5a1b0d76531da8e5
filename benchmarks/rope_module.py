"""``posenc.RoPE`` as attention layers call it, against the bare kernel call and a copy: a prefill and a decode.

Cases, taking turns rep by rep: ``copy`` (clone of q and k), ``apply_rotary_qk`` (cos/sin already gathered, so the
kernel call alone), ``RoPE(offset=...)`` (an int offset: the module hands the kernels its cached table),
``RoPE(positions=...)`` (the same positions as ids), and where transformers is installed, Hugging Face's
``apply_rotary_pos_emb`` (its eager formula, cos/sin given: against ``apply_rotary_qk``) and ``hf-llama`` (Llama's
rotary embedding computing cos/sin for the position ids, then ``apply_rotary_pos_emb``: what a Hugging Face
attention layer runs per call, against ``RoPE``). ``apply_rotary_qk(freqs_cis table, offset=...)`` reads a table
of ``TABLE_ROWS`` positions kept as Meta's complex ``freqs_cis`` (cos and sin the real and imaginary parts, a view
with a pair stride the kernels cannot read as is): the rows the tokens read are copied, not the table.

Where the Triton kernel runs (CUDA, or the interpreter with ``--launch-parts``), four more cases take a Triton
call's host time apart (a decode step took 0.31 ms on an H200's VM against 0.23 ms for Hugging Face's eager
formula): ``apply_rotary_qk(backend='triton')``, the same with the launch replaced by a no-op (posenc's Python:
after the first call, a replay of its plan, ``posenc.kernels.replay``), ``triton launch (planned once)`` (a plan
made beforehand, launched: Triton's launcher and the device's context) and ``triton kernel[grid] (planned once)``
(the same without ``torch.cuda.device``).

    python benchmarks/rope_module.py --csv docs/results/rope_module_cpu.csv
"""

from __future__ import annotations

import argparse
import importlib.util
from pathlib import Path

import torch

from common import (
    add_allocation_argument,
    at_least,
    environment,
    measure_interleaved,
    rows_against_copy,
    write_rows,
)
from posenc import RoPE, apply_rotary_qk
from posenc.testing import random_qk

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
TABLE_ROWS = 131072  # a 128k-context model's table


def launch_parts(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> dict:
    """A Triton call and its parts (see the module's docstring), for host time per call."""
    from posenc.kernels import triton_rope  # imports triton: only where asked
    from posenc.kernels.launch import triton_plans

    def call_without_launch():
        launch, triton_rope.launch = triton_rope.launch, lambda plan: None
        try:
            return apply_rotary_qk(q, k, cos, sin, backend="triton")
        finally:
            triton_rope.launch = launch

    outs = [torch.empty_like(q), torch.empty_like(k)]
    (plan,) = triton_plans([q, k], outs, cos, sin, None, None, 0, None, "broadcast", False, False, True)

    def kernel_alone():
        triton_rope._rope_kernel[plan.grid](*plan.args, **plan.constants, **plan.options)
        return outs

    return {
        "apply_rotary_qk(backend='triton')": lambda: apply_rotary_qk(q, k, cos, sin, backend="triton"),
        "apply_rotary_qk(backend='triton'), launch a no-op": call_without_launch,
        "triton launch (planned once)": lambda: (triton_rope.launch(plan), outs)[1],
        "triton kernel[grid] (planned once)": kernel_alone,
    }


def make_cases(
    rope: RoPE, dtype: torch.dtype, seq: int, offset: int, device: str, parts: bool = False, heads: tuple = (32, 8)
) -> dict:
    q, k = random_qk(1, *heads, seq, 128, dtype=dtype, device=device)
    positions = torch.arange(offset, offset + seq, device=device)
    cos, sin = rope.cos_sin(positions, dtype=torch.float32)
    cases = {
        "copy": lambda: (q.clone(), k.clone()),
        "apply_rotary_qk": lambda: apply_rotary_qk(q, k, cos, sin),
        "RoPE(offset=...)": lambda: rope(q, k, offset=offset),
        "RoPE(positions=...)": lambda: rope(q, k, positions=positions),
    }
    angles = torch.arange(TABLE_ROWS, dtype=torch.float64)[:, None] * rope.frequencies()[0]
    freqs_cis = torch.polar(torch.ones_like(angles), angles).to(device=device, dtype=torch.complex64)
    table_cos, table_sin = torch.view_as_real(freqs_cis).unbind(-1)  # (n, r/2) each, pair stride 2
    cases["apply_rotary_qk(freqs_cis table, offset=...)"] = lambda: apply_rotary_qk(
        q, k, table_cos, table_sin, offset=offset
    )
    if importlib.util.find_spec("transformers") is not None:
        from transformers import LlamaConfig
        from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

        config = LlamaConfig(hidden_size=4096, num_attention_heads=32, num_key_value_heads=8, head_dim=128)
        hf_rope, position_ids = LlamaRotaryEmbedding(config).to(device), positions[None]

        def hf_llama():
            hf_cos, hf_sin = hf_rope(q, position_ids)
            return apply_rotary_pos_emb(q, k, hf_cos, hf_sin)

        given_cos, given_sin = hf_rope(q, position_ids)
        cases["apply_rotary_pos_emb"] = lambda: apply_rotary_pos_emb(q, k, given_cos, given_sin)
        cases["hf-llama"] = hf_llama
    if parts:
        cases |= launch_parts(q, k, cos, sin)
    return cases


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--dtypes", nargs="+", default=["fp32", "bf16"], choices=list(DTYPES))
    parser.add_argument("--prefill", type=at_least(1), default=4096, help="tokens of the prefill case")
    parser.add_argument(
        "--reps", type=at_least(1), nargs=2, default=[30, 2000], help="reps of the prefill and the decode"
    )
    parser.add_argument("--warmup", type=int, default=2, help="untimed rounds of every case before the timed ones (2)")
    parser.add_argument("--heads", type=int, default=32, help="q heads (32, Llama 3 8B's)")
    parser.add_argument(
        "--kv-heads",
        type=int,
        default=8,
        help="k heads (8; fewer heads in all: the tests' interpreted Triton runs a program per head group)",
    )
    parser.add_argument(
        "--launch-parts",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="time a Triton call's parts (default: on CUDA; on CPU it needs TRITON_INTERPRET=1)",
    )
    parser.add_argument("--csv", type=Path, default=None)
    add_allocation_argument(parser)
    args = parser.parse_args()
    parts = args.device == "cuda" if args.launch_parts is None else args.launch_parts
    if min(args.heads, args.kv_heads) < 1:
        parser.error(f"--heads and --kv-heads must be at least 1, got {args.heads} and {args.kv_heads}")
    if args.warmup < 0:
        parser.error(f"--warmup must be at least 0, got {args.warmup}")
    hq, hk = args.heads, args.kv_heads

    env = environment(args.device, args.alloc)
    rope = RoPE(128)
    rows = []
    with torch.no_grad():
        prefill, decode = ("prefill", args.prefill, 0, args.reps[0]), ("decode", 1, args.prefill - 1, args.reps[1])
        for mode, seq, offset, reps in (prefill, decode):
            for dtype_name in args.dtypes:
                cases = make_cases(rope, DTYPES[dtype_name], seq, offset, args.device, parts, heads=(hq, hk))
                times = measure_interleaved(cases, reps=reps, device=args.device, warmup=args.warmup)
                shape = f"b=1,hq={hq},hk={hk},s={seq},d=128,offset={offset}"
                rows += rows_against_copy(times, op="rope-module", mode=mode, dtype=dtype_name, shape=shape, env=env)
    if args.csv is not None:
        write_rows(rows, args.csv)
        print(f"wrote {len(rows)} rows to {args.csv}")


if __name__ == "__main__":
    main()
