"""Replayed eager calls of the fused kernels (posenc.kernels.replay; Triton's in triton_replay): a call whose
metadata has been through the full path before repeats that launch with its own pointers. Each replay must equal
the full path bit for bit, and every call that the full path would treat differently (errors, modes, gradients,
transforms, other tables) must not be replayed."""

from __future__ import annotations

import contextlib
import copy
import pickle
import threading
from unittest import mock

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils._python_dispatch import TorchDispatchMode

import posenc
import posenc.rope.apply as apply_module
import posenc.rope.module as module
from posenc import RoPE, apply_rotary, apply_rotary_, apply_rotary_qk
from posenc.kernels import cpu_rope
from posenc.kernels.backend import triton_module_or_error
from posenc.kernels.replay import plain_eager
from posenc.testing import random_qk, torch_threads

pytestmark = pytest.mark.skipif(not cpu_rope.cpu_available(), reason="the CPU kernel is not built here")


def _triton_interpreted() -> bool:
    module = triton_module_or_error()[0]
    return module is not None and module.interpreted()


# These tests rotate CPU tensors through Triton's interpreter (tests/conftest.py sets TRITON_INTERPRET=1, as CI runs
# the kernel); where Triton runs compiled (POSENC_TRITON_NATIVE=1 on a GPU machine) the CUDA test below runs instead.
needs_triton = pytest.mark.skipif(not _triton_interpreted(), reason="Triton missing, or compiled for a GPU here")

DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


@contextlib.contextmanager
def counting_calls(**targets: tuple[object, str]):
    """Counts of the calls of each target (name -> (object, attribute)), each wrapped while the block runs."""
    counts = dict.fromkeys(targets, 0)

    def counted(name, function):
        def call(*args, **kwargs):
            counts[name] += 1
            return function(*args, **kwargs)

        return call

    with contextlib.ExitStack() as stack:
        for name, (owner, attribute) in targets.items():
            stack.enter_context(mock.patch.object(owner, attribute, counted(name, getattr(owner, attribute))))
        yield counts


def counting_full_paths():
    """Counts of the calls that took the full path, by entry: "functions" (rotate_tensors') and "RoPE" (forward's
    rotation through rotate_tensors)."""
    return counting_calls(functions=(apply_module, "_rotate_tensors"), RoPE=(module, "rotate_tensors"))


def table(rows: int, half: int, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    angles = torch.arange(rows, dtype=torch.float64)[:, None] * torch.logspace(0, -4, half, dtype=torch.float64)
    return angles.cos().to(dtype), angles.sin().to(dtype)


def strided_copy(t: torch.Tensor) -> torch.Tensor:
    """t's values in a tensor of its shape, strides and dtype (the same key)."""
    return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype).copy_(t)


ENTRIES = (
    "apply_rotary",
    "apply_rotary_qk broadcast",
    "apply_rotary_qk table",
    "RoPE",
    "apply_rotary_ broadcast",
    "apply_rotary_ table",
)


