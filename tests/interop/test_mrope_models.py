"""Every vision-language model of the installed transformers that turns its pairs by three position axes (M-RoPE):
posenc knows it (rotates as it does, or refuses it with the reason), and rotates as its own rotary class and
apply_rotary_pos_emb do, built from its own config class."""

from __future__ import annotations

import functools
import importlib
import inspect
import warnings
from pathlib import Path

import pytest
import torch

from posenc.interop import hf as hf_interop
from posenc.interop.hf import rope_from_config, rope_kwargs_from_config
from posenc.rope.mrope import MRoPE, mrope_axis_of_pair

transformers = pytest.importorskip("transformers")
from transformers.models.auto.configuration_auto import (  # noqa: E402
    CONFIG_MAPPING_NAMES,
    model_type_to_module_name,
)


def _modeling(model_type: str):
    try:
        module = model_type_to_module_name(model_type)
        return importlib.import_module(f"transformers.models.{module}.modeling_{module}")
    except Exception:  # unknown, or a modeling module that needs an optional package
        return None


def _mrope_rotary(modeling) -> type | None:
    """The module's text rotary class if it turns pairs by several axes: it recomposes per-axis frequencies and
    reads mrope_section."""
    found = [
        cls
        for name, cls in vars(modeling).items()
        if name.endswith("RotaryEmbedding")
        and "Vision" not in name
        and getattr(cls, "__module__", None) == modeling.__name__
        and hasattr(cls, "recomposition_frequencies")
        and "mrope_section" in inspect.getsource(cls)
    ]
    return found[0] if found else None


@functools.cache
def mrope_modules() -> frozenset[str]:
    """The modeling modules of the installed transformers whose text model has M-RoPE."""
    models, modules = Path(transformers.__file__).parent / "models", set()
    for model_type in CONFIG_MAPPING_NAMES:
        # _mrope_rotary wants "mrope_section" in the source of a class of the module, which is in the module's file:
        # one without it is not imported (importing all ~400 took 17 s).
        module = model_type_to_module_name(model_type)
        source = models / module / f"modeling_{module}.py"
        if not source.is_file() or "mrope_section" not in source.read_text(encoding="utf-8"):
            continue
        modeling = _modeling(model_type)
        if modeling is not None and _mrope_rotary(modeling) is not None:
            modules.add(model_type_to_module_name(model_type))
    return frozenset(modules)


def test_every_mrope_model_of_the_installed_transformers_is_known():
    """A new M-RoPE model in transformers makes this fail until it is rotated (and tested below) or refused: a
    model type posenc did not know would be read as Qwen2-VL's contiguous sections, which it may not be."""
    refused = {t for t in hf_interop._UNSUPPORTED_MODELS if "multimodal RoPE" in hf_interop._UNSUPPORTED_MODELS[t]}
    known = {model_type_to_module_name(t) for t in {*hf_interop._MROPE_MODELS, *refused}}
    assert mrope_modules() == known
    assert len(known) > 15  # the scan finds what it should


def _text_config(model_type: str, section: tuple[int, ...], *, given: bool = True, head_dim: int | None = None):
    """The model's text config class with sizes its sections fit (or ``head_dim``): the whole head rotated, 2 heads;
    without ``given``, no mrope_section in it (the rotary class takes its fallback)."""
    config = transformers.AutoConfig.for_model(model_type)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        text = config.get_text_config() if not hasattr(config, "thinker_config") else config.thinker_config.text_config
    head_dim = head_dim or 2 * sum(section)
    rope_parameters = {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 1.0}
    if given:
        rope_parameters["mrope_section"] = list(section)
    return type(text)(
        hidden_size=2 * head_dim,
        num_attention_heads=2,
        num_key_value_heads=2,
        head_dim=head_dim,
        rope_parameters=rope_parameters,
    )


def _another_section(layout: str, section: tuple[int, ...]) -> tuple[int, ...]:
    """A section of the same sum, valid for the layout, that differs from the model's fallback."""
    if layout == "sections":
        return tuple(reversed(section))
    if layout == "interleaved":
        return (section[0] + 1, section[1] - 1, section[2])
    return (section[0] - 1, section[1] - 1, section[2] + 2)


