"""inv_freq per pair under every registered scaling type, side by side, for one base / head dim / length.

The types come from ``posenc.rope.frequencies.SCALINGS`` at call time, so a type added there appears here once it
has an example in ``EXAMPLE_ROPE_PARAMETERS`` (the one place that says what parameters to show each type with);
a registered type without one is an error naming this dict, never a silent gap in the table.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from posenc._checks import even_positive_int, positive_int
from posenc.rope.frequencies import SCALINGS, turns_fraction_of_pairs
from posenc.rope.module import RoPE
from posenc.rope.parameters import NEEDS_FOUR_CHANNELS, parse_rope_parameters
from posenc.rope.scaling import WITHOUT_EXAMPLE

# rope_type -> (rotary_dim, train_len, factor) -> the type's own rope_parameters (Hugging Face key names).
# factor is the context extension ratio shown; train_len is the original (trained) context.
ExampleFn = Callable[[int, int, float], dict[str, Any]]


def _longrope_example(rotary_dim: int, train_len: int, factor: float) -> dict[str, Any]:
    # LongRoPE's factors are searched per model; a ramp from 1 (fastest pair, kept) to `factor` (slowest pair,
    # fully interpolated) has the shape the searched ones have (Phi-3's grow from ~1 to ~factor).
    half = rotary_dim // 2
    ramp = [1.0 + (factor - 1.0) * i / max(half - 1, 1) for i in range(half)]
    return {
        "short_factor": [1.0] * half,
        "long_factor": ramp,
        "factor": factor,
        "original_max_position_embeddings": train_len,
    }


EXAMPLE_ROPE_PARAMETERS: dict[str, ExampleFn] = {
    "default": lambda r, length, factor: {},
    "linear": lambda r, length, factor: {"factor": factor},
    "ntk": lambda r, length, factor: {"factor": factor},
    "dynamic": lambda r, length, factor: {"factor": factor},
    "yarn": lambda r, length, factor: {
        "factor": factor,
        "original_max_position_embeddings": length,
        "beta_fast": 32.0,
        "beta_slow": 1.0,
    },
    "llama3": lambda r, length, factor: {
        "factor": factor,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": length,
    },
    "longrope": _longrope_example,
    # Gemma-style: a quarter of the pairs (at least one) keep the full head's frequencies, the rest stand still.
    "proportional": lambda r, length, factor: {"partial_rotary_factor": max(0.25, 2 / r)},
}


def is_extension_factor(factor: Any) -> bool:
    """Whether ``factor`` is a context extension ratio: a real number >= 1 (`not factor >= 1` catches NaN)."""
    return not isinstance(factor, bool) and isinstance(factor, (int, float)) and factor >= 1.0


def _check_factor(factor: Any) -> None:
    if not is_extension_factor(factor):
        raise ValueError(f"factor must be a number >= 1 (the context extension ratio), got {factor!r}")


def example_rope_parameters(rope_type: str, *, rotary_dim: int, train_len: int, factor: float = 4.0) -> dict[str, Any]:
    """The rope_parameters (without rope_type / rope_theta) used to show ``rope_type`` in tables and figures.

    rotary_dim: the channels rotated (even); train_len: the trained context; factor: the extension ratio (>= 1)."""
    rotary_dim, train_len = even_positive_int("rotary_dim", rotary_dim), positive_int("train_len", train_len)
    _check_factor(factor)
    if rope_type not in SCALINGS:
        raise ValueError(f"unknown rope_type {rope_type!r}; known types: {', '.join(SCALINGS)}")
    if rope_type not in EXAMPLE_ROPE_PARAMETERS:
        raise ValueError(
            f"rope_type {rope_type!r} is registered in SCALINGS but has no example parameters: add a line for it "
            "to posenc.analysis.frequencies.EXAMPLE_ROPE_PARAMETERS, or pass parameters={rope_type: {...}}"
        )
    return EXAMPLE_ROPE_PARAMETERS[rope_type](rotary_dim, train_len, factor)


@dataclasses.dataclass(frozen=True)
class FrequencyTable:
    """rope_types: (T,) names; parameters: (T,) the rope_parameters each type was built with;
    inv_freq: (T, P) float64, P the most pairs any type rotates (d/2 unless every type rotates part of the head),
    NaN past a type's own r/2 pairs; attention_factor: (T,) float64; train_len, seq_len: the lengths used."""

    rope_types: tuple[str, ...]
    parameters: tuple[dict[str, Any], ...]
    inv_freq: torch.Tensor
    attention_factor: torch.Tensor
    train_len: int
    seq_len: int

    def ratio_to_default(self) -> torch.Tensor:
        """(T, P): inv_freq of each type divided by plain RoPE's (1 where a pair is left alone)."""
        if "default" not in self.rope_types:
            raise ValueError("the table has no 'default' row to divide by; include 'default' in rope_types")
        return self.inv_freq / self.inv_freq[self.rope_types.index("default")]

    def to_rows(self) -> list[dict[str, Any]]:
        """Long format, one row per (rope_type, rotated pair): rope_type, pair, inv_freq, wavelength (inf where the
        frequency is 0), attention_factor."""
        rows = []
        for t, name in enumerate(self.rope_types):
            for i, value in enumerate(self.inv_freq[t].tolist()):
                if value != value:  # NaN: past this type's rotated pairs
                    continue
                rows.append(
                    {
                        "rope_type": name,
                        "pair": i,
                        "inv_freq": value,
                        "wavelength": 2 * math.pi / value if value else math.inf,  # frequency 0 never turns
                        "attention_factor": float(self.attention_factor[t]),
                    }
                )
        return rows


