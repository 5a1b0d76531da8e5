"""LabConfig validation, presets, overrides, and the rope_parameters of every extension."""

from __future__ import annotations

import dataclasses
import math
import re

import pytest
import torch

import posenc
from posenc.lab.config import EXTENSIONS, PRESETS, LabConfig, extension_rope_parameters, make_config
from posenc.rope.frequencies import default_inv_freq


@pytest.mark.parametrize("name", list(PRESETS))
def test_presets_are_valid_and_cover_every_encoding(name):
    config = PRESETS[name]
    assert set(config.encodings) == set(posenc.available())
    assert set(config.extensions) == set(EXTENSIONS)
    assert config.eval_lengths == tuple(config.train_len * f for f in (1, 2, 4, 8))
    assert config.extension_lengths == config.eval_lengths[1:]


def test_full_preset_has_three_seeds():
    assert PRESETS["full"].seeds == (0, 1, 2)
    assert make_config("full", seed=5).seeds == (5, 6, 7)


def test_train_len_override_keeps_the_multiples_and_halves_score_len():
    config = make_config("default", train_len=32)
    assert config.eval_lengths == (32, 64, 128, 256)
    assert config.score_len == 16
    explicit = make_config("default", train_len=32, eval_lengths=[32, 96], score_len=8)
    assert explicit.eval_lengths == (32, 96) and explicit.score_len == 8


