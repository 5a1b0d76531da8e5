"""RoPE frequencies: the base inverse frequencies and one pure function per scaling type.

Every function here works in float64 and returns ``(inv_freq, attention_factor)`` with ``inv_freq`` of shape
(r/2,), where r is the rotary dim. Positions times these frequencies give the rotation angles; keeping them in
float64 until the cos/sin table is built is what makes position 2**20 as exact as position 20.

A scaling type of one's own is added with ``posenc.rope.register_scaling``, which writes every table that names the
types (docs/scaling.md, "Adding a scaling type"). Kernels never change for it: they consume cos/sin.
The functions take plain, already validated and resolved values (``posenc.rope.parameters`` owns the dict keys,
the defaults and the fallbacks); each follows the formula of Hugging Face ``transformers``' function of the same
name in ``modeling_rope_utils.py``, branch for branch, but in float64.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from types import MappingProxyType
from typing import Any

import torch

ScalingFn = Callable[..., tuple[torch.Tensor, float]]


# Frequencies are host values, float64 on the CPU whatever default device the caller has set: RoPE keeps them, and
# one computed under a torch.device("meta") context (shape inference) stayed meta, with no values once the module
# was materialised with to_empty().


def default_inv_freq(rotary_dim: int, base: float | torch.Tensor) -> torch.Tensor:
    """theta_i = base^(-2i/r) for i in [0, r/2). Returns (r/2,) float64 on the CPU. base: a number, or a 0-d tensor
    (differentiable: its graph is kept)."""
    exponents = torch.arange(0, rotary_dim, 2, dtype=torch.float64, device="cpu") / rotary_dim
    # The base as a 0-d tensor, which eager's float ** tensor wraps it in anyway (same kernel, same bits): a traced
    # dynamic NTK base is a symbolic float, and torch 2.12's float ** tensor compared it with 1.0 and 2.0 on the host,
    # guards that refused a torch.export Dim across dynamic NTK's switch (2.13 asks only statically_known_true).
    # A tensor base stays a tensor: scalar_tensor reads one with .item(), which refused a base that requires grad
    # (TypeError), torch.func's vmap and grad over it, and a fake one under a FakeTensorMode.
    if isinstance(base, torch.Tensor):
        base = base.to(dtype=torch.float64, device="cpu")
    else:
        base = torch.scalar_tensor(base, dtype=torch.float64, device="cpu")
    return 1.0 / base**exponents


def default(*, rotary_dim: int, base: float, **_: object) -> tuple[torch.Tensor, float]:
    """Plain RoPE (Su et al., 2021)."""
    return default_inv_freq(rotary_dim, base), 1.0


def linear(*, rotary_dim: int, base: float, factor: float, **_: object) -> tuple[torch.Tensor, float]:
    """Position interpolation (Chen et al., 2023; kaiokendev): positions / factor, i.e. every frequency / factor."""
    return default_inv_freq(rotary_dim, base) / factor, 1.0


def ntk(*, rotary_dim: int, base: float, factor: float, **_: object) -> tuple[torch.Tensor, float]:
    """Static NTK-aware scaling (bloc97, 2023; YaRN §3.1): base * factor^(r/(r-2)).

    The exponent is chosen so the highest frequency (i = 0) is unchanged and the lowest (i = r/2 - 1) is divided by
    exactly ``factor``: high frequencies extrapolate, low ones interpolate. Not in ``transformers``; it equals
    ``dynamic`` with the same ``factor`` at the length where dynamic's scale reaches ``factor``,
    max_position_embeddings * (2 - 1/factor).
    """
    return default_inv_freq(rotary_dim, _ntk_base(base, factor, rotary_dim, "factor")), 1.0


def _ntk_base(base: float, scale: float, rotary_dim: int, what: str) -> float:
    """base * scale^(r/(r-2)), or a ValueError where that leaves float range (a factor of 1e300, say), which would
    otherwise give frequencies of 0 without a word."""
    try:
        scaled = base * scale ** (rotary_dim / (rotary_dim - 2))
    except OverflowError:
        scaled = math.inf
    if not -math.inf < scaled < math.inf:  # not math.isfinite, which torch.compile cannot trace for a symbolic float
        raise ValueError(
            f"the NTK base, base * {what}^(r/(r-2)) = {base} * {scale}^({rotary_dim}/{rotary_dim - 2}), overflows "
            "float64; use a smaller rope_parameters['factor']"
        )
    return scaled


def dynamic(
    *,
    rotary_dim: int,
    base: float,
    factor: float,
    max_position_embeddings: int,
    seq_len: int | None = None,
    **_: object,
) -> tuple[torch.Tensor, float]:
    """Dynamic NTK (emozilla, 2023): NTK-aware with the factor that the current length needs.

    base' = base * (factor * L / max_position_embeddings - (factor - 1))^(r/(r-2)), L = max(seq_len, max_pos).
    Equals ``default`` for every seq_len <= max_position_embeddings (and for seq_len None).
    """
    # torch.sym_max for a symbolic length: the builtin max of one asks which is larger on the host, and make_fx's
    # symbolic trace then kept the example's answer for every length (Dynamo rewrites max itself). Plain ints take the
    # builtin (sym_max's answer for them), which Dynamo before torch 2.12 (the GPU image's 2.11) could trace, where
    # sym_max of two ints stopped it: "torch.* op returned non-Tensor".
    if seq_len is None:
        length = max_position_embeddings
    elif type(seq_len) is int:
        length = max(seq_len, max_position_embeddings)
    else:
        length = torch.sym_max(seq_len, max_position_embeddings)
    scale = factor * length / max_position_embeddings - (factor - 1)
    return default_inv_freq(
        rotary_dim, _ntk_base(base, scale, rotary_dim, "(factor * seq_len / max - (factor - 1))")
    ), 1.0


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    """YaRN's attention temperature: 0.1 * mscale * ln(scale) + 1 for scale > 1, else 1."""
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def yarn_ramp(
    rotary_dim: int,
    base: float,
    original_max_position_embeddings: int,
    beta_fast: float,
    beta_slow: float,
    truncate: bool,
) -> tuple[float, float]:
    """(low, high): the pair indices where YaRN's ramp from extrapolation to interpolation starts and ends."""

    def correction_dim(rotations: float) -> float:
        # The (fractional) dim index whose pair turns `rotations` times over the original length.
        return (
            rotary_dim * math.log(original_max_position_embeddings / (rotations * 2 * math.pi)) / (2 * math.log(base))
        )

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if truncate:
        low, high = math.floor(low), math.ceil(high)
    # Hugging Face clamps high to rotary_dim - 1 (not r/2 - 1); kept for bit-compatibility.
    low, high = max(low, 0), min(high, rotary_dim - 1)
    if low == high:
        high += 0.001  # a zero-width ramp would divide by zero
    return low, high