@pytest.mark.parametrize("given", [True, False], ids=["config-section", "fallback-section"])
@pytest.mark.parametrize("model_type", sorted(hf_interop._MROPE_MODELS))
def test_rotates_as_each_mrope_model(model_type: str, given: bool) -> None:
    """Built from the model's own config class: with a section of the config's (one that is not the model's
    fallback), and with none (transformers' rotary class then takes its fallback, posenc its table's)."""
    layout, fallback = hf_interop._MROPE_MODELS[model_type]
    section = _another_section(layout, fallback) if given else fallback
    assert section != fallback or not given
    try:
        config = _text_config(model_type, section, given=given)
    except KeyError as err:  # Cosmos3-Edge's config class requires the key: it has no fallback to follow
        assert not given and "mrope_section" in str(err)
        pytest.skip(f"{model_type}'s config class requires mrope_section")
    modeling = _modeling(model_type)
    rotary = _mrope_rotary(modeling)(config)
    gen = torch.Generator().manual_seed(0)
    s = 7
    # Three different axes (an image's t, h, w), positions large enough that a wrong axis or pair shows.
    positions = torch.stack([torch.arange(s) + 3, 5 * torch.arange(s) % 11 + 40, 7 * torch.arange(s) + 200])[:, None]
    q, k = torch.randn(2, 1, 2, s, config.head_dim, generator=gen)
    theirs = modeling.apply_rotary_pos_emb(q, k, *rotary(q, positions))
    rope = rope_from_config(config)
    assert isinstance(rope, MRoPE) and rope.mrope_layout == layout and rope.mrope_section == section
    assert rope.interleaved == (model_type in hf_interop._INTERLEAVED_MODELS)
    for ours, hf in zip(rope(q, k, positions=positions), theirs, strict=True):
        # transformers takes the angles in float32: position ~240 times a float32 frequency, ~3e-5 rad at most.
        torch.testing.assert_close(ours, hf, rtol=0, atol=1e-4)


_Q, _K = torch.randn(2, 1, 2, 7, 128, generator=torch.Generator().manual_seed(0))
# Three axes of ids that differ (an image's t, h, w), large enough that a wrong axis or pair shows.
_POSITIONS = torch.stack([torch.arange(7) + 3, 5 * torch.arange(7) % 11 + 40, 7 * torch.arange(7) + 200])[:, None]


def _rotated_by_transformers(model_type: str, config) -> tuple[torch.Tensor, torch.Tensor]:
    modeling = _modeling(model_type)
    q, k = _Q[..., : config.head_dim], _K[..., : config.head_dim]
    return modeling.apply_rotary_pos_emb(q, k, *_mrope_rotary(modeling)(config)(q, _POSITIONS))


@pytest.mark.parametrize(
    ("model_type", "head_dim", "section"),
    [
        ("qwen3_vl", 128, (16, 24, 24)),  # Qwen2-VL's sections, interleaved: t, h, w turn 22, 21, 21 pairs (as vLLM)
        ("qwen3_5", 64, (5, 13, 14)),  # h's and w's sections outrun the cycle: 11, 11, 10
        ("qwen3_vl_moe", 128, (10, 10, 10)),  # no sum check: h and w turn 10 pairs each, t the other 44
        ("cosmos3_edge", 48, (0, 12, 12)),  # t's section is never read
        ("qwen2_vl", 64, (16, 0, 16)),  # a zero-width section: h turns no pair
        ("glm4v", 64, (0, 16, 16)),
        ("ernie4_5_vl_moe", 64, (0, 0, 32)),  # h and w turn nothing, t all
    ],
)
def test_unusual_sections_transformers_accepts_rotate_as_it_does(
    model_type: str, head_dim: int, section: tuple[int, ...]
) -> None:
    """Sections that transformers lays out (without an error) are laid out as it does: posenc refused interleaved
    ones the t, h, w cycle does not give each axis exactly (Qwen2-VL's [16, 24, 24] with Qwen3-VL's layout), ones
    not summing to r/2 there, and any zero section."""
    config = _text_config(model_type, section, head_dim=head_dim)
    theirs = _rotated_by_transformers(model_type, config)
    ours = rope_from_config(config)(_Q[..., :head_dim], _K[..., :head_dim], positions=_POSITIONS)
    for got, want in zip(ours, theirs, strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-4)
    if section == (16, 24, 24):
        axis = mrope_axis_of_pair(section, layout="interleaved", pairs=64)
        assert torch.bincount(axis, minlength=3).tolist() == [22, 21, 21]


@pytest.mark.parametrize(
    ("model_type", "head_dim", "section", "match"),
    [
        ("qwen2_vl", 128, (10, 10, 10), "must sum to rotary_dim / 2 = 64"),
        ("glm4v", 64, (8, 12, 13), "must sum to rotary_dim / 2 = 32"),
        ("ernie4_5_vl_moe", 128, (16, 24, 24), "so h and w need equal sections"),
        ("ernie4_5_vl_moe", 128, (32, 32, 0), "gives t the rest \\(at least one pair\\)"),
        ("ernie4_5_vl_moe", 128, (22, 22, 10), "must sum to rotary_dim / 2 = 64"),
        ("qwen3_vl", 128, (32, 32), "interleaved M-RoPE takes 3 sections"),
    ],
)
def test_sections_transformers_fails_on_are_refused_with_the_reason(
    model_type: str, head_dim: int, section: tuple[int, ...], match: str
) -> None:
    """Where the model's own rotary embedding fails deep inside torch (a split, stack or slice of the wrong size),
    posenc refuses the sections up front, naming what they must be."""
    config = _text_config(model_type, section, head_dim=head_dim)
    with pytest.raises((RuntimeError, IndexError)):
        _rotated_by_transformers(model_type, config)
    with pytest.raises(ValueError, match=match):
        rope_from_config(config)


