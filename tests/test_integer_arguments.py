"""One rule for integer arguments (``posenc._checks.integer``): any ``numbers.Integral`` but bool is taken and becomes
a plain int (a length computed with numpy gives what the int gives, bit for bit, and configs holding it write to
JSON); bool, float and tensors are refused where an int is meant, naming the argument, its value and the fix."""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch

import posenc
from posenc import analysis
from posenc._checks import integer
from posenc.distributed import shard_packed_positions, shard_positions
from posenc.lab import dist as lab_dist
from posenc.lab import model as lab_model
from posenc.lab.config import make_config
from posenc.lab.data import load_corpus


def _qk() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return torch.randn(1, 2, 5, 8, generator=generator), torch.randn(1, 2, 5, 8, generator=generator)


def _cache() -> posenc.KVCache:
    cache = posenc.KVCache()
    k, v = torch.ones(1, 2, 6, 8), torch.zeros(1, 2, 6, 8)
    cache.update(k, v, torch.arange(6)[None])
    return cache


def _cropped(length: Any) -> tuple[int, torch.Tensor]:
    cache = _cache()
    cache.crop(length)
    return cache.length, cache.next_positions(1)


def _rope_call(value: Any) -> tuple[torch.Tensor, torch.Tensor]:
    return posenc.RoPE(8)(*_qk(), offset=value)


def _json(config: Any) -> Any:
    """The config, after checking that JSON writes it (numpy's integers it could not: 'int64 is not JSON
    serializable')."""
    json.dumps(dataclasses.asdict(config))
    return config


