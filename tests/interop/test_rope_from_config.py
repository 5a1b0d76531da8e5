"""rope_from_config against the models' own rotary code in transformers, for hand-written real configs.

For each fixture the same config.json feeds transformers' config class and rotary embedding (and the model's own
apply function: rotate_half, partial rotary, GPT-J's rotate_every_two, DeepSeek's interleave) and posenc's
``rope_from_config``; the rotated q and k must agree within transformers' float32 error, bounded per element by
(|x1| + |x2|) * attention_factor * (angle * (ln(base) + 9) * 2^-24 + 4 * 2^-24) + 4 * 2^-24 * |out| (its angle is
a float32 product of a float32 frequency; ours is taken in float64).
"""

from __future__ import annotations

import copy
import importlib
import importlib.util
import inspect
import json
import math
import re
import sys
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

from posenc import RoPE
from posenc.interop import hf as hf_interop
from posenc.interop import rope_from_config, rope_kwargs_from_config
from posenc.interop._discover import innermost
from posenc.rope.mrope import MRoPE

transformers = pytest.importorskip("transformers")

CONFIGS = Path(__file__).parents[1] / "fixtures" / "configs"
EPS32 = 2.0**-24

# model_type -> (modeling module, rotary class, config class)
HF_MODELS = {
    "llama": ("llama", "LlamaRotaryEmbedding", "LlamaConfig"),
    "qwen2": ("qwen2", "Qwen2RotaryEmbedding", "Qwen2Config"),
    "phi3": ("phi3", "Phi3RotaryEmbedding", "Phi3Config"),
    "gpt_neox": ("gpt_neox", "GPTNeoXRotaryEmbedding", "GPTNeoXConfig"),
    "deepseek_v3": ("deepseek_v3", "DeepseekV3RotaryEmbedding", "DeepseekV3Config"),
    "gptj": ("gptj", "GPTJRotaryEmbedding", "GPTJConfig"),
    "qwen2_vl": ("qwen2_vl", "Qwen2VLRotaryEmbedding", "Qwen2VLTextConfig"),
}


def load(name: str) -> dict[str, Any]:
    return json.loads((CONFIGS / name).read_text())


def hf_config(cfg: dict[str, Any]) -> Any:
    module, _, config_class = HF_MODELS[cfg["model_type"]]
    configs = importlib.import_module(f"transformers.models.{module}.configuration_{module}")
    return getattr(configs, config_class)(**{k: v for k, v in cfg.items() if k != "model_type"})


def hf_rotate(cfg: dict[str, Any], q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor):
    """transformers' rotation of q, k: (b, h, s, d) at positions (b, s) (or (3, b, s) for M-RoPE)."""
    model_type = cfg["model_type"]
    module, rotary_class, _ = HF_MODELS[model_type]
    modeling = importlib.import_module(f"transformers.models.{module}.modeling_{module}")
    rotary = getattr(modeling, rotary_class)(hf_config(cfg))
    if model_type == "gptj":  # (b, s, h, d) and sin first; only the first rotary_dim channels
        sin, cos = rotary(q, positions)
        r = cfg["rotary_dim"]
        out = []
        for x in (q.transpose(1, 2), k.transpose(1, 2)):
            rotated = modeling.apply_rotary_pos_emb(x[..., :r], sin, cos)
            out.append(torch.cat((rotated, x[..., r:]), dim=-1).transpose(1, 2))
        return tuple(out)
    cos, sin = rotary(q, positions)
    if model_type == "deepseek_v3":
        return modeling.apply_rotary_pos_emb_interleave(q, k, cos, sin)
    return modeling.apply_rotary_pos_emb(q, k, cos, sin)


