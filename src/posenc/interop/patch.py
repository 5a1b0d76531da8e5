"""Run a loaded ``transformers`` model's RoPE through posenc, in place: ``patch_model`` / ``unpatch_model``.

What is replaced, per patched model and nothing else in the process:

* the model's ``*RotaryEmbedding`` modules become ``PosencRotaryEmbedding``s (one per config the modules were built
  from, with one RoPE per layer type where the config has a rope dict per type): cos/sin of shape (b, s, r/2) in
  float32, from float64 angles (``posenc.rope.module.angles_to_cos_sin``), instead of Hugging Face's (b, s, r);
* each attention module runs a copy of its class's forward function whose globals resolve its
  ``apply_rotary_pos_emb*`` functions to posenc's rotation (``posenc.apply_rotary_qk``, any backend), each in the
  pair layout the original was found to rotate in: the module holds the copy, and its class becomes a subclass of
  its own, of the same name, whose ``forward`` calls it (one subclass per class, shared by every patched model, so
  that ``torch.compile`` compiles patched models of one class once, as unpatched ones; ``unpatch_model`` puts the
  class back). The class, the modeling module and every other model of the same class are untouched, and the copy
  is plain Python, so ``torch.compile`` traces it like the original. Under an accelerate hook (``dispatch_model``,
  ``cpu_offload``: ``forward`` is the hook's wrapper of ``_old_forward``) ``_old_forward`` calls it, so the hook
  keeps running, before and after ``unpatch_model``.

Which modules and functions these are is found by inspecting the model (``posenc.interop._discover``), so any
architecture that follows transformers' RoPE conventions can be patched; ``VERIFIED_ARCHITECTURES`` are those whose
patched logits the tests compare, ``SUPPORTED_ARCHITECTURES`` those ``tiny_model_from_config`` builds and whose
rotary dim ``rope_parameters`` may change.

In ``mode="consistent"`` with a type whose frequencies change with the length (``dynamic``, ``longrope``), keys go
into the KV cache unrotated and the attention rotates all of them at read with the frequencies of the current step
(the copy's ``ALL_ATTENTION_FUNCTIONS`` is wrapped for that), so every score of a step uses one set of frequencies.
With one attention layer cached decoding then equals a full forward pass; in a deeper stack the cached keys and
values of later layers come from hidden states of earlier steps, computed with those steps' frequencies, so the
guarantee is per score, not end to end (as for ``RoPE(mode="consistent")``). This needs a cache that returns the
past keys in order without gaps (``DynamicCache``, what ``generate`` uses by default, sliding-window layers
included). A ``StaticCache`` returns its whole fixed-size buffer, so the keys' positions cannot be counted back from
the new tokens: the patched attention raises a TypeError when it is given one in that mode (``mode="hf"`` takes it).
The cache layers it fills are marked as unrotated: every patched attention reads the mark, so that one rotating keys
at read refuses keys rotated when cached and one rotating them when cached refuses unrotated ones (the unpatched
model does not read it).

Before anything is replaced, the posenc RoPE is checked against the model's own rotary embedding (the same number
of frequencies, the same inv_freq within the buffer's rounding, the same attention scaling) and each rotation
function is run against posenc's rotation; a mismatch is an error, never a silently different model.

The parts it installs live beside this module, which checks, patches and unpatches: ``posenc.interop.rotary`` (the
rotary embedding and rotation functions), ``posenc.interop.consistent`` (keys rotated at read, and the cache's
marks), ``posenc.interop.architectures`` (the model types it knows by name); ``tiny_model_from_config`` is
``posenc.interop.tiny``'s.

Shape key: b batch, h heads, s new tokens, t tokens in the cache (t >= s), d head dim, r rotary dim.
"""

from __future__ import annotations

import ast
import copy
import dataclasses
import functools
import inspect
import math
import textwrap
import threading
import types
import warnings
import weakref
from collections.abc import Mapping, Sequence
from typing import Any, Literal

import torch
from torch import nn

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
from posenc.interop.architectures import (
    _QUERIES_THEN_KEYS_ATTENTION,
    _WHOLE_HEAD_ATTENTION,
    SUPPORTED_ARCHITECTURES,
    VERIFIED_ARCHITECTURES,
)
from posenc.interop.consistent import (
    _SHARED_KV_STATES,
    ROPES_ATTR,
    _checking_the_cache,
    _handing_out_rotated_shared_keys,
    _KeysRotatedAtRead,
    _refusing_unrotated_keys,
    argument,
    argument_position,
)
from posenc.interop.consistent import _UnrotatedKeys as _UnrotatedKeys  # caches pickled by older posenc name it here
from posenc.interop.hf import rope_kwargs_from_config, rope_layer_types
from posenc.interop.rotary import PosencRotaryEmbedding, _QueriesThenKeys, _rotate_one, _rotate_qk
from posenc.interop.tiny import tiny_model_from_config as tiny_model_from_config  # importable from here, as before
from posenc.rope.frequencies import float32_blend_rtol, is_seq_len_dependent
from posenc.rope.module import RoPE
from posenc.rope.mrope import MRoPE
from posenc.rope.parameters import OPTIONAL_KEYS, REQUIRED_KEYS