def yarn(
    *,
    rotary_dim: int,
    base: float,
    factor: float,
    original_max_position_embeddings: int,
    beta_fast: float = 32.0,
    beta_slow: float = 1.0,
    mscale: float | None = None,
    mscale_all_dim: float | None = None,
    attention_factor: float | None = None,
    truncate: bool = True,
    **_: object,
) -> tuple[torch.Tensor, float]:
    """YaRN (Peng et al., 2023): NTK-by-parts interpolation plus an attention temperature.

    Pairs that turn more than ``beta_fast`` times over the original length keep their frequency, pairs that turn
    fewer than ``beta_slow`` times are divided by ``factor``, and a linear ramp joins the two. The attention
    factor is, unless given: mscale(factor, mscale) / mscale(factor, mscale_all_dim) when both are non-zero
    (DeepSeek), else mscale(factor).
    """
    if attention_factor is None:
        if mscale and mscale_all_dim:
            attention_factor = yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all_dim)
        else:
            attention_factor = yarn_mscale(factor)

    low, high = yarn_ramp(rotary_dim, base, original_max_position_embeddings, beta_fast, beta_slow, truncate)
    ramp = ((torch.arange(rotary_dim // 2, dtype=torch.float64, device="cpu") - low) / (high - low)).clamp(0.0, 1.0)
    inv_freq = default_inv_freq(rotary_dim, base)
    return inv_freq / factor * ramp + inv_freq * (1.0 - ramp), float(attention_factor)


def longrope(
    *,
    rotary_dim: int,
    base: float,
    short_factor: Sequence[float],
    long_factor: Sequence[float],
    original_max_position_embeddings: int,
    factor: float | None = None,
    attention_factor: float | None = None,
    seq_len: int | None = None,
    **_: object,
) -> tuple[torch.Tensor, float]:
    """LongRoPE (Ding et al., 2024; Phi-3): one searched rescale factor per pair.

    ``long_factor`` once the sequence passes ``original_max_position_embeddings``, ``short_factor`` before (and when
    seq_len is None). Attention factor, unless given: sqrt(1 + ln(factor) / ln(original)) for factor > 1, else 1.
    """
    if attention_factor is None:
        if factor is None:
            raise ValueError("longrope needs `factor` (or `attention_factor`) to set the attention factor")
        attention_factor = (
            1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original_max_position_embeddings))
        )
    chosen = long_factor if seq_len and seq_len > original_max_position_embeddings else short_factor
    chosen = torch.tensor(chosen, dtype=torch.float64, device="cpu")
    return default_inv_freq(rotary_dim, base) / chosen, float(attention_factor)


def llama3(
    *,
    rotary_dim: int,
    base: float,
    factor: float,
    low_freq_factor: float,
    high_freq_factor: float,
    original_max_position_embeddings: int,
    **_: object,
) -> tuple[torch.Tensor, float]:
    """Llama 3.1: wavelengths below original/high_freq_factor are kept, those above original/low_freq_factor
    are divided by ``factor``, and the band between is interpolated smoothly in 1/wavelength.

    Equal factors (Llama 4: 1 and 1) leave no band: a step, the wavelengths from original/low_freq_factor on divided
    by ``factor`` (as at the low edge of a band). transformers' smoothing weight there is 0/0 or x/0, which its
    torch.where discards for every wavelength but the edge itself."""
    inv_freq = default_inv_freq(rotary_dim, base)
    wavelen = 2 * math.pi / inv_freq
    low_freq_wavelen = original_max_position_embeddings / low_freq_factor
    high_freq_wavelen = original_max_position_embeddings / high_freq_factor
    if low_freq_factor == high_freq_factor:
        return torch.where(wavelen >= low_freq_wavelen, inv_freq / factor, inv_freq), 1.0
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (original_max_position_embeddings / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(medium, smoothed, scaled), 1.0


def float32_blend_rtol(rope_type: str, params: Mapping[str, Any], base: float) -> float:
    """How far, relative, a float32 computation of a type's frequencies (transformers') may stray from the exact
    ones on top of the roundings of base**e, which every type has (about (ln(base) + 8) * 2^-24).

    YaRN and Llama 3 blend inv/factor with inv by a weight computed in float32, and an absolute error in the weight
    moves the result by up to factor - 1 times it, relative. YaRN's ramp runs over pair indices: a few roundings,
    3 * 2^-24 covers it where the ramp is about as wide as its start; a narrower one adds low's own rounding to
    float32, 2^-24 * low / (high - low), left out here (equal betas, 0.001 wide, put a frequency 3.3e-4 off: a
    model whose float32 buffer rotates visibly off the exact angles at long positions, which patch_model refuses
    to patch, rightly; yarn_ramp gives low and high). Truncated, its ends are integers and (i - low) / (high - low)
    rounds once (by up to 2^-25; every weight is exact only where high - low is a power of two), then 1 - ramp once
    more (by up to 2^-25, and only for a weight under 1/2, whose own rounding is then under 2^-26): 3/4 of 2^-24 at
    most (0.749 * 2^-24 measured over widths 1-399), and 1 * 2^-24 absolute covers both. (Until 2026-12-06 the
    truncated weight counted as exact; a fuzz found a factor-52.5 config, ramp 32 to 102, whose pair 101, weight
    1/70 from a 69/70 that rounded, was 15.3 * 2^-24 off against 14.4 allowed.)
    Llama 3's weight is (original / wavelength - low) / (high - low), with the wavelength taken from the float32
    inv_freq: it carries that inv_freq's own error, (ln(base) + 8) * 2^-24, plus 2 roundings, both scaled by up to
    high / (high - low). So (factor - 1) * gain * that. (Until 2026-12-03 Llama 3's bound left the wavelength's
    error out, and patch_model refused a factor-54 config with a narrow band that posenc computes exactly.) Llama 3
    with equal factors (Llama 4) is a step with no weight, and 0 here. params: as ``RopeSpec.params``.
    """
    if not is_builtin(rope_type):  # a registered type's parameters mean what its function makes of them
        return 0.0
    if rope_type == "yarn":
        gain, roundings = 1.0, (1.0 if params.get("truncate", True) else 3.0)
    elif rope_type == "llama3" and params["high_freq_factor"] > params["low_freq_factor"]:
        gain = params["high_freq_factor"] / (params["high_freq_factor"] - params["low_freq_factor"])
        roundings = 2.0 + math.log(base) + 8.0
    else:
        return 0.0
    return (float(params["factor"]) - 1.0) * gain * roundings * 2.0**-24


def proportional_pairs(partial_rotary_factor: float, rotary_dim: int) -> int:
    """How many pairs proportional RoPE turns (transformers' int(factor * r // 2)); the rest stand still."""
    return int(partial_rotary_factor * rotary_dim // 2)


def proportional(
    *, rotary_dim: int, base: float, partial_rotary_factor: float = 1.0, factor: float = 1.0, **_: object
) -> tuple[torch.Tensor, float]:
    """Proportional RoPE (Hugging Face, Gemma-style): the first ``partial_rotary_factor`` of the pairs turn with
    the frequencies of the *full* head (exponent over r, not over the rotated part); the rest get frequency 0.

    Unlike partial rotation it keeps all r channels in the rotation (r = head_dim), so the unrotated pairs are
    (i, i + r/2) for the high i, not the trailing channels. All frequencies are then divided by ``factor``.
    """
    rotated = proportional_pairs(partial_rotary_factor, rotary_dim)
    inv_freq = 1.0 / base ** (torch.arange(0, 2 * rotated, 2, dtype=torch.float64, device="cpu") / rotary_dim)
    inv_freq = torch.cat((inv_freq, torch.zeros(rotary_dim // 2 - rotated, dtype=torch.float64, device="cpu")))
    return inv_freq / factor, 1.0


# name -> function(*, rotary_dim, base, seq_len, max_position_embeddings, **type_parameters)
SCALINGS: dict[str, ScalingFn] = {
    "default": default,
    "linear": linear,
    "ntk": ntk,
    "dynamic": dynamic,
    "yarn": yarn,
    "longrope": longrope,
    "llama3": llama3,
    "proportional": proportional,
}

# The functions posenc ships, by name, as they were before any register_scaling(..., replace=True): the checks that
# know a built-in's parameters (yarn's betas, llama3's band, the trained length yarn / llama3 extend from) apply
# while its name holds this function, and a replacement is validated by what was registered for it instead.
BUILTIN_SCALINGS: Mapping[str, ScalingFn] = MappingProxyType(dict(SCALINGS))


def is_builtin(rope_type: str) -> bool:
    """Whether ``rope_type`` names posenc's own function now (False for a registered type, or a replaced built-in)."""
    builtin = BUILTIN_SCALINGS.get(rope_type)
    return builtin is not None and SCALINGS.get(rope_type) is builtin


def turns_fraction_of_pairs(rope_type: str | None) -> bool:
    """Whether ``rope_type`` reads ``partial_rotary_factor`` as the fraction of a whole head's pairs that turn (the
    rest stand still) rather than of the channels rotated: posenc's own 'proportional' only. A function registered
    in its place (``register_scaling("proportional", ..., replace=True)``) reads the key as every other type does."""
    return rope_type == "proportional" and is_builtin(rope_type)


# Types whose frequencies change with the current sequence length (they cannot be tabulated once). A set that
# ``posenc.rope.register_scaling`` adds to: read it through ``is_seq_len_dependent``, never a copy taken at import (a
# frozenset imported by name left a registered type tabulated once, its function always called with seq_len=None).
SEQ_LEN_DEPENDENT: set[str] = {"dynamic", "longrope"}


def is_seq_len_dependent(rope_type: str) -> bool:
    """Whether ``rope_type``'s frequencies change with the sequence length (registered types included)."""
    return rope_type in SEQ_LEN_DEPENDENT