@st.composite
def calls(draw, backend: str = "auto"):
    """A call of apply_rotary, apply_rotary_qk or RoPE as a decode step or a short prefill makes it (tables read
    from an int offset, at position ids or from per-sequence offsets) on ``backend``, with the
    arguments of two steps: (entry, call(q, k, offset) -> outputs, (q, k, offset) twice, the RoPE or None, whether
    the full path is taken again: it copies q and k, or the Triton kernel reads ids or offsets)."""
    dtype = draw(st.sampled_from(DTYPES))
    b, hq, s = draw(st.integers(1, 2)), draw(st.integers(1, 5)), draw(st.integers(1, 9))
    hk = draw(st.sampled_from([d for d in range(1, hq + 1) if hq % d == 0]))
    d = draw(st.sampled_from([2, 6, 16, 34, 64]))
    half = draw(st.integers(1, d // 2))
    layout = draw(st.sampled_from(["bhsd", "bshd"]))
    interleaved, conjugate = draw(st.booleans()), draw(st.booleans())
    # q and k slices of one projection's output, as attention layers cut them, or views with a step in their last dim
    # (channels strided 2 apart), which the full path copies before the kernel reads them.
    memory = draw(st.sampled_from(["dense", "fused", "strided"]))
    entry = draw(st.sampled_from(ENTRIES))
    if backend != "auto" and entry.startswith("apply_rotary_ ") and memory == "strided":
        memory = "fused"  # a fused backend named explicitly refuses to write a strided x in place ("auto": torch)
    rows = draw(st.sampled_from(["offset", "positions", "offsets"]))  # how a table is read
    if entry == "RoPE":
        half = d // 2
    one_dim_ids = draw(st.booleans())  # (s,) position ids, else (b, s)

    def activations(seed):
        if memory == "strided":
            q, k = random_qk(b, hq, hk, s, 2 * d, dtype=dtype, layout=layout, seed=seed)
            return q[..., ::2], k[..., ::2]
        if memory == "fused":
            width = (hq + 2 * hk) * d
            qkv = torch.randn(b, s, width, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
            qkv = qkv.to(dtype)
            q, k = qkv[..., : hq * d].view(b, s, hq, d), qkv[..., hq * d : (hq + hk) * d].view(b, s, hk, d)
            return (q, k) if layout == "bshd" else (q.transpose(1, 2), k.transpose(1, 2))
        return random_qk(b, hq, hk, s, d, dtype=dtype, layout=layout, seed=seed)

    angle_dtype = torch.float64 if dtype == torch.float64 else torch.float32
    cos, sin = table(64, half, angle_dtype)
    offsets = (draw(st.integers(0, 64 - s)), draw(st.integers(0, 64 - s)))

    def table_rows(offset):
        """An int offset, or position ids or per-sequence offsets (each step's own tensor) from it."""
        if rows == "positions":
            ids = (torch.arange(s) * 5 + offset) % 64  # not consecutive
            return {"positions": ids if one_dim_ids else torch.stack([ids.flip(0)] * b)}
        if rows == "offsets":
            return {"offset": (torch.arange(b) + offset) % (65 - s)}
        return {"offset": offset}

    rope = RoPE(d, interleaved=interleaved, backend=backend) if entry == "RoPE" else None
    if rope is not None:

        def call(q, k, offset):
            return rope(q, k, layout=layout, **table_rows(offset))

    elif entry == "apply_rotary_qk table":

        def call(q, k, offset):
            options = {"layout": layout, "interleaved": interleaved, "conjugate": conjugate, "backend": backend}
            return apply_rotary_qk(q, k, cos, sin, **options, **table_rows(offset))

    elif entry == "apply_rotary_ table":

        def call(q, k, offset):
            options = {"layout": layout, "interleaved": interleaved, "conjugate": conjugate, "backend": backend}
            options |= table_rows(offset)
            return apply_rotary_(q, cos, sin, **options), apply_rotary_(k, cos, sin, **options)

    else:
        # Broadcast angles: (b or 1, 1, s, r/2) for bhsd, (b or 1, s, 1, r/2) for bshd, from the offset's rows.
        def call(q, k, offset):
            c, n = cos[offset : offset + s], sin[offset : offset + s]
            axis = 0 if layout == "bhsd" else 1
            c, n = c.unsqueeze(axis)[None], n.unsqueeze(axis)[None]
            options = {"interleaved": interleaved, "conjugate": conjugate, "backend": backend}
            if entry == "apply_rotary":
                return (apply_rotary(q, c, n, **options),)
            if entry == "apply_rotary_ broadcast":
                return apply_rotary_(q, c, n, **options), apply_rotary_(k, c, n, **options)
            return apply_rotary_qk(q, k, c, n, **options)

    steps = [(*activations(seed), offset) for seed, offset in enumerate(offsets)]
    # The full path copies strided q and k, and builds each token's row where per-sequence offsets read more than one.
    # Triton calls that read ids or offsets are never replayed (triton_replay: the full path checks their rows).
    table_read = entry in ("RoPE", "apply_rotary_qk table", "apply_rotary_ table")
    copied = memory == "strided" or (table_read and rows == "offsets" and s > 1)
    copied = copied or (backend == "triton" and table_read and rows != "offset")
    return entry, call, steps, rope, copied


@settings(max_examples=80, deadline=None)
@given(calls())
def test_a_replayed_call_equals_the_full_path_bit_for_bit(case):
    """Two steps of one call site: the second, other values at another offset, replays the first's launch (unless
    the full path copied q and k); its outputs equal the full path's for the same arguments bit for bit, and its
    inputs are left untouched (or, in place, are the outputs)."""
    check_replayed_call(case)


@needs_triton
@settings(max_examples=40, deadline=None)
@given(calls(backend="triton"))
def test_a_replayed_triton_launch_equals_the_full_path_bit_for_bit(case):
    """The same for Triton's launches (interpreted here, as CI tests the kernel): a replay puts the call's tensors
    and int offset into the planned launch, and calls reading ids or offsets take the full path each time."""
    check_replayed_call(case)


def check_replayed_call(case) -> None:
    entry, call, ((q1, k1, o1), (q2, k2, o2)), rope, copied = case
    inplace = entry.startswith("apply_rotary_ ")
    apply_module._PLANS.clear()
    with counting_full_paths() as full:
        call(q1, k1, o1)
        before = dict(full)
        inputs = (strided_copy(q2), strided_copy(k2))
        replayed = call(q2, k2, o2)
        # A plan is kept only where the kernel read the caller's q and k: a copy made on the way is not replayed.
        assert (full == before) != copied, f"{entry}: the second step {'replayed' if copied else 'took the full path'}"
    if inplace:
        assert replayed[0] is q2 and replayed[1] is k2
        q2, k2 = inputs
    else:
        assert torch.equal(q2, inputs[0]) and torch.equal(k2, inputs[1])
    apply_module._PLANS.clear()
    # Stores that keep nothing: the full path each time.
    with contextlib.ExitStack() as stack:
        stack.enter_context(mock.patch.object(apply_module, "_PLANS", apply_module.Plans(0)))
        if rope is not None:
            stack.enter_context(mock.patch.object(rope, "_plans", apply_module.Plans(0)))
        wanted = call(q2, k2, o2)
    for got, want in zip(replayed, wanted, strict=True):
        assert got.dtype == want.dtype and got.shape == want.shape and got.stride() == want.stride()
        assert torch.equal(got, want)


def full_path(call):
    """call() with stores that keep no plan: the full path each time."""
    with mock.patch.object(apply_module, "_PLANS", apply_module.Plans(0)):
        return call()


def test_every_option_of_a_call_is_part_of_its_key():
    """Calls that differ in one option only, one after another, each get their own plan: pair layout, direction,
    layout of q and k (read from one buffer both ways), offset or none."""
    cos, sin = table(32, 8)
    q, k = random_qk(1, 4, 4, 4, 16)
    apply_module._PLANS.clear()
    variants = [
        {"interleaved": interleaved, "conjugate": conjugate, "layout": layout, "offset": offset}
        for interleaved in (False, True)
        for conjugate in (False, True)
        for layout, offset in (("bhsd", 3), ("bshd", 3), (None, None))
    ]
    for _ in range(2):  # the second round replays
        for options in variants:
            c, n = (cos[:4], sin[:4]) if options["offset"] is None else (cos, sin)
            got = apply_rotary_qk(q, k, c, n, **options)
            want = full_path(lambda c=c, n=n, options=options: apply_rotary_qk(q, k, c, n, **options))
            assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True)), options
    assert len(apply_module._PLANS) == len(variants)


def test_ids_and_per_sequence_offsets_of_one_shape_are_told_apart():
    """Position ids (s,) and per-sequence offsets (b,) of the same shape and dtype: two plans, each read its way
    (for two sequences of two tokens, rows 5, 9 and 5, 9 against 5, 6 and 9, 10)."""
    cos, sin = table(32, 8)
    q, k = random_qk(2, 2, 2, 2, 16)
    rope = RoPE(16)
    ids = torch.tensor([5, 9])
    for _ in range(2):
        for kwargs in ({"positions": ids}, {"offset": ids}):
            got = apply_rotary_qk(q, k, cos, sin, **kwargs)
            want = full_path(lambda kwargs=kwargs: apply_rotary_qk(q, k, cos, sin, **kwargs))
            assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True)), kwargs
            assert torch.equal(rope(q, k, **kwargs)[0], copy.deepcopy(rope)(q, k, **kwargs)[0]), kwargs


def test_a_call_that_cannot_be_replayed_is_not_recorded_again():
    """Where the full path copies q and k (a step in their last dim), the key remembers it: later calls take the
    full path without recording and planning again (~5 us each)."""
    cos, sin = table(32, 8)
    q, k = random_qk(1, 2, 2, 1, 32)
    q, k = q[..., ::2], k[..., ::2]
    apply_module._PLANS.clear()
    with mock.patch.object(apply_module, "plan_of", wraps=apply_module.plan_of) as planned:
        for _ in range(3):
            apply_rotary_qk(q, k, cos, sin, offset=3)
    assert planned.call_count == 1


def fresh(q: torch.Tensor, k: torch.Tensor, backend: str = "auto", **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
    """A new ``RoPE(q.shape[-1])``'s call, through the full path only (no plan of its own or of the functions')."""
    with mock.patch.object(apply_module, "_PLANS", apply_module.Plans(0)):
        return RoPE(q.shape[-1], backend=backend)(q, k, **kwargs)


def decode_rope(dtype=torch.float32, **options):
    rope = RoPE(16, **options)
    q, k = random_qk(1, 4, 2, 1, 16, dtype=dtype)
    rope(q, k, offset=3)  # the full path, which keeps a plan
    assert len(rope._plans) == 1
    return rope, q, k


def test_calls_the_full_path_treats_otherwise_are_not_replayed():
    """Each of these, made after a call of the same shapes has kept a plan, needs the full path: a dispatch mode
    sees the op, a gradient is recorded, a negative view is read by value, vmap batches, Dynamo traces, a
    FakeTensorMode gives fake outputs."""
    rope, q, k = decode_rope()
    want = rope(q, k, offset=5)

    seen = []

    class Seen(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            seen.append(str(func))
            return func(*args, **(kwargs or {}))

    with Seen():
        got = rope(q, k, offset=5)
    assert any("posenc.rotary" in op for op in seen)
    assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True))

    grads = []
    for module_ in (rope, RoPE(16, backend="torch")):
        leaf = q.clone().requires_grad_()
        out, _ = module_(leaf, k, offset=5)
        out.backward(torch.arange(out.numel(), dtype=out.dtype).view_as(out))
        grads.append(leaf.grad)
    torch.testing.assert_close(grads[0], grads[1])

    torch.testing.assert_close(rope(torch._neg_view(q), k, offset=5)[0], -want[0])

    batched = torch.func.vmap(lambda x: rope(x[None], k, offset=5)[0][0])(q)
    torch.testing.assert_close(batched, want[0])

    compiled = torch.compile(lambda q, k: rope(q, k, offset=5), backend="eager", fullgraph=True)
    torch.testing.assert_close(compiled(q, k), want)

    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode() as fake:
        fq, fk = fake.from_tensor(q), fake.from_tensor(k)
        assert rope(fq, fk, offset=5)[0].shape == q.shape


