"""Where a loaded ``transformers`` model keeps its RoPE, and what its rotation functions do: the parts that
``posenc.interop.patch`` replaces, found by inspecting the model and checked by running them.

A model qualifies when

* its cos/sin come from modules of one ``*RotaryEmbedding`` class holding an ``inv_freq`` buffer (or one
  ``{layer_type}_inv_freq`` per layer type, for configs with a rope dict per layer type); a vision or audio
  tower's rotary embedding and rotation are not counted, and stay transformers', and
* its attention modules rotate by calling module-level functions named ``apply_rotary_pos_emb*`` whose first four
  parameters are (q, k, cos, sin) and which take ``unsqueeze_dim``, as ~170 transformers architectures do.

Each such function is then run on random q and k with cos/sin from a copy of the model's own rotary module, and
must equal posenc's rotation of the first r channels in one of the two pair layouts. That decides which layout
replaces it (DeepSeek-V3.2 rotates its indexer's keys split-half and its attention's interleaved), and refuses a
function that rotates any other way (by the negative angle, the last r channels, ...) before the model is touched.

Shape key: b batch, h heads, s tokens, d head dim, r rotary dim.
"""

from __future__ import annotations

import copy
import dataclasses
import inspect
import re
import types
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from posenc.rope.apply import apply_rotary_qk
from posenc.rope.module import RoPE, angles_to_cos_sin
from posenc.rope.mrope import mrope_cos_sin

ROTATION_PREFIX = "apply_rotary_pos_emb"
_TOWER = re.compile(r"vision|audio", re.IGNORECASE)  # the encoders of multimodal models, which keep their own RoPE
# Positions the probe rotates at: below any trained length, so a dynamic / LongRoPE module keeps its state.
_PROBE_POSITIONS = (0, 1, 2, 3, 5, 8, 12, 15)
_PROBE_TOLERANCE = 1e-4  # float32 rotation of unit-scale values at positions < 16; a wrong layout is off by ~1


@dataclasses.dataclass(frozen=True)
class Rotation:
    """One rotation function of a modeling module, as probed.

    name: its global name (``apply_rotary_pos_emb`` or a variant); interleaved: the pair layout it rotates in;
    regrouped: True when it returns the rotated channels evens first, then odds (the MLA models'
    ``apply_rotary_pos_emb_interleave``): the same q.k for every pair of q and k, so posenc rotates them in place;
    unsqueeze_at: the index, among the arguments after (q, k, cos, sin), at which a positional ``unsqueeze_dim``
    arrives; unsqueeze_default: its default; tensors: 2 for a function of (q, k, cos, sin, ...), 1 for one of
    (x, cos, sin, ...) that the attention calls on q and on k in turn (Gemma 3n, Gemma 4).
    """

    name: str
    interleaved: bool
    regrouped: bool
    unsqueeze_at: int
    unsqueeze_default: int
    tensors: int = 2

    @property
    def layout(self) -> str:
        if not self.interleaved:
            return "split-half"
        return "interleaved, returned evens then odds" if self.regrouped else "interleaved"


@dataclasses.dataclass(frozen=True)
class ModelRope:
    """The RoPE parts of a model. rotary: (name, module) of each rotary embedding, all of ``rotary_cls``;
    attention: the modules whose forward rotates, with ``calls`` naming the rotation functions per class;
    """

    model_type: str
    rotary: tuple[tuple[str, nn.Module], ...]
    rotary_cls: type[nn.Module]
    attention: tuple[nn.Module, ...]
    calls: Mapping[type[nn.Module], tuple[str, ...]]


def state_name(layer_type: str | None, name: str) -> str:
    """transformers' name for one layer type's rope state ("sliding_attention_inv_freq"); name itself without one."""
    return f"{layer_type}_{name}" if layer_type else name


def _common_parent(names: list[str]) -> str:
    """The longest dotted prefix that the parents of all the module names share ("" for the model itself)."""
    common: list[str] = []
    for level in zip(*(name.split(".")[:-1] for name in names), strict=False):
        if len(set(level)) != 1:
            break
        common.append(level[0])
    return ".".join(common)


