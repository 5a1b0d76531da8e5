"""float64 references written for clarity, one tolerance table, and input generators.

Used by the tests and the benchmarks; every fast path in posenc is compared against these. The references loop
over pairs and positions the way the papers write the math, and compute everything in float64.
"""

from __future__ import annotations

import contextlib
import math
import numbers
import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import torch

from posenc._checks import base_value, even_positive_int, float_tensor, integer, positive_int, same_device
from posenc.bias.alibi import alibi_head_count

__all__ = [
    "DTYPES",
    "REDUCTION_TOLERANCES",
    "TINY_HF_SIZES",
    "TOLERANCES",
    "alibi_bias_reference",
    "alibi_slopes_reference",
    "assert_close",
    "attention_reference",
    "random_qk",
    "rope_inv_freq_reference",
    "rope_reference",
    "run_torchrun",
    "sinusoidal_reference",
    "t5_bucket_reference",
    "torch_threads",
]

# (atol, rtol) for comparing a result in `dtype` against the float64 reference, for elementwise ops (a rotation,
# an embedding). rtol is one unit in the last place of the dtype: the best a result rounded once can do, plus
# the float32 intermediate rounding. atol is in units of the operands' size: an output of a rotation near zero
# (x1 cos - x2 sin cancelling) carries the float32 rounding of products of size |x|, about |x| 2^-24, whatever its
# own size. assert_close multiplies it by the largest |reference| of the row (or its `scale=`), so that correct
# results pass and wrong ones fail at every activation scale; the plain absolute tolerance for unit-scale data
# (randn), as torch.testing.assert_close takes it. Reductions (attention) use REDUCTION_TOLERANCES.
TOLERANCES: dict[torch.dtype, tuple[float, float]] = {
    torch.float64: (1e-12, 1e-12),
    torch.float32: (1e-6, 2.0**-20),
    torch.bfloat16: (1e-6, 2.0**-7),
    torch.float16: (1e-6, 2.0**-10),
}
REDUCTION_TOLERANCES: dict[torch.dtype, tuple[float, float]] = {
    torch.float64: (1e-10, 1e-10),
    torch.float32: (1e-5, 1e-4),
    torch.bfloat16: (2e-2, 2e-2),
    torch.float16: (2e-3, 2e-3),
}
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# The sizes of a tiny transformers text model, given to a config class over its defaults (no download): two layers
# of 4 query and 2 key/value heads of 16 channels; initializer range 0.3, so that attention is peaked enough for
# the rotation to move the logits by far more than float32 rounding.
TINY_HF_SIZES: dict[str, int | float] = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    initializer_range=0.3,
)