def test_bad_calls_after_a_plan_still_get_their_errors():
    """A plan for good arguments never answers bad ones: the full path's errors, with their messages."""
    cos, sin = table(8, 8)
    q, k = random_qk(1, 2, 2, 3, 16)
    apply_rotary_qk(q, k, cos, sin, offset=2, interleaved=True)
    with pytest.raises(ValueError, match="rows"):
        apply_rotary_qk(q, k, cos, sin, offset=6, interleaved=True)  # rows 6..8 of 8
    with pytest.raises(ValueError):
        apply_rotary_qk(q, k, cos, sin, offset=-1, interleaved=True)
    with pytest.raises(TypeError, match="interleaved must be True or False"):
        apply_rotary_qk(q, k, cos, sin, offset=2, interleaved=1)
    apply_rotary_qk(q, k, cos, sin, positions=torch.tensor([1, 0, 2]))
    for ids in ([1, 8, 2], [1, -1, 2]):  # rows the kernel finds outside the table: the full path's error
        with pytest.raises(ValueError, match="rows"):
            apply_rotary_qk(q, k, cos, sin, positions=torch.tensor(ids))
    rope, q, k = decode_rope()
    with pytest.raises(TypeError, match="same dtype"):
        rope(q, k.double(), offset=3)
    with pytest.raises(ValueError, match="layout"):
        rope(q, k, offset=3, layout="bsdh")


def test_a_rope_replays_on_the_table_it_keeps_now():
    """A step past the table grows it (the plan's table is replaced: the full path once, then a plan of the new
    table); dropped tables (forget_frequencies, a move to another device and back) and a changed pair layout are
    followed too. Every result equals a fresh module's (through the full path)."""
    rope, q, k = decode_rope()
    for offset in (300, 301, 5):  # 300 is past the 256-row table
        assert all(
            torch.equal(g, w) for g, w in zip(rope(q, k, offset=offset), fresh(q, k, offset=offset), strict=True)
        )
    assert next(iter(rope._tables.values()))[0].shape[0] == 512
    with counting_full_paths() as full:
        rope(q, k, offset=7)
    assert full["RoPE"] == 0  # the plan of the grown table
    far = 70_000  # past the largest table: a window of rows is read there, which is not the table plans are kept for
    assert torch.equal(rope(q, k, offset=far)[0], fresh(q, k, offset=far)[0])
    with counting_full_paths() as full:
        rope(q, k, offset=7)
    assert full["RoPE"] == 0  # the window's call left the table's plan as it was
    for ids in ([[3]], [[700]], [[4]]):  # position ids past the table grow it as well
        positions = torch.tensor(ids)
        assert torch.equal(rope(q, k, positions=positions)[0], fresh(q, k, positions=positions)[0])
    with pytest.raises(ValueError, match=">= 0"):
        rope(q, k, positions=torch.tensor([[-1]]))
    assert next(iter(rope._tables.values()))[0].shape[0] == 1024
    posenc.rope.module.forget_frequencies("default")
    assert rope._tables == {}
    rope(*random_qk(1, 2, 2, 2, 16), offset=0)  # another shape builds the table anew: 256 rows, where 1024 were
    assert next(iter(rope._tables.values()))[0].shape[0] == 256
    for offset in (7, 400):  # the decode step's plan read the 1024-row table
        assert torch.equal(rope(q, k, offset=offset)[0], fresh(q, k, offset=offset)[0])
    rope.to("meta").to("cpu")
    assert torch.equal(rope(q, k, offset=7)[0], fresh(q, k, offset=7)[0])
    rope.interleaved = True
    assert torch.equal(rope(q, k, offset=7)[0], RoPE(16, interleaved=True)(q, k, offset=7)[0])


@pytest.mark.parametrize("backend", ["auto", pytest.param("triton", marks=needs_triton)])
def test_decode_steps_past_the_table_replay_the_window_they_read(backend):
    """Past the largest table (2**16 rows) a RoPE reads windows of 4096 rows; a decode loop there replays the plan of
    its window while its offset lies in it (25.7 -> 10.5 us a step on 2026-12-07, where every step took the full
    path), and the step that leaves it takes the full path once, which reads the next window. A request near the
    start, sharing the RoPE and taking turns with it, keeps the plan of the table: each side replays its own. Every
    result equals a fresh module's, through the full path."""
    rope = RoPE(16, backend=backend)
    q, k = random_qk(1, 4, 2, 1, 16)
    # The window of rows 69632..73727 (its first a multiple of 2048 at or below the first offset), then 73728..
    far = (71_670, 71_671, 71_672, 73_726, 73_727, 73_728, 73_729)
    steps = [(offset, near) for i, offset in enumerate(far) for near in (3 + i, None)]
    wants = [fresh(q, k, backend, offset=offset if near is None else near) for offset, near in steps]
    with counting_full_paths() as full:
        for (offset, near), want in zip(steps, wants, strict=True):
            assert same(rope(q, k, offset=offset if near is None else near), want), (offset, near)
    # The first far call, the first near one, and the far one that left the first window (offset 73728).
    assert full["RoPE"] == 3
    cpu = (torch.device("cpu"), torch.float32)
    assert list(rope._windows) == [(*cpu, 69632), (*cpu, 73728)]


def test_a_windows_plan_is_replayed_only_while_that_window_is_kept():
    """A window's plan reads the window it was made on: once other windows have taken its place (the latest 8 of a
    device and dtype are kept), or a move or ``forget_frequencies`` dropped them, the next call takes the full path,
    which reads a window of its own, and equals a fresh module's."""
    rope = RoPE(16)
    q, k = random_qk(1, 4, 2, 1, 16)
    far = 100_000
    rope(q, k, offset=far)  # keeps the plan of the window of rows 98304..102399
    others = [random_qk(b, 4, 2, 1, 16) for b in range(2, 10)]  # other keys, each far from the rest
    for i, (q2, k2) in enumerate(others):
        rope(q2, k2, offset=far + 4096 * (i + 1))
    assert (
        len(rope._windows) == module._WINDOWS_KEPT and (torch.device("cpu"), torch.float32, 98304) not in rope._windows
    )
    for drop in (None, lambda: rope.to("meta").to("cpu"), lambda: module.forget_frequencies("default")):
        if drop is not None:
            rope(q, k, offset=far + 1)  # a plan again, then its window dropped
            drop()
        with counting_full_paths() as full:
            assert same(rope(q, k, offset=far + 2), fresh(q, k, offset=far + 2))
        assert full["RoPE"] == 2, drop  # this RoPE's call and the fresh one's


