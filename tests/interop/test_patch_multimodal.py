"""patch_model on vision-language models: their text model's multimodal RoPE (three position axes, M-RoPE) becomes
posenc's ``MRoPE``, and the vision tower keeps its own rotation.

The models are tiny and random (no download). The language model is run with (3, b, s) position ids whose axes
differ, as image tokens get them, and must give the unpatched hidden states, in a full forward and in a cached
decoding step; with text ids (the same on every axis) the positions would not tell the layouts apart, which the
test shows too.
"""

from __future__ import annotations

import copy
import warnings
from typing import Any

import pytest
import torch

from posenc.interop.patch import PosencRotaryEmbedding, is_patched, patch_model, unpatch_model
from posenc.testing import TINY_HF_SIZES

transformers = pytest.importorskip("transformers")

TEXT = dict(**TINY_HF_SIZES, vocab_size=160, max_position_embeddings=64)
VISION = dict(
    depth=1,
    hidden_size=64,
    embed_dim=32,
    intermediate_size=64,
    num_heads=2,
    out_hidden_size=64,
    patch_size=14,
    spatial_merge_size=2,
    temporal_patch_size=2,
)
# Qwen2.5-Omni's thinker has an audio tower too, which no test here runs: its default (32 layers of width 1280) took
# 17 of the 18 s its case cost to build.
AUDIO = dict(
    encoder_layers=1, encoder_attention_heads=2, encoder_ffn_dim=64, d_model=32, output_dim=TEXT["hidden_size"]
)
IMAGE, VISION_START = 150, 152
# model_type -> an mrope_section that fits 8 pairs in the type's layout (16 channels; GLM-4.5V rotates half).
MODELS = {
    "qwen2_vl": [2, 3, 3],
    "qwen2_5_vl": [2, 3, 3],
    "qwen3_vl": [4, 2, 2],  # interleaved: t, h, w cycled
    "qwen3_vl_moe": [4, 2, 2],
    "glm4v": [2, 3, 3],  # adjacent pairs
    "glm4v_moe": [2, 1, 1],  # 4 pairs: partial rotary
    "glm_ocr": [2, 3, 3],
    "paddleocr_vl": [2, 3, 3],
    "qwen2_5_omni_thinker": [2, 3, 3],
    "ernie4_5_vl_moe": [3, 3, 2],  # h, w alternating, then t; its inv_freq buffer holds them in another order
}
FP32 = dict(atol=1e-4, rtol=1e-4)


def build(model_type: str) -> Any:
    defaults = transformers.AutoConfig.for_model(model_type)
    rope = {**defaults.text_config.rope_parameters, "mrope_section": MODELS[model_type]}
    vision = {key: value for key, value in VISION.items() if hasattr(defaults.vision_config, key)}
    audio = {"audio_config": AUDIO} if hasattr(defaults, "audio_config") else {}
    config = transformers.AutoConfig.for_model(
        model_type,
        text_config={**TEXT, "rope_parameters": rope},
        vision_config=vision,
        **audio,
        image_token_id=IMAGE,
        video_token_id=IMAGE + 1,
        vision_start_token_id=VISION_START,
    )
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return transformers.AutoModelForImageTextToText.from_config(config).eval()


