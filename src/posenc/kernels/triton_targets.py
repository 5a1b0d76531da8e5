"""Compile the Triton rotary kernel for a CUDA GPU that is not there: what a machine without one can still check.

Triton's compiler needs no GPU: given a target architecture it lowers a kernel to PTX and, with the ptxas that
ships in the triton wheel, to a cubin. ``compile_launch`` takes a launch planned by
``posenc.kernels.triton_rope.plan_launch`` and binds its arguments the way Triton's JIT binds a real launch (an
int argument becomes i32, i64 past 2**31, or the constant 1; pointers 16-byte aligned get alignment hints), then
runs the whole pipeline. Type errors that only the compiler sees (the interpreter runs the kernel as Python),
register spills and the width of the global loads and stores then show up on a CPU-only machine.

This reaches into Triton's runtime (``create_function_from_signature``, ``JITFunction._pack_args``), which is not
public API: it is written against triton 3.x and raises if those names change, rather than checking less.
"""

from __future__ import annotations

import collections
import functools
import re
import subprocess
import tempfile
from dataclasses import dataclass, replace
from pathlib import Path

from posenc.kernels import triton_rope
from posenc.kernels.triton_rope import Launch


@dataclass(frozen=True)
class CompiledRope:
    """The kernel compiled for one launch and architecture.

    registers: per thread; local_bytes, stack_bytes: per-thread local memory and stack frame (spills show in
    either: ptxas puts them on the stack); global_accesses: how many PTX instructions of each global load/store
    form (``ld.global.v4.b32`` moves 16 bytes a thread).
    """

    arch: int
    ptx: str
    registers: int
    local_bytes: int
    stack_bytes: int
    num_warps: int
    global_accesses: dict[str, int]


@functools.cache
def _jit_function():  # -> triton.runtime.jit.JITFunction
    from triton.runtime.jit import JITFunction

    kernel = triton_rope._rope_kernel
    # Under TRITON_INTERPRET=1 the decorator returned an interpreter wrapper; the compiler wants the JIT form.
    return kernel if isinstance(kernel, JITFunction) else JITFunction(kernel.fn)


def _resources(cubin: bytes) -> dict[str, int]:
    import triton.backends.nvidia as nvidia

    tool = Path(nvidia.__file__).with_name("bin") / "cuobjdump"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as file:
        file.write(cubin)
        file.flush()
        report = subprocess.run(
            [str(tool), "--dump-resource-usage", file.name], capture_output=True, text=True, check=True, timeout=60
        ).stdout
    usage = dict(re.findall(r"\b(REG|STACK|LOCAL|SHARED):(\d+)", report))
    if not {"REG", "STACK", "LOCAL"} <= usage.keys():
        raise RuntimeError(f"cuobjdump reported no resource usage for the kernel:\n{report}")
    return {name: int(value) for name, value in usage.items()}