@pytest.mark.parametrize(
    ("model_type", "layout"),
    [
        ("qwen2_vl", "sections"),
        ("qwen2_5_vl", "sections"),
        ("qwen3_vl", "interleaved"),
        ("qwen3_vl_moe", "interleaved"),
        ("qwen3_5", "interleaved"),
        ("glm4v", "sections"),
        ("cosmos3_edge", "interleaved"),
        ("ernie4_5_vl_moe", "alternating"),
    ],
)
def test_vision_language_configs_read_their_text_model(model_type: str, layout: str) -> None:
    """The top-level config object and its dict form (text_config nested) both give M-RoPE with the model's own
    layout; Qwen2.5-VL's object once came back as plain RoPE, Qwen3-VL's as Qwen2-VL's sections."""
    config = transformers.AutoConfig.for_model(model_type)
    for form in (config, config.to_dict()):
        kwargs = rope_kwargs_from_config(form)
        assert kwargs["mrope_layout"] == layout
        assert kwargs["mrope_section"] == list(hf_interop._MROPE_MODELS[model_type][1])


@functools.cache
def composite_text_models() -> dict[str, str]:
    """Model types of the installed transformers whose config nests a text model of a type the tables name."""
    tables = {*hf_interop._MROPE_MODELS, *hf_interop._INTERLEAVED_MODELS, *hf_interop._UNSUPPORTED_MODELS}
    found = {}
    for model_type in CONFIG_MAPPING_NAMES:
        if model_type in tables:
            continue
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                cfg = transformers.AutoConfig.for_model(model_type).to_dict()
        except Exception:
            continue
        inner = cfg
        while isinstance(inner, dict) and not inner.get("rope_parameters"):
            inner = next((inner[k] for k in hf_interop._NESTED_CONFIGS if isinstance(inner.get(k), dict)), None)
        if isinstance(inner, dict) and inner is not cfg and inner.get("model_type") in tables:
            found[model_type] = inner["model_type"]
    return found


def test_composite_configs_name_their_text_model():
    """A config.json whose text_config omits its model_type still reads as its text model: Cosmos3-Omni's once
    read as Qwen2-VL's sections (4.3 off), GLM-4.6V's lost its partial rotation and pair layout."""
    found = composite_text_models()
    assert len(found) >= 5  # the scan finds what it should
    for outer, inner in found.items():
        resolved = hf_interop._text_model({"model_type": outer, "text_config": {}})["model_type"]
        assert model_type_to_module_name(resolved) == model_type_to_module_name(inner), (outer, inner)


@pytest.mark.parametrize(
    "outer", ["cosmos3_omni", "glm46v", "minicpmv4_7", "qwen2_5_omni", "qwen3_omni_moe", "colqwen2"]
)
def test_composite_configs_rotate_as_their_text_model(outer: str) -> None:
    """The whole config, as an object and as a dict without the inner model_type, gives the text model's M-RoPE."""
    config = transformers.AutoConfig.for_model(outer)
    kwargs = rope_kwargs_from_config(config)
    inner = hf_interop._text_model(config.to_dict())["model_type"]
    assert (kwargs["mrope_layout"], tuple(kwargs["mrope_section"])) == hf_interop._MROPE_MODELS[inner]
    stripped = config.to_dict()
    holder = stripped
    while "rope_parameters" not in holder or not holder["rope_parameters"]:
        holder = next(holder[k] for k in hf_interop._NESTED_CONFIGS if isinstance(holder.get(k), dict))
    holder.pop("model_type", None)
    assert rope_kwargs_from_config(stripped) == kwargs


def test_a_config_key_that_contradicts_the_model_type_is_overruled_with_a_warning() -> None:
    config = _text_model_dict("qwen3_5_text", mrope_interleaved=False)
    with pytest.warns(UserWarning, match="says mrope_interleaved=False, but model_type 'qwen3_5_text' lays out"):
        assert rope_kwargs_from_config(config)["mrope_layout"] == "interleaved"
    # A model type posenc does not know goes by the key (and is read with a warning: transformers does not know it).
    with pytest.warns(UserWarning, match="model_type 'new_vl' is not one the installed transformers knows"):
        assert rope_kwargs_from_config({**config, "model_type": "new_vl"})["mrope_layout"] == "sections"
        config = _text_model_dict("new_vl", mrope_interleaved=True)
        assert rope_kwargs_from_config(config)["mrope_layout"] == "interleaved"


def _text_model_dict(model_type: str, **rope: object) -> dict:
    parameters = {"rope_type": "default", "rope_theta": 1e6, "mrope_section": [11, 11, 10], **rope}
    return {"model_type": model_type, "head_dim": 64, "hidden_size": 128, "num_attention_heads": 2} | {
        "rope_parameters": parameters
    }


@pytest.mark.parametrize(
    ("model_type", "match"),
    [
        ("hunyuan_vl", "two channels of a pair can turn by different axes"),
        ("hy_v4_vl", "multimodal RoPE on adjacent pairs"),
        ("cohere_compass", "one rope dict per layer type"),
    ],
)
def test_mrope_layouts_posenc_cannot_make_are_refused(model_type: str, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        rope_from_config(transformers.AutoConfig.for_model(model_type))