def bound(rope: RoPE, x: torch.Tensor, out: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Per-element bound on |ours - transformers'| for x: (b, h, s, d) rotated at positions: (b, s)."""
    inv, factor = rope.frequencies(int(positions.max()) + 1)
    angles = positions[:, None, :, None].double() * inv  # (b, 1, s, r/2)
    per_pair = factor * (angles * (math.log(rope.base) + 9) * EPS32 + 4 * EPS32)
    half = rope.rotary_dim // 2
    if rope.interleaved:
        pair_abs = x[..., 0 : 2 * half : 2].abs() + x[..., 1 : 2 * half : 2].abs()
        pair = (pair_abs * per_pair).repeat_interleave(2, dim=-1)
    else:
        pair_abs = x[..., :half].abs() + x[..., half : 2 * half].abs()
        pair = torch.cat((pair_abs * per_pair, pair_abs * per_pair), dim=-1)
    pair = torch.cat((pair, torch.zeros_like(x[..., 2 * half :])), dim=-1)
    return pair + 4 * EPS32 * (out.abs() + x.abs())


def reinterleave(x: torch.Tensor, rotary_dim: int) -> torch.Tensor:
    """DeepSeek stores rotated pairs as (evens, odds); posenc keeps them in place: put them back in place."""
    out = x.clone()
    out[..., 0:rotary_dim:2], out[..., 1:rotary_dim:2] = x[..., : rotary_dim // 2], x[..., rotary_dim // 2 : rotary_dim]
    return out


FIXTURES = sorted(p.name for p in CONFIGS.glob("*.json"))


@pytest.mark.parametrize("name", FIXTURES)
def test_rotates_exactly_as_the_model(name: str) -> None:
    cfg = load(name)
    rope = rope_from_config(CONFIGS / name)
    max_pos = cfg.get("max_position_embeddings", cfg.get("n_positions"))
    gen = torch.Generator().manual_seed(0)
    # a call that stays inside the original length, then one that passes it (LongRoPE switches to long factors)
    for positions in (torch.tensor([[0, 1, 2, 3, 217, 423, 2047]]), torch.tensor([[0, 7, 2047, 4096, max_pos - 1]])):
        positions = positions.clamp(max=max_pos - 1)
        s = positions.shape[1]
        q = torch.randn(1, 3, s, rope.head_dim, generator=gen)
        k = torch.randn(1, 3, s, rope.head_dim, generator=gen)
        hf_positions = positions
        if isinstance(rope, MRoPE):  # three different axes, or the sections would not matter
            hf_positions = torch.stack((positions, positions // 3 + 5, positions % 7 + 100))
        hf_q, hf_k = hf_rotate(cfg, q, k, hf_positions)
        our_q, our_k = rope(q, k, positions=hf_positions)
        largest = hf_positions.amax(0) if isinstance(rope, MRoPE) else positions  # the error grows with the angle
        for ours, theirs, x in ((our_q, hf_q, q), (our_k, hf_k, k)):
            if cfg["model_type"] == "deepseek_v3":
                theirs = reinterleave(theirs, rope.rotary_dim)
            excess = (ours - theirs).abs() - bound(rope, x, theirs, largest)
            assert excess.max() <= 0, f"{name}: max excess {excess.max():.3g}"


EXPECTED = {
    "llama-3.1-8b.json": dict(head_dim=128, rotary_dim=128, base=500000.0, rope_type="llama3", interleaved=False),
    "llama-3.1-8b-new-form.json": dict(head_dim=128, rotary_dim=128, base=500000.0, rope_type="llama3"),
    "qwen2.5-7b-instruct-yarn.json": dict(head_dim=128, rotary_dim=128, base=1e6, rope_type="yarn"),
    "phi-3-mini-128k-instruct.json": dict(head_dim=96, rotary_dim=96, rope_type="longrope"),
    "deepseek-v3.json": dict(head_dim=64, rotary_dim=64, rope_type="yarn", interleaved=True),
    "gpt-neox-20b.json": dict(head_dim=96, rotary_dim=24, base=10000.0, interleaved=False),
    "gpt-j-6b.json": dict(head_dim=256, rotary_dim=64, interleaved=True),
    "qwen2-vl-7b-instruct.json": dict(head_dim=128, rotary_dim=128, rope_type="default", mrope_section=(16, 24, 24)),
}


@pytest.mark.parametrize("name", FIXTURES)
def test_reads_dims_type_and_layout(name: str) -> None:
    rope = rope_from_config(CONFIGS / name)
    for attr, value in EXPECTED[name].items():
        assert getattr(rope, attr) == value, (name, attr)


def test_known_numbers_of_real_models() -> None:
    phi3 = rope_from_config(CONFIGS / "phi-3-mini-128k-instruct.json")
    # factor = 131072 / 4096 = 32 (top-level original length), attention factor sqrt(1 + ln 32 / ln 4096)
    assert phi3.frequencies()[1] == pytest.approx(math.sqrt(1 + math.log(32) / math.log(4096)), abs=1e-12)
    deepseek = rope_from_config(CONFIGS / "deepseek-v3.json")
    assert deepseek.frequencies()[1] == 1.0  # mscale == mscale_all_dim: the ratio is 1
    qwen = rope_from_config(CONFIGS / "qwen2.5-7b-instruct-yarn.json")
    assert qwen.frequencies()[1] == pytest.approx(0.1 * math.log(4.0) + 1, abs=1e-12)


@pytest.mark.parametrize("name", ["llama-3.1-8b.json", "qwen2.5-7b-instruct-yarn.json", "gpt-neox-20b.json"])
@pytest.mark.usefixtures("dict_reading")
def test_path_dict_folder_and_config_object_agree(name: str, tmp_path: Path) -> None:
    cfg = load(name)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    specs = [
        rope_from_config(source).spec for source in (CONFIGS / name, str(CONFIGS / name), cfg, tmp_path, hf_config(cfg))
    ]
    assert all(spec == specs[0] for spec in specs)


def test_old_and_new_forms_agree() -> None:
    old = rope_from_config(CONFIGS / "llama-3.1-8b.json")
    new = rope_from_config(CONFIGS / "llama-3.1-8b-new-form.json")
    assert old.spec == new.spec


@pytest.fixture(params=["through its config class", "as a plain dict"])
def dict_reading(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Both ways a dict is read: through transformers' config class (where installed), and by posenc's own tables
    (without transformers, or where the class refuses the dict)."""
    if request.param == "as a plain dict":
        monkeypatch.setattr(hf_interop, "_through_config_class", lambda cfg: None)
    return request.param


@pytest.mark.usefixtures("dict_reading")
def test_legacy_spellings() -> None:
    base = {"hidden_size": 64, "num_attention_heads": 2, "max_position_embeddings": 128}
    su = {
        **base,
        "model_type": "phi3",
        "rope_scaling": {"type": "su", "short_factor": [1.0] * 16, "long_factor": [2.0] * 16},
    }
    assert rope_from_config(su).rope_type == "longrope"
    phi_yarn = {**su, "rope_scaling": {**su["rope_scaling"], "type": "yarn"}}
    assert rope_from_config(phi_yarn).rope_type == "longrope"  # Phi3Config's mapping
    partial = {**base, "partial_rotary_factor": 0.5, "rope_theta": 500.0}
    rope = rope_from_config(partial)
    assert (rope.rotary_dim, rope.base) == (16, 500.0)
    assert rope_from_config({**base, "head_dim": 16}).head_dim == 16


@pytest.mark.usefixtures("dict_reading")
def test_raw_configs_read_as_transformers_reads_them() -> None:
    """Found by fuzzing against transformers: a raw Phi-3 dict without a top-level original length takes Phi3Config's
    default 4096 (not the rope dict's 2048); YaRN's truncate: null means no truncation (HF tests its truth); GPT-J's
    fixed table has base 10000 whatever rope_theta says."""
    from transformers.models.phi3 import configuration_phi3, modeling_phi3

    phi3 = {
        "model_type": "phi3",
        "hidden_size": 64,
        "num_attention_heads": 2,
        "max_position_embeddings": 8192,
        "rope_scaling": {
            "type": "longrope",
            "short_factor": [1.0] * 16,
            "long_factor": [3.0] * 16,
            "original_max_position_embeddings": 2048,
            "factor": 4.0,
        },
    }
    hf = modeling_phi3.Phi3RotaryEmbedding(configuration_phi3.Phi3Config(**phi3))
    inv_freq, factor = rope_from_config(phi3).frequencies(3000)
    assert math.isclose(factor, hf.attention_scaling, rel_tol=1e-12)
    torch.testing.assert_close(inv_freq, hf.inv_freq.double(), rtol=1e-6, atol=0)  # short factors at 3000 < 4096

    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024, "rope_theta": 1e4}
    untruncated = RoPE(64, rope_parameters={**yarn, "truncate": False}).frequencies()[0]
    torch.testing.assert_close(RoPE(64, rope_parameters={**yarn, "truncate": None}).frequencies()[0], untruncated)
    RoPE(64, rope_parameters={"rope_type": "linear", "factor": 2.0, "truncate": None})  # null elsewhere: absent
    gptj = {"model_type": "gptj", "n_embd": 64, "n_head": 2, "rotary_dim": 16, "rope_theta": 5e5}
    assert rope_from_config(gptj).base == 10000.0
    # GPTNeoXConfig reads rotary_emb_base and rotary_pct, not a top-level rope_theta / partial_rotary_factor.
    neox = {"model_type": "gpt_neox", "hidden_size": 128, "num_attention_heads": 2, "rope_theta": 5e5}
    neox_rope = rope_from_config({**neox, "partial_rotary_factor": 0.5})
    assert (neox_rope.base, neox_rope.rotary_dim) == (10000.0, 16)
    neox_rope = rope_from_config({**neox, "rotary_emb_base": 500.0, "rotary_pct": 0.5})
    assert (neox_rope.base, neox_rope.rotary_dim) == (500.0, 32)


@pytest.mark.usefixtures("dict_reading")
def test_deepseek_v3_pairs_adjacent_channels_unless_its_config_says_not() -> None:
    """DeepseekV3Config defaults rope_interleave to True; its config.json does not spell it out."""
    cfg = load("deepseek-v3.json")
    assert "rope_interleave" not in cfg and transformers.DeepseekV3Config().rope_interleave is True
    assert rope_from_config(cfg).interleaved
    assert not rope_from_config({**cfg, "rope_interleave": False}).interleaved


def _llama_trained_at_2048(rope_parameters: dict[str, Any]) -> dict[str, Any]:
    """A Llama config.json with the original (trained) length at the top level, as Phi-3 keeps it, beside 8192."""
    return {
        "model_type": "llama",
        "hidden_size": 128,
        "num_attention_heads": 2,
        "max_position_embeddings": 8192,
        "original_max_position_embeddings": 2048,
        "rope_parameters": rope_parameters,
    }


@pytest.mark.usefixtures("dict_reading")
@pytest.mark.parametrize("rope_type", ["yarn", "llama3"])
def test_kwargs_take_a_top_level_original_length_for_every_type_that_reads_one(rope_type: str) -> None:
    raw = _llama_trained_at_2048({"rope_type": rope_type, "factor": 4.0, "original_max_position_embeddings": 1024})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        kwargs = rope_kwargs_from_config(raw)
    assert kwargs["rope_parameters"]["original_max_position_embeddings"] == 2048


@pytest.mark.usefixtures("dict_reading")
def test_a_new_type_that_reads_the_original_length_takes_the_top_level_one(monkeypatch) -> None:
    # hf.py kept its own list of the types that read it (llama3, yarn, longrope): a type added to posenc's tables
    # scaled from max_position_embeddings (8192) instead of the config's original length (2048), without a word.
    from posenc.rope import frequencies, parameters

    monkeypatch.setitem(frequencies.SCALINGS, "brand_new", frequencies.yarn)
    monkeypatch.setitem(parameters.REQUIRED_KEYS, "brand_new", frozenset({"factor"}))
    monkeypatch.setitem(parameters.OPTIONAL_KEYS, "brand_new", frozenset({"original_max_position_embeddings"}))
    monkeypatch.setattr(parameters, "_NEEDS_ORIGINAL", parameters._NEEDS_ORIGINAL | {"brand_new"})
    raw = _llama_trained_at_2048({"rope_type": "brand_new", "factor": 4.0})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # transformers: no validation function for 'brand_new'
        rope = rope_from_config(raw)
    assert rope.spec.params["original_max_position_embeddings"] == 2048


def test_mode_passes_through() -> None:
    rope = rope_from_config(CONFIGS / "phi-3-mini-128k-instruct.json", mode="consistent")
    assert rope.mode == "consistent" and rope.rotates_cached_keys


def test_per_layer_rope_dicts_need_a_layer_type() -> None:
    cfg = {
        "hidden_size": 64,
        "num_attention_heads": 2,
        "layer_types": ["sliding_attention", "full_attention"],
        "rope_parameters": {
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
        },
    }
    with pytest.raises(ValueError, match=re.escape("pass layer_type= one of ['sliding_attention', 'full_attention']")):
        rope_from_config(cfg)
    assert rope_from_config(cfg, layer_type="full_attention").rope_type == "linear"
    with pytest.raises(ValueError, match="the config has a single rope dict; drop layer_type"):
        rope_from_config(load("llama-3.1-8b.json"), layer_type="full_attention")


def test_a_null_rope_type_is_read_where_the_model_reads_no_rope_dict() -> None:
    """GPT-J and CodeGen build a fixed table whatever the dict says, and their models run with a null rope_type."""
    gptj = {"model_type": "gptj", "n_embd": 64, "n_head": 4, "rotary_dim": 8, "n_positions": 64}
    rope = rope_from_config({**gptj, "rope_parameters": {"rope_type": None, "rope_theta": 1e4}})
    assert (rope.rope_type, rope.spec.rotary_dim, rope.interleaved) == ("default", 8, True)


def test_rope_dicts_per_layer_type_whose_layers_are_not_named_are_refused() -> None:
    """Read as one dict, the layer types' dicts were dropped as unread keys: a default RoPE at theta 10000."""
    per_type = {
        "full_attention": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e6},
        "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
    }
    cfg = {"hidden_size": 64, "num_attention_heads": 4, "max_position_embeddings": 32, "rope_parameters": per_type}
    with pytest.raises(ValueError, match="holds dicts under 'full_attention', 'sliding_attention', rope dicts per"):
        rope_from_config(cfg)
    # A string's letters named no layer type either.
    with pytest.raises(TypeError, match=r"layer_types must be a list with one layer type per layer .* got 'full_"):
        rope_from_config({**cfg, "layer_types": "full_attention"}, layer_type="full_attention")
    named = {**cfg, "layer_types": ["sliding_attention", "full_attention"]}
    assert rope_from_config(named, layer_type="full_attention").rope_type == "yarn"
    bad = {**named, "rope_parameters": {**per_type, "full_attention": "default"}}
    with pytest.raises(TypeError, match=r"rope dict for layer type 'full_attention' must be a dict like .* got 'def"):
        rope_from_config(bad, layer_type="full_attention")


@pytest.mark.parametrize(
    ("config", "error", "match"),
    [
        (42, TypeError, "config must be a transformers config object, a dict, or a path"),
        (
            {"head_dim": 8, "rope_scaling": {"type": "dynamic", "factor": 2.0}},
            ValueError,
            "this config has no max_position_embeddings; add it to the config",
        ),
        (
            {"model_type": "llama", "head_dim": 8, "rope_parameters": {"rope_type": None, "type": "linear"}},
            ValueError,
            "rope_type null, which transformers' model fails on (KeyError: None); set rope_type to 'linear'",
        ),
        ("/nonexistent/config.json", FileNotFoundError, "is neither"),
        ({"num_attention_heads": 2}, ValueError, "config needs head_dim, or hidden_size and num_attention_heads"),
        ({"head_dim": 8, "rope_scaling": [1, 2]}, TypeError, "rope_parameters / rope_scaling must be a dict"),
        ({"head_dim": 8, "rope_scaling": {"type": "magic"}}, ValueError, "unknown rope_type 'magic'"),
        (
            {"head_dim": 8, "rope_parameters": {"mrope_section": [1, 1, 1, 1], "mrope_interleaved": True}},
            ValueError,
            "interleaved M-RoPE takes 3 sections (t, h, w), got mrope_section [1, 1, 1, 1]",
        ),
        # transformers fails on these deep in its rotary class; the model type's default is not what they say.
        (
            {"model_type": "qwen3_vl_text", "head_dim": 128, "rope_parameters": {"mrope_section": []}},
            ValueError,
            "rope_parameters['mrope_section'] is []: give the pairs per axis (t, h, w), e.g. [24, 20, 20]",
        ),
        (
            {"model_type": "qwen2_vl_text", "head_dim": 8, "rope_parameters": {"mrope_section": None}},
            ValueError,
            "rope_parameters['mrope_section'] is None: give the pairs per axis",
        ),
        # Not a list: a bare "'int' object is not iterable" from list() before; a string was split into characters.
        *(
            (
                {"model_type": model_type, "head_dim": 16, "rope_parameters": {"mrope_section": section}},
                TypeError,
                f"rope_parameters['mrope_section'] must be a list of frequency pairs per axis, e.g. [16, 24, 24], got "
                f"{section!r}",
            )
            for model_type, section in (("qwen2_vl_text", 8), ("qwen2_vl_text", "2,3,3"), ("llama", 8), ("llama", 0))
        ),
        # A model type posenc does not know, interleaving M-RoPE axes with no sections: plain RoPE before.
        (
            {
                "model_type": "my_vl",
                "head_dim": 16,
                "rope_parameters": {"mrope_section": [], "mrope_interleaved": True},
            },
            ValueError,
            "rope_parameters['mrope_section'] is []: give the pairs per axis (t, h, w), e.g. [16, 24, 24]",
        ),
        # float() read these, and bool() the string "false" as true (laying the axes out interleaved).
        ({"head_dim": 8, "rope_theta": "10000"}, ValueError, "the config's rope_theta must be a number, got '10000'"),
        ({"head_dim": 8, "rope_theta": True}, ValueError, "the config's rope_theta must be a number, got True"),
        (
            {"head_dim": 8, "rope_parameters": {"mrope_section": [1, 1, 2], "mrope_interleaved": "false"}},
            TypeError,
            "rope_parameters['mrope_interleaved'] must be true or false, got 'false'",
        ),
        # ERNIE-4.5-VL's sections are in the order h, w, t: the example must not be read as t, h, w.
        (
            {"model_type": "ernie4_5_vl_moe_text", "head_dim": 128, "rope_parameters": {"mrope_section": []}},
            ValueError,
            "is []: give the pairs per axis (h, w, t), e.g. [22, 22, 20], or leave the key out for the default of "
            "model_type 'ernie4_5_vl_moe_text'",
        ),
    ],
)
def test_bad_configs(config: Any, error: type, match: str) -> None:
    with pytest.raises(error, match=re.escape(match)):
        rope_from_config(config)


def test_kwargs_are_the_constructor_arguments() -> None:
    kwargs = rope_kwargs_from_config(CONFIGS / "gpt-j-6b.json")
    assert kwargs == {
        "head_dim": 256,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
        "max_position_embeddings": 2048,
        "interleaved": True,
        "rotary_dim": 64,
    }


# Readers and non-readers of partial_rotary_factor in their default RoPE, the latter including ones a fuzzer found
# misread by an allow-list of non-readers (dbrx, jetmoe, vaultgemma, zamba2, lfm2, cohere2_moe, granitemoehybrid).
DEFAULT_RULE_SAMPLE = [
    *("gpt_neox", "glm", "glm4", "nemotron", "persimmon", "phi", "phi3", "qwen3_next", "stablelm", "bamba"),
    *("llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "olmo2", "starcoder2", "cohere"),
    *("dbrx", "jetmoe", "vaultgemma", "zamba2", "lfm2", "cohere2_moe", "granitemoehybrid"),
]


def test_the_table_of_default_rope_readers_is_the_installed_transformers():
    """Where transformers is missing the table decides; it must say what every rotary class of the installed one
    does (read from its compute_default_rope_parameters, as rope_kwargs_from_config asks when it is present)."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    readers = set()
    for model_type in CONFIG_MAPPING_NAMES:
        source = hf_interop._default_rope_source(model_type)
        if source is not None and "partial_rotary_factor" in source:
            readers.add(model_type)
    assert readers == hf_interop._DEFAULT_READS_PARTIAL


@pytest.mark.parametrize("model_type", DEFAULT_RULE_SAMPLE)
def test_default_rope_reads_partial_rotary_factor_as_the_model_does(model_type: str) -> None:
    # The model's own rotary class built from a config with partial_rotary_factor=0.5 and head_dim 16 has 8
    # frequencies (whole head) or 4; posenc's with and without transformers to ask.
    from transformers.models.auto.configuration_auto import model_type_to_module_name

    rope_parameters = {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5}
    config = transformers.AutoConfig.for_model(
        model_type,
        hidden_size=64,
        num_attention_heads=4,
        num_key_value_heads=4,
        head_dim=16,
        rope_parameters=rope_parameters,
    ).get_text_config()
    module = model_type_to_module_name(model_type)
    modeling = importlib.import_module(f"transformers.models.{module}.modeling_{module}")
    rotary = [
        cls
        for name, cls in vars(modeling).items()
        if name.endswith("RotaryEmbedding") and hasattr(cls, "compute_default_rope_parameters")
    ]
    assert len(rotary) == 1, rotary
    hf = rotary[0](config)
    assert hf.inv_freq.numel() == (4 if model_type in hf_interop._DEFAULT_READS_PARTIAL else 8)
    ours, factor = rope_from_config(config).frequencies()
    hf_interop._default_reads_partial.cache_clear()
    try:
        with pytest.MonkeyPatch.context() as no_transformers:
            no_transformers.setattr(hf_interop, "_default_rope_source", lambda model_type: None)
            from_table, _ = rope_from_config(config).frequencies()
    finally:
        hf_interop._default_reads_partial.cache_clear()
    torch.testing.assert_close(from_table, ours, rtol=0, atol=0)
    torch.testing.assert_close(ours, hf.inv_freq.double(), rtol=1e-6, atol=0)
    assert factor == hf.attention_scaling


# The rotation functions of a modeling module, as the models call them: apply_rotary_pos_emb, else the complex
# form (Llama 4, DeepSeek-V2), else the MLA models' evens-then-odds variant (DeepSeek-V3 has both: its config's
# rope_interleave decides, and rope_kwargs_from_config reads it).
ROTATION_ENTRIES = ("apply_rotary_pos_emb", "apply_rotary_emb", "apply_rotary_pos_emb_interleave")
ROTATION_HELPERS = ("rotate_half", "_apply_rotary_emb", "rotate_every_two", "stack_freqs")


def pair_layout_in_source(model_type: str) -> str | None:
    """'adjacent', 'split', 'negated' (rotation by -angle) or None (no text rotation function), read from the
    model's modeling code: which channels its rotate_half (or the like) pairs, and with which sign."""
    from transformers.models.auto.configuration_auto import model_type_to_module_name

    try:
        module = model_type_to_module_name(model_type)
        modeling = importlib.import_module(f"transformers.models.{module}.modeling_{module}")
    except Exception:  # a modeling module that needs an optional package
        return None
    # Under the module that the kernels package makes of apply_rotary_pos_emb (transformers >= 5.25) too.
    unwrapped = {name: innermost(f) for name, f in vars(modeling).items() if callable(f)}
    functions = {
        name: f for name, f in unwrapped.items() if inspect.isfunction(f) and f.__module__ == modeling.__name__
    }
    entry = next((name for name in ROTATION_ENTRIES if name in functions), None)
    if entry is None:
        return None
    source = inspect.getsource(functions[entry])
    # The helpers it calls: rotate_half, and its renamed copies (GLM-4V's rotate_half_llm, ERNIE-VL's rotate_half_text).
    helpers = [h for h in functions if h in ROTATION_HELPERS or re.fullmatch(r"rotate_half\w*", h)]
    source += "".join(inspect.getsource(functions[h]) for h in helpers if re.search(rf"\b{h}\(", source))
    code = re.sub(r'r?"""[\s\S]*?"""', "", source)
    code = "".join(line for line in code.splitlines() if not line.strip().startswith("#")).replace(" ", "")
    if "torch.cat((x2,-x1)" in code:
        return "negated"
    if any(mark in code for mark in ("::2]", "rotate_every_two", "view_as_complex", "-1,2)", "-1,1,2)")):
        return "adjacent"
    return "split"


def test_the_table_of_adjacent_pair_models_is_the_installed_transformers():
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    layouts = {model_type: pair_layout_in_source(model_type) for model_type in CONFIG_MAPPING_NAMES}
    assert {t for t, layout in layouts.items() if layout == "adjacent"} == hf_interop._INTERLEAVED_MODELS
    assert {t for t, layout in layouts.items() if layout == "negated"} <= set(hf_interop._UNSUPPORTED_MODELS)
    assert sum(layout == "split" for layout in layouts.values()) > 200  # the classifier reads what it should
    # docs/scaling.md says how many; it said 40 for a while after the table grew to 49.
    docs = (Path(__file__).parents[2] / "docs" / "scaling.md").read_text()
    assert f"adjacent pairs for the {len(hf_interop._INTERLEAVED_MODELS)} model types" in " ".join(docs.split())


# Built from each model's own config class with small sizes; rotated by its own rotary class and apply function.
ADJACENT_SAMPLE = [
    *("cohere", "cohere2", "glm", "glm4", "helium", "ernie4_5", "moonshine", "openai_privacy_filter"),
    *("llama4_text", "longcat_flash", "glm_moe_dsa", "bailing_hybrid"),
]


@pytest.mark.parametrize("model_type", [*ADJACENT_SAMPLE, "gpt_oss", "llama"])
def test_rotates_as_models_of_either_pair_layout(model_type: str) -> None:
    from transformers.models.auto.configuration_auto import model_type_to_module_name

    sizes = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=4, head_dim=16, qk_rope_head_dim=16)
    config = transformers.AutoConfig.for_model(model_type, **sizes).get_text_config()
    module = model_type_to_module_name(model_type)
    modeling = importlib.import_module(f"transformers.models.{module}.modeling_{module}")
    (rotary_class,) = [
        cls
        for name, cls in vars(modeling).items()
        if name.endswith("RotaryEmbedding") and "Vision" not in name and cls.__module__ == modeling.__name__
    ]
    gen = torch.Generator().manual_seed(0)
    positions = torch.tensor([[0, 1, 2, 3, 217, 423, 1000]])
    q, k = torch.randn(2, 1, 4, 7, 16, generator=gen)
    angles = rotary_class(config)(q, positions)
    if hasattr(modeling, "apply_rotary_pos_emb"):
        theirs = modeling.apply_rotary_pos_emb(q, k, *angles)
    elif hasattr(modeling, "apply_rotary_pos_emb_interleave"):
        theirs = modeling.apply_rotary_pos_emb_interleave(q, k, *angles)
    else:  # Llama 4: (b, s, h, d) and complex frequencies
        theirs = [x.transpose(1, 2) for x in modeling.apply_rotary_emb(q.transpose(1, 2), k.transpose(1, 2), angles)]
    rope = rope_from_config(config)
    assert rope.interleaved == (model_type in ADJACENT_SAMPLE)
    for ours, hf, x in zip(rope(q, k, positions=positions), theirs, (q, k), strict=True):
        if hasattr(modeling, "apply_rotary_pos_emb_interleave") and not hasattr(modeling, "apply_rotary_pos_emb"):
            hf = reinterleave(hf, rope.rotary_dim)
        excess = (ours - hf).abs() - bound(rope, x, hf, positions)
        assert excess.max() <= 0, f"{model_type}: max excess {excess.max():.3g}"


def test_llama4_scouts_equal_llama3_factors_rotate_as_the_model_does() -> None:
    """Llama 4 Scout's config.json scales with llama3 at low_freq_factor = high_freq_factor = 1 (no band: a step at
    wavelength 8192), which transformers takes with a warning. It was refused ("low_freq_factor must be <
    high_freq_factor"), so posenc could not read or patch the model."""
    from transformers.models.llama4 import modeling_llama4

    scout = {"rope_type": "llama3", "factor": 16.0, "low_freq_factor": 1.0, "high_freq_factor": 1.0}
    cfg = {
        "model_type": "llama4_text",
        **dict(hidden_size=256, num_attention_heads=2, num_key_value_heads=1, head_dim=128),
        "max_position_embeddings": 10485760,
        "rope_theta": 500000.0,
        "rope_scaling": {**scout, "original_max_position_embeddings": 8192},
    }
    config = transformers.AutoConfig.for_model(**cfg)
    rope = rope_from_config(config)
    assert (rope.rope_type, rope.interleaved, rope.rotary_dim) == ("llama3", True, 128)
    inv, _ = rope.frequencies()
    plain = 1.0 / 500000.0 ** (torch.arange(0, 128, 2, dtype=torch.float64) / 128)
    step = 2 * math.pi / plain >= 8192
    assert 0 < int(step.sum()) < 64  # the step falls inside the head
    torch.testing.assert_close(inv, torch.where(step, plain / 16, plain), rtol=1e-15, atol=0.0)

    gen = torch.Generator().manual_seed(0)
    positions = torch.tensor([[0, 1, 7, 8191, 8192, 40000, 131071]])
    q, k = torch.randn(2, 1, 2, 7, 128, generator=gen)
    angles = modeling_llama4.Llama4TextRotaryEmbedding(config)(q, positions)
    theirs = [x.transpose(1, 2) for x in modeling_llama4.apply_rotary_emb(q.transpose(1, 2), k.transpose(1, 2), angles)]
    for ours, hf, x in zip(rope(q, k, positions=positions), theirs, (q, k), strict=True):
        excess = (ours - hf).abs() - bound(rope, x, hf, positions)
        assert excess.max() <= 0, f"max excess {excess.max():.3g}"


@pytest.mark.parametrize(
    ("model_type", "match"),
    [
        ("nanochat", "negative angle"),
        ("deepseek_v4", "last qk_rope_head_dim channels"),
        ("hy_v4_vl", "multimodal RoPE on adjacent pairs"),
    ],
)
def test_rotations_posenc_cannot_do_are_refused(model_type: str, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        rope_from_config(transformers.AutoConfig.for_model(model_type))


@pytest.mark.parametrize(
    ("model_type", "options", "match"),
    [
        *((name, {}, f"model_type '{name}' has no rotary") for name in ("bert", "gpt2", "bloom", "t5", "opt")),
        ("data2vec-text", {}, "model_type 'data2vec-text' has no rotary"),  # its code: modeling_data2vec_text.py
        ("falcon", {"alibi": True}, "alibi=True: .* its encoding is ALiBi"),
        ("esm", {"position_embedding_type": "absolute"}, "position_embedding_type='absolute'"),
        ("granitemoehybrid", {"position_embedding_type": "nope"}, "position_embedding_type='nope'"),
    ],
)
def test_a_model_that_does_not_rotate_has_no_rope_to_read(model_type: str, options: dict, match: str) -> None:
    # These gave a default RoPE of the config's head size, a silent wrong answer for a model without one.
    with pytest.raises(ValueError, match=match):
        rope_from_config(transformers.AutoConfig.for_model(model_type, **options))


def test_a_model_type_transformers_does_not_know_is_read_with_a_warning() -> None:
    chatglm = {"model_type": "chatglm", "hidden_size": 4096, "num_attention_heads": 32}  # remote code
    with pytest.warns(UserWarning, match="'chatglm' is not one the installed transformers knows .* check them"):
        assert rope_from_config(chatglm).rotary_dim == 128
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a config without a model type is taken as given
        rope_from_config({"hidden_size": 4096, "num_attention_heads": 32})
        rope_from_config(transformers.AutoConfig.for_model("falcon"))  # Falcon with RoPE, as by default


def test_without_transformers_a_model_type_is_read_without_a_warning(monkeypatch: pytest.MonkeyPatch) -> None:
    # transformers is optional: without it every model type was 'not one the installed transformers knows'.
    from posenc.interop import hf

    monkeypatch.setitem(sys.modules, "transformers.models.auto.configuration_auto", None)  # import fails
    hf._transformers_rotates.cache_clear()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            assert hf._transformers_rotates("llama") is True
            rope_from_config({"model_type": "llama", "hidden_size": 64, "num_attention_heads": 4})
            # Phi3Config's default original length, which it gives a raw dict without a top-level one, is known
            # without the class too (test_raw_configs_read_as_transformers_reads_them: with it).
            long = {"type": "longrope", "short_factor": [1.0] * 16, "long_factor": [3.0] * 16, "factor": 4.0}
            phi3 = {"model_type": "phi3", "hidden_size": 64, "num_attention_heads": 2, "max_position_embeddings": 8192}
            phi3["rope_scaling"] = {**long, "original_max_position_embeddings": 2048}
            assert rope_from_config(phi3).spec.params["original_max_position_embeddings"] == 4096
    finally:
        hf._transformers_rotates.cache_clear()


@pytest.mark.parametrize(
    ("rope", "unused"),
    [
        # Yarn-Llama-2's config.json
        ({"type": "yarn", "factor": 16.0, "original_max_position_embeddings": 4096, "finetuned": True}, "finetuned"),
        # 'dynamic' scales from max_position_embeddings; transformers never reads the original length there
        ({"rope_type": "dynamic", "factor": 2.0, "original_max_position_embeddings": 1024}, "original_max_position"),
    ],
)
# Yarn-Llama-2's factor 16 on a 2048-position config: the mismatch warning is expected here.
@pytest.mark.filterwarnings(r"ignore:rope_parameters\['factor'\]=.* differs from max_position_embeddings")
def test_keys_the_type_does_not_read_are_ignored_as_transformers_does(rope, unused):
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    cfg = {"model_type": "llama", "hidden_size": 64, "num_attention_heads": 4, "max_position_embeddings": 2048}
    cfg |= {"rope_scaling" if "type" in rope else "rope_parameters": rope, "rope_theta": 10000.0}
    with pytest.warns(UserWarning, match=f"key\\(s\\) {unused}.* ignored, as transformers ignores them"):
        ours, factor = rope_from_config(cfg).frequencies(4096)
    config = transformers.LlamaConfig(**{k: v for k, v in cfg.items() if k != "model_type"})
    theirs, attention = ROPE_INIT_FUNCTIONS[config.rope_parameters["rope_type"]](config, None, seq_len=4096)
    torch.testing.assert_close(ours, theirs.double(), rtol=1e-6, atol=0)
    assert factor == pytest.approx(attention, rel=1e-12)
    with pytest.raises(ValueError, match=unused):  # given by hand, the same key is refused as a likely typo
        RoPE(16, rope_parameters={"rope_theta": 10000.0, **rope}, max_position_embeddings=2048)


@pytest.mark.parametrize(("layer_type", "theta"), [("sliding_attention", 10000.0), ("full_attention", 1000000.0)])
def test_config_objects_with_a_theta_per_layer_type(layer_type: str, theta: float) -> None:
    """Gemma 3's config object keeps default_theta as a dict per kind of layer (global / local); it once failed in
    float(). A layer dict without rope_theta takes its kind's."""
    config = transformers.AutoConfig.for_model("gemma3_text")
    assert isinstance(config.default_theta, dict)
    assert rope_from_config(config, layer_type=layer_type).base == theta

    class Bare:  # a config object whose layer dicts leave theta to the class default
        def __init__(self) -> None:
            self.default_theta = {"global": 7.0, "local": 3.0}

        def to_dict(self):
            rope = {kind: {"rope_type": "default"} for kind in ("sliding_attention", "full_attention")}
            return config.to_dict() | {"rope_parameters": rope}

    assert rope_from_config(Bare(), layer_type=layer_type).base == (3.0 if layer_type == "sliding_attention" else 7.0)


def test_a_config_class_that_keeps_the_trained_length_under_its_own_name() -> None:
    # BailingHybridConfig maps max_position_embeddings to model_max_length, DBRX to max_seq_len: the dict a config
    # object writes, and a config.json, hold only their own names.
    config = transformers.AutoConfig.for_model("bailing_hybrid", max_position_embeddings=8)
    dynamic = {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4}
    for given in (config, {**config.to_dict(), "rope_parameters": dynamic}):
        assert rope_kwargs_from_config(given)["max_position_embeddings"] == 8
    dbrx = transformers.AutoConfig.for_model("dbrx", d_model=64, n_heads=4, max_seq_len=32)
    assert rope_kwargs_from_config(dbrx.to_dict())["max_position_embeddings"] == 32
    # JetMoE's head_dim is its kv_channels, not hidden_size / heads, and its rotary embedding reads it.
    jetmoe = transformers.AutoConfig.for_model("jetmoe", hidden_size=64, num_attention_heads=4, kv_channels=32)
    for given in (jetmoe, jetmoe.to_dict()):
        assert rope_kwargs_from_config(given)["head_dim"] == 32


@pytest.mark.parametrize(
    ("model_type", "rotary_class", "layer_types"),
    [
        ("mistral4", "mistral4.modeling_mistral4.Mistral4RotaryEmbedding", (None,)),
        (
            "dots3_note_text",
            "dots3_note.modeling_dots3_note.Dots3NoteTextRotaryEmbedding",
            ("indexed_attention", "sliding_attention"),
        ),
    ],
)
def test_mla_models_whose_head_dim_is_not_the_rotated_size(model_type: str, rotary_class: str, layer_types) -> None:
    """Mistral 4 (head_dim 128, partial 0.5) and dots.llm3 (256, 0.25) rotate qk_rope_head_dim = 64 channels with
    frequencies over those 64 (head_dim * partial); the partial factor applied to the 64 rotated half of them."""
    from transformers import CONFIG_MAPPING

    path, name = rotary_class.rsplit(".", 1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        config = CONFIG_MAPPING[model_type]()
        reference = getattr(importlib.import_module(f"transformers.models.{path}"), name)(config)
        for layer_type in layer_types:
            rope = rope_from_config(config, layer_type=layer_type)
            inv_freq = getattr(reference, "inv_freq" if layer_type is None else f"{layer_type}_inv_freq")
            factor = getattr(
                reference, "attention_scaling" if layer_type is None else f"{layer_type}_attention_scaling"
            )
            assert (rope.head_dim, rope.rotary_dim) == (config.qk_rope_head_dim, 2 * inv_freq.numel())
            torch.testing.assert_close(rope.frequencies()[0].float(), inv_freq)
            assert rope.frequencies()[1] == pytest.approx(factor)


def test_partial_scaled_types_and_a_top_level_original_length_read_as_transformers_reads_them() -> None:
    """Gaps a mutation pass found: a scaled type keeps its partial_rotary_factor whatever 'default' does with it,
    and a top-level original_max_position_embeddings wins over the rope dict's (LlamaConfig and Phi3Config alike)."""
    from transformers.models.llama import configuration_llama, modeling_llama
    from transformers.models.phi3 import configuration_phi3, modeling_phi3

    sizes = {"hidden_size": 128, "num_attention_heads": 2, "max_position_embeddings": 8192}
    cases = [
        (
            "llama",
            {
                "rope_type": "yarn",
                "factor": 4.0,
                "partial_rotary_factor": 0.5,
                "original_max_position_embeddings": 1024,
            },
            {},
        ),
        ("llama", {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024}, {"original": 2048}),
        (
            "phi3",
            {"rope_type": "longrope", "short_factor": [1.0] * 32, "long_factor": [3.0] * 32, "factor": 4.0},
            {"original": 2048},
        ),
    ]
    classes = {
        "llama": (configuration_llama.LlamaConfig, modeling_llama.LlamaRotaryEmbedding),
        "phi3": (configuration_phi3.Phi3Config, modeling_phi3.Phi3RotaryEmbedding),
    }
    for model_type, rope_parameters, extra in cases:
        raw = {"model_type": model_type, **sizes, "rope_parameters": rope_parameters}
        if "original" in extra:
            raw["original_max_position_embeddings"] = extra["original"]
            rope_parameters.setdefault("original_max_position_embeddings", 4096)  # the dict's, which loses
        config_class, rotary_class = classes[model_type]
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            # A deep copy: transformers writes the top-level original length into the rope dict it is given, and
            # posenc must apply that priority itself, not find it already done.
            hf_kwargs = copy.deepcopy({k: v for k, v in raw.items() if k != "model_type"})
            hf = rotary_class(config_class(**hf_kwargs))
            inv_freq, factor = rope_from_config(raw).frequencies()
        torch.testing.assert_close(inv_freq.float(), hf.inv_freq, rtol=1e-6, atol=0, msg=f"{model_type} {raw}")
        assert factor == pytest.approx(hf.attention_scaling, rel=1e-6)


def test_a_legacy_type_that_disagrees_with_rope_type_is_refused() -> None:
    from posenc.rope.parameters import parse_rope_parameters

    with pytest.raises(ValueError, match=r"rope_type='linear' and type='yarn'"):
        parse_rope_parameters(64, {"rope_type": "linear", "type": "yarn", "factor": 2.0})
    assert parse_rope_parameters(64, {"rope_type": "linear", "type": "linear", "factor": 2.0}) is not None


def rotary_of(config: Any) -> torch.nn.Module:
    """The model's own rotary embedding built from a transformers config object."""
    from transformers.models.auto.configuration_auto import model_type_to_module_name

    name = model_type_to_module_name(config.model_type)
    modeling = importlib.import_module(f"transformers.models.{name}.modeling_{name}")
    (cls,) = [
        c
        for n, c in vars(modeling).items()
        if n.endswith("RotaryEmbedding") and c.__module__ == modeling.__name__ and "Vision" not in n
    ]
    return cls(config)


def test_a_rope_scaling_block_beside_rope_parameters_wins_as_in_transformers(tmp_path: Path) -> None:
    """A model card's YaRN block added as rope_scaling to a config.json that transformers 5 saved with
    rope_parameters: transformers reads rope_scaling, theta included (the rope_parameters' 1e6 is dropped)."""
    cfg = {
        "model_type": "qwen3",
        "hidden_size": 64,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "max_position_embeddings": 4096,
        "rope_parameters": {"rope_type": "default", "rope_theta": 1e6},
        "rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024},
    }
    loaded = transformers.AutoConfig.for_model(**cfg)
    hf = rotary_of(loaded)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    for given in (cfg, tmp_path, loaded):
        rope = rope_from_config(given)
        assert (rope.rope_type, rope.base) == ("yarn", loaded.rope_parameters["rope_theta"]) == ("yarn", 10000.0)
        inv_freq, factor = rope.frequencies()
        torch.testing.assert_close(inv_freq, hf.inv_freq.double(), rtol=1e-6, atol=0)
        assert factor == pytest.approx(hf.attention_scaling, rel=1e-12)
    # An empty rope_scaling is no block: rope_parameters is read.
    assert rope_from_config({**cfg, "rope_scaling": {}}).base == 1e6


def test_a_rope_dict_per_layer_type_keeps_its_own_trained_length() -> None:
    """transformers applies a top-level original_max_position_embeddings to a single rope dict only; a dict per
    layer type keeps its own (else takes max_position_embeddings)."""
    llama3 = {"rope_type": "llama3", "factor": 8.0, "rope_theta": 1e6, "low_freq_factor": 1.0, "high_freq_factor": 4.0}
    for full, original in (({**llama3, "original_max_position_embeddings": 512}, 512), (llama3, 4096)):
        config = transformers.AutoConfig.for_model(
            "gemma3_text",
            hidden_size=64,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=32,
            num_hidden_layers=2,
            max_position_embeddings=4096,
            layer_types=["sliding_attention", "full_attention"],
            rope_parameters={"full_attention": full, "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}},
            original_max_position_embeddings=1024,
        )
        for given in (config, config.to_dict()):
            rope = rope_from_config(given, layer_type="full_attention")
            assert rope.spec.params["original_max_position_embeddings"] == original
            expected = rotary_of(config).full_attention_inv_freq.double()
            torch.testing.assert_close(rope.frequencies()[0], expected, rtol=1e-6, atol=0)


def _gemma_layers(model_type: str, **options: Any) -> Any:
    layers = {"num_hidden_layers": 2, "layer_types": ["sliding_attention", "full_attention"]}
    dims = {"hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16}
    return transformers.AutoConfig.for_model(model_type, **dims, max_position_embeddings=2048, **{**layers, **options})


@pytest.mark.parametrize("model_type", ["gemma4_text", "embedding_gemma2_text"])
def test_a_layer_type_reads_its_per_layer_config(model_type: str) -> None:
    """transformers' heterogeneous configs: Gemma 4's full-attention layers take global_head_dim (here 32) as their
    head_dim through per_layer_config, which posenc did not read until 2026-12-05: it gave those layers the sliding
    layers' 16, half the frequencies, silently (patch_model refused, rope_from_config did not)."""
    config = _gemma_layers(model_type, global_head_dim=32)
    assert config.to_dict()["per_layer_config"]["1"]["head_dim"] == 32
    reference = rotary_of(config)
    for given in (config, config.to_dict()):
        for layer_type, head_dim in (("full_attention", 32), ("sliding_attention", 16)):
            rope = rope_from_config(given, layer_type=layer_type)
            assert rope.head_dim == head_dim
            expected = getattr(reference, f"{layer_type}_inv_freq").double()
            torch.testing.assert_close(rope.frequencies()[0], expected, rtol=1e-6, atol=0)


def test_layers_of_one_type_that_differ_in_their_per_layer_config_are_refused() -> None:
    config = _gemma_layers("gemma4_text", num_hidden_layers=4, layer_types=["sliding_attention", "full_attention"] * 2)
    cfg = {**config.to_dict(), "per_layer_config": {"1": {"head_dim": 32}, "3": {"head_dim": 64}}}
    with pytest.raises(ValueError, match="is not homogeneous across layers"):  # transformers refuses it, too
        transformers.AutoConfig.for_model(**cfg).per_layer_config["full_attention"]
    with pytest.raises(
        ValueError,
        match=re.escape(
            "the full_attention layers of this config differ in their per_layer_config (layer 1: {'head_dim': 32}, "
            "layer 3: {'head_dim': 64}), so no one RoPE serves them"
        ),
    ):
        rope_from_config(cfg, layer_type="full_attention")
    assert rope_from_config(cfg, layer_type="sliding_attention").head_dim == 16


@pytest.mark.parametrize("truncate", [False, None, True])
def test_yarn_in_a_layer_types_dict_truncates_as_transformers_does(truncate: bool | None) -> None:
    """transformers' YaRN reads truncate from the outer rope_parameters, never from a layer type's dict, so a
    Gemma 3 whose full_attention dict says truncate: false still truncates. posenc read the inner key (0.15
    relative off in inv_freq); now it rotates as the model does, and warns where the dict says otherwise."""
    yarn = {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4, "original_max_position_embeddings": 512}
    sliding = {"rope_type": "default", "rope_theta": 1e4}
    config = _gemma_layers(
        "gemma3_text",
        rope_parameters={"full_attention": {**yarn, "truncate": truncate}, "sliding_attention": sliding},
    )
    expected = rotary_of(config).full_attention_inv_freq.double()
    for given in (config, config.to_dict()):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            rope = rope_from_config(given, layer_type="full_attention")
        said = [str(w.message) for w in caught if "reads YaRN's truncate from the outer" in str(w.message)]
        assert len(said) == (0 if truncate else 1)
        torch.testing.assert_close(rope.frequencies()[0], expected, rtol=1e-6, atol=0)
    # What the dict asked for is a different rotation: the test above can tell them apart.
    untruncated = RoPE(16, rope_parameters={**yarn, "truncate": False}).frequencies()[0]
    assert not torch.allclose(untruncated, expected, rtol=1e-3)


@pytest.mark.usefixtures("dict_reading")
@pytest.mark.parametrize("model_type", ["ernie4_5", "lfm2", "exaone", "llama"])
def test_a_dict_without_rope_theta_takes_its_config_class_default(model_type: str) -> None:
    cfg = {"model_type": model_type, "hidden_size": 64, "num_attention_heads": 4, "head_dim": 16}
    expected = transformers.AutoConfig.for_model(**cfg).rope_parameters["rope_theta"]
    assert rope_from_config(cfg).base == expected
    assert expected != 10000.0 or model_type == "llama"


@pytest.mark.usefixtures("dict_reading")
@pytest.mark.parametrize("model_type", ["llama4", "mllama", "voxtral_realtime", "musicflamingo"])
def test_a_text_config_without_model_type_takes_its_sub_config_class_default(model_type: str) -> None:
    """Not the outer class's (MusicFlamingo's is its audio tower's 1200)."""
    text = {"hidden_size": 64, "num_attention_heads": 4, "head_dim": 16, "rope_parameters": {"rope_type": "default"}}
    cfg = {"model_type": model_type, "text_config": text}
    expected = transformers.AutoConfig.for_model(**cfg).get_text_config().rope_parameters["rope_theta"]
    assert rope_from_config(cfg).base == expected


def test_the_table_of_configs_that_fold_rope_scaling_into_layer_dicts_is_the_installed_transformers() -> None:
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING, CONFIG_MAPPING_NAMES

    folding = set()
    for model_type in CONFIG_MAPPING_NAMES:
        convert = getattr(CONFIG_MAPPING[model_type], "convert_rope_params_to_dict", None)
        if convert is not None and ".update(rope_scaling)" in inspect.getsource(convert):
            folding.add(model_type)
    assert folding == hf_interop._LAYERED_ROPE_SCALING


def test_a_legacy_rope_scaling_that_transformers_folds_into_layer_dicts(monkeypatch: pytest.MonkeyPatch) -> None:
    """Gemma 3's config.json as released: transformers puts its linear x8 into full_attention only, and the sliding
    layers take rope_local_base_freq. Read through Gemma3TextConfig as from_pretrained reads it; without the class,
    refused with the fix (read as the one rope dict it would scale every layer)."""
    gemma3 = {
        "model_type": "gemma3_text",
        "hidden_size": 64,
        "num_attention_heads": 4,
        "head_dim": 16,
        "rope_theta": 1e6,
        "rope_local_base_freq": 1e4,
        "rope_scaling": {"rope_type": "linear", "factor": 8.0},
    }
    loaded = transformers.AutoConfig.for_model(**gemma3)
    for given in (gemma3, loaded):
        full = rope_from_config(given, layer_type="full_attention")
        assert (full.rope_type, full.base, full.spec.params["factor"]) == ("linear", 1e6, 8.0)
        sliding = rope_from_config(given, layer_type="sliding_attention")
        assert (sliding.rope_type, sliding.base) == ("default", 1e4)
    monkeypatch.setattr(hf_interop, "_through_config_class", lambda cfg: None)  # as without transformers
    fix = r"load it with transformers \(transformers.AutoConfig.from_pretrained\) and pass the config object"
    with pytest.raises(ValueError, match=rf"gemma3_text config has a legacy rope_scaling block, .*{fix}"):
        rope_from_config(gemma3)
    nested = {
        **{key: value for key, value in gemma3.items() if key != "model_type"},
        "layer_types": ["sliding_attention", "full_attention"],
        "rope_parameters": {"full_attention": {"rope_type": "default"}, "sliding_attention": {"rope_type": "default"}},
    }
    with pytest.raises(ValueError, match=rf"rope_scaling block beside rope dicts per layer type, .*{fix}"):
        rope_from_config(nested, layer_type="full_attention")


def test_without_transformers_a_dict_with_a_model_type_says_it_misses_the_class_defaults(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Without transformers a dict is read as written, so the same call gave another RoPE, silently: Phi's rotary
    fraction, Gemma's head_dim of 256 and Llama 4's theta of 500000 are their config classes' defaults."""
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "transformers" else real(name, *a)
    )
    monkeypatch.setattr(hf_interop, "_through_config_class", lambda cfg: None)  # as without transformers
    gemma = {"model_type": "gemma", "hidden_size": 1024, "num_attention_heads": 16}
    (tmp_path / "config.json").write_text(json.dumps(gemma))
    for given in (gemma, tmp_path):
        with pytest.warns(UserWarning, match="transformers is not installed, so this 'gemma' config .* pip install"):
            assert rope_from_config(given).head_dim == 64  # hidden / heads: GemmaConfig's 256 needs transformers
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no model type: no config class to miss
        rope_from_config({"hidden_size": 64, "num_attention_heads": 4})


def test_a_dict_its_config_class_refuses_says_it_misses_the_class_defaults() -> None:
    """A key the config class checks strictly (a float vocab_size, which from_pretrained refuses too) dropped all of
    the class's defaults, silently: this Qwen3 config rotated 64 channels, not Qwen3Config's head_dim of 128, and a
    Phi config the whole head, not Phi's half."""
    qwen3 = {"model_type": "qwen3", "hidden_size": 1024, "num_attention_heads": 16, "vocab_size": 151936.0}
    with pytest.warns(
        UserWarning, match=r"Qwen3Config refuses this config \(.*'vocab_size'.*posenc's generic defaults"
    ):
        assert rope_from_config(qwen3).head_dim == 64  # hidden / heads: read as written
    assert rope_from_config({**qwen3, "vocab_size": 151936}).head_dim == 128
    phi = {"model_type": "phi", "hidden_size": 1024, "num_attention_heads": 16, "intermediate_size": 4096.0}
    with pytest.warns(UserWarning, match="PhiConfig refuses this config"):
        assert rope_from_config(phi).rotary_dim == 64


@pytest.mark.parametrize(
    ("model_type", "rotary_dim"),
    [("phi", 32), ("stablelm", 16), ("persimmon", 32), ("gemma", 256), ("ernie4_5", 128), ("llama", 64)],
)
def test_a_dict_takes_what_its_config_class_fills_in(model_type: str, rotary_dim: int) -> None:
    """Found by fuzzing against transformers: a dict without partial_rotary_factor or head_dim rotated the whole of
    hidden / heads, where Phi's class defaults the factor to 0.5 and Gemma's head_dim to 256."""
    cfg = {"model_type": model_type, "hidden_size": 1024, "num_attention_heads": 16, "num_key_value_heads": 16}
    config = transformers.AutoConfig.for_model(**cfg)
    from_dict, from_object = rope_from_config(cfg), rope_from_config(config)
    assert from_dict.rotary_dim == from_object.rotary_dim == rotary_dim
    torch.testing.assert_close(from_dict.frequencies()[0], from_object.frequencies()[0], rtol=0, atol=0)


def test_a_composite_whose_outer_rope_is_another_towers_reads_the_text_models() -> None:
    """MusicFlamingo's outer config holds its audio tower's RoPE (theta 1200, a fifth of the channels); the text
    model is its text_config's."""
    text = {"hidden_size": 64, "num_attention_heads": 4, "head_dim": 16, "rope_parameters": {"rope_type": "default"}}
    cfg = {"model_type": "musicflamingo", "text_config": text}
    config = transformers.AutoConfig.for_model(**cfg)
    expected = config.get_text_config().rope_parameters["rope_theta"]
    for given in (cfg, config):
        rope = rope_from_config(given)
        assert (rope.base, rope.rotary_dim) == (expected, 16)


@pytest.mark.parametrize(("model_type", "half"), [("t5gemma", "decoder"), ("dia", "decoder_config")])
def test_an_encoder_decoder_config_names_the_half_to_read(model_type: str, half: str) -> None:
    """Each half of T5Gemma / Dia has RoPE of its own: the whole config failed on its missing sizes ("config needs
    head_dim ..."), which did not say what to pass."""
    from transformers import AutoConfig

    config = AutoConfig.for_model(model_type).to_dict()
    with pytest.raises(ValueError, match=re.escape(f"pass the one to read, e.g. config[{half!r}]")):
        rope_from_config(config)
    rope = rope_from_config(config[half])
    assert (rope.head_dim, rope.base) == (config[half]["head_dim"], config[half]["rope_parameters"]["rope_theta"])


def test_a_config_with_rope_of_its_own_beside_an_encoder_half_is_read_at_the_top() -> None:
    """The encoder-decoder refusal is for configs whose RoPE lives only in their halves: a model type posenc does
    not know with its own RoPE keys and an 'encoder' sub-config (a speech encoder beside the decoder) is the
    decoder's RoPE, read as written (mutation pass 13: refusing every config with an 'encoder' dict passed)."""
    config = {"hidden_size": 64, "num_attention_heads": 4, "rope_theta": 5e5, "encoder": {"hidden_size": 32}}
    rope = rope_from_config(config)
    assert (rope.head_dim, rope.base) == (16, 5e5)
    with pytest.raises(ValueError, match=re.escape("pass the one to read, e.g. config['decoder']")):
        rope_from_config({"encoder": config, "decoder": config})
