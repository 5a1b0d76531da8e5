"""How a rotary call says where each token is, checked once and brought to the form every backend reads.

Two ways to pass cos/sin (r = rotary dim, pairs r/2):

* broadcast: cos, sin broadcast to x.shape[:-1] + (r/2,) (the default; ``kind="broadcast"``);
* table: cos, sin are (n, r/2) tables and row ``p`` rotates a token at position ``p``. Positions come from
  ``positions`` ((s,) or (b, s) ids), ``offset`` (an int, or (b,) per sequence) added to them (or to 0..s-1),
  or ``cu_seqlens`` ((n_seq + 1,) prefix sums, x packed as (total, h, d), positions restarting at 0 per
  sequence, plus ``offset``), as flash-attention's varlen API. ``kind`` is then "bhsd", "bshd" or "varlen".

Every backend sees x as a (n0, n1, n2, d) view with rows (i0, i1, i2) = (batch, head, token); in table mode the
token axis is the one positions index. Shape key: b batch, h heads, s sequence, d head dim.
"""

from __future__ import annotations

from typing import Literal

import torch

from posenc._checks import (
    angle_dtypes,
    assert_without_sync,
    first_dtensor,
    float_tensor,
    host_min_max,
    int_fix,
    int_tensor,
    prefix_sums,
    replicated_like,
    replicated_values,
    size_in,
    values_readable,
    wrapped_positions,
)


# Hugging Face's rotary embeddings return each pair's angle twice, (..., rotary_dim): torch.cat((freqs, freqs), -1) in
# most models, torch.repeat_interleave(freqs, 2, -1) in Cohere's (Cohere2, Ergo, BLT), whose first half holds the first
# quarter of the angles, each twice. No shape tells the two apart, so the hint names both: the first half alone, the
# recipe for the concatenated form, silently rotated a Cohere model's q and k by the wrong angles (max error 3.8 on
# unit-scale x). With full rotation such cos/sin are refused by width; with rotary_dim <= head_dim / 2 (GPT-NeoX's
# rotary_pct=0.25) they fit and would rotate twice the channels by the wrong angles: hence the docs' warning too.
def hf_cos_hint(width: int, channels: int) -> str:
    """The end of the error for cos/sin of last dim ``width`` too wide for x's ``channels``: where they could be
    Hugging Face's (an even width up to the head dim), how to take posenc's from them; else nothing."""
    if width % 2 or width > channels:
        return ""
    return (
        f"; Hugging Face's cos/sin (..., rotary_dim) hold each pair's value twice: pass cos[..., :{width // 2}] and "
        f"sin[..., :{width // 2}] where the model concatenates them (torch.cat((freqs, freqs), -1): Llama, GLM and "
        "most), cos[..., ::2] and sin[..., ::2] where it interleaves them (torch.repeat_interleave(freqs, 2, -1): "
        "Cohere)"
    )


def _token_major_hint(name: str, x: torch.Tensor, kind: str, *, at_offset: bool) -> str:
    """The end of the error for an x of too few dims in a table call: tokens laid out one after another, (n_tokens,
    h, d) or flat (n_tokens, h * d) as vLLM keeps q and k, are one sequence of a (b, s, h, d) batch of one.

    at_offset: the call read x at offset= (no positions=), so its (b, h, d) is one token of each of b sequences (a
    decode step). Read as one sequence, x[None] at that offset, token i went to offset + i (max error 3.5, no
    error): the view named first is b sequences of one token."""
    if kind == "varlen" or x.dim() not in (2, 3):
        return ""
    view = f"{name}[None]" if x.dim() == 3 else f"{name}.view(1, n_tokens, -1, head_dim)"
    decode = ""
    if kind == "bhsd" and x.dim() == 3:
        # Read (b, h, s, d), a 3-D x is as likely (h, s, d) without its batch axis, which layout='bshd' would misread.
        decode = f"; for one sequence laid out (h, s, d), pass {name}[None]"
    if at_offset:
        one_each = f"{name}[:, None]" if x.dim() == 3 else f"{name}.view(b, 1, -1, head_dim)"
        decode += f"; for one token of each sequence at offset (a decode step), pass {one_each} with layout='bshd'"
    return decode + (
        "; for tokens laid out (n_tokens, h, d) or (n_tokens, h * d) (vLLM's q and k) read at position ids "
        f"(n_tokens,), pass {view} with layout='bshd' (a view, no copy); for packed sequences counting from 0, pass "
        "it as (n_tokens, h, d) with cu_seqlens"
    )


