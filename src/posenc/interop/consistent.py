"""'consistent' mode's keys rotated at read, and the marks on the KV cache that keep every key rotated exactly once.

With a type whose frequencies change with the length (``dynamic``, ``longrope``), a patched attention caches its keys
unrotated, and ``_KeysRotatedAtRead``, standing in for its ``ALL_ATTENTION_FUNCTIONS``, rotates all of them with the
frequencies of the current step (``_attend_with_rotated_keys``) and the RoPE that the attention module holds
(``ROPES_ATTR``), so one copy of the forward serves every model patched alike. ``_checking_the_cache`` wraps such a
forward: it refuses a cache of fixed-size layers (``StaticCache``) or one holding keys rotated when cached, and marks
the layers it fills as unrotated; ``_refusing_unrotated_keys`` wraps every other patched forward, which refuses
those layers. ``_handing_out_rotated_shared_keys`` rotates the keys Gemma 4 returns in ``shared_kv_states`` for its
assistant.

Shape key: b batch, h heads, s new tokens, t tokens in the cache (t >= s), d head dim.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import threading
import types
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn
from torch.utils.weak import WeakIdKeyDictionary

from posenc._checks import compiling, recording
from posenc.rope.apply import apply_rotary
from posenc.rope.module import RoPE, _keepable

# What transformers' continuous batching passes to the attention (its PagedAttentionCache's reads), 5.25.
_PAGED_ATTENTION_KWARGS = frozenset({"block_table", "read_index", "write_index"})


# The attribute of a patched attention module that holds the RoPE rotating its keys at read, by layer type ("" for a
# model with one rope dict): set by patch_model, removed by unpatch_model. On the module, not in the globals of the
# patched forward: that copy is shared by every model patched alike (one compiled graph), and a deepcopy of the model
# copies the module's RoPEs with it (functions are not copied: the copy rotated with the original's RoPE objects).
ROPES_ATTR = "_posenc_ropes"


def _module_ropes(module: nn.Module) -> Mapping[str, RoPE]:
    """The RoPEs by layer type that ``module`` (a patched attention module) rotates its keys with at read."""
    ropes = getattr(module, ROPES_ATTR, None)
    if ropes is None:
        raise RuntimeError(
            f"posenc's 'consistent' mode rotates the keys of an attention module patched by patch_model, and this "
            f"{type(module).__name__} holds no RoPE for it ({ROPES_ATTR}): call patch_model on the model it belongs to"
        )
    return ropes


def _attend_with_rotated_keys(
    attend: Callable[..., Any],
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    *args: Any,
    **kwargs: Any,
) -> Any:
    """'consistent' mode: rotate every key, cached ones included, with the frequencies of this step, then attend.

    module: the patched attention module, whose RoPEs by layer type (``ROPES_ATTR``; "" for a model with one) rotate
    the keys, its ``layer_type``'s where it has several.
    query: (b, h_q, s_q, d), already rotated; key: (b, h_k, t, d) unrotated, the t - s cached keys first (in Gemma 3n
    and Gemma 4's layers that reuse another layer's keys, that layer's, which are the same tokens'); position_ids
    (b or 1, s): the new tokens'. s_q is s but in Gemma 4's layers that reuse keys, which in generate's prefill get
    the queries of the last tokens only (its logits_to_keep) and every new token's keys and position_ids. The cached
    keys' positions continue backwards from the first new token's. In rows with left padding that count reaches
    below 0 exactly on the pad slots, which the mask hides; they are rotated as position 0 (RoPE takes no negative
    positions), which changes no score that is used.
    """
    position_ids = kwargs.get("position_ids")
    if position_ids is None:
        raise RuntimeError(
            "posenc's 'consistent' mode needs the position_ids the model passes to its attention; this model did "
            "not pass them (patch with mode='hf')"
        )
    new, total = position_ids.shape[-1], key.shape[-2]  # not the queries': Gemma 4 may have fewer (see above)
    paged = sorted(_PAGED_ATTENTION_KWARGS & kwargs.keys())
    if total > new and paged:
        # Continuous batching (generate_batch) packs several requests' keys into one row, read from a paged cache
        # that is no transformers Cache: counting positions back from the first new token rotated them wrongly.
        raise TypeError(
            "posenc's 'consistent' mode cannot serve a paged KV cache (continuous batching, generate_batch: the "
            f"attention got {', '.join(paged)}), whose keys of several requests share one row; patch with "
            "mode='hf', or use generate with a DynamicCache"
        )
    ropes = _module_ropes(module)
    rope = ropes[""] if "" in ropes else ropes[module.layer_type]
    key = _rotate_keys_for_step(rope, _unrotated(key), position_ids)
    return attend(module, query, key, value, attention_mask, *args, **kwargs)


def _key_positions(position_ids: torch.Tensor, total: int) -> torch.Tensor:
    """The positions (b or 1, total) of ``total`` keys whose last ``s`` are the new tokens' (position_ids: (b or 1,
    s)): the cached ones count back from the first new token's, clamped at 0 (left padding's slots, masked)."""
    new = position_ids.shape[-1]
    if total <= new:
        return position_ids
    past = position_ids[:, :1] - (total - new) + torch.arange(total - new, device=position_ids.device)
    return torch.cat((past.clamp_min(0), position_ids), dim=-1)


def _rotate_keys_for_step(rope: RoPE, key: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
    """key (b, h_k, t, d), whose last s are the new tokens' (position_ids (b or 1, s)), rotated at the keys'
    positions (``_key_positions``) with the frequencies for max(position_ids) + 1."""
    dtype = torch.float64 if key.dtype == torch.float64 else torch.float32
    cos, sin = _keys_cos_sin(rope, position_ids, key.shape[-2], dtype)
    return apply_rotary(key, cos.unsqueeze(1), sin.unsqueeze(1), interleaved=rope.interleaved, backend=rope.backend)


def _step_keys_cos_sin(
    rope: RoPE, position_ids: torch.Tensor, total: int, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin (b or 1, t, r/2) of the keys' positions (``_key_positions``) with the frequencies for
    max(position_ids) + 1.

    Inside torch.compile with no graph break (``RoPE.step_cos_sin_in_graph``): a break here, in every attention
    layer, made Dynamo compile each layer's attention forward as a frame of its own, guarded on its layer_idx and
    its cache layer, 3 x num_hidden_layers times, past the recompile limit (8) from 3 layers on."""
    key_positions = _key_positions(position_ids, total)
    if not compiling():
        return rope.cos_sin(key_positions, seq_len=rope.scaling_length(position_ids), dtype=dtype)
    # The key positions' maximum is the new tokens' (the cached ones count back from the first new one), but the
    # length is read from position_ids, as the eager path does.
    return rope.step_cos_sin_in_graph(key_positions, position_ids, dtype)


