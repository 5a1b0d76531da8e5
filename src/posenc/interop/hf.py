"""Hugging Face configs -> ``posenc.RoPE``: the rotation a model does, from its config.json.

Reads both forms ``transformers`` has used: the new ``rope_parameters`` dict and the old ``rope_scaling`` dict with
top-level ``rope_theta`` / ``partial_rotary_factor`` / ``rotary_pct`` / ``rotary_emb_base`` / ``head_dim`` /
``original_max_position_embeddings``, plus the per-model spellings that decide the layout (GPT-J's absolute
``rotary_dim`` with adjacent pairs, DeepSeek's ``rope_interleave``, Qwen2-VL's ``mrope_section``). A config object
is read through ``to_dict()``; ``transformers`` is imported only to ask a model's rotary class whether its default
RoPE reads ``partial_rotary_factor``, and only for a config that sets a factor below 1.

Layout notes: DeepSeek-V3 (``rope_interleave``) rotates adjacent pairs of the rope part ``q[..., -64:]`` and then
stores the result de-interleaved (evens then odds); posenc writes the pairs back in place. Both orders give the same
q.k scores. DeepSeek's extra softmax scale mscale(factor, mscale_all_dim)^2 belongs to its attention, not to RoPE.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import inspect
import json
import os
import warnings
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

from posenc._checks import positive_int, user_stacklevel
from posenc.rope.module import RoPE
from posenc.rope.mrope import _ORDER as _MROPE_AXIS_ORDER
from posenc.rope.mrope import MRoPE, MRopeLayout
from posenc.rope.parameters import OPTIONAL_KEYS, REQUIRED_KEYS, pop_rope_type, rotary_fraction, unread_keys

# Model types whose rotation pairs adjacent channels (x0, x1), (x2, x3), ...: a rotate_half on x[..., ::2] and
# x[..., 1::2], rotate_every_two, view_as_complex, or pairs rotated in place and stored evens-then-odds (the MLA
# models' apply_rotary_pos_emb_interleave; the same q.k scores). Every other model type pairs channel i with
# i + r/2. Read from the modeling code of transformers 5.25; tests/interop/test_rope_from_config.py holds the table
# to the installed transformers.
_INTERLEAVED_MODELS = frozenset(
    {
        *("bailing_hybrid", "blt", "blt_global_transformer", "blt_local_decoder", "blt_local_encoder", "blt_patcher"),
        *("codegen", "cohere", "cohere2", "cohere2_moe", "deepseek_v2", "deepseek_v4", "efficientloftr"),
        *("ergo", "ernie4_5", "ernie4_5_moe", "ernie4_5_vl_moe", "ernie4_5_vl_moe_text", "ernie4_5_vl_moe_vision"),
        *("glm", "glm4", "glm_moe_dsa", "glm4v", "glm4v_text", "glm4v_vision", "glm_ocr", "glm_ocr_text"),
        *("glm_ocr_vision", "gptj", "helium", "hy_v4"),
        *("hy_v4_vl", "hy_v4_vl_text", "hy_v4_vl_vision", "lightglue", "llama4", "llama4_text", "llama4_vision_model"),
        *("longcat_flash", "mistral_large4", "mistral_large4_text", "moonshine", "moonshine_streaming"),
        *("moonshine_streaming_encoder", "openai_privacy_filter", "pe_audio", "pe_audio_encoder", "pe_audio_video"),
        *("pe_audio_video_encoder", "pe_video", "pe_video_encoder"),
    }
)
# Model types whose rotation posenc.RoPE cannot do, and why: refused rather than rotated some other way (DeepSeek-V4
# stays in the table above, which says what transformers does, and is refused before the table is read).
_UNSUPPORTED_MODELS = {
    "nanochat": "nanochat rotates by the negative angle (its rotate_half is cat(x2, -x1)), which posenc.RoPE does not",
    "deepseek_v4": "DeepSeek-V4 rotates the last qk_rope_head_dim channels of a head, with two rope dicts (main and "
    "compress); build posenc.RoPE(qk_rope_head_dim, interleaved=True, base=...) for the rope part yourself",
    **dict.fromkeys(
        ("hunyuan_vl", "hunyuan_vl_text"),
        "HunYuan-VL's multimodal RoPE cuts the duplicated cos/sin into sections, so the two channels of a pair can "
        "turn by different axes (not a rotation posenc.MRoPE makes), with one axis per section",
    ),
    **dict.fromkeys(
        ("hy_v4_vl", "hy_v4_vl_text"),
        "HY-V4-VL's multimodal RoPE on adjacent pairs lays its axes out in its own way, which posenc.MRoPE does not",
    ),
    **dict.fromkeys(
        ("cohere_compass", "cohere_compass_text"),
        "Cohere Compass has multimodal RoPE with one rope dict per layer type, which posenc does not read",
    ),
    "neomme": "NeoMME's multimodal RoPE turns alternate pairs by two axes (rows, columns), which posenc.MRoPE does not",
}
# Model types whose config class folds a legacy rope_scaling block into its rope dicts per layer type (Gemma 3 into
# full_attention, ModernBERT into both), not taking it as the one rope dict (transformers 5.25;
# tests/interop/test_rope_from_config.py holds it to the installed transformers).
_LAYERED_ROPE_SCALING = frozenset(
    {"gemma3_text", "gemma3n_text", "modernbert", "modernbert-decoder", "olmo3", "t5gemma2_decoder", "t5gemma2_text"}
)
# Model types whose config class defaults rope_interleave to True (DeepSeek-V3's config.json omits the key).
_INTERLEAVE_DEFAULTS = {"deepseek_v3": True}
# Model types whose rotary dim is given in channels (`rotary_dim`), not as a fraction.
_ABSOLUTE_ROTARY_DIM = frozenset({"gptj", "codegen"})
# Defaults a model class applies when its config.json omits the key.
_PARTIAL_DEFAULTS = {"gpt_neox": 0.25}
# Top-level keys a model's config class reads for theta and the rotary fraction (GPTNeoXConfig reads its own names
# and ignores a top-level rope_theta or partial_rotary_factor); the default is both spellings.
_TOP_LEVEL_THETA = {"gpt_neox": ("rotary_emb_base",)}
_TOP_LEVEL_PARTIAL = {"gpt_neox": ("rotary_pct",)}
# Model types whose 'default' RoPE (their rotary class's compute_default_rope_parameters in transformers 5.x) reads
# partial_rotary_factor. The others, 224 of the 292 model types with a rotary class in transformers 5.25 (Llama,
# Mistral, Qwen2/3, Gemma, DeepSeek, ...), rotate the whole head there and never read it, although their configs
# accept the key; the scaled types (ROPE_INIT_FUNCTIONS) always read it. Where transformers is installed, the
# model's own rotary class decides (``_default_reads_partial``); this table, taken from transformers 5.25, is for
# where it is not. tests/interop/test_rope_from_config.py holds it to the installed transformers.
_DEFAULT_READS_PARTIAL = frozenset(
    {
        "bamba",
        "deepseek_v4",
        "diffusion_gemma",
        "diffusion_gemma_text",
        "efficientloftr",
        "glm",
        "glm4",
        "glm4_moe",
        "glm4_moe_lite",
        "glm4v",
        "glm4v_moe",
        "glm4v_moe_text",
        "glm4v_moe_vision",
        "glm4v_text",
        "glm4v_vision",
        "glm_image",
        "glm_image_text",
        "glm_image_vision",
        "glm_image_vqmodel",
        "glm_ocr",
        "glm_ocr_text",
        "glm_ocr_vision",
        "glmasr",
        "glmasr_encoder",
        "gpt_neox",
        "gpt_neox_japanese",
        "laguna",
        "mellum",
        "mimo_v2_flash",
        "minimax_m2",
        "minimax_m3_vl",
        "minimax_m3_vl_text",
        "minimax_m3_vl_vision",
        "moonshine",
        "moonshine_streaming",
        "moonshine_streaming_encoder",
        "musicflamingo",
        "nemo_speechlm",
        "nemotron",
        "nemotron3_5_transcribe_asr_audio",
        "nemotron3_5_transcribe_audio",
        "nemotron3_5_transcribe_word_timestamp",
        "nemotron3_diarization",
        "nemotron3_diarization_audio",
        "neomme",
        "persimmon",
        "phi",
        "phi3",
        "phi4_multimodal",
        "phi4_multimodal_audio",
        "phi4_multimodal_vision",
        "qwen3_5",
        "qwen3_5_moe",
        "qwen3_5_moe_text",
        "qwen3_5_moe_vision",
        "qwen3_5_text",
        "qwen3_5_vision",
        "qwen3_next",
        "qwen4_exp",
        "qwen4_exp_text",
        "qwen4_exp_vision",
        "recurrent_gemma",
        "solar_open",
        "stablelm",
        "step3p5",
        "step3p5_vision",
        "step3p7",
        "zaya",
    }
)
# Defaults a model class applies to a top-level key its config.json omits (transformers then copies the top-level
# original_max_position_embeddings over the rope dict's own).
_ORIGINAL_DEFAULTS = {"phi3": 4096}
# Model types whose text model turns its pairs by three position axes (M-RoPE): how the axes share the pairs (see
# posenc.rope.mrope.mrope_axis_of_pair) and the mrope_section their rotary class falls back to when the config has
# none. Read from transformers 5.25; tests/interop/test_mrope_models.py holds the table to the installed transformers.
_QWEN2_VL, _QWEN3_VL = ("sections", (16, 24, 24)), ("interleaved", (24, 20, 20))
_QWEN3_5, _GLM4_V, _ERNIE_VL = ("interleaved", (11, 11, 10)), ("sections", (8, 12, 12)), ("alternating", (22, 22, 20))
_MROPE_MODELS: dict[str, tuple[MRopeLayout, tuple[int, ...]]] = {
    **dict.fromkeys(("qwen2_vl", "qwen2_vl_text", "qwen2_5_vl", "qwen2_5_vl_text", "paddleocr_vl"), _QWEN2_VL),
    **dict.fromkeys(("paddleocr_vl_text", "qwen2_5_omni", "qwen2_5_omni_thinker", "qwen2_5_omni_text"), _QWEN2_VL),
    **dict.fromkeys(("qwen2_5_omni_talker",), _QWEN2_VL),
    **dict.fromkeys(("qwen3_vl", "qwen3_vl_text", "qwen3_vl_moe", "qwen3_vl_moe_text", "cosmos3_edge"), _QWEN3_VL),
    **dict.fromkeys(
        ("cosmos3_edge_text", "qwen3_omni_moe", "qwen3_omni_moe_thinker", "qwen3_omni_moe_text"), _QWEN3_VL
    ),
    **dict.fromkeys(("qwen3_omni_moe_talker_text", "qwen3_omni_moe_talker_code_predictor"), _QWEN3_VL),
    **dict.fromkeys(("qwen3_5", "qwen3_5_text", "qwen3_5_moe", "qwen3_5_moe_text", "qwen4_exp"), _QWEN3_5),
    **dict.fromkeys(("qwen4_exp_text",), _QWEN3_5),
    **dict.fromkeys(("glm4v", "glm4v_text", "glm4v_moe", "glm4v_moe_text", "glm_image", "glm_image_text"), _GLM4_V),
    **dict.fromkeys(("glm_ocr", "glm_ocr_text"), _GLM4_V),
    **dict.fromkeys(("ernie4_5_vl_moe", "ernie4_5_vl_moe_text"), _ERNIE_VL),
}
# Where composite configs keep their text model, in the order looked for.
_NESTED_CONFIGS = ("text_config", "thinker_config", "vlm_config")
# Composite model types whose text model is another model type that the tables above name, for a config.json whose
# text_config omits its model_type (transformers 5.25; tests/interop/test_mrope_models.py holds it to the installed
# transformers).
_TEXT_MODELS = {
    **dict.fromkeys(("aya_vision", "cohere2_vision"), "cohere2"),
    "colqwen2": "qwen2_vl",
    "cosmos3_omni": "qwen3_vl_text",
    **dict.fromkeys(("glm46v", "glmga"), "glm4v_text"),
    **dict.fromkeys(("jev", "minicpm_ocr", "minicpmv4_6", "minicpmv4_7"), "qwen3_5_text"),
}


def read_config_json(config: str | os.PathLike[str]) -> dict[str, Any]:
    """The dict in a config.json, given as its path or its folder's. FileNotFoundError where there is none,
    ValueError naming the file where it is not a JSON object."""
    path = Path(config)
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"config must be a config.json or a folder holding one; {str(path)!r} is neither")
    try:
        loaded = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ValueError(f"{str(path)!r} is not valid JSON: {error}") from error
    if not isinstance(loaded, dict):
        raise ValueError(f"{str(path)!r} must hold a JSON object, got {type(loaded).__name__}")
    return loaded


def _load(config: Any) -> tuple[dict[str, Any], Any]:
    """Returns (the config as a plain dict, the model class' default theta: a number, or a dict per kind of layer).
    A dict or a config.json is read through its config class where transformers is installed
    (``_through_config_class``), else as it is, with the default theta of ``_dict_default_theta``."""
    if isinstance(config, (str, os.PathLike, Mapping)):
        cfg = read_config_json(config) if isinstance(config, (str, os.PathLike)) else dict(config)
        built = _through_config_class(cfg)
        if built is None:
            model_type = cfg.get("model_type")
            if model_type and importlib.util.find_spec("transformers") is None:
                # Silently, the same dict gave another RoPE with and without transformers (Phi's rotary fraction,
                # Gemma's head_dim of 256, Llama 4's theta of 500000 are the config classes' defaults).
                warnings.warn(
                    f"transformers is not installed, so this {model_type!r} config is read as written: what it "
                    "leaves out takes posenc's generic defaults (head_dim = hidden_size // num_attention_heads, "
                    "rope_theta 10000, the whole head rotated), not the defaults of the model's config class that "
                    "from_pretrained applies; pip install transformers to read it as the model does",
                    stacklevel=user_stacklevel(),
                )
            return cfg, _dict_default_theta(cfg)
        config = built
    if callable(getattr(config, "to_dict", None)):
        return dict(config.to_dict()), getattr(config, "default_theta", 10000.0)
    raise TypeError(
        f"config must be a transformers config object, a dict, or a path to a config.json, got {type(config).__name__}"
    )


def _nested_text_configs(cfg: Mapping[str, Any]) -> Iterator[tuple[str, Mapping[str, Any]]]:
    """(key, config) for each step from a config down to the one that holds the text model's RoPE: none for a text
    model's config, text_config for a vision-language model (inside thinker_config for Qwen-Omni, vlm_config for
    ColQwen2)."""
    for _ in range(3):
        key = next((key for key in _NESTED_CONFIGS if isinstance(cfg.get(key), Mapping)), None)
        if key is None:
            return
        # The nested config whenever it holds RoPE keys of its own (MusicFlamingo's outer ones are its audio
        # tower's); the outer one only when it alone does (Qwen2-VL's legacy config.json, flat at the top).
        if _has_rope_keys(cfg) and not _holds_rope(cfg[key]):
            return
        cfg = cfg[key]
        yield key, cfg


def _has_rope_keys(cfg: Mapping[str, Any]) -> bool:
    return bool(cfg.get("rope_parameters") or cfg.get("rope_scaling") or "rope_theta" in cfg)


def _holds_rope(cfg: Mapping[str, Any]) -> bool:
    """Whether cfg, or a config nested in it, has RoPE keys."""
    return _has_rope_keys(cfg) or any(
        isinstance(cfg.get(key), Mapping) and _holds_rope(cfg[key]) for key in _NESTED_CONFIGS
    )


# Encoder-decoder configs (T5Gemma, T5Gemma 2, Dia): each half is a model with RoPE of its own.
_ENCODER_DECODER_CONFIGS = ("encoder", "decoder", "encoder_config", "decoder_config")


def _text_model(cfg: Mapping[str, Any]) -> Mapping[str, Any]:
    """The part of a config that holds the text model's RoPE, with its model type (``_nested_text_configs``)."""
    halves = [key for key in _ENCODER_DECODER_CONFIGS if isinstance(cfg.get(key), Mapping)]
    if halves and not _holds_rope(cfg):
        # Neither half is "the" text model; reading the outer config failed on its missing sizes instead.
        raise ValueError(
            f"this {cfg.get('model_type') or 'encoder-decoder'} config keeps a model with RoPE of its own in each of "
            f"{', '.join(map(repr, halves))}: pass the one to read, e.g. config[{halves[-1]!r}]"
        )
    for _, inner in _nested_text_configs(cfg):
        outer = cfg.get("model_type")
        cfg = {**inner, "model_type": inner.get("model_type") or _TEXT_MODELS.get(outer, outer)}
    return cfg


