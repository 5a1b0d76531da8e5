"""Two processes on gloo: cos/sin bitwise equal across ranks; sharded RoPE equals the unsharded rows."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch.distributed as dist

from posenc.rope.frequencies import SCALINGS

WORKER = Path(__file__).with_name("gloo_worker.py")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun(script: Path, *args: str, nproc: int = 2) -> subprocess.CompletedProcess:
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nnodes=1",
        f"--nproc-per-node={nproc}",
        "--master-addr=127.0.0.1",
        f"--master-port={free_port()}",
        str(script),
        *args,
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)


@pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(), reason="torch built without gloo")
def test_two_ranks_agree_bitwise_and_shards_match(tmp_path):
    configs = [{}, {"rope_type": "default", "rope_theta": 500000.0, "partial_rotary_factor": 0.5}]
    examples = {
        "linear": {"factor": 4.0},
        "ntk": {"factor": 4.0},
        "dynamic": {"factor": 4.0},
        "yarn": {"factor": 4.0},
        "llama3": {
            "factor": 4.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 16,
        },
    }
    configs += [{"rope_type": name, **params} for name, params in examples.items() if name in SCALINGS]
    result = torchrun(WORKER, str(tmp_path), json.dumps(configs))
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert (tmp_path / "ok-0").exists() and (tmp_path / "ok-1").exists()