Kind = Literal["broadcast", "bhsd", "bshd", "varlen"]
KINDS = ("broadcast", "bhsd", "bshd", "varlen")


def rotary_kind(
    layout: str | None, positions: torch.Tensor | None, offset: object, cu_seqlens: torch.Tensor | None
) -> Kind:
    """Which way cos/sin are read; raises if ``layout`` is given where it has no meaning."""
    table = positions is not None or offset is not None or cu_seqlens is not None
    if not table:
        if layout is not None:
            raise ValueError(
                f"layout={layout!r} only applies when cos/sin are tables read at positions; pass positions=, "
                "offset= or cu_seqlens=, or drop layout (broadcast cos/sin need no layout)"
            )
        return "broadcast"
    if cu_seqlens is not None:
        if layout is not None:
            raise ValueError("with cu_seqlens x is packed as (total_tokens, h, d); drop layout")
        return "varlen"
    layout = "bhsd" if layout is None else layout
    if layout not in ("bhsd", "bshd"):
        raise ValueError(f"layout must be 'bhsd' or 'bshd', got {layout!r}")
    return layout  # type: ignore[return-value]


def check_table_call(
    xs: dict[str, torch.Tensor],
    cos: torch.Tensor,
    sin: torch.Tensor,
    kind: Kind,
    *,
    positions: torch.Tensor | None,
    offset: int | torch.Tensor | None,
    cu_seqlens: torch.Tensor | None,
    rows_checked: bool = False,
    vouched: bool = False,
) -> tuple[torch.Tensor | None, int]:
    """Validate a table-mode call; returns (offsets as a (b,) int64 tensor or None, int offset). A tensor offset
    is (b,), or 0-d / (1,) for all sequences alike.

    xs: name -> tensor, (b, h, s, d) / (b, s, h, d) / (total, h, d) by ``kind``; tensors may differ in h only.
    Data-dependent checks (positions inside the table, cu_seqlens ascending) are skipped under torch.compile and
    CUDA graph capture (``posenc._checks.values_readable``); ``rows_checked`` (the caller knows every position is
    >= 0 and inside the table) skips the positions' and offsets' ones. ``vouched`` (the caller checked each x as
    ``float_tensor`` does and passes its own float32/float64 (n, r/2) table: RoPE) skips those checks.

    The checks run in this order, each helper raising the first problem it meets: the table, each x against it,
    cu_seqlens, offset, positions' shape, then the rows that tokens read. Every call on a decode step runs this: the
    helpers take their arguments by position, and those for arguments not given are not called.
    """
    if not vouched:
        _check_table(cos, sin)
    batch, seq, device = _check_xs(xs, cos, sin, kind, vouched, offset is not None and positions is None)
    # Values are read below for cu_seqlens and for rows the caller has not checked: a RoPE call (rows_checked) reads
    # none and asks nothing (~0.5 us of a decode step).
    check_data = (cu_seqlens is not None or not rows_checked) and values_readable(device)
    if cu_seqlens is not None:
        batch = _check_cu_seqlens(cu_seqlens, positions, seq, xs, device, check_data)
    offsets, offset_int = None, 0
    # Offsets alone (no position ids, not packed): token i of sequence b reads row offsets[b] + i, so the offsets'
    # min and max give the rows' range, read once below, with no positions tensor built here for it.
    reads_offsets = check_data and not rows_checked and positions is None and kind != "varlen" and seq > 0 and batch > 0
    if offset is not None:
        offsets, offset_int = _check_offset(
            offset, batch, seq, cos.shape[0], xs, device, check_data and not rows_checked and not reads_offsets
        )
    if positions is not None:
        _check_positions_shape(positions, kind, batch, seq, xs, device)
    _check_rows_read(
        kind,
        batch,
        seq,
        cos.shape[0],
        positions,
        offsets,
        offset_int,
        cu_seqlens,
        device,
        reads_offsets,
        check_data and not rows_checked,
    )
    return offsets, offset_int