def compile_launch(launch: Launch, arch: int = 90) -> CompiledRope:
    """Compile ``launch`` for sm_<arch> (90: H100/H200, 80: A100) down to a cubin; raises what Triton raises."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, make_backend
    from triton.compiler import compile as triton_compile
    from triton.runtime.jit import create_function_from_signature

    kernel = _jit_function()
    target = GPUTarget("cuda", arch, 32)
    backend = make_backend(target)
    binder = create_function_from_signature(kernel.signature, kernel.params, backend)
    keywords = {**launch.constants, **launch.options}
    bound, specialization, options = binder(*launch.args, **keywords)
    options, signature, constants, attrs = kernel._pack_args(backend, keywords, bound, specialization, options)
    compiled = triton_compile(ASTSource(kernel, signature, constants, attrs), target=target, options=options.__dict__)
    ptx = compiled.asm["ptx"]
    usage = _resources(compiled.asm["cubin"])
    return CompiledRope(
        arch=arch,
        ptx=ptx,
        registers=usage["REG"],
        local_bytes=usage["LOCAL"],
        stack_bytes=usage["STACK"],
        num_warps=compiled.metadata.num_warps,
        global_accesses=dict(collections.Counter(re.findall(r"\b((?:ld|st)\.global(?:\.[\w]+)*)", ptx))),
    )


def _case_plans() -> dict[str, Launch]:
    """Representative launches, as ``posenc.kernels.launch.triton_plans`` lays them out for real calls.

    Shapes are small (the plan, not the data, is what gets compiled) but keep what the compiler specialises on:
    sizes and strides divisible by 16 where a real prefill's are, odd head dims where a model's are.
    """
    import torch

    from posenc.kernels.launch import triton_plans

    def plan(
        dtype, *, d, r, s=512, hq=8, hk=2, layout="bhsd", interleaved=False, conjugate=False, how="offset", wide=False
    ):
        shape = (lambda h: (2, h, s, d)) if layout == "bhsd" else (lambda h: (2, s, h, d))
        xs = [torch.zeros(shape(hq), dtype=dtype), torch.zeros(shape(hk), dtype=dtype)]
        kind, positions, offsets, cu_seqlens, offset = layout, None, None, None, 0
        table = torch.zeros(4 * s, r // 2, dtype=torch.float64 if wide or dtype == torch.float64 else torch.float32)
        cos = table
        if how == "offset":
            offset = 7
        elif how == "positions":
            positions = torch.zeros(2, s, dtype=torch.long)
        elif how == "per_sequence":
            offsets = torch.zeros(2, dtype=torch.long)
        elif how == "broadcast":
            kind, cos = "broadcast", table[:s]
        elif how == "varlen":
            xs = [torch.zeros(s, h, d, dtype=dtype) for h in (hq, hk)]
            kind, cu_seqlens, offsets = "varlen", torch.tensor([0, s // 3, s]), torch.zeros(2, dtype=torch.long)
        inplace = how == "in_place"
        outs = xs if inplace else [torch.empty_like(x) for x in xs]
        (launch,) = triton_plans(
            xs, outs, cos, cos, positions, offsets, offset, cu_seqlens, kind, interleaved, conjugate, not inplace
        )
        return launch

    bf16, fp16, fp32, fp64 = torch.bfloat16, torch.float16, torch.float32, torch.float64
    plans = {
        "bf16 d128 split-half offset": plan(bf16, d=128, r=128),
        "bf16 d128 adjacent-pairs bshd": plan(bf16, d=128, r=128, layout="bshd", interleaved=True),
        "fp32 d128 split-half offset": plan(fp32, d=128, r=128),
        "fp16 d128 r64 copy-tail": plan(fp16, d=128, r=64),
        # Adjacent pairs with a tail of another width than the pairs: a loop variable once changed shape there.
        "fp32 d128 r96 adjacent-pairs copy-tail": plan(fp32, d=128, r=96, interleaved=True),
        "bf16 d80 r64 adjacent-pairs copy-tail positions": plan(bf16, d=80, r=64, interleaved=True, how="positions"),
        "bf16 d128 in-place": plan(bf16, d=128, r=128, how="in_place"),
        "bf16 d64 per-sequence bshd": plan(bf16, d=64, r=64, layout="bshd", how="per_sequence"),
        "bf16 d80 position-ids": plan(bf16, d=80, r=80, how="positions"),
        "bf16 d96 r48 varlen adjacent-pairs": plan(bf16, d=96, r=48, interleaved=True, how="varlen"),
        "bf16 d256 decode broadcast": plan(bf16, d=256, r=256, s=1, how="broadcast"),
        "fp64 d64 adjacent-pairs conjugate": plan(fp64, d=64, r=64, s=7, interleaved=True, conjugate=True),
        # float64 tables make the math float64 for 16-bit x, rounded through float32 when stored (as torch does).
        "bf16 d128 float64 tables": plan(bf16, d=128, r=128, wide=True),
    }
    # A configuration other than the default, as benchmarks/triton_tune.py sweeps them: the launch options reach
    # the compiler.
    xs = [torch.zeros(1, h, 512, 128, dtype=bf16) for h in (8, 2)]
    (plans["bf16 d128 BLOCK_S=64 num_warps=8"],) = triton_plans(
        xs, [torch.empty_like(x) for x in xs], torch.zeros(512, 64), torch.zeros(512, 64), None, None, 0, None,
        "bhsd", False, False, True, block_s=64, num_warps=8,
    )  # fmt: skip
    # Runs of token blocks that every head group covers before the next run (benchmarks/triton_tune.py's
    # --superblocks): the other order of the grid.
    (plans["bf16 d128 superblock 8"],) = triton_plans(
        xs, [torch.empty_like(x) for x in xs], torch.zeros(512, 64), torch.zeros(512, 64), None, None, 0, None,
        "bhsd", False, False, True, superblock=8,
    )  # fmt: skip
    # Several heads a program (one load of positions and cos/sin for all), packed tokens, a tail. (With adjacent
    # pairs too, ptxas for sm_80 capped this at 96 registers and spilled 8 bytes: a tuning candidate may, the
    # launches a call makes by default may not.)
    xs = [torch.zeros(512, h, 96, dtype=bf16) for h in (8, 2)]
    (plans["bf16 d96 r64 varlen copy-tail 4 heads a program"],) = triton_plans(
        xs, [torch.empty_like(x) for x in xs], torch.zeros(1024, 32), torch.zeros(1024, 32), None,
        torch.zeros(2, dtype=torch.long), 0, torch.tensor([0, 100, 512]), "varlen", False, False, True,
        heads_per_program=4,
    )  # fmt: skip
    # q's token stride past 2**31 (Triton passes it as i64) while k's is i32: both must still compile.
    base = plans["bf16 d128 split-half offset"]
    args = list(base.args)
    args[_jit_function().arg_names.index("sq2")] = 2**33
    plans["bf16 q token stride past 2**31"] = replace(base, args=tuple(args))
    return plans


def main(argv: list[str] | None = None) -> int:
    """``python -m posenc.kernels.triton_targets``: compile the representative launches, print what they became."""
    import argparse
    import json

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--arch", type=int, action="append", help="sm_<arch>, repeatable (default: 80 and 90)")
    parser.add_argument("--json", action="store_true", help="one JSON object per line instead of a table")
    args = parser.parse_args(argv)
    if triton_rope.interpreted():
        parser.error("TRITON_INTERPRET=1 is set: Triton's compiler is unavailable in interpreter mode; unset it")
    failures = 0
    for arch in args.arch or [80, 90]:
        for name, plan in _case_plans().items():
            row: dict[str, object] = {"case": name, "arch": arch}
            try:
                compiled = compile_launch(plan, arch)
            except Exception as error:  # report every case, then fail
                failures += 1
                row["error"] = f"{type(error).__name__}: {error}"
            else:
                row.update(
                    registers=compiled.registers,
                    local_bytes=compiled.local_bytes,
                    stack_bytes=compiled.stack_bytes,
                    num_warps=compiled.num_warps,
                    global_accesses=compiled.global_accesses,
                )
            if args.json:
                print(json.dumps(row))
            elif "error" in row:
                print(f"sm_{arch}  {name:40s} FAILED {row['error']}")
            else:
                accesses = " ".join(f"{k}x{v}" for k, v in sorted(compiled.global_accesses.items()))
                print(
                    f"sm_{arch}  {name:40s} regs {compiled.registers:3d}  local {compiled.local_bytes:3d} B  "
                    f"warps {compiled.num_warps}  {accesses}"
                )
    return 1 if failures else 0


if __name__ == "__main__":
    raise SystemExit(main())
