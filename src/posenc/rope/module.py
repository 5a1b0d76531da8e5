"""``RoPE``: a thin holder of a validated config and a lazily grown cos/sin table.

Share one instance across all layers of a model: the table is built once per (device, dtype) and grows on demand,
to the next power of two past the largest position seen (there is no fixed maximum). Angles are computed in float64
and stored as float32 (float64 for float64 inputs), so a bf16 model at position 2**20 rotates as exactly as at
position 20.
"""

from __future__ import annotations

import contextlib
import functools
import operator
import threading
import weakref
from collections.abc import Mapping
from typing import Any, Literal

import torch
from torch import nn

from posenc import _compile_marks as compile_marks
from posenc._checks import (
    INDEX_DTYPES,
    assert_without_sync,
    compiling,
    fake_mode_active,
    flag,
    float_dtype,
    float_tensor,
    host_list,
    host_min_max,
    index_values,
    int_tensor,
    integer_offset,
    is_dtensor,
    laid_out_as,
    recording,
    refuse_jit_trace,
    replicated_values,
    same_device,
    sequence_length,
    size_in,
    to_device,
    values_readable,
)
from posenc.encoding import ActsOn
from posenc.kernels.backend import BACKENDS, transformed
from posenc.kernels.recording import recording_launches
from posenc.kernels.replay import Plans, plain_eager, plan_of, replay, rows_read, tensor_key
from posenc.positions import ids_fit, resolve_positions
from posenc.rope.apply import Backend, apply_rotary, apply_rotary_qk, rotate_tensors
from posenc.rope.frequencies import dynamic as dynamic_frequencies
from posenc.rope.frequencies import is_seq_len_dependent
from posenc.rope.parameters import RopeSpec, compute_frequencies, parse_rope_parameters

Layout = Literal["bhsd", "bshd"]

# Beyond this many positions the table would cost more than computing angles for the positions asked for.
_TABLE_LIMIT = 1 << 16
# Beyond the table, a RoPE keeps windows of this many rows (2 MiB at r = 128, float32), each starting at a multiple
# of half of it, around the positions asked for: decode steps far out read it as they read the table, where
# computing their angles per call took 2.7x the time (119 against 44 us of CPU time for a one-token bf16 call, 32/8
# heads) and, on CUDA, a device sync per call for the positions' extent.
_WINDOW = 1 << 12
# Windows kept per device and dtype, the latest used: several requests far out sharing a RoPE (threads of a server)
# each keep theirs, where one kept window was rebuilt on every call of two alternating streams (4.0 ms a call).
_WINDOWS_KEPT = 8
# Lengths whose frequencies a RoPE keeps (see RoPE.frequencies).
_FREQUENCIES_KEPT = 8


def angles_to_cos_sin(
    positions: torch.Tensor,
    inv_freq: torch.Tensor,
    attention_factor: float = 1.0,
    dtype: torch.dtype = torch.float32,
) -> tuple[torch.Tensor, torch.Tensor]:
    """positions: (...) integer; inv_freq: (r/2,) float64. Returns cos, sin: (..., r/2) in ``dtype``.

    The product is taken in float64: in float32, position 1e6 times a frequency near 1 is off by ~0.06 rad.
    """
    inv_freq = inv_freq.to(device=positions.device, dtype=torch.float64)
    if (
        compiling()
        and not torch.compiler.is_exporting()
        and not transformed(positions, inv_freq)
        and not (inv_freq.requires_grad and torch.is_grad_enabled())
    ):
        # Opaque to Inductor, so cos/sin are computed once, (..., r/2), and read by the rotation. Traced in the open,
        # Inductor inlined them into the rotation of the torch path: two float64 sines per element of every head.
        # Measured on the CPU (q (1, 8, 2048, 128), k (1, 2, 2048, 128), float32, one thread): a compiled RoPE
        # forward took 6.6x the time of a compiled rotation by a ready table, and 2x on the fused CPU path.
        return _angles_cos_sin(positions, inv_freq, float(attention_factor), dtype)
    return _angles_cos_sin_impl(positions, inv_freq, float(attention_factor), dtype)


