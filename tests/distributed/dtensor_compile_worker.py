"""Run by test_dtensor_compile.py, in one process (world size 1) or under torchrun (2, gloo); not collected by pytest.

Compiled (and eager) rotations of DTensors, sharded on the heads, the sequence (uneven on 2 ranks: 5 tokens), the
batch or replicated, with broadcast cos/sin (replicated, or sharded with x's sequence) and tables read at an offset or
at position ids (replicated, or sharded with x's sequence), at per-sequence offsets, packed by cu_seqlens, and by
plain tensors beside the DTensors, and RoPE's forward, against a float64 formula on plain tensors (RoPE: its own call
on them). Compiled, a DTensor call failed with "Operator posenc.rotary.default does not have a sharding strategy
registered"; with DTensor position ids, compiled and eager failed too (torch._assert_async has no sharding strategy;
DTensor refuses .tolist()); with a tensor offset, cu_seqlens or any plain tensor (RoPE's tables), eager and compiled
failed with "got mixed torch.Tensor and DTensor". Prints ok.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

import posenc


def reference(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool) -> torch.Tensor:
    """x rotated in float64; cos/sin (..., r/2) broadcast to x's rows."""
    x, cos, sin = x.double(), cos.double(), sin.double()
    half = cos.shape[-1]
    if interleaved:
        a, b = x[..., 0 : 2 * half : 2], x[..., 1 : 2 * half : 2]
    else:
        a, b = x[..., :half], x[..., half : 2 * half]
    ra, rb = a * cos - b * sin, b * cos + a * sin
    rotated = torch.stack((ra, rb), -1).flatten(-2) if interleaved else torch.cat((ra, rb), -1)
    return torch.cat((rotated, x[..., 2 * half :]), -1)