def test_replayed_windows_count_as_used_when_one_is_dropped():
    """Seven requests far out share a RoPE, each decoding in its own window and replaying its plan. When two of them
    move to their next windows, the window dropped for the ninth is the least recently used, one that a request
    has left; a replay that did not count as a use dropped the oldest built instead, a window still read, which
    then took the full path to be built again."""
    rope = RoPE(16)
    far = 100_000
    streams = [(random_qk(b, 4, 2, 1, 16), far + 8192 * b) for b in range(1, 8)]  # other keys, other windows
    for _ in range(3):
        for (q, k), offset in streams:
            rope(q, k, offset=offset)
    for moving in (6, 5):  # to the next window: the 8th, then the 9th (one dropped)
        (q, k), offset = streams[moving]
        streams[moving] = ((q, k), offset + 4096)
        rope(q, k, offset=offset + 4096)
        wants = [fresh(q, k, offset=offset) for (q, k), offset in streams]
        with counting_full_paths() as full:
            for ((q, k), offset), want in zip(streams, wants, strict=True):
                assert same(rope(q, k, offset=offset), want)
        assert full["RoPE"] == 0, moving  # every request's window still kept (5 built again on the old code)


def test_plans_follow_the_thread_count_and_stay_bounded():
    """The kernel's thread count is part of a plan (a count set since makes another: the values are the same, the
    threads the kernel wakes are not); a prefill of each length
    keeps one plan, the latest 16 of a RoPE and 64 of the functions."""
    rope, _, _ = decode_rope()
    big_q, big_k = random_qk(1, 8, 8, 600, 16)  # enough elements for two threads
    want = RoPE(16)(big_q, big_k, offset=1)
    for threads in (1, 2, 1):
        with torch_threads(threads):
            assert all(torch.equal(g, w) for g, w in zip(rope(big_q, big_k, offset=1), want, strict=True))
    assert len(rope._plans) == 3  # the decode step's, and the prefill's at one thread and at two
    for length in range(1, 40):
        rope(*random_qk(1, 2, 2, length, 16), offset=0)
        apply_rotary(torch.randn(1, 2, length, 16), *table(64, 8), offset=0)
    assert len(rope._plans) == 16
    assert len(apply_module._PLANS) <= 64


def test_a_rope_with_plans_pickles_and_copies():
    """A plan holds a lock and the table's weak reference: neither travels; the copy makes its own."""
    rope, q, k = decode_rope()
    want = rope(q, k, offset=9)
    for other in (copy.deepcopy(rope), pickle.loads(pickle.dumps(rope))):
        assert len(other._plans) == 0
        assert all(torch.equal(g, w) for g, w in zip(other(q, k, offset=9), want, strict=True))
        assert len(other._plans) == 1


