"""What a patched model rotates with in place of transformers' code: ``PosencRotaryEmbedding``, which stands in for
the model's ``*RotaryEmbedding`` modules (cos/sin of shape (b, s, r/2) from float64 angles), and ``_rotate_qk`` /
``_rotate_one``, which the patched attention forward calls in place of its ``apply_rotary_pos_emb*`` functions
(``_QueriesThenKeys`` in 'consistent' mode where it rotates q and k in separate calls).

Shape key: b batch, h heads, s new tokens, d head dim, r rotary dim.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

from posenc import _compile_marks as compile_marks
from posenc._checks import compiling
from posenc.interop._discover import state_name
from posenc.interop.consistent import forget_keys_cos_sin
from posenc.rope.apply import apply_rotary, apply_rotary_qk
from posenc.rope.frequencies import is_seq_len_dependent
from posenc.rope.module import RoPE, angles_to_cos_sin
from posenc.rope.mrope import MRoPE, mrope_cos_sin


class PosencRotaryEmbedding(nn.Module):
    """Stands in for a model's ``*RotaryEmbedding``: ``forward(x, position_ids, layer_type=None) -> (cos, sin)``.

    rope: the ``RoPE``, or one per layer type (``{"full_attention": ..., "sliding_attention": ...}``) for a config
    with a rope dict per layer type, whose model then asks for each type's cos/sin by ``layer_type``.
    x: (b, s, hidden), only its dtype is read; position_ids: (b or 1, s) integer.
    Returns cos, sin: (b or 1, s, r/2), float64 for a float64 model else float32 (one value per rotated pair,
    posenc's convention, consumed by the patched attention's rotation, not by Hugging Face's).

    Fixed types keep their float64 frequencies in a buffer (``inv_freq``, or ``{layer_type}_inv_freq``) that
    follows device moves but never dtype casts, so the forward has no data-dependent step and ``torch.compile``
    traces it without a graph break. ``dynamic`` and ``longrope`` ask the ``RoPE`` for the frequencies of each
    call's length (``RoPE.scaling_length``: in 'hf' mode with transformers' dynamic NTK state).

    Both are taken when it is built, from the RoPE patch_model checked against the model's own rotary embedding,
    and kept: a ``register_scaling(name, fn, replace=True)`` of the type afterwards does not reach a patched model
    (it warns, naming them), which goes on rotating as transformers' type does until it is unpatched. Until
    2026-12-06 it kept the old frequencies only until a device move or dtype cast (``model.float()``,
    ``model.to(...)``) remade them with the replacement, and took the length-dependent path if the replacement was
    registered as one, silently either way.
    """

    def __init__(self, rope: RoPE | Mapping[str, RoPE]) -> None:
        super().__init__()
        if isinstance(rope, RoPE):
            self.layer_types: tuple[str, ...] = ()
            self.rope = rope
        else:
            if not rope or not all(isinstance(value, RoPE) for value in rope.values()):
                raise TypeError("rope must be a RoPE or a non-empty dict mapping each layer type to its RoPE")
            self.layer_types = tuple(rope)
            self.ropes = nn.ModuleDict(dict(rope))
        self.attention_factors: dict[str, float] = {}
        # (r/2,) float64 on the CPU per layer type: what the buffers are made from on every device move or cast.
        self._checked_inv_freq: dict[str, torch.Tensor] = {}
        # The layer types whose cos/sin the RoPE makes for each call's length (dynamic, longrope).
        self._length_dependent = frozenset(
            layer_type for layer_type, each in self._ropes().items() if is_seq_len_dependent(each.rope_type)
        )
        for layer_type, each in self._ropes().items():
            inv_freq, attention_factor = each.frequencies()
            self._checked_inv_freq[layer_type] = inv_freq.to(device="cpu", dtype=torch.float64)
            self.register_buffer(state_name(layer_type, "inv_freq"), inv_freq.to(torch.float64), persistent=False)
            self.attention_factors[layer_type] = float(attention_factor)
        with _LIVE_LOCK:
            _LIVE.add(self)

    def __setstate__(self, state: dict[str, Any]) -> None:
        # Unpickled or deep-copied: counted among the live ones, and one pickled by a posenc before 2026-12-06 takes
        # what it holds (its buffers, float64) as its checked frequencies.
        super().__setstate__(state)
        if "_checked_inv_freq" not in state:
            ropes = self._ropes()
            self._checked_inv_freq = {
                key: self._buffers[state_name(key, "inv_freq")].to(device="cpu", dtype=torch.float64) for key in ropes
            }
            self._length_dependent = frozenset(
                key for key, rope in ropes.items() if is_seq_len_dependent(rope.rope_type)
            )
        with _LIVE_LOCK:
            _LIVE.add(self)

    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True) -> PosencRotaryEmbedding:
        # model.half() / .to(bfloat16) cast every float buffer; the frequencies must stay float64 (a bf16 inv_freq
        # is off by 2**-9, i.e. whole turns at position 1e4), so only the device move is kept. They are made
        # afresh from the ones checked at patch time: a model built on the meta device and moved with to_empty() has
        # no values to keep.
        super()._apply(fn, recurse)
        for layer_type, inv_freq in self._checked_inv_freq.items():
            name = state_name(layer_type, "inv_freq")
            self._buffers[name] = inv_freq.to(device=self._buffers[name].device)
        return self

    def _ropes(self) -> dict[str, RoPE]:
        """layer type ('' for a single rope dict) -> its RoPE."""
        return {"": self.rope} if not self.layer_types else dict(self.ropes)

    @property
    def device(self) -> torch.device:
        return next(iter(self._buffers.values())).device

    @property
    def rope_type(self) -> str | dict[str, str]:
        """The type, or one per layer type, as transformers' rotary modules hold it (the RoPEs are built from the
        model's config, so these are transformers' names): a model's forward may read it (Ergo computes cos/sin for
        each layer type it lists)."""
        names = {key: rope.rope_type for key, rope in self._ropes().items()}
        return names if self.layer_types else names[""]

    def forward(
        self, x: torch.Tensor, position_ids: torch.Tensor, layer_type: str | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.layer_types:
            if layer_type is not None:
                raise ValueError(
                    f"layer_type={layer_type!r} given, but this model's config has one rope dict for every layer"
                )
            rope, key = self.rope, ""
        elif layer_type in self.layer_types:
            rope, key = self.ropes[layer_type], layer_type
        else:
            raise ValueError(f"layer_type must be one of {list(self.layer_types)}, got {layer_type!r}")
        # A forward starts here: cos/sin that 'consistent' mode's layers shared for these position_ids in an earlier
        # forward are made anew in this one (an inference tensor changed in place shows no version change).
        forget_keys_cos_sin(position_ids)
        dtype = torch.float64 if x.dtype == torch.float64 else torch.float32
        if key in self._length_dependent:
            return rope.call_cos_sin(position_ids, dtype=dtype)
        inv_freq = getattr(self, state_name(key, "inv_freq"))
        if position_ids.dim() == 3:  # (3, b, s): temporal, height, width ids
            if not isinstance(rope, MRoPE) or position_ids.shape[0] != 3:
                raise ValueError(
                    f"position_ids of shape {tuple(position_ids.shape)}: (3, b, s) ids are for multimodal RoPE, and "
                    f"this rotary embedding's is {type(rope).__name__}"
                )
            return mrope_cos_sin(
                position_ids, inv_freq, rope.mrope_section, self.attention_factors[key], dtype, layout=rope.mrope_layout
            )
        # Text ids (b, s): the same id on every axis, which is plain RoPE whatever the layout.
        return angles_to_cos_sin(position_ids, inv_freq, self.attention_factors[key], dtype)

    def extra_repr(self) -> str:
        ropes = self._ropes()
        return ", ".join(
            f"{key + ': ' if key else ''}rope_type={rope.rope_type!r}, rotary_dim={rope.rotary_dim}, mode={rope.mode!r}"
            for key, rope in ropes.items()
        )


# Every PosencRotaryEmbedding alive, for register_scaling's warning that a replacement does not reach them.
_LIVE: weakref.WeakSet[PosencRotaryEmbedding] = weakref.WeakSet()
_LIVE_LOCK = threading.Lock()


def patched_with(rope_type: str) -> list[PosencRotaryEmbedding]:
    """The live ``PosencRotaryEmbedding``s with a RoPE of ``rope_type``: patched models that keep its frequencies."""
    with _LIVE_LOCK:
        live = list(_LIVE)
    return [module for module in live if any(rope.rope_type == rope_type for rope in module._ropes().values())]


def _rotate_qk(
    q: torch.Tensor,
    k: torch.Tensor | None,
    cos: torch.Tensor,
    sin: torch.Tensor,
    *args: Any,
    interleaved: bool,
    regrouped: bool,
    backend: str,
    keys: bool,
    unsqueeze_at: int,
    unsqueeze_default: int,
    **kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """posenc's ``apply_rotary_pos_emb*``: q (b, h_q, s, d), k (b, h_k, s, d) or None (Mistral Large 4's layers that
    reuse another layer's keys), heads after s with unsqueeze_dim=2; cos, sin (b or 1, s, r/2). The arguments after
    (q, k, cos, sin) are the replaced function's: unsqueeze_dim, positionally at ``unsqueeze_at`` or by keyword, and
    position_ids, which transformers' functions ignore too (``rotation_signature`` admits no others).

    regrouped: return the rotated channels evens first, then odds, as the replaced function does, so that q, k and
    the KV cache hold what transformers' would (a cache filled before patching stays valid).
    keys=False leaves k unrotated (it is rotated at read, see ``_attend_with_rotated_keys``).
    """
    cos, sin = _unsqueezed(cos, sin, args, kwargs, unsqueeze_at, unsqueeze_default)
    if not keys or k is None:
        q = apply_rotary(q, cos, sin, interleaved=interleaved, backend=backend)
    else:
        q, k = apply_rotary_qk(q, k, cos, sin, interleaved=interleaved, backend=backend)
    if regrouped:
        q = _evens_then_odds(q, 2 * cos.shape[-1])
        k = k if k is None or not keys else _evens_then_odds(k, 2 * cos.shape[-1])
    return q, k


def _rotate_one(
    x: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    *args: Any,
    interleaved: bool,
    regrouped: bool,
    backend: str,
    unsqueeze_at: int,
    unsqueeze_default: int,
    **kwargs: Any,
) -> torch.Tensor:
    """posenc's rotation function of (x, cos, sin, ...), which the attention calls on q and on k in turn (Gemma 3n,
    Gemma 4): as ``_rotate_qk``, for one tensor."""
    cos, sin = _unsqueezed(cos, sin, args, kwargs, unsqueeze_at, unsqueeze_default)
    x = apply_rotary(x, cos, sin, interleaved=interleaved, backend=backend)
    return _evens_then_odds(x, 2 * cos.shape[-1]) if regrouped else x


class _QueriesThenKeys:
    """'consistent' mode's rotation function of (x, cos, sin, ...) for an attention forward that calls it on q and
    then, unless the layer reuses another layer's keys, on k (Gemma 3n, Gemma 4; the order is read from its source
    by ``posenc.interop.patch._require_queries_then_keys``): the first call of each forward rotates q as
    ``_rotate_one``, the second returns k unrotated, to be cached so and rotated at read
    (``_attend_with_rotated_keys``).

    The calls are counted per thread (the models patched alike share one, and a model may run in several threads):
    ``begin`` before each forward, ``calls_made`` after it. Under torch.compile they are counted in an attribute that
    Dynamo traces (it cannot trace a thread-local), so that the graph does not break in every attention layer: the
    count is then one of the traced code's order, which a compiled frame fixes when it is traced, whatever other
    threads or models do. rotate: ``_rotate_one`` with the layout's options bound.
    """

    def __init__(self, rotate: Callable[..., torch.Tensor]) -> None:
        self._rotate = rotate
        self._calls = threading.local()
        self._traced_calls = 0

    def begin(self) -> None:
        if compiling():
            self._traced_calls = 0
        else:
            _count_rotations(self._calls, reset=True)

    def calls_made(self) -> int:
        if compiling():
            return self._traced_calls
        return _count_rotations(self._calls, reset=False, advance=False)

    def __call__(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        if compiling():
            n, self._traced_calls = self._traced_calls, self._traced_calls + 1
            return _queries_only(self._rotate, n, x, cos, sin, *args, **kwargs)
        return _rotate_queries_only(self._rotate, self._calls, x, cos, sin, *args, **kwargs)


@compile_marks.disable(reason="posenc's 'consistent' mode counts each attention forward's rotation calls on the host")
def _count_rotations(calls: threading.local, *, reset: bool = False, advance: bool = True) -> int:
    """How many rotation calls this thread's attention forward has made (0 after ``reset``); ``advance`` counts
    one more, after the returned number."""
    n = 0 if reset else getattr(calls, "n", 0)
    calls.n = n + 1 if advance and not reset else n
    return n


@compile_marks.disable(reason="posenc's 'consistent' mode tells q from k by the order of the rotation calls")
def _rotate_queries_only(
    rotate: Callable[..., torch.Tensor],
    calls: threading.local,
    x: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    *args: Any,
    **kwargs: Any,
) -> torch.Tensor:
    return _queries_only(rotate, _count_rotations(calls), x, cos, sin, *args, **kwargs)


def _queries_only(
    rotate: Callable[..., torch.Tensor],
    n: int,
    x: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    *args: Any,
    **kwargs: Any,
) -> torch.Tensor:
    """x rotated where it is the forward's first rotation call (n = 0: the queries), x itself for the second (the
    keys), else a RuntimeError."""
    if n == 0:  # the queries
        return rotate(x, cos, sin, *args, **kwargs)
    if n == 1:  # the keys: cached unrotated, rotated at read
        return x
    raise RuntimeError(
        f"posenc's 'consistent' mode expected at most two rotation calls (q, then k) in an attention forward, got "
        f"{n + 1}; this transformers version's attention differs from the one posenc checked (patch with mode='hf')"
    )


def _unsqueezed(
    cos: torch.Tensor, sin: torch.Tensor, args: tuple, kwargs: Mapping[str, Any], at: int, default: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin with the head axis inserted where the replaced function's unsqueeze_dim says: positionally at
    ``at`` among the arguments after the tensors and cos/sin, by keyword, or ``default``."""
    unsqueeze_dim = kwargs.get("unsqueeze_dim", args[at] if len(args) > at else default)
    return cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)


def _evens_then_odds(x: torch.Tensor, r: int) -> torch.Tensor:
    """x (..., d) with its first r channels reordered 0, 2, 4, ..., 1, 3, 5, ... and the rest after them."""
    return torch.cat((x[..., 0:r:2], x[..., 1:r:2], x[..., r:]), dim=-1)