def _with_aliases(cfg: Mapping[str, Any]) -> Mapping[str, Any]:
    """cfg with the standard names its config class maps to its own keys (``attribute_map``: Bailing-Hybrid keeps
    max_position_embeddings as model_max_length, DBRX as max_seq_len, GPT-2-style configs as n_positions), where the
    standard name is not there itself. Needs transformers for the map; without it cfg is returned as it is."""
    aliases = _attribute_map(str(cfg.get("model_type") or ""))
    found = {alias: cfg[key] for alias, key in aliases.items() if cfg.get(alias) is None and cfg.get(key) is not None}
    return {**cfg, **found} if found else cfg


def _through_config_class(cfg: Mapping[str, Any]) -> Any:
    """The transformers config object of a config dict, built by the class its model_type names, as from_pretrained
    builds it: the class fills what the dict leaves out (Gemma's head_dim of 256, Phi's partial_rotary_factor of
    0.5, its default theta) and folds legacy keys in (Gemma 3's rope_scaling into its full-attention rope dict).
    None where transformers is missing, does not know the type, or refuses the dict: then the dict is read as it
    is, and posenc's own checks say what is wrong with it; a refused dict with a warning that says so."""
    try:
        from transformers.models.auto.configuration_auto import CONFIG_MAPPING
        from transformers.utils import logging as hf_logging

        cls = CONFIG_MAPPING[str(cfg.get("model_type") or "")]
    except Exception:  # not installed, or a model type it does not know
        return None
    # Quietly: its notes on legacy keys, which it converts, are for whoever saves configs, not for this read.
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return cls.from_dict(dict(cfg))
    except Exception as error:  # a dict the class refuses
        refusal = f"{type(error).__name__}: {' '.join(str(error).split())}"
    finally:
        hf_logging.set_verbosity(verbosity)
    # Silently, a key the class checks strictly (a vocab_size of 151936.0) dropped all of its defaults: a Qwen3
    # config without head_dim rotated 64 channels, not the class's 128, a Phi config the whole head, not half.
    warnings.warn(
        f"transformers' {cls.__name__} refuses this config ({refusal[:300]}), so from_pretrained would not load it "
        "either; it is read as written: what it leaves out takes posenc's generic defaults (head_dim = hidden_size // "
        "num_attention_heads, rope_theta 10000, the whole head rotated), not the defaults of the model's config class",
        stacklevel=user_stacklevel(),
    )
    return None


