"""Hugging Face-style ``rope_parameters`` dicts: parse, validate (raise, never warn), and normalise.

The math in ``frequencies`` takes plain values; this module is the only place that knows the dict keys, their
valid ranges, their defaults, and the fallbacks Hugging Face applies (``original_max_position_embeddings`` ->
``max_position_embeddings``; a missing YaRN / LongRoPE ``factor`` -> max / original).
"""

from __future__ import annotations

import dataclasses
import math
import numbers
import warnings
from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch._subclasses.fake_tensor import unset_fake_temporarily

from posenc._checks import (
    base_value,
    compiling,
    even_positive_int,
    integer_offset,
    positive_int,
    real_scalar,
    sequence_length,
    user_stacklevel,
)
from posenc.rope.frequencies import SCALINGS, is_builtin, proportional_pairs, turns_fraction_of_pairs

# Per rope_type: keys that must be present and keys that may be present (beyond the common ones).
REQUIRED_KEYS: dict[str, frozenset[str]] = {
    "default": frozenset(),
    "linear": frozenset({"factor"}),
    "ntk": frozenset({"factor"}),
    "dynamic": frozenset({"factor"}),
    "yarn": frozenset({"factor"}),
    "longrope": frozenset({"short_factor", "long_factor"}),
    "llama3": frozenset({"factor", "low_freq_factor", "high_freq_factor"}),
    "proportional": frozenset(),
}
OPTIONAL_KEYS: dict[str, frozenset[str]] = {
    "default": frozenset(),
    "linear": frozenset(),
    "ntk": frozenset(),
    "dynamic": frozenset(),
    "yarn": frozenset(
        {
            "original_max_position_embeddings",
            "beta_fast",
            "beta_slow",
            "mscale",
            "mscale_all_dim",
            "attention_factor",
            "truncate",
        }
    ),
    "longrope": frozenset({"original_max_position_embeddings", "factor", "attention_factor"}),
    "llama3": frozenset({"original_max_position_embeddings"}),
    "proportional": frozenset({"factor"}),
}
COMMON_KEYS = frozenset({"rope_type", "type", "rope_theta", "partial_rotary_factor"})
# Types that extend from a trained length: it comes from `original_max_position_embeddings`, else the model's max.
_NEEDS_ORIGINAL = frozenset({"yarn", "longrope", "llama3"})
# A `factor` of None here means "max_position_embeddings / original_max_position_embeddings" (DeepSeek, Phi-3).
_IMPLICIT_FACTOR = frozenset({"yarn", "longrope"})


@dataclasses.dataclass(frozen=True)
class RopeSpec:
    """A validated RoPE configuration with plain values.

    rotary_dim: channels rotated per head (even, <= head_dim); base: rope_theta;
    params: the type's own parameters, keyed as in Hugging Face configs, defaults and fallbacks resolved;
    max_position_embeddings: the model's trained length (``dynamic`` scales from it), or None.
    """

    head_dim: int
    rotary_dim: int
    base: float
    rope_type: str = "default"
    params: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    max_position_embeddings: int | None = None


# Types whose exponent r/(r-2) needs a rotary dim of at least 4.
NEEDS_FOUR_CHANNELS = ("ntk", "dynamic")


def rotary_fraction(rotary_dim: int, head_dim: int) -> float:
    """The partial_rotary_factor f that rotates rotary_dim of head_dim channels: int(head_dim * f) == rotary_dim.

    rotary_dim / head_dim itself can land an ulp low (30 / 44 * 44 = 29.999...), which the parser's int() truncates
    to an odd 29 and refuses; the next float up gives rotary_dim exactly."""
    fraction = rotary_dim / head_dim
    if int(head_dim * fraction) < rotary_dim:
        fraction = math.nextafter(fraction, math.inf)
    return fraction


def _real(key: str, value: Any, *, low: float, low_inclusive: bool, hint: str = "", index: int | None = None) -> float:
    """value as a float in range; key (and index, for an entry of a list) name it in errors. Numbers of any kind
    are taken: Python's, numpy's, and one-element tensors (``real_scalar``)."""
    name = f"rope_parameters['{key}']" + (f"[{index}]" if index is not None else "")
    value = real_scalar(name, value)
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a finite real number, got {value!r}{hint}")
    if not math.isfinite(value):  # the right type, a value out of range (as one below `low` is)
        raise ValueError(f"{name} must be a finite real number, got {value!r}{hint}")
    if value < low or (value == low and not low_inclusive):
        bound = f">= {low}" if low_inclusive else f"> {low}"
        raise ValueError(f"{name} must be {bound}, got {value!r}{hint}")
    return float(value)


