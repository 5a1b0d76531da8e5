"""Run by torchrun (2 processes, gloo) from test_gloo.py; not collected by pytest (no test_ prefix).

Each rank builds RoPE from the same config, computes its shard's cos/sin and rotations, and checks with
collectives that (1) inv_freq and the cos/sin table are bitwise equal on every rank, (2) the shard's rotated rows
equal the rows of the whole-sequence rotation. Writes ok-<rank> to the output folder on success.

Ranks of one job run the same code on one machine here, so (1) would hold for any deterministic formula; what can
differ between real ranks is how each came to its table. So rank 0 computes it on one thread from positions 0..n-1,
and rank 1 on two threads, having first grown its table past torch's parallel grain (32768 elements) and asking
for the positions backwards and in two pieces of odd sizes: a row must not depend on its table's size, on how
the work was split, or on which rows came with it.

Then DTensor calls sharded across the two ranks (``_sharded_dtensor_calls``): per-sequence offsets and cu_seqlens,
and their refusal where only one rank holds a bad offset; attend of q sharded on the batch or the heads;
CausalSelfAttention under tensor parallelism, on a 1-D mesh and on the "tp" dimension of a (1, 2) 2-D mesh.
"""

from __future__ import annotations

import copy
import itertools
import json
import os
import sys
from datetime import timedelta

import torch
import torch.distributed as dist

import posenc
from posenc.distributed import shard_positions
from posenc.rope.mrope import mrope_cos_sin


