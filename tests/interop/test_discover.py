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
from posenc.interop._discover import innermost, probe_rotation, rotation_signature
from posenc.interop.patch import PosencRotaryEmbedding, is_patched, patch_model, unpatch_model
from posenc.interop.rotary import _rotate_one, _rotate_qk
from posenc.rope.module import RoPE
from posenc.testing import TINY_HF_SIZES

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
    assert rotation_signature(modeling("llama").apply_rotary_pos_emb, "f") == (0, 1, 2)
    # DeepSeek's interleave variant: (q, k, cos, sin, position_ids=None, unsqueeze_dim=1)
    interleave = modeling("deepseek_v3").apply_rotary_pos_emb_interleave
    assert rotation_signature(interleave, "f") == (1, 1, 2)
    # Gemma 4's, called on q and on k in turn: (x, cos, sin, unsqueeze_dim=1)
    assert rotation_signature(modeling("gemma4").apply_rotary_pos_emb, "f") == (0, 1, 1)
    q, k = torch.randn(1, 5, 3, 8), torch.randn(1, 5, 1, 8)  # heads after tokens: unsqueeze_dim=2
    cos, sin = torch.randn(1, 5, 4), torch.randn(1, 5, 4)
    options = dict(interleaved=False, regrouped=False, backend="torch", keys=True, unsqueeze_at=1, unsqueeze_default=1)
    by_keyword = _rotate_qk(q, k, cos, sin, unsqueeze_dim=2, **options)
    positional = _rotate_qk(q, k, cos, sin, None, 2, **options)
    for a, b in zip(by_keyword, positional, strict=True):
        torch.testing.assert_close(a, b, atol=0, rtol=0)
    with pytest.raises(ValueError, match="do not broadcast"):  # the default, 1, is for heads before tokens
        _rotate_qk(q, k, cos, sin, **options)


def rotate_nothing(q, k, cos, sin, unsqueeze_dim=1):
    return q, k


class KernelizedFunction(nn.Module):
    """What the kernels package (required by transformers >= 5.25) makes of a function: a module whose class's
    forward calls it, held in the closure, with no __wrapped__."""

    def __init__(self, func) -> None:
        super().__init__()

        def forward(self, *args, **kwargs):
            return func(*args, **kwargs)

        type(self).forward = forward


def test_the_function_under_a_kernelized_module_is_read() -> None:
    wrapped = KernelizedFunction(rotate_nothing)
    assert innermost(wrapped) is rotate_nothing
    assert rotation_signature(wrapped, "apply_rotary_pos_emb") == (0, 1, 2)
    assert innermost(nn.Linear(2, 2)).__class__ is nn.Linear  # a module with no function in its closure is itself
    with pytest.raises(ValueError, match=r"apply_rotary_pos_emb\(q, k\) is not \(q, k, cos, sin"):  # its own
        rotation_signature(KernelizedFunction(lambda q, k: (q, k)), "apply_rotary_pos_emb")
    # transformers' own, whichever form the installed version gives it
    assert innermost(modeling("llama").apply_rotary_pos_emb).__name__ == "apply_rotary_pos_emb"


# --- patch_model on architectures beyond SUPPORTED_ARCHITECTURES ------------------------------------------------

SIZES = dict(
    **TINY_HF_SIZES, vocab_size=128, max_position_embeddings=16, pad_token_id=0, bos_token_id=1, eos_token_id=None
)
FP32 = dict(atol=1e-4, rtol=1e-4)
# DeepSeek-V3 with multi-head latent attention: 8 rope channels per head, one kv head per head.
MLA = dict(
    num_key_value_heads=4,
    n_routed_experts=4,
    num_experts_per_tok=2,
    n_group=1,
    topk_group=1,
    moe_intermediate_size=32,
    first_k_dense_replace=1,
    kv_lora_rank=16,
    q_lora_rank=16,
    qk_rope_head_dim=8,
    qk_nope_head_dim=8,
    v_head_dim=16,
    head_dim=None,
)