def _factor_list(key: str, value: Any, pairs: int) -> tuple[float, ...]:
    # A dict or set has a length too, but no order of pairs (a dict would be read by its keys).
    # A 0-d tensor or array has __len__ too, which raises ("len() of a 0-d tensor", from inside torch).
    zero_dim = getattr(value, "ndim", None) == 0
    if isinstance(value, (str, bytes, Mapping, set, frozenset)) or not hasattr(value, "__len__") or zero_dim:
        raise TypeError(f"rope_parameters['{key}'] must be a list of {pairs} positive numbers, got {value!r}")
    if len(value) != pairs:
        raise ValueError(
            f"rope_parameters['{key}'] must hold rotary_dim / 2 = {pairs} factors (one per rotated pair), "
            f"got {len(value)}"
        )
    hint = f" (every entry of {key} must be > 0)"
    return tuple(_real(key, item, low=0.0, low_inclusive=False, hint=hint, index=i) for i, item in enumerate(value))


def _resolve(rope_type: str, params: dict[str, Any], rotary_dim: int, max_pos: int | None) -> dict[str, Any]:
    """Check every value's type and range, apply Hugging Face's defaults and fallbacks. Returns new params.

    A shared key is range-checked for every type that has it; what a built-in type's name implies (a trained length
    for yarn / llama3, yarn's implicit factor and betas, llama3's band, ntk's four channels) only while the name
    holds posenc's function: a replacement registered under it (register_scaling(..., replace=True)) is validated by
    the keys registered for it, and gets no keys it did not declare."""
    kind = rope_type if is_builtin(rope_type) else None  # None: a registered type, or a replaced built-in
    out = dict(params)
    for key in ("low_freq_factor", "high_freq_factor"):
        if key in out:
            out[key] = _real(key, out[key], low=0.0, low_inclusive=False)
    for key, default in (("beta_fast", 32), ("beta_slow", 1)):
        if key in out:
            # transformers reads `get(key) or default`, so a 0 there silently means the default. A zero saved as a
            # tensor is that 0 too (_real reads it as one), so it gets the hint as well.
            value = real_scalar(f"rope_parameters['{key}']", out[key])
            zero = isinstance(value, numbers.Real) and value == 0
            hint = f" (transformers takes 0 for the default {default}: leave the key out for that)" if zero else ""
            out[key] = _real(key, value, low=0.0, low_inclusive=False, hint=hint)
    if "attention_factor" in out:
        out["attention_factor"] = _real("attention_factor", out["attention_factor"], low=0.0, low_inclusive=False)
    for key in ("mscale", "mscale_all_dim"):
        if key in out:
            out[key] = _real(key, out[key], low=0.0, low_inclusive=True)
    if "truncate" in out and not isinstance(out["truncate"], bool):
        raise TypeError(f"rope_parameters['truncate'] must be True or False, got {out['truncate']!r}")
    for key in ("short_factor", "long_factor"):
        if key in out:
            out[key] = _factor_list(key, out[key], rotary_dim // 2)

    if "original_max_position_embeddings" in out:
        out["original_max_position_embeddings"] = sequence_length(
            "rope_parameters['original_max_position_embeddings']",
            trained_length(out["original_max_position_embeddings"]),
        )
        if kind == "longrope" and out["original_max_position_embeddings"] < 2:
            raise ValueError(
                "rope_parameters['original_max_position_embeddings'] must be >= 2 for longrope (its attention "
                f"factor divides by log(original)), got {out['original_max_position_embeddings']}"
            )
    elif kind in _NEEDS_ORIGINAL:
        if max_pos is not None:
            out["original_max_position_embeddings"] = max_pos
        else:
            raise ValueError(
                f"rope_type {rope_type!r} needs the trained length: give rope_parameters"
                "['original_max_position_embeddings'] or max_position_embeddings"
            )
    if kind == "dynamic" and max_pos is None:
        raise ValueError(
            "rope_type 'dynamic' needs max_position_embeddings (the trained length it scales from); pass "
            "max_position_embeddings=..."
        )
    if kind in NEEDS_FOUR_CHANNELS and rotary_dim < 4:
        raise ValueError(f"rope_type {rope_type!r} needs rotary_dim >= 4 (its exponent is r/(r-2)), got {rotary_dim}")

    if out.get("factor") is not None:
        out["factor"] = _real("factor", out["factor"], low=1.0, low_inclusive=True, hint=" (1 means no scaling)")
    elif kind in _IMPLICIT_FACTOR and max_pos is not None:
        implicit = max_pos / out["original_max_position_embeddings"]
        if implicit < 1.0 and kind == "longrope":
            # A model configured below its original length (Phi3Config's default original is 4096): transformers
            # then takes attention factor 1, and LongRoPE uses the factor for nothing else.
            implicit = 1.0
        if implicit < 1.0:
            raise ValueError(
                f"rope_parameters['factor'] is missing and max_position_embeddings / original_max_position_embeddings"
                f" = {max_pos} / {out['original_max_position_embeddings']} = {implicit} < 1; give a factor >= 1"
            )
        out["factor"] = implicit
    elif kind == "yarn":
        raise ValueError("rope_parameters['factor'] is None: give a factor >= 1 or max_position_embeddings")
    elif kind == "longrope" and "attention_factor" not in out:
        raise ValueError(
            "rope_type 'longrope' needs rope_parameters['factor'] >= 1 (or 'attention_factor', or "
            "max_position_embeddings to infer factor = max / original)"
        )
    else:
        out.pop("factor", None)

    if kind == "yarn":
        beta_fast, beta_slow = out.setdefault("beta_fast", 32.0), out.setdefault("beta_slow", 1.0)
        # Equal betas are a step from kept to divided frequencies (the ramp's zero width is widened by 0.001, as in
        # transformers, which takes them without a warning); a beta_fast below beta_slow turns the ramp around.
        if beta_fast < beta_slow:
            raise ValueError(
                f"rope_parameters['beta_fast'] must be >= rope_parameters['beta_slow'] (defaults 32 and 1), got "
                f"beta_fast={beta_fast} and beta_slow={beta_slow}"
            )
    # Equal factors are an empty band, a step (Llama 4 Scout's config.json: 1 and 1, which transformers takes with a
    # warning); a high below the low one has no band that means anything.
    if kind == "llama3" and out["low_freq_factor"] > out["high_freq_factor"]:
        raise ValueError(
            f"rope_parameters['low_freq_factor'] must be <= rope_parameters['high_freq_factor'] (Llama 3.1 uses 1 "
            f"and 4, Llama 4 1 and 1), got low_freq_factor={out['low_freq_factor']} and "
            f"high_freq_factor={out['high_freq_factor']}"
        )
    return out


# Legacy type names -> the type transformers maps them to.
LEGACY_TYPES = {"su": "longrope", "mrope": "default"}


def unread_keys(rope_type: str, keys: Iterable[str]) -> list[str]:
    """The keys of a rope dict that a known ``rope_type`` does not read, sorted: refused by
    ``parse_rope_parameters``, ignored with a warning by ``posenc.interop.rope_from_config``."""
    return sorted(set(keys) - REQUIRED_KEYS[rope_type] - OPTIONAL_KEYS[rope_type] - COMMON_KEYS)


def pop_rope_type(params: dict[str, Any]) -> str:
    """Remove ``rope_type`` and its legacy spelling ``type`` from params; returns the type they name (legacy names
    mapped, "default" when neither is set). Both set to different types is a ValueError (Qwen2-VL configs carry
    type 'mrope' beside rope_type 'default', which agree)."""
    named = {key: params.pop(key) for key in ("rope_type", "type") if key in params}
    for key, value in named.items():
        if value is not None and not isinstance(value, str):
            raise TypeError(f"rope_parameters['{key}'] must be a string naming the type (e.g. 'yarn'), got {value!r}")
    types = {key: LEGACY_TYPES.get(value, value) for key, value in named.items() if value}
    if len(set(types.values())) > 1:
        raise ValueError(
            f"rope_parameters has rope_type={named['rope_type']!r} and type={named['type']!r} ('type' is the legacy "
            "spelling of the same key); keep one of them"
        )
    return next(iter(types.values()), "default")


def _partial_rotary_factor(value: Any) -> float:
    value = real_scalar("rope_parameters['partial_rotary_factor']", value)
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(
            f"partial_rotary_factor must be a number in (0, 1] (rope_parameters['partial_rotary_factor'], the "
            f"fraction of head_dim that rotates), got {type(value).__name__} {value!r}"
        )
    if not (0.0 < value <= 1.0):
        raise ValueError(
            f"partial_rotary_factor must be in (0, 1] (rope_parameters['partial_rotary_factor'], the fraction of "
            f"head_dim that rotates), got {value!r}"
        )
    return float(value)


def _check_float32_range(spec: RopeSpec, lengths: tuple[int | None, ...]) -> None:
    """Raise where the frequencies or the attention factor of ``spec`` at any of ``lengths`` leave float32's range."""
    rope_type, params, rotary_dim = spec.rope_type, spec.params, spec.rotary_dim
    for length in lengths:
        # On the CPU, as every frequency is (posenc.rope.frequencies), also where the caller builds on meta.
        inv_freq, factor = compute_frequencies(spec, seq_len=length)
        factor_as_float32 = float(torch.tensor(float(factor), device="cpu").float())
        if turns_fraction_of_pairs(rope_type):
            inv_freq = inv_freq[: proportional_pairs(params["partial_rotary_factor"], rotary_dim)]
        as_float32 = inv_freq.float()
        if not bool(((as_float32 > 0) & (as_float32 < math.inf)).all()):
            raise ValueError(
                f"rope_type {rope_type!r} with {params} gives frequencies that are 0 or infinite in float32 "
                f"(from {float(inv_freq.min()):.3g} to {float(inv_freq.max()):.3g}): nothing would rotate there, or "
                "only NaN; use a smaller factor or rope_theta"
            )
        if not 0 < factor_as_float32 < math.inf:
            raise ValueError(
                f"rope_type {rope_type!r} with {params} gives an attention factor of {float(factor):.3g}, which "
                "cos and sin cannot carry in float32 (they would be 0 or infinite); use an attention_factor that "
                "float32 holds (about 1e-38 to 3e38)"
            )


def trained_length(value: Any) -> Any:
    """An ``original_max_position_embeddings`` as the parser reads it: a whole float as an int (transformers computes
    with whatever number a config holds: 2048.0 is 2048 there, no error), numpy's integers as ints; anything else as
    it is, for the parser to judge. The figures read the key through this too: they took only ints, so 4096.0 was
    scaled from by RoPE and ignored by the figures' L."""
    value = integer_offset(value)
    return int(value) if isinstance(value, float) and value.is_integer() else value


def parse_rope_parameters(
    head_dim: int,
    rope_parameters: Mapping[str, Any] | None = None,
    *,
    base: float | None = None,
    rotary_dim: int | None = None,
    max_position_embeddings: int | None = None,
) -> RopeSpec:
    """Validate a Hugging Face-style dict and resolve the rotary dim, the base and the type's parameters.

    ``base`` / ``rotary_dim`` given explicitly must agree with ``rope_theta`` / ``partial_rotary_factor``. Keys set
    to None count as absent (Hugging Face configs write ``"attention_factor": null``). ``type`` is accepted as the
    legacy spelling of ``rope_type``. Every bad value raises a ValueError or TypeError naming the key.
    """
    head_dim = positive_int("head_dim", head_dim)
    max_position_embeddings = sequence_length("max_position_embeddings", max_position_embeddings)
    if rope_parameters is None:
        rope_parameters = {}
    if not isinstance(rope_parameters, Mapping):
        raise TypeError(
            "rope_parameters must be a dict like {'rope_type': 'default', 'rope_theta': 10000.0}, "
            f"got {type(rope_parameters).__name__}"
        )
    params = dict(rope_parameters)
    rope_type = pop_rope_type(params)
    if rope_type not in SCALINGS:
        raise ValueError(f"unknown rope_type {rope_type!r}; known types: {', '.join(sorted(SCALINGS))}")
    if rope_type not in REQUIRED_KEYS or rope_type not in OPTIONAL_KEYS:
        # A type added to SCALINGS alone: without this, a bare KeyError from the line below.
        raise ValueError(
            f"rope_type {rope_type!r} is registered in SCALINGS but posenc.rope.parameters does not know its keys: "
            "add a line for it to both REQUIRED_KEYS and OPTIONAL_KEYS (frozenset() where it has none)"
        )

    required = REQUIRED_KEYS[rope_type]
    builtin = is_builtin(rope_type)  # False for a replaced built-in: its registered keys alone say what it takes
    missing = sorted(required - params.keys())
    if missing:
        raise ValueError(f"rope_type {rope_type!r} needs the key(s) {', '.join(missing)} in rope_parameters")
    nullable = {"factor"} if builtin and rope_type in _IMPLICIT_FACTOR else set()
    for key in sorted(required - nullable):
        if params[key] is None:
            raise ValueError(f"rope_parameters['{key}'] is None; rope_type {rope_type!r} needs a value")
    if params.get("truncate", False) is None and "truncate" in OPTIONAL_KEYS[rope_type]:
        # transformers reads get("truncate", True) and tests its truth: an explicit null (JSON) means no truncation,
        # unlike every other key here, where None means absent.
        params["truncate"] = False
    params = {key: value for key, value in params.items() if value is not None or key in nullable}
    allowed = required | OPTIONAL_KEYS[rope_type]
    unknown = unread_keys(rope_type, params)
    if unknown:
        raise ValueError(
            f"rope_parameters has key(s) {', '.join(unknown)} that rope_type {rope_type!r} does not use; "
            f"it accepts {', '.join(sorted(allowed | COMMON_KEYS))}"
        )

    theta = params.pop("rope_theta", None)
    if theta is not None:
        theta = base_value("rope_parameters['rope_theta']", theta)
        if base is not None and theta != base_value("base", base):
            raise ValueError(f"base={base} disagrees with rope_parameters['rope_theta']={theta}; give one of them")
    else:
        theta = base_value("base", 10000.0 if base is None else base)

    partial = params.pop("partial_rotary_factor", None)
    if partial is not None:
        partial = _partial_rotary_factor(partial)
    if turns_fraction_of_pairs(rope_type):
        # Proportional RoPE rotates every channel and zeroes the frequencies of the tail pairs instead.
        if rotary_dim is not None and rotary_dim != head_dim:
            raise ValueError(f"rope_type 'proportional' rotates all head_dim={head_dim} channels; drop rotary_dim")
        params["partial_rotary_factor"] = 1.0 if partial is None else partial
        rotary_dim = head_dim
        if head_dim % 2:
            raise ValueError(f"rope_type 'proportional' turns all channels in pairs; head_dim={head_dim} is odd")
        if proportional_pairs(params["partial_rotary_factor"], rotary_dim) == 0:
            enough = math.ceil(2e4 / head_dim) / 1e4  # 2 / head_dim rounded up, so that factor * head_dim >= 2
            raise ValueError(
                f"partial_rotary_factor={partial} of head_dim={head_dim} turns int({partial} * {head_dim} // 2) = 0 "
                f"pairs with rope_type 'proportional': nothing would rotate; choose a factor >= {enough}"
            )
    elif partial is not None:
        from_factor = int(head_dim * partial)
        if from_factor < 2 or from_factor % 2:
            raise ValueError(
                f"partial_rotary_factor={partial} of head_dim={head_dim} gives rotary_dim=int({head_dim} * {partial})"
                f" = {from_factor}, but channels rotate in pairs: choose a factor that gives an even rotary_dim >= 2"
            )
        if rotary_dim is not None and rotary_dim != from_factor:
            raise ValueError(
                f"rotary_dim={rotary_dim} disagrees with partial_rotary_factor={partial} "
                f"(which gives {from_factor} of head_dim={head_dim}); give one of them"
            )
        rotary_dim = from_factor
    if rotary_dim is None:
        if head_dim == 1:
            raise ValueError("head_dim=1 leaves nothing to rotate: RoPE turns channels in pairs, so use head_dim >= 2")
        if head_dim % 2:
            raise ValueError(
                f"head_dim={head_dim} is odd and RoPE rotates channels in pairs: pass rotary_dim={head_dim - 1} to "
                f"rotate {head_dim - 1} of the {head_dim} channels (the last passes through), or use an even head_dim"
            )
        rotary_dim = head_dim
    rotary_dim = even_positive_int("rotary_dim", rotary_dim)
    if rotary_dim > head_dim:
        raise ValueError(f"rotary_dim={rotary_dim} must be <= head_dim={head_dim}")

    params = _resolve(rope_type, params, rotary_dim, max_position_embeddings)
    spec = RopeSpec(
        head_dim=head_dim,
        rotary_dim=rotary_dim,
        base=theta,
        rope_type=rope_type,
        params=params,
        max_position_embeddings=max_position_embeddings,
    )
    # A factor whose ntk base overflows is refused here, not at the first call; so is one that takes frequencies
    # below float32's range (linear with factor 1e50 rotated nothing) or past it, and an attention factor that cos
    # and sin cannot carry in float32. The length-dependent types are checked at the lengths they start from
    # (dynamic's trained one) and, for longrope, past its original length too.
    lengths: tuple[int | None, ...] = (None,)
    if rope_type == "longrope":
        lengths = (None, int(params["original_max_position_embeddings"]) + 1)
    # Under a FakeTensorMode too (shape inference that builds the model), whose tensors have no values to read:
    # these are the config's, checked on the host (a DataDependentOutputException from torch, else).
    with unset_fake_temporarily():
        _check_float32_range(spec, lengths)
    if builtin:  # a replacement's parameters are not transformers' type's
        _warn_where_transformers_warns(rope_type, params, max_position_embeddings)
    return spec


def _warn_where_transformers_warns(rope_type: str, params: dict[str, Any], max_pos: int | None) -> None:
    """Values transformers' config validation warns about (and then uses): warned here too, with its conditions."""
    original = params.get("original_max_position_embeddings")
    if max_pos is None or original is None:
        return
    # transformers also warns when they are equal, which is what an absent original defaults to here.
    if rope_type == "llama3" and original > max_pos:
        message = (
            f"rope_parameters['original_max_position_embeddings']={original} is above "
            f"max_position_embeddings={max_pos}: llama3 scaling stretches a trained length to a longer one"
        )
    elif rope_type == "yarn" and max_pos / original not in (params["factor"], 1.0):
        message = (
            f"rope_parameters['factor']={params['factor']} differs from max_position_embeddings / "
            f"original_max_position_embeddings = {max_pos} / {original}; the factor is used, as in transformers"
        )
    else:
        return
    warnings.warn(f"{message} (transformers warns about this config too)", stacklevel=user_stacklevel())


def compute_frequencies(spec: RopeSpec, *, seq_len: int | None = None) -> tuple[torch.Tensor, float]:
    """(inv_freq (r/2,) float64, attention_factor) for a validated spec and the current sequence length."""
    if seq_len is not None and not compiling():
        sequence_length("seq_len", seq_len)
    scaling = SCALINGS.get(spec.rope_type)
    if scaling is None:
        # A RoPE of a registered type, unpickled (torch.load, a spawned DataLoader or multiprocessing worker) where
        # the registration has not run: a bare KeyError from here before.
        raise ValueError(
            f"rope_type {spec.rope_type!r} is not registered in this process: call "
            f"posenc.register_scaling({spec.rope_type!r}, ...) with the same function before using a RoPE of it "
            "(one unpickled, or in a spawned worker, runs no registration of the process that built it)"
        )
    return scaling(
        rotary_dim=spec.rotary_dim,
        base=spec.base,
        seq_len=seq_len,
        max_position_embeddings=spec.max_position_embeddings,
        **spec.params,
    )


def rope_frequencies(
    head_dim: int,
    rope_parameters: Mapping[str, Any] | None = None,
    *,
    max_position_embeddings: int | None = None,
    seq_len: int | None = None,
) -> tuple[torch.Tensor, float]:
    """Inverse frequencies and attention factor for a Hugging Face-style config.

    Returns (inv_freq, attention_factor): inv_freq is (rotary_dim // 2,) float32, computed in float64 and rounded
    once; attention_factor multiplies cos and sin (1.0 for the built-in types except YaRN / LongRoPE; a type added by
    ``register_scaling`` returns its own). ``seq_len`` matters only to the length-dependent types: ``dynamic``,
    ``longrope`` and one registered with ``seq_len_dependent=True``.
    """
    spec = parse_rope_parameters(head_dim, rope_parameters, max_position_embeddings=max_position_embeddings)
    inv_freq, factor = compute_frequencies(spec, seq_len=seq_len)
    return inv_freq.to(torch.float32), float(factor)