def innermost(func: Callable[..., Any]) -> types.FunctionType:
    """The function under its functools.wraps decorators, and under the ``nn.Module`` that the ``kernels``
    package (which transformers >= 5.25 requires) makes of a function it may swap for a hub kernel
    (``use_kernel_forward_from_hub`` on transformers' ``apply_rotary_pos_emb``): its class's forward calls the
    function, the one function in its closure."""
    while True:
        if hasattr(func, "__wrapped__"):
            func = func.__wrapped__
        elif isinstance(func, nn.Module) and (inner := _function_in_closure(type(func).forward)) is not None:
            func = inner
        else:
            return func  # type: ignore[return-value]


def _function_in_closure(method: Callable[..., Any]) -> types.FunctionType | None:
    """The one plain function among ``method``'s closure cells; None where there is none or more than one."""
    found = []
    for cell in getattr(method, "__closure__", None) or ():
        try:
            contents = cell.cell_contents
        except ValueError:  # an empty cell
            continue
        if isinstance(contents, types.FunctionType):
            found.append(contents)
    return found[0] if len(found) == 1 else None


def rotation_names(cls: type[nn.Module]) -> tuple[str, ...]:
    """The ``apply_rotary_pos_emb*`` functions that ``cls.forward`` calls by global name, in its module."""
    forward = innermost(cls.forward)
    code, namespace = getattr(forward, "__code__", None), getattr(forward, "__globals__", {})
    if code is None:
        return ()
    return tuple(
        sorted(name for name in code.co_names if name.startswith(ROTATION_PREFIX) and callable(namespace.get(name)))
    )


def _rotates_outside_forward(cls: type[nn.Module]) -> str | None:
    """'Class.method calls apply_rotary_pos_emb' for the first method of ``cls`` other than forward that calls a
    rotation function (Qwen4-Exp's indexer rotates its pooled keys in _select_tokens), its own or inherited, static,
    or decorated; None where none does."""
    for klass in cls.__mro__:
        if klass.__module__.startswith("torch."):
            continue
        for attr, value in vars(klass).items():
            function = getattr(value, "__func__", value)  # staticmethod, classmethod
            if isinstance(function, types.FunctionType):  # under functools.wraps decorators (torch.no_grad())
                function = innermost(function)
            code = getattr(function, "__code__", None)
            if attr == "forward" or code is None:
                continue
            namespace = function.__globals__
            for called in sorted(code.co_names):
                if called.startswith(ROTATION_PREFIX) and callable(namespace.get(called)):
                    return f"{klass.__name__}.{attr} calls {called}"
    return None


