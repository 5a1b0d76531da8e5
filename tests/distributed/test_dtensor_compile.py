"""Compiled rotations of DTensors (world size 1, gloo, in a process of its own): the fused ops have no sharding
strategy, so a compiled DTensor call failed with "Operator posenc.rotary.default does not have a sharding strategy
registered" (and, with position ids, "aten._assert_async.msg does not have a sharding strategy registered"); tensor
offsets, cu_seqlens and plain tensors beside DTensors (RoPE's own tables) failed eager too, "got mixed torch.Tensor
and DTensor"."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch.distributed as dist

WORKER = Path(__file__).with_name("dtensor_compile_worker.py")


@pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(), reason="torch built without gloo")
def test_compiled_dtensor_rotations_match_the_formula():
    done = subprocess.run([sys.executable, str(WORKER)], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stdout[-3000:] + done.stderr[-3000:]