def _dict_default_theta(cfg: Mapping[str, Any]) -> Any:
    """The default theta of the config class that reads the text model's RoPE from ``cfg``: the class its
    model_type names, or for a nested text config without one, the outer class's sub-config class (Llama 4's
    text_config defaults to 500000, whatever its vision tower does). 10000 without transformers."""
    try:
        from transformers.models.auto.configuration_auto import CONFIG_MAPPING

        cls = CONFIG_MAPPING[str(cfg.get("model_type") or "")]
        for key, inner in _nested_text_configs(cfg):
            cls = CONFIG_MAPPING[inner["model_type"]] if inner.get("model_type") else cls.sub_configs[key]
        return getattr(cls, "default_theta", 10000.0)
    except Exception:  # not installed, or a model type it does not know
        return 10000.0


@functools.cache
def _attribute_map(model_type: str) -> dict[str, str]:
    try:
        from transformers.models.auto.configuration_auto import CONFIG_MAPPING

        return dict(getattr(CONFIG_MAPPING[model_type], "attribute_map", None) or {})
    except Exception:  # not installed, or a model type it does not know
        return {}


def _first(cfg: Mapping[str, Any], *keys: str) -> Any:
    """The first of ``keys`` present in cfg with a value that is not None."""
    for key in keys:
        if cfg.get(key) is not None:
            return cfg[key]
    return None


