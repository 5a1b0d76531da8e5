"""``register_scaling``: a RoPE scaling type of one's own, without editing posenc.

A type is named in several tables: its function (``frequencies.SCALINGS``), its keys (``parameters.REQUIRED_KEYS`` /
``OPTIONAL_KEYS``), whether it reads the sequence length (``frequencies.SEQ_LEN_DEPENDENT``), the parameters the
figures draw it with (``posenc.analysis.frequencies.EXAMPLE_ROPE_PARAMETERS``) and the lab's training-free extensions
(``posenc.lab.config.EXTENSIONS``). Writing them by hand missed one or another; here they are written together,
after the pieces are checked, or not at all.
"""

from __future__ import annotations

import inspect
import sys
import warnings
from collections.abc import Callable, Iterable
from typing import Any

import torch

from posenc._checks import user_stacklevel
from posenc.rope import frequencies, parameters
from posenc.rope.module import forget_frequencies

# (rotary_dim, train_len, factor) -> the type's own rope_parameters, as in EXAMPLE_ROPE_PARAMETERS.
ExampleFn = Callable[[int, int, float], dict[str, Any]]

# Types registered without example parameters: the figures' and the lab report's "every type" leave them out (a
# figure asked for one by name still says that it has none).
WITHOUT_EXAMPLE: set[str] = set()

# The keywords compute_frequencies passes every type beside its own parameters.
_CALL_KEYWORDS = ("rotary_dim", "base", "seq_len", "max_position_embeddings")
# Built-ins whose frequencies posenc/rope/module.py computes without their function in places (dynamic's plain RoPE
# up to the trained length and its in-graph op, LongRoPE's two sets chosen on the device): a function registered
# under their name would be bypassed there, silently.
_SHORTCUT_TYPES = frozenset({"dynamic", "longrope"})
# What the example is checked with: the figures' defaults (posenc.analysis.frequencies.frequency_table).
_EXAMPLE_ROTARY_DIM, _EXAMPLE_TRAIN_LEN, _EXAMPLE_FACTOR = 64, 2048, 4.0


def _keys(what: str, keys: Iterable[str]) -> frozenset[str]:
    if isinstance(keys, str) or not isinstance(keys, Iterable):
        raise TypeError(f"{what} must be a list of rope_parameters key names, got {keys!r}")
    keys = tuple(keys)
    bad = [key for key in keys if not isinstance(key, str) or not key.isidentifier()]
    if bad:
        raise ValueError(
            f"{what} must hold key names that are Python identifiers (they are keyword arguments of "
            f"the function), got {', '.join(map(repr, bad))}"
        )
    clash = sorted(set(keys) & (parameters.COMMON_KEYS | set(_CALL_KEYWORDS)))
    if clash:
        raise ValueError(
            f"{what} names {', '.join(clash)}, which every type has (rope_type, rope_theta -> base, "
            "partial_rotary_factor -> rotary_dim) or which posenc passes itself (seq_len, max_position_embeddings): "
            "leave them out"
        )
    return frozenset(keys)


def _check_signature(name: str, fn: Callable[..., Any], required: frozenset[str], optional: frozenset[str]) -> None:
    """fn must take the keywords compute_frequencies passes, with only the required keys present and with all."""
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):  # a builtin without a signature: it will be called, not inspected
        return
    for keys in (required, required | optional):
        call = {key: None for key in (*_CALL_KEYWORDS, *sorted(keys))}
        try:
            signature.bind(**call)
        except TypeError as error:
            raise TypeError(
                f"the function of rope_type {name!r} is called as fn(*, rotary_dim, base, seq_len, "
                f"max_position_embeddings, <its keys: {', '.join(sorted(keys)) or 'none'}>) and returns (inv_freq "
                f"(rotary_dim // 2,) float64, attention_factor), as posenc.rope.frequencies.yarn is; its signature "
                f"{signature} cannot take that ({error}); end it with **_ to ignore what it does not read, and give "
                "keys it may go without a default"
            ) from None


