"""One registry: encoding name -> class. Scaling types have theirs in ``posenc.rope.frequencies.SCALINGS``."""

from __future__ import annotations

import inspect
from typing import Any

from torch import nn

from posenc._checks import positive_int
from posenc.absolute import LearnedAbsolute, Sinusoidal
from posenc.bias import ALiBi, T5Bias
from posenc.nope import NoPE
from posenc.rope import RoPE

ENCODINGS: dict[str, type[nn.Module]] = {
    "learned": LearnedAbsolute,
    "sinusoidal": Sinusoidal,
    "t5": T5Bias,
    "alibi": ALiBi,
    "nope": NoPE,
    "rope": RoPE,
}


def available() -> list[str]:
    """Names of the registered encodings."""
    return list(ENCODINGS)


def _lookup(name: str) -> type[nn.Module]:
    if name not in ENCODINGS:
        raise ValueError(f"unknown encoding {name!r}; known encodings: {', '.join(ENCODINGS)}")
    return ENCODINGS[name]


def build(name: str, /, *args: Any, **kwargs: Any) -> nn.Module:
    """Construct an encoding by name with its own arguments, e.g. ``build("rope", 64, base=500000.0)``."""
    return _lookup(name)(*args, **kwargs)


def build_for_model(
    name: str, /, *, dim: int, num_heads: int, head_dim: int, max_positions: int, **kwargs: Any
) -> nn.Module:
    """Construct an encoding from a model's sizes, so a model can take any name without special cases.

    dim: model width; num_heads: h (ALiBi's slopes, T5's bias per head); head_dim: per-head width; max_positions:
    the training length (the learned table's size); kwargs: options of that family's constructor (e.g. ``base``,
    ``rope_parameters``, ``num_buckets``); an option the family does not take is a TypeError, never silently
    dropped. The four sizes must be positive ints for every family, also those that read fewer of them, so that a
    bad one shows before the name changes to one that reads it. (dim need not be num_heads * head_dim: Gemma's is
    not.)
    """
    family = _lookup(name)
    for size, value in (
        ("dim", dim),
        ("num_heads", num_heads),
        ("head_dim", head_dim),
        ("max_positions", max_positions),
    ):
        positive_int(size, value)
    options = _options(family)
    unknown = [key for key in kwargs if key not in options]
    if unknown:  # before the call: Python's own error would name the argument but not what the family takes
        raise TypeError(
            f"encoding {name!r} takes no option {', '.join(map(repr, unknown))}; its options: "
            f"{', '.join(options) or 'none'} (its sizes come from dim, num_heads, head_dim and max_positions)"
        )
    return family.from_model_dims(
        dim=dim, num_heads=num_heads, head_dim=head_dim, max_positions=max_positions, **kwargs
    )


def _options(family: type[nn.Module]) -> list[str]:
    """The keyword-only arguments of the family's constructor: what build_for_model passes on beside the sizes."""
    if family.__init__ is nn.Module.__init__:  # takes nothing (its *args, **kwargs only raise)
        return []
    return [p.name for p in inspect.signature(family).parameters.values() if p.kind is p.KEYWORD_ONLY]