# name in errors -> (an int it takes, what a call with it gives). Module outputs are drawn under one seed.
ENTRY_POINTS: dict[str, tuple[int, Callable[[Any], Any]]] = {
    "RoPE head_dim": (8, lambda v: posenc.RoPE(v)(*_qk())),
    "RoPE rotary_dim": (4, lambda v: posenc.RoPE(8, rotary_dim=v)(*_qk())),
    "RoPE max_position_embeddings": (
        64,
        lambda v: posenc.RoPE(8, rope_parameters={"rope_type": "dynamic", "factor": 2.0}, max_position_embeddings=v)(
            *_qk(), seq_len=100
        ),
    ),
    "RoPE.forward seq_len": (
        200,
        lambda v: posenc.RoPE(8, rope_parameters={"rope_type": "dynamic", "factor": 2.0}, max_position_embeddings=64)(
            *_qk(), seq_len=v
        ),
    ),
    "RoPE.forward offset": (3, _rope_call),
    "MRoPE mrope_section": (2, lambda v: posenc.MRoPE(8, mrope_section=[v, 1, 1])(*_qk())),
    "MRoPE.forward offset": (
        3,
        lambda v: posenc.MRoPE(8, mrope_section=[2, 1, 1])(*_qk(), positions=torch.arange(5).expand(3, 1, 5), offset=v),
    ),
    "apply_rotary offset": (
        3,
        lambda v: posenc.apply_rotary(_qk()[0], *posenc.RoPE(8).cos_sin(torch.arange(16)), offset=v),
    ),
    "rope_frequencies head_dim": (8, lambda v: posenc.rope_frequencies(v)),
    "rope_parameters original_max_position_embeddings": (
        64,
        lambda v: posenc.rope_frequencies(
            8, {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": v}
        ),
    ),
    "ALiBi num_heads": (4, lambda v: (m := posenc.ALiBi(v), m.num_heads, m.bias(3, 3))[1:]),
    "ALiBi.bias q_len": (3, lambda v: posenc.ALiBi(4).bias(v, 5)),
    "ALiBi.bias k_len": (5, lambda v: posenc.ALiBi(4).bias(3, v)),
    "ALiBi.bias offset": (2, lambda v: posenc.ALiBi(4).bias(3, 5, offset=v)),
    "alibi_slopes num_heads": (5, lambda v: posenc.alibi_slopes(v)),
    "T5Bias num_heads": (4, lambda v: (m := posenc.T5Bias(v), m.num_heads)[1]),
    "T5Bias num_buckets": (16, lambda v: posenc.T5Bias(4, num_buckets=v).num_buckets),
    "t5_relative_bucket num_buckets": (
        16,
        lambda v: posenc.t5_relative_bucket(torch.arange(-40, 40), bidirectional=True, num_buckets=v),
    ),
    "LearnedAbsolute max_positions": (16, lambda v: posenc.LearnedAbsolute(v, 8).max_positions),
    "Sinusoidal dim": (8, lambda v: posenc.Sinusoidal(v)(torch.arange(5))),
    "sinusoidal_table dim": (8, lambda v: posenc.sinusoidal_table(torch.arange(5), v)),
    "CausalSelfAttention num_heads": (2, lambda v: posenc.CausalSelfAttention(16, v).num_heads),
    "build_for_model num_heads": (
        4,
        lambda v: posenc.build_for_model("alibi", dim=16, num_heads=v, head_dim=4, max_positions=32).num_heads,
    ),
    "KVCache.next_positions seq_len": (2, lambda v: _cache().next_positions(v)),
    "KVCache.crop length": (4, _cropped),
    "shard_positions seq_len": (8, lambda v: shard_positions(v, 2, 1)),
    "shard_positions rank": (1, lambda v: shard_positions(8, 2, v)),
    "shard_packed_positions rank": (1, lambda v: shard_packed_positions(torch.tensor([0, 4, 8]), 2, v).positions),
    "lab Ranks.rank": (1, lambda v: _json(lab_dist.Ranks(v, 2))),
    "lab Ranks.world_size": (2, lambda v: _json(lab_dist.Ranks(0, v))),
    "lab ModelSpec.dim": (16, lambda v: _json(lab_model.ModelSpec(v, 1, 2, 32))),
    "lab LabConfig train_len": (32, lambda v: _json(make_config("quick", train_len=v))),
    "lab LabConfig seed": (3, lambda v: _json(make_config("quick", seed=v))),
    "lab LabConfig eval_lengths": (256, lambda v: _json(make_config("quick", eval_lengths=(16, v)))),
    "lab LabConfig max_corpus_bytes": (10**6, lambda v: _json(make_config("quick", max_corpus_bytes=v))),
    "FigureConfig head_dim": (16, lambda v: _json(analysis.FigureConfig(head_dim=v))),
    "FigureConfig train_len": (64, lambda v: _json(analysis.FigureConfig(train_len=v))),
    "FigureConfig eval_len": (256, lambda v: _json(analysis.FigureConfig(train_len=64, eval_len=v))),
    "FigureConfig num_heads": (4, lambda v: _json(analysis.FigureConfig(num_heads=v))),
    "FigureConfig original_max_position_embeddings": (
        64,
        lambda v: _json(
            analysis.FigureConfig(
                rope_parameters={"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": v}
            )
        ),
    ),
    "wavelengths train_len": (64, lambda v: dataclasses.asdict(analysis.wavelengths(16, v))),
    "frequency_table train_len": (64, lambda v: dataclasses.asdict(analysis.frequency_table(16, train_len=v))),
    "example_rope_parameters train_len": (
        64,
        lambda v: analysis.example_rope_parameters("yarn", rotary_dim=16, train_len=v),
    ),
    "long_term_decay max_distance": (32, lambda v: analysis.long_term_decay(16, max_distance=v).bound),
    "relative_invariance head": (
        1,
        lambda v: analysis.relative_invariance(posenc.ALiBi(4), 8, head_dim=8, head=v).scores,
    ),
    "bias_matrix q_len": (3, lambda v: analysis.bias_matrix(posenc.ALiBi(4), v, 5)),
}

# Those that take no tensor for the integer: a one-element tensor is refused there, not read as an int.
TAKES_TENSORS = {"RoPE.forward offset", "MRoPE.forward offset", "apply_rotary offset"}
# A bool or a float refused with TypeError (the argument's type is wrong), ValueError elsewhere, as before.
TYPE_ERRORS = {"ALiBi.bias offset", "KVCache.crop length", "lab Ranks.rank", "lab Ranks.world_size"} | TAKES_TENSORS


def _same(a: Any, b: Any) -> bool:
    """a and b equal and of the same types all the way down: tensors bit for bit, ints as ints (not numpy's)."""
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    if dataclasses.is_dataclass(a) and not isinstance(a, type):
        return type(a) is type(b) and _same(dataclasses.asdict(a), dataclasses.asdict(b))
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[key], b[key]) for key in a)
    if isinstance(a, (tuple, list)):
        return type(a) is type(b) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, float) and isinstance(b, float) and a != a:
        return b != b
    return type(a) is type(b) and a == b


@pytest.mark.parametrize("name", ENTRY_POINTS)
@pytest.mark.parametrize("kind", [np.int64, np.int32, np.uint32])
def test_numpy_integers_give_what_the_int_gives(name: str, kind: type) -> None:
    value, call = ENTRY_POINTS[name]
    torch.manual_seed(0)
    expected = call(value)
    torch.manual_seed(0)
    got = call(kind(value))
    assert _same(expected, got), (expected, got)


@pytest.mark.parametrize("name", ENTRY_POINTS)
@pytest.mark.parametrize("given", [True, 4.0], ids=["bool", "float"])
def test_bools_and_floats_are_refused_naming_the_argument(name: str, given: Any) -> None:
    value, call = ENTRY_POINTS[name]
    if isinstance(given, float):
        given = float(value)
    if name.endswith("original_max_position_embeddings") and isinstance(given, float):
        pytest.skip("a whole float there is taken as the int, as transformers computes with it (2048.0 = 2048)")
    argument = name.split(" ")[-1].split(".")[-1]
    error = TypeError if name in TYPE_ERRORS else ValueError
    with pytest.raises(error, match=re.escape(argument)):
        call(given)


