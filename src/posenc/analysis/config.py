"""``FigureConfig``: the one RoPE configuration the figures and the report draw, validated by the real parser.

It holds plain values and a Hugging Face-style ``rope_parameters`` dict; ``parse_rope_parameters`` validates it,
so a config that RoPE itself would reject is rejected here with the same message.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from posenc._checks import flag, positive_int
from posenc.analysis.frequencies import EXAMPLE_ROPE_PARAMETERS, example_rope_parameters, is_extension_factor
from posenc.interop.hf import num_heads_from_config, read_config_json, rope_kwargs_from_config, rope_layer_types
from posenc.rope.frequencies import turns_fraction_of_pairs
from posenc.rope.parameters import (
    REQUIRED_KEYS,
    RopeSpec,
    parse_rope_parameters,
    pop_rope_type,
    rotary_fraction,
    trained_length,
)

# The training length the figures assume when nothing says otherwise.
DEFAULT_TRAIN_LEN = 2048
# Keys of a Hugging Face model config.json that say something about positions; the rest are ignored there.
_HF_MARKERS = frozenset({"hidden_size", "num_attention_heads", "model_type"})


def _check_odd_head_dim(head_dim: int, rope_parameters: Mapping[str, Any]) -> None:
    """RoPE's own error for an odd head_dim says to pass rotary_dim, which figures take as a rotary fraction."""
    if head_dim % 2 == 0 or head_dim == 1 or "partial_rotary_factor" in rope_parameters:
        return
    if turns_fraction_of_pairs(rope_parameters.get("rope_type", rope_parameters.get("type"))):
        return  # its own error says all channels turn in pairs
    # A fraction whose product with head_dim truncates to head_dim - 1 with room to spare for float rounding.
    fraction = round((head_dim - 0.5) / head_dim, 6)
    raise ValueError(
        f"head_dim={head_dim} is odd and RoPE rotates channels in pairs: use an even head_dim, or rotate "
        f"{head_dim - 1} of the {head_dim} channels with the rope parameter partial_rotary_factor={fraction} "
        f"(posenc plot / report: --rope-param partial_rotary_factor={fraction})"
    )


def _fraction(rope: Mapping[str, Any]) -> float:
    """The rope dict's partial_rotary_factor as a float in (0, 1], or 1.0 standing in for a value that is not one,
    which parse_rope_parameters then refuses, naming it ('abc' * 64 was a string of 192 letters in int()'s message,
    inf an OverflowError traceback, NaN "cannot convert float NaN to integer"). Any real number the parser takes
    (numpy's, Fraction, a 0-d tensor) is read as itself."""
    value = rope.get("partial_rotary_factor", 1.0)
    if isinstance(value, (str, bytes, bool)):
        return 1.0
    try:
        fraction = float(value)
    except (TypeError, ValueError, OverflowError):
        return 1.0
    return fraction if 0 < fraction <= 1 else 1.0


