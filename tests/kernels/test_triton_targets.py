"""The Triton kernel compiled for real GPUs (sm_80 and sm_90) on a machine without one.

The interpreted tests run the kernel as Python, which accepts code that the compiler rejects (a variable whose
type differs between the branches of an ``if``) and says nothing of registers or access widths. Here Triton's own
compiler builds the representative launches of ``posenc.kernels.triton_targets`` down to cubins. It runs in a
subprocess: Triton's compiler does not work inside a process that runs its interpreter, as this suite does.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest


@pytest.fixture(scope="module")
def compiled() -> list[dict]:
    if importlib.util.find_spec("triton.backends.nvidia") is None:
        pytest.skip("this triton build has no NVIDIA backend to compile for")
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    command = [sys.executable, "-W", "ignore", "-m", "posenc.kernels.triton_targets", "--json"]
    result = subprocess.run(
        [*command, "--arch", "80", "--arch", "90"], capture_output=True, text=True, env=env, timeout=600
    )
    rows = [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]
    assert rows, f"no cases reported:\n{result.stdout}\n{result.stderr[-3000:]}"
    failed = [f"sm_{row['arch']} {row['case']}: {row['error']}" for row in rows if "error" in row]
    assert not failed and result.returncode == 0, "\n".join(failed) or result.stderr[-3000:]
    return rows


def test_every_case_compiles_for_both_architectures(compiled):
    cases = {row["case"] for row in compiled}
    assert {row["arch"] for row in compiled} == {80, 90}
    assert len(compiled) == 2 * len(cases) >= 20
    # The regression that only the compiler sees: q's token stride passed as i64, k's as i32.
    assert "bf16 q token stride past 2**31" in cases
    assert "bf16 d128 superblock 8" in cases


def test_no_register_spills(compiled):
    spilled = [
        (row["arch"], row["case"], row["local_bytes"]) for row in compiled if row["local_bytes"] or row["stack_bytes"]
    ]
    assert not spilled


def test_rows_move_in_16_byte_accesses(compiled):
    """Every store, and every load but the scalar int64 position/offset reads, moves 16 bytes a thread: the
    kernel reads x and cos/sin and writes out as wide as the memory system allows. A decode step (one token,
    one 256-channel row a head) has too little work per head to fill a 16-byte access per thread and is exempt.
    So is a 16-channel tail copied past the rotated channels (d = 80, r = 64): the default 32 tokens a program
    give 4 bf16 a thread there (8 bytes), one load and one store a head, two heads a program; the rotated
    channels of that case must still move 16 bytes."""
    wide = {"ld.global.v4.b32", "st.global.v4.b32", "ld.global.v2.b64", "st.global.v2.b64", "ld.global.b64"}
    narrow_tail = {"ld.global.v2.b32", "st.global.v2.b32"}
    narrow = []
    for row in compiled:
        forms = set(row["global_accesses"])
        allowed = wide
        if "d80 r64" in row["case"] and "copy-tail" in row["case"]:
            allowed = wide | narrow_tail
            assert all(row["global_accesses"].get(form, 0) <= 2 for form in narrow_tail), row
        if "decode" not in row["case"] and forms - allowed:
            narrow.append((row["arch"], row["case"], sorted(forms - allowed)))
        assert "decode" in row["case"] or {"ld.global.v4.b32", "st.global.v4.b32"} <= forms or "fp64" in row["case"]
    assert not narrow


def test_launch_options_reach_the_compiler(compiled):
    """num_warps given to the plan is what the cubin runs with; the default plan takes Triton's 4."""
    warps = {row["case"]: row["num_warps"] for row in compiled if row["arch"] == 90}
    assert warps["bf16 d128 BLOCK_S=64 num_warps=8"] == 8
    assert warps["bf16 d128 split-half offset"] == 4


def test_rotation_is_compiled_with_fused_multiply_adds_whatever_triton_defaults_to():
    """The launch asks for FMA contraction by name: Triton 3.9 warns that its default turns it off in 3.10, which
    would change the rotation's rounding with the Triton version. No warning, and the PTX holds the FMAs."""
    if importlib.util.find_spec("triton.backends.nvidia") is None:
        pytest.skip("this triton build has no NVIDIA backend to compile for")
    script = (
        "import torch\n"
        "from posenc.kernels.launch import triton_plans\n"
        "from posenc.kernels.triton_targets import compile_launch\n"
        "xs = [torch.zeros(1, h, 64, 128) for h in (4, 2)]\n"
        "(plan,) = triton_plans(xs, [torch.empty_like(x) for x in xs], torch.zeros(64, 64), torch.zeros(64, 64),"
        " None, None, 0, None, 'bhsd', False, False, True)\n"
        "print(compile_launch(plan, 90).ptx.count('fma.rn.f32'))\n"
    )
    env = {
        key: value for key, value in os.environ.items() if key not in ("TRITON_INTERPRET", "TRITON_DEFAULT_FP_FUSION")
    }
    result = subprocess.run(
        [sys.executable, "-W", "error:TRITON_DEFAULT_FP_FUSION", "-c", script],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert int(result.stdout.split()[-1]) >= 4  # x1 cos - x2 sin and x2 cos + x1 sin, on q's and k's values
