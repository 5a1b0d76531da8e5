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
import stat
import struct
import subprocess
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NamedTuple

import torch

from posenc.kernels import huge_pages
from posenc.kernels.recording import record

SOURCE = Path(__file__).with_name("cpu_rope.cpp")
# -march=native by default: the build happens on the machine that runs it, and the cache key includes the CPU's
# model and feature flags. -ffp-contract=fast lets the compiler fuse x1*cos - x2*sin into one rounding (closer to
# the float64 result).
FLAGS = ("-O3", "-ffp-contract=fast", "-fopenmp", "-shared", "-fPIC", "-std=c++17")
GRAIN = 32768  # elements per thread, at::internal::GRAIN_SIZE
DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2, torch.float64: 3}


# Mirrors `struct Args` in cpu_rope.cpp: five pointers (x, out, cos, sin, pos), sixteen int64 (n[3], d, half,
# xs[3], os[3], cs[3], ps[2]), four int32 (interleaved, conjugate, copy_tail, threads) and the table's rows (int64).
# Packed with struct, which costs a microsecond where building a ctypes.Structure with its arrays cost about ten.
_ARGS = struct.Struct("=5Q16q4iq")
# The five pointers that begin it, which ``posenc.kernels.replay`` fills in, and the index of n[2] (the tokens a
# job reads rows for) among its fields.
_POINTERS = struct.Struct("=5Q")
_SEQ_FIELD = 7


class Launch(NamedTuple):
    """One call into the kernel library: the packed ``struct Args`` of each job and the call's other arguments."""

    jobs: tuple[bytes, ...]
    code: int
    wide: int
    run: Any  # the library's posenc_rope_jobs


def _cache_dir() -> Path:
    root = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "posenc"
    try:
        root.mkdir(parents=True, exist_ok=True)
        if os.access(root, os.W_OK):
            return root
    except OSError:
        pass
    # The temp dir is shared with other users, and a library's name is a hash of facts anyone can read: a folder
    # there that another user owns or may write into could hold a library of theirs under that name, which this
    # process would load. Such a folder is refused for a private one of this process.
    if hasattr(os, "getuid"):
        shared = Path(tempfile.gettempdir()) / f"posenc-{os.getuid()}"
        try:
            shared.mkdir(mode=0o700, exist_ok=True)
            info = shared.lstat()
            if stat.S_ISDIR(info.st_mode) and info.st_uid == os.getuid() and not info.st_mode & 0o022:
                return shared
        except OSError:
            pass
    return Path(tempfile.mkdtemp(prefix="posenc-"))


def _cpu_model() -> str:
    """The first CPU's model name and feature flags: a -march=native build runs only where both match (VMs often
    report one generic name, "AMD EPYC", for several generations of cores)."""
    found: dict[str, str] = {}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key = line.split(":", 1)[0].strip()
            if key in ("model name", "flags", "Features", "CPU part") and key not in found:
                found[key] = line
    except OSError:
        pass
    return "\n".join(found.values()) or platform.processor()


_DEFAULTS_SET: set[str] = set()  # paths of the libraries given their default streaming threshold and huge page size