def find_rope_modules(model: nn.Module, model_type: str) -> ModelRope:
    """The rotary embeddings and rotating attention modules of ``model``; ValueError naming what is missing."""
    rotary = tuple(
        (name, module) for name, module in model.named_modules() if type(module).__name__.endswith("RotaryEmbedding")
    )
    classes = sorted({type(module).__name__ for _, module in rotary})
    if len(classes) > 1:
        # A vision-language model: its vision (or audio) tower's rotary embedding feeds the tower's own rotation,
        # which stays transformers'; only the text model's RoPE is replaced. (One class is taken whatever its name:
        # HiggsAudio's text model has HiggsAudioV2RotaryEmbedding.)
        rotary = tuple((name, module) for name, module in rotary if not _TOWER.search(type(module).__name__))
        classes = sorted({type(module).__name__ for _, module in rotary})
    if len(classes) != 1:
        found = f"{len(classes)} ({', '.join(classes)})" if classes else "none"
        raise ValueError(
            f"posenc patches models whose cos/sin come from one *RotaryEmbedding class; this {model_type} model has "
            f"{found}"
        )
    rotary_cls = type(rotary[0][1])
    if not any(name.endswith("inv_freq") for name, _ in rotary[0][1].named_buffers(recurse=False)):
        raise ValueError(
            f"its {rotary_cls.__name__} holds no inv_freq buffer (a fixed sin/cos table instead), so posenc cannot "
            "check its frequencies against posenc's; build posenc.RoPE from posenc.interop.rope_from_config(config)"
        )
    # The attention modules that get these cos/sin: those under the rotary modules' common parent (not a vision
    # tower's, which may call apply_rotary_pos_emb too, with cos/sin of its own).
    prefix = _common_parent([name for name, _ in rotary])
    calls: dict[type[nn.Module], tuple[str, ...]] = {}
    attention = []
    for name, module in model.named_modules():
        if prefix and not (name == prefix or name.startswith(prefix + ".")):
            continue
        cls = type(module)
        if cls not in calls:
            calls[cls] = rotation_names(cls)
            outside = _rotates_outside_forward(cls)
            if outside:
                raise ValueError(
                    f"its {outside} outside forward: posenc replaces only the rotation functions that forward "
                    "calls, so there transformers' own would rotate with posenc's cos/sin, r/2 values per token where "
                    "it takes r"
                )
        if calls[cls]:
            attention.append(module)
    calls = {cls: names for cls, names in calls.items() if names}
    for cls in calls:
        cut = _indexes_cos_sin(cls)
        if cut:
            raise ValueError(
                f"its {cls.__name__} cuts cos/sin itself ({cut}), which transformers' cos/sin of r values per token "
                "allow and posenc's r/2 do not"
            )
    if not attention:
        raise ValueError(
            f"no module of this {model_type} model rotates by calling a module-level {ROTATION_PREFIX}* function, "
            "the step posenc replaces; its attention rotates some other way, which posenc cannot patch"
        )
    return ModelRope(model_type, rotary, rotary_cls, tuple(attention), calls)


_COS_SIN_CUT = re.compile(r"\b(?:cos|sin)\s*\[[^\]]*\]|\b(?:cos|sin)\.(?:narrow|chunk|split)\(")


def _indexes_cos_sin(cls: type[nn.Module]) -> str | None:
    """The first place where ``cls.forward`` slices cos or sin (MiniMax-M3's indexer: ``cos[..., :head_dim]``)."""
    try:
        source = inspect.getsource(innermost(cls.forward))
    except (OSError, TypeError):
        return None
    code = "\n".join(line.split("#", 1)[0] for line in source.splitlines())
    match = _COS_SIN_CUT.search(code)
    return match.group(0) if match else None