def assert_close(
    actual: torch.Tensor,
    reference: torch.Tensor,
    *,
    reduction: bool = False,
    msg: str = "",
    scale: float | torch.Tensor | None = None,
) -> None:
    """Compare ``actual`` with a float64 ``reference`` using the tolerance of ``actual.dtype`` (float64, float32,
    bfloat16, float16); integer and bool tensors (positions, buckets, masks) have no rounding and compare exactly.

    An element passes when ``|actual - reference| <= atol * scale + rtol * |reference|`` (plus one subnormal step of
    the dtype, which float16 needs below 6e-5), with ``(atol, rtol)`` from ``TOLERANCES``, or ``REDUCTION_TOLERANCES``
    with ``reduction=True``. ``scale`` is the size of the operands the element was computed from: by default the
    largest finite ``|reference|`` in its row (the last dimension), which bounds a rotation's pairs, so a check
    means the same at every activation scale. Give it (a float, or a tensor broadcastable to ``reference``) where the
    operands are larger than the result, e.g. the largest ``|v|`` for an attention output that averages values of
    both signs, and where each element is computed on its own from operands of its own size (a bias table, whose
    rows grow from 0 at the diagonal to slope * distance: ``scale=reference.abs()``, or ``scale=1.0`` for the plain
    absolute tolerance), which the row's largest value would let drift. Non-finite values must match exactly (nan
    never does).
    """
    for name, value in (("actual", actual), ("reference", reference)):
        if not isinstance(value, torch.Tensor):
            # An AttributeError from the first tensor method before (a list, a numpy array).
            raise TypeError(f"{name} must be a torch.Tensor, got {type(value).__name__}; wrap it with torch.as_tensor")
    for name, value in (("actual", actual), ("reference", reference), ("scale", scale)):
        if isinstance(value, torch.Tensor) and value.device.type == "meta":
            # torch's bare "Tensor.item() cannot be called on meta tensors" before (integers passed unread).
            raise ValueError(
                f"assert_close compares values, and {name} is on the meta device, which holds none (shapes only); "
                "compare tensors computed on the CPU or a GPU"
            )
    if reference.is_complex():
        # Cast to float64 below, it lost its imaginary part: [1, 2] passed against [1+5j, 2].
        raise TypeError(
            "assert_close compares real tensors, and reference is complex; compare torch.view_as_real of both"
        )
    if scale is not None and actual.shape == reference.shape and actual.device == reference.device:
        # Checked on every path: integer operands and empty ones returned before their scale was looked at, so a
        # negative or misshapen scale passed there and failed only once the operands became floats or non-empty.
        _checked_scale(scale, reference)
    if not actual.is_floating_point() and not actual.is_complex():
        # In int64 where both are integers: float64 holds integers exactly only up to 2**53.
        wide = torch.int64 if not (reference.is_floating_point() or reference.is_complex()) else torch.float64
        torch.testing.assert_close(actual.to(wide), reference.to(wide), atol=0, rtol=0, msg=msg or None)
        return
    table = REDUCTION_TOLERANCES if reduction else TOLERANCES
    if actual.dtype not in table:
        raise TypeError(
            f"assert_close has tolerances for {', '.join(str(t) for t in table)} and compares integers exactly; "
            f"got actual of dtype {actual.dtype}"
        )
    atol, rtol = table[actual.dtype]
    a, r = actual.to(torch.float64), reference.to(torch.float64)
    if a.shape != r.shape or a.device != r.device or a.numel() == 0:
        # torch's own message for a shape or device mismatch (and nothing to compare in an empty tensor).
        torch.testing.assert_close(a, r, msg=msg or None)
        return
    floor = torch.finfo(actual.dtype).smallest_normal * torch.finfo(actual.dtype).eps
    allowed = _allowed_error(r, atol, rtol, _row_scale(r) if scale is None else _checked_scale(scale, r), floor)
    diff = (a - r).abs()
    ok = (a == r) | (torch.isfinite(a) & torch.isfinite(r) & (diff <= allowed))
    if bool(ok.all()):
        return
    # The worst element: a non-finite mismatch first, else the largest error in units of what it was allowed.
    badness = torch.where(ok, 0.0, (diff / allowed).nan_to_num(nan=float("inf")))
    index = tuple(int(i) for i in torch.unravel_index(badness.argmax(), badness.shape))
    detail = (
        f"{int((~ok).sum())} of {ok.numel()} elements are off by more than atol {atol:g} x scale + rtol {rtol:g} x "
        f"|reference| ({actual.dtype}); the worst, at index {index}, is {a[index].item():.9g} against "
        f"{r[index].item():.9g}: off by {diff[index].item():.3g}, allowed {allowed[index].item():.3g}"
    )
    raise AssertionError(f"{msg}: {detail}" if msg else detail)


def _row_scale(reference: torch.Tensor) -> torch.Tensor:
    """The largest finite |reference| along the last dimension, kept for broadcasting (a 0-d tensor: itself)."""
    size = torch.where(torch.isfinite(reference), reference.abs(), 0.0)
    return size if size.dim() == 0 else size.amax(-1, keepdim=True)