def test_threads_replaying_one_rope_each_get_their_own_steps():
    """Decode loops in four threads share a RoPE (one model serving several requests): each step equals the same
    step alone."""
    rope, _, _ = decode_rope(torch.bfloat16)
    steps = [(random_qk(1, 4, 2, 1, 16, dtype=torch.bfloat16, seed=seed), seed * 7 % 250) for seed in range(200)]
    wanted = [fresh(q, k, offset=offset) for (q, k), offset in steps]
    results: dict[int, list] = {}

    def work(worker):
        results[worker] = [rope(q, k, offset=offset) for (q, k), offset in steps[worker::4]]

    threads = [threading.Thread(target=work, args=(worker,)) for worker in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for worker in range(4):
        for got, want in zip(results[worker], wanted[worker::4], strict=True):
            assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


@pytest.mark.filterwarnings("ignore:`torch.jit.trace` is deprecated")  # a FutureWarning from torch 2.15 on
def test_plain_eager_sees_every_mode_and_trace():
    """What turns replays off: each of these makes plain_eager() False inside, and True after."""
    from torch.overrides import TorchFunctionMode

    assert plain_eager()
    for context in (
        TorchDispatchMode(),
        TorchFunctionMode(),
        torch.device("cpu"),  # a function mode too
        torch.autograd.forward_ad.dual_level(),
    ):
        with context:
            assert not plain_eager()
        assert plain_eager()
    assert torch.func.vmap(lambda x: torch.tensor(plain_eager()) + 0 * x)(torch.zeros(2)).tolist() == [0.0, 0.0]
    # check_trace=False: the check runs the function again untraced, where plain_eager() is True (a TracerWarning).
    traced = torch.jit.trace(lambda x: x + float(plain_eager()), torch.zeros(1), check_trace=False)
    assert traced(torch.zeros(1)).item() == 0.0


def test_in_place_calls_leave_angles_in_their_own_storage_to_the_full_path():
    """In place, angles read from the storage being rotated (one buffer holding activations and angles) must be read
    before they are overwritten: the full path copies them first. A plan kept from separate tensors of the same
    shapes is not used for them."""
    cos, sin = table(4, 8)
    apply_module._PLANS.clear()
    apply_rotary_(torch.randn(1, 1, 4, 16), cos, sin, offset=0)  # keeps the plan
    buffer = torch.randn(64)
    x, shared_cos, shared_sin = buffer.view(1, 1, 4, 16), buffer[:32].view(4, 8), buffer[32:].view(4, 8)
    want_buffer = buffer.clone()
    want = full_path(
        lambda: apply_rotary_(
            want_buffer.view(1, 1, 4, 16), want_buffer[:32].view(4, 8), want_buffer[32:].view(4, 8), offset=0
        )
    )
    got = apply_rotary_(x, shared_cos, shared_sin, offset=0)
    assert torch.equal(got, want)
    with counting_full_paths() as full:  # the plan of separate tensors is still there for them
        apply_rotary_(torch.randn(1, 1, 4, 16), cos, sin, offset=0)
    assert full["functions"] == 0


def test_in_place_calls_leave_ids_in_their_own_storage_to_the_full_path():
    """The same for position ids stored in x's own bytes (they killed the process in the CPU kernel, which read them
    again after the rotation had overwritten them): a plan kept from separate ids of the same key is not replayed
    for them; the full path copies them first."""
    cos, sin = table(8, 8)
    ids = [3, 2, 1, 0]
    apply_module._PLANS.clear()
    apply_rotary_(torch.randn(1, 1, 4, 16), cos, sin, positions=torch.tensor(ids))  # keeps the plan
    buffer = torch.randn(1, 1, 4, 16)
    shared_ids = buffer.view(-1).view(torch.int64)[:4]
    shared_ids.copy_(torch.tensor(ids))
    want_buffer = buffer.clone()
    want = full_path(lambda: apply_rotary_(want_buffer, cos, sin, positions=torch.tensor(ids)))
    with counting_full_paths() as full:
        got = apply_rotary_(buffer, cos, sin, positions=shared_ids)
    assert full["functions"] == 1 and torch.equal(got, want)
    with counting_full_paths() as full:  # the plan of separate tensors is still there for them
        apply_rotary_(torch.randn(1, 1, 4, 16), cos, sin, positions=torch.tensor(ids))
    assert full["functions"] == 0


@pytest.mark.parametrize("read", ["angles", "ids"])
def test_in_place_calls_leave_reads_in_another_storage_over_x_bytes_to_the_full_path(read):
    """Two storages may cover one buffer (torch.from_numpy of two views of one array, frombuffer): the replay
    compared where storages start, so angles or ids in x's bytes by way of another storage were replayed from a plan
    of separate tensors, read after the rotation had overwritten them (the ids: SIGSEGV)."""
    cos, sin = table(8, 8)
    ids = [3, 2, 1, 0]
    raw = bytearray(66 * 4)  # x's storage starts 8 bytes in, the twin's at the start: two storages, one set of bytes
    x = torch.frombuffer(raw, dtype=torch.float32, offset=8).view(1, 1, 4, 16)
    twin = torch.frombuffer(raw, dtype=torch.float32)[2:].view(1, 1, 4, 16)
    x.copy_(torch.randn(1, 1, 4, 16))
    if read == "angles":
        call = dict(cos=twin.view(-1)[:32].view(4, 8), sin=twin.view(-1)[32:].view(4, 8), offset=0)
        separate = dict(cos=cos[:4].clone(), sin=sin[:4].clone(), offset=0)
    else:
        twin.view(-1).view(torch.int64)[:4].copy_(torch.tensor(ids))
        call = dict(cos=cos, sin=sin, positions=twin.view(-1).view(torch.int64)[:4])
        separate = dict(cos=cos, sin=sin, positions=torch.tensor(ids))
    want = x.clone()
    want = full_path(lambda: apply_rotary_(want, **{k: v.clone() if k != "offset" else v for k, v in call.items()}))
    apply_module._PLANS.clear()
    apply_rotary_(torch.randn(1, 1, 4, 16), **separate)  # keeps the plan
    with counting_full_paths() as full:
        got = apply_rotary_(x, **call)
    assert full["functions"] == 1 and torch.equal(got, want)


def test_an_inference_tensor_rotated_in_place_outside_inference_mode_is_refused_after_a_plan():
    """A plan kept inside torch.inference_mode() for an inference tensor does not serve the same tensor outside it,
    where torch (and the full path) refuse to change it in place."""
    cos, sin = table(8, 8)
    with torch.inference_mode():
        x = torch.randn(1, 2, 3, 16)
        apply_rotary_(x, cos, sin, offset=1)
        apply_rotary_(x, cos, sin, offset=1)  # replayed
    with pytest.raises(RuntimeError, match="inference_mode"):
        apply_rotary_(x, cos, sin, offset=1)


def test_copies_and_in_place_calls_of_one_shape_are_told_apart():
    """apply_rotary and apply_rotary_ of tensors of one shape take turns: each keeps its own plan, the copy leaves x
    as it was and the in-place call rotates it."""
    cos, sin = table(8, 8)
    x = torch.randn(1, 2, 3, 16)
    apply_module._PLANS.clear()
    for _ in range(2):
        want = full_path(lambda: apply_rotary(x, cos, sin, offset=2))
        before = x.clone()
        assert torch.equal(apply_rotary(x, cos, sin, offset=2), want) and torch.equal(x, before)
        y = x.clone()
        assert apply_rotary_(y, cos, sin, offset=2) is y and torch.equal(y, want)
    assert len(apply_module._PLANS) == 2


@pytest.mark.parametrize("backend", ["auto", pytest.param("triton", marks=needs_triton)])
def test_a_replayed_in_place_call_is_seen_by_a_graph_that_saved_x(backend):
    """x saved by a graph (the other factor of a product with a weight that requires grad), then rotated in place by
    a replayed call: the backward refuses, as torch's own in-place ops and the full path make it, rather than
    compute the weight's gradient from the rotated values."""
    cos, sin = table(8, 8)
    apply_rotary_(torch.randn(1, 2, 3, 16), cos, sin, offset=1, backend=backend)  # keeps the plan
    weight, x = torch.randn(1, 2, 3, 16, requires_grad=True), torch.randn(1, 2, 3, 16)
    product = weight * x
    with counting_full_paths() as full:
        apply_rotary_(x, cos, sin, offset=1, backend=backend)
    assert full["functions"] == 0
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        product.sum().backward()


def test_arguments_a_key_cannot_hold_get_the_full_paths_errors():
    """A layout, backend or pair layout that cannot be (or must not be read as) part of a key: the full path's
    error, not the key's. A list layout raised "TypeError: unhashable type: 'list'" from the plans' lookup, where the
    full path says which layouts there are; a RoPE whose interleaved was set to 1 (equal to True as a key) replayed
    True's plan, where the full path refuses anything but a bool."""
    cos, sin = table(32, 8)
    q, k = random_qk(1, 4, 2, 1, 16)
    apply_rotary_qk(q, k, cos, sin, offset=3)
    with pytest.raises(ValueError, match="layout must be 'bhsd' or 'bshd'"):
        apply_rotary_qk(q, k, cos, sin, offset=3, layout=["bhsd"])
    with pytest.raises(ValueError, match="layout must be 'bhsd' or 'bshd'"):
        apply_rotary(q, cos, sin, offset=3, layout={"bhsd": 1})
    rope, q, k = decode_rope()
    with pytest.raises(ValueError, match="layout must be 'bhsd' or 'bshd'"):
        rope(q, k, offset=3, layout=["bhsd"])
    rope.backend = ["cpu"]
    with pytest.raises(ValueError, match="backend must be one of"):
        rope(q, k, offset=3)
    rope.backend = "auto"
    rope.interleaved = 1
    with pytest.raises(TypeError, match="interleaved must be True or False"):
        rope(q, k, offset=3)


class CountingLibrary:
    """A stand-in for the kernel library that counts the calls into it and hands them to ``library``."""

    def __init__(self, library):
        self.calls = 0
        self._library = library

    def __getattr__(self, name):
        function = getattr(self._library, name)

        def counted(*args):
            self.calls += 1
            return function(*args)

        setattr(self, name, counted)
        return counted


def test_a_plan_runs_only_the_kernel_library_loaded_now(monkeypatch):
    """A plan holds the library its launch called; where ``cpu_rope._library`` gives another since (the tests of
    the builds for older x86 levels swap it in) or none (the kernel unavailable), a replay would still call the old
    one: the older builds' tests replayed the native build's plans of the same shapes, and backend='cpu' went on
    without a kernel. Those calls take the full path, with the library there is now."""
    cos, sin = table(32, 8)
    q, k = random_qk(1, 4, 2, 1, 16)
    rope = RoPE(16)
    calls = (lambda: apply_rotary_qk(q, k, cos, sin, offset=3, backend="cpu"), lambda: rope(q, k, offset=3))
    wanted = [call() for call in calls]  # plans of the native library
    counting = CountingLibrary(cpu_rope._library()[0])
    monkeypatch.setattr(cpu_rope, "_library", lambda: (counting, ""))
    for call, want in zip(calls, wanted, strict=True):
        before = counting.calls
        got = call()
        assert counting.calls == before + 1
        assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True))
    monkeypatch.setattr(cpu_rope, "_library", lambda: (None, "no C++ compiler found"))
    with pytest.raises(RuntimeError, match="backend='cpu' is unavailable"):
        calls[0]()
    torch.testing.assert_close(calls[1](), wanted[1])  # "auto": the torch path