def build_library(source: bytes, *, arch: str = "native") -> tuple[ctypes.CDLL | None, str]:
    """Compile ``source`` (the text of cpu_rope.cpp, this one or another revision's) into a shared library cached
    on disk under a hash of the source, flags, compiler and CPU, and load it: (library, "") or (None, why not).

    arch: the compiler's ``-march``. The package builds for ``native``; the tests also build for older x86 levels
    (``x86-64-v3``: AVX2 without AVX-512) so the loops that other CPUs run are checked here too. Loading a build
    for instructions this CPU lacks would crash at the first call: check the CPU first.
    """
    flags = (f"-march={arch}", *FLAGS)
    compiler = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")
    if compiler is None:
        return None, "no C++ compiler found (set CXX or install g++)"
    try:
        version = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError) as error:
        return None, f"{compiler} --version failed: {error}"
    key = hashlib.sha256(b"\0".join([source, " ".join(flags).encode(), version.encode(), _cpu_model().encode()]))
    directory = _cache_dir()
    target = directory / f"cpu_rope_{key.hexdigest()[:16]}.so"
    if not target.exists():
        try:
            directory.mkdir(parents=True, exist_ok=True)
            # Build under unique names and rename: concurrent first uses (test workers) never see half a file.
            with tempfile.TemporaryDirectory(dir=directory) as scratch:
                source_path, partial = Path(scratch) / SOURCE.name, Path(scratch) / "partial.so"
                source_path.write_bytes(source)
                result = subprocess.run(
                    [compiler, *flags, str(source_path), "-o", str(partial)],
                    capture_output=True,
                    text=True,
                    timeout=300,
                )
                if result.returncode != 0:
                    return None, f"building {SOURCE.name} failed:\n{result.stderr[-2000:]}"
                os.replace(partial, target)
        except (OSError, subprocess.SubprocessError) as error:  # a full disk, a compiler past its time limit
            return None, f"building {SOURCE.name} in {directory} failed: {error}"
    try:
        library = ctypes.CDLL(str(target))
    except OSError as error:
        # Built, but not loadable: a cache on a filesystem mounted noexec (a hardened /tmp or home) maps no code.
        return None, (
            f"loading the built kernel failed: {error}; set XDG_CACHE_HOME to a folder on a filesystem that allows "
            "executing programs (not mounted noexec)"
        )
    library.posenc_rope.argtypes = (ctypes.c_char_p, ctypes.c_int32, ctypes.c_int32)
    library.posenc_rope.restype = ctypes.c_int
    if hasattr(library, "posenc_rope_jobs"):  # older revisions (benchmarks/cpu_kernel_ab.py) have one job a call
        library.posenc_rope_jobs.argtypes = (ctypes.c_char_p, ctypes.c_int32, ctypes.c_int32, ctypes.c_int32)
        library.posenc_rope_jobs.restype = ctypes.c_int
    if hasattr(library, "posenc_stream_jobs"):  # and no streaming stores
        library.posenc_stream_jobs.argtypes = (ctypes.c_char_p, ctypes.c_int32, ctypes.c_int32)
        library.posenc_stream_jobs.restype = ctypes.c_uint64
        library.posenc_set_stream_threshold.argtypes = (ctypes.c_int64,)
        library.posenc_set_stream_threshold.restype = ctypes.c_int64
        library.posenc_can_stream.restype = ctypes.c_int
    if hasattr(library, "posenc_set_huge_page_size"):
        library.posenc_set_huge_page_size.argtypes = (ctypes.c_int64,)
        library.posenc_set_huge_page_size.restype = ctypes.c_int64
    if hasattr(library, "posenc_last_streams"):  # a build of 3248472 has the size without it
        library.posenc_last_streams.restype = ctypes.c_uint64
    # Loading a library again returns the same handle: only its first load sets the defaults, so a setting made
    # since (by a test or a benchmark) stays.
    if str(target) not in _DEFAULTS_SET:
        if hasattr(library, "posenc_set_stream_threshold"):
            library.posenc_set_stream_threshold(last_level_cache_bytes())
        if hasattr(library, "posenc_set_huge_page_size"):
            library.posenc_set_huge_page_size(huge_pages.huge_page_bytes())
        elif hasattr(library, "posenc_set_huge_pages"):
            # Builds of 94d6c93..61b791c advise their outputs themselves when given a size: leave the pages to
            # posenc.kernels.huge_pages, as this revision's kernel does (benchmarks/cpu_kernel_ab.py).
            library.posenc_set_huge_pages.argtypes = (ctypes.c_int64,)
            library.posenc_set_huge_pages(0)
        _DEFAULTS_SET.add(str(target))
    return library, ""


@functools.cache
def last_level_cache_bytes() -> int:
    """The size of the CPU's largest cache as Linux's sysfs gives it (what lscpu reads; glibc's sysconf reports
    ten times the VM's L3 on some hypervisors), else 32 MiB."""
    sizes = []
    for entry in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*"):
        try:
            level, size = int((entry / "level").read_text()), (entry / "size").read_text().strip()
            scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(size[-1:], 1)
            sizes.append((level, int(size.rstrip("KMG")) * scale))
        except (OSError, ValueError):
            continue
    return max(sizes)[1] if sizes else 32 << 20


@functools.cache
def _library() -> tuple[ctypes.CDLL | None, str]:
    """(the loaded library built from this package's cpu_rope.cpp, "") or (None, why it could not be built)."""
    return build_library(SOURCE.read_bytes())


