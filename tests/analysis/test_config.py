"""FigureConfig: validated by the real RoPE parser; reads its own JSON or a Hugging Face config.json."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

from posenc import RoPE
from posenc.analysis import FigureConfig, example_rope_parameters
from posenc.analysis.run import run_figure_config
from posenc.analysis.wavelengths import wavelengths
from posenc.interop import rope_from_config


def test_defaults():
    config = FigureConfig()
    assert (config.head_dim, config.base, config.rope_type, config.train_len, config.eval_len) == (
        64,
        10000.0,
        "default",
        2048,
        8192,
    )


def test_from_flags():
    config = FigureConfig.from_flags(rope_type="yarn", base=500000.0, rope_parameters={"factor": 8.0}, train_len=512)
    assert config.rope_type == "yarn" and config.base == 500000.0 and config.spec.params["factor"] == 8.0
    assert config.eval_len == 8 * 512  # the length the factor extends to
    assert FigureConfig.from_flags(rope_type="yarn", rope_parameters={"factor": 1.5}, train_len=512).eval_len == 768
    assert FigureConfig.from_flags(train_len=512).eval_len == 4 * 512  # no factor: 4x
    assert FigureConfig.from_flags(rope_type="linear", rope_parameters={"factor": 1.1}, train_len=100).eval_len == 110
    with pytest.raises(ValueError, match="rope_type is given twice"):
        FigureConfig.from_flags(rope_type="yarn", rope_parameters={"rope_type": "linear"})


@pytest.mark.parametrize("rope_type", ["llama3", "longrope", "yarn", "linear", "proportional"])
def test_a_type_named_alone_is_drawn_with_the_example_parameters(rope_type):
    # `posenc plot --rope-type llama3` was an error asking for factor, low_freq_factor and high_freq_factor.
    config = FigureConfig.from_flags(rope_type=rope_type, train_len=512, head_dim=32)
    expected = example_rope_parameters(rope_type, rotary_dim=32, train_len=512, factor=4.0)
    assert {k: config.rope_parameters[k] for k in expected} == expected
    given = FigureConfig.from_flags(rope_type=rope_type, rope_parameters={"factor": 8.0, "rope_theta": 5e5})
    assert given.base == 5e5 and given.rope_parameters.get("factor", 8.0) == 8.0  # what is given wins


def test_proportional_named_alone_turns_a_quarter_of_the_pairs_and_keeps_a_given_fraction():
    # Its one parameter is optional, so the type named alone was drawn as plain RoPE.
    alone = FigureConfig.from_flags(rope_type="proportional", head_dim=64)
    assert int((RoPE(64, **alone.rope_kwargs()).frequencies()[0] > 0).sum()) == 8
    given = FigureConfig.from_flags(rope_type="proportional", rope_parameters={"partial_rotary_factor": 0.5})
    assert given.rope_parameters["partial_rotary_factor"] == 0.5


def test_hugging_face_config(tmp_path):
    llama = {
        "model_type": "llama",
        "hidden_size": 4096,
        "num_attention_heads": 32,
        "max_position_embeddings": 131072,
        "rope_theta": 500000.0,
        "rope_scaling": {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
        "vocab_size": 128256,
    }
    path = tmp_path / "config.json"
    path.write_text(json.dumps(llama))
    config = FigureConfig.from_json(path)
    assert (config.head_dim, config.num_heads, config.train_len, config.eval_len) == (128, 32, 8192, 131072)
    assert config.rope_type == "llama3" and config.base == 500000.0


def test_own_json(tmp_path):
    path = tmp_path / "figures.json"
    path.write_text(json.dumps({"head_dim": 32, "rope_parameters": {"rope_type": "linear", "factor": 2.0}}))
    config = FigureConfig.from_json(path)
    assert config.head_dim == 32 and config.rope_type == "linear"


def test_bad_input_is_a_clear_error(tmp_path):
    with pytest.raises(ValueError, match="rope_type 'yarn' needs the key"):
        FigureConfig(rope_parameters={"rope_type": "yarn"})
    with pytest.raises(ValueError, match="unknown rope_type"):
        FigureConfig(rope_parameters={"rope_type": "warp"})
    with pytest.raises(ValueError, match="eval_len=100 must be >= train_len=2048"):
        FigureConfig(eval_len=100)
    with pytest.raises(ValueError, match="head_dim must be a positive integer"):
        FigureConfig(head_dim=0)
    with pytest.raises(TypeError, match="rope_parameters must be a dict"):
        FigureConfig(rope_parameters=[1])
    with pytest.raises(ValueError, match="unknown key\\(s\\) colour"):
        FigureConfig.from_mapping({"colour": "red"})
    with pytest.raises(ValueError, match="does not exist"):
        FigureConfig.from_json(tmp_path / "missing.json")
    broken = tmp_path / "broken.json"
    broken.write_text("{")
    with pytest.raises(ValueError, match="is not valid JSON"):
        FigureConfig.from_json(broken)
    with (
        pytest.raises(ValueError, match="hidden_size and num_attention_heads"),
        pytest.warns(UserWarning, match="'x' is not"),
    ):
        FigureConfig.from_mapping({"model_type": "x"})


@pytest.mark.parametrize("path", sorted((Path(__file__).parents[1] / "fixtures" / "configs").glob("*.json")))
def test_a_hugging_face_config_draws_the_rope_the_model_does(path):
    """Every stored model config gives the figures the RoPE that rope_from_config (checked against transformers in
    tests/interop) builds: rotary dim, pair layout, and frequencies and attention factor at and past train_len."""
    config = FigureConfig.from_json(path)
    model = rope_from_config(path)
    drawn = RoPE(config.head_dim, **config.rope_kwargs())
    assert (drawn.rotary_dim, drawn.interleaved) == (model.rotary_dim, model.interleaved)
    for seq_len in (config.train_len, config.eval_len):
        inv_freq, factor = drawn.frequencies(seq_len)
        expected_inv_freq, expected_factor = model.frequencies(seq_len)
        torch.testing.assert_close(inv_freq, expected_inv_freq, rtol=0, atol=0)
        assert factor == pytest.approx(expected_factor, rel=1e-12), seq_len


def test_train_len_is_the_length_the_scaling_extends_from():
    """The figures' L follows the scaling's original_max_position_embeddings; a contradicting train_len is an error
    (the dashed line, eval_len and figure 6's L once said 2048 for a YaRN that scales from 8192)."""
    rope = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8192}
    config = FigureConfig.from_flags(rope_parameters=rope)
    assert (config.train_len, config.eval_len) == (8192, 4 * 8192)
    assert FigureConfig.from_mapping({"rope_parameters": rope}).train_len == 8192
    with pytest.raises(
        ValueError, match="train_len=2048 but rope_parameters say original_max_position_embeddings=8192"
    ):
        FigureConfig.from_flags(rope_parameters=rope, train_len=2048)
    assert FigureConfig(rope_parameters={"rope_theta": 1e4, **rope}).train_len == 8192
    with pytest.raises(ValueError, match="give one"):
        FigureConfig(rope_parameters={"rope_theta": 1e4, **rope}, train_len=4096)