@pytest.mark.parametrize("backend", ["auto", pytest.param("triton", marks=needs_triton)])
def test_a_plan_is_kept_only_where_its_outputs_are_laid_out_as_a_replay_allocates_them(backend):
    """x whose elements share memory (an as_strided view, sliding windows) has outputs that torch.empty_like would lay
    out with stride 1 on another dim: the full path allocates them row-major instead. A replay allocates with
    empty_like, so the launch of such an x is not kept (a replay wrote row-major rows into the other layout: wrong
    values, not an error), on either fused kernel."""
    cos, sin = table(32, 8)
    x = torch.randn(200).as_strided((1, 2, 3, 16), (0, 16, 1, 1))
    assert torch.empty_like(x).stride(-1) != 1
    apply_module._PLANS.clear()
    for offset in (1, 5):
        got = apply_rotary(x, cos, sin, offset=offset, backend=backend)
        want = full_path(lambda offset=offset: apply_rotary(x, cos, sin, offset=offset, backend=backend))
        assert got.stride() == want.stride() and torch.equal(got, want)


def same(got, want) -> bool:
    return all(torch.equal(g, w) for g, w in zip(got, want, strict=True))


def test_what_a_key_leaves_out_is_never_replayed():
    """Arguments that a key does not hold, each after a call of the same metadata has kept a plan: rotations in
    place (which must write x and return it), position ids beside an offset (the full path adds them: a plan of
    offset 0 would drop a later offset), a RoPE's seq_len (checked against the positions), numpy offsets (not read
    as ints by the key), the kernel's thread count for the functions too."""
    cos, sin = table(64, 8)
    q, k = random_qk(1, 4, 2, 3, 16)
    x = q.clone()
    for offset in (2, 5):
        want = full_path(lambda offset=offset: apply_rotary(x.clone(), cos, sin, offset=offset))
        assert apply_rotary_(x, cos, sin, offset=offset) is x and torch.equal(x, want)
        x.copy_(q)
    ids = torch.tensor([4, 1, 7])
    for offset in (0, 5):
        got = apply_rotary_qk(q, k, cos, sin, positions=ids, offset=offset)
        assert same(got, full_path(lambda offset=offset: apply_rotary_qk(q, k, cos, sin, positions=ids, offset=offset)))
    # Rows past the table once the offset is added: the full path's error, where a replay of offset 0's plan with
    # the angles' pointers moved by the offset read past the table's end.
    with pytest.raises(ValueError, match="rows"):
        apply_rotary_qk(q, k, cos, sin, positions=torch.tensor([60, 62, 63]), offset=1)
    for offset in (np.int64(0), np.int64(3)):
        got = apply_rotary(q, cos, sin, offset=offset)
        assert torch.equal(got, full_path(lambda offset=offset: apply_rotary(q, cos, sin, offset=offset)))
    apply_module._PLANS.clear()
    big = torch.randn(1, 8, 600, 16)  # enough elements for two threads
    for threads in (1, 2):
        with torch_threads(threads):
            apply_rotary(big, *table(600, 8), offset=0)
    assert len(apply_module._PLANS) == 2

    rope = RoPE(16)
    for offset in (0, 5):  # each against a RoPE of its own, which keeps no plan before the call
        assert same(rope(q, k, positions=ids, offset=offset), RoPE(16)(q, k, positions=ids, offset=offset))
    rope(q, k, offset=3)
    with pytest.raises(ValueError, match="seq_len is shorter"):
        rope(q, k, offset=3, seq_len=4)


def test_index_tensors_the_full_path_converts_are_not_replayed():
    """Position ids or offsets of another integer dtype, and per-sequence offsets read for several tokens: the
    kernel reads a tensor the full path made from them (each token's int64 row), not the caller's, so no plan is
    kept. A replay of the caller's pointer would read other rows: here views of bigger buffers, where it reads rows
    inside the table past the view (int32 ids read as int64, (b,) offsets read as (b, s) rows) and no error."""
    cos, sin = table(64, 8)
    q, k = random_qk(2, 4, 2, 3, 16)
    rows = torch.tensor([4, 0, 1, 0, 7, 0, 2, 0, 9, 0, 3, 0])  # as int64 from int32 memory: 4, 1, 7, 2, 9, 3
    index = (
        {"positions": rows.to(torch.int32)[:6].view(2, 3)},
        {"offset": rows.to(torch.int32)[:2]},
        {"offset": rows[::2][:2]},
        {"offset": rows[:2]},
    )
    rope = RoPE(16)
    for kwargs in index:
        for _ in range(2):  # the second call would replay the first's plan
            got = apply_rotary_qk(q, k, cos, sin, **kwargs)
            assert same(got, full_path(lambda kwargs=kwargs: apply_rotary_qk(q, k, cos, sin, **kwargs))), kwargs
            assert same(rope(q, k, **kwargs), RoPE(16)(q, k, **kwargs)), kwargs


def test_a_rope_holds_the_table_a_cuda_graph_capture_reads():
    """Under a CUDA graph capture the full path holds the table it reads for the graph's life (``_hold_for_graph``):
    a capture never replays, which would skip that. (Asked of ``_capturing``, mocked: a CPU machine captures
    nothing.)"""
    rope, q, k = decode_rope()
    with mock.patch.object(module, "_capturing", return_value=True):
        rope(q, k, offset=3)
    assert len(rope._captured) == 1 and rope._captured[0] is next(iter(rope._tables.values()))


def counting_triton_launches():
    """Counts of ``plan_launch`` calls (the full path's) and of launches (the full path's and the replays')."""
    from posenc.kernels import triton_rope

    return counting_calls(planned=(triton_rope, "plan_launch"), launched=(triton_rope, "launch"))


@needs_triton
@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
def test_a_triton_plan_is_made_once_and_launched_at_every_call(layout):
    """A decode loop on Triton plans its launch once: later steps put their own tensors and offset into it (one
    launch for q and k; two where their token counts differ, as GQA's broadcast cos/sin in (b, s, h, d) give them),
    each step equal to the full path's, on RoPE's table and on cos/sin given."""
    apply_module._PLANS.clear()
    rope = RoPE(16, backend="triton")
    cos, sin = table(64, 8)
    axis = 1 if layout == "bhsd" else 2
    for entry in ("RoPE", "apply_rotary_qk"):
        with counting_triton_launches() as counts:
            for step in range(4):
                q, k = random_qk(1, 4, 2, 1, 16, layout=layout, seed=step)
                if entry == "RoPE":
                    got = rope(q, k, offset=3 + step, layout=layout)
                    want = fresh(q, k, "triton", offset=3 + step, layout=layout)
                else:
                    c, n = (
                        cos[3 + step : 4 + step][None].unsqueeze(axis),
                        sin[3 + step : 4 + step][None].unsqueeze(axis),
                    )
                    got = apply_rotary_qk(q, k, c, n, backend="triton")
                    want = full_path(lambda q=q, k=k, c=c, n=n: apply_rotary_qk(q, k, c, n, backend="triton"))
                assert same(got, want), (entry, step)
        launches = 2 if entry == "apply_rotary_qk" and layout == "bshd" else 1
        # The full path's four (want) and the first step's plan; the replays plan nothing.
        assert counts["planned"] == launches * 5, (entry, counts)
        assert counts["launched"] == launches * 8, (entry, counts)