def test_none_overrides_pass_through():
    assert make_config("quick", steps=None, lr=None) == PRESETS["quick"]


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"encodings": ("rope", "xpos")}, "unknown encodings: xpos"),
        ({"encodings": ()}, "encodings (--encodings) must name at least one"),
        ({"encodings": ("rope", "rope")}, "names something twice"),
        ({"extensions": ("pi", "longrope2")}, "unknown extensions: longrope2"),
        ({"encodings": ("alibi",)}, "add rope to encodings"),
        ({"eval_lengths": (16, 8)}, "eval length 8 is shorter than train_len=16"),
        ({"eval_lengths": (32, 16, 64)}, "eval_lengths (--eval-lengths) must be increasing without repeats"),
        # `--eval-lengths ,` was refused without naming its flag, as every other field's refusal does.
        ({"eval_lengths": ()}, "eval_lengths (--eval-lengths) must be a non-empty tuple"),
        ({"score_len": 17}, "score_len=17 (--score-len) must be <= train_len=16 (--train-len)"),
        ({"task": "needle"}, "unknown task 'needle'"),
        # Each sample is written into one eval window's text: 4 windows drew 4 samples where results.json said 8.
        (
            {"task": "passkey", "eval_windows": 4},
            "task_samples (--task-samples) is 8 but only eval_windows=4 (--eval-windows) give its samples' text",
        ),
        ({"steps": 0}, "steps (--steps) must be a positive integer"),
        ({"lr": -1.0}, "lr (--lr) must be a finite number > 0"),
        ({"lr": float("nan")}, "lr (--lr) must be a finite number > 0"),
        # A NaN grad_clip turned clipping off without a word; a NaN weight decay ended in "training diverged".
        ({"grad_clip": float("nan")}, "grad_clip must be a finite number >= 0, got nan"),
        ({"weight_decay": float("inf")}, "weight_decay must be a finite number >= 0, got inf"),
        ({"weight_decay": -0.1}, "weight_decay must be a finite number >= 0"),
        ({"dim": 30, "heads": 4}, "dim=30 (--dim) must be a multiple of heads=4 (--heads)"),
        ({"dim": 36, "heads": 4}, "even head_dim"),
        ({"dim": 9, "heads": 3, "encodings": ("sinusoidal",), "extensions": ()}, "dim=9 (--dim) must be even"),
        ({"val_fraction": 0.0}, "val_fraction must be > 0"),
        ({"warmup_fraction": 1.5}, "warmup_fraction must be a number in"),
        ({"finetune_steps": -1}, "finetune_steps (--finetune-steps) must be an integer >= 0"),
        ({"max_corpus_bytes": 0}, "max_corpus_bytes must be a positive integer"),
        # These trained every model, then failed with a traceback at the ntk unit / the second seed.
        ({"dim": 4, "heads": 2}, "extension ntk cannot extend the rope model's heads of dim / heads = 4 / 2 = 2"),
        ({"seed": 2**64 - 1, "num_seeds": 2}, "past the largest seed torch takes"),
    ],
)
def test_bad_values_name_the_field(overrides, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        make_config("quick", **overrides)


@pytest.mark.parametrize(
    "overrides",
    [
        {"dim": 32, "heads": 3},  # suggested dim=33: heads of 11 channels, which RoPE and sinusoidal refuse
        {"dim": 32, "heads": 3, "encodings": ("sinusoidal",), "extensions": ()},
        {"dim": 10, "heads": 4, "encodings": ("alibi",), "extensions": ()},
    ],
)
def test_a_dim_that_heads_do_not_divide_suggests_one_that_is_taken(overrides):
    with pytest.raises(ValueError, match=r"must be a multiple of heads") as refused:
        make_config("quick", **overrides)
    suggested = int(re.search(r"e\.g\. dim=(\d+)", str(refused.value))[1])
    assert make_config("quick", **{**overrides, "dim": suggested}).dim == suggested


def test_unknown_preset_and_unknown_field():
    with pytest.raises(ValueError, match="unknown preset 'huge'; known presets: quick, default, full"):
        make_config("huge")
    with pytest.raises(TypeError, match="unknown LabConfig field"):
        make_config("quick", num_layers=2)
    with pytest.raises(TypeError, match="encodings must be a tuple of names"):
        dataclasses.replace(PRESETS["quick"], encodings="rope")


def test_results_key_ignores_what_only_selects_units():
    base = PRESETS["default"]
    assert base.results_key() == make_config("default", encodings=("rope",), extensions=(), seed=3).results_key()
    assert base.results_key() != make_config("default", steps=7).results_key()


@pytest.mark.parametrize("name", list(EXTENSIONS))
@pytest.mark.parametrize("factor", [2, 4, 8])
def test_every_extension_builds_a_rope_module(name, factor):
    params = extension_rope_parameters(name, factor, 64)
    rope = posenc.RoPE(16, rope_parameters=params, max_position_embeddings=64)
    inv_freq, attention_factor = rope.frequencies(seq_len=64 * factor)
    default = default_inv_freq(16, 10000.0)
    assert inv_freq.shape == (8,)
    # Every extension slows (or keeps) every frequency: none rotates faster than the trained model.
    assert bool((inv_freq <= default * (1 + 1e-12)).all())
    if name == "pi":
        torch.testing.assert_close(inv_freq, default / factor, rtol=1e-12, atol=0)
    if name == "yarn":
        assert attention_factor == pytest.approx(0.1 * math.log(factor) + 1)
    else:
        assert attention_factor == 1.0


def test_dynamic_is_the_trained_rope_at_the_training_length():
    rope = posenc.RoPE(16, rope_parameters=extension_rope_parameters("dynamic", 4, 64), max_position_embeddings=64)
    torch.testing.assert_close(rope.frequencies(seq_len=64)[0], default_inv_freq(16, 10000.0), rtol=0, atol=0)


@pytest.mark.parametrize("scale", [2, 4, 8])
def test_dynamic_takes_no_target_and_is_hugging_faces_factor_2(scale):
    # factor 2 whatever the target: at s times the training length, HF's alpha = 2 * s - 1 scales the base by
    # alpha ** (d / (d - 2)). The target's own factor (4 for a 4x target) would make it 4 * s - 3.
    params = extension_rope_parameters("dynamic", 4, 64)
    assert params == extension_rope_parameters("dynamic", 8, 64) == {"rope_type": "dynamic", "factor": 2.0}
    rope = posenc.RoPE(16, rope_parameters=params, max_position_embeddings=64)
    expected = default_inv_freq(16, 10000.0 * (2 * scale - 1) ** (16 / 14))
    torch.testing.assert_close(rope.frequencies(seq_len=64 * scale)[0], expected, rtol=1e-12, atol=0)


@pytest.mark.parametrize("name", ["yarn", "llama3"])
def test_yarn_and_llama3_extend_from_the_training_length(name):
    # Their original length is train_len, not the target: pairs that turn less than once within the 64 trained
    # positions (pair 3 on, wavelength 199) are fully interpolated, the fastest pair is kept.
    params = extension_rope_parameters(name, 4, 64)
    assert params["original_max_position_embeddings"] == 64
    rope = posenc.RoPE(16, rope_parameters=params, max_position_embeddings=64)
    inv_freq, default = rope.frequencies(seq_len=256)[0], default_inv_freq(16, 10000.0)
    slow = 2 * math.pi / default > 64
    assert slow.tolist() == [False] * 3 + [True] * 5
    torch.testing.assert_close(inv_freq[slow], default[slow] / 4, rtol=1e-12, atol=0)
    assert inv_freq[0] == default[0]


def test_unknown_extension():
    with pytest.raises(ValueError, match="unknown extension 'rerope'"):
        extension_rope_parameters("rerope", 2, 64)


def test_config_is_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        PRESETS["quick"].steps = 3  # type: ignore[misc]
    assert isinstance(PRESETS["quick"], LabConfig)


def test_extensions_with_no_length_past_training_are_not_planned():
    from posenc.lab.runner import plan

    config = make_config("quick", eval_lengths=(16,))  # the quick preset trains at 16
    assert config.extensions and not config.extension_lengths
    assert [unit.name for unit in plan(config)] == list(config.encodings)
    assert make_config("quick", dim=4, heads=2, extensions=("pi", "yarn")).extensions == ("pi", "yarn")


def test_lab_help_lists_the_names_the_config_takes(monkeypatch, capsys):
    # The help text wrote the extensions, presets and tasks by hand: an extension added to EXTENSIONS, a family
    # added to the registry, or a preset or task added to the lab went unlisted (or, for --preset, refused).
    from posenc.cli import main
    from posenc.lab import config
    from posenc.registry import ENCODINGS

    monkeypatch.setitem(EXTENSIONS, "brand_new", EXTENSIONS["pi"])
    monkeypatch.setitem(ENCODINGS, "brand_new_family", ENCODINGS["nope"])
    monkeypatch.setitem(PRESETS, "tiny", PRESETS["quick"])
    monkeypatch.setattr(config, "TASKS", (*config.TASKS, "brand_new_task"))
    monkeypatch.setattr(config, "FINETUNABLE", (*config.FINETUNABLE, "brand_new"))
    monkeypatch.setenv("COLUMNS", "400")  # argparse breaks a long comma list inside a word
    with pytest.raises(SystemExit):
        main(["lab", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "{quick,default,full,tiny}" in text and "{copy,passkey,brand_new_task}" in text
    assert f"comma list of {','.join(EXTENSIONS)}, or none" in text and ",brand_new," in text
    assert "nope,rope,brand_new_family)" in text
    assert "fine-tune pi and yarn and brand_new, and plain rope" in text


def test_an_encoding_that_cannot_be_built_for_the_model_is_refused_by_the_config(monkeypatch):
    # Only rope's and sinusoidal's size rules were checked by name: a registered family with its own rule failed at
    # its unit, after the encodings before it had trained.
    from posenc.registry import ENCODINGS

    class WideHeads(posenc.NoPE):
        @classmethod
        def from_model_dims(cls, *, dim, num_heads, head_dim, max_positions, **options):
            if head_dim < 64:
                raise ValueError(f"head_dim must be >= 64, got {head_dim}")
            return cls()

    monkeypatch.setitem(ENCODINGS, "wide_heads", WideHeads)
    state = torch.random.get_rng_state()
    config = make_config(
        "quick", encodings=("learned", "t5"), extensions=()
    )  # builds both; the caller's random state stays
    assert torch.equal(torch.random.get_rng_state(), state) and config.encodings == ("learned", "t5")
    with pytest.raises(
        ValueError, match=r"encoding wide_heads cannot be built .*head_dim=16.*: head_dim must be >= 64"
    ):
        make_config("quick", encodings=("alibi", "wide_heads"), extensions=())

    class TypedHeads(posenc.NoPE):  # a family whose rule raises TypeError (a size of the wrong kind) is named too
        @classmethod
        def from_model_dims(cls, *, dim, num_heads, head_dim, max_positions, **options):
            raise TypeError("head_dim must be a power of two")

    monkeypatch.setitem(ENCODINGS, "typed_heads", TypedHeads)
    with pytest.raises(ValueError, match=r"encoding typed_heads cannot be built .*: head_dim must be a power of two"):
        make_config("quick", encodings=("typed_heads",), extensions=())


def test_lab_extensions_none_is_the_empty_list_only_alone():
    from posenc.cli import build_parser

    def extensions(text):
        return build_parser().parse_args(["lab", "--extensions", text]).extensions

    assert extensions("none") == () and extensions("pi, yarn") == ("pi", "yarn")
    # "none" among names is not "no extension": the config then refuses the unknown name instead of running none.
    assert extensions("pi,none") == ("pi", "none")
