"""Run a loaded ``transformers`` model's RoPE through posenc, in place: ``patch_model`` / ``unpatch_model``.

What is replaced, per patched model and nothing else in the process:

* the model's ``*RotaryEmbedding`` modules become ``PosencRotaryEmbedding``s (one per config the modules were built
  from, with one RoPE per layer type where the config has a rope dict per type): cos/sin of shape (b, s, r/2) in
  float32, from float64 angles (``posenc.rope.module.angles_to_cos_sin``), instead of Hugging Face's (b, s, r);
* each attention module gets an instance-level ``forward``: a copy of its class's forward function whose globals
  resolve its ``apply_rotary_pos_emb*`` functions to posenc's rotation (``posenc.apply_rotary_qk``, any backend),
  each in the pair layout the original was found to rotate in. The class, the modeling module and every other
  model of the same class are untouched, and the copy is plain Python, so ``torch.compile`` traces it like the
  original.

Which modules and functions these are is found by inspecting the model (``posenc.interop._discover``), so any
architecture that follows transformers' RoPE conventions can be patched; ``VERIFIED_ARCHITECTURES`` are those whose
patched logits the tests compare, ``SUPPORTED_ARCHITECTURES`` those ``tiny_model_from_config`` builds and whose
rotary dim ``rope_parameters`` may change.

In ``mode="consistent"`` with a type whose frequencies change with the length (``dynamic``, ``longrope``), keys go
into the KV cache unrotated and the attention rotates all of them at read with the frequencies of the current
step (the copy's ``ALL_ATTENTION_FUNCTIONS`` is wrapped for that), so every score of a step uses one set of
frequencies and cached decoding equals a full forward pass. This needs a cache that returns the past keys in order
without gaps (``DynamicCache``, what ``generate`` uses by default, sliding-window layers included). A
``StaticCache`` returns its whole fixed-size buffer, so the keys' positions cannot be counted back from the new
tokens: the patched attention raises a TypeError when it is given one in that mode (``mode="hf"`` takes it). The
cache layers it fills are marked as unrotated: every patched attention reads the mark, so that one rotating keys at
read refuses keys rotated when cached and one rotating them when cached refuses unrotated ones (the unpatched model
does not read it).

Before anything is replaced, the posenc RoPE is checked against the model's own rotary embedding (the same number
of frequencies, the same inv_freq within the buffer's rounding, the same attention scaling) and each rotation
function is run against posenc's rotation; a mismatch is an error, never a silently different model.

Shape key: b batch, h heads, s new tokens, t tokens in the cache (t >= s), d head dim, r rotary dim.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import importlib
import math
import os
import types
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal

import torch
from torch import nn

from posenc import _compile_marks as compile_marks
from posenc.interop._discover import (
    ModelRope,
    Rotation,
    buffer_order,
    find_rope_modules,
    forward_scaling,
    innermost,
    probe_rotation,
    rotation_signature,
    state_name,
)
from posenc.interop.hf import read_config_json, rope_kwargs_from_config, rope_layer_types
from posenc.rope.apply import apply_rotary, apply_rotary_qk
from posenc.rope.frequencies import SEQ_LEN_DEPENDENT, float32_blend_rtol
from posenc.rope.module import RoPE, angles_to_cos_sin
from posenc.rope.mrope import MRoPE, mrope_cos_sin

# The model types whose code reads the rope dict only in the rotary embedding, so that rope_parameters= may change
# it in place (saved and reloaded with every rope type in tests/interop/test_patch.py), whose attention hands keys
# to the attention function with the rotated channels first ('consistent' mode), and that tiny_model_from_config
# builds.
SUPPORTED_ARCHITECTURES: tuple[str, ...] = ("gemma", "gpt_neox", "llama", "mistral", "phi3", "qwen2", "qwen3")
# Architectures whose apply_rotary_pos_emb rotates all head_dim channels (no pass-through part): a rotary dim below
# head_dim crashes their unpatched forward, so a saved config asking for one would not load into a working model.
_WHOLE_HEAD_ATTENTION = frozenset({"gemma", "llama", "mistral", "qwen2", "qwen3"})
# The model types whose patched tiny models give the unpatched logits, full forward and cached decoding, in
# tests/interop/test_patch_architectures.py and test_patch_multimodal.py (transformers 5.25; `python
# scripts/patch_coverage.py` lists the first). Others that pass patch_model's checks are patched with a warning.
VERIFIED_ARCHITECTURES: frozenset[str] = frozenset(
    {
        *("afmoe", "apertus", "apertus1p5_text", "arcee", "aria_text", "axk1", "axk2", "bailing_hybrid", "beam"),
        *("bitnet", "cohere", "cohere2", "cohere2_moe", "cwm", "deepseek_v3", "deepseek_v32", "diffllama", "doge"),
        *("dory", "dots1", "ergo", "ernie4_5", "ernie4_5_moe", "exaone4", "exaone_moe", "falcon", "flex_olmo", "flint"),
        *("gemma", "gemma2", "gemma3_text", "gemma3n_text", "gemma4_text", "gemma4_unified_text", "glm", "glm4"),
        *("glm4_moe", "glm4_moe_lite", "glm_moe_dsa", "gpt_neox"),
        *("gpt_neox_japanese", "gpt_oss", "granite", "granite_swa", "granitemoe", "granitemoe_swa", "granitemoeshared"),
        *("helium", "hrm_text", "hunyuan_v1_dense", "hunyuan_v1_moe", "hy_v3", "hy_v4", "hyperclovax", "jais2"),
        *("jetmoe", "kolibri1", "laguna", "lara_mini", "lfm2", "lfm3", "llama", "mellum", "mimo_v2_flash", "minicpm3"),
        *("minicpm5_moe", "minimax", "minimax_m2", "ministral", "ministral3", "mistral", "mixtral"),
        *("modernbert-decoder", "moshi", "nemotron", "olmo", "olmo2", "olmo3", "olmo_hybrid", "olmoe", "persimmon"),
        *("phi", "phi3", "phimoe", "qwen2", "qwen2_moe", "qwen3", "qwen3_5_moe_text", "qwen3_5_text", "qwen3_moe"),
        *("qwen3_next", "seed_oss", "smollm3", "solar_open", "stablelm", "starcoder2", "vaultgemma", "youtu", "zaya"),
        # vision-language models, their text model's M-RoPE (tests/interop/test_patch_multimodal.py)
        *("ernie4_5_vl_moe", "glm4v", "glm4v_moe", "glm_ocr", "paddleocr_vl", "qwen2_5_omni_thinker", "qwen2_5_vl"),
        *("qwen2_vl", "qwen3_vl", "qwen3_vl_moe"),
    }
)
# inv_freq agreement with a float32 frequency buffer: transformers' float32 pow is off by up to
# (ln(base) + 8) * 2**-24 relative (~1.3e-6 at base 5e5), plus float32_blend_rtol for YaRN without truncation and
# Llama 3 (4.6e-5 for YaRN at factor 256, 1.3e-5 for Llama 3.1's); a wrong rotary dim, base or scaling is off by far
# more.
_FREQUENCY_RTOL = 1e-5

# The names a patched attention forward resolves differently from its modeling module.
_ATTENTION_REGISTRY_NAME = "ALL_ATTENTION_FUNCTIONS"
_STATE_ATTR = "_posenc_patch"


@dataclasses.dataclass(frozen=True)
class PatchReport:
    """What ``patch_model`` did. architecture: the config's model_type; rope_type ... backend: the installed
    ``RoPE``'s settings; rotary_modules: the names of the replaced rotary embedding modules; attention_modules: how
    many attention modules rotate with posenc; config_changed: True when ``model.config`` was rewritten;
    rope_parameters: the rope dict after patching (a composite model's text config's); rotations: each replaced
    rotation function's name and the layout it was found to rotate in ("split-half", "interleaved", or "interleaved,
    returned evens then odds"); interleaved is the config's layout, which a model whose functions differ (DeepSeek's
    split-half and interleaved ones) does not follow everywhere. For a config with a rope dict per layer type,
    rope_type lists each type's ("full_attention: linear, sliding_attention: default") and head_dim / rotary_dim
    are the first type's."""

    architecture: str
    rope_type: str
    head_dim: int
    rotary_dim: int
    interleaved: bool
    mode: str
    backend: str
    rotary_modules: tuple[str, ...]
    attention_modules: int
    config_changed: bool
    rope_parameters: Mapping[str, Any]
    rotations: Mapping[str, str] = dataclasses.field(default_factory=dict)

    def __str__(self) -> str:
        config = f"; config.rope_parameters = {dict(self.rope_parameters)}" if self.config_changed else ""
        return (
            f"posenc patched {self.architecture}: {', '.join(self.rotary_modules)} and {self.attention_modules} "
            f"attention modules -> rope_type={self.rope_type!r}, rotary_dim={self.rotary_dim}/{self.head_dim}, "
            f"interleaved={self.interleaved}, mode={self.mode!r}, backend={self.backend!r}{config}"
        )


