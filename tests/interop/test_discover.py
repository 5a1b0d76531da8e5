"""The checks patch_model makes before it touches a model: which layout a rotation function rotates in (run on
random q and k with the model's own cos/sin), what it refuses, and what the per-layer-type and generic paths do."""

from __future__ import annotations

import copy
import importlib
from typing import Any

import pytest
import torch
from torch import nn

from posenc.interop import patch as patch_module
from posenc.interop._discover import probe_rotation, rotation_signature
from posenc.interop.patch import PosencRotaryEmbedding, _rotate_qk, is_patched, patch_model
from posenc.rope.module import RoPE

transformers = pytest.importorskip("transformers")


def modeling(name: str) -> Any:
    return importlib.import_module(f"transformers.models.{name}.modeling_{name}")


class Rotary(nn.Module):
    """A rotary embedding as transformers writes them: cos/sin (b, s, r), the frequencies repeated as ``repeat``
    says ("cat" for split-half models, "interleave" for Cohere's)."""

    def __init__(self, rotary_dim: int = 8, repeat: str = "cat") -> None:
        super().__init__()
        self.register_buffer("inv_freq", 1.0 / 100.0 ** (torch.arange(0, rotary_dim, 2).float() / rotary_dim))
        self.attention_scaling = 1.0
        self.repeat = repeat

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = position_ids[..., None].float() * self.inv_freq
        emb = torch.cat((freqs, freqs), -1) if self.repeat == "cat" else freqs.repeat_interleave(2, -1)
        return emb.cos().to(x.dtype), emb.sin().to(x.dtype)


def rotate_last(q, k, cos, sin, unsqueeze_dim=1):
    """Rotates the last r channels (as DeepSeek-V4 does), not the first."""
    r = cos.shape[-1]
    q_rot, k_rot = modeling("llama").apply_rotary_pos_emb(q[..., -r:], k[..., -r:], cos, sin, unsqueeze_dim)
    return torch.cat((q[..., :-r], q_rot), -1), torch.cat((k[..., :-r], k_rot), -1)


@pytest.mark.parametrize(
    ("model", "function", "repeat", "expected"),
    [
        ("llama", "apply_rotary_pos_emb", "cat", "split-half"),
        ("glm", "apply_rotary_pos_emb", "cat", "interleaved"),  # GLM's partial adjacent pairs, from cat'd cos/sin
        ("cohere", "apply_rotary_pos_emb", "interleave", "interleaved"),
        ("deepseek_v3", "apply_rotary_pos_emb_interleave", "cat", "interleaved, returned evens then odds"),
    ],
)
def test_the_probe_finds_the_layout(model: str, function: str, repeat: str, expected: str) -> None:
    rotation = getattr(modeling(model), function)
    found = probe_rotation(function, rotation, Rotary(8, repeat), layer_type=None, head_dim=8)
    assert found.layout == expected


def test_a_function_that_rotates_part_of_a_wider_head_is_checked_on_the_whole_head() -> None:
    # GLM rotates the first r channels of the head it is given and passes the rest through: as posenc does.
    glm = modeling("glm").apply_rotary_pos_emb
    assert probe_rotation("apply_rotary_pos_emb", glm, Rotary(8), layer_type=None, head_dim=16).interleaved
    # Rotating the last r channels instead agrees on q, k of r channels only: refused.
    with pytest.raises(ValueError, match=r"on q, k of 16 channels it matches neither .* of the first 8"):
        probe_rotation("apply_rotary_pos_emb", rotate_last, Rotary(8), layer_type=None, head_dim=16)
    # A function that fails on a wider head is one the attention calls on the rotated slice only: fine.
    llama = modeling("llama").apply_rotary_pos_emb
    assert probe_rotation("apply_rotary_pos_emb", llama, Rotary(8), layer_type=None, head_dim=16).layout == "split-half"


