"""Two processes on gloo: cos/sin bitwise equal across ranks; sharded RoPE equals the unsharded rows; DTensor rotations
sharded across the ranks at per-sequence offsets and packed by cu_seqlens, a bad offset or position id refused on every
rank; CausalSelfAttention's heads sharded by tensor parallelism (a 1-D mesh, and a 2-D mesh's "tp" dimension) equal to
the whole layer; attend with q sharded on the batch or the heads equal to the whole call, q sharded on the sequence
refused; score_bias of DTensor ids beside plain ones."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch.distributed as dist

from posenc.analysis.frequencies import EXAMPLE_ROPE_PARAMETERS
from posenc.rope.frequencies import SCALINGS
from posenc.testing import run_torchrun

WORKER = Path(__file__).with_name("gloo_worker.py")


@pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(), reason="torch built without gloo")
def test_two_ranks_agree_bitwise_and_shards_match(tmp_path):
    configs = [{}, {"rope_type": "default", "rope_theta": 500000.0, "partial_rotary_factor": 0.5}]
    # Every registered type, with the parameters the figures use (head_dim 16, trained length 16, factor 4).
    configs += [{"rope_type": name, **EXAMPLE_ROPE_PARAMETERS[name](16, 16, 4.0)} for name in SCALINGS]
    result = run_torchrun(WORKER, str(tmp_path), json.dumps(configs))
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert (tmp_path / "ok-0").exists() and (tmp_path / "ok-1").exists()