# inv_freq agreement with a float32 frequency buffer: transformers' float32 pow is off by up to
# (ln(base) + 8) * 2**-24 relative (~1.3e-6 at base 5e5), plus float32_blend_rtol for YaRN's blend and Llama 3's
# (4.6e-5 for untruncated YaRN at factor 256, 1.5e-5 truncated, 1.3e-5 for Llama 3.1's); a wrong rotary dim, base or
# scaling is off by far more.
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
    # (the parent's name in the model, attribute, original module). A name, not the parent: this state is kept on
    # the model, and a base model (LlamaModel) is its rotary module's parent, so model -> state -> model was a cycle
    # that kept a dropped patched model's weights alive until Python's cyclic collector ran.
    rotary: list[tuple[str, str, nn.Module]]
    attention: list[nn.Module]
    classes: list[type[nn.Module]]  # each attention module's class before patching
    config: Any
    original_config_values: dict[str, Any]  # attribute -> its value before patching
    weights_dtype: torch.dtype | None  # the model's floating parameters' dtype when patched
    # Per attention module, the instance forward its patched one replaced (accelerate's _old_forward, see
    # _forward_slot), or None for the class's.
    replaced_forwards: list[Any]
    # Set by unpatch_model. A shallow copy (copy.copy) of a patched model shares its modules and this state: once
    # either is unpatched, so is the other, which must then say so rather than try to undo it again.
    undone: bool = False


def _patch_state(model: nn.Module) -> _PatchState | None:
    """The state of the patch in force on ``model``, or None. Read from the model's own attributes: a wrapper whose
    ``__getattr__`` forwards to the model it wraps (peft's PeftModel) would otherwise answer with that model's state,
    whose module names are not the wrapper's (unpatch_model(wrapper) failed half-way on an AttributeError)."""
    state: _PatchState | None = getattr(model, "__dict__", {}).get(_STATE_ATTR)  # vars() raises on None, an int
    return None if state is None or state.undone else state


class _PickleGuard:
    """What a patched attention module is rebuilt with (``copyreg.__newobj__``'s part, see ``_patched_class``):
    copy.copy and copy.deepcopy call it, and pickle, which stores it, refuses it, so that pickling a patched module,
    or anything holding one (the model, a layer), raises this error.

    Pickle stores a patched module's class by its name, which finds transformers' class (a PicklingError that said
    nothing of posenc; before that, a loaded model ran the class's unpatched forward on posenc's cos/sin and failed
    in a shape mismatch)."""

    def __call__(self, cls: type[nn.Module], *args: Any) -> nn.Module:
        return cls.__new__(cls, *args)

    def __reduce_ex__(self, protocol: Any) -> Any:
        raise TypeError(
            "a model patched by posenc cannot be pickled, nor can its patched layers (torch.save(model), "
            "multiprocessing, Ray): their patched attention forwards would load as the class's own, beside posenc's "
            "rotary module. Save the weights (model.save_pretrained or torch.save(model.state_dict())), or pickle "
            "the model before patch_model / after unpatch_model(model), and call patch_model again where it is loaded"
        )


# A patched attention module's own patched forward function (unbound: it holds nothing of the module).
_FORWARD_ATTR = "_posenc_forward"
# accelerate's add_hook_to_module (used by dispatch_model, cpu_offload and from_pretrained(device_map=...)) keeps a
# module's forward in _OLD_FORWARD_ATTR and sets `forward` to a wrapper that runs the hook (_HOOK_ATTR) around it.
_OLD_FORWARD_ATTR = "_old_forward"
_HOOK_ATTR = "_hf_hook"

# What posenc made of an attention class (its patched subclass under "class", the patched forwards it shares by
# (rotations, backend, ...) under their key, see _patched_forward) is kept on the class itself, under _REGISTRY_ATTR
# (read with vars(): a subclass has its own), so that it lives as long as the class, and no longer. Kept in a dict of
# posenc's, it kept every class ever patched alive, with its modeling module (the forwards' globals copy it): a class
# made again and again (trust_remote_code reloads, FSDP2's classes) grew the process for good. Weak keys or values
# cannot do it: the patched subclass and the forwards' globals hold the class, and whatever posenc made must outlive
# the models patched with it, or torch.compile compiled each model patched after the last was dropped again (the
# 9th of a 2-layer Llama an error with fullgraph=True). A private attribute that nothing else reads; setting it does
# not make a model of that class compiled before recompile (measured).
_REGISTRY_ATTR = "_posenc_patched"
_PATCHED_CLASSES_LOCK = threading.Lock()
_UNSETTABLE: dict[type, dict[Any, Any]] = {}  # where a class refuses the attribute (its metaclass): kept for good
_PATCHED_CLASS_FORWARDS: weakref.WeakSet[types.FunctionType] = weakref.WeakSet()  # each patched class's forward


def _registry(cls: type) -> dict[Any, Any]:
    """What posenc made of ``cls`` (see ``_REGISTRY_ATTR``), made empty where there is none. Call under
    ``_PATCHED_CLASSES_LOCK``."""
    registry = vars(cls).get(_REGISTRY_ATTR, _UNSETTABLE.get(cls))
    if registry is None:
        registry = {}
        try:
            type.__setattr__(cls, _REGISTRY_ATTR, registry)
        except (TypeError, AttributeError):
            _UNSETTABLE[cls] = registry
    return registry


def _patched_class_of(cls: type) -> type[nn.Module] | None:
    """The patched subclass made of ``cls`` (``_patched_class``), or None."""
    with _PATCHED_CLASSES_LOCK:
        return vars(cls).get(_REGISTRY_ATTR, _UNSETTABLE.get(cls, {})).get("class")


def _call_patched_forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
    return getattr(self, _FORWARD_ATTR)(self, *args, **kwargs)


def _reduce_patched(self: nn.Module, protocol: Any) -> Any:
    # The default reduction, with the class built by the guard, which pickle refuses and copy calls.
    return (_PickleGuard(), *object.__reduce_ex__(self, max(protocol, 2))[1:])


