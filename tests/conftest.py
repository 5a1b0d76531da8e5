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

# pytest-xdist workers (the README's `-n 2`) share the machine's cores: each takes its share of threads, not torch's
# default of one per core. Two workers of two OpenMP threads on 2 cores spin-wait for each other's cores: a tiny lab
# training test took 38 and 186 s, against 15 and 17 s with one thread each (measured side by side under load). Set
# before torch is imported, so that subprocesses (torchrun ranks, benchmark scripts) inherit it; tests that are about
# thread counts set theirs. An OMP_NUM_THREADS given by the caller wins.
if "PYTEST_XDIST_WORKER_COUNT" in os.environ and "OMP_NUM_THREADS" not in os.environ:
    _cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    os.environ["OMP_NUM_THREADS"] = str(max(1, _cores // int(os.environ["PYTEST_XDIST_WORKER_COUNT"])))
    if "torch" in sys.modules:  # imported by a plugin before this file: too late for the variable
        sys.modules["torch"].set_num_threads(int(os.environ["OMP_NUM_THREADS"]))

# The files that take longest, slowest first (seconds of a run alone on the 2-core CI host, `--durations=0`, after
# the second round of cuts of 2026-12-06). The README's command runs whole files on two workers (`-n 2 --dist
# loadfile`): starting these first lets the short files fill in at the end, where xdist's own order (most tests
# first) could leave one worker running a one-test file of 90 s alone. The order changes when a file starts, never
# what runs.
SLOWEST_FIRST = (
    "tests/kernels/test_rope_kernels.py",
    "tests/kernels/test_flex_bias.py",
    "tests/interop/test_patch.py",
    "tests/distributed/test_dtensor_compile.py",
    "tests/lab/test_runner.py",
    "tests/rope/test_module_compile_checks.py",
    "tests/test_benchmarks.py",
    "tests/interop/test_patch_architectures.py",
    "tests/interop/test_patch_gemma_consistent.py",
    "tests/kernels/test_rope_fuzz.py",
    "tests/lab/test_ddp.py",
)


def pytest_configure(config: pytest.Config) -> None:
    if hasattr(config.option, "loadscopereorder"):  # pytest-xdist: keep the order below
        config.option.loadscopereorder = False


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    rank = {path: i for i, path in enumerate(SLOWEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::")[0], len(rank)))  # stable: the rest keep theirs


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