def test_the_probe_refuses_rotations_posenc_does_not_make() -> None:
    nanochat = modeling("nanochat").apply_rotary_pos_emb  # by the negative angle
    with pytest.raises(ValueError, match="apply_rotary_pos_emb does not rotate as posenc does: on q, k of 8"):
        probe_rotation("apply_rotary_pos_emb", nanochat, Rotary(8), layer_type=None, head_dim=8)

    def swapped(tensor, sin, cos):
        return tensor

    with pytest.raises(ValueError, match=r"is not \(q, k, cos, sin, \.\.\., unsqueeze_dim\)"):
        probe_rotation("apply_rotary_pos_emb", swapped, Rotary(8), layer_type=None, head_dim=8)

    def broken(q, k, cos, sin, unsqueeze_dim=1):
        raise RuntimeError("shape mismatch")

    with pytest.raises(ValueError, match="failed on q, k of 8 channels: shape mismatch"):
        probe_rotation("apply_rotary_pos_emb", broken, Rotary(8), layer_type=None, head_dim=8)

    def one(q, k, cos, sin, unsqueeze_dim=1):
        return q

    with pytest.raises(ValueError, match=r"returned Tensor, not \(q, k\)"):
        probe_rotation("apply_rotary_pos_emb", one, Rotary(8), layer_type=None, head_dim=8)


def test_the_probe_leaves_the_models_rotary_module_as_it_was() -> None:
    class Stateful(Rotary):  # as transformers' dynamic NTK, whose forward updates its frequencies
        def forward(self, x: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            self.inv_freq.mul_(0.5)
            return super().forward(x, position_ids)

    rotary = Stateful(8)
    before = rotary.inv_freq.clone()
    found = probe_rotation("f", modeling("llama").apply_rotary_pos_emb, rotary, layer_type=None, head_dim=8)
    assert found.layout == "split-half"  # checked with the frequencies the copy's call used
    torch.testing.assert_close(rotary.inv_freq, before, atol=0, rtol=0)


def test_unsqueeze_dim_is_found_positionally_and_by_keyword() -> None:
    assert rotation_signature(modeling("llama").apply_rotary_pos_emb, "f") == (0, 1)
    # DeepSeek's interleave variant: (q, k, cos, sin, position_ids=None, unsqueeze_dim=1)
    interleave = modeling("deepseek_v3").apply_rotary_pos_emb_interleave
    assert rotation_signature(interleave, "f") == (1, 1)
    q, k = torch.randn(1, 5, 3, 8), torch.randn(1, 5, 1, 8)  # heads after tokens: unsqueeze_dim=2
    cos, sin = torch.randn(1, 5, 4), torch.randn(1, 5, 4)
    options = dict(interleaved=False, backend="torch", keys=True, unsqueeze_at=1, unsqueeze_default=1)
    by_keyword = _rotate_qk(q, k, cos, sin, unsqueeze_dim=2, **options)
    positional = _rotate_qk(q, k, cos, sin, None, 2, **options)
    for a, b in zip(by_keyword, positional, strict=True):
        torch.testing.assert_close(a, b, atol=0, rtol=0)
    with pytest.raises(ValueError, match="do not broadcast"):  # the default, 1, is for heads before tokens
        _rotate_qk(q, k, cos, sin, **options)


# --- patch_model on architectures beyond SUPPORTED_ARCHITECTURES ------------------------------------------------

SIZES = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    vocab_size=128,
    max_position_embeddings=16,
    initializer_range=0.3,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=None,
)
FP32 = dict(atol=1e-4, rtol=1e-4)


def build(model_type: str, **overrides: Any) -> Any:
    config = transformers.AutoConfig.for_model(model_type, **{**SIZES, **overrides})
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(config).eval()


def tokens(length: int = 28) -> torch.Tensor:
    return torch.randint(3, 128, (2, length), generator=torch.Generator().manual_seed(0))


