"""Run by test_dtensor_compile.py, in one process (world size 1) or under torchrun (2, gloo); not collected by pytest.

Compiled (and eager) rotations of DTensors, sharded on the heads, the sequence (uneven on 2 ranks: 5 tokens), the
batch or replicated, with broadcast cos/sin (replicated, or sharded with x's sequence) and tables read at an offset or
at position ids (replicated, or sharded with x's sequence), against a float64 formula on plain tensors. Compiled, a
DTensor call failed with "Operator posenc.rotary.default does not have a sharding strategy registered"; with DTensor
position ids, compiled and eager failed too (torch._assert_async has no sharding strategy; DTensor refuses .tolist()).
Prints ok.
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

    # name, x, x's placement, extra tensors and their placements, kwargs, the global cos/sin rows x reads
    cases = []
    for p in (Shard(0), Shard(1), Shard(2), Replicate()):
        cases.append(("broadcast", x, p, (cos[:s], sin[:s]), (Replicate(),), {}, cos[:s], sin[:s]))
        rows = slice(3, 3 + s)
        cases.append(("table offset=3", x, p, (cos, sin), (Replicate(),), {"offset": 3}, cos[rows], sin[rows]))
        cases.append(("positions", x, p, (cos, sin, positions), (Replicate(),), {}, cos[positions], sin[positions]))
    # cos/sin sharded along x's sequence, and positions sharded with it (each token keeps its global position).
    cases.append(("broadcast sharded cos", x, Shard(2), (cos[:s], sin[:s]), (Shard(0),), {}, cos[:s], sin[:s]))
    cases.append(("positions sharded", x, Shard(2), (cos, sin, positions), (Replicate(), Replicate(), Shard(0)), {},
                  cos[positions], sin[positions]))  # fmt: skip
    bshd = x.transpose(1, 2).contiguous()
    cases.append(("bshd offset=3", bshd, Shard(1), (cos, sin), (Replicate(),), {"offset": 3, "layout": "bshd"},
                  cos[3 : 3 + s, None], sin[3 : 3 + s, None]))  # fmt: skip
    failures = []
    for index, (name, xg, placement, extra, extra_placements, kwargs, want_cos, want_sin) in enumerate(cases):
        kwargs = dict(kwargs)
        if name.startswith("positions"):
            kwargs["positions"] = "t2"
        tensors = [dt(t, *(extra_placements if len(extra_placements) == 1 else [extra_placements[i]]))
                   for i, t in enumerate(extra)]  # fmt: skip
        for interleaved in (False, True) if placement == Shard(2) else (index % 2 == 1,):
            want = reference(xg, want_cos, want_sin, interleaved)
            for how in ("copy", "inplace", "grad", "eager"):
                torch._dynamo.reset()

                def f(a, c, s_, *rest, how=how, interleaved=interleaved, kwargs=kwargs):
                    k = {key: rest[0] if value == "t2" else value for key, value in kwargs.items()}
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
    dist.destroy_process_group()
    if failures:
        raise SystemExit("\n".join(failures))
    print("ok")


if __name__ == "__main__":
    main()
