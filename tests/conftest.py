"""Suite-wide setup.

On machines without a GPU the Triton kernels are tested through Triton's interpreter on CPU tensors. Triton reads
TRITON_INTERPRET when a kernel is decorated, so it must be set before any test module (kernels, interop, lab...)
imports ``posenc.kernels.triton_rope``: this root conftest is loaded before every test module. On a GPU machine
scripts/gpu_check.sh sets POSENC_TRITON_NATIVE=1 to run the same tests compiled for CUDA.
"""

import os
import subprocess
import sys
import textwrap

import pytest

if os.environ.get("POSENC_TRITON_NATIVE") != "1":
    os.environ.setdefault("TRITON_INTERPRET", "1")

HOLDER = textwrap.dedent(
    """
    import sys
    from pathlib import Path
    from posenc.lab.lock import FolderLock
    held = FolderLock(Path(sys.argv[1]), "posenc lab --preset quick --out elsewhere")
    print("locked", flush=True)
    sys.stdin.read()  # until the test closes stdin or kills this process
    """
)


@pytest.fixture
def hold_folder():
    """hold_folder(folder) -> the Popen of another process that holds the folder's lab lock, as a running ``posenc
    lab --preset quick --out elsewhere`` would, until the test ends (or kills it)."""
    held: list[subprocess.Popen] = []

    def hold(folder):
        proc = subprocess.Popen(
            [sys.executable, "-c", HOLDER, str(folder)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )
        held.append(proc)
        assert proc.stdout.readline() == "locked\n"
        return proc

    yield hold
    for proc in held:
        proc.kill()
        proc.wait()