def _sharded_dtensor_calls(world: int) -> None:
    """apply_rotary of DTensors sharded unevenly across the ranks, at per-sequence offsets and packed by cu_seqlens
    (themselves sharded, or plain), equal to the call on the whole tensors; a negative offset held by one rank's shard
    alone is refused on every rank. That check read each rank's shard only: the rank holding it raised, and the other
    went on into the next collective, waiting there for a peer that never came (a hang)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    dt = lambda t, *p: distribute_tensor(t, mesh, list(p) or [Replicate()])  # noqa: E731
    gen = torch.Generator().manual_seed(1)
    cos, sin = posenc.RoPE(16).cos_sin(torch.arange(40))
    packed, x = torch.randn(9, 2, 16, generator=gen), torch.randn(4, 2, 5, 16, generator=gen)
    cu, offsets = torch.tensor([0, 3, 3, 7, 9]), torch.tensor([1, 2, 3, 4])
    # x, its kwargs, x's placement, theirs (None: plain tensors, cos/sin too)
    calls = [
        (packed, {"cu_seqlens": cu, "offset": offsets}, Shard(0), Shard(0)),
        (packed, {"cu_seqlens": cu}, Shard(0), None),
        (x, {"offset": offsets}, Shard(2), Shard(0)),
        (x, {"offset": offsets, "positions": torch.tensor([4, 0, 2, 1, 3])}, Shard(2), None),
    ]
    for whole, kwargs, placement, ids_placement in calls:
        want = posenc.apply_rotary(whole, cos, sin, **kwargs)
        given = {key: t if ids_placement is None else dt(t, ids_placement) for key, t in kwargs.items()}
        tables = [t if ids_placement is None else dt(t) for t in (cos, sin)]
        got = posenc.apply_rotary(dt(whole, placement), *tables, **given).full_tensor()
        assert (got - want).abs().max() < 1e-6, (list(kwargs), placement)
    # One of offsets and position ids a DTensor, the other plain: the plain one is taken onto the mesh (the rows met
    # a plain tensor otherwise; before this case only the compile worker, ~90 s, reached that line).
    ids = torch.tensor([4, 0, 2, 1, 3])
    want = posenc.apply_rotary(x, cos, sin, offset=offsets, positions=ids)
    for offset, positions in ((dt(offsets, Shard(0)), ids), (offsets, dt(ids, Shard(0)))):
        got = posenc.apply_rotary(dt(x, Shard(2)), dt(cos), dt(sin), offset=offset, positions=positions)
        assert (got.full_tensor() - want).abs().max() < 1e-6, (type(offset), type(positions))
    bad = torch.tensor([1, 2, 3, -4])  # the last rank's shard alone holds the negative offset
    try:
        posenc.apply_rotary(dt(x, Shard(0)), dt(cos), dt(sin), offset=dt(bad, Shard(0)), positions=torch.arange(5))
    except ValueError as error:
        assert "offset must be >= 0" in str(error), error
    else:
        raise AssertionError("a negative offset on one rank's shard was not refused on this rank")
    _sharded_ids_checked_whole(dt, Shard(0), gen)
    _sharded_document_ids(dt, Shard(0), gen)
    _attention_with_sharded_positions(dt, Shard(1), gen)
    _document_ids_and_positions_sharded_along_the_sequence(dt, Shard)
    _mrope_ids_on_the_mesh(mesh, dt, Shard, gen)
    _attend_sharded_on_the_batch_or_heads(dt, Shard, gen)
    _heads_sharded(mesh, dt, Shard, gen)
    _heads_sharded_on_a_submesh(world, gen)
    _score_bias_of_dtensor_ids(dt, Shard, gen)
    _channels_and_empty_shards(mesh, dt, Shard, world, gen)


def _channels_and_empty_shards(mesh, dt, shard, world: int, gen: torch.Generator) -> None:
    """A DTensor sharded on its channels (k of tensor parallelism with fewer key heads than ranks: ColwiseParallel
    splits a head) was rotated by writes into slices of an empty output, which such a DTensor lost: uninitialised
    memory came back (max error 5e35; in place 4.4; the layer 1.2), without an error. And a shard that holds
    nothing (batch 1 on 2 ranks) failed in DTensor's out= rules ("min() arg is an empty sequence"). A layer whose
    heads do not split among the ranks is refused naming them (DTensor's "Cannot unflatten unevenly sharded")."""
    from torch.distributed.tensor.parallel import parallelize_module

    x = torch.randn(1, 2, 5, 16, generator=gen)
    rope, mrope = posenc.RoPE(16, rotary_dim=12), posenc.MRoPE(16, mrope_section=[2, 3, 3])
    cos, sin = posenc.RoPE(16).cos_sin(torch.arange(5))
    # Partial rotation too: in place, a copy_ into a slice of x (a new DTensor, no view) left x unrotated.
    for interleaved, pairs in itertools.product((False, True), (8, 6, 4)):
        angles = cos[:, :pairs], sin[:, :pairs]
        want = posenc.apply_rotary(x, *angles, interleaved=interleaved)
        got = posenc.apply_rotary(dt(x, shard(3)), *angles, interleaved=interleaved)
        assert (got.full_tensor() - want).abs().max() < 1e-6, ("channels", interleaved, pairs)
        in_place = dt(x.clone(), shard(3))
        posenc.apply_rotary_(in_place, *angles, interleaved=interleaved)
        assert (in_place.full_tensor() - want).abs().max() < 1e-6, ("channels in place", interleaved, pairs)
    for placement in (shard(0), shard(1), shard(3)):  # batch 1 and 2 heads: a rank holds nothing on 3+ ranks
        for got, want in zip(rope(dt(x, placement), dt(x, placement), offset=3), rope(x, x, offset=3), strict=True):
            assert (got.full_tensor() - want).abs().max() < 1e-6, ("rope", placement)
        ids = torch.randint(0, 9, (3, 1, 5), generator=gen)
        got, want = mrope(dt(x, placement), dt(x, placement), positions=ids)[0], mrope(x, x, positions=ids)[0]
        assert (got.full_tensor() - want).abs().max() < 1e-6, ("mrope", placement)
    torch.manual_seed(0)
    whole = posenc.CausalSelfAttention(16 * world, world, num_kv_heads=1, encoding=posenc.RoPE(16))
    layer = parallelize_module(copy.deepcopy(whole), mesh, _tp_plan())
    mine, theirs = posenc.KVCache(), posenc.KVCache()
    x = torch.randn(1, 5, 16 * world, generator=gen)
    step = torch.randn(1, 2, 16 * world, generator=gen)
    got = [layer(dt(x), cache=mine), layer(dt(step), cache=mine)]
    for g, w in zip(got, [whole(x, cache=theirs), whole(step, cache=theirs)], strict=True):
        assert (g.full_tensor() - w).abs().max() < 1e-5, "one key head split across the ranks"
    uneven = parallelize_module(posenc.CausalSelfAttention(16 * (world + 1), world + 1), mesh, _tp_plan())
    try:
        uneven(dt(torch.randn(1, 3, 16 * (world + 1), generator=gen)))
    except ValueError as error:
        assert f"num_heads={world + 1} heads of 16 channels do not split evenly" in str(error), error
    else:
        raise AssertionError("heads that do not split among the ranks were not refused")


def _tp_plan(local_qkv: bool = False) -> dict:
    """parallelize_module's plan for CausalSelfAttention's heads: q/k/v column-wise (their DTensors kept unless
    ``local_qkv``), the output row-wise."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    plan = {name: ColwiseParallel(use_local_output=local_qkv) for name in ("q_proj", "k_proj", "v_proj")}
    return {**plan, "o_proj": RowwiseParallel(use_local_output=False)}


def _heads_sharded(mesh, dt, shard, gen: torch.Generator) -> None:
    """Tensor parallelism: heads sharded across the ranks. CausalSelfAttention parallelized by parallelize_module
    (ColwiseParallel q/k/v, RowwiseParallel output, DTensors kept) failed in attention: CPU's fused SDPA has no
    DTensor sharding strategy, and ALiBi's and T5's biases of every head met the heads' shard ("got mixed
    torch.Tensor and DTensor"); now each rank attends its own heads with its heads' slopes / table rows, prefill and
    a KVCache decode step equal to the whole layer's. The projections' local shards (use_local_output=True, the
    default) are refused by name, not by view(). DTensor position ids beside x are read whole, as beside plain x;
    packed documents (DTensor ids) and the probabilities of return_attention (laid out as q) equal the whole's."""
    from torch.distributed.tensor.parallel import parallelize_module

    x, step = torch.randn(2, 5, 64, generator=gen), torch.randn(2, 2, 64, generator=gen)
    ids, docs = torch.tensor([[3, 1, 4, 1, 5], [0, 1, 2, 3, 9]]), torch.tensor([[0, 0, 1, 1, 1], [0, 1, 1, 2, 2]])
    for kind, kv_heads in ((posenc.ALiBi, 4), (posenc.T5Bias, 2), (posenc.RoPE, 2)):
        torch.manual_seed(0)  # the same T5 table and projections on every rank, as a real model's loaded weights
        encoding = posenc.RoPE(16) if kind is posenc.RoPE else kind(4)
        whole = posenc.CausalSelfAttention(64, 4, num_kv_heads=kv_heads, encoding=encoding)
        for local in (False, True):
            layer = parallelize_module(copy.deepcopy(whole), mesh, _tp_plan(local_qkv=local))
            if local:
                try:
                    layer(x)
                except ValueError as error:
                    assert "use_local_output=False" in str(error), error
                else:
                    raise AssertionError("projections' local shards were not refused")
                continue
            mine, theirs = posenc.KVCache(), posenc.KVCache()
            got = [layer(dt(x), cache=mine), layer(dt(step), cache=mine)]
            want = [whole(x, cache=theirs), whole(step, cache=theirs)]
            for g, w in zip(got, want, strict=True):
                assert (g.full_tensor() - w).abs().max() < 1e-5, (kind.__name__, kv_heads)
            # Position ids a DTensor beside x's: kept one, they met the cache's plain next positions, ALiBi's slopes
            # and T5's table ("got mixed torch.Tensor and DTensor", every encoding); now read whole, as beside plain x.
            mine, theirs = posenc.KVCache(), posenc.KVCache()
            got = [layer(dt(x), positions=dt(ids), cache=mine), layer(dt(step), cache=mine)]
            want = [whole(x, positions=ids, cache=theirs), whole(step, cache=theirs)]
            for g, w in zip(got, want, strict=True):
                assert (g.full_tensor() - w).abs().max() < 1e-5, (kind.__name__, "positions")
            # Packed documents (DTensor ids), and the probabilities: a DTensor laid out as q, each rank its heads'.
            (out, probs), (w_out, w_probs) = (
                layer(dt(x), document_ids=dt(docs), return_attention=True),
                whole(x, document_ids=docs, return_attention=True),
            )
            assert probs.placements == (shard(1),), probs.placements
            for g, w in ((out, w_out), (probs, w_probs)):
                assert (g.full_tensor() - w).abs().max() < 1e-5, (kind.__name__, "document_ids")
            # Training: the weights' gradients through each rank's heads are the whole layer's (T5's plain table
            # too, its bias' gradient gathered from every rank's heads by the redistribution's backward).
            (layer(dt(x)).full_tensor() ** 2).sum().backward()
            (whole(x) ** 2).sum().backward()
            for (name, p), w in zip(layer.named_parameters(), whole.parameters(), strict=True):
                grad = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
                assert (grad - w.grad).abs().max() < 1e-5, (kind.__name__, name)


def _heads_sharded_on_a_submesh(world: int, gen: torch.Generator) -> None:
    """Tensor parallelism over the "tp" dimension of a 2-D (dp, tp) mesh, as a model trained with both is laid out:
    the layer's DTensors live on the submesh mesh["tp"] (its own mesh, not its root), while the position ids are
    distributed over the whole 2-D mesh. Prefill and a KVCache decode step equal the whole layer's, every encoding the
    layer takes (RoPE in both pair layouts and rotating cached keys, ALiBi, T5, NoPE). posenc takes its plain cos/sin,
    masks and biases onto q's own mesh (``replicated_like``) and reads the ids whole: taken onto the root mesh instead,
    or the ids kept as given, they met q's submesh ("Cannot run aten.mul.Tensor on inputs with different meshes"),
    which no 1-D mesh, its own root, can show."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor
    from torch.distributed.tensor.parallel import parallelize_module

    mesh = init_device_mesh("cpu", (1, world), mesh_dim_names=("dp", "tp"))
    plan = _tp_plan()
    x, step = torch.randn(2, 5, 64, generator=gen), torch.randn(2, 1, 64, generator=gen)
    ids = torch.tensor([[3, 1, 4, 1, 5], [0, 1, 2, 3, 9]])
    encodings = [  # built after the seed: T5's table the same on every rank, as a real model's loaded weights
        lambda: posenc.RoPE(16),
        lambda: posenc.RoPE(16, interleaved=True),
        lambda: posenc.RoPE(
            16, rope_parameters={"rope_type": "dynamic", "factor": 2.0}, max_position_embeddings=4, mode="consistent"
        ),
        lambda: posenc.ALiBi(4),
        lambda: posenc.T5Bias(4),
        posenc.NoPE,
    ]
    for make in encodings:
        torch.manual_seed(0)
        encoding = make()
        whole = posenc.CausalSelfAttention(64, 4, num_kv_heads=2, encoding=encoding)
        layer = parallelize_module(copy.deepcopy(whole), mesh["tp"], plan)
        mine, theirs = posenc.KVCache(), posenc.KVCache()
        # Plain x, taken onto mesh["tp"] by ColwiseParallel; ids split over dp (one rank there) and replicated on tp.
        given = distribute_tensor(ids, mesh, [Shard(0), Replicate()])
        got = [layer(x, positions=given, cache=mine), layer(step, cache=mine)]
        want = [whole(x, positions=ids, cache=theirs), whole(step, cache=theirs)]
        name = type(encoding).__name__
        for g, w in zip(got, want, strict=True):
            assert g.device_mesh == mesh["tp"], (name, g.device_mesh)
            assert (g.full_tensor() - w).abs().max() < 1e-5, (name, (g.full_tensor() - w).abs().max())
    _flex_sized_calls_sharded(mesh["tp"], plan, gen)


def _flex_sized_calls_sharded(mesh, plan: dict, gen: torch.Generator) -> None:
    """Heads sharded, a call the whole layer routes to the compiled FlexAttention (ALiBi or T5, no grad, 128 keys or
    more, the score threshold lowered as tests/kernels/test_flex_bias.py lowers it) is attended on the materialized
    path, each rank its own heads, equal to the whole layer's, with no fallback warning: attend_flex refuses DTensors
    ("not DTensors"). attend_flex is replaced here by one that records and raises, and flex_available answers True
    without importing dynamo (3 s a rank), so that nothing compiles: the whole layer's real flex call costs each rank
    13 s (inductor cache warm) to 39 s (cold) on 2 shared CPU cores, and flex against the materialized bias is
    tests/kernels/test_flex_bias.py's."""
    import contextlib
    import warnings

    from torch.distributed.tensor.parallel import parallelize_module

    from posenc import attention
    from posenc.kernels import flex_bias

    calls = []

    def routed(q, *args, **kwargs):
        calls.append(type(q).__name__)
        raise LookupError("routed to attend_flex")

    x = torch.randn(1, 140, 64, generator=gen)  # CPU flex takes 128 keys or more (flex_bias.CPU_MIN_KEYS)
    kept = attention.attend_flex, flex_bias.CPU_MIN_SCORES, flex_bias.flex_available
    for make in (lambda: posenc.ALiBi(4), lambda: posenc.T5Bias(4)):
        torch.manual_seed(0)
        whole = posenc.CausalSelfAttention(64, 4, num_kv_heads=2, encoding=make()).eval()
        layer = parallelize_module(copy.deepcopy(whole), mesh, plan)
        name = type(whole.encoding).__name__
        with torch.no_grad():
            want = whole(x)  # materialized: the default threshold is 4096 x 4096 scores
            attention.attend_flex, flex_bias.CPU_MIN_SCORES, flex_bias.flex_available = routed, 0, lambda: True
            try:
                with contextlib.suppress(LookupError):
                    whole(x)  # the call is flex-sized: the whole layer goes there
                with warnings.catch_warnings():
                    warnings.simplefilter("error", UserWarning)  # a FlexFallback warns
                    got = layer(x)
            finally:
                attention.attend_flex, flex_bias.CPU_MIN_SCORES, flex_bias.flex_available = kept
        assert calls == ["Tensor"], (name, calls)
        calls.clear()
        assert (got.full_tensor() - want).abs().max() < 1e-5, name


def _score_bias_of_dtensor_ids(dt, shard, gen: torch.Generator) -> None:
    """ALiBi's and T5's score_bias of DTensor position ids failed inside torch: their plain slopes and table met the
    ids ("got mixed torch.Tensor and DTensor"). Now the bias of the whole ids, replicated on their mesh, which DTensor
    adds to scores sharded on heads with no communication, equal to the whole sum (T5's table gradient too).
    attend_flex of DTensors failed inside dynamo's fake run of the score_mod; now refused by name."""
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.debug import CommDebugMode

    from posenc.kernels.flex_bias import attend_flex

    q_ids, k_ids = torch.tensor([[3, 4], [5, 6]]), torch.arange(7)[None].expand(2, 7)
    scores = torch.randn(2, 4, 2, 7, generator=gen)
    for kind in (posenc.ALiBi, posenc.T5Bias):
        torch.manual_seed(0)
        whole = kind(4)
        sharded = copy.deepcopy(whole)
        want = scores + whole.score_bias(q_ids, k_ids)
        # Either ids a DTensor, or both: the bias is replicated on their mesh.
        for given in ((q_ids, dt(k_ids)), (dt(q_ids, shard(0)), k_ids)):
            one = sharded.score_bias(*given)
            assert one.placements == (Replicate(),), (kind.__name__, one.placements)
            assert torch.equal(one.full_tensor(), whole.score_bias(q_ids, k_ids)), kind.__name__
        bias = sharded.score_bias(dt(q_ids, shard(0)), dt(k_ids))
        assert bias.placements == (Replicate(),), (kind.__name__, bias.placements)
        heads = dt(scores, shard(1))
        with CommDebugMode() as comm:
            got = heads + bias
        assert got.placements == (shard(1),) and comm.get_total_counts() == 0, (kind.__name__, got.placements)
        assert (got.full_tensor() - want).abs().max() < 1e-6, kind.__name__
        if kind is posenc.T5Bias:  # ALiBi learns nothing
            (want**2).sum().backward()
            (got.full_tensor() ** 2).sum().backward()
            assert (sharded.table.weight.grad - whole.table.weight.grad).abs().max() < 1e-5
    q = dt(torch.randn(1, 4, 8, 16, generator=gen), shard(1))
    try:
        attend_flex(q, q, q, posenc.ALiBi(4), torch.arange(8)[None], torch.arange(8)[None])
    except ValueError as error:
        assert "not DTensors" in str(error), error
    else:
        raise AssertionError("attend_flex of DTensors was not refused")


def _attend_sharded_on_the_batch_or_heads(dt, shard, gen: torch.Generator) -> None:
    """posenc.attention.attend of q sharded on the batch or the heads (k and v DTensors laid out as q, or plain), with
    a per-row document mask and ALiBi's bias: each rank attends its own rows or heads, the mask and bias cut as q is,
    the output and probabilities laid out as q with the whole tensor's strides, equal to the whole call. q sharded
    along the sequence is refused by name (its keys live on the other rank)."""
    from posenc.attention import attend, causal_mask

    q, k, v = (torch.randn(2, 4, 5, 8, generator=gen) for _ in range(3))
    docs = torch.tensor([[0, 0, 1, 1, 1], [0, 1, 1, 1, 2]])
    allowed = causal_mask(5, 5, q.device, docs)  # (b, 1, s, t): rows differ
    bias = posenc.ALiBi(4).score_bias(torch.arange(5), torch.arange(5))
    want = attend(q, k, v, allowed, bias, need_probs=True)
    for placement, kv_sharded in itertools.product((shard(0), shard(1)), (True, False)):
        kv = (dt(k, placement), dt(v, placement)) if kv_sharded else (k, v)  # plain k, v: taken whole
        got = attend(dt(q, placement), *kv, allowed, bias, need_probs=True)
        for g, w in zip(got, want, strict=True):
            assert g.placements == (placement,) and g.stride() == g.full_tensor().stride(), (placement, g.stride())
            assert (g.full_tensor() - w).abs().max() < 1e-6, (placement, kv_sharded)
    try:
        attend(dt(q, shard(2)), dt(k, shard(2)), dt(v, shard(2)), allowed, bias, need_probs=False)
    except ValueError as error:
        assert "sharded on heads or the batch" in str(error), error
    else:
        raise AssertionError("q sharded along the sequence was not refused")


def _mrope_ids_on_the_mesh(mesh, dt, shard, gen: torch.Generator) -> None:
    """MRoPE's (3, b, s) ids as a replicated DTensor beside q, k sharded on heads (tensor parallelism) or the batch
    met its plain axis-of-pair table in index_select ("got mixed torch.Tensor and DTensor"); now rotated as the
    whole."""
    rope = posenc.MRoPE(16, mrope_section=[2, 3, 3])
    q, k = torch.randn(2, 4, 5, 16, generator=gen), torch.randn(2, 2, 5, 16, generator=gen)
    ids = torch.randint(0, 9, (3, 2, 5), generator=gen)
    want = rope(q, k, positions=ids)
    for placement in (shard(1), shard(0)):
        got = rope(dt(q, placement), dt(k, placement), positions=dt(ids))
        assert all((g.full_tensor() - w).abs().max() < 1e-6 for g, w in zip(got, want, strict=True)), placement
    # mrope_cos_sin reads DTensor ids whole, as plain ones: negative ones refused (after it began reading only CPU
    # ids, a DTensor's were passed unchecked).
    inv_freq, section = rope.frequencies(None)[0], [2, 3, 3]
    whole = mrope_cos_sin(ids, inv_freq, section)[0]
    assert torch.equal(mrope_cos_sin(dt(ids), inv_freq, section)[0].full_tensor(), whole)
    try:
        mrope_cos_sin(dt(ids - 100), inv_freq, section)
    except ValueError as error:
        assert "positions must be >= 0" in str(error)
    else:
        raise AssertionError("negative DTensor ids were taken")
    # ALiBi's state of DTensor slopes (a module distributed whole): the head count's own compared by their values
    # ("aten.equal.default got mixed torch.Tensor and DTensor" before), and left out as plain ones are.
    from torch.distributed.tensor import distribute_module

    layer = distribute_module(posenc.CausalSelfAttention(16, 2, encoding=posenc.ALiBi(2)), mesh)
    assert "encoding.slopes" not in layer.state_dict()


def _document_ids_and_positions_sharded_along_the_sequence(dt, shard) -> None:
    """document_ids_from_positions of position ids sharded along the sequence gave wrong ids without an error (the
    shards' slices and in-place write), and positions_from_document_ids of any DTensor, document_ids_from_cu_seqlens'
    own output included, failed inside torch.where ("mixed torch.Tensor and DTensor"): now those of the whole values,
    laid out as the ids are."""
    docs = torch.tensor([[0, 0, 1, 1, 1, 2], [0, 1, 1, 1, 2, 2]])
    positions = torch.tensor([[0, 1, 0, 1, 2, 3], [5, 6, 7, 0, 1, 2]])
    for placement in (shard(1), shard(0)):
        got = posenc.document_ids_from_positions(dt(positions, placement))
        want = torch.tensor([[0, 0, 1, 1, 1, 1], [0, 0, 0, 1, 1, 1]])
        assert got.placements == (placement,) and torch.equal(got.full_tensor(), want), got.full_tensor()
        got = posenc.positions_from_document_ids(dt(docs, placement))
        want = posenc.positions_from_document_ids(docs)
        assert got.placements == (placement,) and torch.equal(got.full_tensor(), want), got.full_tensor()
    cu = torch.tensor([0, 3, 3, 7, 9])
    got = posenc.positions_from_document_ids(posenc.document_ids_from_cu_seqlens(dt(cu, shard(0))))
    assert torch.equal(got.full_tensor(), torch.tensor([0, 1, 2, 0, 1, 2, 3, 0, 1])), got.full_tensor()


def _attention_with_sharded_positions(dt, shard, gen: torch.Generator) -> None:
    """CausalSelfAttention of plain x at position ids sharded along the sequence, equal to the call at the whole ids:
    with ALiBi or T5's bias, and into a KVCache continued by plain ids or its own next positions. The DTensor ids met
    the biases' plain tensors, and, cached, the next step's plain ids or arange ("got mixed torch.Tensor and DTensor",
    eager and compiled): now taken whole, as document ids are."""
    x, step = torch.randn(2, 5, 32, generator=gen), torch.randn(2, 2, 32, generator=gen)
    ids, next_ids = torch.tensor([[3, 1, 4, 1, 5], [0, 1, 2, 3, 9]]), torch.tensor([[6, 7], [10, 11]])
    for encoding in (posenc.ALiBi(2), posenc.T5Bias(2), posenc.RoPE(16)):
        attention = posenc.CausalSelfAttention(32, 2, encoding=encoding)
        assert torch.equal(attention(x, positions=dt(ids, shard)), attention(x, positions=ids)), encoding
    for given in (next_ids, None):  # plain ids, or the cache's next positions
        steps = []
        for first in (dt(ids, shard), ids):
            cache = posenc.KVCache()
            attention(x, positions=first, cache=cache)
            steps.append(attention(step, positions=given, cache=cache))
        assert torch.equal(steps[0], steps[1]), given


def _sharded_document_ids(dt, shard, gen: torch.Generator) -> None:
    """document_ids_from_cu_seqlens of sharded prefix sums failed inside repeat_interleave (DTensor has no rule for
    it), and CausalSelfAttention's document ids sharded across the ranks met its plain tensors ("mixed torch.Tensor
    and DTensor"), a run that comes back later on one rank's shard refused with different errors per rank: now the
    ids of the whole values, and the same refusal on every rank."""
    from torch.distributed.tensor import Replicate

    cu = torch.tensor([0, 3, 3, 7, 9])
    got = posenc.document_ids_from_cu_seqlens(dt(cu, shard))
    # Replicated, as the rotation takes them: (total_tokens,) ids have no layout in common with (n_seq + 1,) sums.
    assert got.placements == (Replicate(),), got.placements
    assert torch.equal(got.full_tensor(), posenc.document_ids_from_cu_seqlens(cu))
    attention = posenc.CausalSelfAttention(32, 2, encoding=posenc.RoPE(16))
    x = torch.randn(4, 5, 32, generator=gen)
    docs = torch.tensor([[0, 0, 1, 1, 1]] * 3 + [[0, 1, 1, 2, 2]])
    assert torch.equal(attention(x, document_ids=dt(docs, shard)), attention(x, document_ids=docs))
    bad = docs.clone()
    bad[-1] = torch.tensor([0, 1, 0, 2, 2])  # the last rank's shard alone has an id that comes back
    try:
        attention(x, document_ids=dt(bad, shard))
    except ValueError as error:
        assert "one run of tokens" in str(error), error
    else:
        raise AssertionError("document ids whose run comes back on one rank's shard were not refused on this rank")


def _sharded_ids_checked_whole(dt, shard, gen: torch.Generator) -> None:
    """Position ids and offsets sharded across the ranks, a negative entry in the last rank's shard alone: refused on
    every rank, with the same message. resolve_positions read each rank's shard only: under CausalSelfAttention the
    rank holding it raised and the other went on into RoPE's gather of the whole ids (on gloo, a timeout after the
    process group's 60 s; a hang on NCCL)."""
    from posenc.positions import resolve_positions

    attention = posenc.CausalSelfAttention(32, 2, encoding=posenc.RoPE(16))
    x, q = torch.randn(4, 5, 32, generator=gen), torch.randn(4, 2, 5, 16, generator=gen)
    cos, sin = posenc.RoPE(16).cos_sin(torch.arange(8))
    ids = torch.tensor([[0, 1, 2, 3, 4]] * 3 + [[4, 3, 2, 1, 0]])
    assert torch.equal(attention(x, positions=dt(ids, shard)), attention(x, positions=ids))
    bad_ids, bad_offset = ids.clone(), torch.tensor([1, 2, 3, -4])
    bad_ids[-1, 2] = -2
    calls = [
        (lambda: attention(x, positions=dt(bad_ids, shard)), "positions must be >= 0"),
        # The rank without the negative id said "offset + position ids must fit in int64" (wrapped_positions).
        (lambda: posenc.apply_rotary(dt(q, shard), dt(cos), dt(sin), positions=dt(bad_ids, shard)), "must be >= 0"),
        (lambda: resolve_positions(5, batch=4, positions=dt(bad_ids, shard)), "positions must be >= 0"),
        (lambda: resolve_positions(5, batch=4, positions=dt(ids, shard), offset=dt(bad_offset, shard)), "offset"),
    ]
    for call, message in calls:
        try:
            call()
        except ValueError as error:
            assert message in str(error), error
        else:
            raise AssertionError(f"a negative entry on one rank's shard was not refused on this rank ({message})")
    # A DTensor offset beside the arange (no ids) or beside plain ids, and plain offsets beside DTensor ids: the sum
    # met a plain tensor ("got mixed torch.Tensor and DTensor"). Now the plain one is taken whole.
    good_offset = torch.tensor([1, 2, 3, 4])
    want = (
        resolve_positions(5, batch=4, offset=good_offset),
        resolve_positions(5, batch=4, positions=ids, offset=good_offset),
    )
    for offset, positions, whole in (
        (dt(good_offset, shard), None, want[0]),
        (dt(good_offset, shard), ids, want[1]),
        (good_offset, dt(ids, shard), want[1]),
    ):
        got = resolve_positions(5, batch=4, positions=positions, offset=offset)
        assert torch.equal(got.full_tensor(), whole), (positions is None, got.full_tensor())


def main(out_dir: str, configs: list[dict]) -> None:
    # A rank waiting in a collective for one that raised fails in a minute, not in gloo's default 30.
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1 + rank % 2)
    seq_len, long_len = 64, 9001
    for params in configs:
        rope = posenc.RoPE(16, rope_parameters=params or None, max_position_embeddings=16)
        positions = torch.arange(seq_len)
        if rank % 2 == 0:
            cos, sin = rope.cos_sin(positions, seq_len=seq_len)
        else:
            rope.cos_sin(torch.arange(long_len), seq_len=long_len)  # a table (or angles) past the parallel grain
            backwards = positions.flip(0)
            pieces = [rope.cos_sin(part, seq_len=seq_len) for part in (backwards[:23], backwards[23:])]
            cos, sin = (torch.cat([piece[i] for piece in pieces]).flip(0) for i in (0, 1))
        inv_freq, _ = rope.frequencies(seq_len)
        for mine in (cos, sin, inv_freq):
            gathered = [torch.empty_like(mine) for _ in range(world)]
            dist.all_gather(gathered, mine.contiguous())
            assert all(torch.equal(g, gathered[0]) for g in gathered), f"ranks differ for {params}"

        gen = torch.Generator().manual_seed(0)  # same q, k on every rank: the whole sequence
        q, k = torch.randn(1, 2, seq_len, 16, generator=gen), torch.randn(1, 2, seq_len, 16, generator=gen)
        full_q, full_k = rope(q, k, seq_len=seq_len)
        pos = shard_positions(seq_len, world, rank)
        shard_q, shard_k = rope(q[:, :, pos], k[:, :, pos], positions=pos, seq_len=seq_len)
        assert torch.equal(shard_q, full_q[:, :, pos]) and torch.equal(shard_k, full_k[:, :, pos]), params
    _sharded_dtensor_calls(world)
    dist.barrier()
    dist.destroy_process_group()
    with open(os.path.join(out_dir, f"ok-{rank}"), "w") as f:
        f.write("ok")


if __name__ == "__main__":
    main(sys.argv[1], json.loads(sys.argv[2]))
    # Every check has passed and ok-<rank> is written: leave without finalizing the interpreter. The device meshes'
    # gloo groups keep their worker threads past destroy_process_group, and a worker that drops the last reference
    # to a collective's tensors while the interpreter finalizes takes the GIL there and aborts the process
    # ("terminate called without an active exception", SIGABRT; seen about once in 6-20 runs under load, by a core
    # dump: ProcessGroupGloo::runLoop destroying an AsyncBarrierWork at exit; pytorch/pytorch#179291 describes it).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