def test_new_scaling_on_another_architecture_matches_the_model_built_with_it() -> None:
    params = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16, "rope_theta": 1e6}
    patched = build("mixtral", num_local_experts=4)  # Mixtral's rope_theta is 1e6
    reference = build("mixtral", num_local_experts=4, rope_parameters=params)
    report = patch_model(patched, rope_parameters={"rope_type": "yarn", "factor": 4.0})
    assert report.config_changed and report.rope_type == "yarn"
    with torch.no_grad():
        torch.testing.assert_close(patched(tokens()).logits, reference(tokens()).logits, **FP32)


def test_a_new_rotary_dim_is_refused_where_posenc_does_not_know_the_attention() -> None:
    model = build("mixtral", num_local_experts=4)
    with pytest.raises(ValueError, match=r"change the rotary dim of this mixtral model from 16 to 8"):
        patch_model(model, rope_parameters={"rope_type": "linear", "factor": 2.0, "partial_rotary_factor": 0.5})
    assert not is_patched(model)


def test_consistent_mode_with_a_length_dependent_type_is_refused_where_posenc_does_not_know_the_keys() -> None:
    model = build("mixtral", num_local_experts=4)
    with pytest.raises(ValueError, match=r"mode='consistent' with rope_type='dynamic' .* mixtral .* mode='hf'"):
        patch_model(model, rope_parameters={"rope_type": "dynamic", "factor": 2.0}, mode="consistent")
    assert not is_patched(model)
    # Fixed types rotate keys before caching in either mode: nothing to refuse.
    assert patch_model(model, mode="consistent").mode == "consistent"


GEMMA3 = dict(
    model_type="gemma3_text",
    num_hidden_layers=4,
    sliding_window_pattern=2,
    layer_types=["sliding_attention", "full_attention"] * 2,
    rope_parameters={
        "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
        "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
    },
)


def test_one_rope_per_layer_type() -> None:
    options = {key: value for key, value in GEMMA3.items() if key != "model_type"}
    model = build("gemma3_text", **options)
    patched = copy.deepcopy(model)
    report = patch_model(patched)
    assert report.rope_type == "full_attention: linear, sliding_attention: default"
    rotary = patched.model.rotary_emb
    assert isinstance(rotary, PosencRotaryEmbedding) and rotary.layer_types == ("full_attention", "sliding_attention")
    with torch.no_grad():
        torch.testing.assert_close(patched(tokens()).logits, model(tokens()).logits, **FP32)
        with pytest.raises(ValueError, match=r"layer_type must be one of \['full_attention', 'sliding_attention'\]"):
            rotary(torch.zeros(1, 3, 64), torch.arange(3)[None], "chunked_attention")
    with pytest.raises(ValueError, match=r"rope dict per layer type; .* rope_parameters=None"):
        patch_model(build("gemma3_text", **options), rope_parameters={"rope_type": "linear", "factor": 2.0})


def test_a_single_rope_takes_no_layer_type() -> None:
    rotary = PosencRotaryEmbedding(RoPE(16))
    with pytest.raises(ValueError, match=r"layer_type='full_attention' given, but .* one rope dict"):
        rotary(torch.zeros(1, 3, 64), torch.arange(3)[None], "full_attention")
    with pytest.raises(TypeError, match="RoPE or a non-empty dict"):
        PosencRotaryEmbedding({})


def test_a_rotary_module_on_the_meta_device_is_refused_for_another_architecture() -> None:
    model = build("mixtral", num_local_experts=4)
    model.model.rotary_emb.to("meta")
    with pytest.raises(ValueError, match="meta device, so apply_rotary_pos_emb cannot be run to check it"):
        patch_model(model)
    assert not is_patched(model)


def test_an_architecture_the_tests_have_not_compared_is_patched_with_a_warning(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(patch_module, "VERIFIED_ARCHITECTURES", frozenset())
    model = build("mixtral", num_local_experts=4)
    with pytest.warns(UserWarning, match="have not compared a patched mixtral model's logits"):
        patch_model(model)
    assert is_patched(model)