def cpu_available() -> bool:
    """True when the fused CPU kernel is built (or builds now) and loads."""
    return _library()[0] is not None


def cpu_unavailable_reason() -> str:
    return _library()[1]


Job = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]


def _loaded(library: ctypes.CDLL | None = None) -> ctypes.CDLL:
    """``library``, else this package's, or a RuntimeError saying why the kernel could not be built."""
    library = library or _library()[0]
    if library is None:
        raise RuntimeError(f"the CPU rotary kernel is unavailable: {cpu_unavailable_reason()}; use backend='torch'")
    return library


def set_stream_threshold(nbytes: int | None, *, library: ctypes.CDLL | None = None) -> int:
    """Set how many bytes a call must write out of place before its stores bypass the cache (non-temporal stores,
    only into pages already in memory; cpu_rope.cpp says when that pays); None restores the default,
    ``last_level_cache_bytes()``. Returns the previous setting. For tests and benchmarks."""
    library = _loaded(library)
    if nbytes is not None and nbytes < 0:
        raise ValueError(f"nbytes must be >= 0, or None for the default, got {nbytes}")
    return library.posenc_set_stream_threshold(last_level_cache_bytes() if nbytes is None else nbytes)


def can_stream(library: ctypes.CDLL | None = None) -> bool:
    """Whether the kernel (this package's, or ``library``) has streaming stores at all: its vector rows (AVX2 or
    AVX-512) do, on Linux; the portable loop does not."""
    library = library or _library()[0]
    return library is not None and bool(library.posenc_can_stream())


