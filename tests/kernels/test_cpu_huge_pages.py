"""Huge pages under the big new outputs of the CPU rotations (posenc.kernels.huge_pages; cpu_rope.cpp, "Huge pages"):
which pages are asked for, that the advice dies with the tensor, which outputs are left alone (and why), that the
public calls, their replays, the backward and the torch path get them, that the kernel streams into them, and that
the bits do not change."""

from __future__ import annotations

import mmap
import os
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import posenc
from posenc.kernels import cpu_rope, huge_pages
from posenc.kernels.cpu_rope import rope_cpu
from posenc.kernels.huge_pages import MIN_BYTES, advised

asking = pytest.mark.skipif(
    not huge_pages.asks(),
    reason=f"huge pages are not asked for here (THP mode {huge_pages.thp_mode()!r}, glibc's allocator: "
    f"{huge_pages._glibc() is not None}, POSENC_HUGE_PAGES={os.environ.get('POSENC_HUGE_PAGES')!r}, "
    f"THP_MEM_ALLOC_ENABLE={os.environ.get('THP_MEM_ALLOC_ENABLE')!r})",
)
D = 128
# glibc maps a big block on its own only where no free chunk of its heap holds it, which in a process that has run
# many tests (a pytest worker) one may: the tests that need such blocks run in a fresh process of their own
# (test_tests_that_need_glibcs_own_mappings_in_a_fresh_process), and skip elsewhere.
FRESH = os.environ.get("POSENC_TEST_FRESH_PROCESS") == "1"
fresh_process = pytest.mark.skipif(not FRESH, reason="run in a fresh process by the test below them")
FRESH_TESTS = ("big_new_output", "does_not_start_and_fill", "public_calls")


@pytest.fixture
def enabled():
    """Asking on (the default, unless POSENC_HUGE_PAGES=0 was set); the setting restored after."""
    before = huge_pages.set_enabled(True)
    yield huge_pages.huge_page_bytes()
    huge_pages.set_enabled(before)


def mapping_of(address: int, smaps: str | None = None) -> dict | None:
    """The entry of /proc/self/smaps (or of ``smaps``, another process's text of it) for the mapping that holds
    ``address``: start, end, path, VmFlags (a list) and its sizes in KiB (Rss, AnonHugePages, ...); None where no
    mapping holds it."""
    found = None
    for line in (Path("/proc/self/smaps").read_text() if smaps is None else smaps).splitlines():
        fields = line.split()
        if "-" in fields[0] and not fields[0].endswith(":"):
            if found is not None:
                return found
            start, end = (int(part, 16) for part in fields[0].split("-"))
            if start <= address < end:
                found = {"start": start, "end": end, "path": fields[5] if len(fields) > 5 else ""}
        elif found is not None and fields[0] == "VmFlags:":
            found["VmFlags"] = fields[1:]
        elif found is not None and fields[1:2] and fields[1].isdigit():
            found[fields[0].rstrip(":")] = int(fields[1])
    return found


def advised_at(address: int, smaps: str | None = None) -> bool:
    mapping = mapping_of(address, smaps)
    return mapping is not None and "hg" in mapping["VmFlags"]