@dataclasses.dataclass
class _PatchState:
    """What ``unpatch_model`` puts back."""

    report: PatchReport
    rotary: list[tuple[nn.Module, str, nn.Module]]  # (parent, attribute, original module)
    attention: list[nn.Module]
    config: Any
    original_config_values: dict[str, Any]  # attribute -> its value before patching
    weights_dtype: torch.dtype | None  # the model's floating parameters' dtype when patched
    # Set by unpatch_model. A shallow copy (copy.copy) of a patched model shares its modules and this state: once
    # either is unpatched, so is the other, which must then say so rather than try to undo it again.
    undone: bool = False


def _patch_state(model: nn.Module) -> _PatchState | None:
    """The state of the patch in force on ``model``, or None."""
    state: _PatchState | None = getattr(model, _STATE_ATTR, None)
    return None if state is None or state.undone else state


class _PickleGuard:
    """Held by each patched attention module, so that pickling it, or anything holding it (the model, a layer),
    is refused; copy.deepcopy keeps the patched forwards (it copies a bound method's function as is), and a guard.

    Pickle stores each attention module's instance forward (a copy of the class's, bound) by its name, so a loaded
    model would run the class's unpatched forward on posenc's cos/sin and fail in a shape mismatch."""

    def __reduce_ex__(self, protocol: Any) -> Any:
        raise TypeError(
            "a model patched by posenc cannot be pickled, nor can its patched layers (torch.save(model), "
            "multiprocessing, Ray): their patched attention forwards would load as the class's own, beside posenc's "
            "rotary module. Save the weights (model.save_pretrained or torch.save(model.state_dict())), or pickle "
            "the model before patch_model / after unpatch_model(model), and call patch_model again where it is loaded"
        )

    def __copy__(self) -> _PickleGuard:
        return self

    def __deepcopy__(self, memo: dict[int, Any]) -> _PickleGuard:
        return self


_GUARD_ATTR = "_posenc_patched_forward"


def _weights_dtype(model: nn.Module) -> torch.dtype | None:
    return next((p.dtype for p in model.parameters() if p.is_floating_point()), None)


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
        for layer_type, each in self._ropes().items():
            inv_freq, attention_factor = each.frequencies()
            self.register_buffer(state_name(layer_type, "inv_freq"), inv_freq.to(torch.float64), persistent=False)
            self.attention_factors[layer_type] = float(attention_factor)

    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True) -> PosencRotaryEmbedding:
        # model.half() / .to(bfloat16) cast every float buffer; the frequencies must stay float64 (a bf16 inv_freq
        # is off by 2**-9, i.e. whole turns at position 1e4), so only the device move is kept. They are made
        # afresh from the RoPE: a model built on the meta device and moved with to_empty() has no values to keep.
        super()._apply(fn, recurse)
        for layer_type, rope in self._ropes().items():
            name = state_name(layer_type, "inv_freq")
            device = self._buffers[name].device
            self._buffers[name] = rope.frequencies()[0].to(device=device, dtype=torch.float64)
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
        dtype = torch.float64 if x.dtype == torch.float64 else torch.float32
        if rope.rope_type in SEQ_LEN_DEPENDENT:
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


# What transformers' continuous batching passes to the attention (its PagedAttentionCache's reads), 5.25.
_PAGED_ATTENTION_KWARGS = frozenset({"block_table", "read_index", "write_index"})