def _angles_cos_sin_impl(
    positions: torch.Tensor, inv_freq: torch.Tensor, attention_factor: float, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    angles = positions.to(torch.float64)[..., None] * inv_freq
    cos, sin = angles.cos(), angles.sin()
    if attention_factor != 1.0:
        cos, sin = cos * attention_factor, sin * attention_factor
    return cos.to(dtype), sin.to(dtype)


_angles_cos_sin = torch.library.custom_op("posenc::angles_cos_sin", mutates_args=())(_angles_cos_sin_impl)


def _dynamic_inv_freq_impl(
    positions: torch.Tensor, rotary_dim: int, base: float, factor: float, max_position_embeddings: int
) -> torch.Tensor:
    """Dynamic NTK's inv_freq (r/2,) float64 on positions' device for max(positions) + 1, read on the host: the
    values ``RoPE.frequencies(seq_len)`` gives (the same function of the same numbers)."""
    seq_len = int(positions.max()) + 1
    inv_freq = _dynamic_frequencies(rotary_dim, base, factor, max_position_embeddings, max(seq_len, 1))
    return inv_freq.to(positions.device, copy=True)  # a copy: an op's output must not be the cached tensor


@functools.lru_cache(maxsize=_FREQUENCIES_KEPT)
def _dynamic_frequencies(
    rotary_dim: int, base: float, factor: float, max_position_embeddings: int, seq_len: int
) -> torch.Tensor:
    # Every layer of a step asks for the same length: computed once (37-150 us on the host), as RoPE.frequencies.
    inv_freq, _ = dynamic_frequencies(
        rotary_dim=rotary_dim,
        base=base,
        factor=factor,
        max_position_embeddings=max_position_embeddings,
        seq_len=seq_len,
    )
    return inv_freq


# An op, opaque to the graph, so that the length is read on the host without a graph break: a 'consistent' patched
# model reads it in every attention layer, and a break there made torch.compile trace each layer's attention as a
# frame of its own, recompiled per layer (its layer_idx and cache layer are guarded on): 3 x num_hidden_layers
# compiles, past torch._dynamo.config.recompile_limit (8) from 3 layers on. It syncs with the device, so a CUDA
# graph is not to capture it.
_dynamic_inv_freq = torch.library.custom_op(
    "posenc::dynamic_inv_freq",
    mutates_args=(),
    tags=(torch.Tag.cudagraph_unsafe,) if hasattr(torch.Tag, "cudagraph_unsafe") else (),
)(_dynamic_inv_freq_impl)


@_dynamic_inv_freq.register_fake
def _(
    positions: torch.Tensor, rotary_dim: int, base: float, factor: float, max_position_embeddings: int
) -> torch.Tensor:
    return positions.new_empty((rotary_dim // 2,), dtype=torch.float64)


@_angles_cos_sin.register_fake
def _(
    positions: torch.Tensor, inv_freq: torch.Tensor, attention_factor: float, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    shape = (*positions.shape, inv_freq.shape[0])
    return positions.new_empty(shape, dtype=dtype), positions.new_empty(shape, dtype=dtype)


def _keepable() -> bool:
    """Whether a table or window made now may be kept for later calls. Not inside a torch.func transform (grad,
    jacrev, vjp, jvp: per-sample gradients, say): there even a fresh tensor is the transform's wrapper, which has no
    storage once it returns, and the next eager call's fused kernel failed on it ("Cannot access data pointer of
    Tensor that doesn't have storage"); one kept from an eager call serves the transforms as a constant. Not while a
    CUDA graph is captured: its memory is written only when the graph replays, so an eager call before that would
    read uninitialised rows. Not under a FakeTensorMode: its tensors have no values, and a real call after it read
    the fake table (a segmentation fault in the fused CPU kernel); nor are kept ones read there (``_kept``)."""
    return not (transformed() or fake_mode_active() or _capturing())


def _length_traced(seq_len: int | None) -> bool:
    """Whether no length may be compared on the host: torch.compile or torch.export traces, or ``seq_len`` is
    make_fx's symbolic length (a torch.SymInt outside Dynamo, whose own symbolic ints fold to ints in the type test).
    Read on the host, a symbolic length's side of a switch was baked into the graph, which then gave the example's
    frequencies at every length, silently."""
    return compiling() or type(seq_len) is torch.SymInt


def _capturing() -> bool:
    """Whether a CUDA graph is being captured on the current stream. None is before CUDA is initialized: asked
    first, that costs ~50 ns where torch.cuda.is_available() costs ~0.6 us, and does not initialize CUDA."""
    return torch.cuda.is_initialized() and torch.cuda.is_current_stream_capturing()


def _kept(cache: dict) -> dict:
    """``cache`` (a RoPE's tables, windows or frequencies), or an empty dict under a FakeTensorMode, which refuses
    real tensors in its computations ("Please convert all Tensors to FakeTensors first"): there they are made anew,
    fake, and not kept (``_keepable``)."""
    return {} if fake_mode_active() else cache


def _stays_on(fn: Any, device: torch.device) -> bool:
    """Whether ``fn`` (what nn.Module._apply maps each tensor by) leaves a tensor of ``device`` there."""
    try:
        return fn(torch.empty(0, device=device)).device == device
    except Exception:  # an fn that takes no empty tensor: the tables go, they are rebuilt on use
        return False


def _position_bounds(
    seq: int, batch: int, positions: torch.Tensor | None, offset: int | torch.Tensor
) -> tuple[int, int] | None:
    """(low, high): every position a forward call reads lies in low..high (with per-sequence offsets the bounds
    need not be reached), read with one device sync at most; None when the arguments take the general path
    (where ``resolve_positions`` checks them and raises)."""
    if positions is not None:
        int_tensor("positions", positions, host_read=True)  # before reading its dtype: a list, or a tensor vmap batches
    if isinstance(offset, torch.Tensor):
        int_tensor("offset", offset, host_read=True)
    low = high = 0
    reductions = []  # (min, max) pairs of the offset and position tensors
    if isinstance(offset, torch.Tensor):
        if offset.dim() > 1 or not size_in(offset.numel(), (1, batch)):
            return None
        if offset.dtype not in INDEX_DTYPES:
            return None
        if offset.numel():
            reductions.append(offset)
    elif type(offset) is int and offset >= 0:
        low = high = offset
    else:
        return None
    if positions is None:
        high += seq - 1
    elif positions.dtype not in INDEX_DTYPES or positions.numel() == 0:
        return None
    else:
        reductions.append(positions)
    if reductions and not values_readable(reductions[0].device):
        return None  # traced or captured: no value may be read (RoPE.forward has a path for each that reads none)
    if reductions:
        values = host_list(torch.stack([m.to(torch.long) for t in reductions for m in torch.aminmax(t)]))
        if isinstance(offset, torch.Tensor) and offset.numel() and values[0] < 0:
            return None  # a negative offset: resolve_positions refuses it, as it does without position ids
        low += sum(values[0::2])
        high += sum(values[1::2])
    return low, high


def _table_key(device: torch.device, dtype: torch.dtype, length: int | None) -> tuple:
    """A table's key in ``RoPE._tables``: (device, dtype), and the frequencies' length where they are scaled for one
    (``RoPE._frequency_length``: LongRoPE past its original length)."""
    return (device, dtype) if length is None else (device, dtype, length)


def _window_key(device: torch.device, dtype: torch.dtype, length: int | None, first: int, count: int | None) -> tuple:
    """A window's key in ``RoPE._windows``: its table's key, its first row's position, and its row count where it is
    not _WINDOW (``RoPE._window``)."""
    return (*_table_key(device, dtype, length), first) + (() if count is None else (count,))


def _exact(window_key: tuple) -> bool:
    """Whether a ``_window_key`` is of a window of exactly a call's rows (one with a count: a length's, scaled)."""
    return len(window_key) == 5


def _key_length(key: tuple) -> int | None:
    """The length a LongRoPE or dynamic NTK replay key (``_far``'s) was made for: its last item, or the one before
    "far"."""
    return key[-2] if key[-1] == "far" else key[-1]


def _far(key: tuple | None, first: int | None) -> tuple | None:
    """A replay key (``RoPE._replay_key``'s) for a call read from int offset ``first``: past the table, a window's
    plan, kept apart from the table's, so that requests far out and near that share a RoPE do not replace each
    other's plan at every turn."""
    return (*key, "far") if key is not None and first is not None and first >= _TABLE_LIMIT else key


_SEQ_AXES = {"bhsd": 2, "bshd": 1}
_LENGTH_TABLED = ("longrope", "dynamic")  # the length-dependent types that _tabled reads from tables


def _tabled(rope_type: str) -> bool:
    """Whether forward reads this type's cos/sin from kept tables: every type whose frequencies do not depend on the
    length; LongRoPE, whose two sets (its short and long factors, either side of its original length) each get
    their table; and dynamic NTK up to max_position_embeddings, where it is plain RoPE (past it every length has
    frequencies of its own: computed per call). Registered length-dependent types are computed per call."""
    return rope_type in _LENGTH_TABLED or not is_seq_len_dependent(rope_type)


def _length_unreadable(rope_type: str) -> ValueError:
    return ValueError(
        f"rope_type {rope_type!r} scales for max(positions) + 1 by default, which cannot be read inside torch.compile,"
        " make_fx's trace, a CUDA graph capture or on the meta device; pass seq_len= (the length to scale for, e.g. "
        "the tokens in the cache plus the new ones) to RoPE's forward or cos_sin, or, where the caller cannot "
        "(CausalSelfAttention, a transformers model patched in mode='hf'), compile without fullgraph=True: the length"
        " is then read in a graph break (RoPE's forward in mode='consistent' reads it in the graph). torch.export has"
        " no graph breaks: there pass seq_len=positions.shape[-1] (or the cached + new length), with the length's Dim"
        " on one side of max_position_embeddings (a program for each). make_fx and"
        " functorch's aot_function have none either: trace a caller that cannot pass seq_len= with torch.compile, or"
        " use a type that does not read the length (linear, yarn, llama3)"
    )


# Serialises the changes to 'hf' dynamic NTK's state (RoPE.scaling_length) across threads. One for the module, not
# one per RoPE, so that a RoPE still pickles and deep-copies; it is taken only by a call that grows or resets a
# state, never by a decode step that keeps it. Reentrant, so that a subclass's __setattr__ may call back in.
_HF_DYNAMIC_LOCK = threading.RLock()


# Every RoPE alive (MRoPE too), for register_scaling(replace=True): a RoPE's tables, windows and frequencies hold the
# numbers of the function registered when it made them, and one built before a replacement went on serving them
# beside the new function's (at lengths it had not kept), silently. Weak: it keeps no RoPE alive.
_LIVE: weakref.WeakSet[RoPE] = weakref.WeakSet()
_LIVE_LOCK = threading.Lock()  # WeakSet iteration is Python code: a RoPE built in another thread meanwhile broke it


def _track(rope: RoPE) -> None:
    with _LIVE_LOCK:
        _LIVE.add(rope)


def forget_frequencies(rope_type: str) -> None:
    """Drop what every live RoPE of ``rope_type`` keeps (tables, windows, frequencies): made anew by the function
    registered now at its next call. Tables a CUDA graph captured stay held (the graph reads them by address)."""
    with _LIVE_LOCK:
        ropes = list(_LIVE)
    for rope in ropes:
        if rope.spec.rope_type == rope_type:
            # New dicts, not clear(): a call in another thread iterating the old ones is not broken by it.
            rope._tables, rope._windows, rope._frequencies = {}, {}, {}


def _hf_dynamic_state(length: int, seen: int, max_position_embeddings: int) -> int:
    """transformers' ``dynamic_rope_update`` rule: 'hf' dynamic NTK's state (the longest length seen, or
    ``max_position_embeddings`` after a reset) after a call of ``length`` finds it at ``seen``."""
    if length > seen:  # growth: scale for the new longest length
        return length
    if length < max_position_embeddings < seen:  # reset: back to the original frequencies
        return max_position_embeddings
    return seen


# One marked function per length-dependent type, since a mark's reason is fixed: it is what fullgraph=True shows.
@compile_marks.disable(
    reason="rope_type 'dynamic' (dynamic NTK) scales for max(positions) + 1, read on the host; for fullgraph=True "
    "pass seq_len= to RoPE.forward / MRoPE.forward (CausalSelfAttention and patched transformers models cannot: "
    "compile them without fullgraph, or use mode='consistent', which reads the length in the graph)"
)
def _call_cos_sin_eagerly(rope: RoPE, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    return rope.cos_sin(positions, seq_len=rope.scaling_length(positions), dtype=dtype)


@compile_marks.disable(
    reason="rope_type 'longrope' with position ids of more than 2 dims (M-RoPE's (3, b, s) axes) chooses its short "
    "or long factors for max(positions) + 1, read on the host; for fullgraph=True pass seq_len= to MRoPE.forward or "
    "cos_sin (a patched transformers model cannot: compile it without fullgraph)"
)
def _call_longrope_cos_sin_eagerly(
    rope: RoPE, positions: torch.Tensor, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    return rope.cos_sin(positions, seq_len=rope.scaling_length(positions), dtype=dtype)


@compile_marks.disable(
    reason="'consistent' mode's KVCache rotates the cached keys for max(positions) + 1, read on the host; "
    "CausalSelfAttention takes no seq_len=, so compile it without fullgraph=True (the length is then read in this "
    "graph break)"
)
def _scaling_length_eagerly(rope: RoPE, positions: torch.Tensor) -> int | None:
    return rope.scaling_length(positions)


@compile_marks.disable(
    reason="a rope_type registered with seq_len_dependent=True (posenc.rope.register_scaling) is computed by its "
    "function for max(positions) + 1, read on the host; for fullgraph=True pass seq_len= to RoPE.forward or cos_sin "
    "(CausalSelfAttention and patched transformers models cannot: compile them without fullgraph)"
)
def _registered_cos_sin_eagerly(
    rope: RoPE, positions: torch.Tensor, step_positions: torch.Tensor, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    return rope.cos_sin(positions, seq_len=int(step_positions.max()) + 1, dtype=dtype)


class RoPE(nn.Module):
    """Rotary position embedding (Su et al., 2021) for queries and keys.

    head_dim: d; rotary_dim: r <= d, even (default d; the last d - r channels pass through);
    base: theta (default 10000, or ``rope_parameters['rope_theta']``);
    interleaved: adjacent pairs (RoFormer, GPT-J) if True, else split-half (Llama's ``rotate_half``);
    rope_parameters: a Hugging Face-style dict (``rope_type``, ``rope_theta``, ``partial_rotary_factor``, ...);
    max_position_embeddings: the model's trained length, used by the length-dependent scaling types;
    backend: "auto" | "torch" | "triton" | "cpu", passed to ``apply_rotary`` (auto: Triton on CUDA, the fused CPU
    kernel on CPU, else torch);
    mode: how ``dynamic``, ``longrope`` and a type registered with ``seq_len_dependent=True`` (whose frequencies
    change with the sequence length) behave:

    * ``"hf"`` (default): what Hugging Face computes. Each call scales for max(positions) + 1; ``dynamic`` also
      keeps the largest length seen so far and falls back to plain RoPE only when a call is shorter than
      ``max_position_embeddings`` (``transformers``' ``dynamic_rope_update``). With a KV cache, keys keep the
      frequencies they were rotated with, so decoding past the switch differs from a full forward.
    * ``"consistent"``: stateless; every call scales for its own max(positions) + 1, and ``CausalSelfAttention``
      keeps the keys unrotated in the ``KVCache`` and re-rotates them when the frequencies change, so every score of
      a step uses one set of frequencies. For one attention layer, each decoding step then equals a full forward
      of the prefix it completes (not of the whole sequence: that scales every row for the final length); in a
      deeper stack, the cached keys and values of later layers were computed from hidden states of
      earlier steps, which no re-rotation can revisit, so there the guarantee is per score, not end to end.
    """

    acts_on = ActsOn.QK

    def __init__(
        self,
        head_dim: int,
        *,
        rotary_dim: int | None = None,
        base: float | None = None,
        interleaved: bool = False,
        rope_parameters: Mapping[str, Any] | None = None,
        max_position_embeddings: int | None = None,
        mode: Literal["hf", "consistent"] = "hf",
        backend: Backend = "auto",
    ) -> None:
        super().__init__()
        self.spec: RopeSpec = parse_rope_parameters(
            head_dim, rope_parameters, base=base, rotary_dim=rotary_dim, max_position_embeddings=max_position_embeddings
        )
        if mode not in ("hf", "consistent"):
            raise ValueError(f"mode must be 'hf' (Hugging Face's numbers) or 'consistent', got {mode!r}")
        self.mode = mode
        if backend not in BACKENDS:
            raise ValueError(f"backend must be one of {', '.join(repr(b) for b in BACKENDS)}, got {backend!r}")
        self.backend = backend
        self.interleaved = flag("interleaved", interleaved)
        self.max_position_embeddings = max_position_embeddings
        # 'hf' dynamic NTK state: the largest length seen (transformers' max_seq_len_cached).
        self.hf_scaled_len = max_position_embeddings
        # Plain attributes, not buffers: derived from the config, rebuilt per device on first use, so the
        # module is safe to create on the meta device and never goes stale after .to().
        self._tables: dict[tuple[torch.device, torch.dtype], tuple[torch.Tensor, torch.Tensor]] = {}
        # _window_key -> cos, sin past the table, or of a call's rows at dynamic NTK's length past its limit (see
        # _WINDOW, RoPE._window); oldest use first.
        self._windows: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}
        self._frequencies: dict[int | None, tuple[torch.Tensor, float]] = {}
        # Tables a CUDA graph capture has read: the graph reads them by address at every replay, so a later call
        # that grows the table must not free them (the allocator would hand their memory to other tensors).
        self._captured: list[tuple[torch.Tensor, torch.Tensor]] = []
        # Calls replayed (forward): key -> (a weak reference to the table or window read, its key in _tables or
        # _windows, the plan, the window's first row's position or None for a table).
        self._plans = Plans(16)
        _track(self)

    def __getstate__(self) -> dict[str, Any]:
        # The tables and frequencies are derived and rebuilt on demand: a pickle (torch.save(model), a spawned
        # process, deepcopy) of a RoPE that has served 60k positions in two dtypes would carry ~100 MB of them.
        state = self.__dict__.copy()
        state["_tables"], state["_windows"], state["_frequencies"], state["_captured"] = {}, {}, {}, []
        state["_plans"] = None  # a lock: made anew by __setstate__
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        self._plans = Plans(16)  # a RoPE pickled before 2026-12-07 has none
        _track(self)  # an unpickled or deep-copied RoPE follows register_scaling(replace=True) as the original does

    def _apply(self, fn: Any, recurse: bool = True) -> RoPE:  # type: ignore[override]
        # A move (model.cpu(), to_empty) leaves the tables of other devices unused: drop them, so that their memory
        # goes (a 128k-row table is 64 MiB on the GPU); the tables of a device fn leaves tensors on stay (a cast,
        # model.float(): the tables are float32 or float64 whatever the module's dtype). Asked of each device's own
        # tensor: a CPU tensor's answer dropped a GPU's tables at every cast, captured ones too, which a CUDA graph
        # still read by address at each replay.
        captured = self.__dict__.get("_captured", [])
        devices = {key[0] for key in (*self._tables, *self._windows)} | {table[0].device for table in captured}
        staying = {device for device in devices if _stays_on(fn, device)}
        self._tables = {key: table for key, table in self._tables.items() if key[0] in staying}
        self._windows = {key: window for key, window in self._windows.items() if key[0] in staying}
        # A graph captured on the device left reads weights that moved too: it cannot replay correctly anyway.
        self._captured = [table for table in captured if table[0].device in staying]
        self._plans.clear()
        return super()._apply(fn, recurse)

    @classmethod
    def from_model_dims(cls, *, dim: int, num_heads: int, head_dim: int, max_positions: int, **options: Any) -> RoPE:
        """``RoPE(head_dim, max_position_embeddings=max_positions, **options)`` (``build_for_model``'s hook): a
        rotation of each head's ``head_dim`` channels; dim and num_heads are not read."""
        # The training length is what the length-dependent scaling types extend from. Given twice it would have to be
        # one value silently chosen over the other.
        if "max_position_embeddings" in options:
            raise TypeError(
                f"max_position_embeddings={options['max_position_embeddings']!r} is the training length that "
                f"max_positions={max_positions} already gives a model's RoPE; pass it once, as max_positions"
            )
        return cls(head_dim, max_position_embeddings=max_positions, **options)

    @property
    def head_dim(self) -> int:
        """d: the channels of a head, the last dimension of the q and k this RoPE takes."""
        return self.spec.head_dim

    @property
    def rotary_dim(self) -> int:
        """r (even, <= d): the channels rotated, in r/2 pairs; the d - r after them pass through unchanged."""
        return self.spec.rotary_dim

    @property
    def base(self) -> float:
        """theta in theta_i = base^(-2i/r): the base of the unscaled frequencies."""
        return self.spec.base

    @property
    def rope_type(self) -> str:
        """The scaling type, as transformers names it ('default', 'linear', 'dynamic', 'yarn', ...)."""
        return self.spec.rope_type

    def frequencies(self, seq_len: int | None = None) -> tuple[torch.Tensor, float]:
        """Returns (inv_freq (r/2,) float64 on the CPU, attention_factor) for a sequence of ``seq_len``."""
        if _length_traced(seq_len):  # constants of the graph: no state to mutate
            return self._traced_frequencies(seq_len, torch.device("cpu"))
        if seq_len is not None:
            sequence_length("seq_len", seq_len)
        # Every layer sharing this RoPE asks for the same length in one step, and a 'consistent' cache asks three
        # times (the keys' check, k, q): the last few lengths are kept (37-150 us each, float64 on the host).
        key = self._frequency_length(seq_len)
        found = _kept(self._frequencies).pop(key, None)  # re-inserted below: the dict's order is the order of use
        if found is None:
            found = compute_frequencies(self.spec, seq_len=key)
            if transformed() or fake_mode_active():  # made inside torch.func.grad & co, or fake: not kept (_keepable)
                return found
            if len(self._frequencies) >= _FREQUENCIES_KEPT:
                # The least recently used; threads sharing this RoPE may evict it first (a cache: nothing is lost).
                with contextlib.suppress(StopIteration, RuntimeError):
                    self._frequencies.pop(next(iter(self._frequencies)), None)
        self._frequencies[key] = found
        return found[0].clone(), found[1]  # a copy: callers may write to it

    def _frequency_length(self, seq_len: int | None) -> int | None:
        """The one length that stands for every seq_len with the same frequencies (None: the unscaled ones), so that
        the cache serves them all: LongRoPE reads only the side of its original length, dynamic NTK scales only past
        max_position_embeddings, the fixed types ignore seq_len, and any other length-dependent type gets seq_len
        itself. Eager only: traced, no length is compared on the host (``_traced_frequencies``)."""
        spec = self.spec
        if seq_len is None or not is_seq_len_dependent(spec.rope_type):
            return None
        if spec.rope_type == "longrope":
            original = int(spec.params["original_max_position_embeddings"])
            return original + 1 if seq_len > original else None
        # Only dynamic is known to be plain RoPE up to the trained length: a registered length-dependent type got
        # its seq_len=None frequencies there, silently, whatever its function computes for that length.
        limit = spec.max_position_embeddings
        if spec.rope_type == "dynamic" and limit is not None and seq_len <= limit:
            return None
        return operator.index(seq_len)

    def _table_length(self, seq_len: int) -> tuple[bool, int | None]:
        """(whether cos/sin for a call scaling for ``seq_len`` are read from a kept table, the table's length key:
        ``_frequency_length``'s). Every type whose frequencies do not depend on the length, LongRoPE's two sets, and
        dynamic NTK's unscaled one: past its limit every length has frequencies of its own (``cos_sin`` computes them
        per call, ``forward`` reads a window of exactly the call's rows), as a registered length-dependent type has
        (computed per call)."""
        length = self._frequency_length(seq_len)
        rope_type = self.spec.rope_type
        return _tabled(rope_type) and not (rope_type == "dynamic" and length is not None), length

    @property
    def rotates_cached_keys(self) -> bool:
        """True when the attention must keep keys unrotated and rotate them at read ('consistent' + a type whose
        frequencies change with the length)."""
        return self.mode == "consistent" and is_seq_len_dependent(self.spec.rope_type)

    def scaling_length(self, positions: torch.Tensor) -> int | None:
        """The seq_len a forward call with these positions (integer, any shape) scales for: max(positions) + 1, or
        for 'hf' dynamic NTK the state it advances as transformers does; None for a type that does not depend on
        the length, or no positions."""
        if not is_seq_len_dependent(self.spec.rope_type) or positions.numel() == 0:
            return None
        if positions.device.type == "meta" or (fake_mode_active() and not recording()):  # shapes only, no state
            return 1
        if not values_readable(positions.device):
            raise _length_unreadable(self.spec.rope_type)
        length = int(positions.max()) + 1
        if self.mode == "consistent" or self.spec.rope_type != "dynamic":
            return length
        return self._advance_hf_state(length)

    def _advance_hf_state(self, length: int) -> int:
        """'hf' dynamic NTK: advance the state (the longest length seen) for a call whose positions reach
        ``length`` - 1, as transformers' ``dynamic_rope_update`` does; returns the length the call scales for."""
        assert self.hf_scaled_len is not None and self.max_position_embeddings is not None
        # The length returned is decided from one reading of the state, never read back after the write: threads
        # sharing this RoPE change it in between, and a read-back let a long call take another call's reset (scaling
        # for max_position_embeddings, short of its own positions: a ValueError) and a short call another's growth
        # (scaled frequencies where plain ones are due, silently). A call that keeps the state (every decode step)
        # takes no lock; one that changes it decides again under the lock, from a reading no other call can change
        # before its write: two growing calls at once could otherwise both read the old length and the shorter one
        # write last, leaving the state below the longest length seen (later calls then scaled too little).
        seen = self.hf_scaled_len
        scaled = _hf_dynamic_state(length, seen, self.max_position_embeddings)
        if scaled == seen:
            return seen
        with _HF_DYNAMIC_LOCK:
            seen = self.hf_scaled_len
            scaled = _hf_dynamic_state(length, seen, self.max_position_embeddings)
            if scaled != seen:
                self.hf_scaled_len = scaled
        return scaled

    def call_scaling_length(self, positions: torch.Tensor) -> int | None:
        """``scaling_length`` wherever a forward call runs: inside torch.compile the length-dependent types read it
        outside the graph, in a graph break (with ``fullgraph=True`` an error that says to compile without it), as
        ``call_cos_sin`` does for 'hf' dynamic NTK; 1 on the meta device; in a CUDA graph capture the error that asks
        for seq_len=. What a 'consistent' ``KVCache`` rotates its keys for."""
        if is_seq_len_dependent(self.spec.rope_type) and compiling():
            return _scaling_length_eagerly(self, positions)
        return self.scaling_length(positions)

    def call_cos_sin(
        self, positions: torch.Tensor, *, dtype: torch.dtype = torch.float32
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The per-step accessor: positions (...) integer ids. Returns cos, sin (..., r/2) in ``dtype``, the ones
        ``forward`` (with no seq_len) rotates these positions by, at the length it scales for (``scaling_length``),
        advancing 'hf' dynamic NTK's state (the largest length seen) as a forward call does: in mode 'hf' the values
        transformers' rotary embedding gives for the same sequence of calls. Call it once per step, where forward
        would be called, and rotate with ``apply_rotary(x, cos, sin)``, giving cos and sin a head axis where the
        positions have a batch axis: for (b, s) positions and x (b, h, s, d), ``cos[:, None], sin[:, None]`` (as
        transformers' ``unsqueeze_dim=1``), for x (b, s, h, d) ``cos[:, :, None]``; a (b, s, r/2) cos passed as it is
        broadcasts over the heads when b equals h, rotating head i by row i's positions without an error. ``cos_sin``
        reads no state: for 'hf' dynamic it differs from forward on a call shorter than the longest one seen but not
        shorter than max_position_embeddings (a decode step after a longer prefill).

        Inside torch.compile 'hf' dynamic NTK computes them outside the graph, one graph break where transformers'
        ``dynamic_rope_update`` makes one too; with ``fullgraph=True`` or in a CUDA graph capture, give the length:
        ``cos_sin(positions, seq_len=...)``. LongRoPE only chooses between two sets of frequencies, which the graph
        does itself (as transformers' does, with no break), and 'consistent' dynamic NTK, which keeps no state,
        reads the length in an op of the graph (no break; not for CUDA graphs, which that read would defeat)."""
        if positions.numel() == 0:  # nothing to scale for, nor any state to advance
            return self.cos_sin(positions, dtype=dtype)
        # make_fx's graph too: there no value may be read (its example's length would be baked in).
        in_graph = (compiling() or recording()) and positions.dim() <= 2  # not M-RoPE's axes
        # 'consistent' dynamic NTK scales for these positions alone (no state), which the graph reads in an op; only
        # 'hf' dynamic NTK keeps a state (a registered type scales for each call's positions, in a graph break).
        stateless = self.spec.rope_type != "dynamic" or self.mode == "consistent"
        if in_graph and stateless and is_seq_len_dependent(self.spec.rope_type):
            return self.cos_sin(positions, dtype=dtype)  # which reads max(positions) + 1 in the graph
        if self.spec.rope_type == "longrope" and compiling():  # M-RoPE's axes
            return _call_longrope_cos_sin_eagerly(self, positions, dtype)
        if is_seq_len_dependent(self.spec.rope_type) and compiling():
            return _call_cos_sin_eagerly(self, positions, dtype)
        return self.cos_sin(positions, seq_len=self.scaling_length(positions), dtype=dtype)

    def step_cos_sin_in_graph(
        self, positions: torch.Tensor, step_positions: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Inside torch.compile: cos, sin (..., r/2) of ``positions`` (...) with the frequencies for max(step_positions)
        + 1, with no graph break: ``cos_sin(positions, seq_len=that length)``'s values. LongRoPE chooses its factors
        on the device; dynamic NTK reads the length on the host in an op (``posenc::dynamic_inv_freq``); a type that
        does not scale with the length (Gemma 3n / 4's sliding layers beside scaled full-attention ones) ignores it.
        What 'consistent' mode rotates the cached keys with, in every layer."""
        if not is_seq_len_dependent(self.spec.rope_type):
            return self.cos_sin(positions, dtype=dtype)
        if self.spec.rope_type == "longrope":
            inv_freq, factor = self._longrope_chosen(step_positions.max() + 1)
        elif self.spec.rope_type == "dynamic":
            spec = self.spec
            assert spec.max_position_embeddings is not None  # parse_rope_parameters requires it for dynamic
            inv_freq = _dynamic_inv_freq(
                step_positions,
                int(spec.rotary_dim),
                float(spec.base),
                float(spec.params["factor"]),
                int(spec.max_position_embeddings),
            )
            factor = 1.0  # dynamic NTK's, at every length
        else:
            # A registered type: its function runs on the host (float64, any Python), so the length is read there,
            # in a graph break, as 'hf' dynamic NTK's is; it raised "has no in-graph length rule" before. make_fx's
            # trace has no graph breaks: there the length must be given.
            if not compiling():
                raise _length_unreadable(self.spec.rope_type)
            return _registered_cos_sin_eagerly(self, positions, step_positions, dtype)
        assert_without_sync(positions >= 0, "positions must be >= 0, got a negative entry")
        return angles_to_cos_sin(positions, inv_freq, factor, dtype)

    def _longrope_chosen(self, length: torch.Tensor) -> tuple[torch.Tensor, float]:
        """LongRoPE's (inv_freq (r/2,) float64 on ``length``'s device, attention_factor) for a length held in the
        graph (an integer tensor): the long factors' row where it passes original_max_position_embeddings, else the
        short ones', picked by torch.where from the two tables, each computed as the eager branch computes it
        (torch.export runs the same ops: to the bit), in one graph for both sides. One attention factor serves both:
        posenc's function computes it from ``factor`` alone, and register_scaling cannot replace longrope."""
        original = int(self.spec.params["original_max_position_embeddings"])
        short, factor = compute_frequencies(self.spec)
        long, _ = compute_frequencies(self.spec, seq_len=original + 1)
        return torch.where(length > original, long.to(length.device), short.to(length.device)), factor

    def _traced_frequencies(self, seq_len: int | None, device: torch.device) -> tuple[torch.Tensor, float]:
        """``frequencies(seq_len)`` while torch.compile or torch.export traces, with no comparison of the length on
        the host, which guarded the program on the example's side of a length-dependent type's switch (one program
        per side, and a constraint error for an exported Dim spanning both). LongRoPE picks the long or the short
        factors' row of its two tables in the graph, on ``device`` (``_longrope_chosen``), for every traced length:
        Dynamo answers isinstance(length, torch.SymInt) False for its symbolic ints. Dynamic NTK's function takes
        max(seq_len, max_position_embeddings), a torch.sym_max, and computes its frequencies from it in the graph:
        up to the limit, the same float64 steps on the same numbers as for seq_len None (eager's unscaled ones),
        which torch.export runs as the host does, to the bit. inv_freq on the CPU but for LongRoPE's choice."""
        if seq_len is None or not is_seq_len_dependent(self.spec.rope_type):
            return compute_frequencies(self.spec)
        if self.spec.rope_type == "longrope":
            return self._longrope_chosen(torch.scalar_tensor(seq_len, dtype=torch.int64, device=device))
        # Dynamic NTK, and a registered type, from the length as it is (symbolic where it varies between calls).
        return compute_frequencies(self.spec, seq_len=seq_len)

    def cos_sin(
        self, positions: torch.Tensor, *, seq_len: int | None = None, dtype: torch.dtype = torch.float32
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """positions: (...) integer tensor. Returns cos, sin: (..., r/2) in ``dtype`` on positions' device.

        seq_len: the sequence length that length-dependent types scale for (default: max(positions) + 1, which
        torch.compile and make_fx read in the graph, LongRoPE choosing its factors on the device and dynamic NTK
        reading the length in an op, ``posenc::dynamic_inv_freq``; a CUDA graph capture cannot read it: there these
        types need it given).

        Reads and advances no state: the length-dependent types scale for these positions (or seq_len) alone, as
        mode 'consistent' does, in either mode. For 'hf' dynamic NTK, ``forward`` (and transformers) scale for the
        longest length seen instead, so on a decode step after a longer prefill (past max_position_embeddings) these
        differ from what forward rotates by. The per-step accessor that equals forward, advancing the state as it
        does, is ``call_cos_sin``.
        """
        refuse_jit_trace(f"{type(self).__name__}.cos_sin")
        int_tensor("positions", positions, host_read=True)
        float_dtype("dtype", dtype)
        # A negative view's rows (torch's table[ids] reads its storage, -ids) and uint8 ids (read as a mask).
        positions = index_values(positions)
        if is_dtensor(positions):
            # The table and frequencies are plain tensors, which DTensor refuses to index by a DTensor or multiply
            # ("got mixed torch.Tensor and DTensor"): the rows of the whole ids, laid out as the ids are (a shard of
            # the ids gets its shard of cos/sin; Replicate to Shard keeps each rank's own rows, no communication).
            cos, sin = self.cos_sin(positions.full_tensor(), seq_len=seq_len, dtype=dtype)
            return laid_out_as(cos, positions), laid_out_as(sin, positions)
        sequence_length("seq_len", seq_len)
        if positions.numel() == 0:
            empty = torch.empty((*positions.shape, self.rotary_dim // 2), device=positions.device, dtype=dtype)
            return empty, empty.clone()
        length_dependent = is_seq_len_dependent(self.spec.rope_type)
        if length_dependent and seq_len is None and (compiling() or recording()) and positions.dim() <= 2:
            # max(positions) + 1, which no traced code may read on the host: the graph reads it itself (no state is
            # read here, in either mode). Not in a CUDA graph capture, which cannot read it at all.
            return self.step_cos_sin_in_graph(positions, positions, dtype)
        needed = self._positions_extent(positions, seq_len)
        if needed is None:
            # Traced or captured: a table sized by max(positions) would be a data-dependent step that breaks the
            # graph. The angles give the values the table holds. The frequencies are constants of the graph,
            # computed on the host in float64; traced, a length-dependent type chooses between its sets in the graph
            # (``_traced_frequencies``: one graph for every length, on both sides of its switch).
            inv_freq, factor = (
                self._traced_frequencies(seq_len, positions.device)
                if _length_traced(seq_len)
                else self.frequencies(seq_len)
            )
            return angles_to_cos_sin(positions, inv_freq, factor, dtype)
        tabled, length = self._table_length(seq_len if seq_len is not None else needed)  # as forward reads them
        if needed > _TABLE_LIMIT or not tabled:
            inv_freq, factor = self.frequencies(seq_len if seq_len is not None else needed)
            return angles_to_cos_sin(positions, inv_freq, factor, dtype)
        cos, sin = self._table(positions.device, needed, dtype, length)
        return cos[positions], sin[positions]

    def _positions_extent(self, positions: torch.Tensor, seq_len: int | None) -> int | None:
        """max(positions) + 1 for non-empty positions, read on the host after checking they are >= 0 (1 on the
        meta device, which has no values); None where values cannot be read (torch.compile, CUDA graph capture):
        then the check runs with the graph, and a length-dependent type without seq_len is an error."""
        # No values: shapes only, as in scaling_length. Not for make_fx's graph, whose rows must come from the ids.
        if positions.device.type == "meta" or (fake_mode_active() and not recording()):
            return 1
        # A seq_len that does not cover the positions would scale dynamic NTK / LongRoPE for a shorter sequence than
        # the one present; refused for every type, so that it shows before a config switches to one that reads it.
        too_short = (
            "seq_len is shorter than the positions it is given for; it is the whole sequence's length (cached tokens "
            "+ new ones, max(positions) + 1 or more), or None to take max(positions) + 1"
        )
        if not values_readable(positions.device):
            assert_without_sync(positions >= 0, "positions must be >= 0, got a negative entry")
            if seq_len is not None:
                assert_without_sync(positions < seq_len, too_short)
            if is_seq_len_dependent(self.spec.rope_type) and seq_len is None:
                raise _length_unreadable(self.spec.rope_type)
            return None
        low, high = host_min_max(positions)
        if low < 0:  # a table would wrap around to its last rows
            raise ValueError(f"positions must be >= 0, got a negative entry ({low})")
        if seq_len is not None and high >= seq_len:
            raise ValueError(f"{too_short}; got seq_len={seq_len} for positions up to {high}")
        return high + 1

    def _table(
        self, device: torch.device, needed: int, dtype: torch.dtype, length: int | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The kept table of at least ``needed`` rows (grown to the next power of two, at least 256) of the
        frequencies for ``length`` (``_frequency_length``'s: None for the unscaled ones)."""
        key = _table_key(device, dtype, length)
        table = _kept(self._tables).get(key)
        if table is None or table[0].shape[0] < needed:
            table = self._rows(device, 0, max(256, 1 << (needed - 1).bit_length()), dtype, length)
            if _keepable():
                self._tables[key] = table
        else:
            self._hold_for_graph(table)
        return table

    def _hold_for_graph(self, rows: tuple[torch.Tensor, torch.Tensor]) -> None:
        """Keep a kept table or window for the module's life if a CUDA graph being captured reads it: the graph
        reads it by address at every replay, and a later call that grows the table or drops the window freed it,
        so that replays rotated by whatever the allocator had written there since, without an error."""
        if _capturing():
            captured = self.__dict__.setdefault("_captured", [])  # a RoPE pickled before 2026-12-05 has none
            if not any(rows is kept for kept in captured):
                captured.append(rows)

    def _window(
        self, device: torch.device, low: int, dtype: torch.dtype, length: int | None = None, count: int | None = None
    ) -> tuple[int, torch.Tensor, torch.Tensor]:
        """The rows of positions first..first + _WINDOW - 1, first the multiple of _WINDOW / 2 at or below ``low``:
        they cover low..low + _WINDOW / 2 - 1 at least, of the frequencies for ``length`` (as ``_table``); with
        ``count``, the rows of low..low + count - 1 exactly, for frequencies that serve one length alone (dynamic
        NTK past its limit: a wider window would be computed for one decode step). Kept as the table is, the latest
        _WINDOWS_KEPT used of each device and dtype, of each of the two kinds."""
        first = low if count is not None else low // (_WINDOW // 2) * (_WINDOW // 2)
        key = _window_key(device, dtype, length, first, count)
        window = _kept(self._windows).pop(key, None)  # re-inserted below: the dict's order is the order of use
        built = window is None
        if built:
            window = self._rows(device, first, _WINDOW if count is None else count, dtype, length)
        else:
            self._hold_for_graph(window)
        if _keepable() or not built:
            self._windows[key] = window
            if built:  # only a new window can take the count past the limit
                # Over a copy of the keys, which tuple() takes without running Python code in between: another
                # thread adding or dropping a window while the keys were compared stopped this call with
                # "RuntimeError: dictionary changed size during iteration".
                # Windows of one length's rows apart from the others: a decode step's, each new, took the places of
                # the wide windows that requests far out read.
                exact = count is not None
                same = [other for other in tuple(self._windows) if other[:2] == key[:2] and _exact(other) == exact]
                for other in same[:-_WINDOWS_KEPT]:
                    self._windows.pop(other, None)  # another thread may have dropped it first
        return (first, *window)

    def _rows(
        self, device: torch.device, first: int, count: int, dtype: torch.dtype, length: int | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin (count, r/2) of positions first..first + count - 1 with the frequencies for ``length``: each
        row the bits angles_to_cos_sin gives that position alone."""
        inv_freq, factor = self.frequencies(length)
        # Not an inference tensor even inside inference_mode (a validation pass first): a later training call could
        # not save one for backward.
        with torch.inference_mode(False):
            return angles_to_cos_sin(torch.arange(first, first + count, device=device), inv_freq, factor, dtype)

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
        """Rotate queries and keys by their absolute positions.

        q: (b, h_q, s, d), k: (b, h_k, s, d) for layout "bhsd"; (b, s, h, d) for "bshd". h_q may differ from h_k.
        q and k (b, s, h, d) of one head count also fit "bhsd", as s heads of h tokens, and are rotated by the wrong
        positions without an error: pass layout="bshd" for them (GQA's differing head counts are refused).
        positions: (s,) or (b, s) integer ids (e.g. packed documents restarting at 0); default 0..s-1.
        offset: int or (b,) tensor added to the positions (tokens already in a KV cache).
        seq_len: the length ``dynamic`` / ``longrope`` scale for (default: max(positions) + 1; for ``dynamic`` in
        'hf' mode, the largest length seen, see the class docstring), and a type registered with
        ``seq_len_dependent=True``. Inside torch.compile the default is taken in the graph for ``longrope`` and
        'consistent' ``dynamic``, and in a graph break for 'hf' ``dynamic`` and a registered type, which therefore
        need it with ``fullgraph=True``; all of them need it in a CUDA graph capture, where positions cannot be
        read (but ``longrope`` with an int offset and no ids: its length, offset + s, is known on the host). A
        positive int for every type.
        Returns new (q, k) with the input dtypes.
        """
        first, index, rows = rows_read(positions, offset)
        key = _far(self._replay_key(q, k, positions, offset, index, rows, layout, seq_len), first)
        if key is not None:
            kept = self._kept_plan(key)
            if kept is not None and kept[1] is None:
                key = None  # this table cannot serve these calls replayed (a copy on the way): the full path
            elif kept is not None:
                table, plan, base = kept
                # A window's plan reads it from the offset's distance to its first row (int offsets only: _keep_plan).
                outs = replay(plan, (q, k), *table, first if base is None else first - base, index)
                if outs is not None:
                    return outs[0], outs[1]
        refuse_jit_trace(type(self).__name__)
        seq_axis = self._check_qk(q, k, layout, seq_len)
        offset = integer_offset(offset)
        # DTensor ids or offsets whole, as plain ones are taken: the tables and angles here are plain tensors, which
        # DTensor refuses to index by or add to a DTensor; the rotation replicates the rows it reads on q's mesh.
        if isinstance(positions, torch.Tensor):
            positions = replicated_values(positions)
        if isinstance(offset, torch.Tensor):
            offset = replicated_values(offset)
        # float32 tables for every activation dtype but float64, whose callers want float64 exactness.
        table_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
        seq = q.shape[seq_axis]
        length_dependent = is_seq_len_dependent(self.spec.rope_type)
        scaled_len = None  # dynamic NTK's length, where decided for this call already (and 'hf' state advanced)
        if _tabled(self.spec.rope_type) and q.device.type != "meta":
            # Position ids and offsets may come from the CPU for CUDA activations, as resolve_positions allows.
            if isinstance(positions, torch.Tensor):
                positions = to_device("positions", positions, q.device, "q")
            if isinstance(offset, torch.Tensor):
                offset = to_device("offset", offset, q.device, "q")
            bounds = _position_bounds(seq, q.shape[0], positions, offset)
            if seq_len is not None and bounds is not None and bounds[1] >= seq_len:
                bounds = None  # the general path checks the positions against seq_len exactly (high may overshoot)
            length = None  # the length whose frequencies the table holds (_frequency_length's; None: unscaled)
            exact = False  # frequencies for this call's length alone: a window of exactly its rows (see below)
            if length_dependent:
                # The table of the set of frequencies for the length this call scales for, seq_len or max(positions)
                # + 1 (for 'hf' dynamic NTK, the state that length advances). The bounds give the latter exactly but
                # for ids beside per-sequence offsets (whose sum of maxima may not be reached): those, and traced
                # calls, take the general path.
                if bounds is None or compiling() or (positions is not None and isinstance(offset, torch.Tensor)):
                    bounds = None
                elif type(wanted := seq_len if seq_len is not None else bounds[1] + 1) is not int:
                    # make_fx's symbolic trace (a torch.SymInt length, not a compile): compared with the original
                    # length here, the example's set was baked into the graph; the general path chooses in it.
                    bounds = None
                elif (
                    bounds[0] < 0
                    or bounds[1] > 2**63 - 1
                    or (isinstance(offset, torch.Tensor) and offset.numel() == 0)
                    or (positions is not None and not ids_fit(positions, seq, q.shape[0]))
                ):
                    # What resolve_positions refuses (a negative or int64-overflowing position, ids of another shape)
                    # raises its error there, as before these types' tables, before any 'hf' state is advanced; and a
                    # batch of none with per-sequence offsets has no positions, so advances no state.
                    bounds = None
                elif self.spec.rope_type == "dynamic" and (
                    seq == 0 or recording() or fake_mode_active() or _capturing()
                ):
                    # Dynamic NTK: calls that advance no state (scaling_length's), or refuse to read it (a CUDA graph
                    # capture too: its replays could advance none, so it asks for seq_len, as make_fx's trace does).
                    bounds = None
                else:
                    if seq_len is None and self.spec.rope_type == "dynamic":
                        # The length this call scales for, decided once (in mode 'hf', the state advanced for it):
                        # the general path below reads no positions for it again.
                        wanted = scaled_len = self._advance_hf_state(wanted) if self.mode == "hf" else wanted
                    tabled, length = self._table_length(wanted)
                    # Dynamic NTK past max_position_embeddings: frequencies of this length alone (a decode step's next
                    # length has others), so no table from row 0: the rows of this call's positions are kept as a
                    # window of their own, which the step's other layers (the same length, the same rows) read.
                    exact = not tabled
            table = None
            # Where a call's plan may be kept: (the key of the table or window it reads, in _tables or _windows; the
            # window's first row's position, None for a table; the int offset the kernel reads it from, or None).
            source: tuple | None = None
            # Not while torch.compile traces: a table grown to the next power of two inside the graph guarded each
            # graph on the table's size, one graph per size (a decode loop with an int offset hit the recompile
            # limit at 16384, a hard error under fullgraph=True). The angles there are computed in the graph, to
            # the table's bits, one graph for every offset and length.
            if bounds is not None and bounds[1] < _TABLE_LIMIT and not exact and not compiling():
                # Frequencies that do not depend on the length (or LongRoPE's set for it): the kernels read the
                # cached table at the tokens' rows (a slice for an int offset), with no per-token cos/sin built here
                # first (measured: 4-6% of a CPU prefill call; at decode size ~35 us of a ~100 us call with position
                # ids). The table covers every row up to the bound, so when no position can be negative the rows
                # need no second check (on CUDA a device sync each).
                needed = max(bounds[1] + 1, 1)
                table, trusted = self._table(q.device, needed, table_dtype, length), bounds[0] >= 0
                source = (_table_key(q.device, table_dtype, length), None, first)
                if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad):
                    # The fused backward saves the table it is given: cut to this call's rows, so that an activation
                    # checkpoint's recompute saves one of the same shape after a longer call has grown the shared
                    # table in between (non-reentrant checkpointing raised CheckpointError on "different metadata").
                    table = (table[0][:needed], table[1][:needed])
            elif (
                # First: while Dynamo traces, a comparison of the (symbolic) bounds would guard the graph on it.
                not compiling()
                and bounds is not None
                and bounds[0] >= 0
                and bounds[1] - bounds[0] < _WINDOW // 2
                and bounds[1] < 2**63 - _WINDOW  # the window's rows fit in int64 (the general path says what does not)
                and (positions is None or not isinstance(offset, torch.Tensor))
            ):
                # Far out (decode steps past the table), or dynamic NTK past its limit (exactly the call's rows): the
                # window's rows, read with every position moved back by its first one, all of them still >= 0 (the
                # offset moves when it alone reaches that far).
                count = bounds[1] - bounds[0] + 1 if exact else None
                start, *table = self._window(q.device, bounds[0], table_dtype, length, count)
                trusted = True
                if positions is None:
                    offset = offset - start
                    if type(offset) is int:
                        # Replayable, from the offset's distance to the window's first row (ids and offset tensors
                        # are read moved back: a copy, which no replay could read).
                        source = (_window_key(q.device, table_dtype, length, start, count), start, offset)
                else:
                    # In int64: the shifted ids reach _WINDOW - 1, past what 8-bit ids hold (they wrapped).
                    positions, offset = positions.long() - (start - offset), 0
            elif (
                bounds is None
                and not length_dependent
                and not compiling()
                and not recording()
                and not values_readable(q.device)
            ):
                # Captured into a CUDA graph: nothing may read a value or copy from the host, so the table built
                # while warming up is read as it stands; a position outside it reads no memory beyond it (the Triton
                # kernel gives those tokens NaN, the torch path asserts on the device).
                table, trusted = _kept(self._tables).get((q.device, table_dtype)), False
                if table is not None:
                    self._hold_for_graph(table)
            if table is not None:
                if key is None and scaled_len is not None and self.mode == "hf" and rows == "offset" and source:
                    # The call that advanced 'hf' dynamic NTK's state takes the full path (a replay would advance
                    # none), but keeps the plan for the calls after it at that state: a decode step's other layers.
                    # Keyed by the length it decided, not the state read again (another thread may have moved it).
                    key = _far(self._replay_key(q, k, None, first, None, rows, layout, seq_len, scaled_len), first)
                if key is None:
                    return self._rotate_by_table(q, k, table, positions, offset, layout, trusted)
                with recording_launches() as launches:
                    q_out, k_out = self._rotate_by_table(q, k, table, positions, offset, layout, trusted)
                # Kept only under a key of the length whose table or window the call read: the key was made from the
                # 'hf' state as it stood when the call began, which another thread's call may have moved since (a
                # plan of one length's window kept under another's, replayed with the wrong frequencies after).
                if source is not None and (self.spec.rope_type not in _LENGTH_TABLED or _key_length(key) == length):
                    table_key, base, read_from = source
                    self._keep_plan(key, launches, (q, k), (q_out, k_out), table, read_from, index, table_key, base)
                return q_out, k_out
        pos = resolve_positions(seq, batch=q.shape[0], positions=positions, offset=offset, device=q.device)
        # cos/sin here, not in _rotate_at: 'hf' dynamic NTK's call_cos_sin breaks the graph inside torch.compile, and
        # Dynamo compiles every frame between the compiled function and that break as a frame of its own, one more
        # break, frame and guard check per call for each method it is called through.
        if scaled_len is not None:
            cos, sin = self.cos_sin(pos, seq_len=scaled_len, dtype=table_dtype)  # call_cos_sin's, length decided
        elif seq_len is None:
            cos, sin = self.call_cos_sin(pos, dtype=table_dtype)  # (b or 1, s, r/2); advances 'hf' dynamic's state
        else:
            cos, sin = self.cos_sin(pos, seq_len=seq_len, dtype=table_dtype)
        return self._rotate_at(q, k, cos, sin, layout)

    def _replay_key(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        positions: object,
        offset: object,
        index: object,
        rows: str | None,
        layout: object,
        seq_len: object,
        scaled: int | None = None,
    ) -> tuple | None:
        """The key under which a call may replay an earlier one's launch of a fused kernel on this module's table
        (``posenc.kernels.replay``), or None for a call that must take the full path: seq_len, positions beside
        an offset, a layout or backend that is not a str or an interleaved that is not a bool (the full path's
        errors: a list could not be part of the key, and 1 would find True's plans), a type that scales for the
        length but LongRoPE and dynamic NTK, anything but plain CPU or CUDA tensors, a gradient to record, anything
        but plain eager, a CUDA graph capture. The table a plan reads is checked at each replay to be the one kept
        now (``forget_frequencies`` and ``_apply`` replace or drop tables). LongRoPE's calls replay with an int
        offset only, keyed by the set of frequencies that offset + s selects (each set has its table); dynamic NTK's
        likewise, keyed by the length they scale for (past the limit each length's rows are a window of their own),
        where, in mode 'hf', the call keeps the state (or, with ``scaled``, for the state the call has set: the length
        it decided). The length is the key's last item for these types (``_key_length``)."""
        if seq_len is not None or (positions is not None and (type(offset) is not int or offset != 0)):
            return None
        if positions is None and type(offset) is not int and not isinstance(offset, torch.Tensor):
            return None
        # First: Dynamo reads plain_eager() as False and traces nothing after it here. Under a CUDA graph capture a
        # call holds the table it reads for the graph's life (_hold_for_graph).
        rope_type = self.spec.rope_type
        # As _tabled, inline: the types that depend on the length and read tables are LongRoPE and dynamic NTK.
        if not plain_eager() or _capturing() or (rope_type not in _LENGTH_TABLED and is_seq_len_dependent(rope_type)):
            return None
        if type(layout) is not str or type(self.backend) is not str or type(self.interleaved) is not bool:
            return None
        grad = torch.is_grad_enabled()
        index_key = None if index is None else tensor_key(index, grad)
        if index is not None and index_key is None:
            return None
        length = None
        if rope_type in _LENGTH_TABLED:
            # The length the call scales for picks the table: offset + s, or max(ids) + 1 (max(offsets) + s),
            # read on the host as the full path's bounds are (on CUDA a sync, which that path makes too).
            if not isinstance(q, torch.Tensor) or q.dim() != 4 or layout not in _SEQ_AXES:
                return None
            seq = q.shape[_SEQ_AXES[layout]]
            if seq == 0:  # no positions: nothing to scale for, nor any 'hf' state to keep
                return None
            hf = rope_type == "dynamic" and self.mode == "hf"
            if index is None:
                wanted = offset + seq
            elif index.numel() == 0 or index.dtype not in INDEX_DTYPES:
                return None  # no ids, or ids the full path converts (no plan would replay them)
            elif hf and scaled is None and self.hf_scaled_len > self.max_position_embeddings:
                # With the state past the limit every call either changes it or scales past the limit, where ids are
                # read moved back (below): no key whatever the ids, so they are not read twice (on CUDA, two syncs).
                return None
            else:
                wanted = host_min_max(index)[1] + (seq if rows == "offsets" else 1)
                if wanted <= 0:
                    return None  # negative ids: the full path's error
            if hf:
                if scaled is not None:
                    wanted = scaled
                else:
                    # Replayed only where the call keeps the 'hf' state (a replay advances none).
                    seen = self.hf_scaled_len
                    if _hf_dynamic_state(wanted, seen, self.max_position_embeddings) != seen:
                        return None
                    wanted = seen
            # Past its limit dynamic NTK's length has frequencies of its own, read from windows keyed by it (with
            # int offsets: ids and offsets tensors read a window through a copy of them, moved back).
            length = self._frequency_length(wanted)
            if index is not None and rope_type == "dynamic" and length is not None:
                return None
        q_key, k_key = tensor_key(q, grad), tensor_key(k, grad)
        if q_key is None or k_key is None:
            return None
        key = (q_key, k_key, index_key, rows, layout, self.interleaved, self.backend, torch.get_num_threads())
        return (*key, length) if rope_type in _LENGTH_TABLED else key

    def _kept_plan(self, key: tuple) -> tuple | None:
        """(the table or window, the plan or None for calls that are not replayable on it, the window's first row's
        position or None for a table) kept under ``key`` for the table or window kept now, or None where there is
        none or it has been replaced or dropped since."""
        kept = self._plans.get(key)
        if kept is None:
            return None
        table_of, table_key, plan, base = kept
        table = (self._tables if base is None else self._windows).get(table_key)
        if table is None or table[0] is not table_of():
            return None
        if base is not None:
            # A replay uses the window: to the end of the order of use, as the full path's _window puts it, so that
            # the one dropped for a new window is the least recently used (a stream's old window), not the oldest
            # built (another stream's current one, which then took the full path and was built again).
            with contextlib.suppress(KeyError):
                self._windows[table_key] = self._windows.pop(table_key)
        return table, plan, base

    def _keep_plan(
        self,
        key: tuple,
        launches: list,
        xs: tuple[torch.Tensor, torch.Tensor],
        outs: tuple[torch.Tensor, torch.Tensor],
        table: Any,
        first: int | None,
        index: torch.Tensor | None,
        table_key: tuple,
        base: int | None = None,
    ) -> None:
        """Keep the plan of a call (its ``launches``) that read ``table`` from row ``first``, where that is the table
        kept now under ``table_key`` (with ``base``, the window kept under that key in ``_windows``, whose first row
        is position ``base``): the plan where replaying it is what the full path would do
        (``posenc.kernels.replay.plan_of``), else None, so that later calls of the key take the full path
        unrecorded. A window's plan replays calls whose offset lies in it (``replay`` refuses the others, which take
        the full path and keep the plan of the table or window they read in its place)."""
        kept = (self._tables if base is None else self._windows).get(table_key)
        if kept is None or kept[0] is not table[0]:
            return
        plan = plan_of(launches, xs, outs, *kept, first, index)
        self._plans.put(key, (weakref.ref(kept[0]), table_key, plan, base))

    def _rotate_by_table(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        table: tuple[torch.Tensor, torch.Tensor] | list[torch.Tensor],
        positions: torch.Tensor | None,
        offset: int | torch.Tensor,
        layout: Layout,
        trusted: bool,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """forward's rotation of checked q and k by rows of this module's cos/sin ``table`` (or window)."""
        q, k = rotate_tensors(
            {"q": q, "k": k},
            *table,
            interleaved=self.interleaved,
            conjugate=False,
            positions=positions,
            offset=offset,
            cu_seqlens=None,
            layout=layout,
            backend=self.backend,
            inplace=False,
            rows_checked=trusted,
            # _check_qk checked q and k, the tables are this module's, and a table is used only eagerly.
            vouched=True,
        )
        return q, k

    def _rotate_at(
        self, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, layout: Layout
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """forward's rotation of checked q and k by cos, sin (b or 1, s, r/2) of their positions (the caller computes
        them: see RoPE.forward)."""
        head_axis = 1 if layout == "bhsd" else 2
        cos, sin = cos.unsqueeze(head_axis), sin.unsqueeze(head_axis)
        return apply_rotary_qk(q, k, cos, sin, interleaved=self.interleaved, backend=self.backend)

    def _check_qk(self, q: torch.Tensor, k: torch.Tensor, layout: Layout, seq_len: int | None) -> int:
        """forward's checks of its arguments but the positions. Returns the sequence axis of q and k."""
        float_tensor("q", q)
        float_tensor("k", k)
        same_device(("q", "k"), q, k)
        sequence_length("seq_len", seq_len)  # for every type, though only the length-dependent ones read it
        if q.dtype != k.dtype:
            raise TypeError(f"q and k must have the same dtype, got {q.dtype} and {k.dtype}")
        if layout not in ("bhsd", "bshd"):
            raise ValueError(f"layout must be 'bhsd' or 'bshd', got {layout!r}")
        for name, t in (("q", q), ("k", k)):
            if t.dim() != 4 or t.shape[-1] != self.head_dim:
                raise ValueError(
                    f"{name} must be 4-D ({'b, h, s, d' if layout == 'bhsd' else 'b, s, h, d'}) with "
                    f"d = head_dim = {self.head_dim}, got shape {tuple(t.shape)}"
                )
        seq_axis = 2 if layout == "bhsd" else 1
        if q.shape[0] != k.shape[0] or q.shape[seq_axis] != k.shape[seq_axis]:
            other, other_axis = ("bshd", 1) if layout == "bhsd" else ("bhsd", 2)
            hint = ""
            # GQA's q and k read in the other layout: what differs is then their head counts, q's a multiple of k's.
            # (q shorter than k, a decode step against its cache, also matches under the other layout: no hint.)
            hq, hk = q.shape[seq_axis], k.shape[seq_axis]
            if q.shape[0] == k.shape[0] and q.shape[other_axis] == k.shape[other_axis] and hq > hk and hq % hk == 0:
                shape = "(b, s, h, d)" if other == "bshd" else "(b, h, s, d)"
                hint = f"; if they are stored {shape} (GQA: {hq} and {hk} heads), pass layout={other!r}"
            raise ValueError(
                f"q and k must share batch and sequence sizes, got {tuple(q.shape)} and {tuple(k.shape)} "
                f"(layout {layout!r}){hint}"
            )
        return seq_axis

    def rotate(self, x: torch.Tensor, positions: torch.Tensor, *, seq_len: int | None = None) -> torch.Tensor:
        """Rotate one tensor x: (b, h, t, d) by positions: (b or 1, t) integer ids, with the frequencies for
        ``seq_len`` (default max(positions) + 1); no state is read or changed. Used to (re-)rotate cached keys.
        Returns x's shape and dtype."""
        float_tensor("x", x)
        int_tensor("positions", positions, host_read=True)
        if x.dim() != 4 or x.shape[-1] != self.head_dim or positions.dim() != 2 or positions.shape[-1] != x.shape[2]:
            raise ValueError(
                f"x must be (b, h, t, d={self.head_dim}) and positions (b or 1, t), got {tuple(x.shape)} and "
                f"{tuple(positions.shape)}"
            )
        dtype = torch.float64 if x.dtype == torch.float64 else torch.float32
        cos, sin = self.cos_sin(positions, seq_len=seq_len, dtype=dtype)
        return apply_rotary(x, cos.unsqueeze(1), sin.unsqueeze(1), interleaved=self.interleaved, backend=self.backend)

    def extra_repr(self) -> str:
        return (
            f"head_dim={self.head_dim}, rotary_dim={self.rotary_dim}, base={self.base}, "
            f"rope_type={self.rope_type!r}, interleaved={self.interleaved}, mode={self.mode!r}, "
            f"backend={self.backend!r}"
        )
