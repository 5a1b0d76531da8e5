"""``FigureConfig``: the one RoPE configuration the figures and the report draw, validated by the real parser.

It holds plain values and a Hugging Face-style ``rope_parameters`` dict; ``parse_rope_parameters`` validates it,
so a config that RoPE itself would reject is rejected here with the same message.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from posenc._checks import positive_int
from posenc.rope.parameters import RopeSpec, parse_rope_parameters

# Keys of a Hugging Face model config.json that say something about positions; the rest are ignored there.
_HF_MARKERS = frozenset({"hidden_size", "num_attention_heads", "model_type"})


@dataclasses.dataclass(frozen=True)
class FigureConfig:
    """What the figures are drawn for.

    head_dim: d per attention head; rope_parameters: Hugging Face-style dict (``rope_type``, ``rope_theta``,
    ``factor``, ...); train_len: the training context L (passed to RoPE as ``max_position_embeddings``);
    eval_len: the longer context an extension is evaluated at (default 4 * train_len; length-dependent types
    scale for it);
    num_heads: h, for the ALiBi / T5 bias matrices and the random model.
    """

    head_dim: int = 64
    rope_parameters: Mapping[str, Any] = dataclasses.field(
        default_factory=lambda: {"rope_type": "default", "rope_theta": 10000.0}
    )
    train_len: int = 2048
    eval_len: int | None = None
    num_heads: int = 8

    def __post_init__(self) -> None:
        positive_int("head_dim", self.head_dim)
        positive_int("train_len", self.train_len)
        if self.eval_len is None:
            object.__setattr__(self, "eval_len", 4 * self.train_len)
        positive_int("eval_len", self.eval_len)
        if self.eval_len < self.train_len:
            raise ValueError(
                f"eval_len={self.eval_len} must be >= train_len={self.train_len}: it is the longer context an "
                "extension is evaluated at"
            )
        positive_int("num_heads", self.num_heads)
        if not isinstance(self.rope_parameters, Mapping):
            raise TypeError(
                "rope_parameters must be a dict like {'rope_type': 'default', 'rope_theta': 10000.0}, "
                f"got {type(self.rope_parameters).__name__}"
            )
        object.__setattr__(self, "rope_parameters", dict(self.rope_parameters))
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
        return self.spec.base

    @property
    def rope_type(self) -> str:
        return self.spec.rope_type

    def rope_kwargs(self) -> dict[str, Any]:
        """Arguments for ``posenc.RoPE(head_dim, **kwargs)`` that build the RoPE this config describes."""
        return {"rope_parameters": dict(self.rope_parameters), "max_position_embeddings": self.train_len}

    @classmethod
    def from_mapping(cls, data: Mapping[str, Any]) -> FigureConfig:
        """Build from this class's fields, or from a Hugging Face model ``config.json`` dict.

        A Hugging Face config (one with ``hidden_size`` / ``num_attention_heads``) gives head_dim (``head_dim`` or
        hidden_size / num_attention_heads), rope_parameters (``rope_parameters``, or the older ``rope_scaling`` plus
        ``rope_theta`` and ``partial_rotary_factor``), train_len (``original_max_position_embeddings`` if the
        scaling names one, else ``max_position_embeddings``) and eval_len (``max_position_embeddings`` when it is
        longer than train_len, else 4 * train_len).
        """
        if not isinstance(data, Mapping):
            raise TypeError(f"a figure config must be a JSON object (a dict), got {type(data).__name__}")
        if _HF_MARKERS & data.keys():
            return cls._from_hugging_face(data)
        fields = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(data.keys() - fields)
        if unknown:
            raise ValueError(
                f"figure config has unknown key(s) {', '.join(unknown)}; it accepts {', '.join(sorted(fields))} "
                "(or a Hugging Face model config.json with hidden_size and num_attention_heads)"
            )
        return cls(**data)

    @classmethod
    def _from_hugging_face(cls, data: Mapping[str, Any]) -> FigureConfig:
        num_heads = data.get("num_attention_heads")
        head_dim = data.get("head_dim")
        if head_dim is None:
            hidden = data.get("hidden_size")
            if not isinstance(hidden, int) or not isinstance(num_heads, int) or num_heads <= 0:
                raise ValueError(
                    "a Hugging Face config needs head_dim, or hidden_size and num_attention_heads, to give the "
                    f"head dim; got hidden_size={hidden!r}, num_attention_heads={num_heads!r}"
                )
            head_dim = hidden // num_heads
        rope = dict(data.get("rope_parameters") or data.get("rope_scaling") or {})
        if "rope_theta" in data:
            rope.setdefault("rope_theta", data["rope_theta"])
        if "partial_rotary_factor" in data:
            rope.setdefault("partial_rotary_factor", data["partial_rotary_factor"])
        rope.setdefault("rope_theta", 10000.0)
        max_positions = data.get("max_position_embeddings")
        train_len = rope.get("original_max_position_embeddings") or max_positions or cls.train_len
        # A config that extends past its training length says how far; otherwise look 4x past it.
        eval_len = max_positions if max_positions and max_positions > train_len else 4 * train_len
        return cls(
            head_dim=head_dim,
            rope_parameters=rope,
            train_len=train_len,
            eval_len=eval_len,
            num_heads=num_heads if num_heads is not None else cls.num_heads,
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
        rope.setdefault("rope_type", "default")
        rope.setdefault("rope_theta", 10000.0)
        given = {"head_dim": head_dim, "train_len": train_len, "eval_len": eval_len, "num_heads": num_heads}
        return cls(rope_parameters=rope, **{k: v for k, v in given.items() if v is not None})

    @classmethod
    def from_json(cls, path: str | Path) -> FigureConfig:
        """Read a JSON file holding either this class's fields or a Hugging Face model config."""
        path = Path(path)
        if not path.is_file():
            raise ValueError(f"config file {str(path)!r} does not exist; give a JSON file with the figure config")
        try:
            data = json.loads(path.read_text())
        except json.JSONDecodeError as err:
            raise ValueError(f"config file {str(path)!r} is not valid JSON: {err}") from err
        return cls.from_mapping(data)