def frequency_table(
    head_dim: int,
    *,
    base: float = 10000.0,
    partial_rotary_factor: float | None = None,
    train_len: int = 2048,
    factor: float = 4.0,
    seq_len: int | None = None,
    rope_types: Sequence[str] | None = None,
    parameters: Mapping[str, Mapping[str, Any]] | None = None,
) -> FrequencyTable:
    """inv_freq under each scaling type for one config, computed by ``posenc.RoPE`` itself.

    head_dim: d; base: rope_theta; partial_rotary_factor: the fraction of channels every type rotates
    ('proportional', which reads that key as the fraction of pairs that turn, keeps its own and is left out when
    the fraction is below 1); train_len: the trained context, RoPE's
    ``max_position_embeddings``; factor: the extension ratio each example uses; seq_len: the length the
    length-dependent types scale for (default ``factor * train_len``, the extended context);
    rope_types: which types (default every type in ``SCALINGS`` now, but one registered without example parameters
    and not given them here); parameters: per type, rope_parameters that
    replace the example (e.g. ``{"yarn": {"factor": 8.0, "beta_fast": 16.0, ...}}``).
    """
    train_len = positive_int("train_len", train_len)
    if isinstance(rope_types, str):  # tuple("linear") would be its letters, and the error name the type 'l'
        raise TypeError(f"rope_types must be a list of type names, e.g. [{rope_types!r}], got a string")
    _check_factor(factor)
    seq_len = positive_int("seq_len", seq_len) if seq_len is not None else round(factor * train_len)
    common = {} if partial_rotary_factor is None else {"partial_rotary_factor": partial_rotary_factor}
    rotary = parse_rope_parameters(head_dim, common).rotary_dim
    # 'proportional' reads partial_rotary_factor as the fraction of pairs that turn, over the whole head: beside
    # types that rotate part of the head its pairs are other frequencies, and no ratio to default means anything.
    if rope_types is None:
        # A type registered without example parameters (register_scaling(example=None)) is drawn only with its own.
        names = tuple(name for name in SCALINGS if name not in WITHOUT_EXAMPLE or name in (parameters or {}))
    else:
        names = tuple(rope_types)
    if rotary < head_dim and any(turns_fraction_of_pairs(name) for name in names):
        if rope_types is not None:
            raise ValueError(
                f"rope_type 'proportional' turns pairs of the whole head and cannot share a table whose types rotate "
                f"{rotary} of {head_dim} channels (partial_rotary_factor={partial_rotary_factor}); leave one out"
            )
        names = tuple(name for name in names if not turns_fraction_of_pairs(name))
    if rotary < 4 and rope_types is None:  # a head of one pair: the NTK types are undefined there
        names = tuple(name for name in names if name not in NEEDS_FOUR_CHANNELS)
    if not names:
        raise ValueError("rope_types is empty; leave it out to show every type in SCALINGS")
    if parameters is None:
        parameters = {}
    # dict() of a string or a list failed with "dictionary update sequence element #0 ...", naming no argument.
    if not isinstance(parameters, Mapping) or not all(isinstance(own, Mapping) for own in parameters.values()):
        raise TypeError(
            "parameters must map a rope_type to its rope_parameters, e.g. {'yarn': {'factor': 8.0}}, got "
            f"{parameters!r}"
        )
    parameters = dict(parameters)
    unknown = sorted(set(parameters) - set(SCALINGS))
    if unknown:
        raise ValueError(f"parameters names unknown rope_type(s) {', '.join(unknown)}; known: {', '.join(SCALINGS)}")
    used, rows, factors = [], [], []
    for name in names:
        if name in parameters:
            own = dict(parameters[name])
            if own.pop("rope_type", name) != name or own.pop("type", name) != name:
                raise ValueError(f"parameters[{name!r}] names a different rope_type; key it by its own type")
        else:
            own = example_rope_parameters(name, rotary_dim=rotary, train_len=train_len, factor=factor)
            if not turns_fraction_of_pairs(name):  # its own partial_rotary_factor means something else (above)
                own = {**own, **common}
        rope = RoPE(head_dim, base=base, rope_parameters={"rope_type": name, **own}, max_position_embeddings=train_len)
        inv_freq, attention_factor = rope.frequencies(seq_len)
        used.append(own)
        rows.append(inv_freq)
        factors.append(attention_factor)
    pairs = max(row.shape[0] for row in rows)
    table = torch.full((len(rows), pairs), float("nan"), dtype=torch.float64)
    for t, row in enumerate(rows):
        table[t, : row.shape[0]] = row
    return FrequencyTable(
        rope_types=names,
        parameters=tuple(used),
        inv_freq=table,
        attention_factor=torch.tensor(factors, dtype=torch.float64),
        train_len=train_len,
        seq_len=seq_len,
    )