def streams(x: torch.Tensor, out: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> bool:
    """Whether ``rope_cpu(x, out, cos, sin, None, ...)`` would use streaming stores now (see
    ``set_stream_threshold``): the kernel's own decision, for tests and benchmarks, asking writes nothing. Where
    ``out``'s pages are not in memory yet, the call itself faults in the first whole huge page inside it to see
    whether it is one (cpu_rope.cpp, "Huge pages"), which this cannot: see ``last_streams``."""
    library = _loaded()
    job = _pack_job(x, out, cos, sin, 0, (0, 0), 0, (0, 0, 1), 1)[0]
    return job is not None and bool(library.posenc_stream_jobs(job, 1, DTYPE_CODES[x.dtype]) & 1)


def last_streams(library: ctypes.CDLL | None = None) -> int:
    """Which jobs (bit j for job j) the last call into the kernel library in this process streamed its stores
    for: what tests check where ``streams`` cannot tell before the call."""
    return int(_loaded(library).posenc_last_streams())


def rope_cpu(
    x: torch.Tensor,
    out: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    positions: torch.Tensor | None,
    *,
    first_row: int = 0,
    interleaved: bool,
    conjugate: bool,
    copy_tail: bool,
    library: ctypes.CDLL | None = None,
) -> None:
    """Write the rotation of x into out (which may be x itself). No autograd.

    x, out: (n0, n1, n2, d) CPU, same dtype (float32/bfloat16/float16/float64), unit last stride;
    cos, sin: float32 or float64 with unit last stride and one set of strides, either (c0, c1, rows, r/2) views
    (strides may be 0) read at (i0, i1, row), or (rows, r/2) tables read at row for every (i0, i1);
    positions: None (row = first_row + i2) or (n0 or 1, n2) int64 (row = positions[i0, i2]; the kernel refuses,
    before writing anything, a position outside the table: a ValueError);
    first_row: the first table row read without positions (an int offset); must be 0 with positions;
    copy_tail: also copy channels r..d-1 (out-of-place); in place they are already there.
    library: one from ``build_library`` (benchmarks compare kernel revisions); default this package's.
    """
    rope_cpu_jobs(
        [(x, out, cos, sin)],
        positions,
        first_row=first_row,
        interleaved=interleaved,
        conjugate=conjugate,
        copy_tail=copy_tail,
        library=library,
    )


def rope_cpu_jobs(
    jobs: Sequence[Job],
    positions: torch.Tensor | None,
    *,
    first_row: int = 0,
    interleaved: bool,
    conjugate: bool,
    copy_tail: bool,
    library: ctypes.CDLL | None = None,
) -> None:
    """``rope_cpu`` for several (x, out, cos, sin) of one dtype (q and k) in one call into the library."""
    if library is not None and len(jobs) > 1 and library is not _library()[0]:
        # Another revision's struct Args may be shorter: its posenc_rope_jobs would step through the jobs wrongly.
        raise ValueError("a library other than this package's takes one job per call; call rope_cpu once per x")
    library = _loaded(library)
    if positions is not None:
        if first_row:
            raise ValueError(f"first_row={first_row} applies only without positions; add it to the positions")
        if positions.dtype != torch.long or positions.dim() != 2 or not positions.is_cpu:
            raise TypeError(f"positions must be a 2-D int64 CPU tensor, got {positions.dtype} {tuple(positions.shape)}")
        pos_ptr = positions.data_ptr()
        pos_strides = (positions.stride(0) if positions.shape[0] > 1 else 0, positions.stride(1))
    else:
        pos_ptr, pos_strides = 0, (0, 0)
    flags = (int(interleaved), int(conjugate), int(copy_tail))
    threads = torch.get_num_threads()
    packed, dtype, wide = [], None, False
    angles, angles_of = None, None  # cos/sin's, checked, and the (cos, sin) they are of: jobs share them (q and k)
    for x, out, cos, sin in jobs:
        if dtype is None:
            dtype, wide = x.dtype, cos.dtype == torch.float64
        elif x.dtype != dtype or (cos.dtype == torch.float64) != wide:
            raise TypeError("every job of one call must share x's dtype and cos/sin's dtype")
        if angles_of is not None and (angles_of[0] is not cos or angles_of[1] is not sin):
            angles = None
        job, angles = _pack_job(x, out, cos, sin, pos_ptr, pos_strides, first_row, flags, threads, angles)
        angles_of = (cos, sin)
        if job is not None:
            packed.append(job)
    if not packed:
        return
    code = DTYPE_CODES[dtype]
    if library is _library()[0]:  # the package's own: a call that posenc.kernels.replay may repeat
        record(Launch(tuple(packed), code, int(wide), library.posenc_rope_jobs))
    if len(packed) == 1:
        status = library.posenc_rope(packed[0], code, int(wide))
    else:
        status = library.posenc_rope_jobs(b"".join(packed), len(packed), code, int(wide))
    if status == 2:
        low, high, rows = int(positions.min()), int(positions.max()), jobs[0][2].shape[-2]  # type: ignore[union-attr]
        raise ValueError(
            f"positions reach {low} .. {high} but the cos/sin table has {rows} rows: each must be in 0 .. {rows - 1}; "
            "build the table for more positions (found by the kernel: under torch.compile nothing checks them before)"
        )
    if status != 0:
        raise TypeError(f"the CPU kernel has no variant for x {dtype} with cos/sin {'float64' if wide else 'float32'}")


class _Angles(NamedTuple):
    """What ``_pack_job`` reads of cos/sin, read and checked once for all the jobs of a call that share them (q and
    k: ~1.5 us of a decode step's second job)."""

    shape: tuple[int, int, int, int]  # (c0, c1, rows, r/2); a (rows, r/2) table as (1, 1, rows, r/2)
    strides: tuple[int, int, int, int]
    table: bool
    wide: bool  # float64
    cos_ptr: int
    sin_ptr: int
    element_size: int


def _angles(cos: torch.Tensor, sin: torch.Tensor) -> _Angles:
    """cos/sin's own checks (``_pack_job``'s that do not involve x), and what the jobs read of them."""
    cos_shape, cos_strides = cos.shape, cos.stride()
    if cos.dtype not in (torch.float32, torch.float64) or sin.dtype != cos.dtype:
        raise TypeError(f"cos and sin must both be float32 or both float64, got {cos.dtype} and {sin.dtype}")
    if sin.shape != cos_shape or sin.stride() != cos_strides:
        raise ValueError(f"cos and sin must be views of one shape and strides, got {tuple(cos_shape)}")
    table = len(cos_shape) == 2
    if table:  # a (rows, r/2) table: the same rows for every (i0, i1)
        cos_shape, cos_strides = (1, 1, *cos_shape), (0, 0, *cos_strides)
    elif len(cos_shape) != 4:
        raise ValueError(f"cos/sin must be (rows, r/2) tables or 4-D (c0, c1, rows, r/2) views, got {tuple(cos_shape)}")
    if cos_shape[3] > 1 and cos_strides[3] != 1:
        raise ValueError(f"cos/sin must have unit stride in their last dim, got {cos_strides}; pass .contiguous()")
    return _Angles(
        tuple(cos_shape),  # type: ignore[arg-type]
        tuple(cos_strides),  # type: ignore[arg-type]
        table,
        cos.dtype == torch.float64,
        cos.data_ptr(),
        sin.data_ptr(),
        cos.element_size(),
    )


def _pack_job(
    x: torch.Tensor,
    out: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    pos_ptr: int,
    pos_strides: tuple[int, int],
    first_row: int,
    flags: tuple[int, int, int],
    threads: int,
    angles: _Angles | None = None,
) -> tuple[bytes | None, _Angles]:
    """Check what the C code trusts (shapes, dtypes, devices, strides, the rows it reads without positions) and
    pack one job's ``struct Args``: (the bytes, or None for an empty x; cos/sin's ``_Angles``). ``angles``: those of
    this cos and sin from an earlier job of the call, already checked. Each tensor's metadata is read once: on a
    decode step this function is a good part of the call. (With positions, the kernel checks that every one is a
    row of the table.)"""
    shape, x_strides, out_strides = x.shape, x.stride(), out.stride()
    if len(shape) != 4 or out.shape != shape:
        raise ValueError(f"x and out must be (n0, n1, n2, d) of one shape, got {tuple(shape)} and {tuple(out.shape)}")
    if not (x.is_cpu and out.is_cpu and (angles is not None or (cos.is_cpu and sin.is_cpu))):
        devices = ", ".join(f"{n} on {t.device}" for n, t in (("x", x), ("out", out), ("cos", cos), ("sin", sin)))
        raise ValueError(f"the CPU kernel reads CPU tensors only, got {devices}")
    n0, n1, n2, d = shape
    if d > 1 and (x_strides[3] != 1 or out_strides[3] != 1):
        raise ValueError(f"x and out must have unit stride in their last dim, got {x_strides} and {out_strides}")
    if x.dtype not in DTYPE_CODES or out.dtype != x.dtype:
        raise TypeError(f"x and out must share a dtype among {list(DTYPE_CODES)}, got {x.dtype} and {out.dtype}")
    if angles is None:
        angles = _angles(cos, sin)
    if x.dtype == torch.float64 and not angles.wide:
        raise TypeError("float64 x needs float64 cos/sin (the math runs in the wider dtype)")
    cos_shape, cos_strides = angles.shape, angles.strides
    half, rows = cos_shape[3], cos_shape[2]
    if 2 * half > d:
        raise ValueError(f"cos has {half} pairs but x has only {d} channels")
    for axis in (0, 1):
        if cos_shape[axis] != 1 and cos_shape[axis] != shape[axis]:
            raise ValueError(f"cos of shape {tuple(cos_shape)} does not broadcast to x's {tuple(shape[:3])}")
    numel = n0 * n1 * n2 * d
    if numel == 0:  # no rows read (an empty positions tensor also has data_ptr 0, like none)
        return None, angles
    broadcast_row = rows == 1 and first_row == 0 and not angles.table  # a 4-D view's size-1 token axis broadcasts
    if pos_ptr == 0 and not broadcast_row and (first_row < 0 or first_row + n2 > rows):
        raise ValueError(f"tokens read rows {first_row} .. {first_row + n2 - 1} but cos/sin have {rows} rows")
    row_stride = 0 if rows == 1 else cos_strides[2]
    skip = first_row * row_stride * angles.element_size
    job = _ARGS.pack(
        x.data_ptr(),
        out.data_ptr(),
        angles.cos_ptr + skip,
        angles.sin_ptr + skip,
        pos_ptr,
        n0,
        n1,
        n2,
        d,
        half,
        *x_strides[:3],
        *out_strides[:3],
        0 if cos_shape[0] == 1 else cos_strides[0],
        0 if cos_shape[1] == 1 else cos_strides[1],
        row_stride,
        *pos_strides,
        *flags,
        # Like torch's own kernels, small tensors stay on one thread: waking others costs more than they save.
        max(1, min(threads, numel // GRAIN)),
        rows,
    )
    return job, angles