def build(model_type: str, **overrides: Any) -> Any:
    """A tiny float32 model; an override of None drops that size (MLA configs derive head_dim themselves)."""
    sizes = {key: value for key, value in {**SIZES, **overrides}.items() if value is not None}
    config = transformers.AutoConfig.for_model(model_type, **sizes)
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(config).eval()


def tokens(length: int = 28) -> torch.Tensor:
    return torch.randint(3, 128, (2, length), generator=torch.Generator().manual_seed(0))


def test_new_scaling_is_refused_where_the_architecture_may_read_the_rope_dict_elsewhere() -> None:
    # DeepSeek-V3's attention takes its softmax scale from YaRN's mscale when it is built: a rewritten config would
    # reload as another model than the patched one.
    for model_type, options in (("mixtral", dict(num_local_experts=4)), ("deepseek_v3", MLA)):
        model = build(model_type, **options)
        with pytest.raises(ValueError, match=rf"for this {model_type} model, set the config's rope parameters"):
            patch_model(model, rope_parameters={"rope_type": "yarn", "factor": 4.0})
        assert not is_patched(model)


def test_consistent_mode_with_a_length_dependent_type_is_refused_where_posenc_does_not_know_the_keys() -> None:
    dynamic = {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e6}
    model = build("mixtral", num_local_experts=4, rope_parameters=dynamic)
    with pytest.raises(ValueError, match=r"mode='consistent' with rope_type='dynamic' .* mixtral .* mode='hf'"):
        patch_model(model, mode="consistent")
    assert not is_patched(model)
    model = build("mixtral", num_local_experts=4)
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


def test_unpatch_hands_back_each_layer_types_dynamic_ntk_state() -> None:
    options = {key: value for key, value in GEMMA3.items() if key != "model_type"}
    options["rope_parameters"] = {
        "full_attention": {"rope_type": "dynamic", "factor": 4.0, "rope_theta": 1e6},
        "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
    }
    model = build("gemma3_text", **options, max_position_embeddings=16)
    patched = copy.deepcopy(model)
    patch_model(patched)
    with torch.no_grad():
        model(tokens(24)), patched(tokens(24))
        unpatch_model(patched)
        restored, original = patched.model.rotary_emb, model.model.rotary_emb
        assert torch.equal(restored.full_attention_inv_freq, original.full_attention_inv_freq)
        torch.testing.assert_close(patched(tokens(20)).logits, model(tokens(20)).logits, **FP32)


def test_one_rope_per_layer_type() -> None:
    options = {key: value for key, value in GEMMA3.items() if key != "model_type"}
    model = build("gemma3_text", **options)
    patched = copy.deepcopy(model)
    report = patch_model(patched)
    assert report.rope_type == "full_attention: linear, sliding_attention: default"
    rotary = patched.model.rotary_emb
    assert isinstance(rotary, PosencRotaryEmbedding) and rotary.layer_types == ("full_attention", "sliding_attention")
    # as transformers' module holds it, which a model's forward may iterate (Ergo's does)
    assert (
        rotary.rope_type
        == model.model.rotary_emb.rope_type
        == {"full_attention": "linear", "sliding_attention": "default"}
    )
    with torch.no_grad():
        torch.testing.assert_close(patched(tokens()).logits, model(tokens()).logits, **FP32)
        with pytest.raises(ValueError, match=r"layer_type must be one of \['full_attention', 'sliding_attention'\]"):
            rotary(torch.zeros(1, 3, 64), torch.arange(3)[None], "chunked_attention")
    with pytest.raises(ValueError, match=r"for this gemma3_text model, set the config's rope parameters"):
        patch_model(build("gemma3_text", **options), rope_parameters={"rope_type": "linear", "factor": 2.0})


def test_a_single_rope_takes_no_layer_type() -> None:
    rotary = PosencRotaryEmbedding(RoPE(16, rope_parameters={"rope_type": "linear", "factor": 4.0}))
    assert rotary.rope_type == "linear"
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