def test_a_whole_float_original_length_is_the_figures_length_as_it_is_ropes(tmp_path):
    """RoPE scales from original_max_position_embeddings=4096.0 (transformers computes with it); the figures took
    only ints, so their L (the dashed line, eval_len, the pairs counted against it) stayed 2048, and a Hugging Face
    config holding 8192.0 failed with "train_len must be a positive integer", an argument nobody gave."""
    rope = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 4096.0}
    config = FigureConfig.from_flags(rope_parameters=rope)
    assert (config.train_len, config.eval_len) == (4096, 4 * 4096)
    assert config.rope_parameters["original_max_position_embeddings"] == 4096
    with pytest.raises(ValueError, match="train_len=2048 but rope_parameters say original_max_position_embeddings"):
        wavelengths(32, 2048, rope_parameters=rope)
    assert wavelengths(32, 4096, rope_parameters=rope).train_len == 4096
    hf = {
        "model_type": "llama",
        "hidden_size": 256,
        "num_attention_heads": 4,
        "max_position_embeddings": 32768,
        "rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8192.0},
    }
    assert FigureConfig.from_mapping(hf).train_len == 8192


@pytest.mark.parametrize("value", [float("inf"), float("nan"), "abc", [1], 1e400])
def test_a_bad_partial_rotary_factor_is_named_when_the_example_is_drawn(value):
    """The example's rotary width was int(head_dim * value) before any check: inf an OverflowError traceback, NaN
    "cannot convert float NaN to integer", 'abc' a string of 192 letters in int()'s message."""
    with pytest.raises((ValueError, TypeError), match=r"partial_rotary_factor must be (a number )?in \(0, 1\]"):
        FigureConfig.from_flags(rope_type="yarn", rope_parameters={"partial_rotary_factor": value})