@dataclasses.dataclass(frozen=True)
class FigureConfig:
    """What the figures are drawn for.

    head_dim: d per attention head; rope_parameters: Hugging Face-style dict (``rope_type``, ``rope_theta``,
    ``factor``, ...); train_len: the training context L (passed to RoPE as ``max_position_embeddings``; default
    the scaling's ``original_max_position_embeddings``, which it must equal when both are given, else 2048);
    eval_len: the longer context an extension is evaluated at (default: rope_parameters' ``factor`` times train_len
    when it is above 1, the length the scaling extends to, else 4 * train_len; length-dependent types
    scale for it);
    num_heads: h, for the ALiBi / T5 bias matrices (the random model of attention_entropy has 2 heads of head_dim);
    interleaved: adjacent pairs (RoFormer, GPT-J, DeepSeek) rather than split halves, which decides the channels
    figure 1 draws (frequencies do not depend on it).
    """

    head_dim: int = 64
    rope_parameters: Mapping[str, Any] = dataclasses.field(
        default_factory=lambda: {"rope_type": "default", "rope_theta": 10000.0}
    )
    train_len: int | None = None
    eval_len: int | None = None
    num_heads: int = 8
    interleaved: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "head_dim", positive_int("head_dim", self.head_dim))
        if not isinstance(self.rope_parameters, Mapping):
            raise TypeError(
                "rope_parameters must be a dict like {'rope_type': 'default', 'rope_theta': 10000.0}, "
                f"got {type(self.rope_parameters).__name__}"
            )
        object.__setattr__(self, "rope_parameters", dict(self.rope_parameters))
        _check_odd_head_dim(self.head_dim, self.rope_parameters)
        # The figures' L (the dashed line, the length the extensions scale from) is the scaling's own. A bad value
        # of the key is left to parse_rope_parameters below, whose message names it.
        original = trained_length(self.rope_parameters.get("original_max_position_embeddings"))  # 4096.0, numpy's
        if isinstance(original, bool) or not isinstance(original, int) or original <= 0:
            original = None
        else:  # as a plain int, for the config's JSON
            self.rope_parameters["original_max_position_embeddings"] = original
        if self.train_len is None:
            object.__setattr__(self, "train_len", DEFAULT_TRAIN_LEN if original is None else original)
        elif original is not None and original != self.train_len:
            raise ValueError(
                f"train_len={self.train_len} but rope_parameters say original_max_position_embeddings={original}: "
                "both are the length the model was trained at; give one (train_len follows it when left out)"
            )
        object.__setattr__(self, "train_len", positive_int("train_len", self.train_len))
        if self.train_len < 2:
            raise ValueError("train_len must be >= 2: the extensions drawn scale from it (LongRoPE divides by its log)")
        if self.eval_len is None:  # the length the scaling extends to, else 4x
            factor = self.rope_parameters.get("factor")
            extends = isinstance(factor, (int, float)) and not isinstance(factor, bool) and 1 < factor < math.inf
            object.__setattr__(self, "eval_len", round(factor * self.train_len) if extends else 4 * self.train_len)
        object.__setattr__(self, "eval_len", positive_int("eval_len", self.eval_len))
        if self.eval_len < self.train_len:
            raise ValueError(
                f"eval_len={self.eval_len} must be >= train_len={self.train_len}: it is the longer context an "
                "extension is evaluated at"
            )
        object.__setattr__(self, "num_heads", positive_int("num_heads", self.num_heads))
        flag("interleaved", self.interleaved)
        # Raises on an unknown type, a missing or unused key, a bad base or rotary fraction.
        object.__setattr__(
            self,
            "_spec",
            parse_rope_parameters(self.head_dim, self.rope_parameters, max_position_embeddings=self.train_len),
        )

    @property
    def spec(self) -> RopeSpec:
        """The validated RoPE spec (rotary dim, base, type and the type's own parameters)."""
        return self._spec  # type: ignore[attr-defined]

    @property
    def base(self) -> float:
        """theta in theta_i = base^(-2i/r), read from rope_parameters (rope_theta)."""
        return self.spec.base

    @property
    def rope_type(self) -> str:
        """The scaling type of rope_parameters, as transformers names it."""
        return self.spec.rope_type

    def rope_kwargs(self) -> dict[str, Any]:
        """Arguments for ``posenc.RoPE(head_dim, **kwargs)`` that build the RoPE this config describes."""
        return {
            "rope_parameters": dict(self.rope_parameters),
            "max_position_embeddings": self.train_len,
            "interleaved": self.interleaved,
        }

    @classmethod
    def from_mapping(cls, data: Mapping[str, Any], *, layer_type: str | None = None) -> FigureConfig:
        """Build from this class's fields, or from a Hugging Face model ``config.json`` dict.

        A Hugging Face config (one with ``hidden_size`` / ``num_attention_heads`` / ``model_type``) is read the way
        ``posenc.interop.rope_from_config`` reads it (old and new forms, GPT-J's absolute ``rotary_dim``,
        GPT-NeoX's ``rotary_pct``, DeepSeek's ``qk_rope_head_dim``, Phi-3's top-level original length); train_len
        is the original (trained) length the scaling names, else ``max_position_embeddings``, and eval_len is
        ``max_position_embeddings`` when it is longer than train_len, else 4 * train_len.
        layer_type: for a Hugging Face config with one rope dict per layer type (Gemma 3, ModernBERT:
        'sliding_attention' / 'full_attention'), which one to draw; such a config needs it.
        """
        if not isinstance(data, Mapping):
            raise TypeError(f"a figure config must be a JSON object (a dict), got {type(data).__name__}")
        if _HF_MARKERS & data.keys():
            return cls._from_hugging_face(data, layer_type)
        if layer_type is not None:
            raise ValueError(
                f"layer_type={layer_type!r} picks a rope dict of a Hugging Face config.json with one per layer type; "
                "this is a figure config of its own, which has one RoPE: drop layer_type"
            )
        fields = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(data.keys() - fields)
        if unknown:
            raise ValueError(
                f"figure config has unknown key(s) {', '.join(unknown)}; it accepts {', '.join(sorted(fields))} "
                "(or a Hugging Face model config.json with hidden_size and num_attention_heads)"
            )
        return cls(**data)

    @classmethod
    def _from_hugging_face(cls, data: Mapping[str, Any], layer_type: str | None) -> FigureConfig:
        # The RoPE a model does, read as posenc.interop.rope_from_config reads it (every per-model spelling), then
        # said in this class's terms: an absolute rotary dim as a fraction, and a factor the model leaves implicit
        # (max / original: Phi-3, DeepSeek) made explicit, because the figures scale from train_len = the original.
        layer_types = rope_layer_types(data)
        if layer_types and layer_type not in layer_types:
            # rope_kwargs_from_config's own error asked for a keyword argument that `posenc plot --config` has no
            # way to give.
            unknown = "" if layer_type is None else f"layer_type={layer_type!r} is none of them; "
            raise ValueError(
                f"this config has one rope dict per layer type ({', '.join(layer_types)}) and the figures draw one "
                f"RoPE: {unknown}pick it with layer_type= (posenc plot / report: --layer-type {layer_types[0]})"
            )
        kwargs = rope_kwargs_from_config(data, layer_type=layer_type)
        head_dim = kwargs["head_dim"]
        rope = dict(kwargs["rope_parameters"])
        if "rotary_dim" in kwargs:
            rope["partial_rotary_factor"] = rotary_fraction(kwargs["rotary_dim"], head_dim)
        max_positions = kwargs["max_position_embeddings"]
        spec = parse_rope_parameters(head_dim, rope, max_position_embeddings=max_positions)
        if rope.get("factor") is None and "factor" in spec.params:
            rope["factor"] = spec.params["factor"]
        train_len = trained_length(rope.get("original_max_position_embeddings")) or max_positions or DEFAULT_TRAIN_LEN
        # A config that extends past its training length says how far; otherwise look 4x past it.
        eval_len = max_positions if max_positions and max_positions > train_len else 4 * train_len
        # The text model's heads, found where the RoPE is: top-level keys alone drew a vision-language model (its
        # heads in text_config) or DBRX (n_heads) with the default 8, and the ALiBi panels with 8 heads' slopes;
        # those of the layer type drawn (its per_layer_config's).
        num_heads = num_heads_from_config(data, layer_type=layer_type)
        return cls(
            head_dim=head_dim,
            rope_parameters=rope,
            train_len=train_len,
            eval_len=eval_len,
            num_heads=num_heads if num_heads is not None else cls.num_heads,
            interleaved=kwargs["interleaved"],
        )

    @classmethod
    def from_flags(
        cls,
        *,
        head_dim: int | None = None,
        base: float | None = None,
        rope_type: str | None = None,
        rope_parameters: Mapping[str, Any] | None = None,
        train_len: int | None = None,
        eval_len: int | None = None,
        num_heads: int | None = None,
        interleaved: bool | None = None,
    ) -> FigureConfig:
        """Build from command-line style options; None means the default. rope_parameters holds the type's own
        keys (``factor``, ``beta_fast``, ...); base and rope_type may also be given there as rope_theta/rope_type."""
        rope: dict[str, Any] = dict(rope_parameters or {})
        for key, value in (("rope_type", rope_type), ("rope_theta", base)):
            if value is None:
                continue
            if key in rope and rope[key] != value:
                raise ValueError(f"{key} is given twice with different values: {rope[key]!r} and {value!r}")
            rope[key] = value
        if "type" not in rope:  # the legacy spelling names the type itself
            rope.setdefault("rope_type", "default")
        rope.setdefault("rope_theta", 10000.0)
        kind = pop_rope_type(dict(rope))
        if kind in EXAMPLE_ROPE_PARAMETERS:
            # A type named without its required parameters (`posenc plot --rope-type llama3`), or with none of its
            # own (`--rope-type proportional`, whose only one is optional), is drawn with the figures' example ones
            # for what is missing, the factor given or 4; a complete set is left as given.
            d = cls.head_dim if head_dim is None else head_dim
            rotary = d if turns_fraction_of_pairs(kind) else int(d * _fraction(rope)) // 2 * 2
            length = rope.get("original_max_position_embeddings", DEFAULT_TRAIN_LEN) if train_len is None else train_len
            factor = rope.get("factor") or 4.0
            # The example is drawn with stand-ins for values it refuses (a factor below 1, a partial_rotary_factor
            # that leaves no pair, an odd head_dim): those stay in rope, and parse_rope_parameters below refuses
            # them, naming the key.
            if not is_extension_factor(factor):
                factor = 4.0
            length = trained_length(length)  # numpy's integers and whole floats too
            if isinstance(length, bool) or not isinstance(length, int) or length < 1:
                length = DEFAULT_TRAIN_LEN
            example = example_rope_parameters(kind, rotary_dim=max(rotary // 2 * 2, 2), train_len=length, factor=factor)
            missing = not REQUIRED_KEYS.get(kind, frozenset()) <= rope.keys()
            if missing or (example and not example.keys() & rope.keys()):
                for key, value in example.items():
                    rope.setdefault(key, value)
        given = {
            "head_dim": head_dim,
            "train_len": train_len,
            "eval_len": eval_len,
            "num_heads": num_heads,
            "interleaved": interleaved,
        }
        return cls(rope_parameters=rope, **{k: v for k, v in given.items() if v is not None})

    @classmethod
    def from_json(cls, path: str | Path, *, layer_type: str | None = None) -> FigureConfig:
        """Read a JSON file holding either this class's fields or a Hugging Face model config, given as the
        config.json or its model folder, as ``posenc.interop.rope_from_config`` reads it (layer_type: as for
        ``from_mapping``)."""
        try:
            data = read_config_json(path)
        except FileNotFoundError:
            if Path(path).is_dir():
                raise ValueError(
                    f"config folder {str(path)!r} holds no config.json; give a JSON file with the figure config, or "
                    "a Hugging Face model's config.json or its folder"
                ) from None
            # A model folder was refused here as a file that "does not exist", where rope_from_config takes it.
            raise ValueError(
                f"config file {str(path)!r} does not exist; give a JSON file with the figure config, or a Hugging "
                "Face model's config.json or its folder"
            ) from None
        return cls.from_mapping(data, layer_type=layer_type)