@needs_triton
def test_dynamic_ntk_on_triton_replays_up_to_its_limit_and_plans_every_step_past_it():
    """Dynamic NTK is plain RoPE up to max_position_embeddings (8 here): its Triton decode steps read the unscaled
    table, plan once and replay, giving plain RoPE's bits; past the limit every step has frequencies of its own, and
    the rows of its positions computed for it (a window of its own), rotated with those frequencies' bits."""
    dynamic = {"rope_type": "dynamic", "factor": 4.0}
    rope = RoPE(16, rope_parameters=dynamic, max_position_embeddings=8, backend="triton")
    with counting_triton_launches() as counts:
        for step in range(3, 7):  # lengths 4..7
            q, k = random_qk(1, 4, 2, 1, 16, seed=step)
            assert same(rope(q, k, offset=step), fresh(q, k, "triton", offset=step)), step
    assert counts["planned"] == 4 + 1 and counts["launched"] == 8  # the fresh calls' four and one plan
    assert len(rope._plans) == 1 and list(rope._tables) == [(torch.device("cpu"), torch.float32)]  # RoPE's own
    with counting_triton_launches() as counts:
        for step in range(8, 11):  # lengths 9..11: the 'hf' state grows each step
            q, k = random_qk(1, 4, 2, 1, 16, seed=step)
            with mock.patch.object(apply_module, "_PLANS", apply_module.Plans(0)):
                want = RoPE(16, rope_parameters=dynamic, max_position_embeddings=8, backend="triton")(
                    q, k, offset=step, seq_len=step + 1
                )
            assert same(rope(q, k, offset=step), want), step
            assert rope.hf_scaled_len == step + 1
    # The fresh calls' three plans; this RoPE's steps compute their cos/sin, whose rotation (cos/sin given) plans
    # once and replays apply_rotary_qk's plan after.
    assert counts["planned"] == 3 + 1 and counts["launched"] == 6


@needs_triton
def test_triton_calls_that_read_ids_or_leave_the_table_take_the_full_path():
    """What only the full path checks on Triton, after a plan of the same metadata: ids and offsets tensors (rows
    checked on the host there; the kernel alone would give a token outside the table NaN), an offset past a given
    table (the full path's error) or past a RoPE's (its table grows)."""
    apply_module._PLANS.clear()
    cos, sin = table(64, 8)
    q, k = random_qk(1, 4, 2, 1, 16)
    for _ in range(2):
        got = apply_rotary_qk(q, k, cos, sin, positions=torch.tensor([[5]]), backend="triton")
        assert same(
            got, full_path(lambda: apply_rotary_qk(q, k, cos, sin, positions=torch.tensor([[5]]), backend="triton"))
        )
    with pytest.raises(ValueError, match="rows"):
        apply_rotary_qk(q, k, cos, sin, positions=torch.tensor([[70]]), backend="triton")
    with pytest.raises(ValueError, match="rows"):
        apply_rotary_qk(q, k, cos, sin, offset=torch.tensor([70]), backend="triton")
    apply_rotary_qk(q, k, cos, sin, offset=60, backend="triton")
    with pytest.raises(ValueError, match="rows"):
        apply_rotary_qk(q, k, cos, sin, offset=64, backend="triton")
    rope = RoPE(16, backend="triton")
    rope(q, k, offset=3)
    rows = next(iter(rope._tables.values()))[0].shape[0]
    assert same(rope(q, k, offset=rows), fresh(q, k, "triton", offset=rows))
    assert next(iter(rope._tables.values()))[0].shape[0] > rows


@pytest.mark.parametrize("backend", ["auto", pytest.param("triton", marks=needs_triton)])
def test_a_rope_keeps_a_plan_where_its_first_call_replays_the_functions(backend):
    """A second RoPE's first call: its rotation replays the plan the first RoPE's call left in the functions' store,
    and that replayed launch is what the second RoPE keeps its own plan of (its later calls replay too)."""
    q, k = random_qk(1, 4, 2, 1, 16)
    RoPE(16, backend=backend)(q, k, offset=3)
    second = RoPE(16, backend=backend)
    with counting_full_paths() as full:
        for step in range(3):
            second(q, k, offset=3 + step)
    assert full == {"functions": 0, "RoPE": 1}


@needs_triton
def test_triton_calls_given_angles_the_full_path_converts_are_not_replayed():
    """cos/sin the Triton kernel cannot read as they are (float32 beside float64 activations, which read float64;
    cos and sin with different strides): the full path converts them, so no plan is kept. A replay of the caller's
    pointers would read float32 bits as float64, or sin with cos's strides, with no error."""
    cos, sin = table(8, 8)
    given = (
        (torch.float64, cos[3:4], sin[3:4]),
        (torch.bfloat16, cos[3:4], sin.t().contiguous().t()[3:4]),
    )
    apply_module._PLANS.clear()
    for dtype, c, n in given:
        q, k = random_qk(1, 4, 2, 1, 16, dtype=dtype)
        c, n = c[None, None], n[None, None]
        for _ in range(2):
            got = apply_rotary_qk(q, k, c, n, backend="triton")
            assert same(got, full_path(lambda q=q, k=k, c=c, n=n: apply_rotary_qk(q, k, c, n, backend="triton")))
    assert len(apply_module._PLANS) == 2
    assert all(plan is apply_module._FULL_PATH for plan in apply_module._PLANS._plans.values())


@pytest.mark.parametrize("backend", ["auto", pytest.param("triton", marks=needs_triton)])
def test_offsets_whose_rows_leave_the_table_get_the_full_paths_answer_after_a_plan(backend):
    """After a plan of several tokens read from an int offset: an offset whose last rows lie past the table, or a
    negative one, gets the full path's error (a replay of Triton's launch would give the tokens past the table NaN,
    and those before row 0 too), and a RoPE's table grows for the rows past it, as at a first call."""
    apply_module._PLANS.clear()
    cos, sin = table(64, 8)
    q, k = random_qk(1, 4, 2, 4, 16)
    for _ in range(2):  # the plan, then its replay: the last offset whose four rows the table holds
        got = apply_rotary_qk(q, k, cos, sin, offset=60, backend=backend)
        assert same(got, full_path(lambda: apply_rotary_qk(q, k, cos, sin, offset=60, backend=backend)))
    with pytest.raises(ValueError, match=r"positions reach 61 \.\. 64 but the cos/sin table has 64 rows"):
        apply_rotary_qk(q, k, cos, sin, offset=61, backend=backend)
    with pytest.raises(ValueError, match="offset must be >= 0"):
        apply_rotary_qk(q, k, cos, sin, offset=-1, backend=backend)
    rope = RoPE(16, backend=backend)
    rope(q, k, offset=0)
    rows = next(iter(rope._tables.values()))[0].shape[0]
    assert same(rope(q, k, offset=rows - 4), fresh(q, k, backend, offset=rows - 4))
    assert next(iter(rope._tables.values()))[0].shape[0] == rows  # replayed: the table as it was
    assert same(rope(q, k, offset=rows - 3), fresh(q, k, backend, offset=rows - 3))
    assert next(iter(rope._tables.values()))[0].shape[0] > rows
    with pytest.raises(ValueError, match="offset must be >= 0"):
        rope(q, k, offset=-1)