def test_a_model_patched_on_the_meta_device_takes_its_weights_after_to_empty() -> None:
    # to_empty() copied the patched rotary embedding's kept meta buffer: a bare 'Cannot copy out of meta tensor'.
    reference = build("llama")
    for inside in (False, True):  # patched inside the meta context too: its frequencies were made meta then
        with torch.device("meta"):
            model = transformers.AutoModelForCausalLM.from_config(reference.config)
            if inside:
                patch_model(model)
        if not inside:
            patch_model(model)
        model.to_empty(device="cpu")
        model.load_state_dict(reference.state_dict())
        with torch.no_grad():
            expected = reference(tokens()).logits
            torch.testing.assert_close(model.eval()(tokens()).logits, expected, atol=1e-4, rtol=1e-4)


def test_an_architecture_the_tests_have_not_compared_is_patched_with_a_warning(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(patch_module, "VERIFIED_ARCHITECTURES", frozenset())
    model = build("mixtral", num_local_experts=4)
    with pytest.warns(UserWarning, match="have not compared a patched mixtral model's logits"):
        patch_model(model)
    assert is_patched(model)


def test_a_cache_filled_before_patching_stays_valid() -> None:
    # DeepSeek's apply_rotary_pos_emb_interleave returns the rotated channels evens first: posenc returns them in
    # that order too, so keys cached by the unpatched model (or after unpatching) are read as they were written.
    for model_type, options in (("deepseek_v3", MLA), ("llama", {})):
        model = build(model_type, **options)
        patched = copy.deepcopy(model)
        ids = tokens(12)
        with torch.no_grad():
            expected = model(ids[:, 8:], cache=model(ids[:, :8], use_cache=True).cache).logits
            past = patched(ids[:, :8], use_cache=True).cache  # filled unpatched
            report = patch_model(patched)
            got = patched(ids[:, 8:], cache=past).logits
            full = model(ids).logits
        torch.testing.assert_close(expected, full[:, 8:], **FP32)  # the cache is read: the check below is one
        torch.testing.assert_close(got, expected, **FP32)
        if model_type == "deepseek_v3":
            assert report.rotations["apply_rotary_pos_emb_interleave"] == "interleaved, returned evens then odds"


def test_dynamic_ntk_state_of_each_layer_type_is_continued() -> None:
    # transformers keeps a dynamic layer type's grown length in {layer_type}_max_seq_len_cached.
    rope = {
        "full_attention": {"rope_type": "dynamic", "factor": 4.0, "rope_theta": 1e4},
        "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
    }
    model = build("gemma3_text", layer_types=["sliding_attention", "full_attention"], rope_parameters=rope)
    ids = tokens(40)
    with torch.no_grad():
        model(ids)  # grows the full-attention frequencies to 40 tokens (trained: 16)
        patched = copy.deepcopy(model)
        patch_model(patched)
        torch.testing.assert_close(patched(ids[:, :30]).logits, model(ids[:, :30]).logits, **FP32)


def test_a_vision_language_model_is_patched_through_its_text_config() -> None:
    text = dict(model_type="llama", **{key: value for key, value in SIZES.items() if key != "initializer_range"})
    vision = dict(
        model_type="clip_vision_model",
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        image_size=32,
        patch_size=16,
    )
    config = transformers.LlavaConfig(text_config=text, vision_config=vision, image_token_id=127)
    torch.manual_seed(0)
    model = transformers.LlavaForConditionalGeneration(config).eval()
    patched = copy.deepcopy(model)
    with pytest.warns(UserWarning, match="llava"):
        report = patch_model(patched)
    assert report.rope_parameters == model.config.text_config.rope_parameters
    with torch.no_grad():
        torch.testing.assert_close(patched(input_ids=tokens()).logits, model(input_ids=tokens()).logits, **FP32)
        unpatch_model(patched)
        assert type(patched.model.language_model.rotary_emb).__name__ == "LlamaRotaryEmbedding"
        torch.testing.assert_close(patched(input_ids=tokens()).logits, model(input_ids=tokens()).logits, **FP32)


def test_keys_reused_from_another_layer_are_passed_as_none() -> None:
    q, cos, sin = torch.randn(1, 2, 5, 8), torch.randn(1, 5, 4), torch.randn(1, 5, 4)
    options = dict(backend="torch", keys=True, unsqueeze_at=1, unsqueeze_default=1)
    for interleaved, regrouped in ((False, False), (True, False), (True, True)):
        rotated, none = _rotate_qk(q, None, cos, sin, interleaved=interleaved, regrouped=regrouped, **options)
        expected, _ = _rotate_qk(q, q[:, :1], cos, sin, interleaved=interleaved, regrouped=regrouped, **options)
        assert none is None
        torch.testing.assert_close(rotated, expected, atol=0, rtol=0)


def test_a_rotation_with_arguments_posenc_would_ignore_is_refused() -> None:
    def scaled(q, k, cos, sin, unsqueeze_dim=1, scale=1.0):
        return q, k

    with pytest.raises(ValueError, match="apply_rotary_pos_emb takes scale, which posenc's rotation has no"):
        rotation_signature(scaled, "apply_rotary_pos_emb")


def test_a_rotation_of_one_tensor_is_probed_on_q_and_on_k_and_replaced_by_one() -> None:
    """Gemma 3n and Gemma 4 rotate q and k in separate calls of (x, cos, sin, unsqueeze_dim): refused as "not (q, k,
    cos, sin, ...)" until 2026-12-05."""
    gemma4 = modeling("gemma4").apply_rotary_pos_emb
    rotation = probe_rotation("apply_rotary_pos_emb", gemma4, Rotary(8), layer_type=None, head_dim=8)
    assert (rotation.tensors, rotation.layout, rotation.unsqueeze_at, rotation.unsqueeze_default) == (
        1,
        "split-half",
        0,
        1,
    )
    x = torch.randn(1, 5, 3, 8)  # heads after tokens, as Gemma 4 calls it: unsqueeze_dim=2
    cos, sin = torch.randn(1, 5, 4).repeat(1, 1, 2), torch.randn(1, 5, 4).repeat(1, 1, 2)  # transformers' halves
    options = dict(interleaved=False, regrouped=False, backend="torch", unsqueeze_at=0, unsqueeze_default=1)
    ours = _rotate_one(x, cos[..., :4], sin[..., :4], unsqueeze_dim=2, **options)
    torch.testing.assert_close(ours, _rotate_one(x, cos[..., :4], sin[..., :4], 2, **options), atol=0, rtol=0)
    torch.testing.assert_close(ours, gemma4(x, cos, sin, unsqueeze_dim=2), atol=1e-6, rtol=1e-6)

    def negative(x, cos, sin, unsqueeze_dim=1):  # one tensor, the wrong way round
        return gemma4(x, cos, -sin, unsqueeze_dim)

    with pytest.raises(ValueError, match="matches neither pair layout"):
        probe_rotation("apply_rotary_pos_emb", negative, Rotary(8), layer_type=None, head_dim=8)
    with pytest.raises(ValueError, match="not the rotated tensor"):
        probe_rotation("f", lambda x, cos, sin, unsqueeze_dim=1: (x, x), Rotary(8), layer_type=None, head_dim=8)
    with pytest.raises(ValueError, match=r"f takes scale, which posenc's rotation has no counterpart for"):
        rotation_signature(lambda x, cos, sin, scale=1.0, unsqueeze_dim=1: x, "f")


def test_a_rotation_that_takes_a_shorter_q_than_its_cos_sin_is_refused() -> None:
    llama = modeling("llama").apply_rotary_pos_emb

    def last_tokens(q, k, cos, sin, unsqueeze_dim=1):  # as MuSE-Glimmer's assistant: q of the last q_len tokens
        q_cos, q_sin = cos[..., -q.shape[-2] :, :], sin[..., -q.shape[-2] :, :]
        return llama(q, q, q_cos, q_sin, unsqueeze_dim)[0], llama(k, k, cos, sin, unsqueeze_dim)[1]

    with pytest.raises(ValueError, match="rotates a q of fewer tokens than its cos/sin"):
        probe_rotation("apply_rotary_pos_emb", last_tokens, Rotary(8), layer_type=None, head_dim=8)


def _modeling_module(source: str) -> dict[str, Any]:
    """The namespace of a stand-in modeling module: ``source`` run beside transformers' apply_rotary_pos_emb."""
    namespace = {"__name__": "modeling_standin", "nn": nn, "torch": torch}
    namespace["apply_rotary_pos_emb"] = modeling("llama").apply_rotary_pos_emb
    exec(source, namespace)
    return namespace


def test_a_rotation_called_outside_forward_is_found_wherever_the_class_keeps_the_method() -> None:
    """Qwen4-Exp's indexer rotates in a plain method of its own class; the check reads every method but forward
    (which patch_model patches), inherited, static, or under a functools.wraps decorator (torch.no_grad(), which
    hid the method's calls: accepted, it rotated with posenc's cos/sin in transformers' function), by the
    module-level functions it calls, not by an attribute that merely shares their prefix."""
    from posenc.interop._discover import _rotates_outside_forward

    found = _modeling_module(
        """
def _first(x):
    return x

class RotatesInForward(nn.Module):
    def forward(self, q, cos, sin):
        return apply_rotary_pos_emb(q, q, cos, sin)

    def scale(self, config):
        return config.apply_rotary_pos_emb_scale  # an attribute, not the function

class Helper(nn.Module):
    def select(self, q, cos, sin):
        return _first(apply_rotary_pos_emb(q, q, cos, sin))

class Inherits(Helper):
    def forward(self, x):
        return x

class Static(nn.Module):
    @staticmethod
    def select(q, cos, sin):
        return apply_rotary_pos_emb(q, q, cos, sin)

class Decorated(nn.Module):
    @torch.no_grad()
    def select(self, q, cos, sin):
        return apply_rotary_pos_emb(q, q, cos, sin)
"""
    )
    assert _rotates_outside_forward(found["RotatesInForward"]) is None
    for name, method in (
        ("Helper", "Helper"),
        ("Inherits", "Helper"),
        ("Static", "Static"),
        ("Decorated", "Decorated"),
    ):
        assert _rotates_outside_forward(found[name]) == f"{method}.select calls apply_rotary_pos_emb", name


def test_a_module_that_rotates_only_outside_its_forward_is_refused() -> None:
    """A submodule whose forward rotates nothing but whose helper does (called by the attention it sits in) would
    rotate with transformers' function and posenc's cos/sin: refused, though its class has no rotation to patch."""
    from posenc.interop._discover import find_rope_modules

    found = _modeling_module(
        """
class Indexer(nn.Module):
    def forward(self, x):
        return x

    def select(self, q, cos, sin):
        return apply_rotary_pos_emb(q, q, cos, sin)
"""
    )
    model = build("llama")
    find_rope_modules(model, "llama")  # as built: accepted
    model.model.layers[0].self_attn.indexer = found["Indexer"]()
    with pytest.raises(ValueError, match=r"its Indexer\.select calls apply_rotary_pos_emb outside forward"):
        find_rope_modules(model, "llama")


@pytest.mark.parametrize("tower", ["Vision", "Audio"])
def test_a_towers_rotary_embedding_is_left_to_the_tower(tower: str) -> None:
    """A multimodal model's vision or audio encoder (dots3_note's audio tower, Qwen2-VL's vision one) has a rotary
    embedding class of its own beside the text model's: only the text model's is patched. A second class that is no
    tower's is refused, naming both."""
    from posenc.interop._discover import find_rope_modules

    model = build("llama")
    text_rotary = type(model.model.rotary_emb)
    towered = type(f"Llama{tower}RotaryEmbedding", (text_rotary,), {})
    model.add_module("tower", nn.Module())
    model.tower.add_module("rotary_emb", towered(model.config))
    found = find_rope_modules(model, "llama")
    assert found.rotary_cls is text_rotary
    assert [name for name, _ in found.rotary] == ["model.rotary_emb"]
    other = type("LlamaSpeechRotaryEmbedding", (text_rotary,), {})
    model.tower.rotary_emb = other(model.config)
    with pytest.raises(ValueError, match=r"has 2 \(LlamaRotaryEmbedding, LlamaSpeechRotaryEmbedding\)"):
        find_rope_modules(model, "llama")
