"""Turn the ways a caller can say "where are these tokens" into one (b or 1, s) int64 tensor.

Accepted: nothing (0..s-1), an integer ``offset`` (KV-cache decoding), per-batch offsets (a (b,) tensor), or
explicit position ids of shape (s,) or (b, s) (packed sequences that restart at 0 per document).

Packed documents are also described by document ids: one integer per token, equal within a document, each
document one run of tokens (ids in any order, as Hugging Face's packed masks take them). The attention reads them to
keep each document to itself (``CausalSelfAttention(..., document_ids=...)``); the helpers below convert between
them, position ids that restart, and flash-attention's ``cu_seqlens``.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from posenc._checks import (
    assert_without_sync,
    compiling,
    first_dtensor,
    host_min_max,
    int64_int,
    int_fix,
    int_tensor,
    integer_offset,
    is_dtensor,
    laid_out_as,
    movable,
    prefix_sums,
    replicated_like,
    replicated_values,
    size_in,
    values_readable,
    wrapped_positions,
)


def ids_fit(positions: torch.Tensor, seq_len: int, batch: int) -> bool:
    """Whether position ids have a shape ``resolve_positions`` takes for ``seq_len`` tokens: (s,) or (1 or b, s)."""
    return (
        positions.dim() in (1, 2)
        and positions.shape[-1] == seq_len
        and (positions.dim() == 1 or size_in(positions.shape[0], (1, batch)))
    )


def resolve_positions(
    seq_len: int,
    *,
    batch: int,
    positions: torch.Tensor | None = None,
    offset: int | torch.Tensor = 0,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """Returns int64 positions of shape (1, s) or (b, s).

    positions: (s,) or (b, s) integer tensor, or None for ``offset + arange(s)``.
    offset: int >= 0, or an integer tensor of shape (b,) (one offset per sequence). Added to ``positions``.
    No offset may be negative, nor any offset + position id (an id below 0 is read where the offset makes up for
    it): checked on the host, or, under torch.compile and CUDA graph capture (where reading a value would break the
    graph or the capture), by an assert that runs with the graph.
    """
    offset = integer_offset(offset)
    tensors = [t for t in (positions, offset) if isinstance(t, torch.Tensor)]
    check_data = values_readable(device if device is not None else (tensors[0].device if tensors else None))
    if isinstance(offset, torch.Tensor):
        int_tensor("offset", offset, host_read=True)
        if device is not None:
            movable("offset", offset, device)  # moved below, once checked where it is
        if offset.dim() == 0:
            offset = offset.reshape(1)
        if offset.dim() != 1 or not size_in(offset.shape[0], (1, batch)):
            raise ValueError(
                f"offset must be an int or a tensor of shape ({batch},) (one per sequence), "
                f"got shape {tuple(offset.shape)}"
            )
        # Whole, where offset is a DTensor (and pos's test below): .any() of a shard read on the host is that rank's
        # alone, so only the rank holding a negative entry raised while the others went on into the next collective.
        if check_data and offset.numel():
            low, high = host_min_max(replicated_values(offset))  # one read, as the test for negatives alone was
            if low < 0:
                raise ValueError("offset must be >= 0 (it counts tokens already in the cache), got a negative entry")
            if positions is None:  # with ids, a sum past int64 shows as a negative one below
                # arange(s) + offset wrapped negative: "positions must be >= 0, got a negative entry (-2**63)".
                int64_int("the last position, offset + seq_len - 1,", high + max(seq_len, 1) - 1)
        offset = offset.to(device=device, dtype=torch.long)[:, None]
    elif isinstance(offset, bool) or not isinstance(offset, int):
        raise TypeError(
            f"offset must be an int or an integer tensor, got {type(offset).__name__} {offset!r}{int_fix(offset)}"
        )
    elif offset < 0:
        raise ValueError(f"offset must be >= 0 (it counts tokens already in the cache), got {offset}")
    elif not compiling():  # max() of a symbolic length would add a guard
        if positions is None:
            int64_int("the last position, offset + seq_len - 1,", offset + max(seq_len, 1) - 1)
        else:
            # With ids the last position is offset + max(ids), not offset + seq_len - 1 (until 2026-12-06 ids that
            # restart at 0 near 2**63 were refused, and ids past seq_len passed here): their sums are checked once
            # added, below, where one past 2**63 - 1 shows as a negative entry. Torch must only be able to add it.
            int64_int("offset", offset)

    if positions is None:
        pos = torch.arange(seq_len, device=device, dtype=torch.long)[None, :]
    else:
        int_tensor("positions", positions, host_read=True)
        if device is not None:
            movable("positions", positions, device)
        if not ids_fit(positions, seq_len, batch):
            raise ValueError(
                f"positions must have shape ({seq_len},) or ({batch}, {seq_len}) to match the sequence, got "
                f"{tuple(positions.shape)}"
            )
        pos = positions[None, :] if positions.dim() == 1 else positions
        pos = pos.to(device=device, dtype=torch.long)
    if isinstance(offset, torch.Tensor) and (like := first_dtensor(pos, offset)) is not None:
        # The plain one of the two (the arange, or plain ids or offsets beside DTensor ones) taken whole, replicated on
        # the other's mesh, as token_positions takes them: DTensor refused the sum ("got mixed torch.Tensor and
        # DTensor"), so a DTensor offset without position ids always failed.
        pos, offset = replicated_like(pos, like), replicated_like(offset, like)
    pos = pos + offset
    if check_data and positions is not None and pos.numel() and bool((replicated_values(pos) < 0).any()):
        if (wrapped := wrapped_positions(positions)) is not None:
            raise wrapped
        raise ValueError("positions must be >= 0 (offset + position ids), got a negative entry")
    if not check_data and isinstance(offset, torch.Tensor):
        assert_without_sync(offset >= 0, "offset must be >= 0 (it counts tokens already in the cache)")
    if not check_data and positions is not None:  # without ids, pos >= 0 follows from the offset's assert
        assert_without_sync(pos >= 0, "positions must be >= 0 (offset + position ids), got a negative entry")
    return pos


def resolve_document_ids(
    document_ids: torch.Tensor, *, batch: int, seq_len: int, device: torch.device | str | None = None
) -> torch.Tensor:
    """document_ids: (s,) or (b, s) integer ids, each document's tokens one run. Returns int64 (1, s) or (b, s).

    One run per id is checked on the host, or by an assert that runs with the graph where values cannot be read (as
    for positions): an id that comes back later would make its two runs one document to the mask, while its
    positions restart at the second run."""
    int_tensor("document_ids", document_ids, what="document ids", host_read=True)
    # Whole, where they are a DTensor: the run check read on the host is otherwise each rank's shard alone (ranks
    # raised different errors), and the mask built from them met plain tensors ("mixed torch.Tensor and DTensor").
    document_ids = replicated_values(document_ids)
    if device is not None:
        movable("document_ids", document_ids, device)
    as_given = tuple(document_ids.shape)
    docs = document_ids[None, :] if document_ids.dim() == 1 else document_ids
    if docs.dim() != 2 or docs.shape[-1] != seq_len or not size_in(docs.shape[0], (1, batch)):
        raise ValueError(
            f"document_ids must have shape ({seq_len},) or ({batch}, {seq_len}) to match the sequence, got {as_given}"
        )
    docs = docs.to(device=device, dtype=torch.long)
    # Each id is one run exactly when a row changes id as often as its sorted ids do.
    runs = _run_starts(docs).sum(dim=1)
    distinct = _run_starts(docs.sort(dim=1).values).sum(dim=1)
    message = (
        "document_ids must give each document one run of tokens, but an id comes back after another; number the "
        "documents apart (posenc.document_ids_from_positions or posenc.document_ids_from_cu_seqlens build them)"
    )
    if values_readable(docs.device):
        if bool((runs != distinct).any()):
            raise ValueError(message)
    else:
        assert_without_sync(runs == distinct, message)
    return docs


def _run_starts(x: torch.Tensor, step: int = 0) -> torch.Tensor:
    """x: (..., s) int64. Returns bool (..., s): True where a run begins in which each entry is the one before plus
    ``step`` (0: equal ids, 1: consecutive positions), at index 0 and wherever x breaks the run. Compared with x
    rolled, not slices x[..., 1:] and x[..., :-1]: under torch.export with a dynamic s, torch's metadata of those
    (..., s - 1) slices guarded s - 1 != 1, so that a program exported with document ids refused a Dim reaching s = 1
    or 2 (a decode step) with "satisfy the generated guard 3 <= s"."""
    first = torch.arange(x.shape[-1], device=x.device) == 0
    return (x - x.roll(1, dims=-1) != step) | first


def _one_or_more_dims(name: str, x: torch.Tensor) -> None:
    if x.dim() == 0:
        raise ValueError(f"{name} must have a sequence dimension, (s,) or (b, s), got a 0-d tensor")


def _of_whole_values(fn: Callable[[torch.Tensor], torch.Tensor], ids: torch.Tensor) -> torch.Tensor:
    """fn of a DTensor's whole values, laid out as ``ids`` are: a run of ids may cross shards, which fn, reading
    neighbouring tokens, must see as one."""
    return laid_out_as(fn(ids.full_tensor()), ids)


def positions_from_document_ids(document_ids: torch.Tensor) -> torch.Tensor:
    """document_ids: (..., s) integers. Returns int64 (..., s): each token's index within its run of equal ids,
    counting from 0 (the position ids of documents packed into one row)."""
    int_tensor("document_ids", document_ids, what="document ids")
    _one_or_more_dims("document_ids", document_ids)
    if is_dtensor(document_ids):
        # The arange below is a plain tensor, which torch.where refused to mix with a DTensor: a bare error.
        return _of_whole_values(positions_from_document_ids, document_ids)
    docs = document_ids.long()
    index = torch.arange(docs.shape[-1], device=docs.device).expand_as(docs)
    first = torch.where(_run_starts(docs), index, 0).cummax(dim=-1).values  # where the current run began
    return index - first


def positions_continuing(
    last_ids: torch.Tensor, last_positions: torch.Tensor, document_ids: torch.Tensor
) -> torch.Tensor:
    """last_ids, last_positions: (b or 1, 1) the document id and position of the last token before these ones;
    document_ids: (b or 1, s) the new tokens'. Returns int64 (b or 1, s): a new token of the last token's document
    continues its positions, one of another document starts at 0 (a KV cache decoding documents one after another,
    left padding before each row's text included)."""
    batch = max(last_ids.shape[0], document_ids.shape[0])
    ids = torch.cat((last_ids.expand(batch, -1), document_ids.expand(batch, -1)), dim=1)
    within = positions_from_document_ids(ids)[:, 1:]
    # A token whose index within its run is its distance from the last token lies in the last token's run.
    continues = within == torch.arange(1, ids.shape[1], device=ids.device)
    return within + torch.where(continues, last_positions.long(), 0)


def document_ids_from_positions(positions: torch.Tensor) -> torch.Tensor:
    """positions: (..., s) integer position ids. Returns int64 (..., s) document ids counting from 0 per row: a
    new document starts wherever a position is not one more than the one before it. This is the rule Hugging Face
    uses to find packed sequences in ``position_ids`` (``find_packed_sequence_indices``)."""
    int_tensor("positions", positions)
    _one_or_more_dims("positions", positions)
    if is_dtensor(positions):
        # Sharded along the sequence, DTensor's slices and in-place write below gave wrong ids without an error.
        return _of_whole_values(document_ids_from_positions, positions)
    pos = positions.long()
    starts = _run_starts(pos, step=1)
    return starts.long().cumsum(dim=-1) - 1


def document_ids_from_cu_seqlens(cu_seqlens: torch.Tensor) -> torch.Tensor:
    """cu_seqlens: (n + 1,) prefix sums of n sequence lengths, from 0 (flash-attention's varlen form). Returns
    int64 (total_tokens,): sequence i's tokens get id i (an empty sequence takes no tokens)."""
    prefix_sums(cu_seqlens)
    if is_dtensor(cu_seqlens):
        # DTensor has no sharding rule for repeat_interleave (a bare error from inside it): the ids of the whole
        # prefix sums, replicated on their mesh as the rotation takes them.
        return replicated_like(document_ids_from_cu_seqlens(cu_seqlens.full_tensor()), cu_seqlens)
    lengths = sequence_lengths(cu_seqlens)
    return torch.repeat_interleave(torch.arange(lengths.shape[0], device=cu_seqlens.device), lengths)


def sequence_lengths(cu_seqlens: torch.Tensor) -> torch.Tensor:
    """cu_seqlens: plain (n + 1,) prefix sums, already checked to be a 1-D integer tensor. Returns int64 (n,) the
    sequence lengths, having checked (where values are readable) that the sums start at 0 and never decrease."""
    if cu_seqlens.device.type == "meta":
        # What the callers build has as many entries as the values say (cu_seqlens[-1] tokens), which a meta tensor
        # does not hold: torch's repeat_interleave raised "cannot repeat_interleave a meta tensor without output_size".
        raise ValueError(
            "cu_seqlens is on the meta device, which holds no values: the tokens it describes (cu_seqlens[-1] of them) "
            "cannot be counted; pass the prefix sums on the CPU or the activations' device"
        )
    lengths = cu_seqlens.long().diff()
    if values_readable(cu_seqlens.device):
        if int(cu_seqlens[0]) != 0:
            raise ValueError(f"cu_seqlens must start at 0 (prefix sums of sequence lengths), got {int(cu_seqlens[0])}")
        if bool((lengths < 0).any()):
            at = int((lengths < 0).nonzero()[0, 0])
            raise ValueError(
                f"cu_seqlens must be non-decreasing (prefix sums of sequence lengths), but entry {at + 1} "
                f"({int(cu_seqlens[at + 1])}) is below entry {at} ({int(cu_seqlens[at])})"
            )
    return lengths
