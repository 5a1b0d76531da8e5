"""Huge pages under the CPU kernel's new outputs (cpu_rope.cpp, "Huge pages"): which pages it asks for, which outputs
it leaves alone, that the public calls and their replays get them, and that the bits do not change."""

from __future__ import annotations

import ctypes
import mmap
from pathlib import Path

import pytest
import torch

import posenc
from posenc.kernels import cpu_rope
from posenc.kernels.cpu_rope import asks_huge_pages, rope_cpu

asking = pytest.mark.skipif(
    not cpu_rope.cpu_available() or cpu_rope.huge_page_bytes() == 0,
    reason=f"no CPU kernel, or transparent huge pages are {cpu_rope.thp_mode()!r} here: it asks only in 'madvise'",
)
D = 128
SMALLEST = 32 << 20  # the smallest output the kernel asks for (HUGE_OUTPUT_BYTES): glibc maps it on its own


@pytest.fixture
def huge_pages():
    """Asking on (it is off unless POSENC_HUGE_PAGES=1 was set when the kernel loaded); the setting restored after."""
    before = cpu_rope.set_huge_pages(True)
    yield cpu_rope.huge_page_bytes()
    cpu_rope.set_huge_pages(before)


def mapping_of(address: int) -> tuple[int, int, str, list[str]]:
    """(start, end, path, VmFlags) of this process's mapping that holds ``address`` (/proc/self/smaps)."""
    found = None
    for line in Path("/proc/self/smaps").read_text().splitlines():
        fields = line.split()
        if "-" in fields[0] and not fields[0].endswith(":"):
            start, end = (int(part, 16) for part in fields[0].split("-"))
            found = (start, end, fields[5] if len(fields) > 5 else "") if start <= address < end else None
        elif found and fields[0] == "VmFlags:":
            return (*found, fields[1:])
    raise AssertionError(f"no mapping holds {address:#x}")


def below_the_break(address: int) -> bool:
    """Whether ``address`` lies below the program break, where the kernel never asks (the brk heap; with the legacy
    bottom-up layout that an unlimited stack gives, every mapping)."""
    sbrk = ctypes.CDLL(None).sbrk
    sbrk.restype = ctypes.c_void_p
    return address < sbrk(0)


LEGACY_LAYOUT = "mappings lie below the program break here (the legacy layout of an unlimited stack): never asked"


def advised(address: int) -> bool:
    return "hg" in mapping_of(address)[3]


