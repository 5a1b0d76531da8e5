"""Peak memory the RoPE backends allocate per call, on the CPU: q (1, 32, s, 128) and k (1, 8, s, 128), a rotated
copy (``apply_rotary_qk``) or in place (``apply_rotary_`` on q, then k), forward alone or with the backward.

The peak is counted from the CPU allocator's own events (``torch.profiler`` with ``profile_memory=True``): every
allocation and free made during the call, in order, summed, its maximum taken with the live bytes at the start as 0.
That is exact and deterministic (no page faults or allocator caching in it, unlike a process's RSS). The floor is
what the call must keep: the outputs for a copy (q and k's size), nothing in place; with the backward also the
gradients of q and k. ``extra`` is the peak above that floor, in MiB and as a multiple of q + k's size.

    python benchmarks/rope_memory.py                          # s = 4096, fp32 and bf16, torch and cpu backends
    python benchmarks/rope_memory.py --seq 2048 --backends torch
"""

from __future__ import annotations

import argparse
import itertools

import torch
from torch.profiler import ProfilerActivity, profile

import posenc


def _allocations(node) -> list:
    """The allocation events under a profiler event-tree node, itself included."""
    found = [node] if node.tag == torch._C._profiler._EventType.Allocation else []
    for child in node.children:
        found += _allocations(child)
    return found


def peak_bytes(fn) -> tuple[int, object]:
    """The most bytes live at once during ``fn()`` above those live before it, from the allocator's events; and
    fn's result (kept alive, so its buffers count as live at the end)."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        result = fn()
    events = [event for root in prof.profiler.kineto_results.experimental_event_tree() for event in _allocations(root)]
    events.sort(key=lambda event: event.start_time_ns)
    live = peak = 0
    for event in events:
        live += event.extra_fields.alloc_size
        peak = max(peak, live)
    return peak, result


def case(seq: int, dtype: torch.dtype, interleaved: bool, rotary: int, inplace: bool, backward: bool, backend: str):
    """(peak bytes, floor bytes) of one call."""
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(1, 32, seq, 128, generator=gen).to(dtype)
    k = torch.randn(1, 8, seq, 128, generator=gen).to(dtype)
    cos, sin = torch.rand(2, seq, rotary // 2, generator=gen).unbind(0)
    grads = (torch.randn_like(q), torch.randn_like(k))
    if backward:
        q.requires_grad_(True)
        k.requires_grad_(True)
    if inplace:
        # Non-leaf copies that require grad (a leaf could not change in place); made before the measurement.
        q_in, k_in = (q.clone(), k.clone()) if backward else (q, k)
    size = q.nbytes + k.nbytes

    def call():
        with torch.set_grad_enabled(backward):
            if inplace:
                outs = (
                    posenc.apply_rotary_(q_in, cos, sin, interleaved=interleaved, backend=backend),
                    posenc.apply_rotary_(k_in, cos, sin, interleaved=interleaved, backend=backend),
                )
            else:
                outs = posenc.apply_rotary_qk(q, k, cos, sin, interleaved=interleaved, backend=backend)
            if backward:
                torch.autograd.backward(outs, grads)
            return outs

    peak, outs = peak_bytes(call)
    floor = (0 if inplace else size) + (size if backward else 0)
    del outs
    return peak, floor, size


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--dtypes", nargs="+", default=["fp32", "bf16"], choices=["fp32", "bf16", "fp16"])
    parser.add_argument("--backends", nargs="+", default=["torch", "cpu"])
    args = parser.parse_args()
    dtypes = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
    print("| backend | dtype | pairs | rotary | call | pass | peak MiB | floor MiB | extra MiB | extra / (q+k) |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    grid = itertools.product(args.backends, args.dtypes, (False, True), (128, 64), (False, True), (False, True))
    for backend, dtype, interleaved, rotary, inplace, backward in grid:
        peak, floor, size = case(args.seq, dtypes[dtype], interleaved, rotary, inplace, backward, backend)
        print(
            f"| {backend} | {dtype} | {'adjacent' if interleaved else 'split-half'} | {rotary} | "
            f"{'in place' if inplace else 'copy'} | {'fwd+bwd' if backward else 'fwd'} | {peak / 2**20:.1f} | "
            f"{floor / 2**20:.1f} | {(peak - floor) / 2**20:.1f} | {(peak - floor) / size:.2f} |",
            flush=True,
        )


if __name__ == "__main__":
    main()