def _attend_with_rotated_keys(
    attend: Callable[..., Any],
    rope: RoPE,
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    *args: Any,
    **kwargs: Any,
) -> Any:
    """'consistent' mode: rotate every key, cached ones included, with the frequencies of this step, then attend.

    query: (b, h_q, s, d), already rotated; key: (b, h_k, t, d) unrotated, the t - s cached keys first. The cached
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
    new, total = query.shape[-2], key.shape[-2]
    key_positions = position_ids
    paged = sorted(_PAGED_ATTENTION_KWARGS & kwargs.keys())
    if total > new and paged:
        # Continuous batching (generate_batch) packs several requests' keys into one row, read from a paged cache
        # that is no transformers Cache: counting positions back from the first new token rotated them wrongly.
        raise TypeError(
            "posenc's 'consistent' mode cannot serve a paged KV cache (continuous batching, generate_batch: the "
            f"attention got {', '.join(paged)}), whose keys of several requests share one row; patch with "
            "mode='hf', or use generate with a DynamicCache"
        )
    if total > new:
        past = position_ids[:, :1] - (total - new) + torch.arange(total - new, device=position_ids.device)
        key_positions = torch.cat((past.clamp_min(0), position_ids), dim=-1)
    key = _rotate_keys_for_step(rope, key, key_positions, position_ids)
    return attend(module, query, key, value, attention_mask, *args, **kwargs)


@compile_marks.disable(
    reason="'consistent' mode reads the step's length, max(position_ids) + 1, on the host; compile the patched model "
    "without fullgraph=True (the length is then read in this graph break, in each attention layer)"
)
def _rotate_keys_for_step(
    rope: RoPE, key: torch.Tensor, key_positions: torch.Tensor, position_ids: torch.Tensor
) -> torch.Tensor:
    # Outside any torch.compile graph: a graph break in each attention layer (transformers' dynamic_rope_update
    # breaks once per forward, in the rotary embedding; the consistent mode's keys are rotated in every layer).
    return rope.rotate(key, key_positions, seq_len=rope.scaling_length(position_ids))


class _KeysRotatedAtRead:
    """Stands in for ``ALL_ATTENTION_FUNCTIONS`` inside a patched attention forward ('consistent' mode)."""

    def __init__(self, functions: Any, rope: RoPE) -> None:
        self._functions = functions
        self._rope = rope

    def get_interface(self, implementation: str, default: Callable[..., Any]) -> Callable[..., Any]:
        return functools.partial(
            _attend_with_rotated_keys, self._functions.get_interface(implementation, default), self._rope
        )


def _with_globals(func: types.FunctionType, replacements: Mapping[str, Any]) -> types.FunctionType:
    """A copy of ``func`` in which the global names in ``replacements`` resolve to the given objects.

    Decorators made with ``functools.wraps`` (transformers' ``deprecate_kwarg``) are copied too, each with a closure
    that calls the copy below it, so the copy behaves as the original in everything else.
    """
    inner = getattr(func, "__wrapped__", None)
    if inner is None:
        namespace = dict(func.__globals__)
        namespace.update(replacements)
        # Without __name__, torch.compile guards these globals through this dict; with it, dynamo would look
        # the names up in the modeling module (sys.modules[__name__]) and find transformers' functions there.
        namespace.pop("__name__", None)
        closure = func.__closure__
        new_func = types.FunctionType(func.__code__, namespace, func.__name__, func.__defaults__, closure)
    else:
        new_inner = _with_globals(inner, replacements)
        cells = func.__closure__ or ()
        slots = [i for i, cell in enumerate(cells) if _cell_holds(cell, inner)]
        if len(slots) != 1:
            raise ValueError(
                f"posenc cannot patch {func.__qualname__}: its decorator does not hold the wrapped function in a "
                "closure, so the copy posenc makes could not call posenc's rotation"
            )
        new_cells = tuple(types.CellType(new_inner) if i == slots[0] else cell for i, cell in enumerate(cells))
        new_func = types.FunctionType(func.__code__, func.__globals__, func.__name__, func.__defaults__, new_cells)
        new_func.__wrapped__ = new_inner
    new_func.__kwdefaults__ = copy.copy(func.__kwdefaults__)
    new_func.__qualname__ = func.__qualname__
    new_func.__module__ = func.__module__
    new_func.__doc__ = func.__doc__
    return new_func


def _cell_holds(cell: types.CellType, obj: object) -> bool:
    try:
        return cell.cell_contents is obj
    except ValueError:  # an empty cell
        return False


def _architecture(model: nn.Module) -> ModelRope:
    """The RoPE parts of a loaded transformers model; ValueError saying why posenc cannot patch it otherwise."""
    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", None)
    if not isinstance(model, nn.Module) or model_type is None:
        raise TypeError(
            f"model must be a loaded transformers model (an nn.Module with a .config), got {type(model).__name__}"
        )
    what = f"this {model_type} model ({type(model).__name__})"
    try:
        layer_types = rope_layer_types(config)
        rope_kwargs_from_config(config, layer_type=layer_types[0] if layer_types else None)
    except (ValueError, TypeError, KeyError, AttributeError, RuntimeError) as error:  # Gemma 4: per-layer sizes
        raise ValueError(f"posenc cannot patch {what}: {error}") from error
    try:
        return find_rope_modules(model, model_type)
    except ValueError as error:
        raise ValueError(f"posenc cannot patch {what}: {error}") from error


def _hf_rope_parameters(intended: RoPE, given: Mapping[str, Any]) -> dict[str, Any]:
    """The rope_parameters to write into a transformers config for a posenc spec (posenc-only types translated)."""
    params = dict(given)
    if intended.rope_type == "ntk":
        # Static NTK is plain RoPE with base * factor^(r/(r-2)) (posenc.rope.frequencies.ntk); the frequency check
        # in _new_config_rope proves the translation.
        r = intended.rotary_dim
        base = intended.base * float(intended.spec.params["factor"]) ** (r / (r - 2))
        params = {key: params[key] for key in ("partial_rotary_factor",) if key in params}
        params.update({"rope_type": "default", "rope_theta": base})
    return params


def _same_frequencies(a: RoPE, b: RoPE) -> bool:
    if (a.rotary_dim, a.interleaved) != (b.rotary_dim, b.interleaved):
        return False
    if (a.rope_type in SEQ_LEN_DEPENDENT) != (b.rope_type in SEQ_LEN_DEPENDENT):
        return False
    lengths = {a.max_position_embeddings, a.spec.params.get("original_max_position_embeddings")} - {None}
    for seq_len in [None, 1, *(n * k + extra for n in lengths for k, extra in ((1, 0), (1, 1), (2, 0), (8, 0)))]:
        (fa, sa), (fb, sb) = a.frequencies(seq_len), b.frequencies(seq_len)
        if not (torch.allclose(fa, fb, rtol=1e-12, atol=0.0) and math.isclose(sa, sb, rel_tol=1e-9)):
            return False
    return True


def _mrope_of(rope: RoPE) -> tuple[tuple[int, ...], str] | None:
    """(mrope_section, mrope_layout) of a multimodal RoPE, as the discovery helpers take it; None for plain RoPE."""
    return (rope.mrope_section, rope.mrope_layout) if isinstance(rope, MRoPE) else None


def _require_same_rotation(
    rope: RoPE, rotary: Sequence[tuple[str, nn.Module]], architecture: str, layer_type: str = ""
) -> None:
    """Raise ValueError unless ``rope`` rotates as each of the model's own rotary modules does.

    rotary: (name, ``*RotaryEmbedding`` module) pairs; layer_type: which of their per-layer-type states to read.
    Compared: the number of frequencies (r/2, so the rotary dim), inv_freq (r/2,) within the buffer's rounding, and
    the attention scaling. The modules' ``original_inv_freq`` is used where they have it: their ``inv_freq`` follows
    the dynamic NTK / LongRoPE state of the last call, while ``rope.frequencies()`` is the set for no length, as
    ``original_inv_freq`` is.
    """
    ours, factor = rope.frequencies()
    ours = ours[buffer_order(ours.numel(), _mrope_of(rope))]
    for name, module in rotary:
        theirs = getattr(module, state_name(layer_type, "original_inv_freq"), None)
        if not isinstance(theirs, torch.Tensor):
            theirs = getattr(module, state_name(layer_type, "inv_freq"), None)
        scaling = getattr(module, state_name(layer_type, "attention_scaling"), None)
        if not isinstance(theirs, torch.Tensor) or not isinstance(scaling, (int, float, torch.Tensor)):
            raise ValueError(
                f"posenc cannot patch this {architecture} model: its {type(module).__name__} ({name}) has no "
                f"{state_name(layer_type, 'inv_freq')} or {state_name(layer_type, 'attention_scaling')} to check "
                "posenc's RoPE against"
            )
        if theirs.is_meta:  # not materialised yet: nothing to compare
            continue
        # A model cast to bf16/fp16 casts these buffers too: allow their rounding.
        finfo = torch.finfo(theirs.dtype)
        rtol, atol = (
            max(_FREQUENCY_RTOL + float32_blend_rtol(rope.rope_type, rope.spec.params, rope.base), finfo.eps),
            finfo.tiny,
        )
        theirs = theirs.detach().to(device="cpu", dtype=torch.float64).flatten()
        scaling = forward_scaling(module, layer_type, default=float(scaling))
        problem = None
        if theirs.numel() != ours.numel():
            problem = (
                f"it has {theirs.numel()} frequencies (rotary dim {2 * theirs.numel()}), posenc {ours.numel()} "
                f"(rotary dim {rope.rotary_dim} of head_dim {rope.head_dim})"
            )
        elif not torch.allclose(ours, theirs, rtol=rtol, atol=atol):
            worst = ((ours - theirs).abs() / theirs.abs().clamp_min(atol)).max().item()
            problem = f"inv_freq differs by up to {worst:.3g} relative (allowed {rtol:.3g})"
        elif not math.isclose(factor, scaling, rel_tol=1e-6):
            problem = f"its attention scaling is {scaling!r}, posenc's {factor!r}"
        if problem is not None:
            what = f"layer_type={layer_type!r}, " if layer_type else ""
            raise ValueError(
                f"posenc's RoPE for this {architecture} config ({what}rope_type={rope.rope_type!r}) does not rotate "
                f"as the model's {type(module).__name__} ({name}) does: {problem}. Patching would change the model's "
                "logits, so the model is left as it was. posenc reads the config, the model rotates by what its "
                "rotary module was built with: if the config was changed after the model was built (model.config's "
                "rope_parameters or rope_theta edited, which transformers does not read back either, or a config "
                "object shared with a model patched with rope_parameters=), restore it, or load the model with the "
                "config you want (from_pretrained(..., config=config)), or change the scaling with "
                "patch_model(model, rope_parameters=...). Otherwise this is a gap in "
                "posenc.interop.rope_kwargs_from_config for this transformers version (please report it with the "
                "config's rope_parameters), unless the model's buffers hold no values yet (after to_empty(): patch "
                "before it, or once they are loaded)"
            )


def _config_errors() -> tuple[type[Exception], ...]:
    """What a config class raises for values it refuses: ValueError and kin, and huggingface_hub's strict dataclass
    validation error (Phi-3's validate_rope in transformers 5.x), which is none of them."""
    try:
        from huggingface_hub.errors import StrictDataclassError
    except ImportError:
        return (ValueError, TypeError, KeyError)
    return (ValueError, TypeError, KeyError, StrictDataclassError)


def _new_config_rope(
    config: Any,
    rope_parameters: Mapping[str, Any],
    *,
    mode: str,
    backend: str,
    architecture: str,
    rotary_cls: type[nn.Module],
) -> tuple[dict[str, Any], RoPE]:
    """Validate the requested rope_parameters and return (the config attributes to set, the RoPE to install).

    The RoPE is read back from a config rebuilt by the model's own config class from the new values, and must
    rotate exactly as requested and as a fresh ``rotary_cls`` built from that config does: that is what makes
    save_pretrained + from_pretrained reproduce the patched model.
    """
    if not isinstance(rope_parameters, Mapping):
        raise TypeError(
            "rope_parameters must be a dict like {'rope_type': 'yarn', 'factor': 4.0}, got "
            f"{type(rope_parameters).__name__}"
        )
    current = rope_kwargs_from_config(config)
    base_params = current["rope_parameters"]
    given = dict(rope_parameters)
    if "type" in given and "rope_type" not in given:  # the legacy spelling; transformers' configs want rope_type
        given["rope_type"] = given.pop("type")
    # Changing the scaling keeps the model's base and rotary fraction unless they are given.
    for key in ("rope_theta", "partial_rotary_factor"):
        if key not in given and key in base_params:
            given[key] = base_params[key]
    head_dim = current["head_dim"]
    intended = RoPE(
        head_dim,
        rope_parameters=given,
        max_position_embeddings=current["max_position_embeddings"],
        interleaved=current["interleaved"],
        mode=mode,
        backend=backend,
    )
    _require_whole_head(
        architecture, config, intended, "the saved model would not run. Drop partial_rotary_factor from rope_parameters"
    )
    hf_params = _hf_rope_parameters(intended, given)
    values: dict[str, Any] = {"rope_parameters": hf_params}
    # Phi-3 keeps original_max_position_embeddings at the top level, and transformers lets it win over the dict's.
    if "original_max_position_embeddings" in hf_params and hasattr(config, "original_max_position_embeddings"):
        values["original_max_position_embeddings"] = hf_params["original_max_position_embeddings"]
    try:
        rebuilt = type(config).from_dict({**config.to_dict(), **copy.deepcopy(values)})
        kwargs = rope_kwargs_from_config(rebuilt)
        installed = RoPE(kwargs.pop("head_dim"), mode=mode, backend=backend, **kwargs)
    except _config_errors() as error:
        detail = " ".join(str(error).split())
        raise ValueError(
            f"{type(config).__name__} cannot hold rope_parameters={hf_params}: {type(error).__name__}: {detail}. "
            "Saving the patched model would not reproduce it; choose a rope_type this architecture's config accepts"
        ) from error
    if not _same_frequencies(intended, installed):
        raise ValueError(
            f"{type(config).__name__} stores rope_parameters={hf_params} as {rebuilt.rope_parameters}, which rotates "
            "differently; saving the patched model would not reproduce it. Choose a rope_type this architecture's "
            "config accepts (e.g. Phi-3 takes only 'default' and 'longrope')"
        )
    _require_same_rotation(installed, [("built from the new config", rotary_cls(rebuilt))], architecture)
    values["rope_parameters"] = copy.deepcopy(rebuilt.rope_parameters)
    return values, installed


def _require_whole_head(architecture: str, config: Any, rope: RoPE, consequence: str) -> None:
    """A rotary dim below head_dim for an architecture whose attention rotates every channel is refused."""
    if architecture in _WHOLE_HEAD_ATTENTION and rope.rotary_dim != rope.head_dim:
        raise ValueError(
            f"{type(config).__name__}'s attention rotates all {rope.head_dim} channels of each head, so it cannot "
            f"hold partial_rotary_factor={rope.rotary_dim / rope.head_dim:g} (rotary dim {rope.rotary_dim}) with "
            f"rope_type {rope.rope_type!r}: {consequence}"
        )


def patch_model(
    model: nn.Module,
    *,
    backend: str = "auto",
    rope_parameters: Mapping[str, Any] | None = None,
    mode: Literal["hf", "consistent"] = "hf",
) -> PatchReport:
    """Replace the RoPE computation (cos/sin and the rotation) of a loaded ``transformers`` model with posenc's.

    model: a model whose attention rotates with transformers' ``apply_rotary_pos_emb`` convention (Llama,
    Mistral, Mixtral, Qwen2/3 and their MoE variants, Gemma 1-3, Phi, Phi-3 incl. LongRoPE, GPT-NeoX, StableLM,
    Cohere, GLM, DeepSeek-V3, OLMo, Granite and ~80 more in transformers 5.25; docs/scaling.md lists them; a
    composite model through its text config, with the multimodal RoPE of Qwen2-VL, Qwen3-VL, GLM-4V and kin as a
    ``posenc.MRoPE``, the vision tower left as it is), e.g.
    ``AutoModelForCausalLM.from_pretrained(...)``. What is replaced is found in the model and checked before it is
    touched: one ``*RotaryEmbedding`` class whose frequencies posenc's RoPE for the config reproduces, and the
    attention's rotation functions, each run on random q and k and required to equal posenc's rotation in one pair
    layout. Configs with a rope dict per layer type (Gemma 3) get one RoPE per type.
    backend: the rotation backend, as for ``posenc.apply_rotary`` ("auto", "torch", "triton", "cpu").
    rope_parameters: None keeps the model's RoPE (logits equal the unpatched model's within the dtype's tolerance);
    a dict such as ``{"rope_type": "yarn", "factor": 4.0}`` changes the scaling in place and rewrites
    ``model.config.rope_parameters`` to match, so ``save_pretrained`` + plain ``from_pretrained`` reproduce it.
    ``rope_theta`` and ``partial_rotary_factor`` default to the model's. Offered for ``SUPPORTED_ARCHITECTURES``,
    whose code reads the rope dict only in the rotary embedding; elsewhere (DeepSeek-V3's attention reads YaRN's
    mscale when built) load the model with the config you want and patch it with None. posenc's ``ntk`` is written
    as the equivalent ``default`` config with a larger ``rope_theta``.
    mode: "hf" (Hugging Face's numbers, also for ``dynamic`` / ``longrope`` with a KV cache) or "consistent" (keys
    cached unrotated and rotated at read with each step's frequencies, so cached decoding equals a full forward;
    it needs a ``DynamicCache``, and the patched attention raises TypeError when given a ``StaticCache`` or the
    paged cache of continuous batching; a cache it filled holds unrotated keys, which the model patched again in
    this mode continues and a patch that rotates keys when it caches them refuses: see ``unpatch_model`` for the
    unpatched model). For
    ``dynamic`` / ``longrope``, "consistent" is offered for ``SUPPORTED_ARCHITECTURES``, whose attention is known
    to hand its keys to the attention function with the rotated channels first.
    Returns a ``PatchReport``. Raises ValueError for a model posenc cannot patch (saying why), a model already
    patched, a rotary module with parameters (learned frequencies, which posenc's would drop), or a RoPE that would
    not rotate as the model's own does (all checked before anything is replaced);
    TypeError for an object that is no transformers model (no ``config``).
    """
    if isinstance(model, nn.Module):
        if _patch_state(model) is not None:
            raise ValueError("model is already patched by posenc; call unpatch_model(model) first")
        _require_no_patched_part(model)
    found = _architecture(model)
    model_type = found.model_type
    config = model.config
    groups = _rotary_groups(model, found)
    _require_no_parameters(model_type, groups)

    # Everything that can fail runs before the model or its config is touched. RoPE validates mode and backend.
    values: dict[str, Any] = {}
    if rope_parameters is None:
        installs = [
            (group_config, members, _ropes_for(group_config, members, model_type, mode=mode, backend=backend))
            for group_config, members in groups
        ]
        for group_config, _, ropes in installs:
            for rope in ropes.values():
                # transformers honours the factor for scaled types (not for 'default' in these architectures, nor
                # does posenc), builds fewer frequencies than the attention rotates, and fails with a size mismatch.
                _require_whole_head(
                    getattr(group_config, "model_type", model_type),  # a composite model's text config's
                    group_config,
                    rope,
                    "the unpatched model fails on it too, with a size mismatch in apply_rotary_pos_emb. Drop "
                    "partial_rotary_factor from the config's rope_parameters",
                )
    elif model_type not in SUPPORTED_ARCHITECTURES or len(groups) > 1 or rope_layer_types(config):
        # Other architectures may read the rope dict elsewhere when built (DeepSeek-V3's attention takes its softmax
        # scale from YaRN's mscale), so a rewritten config could reload as a different model than the patched one.
        raise ValueError(
            f"rope_parameters= changes the scaling of {', '.join(SUPPORTED_ARCHITECTURES)} models, whose code reads "
            f"the rope dict only in the rotary embedding; for this {model_type} model, set the config's rope "
            "parameters and load the model with that config (from_pretrained(..., config=config)), then patch it "
            "with rope_parameters=None"
        )
    else:
        values, rope = _new_config_rope(
            config, rope_parameters, mode=mode, backend=backend, architecture=model_type, rotary_cls=found.rotary_cls
        )
        installs = [(config, groups[0][1], {"": rope})]
    first_members, first_ropes = installs[0][1], installs[0][2]
    first = next(iter(first_ropes.values()))
    layer_type = next(iter(first_ropes)) or None
    # With rope_parameters the model's own rotary module stands for the old scaling: checked only for the layout.
    rotations = _probe_rotations(found, first_members[0][1], layer_type, first, same_rope=rope_parameters is None)
    keys_at_read = any(rope.rotates_cached_keys for _, _, ropes in installs for rope in ropes.values())
    if keys_at_read:
        _require_keys_at_read(found, rotations, [ropes for _, _, ropes in installs])
    forwards = {cls: _patched_forward(cls, rotations[cls], first, keys_at_read) for cls in found.calls}
    if model_type not in VERIFIED_ARCHITECTURES:
        warnings.warn(
            f"posenc checked this {model_type} model's frequencies and rotation functions, but its tests have not "
            f"compared a patched {model_type} model's logits with the unpatched one's; compare them on a few inputs "
            "before relying on the patch (posenc.interop.patch.VERIFIED_ARCHITECTURES lists the ones they have)",
            stacklevel=2,
        )

    layouts = {rotation.name: rotation.layout for per_class in rotations.values() for rotation in per_class}
    rope_config = installs[0][0]  # a composite model's text config
    report = PatchReport(
        architecture=model_type,
        rope_type=", ".join(f"{key}: {rope.rope_type}" if key else rope.rope_type for key, rope in first_ropes.items()),
        head_dim=first.head_dim,
        rotary_dim=first.rotary_dim,
        interleaved=first.interleaved,
        mode=mode,
        backend=backend,
        rotary_modules=tuple(name for _, members, _ in installs for name, _ in members),
        attention_modules=len(found.attention),
        config_changed=bool(values),
        rope_parameters=copy.deepcopy(values["rope_parameters"] if values else rope_config.rope_parameters),
        rotations=layouts,
    )
    replacements = []
    device = next((p.device for p in model.parameters()), torch.device("cpu"))
    for group_config, members, ropes in installs:
        replacement = PosencRotaryEmbedding(ropes if len(ropes) > 1 or "" not in ropes else ropes[""]).to(device)
        if hasattr(members[0][1], "config"):  # read by some models' forward (Granite-SWA keys cos/sin by its theta)
            replacement.config = group_config
        replacements.append((replacement, members))

    # Nothing below can fail: the model is changed only here.
    originals = {key: getattr(config, key) for key in values}  # _new_config_rope only sets existing attributes
    for key, value in values.items():
        setattr(config, key, value)
    named = dict(model.named_modules())
    swapped = []
    for replacement, members in replacements:
        for name, module in members:
            parent_name, _, attr = name.rpartition(".")
            setattr(named[parent_name], attr, replacement)
            swapped.append((named[parent_name], attr, module))
    for module in found.attention:
        # An instance attribute: nn.Module.__call__ finds it before the class's forward.
        module.forward = types.MethodType(forwards[type(module)], module)
        object.__setattr__(module, _GUARD_ATTR, _PickleGuard())

    state = _PatchState(report, swapped, list(found.attention), config, originals, _weights_dtype(model))
    object.__setattr__(model, _STATE_ATTR, state)
    return report


def _require_no_patched_part(model: nn.Module) -> None:
    """Raise ValueError where part of ``model`` was patched on its own (``patch_model(model.model)``), or ``model`` is
    part of a patched model: its rotary module is then posenc's, which has no transformers buffers to check against,
    and the error said only that."""
    for name, module in model.named_modules():
        if name and _patch_state(module) is not None:
            raise ValueError(
                f"model.{name} is already patched by posenc (patch_model was called on it); call "
                f"unpatch_model(model.{name}) first, or keep that patch and leave the whole model as it is"
            )
    for name, module in model.named_modules():
        if isinstance(module, PosencRotaryEmbedding):
            raise ValueError(
                f"model.{name} is posenc's rotary embedding: model is part of a model that posenc has patched (it "
                "shares that model's modules); call unpatch_model on the model that patch_model was called on first"
            )


def _rotary_groups(model: nn.Module, found: ModelRope) -> list[tuple[Any, list[tuple[str, nn.Module]]]]:
    """The rotary modules grouped by the config each was built from (the model's, or one of its own: Granite-SWA
    keeps one rotary embedding per rope_theta), the model's config first."""
    groups: dict[int, tuple[Any, list[tuple[str, nn.Module]]]] = {id(model.config): (model.config, [])}
    for name, module in found.rotary:
        own = getattr(module, "config", None)
        own = own if callable(getattr(own, "to_dict", None)) else model.config
        groups.setdefault(id(own), (own, []))[1].append((name, module))
    return [group for group in groups.values() if group[1]]


def _require_no_parameters(model_type: str, groups: Sequence[tuple[Any, Sequence[tuple[str, nn.Module]]]]) -> None:
    """Raise ValueError where a rotary module holds parameters (learned frequencies, an inv_freq made an
    nn.Parameter): the PosencRotaryEmbedding that replaces it computes fixed frequencies from the config, so the
    patched model would drop them from its parameters and their gradients (None, with no error) without a word."""
    for _, members in groups:
        for name, module in members:
            held = [parameter_name for parameter_name, _ in module.named_parameters()]
            if held:
                raise ValueError(
                    f"posenc cannot patch this {model_type} model: its {type(module).__name__} ({name}) holds "
                    f"parameters ({', '.join(held)}), learned rotary frequencies that posenc's rotary embedding, "
                    "computed from the config, would replace with fixed ones (their gradients lost); keep "
                    "transformers' rotary embedding for this model"
                )


def _ropes_for(
    config: Any, members: Sequence[tuple[str, nn.Module]], model_type: str, *, mode: str, backend: str
) -> dict[str, RoPE]:
    """posenc's RoPE for a config, one per layer type with a rope dict of its own (key "" for a config with one),
    each checked to rotate as the rotary modules built from that config do."""
    ropes = {}
    for layer_type in rope_layer_types(config) or ("",):
        kwargs = rope_kwargs_from_config(config, layer_type=layer_type or None)
        kind = MRoPE if "mrope_section" in kwargs else RoPE
        rope = kind(kwargs.pop("head_dim"), mode=mode, backend=backend, **kwargs)
        _require_same_rotation(rope, members, model_type, layer_type)
        if rope.rope_type == "dynamic" and mode == "hf":
            # Continue transformers' dynamic NTK state where the model left it (one per layer type).
            rope.hf_scaled_len = max(
                int(getattr(module, state_name(layer_type, "max_seq_len_cached"), module.max_seq_len_cached))
                for _, module in members
            )
        ropes[layer_type] = rope
    return ropes


def _probe_rotations(
    found: ModelRope, rotary: nn.Module, layer_type: str | None, rope: RoPE, *, same_rope: bool
) -> dict[type[nn.Module], tuple[Rotation, ...]]:
    """Each attention class's rotation functions, probed (``posenc.interop._discover.probe_rotation``) once each
    with cos/sin from ``rotary`` (for ``layer_type``) and heads of ``rope.head_dim`` channels; with ``same_rope``
    (``rope`` is to reproduce ``rotary``), at far positions against ``rope`` too.

    A rotary module that is not materialised (meta) cannot be run: the architectures posenc knows take their
    layout from the config then; any other is refused.
    """
    buffer = getattr(rotary, state_name(layer_type, "inv_freq"), None)
    runnable = not (isinstance(buffer, torch.Tensor) and buffer.is_meta)
    probed: dict[int, Rotation] = {}
    rotations = {}
    for cls, names in found.calls.items():
        namespace = innermost(cls.forward).__globals__
        per_class = []
        for name in names:
            function = namespace[name]
            if id(function) not in probed:
                try:
                    if runnable:
                        probed[id(function)] = probe_rotation(
                            name,
                            function,
                            rotary,
                            layer_type=layer_type,
                            head_dim=rope.head_dim,
                            mrope=_mrope_of(rope),
                            rope=rope if same_rope else None,
                        )
                    elif found.model_type in SUPPORTED_ARCHITECTURES:
                        probed[id(function)] = Rotation(
                            name, rope.interleaved, False, *rotation_signature(function, name)
                        )
                    else:
                        raise ValueError(
                            f"{type(rotary).__name__} is on the meta device, so {name} cannot be run to check it; "
                            "patch the model once its weights are loaded"
                        )
                except ValueError as error:
                    raise ValueError(
                        f"posenc cannot patch this {found.model_type} model's {cls.__name__}: {error}. The model is "
                        "left as it was"
                    ) from error
            per_class.append(probed[id(function)])
        rotations[cls] = tuple(per_class)
    return rotations


def _require_keys_at_read(
    found: ModelRope,
    rotations: Mapping[type[nn.Module], tuple[Rotation, ...]],
    installs: Sequence[Mapping[str, RoPE]],
) -> None:
    """'consistent' mode with a length-dependent type rotates cached keys at read, in the attention function, where
    posenc must know which channels of the key are the rotated ones and in which layout: refuse where it does not.
    installs: the RoPEs installed, per rotary config and layer type."""
    rope = next(rope for ropes in installs for rope in ropes.values() if rope.rotates_cached_keys)
    problem = None
    if len(installs) > 1 or "" not in installs[0]:
        problem = "it has more than one rope dict (per layer type, or rotary embeddings with configs of their own)"
    elif found.model_type not in SUPPORTED_ARCHITECTURES:
        problem = (
            f"posenc knows where the rotated channels sit in the keys the attention function gets only for "
            f"{', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    else:
        for cls, per_class in rotations.items():
            if len(per_class) != 1 or per_class[0].layout != ("interleaved" if rope.interleaved else "split-half"):
                problem = f"{cls.__name__} rotates with {', '.join(r.name for r in per_class)}"
    if problem is not None:
        raise ValueError(
            f"mode='consistent' with rope_type={rope.rope_type!r} rotates the cached keys at read, which posenc does "
            f"not do for this {found.model_type} model: {problem}. Patch it with mode='hf' (transformers' numbers)"
        )


def _patched_forward(
    cls: type[nn.Module], rotations: tuple[Rotation, ...], rope: RoPE, keys_at_read: bool
) -> types.FunctionType:
    """One copy of ``cls.forward`` per patched model and attention class, shared by its layers (one set of
    torch.compile guards), whose rotation functions are posenc's, each in the layout its original rotates in."""
    func = cls.forward
    namespace = innermost(func).__globals__
    replacements: dict[str, Any] = {}
    for rotation in rotations:
        options = dict(
            interleaved=rotation.interleaved,
            regrouped=rotation.regrouped,
            backend=rope.backend,
            unsqueeze_at=rotation.unsqueeze_at,
            unsqueeze_default=rotation.unsqueeze_default,
        )
        if rotation.tensors == 2:
            replacements[rotation.name] = functools.partial(_rotate_qk, keys=not keys_at_read, **options)
        elif keys_at_read:  # it cannot tell q from k, so it cannot leave the keys to be rotated at read
            raise ValueError(
                f"{cls.__qualname__} rotates q and k in separate calls of {rotation.name}; mode='consistent' is not "
                "supported for it (use mode='hf')"
            )
        else:
            replacements[rotation.name] = functools.partial(_rotate_one, **options)
    if keys_at_read:
        if _ATTENTION_REGISTRY_NAME not in namespace:
            raise ValueError(
                f"{cls.__qualname__}.forward does not use {_ATTENTION_REGISTRY_NAME}; mode='consistent' is not "
                "supported for it in this transformers version (use mode='hf')"
            )
        replacements[_ATTENTION_REGISTRY_NAME] = _KeysRotatedAtRead(namespace[_ATTENTION_REGISTRY_NAME], rope)
        return _checking_the_cache(_with_globals(func, replacements))
    return _refusing_unrotated_keys(_with_globals(func, replacements))


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
    """How many keys ``cache`` holds for ``layer`` (0 for a layer it has not built yet)."""
    return cache.get_seq_length(layer) if layer < len(getattr(cache, "layers", ()) or ()) else 0


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
    sliding or quantized); a fixed-size layer (``StaticLayer``) returns its whole buffer, whose slots do not sit
    at the positions that 'consistent' mode counts back from the new tokens."""
    kinds = {type(layer) for layer in getattr(cache, "layers", None) or ()}
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


def is_patched(model: nn.Module) -> bool:
    """True when ``patch_model`` patched this model and ``unpatch_model`` has not undone it."""
    return _patch_state(model) is not None


def unpatch_model(model: nn.Module) -> PatchReport:
    """Undo ``patch_model``: the original rotary modules, the class's attention forward, and the config's rope
    values as they were before patching. Returns the report of the patch that was undone.

    A KV cache filled in ``mode="consistent"`` with ``dynamic`` / ``longrope`` holds unrotated keys, which the
    unpatched model, rotating keys when it caches them, would attend to as they are, with no error (posenc no
    longer runs in it to refuse them): start a new cache, or continue that one after ``patch_model(model,
    mode="consistent")``."""
    state = _patch_state(model)
    if state is None:
        raise ValueError(
            "model is not patched by posenc (patch_model was not called, or unpatch_model already was, on it or on a "
            "copy.copy that shares its modules)"
        )
    # The originals were outside the module tree while patched: follow a device move made meanwhile, and a dtype
    # cast that changed the model's floating parameters (model.to(torch.bfloat16) would have cast inv_freq too). A
    # cast to the dtype the parameters already had goes unseen.
    dtype = _weights_dtype(model)
    cast = dtype if dtype is not None and dtype != state.weights_dtype else None
    for key, value in state.original_config_values.items():
        setattr(state.config, key, value)
    for parent, attr, original in state.rotary:
        patched = getattr(parent, attr)
        original.to(device=patched.device, dtype=cast)
        if isinstance(patched, PosencRotaryEmbedding):
            for layer_type, rope in patched._ropes().items():
                if rope.rope_type == "dynamic" and rope.mode == "hf":
                    _hand_back_dynamic_state(original, layer_type, rope.hf_scaled_len)
        setattr(parent, attr, original)
    for module in state.attention:
        module.__dict__.pop("forward", None)
        module.__dict__.pop(_GUARD_ATTR, None)
    state.undone = True
    object.__delattr__(model, _STATE_ATTR)
    return state.report


def _hand_back_dynamic_state(original: nn.Module, layer_type: str, length: int | None) -> None:
    """Leave transformers' rotary module in the dynamic NTK state that posenc's RoPE reached while patched (the
    longest length seen, or the reset to the trained length), as its ``dynamic_rope_update`` would have left it: the
    model then continues as if it had never been patched."""
    rope_types = getattr(original, "rope_type", None)
    rope_type = rope_types.get(layer_type) if isinstance(rope_types, dict) else rope_types
    trained = getattr(original, "original_max_seq_len", None)
    buffer = getattr(original, state_name(layer_type, "inv_freq"), None)
    if length is None or not isinstance(rope_type, str) or "dynamic" not in rope_type or trained is None:
        return
    if not isinstance(buffer, torch.Tensor) or buffer.is_meta:
        return
    cached = state_name(layer_type, "max_seq_len_cached")
    if getattr(original, cached, getattr(original, "max_seq_len_cached", None)) == length:
        return
    if length > trained:
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

        kwargs = {"layer_type": layer_type} if layer_type else {}
        # The length as transformers gives it (max(position_ids) + 1, an int64 tensor), which makes its arithmetic
        # float32: a Python int gives float64's, one rounding away.
        seq_len = torch.tensor(length, device=buffer.device)
        inv_freq, original.attention_scaling = ROPE_INIT_FUNCTIONS[rope_type](
            original.config, buffer.device, seq_len=seq_len, **kwargs
        )
        original.register_buffer(state_name(layer_type, "inv_freq"), inv_freq, persistent=False)
        setattr(original, cached, length)
    else:
        first = getattr(original, state_name(layer_type, "original_inv_freq")).to(buffer.device)
        original.register_buffer(state_name(layer_type, "inv_freq"), first, persistent=False)
        setattr(original, state_name(layer_type, "original_inv_freq"), first)
        setattr(original, cached, trained)


def tiny_model_from_config(
    config: str | os.PathLike[str] | Mapping[str, Any],
    *,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int | None = None,
    head_dim: int | None = None,
    vocab_size: int = 256,
    max_position_embeddings: int | None = None,
    keep_scaling: bool = False,
    seed: int = 0,
    attn_implementation: str = "sdpa",
) -> nn.Module:
    """A small randomly initialised causal LM of the architecture in a ``config.json``, with its RoPE.

    config: a path to a config.json (or its folder) or the dict it holds; its ``model_type`` must be in
    ``SUPPORTED_ARCHITECTURES``. The architecture's code, ``rope_theta``, rotary fraction and pair layout come from
    it; the sizes from the arguments (head_dim defaults to hidden_size // num_heads; num_kv_heads to num_heads).
    max_position_embeddings: the trained length the scaling types extend from (default: the config's).
    keep_scaling: keep the config's rope scaling (LongRoPE factor lists must then fit the head dim); by default the
    model gets plain RoPE, to which ``patch_model(model, rope_parameters=...)`` applies an extension later.
    seed: the initial weights' (the global generator is left as it was); attn_implementation: transformers'
    ("sdpa", "eager", ...).
    Returns an unpatched ``transformers`` ``*ForCausalLM`` in float32, eval mode; ``model(input_ids).logits`` is
    (b, s, vocab_size).
    """
    try:
        from transformers import AutoConfig, AutoModelForCausalLM
    except ModuleNotFoundError as error:
        if error.name != "transformers":  # a module transformers needs: its own message says which
            raise
        raise ModuleNotFoundError(
            f"tiny_model_from_config builds a transformers model and needs the package ({error}); "
            "pip install transformers"
        ) from error

    if isinstance(config, (str, os.PathLike)):
        source = read_config_json(config)
    elif isinstance(config, Mapping):
        source = dict(config)
    else:
        raise TypeError(f"config must be a path to a config.json or a dict, got {type(config).__name__}")
    model_type = source.get("model_type")
    if model_type not in SUPPORTED_ARCHITECTURES:
        raise ValueError(
            f"config's model_type {model_type!r} is not supported; supported architectures: "
            f"{', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    for name, value in (
        ("hidden_size", hidden_size),
        ("num_layers", num_layers),
        ("num_heads", num_heads),
        ("vocab_size", vocab_size),
    ):
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    kv_heads = num_heads if num_kv_heads is None else num_kv_heads
    if isinstance(kv_heads, bool) or not isinstance(kv_heads, int) or kv_heads <= 0 or num_heads % kv_heads:
        raise ValueError(f"num_kv_heads must be a positive divisor of num_heads={num_heads}, got {num_kv_heads!r}")
    if head_dim is None:
        if hidden_size % num_heads:
            raise ValueError(f"hidden_size={hidden_size} must be divisible by num_heads={num_heads}, or give head_dim")
        head_dim = hidden_size // num_heads
    if model_type == "gpt_neox" and head_dim * num_heads != hidden_size:
        raise ValueError(
            f"GPT-NeoX ties head_dim to hidden_size / num_heads = {hidden_size / num_heads}; drop head_dim"
        )
    if model_type == "gpt_neox" and kv_heads != num_heads:
        raise ValueError("GPT-NeoX has no grouped-query attention; leave num_kv_heads unset")
    if max_position_embeddings is not None and (
        isinstance(max_position_embeddings, bool)
        or not isinstance(max_position_embeddings, int)
        or max_position_embeddings <= 0
    ):
        raise ValueError(f"max_position_embeddings must be a positive integer, got {max_position_embeddings!r}")

    rope = rope_kwargs_from_config(source)
    params = dict(rope["rope_parameters"])
    if not keep_scaling:
        params = {key: params[key] for key in ("rope_theta", "partial_rotary_factor") if key in params}
        params["rope_type"] = "default"
    trained = max_position_embeddings if max_position_embeddings is not None else rope["max_position_embeddings"]
    sizes: dict[str, Any] = {
        "hidden_size": hidden_size,
        "num_hidden_layers": num_layers,
        "num_attention_heads": num_heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "intermediate_size": 4 * hidden_size,
        "vocab_size": vocab_size,
        "max_position_embeddings": trained,
        "rope_parameters": params,
        "pad_token_id": None,
        "bos_token_id": None,
        "eos_token_id": None,
    }
    if model_type == "gpt_neox":
        del sizes["num_key_value_heads"], sizes["head_dim"]
    kept = {key: value for key, value in source.items() if key in _KEPT_KEYS}
    if not keep_scaling:
        kept.pop("original_max_position_embeddings", None)
    hf_config = AutoConfig.for_model(model_type, **kept, **sizes)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(
            hf_config, dtype=torch.float32, attn_implementation=attn_implementation
        )
    return model.eval()


# config.json keys that describe the architecture's behaviour (kept from the source); sizes and token ids are not.
_KEPT_KEYS = frozenset(
    {
        "hidden_act",
        "rms_norm_eps",
        "layer_norm_eps",
        "attention_bias",
        "mlp_bias",
        "use_parallel_residual",
        "sliding_window",
        "use_sliding_window",
        "original_max_position_embeddings",
        "rope_interleave",
    }
)