def fresh_output(rows: int, page: int, *, dtype: torch.dtype = torch.float32) -> tuple[mmap.mmap, torch.Tensor]:
    """A new private anonymous mapping (no page of it in memory, as glibc maps a big block) and an (1, 1, rows, D)
    tensor on it that starts half a huge page and 64 bytes in: unaligned at both ends."""
    size = torch.empty(0, dtype=dtype).element_size()
    region = mmap.mmap(-1, rows * D * size + 2 * page, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if below_the_break(ctypes.addressof(ctypes.c_char.from_buffer(region))):
        region.close()
        pytest.skip(LEGACY_LAYOUT)
    start = page // 2 + 64
    return region, torch.frombuffer(region, dtype=dtype, offset=start, count=rows * D).view(1, 1, rows, D)


def whole_pages(out: torch.Tensor, page: int) -> tuple[int, int]:
    start = out.data_ptr()
    return -(-start // page) * page, (start + out.numel() * out.element_size()) // page * page


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@asking
def test_the_kernel_asks_for_exactly_the_whole_huge_pages_inside_a_fresh_output(huge_pages, dtype):
    page = huge_pages
    rows = (SMALLEST + 3 * page) // (D * torch.empty(0, dtype=dtype).element_size())
    x = torch.randn(1, 1, rows, D).to(dtype)
    cos, sin = (t.float() for t in posenc.RoPE(D, max_position_embeddings=rows).cos_sin(torch.arange(rows)))
    region, out = fresh_output(rows, page, dtype=dtype)
    assert asks_huge_pages(x, out, cos, sin)
    first, last = whole_pages(out, page)
    assert not advised(first), "asks_huge_pages only answers"
    rope_cpu(x, out, cos, sin, None, interleaved=False, conjugate=False, copy_tail=True)
    begin, end, _, flags = mapping_of(first)
    assert "hg" in flags and (begin, end) == (first, last), "the whole huge pages inside the output, and no more"
    assert last - first >= SMALLEST
    assert not advised(out.data_ptr()), "not the partial page before them"
    assert not asks_huge_pages(x, out, cos, sin), "its pages are in memory now"
    cpu_rope.set_huge_pages(False)
    plain = torch.empty_like(x)
    rope_cpu(x, plain, cos, sin, None, interleaved=False, conjugate=False, copy_tail=True)
    # Into huge pages the kernel also streams its stores (cpu_rope.cpp): another store path, the same bits.
    assert torch.equal(out, plain)
    del out
    region.close()


@asking
def test_the_kernel_leaves_alone_the_outputs_it_cannot_help(huge_pages, monkeypatch):
    page = huge_pages
    rows = 2 * (SMALLEST + 2 * page) // (D * 4)  # read as one block, half of it is still past SMALLEST
    x = torch.randn(1, 1, rows, D)
    cos, sin = posenc.RoPE(D, max_position_embeddings=rows).cos_sin(torch.arange(rows))
    region, out = fresh_output(rows, page)
    assert asks_huge_pages(x, out, cos, sin)
    assert not asks_huge_pages(out, out, cos, sin), "in place: x's own pages"
    few = SMALLEST // (D * 4) - 1
    assert not asks_huge_pages(x[:, :, :few], out[:, :, :few], cos, sin), "smaller than glibc's own mappings"
    gapped = out.view(1, 1, rows // 2, 2 * D)[..., :D]
    assert not asks_huge_pages(x[:, :, : rows // 2], gapped, cos, sin), "every other row: bytes it does not write"
    quarter = (cos[:, : D // 4], sin[:, : D // 4])  # rotary_dim D / 2
    assert asks_huge_pages(x, out, *quarter, copy_tail=True)
    assert not asks_huge_pages(x, out, *quarter, copy_tail=False), "the channels past r are left unwritten"
    cpu_rope.set_huge_pages(False)
    assert not asks_huge_pages(x, out, cos, sin), "turned off"
    monkeypatch.setenv("POSENC_HUGE_PAGES", "1")
    cpu_rope.set_huge_pages(None)
    assert asks_huge_pages(x, out, cos, sin), "on by the environment"
    with pytest.raises(
        ValueError, match=r"POSENC_HUGE_PAGES must be 1 \(ask for huge pages\) or 0 \(do not\), got 'maybe'"
    ):
        monkeypatch.setenv("POSENC_HUGE_PAGES", "maybe")
        cpu_rope.set_huge_pages(None)
    for off in ("0", "", "off"):
        monkeypatch.setenv("POSENC_HUGE_PAGES", off)
        cpu_rope.set_huge_pages(None)
        assert not asks_huge_pages(x, out, cos, sin), f"off with POSENC_HUGE_PAGES={off!r}"
    monkeypatch.delenv("POSENC_HUGE_PAGES")
    cpu_rope.set_huge_pages(None)
    assert not asks_huge_pages(x, out, cos, sin), "off by default"
    cpu_rope.set_huge_pages(True)
    out.zero_()  # faulted in, as recycled heap memory is
    assert not asks_huge_pages(x, out, cos, sin), "its pages are in memory already"
    del out, gapped
    region.close()


@asking
def test_a_buffer_advised_by_hand_follows_the_kernels_rule(huge_pages):
    """``advise_huge_pages`` (benchmarks/rope.py's copy-huge) asks for the pages the kernel would ask for."""
    page = huge_pages
    rows = (SMALLEST + 3 * page) // (D * 4)
    x = torch.randn(1, 1, rows, D)
    cos, sin = posenc.RoPE(D, max_position_embeddings=rows).cos_sin(torch.arange(rows))
    region, out = fresh_output(rows, page)
    assert not cpu_rope.advise_huge_pages(out[:, :, : SMALLEST // (D * 4) - 1]), "below 32 MiB, as the kernel"
    assert asks_huge_pages(x, out, cos, sin) and cpu_rope.advise_huge_pages(out)
    first, last = whole_pages(out, page)
    begin, end, _, flags = mapping_of(first)
    assert "hg" in flags and (begin, end) == (first, last)
    with pytest.raises(ValueError, match="out must be a contiguous CPU tensor"):
        cpu_rope.advise_huge_pages(out.transpose(2, 3))
    del out
    region.close()


@pytest.mark.parametrize(
    ("text", "mode"),
    [
        ("always [madvise] never\n", "madvise"),
        ("[always] madvise never\n", "always"),
        ("always madvise [never]", "never"),
    ],
)
def test_only_mode_madvise_has_huge_pages_to_ask_for(tmp_path, monkeypatch, text, mode):
    (tmp_path / "enabled").write_text(text)
    (tmp_path / "hpage_pmd_size").write_text("2097152\n")
    monkeypatch.setattr(cpu_rope, "_THP", tmp_path)
    try:
        cpu_rope.thp_mode.cache_clear(), cpu_rope.huge_page_bytes.cache_clear()
        assert cpu_rope.thp_mode() == mode
        # 'always' gives huge pages unasked, 'never' refuses them.
        assert cpu_rope.huge_page_bytes() == (2097152 if mode == "madvise" else 0)
        (tmp_path / "enabled").unlink()
        cpu_rope.thp_mode.cache_clear(), cpu_rope.huge_page_bytes.cache_clear()
        assert cpu_rope.thp_mode() == "unsupported" and cpu_rope.huge_page_bytes() == 0
    finally:
        cpu_rope.thp_mode.cache_clear(), cpu_rope.huge_page_bytes.cache_clear()


@pytest.mark.parametrize("grad", [False, True])
@asking
def test_public_calls_and_their_replays_write_big_outputs_into_huge_pages(huge_pages, grad):
    """q and k of 36 MiB and 9 MiB (float32): glibc maps blocks past 32 MiB fresh whatever its adaptive threshold
    says, so q's output is a new mapping; k's may be recycled heap memory, which is left alone. Without grad the second
    call replays the first one's launch; with grad the backward writes the gradients the same way."""
    rope = posenc.RoPE(D, max_position_embeddings=8192, backend="cpu")
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
        first, last = whole_pages(tensor, huge_pages)
        begin, end, path, flags = mapping_of(first)
        if path == "[heap]" or below_the_break(first):
            pytest.skip(f"the output lies below the program break ({path or LEGACY_LAYOUT})")
        assert "hg" in flags and begin <= first and last <= end
    assert torch.equal(kept[0], kept[-2 if grad else 1])