def _check_table(cos: torch.Tensor, sin: torch.Tensor) -> None:
    """cos and sin: float tables of one shape, (n_positions, r/2)."""
    angle_dtypes(cos, sin)
    if cos.dim() != 2 or cos.shape != sin.shape:
        raise ValueError(
            f"with positions/offset/cu_seqlens, cos and sin are tables of shape (n_positions, r/2); got "
            f"{tuple(cos.shape)} and {tuple(sin.shape)}"
        )


def _check_xs(
    xs: dict[str, torch.Tensor], cos: torch.Tensor, sin: torch.Tensor, kind: Kind, vouched: bool, at_offset: bool
) -> tuple[int, int, torch.device]:
    """Each x (``check_table_call``'s xs) against the (n, r/2) table: a float tensor (unless vouched) on cos/sin's
    device, of ``kind``'s rank, wide enough for r channels, of the first x's batch and token sizes. Returns (batch,
    seq, device): (b, s), or (1, total_tokens) for varlen, and the device they all share. at_offset: as
    ``_token_major_hint``'s."""
    half = cos.shape[1]
    if half == 0:
        # As broadcast cos/sin are refused: read against x's width, a table of no pairs "needed 0 channels" and
        # was told to pass cos[..., :0], Hugging Face's hint for a width that cannot be theirs.
        raise ValueError(
            f"cos must have a last dimension of r/2 >= 1 (one value per rotated pair), got shape {tuple(cos.shape)}"
        )
    rank = 3 if kind == "varlen" else 4
    axes = {"bhsd": "(b, h, s, d)", "bshd": "(b, s, h, d)", "varlen": "(total_tokens, h, d)"}[kind]
    first = next(iter(xs.values()))
    cos_device, sin_device = cos.device, sin.device  # read once: each read builds a torch.device
    for name, x in xs.items():
        if not vouched:
            float_tensor(name, x)
        device = x.device
        if device != cos_device or device != sin_device:
            raise ValueError(f"{name} is on {device} but cos/sin on {cos_device}/{sin_device}; move all to one device")
        if x.dim() != rank:
            raise ValueError(
                f"{name} must be {rank}-D {axes} for this call, got shape {tuple(x.shape)}"
                + _token_major_hint(name, x, kind, at_offset=at_offset)
            )
        if 2 * half > x.shape[-1]:
            raise ValueError(
                f"cos.shape[-1]={half} pairs needs {2 * half} channels but {name}.shape[-1]={x.shape[-1]}; "
                "the table holds one value per pair, (n_positions, rotary_dim // 2)" + hf_cos_hint(half, x.shape[-1])
            )
        token_axes = (0,) if kind == "varlen" else (0, 2) if kind == "bhsd" else (0, 1)
        # The first tensor matches itself: the test (a generator, ~0.5 us) is for the others.
        if x is not first and any(x.shape[a] != first.shape[a] for a in token_axes):
            raise ValueError(
                f"all inputs must share their batch and token sizes {axes}; got {tuple(first.shape)} and "
                f"{tuple(x.shape)} for {name}"
            )
    if kind == "varlen":
        return 1, first.shape[0], cos_device
    return first.shape[0], first.shape[2 if kind == "bhsd" else 1], cos_device