@pytest.mark.parametrize("half", [0.5, "numpy", "fraction", "tensor"])
def test_a_partial_rotary_factor_of_any_real_type_draws_the_example_for_its_pairs(half):
    """The example's stand-in took only int and float: numpy's, a Fraction or a 0-d tensor (which the parser takes)
    gave longrope's example factors for the whole head ("short_factor must hold ... 16 factors, got 32")."""
    import fractions

    import numpy as np

    value = {"numpy": np.float32(0.5), "fraction": fractions.Fraction(1, 2), "tensor": torch.tensor(0.5)}.get(
        half, half
    )
    config = FigureConfig.from_flags(
        head_dim=64, rope_type="longrope", rope_parameters={"partial_rotary_factor": value}
    )
    assert config.spec.rotary_dim == 32


def test_a_bad_original_length_is_blamed_on_its_key_and_a_run_keeps_it():
    rope = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": "abc"}
    with pytest.raises(ValueError, match="original_max_position_embeddings"):
        FigureConfig.from_flags(rope_parameters=rope)


@pytest.mark.parametrize("head_dim", [3, 63, 255])
def test_an_odd_head_dim_is_told_the_rotary_fraction_figures_take(head_dim):
    """RoPE's own message said to pass rotary_dim, which neither FigureConfig nor posenc plot takes."""
    fraction = round((head_dim - 0.5) / head_dim, 6)
    hint = f"partial_rotary_factor={fraction} (posenc plot / report: --rope-param partial_rotary_factor={fraction})"
    with pytest.raises(
        ValueError, match=re.escape(f"rotate {head_dim - 1} of the {head_dim} channels with the rope parameter {hint}")
    ):
        FigureConfig(head_dim=head_dim)
    config = FigureConfig(head_dim=head_dim, rope_parameters={"partial_rotary_factor": fraction})
    assert config.spec.rotary_dim == head_dim - 1


@pytest.mark.parametrize(("head_dim", "rotary_dim"), [(44, 30), (49, 16), (256, 64)])
def test_an_absolute_rotary_dim_keeps_its_channels(head_dim, rotary_dim, tmp_path):
    """GPT-J's rotary_dim, and a lab run's, become the fraction rotary_dim / head_dim, which for 30 of 44 is an ulp
    short of giving 30 back: the parser read int(29.999...) = 29 channels and refused the config as odd."""
    hf = {"model_type": "gptj", "n_embd": 4 * head_dim, "n_head": 4, "rotary_dim": rotary_dim, "n_positions": 2048}
    assert FigureConfig.from_mapping(hf).spec.rotary_dim == rotary_dim
    sizes = {"dim": 4 * head_dim, "heads": 4, "train_len": 64, "eval_lengths": [64, 128]}
    rope = {"head_dim": head_dim, "rotary_dim": rotary_dim, "interleaved": True, "rope_parameters": {}}
    (tmp_path / "results.json").write_text(json.dumps({"config": sizes, "rope": rope}))
    assert run_figure_config(tmp_path).spec.rotary_dim == rotary_dim


def test_a_run_whose_rope_lacks_a_key_is_named_not_a_key_error(tmp_path):
    sizes = {"dim": 64, "heads": 4, "train_len": 64, "eval_lengths": [64, 128]}
    for rope in ({"head_dim": 16, "rotary_dim": 16, "interleaved": False}, {"head_dim": 16, "rope_parameters": 3}):
        (tmp_path / "results.json").write_text(json.dumps({"config": sizes, "rope": rope}))
        with pytest.raises(ValueError, match=r"results\.json's rope (lacks|has).*not the results\.json the lab writes"):
            run_figure_config(tmp_path)


@pytest.mark.parametrize(
    ("rope_type", "given", "head_dim", "match"),
    [
        ("longrope", {"factor": 0.5}, 32, r"rope_parameters\['factor'\] must be >= 1.0"),
        ("linear", {"factor": 0.5}, 32, r"rope_parameters\['factor'\] must be >= 1.0"),
        ("linear", {"factor": 2.0, "partial_rotary_factor": 0.25}, 2, "partial_rotary_factor=0.25 of head_dim=2"),
        ("yarn", {"original_max_position_embeddings": 0}, 32, "original_max_position_embeddings"),
    ],
)
def test_bad_rope_parameters_are_named_not_the_example_arguments(rope_type, given, head_dim, match):
    """example_rope_parameters checks its own arguments: the values it refuses are left to the rope parameter
    checks, whose errors name the key the user gave."""
    with pytest.raises(ValueError, match=match):
        FigureConfig.from_flags(rope_type=rope_type, rope_parameters=given, head_dim=head_dim)


