"""One registry: encoding name -> class (``register`` adds one of your own). Scaling types have theirs in
``posenc.rope.frequencies.SCALINGS`` (``posenc.rope.register_scaling`` adds one of your own)."""

from __future__ import annotations

import inspect
import re
import types
from typing import Any

from torch import nn

from posenc._checks import positive_int
from posenc.absolute import LearnedAbsolute, Sinusoidal
from posenc.bias import ALiBi, T5Bias
from posenc.encoding import ActsOn
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


# A name is a lab unit's folder (runs/<name>/), one item of --encodings' comma list, and the part before "+" of a
# report label ("rope+yarn"): "/", "," and "+" would break one of them.
_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]*")


def register(name: str, family: type[nn.Module], *, replace: bool = False) -> None:
    """Add an encoding family of your own under ``name``, for ``build``, ``build_for_model``, the lab
    (``--encodings name`` in a process that registered it) and ``posenc info``, without editing posenc.

    family: an ``nn.Module`` class with a class attribute ``acts_on`` (a ``posenc.ActsOn``: what
    ``CausalSelfAttention`` reads of it) and a classmethod ``from_model_dims(*, dim, num_heads, head_dim,
    max_positions, **options)``. Checked here, so that a missing piece is named now and not at the first model
    built. A name already registered (a built-in one too) is refused unless ``replace=True``.
    """
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise ValueError(
            f"encoding name must be letters, digits, '_', '.' or '-' (not starting with '.' or '-'), got {name!r}: "
            "it names the lab's run folders and is one item of --encodings' comma list"
        )
    if not (isinstance(family, type) and issubclass(family, nn.Module)):
        raise TypeError(f"family must be an nn.Module subclass (the class, not an instance), got {family!r}")
    if not isinstance(getattr(family, "acts_on", None), ActsOn):
        raise TypeError(
            f"{family.__name__} needs a class attribute acts_on = posenc.ActsOn.INPUT, QK, SCORE_BIAS or NONE "
            f"(see posenc.encoding), got {getattr(family, 'acts_on', None)!r}"
        )
    if not callable(getattr(family, "from_model_dims", None)):
        raise TypeError(f"{family.__name__} needs {_FROM_MODEL_DIMS}")
    _check_from_model_dims(family)
    if name in ENCODINGS and not replace:
        raise ValueError(
            f"encoding {name!r} is registered already (as {ENCODINGS[name].__name__}); pick another name, or pass "
            "replace=True"
        )
    ENCODINGS[name] = family


def _check_from_model_dims(family: type[nn.Module]) -> None:
    """Raise TypeError unless ``family.from_model_dims`` can be called as build_for_model calls it: on the class,
    with the four sizes by keyword. An instance method (no @classmethod) failed only at the first build_for_model,
    with Python's "missing 1 required positional argument: 'self'"; a size it does not take, likewise."""
    own = next((vars(klass)["from_model_dims"] for klass in family.__mro__ if "from_model_dims" in vars(klass)), None)
    if isinstance(own, types.FunctionType):  # a plain function in the class body: called on the class as it is
        first = next(iter(inspect.signature(own).parameters.values()), None)
        by_position = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
        if (
            first is not None
            and first.kind in by_position
            and first.default is first.empty
            and first.name not in _SIZES
        ):
            raise TypeError(
                f"{family.__name__}.from_model_dims is a method of instances (it takes {first.name} first): it must "
                f"be {_FROM_MODEL_DIMS}; add @classmethod"
            )
    try:
        parameters = inspect.signature(family.from_model_dims).parameters.values()
    except (TypeError, ValueError):  # a callable whose signature Python cannot read: taken on trust
        return
    positional = [p.name for p in parameters if p.kind is p.POSITIONAL_ONLY and p.default is p.empty]
    named = {p.name for p in parameters if p.kind in _BY_KEYWORD}
    missing = [] if any(p.kind is p.VAR_KEYWORD for p in parameters) else [n for n in _SIZES if n not in named]
    if positional or missing:
        problem = (
            f"requires {', '.join(positional)} by position" if positional else f"does not take {', '.join(missing)}"
        )
        raise TypeError(f"{family.__name__}.from_model_dims {problem}: it must be {_FROM_MODEL_DIMS}")


_FROM_MODEL_DIMS = (
    "a classmethod from_model_dims(cls, *, dim, num_heads, head_dim, max_positions, **options) that builds it from "
    "a model's sizes (what build_for_model and the lab call; see ALiBi.from_model_dims)"
)


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
    if not callable(getattr(family, "from_model_dims", None)):  # put into ENCODINGS by hand, not by register()
        raise TypeError(
            f"encoding {name!r} ({family.__name__}) cannot be built from a model's sizes: it needs {_FROM_MODEL_DIMS}"
        )
    sizes = {}
    for size, value in (
        ("dim", dim),
        ("num_heads", num_heads),
        ("head_dim", head_dim),
        ("max_positions", max_positions),
    ):
        sizes[size] = positive_int(size, value)
    options = _options(family)
    unknown = [] if options is None else [key for key in kwargs if key not in options]
    if unknown:  # before the call: Python's own error would name the argument but not what the family takes
        raise TypeError(
            f"encoding {name!r} takes no option {', '.join(map(repr, unknown))}; its options: "
            f"{', '.join(options) or 'none'} (its sizes come from dim, num_heads, head_dim and max_positions)"
        )
    return family.from_model_dims(**sizes, **kwargs)


_SIZES = ("dim", "num_heads", "head_dim", "max_positions")
_BY_KEYWORD = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)


def _options(family: type[nn.Module]) -> list[str] | None:
    """What build_for_model passes on beside the sizes: what ``from_model_dims`` takes by keyword but the sizes, the
    constructor's keyword-only arguments and, where ``from_model_dims`` passes the rest on (``**options``), the
    constructor's positional-or-keyword ones with a default (those without one are what it fills from the sizes:
    RoPE's head_dim, ALiBi's num_heads). None where the family takes any (a constructor with ``**kwargs`` behind
    ``**options``; a signature Python cannot read): the family decides. Only the constructor's keyword-only ones
    were counted, so a registered family's ``__init__(self, scale=1.0)`` took ``scale`` from build but not from
    build_for_model."""
    try:
        own = inspect.signature(family.from_model_dims).parameters.values()
        taken = [] if family.__init__ is nn.Module.__init__ else inspect.signature(family).parameters.values()
    except (TypeError, ValueError):
        return None
    names = [p.name for p in own if p.kind in _BY_KEYWORD and p.name not in _SIZES]
    names += [p.name for p in taken if p.kind is p.KEYWORD_ONLY]
    if any(p.kind is p.VAR_KEYWORD for p in own):
        if any(p.kind is p.VAR_KEYWORD for p in taken):
            return None
        names += [p.name for p in taken if p.kind is p.POSITIONAL_OR_KEYWORD and p.default is not p.empty]
    return list(dict.fromkeys(names))
