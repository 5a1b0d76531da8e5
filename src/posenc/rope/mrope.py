"""Multimodal RoPE (M-RoPE, Qwen2-VL): three position ids per token (temporal, height, width).

The r/2 frequency pairs are shared among the axes by ``mrope_section`` (e.g. [16, 24, 24] for r = 128): in
contiguous sections, section i's pairs turning by the position id of axis i % 3 (Qwen2-VL, Qwen2.5-VL, GLM-4V), or
cycled t, h, w over the pairs (``mrope_layout="interleaved"``: Qwen3-VL, Qwen3.5), or h and w alternating before t
(``"alternating"``: ERNIE-4.5-VL). Text tokens carry the same id on all three axes, which makes M-RoPE equal to
plain RoPE for them. Numerically identical to ``transformers``' rotary embeddings and ``apply_rotary_pos_emb`` of
those models (``mrope_section`` there counts pairs, too; 4.x's ``apply_multimodal_rotary_pos_emb`` doubled it to
count channels of the duplicated cos/sin).

Shape key: a axes (3), b batch, h heads, s sequence, d head dim, r rotary dim.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Literal, get_args

import torch

from posenc._checks import (
    assert_without_sync,
    compiling,
    fake_mode_active,
    float_dtype,
    float_tensor,
    host_list,
    host_min_max,
    int64_int,
    int_fix,
    int_tensor,
    integer,
    integer_offset,
    is_dtensor,
    movable,
    refuse_jit_trace,
    replicated_like,
    replicated_values,
    sequence_length,
    size_in,
    to_device,
    values_readable,
)
from posenc.kernels.replay import plain_eager
from posenc.rope.frequencies import is_seq_len_dependent
from posenc.rope.module import _SEQ_AXES, Layout, RoPE, _keepable

AXES = 3


# How the axes share the pairs; see mrope_axis_of_pair.
MRopeLayout = Literal["sections", "interleaved", "alternating"]
MROPE_LAYOUTS: tuple[str, ...] = get_args(MRopeLayout)
_ORDER = {"sections": "t, h, w", "interleaved": "t, h, w", "alternating": "h, w, t"}


def check_mrope_layout(layout: Any) -> MRopeLayout:
    if layout not in MROPE_LAYOUTS:
        raise ValueError(f"mrope_layout must be one of {', '.join(map(repr, MROPE_LAYOUTS))}, got {layout!r}")
    return layout


def check_mrope_section(
    mrope_section: Sequence[int], rotary_dim: int, *, layout: MRopeLayout = "sections"
) -> tuple[int, ...]:
    """Validate the sections for the layout, accepting what transformers' rotary embeddings lay out and refusing
    what they crash on. Returns them as a tuple.

    Sections are ints >= 0 (a 0 section turns no pair by its axis, as a zero-width split does in transformers).
    'sections' and 'alternating' need them to sum to r/2 (transformers' split by them fails otherwise);
    'alternating' also needs equal h and w sections (it stacks them) and a t section (it slices ``[:-t]``).
    'interleaved' takes any three: the t, h, w cycle gives h and w at most their sections and t every other pair,
    whatever the sum (Qwen3-VL's ``recomposition_frequencies``; ``[16, 24, 24]`` at r = 128 turns 22, 21, 21)."""
    if isinstance(mrope_section, (str, bytes)) or not isinstance(mrope_section, Sequence) or not mrope_section:
        raise TypeError(f"mrope_section must be a list of non-negative ints, e.g. [16, 24, 24], got {mrope_section!r}")
    sections = tuple(_non_negative_int(f"mrope_section[{i}]", n) for i, n in enumerate(mrope_section))
    if layout != "sections" and len(sections) != AXES:
        # transformers reads the first three and silently drops the rest: an axis the config asked for
        raise ValueError(f"{layout} M-RoPE takes 3 sections ({_ORDER[layout]}), got mrope_section {list(sections)}")
    if layout == "interleaved":
        return sections
    if sum(sections) != rotary_dim // 2:
        raise ValueError(
            f"mrope_section {list(sections)} must sum to rotary_dim / 2 = {rotary_dim // 2} (it counts frequency "
            f"pairs), but sums to {sum(sections)}"
        )
    if layout == "alternating" and (sections[0] != sections[1] or not sections[2]):
        raise ValueError(
            "alternating M-RoPE alternates h and w over the first h + w pairs (so h and w need equal sections) and "
            f"gives t the rest (at least one pair), as ERNIE-4.5-VL's [22, 22, 20] of 64 pairs; mrope_section "
            f"{list(sections)} (h, w, t) does not"
        )
    return sections


def _non_negative_int(name: str, value: Any) -> int:
    return integer(name, value, low=0, expected="an integer >= 0 (a count of frequency pairs)")


def mrope_axis_of_pair(
    mrope_section: Sequence[int], *, layout: MRopeLayout = "sections", pairs: int | None = None
) -> torch.Tensor:
    """(r/2,) int64: which position axis (0 temporal, 1 height, 2 width) turns each pair. Every pair keeps its own
    frequency; only the position it turns by changes. pairs: r/2, by default sum(mrope_section) (which an
    'interleaved' section list need not match; the other layouts' must, or it is a ValueError).

    'sections' (Qwen2-VL, GLM-4V): section i's pairs, in a run, read axis i % 3.
    'interleaved' (Qwen3-VL, Qwen3.5; ``mrope_interleaved`` in their configs): pair j reads h where j % 3 == 1 and
    j < 3 * sections[1], w where j % 3 == 2 and j < 3 * sections[2], t elsewhere, so that every axis turns at high
    and low frequencies alike (sections[0] is not read: t takes what h and w leave, as in transformers and vLLM).
    'alternating' (ERNIE-4.5-VL; sections in the order h, w, t): the first h + w pairs alternate h, w; the last
    sections[2] pairs read t."""
    # Built from Python ints: traced by torch.compile, a repeat_interleave by section sizes (or a boolean index)
    # has a data-dependent shape, which broke the graph on every call of a sections / alternating M-RoPE (a patched
    # Qwen2-VL's or ERNIE-4.5-VL's forward, whose unpatched model compiles whole); a list is a constant of the graph.
    layout = check_mrope_layout(layout)
    sections = [_non_negative_int(f"mrope_section[{i}]", n) for i, n in enumerate(mrope_section)]
    pairs = sum(sections) if pairs is None else pairs
    if layout != "interleaved" and pairs != sum(sections):
        # Their sections count every pair; laid out over another number they would give an axis pairs (or take
        # them from it) that the sections do not say, with no error (mrope_cos_sin with another inv_freq).
        raise ValueError(
            f"{layout} mrope_section {sections} lays out {sum(sections)} pairs, but there are {pairs} (rotary_dim / "
            "2); only 'interleaved' sections may sum to another number"
        )
    # An unknown layout read as 'alternating', or 2 sections read past their end, gave axes with no error.
    check_mrope_section(sections, 2 * pairs, layout=layout)
    if layout == "sections":
        axes = [i % AXES for i, count in enumerate(sections) for _ in range(count)]
    elif layout == "interleaved":
        axes = [j % AXES if j % AXES and j < AXES * sections[j % AXES] else 0 for j in range(pairs)]
    else:
        axes = [1 + j % 2 if j < sections[0] + sections[1] else 0 for j in range(pairs)]
    return torch.tensor(axes, dtype=torch.long, device="cpu")


def mrope_cos_sin(
    positions: torch.Tensor,
    inv_freq: torch.Tensor,
    mrope_section: Sequence[int],
    attention_factor: float = 1.0,
    dtype: torch.dtype = torch.float32,
    *,
    layout: MRopeLayout = "sections",
) -> tuple[torch.Tensor, torch.Tensor]:
    """positions: (3, b, s) or (3, s) integer, >= 0 (temporal, height, width: transformers 5's (4, b, s) ids without
    their first, text row; vLLM's (3, n)); inv_freq: (r/2,) float64. Returns cos, sin: (b, s, r/2) (or (s, r/2)) in
    ``dtype``. Negative ids are refused where that costs no device sync (CPU ids), as the Hugging Face path this
    serves on every forward reads no values on a GPU.

    Angles are taken in float64, as in ``angles_to_cos_sin``; each pair reads its own axis' positions.
    """
    int_tensor("positions", positions)
    if positions.dim() not in (2, 3) or positions.shape[0] != AXES:
        # Unchecked, (4, b, s) ids were read as t, h, w from their first three rows (wrong angles, no error), and
        # text ids (n, 1) came back as cos (1, r/2) that failed later in a broadcast.
        raise ValueError(
            f"positions must be (3, b, s) or (3, s) (temporal, height, width ids), got shape "
            f"{tuple(positions.shape)}; from transformers' (4, b, s) ids pass positions[1:], and text ids (b, s) as "
            "ids.expand(3, b, s)"
        )
    float_tensor("inv_freq", inv_freq)
    if inv_freq.dim() != 1:
        raise ValueError(f"inv_freq must be (r/2,), one frequency per pair, got shape {tuple(inv_freq.shape)}")
    # Plain CPU ids only, outside torch.func's transforms (a vmapped tensor has no values to read).
    if positions.numel() and (type(positions) is torch.Tensor or is_dtensor(positions)) and positions.is_cpu:
        negative = "positions must be >= 0 (token positions), got a negative entry"
        if values_readable(positions.device):
            if not torch._C._are_functorch_transforms_active() and host_min_max(positions)[0] < 0:
                raise ValueError(negative)
        else:
            assert_without_sync(positions >= 0, negative)
    axis = mrope_axis_of_pair(mrope_section, layout=layout, pairs=inv_freq.numel())
    return _cos_sin_by_axis(positions, inv_freq, axis, attention_factor, dtype)


def _cos_sin_by_axis(
    positions: torch.Tensor, inv_freq: torch.Tensor, axis: torch.Tensor, attention_factor: float, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """``mrope_cos_sin`` with pair j turning by the positions of axis[j]; axis: (r/2,) int64 (``mrope_axis_of_pair``)
    on any device."""
    # DTensor ids (heads or batch sharded activations, the ids replicated or sharded): the module's plain axis and
    # frequencies taken onto their mesh, whole ("got mixed torch.Tensor and DTensor" inside index_select).
    axis = replicated_like(axis.to(positions.device), positions)
    pos = positions.to(torch.float64).index_select(0, axis)  # (r/2, b, s): pair j's positions
    angles = pos.movedim(0, -1) * replicated_like(inv_freq.to(device=positions.device, dtype=torch.float64), positions)
    cos, sin = angles.cos(), angles.sin()
    if attention_factor != 1.0:
        cos, sin = cos * attention_factor, sin * attention_factor
    return cos.to(dtype), sin.to(dtype)


def _text_only(q: object, positions: torch.Tensor, offset: object, layout: object) -> bool:
    """Whether (3, b, s) ``positions`` that fit q are text ids, the same on all three axes, asked only where reading
    them costs no device sync and nothing traces the call: plain CPU ids in plain eager, and an int offset of 0 (the
    rope deltas of a prompt with images go to every axis through forward's own path). Ids that do not fit q, and
    negative ids, take that path too, for its message; ids of a dtype RoPE refuses get the same error on either
    path."""
    # plain_eager first: Dynamo reads it as False and traces no shape comparison after it (each would guard a graph).
    if not plain_eager() or type(offset) is not int or offset != 0 or type(layout) is not str:
        return False
    if type(positions) is not torch.Tensor or not positions.is_cpu or positions.is_complex():  # no order, no min
        return False
    if not isinstance(q, torch.Tensor) or q.dim() != 4 or layout not in _SEQ_AXES or positions.shape[0] != AXES:
        return False
    if positions.shape[2] != q.shape[_SEQ_AXES[layout]] or positions.shape[1] not in (1, q.shape[0]):
        return False
    if positions.numel() <= 3 * 64:
        # A decode step's few ids compared as Python ints: ~0.6 us, where torch.equal takes ~2 us a pair of axes
        # (measured before the >= 0 test over the same ints was added, not since).
        t, h, w = positions.tolist()
        return t == h == w and all(i >= 0 for row in t for i in row)
    # Axis 1 against axis 0, axis 2 against axis 1.
    return torch.equal(positions[1:], positions[:-1]) and bool(positions[0].min() >= 0)


class MRoPE(RoPE):
    """RoPE with three position axes (temporal, height, width), as vision-language models use them. Accepts every
    ``RoPE`` option (scaling types, ``interleaved`` pairs as in GLM-4V, partial rotation).

    mrope_section: pairs per axis (ints >= 0), summing to rotary_dim / 2 but where interleaved (Qwen2-VL:
    [16, 24, 24]; Qwen3-VL: [24, 20, 20]).
    mrope_layout: how the axes share the pairs: 'sections', contiguous (Qwen2-VL, Qwen2.5-VL, GLM-4V);
    'interleaved', cycled t, h, w (Qwen3-VL, Qwen3.5; their configs' ``mrope_interleaved``), where h's and w's
    sections only cap their axes and t takes every other pair, so any three sections are taken, of any sum, as
    transformers takes them ([16, 24, 24] at r = 128 turns 22, 21, 21 pairs); 'alternating', h and w alternating,
    then t (ERNIE-4.5-VL, whose sections are in the order h, w, t; h and w equal). See ``mrope_axis_of_pair``.
    ``forward`` and ``cos_sin`` take positions of shape (3, b, s); (s,) or (b, s) ids (text only, the same id on
    every axis) behave like plain RoPE.
    """

    def __init__(
        self,
        head_dim: int,
        *,
        mrope_section: Sequence[int],
        mrope_layout: MRopeLayout = "sections",
        rope_parameters: Mapping[str, Any] | None = None,
        **options: Any,
    ) -> None:
        super().__init__(head_dim, rope_parameters=rope_parameters, **options)
        self.mrope_layout = check_mrope_layout(mrope_layout)
        self.mrope_section = check_mrope_section(mrope_section, self.rotary_dim, layout=mrope_layout)

    def cos_sin(
        self, positions: torch.Tensor, *, seq_len: int | None = None, dtype: torch.dtype = torch.float32
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """positions: (3, b, s) integer ids, or text ids of at most 2 dims (then as ``RoPE.cos_sin``). Returns cos,
        sin: (b, s, r/2) in ``dtype``. seq_len: as for ``RoPE.cos_sin``."""
        refuse_jit_trace("MRoPE.cos_sin")
        int_tensor("positions", positions, host_read=True)
        if positions.dim() < 3:
            return super().cos_sin(positions, seq_len=seq_len, dtype=dtype)
        float_dtype("dtype", dtype)
        sequence_length("seq_len", seq_len)
        if positions.dim() != 3 or positions.shape[0] != AXES:
            raise ValueError(
                f"positions must be (3, b, s) (temporal, height, width ids) or text ids (s,) / (b, s), got shape "
                f"{tuple(positions.shape)}"
            )
        length_dependent = is_seq_len_dependent(self.spec.rope_type)
        if positions.numel():  # checks them (>= 0), and gives the default length where values can be read
            extent = self._positions_extent(positions, seq_len)
            seq_len = extent if seq_len is None else seq_len
        inv_freq, factor = self.frequencies(seq_len if length_dependent else None)
        return _cos_sin_by_axis(positions, inv_freq, self._axis_of_pair(inv_freq.numel()), factor, dtype)

    def _axis_of_pair(self, pairs: int) -> torch.Tensor:
        """``mrope_axis_of_pair`` of this module's sections and layout, checked there, and kept for the next calls
        while both are the same objects: building the (r/2,) tensor from a list (~11 us) and checking the sections
        again (~4 us) took a tenth of a decode step's host time. Built anew while traced (a constant of the graph,
        from Python ints) and under a FakeTensorMode; not kept where RoPE's tables are not (``_keepable``)."""
        sections, layout = self.mrope_section, self.mrope_layout
        if compiling():
            return mrope_axis_of_pair(sections, layout=layout, pairs=pairs)
        kept = getattr(self, "_axes_kept", None)
        # `is`: a tuple of ints cannot change, while an equal value of another type (16.0) would skip its check. A
        # FakeTensorMode refuses real tensors (RoPE's _kept).
        same = kept is not None and kept[0] is sections and kept[1] == layout and kept[2] == pairs
        if same and not fake_mode_active():
            return kept[3]
        axis = mrope_axis_of_pair(sections, layout=layout, pairs=pairs)
        plain = type(sections) is tuple and all(type(n) is int for n in sections) and type(layout) is str
        if plain and _keepable():
            self._axes_kept = (sections, layout, pairs, axis)
        return axis

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        *,
        positions: torch.Tensor | None = None,
        offset: int | torch.Tensor = 0,
        layout: Layout = "bhsd",
        seq_len: int | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """q: (b, h_q, s, d), k: (b, h_k, s, d) for "bhsd" ((b, s, h, d) for "bshd"); positions: (3, b, s) or
        (3, 1, s) integer ids, or anything ``RoPE.forward`` takes; offset: an int (or a 0-d integer tensor) added to
        every axis (when
        decoding text after a prompt with images: the largest id of the prompt + 1, which is the cache length plus
        the model's rope delta, not the cache length; a (b,) tensor only with text ids); seq_len: as for
        ``RoPE.forward``. Returns new (q, k) with the input dtypes.

        A (3, s) tensor is read as text ids of a batch of 3, as ``RoPE`` reads it; three axes are (3, b, s). Three
        axes that hold the same ids (text tokens) rotate as those text ids do, and on the CPU (ids readable without
        a sync) they are taken as such, through RoPE's table and replayed calls: the same bits, ~4x less host time
        a decode step."""
        refuse_jit_trace("MRoPE")
        ambiguous = isinstance(positions, torch.Tensor) and positions.dim() == 2 and positions.shape[0] == AXES
        if ambiguous and isinstance(q, torch.Tensor) and q.dim() == 4 and q.shape[0] != AXES:
            raise ValueError(
                f"positions of shape {tuple(positions.shape)} are neither text ids (s,) or (b, s) for a batch of "
                f"{q.shape[0]} nor three axes (3, b, s); for three axes of one sequence pass positions[:, None]"
            )
        if not isinstance(positions, torch.Tensor) or positions.dim() != 3:
            return super().forward(q, k, positions=positions, offset=offset, layout=layout, seq_len=seq_len)
        if _text_only(q, positions, offset, layout):
            # Text tokens (every generated one, at every decode step) carry one id on all three axes, which turns
            # every pair by it: RoPE's rotation by those ids, bit for bit, through its table and its replayed calls.
            # A CPU decode step took 77-86 us with the three axes' cos/sin built per call.
            return super().forward(q, k, positions=positions[0], layout=layout, seq_len=seq_len)
        seq_axis = self._check_qk(q, k, layout, seq_len)
        offset = integer_offset(offset)
        int_tensor("positions", positions, host_read=True)
        kept = None  # a 0-d offset whose value cannot be read here: added on the device, checked with the graph
        if isinstance(offset, torch.Tensor) and offset.dim() == 0:
            # One offset as a 0-d tensor, as RoPE takes it (it was refused: "must be an int, got Tensor"). Read where
            # it is, as RoPE reads tensor offsets; traced, captured or on the meta device, added as a tensor.
            int_tensor("offset", offset, host_read=True)
            offset = replicated_values(offset)
            movable("offset", offset, q.device)
            if values_readable(offset.device):
                offset = int(host_list(offset))
            else:
                kept, offset = offset.to(device=q.device, dtype=torch.long), 0
                assert_without_sync(kept >= 0, "offset must be >= 0 (it counts tokens already in the cache)")
        if isinstance(offset, bool) or not isinstance(offset, int):
            got = (
                f"{type(offset).__name__} of shape {tuple(offset.shape)}; add per-row offsets to the positions "
                "themselves"
                if isinstance(offset, torch.Tensor)
                else f"{type(offset).__name__} {offset!r}{int_fix(offset)}"
            )
            raise TypeError(f"offset must be an int or a 0-d integer tensor with (3, b, s) positions, got {got}")
        if offset < 0:
            raise ValueError(f"offset must be >= 0 (it counts tokens already in the cache), got {offset}")
        int64_int("offset", offset)
        if (
            positions.shape[0] != AXES
            or positions.shape[2] != q.shape[seq_axis]
            or not size_in(positions.shape[1], (1, q.shape[0]))
        ):
            raise ValueError(
                f"positions must have shape (3, b, s) = (3, {q.shape[0]}, {q.shape[seq_axis]}) (temporal, height, "
                f"width ids), got {tuple(positions.shape)}"
            )
        if offset and values_readable(positions.device) and positions.numel():
            # ids + offset past 2**63 - 1 wrap negative, which the rotation's check read as a negative id. Read only
            # where an offset is added to given ids (rare beside 3-axis ids; not compiled, not a capture).
            high = host_min_max(positions)[1]
            if high > 2**63 - 1 - offset:
                raise ValueError(
                    f"offset + position ids must fit in int64 (below 2**63, a token position): offset={offset} "
                    f"with ids up to {high} sums past 2**63 - 1; lower offset"
                )
        pos = to_device("positions", positions, q.device).to(torch.long) + offset
        if kept is not None:
            pos = pos + kept
        dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
        # Computed here, as RoPE.forward does, not in _rotate_at: one frame less for torch.compile (see there).
        if seq_len is None:
            cos, sin = self.call_cos_sin(pos, dtype=dtype)  # (b or 1, s, r/2); advances 'hf' dynamic's state
        else:
            cos, sin = self.cos_sin(pos, seq_len=seq_len, dtype=dtype)
        return self._rotate_at(q, k, cos, sin, layout)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, mrope_section={list(self.mrope_section)}, mrope_layout={self.mrope_layout!r}"