def _check_cu_seqlens(
    cu_seqlens: torch.Tensor,
    positions: torch.Tensor | None,
    seq: int,
    xs: dict[str, torch.Tensor],
    device: torch.device,
    check_data: bool,
) -> int:
    """cu_seqlens: integer (n_seq + 1,) prefix sums on xs' ``device``, from 0 to the ``seq`` packed tokens and
    non-decreasing (read on the host where ``check_data``, else asserted with the graph); no positions beside them.
    Returns the number of sequences."""
    prefix_sums(cu_seqlens)
    if positions is not None:
        raise ValueError("positions cannot be combined with cu_seqlens: packed sequences count from 0 (+ offset)")
    if cu_seqlens.device != device:
        raise _elsewhere("cu_seqlens", cu_seqlens, xs)
    if check_data:
        if int(cu_seqlens[0]) != 0 or int(cu_seqlens[-1]) != seq:
            raise ValueError(
                f"cu_seqlens must start at 0 and end at total_tokens={seq}, got "
                f"{int(cu_seqlens[0])} .. {int(cu_seqlens[-1])}"
            )
        if bool((cu_seqlens[1:] < cu_seqlens[:-1]).any()):
            raise ValueError("cu_seqlens must be non-decreasing (prefix sums of sequence lengths)")
    else:
        # Unread, bad prefix sums would be read differently by each backend: checked with the graph instead. Non-
        # decreasing as its running max, not as slices cu[1:] >= cu[:-1]: under torch.export, torch's metadata of
        # those (n_seq,) slices guarded n_seq != 1, and a program refused a Dim that allowed one sequence.
        assert_without_sync(
            (cu_seqlens[0] == 0) & (cu_seqlens[-1] == seq) & (cu_seqlens.cummax(0).values == cu_seqlens).all(),
            "cu_seqlens must start at 0, end at total_tokens and be non-decreasing (prefix sums of lengths)",
        )
    return cu_seqlens.shape[0] - 1


def _check_offset(
    offset: int | torch.Tensor,
    batch: int,
    seq: int,
    rows: int,
    xs: dict[str, torch.Tensor],
    device: torch.device,
    check_sign: bool,
) -> tuple[torch.Tensor | None, int]:
    """offset: an int >= 0 that leaves a table of ``rows`` rows some row to read, or an integer tensor on xs'
    ``device`` of one value per sequence or one for all (none negative, read on the host where ``check_sign``).
    Returns (offsets, offset_int) as ``check_table_call`` does."""
    if isinstance(offset, torch.Tensor):
        int_tensor("offset", offset, host_read=True)
        if offset.dim() > 1 or not size_in(offset.numel(), (1, batch)):
            raise ValueError(
                f"offset must be an int, a ({batch},) tensor (one per sequence) or a 0-d tensor, got shape "
                f"{tuple(offset.shape)}"
            )
        # One offset for every sequence, as a 0-d or (1,) tensor: the same as resolve_positions accepts.
        offset = offset.reshape(1).expand(batch) if offset.shape != (batch,) else offset
        if offset.device != device:
            raise _elsewhere("offset", offset, xs)
        # Whole, where offset is a DTensor: .any() of a shard read on the host is that rank's alone, so only the rank
        # holding a negative offset raised, and the others went on into the next collective (a hang on NCCL).
        if check_sign and bool((replicated_values(offset) < 0).any()):
            raise ValueError(_NEGATIVE_OFFSET)
        return offset.to(torch.long), 0
    if isinstance(offset, bool) or not isinstance(offset, int):
        raise TypeError(
            f"offset must be an int or an integer tensor, got {type(offset).__name__} {offset!r}{int_fix(offset)}"
        )
    if offset < 0:
        raise ValueError(f"offset must be >= 0, got {int(offset)}")  # int(): a symbolic int cannot be formatted
    if offset >= rows and seq > 0 and batch > 0:
        # Every position is >= 0, so every row read is past the table; checked here, as the sum with position ids
        # would wrap in int64 for offsets of 2**63 and more.
        raise ValueError(
            f"offset={int(offset)} is past the cos/sin table's {int(rows)} rows; build the table for more positions"
        )
    return None, offset