def rotation_signature(function: Callable[..., Any], name: str) -> tuple[int, int, int]:
    """(unsqueeze_at, unsqueeze_default, tensors) of a rotation function; ValueError unless it is (q, k, cos, sin)
    or (x, cos, sin) followed by unsqueeze_dim and at most position_ids."""
    try:
        signature = inspect.signature(innermost(function))
    except (TypeError, ValueError) as error:
        raise ValueError(f"{name} has no readable signature ({error})") from error
    parameters = list(signature.parameters.values())
    names = [p.name for p in parameters]
    positional = [p for p in parameters if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    tensors = next((n for n in (2, 1) if len(positional) >= n + 2 and names[n : n + 2] == ["cos", "sin"]), None)
    if tensors is None or "unsqueeze_dim" not in names:
        raise ValueError(f"{name}{signature} is not (q, k, cos, sin, ..., unsqueeze_dim) or (x, cos, sin, ...)")
    # Arguments posenc's replacement would ignore must be ones that transformers' functions ignore too: an unknown
    # one could change what the function does in a call the probe did not make.
    unknown = [n for n in names[tensors + 2 :] if n not in ("unsqueeze_dim", "position_ids")]
    if unknown:
        raise ValueError(f"{name} takes {', '.join(unknown)}, which posenc's rotation has no counterpart for")
    at = names.index("unsqueeze_dim")
    default = parameters[at].default
    return at - tensors - 2, 1 if default is inspect.Parameter.empty else int(default), tensors


def buffer_order(pairs: int, mrope: tuple[Sequence[int], str] | None = None) -> torch.Tensor:
    """(pairs,) int64: the order in which a transformers rotary embedding keeps the frequencies of its pairs in its
    ``inv_freq`` buffer; mrope: (mrope_section, mrope_layout) of a multimodal RoPE.

    Pair order everywhere but ERNIE-4.5-VL's alternating M-RoPE, whose buffer holds the h/w pairs' frequencies
    evens first, then odds, then t's, so that a split by its sections gives each axis its pairs (its
    ``recomposition_frequencies`` interleaves h and w again, which is the pair order)."""
    order = torch.arange(pairs)
    if mrope is None or mrope[1] != "alternating":
        return order
    spatial = mrope[0][0] + mrope[0][1]
    return torch.cat((order[:spatial:2], order[1:spatial:2], order[spatial:]))


def run_rotary(module: nn.Module, x: torch.Tensor, positions: torch.Tensor, layer_type: str | None) -> Any:
    """``module(x, position_ids)`` for a model's rotary embedding, with the ``layer_type`` argument that rotary
    embeddings with a rope dict per layer type take; under no_grad."""
    with torch.no_grad():
        return module(x, positions, layer_type) if layer_type else module(x, positions)


def forward_scaling(module: nn.Module, layer_type: str | None, *, default: float) -> float:
    """The factor a rotary module's forward scales cos/sin by, read as its cos at position 0 (a copy is run: the
    forward may advance a dynamic state). It need not be the ``attention_scaling`` it holds: PhiMoE's forward scales
    by the config's mscale instead. ``default`` where the forward gives no real (cos, sin) to read (a complex
    ``freqs_cis``, or a module that needs more than (x, position_ids))."""
    probe = copy.deepcopy(module)
    buffer = getattr(probe, state_name(layer_type, "inv_freq"))
    x = torch.zeros(1, 1, 1, device=buffer.device)
    positions = torch.zeros(1, 1, dtype=torch.long, device=buffer.device)
    try:
        out = run_rotary(probe, x, positions, layer_type)
    except Exception:  # the attribute is then all there is to read
        return default
    if not (isinstance(out, (tuple, list)) and len(out) == 2 and isinstance(out[0], torch.Tensor)):
        return default
    cos = out[0]
    if cos.is_complex() or not cos.is_floating_point() or cos.numel() == 0:
        return default
    return float(cos.flatten()[0])


def far_position_problem(
    rotary: nn.Module,
    layer_type: str | None,
    rope: RoPE,
    rotated: Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], Any],
    layout: tuple[bool, bool],
    generator: torch.Generator,
) -> str:
    """Why ``rotated`` (the model's rotation function, called with cos/sin from a copy of ``rotary``) differs from
    posenc's rotation by ``rope`` in ``layout`` at far positions, or "" where it does not.

    Each call is one sequence: positions up to the trained length, just past it, and 4x past it, as a prefill or a
    decode step there would ask, with ``rope``'s cos/sin for the length the copy scaled for. This sees what the
    model's forward does beyond its inv_freq buffer at lengths the probe below 16 does not reach: Mistral Large 4's
    learned LeRoPE alpha on slow pairs, PhiMoE's length-dependent mscale."""
    probe = copy.deepcopy(rotary)
    buffer = getattr(probe, state_name(layer_type, "inv_freq"))
    device = buffer.device
    limit = int(getattr(probe, "original_max_seq_len", 0) or rope.max_position_embeddings or 16)
    # HF's float32 angles are off by up to position * inv_freq * eps (of the buffer's dtype: a bf16 model's may be
    # bf16), times |x| up to ~5 for these q, k.
    eps = max(2.0**-24, torch.finfo(buffer.dtype).eps / 2)
    r = rope.rotary_dim
    interleaved, regrouped = layout
    for positions in ((0, 1, limit - 1), (0, limit, 2 * limit + 3), (0, 3, 4 * limit + 7)):
        ids = torch.tensor([positions], device=device)
        try:
            cos, sin = run_rotary(probe, torch.zeros(1, 3, 1, device=device), ids, layer_type)
        except Exception:  # a model that cannot run there itself (GPT-J's fixed table ends at its trained length)
            continue
        length = max(positions) + 1
        if rope.rope_type == "dynamic":  # the length transformers' dynamic state scaled for in that call
            length = max(length, int(getattr(probe, state_name(layer_type, "max_seq_len_cached"), length)))
        ours_cos, ours_sin = rope.cos_sin(ids[0].cpu(), seq_len=length)
        q = torch.randn(1, 2, 3, r, generator=generator, dtype=torch.float32)
        k = torch.randn(1, 1, 3, r, generator=generator, dtype=torch.float32)
        ours = apply_rotary_qk(
            q, k, ours_cos[None, None], ours_sin[None, None], interleaved=interleaved, backend="torch"
        )
        if regrouped:
            ours = tuple(torch.cat((t[..., 0:r:2], t[..., 1:r:2]), dim=-1) for t in ours)
        with torch.no_grad():
            theirs = rotated(q.to(device), k.to(device), cos, sin)
        tolerance = _PROBE_TOLERANCE + 8 * max(positions) * eps
        worst = max((t.detach().float().cpu() - o).abs().max().item() for t, o in zip(theirs, ours, strict=True))
        if not worst <= tolerance:
            learned = [name for name, _ in probe.named_parameters()]
            why = f"; it has learned parameters ({', '.join(learned)}) that posenc does not read" if learned else ""
            return (
                f"at positions {list(positions)} the model's {type(rotary).__name__} rotates differently from "
                f"posenc's RoPE for its config (rope_type={rope.rope_type!r}): off by {worst:.3g}, allowed "
                f"{tolerance:.3g}{why}. Its forward computes cos/sin from more than its inv_freq and attention "
                "scaling; patching would change the model's logits there"
            )
    return ""