def _patched_class(cls: type[nn.Module]) -> type[nn.Module]:
    """The class a patched attention module of class ``cls`` is given: a subclass with ``cls``'s name, qualname and
    module, whose ``forward`` calls the function the module holds in ``_FORWARD_ATTR`` (that patch's copy of
    ``cls.forward``), with the signature of ``cls.forward``. One per class, shared by the modules of every model
    patched in the process.

    Not an instance ``forward``: torch.compile guards an instance forward that is no bound method on its identity, so
    each patched model compiled again (a third one with fullgraph=True failed at the recompile limit, later ones ran
    uncompiled), and a bound method (module -> forward -> module) is a reference cycle that kept a dropped model's
    weights alive until Python's cyclic collector ran. The module's class is compiled as its type, the function by
    its code, both shared, so patched models compile as often as unpatched ones; a copy of a module (deepcopy, a
    DataParallel replica) keeps its class and so calls itself."""
    with _PATCHED_CLASSES_LOCK:
        registry = _registry(cls)
        patched = registry.get("class")
        if patched is None:
            # Its own code object: Dynamo keeps the frames it compiles per code object, as for the class's forward.
            code = _call_patched_forward.__code__.replace(co_name="forward")
            forward = types.FunctionType(code, _call_patched_forward.__globals__, "forward")
            forward.__qualname__ = f"{cls.__qualname__}.forward"
            forward.__module__ = cls.__module__
            forward.__doc__ = cls.forward.__doc__
            forward.__signature__ = inspect.signature(cls.forward)  # type: ignore[attr-defined]
            namespace = {
                "__module__": cls.__module__,
                "__qualname__": cls.__qualname__,
                "__doc__": cls.__doc__,
                "forward": forward,
                "__reduce_ex__": _reduce_patched,
            }
            patched = registry["class"] = type(cls)(cls.__name__, (cls,), namespace)
            _PATCHED_CLASS_FORWARDS.add(forward)
    return patched


# A class made since patching as a subclass of a patched class (FSDP2's fully_shard makes FSDP<name>) -> {the
# original class: the same subclass made of it}. Weak keys: the value is built on the original, not on the key.
_UNPATCHED_SUBCLASSES: weakref.WeakKeyDictionary[type, dict[type, type]] = weakref.WeakKeyDictionary()


def _unpatched_class(cls: type[nn.Module], original: type[nn.Module]) -> type[nn.Module] | None:
    """The class a module of class ``cls`` is given back when unpatched, where ``original`` was its class when
    patched: ``original`` for posenc's patched class, and for a subclass made of that since (FSDP2's ``fully_shard``
    sets ``module.__class__ = type(f"FSDP{name}", (FSDPModule, cls), {...})``) the same subclass made of ``original``:
    same name, qualname, module and attributes of its own, one per class (cached), leaving ``cls``, which other
    modules may have, as it is. None where that cannot be remade alike: ``cls`` is no subclass of the patched class,
    has ``__slots__``, or a function of its own calls ``super()`` (bound to ``cls``, which the remade class is not)."""
    patched = _patched_class_of(original)
    if patched is None or not issubclass(cls, patched):
        return None
    if cls is patched:
        return original
    with _PATCHED_CLASSES_LOCK:
        made = _UNPATCHED_SUBCLASSES.get(cls, {}).get(original)
        if made is None:
            made = _remade_on(cls, patched, original)
            if made is not None:
                _UNPATCHED_SUBCLASSES.setdefault(cls, {})[original] = made
    return made


def _remade_on(cls: type[nn.Module], patched: type[nn.Module], original: type[nn.Module]) -> type[nn.Module] | None:
    """``cls`` (a subclass of ``patched``) made again with ``original`` in place of ``patched`` among its bases,
    recursively; None where it cannot be (see ``_unpatched_class``)."""
    if cls is patched:
        return original
    namespace = {key: value for key, value in vars(cls).items() if key not in ("__dict__", "__weakref__")}
    if "__slots__" in namespace or any(_calls_super(value) for value in namespace.values()):
        return None
    bases = []
    for base in cls.__bases__:
        remade = _remade_on(base, patched, original) if issubclass(base, patched) else base
        if remade is None:
            return None
        bases.append(remade)
    namespace["__qualname__"] = cls.__qualname__
    return type(cls)(cls.__name__, tuple(bases), namespace)


def _calls_super(value: Any) -> bool:
    """Whether ``value`` (a class attribute: a function, classmethod, staticmethod or property) reads ``__class__``,
    the cell of zero-argument ``super()``."""
    functions = [getattr(value, name, None) for name in ("fget", "fset", "fdel")] if isinstance(value, property) else []
    functions.append(getattr(value, "__func__", value))
    return any("__class__" in getattr(getattr(f, "__code__", None), "co_freevars", ()) for f in functions)


def _patched_base(cls: type) -> type | None:
    """The patched class (``_patched_class``) among ``cls``'s bases, ``cls`` itself included, or None."""
    with _PATCHED_CLASSES_LOCK:
        return next((c for c in cls.__mro__ if vars(c).get("forward") in _PATCHED_CLASS_FORWARDS), None)


def _is_patched_forward(forward: Any) -> bool:
    """True for a patched class's forward bound to a module (what accelerate's hook keeps of a patched module)."""
    with _PATCHED_CLASSES_LOCK:  # another thread may be adding a class
        func = getattr(forward, "__func__", None) if isinstance(forward, types.MethodType) else None
        return isinstance(func, types.FunctionType) and func in _PATCHED_CLASS_FORWARDS


def _is_own_class_forward(module: nn.Module, forward: Any) -> bool:
    """True for ``module``'s class forward bound to it: what accelerate's remove_hook_from_module leaves on the
    instance (the ``_old_forward`` it kept), which calls nothing more than the class's forward would."""
    return (
        isinstance(forward, types.MethodType)
        and forward.__self__ is module
        and forward.__func__ is getattr(type(module).forward, "__func__", type(module).forward)
    )


