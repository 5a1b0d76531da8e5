"""ALiBi and T5 biases as FlexAttention ``score_mod`` functions: attention without a (b, h, s, t) float mask.

The materialized path (``posenc.attention.attend``) builds the bias and a mask of s * t floats per head; at
s = t = 8192 and 8 heads that is 2 GiB before attention starts. ``score_mod`` computes each bias entry inside
the compiled attention kernel instead. Where it is used (``use_flex``), only where that mask would be large:

* CUDA: ALiBi and T5 when FlexAttention imports and s * t >= ``CUDA_MIN_SCORES`` (forward and backward,
  including the T5 table's gradient);
* CPU: inference only (PyTorch has no CPU backward for FlexAttention) and s * t >= ``CPU_MIN_SCORES``, where the
  mask's memory matters more than the compile (seconds on 2 cores); see docs/benchmarks.md for the measured
  peak memory.

A subclass of either that defines its own ``score_bias`` (or, for T5, its own ``buckets``), an instance given its
own, and a T5Bias whose ``table`` is not a plain ``nn.Embedding`` (a LoRA adapter's wrapper) are always materialized:
the score_mods here compute ALiBi's and T5's own formulas from the slopes and the table's weight.

A KV-cache decode step (s = 1) stays on the materialized path on either device: its (b, h, 1, t) bias is smaller
than the cache it attends over.

How FlexAttention is compiled differs by device:

* CUDA: with dynamo's automatic dynamic shapes (``dynamic=None``): the first call compiles for its exact shape,
  the first call with another length recompiles with the lengths symbolic, and later lengths reuse that kernel
  (training sees many lengths). A few more recompiles happen where dynamo specializes a size of 1 (one block, a
  batch of 1), per encoding type and per head count or head dim.
* CPU: one static compile per shape (``dynamic=False``). Symbolic lengths fail to compile there in torch 2.13
  (inductor's C++ for flex: "cur_kvSplitSize2 / cur_qSplitSize2 was not declared"), in orders of calls that no
  rule here could rule out; CPU inference sees few lengths.

Never for float64: inductor's CPU FlexAttention takes float32/bf16/fp16 only (a float64 call failed to compile
and turned FlexAttention off for the process), CUDA's is unmeasured here, and float64 callers want exactness.

Inside a caller's ``torch.compile`` the call joins the caller's graph on CUDA. On CPU it is a graph break: inductor
cannot lower FlexAttention on q, k, v computed in the same graph, only on a graph's inputs (torch 2.13), so the
call is a graph of its own. With ``fullgraph=True`` that is an error, whatever the backend (with "eager" or
"aot_eager" the call once stayed in the graph), whose message says how to materialize instead. A custom op around
the call, which would keep one graph, did not work while the block mask came from create_block_mask, whose vmap
fails inside a compiled graph's run (``causal_block_mask`` now builds it without one; not tried since).

Either way dynamo stops compiling after 8 variants (its recompile limit, shared by every caller in the process)
and would then quietly run an unfused flex_attention that materializes the whole score matrix. posenc makes that,
and any compile error, a ``FlexFallback``: ``CausalSelfAttention`` warns and materializes the bias itself (the same
result), and does so for the rest of the process on that device type rather than fail to compile again.

Shape key: b batch, h query heads, s queries, t keys, d head dim. The queries are always the last s of the t
keys (causal attention with a cache), so a score_mod reads one position tensor, the keys', and finds query i at
key index ``past + i`` (a 0-d tensor, so that its value is not compiled in): with two captured position tensors
of different lengths, the recompile with symbolic lengths fails on CPU with the same inductor error.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable

import torch
from torch import nn

from posenc import _compile_marks as compile_marks
from posenc._checks import (
    attention_inputs,
    autocast_off,
    compiling,
    encoding_heads,
    first_dtensor,
    int_tensor,
    replicated_values,
    size_in,
    values_readable,
)
from posenc.bias import ALiBi, T5Bias, t5_relative_bucket

# Below this many scores per head the materialized mask is small (64 MiB in float32) and not worth a compile.
CPU_MIN_SCORES = 4096 * 4096
# On CUDA, where FlexAttention also serves training, the bar is lower; below it the mask (4 MiB per head in
# float32) costs less than keeping one more compiled kernel per shape class.
CUDA_MIN_SCORES = 1024 * 1024
# Inductor's CPU FlexAttention (torch 2.13) splits the keys into blocks of min(128, t); with t < 128 and t = 8 mod 16
# (8, 24, 40, ... 120) it returned wrong rows among the first 8 queries in most fresh processes on an AVX2 host
# (plain causal, no score_mod: 0.1-2.6 off), at t >= 128 in none of 25 (tails of 8 included). The default
# CPU_MIN_SCORES never routes fewer keys than this; the bound keeps a lowered threshold right too.
CPU_MIN_KEYS = 128

ScoreMod = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


# Device types where the compiled kernel failed (a compile error or the recompile limit): materialized from then on.
_GIVEN_UP: set[str] = set()


# device type -> compiled flex_attention, or None where this PyTorch has no flex.
_FLEX: dict[str, Callable | None] = {}


def _flex(device_type: str = "cuda") -> Callable | None:
    # Not functools.cache: the layer calls this inside a caller's torch.compile, and dynamo traces through a cache
    # wrapper with a warning that it might be silently wrong. Only eager calls fill the cache; a traced call that
    # stored the wrapper it traced left eager calls an unfused flex_attention (measured).
    if device_type in _FLEX:
        return _FLEX[device_type]
    try:
        from torch.nn.attention.flex_attention import flex_attention
    except ImportError:
        found = None
    else:
        # FlexAttention only saves memory when compiled (eager is the reference math); dynamic shapes where they
        # compile (see the module docstring).
        found = torch.compile(flex_attention, dynamic=None if device_type == "cuda" else False)
    if not compiling():
        _FLEX[device_type] = found
    return found


def _block_ranges(ids: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """ids (b, n) -> the smallest and largest id of each run of ``block`` columns, each (b, ceil(n / block))."""
    pad = -ids.shape[1] % block
    if pad:  # repeating the last column changes neither the last block's minimum nor its maximum
        ids = torch.cat([ids, ids[:, -1:].expand(-1, pad)], dim=1)
    blocks = ids.view(ids.shape[0], -1, block)
    return blocks.amin(dim=-1), blocks.amax(dim=-1)


def _ordered(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(b, nq, nk) bool -> BlockMask's (b, 1, nq) counts and (b, 1, nq, nk) key-block indices, the marked first."""
    blocks = blocks[:, None]
    order = torch.argsort(blocks.to(torch.int8), dim=-1, descending=True, stable=True)
    return blocks.sum(dim=-1, dtype=torch.int32), order.to(torch.int32)


