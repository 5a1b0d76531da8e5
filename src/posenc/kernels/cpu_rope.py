"""CPU fast path: build ``cpu_rope.cpp`` once per machine (cached on disk) and call it through ctypes.

Why a C++ file and not torch operations: rotation is memory-bound, and any arrangement of torch ops makes several
passes (and, for bf16/fp16, float32 temporaries); one loop that reads each element once and writes it once runs
at copy speed (docs/benchmarks.md has the measurements). The file includes no torch header, so the build takes
about a second with the system C++ compiler; when no compiler works, ``cpu_available()`` is False and "auto"
falls back to the pure-torch path.

The launcher takes the canonical views of ``posenc.kernels.layout``: x and out (n0, n1, n2, d) with unit last
stride, cos/sin (c0, c1, rows, r/2) read at (i0, i1, pos), and optional per-token positions.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

SOURCE = Path(__file__).with_name("cpu_rope.cpp")
# -march=native: the build happens on the machine that runs it, and the cache key includes the CPU model.
# -ffp-contract=fast lets the compiler fuse x1*cos - x2*sin into one rounding (closer to the float64 result).
FLAGS = ("-O3", "-march=native", "-ffp-contract=fast", "-fopenmp", "-shared", "-fPIC", "-std=c++17")
GRAIN = 32768  # elements per thread, at::internal::GRAIN_SIZE
DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2, torch.float64: 3}


class _Args(ctypes.Structure):
    # Mirrors `struct Args` in cpu_rope.cpp field by field.
    _fields_ = (
        ("x", ctypes.c_void_p),
        ("out", ctypes.c_void_p),
        ("cos", ctypes.c_void_p),
        ("sin", ctypes.c_void_p),
        ("pos", ctypes.c_void_p),
        ("n", ctypes.c_int64 * 3),
        ("d", ctypes.c_int64),
        ("half", ctypes.c_int64),
        ("xs", ctypes.c_int64 * 3),
        ("os", ctypes.c_int64 * 3),
        ("cs", ctypes.c_int64 * 3),
        ("ps", ctypes.c_int64 * 2),
        ("interleaved", ctypes.c_int32),
        ("conjugate", ctypes.c_int32),
        ("copy_tail", ctypes.c_int32),
        ("threads", ctypes.c_int32),
    )


def _cache_dir() -> Path:
    root = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "posenc"
    try:
        root.mkdir(parents=True, exist_ok=True)
        if os.access(root, os.W_OK):
            return root
    except OSError:
        pass
    return Path(tempfile.gettempdir()) / f"posenc-{os.getuid()}"


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("model name", "flags")):
                return line
    except OSError:
        pass
    return platform.processor()


def build_library(source: bytes) -> tuple[ctypes.CDLL | None, str]:
    """Compile ``source`` (the text of cpu_rope.cpp, this one or another revision's) into a shared library cached
    on disk under a hash of the source, flags, compiler and CPU, and load it: (library, "") or (None, why not)."""
    compiler = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")
    if compiler is None:
        return None, "no C++ compiler found (set CXX or install g++)"
    try:
        version = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError) as error:
        return None, f"{compiler} --version failed: {error}"
    key = hashlib.sha256(b"\0".join([source, " ".join(FLAGS).encode(), version.encode(), _cpu_model().encode()]))
    directory = _cache_dir()
    target = directory / f"cpu_rope_{key.hexdigest()[:16]}.so"
    if not target.exists():
        directory.mkdir(parents=True, exist_ok=True)
        # Build under unique names and rename: concurrent first uses (test workers) never see half a file.
        with tempfile.TemporaryDirectory(dir=directory) as scratch:
            source_path, partial = Path(scratch) / SOURCE.name, Path(scratch) / "partial.so"
            source_path.write_bytes(source)
            result = subprocess.run(
                [compiler, *FLAGS, str(source_path), "-o", str(partial)], capture_output=True, text=True, timeout=300
            )
            if result.returncode != 0:
                return None, f"building {SOURCE.name} failed:\n{result.stderr[-2000:]}"
            os.replace(partial, target)
    library = ctypes.CDLL(str(target))
    library.posenc_rope.argtypes = (ctypes.POINTER(_Args), ctypes.c_int32, ctypes.c_int32)
    library.posenc_rope.restype = ctypes.c_int
    return library, ""


@functools.cache
def _library() -> tuple[ctypes.CDLL | None, str]:
    """(the loaded library built from this package's cpu_rope.cpp, "") or (None, why it could not be built)."""
    return build_library(SOURCE.read_bytes())


def cpu_available() -> bool:
    """True when the fused CPU kernel is built (or builds now) and loads."""
    return _library()[0] is not None


def cpu_unavailable_reason() -> str:
    return _library()[1]


def _strides(t: torch.Tensor) -> ctypes.Array:
    return (ctypes.c_int64 * 3)(*t.stride()[:3])


def rope_cpu(
    x: torch.Tensor,
    out: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    positions: torch.Tensor | None,
    *,
    interleaved: bool,
    conjugate: bool,
    copy_tail: bool,
    library: ctypes.CDLL | None = None,
) -> None:
    """Write the rotation of x into out (which may be x itself). No autograd.

    x, out: (n0, n1, n2, d) CPU, same dtype (float32/bfloat16/float16/float64), unit last stride;
    cos, sin: (c0, c1, rows, r/2) views (strides may be 0) with unit last stride, float32 or float64;
    positions: None (row = i2) or (n0 or 1, n2) int64, the cos/sin row of each token.
    copy_tail: also copy channels r..d-1 (out-of-place); in place they are already there.
    library: one from ``build_library`` (benchmarks compare kernel revisions); default this package's.
    """
    reason = ""
    if library is None:
        library, reason = _library()
    if library is None:
        raise RuntimeError(f"the CPU rotary kernel is unavailable: {reason}; use backend='torch'")
    if x.dim() != 4 or out.shape != x.shape:
        raise ValueError(f"x and out must be (n0, n1, n2, d) of one shape, got {tuple(x.shape)} and {tuple(out.shape)}")
    for name, t in (("x", x), ("out", out), ("cos", cos), ("sin", sin)):
        if t.device.type != "cpu":
            raise ValueError(f"{name} is on {t.device}; the CPU kernel reads CPU tensors only")
        if t.shape[-1] > 1 and t.stride(-1) != 1:
            raise ValueError(
                f"{name} must have unit stride in its last dim, got strides {t.stride()}; pass .contiguous()"
            )
    if x.dtype not in DTYPE_CODES or out.dtype != x.dtype:
        raise TypeError(f"x and out must share a dtype among {list(DTYPE_CODES)}, got {x.dtype} and {out.dtype}")
    if cos.dtype not in (torch.float32, torch.float64) or sin.dtype != cos.dtype:
        raise TypeError(f"cos and sin must both be float32 or both float64, got {cos.dtype} and {sin.dtype}")
    wide = cos.dtype == torch.float64
    if x.dtype == torch.float64 and not wide:
        raise TypeError("float64 x needs float64 cos/sin (the math runs in the wider dtype)")
    if cos.dim() != 4 or cos.stride() != sin.stride() or cos.shape != sin.shape:
        raise ValueError(f"cos and sin must be 4-D views of one shape and strides, got {tuple(cos.shape)}")
    if positions is not None and (positions.dtype != torch.long or positions.dim() != 2):
        raise TypeError(f"positions must be a 2-D int64 tensor, got {positions.dtype} {tuple(positions.shape)}")
    if x.numel() == 0:
        return
    pos_strides = (0, 0)
    if positions is not None:
        pos_strides = (positions.stride(0) if positions.shape[0] > 1 else 0, positions.stride(1))
    args = _Args(
        x.data_ptr(),
        out.data_ptr(),
        cos.data_ptr(),
        sin.data_ptr(),
        positions.data_ptr() if positions is not None else None,
        (ctypes.c_int64 * 3)(*x.shape[:3]),
        x.shape[3],
        cos.shape[3],
        _strides(x),
        _strides(out),
        (ctypes.c_int64 * 3)(*(0 if cos.shape[i] == 1 else cos.stride(i) for i in range(3))),
        (ctypes.c_int64 * 2)(*pos_strides),
        int(interleaved),
        int(conjugate),
        int(copy_tail),
        # Like torch's own kernels, small tensors stay on one thread: waking others costs more than they save.
        max(1, min(torch.get_num_threads(), x.numel() // GRAIN)),
    )
    if library.posenc_rope(ctypes.byref(args), DTYPE_CODES[x.dtype], int(wide)) != 0:
        raise TypeError(f"the CPU kernel has no variant for x {x.dtype} with cos/sin {cos.dtype}")