def _attention_heads(cfg: Mapping[str, Any]) -> Any:
    """The query heads a text model's config gives (GPT-2-style configs spell it n_head), or None."""
    return _first(cfg, "num_attention_heads", "n_head")


def num_heads_from_config(config: Any, *, layer_type: str | None = None) -> int | None:
    """The query heads of the text model a config describes, or None where it gives none. config and layer_type: as
    for ``rope_kwargs_from_config``, and read as it reads the RoPE: a vision-language model's heads are its
    text_config's, a model's own spelling (DBRX's n_heads) is its config class's ``attribute_map``'s, and a layer
    type's are its ``per_layer_config`` overrides' (dots3's sliding layers have half the heads of the others)."""
    cfg, _ = _load(config)
    return _attention_heads(_with_aliases(_layer_type_config(_text_model(cfg), layer_type)))


def _layer_types(cfg: Mapping[str, Any]) -> tuple[str, ...]:
    """The config's ``layer_types``, one name per layer (() where it has none). A string was read as its letters:
    a rope dict per layer type then matched none of them, and the config was read as one default RoPE."""
    value = cfg.get("layer_types")
    if value is None:
        return ()
    if isinstance(value, (str, bytes, Mapping)) or not isinstance(value, Sequence):
        raise TypeError(
            f"the config's layer_types must be a list with one layer type per layer (e.g. ['sliding_attention', "
            f"'full_attention']), got {value!r}"
        )
    return tuple(value)


