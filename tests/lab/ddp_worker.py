"""Run by torchrun from test_ddp.py; not collected by pytest (no test_ prefix).

Runs ``posenc lab`` with the given arguments, exactly as the command line does, and records what this process
did to LOG_DIR/rank<RANK>.json: the exit status, every file it wrote (every write, the lab's and the report's,
goes through ``posenc._atomic.atomic_path``), and everything it printed to stdout and stderr (progress bars
included).
Usage: python ddp_worker.py LOG_DIR lab-arguments...
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import sys
from pathlib import Path

import torch.distributed as dist

from posenc import _atomic
from posenc.cli import main


def run(log_dir: str, argv: list[str]) -> int:
    rank = int(os.environ.get("RANK", "0"))
    written: list[str] = []
    real_atomic_path = _atomic.atomic_path

    @contextlib.contextmanager
    def recording(path: Path, **options):
        written.append(str(path))
        with real_atomic_path(path, **options) as tmp:
            yield tmp

    _atomic.atomic_path = recording
    stdout, stderr = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
        status = main(["lab", *argv])
    log = {"status": status, "written": written, "stdout": stdout.getvalue(), "stderr": stderr.getvalue()}
    log["left_the_group"] = not dist.is_initialized()  # the lab joins torchrun's group for the run, then leaves it
    Path(log_dir, f"rank{rank}.json").write_text(json.dumps(log))
    return status


if __name__ == "__main__":
    sys.exit(run(sys.argv[1], sys.argv[2:]))