def _check_positions_shape(
    positions: torch.Tensor, kind: Kind, batch: int, seq: int, xs: dict[str, torch.Tensor], device: torch.device
) -> None:
    """positions: integer ids (s,) or (b or 1, s) matching the sequence of xs read as ``kind``, on xs' ``device``."""
    int_tensor("positions", positions, host_read=True)
    if (
        positions.dim() not in (1, 2)
        or positions.shape[-1] != seq
        or (positions.dim() == 2 and not size_in(positions.shape[0], (1, batch)))
    ):
        name = next(iter(xs))
        where = {
            "bhsd": f"{name} read as (b, h, s, d) (layout 'bhsd', the default)",
            "bshd": f"{name} read as (b, s, h, d) (layout 'bshd')",
            "varlen": f"{name} packed as (total_tokens, h, d)",
        }[kind]
        # Sizes as ints: under torch.compile they may be symbolic, which Dynamo can format but not concatenate.
        hint = f"; for {name} in (b, s, h, d) pass layout='bshd'" if kind == "bhsd" else ""
        given = tuple(int(n) for n in positions.shape)
        # The constant part built apart: Dynamo before torch 2.13 shows an f-string holding a symbolic size as
        # its pieces (in a fullgraph error), and this keeps the expected shapes in one piece.
        expected = (
            f"positions must have shape ({int(seq)},) or ({int(batch)}, {int(seq)}) to match the sequence of "
            f"{where}, got "
        )
        raise ValueError(f"{expected}{given}{hint}")
    if positions.device != device:
        raise _elsewhere("positions", positions, xs)


def _check_rows_read(
    kind: Kind,
    batch: int,
    seq: int,
    rows: int,
    positions: torch.Tensor | None,
    offsets: torch.Tensor | None,
    offset_int: int,
    cu_seqlens: torch.Tensor | None,
    device: torch.device,
    reads_offsets: bool,
    unchecked: bool,
) -> None:
    """The table rows that tokens read are >= 0 and inside a table of ``rows`` rows: known from the int offset for
    consecutive rows; else, on the host, from the offsets' range (``reads_offsets``) or, where values are readable and
    the caller has not checked the rows (``unchecked``), every token's position; else not at all."""
    if seq > 0 and consecutive_rows(kind, positions, offsets):
        # offset..offset+s-1: the range is known without building it (a decode step's common case).
        if offset_int + seq > rows:
            raise ValueError(
                f"positions reach {int(offset_int)} .. {int(offset_int + seq - 1)} but the cos/sin table has "
                f"{int(rows)} rows; build the table for at least {int(offset_int + seq)} positions"
            )
    elif reads_offsets:
        assert offsets is not None  # consecutive_rows took an int offset
        low, high = host_min_max(offsets)
        if low < 0:
            raise ValueError(_NEGATIVE_OFFSET)
        high += seq - 1
        if high > 2**63 - 1:  # offsets + 0..s-1 would wrap negative (2**63 itself: no int64 constant to trace)
            raise wrapped_positions(None)  # type: ignore[misc]  # never None without position ids
        _check_rows_in_table(low, high, rows)
    elif unchecked and seq > 0 and batch > 0:
        pos = token_positions(
            kind,
            batch,
            seq,
            positions=positions,
            offsets=offsets,
            offset=offset_int,
            cu_seqlens=cu_seqlens,
            device=device,
        )
        low, high = host_min_max(pos)
        if low < 0:
            if (wrapped := wrapped_positions(positions)) is not None:
                raise wrapped
            raise ValueError(
                f"positions must be >= 0 (offset + position ids), got a negative entry ({low}); positions index the "
                "table rows"
            )
        _check_rows_in_table(low, high, rows)


_NEGATIVE_OFFSET = "offset must be >= 0, got a negative entry"


def _elsewhere(name: str, t: torch.Tensor, xs: dict[str, torch.Tensor]) -> ValueError:
    """The refusal of an index tensor (positions, offset, cu_seqlens) on another device than the activations xs
    (name -> tensor, all on one device), naming both and the move that fixes it."""
    x_name, x = next(iter(xs.items()))
    return ValueError(f"{name} is on {t.device} but {x_name} on {x.device}; move it there: {name}.to({x_name}.device)")


def _check_rows_in_table(low: int, high: int, rows: int) -> None:
    """Raise where positions low..high (read on the host) reach past a table of ``rows`` rows."""
    if high >= rows:
        raise ValueError(
            f"positions reach {low} .. {high} but the cos/sin table has {rows} rows; "
            f"build the table for at least {high + 1} positions"
        )


def consecutive_rows(kind: Kind, positions: torch.Tensor | None, offsets: torch.Tensor | None) -> bool:
    """True when token i of every sequence reads table row offset + i (an int offset, or none): every backend then
    reads rows offset..offset+s-1 as a slice of the table, with no positions tensor built or gathered."""
    return kind in ("bhsd", "bshd") and positions is None and offsets is None


