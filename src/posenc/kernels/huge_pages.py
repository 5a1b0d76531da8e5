"""Transparent huge pages under the big new outputs that the kernels write on CPU.

A big output is fresh memory: with its defaults glibc maps a block of 32 MiB or more on its own (a thread's arena may
still serve one from memory it holds) and unmaps it when freed, so each call faults the output in again, and the OS
zero-fills it 4 KiB at a time (8192 faults for q (1, 32, 4096, 128) in bf16): most of an out-of-place rotation's
time. Where the OS gives huge pages only to memory that asks for them (THP mode 'madvise', Debian's and Ubuntu's
default), ``advised`` asks, with madvise(MADV_HUGEPAGE), for the whole 2 MiB pages inside such an output before the
kernel writes it: one fault per 2 MiB, and the kernel then streams its stores (cpu_rope.cpp, "Huge pages"). Every
byte of those pages is written, so no memory is added.

Only where the advice dies with the tensor: the block must be one that glibc's allocator mapped on its own (its chunk
header says so), which it unmaps, advice and all, when the tensor is freed. An allocator that keeps big blocks for
later (jemalloc or tcmalloc preloaded, glibc with a raised mmap threshold) would hand the advised range to other
allocations, and it usually recycles that memory already in place (no faults to save), so those outputs are left
alone. Stop 64 asked inside the kernel, for any fresh output, and had to stay opt-in for that reason.

On by default; ``POSENC_HUGE_PAGES=0`` (or ``set_enabled(False)``) turns it off, as a process that cannot afford the
OS compacting memory to find a free huge page at a fault (THP ``defrag`` setting 'madvise', the default) may want.
"""

from __future__ import annotations

import ctypes
import functools
import mmap
import os
from pathlib import Path

import torch

from posenc._checks import compiling

MIN_BYTES = 32 << 20  # glibc's largest adaptive mmap threshold: blocks this large are mostly mappings of their own
_THP = Path("/sys/kernel/mm/transparent_hugepage")
_IS_MMAPPED = 0x2  # glibc's chunk header: the bit of the size field that says the chunk is a mapping of its own
_MADV_HUGEPAGE = getattr(mmap, "MADV_HUGEPAGE", None)
_enabled: bool | None = None  # None: from the environment, at the first use


@functools.cache
def thp_mode() -> str:
    """The OS's transparent huge page mode: 'always', 'madvise' or 'never'; 'unsupported' where there is none
    (not Linux, or a kernel without them)."""
    try:
        text = (_THP / "enabled").read_text()
    except OSError:
        return "unsupported"
    start, end = text.find("["), text.find("]")
    return text[start + 1 : end] if 0 <= start < end else "unsupported"


@functools.cache
def huge_page_bytes() -> int:
    """The size of the OS's transparent huge pages where it gives them ('always', or 'madvise' to memory that asks);
    0 where it gives none ('never', unsupported). The CPU kernel looks for pages of this size under its outputs."""
    if thp_mode() not in ("always", "madvise"):
        return 0
    try:
        size = int((_THP / "hpage_pmd_size").read_text())
    except (OSError, ValueError):
        return 0
    return size if size > 0 and size & (size - 1) == 0 else 0


def _from_environment() -> bool:
    value = os.environ.get("POSENC_HUGE_PAGES", "").strip().lower()
    if value not in ("", "0", "1", "false", "true", "no", "yes", "off", "on"):
        raise ValueError(f"POSENC_HUGE_PAGES must be 1 (ask for huge pages, the default) or 0 (do not), got {value!r}")
    return value not in ("0", "false", "no", "off")


def enabled() -> bool:
    """Whether ``advised`` asks for huge pages (turned on, which is the default; see ``set_enabled``)."""
    global _enabled
    if _enabled is None:
        _enabled = _from_environment()
    return _enabled


def set_enabled(on: bool | None) -> bool:
    """Turn asking on or off; None restores the default: on, unless ``POSENC_HUGE_PAGES=0`` (or false/no/off) is in
    the environment. Returns whether it was on before."""
    global _enabled
    before = enabled()
    _enabled = _from_environment() if on is None else bool(on)
    return before