def _checked_scale(scale: float | torch.Tensor, reference: torch.Tensor) -> torch.Tensor:
    """``scale`` as a float64 tensor broadcastable to ``reference``; finite and non-negative."""
    if isinstance(scale, bool) or (isinstance(scale, torch.Tensor) and scale.dtype == torch.bool):
        # True read as a scale of 1.0: a flag passed where the size of the operands goes.
        raise TypeError(f"scale must be a float or a float tensor (the size of the operands), got {scale!r}")
    size = torch.as_tensor(scale, dtype=torch.float64, device=reference.device)
    try:
        fits = torch.broadcast_shapes(size.shape, reference.shape) == reference.shape
    except RuntimeError:
        fits = False
    if not fits:
        raise ValueError(
            f"scale must be a float or a tensor broadcastable to the reference's shape {tuple(reference.shape)}, "
            f"got shape {tuple(size.shape)}"
        )
    if not bool((torch.isfinite(size) & (size >= 0)).all()):
        raise ValueError("scale must be finite and >= 0 (the size of the operands, e.g. their largest |value|)")
    return size


def _allowed_error(
    reference: torch.Tensor, atol: float, rtol: float, scale: torch.Tensor, floor: float
) -> torch.Tensor:
    """The error each element may carry: atol in units of the operands' size, rtol of its own, and a floor of one
    subnormal step (the spacing float16 rounds to below its smallest normal, 6.1e-5)."""
    return floor + atol * scale + rtol * torch.where(torch.isfinite(reference), reference.abs(), 0.0)