def probe_rotation(
    name: str,
    function: Callable[..., Any],
    rotary: nn.Module,
    *,
    layer_type: str | None,
    head_dim: int,
    mrope: tuple[Sequence[int], str] | None = None,
    rope: RoPE | None = None,
) -> Rotation:
    """Run ``function`` (a model's ``apply_rotary_pos_emb*``) with cos/sin from a copy of ``rotary`` and return
    the layout in which it equals posenc's rotation; ValueError saying how it differs otherwise.

    rope: posenc's RoPE for the model (not M-RoPE); given, the layout found is then checked at far positions too,
    past the trained length, against ``rope``'s own cos/sin (``far_position_problem``).

    The copy is called at positions below 16, and posenc's cos/sin are made from the frequencies and scaling the
    copy holds after that call: this checks the rotation, not the frequencies (``patch`` compares those). mrope:
    (mrope_section, mrope_layout) of a multimodal RoPE, whose rotary embedding is then called with three axes of
    ids that differ, and posenc's cos/sin made by ``posenc.rope.mrope.mrope_cos_sin``: so the sharing of the pairs
    among the axes is checked with the rotation.
    """
    unsqueeze_at, unsqueeze_default, tensors = rotation_signature(function, name)

    def rotated(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> Any:
        return function(q, k, cos, sin) if tensors == 2 else (function(q, cos, sin), function(k, cos, sin))

    probe = copy.deepcopy(rotary)
    buffer = getattr(probe, state_name(layer_type, "inv_freq"), None)
    if not isinstance(buffer, torch.Tensor) or buffer.is_meta:
        raise ValueError(f"{type(rotary).__name__} holds no {state_name(layer_type, 'inv_freq')} to run {name} with")
    device = buffer.device
    limit = int(getattr(probe, "original_max_seq_len", 0) or 16)
    positions = torch.tensor([[min(p, limit - 1) for p in _PROBE_POSITIONS]], device=device)
    if mrope is not None:  # three axes that differ, so that the layout of the axes is checked too
        positions = torch.stack((positions, positions.flip(-1), positions // 2))
    x = torch.zeros(1, positions.shape[-1], 1, device=device)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        try:
            cos, sin = run_rotary(probe, x, positions, layer_type)
        except Exception as error:  # a rotary module that needs more than (x, position_ids): cannot be checked
            raise ValueError(f"{type(rotary).__name__} could not be run to check {name}: {error}") from error
        inv_freq = getattr(probe, state_name(layer_type, "inv_freq")).detach().to(torch.float64)
        inv_freq = inv_freq[torch.argsort(buffer_order(inv_freq.numel(), mrope)).to(device)]  # in pair order
        scaling = forward_scaling(
            rotary, layer_type, default=float(getattr(probe, state_name(layer_type, "attention_scaling"), 1.0))
        )
        if mrope is None:
            ours_cos, ours_sin = angles_to_cos_sin(positions, inv_freq, scaling, torch.float32)
        else:
            section, layout_of_axes = mrope
            ours_cos, ours_sin = mrope_cos_sin(
                positions, inv_freq, section, scaling, torch.float32, layout=layout_of_axes
            )
        ours_cos, ours_sin = ours_cos.unsqueeze(1), ours_sin.unsqueeze(1)  # (1, 1, s, r/2)
        r = 2 * inv_freq.numel()
        width = {r, head_dim} if head_dim > r else {r}
        layout = None
        problem = ""
        for d in sorted(width):
            q = torch.randn(1, 2, positions.shape[-1], d, generator=generator).to(device)
            k = torch.randn(1, 1, positions.shape[-1], d, generator=generator).to(device)
            try:
                theirs = rotated(q, k, cos, sin)
            except Exception as error:
                if d == r:  # with r channels every rotation function must run
                    raise ValueError(f"{name} failed on q, k of {r} channels: {error}") from error
                continue  # the attention slices the rotated channels out before calling it
            if tensors == 1 and not all(isinstance(t, torch.Tensor) for t in theirs):
                raise ValueError(f"{name} returned {type(theirs[0]).__name__}, not the rotated tensor")
            if not (isinstance(theirs, (tuple, list)) and len(theirs) == 2):
                raise ValueError(f"{name} returned {type(theirs).__name__}, not (q, k)")
            candidates = (layout,) if layout is not None else ((False, False), (True, False), (True, True))
            for interleaved, regrouped in candidates:
                ours = apply_rotary_qk(q, k, ours_cos, ours_sin, interleaved=interleaved, backend="torch")
                if regrouped:
                    ours = tuple(torch.cat((t[..., 0:r:2], t[..., 1:r:2], t[..., r:]), dim=-1) for t in ours)
                if all(
                    isinstance(t, torch.Tensor) and t.shape == o.shape and torch.allclose(t, o, atol=_PROBE_TOLERANCE)
                    for t, o in zip(theirs, ours, strict=True)
                ):
                    layout = (interleaved, regrouped)
                    break
            else:
                problem = f"on q, k of {d} channels it matches neither pair layout of posenc's rotation"
                if d > r:
                    problem += f" of the first {r}"
                layout = None
                break
    if layout is None:
        raise ValueError(
            f"{name} does not rotate as posenc does: {problem}, with the cos/sin that {type(rotary).__name__}'s "
            "inv_freq and attention scaling give (either the function rotates otherwise, or the rotary embedding's "
            "forward computes its cos/sin from more than those)"
        )
    if rope is not None and mrope is None:
        problem = far_position_problem(rotary, layer_type, rope, rotated, layout, generator)
        if problem:
            raise ValueError(problem)
    # posenc rotates q and k with one cos/sin per token of each: a function that also takes a q shorter than its
    # cos/sin (MuSE-Glimmer's assistant rotates the last q_len of them) must have been given one by its model.
    short_q = torch.randn(1, 2, 2, r, generator=generator).to(device)
    try:
        with torch.no_grad():
            rotated(short_q, k[..., :r], cos, sin)
    except Exception:
        return Rotation(name, layout[0], layout[1], unsqueeze_at, unsqueeze_default, tensors)
    raise ValueError(
        f"{name} rotates a q of fewer tokens than its cos/sin (against the last of them), which posenc's rotation, one "
        "cos/sin per token of q and of k, does not"
    )