@functools.cache
def _glibc() -> ctypes.CDLL | None:
    """glibc, where it is the allocator under torch's CPU tensors (torch's allocator calls posix_memalign, which
    resolves to the first definition loaded: a preloaded jemalloc or tcmalloc replaces glibc's); else None."""
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.gnu_get_libc_version  # noqa: B018 - only glibc has it
        first = ctypes.CDLL(None)
    except (OSError, AttributeError):
        return None
    names = ("posix_memalign", "malloc", "free")
    try:
        if any(
            ctypes.cast(getattr(first, n), ctypes.c_void_p).value
            != ctypes.cast(getattr(libc, n), ctypes.c_void_p).value
            for n in names
        ):
            return None
    except AttributeError:
        return None
    libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    libc.madvise.restype = ctypes.c_int
    return libc


def why_not() -> str:
    """Why ``advised`` asks for no huge pages in this process, or "" where it asks: it must be turned on, the THP
    mode 'madvise', glibc's allocator under torch's CPU tensors (not torch's mobile allocator either, which puts
    guard bytes before them), and torch not asking for every buffer itself (``THP_MEM_ALLOC_ENABLE=1``)."""
    if not enabled():
        return "POSENC_HUGE_PAGES=0"
    if thp_mode() != "madvise" or _MADV_HUGEPAGE is None:
        return f"THP {thp_mode()}"
    if _glibc() is None:
        return "the allocator is not glibc's"
    if os.environ.get("THP_MEM_ALLOC_ENABLE") == "1":
        return "THP_MEM_ALLOC_ENABLE=1: torch asks itself"
    if torch._C._is_default_mobile_cpu_allocator_set():
        return "torch's mobile allocator"
    return ""


def asks() -> bool:
    """Whether ``advised`` asks for huge pages in this process (``why_not``)."""
    return not why_not()


def _own_mapping(ptr: int, nbytes: int) -> bool:
    """Whether the block at ``ptr``, which torch's CPU allocator returned for ``nbytes``, is a mapping of its own
    that glibc unmaps when it is freed: the chunk header just before ``ptr`` (its offset from the mapping's start,
    then its size with the IS_MMAPPED bit) says so, and both ends of the mapping it describes fall on pages."""
    word = ctypes.sizeof(ctypes.c_size_t)
    page = mmap.PAGESIZE
    header = ptr - 2 * word
    # Torch's allocator aligns to 64 bytes, so glibc's header shares ptr's page, which is mapped. Where ptr starts a
    # page, the page before may be a gap or a guard page (a tensor over a mapping of its own); torch aligns so only
    # with THP_MEM_ALLOC_ENABLE=1, and then it asks for huge pages itself.
    if header // page != ptr // page:
        return False
    lead, size = (ctypes.c_size_t.from_address(header + i * word).value for i in range(2))
    chunk = size & ~0x7
    # A chunk of glibc's could hold the block: the bytes plus at most two pages of header, alignment and rounding.
    return (
        bool(size & _IS_MMAPPED)
        and nbytes <= chunk <= nbytes + 2 * page
        and lead < page
        and (header - lead) % page == 0
        and (header + chunk) % page == 0
    )


def advised(out: torch.Tensor) -> torch.Tensor:
    """``out``, a tensor just allocated by torch's CPU allocator (``torch.empty_like``) that the caller writes whole
    next, given huge pages where that is safe and saves faults (module docstring): at least ``MIN_BYTES``, its own
    block from its first byte, which glibc mapped on its own; only the whole huge pages inside it are asked for.
    Every other tensor is returned as is."""
    # Plain tensors only: not traced (torch.compile, FakeTensor, symbolic sizes) or wrapped ones (torch.func), which
    # have no memory to advise. (compiling(): torch's own query is True in every thread while one compiles.)
    if type(out) is not torch.Tensor or not out.is_cpu or compiling() or out.nbytes < MIN_BYTES:
        return out
    if torch._C._functorch.is_functorch_wrapped_tensor(out) or not asks():
        return out
    nbytes = out.nbytes
    ptr = out.data_ptr()
    storage = out.untyped_storage()
    if ptr == 0 or storage.data_ptr() != ptr or storage.nbytes() != nbytes or not _own_mapping(ptr, nbytes):
        return out
    page = huge_page_bytes()
    first, last = -(-ptr // page) * page, (ptr + nbytes) // page * page
    if last > first:
        _glibc().madvise(first, last - first, _MADV_HUGEPAGE)  # a refusal (EINVAL, ENOMEM) leaves 4 KiB pages
    return out