def _forward_slot(module: nn.Module) -> str:
    """The instance attribute that holds ``module``'s own forward: accelerate's ``_old_forward`` under one of its
    hooks, whose wrapper in ``forward`` calls it (a patched forward put in ``forward`` would bypass the hook, and
    the hook's removal would put back the unpatched forward, which fails on posenc's cos/sin), else ``forward``."""
    hooked = _HOOK_ATTR in module.__dict__ and _OLD_FORWARD_ATTR in module.__dict__
    return _OLD_FORWARD_ATTR if hooked else "forward"


def _install_forward(module: nn.Module, function: types.FunctionType) -> Any:
    """Make ``module`` run ``function`` (its class's forward, patched) as its forward; return the instance forward
    this replaces (accelerate's ``_old_forward``, see ``_forward_slot``, or another set on the instance), or None."""
    slot = _forward_slot(module)
    replaced = module.__dict__.get(slot)
    object.__setattr__(module, _FORWARD_ATTR, function)
    module.__class__ = _patched_class(type(module))
    if slot == "forward":
        module.__dict__.pop("forward", None)
    else:  # the hook's wrapper calls it: bound, as accelerate keeps it (the hook's wrapper holds the module too)
        setattr(module, slot, types.MethodType(type(module).forward, module))
    return replaced


def _restore_forward(module: nn.Module, original_cls: type[nn.Module], replaced: Any) -> None:
    """Undo ``_install_forward``: ``module``'s class back to ``original_cls``, and the instance forward its patched
    one replaced (``replaced``; None: none) in the slot that holds the patched one now: ``forward``, or accelerate's
    ``_old_forward`` where a hook was added after patching (its wrapper in ``forward`` stays, and calls the
    original)."""
    restored = _unpatched_class(type(module), original_cls)
    if restored is not None:
        module.__class__ = restored
        module.__dict__.pop(_FORWARD_ATTR, None)
    else:  # a class posenc cannot make again of the original: it calls the class's own forward instead
        object.__setattr__(module, _FORWARD_ATTR, original_cls.forward)
    for slot in ("forward", _OLD_FORWARD_ATTR):
        if _is_patched_forward(module.__dict__.get(slot)):
            if replaced is not None:
                setattr(module, slot, replaced)
            elif slot == "forward":
                del module.__dict__[slot]
            else:  # what add_hook_to_module would have kept of the unpatched module
                setattr(module, slot, types.MethodType(type(module).forward, module))
            return
    if replaced is not None:
        module.forward = replaced
    else:  # replaced since by something that keeps no _old_forward: the class's forward, as before posenc
        module.__dict__.pop("forward", None)


def _rotary_device(rotary: nn.Module, model: nn.Module) -> torch.device:
    """Where ``rotary`` computes its cos/sin: the device of its buffers. Not the first parameter's: an offloaded model
    (accelerate's cpu_offload, a device_map with "cpu" or "disk") holds its parameters on the meta device until each
    is called, its rotary module's inv_freq on the device it runs on. A model not materialised yet (all on meta)
    gets the parameters' device."""
    device = next((buffer.device for buffer in rotary.buffers() if not buffer.is_meta), None)
    return device if device is not None else next((p.device for p in model.parameters()), torch.device("cpu"))


def _weights_dtype(model: nn.Module) -> torch.dtype | None:
    return next((p.dtype for p in model.parameters() if p.is_floating_point()), None)


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
        # A code object of its own: Dynamo guards an inlined function by its code and the globals it read through
        # the dict it traced first, so a copy sharing code with one of other globals ran that one's compiled graph.
        code = func.__code__.replace()
        new_func = types.FunctionType(code, namespace, func.__name__, func.__defaults__, closure)
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
    if is_seq_len_dependent(a.rope_type) != is_seq_len_dependent(b.rope_type):
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
    # And the original length a config keeps at the top level (Phi-3), which transformers copies over the dict's:
    # without it the intended RoPE scaled from max_position_embeddings, and Phi-3-128k with new LongRoPE factors was
    # refused as a rope_type that Phi-3 does not take.
    original = _top_level_original(config)
    rope_type = given.get("rope_type")
    takes_original = "original_max_position_embeddings" in (
        REQUIRED_KEYS.get(rope_type, frozenset()) | OPTIONAL_KEYS.get(rope_type, frozenset())
    )
    if original is not None and takes_original and "original_max_position_embeddings" not in given:
        given["original_max_position_embeddings"] = original
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
    _require_transformers_type(hf_params)
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