def token_positions(
    kind: Kind,
    batch: int,
    seq: int,
    *,
    positions: torch.Tensor | None,
    offsets: torch.Tensor | None,
    offset: int,
    cu_seqlens: torch.Tensor | None,
    device: torch.device,
) -> torch.Tensor:
    """The table row of every token: (b or 1, s) int64, or (1, total_tokens) for varlen.

    ``batch`` is b (the number of packed sequences for varlen); ``seq`` is s (total_tokens for varlen). Where one of
    positions, offsets and cu_seqlens is a DTensor, so are the others and the result (``replicated_like``).
    """
    like = first_dtensor(positions, offsets, cu_seqlens)
    if kind == "varlen":
        assert cu_seqlens is not None
        # DTensor has no sharding strategy for searchsorted: found on the whole values, then replicated. Contiguous:
        # searchsorted copies strided boundaries itself, warning from inside torch that the caller's cu_seqlens (an
        # int64 column of a bigger tensor, say) "will lower the performance".
        cu = replicated_values(cu_seqlens).to(torch.long).contiguous()
        offsets = None if offsets is None else replicated_values(offsets)
        token = torch.arange(seq, device=device)
        # searchsorted finds each token's sequence without a Python loop over sequences. In the whole of cu, one past
        # it (cu[0] = 0 precedes every token), not in the slice cu[1:]: under torch.export, torch's metadata of that
        # (n_seq,) slice guarded n_seq != 1, and a program refused a Dim that allowed a single sequence.
        sequence = torch.searchsorted(cu, token, right=True) - 1
        pos = (token - cu[sequence] + (offsets[sequence] if offsets is not None else 0) + offset)[None]
        return pos if like is None else replicated_like(pos, like)
    if like is not None:
        positions, offsets = (None if t is None else replicated_like(t, like) for t in (positions, offsets))
    if positions is None and offsets is not None and seq == 1:
        # A decode step's rows are its per-sequence offsets: a view of them, not an arange and a sum (measured: a
        # CPU decode call of q and k with a (b,) offset took 55 us, not 69).
        return offsets[:, None] + offset if offset else offsets[:, None]
    if positions is None:
        pos = _arange(seq, device, like)[None]
    else:  # (s,) or (b, s); not reshape(-1, s), which cannot infer -1 when s = 0
        pos = positions.to(torch.long)
        pos = pos[None] if pos.dim() == 1 else pos
    if offsets is not None:
        pos = pos + offsets[:, None]
    return pos + offset if offset else pos


def _arange(seq: int, device: torch.device, like: torch.Tensor | None) -> torch.Tensor:
    """0..seq-1 (int64), replicated on like's mesh where like is a DTensor."""
    token = torch.arange(seq, device=device)
    return token if like is None else replicated_like(token, like)


def canonical(x: torch.Tensor, kind: Kind) -> torch.Tensor:
    """The (n0, n1, n2, d) view of x whose rows are (batch, head, token); no copy.

    broadcast: x of 1 to 4 dims, padded with leading 1s; bhsd: x itself; bshd: heads and tokens swapped;
    varlen: (total, h, d) seen as (1, h, total, d).
    """
    if kind == "bshd":
        return x.transpose(1, 2)
    if kind == "varlen":
        return x.transpose(0, 1)[None]
    if kind == "broadcast":
        return x.reshape((1,) * (4 - x.dim()) + tuple(x.shape)) if x.dim() < 4 else x
    return x


def canonical_cos(cos: torch.Tensor, x: torch.Tensor, kind: Kind) -> torch.Tensor:
    """cos as a (n0 or 1, n1 or 1, rows, r/2) view read at (i0, i1, row); no copy.

    broadcast: cos expanded to x's rows (row = token index); table: the (n, r/2) table (row = position).
    """
    if kind == "broadcast":
        return canonical(cos.expand(*x.shape[:-1], cos.shape[-1]), kind)
    return cos.expand(1, 1, *cos.shape)