def rope_inv_freq_reference(rotary_dim: int, base: float) -> list[float]:
    """theta_i = base^(-2i/r), i = 0..r/2-1 (Su et al., Eq. 15). rotary_dim: even and positive; base: finite, > 1."""
    # Checked, as an oracle must be: base -1 gave complex "frequencies", rotary_dim 0 or -4 none at all.
    rotary_dim, base = even_positive_int("rotary_dim", rotary_dim), base_value("base", base)
    return [base ** (-2.0 * i / rotary_dim) for i in range(rotary_dim // 2)]


def rope_reference(
    x: torch.Tensor,
    positions: torch.Tensor,
    *,
    rotary_dim: int | None = None,
    base: float = 10000.0,
    interleaved: bool = False,
    inv_freq: list[float] | torch.Tensor | None = None,
    attention_factor: float = 1.0,
) -> torch.Tensor:
    """Rotate x (..., s, d) by positions (s,) or broadcastable to x.shape[:-1]; float64 result.

    Pair i is channels (2i, 2i+1) when interleaved, else (i, i + r/2); it turns by angle position * theta_i.
    The channels past rotary_dim are copied. ``attention_factor`` scales the rotated channels (YaRN's mscale).
    rotary_dim: r (even, <= d); default 2 * len(inv_freq) when inv_freq is given, as ``apply_rotary`` reads it, else d.
    """
    float_tensor("x", x)  # a complex x lost its imaginary part in the float64 cast
    if not isinstance(positions, torch.Tensor):
        raise TypeError(f"positions must be a torch.Tensor, got {type(positions).__name__}")
    x = x.to(torch.float64)
    d = x.shape[-1]
    thetas = None if inv_freq is None else [float(t) for t in inv_freq]
    r = (d if thetas is None else 2 * len(thetas)) if rotary_dim is None else rotary_dim
    if r <= 0 or r % 2 or r > d:
        raise ValueError(f"rotary_dim must be even, positive and <= d = {d}, got {r}")
    if thetas is None:
        thetas = rope_inv_freq_reference(r, base)
    elif len(thetas) != r // 2:
        raise ValueError(f"inv_freq has {len(thetas)} frequencies but rotary_dim={r} needs {r // 2}")
    if positions.dim() > x.dim() - 1 or any(
        p not in (1, n) for p, n in zip(reversed(positions.shape), reversed(x.shape[:-1]), strict=False)
    ):
        raise ValueError(
            f"positions must be (s,) or broadcastable to x.shape[:-1] = {tuple(x.shape[:-1])}, got shape "
            f"{tuple(positions.shape)}"
        )
    pos = positions.to(torch.float64)
    out = x.clone()
    for i, theta in enumerate(thetas):
        a, b = (2 * i, 2 * i + 1) if interleaved else (i, i + r // 2)
        angle = pos * theta
        cos, sin = torch.cos(angle) * attention_factor, torch.sin(angle) * attention_factor
        out[..., a] = x[..., a] * cos - x[..., b] * sin
        out[..., b] = x[..., b] * cos + x[..., a] * sin
    return out


def sinusoidal_reference(positions: torch.Tensor, dim: int, *, base: float = 10000.0) -> torch.Tensor:
    """PE(p, 2i) = sin(p / base^(2i/d)), PE(p, 2i+1) = cos(p / base^(2i/d)) (Vaswani et al., §3.5). dim: even."""
    # The loop fills pairs: an odd dim left the last column of torch.empty unwritten (whatever memory held).
    dim = even_positive_int("dim", dim)
    base = base_value("base", base)  # base 0 gave NaN
    if not isinstance(positions, torch.Tensor):
        raise TypeError(f"positions must be a torch.Tensor, got {type(positions).__name__}")
    pos = positions.to(torch.float64)
    out = torch.empty((*positions.shape, dim), dtype=torch.float64)
    for i in range(dim // 2):
        angle = pos / base ** (2.0 * i / dim)
        out[..., 2 * i] = torch.sin(angle)
        out[..., 2 * i + 1] = torch.cos(angle)
    return out


def alibi_slopes_reference(num_heads: int) -> list[float]:
    """Press et al.'s slopes: geometric from 2^(-8/n); for non-powers of two, the closest lower power of two's
    slopes followed by every other slope of twice that power (the paper's reference code)."""

    def power_of_two(n: int) -> list[float]:
        start = 2 ** (-(2 ** -(math.log2(n) - 3)))
        return [start * start**i for i in range(n)]

    num_heads = alibi_head_count(num_heads)  # 0: "math domain error"; 2**62 heads: a list without end
    if math.log2(num_heads).is_integer():
        return power_of_two(num_heads)
    closest = 2 ** math.floor(math.log2(num_heads))
    return power_of_two(closest) + alibi_slopes_reference(2 * closest)[0::2][: num_heads - closest]


def alibi_bias_reference(num_heads: int, q_positions: list[int], k_positions: list[int]) -> torch.Tensor:
    """(h, sq, sk): -slope_h * |m - n|; no causal mask. Positions: sequences of integers (numpy's too)."""
    q_positions, k_positions = list(q_positions), list(k_positions)  # once: a generator is read by the check
    for name, positions in (("q_positions", q_positions), ("k_positions", k_positions)):
        if any(isinstance(p, bool) or not isinstance(p, numbers.Integral) for p in positions):  # [0.5, 1] was taken
            raise TypeError(f"{name} must be a sequence of integer positions, got {positions!r}")
    q_positions, k_positions = [int(p) for p in q_positions], [int(p) for p in k_positions]
    slopes = alibi_slopes_reference(num_heads)
    return torch.tensor(
        [[[-s * abs(m - n) for n in k_positions] for m in q_positions] for s in slopes], dtype=torch.float64
    )


def t5_bucket_reference(relative_position: int, *, bidirectional: bool, num_buckets: int, max_distance: int) -> int:
    """T5's bucket for one relative position (key - query), in exact arithmetic: Python integers only.

    The logarithmic bucket is max_exact + floor(L * log(distance / max_exact) / log(max_distance / max_exact)),
    L = num_buckets - max_exact, capped at num_buckets - 1. Floats round an exact edge either way (log(2) / log(32)
    * 5 is 0.999... in float64, a bucket low), so the floor is found as the largest j <= L with
    (max_distance / max_exact) ** j <= (distance / max_exact) ** L, compared in integers. T5's own float32 logarithm
    (which ``posenc.t5_relative_bucket`` follows) lands one bucket off this at a few edges: 9 of 9.8 million
    (num_buckets, max_distance, distance) with num_buckets < 70 and max_distance < 300, and at (32, 939, 728).
    """
    bucket = 0
    if bidirectional:
        num_buckets //= 2
        if relative_position > 0:
            bucket += num_buckets
        distance = abs(relative_position)
    else:
        distance = max(-relative_position, 0)
    max_exact = num_buckets // 2
    if distance < max_exact:
        return bucket + distance
    steps = num_buckets - max_exact
    if distance >= max_distance:
        return bucket + num_buckets - 1  # (distance / max_exact) ** L >= (max_distance / max_exact) ** L: j = L
    j = 0
    while j < steps and max_distance ** (j + 1) * max_exact ** (steps - j - 1) <= distance**steps:
        j += 1
    return bucket + min(max_exact + j, num_buckets - 1)


def attention_reference(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """Causal softmax(q k^T / sqrt(d) + bias) v in float64. q: (b, h, s, d); k, v: (b, g, s, d), g | h."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        float_tensor(name, t)
        if t.dim() != 4:
            raise ValueError(f"{name} must have shape (b, heads, s, d), got {tuple(t.shape)}")
    for name, t in (("k", k), ("v", v), *((("bias", bias),) if bias is not None else ())):
        # meta q beside CPU k gave a CPU result of no values (meta @ cpu is computed as cpu in torch).
        same_device(("q", name), q, t)
    if q.shape[1] % k.shape[1] or v.shape[1] != k.shape[1]:
        raise ValueError(
            f"q's heads must be a multiple of k's and v's (grouped-query attention), got h={q.shape[1]} q heads, "
            f"{k.shape[1]} k heads and {v.shape[1]} v heads"
        )
    q, k, v = (t.to(torch.float64) for t in (q, k, v))
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    s = q.shape[2]
    scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    if bias is not None:
        scores = scores + bias.to(torch.float64)
    future = torch.ones(s, s, dtype=torch.bool).triu(1)
    return scores.masked_fill(future, float("-inf")).softmax(-1) @ v


def random_qk(
    batch: int,
    q_heads: int,
    k_heads: int,
    seq: int,
    head_dim: int,
    *,
    dtype: torch.dtype = torch.float32,
    layout: str = "bhsd",
    seed: int = 0,
    device: str | torch.device = "cpu",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Random q (b, h_q, s, d) and k (b, h_k, s, d) (or bshd), drawn in float64 and cast to ``dtype``."""
    if layout not in ("bhsd", "bshd"):  # any other string was read as "bshd"
        raise ValueError(f"layout must be 'bhsd' or 'bshd', got {layout!r}")
    # torch.randn's "invalid combination of arguments" before; True was 1 head. Plain ints (numpy's converted).
    batch, q_heads, k_heads, head_dim = (
        positive_int(name, size)
        for name, size in (("batch", batch), ("q_heads", q_heads), ("k_heads", k_heads), ("head_dim", head_dim))
    )
    seq = integer("seq", seq, low=0)
    # torch's CPU generator keeps 32 bits of the seed: 2**32 drew what 0 draws.
    seed = integer("seed", seed, low=0, high=2**32, expected="an int in [0, 2**32) (torch's generator keeps 32 bits)")
    gen = torch.Generator().manual_seed(seed)
    shapes = [(batch, h, seq, head_dim) if layout == "bhsd" else (batch, seq, h, head_dim) for h in (q_heads, k_heads)]
    q, k = (torch.randn(shape, generator=gen, dtype=torch.float64).to(device=device, dtype=dtype) for shape in shapes)
    return q, k


def run_torchrun(
    script: str | Path, *args: str, nproc: int = 2, timeout: float = 300.0
) -> subprocess.CompletedProcess[str]:
    """Run ``script ARGS`` in ``nproc`` local processes under ``torch.distributed.run`` on a free loopback port,
    one torch thread each (2 processes on 2 cores). Returns the finished process with its captured output."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nnodes=1", f"--nproc-per-node={nproc}",
        "--master-addr=127.0.0.1", f"--master-port={port}", str(script), *args,
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)


@contextlib.contextmanager
def torch_threads(count: int | None = None) -> Iterator[None]:
    """torch's intra-op thread count set to ``count`` inside the block (None: left as it is, for code that sets its
    own, a benchmark's main), and the one before restored after it, also where the block raises: a test about thread
    counts, or one that needs the bits of one count, leaves the rest of the process as it found it."""
    if count is not None and (isinstance(count, bool) or not isinstance(count, int) or count < 1):
        raise ValueError(f"count must be a positive int (torch threads) or None, got {count!r}")
    before = torch.get_num_threads()
    if count is not None:
        torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(before)