def _top_level_original(config: Any) -> int | None:
    """The config's top-level ``original_max_position_embeddings`` (Phi-3's, whose config class sets 4096 where the
    config.json has none), or None: absent, or a config with a rope dict per layer type, which keeps its own."""
    if rope_layer_types(config):
        return None
    value = getattr(config, "original_max_position_embeddings", None)
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _require_transformers_type(hf_params: Mapping[str, Any]) -> None:
    """A rope_type that transformers has no function for is refused: its rotary class, built from the new config,
    failed with a bare KeyError, and no from_pretrained could rebuild the model from what would be saved."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    rope_type = hf_params.get("rope_type") or "default"
    if rope_type != "default" and rope_type not in ROPE_INIT_FUNCTIONS:
        raise ValueError(
            f"rope_type {rope_type!r} is posenc's own: transformers has no function for it, so a config that names "
            "it could not be loaded again. patch_model writes only types transformers builds (posenc's 'ntk' as the "
            "equivalent 'default' config; another posenc-only type needs such a translation in "
            "posenc.interop.patch._hf_rope_parameters)"
        )


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
    Mistral, Mixtral, Qwen2/3 and their MoE variants, Gemma 1-4 and 3n, Phi, Phi-3 incl. LongRoPE, GPT-NeoX,
    StableLM, Cohere, GLM, DeepSeek-V3, OLMo, Granite and ~85 more in transformers 5.25; docs/scaling.md lists them; a
    composite model through its text config, with the multimodal RoPE of Qwen2-VL, Qwen3-VL, GLM-4V and kin as a
    ``posenc.MRoPE``, the vision tower left as it is), e.g.
    ``AutoModelForCausalLM.from_pretrained(...)``. What is replaced is found in the model and checked before it is
    touched: one ``*RotaryEmbedding`` class whose frequencies posenc's RoPE for the config reproduces, and the
    attention's rotation functions, each run on random q and k and required to equal posenc's rotation in one pair
    layout. Configs with a rope dict per layer type (Gemma 3) get one RoPE per type.
    backend: the rotation backend, as for ``posenc.apply_rotary`` ("auto", "torch", "triton", "cpu").
    rope_parameters: None keeps the model's RoPE (logits equal the unpatched model's within the dtype's tolerance
    and transformers' float32 angles, whose error grows with the position: docs/scaling.md; a float64 model too);
    a dict such as ``{"rope_type": "yarn", "factor": 4.0}`` changes the scaling in place and rewrites
    ``model.config.rope_parameters`` to match, so ``save_pretrained`` + plain ``from_pretrained`` reproduce it.
    ``rope_theta`` and ``partial_rotary_factor`` default to the model's, and ``original_max_position_embeddings`` to
    the config's top-level one where it has it (Phi-3), which transformers lets win over the dict's. Offered for
    ``SUPPORTED_ARCHITECTURES``, whose code reads the rope dict only in the rotary embedding; elsewhere (DeepSeek-V3's
    attention reads YaRN's mscale when built) load the model with the config you want and patch it with None.
    posenc's ``ntk`` is written as the equivalent ``default`` config with a larger ``rope_theta``. Nothing else of
    the dict it replaces is carried over: a Llama 3.1 config's ``original_max_position_embeddings`` (its pre-training
    length) is not, so a new scaling extends from ``max_position_embeddings`` unless the new dict gives it.
    mode: "hf" (Hugging Face's numbers, also for ``dynamic`` / ``longrope`` with a KV cache) or "consistent" (keys
    cached unrotated and rotated at read with each step's frequencies, so every score of a step uses one set of
    frequencies: cached decoding equals a full forward for one layer, and per score in deeper stacks, whose later
    layers cache keys and values computed from earlier steps' hidden states (a 2-layer tiny Llama with ``dynamic``,
    20 tokens decoded past its trained length: logits up to 0.4, 4e-5 from a full forward's, against 1e-7 unscaled);
    it needs a ``DynamicCache``, and the patched attention raises TypeError when given a ``StaticCache`` or the
    paged cache of continuous batching; a cache it filled holds unrotated keys, which the model patched again in
    this mode continues and a patch that rotates keys when it caches them refuses: see ``unpatch_model`` for the
    unpatched model). For
    ``dynamic`` / ``longrope``, "consistent" is offered for ``SUPPORTED_ARCHITECTURES``, whose attention is known
    to hand its keys to the attention function with the rotated channels first, and for Gemma 3n and Gemma 4's
    text models (q, then k, rotated in separate calls; a RoPE per layer type; layers that reuse cached keys).
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
        _require_keys_at_read(model, found, rotations, [ropes for _, _, ropes in installs])
    forwards = {
        cls: _patched_forward(cls, rotations[cls], first, keys_at_read, tuple(first_ropes)) for cls in found.calls
    }
    if model_type not in VERIFIED_ARCHITECTURES:
        warnings.warn(
            f"posenc checked this {model_type} model's frequencies and rotation functions, but its tests have not "
            f"compared a patched {model_type} model's logits with the unpatched one's; compare them on a few inputs "
            "before relying on the patch (posenc.interop.patch.VERIFIED_ARCHITECTURES lists the ones they have)",
            stacklevel=2,
        )

    attention_ids = {id(module) for module in found.attention}
    wrapped = [
        name
        for name, module in model.named_modules()
        if id(module) in attention_ids
        and _forward_slot(module) == "forward"
        and "forward" in module.__dict__
        and not _is_own_class_forward(module, module.__dict__["forward"])
    ]
    if wrapped:  # accelerate's hooks are kept (_forward_slot); another instance forward cannot be called around ours
        warnings.warn(
            f"model.{wrapped[0]}.forward is set on the instance ({len(wrapped)} attention module(s)), not by an "
            "accelerate hook: while patched, posenc's forward runs instead of it and unpatch_model puts it back; to "
            "keep a wrapper running, add it after patch_model as a forward hook (register_forward_hook)",
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
    for group_config, members, ropes in installs:
        replacement = PosencRotaryEmbedding(ropes if len(ropes) > 1 or "" not in ropes else ropes[""])
        replacement.to(_rotary_device(members[0][1], model))
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
            swapped.append((parent_name, attr, module))
    classes = [type(module) for module in found.attention]
    replaced_forwards = [_install_forward(module, forwards[type(module)]) for module in found.attention]
    for module in found.attention:
        object.__setattr__(module, PAIRS_ATTR, _pair_counts(module, installs))
    if keys_at_read:  # one rope dict (_require_keys_at_read): the RoPEs the rotary module holds, by layer type
        for module in found.attention:
            object.__setattr__(module, ROPES_ATTR, dict(first_ropes))

    state = _PatchState(
        report, swapped, list(found.attention), classes, config, originals, _weights_dtype(model), replaced_forwards
    )
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
    for name, module in model.named_modules():
        made_of = _patched_base(type(module))
        if made_of is type(module):
            raise ValueError(
                f"model.{name} is an attention module of a model that posenc has patched (or a copy of one taken out "
                "of it); call unpatch_model on the model that patch_model was called on first, or build this "
                "model's modules anew"
            )
        if made_of is not None:
            # A class made of the patched one since patching that unpatch_model could not remake on the original
            # (its own methods call super(), or it has __slots__): it still calls the patched forward, which reads
            # what patch_model sets, so patching it again would be refused as rotating by nothing known.
            raise ValueError(
                f"model.{name} is of class {type(module).__qualname__}, made from posenc's patched "
                f"{made_of.__qualname__} while the model was patched, which unpatch_model could not remake on the "
                f"original class (a method of its own calls super(), or it has __slots__); give the module a class "
                f"made of the original {made_of.__mro__[1].__qualname__} (or build the model again), then patch it"
            )


def _where_the_patch_is(model: nn.Module) -> str:
    """Why an unpatched ``model`` may still run posenc: a part of it was patched, or it is a part of (or was taken
    out of) a patched model; else the usual reasons."""
    if not isinstance(model, nn.Module):
        return f": model must be the nn.Module that patch_model was called on, got {type(model).__name__}"
    for name, module in model.named_modules():
        if name and _patch_state(module) is not None:
            return f", but model.{name} is: call unpatch_model(model.{name})"
    for name, module in model.named_modules():
        if isinstance(module, PosencRotaryEmbedding):
            return (
                f", but model.{name} is posenc's rotary embedding: model is part of a model that posenc patched (a "
                "wrapper such as peft's PeftModel, which merge_and_unload leaves the patched model of); call "
                "unpatch_model on the model that patch_model was called on"
            )
    return (
        " (patch_model was not called, or unpatch_model already was, on it or on a copy.copy that shares its modules)"
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
    model: nn.Module,
    found: ModelRope,
    rotations: Mapping[type[nn.Module], tuple[Rotation, ...]],
    installs: Sequence[Mapping[str, RoPE]],
) -> None:
    """'consistent' mode with a length-dependent type rotates cached keys at read, in the attention function, where
    posenc must know which channels of the key are the rotated ones and in which layout: refuse where it does not.
    installs: the RoPEs installed, per rotary config and layer type."""
    rope = next(rope for ropes in installs for rope in ropes.values() if rope.rotates_cached_keys)
    layered = found.model_type in _QUERIES_THEN_KEYS_ATTENTION
    known = (*SUPPORTED_ARCHITECTURES, *sorted(_QUERIES_THEN_KEYS_ATTENTION))
    # Gemma 3n / 4 rotate each layer's keys at read with its layer type's RoPE, found by the module's layer_type.
    strays = sorted(
        {type(module).__name__ for module in found.attention if getattr(module, "layer_type", None) not in installs[0]}
    )
    problem = None
    if len(installs) > 1 or ("" not in installs[0] and not layered):
        problem = "it has more than one rope dict (per layer type, or rotary embeddings with configs of their own)"
    elif found.model_type not in known:
        problem = (
            "posenc knows where the rotated channels sit in the keys the attention function gets only for "
            f"{', '.join(known)}"
        )
    elif "" not in installs[0] and strays:
        problem = f"{', '.join(strays)} has no layer_type among the config's rope dicts ({', '.join(installs[0])})"
    elif borrowed := _layer_types_reusing_foreign_keys(found.attention):
        problem = (
            f"its layers of type {', '.join(borrowed)} reuse keys that no layer of this model caches (Gemma 4's "
            "assistant gets its target model's shared_kv_states), of tokens whose positions posenc cannot count "
            "back from this model's new tokens"
        )
    else:
        for cls, per_class in rotations.items():
            if len(per_class) != 1 or per_class[0].layout != ("interleaved" if rope.interleaved else "split-half"):
                problem = f"{cls.__name__} rotates with {', '.join(r.name for r in per_class)}"
    if problem is not None:
        raise ValueError(
            f"mode='consistent' with rope_type={rope.rope_type!r} rotates the cached keys at read, which posenc does "
            f"not do for this {found.model_type} model: {problem}. Patch it with mode='hf' (transformers' numbers)"
            f"{_text_model_hint(model, found, known)}"
        )


def _text_model_hint(model: nn.Module, found: ModelRope, known: Sequence[str]) -> str:
    """Where a composite model's rotary embedding sits in a submodule of an architecture 'consistent' mode takes (Gemma
    4's text model inside Gemma4ForConditionalGeneration), the call that patches that submodule alone."""
    for name, _ in found.rotary:
        holder = name.rpartition(".")[0]
        config = getattr(model.get_submodule(holder), "config", None) if holder else None
        kind = getattr(config, "model_type", None)
        if kind != found.model_type and kind in known:
            return f", or patch its {kind} text model alone: patch_model(model.get_submodule({holder!r}), ...)"
    return ""