def _rope_dict(cfg: Mapping[str, Any]) -> Any:
    """The config's rope dict as transformers takes it: a legacy ``rope_scaling`` that is not empty wins over
    ``rope_parameters`` (a model card's YaRN block added to a config.json saved with rope_parameters), theta
    included: the rope_parameters' own rope_theta is not read then. Where rope_scaling would be folded into rope
    dicts per layer type, a ValueError: the config classes that do it each do it their own way."""
    scaling, params = cfg.get("rope_scaling"), cfg.get("rope_parameters")
    layer_types = set(_layer_types(cfg))
    per_layer = isinstance(params, Mapping) and any(key in layer_types for key in params)
    model_type = cfg.get("model_type")
    if scaling and (per_layer or model_type in _LAYERED_ROPE_SCALING):
        beside = " beside rope dicts per layer type" if per_layer else ""
        raise ValueError(
            f"this {model_type or 'model'} config has a legacy rope_scaling block{beside}, which transformers' config "
            "classes combine with rope dicts per layer type each in their own way (Gemma 3 folds it into "
            "full_attention, with rope_local_base_freq for the sliding layers); load it with transformers "
            "(transformers.AutoConfig.from_pretrained) and pass the config object, which holds the result"
        )
    return scaling or params


def _layer_type_config(cfg: Mapping[str, Any], layer_type: str | None) -> Mapping[str, Any]:
    """cfg as the layers of ``layer_type`` see it: with their ``per_layer_config`` overrides (transformers'
    heterogeneous configs: Gemma 4's full-attention layers take ``global_head_dim`` as their head_dim), which must be
    the same for every layer of the type, as transformers requires where it reads a layer type's config. cfg itself
    where it has no overrides or no layer type is asked for."""
    overrides = cfg.get("per_layer_config")
    layer_types = list(_layer_types(cfg))
    if not isinstance(overrides, Mapping) or not overrides or layer_type not in layer_types:
        return cfg
    by_layer = {int(index): dict(values or {}) for index, values in overrides.items()}
    layers = [index for index, kind in enumerate(layer_types) if kind == layer_type]
    first = by_layer.get(layers[0], {})
    differ = [index for index in layers if by_layer.get(index, {}) != first]
    if differ:
        raise ValueError(
            f"the {layer_type} layers of this config differ in their per_layer_config (layer {layers[0]}: {first}, "
            f"layer {differ[0]}: {by_layer.get(differ[0], {})}), so no one RoPE serves them; transformers refuses "
            "to read such a layer type as one config too"
        )
    return {**cfg, **first}


def rope_layer_types(config: Any) -> tuple[str, ...]:
    """The layer types that have a rope dict of their own in ``config``, sorted (Gemma 3's 'full_attention' and
    'sliding_attention'): the values ``rope_kwargs_from_config(config, layer_type=...)`` takes. () for a config
    with one rope dict for every layer. config: as for ``rope_kwargs_from_config``."""
    cfg = _text_model(_load(config)[0])
    rope = _rope_dict(cfg)
    if not isinstance(rope, Mapping):
        return ()
    layer_types = set(_layer_types(cfg))
    return tuple(sorted(key for key, value in rope.items() if key in layer_types and value is not None))