# This thread's cos/sin of the keys' positions, by the position_ids they were made for (dropped with them): every
# attention layer of a forward gets the same position_ids and rotates its keys with the same RoPE (or one per layer
# type), so the first layer computes them and the others read them. Computed in each of 12 layers, a decode step
# read the step's length and the positions' extent on the host 24 times (a device sync each on CUDA) and took the
# float64 cos/sin of every cached position 12 times.
_SHARED = threading.local()


def _keys_cos_sin(
    rope: RoPE, position_ids: torch.Tensor, total: int, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """``_step_keys_cos_sin``, computed once per (RoPE, key count, dtype) for these position_ids, as long as they
    are unchanged (their version counter) and ``forget_keys_cos_sin`` has not dropped them. Not shared while traced
    (torch.compile, make_fx), inside a torch.func transform, under a FakeTensorMode or in a CUDA graph capture (see
    ``posenc.rope.module._keepable``): there each layer computes its own."""
    if compiling() or recording() or not _keepable():
        return _step_keys_cos_sin(rope, position_ids, total, dtype)
    memo = _shared_memo()
    # An inference tensor has no version counter; inference_mode is in the key, since a cos/sin made there cannot
    # be saved for backward by a call outside it.
    version = None if position_ids.is_inference() else position_ids._version
    wanted = (total, dtype, torch.is_inference_mode_enabled(), version)
    made = memo.get(position_ids)
    if made is None:
        made = memo[position_ids] = []
    for owner, key, cos, sin in made:
        if owner is rope and key == wanted:
            return cos, sin
    cos, sin = _step_keys_cos_sin(rope, position_ids, total, dtype)
    made.append((rope, wanted, cos, sin))
    return cos, sin


def _shared_memo() -> WeakIdKeyDictionary:
    memo = getattr(_SHARED, "memo", None)
    if memo is None:
        memo = _SHARED.memo = WeakIdKeyDictionary()
    return memo


def forget_keys_cos_sin(position_ids: torch.Tensor) -> None:
    """Drop this thread's shared cos/sin for ``position_ids``: called where a forward starts (its rotary
    embedding), so that an inference tensor reused for the next call, changed in place with no version counter to
    show it, gets its cos/sin anew."""
    if not compiling():
        memo = getattr(_SHARED, "memo", None)
        if memo is not None:
            memo.pop(position_ids, None)


class _KeysRotatedAtRead:
    """Stands in for ``ALL_ATTENTION_FUNCTIONS`` inside a patched attention forward ('consistent' mode). Holds no
    RoPE: the attention function is called with the module, which holds them (``ROPES_ATTR``)."""

    def __init__(self, functions: Any) -> None:
        self._functions = functions

    def get_interface(self, implementation: str, default: Callable[..., Any]) -> Callable[..., Any]:
        return functools.partial(_attend_with_rotated_keys, self._functions.get_interface(implementation, default))


_SHARED_KV_STATES = "shared_kv_states"


def argument_position(forward: Callable[..., Any], name: str) -> int | None:
    """Where a call of the method ``forward`` passes its parameter ``name`` positionally: the index in its args
    after self, or None if it has no such parameter."""
    parameters = list(inspect.signature(forward).parameters)
    return parameters.index(name) - 1 if name in parameters else None


def argument(args: tuple, kwargs: Mapping[str, Any], name: str, position: int | None) -> Any:
    """The value a call (args after self, kwargs) gives the parameter ``name`` at ``position``
    (``argument_position``), by keyword or positionally; None where it gives none."""
    if name in kwargs:
        return kwargs[name]
    return args[position] if position is not None and 0 <= position < len(args) else None


def _handing_out_rotated_shared_keys(forward: types.FunctionType) -> types.FunctionType:
    """Gemma 4: ``forward`` (an attention whose class takes ``shared_kv_states``) that, in the model's last layer and
    when the forward was asked to ``return_shared_kv_states``, replaces each layer type's keys in that dict by the
    keys rotated as this step's attention rotated them (the module's RoPEs, ``ROPES_ATTR``, the step's frequencies).

    The storing layers put their unrotated keys there, which the reusing layers rotate at read; after the last
    layer nothing of the model reads them but a layer recomputed by gradient checkpointing, which is given the
    unrotated keys they were rotated from (``_unrotated``), and the caller (``generate(assistant_model=...)``'s
    Gemma 4 assistant) reads them as rotated keys, as transformers' target hands them out. New tensors: the cache's
    own are kept."""
    position = argument_position(forward, _SHARED_KV_STATES)

    @functools.wraps(forward)
    def handing_out(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        out = forward(self, *args, **kwargs)
        if not kwargs.get("return_shared_kv_states") or not _is_last_layer(self):
            return out
        shared = argument(args, kwargs, _SHARED_KV_STATES, position)
        if shared is None:  # no dict, so none is returned
            return out
        position_ids = kwargs["position_ids"]  # there: the attention has rotated its keys with them
        ropes = _module_ropes(self)
        for layer_type, (key, *rest) in list(shared.items()):
            rope = ropes[""] if "" in ropes else ropes[layer_type]
            # Rotated already where this forward is recomputed (gradient checkpointing): from the same keys again,
            # since the recomputation must save what the forward saved.
            key = _unrotated(key)
            rotated = _rotate_keys_for_step(rope, key, position_ids)
            if not compiling():
                _HANDED_OUT[rotated] = key
            shared[layer_type] = (rotated, *rest)
        return out

    return handing_out


# The keys ``_handing_out_rotated_shared_keys`` put in shared_kv_states, by the unrotated ones they were rotated from.
# Gradient checkpointing recomputes the layers that reuse those keys during the backward, after the forward has
# returned, and they read them from that same dict: rotated once more, the recomputed scores differed from the
# forward's and the gradients were silently wrong (up to 1.7 on a tiny Gemma 4). Not per thread: the backward may
# run in autograd's device threads.
_HANDED_OUT = WeakIdKeyDictionary()


def _unrotated(key: torch.Tensor) -> torch.Tensor:
    """key as the attention rotates it at read: the unrotated key where ``key`` is one that
    ``_handing_out_rotated_shared_keys`` handed out (a layer reusing it, recomputed), else key itself."""
    return key if compiling() or not _HANDED_OUT else _HANDED_OUT.get(key, key)  # empty: ~0.1 us, not ~0.6


def _is_last_layer(module: nn.Module) -> bool:
    """True for the attention of the model's last decoder layer (its ``layer_idx`` is ``num_hidden_layers - 1``)."""
    layers = getattr(getattr(module, "config", None), "num_hidden_layers", None)
    return isinstance(layers, int) and getattr(module, "layer_idx", None) == layers - 1


def _cache_class() -> type | None:
    """transformers' ``Cache`` base class, or None in a version without one."""
    cache_cls = getattr(importlib.import_module("transformers.cache_utils"), "Cache", None)
    return cache_cls if isinstance(cache_cls, type) else None


def _caches_in(cache_cls: type, args: tuple, kwargs: Mapping[str, Any]) -> list[Any]:
    """The caches among a forward's arguments. Found by type, not by name: transformers has called the argument
    past_key_values, cache and (in GPT-NeoX) layer_past, positionally or by keyword."""
    return [value for value in (*args, *kwargs.values()) if isinstance(value, cache_cls)]


def _checking_the_cache(forward: types.FunctionType) -> types.FunctionType:
    """'consistent' mode: ``forward`` preceded by ``_require_growing_cache`` and ``_require_unrotated_keys`` on the
    cache it is given, and followed by marking the cache layer as holding unrotated keys."""
    cache_utils = importlib.import_module("transformers.cache_utils")
    cache_cls, growing_layer = _cache_class(), getattr(cache_utils, "DynamicLayer", None)
    if cache_cls is None or not isinstance(growing_layer, type):
        raise ValueError(
            "transformers.cache_utils has no Cache / DynamicLayer; mode='consistent' is not supported for this "
            "transformers version (use mode='hf')"
        )

    @functools.wraps(forward)
    def checked(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        caches = _caches_in(cache_cls, args, kwargs)
        layer = getattr(self, "layer_idx", None)
        for cache in caches:
            _require_growing_cache(cache, growing_layer)
            if isinstance(layer, int):
                _require_unrotated_keys(cache, layer)
        out = forward(self, *args, **kwargs)
        if isinstance(layer, int):
            for cache in caches:
                cache.__dict__.setdefault(_MARKS_ATTR, {})[layer] = _UNROTATED
        return out

    return checked


def _refusing_unrotated_keys(forward: types.FunctionType) -> types.FunctionType:
    """A forward that caches keys rotated ('hf' mode, or 'consistent' with a fixed type): ``forward`` preceded by
    ``_require_rotated_keys`` on the cache it is given. Unchanged in a transformers version without ``Cache``."""
    cache_cls = _cache_class()
    if cache_cls is None:
        return forward

    @functools.wraps(forward)
    def checked(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        layer = getattr(self, "layer_idx", None)
        if isinstance(layer, int):
            for cache in _caches_in(cache_cls, args, kwargs):
                _require_rotated_keys(cache, layer)
        return forward(self, *args, **kwargs)

    return checked


# A cache's {layer index: _UNROTATED} for the layers a 'consistent' forward (keys rotated at read) filled.
_MARKS_ATTR = "_posenc_unrotated_keys"


class _UnrotatedKeys:
    """What a 'consistent' forward leaves on the cache layers it fills: their keys are unrotated. Copied as itself.

    Unrotated keys are the key projections alone, the same whichever RoPE rotates them, so any 'consistent' forward
    of the model may continue them: the same patch, a copy of the model, or the model patched again."""

    def __copy__(self) -> _UnrotatedKeys:
        return self

    def __deepcopy__(self, memo: dict[int, Any]) -> _UnrotatedKeys:
        return self


_UNROTATED = _UnrotatedKeys()


def _held_keys(cache: Any, layer: int) -> int:
    """How many keys ``cache`` holds for ``layer`` (0 for a layer it has not built yet, or a ``DummyLayer``)."""
    layers = getattr(cache, "layers", ()) or ()
    if layer >= len(layers) or _is_dummy(layers[layer]):
        return 0
    return cache.get_seq_length(layer)


def _is_dummy(layer: Any) -> bool:
    """True for transformers' ``DummyLayer``, which stands in a cache for a layer that caches nothing (Gemma 3n and
    Gemma 4's layers that reuse another layer's keys) and holds no keys to misplace. Known by having no
    get_seq_length, which every cache layer that holds keys has: no import, which torch.compile would not trace."""
    return not callable(getattr(layer, "get_seq_length", None))


def _marked_unrotated(cache: Any, layer: int) -> bool:
    # isinstance, not identity: a pickled and loaded cache holds a new instance.
    return isinstance((getattr(cache, _MARKS_ATTR, None) or {}).get(layer), _UnrotatedKeys)


def _require_unrotated_keys(cache: Any, layer: int) -> None:
    """Raise unless the keys ``cache`` holds for ``layer`` (if any) were put there by a 'consistent' forward: any
    others were rotated when cached (before patch_model, after unpatch_model, or by a model patched with mode='hf'),
    and would be rotated twice."""
    held = _held_keys(cache, layer)
    if held and not _marked_unrotated(cache, layer):
        raise ValueError(
            f"this {type(cache).__name__} holds {held} keys for layer {layer} that posenc's mode='consistent' did not "
            "cache: they are rotated already (cached before patch_model, after unpatch_model, or by a model patched "
            "with mode='hf' or with a rope type whose keys are rotated when cached), and consistent mode keeps keys "
            "unrotated and rotates them at read, so they would be rotated twice. Start a new cache for this model, "
            "or patch it with mode='hf', which continues such a cache"
        )


def _require_rotated_keys(cache: Any, layer: int) -> None:
    """Raise if ``cache`` holds keys for ``layer`` that a 'consistent' forward cached unrotated: a forward that
    rotates keys when it caches them would attend to them unrotated. A layer emptied since (``cache.reset()``) is
    unmarked, as this forward fills it with rotated keys."""
    if not _marked_unrotated(cache, layer):
        return
    held = _held_keys(cache, layer)
    if not held:
        del cache.__dict__[_MARKS_ATTR][layer]
        return
    raise ValueError(
        f"this {type(cache).__name__} holds {held} keys for layer {layer} that posenc's mode='consistent' cached "
        "unrotated (it rotates them at read, with each step's frequencies); this model rotates keys when it caches "
        "them and would attend to those unrotated. Continue the cache with a model patched with mode='consistent' "
        "and a rope type whose frequencies change with the length ('dynamic', 'longrope'), or start a new cache"
    )


def _require_growing_cache(cache: Any, growing_layer: type) -> None:
    """Raise TypeError unless every layer of ``cache`` appends new keys after the cached ones (a ``DynamicLayer``,
    sliding or quantized) or holds none (a ``DummyLayer``); a fixed-size layer (``StaticLayer``) returns its whole
    buffer, whose slots do not sit at the positions that 'consistent' mode counts back from the new tokens."""
    kinds = {type(layer) for layer in getattr(cache, "layers", None) or () if not _is_dummy(layer)}
    replicate = getattr(cache, "layer_class_to_replicate", None)
    if isinstance(replicate, type):  # the class of the layers a lazily built cache will add
        kinds.add(replicate)
    fixed = sorted(kind.__name__ for kind in kinds if not issubclass(kind, growing_layer))
    if fixed:
        raise TypeError(
            "posenc's mode='consistent' rotates every cached key at read and needs a cache that returns the past "
            f"keys in order without gaps, like DynamicCache; got a {type(cache).__name__} with {', '.join(fixed)} "
            "layers, whose fixed-size buffers would give the keys wrong positions. Use a DynamicCache (generate's "
            "default: drop cache_implementation='static') or patch the model with mode='hf'"
        )