def _layer_types_reusing_foreign_keys(attention: Sequence[nn.Module]) -> list[str]:
    """The layer types whose layers reuse another layer's keys (Gemma 3n / 4's ``is_kv_shared_layer``) with no layer
    of the model storing them (``store_full_length_kv``): keys from outside the model, not cached behind its new
    tokens, whose positions 'consistent' mode would count wrongly (Gemma 4's assistant, whose every layer reuses)."""
    stored = {module.layer_type for module in attention if getattr(module, "store_full_length_kv", False)}
    return sorted({module.layer_type for module in attention if getattr(module, "is_kv_shared_layer", False)} - stored)


def _patched_forward(
    cls: type[nn.Module],
    rotations: tuple[Rotation, ...],
    rope: RoPE,
    keys_at_read: bool,
    layer_types: tuple[str, ...] = ("",),
) -> types.FunctionType:
    """A copy of ``cls.forward`` whose rotation functions are posenc's, each in the layout its original rotates in:
    one per attention class, rotation layouts, backend and (with ``keys_at_read``) layer types, shared by the layers
    of every model patched so (one compiled graph). With ``keys_at_read`` it rotates the keys at read with the RoPEs
    the attention module holds (``ROPES_ATTR``, set by patch_model), not ones of its globals: until 2026-12-05 each
    such model had a copy of its own, compiled again (the 8th 2-layer Llama hit the recompile limit, an error with
    fullgraph=True). A copy of other globals has code of its own (see ``_with_globals``), so torch.compile never
    runs one patch's graph for another. rope: the first installed RoPE (its backend); layer_types: with
    ``keys_at_read``, those of the RoPEs that rotate the keys ("" for a model with one rope dict)."""
    func = cls.forward
    namespace = innermost(func).__globals__
    replacements: dict[str, Any] = {}
    queries_then_keys: _QueriesThenKeys | None = None
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
        elif keys_at_read:  # q, then k: the second call's tensor is left to be rotated at read
            _require_queries_then_keys(cls, rotation.name)
            queries_then_keys = _QueriesThenKeys(functools.partial(_rotate_one, **options))
            replacements[rotation.name] = queries_then_keys
        else:
            replacements[rotation.name] = functools.partial(_rotate_one, **options)
    if keys_at_read:
        if _ATTENTION_REGISTRY_NAME not in namespace:
            raise ValueError(
                f"{cls.__qualname__}.forward does not use {_ATTENTION_REGISTRY_NAME}; mode='consistent' is not "
                "supported for it in this transformers version (use mode='hf')"
            )
        replacements[_ATTENTION_REGISTRY_NAME] = _KeysRotatedAtRead(namespace[_ATTENTION_REGISTRY_NAME])
    key = (rotations, rope.backend, keys_at_read, layer_types if keys_at_read else ())  # all replacements hold
    with _PATCHED_CLASSES_LOCK:
        registry = _registry(cls)
        shared = registry.get(key)
        if shared is None or not _holds_globals(innermost(shared), namespace, replacements):
            shared = registry[key] = _wrapped_forward(func, replacements, keys_at_read, queries_then_keys)
    return shared