def main() -> None:
    if "RANK" in os.environ:
        dist.init_process_group("gloo")
    else:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    world = dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(0)
    b, h, s, d, half = 2, 4, 5, 10, 4  # d > 2 * half: the tail passes through
    x = torch.randn(b, h, s, d)
    angles = torch.arange(16.0)[:, None] * 10000.0 ** (-torch.arange(half) / half)
    cos, sin = angles.cos(), angles.sin()
    positions = torch.tensor([3, 1, 4, 1, 5])
    dt = lambda t, *p: distribute_tensor(t, mesh, list(p) or [Replicate()])  # noqa: E731
    rot = lambda *a, **k: posenc.apply_rotary(*a, **k)  # noqa: E731

    # name, x, x's placement, extra tensors and their placements (one for all, or one each; None: a plain tensor,
    # taken as the whole value on every rank), kwargs ("tN": extra tensor N), the global cos/sin rows x reads.
    cases = []
    offsets = torch.tensor([2, 7])
    rows_at = lambda o: o[:, None] + torch.arange(s)  # noqa: E731  # (b, s): token i of sequence j reads o[j] + i
    for p in (Shard(0), Shard(1), Shard(2), Replicate()):
        cases.append(("broadcast", x, p, (cos[:s], sin[:s]), (Replicate(),), {}, cos[:s], sin[:s]))
        rows = slice(3, 3 + s)
        cases.append(("table offset=3", x, p, (cos, sin), (Replicate(),), {"offset": 3}, cos[rows], sin[rows]))
        cases.append(("positions", x, p, (cos, sin, positions), (Replicate(),), {"positions": "t2"}, cos[positions],
                      sin[positions]))  # fmt: skip
        # Per-sequence offsets, plain or a DTensor: the rows were built from a plain arange beside the DTensors
        # ("aten.add.Tensor got mixed torch.Tensor and DTensor"), as were plain position ids and cos/sin.
        want = cos[rows_at(offsets)][:, None], sin[rows_at(offsets)][:, None]
        cases.append(("tensor offset", x, p, (cos, sin, offsets), (Replicate(), Replicate(), None),
                      {"offset": "t2"}, *want))  # fmt: skip
        cases.append(("dtensor offset", x, p, (cos, sin, offsets), (Replicate(),), {"offset": "t2"}, *want))
        cases.append(("plain positions", x, p, (cos, sin, positions), (Replicate(), Replicate(), None),
                      {"positions": "t2"}, cos[positions], sin[positions]))  # fmt: skip
        cases.append(("plain table", x, p, (cos, sin), (None, None), {"offset": 3}, cos[rows], sin[rows]))
        cases.append(("plain broadcast", x, p, (cos[:s], sin[:s]), (None, None), {}, cos[:s], sin[:s]))
    # cos/sin sharded along x's sequence, and positions sharded with it (each token keeps its global position).
    cases.append(("broadcast sharded cos", x, Shard(2), (cos[:s], sin[:s]), (Shard(0),), {}, cos[:s], sin[:s]))
    cases.append(("positions sharded", x, Shard(2), (cos, sin, positions), (Replicate(), Replicate(), Shard(0)),
                  {"positions": "t2"}, cos[positions], sin[positions]))  # fmt: skip
    both = positions + offsets[:, None]
    cases.append(("positions sharded + plain offset", x, Shard(2), (cos, sin, positions, offsets),
                  (Replicate(), Replicate(), Shard(0), None), {"positions": "t2", "offset": "t3"},
                  cos[both][:, None], sin[both][:, None]))  # fmt: skip
    bshd = x.transpose(1, 2).contiguous()
    cases.append(("bshd offset=3", bshd, Shard(1), (cos, sin), (Replicate(),), {"offset": 3, "layout": "bshd"},
                  cos[3 : 3 + s, None], sin[3 : 3 + s, None]))  # fmt: skip
    cases.append(("bshd tensor offset", bshd, Shard(1), (cos, sin, offsets), (Replicate(), Replicate(), None),
                  {"offset": "t2", "layout": "bshd"}, cos[rows_at(offsets)][:, :, None],
                  sin[rows_at(offsets)][:, :, None]))  # fmt: skip
    decode = x[:, :, :1].contiguous()  # a decode step's rows are the offsets themselves
    cases.append(("decode tensor offset", decode, Shard(0), (cos, sin, offsets), (Replicate(), Replicate(), None),
                  {"offset": "t2"}, cos[offsets][:, None, None], sin[offsets][:, None, None]))  # fmt: skip
    # Two packed sequences of 3 and 4 tokens, x (total, h, d), sharded on the tokens (uneven on 2 ranks, a sequence
    # straddling them) or the heads: positions restart at each sequence's global start.
    packed, cu = torch.randn(7, h, d), torch.tensor([0, 3, 7])
    packed_rows = torch.tensor([0, 1, 2, 0, 1, 2, 3])
    for p in (Shard(0), Shard(1), Replicate()):
        cases.append(("cu_seqlens", packed, p, (cos, sin, cu), (Replicate(), Replicate(), None),
                      {"cu_seqlens": "t2"}, cos[packed_rows, None], sin[packed_rows, None]))  # fmt: skip
        with_offsets = packed_rows + torch.tensor([2, 2, 2, 7, 7, 7, 7])
        cases.append(("dtensor cu_seqlens + offset", packed, p, (cos, sin, cu, offsets), (Replicate(),),
                      {"cu_seqlens": "t2", "offset": "t3"}, cos[with_offsets, None],
                      sin[with_offsets, None]))  # fmt: skip
    # Compiled in place and with a gradient too for the cases before the tensor offsets, and after them where x is
    # sharded on its tokens (the rest compile a copy: each compile takes seconds). Where x is sharded on its sequence
    # both pair layouts compile a copy, and in place and with a gradient only one, alternating case by case (the
    # layout only slices the last dimension, which no case shards): both layouts still meet every way.
    every_way = {"broadcast", "table offset=3", "positions", "broadcast sharded cos", "positions sharded",
                 "bshd offset=3"}  # fmt: skip
    failures = []
    for index, (name, xg, placement, extra, extra_placements, kwargs, want_cos, want_sin) in enumerate(cases):
        tokens = Shard(0) if name.endswith("cu_seqlens") or "cu_seqlens +" in name else Shard(2)
        ways = ("copy", "inplace", "grad", "eager") if name in every_way or placement == tokens else ("copy", "eager")
        placements = extra_placements * len(extra) if len(extra_placements) == 1 else extra_placements
        tensors = [t if where is None else dt(t, where) for t, where in zip(extra, placements, strict=True)]
        for interleaved in (False, True) if placement == Shard(2) else (index % 2 == 1,):
            want = reference(xg, want_cos, want_sin, interleaved)
            for how in ways if interleaved == (index % 2 == 1) else ("copy", "eager"):
                torch._dynamo.reset()

                def f(a, c, s_, *rest, how=how, interleaved=interleaved, kwargs=kwargs):
                    given = (c, s_, *rest)
                    k = {key: given[int(v[1:])] if str(v)[:1] == "t" else v for key, v in kwargs.items()}
                    if how == "inplace":
                        return posenc.apply_rotary_(a, c, s_, interleaved=interleaved, **k)
                    return rot(a, c, s_, interleaved=interleaved, **k)

                a = dt(xg.clone(), placement)
                if how == "grad":
                    a.requires_grad_(True)
                try:
                    run = f if how == "eager" else torch.compile(f, backend="aot_eager", fullgraph=True)
                    out = run(a, *tensors)
                    assert isinstance(out, DTensor), type(out)
                    got = out.full_tensor()
                    if how == "inplace":
                        assert out is a, "apply_rotary_ must return x"
                    if how == "grad":
                        out.square().sum().backward()
                        # A rotation keeps norms: the gradient of |R x|^2 is 2 x.
                        assert torch.allclose(a.grad.full_tensor(), 2 * xg, atol=1e-5), "gradient"
                    err = (got.double() - want).abs().max().item()
                    assert err < 1e-5, f"max error {err}"
                except Exception as error:
                    failures.append(f"{name} {placement} interleaved={interleaved} {how}: {type(error).__name__}: "
                                    f"{str(error).splitlines()[0][:300]}")  # fmt: skip
    # RoPE's cached tables are plain tensors: with DTensor q and k every call failed (mixed torch.Tensor and DTensor).
    rope = posenc.RoPE(d, rotary_dim=2 * half)
    q, k = torch.randn(b, h, s, d), torch.randn(b, 2, s, d)
    for kwargs in ({}, {"offset": 3}, {"offset": offsets}, {"offset": dt(offsets)}, {"positions": positions},
                   {"positions": dt(positions, Shard(0))}):  # fmt: skip
        plain = {key: v.full_tensor() if isinstance(v, DTensor) else v for key, v in kwargs.items()}
        want_q, want_k = rope(q, k, **plain)
        for p in (Shard(1), Shard(2)):
            for compiled in (False, True):
                torch._dynamo.reset()
                run = torch.compile(rope, backend="aot_eager", fullgraph=True) if compiled else rope
                try:
                    got_q, got_k = run(dt(q, p), dt(k, p), **kwargs)
                    err = max((got_q.full_tensor() - want_q).abs().max(), (got_k.full_tensor() - want_k).abs().max())
                    assert err < 1e-5, f"max error {float(err)}"
                except Exception as error:
                    failures.append(f"RoPE {list(kwargs)} {p} compiled={compiled}: {type(error).__name__}: "
                                    f"{str(error).splitlines()[0][:300]}")  # fmt: skip
    # Plain (whole) x with DTensor ids, offsets or cu_seqlens (and cos/sin): with plain cos/sin, the fused CPU kernel
    # ("auto") read the DTensor ids' storage, not their values, and rotated by the wrong rows without an error (max
    # error 4.6); the torch path failed with "mixed torch.Tensor and DTensor".
    plain_calls = [
        (x, {"positions": positions}, cos[positions], sin[positions]),
        (x, {"offset": offsets}, cos[rows_at(offsets)][:, None], sin[rows_at(offsets)][:, None]),
        (packed, {"cu_seqlens": cu, "offset": offsets}, cos[with_offsets, None], sin[with_offsets, None]),
    ]
    for xg, kwargs, want_cos, want_sin in plain_calls:
        want = reference(xg, want_cos, want_sin, False)
        for p in (Shard(0), Replicate()):
            for backend, compiled in (("auto", False), ("torch", False), ("auto", True)):
                torch._dynamo.reset()
                call = torch.compile(rot, backend="aot_eager", fullgraph=True) if compiled else rot
                given = {key: dt(t, p) for key, t in kwargs.items()}
                tables = (cos, sin) if p == Shard(0) else (dt(cos), dt(sin))  # plain ones took the fused kernel
                try:
                    got = call(xg, *tables, backend=backend, **given)
                    assert type(got) is torch.Tensor, type(got)
                    err = (got.double() - want).abs().max().item()
                    assert err < 1e-5, f"max error {err}"
                except Exception as error:
                    failures.append(f"plain x, DTensor {list(kwargs)} {p} {backend} compiled={compiled}: "
                                    f"{type(error).__name__}: {str(error).splitlines()[0][:300]}")  # fmt: skip
    # DTensor cos/sin alone beside plain x and plain (or no) ids: their whole values too. Only the ids, offsets and
    # cu_seqlens were looked at, and the DTensor table met plain x or ids ("mixed torch.Tensor and DTensor").
    for kwargs, rows in (({}, slice(0, s)), ({"offset": 3}, slice(3, 3 + s)), ({"positions": positions}, positions)):
        tables = (cos, sin) if kwargs else (cos[:s], sin[:s])
        for backend in ("auto", "torch"):
            try:
                got = rot(x, *(dt(t) for t in tables), backend=backend, **kwargs)
                assert type(got) is torch.Tensor, type(got)
                err = (got.double() - reference(x, cos[rows], sin[rows], False)).abs().max().item()
                assert err < 1e-5, f"max error {err}"
            except Exception as error:
                failures.append(f"plain x and ids, DTensor cos/sin {list(kwargs)} {backend}: {type(error).__name__}: "
                                f"{str(error).splitlines()[0][:300]}")  # fmt: skip
    # cos_sin and rotate with DTensor ids: the plain table indexed by a DTensor failed (mixed torch.Tensor and
    # DTensor). cos/sin come back laid out as the ids are.
    ids = torch.tensor([[3, 1, 4, 1, 5], [0, 1, 2, 3, 9]])
    want_cos, want_sin = rope.cos_sin(ids)
    want_x = rope.rotate(x, ids)
    for p in (Shard(0), Shard(1), Replicate()):
        for compiled in (False, True):
            torch._dynamo.reset()
            cos_sin = torch.compile(rope.cos_sin, backend="aot_eager", fullgraph=True) if compiled else rope.cos_sin
            rotate = torch.compile(rope.rotate, backend="aot_eager", fullgraph=True) if compiled else rope.rotate
            try:
                got_cos, got_sin = cos_sin(dt(ids, p))
                assert got_cos.placements == (p,), got_cos.placements
                got_x = rotate(dt(x, Shard(2)), dt(ids, p))
                pairs = ((got_cos, want_cos), (got_sin, want_sin), (got_x, want_x))
                err = max((got.full_tensor() - want).abs().max() for got, want in pairs)
                assert err < 1e-6, f"max error {float(err)}"
            except Exception as error:
                failures.append(f"RoPE.cos_sin/rotate ids {p} compiled={compiled}: {type(error).__name__}: "
                                f"{str(error).splitlines()[0][:300]}")  # fmt: skip
    # CausalSelfAttention of plain x at DTensor ids, compiled: ALiBi's bias, and a KVCache whose next step has plain
    # ids. The DTensor ids met the bias's plain slopes and, cached, the plain ids ("RuntimeError when making fake
    # tensor call", eager: "got mixed torch.Tensor and DTensor").
    xa, step = torch.randn(b, s, 32), torch.randn(b, 1, 32)
    ids, next_ids = torch.tensor([[3, 1, 4, 1, 5], [0, 1, 2, 3, 9]]), torch.tensor([[6], [10]])
    alibi = posenc.CausalSelfAttention(32, 2, encoding=posenc.ALiBi(2))
    rotary = posenc.CausalSelfAttention(32, 2, encoding=posenc.RoPE(16))

    def prefill_and_step(first):
        cache = posenc.KVCache()
        rotary(xa, positions=first, cache=cache)
        return rotary(step, positions=next_ids, cache=cache)

    for name, call in (("ALiBi", lambda first: alibi(xa, positions=first)), ("KVCache step", prefill_and_step)):
        torch._dynamo.reset()
        try:
            got = torch.compile(call, backend="aot_eager", fullgraph=True)(dt(ids, Shard(1)))
            err = (got - call(ids)).abs().max().item()
            assert err < 1e-5, f"max error {err}"
        except Exception as error:
            failures.append(f"CausalSelfAttention {name}, DTensor ids, compiled: {type(error).__name__}: "
                            f"{str(error).splitlines()[0][:300]}")  # fmt: skip
    dist.destroy_process_group()
    if failures:
        raise SystemExit("\n".join(failures))
    print("ok")


if __name__ == "__main__":
    main()