def whole_pages(out: torch.Tensor, page: int) -> tuple[int, int]:
    start = out.data_ptr()
    return -(-start // page) * page, (start + out.nbytes) // page * page


def big(dtype: torch.dtype = torch.float32, extra_pages: int = 3) -> torch.Tensor:
    """A (1, 1, rows, D) tensor just past MIN_BYTES: glibc maps blocks of that size on their own."""
    size = torch.empty(0, dtype=dtype).element_size()
    return torch.randn(1, 1, (MIN_BYTES + extra_pages * (2 << 20)) // (D * size), D).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@asking
@fresh_process
def test_a_big_new_output_gets_exactly_its_whole_huge_pages_and_they_die_with_it(enabled, dtype):
    page = enabled
    x = big(dtype)
    out = torch.empty_like(x)
    first, last = whole_pages(out, page)
    assert not advised_at(first)
    assert advised(out) is out
    mapping = mapping_of(first)
    assert "hg" in mapping["VmFlags"] and (mapping["start"], mapping["end"]) == (first, last), (
        "the whole huge pages inside the output, and no more"
    )
    assert not advised_at(out.data_ptr()), "not the partial page before them (glibc's header is there)"
    assert not advised_at(out.data_ptr() + out.nbytes - 1) or last == out.data_ptr() + out.nbytes
    del out
    # glibc unmaps the block when the tensor is freed, and the advice goes with it: the next tensor there (or none)
    # is not advised.
    assert not advised_at(first)
    again = torch.empty_like(x)
    assert not advised_at(again.data_ptr() + page), "a later block is advised only when it is an output too"


@asking
def test_outputs_that_would_not_take_the_advice_with_them_are_left_alone(enabled, monkeypatch):
    page = enabled
    x = big()
    small = torch.empty(MIN_BYTES // 4 - 1)  # below MIN_BYTES: glibc may keep such blocks for later
    advised(small)
    assert not advised_at(-(-small.data_ptr() // page) * page + page)
    shared = torch.empty(2 * x.numel())
    view = shared[x.numel() :]  # not its block's first byte: no glibc header before it
    assert advised(view) is view and not advised_at(whole_pages(view, page)[0])
    half = shared[: x.numel()]  # the first byte, but half of the block: the rest is not this caller's to write
    advised(half)
    assert not advised_at(whole_pages(half, page)[0])
    huge_pages.set_enabled(False)
    out = advised(torch.empty_like(x))
    assert not advised_at(whole_pages(out, page)[0]), "turned off"
    monkeypatch.setattr(huge_pages, "_glibc", lambda: None)  # what a preloaded allocator gives (tested below)
    huge_pages.set_enabled(True)
    assert not huge_pages.asks()
    out = advised(torch.empty_like(x))
    assert not advised_at(whole_pages(out, page)[0]), "not glibc's block"


@asking
@fresh_process
def test_a_tensor_that_does_not_start_and_fill_its_block_is_left_alone(enabled):
    """``advised`` reads glibc's header just before the tensor's storage: a tensor that is not the whole of its
    storage, from its first byte, is not the block the header describes (here one that would pass its checks)."""
    page = enabled
    block = torch.empty(MIN_BYTES // 4 + 1024)  # glibc's mapping of its own, 4 KiB more than its first part
    first = block[: MIN_BYTES // 4]
    assert huge_pages._own_mapping(block.data_ptr(), first.nbytes), "the header alone would let it through"
    assert advised(first) is first and not advised_at(whole_pages(first, page)[0]), "not the whole storage"
    # The whole storage's bytes, but not from its first one: a header forged inside the data just before it.
    offset = 1024
    words = block.view(torch.int64)
    header = block.data_ptr() + offset * 4 - 16
    words[offset // 2 - 2] = header % mmap.PAGESIZE  # the offset of the "chunk" from a page
    chunk = -(-(header + block.nbytes) // mmap.PAGESIZE) * mmap.PAGESIZE - header
    words[offset // 2 - 1] = chunk | 0x2
    shifted = block.as_strided((block.numel(),), (0,), offset)  # every element the same float: nbytes as the block's
    assert huge_pages._own_mapping(shifted.data_ptr(), shifted.nbytes), "the forged header would let it through"
    assert advised(shifted) is shifted and not advised_at(whole_pages(block, page)[0]), "not from the first byte"
    assert advised(block) is block and advised_at(whole_pages(block, page)[0]), "the block itself is advised"


def test_only_a_header_that_describes_a_whole_mapping_passes():
    """``_own_mapping`` reads glibc's header (offset from the mapping's start, then size | IS_MMAPPED) as glibc's
    munmap checks it: both ends on pages, and a size that holds the block. Headers written into a buffer here."""
    page = mmap.PAGESIZE
    words = torch.zeros(2 * page // 8, dtype=torch.int64)
    ptr = -(-words.data_ptr() // page) * page + 64  # 64 bytes into a page of the buffer, as torch's blocks start
    if ptr + 8 > words.data_ptr() + words.nbytes:
        ptr -= page
    index = (ptr - words.data_ptr()) // 8
    nbytes = MIN_BYTES + 100

    def reads(lead: int, size: int, *, at: int = ptr) -> bool:
        words[index - 2], words[index - 1] = lead, size
        return huge_pages._own_mapping(at, nbytes)

    header = ptr - 16
    lead, chunk = header % page, -(-(header + nbytes) // page) * page - header
    assert reads(lead, chunk | 0x2)
    assert not reads(lead, chunk), "not mapped on its own: from a heap"
    assert not reads(lead + 16, chunk | 0x2), "the mapping would not start on a page"
    assert not reads(lead, (chunk + 16) | 0x2), "the mapping would not end on a page"
    assert not reads(lead, (chunk - page) | 0x2), "too small for the block"
    assert not reads(lead, (chunk + 2 * page) | 0x2), "far larger than the block"
    assert not reads(lead + page, (chunk + page) | 0x2), "a lead that torch's alignment never makes"
    # A tensor that starts a page: its header would lie on the page before, which may be a gap or a guard page.
    start = -(-(words.data_ptr() + 16) // page) * page
    words[(start - words.data_ptr()) // 8 - 2] = (start - 16) % page
    words[(start - words.data_ptr()) // 8 - 1] = (-(-(start - 16 + nbytes) // page) * page - (start - 16)) | 0x2
    assert not huge_pages._own_mapping(start, nbytes), "never read across a page"


def test_torchs_mobile_allocator_is_not_asked_under():
    """It puts guard bytes between glibc's header and the tensor."""
    torch._C._set_default_mobile_cpu_allocator()
    try:
        assert not huge_pages.asks()
    finally:
        torch._C._unset_default_mobile_cpu_allocator()


def test_the_environment_turns_it_off_and_anything_else_is_a_clear_error(monkeypatch):
    before = huge_pages.enabled()
    try:
        for value, on in [("", True), ("1", True), ("on", True), ("yes", True), ("0", False), ("off", False)]:
            monkeypatch.setenv("POSENC_HUGE_PAGES", value)
            huge_pages.set_enabled(None)
            assert huge_pages.enabled() is on, f"POSENC_HUGE_PAGES={value!r}"
        monkeypatch.delenv("POSENC_HUGE_PAGES")
        huge_pages.set_enabled(None)
        assert huge_pages.enabled(), "on by default"
        monkeypatch.setenv("POSENC_HUGE_PAGES", "maybe")
        with pytest.raises(ValueError, match=r"POSENC_HUGE_PAGES must be 1 .* or 0 \(do not\), got 'maybe'"):
            huge_pages.set_enabled(None)
    finally:
        huge_pages.set_enabled(before)


CHILD = textwrap.dedent(
    """
    import torch
    from pathlib import Path
    from posenc.kernels import huge_pages
    x = torch.ones(1, 1, (huge_pages.MIN_BYTES + (6 << 20)) // 512, 128)
    warm = torch.empty_like(x).fill_(0)  # a block that a recycling allocator hands out again, in memory
    del warm
    out = huge_pages.advised(torch.empty_like(x))
    page = huge_pages.huge_page_bytes()
    print(huge_pages.asks(), -(-out.data_ptr() // page) * page)
    print(Path("/proc/self/smaps").read_text())
    """
)


def child(env: dict[str, str]) -> str:
    """'asks advised' of the CHILD process: whether it asks, and whether its big new output was advised."""
    result = subprocess.run(
        [sys.executable, "-c", CHILD], env={**os.environ, **env}, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr[-3000:]
    first_line, smaps = result.stdout.split("\n", 1)
    asks, first = first_line.split()
    return f"{asks} {advised_at(int(first), smaps)}"


@asking
def test_a_glibc_that_keeps_big_blocks_or_another_allocator_gets_no_advice(tmp_path):
    assert child({}) == "True True", "glibc's defaults: a mapping of its own, advised"
    # glibc told to keep every block in its heap (as benchmarks' --alloc reuse does): the chunk is not a mapping of
    # its own, so the advice would outlive the tensor.
    assert child({"MALLOC_MMAP_MAX_": "0", "MALLOC_TOP_PAD_": str(1 << 30)}) == "True False"
    # An allocator preloaded in glibc's place (as jemalloc or tcmalloc are): a shim forwarding to glibc, so the
    # blocks are the same, but malloc is no longer glibc's.
    compiler = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")
    if compiler is None:
        pytest.skip("no C++ compiler for the preloaded allocator")
    source = tmp_path / "shim.cpp"
    source.write_text(
        textwrap.dedent(
            """
            #include <cstddef>
            extern "C" {
            void* __libc_malloc(size_t);
            void __libc_free(void*);
            void* __libc_memalign(size_t, size_t);
            void* malloc(size_t n) { return __libc_malloc(n); }
            void free(void* p) { __libc_free(p); }
            int posix_memalign(void** p, size_t a, size_t n) { *p = __libc_memalign(a, n); return *p ? 0 : 12; }
            }
            """
        )
    )
    shim = tmp_path / "shim.so"
    subprocess.run([compiler, "-O2", "-shared", "-fPIC", str(source), "-o", str(shim)], check=True, timeout=120)
    assert child({"LD_PRELOAD": str(shim)}) == "False False"


@pytest.mark.parametrize(
    ("text", "mode", "size"),
    [
        ("always [madvise] never\n", "madvise", 2097152),
        ("[always] madvise never\n", "always", 2097152),  # the kernel looks for them; nothing to ask
        ("always madvise [never]", "never", 0),
    ],
)
def test_the_thp_mode_says_what_to_ask_for_and_look_for(tmp_path, monkeypatch, text, mode, size):
    (tmp_path / "enabled").write_text(text)
    (tmp_path / "hpage_pmd_size").write_text("2097152\n")
    monkeypatch.setattr(huge_pages, "_THP", tmp_path)
    try:
        huge_pages.thp_mode.cache_clear(), huge_pages.huge_page_bytes.cache_clear()
        assert huge_pages.thp_mode() == mode and huge_pages.huge_page_bytes() == size
        torch_asks = os.environ.get("THP_MEM_ALLOC_ENABLE") == "1"
        expected = mode == "madvise" and huge_pages.enabled() and huge_pages._glibc() is not None and not torch_asks
        assert huge_pages.asks() == expected
        (tmp_path / "enabled").unlink()
        huge_pages.thp_mode.cache_clear(), huge_pages.huge_page_bytes.cache_clear()
        assert huge_pages.thp_mode() == "unsupported" and huge_pages.huge_page_bytes() == 0
    finally:
        huge_pages.thp_mode.cache_clear(), huge_pages.huge_page_bytes.cache_clear()


@pytest.mark.parametrize("advise", [True, False])
def test_the_kernel_streams_into_fresh_output_only_where_it_finds_huge_pages(advise):
    """cpu_rope.cpp: into a fresh output the kernel streams its stores only where the first whole huge page inside
    it comes in as a huge page (2 MiB zeroed at once do not stay in cache); 4 KiB pages it writes plainly. Asking
    beforehand (``streams``) writes nothing, so it cannot tell yet."""
    if not (cpu_rope.cpu_available() and cpu_rope.can_stream()) or huge_pages.huge_page_bytes() == 0:
        pytest.skip("no streaming stores or no transparent huge pages here")
    page = huge_pages.huge_page_bytes()
    x = torch.randn(1, 4, 4096, D, dtype=torch.bfloat16)  # 4 MiB: a whole huge page in any 4 MiB + 2 MiB window
    cos, sin = posenc.RoPE(D, max_position_embeddings=4096).cos_sin(torch.arange(4096))
    region = mmap.mmap(-1, x.nbytes + page, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    # Advised for huge pages or refused them, the region is a mapping of its own in /proc/self/smaps (no neighbour
    # merges into it), whatever the OS's mode.
    region.madvise(mmap.MADV_HUGEPAGE if advise else mmap.MADV_NOHUGEPAGE)
    base = torch.frombuffer(region, dtype=torch.uint8, count=1).data_ptr()
    assert (mapping_of(base)["start"], mapping_of(base)["end"]) == (base, base + len(region))
    offset = -base % page + 64  # 64 bytes past a huge page boundary, as glibc's blocks start
    out = torch.frombuffer(region, dtype=torch.bfloat16, offset=offset, count=x.numel()).view(x.shape)
    default = cpu_rope.set_stream_threshold(1 << 20)
    try:
        assert not cpu_rope.streams(x, out, cos, sin), "not in memory yet: asking cannot tell, and writes nothing"
        assert mapping_of(base)["Rss"] == 0
        rope_cpu(x, out, cos, sin, None, interleaved=False, conjugate=False, copy_tail=True)
        huge = mapping_of(base)["AnonHugePages"] > 0
        # The fault decides, not the advice: with no free huge page the OS falls back to 4 KiB ones.
        assert bool(cpu_rope.last_streams() & 1) == huge
        with pytest.raises(ValueError):  # a position past the table: refused before anything is written
            rope_cpu(x, out, cos, sin, torch.full((1, 4096), 4096), interleaved=False, conjugate=False, copy_tail=True)
        assert not cpu_rope.last_streams(), "a refused call streamed nothing"
        if advise and not huge:
            pytest.skip("the OS had no free huge page for the advised output: streaming into one is untested here")
        assert cpu_rope.streams(x, out, cos, sin), "in memory now"
        plain = torch.empty_like(x)
        cpu_rope.set_stream_threshold(2**62)
        rope_cpu(x, plain, cos, sin, None, interleaved=False, conjugate=False, copy_tail=True)
        assert not cpu_rope.last_streams()
        assert torch.equal(out, plain), "streamed and plain stores, the same bits"
    finally:
        cpu_rope.set_stream_threshold(default)
        del out
        region.close()


@pytest.mark.parametrize(("backend", "grad"), [("cpu", False), ("cpu", True), ("torch", False)])
@asking
@fresh_process
def test_public_calls_their_replays_and_the_backward_write_big_outputs_into_huge_pages(enabled, backend, grad):
    """q of 36 MiB and k of 9 MiB (float32): q's output is a mapping of glibc's own, advised; k's may be recycled
    heap memory, which is left alone. Without grad the second call replays the first one's launch; with grad the
    backward writes the gradients the same way. The values match those written with asking off, bit for bit."""
    if backend == "cpu" and not cpu_rope.cpu_available():
        pytest.skip("no CPU kernel")
    rope = posenc.RoPE(D, max_position_embeddings=8192, backend=backend)
    q = torch.randn(1, 9, 8192, D, requires_grad=grad)
    k = torch.randn(1, 2, 8192, D)
    kept = []
    with torch.set_grad_enabled(grad):
        for _ in range(2):
            outs = rope(q, k)
            kept.append(outs[0])
            if grad:
                kept.append(torch.autograd.grad(outs[0], q, torch.ones_like(outs[0]))[0])
    for tensor in kept:
        first, last = whole_pages(tensor, enabled)
        mapping = mapping_of(first)
        assert "hg" in mapping["VmFlags"] and mapping["start"] <= first and last <= mapping["end"]
    huge_pages.set_enabled(False)
    with torch.set_grad_enabled(grad):
        plain = rope(q, k)[0]
        assert not advised_at(whole_pages(plain, enabled)[0])
        assert torch.equal(kept[0], plain)
        if grad:
            assert torch.equal(kept[1], torch.autograd.grad(plain, q, torch.ones_like(plain))[0])


@asking
def test_traced_code_asks_for_nothing(enabled, monkeypatch):
    """Under torch.compile there is no memory to advise yet (the torch path's Python is traced): ``advised`` steps
    aside, and fullgraph compiles."""
    x = big()
    looked = []
    own_mapping = huge_pages._own_mapping
    monkeypatch.setattr(huge_pages, "_own_mapping", lambda *args: looked.append(args) or own_mapping(*args))
    compiled = torch.compile(lambda t: advised(torch.empty_like(t)).copy_(t) * 2, fullgraph=True, backend="eager")
    assert torch.equal(compiled(x), x * 2)
    assert not looked
    advised(torch.empty_like(x))
    assert len(looked) == 1, "eager, it looks"


@asking
def test_tests_that_need_glibcs_own_mappings_in_a_fresh_process():
    if FRESH:
        pytest.skip("this is the fresh process")
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__, "-k", " or ".join(FRESH_TESTS)],
        env={**os.environ, "POSENC_TEST_FRESH_PROCESS": "1"},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-2000:]
    expected = 6 if cpu_rope.cpu_available() else 4  # two of them call the CPU kernel
    assert re.search(rf"^{expected} passed\b", result.stdout, re.MULTILINE), result.stdout[-2000:]