@pytest.mark.parametrize("backend", ["auto", pytest.param("triton", marks=needs_triton)])
def test_q_given_as_k_too_is_rotated_into_both_outputs_at_every_call(backend):
    """apply_rotary_qk(q, q) and rope(q, q): one tensor given twice, which one Triton launch rotates into two outputs.
    A plan finds the call's tensors in a launch by their pointers, which cannot tell q from k here: one that took
    the launch for q's alone would leave k's output unwritten at a replay."""
    apply_module._PLANS.clear()
    cos, sin = table(64, 8)
    rope = RoPE(16, backend=backend)
    for step in range(3):
        q = random_qk(1, 4, 4, 1, 16, seed=step)[0]
        got = apply_rotary_qk(q, q, cos, sin, offset=step, backend=backend)
        want = full_path(lambda q=q, step=step: apply_rotary_qk(q, q, cos, sin, offset=step, backend=backend))
        assert same(got, want) and same(got[::-1], want), step
        assert same(rope(q, q, offset=step), fresh(q, q, backend, offset=step)), step


def test_cuda_tensors_are_keyed_by_device_and_never_during_a_graph_capture():
    """A CUDA tensor's key holds its device index (a plan of cuda:0 must not serve cuda:1), and none is made while a
    CUDA graph is captured on the current stream: a capture's calls take the full path, which holds what they read
    for the graph's life. (Mocked: a CPU tensor made to read as a CUDA one; a CPU machine captures nothing.)"""
    from posenc.kernels.replay import tensor_key

    t = torch.zeros(2, 3)
    assert tensor_key(t, False) == (t.shape, t.stride(), t.dtype, torch._C._dispatch_keys(t).raw_repr())
    with (
        mock.patch.object(torch.Tensor, "is_cpu", new_callable=mock.PropertyMock, return_value=False),
        mock.patch.object(torch.Tensor, "is_cuda", new_callable=mock.PropertyMock, return_value=True),
        mock.patch.object(torch.Tensor, "get_device", return_value=1),
    ):
        with mock.patch.object(torch.cuda, "is_current_stream_capturing", return_value=False):
            assert tensor_key(t, False)[-1] == 1
        with mock.patch.object(torch.cuda, "is_current_stream_capturing", return_value=True):
            assert tensor_key(t, False) is None
    assert tensor_key(t.to("meta"), False) is None


@pytest.mark.skipif(
    not torch.cuda.is_available() or triton_module_or_error()[0] is None or _triton_interpreted(),
    reason="needs a CUDA device and Triton compiled for it (scripts/gpu_check.sh runs it)",
)
def test_triton_replays_windows_on_cuda():
    """On a GPU: decode steps past the largest table replay the plan of the window they read, and a decode step of
    dynamic NTK past its limit the plan of its own rows' window, with the bits of the full path (cos/sin computed
    for the call's length: ``cos_sin(..., seq_len=)``, rotated as given)."""
    device = torch.device("cuda")
    apply_module._PLANS.clear()
    rope = RoPE(64)
    offsets = (70_000, 70_001, 73_727, 73_728)  # the window of rows 69632..73727, then the next
    qks = [tuple(t.to(device) for t in random_qk(1, 4, 2, 1, 64, dtype=torch.bfloat16, seed=o)) for o in offsets]
    wants = [fresh(q, k, offset=offset) for (q, k), offset in zip(qks, offsets, strict=True)]
    with counting_triton_launches() as counts:
        for (q, k), offset, want in zip(qks, offsets, wants, strict=True):
            assert same(rope(q, k, offset=offset), want), offset
    # One plan: the first call's full path. The next window's full path replays the functions' plan of that call
    # (posenc.rope.apply: the same shapes, a window given as the table), the other two calls this RoPE's plan.
    assert counts == {"planned": 1, "launched": 4}, counts
    dynamic = RoPE(64, rope_parameters={"rope_type": "dynamic", "factor": 4.0}, max_position_embeddings=16)
    for step in range(16, 20):  # each a new length: the 'hf' state grows
        for layer in range(3):
            q, k = (t.to(device) for t in random_qk(1, 4, 2, 1, 64, dtype=torch.bfloat16, seed=10 * step + layer))
            cos, sin = dynamic.cos_sin(torch.tensor([[step]], device=device), seq_len=step + 1)
            want = full_path(lambda q=q, k=k, c=cos, n=sin: apply_rotary_qk(q, k, c[:, None], n[:, None]))
            assert same(dynamic(q, k, offset=step), want), (step, layer)
        assert dynamic.hf_scaled_len == step + 1


@pytest.mark.skipif(
    not torch.cuda.is_available() or triton_module_or_error()[0] is None or _triton_interpreted(),
    reason="needs a CUDA device and Triton compiled for it (scripts/gpu_check.sh runs it)",
)
def test_triton_replays_on_cuda_equal_the_full_path_and_stay_out_of_graph_captures():
    """On a GPU: decode steps through RoPE and apply_rotary_qk (cos/sin given) plan their launch once and replay it
    with the bits of the full path; a CUDA graph captured after a plan exists takes the full path (a capture holds
    what it reads), and its replay rotates new values as an eager call does."""
    device = torch.device("cuda")
    apply_module._PLANS.clear()
    rope = RoPE(64)
    cos, sin = (t.to(device) for t in table(64, 32))
    with counting_triton_launches() as counts:
        for step in range(3):
            q, k = (t.to(device) for t in random_qk(1, 4, 2, 1, 64, dtype=torch.bfloat16, seed=step))
            assert same(rope(q, k, offset=3 + step), fresh(q, k, offset=3 + step))
            c, n = cos[3 + step : 4 + step][None, None], sin[3 + step : 4 + step][None, None]
            assert same(apply_rotary_qk(q, k, c, n), full_path(lambda q=q, k=k, c=c, n=n: apply_rotary_qk(q, k, c, n)))
    # Each entry's first call, and the six full paths the comparisons took; every other call replayed.
    assert counts == {"planned": 8, "launched": 12}, counts
    q, k = (t.to(device) for t in random_qk(1, 4, 2, 1, 64, dtype=torch.bfloat16, seed=9))
    c, n = cos[5:6][None, None], sin[5:6][None, None]
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        apply_rotary_qk(q, k, c, n)  # warm-up, replayed
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with counting_triton_launches() as counts, torch.cuda.graph(graph):
        captured = apply_rotary_qk(q, k, c, n)
    assert counts["planned"] == 1, "a capture replayed a plan"
    fresh_q = torch.randn_like(q)
    q.copy_(fresh_q)
    graph.replay()
    torch.cuda.synchronize()
    assert same(captured, full_path(lambda: apply_rotary_qk(q, k, c, n)))