def _check_example(name: str, example: ExampleFn) -> None:
    """The example's parameters pass the type's own validation and give (r/2,) finite frequencies, at the trained
    length and past it."""
    own = example(_EXAMPLE_ROTARY_DIM, _EXAMPLE_TRAIN_LEN, _EXAMPLE_FACTOR)
    if not isinstance(own, dict):
        raise TypeError(
            f"example of rope_type {name!r} must return a dict of its rope_parameters, got {type(own).__name__}"
        )
    spec = parameters.parse_rope_parameters(
        _EXAMPLE_ROTARY_DIM,
        {**own, "rope_type": name},
        max_position_embeddings=_EXAMPLE_TRAIN_LEN,
    )
    for seq_len in (None, _EXAMPLE_TRAIN_LEN, int(_EXAMPLE_TRAIN_LEN * _EXAMPLE_FACTOR)):
        inv_freq, factor = parameters.compute_frequencies(spec, seq_len=seq_len)
        if not isinstance(inv_freq, torch.Tensor) or inv_freq.shape != (_EXAMPLE_ROTARY_DIM // 2,):
            shape = tuple(inv_freq.shape) if isinstance(inv_freq, torch.Tensor) else type(inv_freq).__name__
            raise ValueError(
                f"the function of rope_type {name!r} must return inv_freq of shape (rotary_dim // 2,) = "
                f"({_EXAMPLE_ROTARY_DIM // 2},) for rotary_dim={_EXAMPLE_ROTARY_DIM}, got {shape} (seq_len={seq_len})"
            )
        if isinstance(factor, bool) or not isinstance(factor, (int, float)):
            raise TypeError(
                f"the function of rope_type {name!r} must return (inv_freq, attention_factor) with a float "
                f"attention_factor (1.0 for none), got {factor!r}"
            )


def register_scaling(
    name: str,
    fn: Callable[..., tuple[torch.Tensor, float]],
    *,
    required: Iterable[str] = (),
    optional: Iterable[str] = (),
    example: ExampleFn | None = None,
    seq_len_dependent: bool = False,
    replace: bool = False,
) -> None:
    """Add a RoPE scaling type ``name`` for ``RoPE``/``MRoPE(rope_parameters={"rope_type": name, ...})``,
    ``rope_frequencies``, the KV cache, ``torch.compile``, the figures and the lab (``--extensions name`` in a process
    that registered it).

    fn: ``fn(*, rotary_dim, base, seq_len, max_position_embeddings, **its keys)`` -> ``(inv_freq, attention_factor)``,
    inv_freq (rotary_dim // 2,) float64 on the CPU, as the built-ins in ``posenc.rope.frequencies``; end it with
    ``**_``. required / optional: the names of its own ``rope_parameters`` keys (``factor`` is range-checked as for
    the built-ins: a number >= 1). example: ``(rotary_dim, train_len, factor) -> its rope_parameters`` for a target of
    ``factor`` times ``train_len``: what the figures draw it with and what the lab extends with; checked now against
    the type's own validation. seq_len_dependent: fn's frequencies change with ``seq_len`` (the current sequence
    length; None means the unscaled ones): RoPE then asks for them at every call's length, and ``mode="consistent"``
    re-rotates cached keys. A name registered already (a built-in one too) is refused unless ``replace=True``, which
    reaches the RoPEs built before it too (what they kept is made anew by the new function at their next call);
    ``dynamic`` and ``longrope``, which RoPE computes by shortcuts of their own in places, cannot be replaced. A
    replaced built-in is validated as any registered type, by ``required`` / ``optional`` and the shared keys' range
    checks, without the built-in's own (a trained length for yarn, its betas, llama3's band) or the keys they add;
    registering posenc's function again (``posenc.rope.frequencies.BUILTIN_SCALINGS[name]``) puts those back.
    """
    from posenc.registry import _NAME  # not at the top: posenc.registry imports posenc.rope

    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise ValueError(
            f"rope_type name must be letters, digits, '_', '.' or '-' (not starting with '.' or '-'), got {name!r}: "
            "it is one item of the lab's --extensions comma list and part of its report labels (rope+name)"
        )
    if name in parameters.LEGACY_TYPES:
        raise ValueError(
            f"rope_type {name!r} is a legacy name that parse_rope_parameters reads as "
            f"{parameters.LEGACY_TYPES[name]!r}; pick another name"
        )
    if not callable(fn):
        raise TypeError(f"fn must be a function computing the frequencies, got {fn!r}")
    if not isinstance(seq_len_dependent, bool):
        raise TypeError(f"seq_len_dependent must be True or False, got {seq_len_dependent!r}")
    if not isinstance(replace, bool):
        raise TypeError(f"replace must be True or False, got {replace!r}")
    if example is not None and not callable(example):
        raise TypeError(
            f"example must be a function (rotary_dim, train_len, factor) -> rope_parameters dict, or None, got "
            f"{example!r}"
        )
    required_keys, optional_keys = _keys("required", required), _keys("optional", optional)
    both = sorted(required_keys & optional_keys)
    if both:
        raise ValueError(f"key(s) {', '.join(both)} are both required and optional; name each in one of them")
    if name in _SHORTCUT_TYPES:
        raise ValueError(
            f"rope_type {name!r} cannot be replaced: RoPE computes its frequencies by shortcuts of its own in places "
            "(posenc/rope/module.py), which would bypass the function; register it under another name"
        )
    from posenc.lab.config import EXTENSIONS  # not at the top: the lab's config imports posenc.registry

    if name in frequencies.SCALINGS and not replace:
        raise ValueError(
            f"rope_type {name!r} is registered already (as {getattr(frequencies.SCALINGS[name], '__name__', '?')}); "
            "pick another name, or pass replace=True"
        )
    if example is not None and name in EXTENSIONS and name not in frequencies.SCALINGS and not replace:
        raise ValueError(
            f"{name!r} is a lab extension already (of another rope_type); pick another name, or pass replace=True"
        )
    if fn is not frequencies.BUILTIN_SCALINGS.get(name):
        # posenc's own function put back under its name gets its keys from the built-in's fallbacks (yarn's
        # original_max_position_embeddings): it takes what it took before any replacement.
        _check_signature(name, fn, required_keys, optional_keys)

    from posenc.analysis.frequencies import EXAMPLE_ROPE_PARAMETERS  # imports RoPE: not at the top either

    tables: list[dict[str, Any]] = [
        frequencies.SCALINGS,
        parameters.REQUIRED_KEYS,
        parameters.OPTIONAL_KEYS,
        EXAMPLE_ROPE_PARAMETERS,
        EXTENSIONS,
    ]
    missing = object()
    saved = [table.get(name, missing) for table in tables]
    sets = (frequencies.SEQ_LEN_DEPENDENT, WITHOUT_EXAMPLE)
    saved_sets = [name in live for live in sets]
    frequencies.SCALINGS[name] = fn
    parameters.REQUIRED_KEYS[name] = required_keys
    parameters.OPTIONAL_KEYS[name] = optional_keys
    (frequencies.SEQ_LEN_DEPENDENT.add if seq_len_dependent else frequencies.SEQ_LEN_DEPENDENT.discard)(name)
    if example is None:
        EXAMPLE_ROPE_PARAMETERS.pop(name, None)
        if name in EXTENSIONS and isinstance(EXTENSIONS[name], _ExampleExtension):
            del EXTENSIONS[name]
        WITHOUT_EXAMPLE.add(name)
    else:
        EXAMPLE_ROPE_PARAMETERS[name] = example
        EXTENSIONS[name] = _ExampleExtension(name)
        WITHOUT_EXAMPLE.discard(name)
    try:
        if example is not None:
            _check_example(name, example)
    except BaseException:
        # All or nothing: a type whose example fails is not left half registered. Only this name's entries are put
        # back (emptying a table to refill it left other threads calling a built-in type without it meanwhile), and
        # what a RoPE of it kept while the rejected function was in place is dropped.
        for table, before in zip(tables, saved, strict=True):
            if before is missing:
                table.pop(name, None)
            else:
                table[name] = before
        for live, was_in in zip(sets, saved_sets, strict=True):
            (live.add if was_in else live.discard)(name)
        forget_frequencies(name)
        raise
    # A replacement: RoPEs built before it kept numbers of the function it replaces (it had served them beside the
    # new function's, at lengths not kept, silently).
    forget_frequencies(name)
    # Patched transformers models keep the frequencies patch_model checked against transformers' own: said here, not
    # left to be found. Asked only of an interop module already imported (rope imports nothing above it).
    rotary = sys.modules.get("posenc.interop.rotary")
    patched = rotary.patched_with(name) if replace and rotary is not None else []
    if patched:
        warnings.warn(
            f"{len(patched)} rotary embedding(s) of transformers models patched by posenc.interop.patch_model use "
            f"rope_type {name!r}: they keep the frequencies they were checked to share with transformers' {name!r} "
            "when patched (the model's config still names that type), not the new function's, which reaches posenc's "
            "own RoPE modules. patch_model installs only what transformers computes for a config: try the new "
            "function in a posenc RoPE or a lab model",
            stacklevel=user_stacklevel(),
        )


class _ExampleExtension:
    """The lab's extension for a registered type: its example parameters for the lab's rotary dim."""

    def __init__(self, name: str) -> None:
        self.name = name

    def __call__(self, factor: float, train_len: int, *, rotary_dim: int) -> dict[str, Any]:
        from posenc.analysis.frequencies import EXAMPLE_ROPE_PARAMETERS

        return {**EXAMPLE_ROPE_PARAMETERS[self.name](rotary_dim, train_len, factor), "rope_type": self.name}

    def __repr__(self) -> str:
        return f"<example parameters of rope_type {self.name!r}>"