@pytest.mark.parametrize("name", sorted(set(ENTRY_POINTS) - TAKES_TENSORS))
def test_one_element_tensors_are_not_read_as_ints(name: str) -> None:
    value, call = ENTRY_POINTS[name]
    with pytest.raises((TypeError, ValueError), match=re.escape(name.split(" ")[-1].split(".")[-1])):
        call(torch.tensor(value))


def test_tensors_stay_taken_where_the_api_takes_them() -> None:
    assert _same(_rope_call(3), _rope_call(torch.tensor(3)))


def test_load_corpus_takes_a_numpy_max_bytes(tmp_path: Any) -> None:
    (tmp_path / "a.txt").write_bytes(bytes(range(32, 127)) * 4)
    expected, got = load_corpus(tmp_path, max_bytes=100), load_corpus(tmp_path, max_bytes=np.int64(100))
    assert _same(dataclasses.asdict(expected), dataclasses.asdict(got))
    with pytest.raises(ValueError, match=r"max_bytes must be a positive integer or None, got 100\.0; pass the int 100"):
        load_corpus(tmp_path, max_bytes=100.0)


def test_write_figures_takes_a_numpy_dpi_and_refuses_a_float(tmp_path: Any) -> None:
    # Checked before anything is drawn: a refused dpi writes nothing.
    with pytest.raises(ValueError, match=r"dpi must be an integer in \[10, 1200\], got 110\.0; pass the int 110"):
        analysis.write_figures(tmp_path, [], dpi=110.0)
    with pytest.raises(ValueError, match=r"dpi must be an integer in \[10, 1200\], got 1201"):
        analysis.write_figures(tmp_path, [], dpi=np.int64(1201))


def test_tiny_model_takes_numpy_sizes() -> None:
    pytest.importorskip("transformers")
    from posenc.interop import tiny_model_from_config

    model = tiny_model_from_config(
        {"model_type": "llama"}, hidden_size=np.int64(32), num_heads=np.int32(2), max_position_embeddings=np.int64(64)
    )
    config = model.config.to_dict()
    assert type(config["hidden_size"]) is int and type(config["max_position_embeddings"]) is int
    json.dumps(config)
    with pytest.raises(ValueError, match=re.escape("num_heads must be a positive integer, got 2.0; pass the int 2")):
        tiny_model_from_config({"model_type": "llama"}, num_heads=2.0)


@pytest.mark.parametrize(
    ("value", "message"),
    [
        (True, "n must be a positive integer, got True (a bool); pass an int"),
        (4.0, "n must be a positive integer, got 4.0; pass the int 4"),
        (4.5, "n must be a positive integer, got 4.5"),
        ("4", "n must be a positive integer, got '4'"),
        (torch.tensor(4), "n must be a positive integer, got tensor(4); pass a Python int (tensor.item())"),
        (np.float64(4.0), "n must be a positive integer, got np.float64(4.0); pass the int 4"),
    ],
)
def test_integer_refusals_say_the_value_and_the_fix(value: Any, message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        integer("n", value, low=1)


def test_integer_returns_plain_ints_and_checks_the_range() -> None:
    for value in (np.int64(3), np.uint8(3), np.int32(3), 3):
        assert type(integer("n", value, low=0, high=4)) is int
    with pytest.raises(ValueError, match=re.escape("n must be an integer in [0, 4), got 4")):
        integer("n", np.int64(4), low=0, high=4)
    with pytest.raises(TypeError, match="n must be an int, got True"):
        integer("n", True, expected="an int", type_error=TypeError)


def test_triton_launch_settings_take_numpy_integers() -> None:
    pytest.importorskip("triton")
    from posenc.kernels.launch import triton_plans

    x, out, cos = torch.zeros(1, 2, 8, 16), torch.zeros(1, 2, 8, 16), torch.zeros(8, 8)

    def plan(**config: Any) -> list:
        return triton_plans([x], [out], cos, cos, None, None, 0, None, "bhsd", False, False, True,
                            **config)  # fmt: skip

    config = {"block_s": 4, "num_warps": 2, "heads_per_program": 1, "superblock": 2}
    expected = plan(**config)
    got = plan(**{key: np.int64(value) for key, value in config.items()})
    assert _same(expected, got), (expected, got)
    with pytest.raises(ValueError, match=re.escape("num_warps must be one of (1, 2, 4, 8, 16, 32), got 2.0; pass the")):
        plan(num_warps=2.0)


@pytest.mark.parametrize("name", sorted(TAKES_TENSORS))
@pytest.mark.parametrize(
    ("given", "said"), [(3.0, "got float 3.0; pass the int 3"), (True, "got bool True (a bool); pass an int")]
)
def test_offsets_refused_say_the_value_and_the_fix(name: str, given: Any, said: str) -> None:
    """Offsets, which take tensors too, are checked by their own code (the hot path): it said only "got float"."""
    _, call = ENTRY_POINTS[name]
    with pytest.raises(TypeError, match=re.escape(said)):
        call(given)