def _wrapped_forward(
    func: types.FunctionType,
    replacements: Mapping[str, Any],
    keys_at_read: bool,
    queries_then_keys: _QueriesThenKeys | None,
) -> types.FunctionType:
    """``func`` with ``replacements`` for its globals, and the checks of the cache its patch needs around it."""
    copied = _checking_cos_width(_with_globals(func, replacements), func)
    if not keys_at_read:
        return _refusing_unrotated_keys(copied)
    checked = _checking_the_cache(copied)
    if _SHARED_KV_STATES in inspect.signature(innermost(func)).parameters:
        checked = _handing_out_rotated_shared_keys(checked)
    return checked if queries_then_keys is None else _counting_rotations(checked, queries_then_keys)


# The pair counts (rotary_dim // 2) of the RoPEs a patched model's rotary modules hold, on each attention module.
PAIRS_ATTR = "_posenc_rotary_pairs"


def _pair_counts(attention: nn.Module, installs: Sequence[tuple[Any, Any, Mapping[str, RoPE]]]) -> tuple[int, ...]:
    """The pair counts ``attention`` may be given cos/sin of: its layer type's RoPEs' where the rotary modules hold
    one per layer type (Gemma 3n / 4), else every RoPE's. Per layer type, since Gemma 4's sliding layers given
    transformers' cos/sin (256 wide at its real sizes) passed a check against the full layers' 256 pairs, and then
    failed inside the rotation with a message that did not say why."""
    layer_type = getattr(attention, "layer_type", None)
    ropes = [rope for _, _, by_type in installs for rope in by_type.values()]
    own = [rope for _, _, by_type in installs for key, rope in by_type.items() if key and key == layer_type]
    return tuple(sorted({rope.rotary_dim // 2 for rope in own or ropes}))


def _checking_cos_width(forward: types.FunctionType, original: types.FunctionType) -> types.FunctionType:
    """``forward`` preceded by a check of the cos/sin it is given as ``position_embeddings``: one value per rotated
    pair (posenc's rotary module), where transformers' repeat each for both channels of a pair. The rotation reads
    its width from cos, so transformers' cos/sin (made before patching, or by the model's own rotary class) rotated
    2 * rotary_dim channels at the wrong angles where they fit in the head (GPT-NeoX, Phi-3 and GLM at a partial
    rotary factor of 1/2: logits off by 18 to 350) without an error."""
    at = argument_position(innermost(original), "position_embeddings")
    if at is None:
        return forward

    @functools.wraps(forward)
    def checked(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        given = argument(args, kwargs, "position_embeddings", at)
        pairs = getattr(self, PAIRS_ATTR, None)
        if pairs and isinstance(given, tuple) and len(given) == 2 and isinstance(given[0], torch.Tensor):
            width = given[0].shape[-1]
            if not any(width == n for n in pairs):
                raise ValueError(
                    f"{type(self).__name__} was given position_embeddings (cos, sin) of width {width}, but posenc's "
                    f"rotation takes one value per rotated pair ({' or '.join(map(str, pairs))} here): transformers' "
                    "cos/sin (made before patch_model, or by the model's own rotary class) repeat each value for "
                    "both channels of a pair. Take them from the patched model's rotary module (e.g. "
                    "model.model.rotary_emb(hidden_states, position_ids)), or call unpatch_model first"
                )
        return forward(self, *args, **kwargs)

    return checked


def _holds_globals(copied: types.FunctionType, namespace: Mapping[str, Any], replacements: Mapping[str, Any]) -> bool:
    """Whether the globals that the copy ``copied`` reads are the modeling module's (``namespace``) as they are now,
    but for ``replacements``: a module changed since the copy was made (a function of it monkeypatched) needs a
    new copy. Only the names its code reads: others come and go (``__warningregistry__``, lazy imports)."""
    missing = object()
    # A stand-in for the attention registry wraps the module's: it must wrap the module's as it is now.
    registry = copied.__globals__.get(_ATTENTION_REGISTRY_NAME)
    if isinstance(registry, _KeysRotatedAtRead) and registry._functions is not namespace.get(_ATTENTION_REGISTRY_NAME):
        return False
    return all(
        copied.__globals__.get(name, missing) is namespace.get(name, missing)
        for name in _names_read(copied.__code__) - replacements.keys()
    )


def _names_read(code: types.CodeType) -> set[str]:
    """The global (and attribute) names ``code`` and the code nested in it (comprehensions, lambdas) read."""
    names = set(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names |= _names_read(const)
    return names


def _require_queries_then_keys(cls: type[nn.Module], name: str) -> None:
    """Raise ValueError unless ``cls.forward`` calls ``name`` exactly twice, first on ``query_states`` in a statement
    that always runs, then on ``key_states``: 'consistent' mode tells k from q by that order (Gemma 3n, Gemma 4)."""
    func = innermost(cls.forward)
    refusal = (
        f"{cls.__qualname__} rotates q and k in separate calls of {name}, and posenc's mode='consistent' tells the "
        "keys (left unrotated, to be rotated at read) from the queries by the order of the calls: q first, in a "
        "statement that always runs, then k"
    )
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(func)))
    except (OSError, TypeError, SyntaxError) as error:
        raise ValueError(f"{refusal}; its source cannot be read ({error}). Patch it with mode='hf'") from error
    body = next(node for node in ast.walk(tree) if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))).body
    calls = sorted(
        (
            node
            for node in ast.walk(tree)
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == name
        ),
        key=lambda node: (node.lineno, node.col_offset),
    )
    rotated = [ast.unparse(call.args[0]) if call.args else "?" for call in calls]
    # A statement at the top of the body, not a branch, loop or block, always runs.
    straight = [stmt for stmt in body if isinstance(stmt, (ast.Assign, ast.AnnAssign, ast.Expr, ast.Return))]
    first_always = bool(calls) and any(calls[0] in ast.walk(stmt) for stmt in straight)
    if rotated != ["query_states", "key_states"] or not first_always:
        raise ValueError(
            f"{refusal}, and this transformers version's forward rotates {', then '.join(rotated) or 'nothing'}"
            f"{'' if first_always else ' (the first conditionally)'}. Patch it with mode='hf'"
        )


def _counting_rotations(forward: types.FunctionType, queries_then_keys: _QueriesThenKeys) -> types.FunctionType:
    """``forward`` with its calls of ``queries_then_keys`` counted from 0: q, then k unless the layer reuses another
    layer's keys (``is_kv_shared_layer``). Another count is a RuntimeError, not a model that attends wrongly."""

    @functools.wraps(forward)
    def counted(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        queries_then_keys.begin()
        out = forward(self, *args, **kwargs)
        made, expected = queries_then_keys.calls_made(), 1 if getattr(self, "is_kv_shared_layer", False) else 2
        if made != expected:
            raise RuntimeError(
                f"posenc's 'consistent' mode expected {expected} rotation call(s) in {type(self).__qualname__}'s "
                f"forward (q{'' if expected == 1 else ', then k'}), got {made}; this attention differs from the one "
                "posenc checked when patching (patch with mode='hf')"
            )
        return out

    return counted


def is_patched(model: nn.Module) -> bool:
    """True when ``patch_model`` patched this model and ``unpatch_model`` has not undone it."""
    return _patch_state(model) is not None


def unpatch_model(model: nn.Module) -> PatchReport:
    """Undo ``patch_model``: the original rotary modules, each attention module's own class (and an instance
    forward the patch bypassed), and the config's rope values as they were before patching. Returns the report of
    the patch that was undone.

    A KV cache filled in ``mode="consistent"`` with ``dynamic`` / ``longrope`` holds unrotated keys, which the
    unpatched model, rotating keys when it caches them, would attend to as they are, with no error (posenc no
    longer runs in it to refuse them): start a new cache, or continue that one after ``patch_model(model,
    mode="consistent")``."""
    state = _patch_state(model)
    if state is None:
        raise ValueError(f"model is not patched by posenc{_where_the_patch_is(model)}")
    # The originals were outside the module tree while patched: follow a device move made meanwhile, and a dtype
    # cast that changed the model's floating parameters (model.to(torch.bfloat16) would have cast inv_freq too). A
    # cast to the dtype the parameters already had goes unseen.
    dtype = _weights_dtype(model)
    cast = dtype if dtype is not None and dtype != state.weights_dtype else None
    for key, value in state.original_config_values.items():
        setattr(state.config, key, value)
    for parent_name, attr, original in state.rotary:
        parent = model.get_submodule(parent_name)
        patched = getattr(parent, attr)
        original.to(device=patched.device, dtype=cast)
        if isinstance(patched, PosencRotaryEmbedding):
            for layer_type, rope in patched._ropes().items():
                if rope.rope_type == "dynamic" and rope.mode == "hf":
                    _hand_back_dynamic_state(original, layer_type, rope.hf_scaled_len)
        setattr(parent, attr, original)
    for module, cls, replaced in zip(state.attention, state.classes, state.replaced_forwards, strict=True):
        _restore_forward(module, cls, replaced)
        module.__dict__.pop(ROPES_ATTR, None)
        module.__dict__.pop(PAIRS_ATTR, None)
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