@pytest.mark.parametrize(
    "config",
    [
        # A vision-language model: its text model, heads and RoPE alike, is in text_config.
        {
            "model_type": "llava",
            "text_config": {
                "model_type": "qwen3",
                "hidden_size": 512,
                "num_attention_heads": 16,
                "num_key_value_heads": 4,
                "head_dim": 32,
                "max_position_embeddings": 4096,
            },
            "vision_config": {"hidden_size": 64, "num_attention_heads": 4},
        },
        # DBRX spells the head count n_heads (its config class's attribute_map).
        {"model_type": "dbrx", "d_model": 512, "n_heads": 16, "max_seq_len": 2048, "attn_config": {"rope_theta": 5e5}},
    ],
    ids=["text_config", "dbrx"],
)
def test_a_hugging_face_config_gives_its_text_models_head_count(config):
    # Read from the top-level keys alone, both were drawn with the default 8 heads (the ALiBi panels' slopes too).
    figure = FigureConfig.from_mapping(config)
    assert (figure.head_dim, figure.num_heads) == (32, 16)


# Gemma 3's text model: one rope dict per layer type, the global layers' scaled.
GEMMA3_TEXT = {
    "model_type": "gemma3_text",
    "hidden_size": 640,
    "num_attention_heads": 4,
    "num_key_value_heads": 1,
    "head_dim": 256,
    "max_position_embeddings": 32768,
    "num_hidden_layers": 2,
    "layer_types": ["sliding_attention", "full_attention"],
    "rope_parameters": {
        "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
        "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1000000.0},
    },
}


@pytest.mark.parametrize(
    ("layer_type", "base", "rope_type"), [("full_attention", 1e6, "linear"), ("sliding_attention", 1e4, "default")]
)
def test_a_config_with_a_rope_dict_per_layer_type_draws_the_one_asked_for(layer_type, base, rope_type):
    figure = FigureConfig.from_mapping(GEMMA3_TEXT, layer_type=layer_type)
    assert (figure.head_dim, figure.num_heads, figure.base, figure.rope_type) == (256, 4, base, rope_type)
    model = rope_from_config(GEMMA3_TEXT, layer_type=layer_type)
    drawn = RoPE(figure.head_dim, **figure.rope_kwargs())
    for got, expected in zip(drawn.frequencies(figure.eval_len), model.frequencies(figure.eval_len), strict=True):
        torch.testing.assert_close(got, expected, rtol=0, atol=0)


def test_a_config_with_a_rope_dict_per_layer_type_names_the_flag_that_picks_one(tmp_path):
    # The figures had no way to take one: rope_kwargs_from_config's error asked for its keyword argument, which
    # `posenc plot --config` could not give.
    with pytest.raises(ValueError, match="--layer-type full_attention"):
        FigureConfig.from_mapping(GEMMA3_TEXT)
    with pytest.raises(ValueError, match="drop layer_type"):
        FigureConfig.from_mapping({"head_dim": 32}, layer_type="full_attention")
    with pytest.raises(ValueError, match=r"layer_type='global' is none of them; .*--layer-type full_attention"):
        FigureConfig.from_mapping(GEMMA3_TEXT, layer_type="global")
    path = tmp_path / "config.json"
    path.write_text(json.dumps(GEMMA3_TEXT))
    assert FigureConfig.from_json(path, layer_type="full_attention").base == 1e6


@pytest.mark.parametrize("layer_type", ["sliding_attention", "indexed_attention"])
def test_a_layer_type_is_drawn_with_its_own_head_count(layer_type):
    """dots3's sliding layers override num_attention_heads in per_layer_config: 64 heads, the others 128. Read from
    the top-level key, every layer type was drawn with 128 (the ALiBi panels' slopes too)."""
    from transformers import AutoConfig

    hf_config = AutoConfig.for_model("dots3_note_text")
    layer = hf_config.layer_types.index(layer_type)
    figure = FigureConfig.from_mapping(hf_config.to_dict(), layer_type=layer_type)
    assert figure.num_heads == hf_config.per_layer_config[layer].num_attention_heads
    assert figure.head_dim == hf_config.per_layer_config[layer].qk_rope_head_dim


def test_a_model_folder_is_read_as_its_config_json(tmp_path):
    # As rope_from_config and the lab's --hf-config read it; the figures said the folder "does not exist".
    llama = {"model_type": "llama", "hidden_size": 256, "num_attention_heads": 4, "rope_theta": 5e5}
    (tmp_path / "config.json").write_text(json.dumps(llama))
    figure = FigureConfig.from_json(tmp_path)
    assert (figure.head_dim, figure.num_heads, figure.base) == (64, 4, 5e5)
    with pytest.raises(ValueError, match="does not exist; give a JSON file"):
        FigureConfig.from_json(tmp_path / "nothing")
    (tmp_path / "empty").mkdir()  # "does not exist" before, for a folder that does
    with pytest.raises(ValueError, match=r"config folder '.*empty' holds no config\.json; give a JSON file"):
        FigureConfig.from_json(tmp_path / "empty")