def causal_block_mask(
    mask_mod: Callable,
    s: int,
    t: int,
    past: int,
    document_ids: torch.Tensor | None = None,
    *,
    device: torch.device | str = "cpu",
    block: int = 128,
):
    """The BlockMask of causal attention of s queries (key indices past .. past + s - 1) over t keys, within
    documents where ``document_ids`` (b or 1, t) are given; ``mask_mod`` decides the pairs of the partial blocks.

    Built from each block's index range and range of document ids, (b, s/block, t/block) small integers, where
    ``create_block_mask`` evaluates the mask for every (query, key) pair and batch row: at s = t = 8192 the flex
    path's peak memory fell from 709 to 98 MiB, and from 2627 to 149 MiB with ids per row for 4 rows
    (docs/benchmarks.md). A block is skipped when
    its keys all follow its queries or no id occurs in both ranges (a shared id must lie in both), and is full
    when its keys all precede its queries and both ranges hold one and the same id; every other block is partial.
    Sound for any ids; for non-decreasing ids (packed documents) the same blocks as ``create_block_mask``'s."""
    from torch.nn.attention.flex_attention import BlockMask

    rows = torch.arange(-(-s // block), device=device)
    cols = torch.arange(-(-t // block), device=device)
    first_q, last_q = past + rows * block, past + ((rows + 1) * block).clamp(max=s) - 1
    first_k, last_k = cols * block, (cols + 1) * block - 1
    some = (first_k[None, :] <= last_q[:, None])[None]
    # A block cut by the end of the queries or keys is never full, as in create_block_mask, which pads the mask with
    # False: the kernels may count on a full block's indices all being in range.
    uncut = ((rows + 1) * block <= s)[:, None] & ((cols + 1) * block <= t)[None, :]
    every = (uncut & (last_k[None, :] <= first_q[:, None]))[None]
    if document_ids is not None:
        q_low, q_high = _block_ranges(document_ids[:, past:], block)
        k_low, k_high = _block_ranges(document_ids, block)
        some = some & (k_low[:, None, :] <= q_high[:, :, None]) & (q_low[:, :, None] <= k_high[:, None, :])
        one_id = (q_low == q_high)[:, :, None] & (k_low == k_high)[:, None, :]
        every = every & one_id & (q_low[:, :, None] == k_low[:, None, :])
    partial = some & ~every
    return BlockMask.from_kv_blocks(
        *_ordered(partial), *_ordered(every), BLOCK_SIZE=block, mask_mod=mask_mod, seq_lengths=(s, t)
    )


def _compiled_call(flex: Callable, q, k, v, score_mod: ScoreMod, block_mask) -> torch.Tensor:
    """The compiled flex call, or a ``FlexFallback`` where it cannot serve (see the class)."""
    from torch._dynamo.exc import FailOnRecompileLimitHit
    from torch._inductor.exc import InductorError

    try:
        with torch._dynamo.config.patch(fail_on_recompile_limit_hit=True):
            return flex(q, k, v, score_mod=score_mod, block_mask=block_mask)
    except (FailOnRecompileLimitHit, InductorError) as error:
        _GIVEN_UP.add(q.device.type)
        # The cause in the message: a warning shows no exception chain (a missing C++ compiler read only as
        # "InductorError"). Its first line, which names it; inductor's messages run on with a traceback.
        cause = next((line.strip() for line in str(error).splitlines() if line.strip()), "")[:300]
        raise FlexFallback(
            f"FlexAttention cannot serve this call ({type(error).__name__}: {cause}); posenc materializes score "
            f"biases on {q.device.type} for the rest of this process"
        ) from error


# Inductor's CPU FlexAttention lowering (torch 2.13) fails on q, k, v computed in the same graph (projections, views:
# "not enough values to unpack", "NoValidChoicesError"); with graph inputs, as in a graph of its own, it compiles.
# Not recursive: the flex call inside is still compiled.
@compile_marks.disable(
    recursive=False,
    reason=(
        "posenc runs CPU FlexAttention as a graph of its own: inductor cannot lower it on tensors computed in the "
        "caller's graph. For one graph (fullgraph=True), raise posenc.kernels.flex_bias.CPU_MIN_SCORES past s * t "
        "to materialize the bias instead"
    ),
)
def _flex_in_own_graph(flex: Callable, q, k, v, score_mod: ScoreMod, block_mask) -> torch.Tensor:
    """``_compiled_call`` from inside a caller's compiled graph, which cannot catch a FlexFallback to materialize:
    where the compiled kernel cannot serve, the same result from flex_attention's unfused math, with a warning."""
    if q.device.type not in _GIVEN_UP:
        try:
            return _compiled_call(flex, q, k, v, score_mod, block_mask)
        except FlexFallback as error:
            warnings.warn(
                f"{error}; this compiled call runs FlexAttention unfused (same result, more memory)", stacklevel=2
            )
    from torch.nn.attention.flex_attention import flex_attention

    return flex_attention(q, k, v, score_mod=score_mod, block_mask=block_mask)


def flex_available() -> bool:
    return _flex() is not None


class FlexFallback(RuntimeError):
    """The compiled FlexAttention cannot serve this call: dynamo's recompile limit is reached (past it, torch would
    quietly run an unfused flex_attention that materializes the scores) or inductor failed to compile a variant.
    ``CausalSelfAttention`` then materializes the bias itself, with a warning."""


def _per_batch(positions: torch.Tensor) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """positions (or document ids): (b or 1, n). Returns index(b, i) -> value, broadcasting a batch of 1."""
    if positions.shape[0] == 1:
        row = positions[0]
        return lambda b, i: row[i]
    return lambda b, i: positions[b, i]


def _past(positions: torch.Tensor, past: int) -> torch.Tensor:
    # A 0-d tensor, not a Python int: dynamo would specialize the compiled kernel on an int's value.
    return torch.tensor(past, dtype=torch.long, device=positions.device)


def alibi_score_mod(slopes: torch.Tensor, positions: torch.Tensor, past: int) -> ScoreMod:
    """score - slope_h * |m - n|; slopes (h,), positions (b or 1, t) of the keys, query i at key index past + i.

    No -inf: which keys a query sees is the block mask's business (token order), as in the materialized path it
    is the ``allowed`` mask's; ``ALiBi.score_bias`` is the same finite bias."""
    at, shift = _per_batch(positions), _past(positions, past)
    slopes = slopes.float()

    def score_mod(score, b, h, q_idx, kv_idx):
        return score - slopes[h] * (at(b, q_idx + shift) - at(b, kv_idx)).abs().float()

    return score_mod


def t5_score_mod(encoding: T5Bias, positions: torch.Tensor, past: int) -> ScoreMod:
    """score + table[bucket(n - m), h], the bucket computed by ``t5_relative_bucket`` (Hugging Face's);
    positions (b or 1, t) of the keys, query i at key index past + i."""
    at, shift = _per_batch(positions), _past(positions, past)
    weight = encoding.table.weight

    def score_mod(score, b, h, q_idx, kv_idx):
        bucket = t5_relative_bucket(
            at(b, kv_idx) - at(b, q_idx + shift),
            bidirectional=encoding.bidirectional,
            num_buckets=encoding.num_buckets,
            max_distance=encoding.max_distance,
        )
        return score + weight[bucket, h].float()

    return score_mod


def score_mod_for(encoding: nn.Module, positions: torch.Tensor, past: int) -> ScoreMod | None:
    """The score_mod of a known bias encoding, or None (then the caller materializes the bias).
    positions: (b or 1, t) of the keys; the queries are the keys from index ``past`` on."""
    family = _flex_family(encoding)
    if family is ALiBi:
        return alibi_score_mod(encoding.head_slopes(), positions, past)
    if family is T5Bias:
        return t5_score_mod(encoding, positions, past)
    return None


# The methods each family's materialized bias goes through that its score_mod computes itself (ALiBi's reads
# head_slopes(), so an override of that is honoured on both paths).
_FORMULA_METHODS = {ALiBi: ("score_bias",), T5Bias: ("score_bias", "buckets")}


def _flex_family(encoding: nn.Module) -> type[nn.Module] | None:
    """ALiBi or T5Bias where the encoding's bias is that family's own formula, else None. The score_mods compute
    the family's formula, not the module's ``score_bias``: a subclass with a ``score_bias`` of its own (a
    log-distance ALiBi) or, for T5, ``buckets`` of its own (another bucketing), in a subclass or assigned on the
    instance, was attended with the parent's bias on this path, without an error."""
    for family, methods in _FORMULA_METHODS.items():
        if isinstance(encoding, family):
            # vars(): a method assigned on the instance (encoding.score_bias = ...) shadows the class's too.
            own = all(getattr(type(encoding), m) is getattr(family, m) and m not in vars(encoding) for m in methods)
            if family is T5Bias:
                # t5_score_mod reads table.weight; a wrapped table (a LoRA adapter's, whose forward adds its delta to
                # the base weight it exposes as .weight) is read through its forward only when materialized.
                own = own and type(encoding.table).forward is nn.Embedding.forward
            return family if own else None
    return None


def use_flex(encoding: nn.Module, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, need_probs: bool) -> bool:
    """Whether ``attend_flex`` should replace the materialized bias for this call (see the module docstring)."""
    # Cheap checks first: flex_available() imports dynamo, which costs seconds on a process's first call.
    if need_probs or _flex_family(encoding) is None or q.shape[2] == 1 or q.device.type in _GIVEN_UP:
        return False
    if q.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        return False  # CPU flex compiles no float64 (CUDA's is unmeasured here); float64 callers want exactness
    scores = q.shape[2] * k.shape[2]
    if q.device.type == "cuda":
        return scores >= CUDA_MIN_SCORES and flex_available()
    if q.device.type != "cpu":
        return False
    needs_grad = torch.is_grad_enabled() and (
        any(t.requires_grad for t in (q, k, v)) or any(p.requires_grad for p in encoding.parameters())
    )
    return not needs_grad and scores >= CPU_MIN_SCORES and k.shape[2] >= CPU_MIN_KEYS and flex_available()


def attend_flex(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    encoding: nn.Module,
    q_positions: torch.Tensor,
    k_positions: torch.Tensor,
    *,
    document_ids: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention with the encoding's bias as a score_mod. q: (b, h, s, d); k, v: (b, h, t, d) (heads
    already repeated for GQA); positions (b or 1, s) and (b or 1, t). The last s of t keys are the queries, so
    q_positions must be the last s columns of k_positions (checked; the kernel reads k_positions only).
    document_ids: (b or 1, t) of the keys, or None; with them a query sees only its own document's keys, and the
    block mask skips the blocks between documents.

    Computed in float32 for bf16/fp16 inputs, as the materialized path does. Returns (b, h, s, d) in q's dtype.
    DTensor q, k or v (tensor parallelism) are refused: ``posenc.attention.attend`` takes them. DTensor ids beside
    plain q, k, v are read whole.
    """
    if first_dtensor(q, k, v) is not None:
        # Dynamo failed inside the compiled call, in its fake tensors' run of the score_mod's plain slopes or table
        # indexed with DTensor values ("RuntimeError when making fake tensor call").
        raise ValueError(
            "attend_flex takes plain q, k, v, not DTensors: the score_mod reads the encoding's slopes or table of "
            "every head. Under tensor parallelism use posenc.attention.attend (or CausalSelfAttention), which "
            "attends each rank's own heads with their bias"
        )
    # DTensor ids beside plain q, k, v: their whole values, as posenc reads such ids elsewhere. Kept DTensors, they met
    # plain tensors in the ids' check below ("got mixed torch.Tensor and DTensor") and in the score_mod.
    q_positions, k_positions = replicated_values(q_positions), replicated_values(k_positions)
    if document_ids is not None:
        document_ids = replicated_values(document_ids)
    flex = _flex(q.device.type)
    if flex is None:
        raise RuntimeError("FlexAttention is unavailable in this PyTorch; use posenc.attention.attend")
    attention_inputs(q, k, v)
    s, t = q.shape[2], k.shape[2]
    if s > t:
        # The queries are the last s keys; with fewer keys the check below compared shapes that cannot broadcast and
        # torch's "The size of tensor a (7) must match the size of tensor b (2)" came out of it.
        raise ValueError(
            f"q has {s} queries but k has {t} keys: the queries must be the last s of the t keys (s <= t), as in "
            "causal attention with a KV cache; pass the cached keys and values with the new ones"
        )
    encoding_heads(encoding, q.shape[1], f"q has {q.shape[1]} heads (dim 1)")  # the score_mod reads slopes[h]
    ids = [("q_positions", q_positions, s, "positions"), ("k_positions", k_positions, t, "positions")]
    if document_ids is not None:
        ids.append(("document_ids", document_ids, t, "document ids"))
    for name, values, n, what in ids:
        int_tensor(name, values, what=what)
        if values.dim() != 2 or values.shape[1] != n or not size_in(values.shape[0], (1, q.shape[0])):
            raise ValueError(f"{name} must have shape (b or 1, {n}) with b = {q.shape[0]}, got {tuple(values.shape)}")
    if values_readable(q.device) and bool((q_positions != k_positions[:, t - s :]).any()):
        raise ValueError(
            "q_positions must be the last s columns of k_positions: the queries are the last s of the t keys, "
            "as in causal attention with a KV cache"
        )
    past = t - s
    # One form for every call of a batch size: shared (1, t) positions expanded like per-sequence ones. A call that
    # switched forms recompiled with symbolic lengths, which inductor's CPU flex code fails to compile.
    k_positions = k_positions.expand(q.shape[0], t).contiguous()
    score_mod = score_mod_for(encoding, k_positions, past)
    if score_mod is None:
        raise ValueError(f"no score_mod for {type(encoding).__name__}; only ALiBi and T5Bias have one")

    shift = _past(k_positions, past)

    if document_ids is None:

        def allowed(b, h, q_idx, kv_idx):
            return kv_idx <= q_idx + shift

    else:
        document_ids = document_ids.contiguous()
        doc = _per_batch(document_ids)

        def allowed(b, h, q_idx, kv_idx):
            return (kv_idx <= q_idx + shift) & (doc(b, q_idx + shift) == doc(b, kv_idx))

    block_mask = causal_block_mask(allowed, s, t, past, document_ids, device=q.device)
    dtype, out_dtype = torch.promote_types(q.dtype, torch.float32), q.dtype
    q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
    # Autocast casts flex_attention's q, k and v back to bf16/fp16 (its probabilities then meet v in that dtype):
    # off, as in attend's materialized path, which this one must equal under autocast too.
    with autocast_off(q.device):
        if not compiling():
            out = _compiled_call(flex, q, k, v, score_mod, block_mask)
        elif q.device.type == "cpu":
            out = _flex_in_own_graph(flex, q, k, v, score_mod, block_mask)
        else:  # inside the caller's torch.compile on CUDA: its graph holds the call
            out = flex(q, k, v, score_mod=score_mod, block_mask=block_mask)
    return out.to(out_dtype)