def _phimoe_rope(rope_type: str, rope: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """PhiMoE's rope dict as the LongRoPE that its rotary embedding computes. Its forward (transformers 5.25,
    ``PhimoeRotaryEmbedding``) takes the frequencies for no length, so LongRoPE's short factors at every length,
    and scales cos/sin by the dict's ``short_mscale`` up to ``original_max_position_embeddings`` and ``long_mscale``
    past it, in place of LongRoPE's own attention factor. With one mscale for both sides (Phi-3.5-MoE's 1.2432), that
    is LongRoPE with long_factor = short_factor and attention_factor = the mscale; two differ by length, which no
    posenc.RoPE does."""
    if rope_type != "longrope":
        raise ValueError(
            f"model_type 'phimoe' with rope_type {rope_type!r} is not supported: PhiMoE's rotary embedding scales "
            "cos/sin by the rope dict's short_mscale / long_mscale in place of the type's own attention factor, "
            "which posenc maps for 'longrope' (Phi-3.5-MoE's) only"
        )
    mscales = {key: rope.pop(key, None) for key in ("short_mscale", "long_mscale")}
    missing = [key for key, value in mscales.items() if value is None]
    if missing:
        raise ValueError(
            f"PhiMoE's longrope dict needs {' and '.join(missing)}: its rotary embedding scales cos/sin by them (the "
            "model itself fails without them)"
        )
    short, long = (float(value) for value in mscales.values())
    if short != long:
        raise ValueError(
            f"PhiMoE's rotary embedding scales cos/sin by short_mscale={short} up to original_max_position_embeddings "
            f"and long_mscale={long} past it, a scale that changes with the length, which posenc.RoPE does not have; "
            "with one value for both, posenc rotates as the model does"
        )
    return "longrope", {**rope, "long_factor": rope.get("short_factor"), "attention_factor": short}


def rope_kwargs_from_config(config: Any, *, layer_type: str | None = None) -> dict[str, Any]:
    """The ``RoPE`` (or ``MRoPE``) constructor arguments a model's config implies, as a dict with ``head_dim``.

    config: a ``transformers`` config object, a dict, or a path to a config.json (or its folder).
    layer_type: for configs with one rope dict per layer type (e.g. "sliding_attention"), which one to read.

    The rotary fraction is the one the model's own code uses: with rope_type 'default', Llama, Mistral, Qwen2/3,
    Gemma and the other model types whose default RoPE ignores ``partial_rotary_factor`` rotate the whole head, so
    the factor is dropped for them; GPT-NeoX, Phi-3 and the like, and every scaled type, keep it.
    """
    cfg, default_theta = _load(config)
    if isinstance(default_theta, Mapping):  # per layer type, as Gemma 3's config class keeps it (global / local)
        kind = "local" if layer_type == "sliding_attention" else "global"
        default_theta = default_theta.get(layer_type, default_theta.get(kind, 10000.0))
    cfg = _with_aliases(_layer_type_config(_text_model(cfg), layer_type))
    model_type = str(cfg.get("model_type") or "")
    if model_type in _UNSUPPORTED_MODELS:
        raise ValueError(f"model_type {model_type!r} is not supported: {_UNSUPPORTED_MODELS[model_type]}")
    _require_rope(cfg, model_type)

    rope = _rope_dict(cfg) or {}
    if not isinstance(rope, Mapping):
        raise TypeError(f"config's rope_parameters / rope_scaling must be a dict, got {type(rope).__name__}")
    rope = dict(rope)
    layer_types = set(_layer_types(cfg))
    nested = [key for key in rope if key in layer_types]
    if not nested and any(isinstance(value, Mapping) for value in rope.values()):
        # No rope key holds a dict: these are rope dicts per layer type whose layers the config does not name, and
        # read as one dict they were dropped as unread keys, leaving a default RoPE at theta 10000.
        keys = [key for key, value in rope.items() if isinstance(value, Mapping)]
        raise ValueError(
            f"the config's rope dict holds dicts under {', '.join(map(repr, keys))}, rope dicts per layer type, but "
            "its layer_types does not name those types, so posenc cannot tell which layer takes which; add "
            "layer_types (one type per layer), or load the config with transformers "
            "(transformers.AutoConfig.from_pretrained) and pass the config object"
        )
    if nested:
        if layer_type not in nested:
            raise ValueError(f"this config has one rope dict per layer type; pass layer_type= one of {nested}")
        own = rope[layer_type]
        if own is not None and not isinstance(own, Mapping):
            raise TypeError(
                f"the config's rope dict for layer type {layer_type!r} must be a dict like {{'rope_type': "
                f"'default', 'rope_theta': 10000.0}}, got {own!r}"
            )
        outer, rope = rope, dict(own or {})
        if rope.get("rope_type", rope.get("type")) == "yarn" and ("truncate" in rope or "truncate" in outer):
            # transformers' YaRN reads truncate from the outer dict (config.rope_parameters.get("truncate", True)),
            # never from a layer type's own: the model truncates unless the outer dict says otherwise.
            given, rope["truncate"] = rope.get("truncate", True), outer.get("truncate", True)
            if bool(given) != bool(rope["truncate"]):
                warnings.warn(
                    f"the {layer_type} rope dict says truncate={given!r}, but transformers reads YaRN's truncate "
                    f"from the outer rope_parameters, not from a layer type's dict, so the model runs with "
                    f"truncate={rope['truncate']!r}; rotating as the model does",
                    stacklevel=user_stacklevel(),
                )
    elif layer_type is not None:
        raise ValueError(f"layer_type={layer_type!r} given but the config has a single rope dict; drop layer_type")

    if "rope_type" in rope and rope["rope_type"] is None and model_type not in _ABSOLUTE_ROTARY_DIM:
        # transformers keeps a null rope_type (beside a legacy 'type' too) and its model fails on it (KeyError: None);
        # GPT-J and CodeGen read no rope dict (below).
        raise ValueError(
            "the config's rope dict has rope_type null, which transformers' model fails on (KeyError: None); set "
            f"rope_type to {rope.get('type') or 'default'!r}"
        )
    if rope.get("rope_type") is not None:
        # transformers reads rope_type where both are given (Phi3Config maps a legacy 'yarn' to rope_type 'longrope'
        # and keeps the old key beside it).
        rope.pop("type", None)
    rope_type = pop_rope_type(rope)
    if model_type == "phi3" and rope_type == "yarn":
        rope_type = "longrope"  # Phi3Config maps its legacy 'yarn' to LongRoPE
    if model_type == "phimoe" and rope_type != "default":
        rope_type, rope = _phimoe_rope(rope_type, rope)

    # The model type decides how its axes share the pairs, as the model's rotary class does (transformers never
    # reads a config's mrope_interleaved key, and a config.json need not carry it); a model type posenc does not
    # know goes by the keys.
    mrope_layout, mrope_section = _MROPE_MODELS.get(model_type, (None, None))
    present, given = "mrope_section" in rope, rope.pop("mrope_section", None)
    if present and not given and (mrope_section is not None or rope.get("mrope_interleaved")):
        # This model type's rotary class fails on these (a TypeError / IndexError deep inside it); its default
        # sections are not what the config says. A type posenc does not know that says it interleaves M-RoPE axes
        # came back as plain RoPE.
        example, default = (
            (list(mrope_section), f", or leave the key out for the default of model_type {model_type!r}")
            if mrope_section is not None
            else ([16, 24, 24], "")
        )
        raise ValueError(
            f"rope_parameters['mrope_section'] is {given!r}: give the pairs per axis "
            f"({_MROPE_AXIS_ORDER[mrope_layout or 'interleaved']}), e.g. {example}{default}"
        )
    if given is not None and (isinstance(given, (str, bytes)) or not isinstance(given, Sequence)):
        # list() of it failed with "'int' object is not iterable" (rope_from_config, posenc plot --config), or, for a
        # string, made one section of each character.
        raise TypeError(
            f"rope_parameters['mrope_section'] must be a list of frequency pairs per axis, e.g. [16, 24, 24], got "
            f"{given!r}"
        )
    mrope_section = given or mrope_section
    key = rope.pop("mrope_interleaved", None)
    if key is not None and not isinstance(key, bool):
        # Read as a truth value, the string "false" (a hand-written config) laid the axes out interleaved.
        raise TypeError(f"rope_parameters['mrope_interleaved'] must be true or false, got {key!r}")
    if mrope_layout is None:
        mrope_layout = "interleaved" if key else "sections"
    elif key is not None and bool(key) != (mrope_layout == "interleaved"):
        warnings.warn(
            f"the config says mrope_interleaved={key!r}, but model_type {model_type!r} lays out its axes as "
            f"mrope_layout={mrope_layout!r} whatever the key says (transformers does not read it); rotating as the "
            "model does",
            stacklevel=user_stacklevel(),
        )

    theta = _first(rope, "rope_theta")
    if theta is None:
        theta = _first(cfg, *_TOP_LEVEL_THETA.get(model_type, ("rope_theta", "rotary_emb_base")))
    try:
        if isinstance(theta, (str, bytes, bool)):
            raise TypeError  # float() reads "10000" and True: a config of the wrong type, not a base
        rope["rope_theta"] = float(default_theta if theta is None else theta)
    except (TypeError, ValueError):
        raise ValueError(f"the config's rope_theta must be a number, got {theta!r}") from None

    partial = None
    if model_type in _ABSOLUTE_ROTARY_DIM:
        # GPT-J and CodeGen build a fixed table (create_sinusoidal_positions): base 10000, no scaling, whatever
        # the config says.
        rotary_dim = cfg.get("rotary_dim")
        rope_type, rope = "default", {"rope_theta": 10000.0}
    else:
        rotary_dim = None
        partial = _first(rope, "partial_rotary_factor")
        if partial is None:
            partial = _first(cfg, *_TOP_LEVEL_PARTIAL.get(model_type, ("partial_rotary_factor", "rotary_pct")))
        if partial is None:
            partial = _PARTIAL_DEFAULTS.get(model_type)
        rope.pop("partial_rotary_factor", None)
        # Asked only when it matters: finding the model's rotary class imports its transformers module.
        if partial is not None and (partial == 1 or rope_type != "default" or _default_reads_partial(model_type)):
            rope["partial_rotary_factor"] = partial

    max_pos = _first(cfg, "max_position_embeddings", "n_positions")
    # transformers gives a top-level original_max_position_embeddings priority over a single rope dict's (Phi-3 keeps
    # it there); a rope dict per layer type keeps its own, else takes max_position_embeddings, as a dict does here.
    original = None if nested else _first(cfg, "original_max_position_embeddings")
    if original is None and not nested:
        original = _ORIGINAL_DEFAULTS.get(model_type)
    # Every type whose keys include the original length (posenc.rope.parameters' tables): a list kept here went
    # stale for a type added there, which then scaled from max_position_embeddings instead, silently.
    keys = REQUIRED_KEYS.get(rope_type, frozenset()) | OPTIONAL_KEYS.get(rope_type, frozenset())
    if original is not None and "original_max_position_embeddings" in keys:
        rope["original_max_position_embeddings"] = original

    if rope_type in REQUIRED_KEYS:
        # transformers warns about keys a type does not read and goes on (Yarn-Llama-2's "finetuned", an
        # original_max_position_embeddings beside 'dynamic', which scales from max_position_embeddings); so does
        # this, where RoPE(rope_parameters=...) given by hand refuses them as likely typos.
        unused = unread_keys(rope_type, rope)
        if unused:
            warnings.warn(
                f"the config's rope dict has key(s) {', '.join(unused)} that rope_type {rope_type!r} does not read; "
                "ignored, as transformers ignores them",
                stacklevel=user_stacklevel(),
            )
            rope = {key: value for key, value in rope.items() if key not in unused}

    head_dim = _first(cfg, "qk_rope_head_dim", "head_dim")
    if cfg.get("qk_rope_head_dim") is not None and _first(cfg, "head_dim") not in (None, head_dim):
        # MLA rotates the qk_rope_head_dim channels, but transformers sizes the rotation (and its frequencies'
        # exponent) by head_dim * partial_rotary_factor: Mistral 4's 128 * 0.5, dots.llm3's 256 * 0.25, both the 64
        # channels rotated. The same fraction of the rotated channels here.
        fraction = 1.0 if partial is None else partial
        rotated = int(cfg["head_dim"] * fraction)
        if rotated > head_dim or rotated % 2:
            raise ValueError(
                f"the config's head_dim={cfg['head_dim']} times partial_rotary_factor={fraction} sizes a "
                f"rotation of {rotated} channels, which the "
                f"qk_rope_head_dim={head_dim} rotated channels cannot hold; transformers' model would fail too"
            )
        rope["partial_rotary_factor"] = rotary_fraction(rotated, head_dim)
    if head_dim is None:
        hidden, heads = _first(cfg, "hidden_size", "n_embd", "d_model"), _attention_heads(cfg)
        if hidden is None or heads is None:
            raise ValueError("config needs head_dim, or hidden_size and num_attention_heads, to size the rotation")
        head_dim = positive_int("config hidden_size", hidden) // positive_int("config num_attention_heads", heads)

    if max_pos is None and rope_type == "dynamic":
        # RoPE's own message says to pass max_position_embeddings=, an argument rope_from_config does not take.
        raise ValueError(
            "rope_type 'dynamic' scales from the trained length, and this config has no max_position_embeddings; "
            "add it to the config"
        )
    kwargs: dict[str, Any] = {
        "head_dim": head_dim,
        "rope_parameters": {"rope_type": rope_type, **rope},
        "max_position_embeddings": max_pos,
        "interleaved": model_type in _INTERLEAVED_MODELS
        or bool(cfg.get("rope_interleave", _INTERLEAVE_DEFAULTS.get(model_type, False))),
    }
    if rotary_dim is not None:
        kwargs["rotary_dim"] = rotary_dim
    if mrope_section is not None:
        kwargs["mrope_section"] = list(mrope_section)
        kwargs["mrope_layout"] = mrope_layout
    return kwargs


# Config keys that switch off the rotary embedding of a model whose code has one, and the values that keep it on.
_ROPE_SWITCHES = {
    "alibi": (None, False),  # Falcon: ALiBi biases instead
    "position_embedding_type": (None, "rotary", "rope"),  # ESM, Evolla ('absolute'), GraniteMoeHybrid ('nope')
    "use_rotary_embedding": (None, True),  # CLVP
}


def _require_rope(cfg: Mapping[str, Any], model_type: str) -> None:
    """Raise ValueError for a config whose model does not rotate q and k (a switch in the config, or a model type
    whose code in the installed transformers has no rotary embedding); warn for a model type transformers does
    not know (remote code: ChatGLM, Qwen 1, Baichuan), which is read by transformers' conventions."""
    for key, on in _ROPE_SWITCHES.items():
        if key in cfg and cfg[key] not in on:
            raise ValueError(
                f"the config says {key}={cfg[key]!r}: this {model_type or 'model'} does not use its rotary "
                "embedding, so it has no RoPE to read"
                + ("; its encoding is ALiBi (posenc.ALiBi(num_heads))" if key == "alibi" else "")
            )
    if not model_type:
        return
    code = _transformers_rotates(model_type)
    if code is False:
        raise ValueError(
            f"model_type {model_type!r} has no rotary embedding in the installed transformers' code (it encodes "
            "position some other way: learned, sinusoidal, relative buckets, ALiBi or none), so it has no RoPE "
            "to read"
        )
    if code is None and model_type not in _INTERLEAVED_MODELS | _ABSOLUTE_ROTARY_DIM | _MROPE_MODELS.keys():
        warnings.warn(
            f"model_type {model_type!r} is not one the installed transformers knows (remote code?): read by "
            "transformers' conventions (split-half pairs, rope_theta, partial_rotary_factor / rotary_pct / head_dim); "
            "check them against the model's own code",
            stacklevel=user_stacklevel(),
        )


@functools.cache
def _transformers_rotates(model_type: str) -> bool | None:
    """Whether the installed transformers' modeling code for ``model_type`` has a rotary embedding: False for a
    type it knows whose package's modeling files never mention one, None for a type it does not know, True
    otherwise (a rotary embedding, or no transformers to ask). The files are read, not imported."""
    try:
        from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES, model_type_to_module_name
    except Exception:  # not installed: nothing to tell
        return True
    if model_type not in CONFIG_MAPPING_NAMES:
        return None
    try:
        package = importlib.util.find_spec(f"transformers.models.{model_type_to_module_name(model_type)}")
    except (ImportError, ValueError):
        package = None
    folders = [] if package is None else list(package.submodule_search_locations or ())
    # Every modeling file of the package: a sub-config type's code may sit in another (data2vec-text's in
    # modeling_data2vec_text.py, Qwen2.5-VL's text model in modeling_qwen2_5_vl.py).
    files = [file for folder in folders for file in Path(folder).glob("modeling_*.py")]
    if not files:
        return True
    return any("otary" in file.read_text(encoding="utf-8") for file in files)


@functools.cache
def _default_reads_partial(model_type: str) -> bool:
    """Whether the model type's 'default' RoPE reads partial_rotary_factor: its rotary class in the installed
    transformers if that has one, else ``_DEFAULT_READS_PARTIAL``. A config of no model type: the factor holds."""
    if not model_type:
        return True
    source = _default_rope_source(model_type)
    return model_type in _DEFAULT_READS_PARTIAL if source is None else "partial_rotary_factor" in source


def _default_rope_source(model_type: str) -> str | None:
    """The source of compute_default_rope_parameters of the model type's one rotary class in the installed
    transformers, or None (no transformers, an unknown type, no such class or several)."""
    try:
        from transformers.models.auto.configuration_auto import model_type_to_module_name

        module = model_type_to_module_name(model_type)
        modeling = importlib.import_module(f"transformers.models.{module}.modeling_{module}")
    except Exception:  # not installed, unknown to it, or a modeling module that needs an optional package
        return None
    classes = [
        cls
        for name, cls in vars(modeling).items()
        if name.endswith("RotaryEmbedding")
        and getattr(cls, "__module__", None) == modeling.__name__
        and hasattr(cls, "compute_default_rope_parameters")
    ]
    if len(classes) != 1:
        return None
    try:
        return inspect.getsource(classes[0].compute_default_rope_parameters)
    except (OSError, TypeError):
        return None


def rope_from_config(config: Any, *, layer_type: str | None = None, mode: Literal["hf", "consistent"] = "hf") -> RoPE:
    """A ``posenc.RoPE`` that rotates exactly as the model does: frequencies, attention factor, rotary dim and
    pair layout. Returns an ``MRoPE`` for the vision-language models with three position axes (``mrope_section``:
    Qwen2-VL, Qwen2.5-VL, Qwen3-VL, Qwen3.5, GLM-4V and their kin); refuses the M-RoPE layouts it cannot make.

    config: a ``transformers`` config object, a dict, or a path to a config.json (or its folder), old or new form;
    a dict or file is read through the config class its model_type names where transformers is installed and the
    class takes it, as ``from_pretrained`` would (the class's defaults for what it leaves out).
    layer_type: for configs with one rope dict per layer type, which one (``rope_layer_types`` lists them); a
    ValueError for a config with a single rope dict.
    mode: 'hf' (Hugging Face's numbers, the default) or 'consistent'; see ``RoPE``.
    """
    kwargs = rope_kwargs_from_config(config, layer_type=layer_type)
    head_dim = kwargs.pop("head_dim")
    if "mrope_section" in kwargs:
        return MRoPE(head_dim, mode=mode, **kwargs)
    return RoPE(head_dim, mode=mode, **kwargs)


# Last, because patch.py imports rope_kwargs_from_config from this module. Re-exported: `as` marks them public.
from posenc.interop.patch import patch_model as patch_model  # noqa: E402
from posenc.interop.patch import unpatch_model as unpatch_model  # noqa: E402