def positions(batch: int = 2, length: int = 12) -> torch.Tensor:
    """(3, b, s) ids whose temporal, height and width axes differ, as an image's tokens get them."""
    steps = torch.arange(length)
    axes = torch.stack((steps, steps // 3 + 5, steps % 3 + 9))
    return axes[:, None, :].expand(3, batch, length)


def tokens(batch: int = 2, length: int = 12) -> torch.Tensor:
    return torch.randint(3, 140, (batch, length), generator=torch.Generator().manual_seed(0))


@pytest.fixture(autouse=True, scope="module")
def _quiet():
    verbosity = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_error()
    yield
    transformers.logging.set_verbosity(verbosity)


@pytest.mark.parametrize("model_type", MODELS)
def test_the_text_models_multimodal_rope_is_posencs(model_type: str) -> None:
    model = build(model_type)
    patched = copy.deepcopy(model)
    report = patch_model(patched)
    language = patched.model.language_model
    assert report.rotary_modules == ("model.language_model.rotary_emb",)
    assert isinstance(language.rotary_emb, PosencRotaryEmbedding)
    assert type(language.rotary_emb.rope).__name__ == "MRoPE"
    ids, axes = tokens(), positions()
    with torch.no_grad():
        torch.testing.assert_close(patched(input_ids=ids).logits, model(input_ids=ids).logits, **FP32)
        ours = language(input_ids=ids, position_ids=axes).last_hidden_state
        theirs = model.model.language_model(input_ids=ids, position_ids=axes).last_hidden_state
        torch.testing.assert_close(ours, theirs, **FP32)
        # The three axes matter: text ids give other states.
        text = language(input_ids=ids, position_ids=torch.arange(12).expand(2, 12)).last_hidden_state
        assert (text - ours).abs().max() > 1e-2
        # A cached decoding step with (3, b, s) ids continues the prefill's.
        past = language(input_ids=ids[:, :8], position_ids=axes[..., :8], use_cache=True).cache
        step = language(input_ids=ids[:, 8:], position_ids=axes[..., 8:], cache=past).last_hidden_state
        torch.testing.assert_close(step, theirs[:, 8:], **FP32)
    unpatch_model(patched)
    assert not is_patched(patched) and type(patched.model.language_model.rotary_emb).__name__.endswith(
        "RotaryEmbedding"
    )


def test_an_image_goes_through_the_untouched_vision_tower_and_the_patched_text_model() -> None:
    model = build("qwen2_vl")
    patched = copy.deepcopy(model)
    patch_model(patched)
    vision_rotary = type(patched.model.visual.rotary_pos_emb).__name__
    assert vision_rotary == "Qwen2VLVisionRotaryEmbedding"  # the vision tower keeps its own RoPE
    ids = torch.tensor([[5, 6, VISION_START, IMAGE, IMAGE, IMAGE, IMAGE, 7, 8, 9]])
    image = dict(
        pixel_values=torch.randn(16, 3 * 2 * 14 * 14, generator=torch.Generator().manual_seed(0)),
        image_grid_thw=torch.tensor([[1, 4, 4]]),  # 4 x 4 patches, merged 2 x 2 into the 4 image tokens
        mm_token_type_ids=(ids == IMAGE).long(),
    )
    with torch.no_grad():
        torch.testing.assert_close(patched(input_ids=ids, **image).logits, model(input_ids=ids, **image).logits, **FP32)
        options = dict(max_new_tokens=6, do_sample=False, **image)
        assert torch.equal(patched.generate(input_ids=ids, **options), model.generate(input_ids=ids, **options))


@pytest.mark.parametrize("model_type", ["qwen3_5_text", "qwen3_5_moe_text"])
def test_a_text_model_with_multimodal_rope_takes_three_axes(model_type: str) -> None:
    # Qwen3.5's language model on its own: linear attention layers, then one with M-RoPE cycling t, h, w.
    rope = dict(rope_theta=1e4, partial_rotary_factor=0.25, mrope_section=[3, 3, 2])
    sizes = {key: value for key, value in TEXT.items() if key != "initializer_range"}
    config = transformers.AutoConfig.for_model(
        model_type, **{**sizes, "num_hidden_layers": 4, "head_dim": 64, "rope_parameters": rope}
    )
    if hasattr(config, "num_experts"):
        config.num_experts, config.num_experts_per_tok = 4, 2
        config.moe_intermediate_size, config.shared_expert_intermediate_size = 32, 64
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    patched = copy.deepcopy(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        patch_model(patched)
    ids, axes = tokens(), positions()
    with torch.no_grad():
        ours = patched.model(input_ids=ids, position_ids=axes).last_hidden_state
        torch.testing.assert_close(ours, model.model(input_ids=ids, position_ids=axes).last_hidden_state, **FP32)
        text = patched.model(input_ids=ids, position_ids=torch.arange(12).expand(2, 12)).last_hidden_state
        assert (text - ours).abs().max() > 1e-2


def test_the_probe_checks_how_the_pairs_are_shared_among_the_axes(monkeypatch: pytest.MonkeyPatch) -> None:
    # Were posenc to read Qwen3-VL's interleaved axes as sections, the rotation probe with three differing axes
    # would see it before anything is replaced.
    from posenc.interop import hf

    monkeypatch.setitem(hf._MROPE_MODELS, "qwen3_vl_text", ("sections", [24, 20, 20]))
    model = build("qwen3_vl")
    with pytest.raises(ValueError, match="apply_rotary_pos_emb does not rotate as posenc does"):
        patch_model(model)
    assert not is_patched(model)


def test_three_axes_are_refused_by_a_plain_rope() -> None:
    from posenc.rope.module import RoPE

    rotary = PosencRotaryEmbedding(RoPE(16))
    with pytest.raises(ValueError, match=r"position_ids of shape \(3, 1, 5\): .* this rotary embedding's is RoPE"):
        rotary(torch.zeros(1, 5, 64), torch.zeros(3, 1, 5, dtype=torch.long))


def test_one_rotary_class_is_the_text_models_whatever_its_name() -> None:
    # Towers are told apart by name only among several rotary classes: HiggsAudio's text model has one, named
    # HiggsAudioV2RotaryEmbedding.
    sizes = {key: value for key, value in TEXT.items() if key != "vocab_size"}
    config = transformers.AutoConfig.for_model("higgs_audio_v2", **sizes)
    torch.manual_seed(0)
    model = transformers.HiggsAudioV2ForConditionalGeneration(config).eval()
    patched = copy.deepcopy(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert patch_model(patched).rotary_modules == ("model.rotary_emb",)
    ids = tokens()
    with torch.no_grad():
        torch.testing.assert_close(patched(input_ids=ids).logits, model(input_ids=ids).logits, **FP32)
