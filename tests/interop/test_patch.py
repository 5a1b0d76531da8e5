"""patch_model / unpatch_model on tiny random transformers models of every supported architecture.

The models are built from configs here (no download) with initializer_range 0.3, so attention is peaked enough
for the rotation to matter: a 5% change of rope_theta moves the float32 logits by 0.08-0.9, while posenc and
transformers agree to ~1e-5. Each patched model is compared with an identical unpatched copy that goes through
the same calls (dynamic NTK keeps state between calls in transformers, and so does posenc's 'hf' mode).
"""

from __future__ import annotations

import contextlib
import copy
import functools
import gc
import importlib
import inspect
import json
import pickle
import sys
import textwrap
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import posenc
from posenc import RoPE
from posenc.interop import consistent as consistent_module
from posenc.interop import patch as patch_module
from posenc.interop import rope_from_config
from posenc.interop._discover import innermost
from posenc.interop.architectures import _WHOLE_HEAD_ATTENTION
from posenc.interop.patch import (
    SUPPORTED_ARCHITECTURES,
    PosencRotaryEmbedding,
    is_patched,
    patch_model,
    tiny_model_from_config,
    unpatch_model,
)
from posenc.testing import torch_threads

transformers = pytest.importorskip("transformers")

CONFIGS = Path(__file__).parents[1] / "fixtures" / "configs"
TRAINED = 16  # max_position_embeddings of the tiny models: prompts of 10 + 12 new tokens cross it
SIZES = dict(
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    intermediate_size=128,
    vocab_size=128,
    max_position_embeddings=TRAINED,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=None,
    initializer_range=0.3,
)
ARCH_SIZES: dict[str, dict[str, Any]] = {
    "llama": dict(num_key_value_heads=2),
    "mistral": dict(num_key_value_heads=2),
    "qwen2": dict(num_key_value_heads=2),
    "qwen3": dict(num_key_value_heads=2, head_dim=16),
    "phi3": dict(num_key_value_heads=2),
    "gpt_neox": dict(rotary_pct=0.5),  # partial rotary: 8 of 16 channels
    "gemma": dict(num_key_value_heads=2, head_dim=16),
}
ROTARY_PAIRS = {"gpt_neox": 4}  # others rotate all 16 channels: 8 pairs


def rope_case(arch: str, rope_type: str) -> dict[str, Any]:
    """Config keys for a rope_type on an architecture (trained length 16)."""
    partial = {"partial_rotary_factor": 0.5} if arch == "gpt_neox" else {}
    pairs = ROTARY_PAIRS.get(arch, 8)
    params: dict[str, Any] = {
        "default": {},
        "linear": {"factor": 2.0},
        "dynamic": {"factor": 2.0},
        "yarn": {"factor": 4.0, "original_max_position_embeddings": TRAINED},
        "llama3": {
            "factor": 4.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8,
        },
        "longrope": {
            "short_factor": [1.0 + i / 8 for i in range(pairs)],
            "long_factor": [2.0 + 3 * i for i in range(pairs)],
            "factor": 4.0,
        },
    }[rope_type]
    out: dict[str, Any] = {"rope_parameters": {"rope_type": rope_type, "rope_theta": 10000.0, **partial, **params}}
    if rope_type == "longrope":
        out["max_position_embeddings"] = 4 * TRAINED
        if arch == "phi3":  # Phi-3 keeps it at the top level
            out["original_max_position_embeddings"] = TRAINED
        else:
            out["rope_parameters"]["original_max_position_embeddings"] = TRAINED
    return out


def build(arch: str, rope_type: str = "default", **overrides: Any) -> Any:
    config = transformers.AutoConfig.for_model(arch, **{**SIZES, **ARCH_SIZES[arch], **rope_case(arch, rope_type)})
    for key, value in overrides.items():
        setattr(config, key, value)
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(config).eval()


def tokens(batch: int = 2, length: int = 28, seed: int = 0) -> torch.Tensor:
    return torch.randint(3, 128, (batch, length), generator=torch.Generator().manual_seed(seed))


def modeling(arch: str) -> Any:
    return importlib.import_module(f"transformers.models.{arch}.modeling_{arch}")


GENERATE = dict(max_new_tokens=12, do_sample=False, return_dict_in_generate=True, output_logits=True)
FP32 = dict(atol=1e-4, rtol=1e-4)  # float32 logits of magnitude ~10 after two layers: observed <= 1.4e-5


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    # Matmuls of 64 x 64: a second thread only adds synchronisation, which on a loaded 2-core runner costs ~20 ms
    # per op. Restored for the rest of the suite.
    with torch_threads(1):
        yield


# Every architecture with every rope_type its transformers config accepts (Phi-3: default and longrope only).
LOGIT_CASES = [
    (arch, rope_type)
    for arch in SUPPORTED_ARCHITECTURES
    for rope_type in (
        ("default", "longrope") if arch == "phi3" else ("default", "linear", "dynamic", "yarn", "llama3", "longrope")
    )
]


@pytest.mark.parametrize(("arch", "rope_type"), LOGIT_CASES)
def test_float32_logits_match_transformers(arch: str, rope_type: str) -> None:
    reference = build(arch, rope_type)
    patched = copy.deepcopy(reference)
    report = patch_model(patched)
    assert report.rope_type == rope_type and report.attention_modules == 2 and not report.config_changed
    ids = tokens()
    with torch.no_grad():
        for length in (10, 28, 20, 12):  # below, past, between and back below the trained length (dynamic NTK state)
            torch.testing.assert_close(patched(ids[:, :length]).logits, reference(ids[:, :length]).logits, **FP32)


# Greedy generation: every architecture, plus the types whose frequencies change while decoding.
GENERATE_CASES = [(arch, "default") for arch in SUPPORTED_ARCHITECTURES] + [
    ("llama", "dynamic"),
    ("llama", "longrope"),
    ("phi3", "longrope"),
    ("gpt_neox", "dynamic"),
    ("qwen2", "yarn"),
]


@pytest.mark.parametrize(("arch", "rope_type"), GENERATE_CASES)
@pytest.mark.parametrize("use_cache", [True, False])
def test_greedy_generation_matches_transformers(arch: str, rope_type: str, use_cache: bool) -> None:
    reference = build(arch, rope_type)
    patched = copy.deepcopy(reference)
    patch_model(patched)
    prompt = tokens(length=10)
    with torch.no_grad():
        expected = reference.generate(prompt, use_cache=use_cache, **GENERATE)
        got = patched.generate(prompt, use_cache=use_cache, **GENERATE)
    assert torch.equal(got.sequences, expected.sequences)
    torch.testing.assert_close(torch.stack(got.logits), torch.stack(expected.logits), **FP32)


# generate's other modes, where positions and caches move in other ways: beams reorder the cache, sampling expands
# the batch, speculative decoding feeds several tokens and crops the cache back after a rejected draft (here across
# the trained length, where dynamic NTK grows and LongRoPE switches factors), a static cache holds fixed slots.
GENERATE_MODES: dict[str, dict[str, Any]] = {
    "beam search": dict(num_beams=3),
    "beam sampling": dict(num_beams=2, do_sample=True),
    "sampling, 3 sequences each": dict(do_sample=True, num_return_sequences=3),
    "prompt lookup": dict(prompt_lookup_num_tokens=3),
    "assisted": dict(num_assistant_tokens=6, num_assistant_tokens_schedule="constant"),
    "static cache, beam search": dict(num_beams=2, cache_implementation="static"),
}


@pytest.mark.parametrize(("arch", "rope_type"), [("llama", "dynamic"), ("phi3", "longrope"), ("qwen2", "yarn")])
@pytest.mark.parametrize("mode", list(GENERATE_MODES))
def test_every_generate_mode_matches_transformers(arch: str, rope_type: str, mode: str) -> None:
    reference = build(arch, rope_type)
    patched = copy.deepcopy(reference)
    patch_model(patched)
    options = dict(GENERATE, output_scores=True, max_new_tokens=14, **GENERATE_MODES[mode])
    prompt = tokens(length=10)
    assistants = {}
    if mode in ("assisted", "prompt lookup"):  # one row; the assistant is another random model of the type
        prompt = prompt[:1]
        if mode == "assisted":
            torch.manual_seed(1)
            other = transformers.AutoModelForCausalLM.from_config(reference.config).eval()
            assistants = {id(reference): other, id(patched): copy.deepcopy(other)}
            patch_model(assistants[id(patched)])
    runs = []
    with torch.no_grad():
        for model in (reference, patched):
            torch.manual_seed(0)
            extra = {"assistant_model": assistants[id(model)]} if assistants else {}
            runs.append(model.generate(prompt, **options, **extra))
    expected, got = runs
    assert torch.equal(got.sequences, expected.sequences)
    for key in ("logits", "scores"):
        torch.testing.assert_close(torch.stack(getattr(got, key)), torch.stack(getattr(expected, key)), **FP32)


# Packed rows as transformers' DataCollatorWithFlattening makes them: documents end to end, position_ids restarting
# at 0, labels -100 at each document's first token. The model keeps documents apart only with no cache and no
# attention_mask (masking_utils' find_packed_sequence_indices): use_cache=False, as training sets it.
PACKED_CASES = [("llama", "dynamic", "consistent"), ("phi3", "longrope", "hf"), ("qwen2", "yarn", "hf")]


def packed_row(lengths: list[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(1, s) input ids, position ids restarting at each document, and labels."""
    ids = tokens(batch=1, length=sum(lengths), seed=1)
    positions = torch.cat([torch.arange(n) for n in lengths])[None]
    labels = ids.masked_fill(positions == 0, -100)
    return ids, positions, labels


@pytest.mark.parametrize(("arch", "rope_type", "mode"), PACKED_CASES)
def test_a_packed_row_gives_each_document_its_own_logits_and_the_unpatched_gradients(
    arch: str, rope_type: str, mode: str
) -> None:
    lengths = [5, 9, 7]  # each below the trained length of 16, the row of 21 past it
    reference = build(arch, rope_type).train()
    patched = copy.deepcopy(reference)
    patch_model(patched, mode=mode)
    ids, positions, labels = packed_row(lengths)
    runs = []
    for model in (reference, patched):
        out = model(input_ids=ids, position_ids=positions, labels=labels, use_cache=False)
        out.loss.backward()
        runs.append((out.logits.detach(), out.loss.detach(), {n: p.grad for n, p in model.named_parameters()}))
        with torch.no_grad():
            alone = torch.cat([model(part, use_cache=False).logits for part in ids.split(lengths, dim=1)], dim=1)
        torch.testing.assert_close(out.logits.detach(), alone, **FP32)
    (logits, loss, grads), (got_logits, got_loss, got_grads) = runs
    torch.testing.assert_close(got_logits, logits, **FP32)
    torch.testing.assert_close(got_loss, loss, **FP32)
    for name, grad in grads.items():
        torch.testing.assert_close(got_grads[name], grad, **FP32, msg=name)


@pytest.mark.parametrize("mode", ["hf", "consistent"])
def test_a_packed_row_scales_dynamic_ntk_for_its_longest_document_as_transformers_does(mode: str) -> None:
    # transformers scales for max(position_ids) + 1 of the call: the short document beside one of 20 turns with the
    # frequencies for 20, not with its own unscaled ones (the documented exception to packed == alone).
    reference = build("llama", "dynamic")
    patched = copy.deepcopy(reference)
    patch_model(patched, mode=mode)
    ids, positions, _ = packed_row([20, 5])
    with torch.no_grad():
        expected = reference(input_ids=ids, position_ids=positions, use_cache=False).logits
        got = patched(input_ids=ids, position_ids=positions, use_cache=False).logits
        alone = patched(ids[:, 20:], use_cache=False).logits
    torch.testing.assert_close(got, expected, **FP32)
    assert (got[:, 20:] - alone).abs().max() > 1e-2


@pytest.mark.parametrize("arch", SUPPORTED_ARCHITECTURES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_error_is_no_larger_than_transformers_own(arch: str, dtype: torch.dtype) -> None:
    # In bf16/fp16 both implementations round (transformers casts cos/sin to the model dtype, posenc rotates in
    # float32), and a random two-layer model amplifies any rounding; the fair bound is the error of each against
    # the float64 model. The mean error is the stable statistic (posenc's is at or below transformers' for every
    # case here); the max, one element of chaotic noise, gets a loose bound that still catches a wrong rotation.
    model = build(arch)
    ids = tokens()
    with torch.no_grad():
        exact = model.to(torch.float64)(ids).logits
        hf = model.to(dtype)(ids).logits.double()
        patch_model(model)
        ours = model(ids).logits.double()
    hf_error, our_error = (hf - exact).abs(), (ours - exact).abs()
    assert our_error.mean() <= 1.1 * hf_error.mean()
    assert our_error.max() <= 2.0 * hf_error.max()


@pytest.mark.parametrize("arch", SUPPORTED_ARCHITECTURES)
def test_transformers_rotary_code_is_not_called_after_patching(arch: str, monkeypatch: pytest.MonkeyPatch) -> None:
    mod = modeling(arch)
    rotary_cls = type(build(arch).get_decoder().rotary_emb)

    def refuse(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("transformers' rotary code was called")

    unpatched, patched = build(arch), build(arch)
    report = patch_model(patched)  # runs transformers' rotation once, to check which layout it rotates in
    assert report.rotary_modules
    for name in ("apply_rotary_pos_emb", "rotate_half"):
        monkeypatch.setattr(mod, name, refuse)
    monkeypatch.setattr(rotary_cls, "forward", refuse)
    # The patched forwards resolve globals in a copy of the module's namespace, made when patching: stub rotate_half
    # there too (apply_rotary_pos_emb there is posenc's).
    for module in patched.modules():
        function = module.__dict__.get(patch_module._FORWARD_ATTR)  # the patched copy of its class's forward
        if function is not None:
            namespace = innermost(function).__globals__
            assert namespace is not vars(mod)
            monkeypatch.setitem(namespace, "rotate_half", refuse)
    with torch.no_grad():
        with pytest.raises(AssertionError, match="rotary code was called"):
            unpatched(tokens())
        patched(tokens())
        patched.generate(tokens(length=4), max_new_tokens=3, do_sample=False)


def test_other_models_and_the_classes_are_untouched() -> None:
    mod = modeling("llama")
    class_forward, module_function = mod.LlamaAttention.forward, mod.apply_rotary_pos_emb
    bystander = build("llama")
    patched = copy.deepcopy(bystander)
    ids = tokens()
    with torch.no_grad():
        before = bystander(ids).logits
        patch_model(patched)
        patched(ids)
        after = bystander(ids).logits
    assert torch.equal(before, after)
    assert mod.LlamaAttention.forward is class_forward and mod.apply_rotary_pos_emb is module_function
    assert type(bystander.model.rotary_emb) is mod.LlamaRotaryEmbedding
    assert all("forward" not in layer.self_attn.__dict__ for layer in bystander.model.layers)
    assert isinstance(patched.model.rotary_emb, PosencRotaryEmbedding)


@pytest.mark.parametrize("backend", ["torch", "auto"])
def test_unpatch_restores_the_original_bit_for_bit(backend: str) -> None:
    model = build("llama", "dynamic")
    original_rotary, original_rope = model.model.rotary_emb, model.config.rope_parameters
    ids = tokens()
    with torch.no_grad():
        before = model(ids[:, :12]).logits
        patch_model(model, backend=backend, rope_parameters={"rope_type": "yarn", "factor": 4.0})
        assert is_patched(model) and model.config.rope_parameters["rope_type"] == "yarn"
        model(ids)
        report = unpatch_model(model)
        after = model(ids[:, :12]).logits
    assert report.rope_type == "yarn" and not is_patched(model)
    assert torch.equal(before, after)
    assert model.model.rotary_emb is original_rotary and model.config.rope_parameters is original_rope
    assert all("forward" not in layer.self_attn.__dict__ for layer in model.model.layers)


def test_a_replaced_type_does_not_reach_a_patched_model_and_says_so() -> None:
    """register_scaling(name, fn, replace=True) of the type a patched model uses: the model kept the frequencies it
    was patched with, silently, until a cast or device move (model.float(), model.to(...)) remade them with the
    replacement (logits up to 9 apart from the unpatched model's here), and a replacement registered as length
    dependent switched it to the new function at once. Now it keeps what patch_model checked against transformers
    (the model's config still names transformers' type), a deep copy too, and the replacement warns, naming them."""
    import posenc.rope.frequencies as fr
    import posenc.rope.parameters as pa
    from posenc.analysis.frequencies import EXAMPLE_ROPE_PARAMETERS
    from posenc.lab.config import EXTENSIONS
    from posenc.rope.scaling import WITHOUT_EXAMPLE

    def quarter(*, rotary_dim: int, base: float, factor: float, **_: Any) -> tuple[torch.Tensor, float]:
        return fr.default_inv_freq(rotary_dim, base) / (2 * factor), 1.0

    model = build("llama", "linear")
    reference = copy.deepcopy(model)
    ids = tokens(1, 12)
    patch_model(model)
    copied = copy.deepcopy(model)
    # What register_scaling writes, put back after (as tests/rope/test_register_scaling.py's fixture does).
    tables: list[Any] = [fr.SCALINGS, pa.REQUIRED_KEYS, pa.OPTIONAL_KEYS, EXAMPLE_ROPE_PARAMETERS, EXTENSIONS]
    tables += [fr.SEQ_LEN_DEPENDENT, WITHOUT_EXAMPLE]
    saved = [copy.copy(table) for table in tables]
    try:
        with torch.no_grad():
            expected = reference(ids).logits
            for seq_len_dependent in (False, True):
                with pytest.warns(UserWarning, match=r"2 rotary embedding\(s\) .* rope_type 'linear': they keep"):
                    posenc.register_scaling(
                        "linear", quarter, required=("factor",), seq_len_dependent=seq_len_dependent, replace=True
                    )
                for patched in (model, copied, model.float(), copied.to("cpu")):
                    torch.testing.assert_close(patched(ids).logits, expected, **FP32)
        # The RoPE the rotary embedding holds gives the new function's, as every posenc RoPE does.
        assert float(model.model.rotary_emb.rope.frequencies()[0][1]) == pytest.approx(10000.0 ** (-2 / 16) / 4)
    finally:
        for table, before in zip(tables, saved, strict=True):
            table.clear()
            table.update(before)


def test_a_rotary_embedding_pickled_without_its_checked_frequencies_takes_its_buffers() -> None:
    """One pickled by a posenc before 2026-12-06 has no _checked_inv_freq: unpickled, it takes its float64 buffers
    as those (what it rotated with), counts among the live ones register_scaling warns of, and keeps them through a
    cast."""
    from posenc.interop.rotary import patched_with

    module = PosencRotaryEmbedding(RoPE(16, rope_parameters={"rope_type": "linear", "factor": 2.0}))
    ids = torch.arange(5)[None]
    expected = module(torch.zeros(1), ids)
    del module._checked_inv_freq, module._length_dependent  # as such a posenc pickled it
    loaded = pickle.loads(pickle.dumps(module))
    assert loaded in patched_with("linear") and loaded._checked_inv_freq[""].dtype == torch.float64
    for got, want in zip(loaded.float()(torch.zeros(1), ids), expected, strict=True):
        assert torch.equal(got, want)


def _hook_as_accelerate_does(module: torch.nn.Module, calls: list[str]) -> None:
    """accelerate.hooks.add_hook_to_module's mechanics (which dispatch_model, cpu_offload and from_pretrained's
    device_map use): the module's forward kept in _old_forward, ``forward`` a wrapper that runs the hook (here: records
    a call) around it. accelerate is no dependency of posenc; its hooks are these few lines."""
    if not (hasattr(module, "_hf_hook") and hasattr(module, "_old_forward")):
        module._old_forward = module.forward
    module._hf_hook = "hook"

    def new_forward(module: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
        calls.append("hook")
        return module._old_forward(*args, **kwargs)

    module.forward = functools.update_wrapper(functools.partial(new_forward, module), module._old_forward)


def _unhook_as_accelerate_does(module: torch.nn.Module) -> None:
    """accelerate.hooks.remove_hook_from_module's mechanics."""
    del module._hf_hook
    module.forward = module._old_forward
    del module._old_forward


def test_an_accelerate_hook_added_before_patching_keeps_running_and_can_be_removed() -> None:
    """patch_model replaced the hook's wrapper in ``forward``: the hook (device alignment, offloaded weights) stopped
    running without a word, and removing it put back the class's forward, which failed in a shape mismatch on
    posenc's cos/sin."""
    reference, model = build("llama", "yarn"), build("llama", "yarn")
    attention, calls, ids = model.model.layers[0].self_attn, [], tokens()
    _hook_as_accelerate_does(attention, calls)
    with torch.no_grad():
        expected, before = reference(ids).logits, model(ids).logits
        with warnings.catch_warnings():  # the hook's wrapper is kept: nothing to warn of
            warnings.simplefilter("error")
            patch_model(model)
        calls.clear()
        torch.testing.assert_close(model(ids).logits, expected, **FP32)
        assert calls == ["hook"]
        _unhook_as_accelerate_does(attention)
        torch.testing.assert_close(model(ids).logits, expected, **FP32)
        unpatch_model(model)
        assert torch.equal(model(ids).logits, before)


@pytest.mark.parametrize("arch", ["gpt_neox", "phi3", "llama"])
def test_a_patched_layer_refuses_transformers_cos_sin_by_their_width(arch: str) -> None:
    """A layer given transformers' position_embeddings (one cos per channel, made before patching or by the model's
    own rotary class) rotated 2 * rotary_dim channels at the wrong angles where they fit the head (GPT-NeoX and
    Phi-3 at a partial rotary factor of 1/2), without an error; posenc's own (one per pair) are taken as before."""
    model = build(arch) if arch == "llama" else build_partial(arch)
    theirs = copy.deepcopy(model.base_model.rotary_emb)
    assert patch_model(model).rotary_dim == (16 if arch == "llama" else 8)
    layer, rotary = model.base_model.layers[0], model.base_model.rotary_emb
    h, ids = torch.randn(1, 6, 64), torch.arange(6)[None]
    pairs = rotary(h, ids)[0].shape[-1]
    with torch.no_grad(), pytest.raises(ValueError, match=rf"width {2 * pairs}, but posenc's rotation takes one value"):
        layer(h, position_embeddings=theirs(h, ids), position_ids=ids)
    with torch.no_grad():
        layer(h, position_embeddings=rotary(h, ids), position_ids=ids)
    unpatch_model(model)
    assert not hasattr(layer.self_attn if hasattr(layer, "self_attn") else layer.attention, patch_module.PAIRS_ATTR)
    with torch.no_grad():
        layer(h, position_embeddings=theirs(h, ids), position_ids=ids)


def test_an_accelerate_hook_added_after_patching_outlives_unpatch() -> None:
    """unpatch_model removed the hook's wrapper from ``forward``, so the hook stopped running; removing it afterwards
    put back posenc's forward on the unpatched model, which refused transformers' cos/sin."""
    model = build("llama", "yarn")
    attention, calls, ids = model.model.layers[0].self_attn, [], tokens()
    with torch.no_grad():
        before = model(ids).logits
        patch_model(model)
        _hook_as_accelerate_does(attention, calls)
        unpatch_model(model)
        calls.clear()
        assert torch.equal(model(ids).logits, before)
        assert calls == ["hook"]
        _unhook_as_accelerate_does(attention)
        assert torch.equal(model(ids).logits, before)


def test_a_model_whose_accelerate_hook_was_removed_patches_again_without_a_warning() -> None:
    """accelerate's remove_hook_from_module leaves the class's forward bound on the instance (the _old_forward it
    kept): patching again warned that the forward was set on the instance and would be bypassed, though it calls
    nothing more than the class's forward."""
    model = build("llama", "yarn")
    reference = build("llama", "yarn")
    attention, calls, ids = model.model.layers[0].self_attn, [], tokens()
    _hook_as_accelerate_does(attention, calls)
    patch_model(model)
    unpatch_model(model)
    _unhook_as_accelerate_does(attention)
    assert "forward" in attention.__dict__  # the bound class forward, as accelerate leaves it
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        patch_model(model)
        patch_model(reference)
    with torch.no_grad():
        assert torch.equal(model(ids).logits, reference(ids).logits)
    unpatch_model(model)
    assert attention.forward.__func__ is type(attention).forward


def test_an_instance_forward_that_is_not_accelerates_is_named_when_patching_bypasses_it() -> None:
    """A wrapper set as an attention module's instance forward (a profiler, a logger) stopped running while patched,
    without a word: patching warns, naming the module and the hook that would keep running, and unpatch_model puts the
    wrapper back."""
    model = build("llama", "yarn")
    attention, calls, ids = model.model.layers[1].self_attn, [], tokens()
    original = attention.forward

    def logged(*args, **kwargs):
        calls.append("wrapper")
        return original(*args, **kwargs)

    attention.forward = logged
    with pytest.warns(UserWarning, match=r"model\.model\.layers\.1\.self_attn\.forward is set on the instance"):
        patch_model(model)
    with torch.no_grad():
        model(ids)
        assert calls == []
        unpatch_model(model)
        model(ids)
    assert calls == ["wrapper"] and attention.forward is logged


def test_an_attention_module_running_another_layers_forward_is_warned_of_when_patching() -> None:
    """An attention module whose instance forward is another layer's (its class's forward, bound to that layer) runs
    that layer's weights. Unlike the module's own class forward that accelerate's remove_hook_from_module leaves, it
    changes the numbers: patching bypasses it, so it warns, and unpatch_model puts it back."""
    model = build("llama")
    first, second = (layer.self_attn for layer in model.model.layers)
    first.forward = second.forward
    with pytest.warns(UserWarning, match=r"model\.model\.layers\.0\.self_attn\.forward is set on the instance"):
        patch_model(model)
    unpatch_model(model)
    assert first.forward.__self__ is second


def _offload_as_accelerate_does(model: torch.nn.Module) -> None:
    """accelerate's cpu_offload, in effect: every parameter on the meta device but while its module runs (buffers
    stay where they are)."""
    for module in model.modules():
        weights = {name: p for name, p in module._parameters.items() if p is not None}
        if not weights:
            continue

        def load(module: torch.nn.Module, args: Any, weights: dict = weights) -> None:
            module._parameters.update(weights)

        def unload(module: torch.nn.Module, args: Any, output: Any, weights: dict = weights) -> None:
            for name, p in weights.items():
                module._parameters[name] = torch.nn.Parameter(p.to("meta"), requires_grad=p.requires_grad)

        module.register_forward_pre_hook(load)
        module.register_forward_hook(unload)
        unload(module, (), None)


def test_an_offloaded_model_computes_cos_sin_where_its_rotary_module_did() -> None:
    """posenc's rotary module went to the first parameter's device, the meta device in an offloaded model, and
    every forward failed ("Cannot copy out of meta tensor")."""
    reference, model = build("llama", "yarn"), build("llama", "yarn")
    _offload_as_accelerate_does(model)
    assert next(model.parameters()).is_meta
    ids = tokens()
    with torch.no_grad():
        expected = reference(ids).logits
        torch.testing.assert_close(model(ids).logits, expected)  # the emulation runs the model as it was
        patch_model(model)
        assert model.model.rotary_emb.inv_freq.device.type == "cpu"
        torch.testing.assert_close(model(ids).logits, expected, **FP32)


def test_a_model_on_the_meta_device_gets_its_rotary_module_there() -> None:
    """Built on meta (shape inference, a model not materialised yet), posenc's rotary module goes where the model's
    is, not to the CPU: its buffers sit with the model's."""
    with torch.device("meta"):
        model = build("llama", "yarn")
    patch_model(model)
    assert [buffer.device.type for buffer in model.model.rotary_emb.buffers()] == ["meta"]
    with torch.no_grad():
        logits = model(tokens().to("meta")).logits
    assert logits.is_meta and logits.shape == (2, 28, model.config.vocab_size)


def test_a_forward_set_on_the_instance_while_patched_is_dropped_by_unpatch() -> None:
    """A wrapper set on an attention module after patch_model calls posenc's forward, which the unpatched model's
    rotary module cannot serve: unpatch_model puts back the class's forward, as before posenc."""
    model = build("llama", "yarn")
    attention, ids = model.model.layers[0].self_attn, tokens()
    with torch.no_grad():
        before = model(ids).logits
        patch_model(model)
        patched = attention.forward
        attention.forward = lambda *args, **kwargs: patched(*args, **kwargs)
        unpatch_model(model)
        assert "forward" not in attention.__dict__
        assert torch.equal(model(ids).logits, before)


class _Forwarding(torch.nn.Module):
    """A wrapper as peft's PeftModel (and its LoraModel inside) is, in what matters here: the model is a submodule,
    and attribute look-ups the wrapper cannot answer go to it."""

    def __init__(self, model: torch.nn.Module, name: str) -> None:
        super().__init__()
        self.name = name
        self.add_module(name, model)

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            inner = self._modules.get(self.__dict__["name"])
            if inner is None:  # add_module asks before the model is in
                raise
            return getattr(inner, name)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self._modules[self.name](*args, **kwargs)


def test_a_wrapper_of_a_patched_model_is_not_taken_for_it() -> None:
    """get_peft_model(patched model): the wrapper answered with the wrapped model's patch, so is_patched said True,
    patch_model said to call unpatch_model(wrapper), and unpatch_model(wrapper) failed half-way on an AttributeError
    (the patch's module names are the wrapped model's)."""
    model = build("llama", "yarn")
    ids = tokens()
    with torch.no_grad():
        before = model(ids).logits
    patch_model(model)
    wrapper = _Forwarding(_Forwarding(model, "model"), "base_model")
    assert not is_patched(wrapper) and is_patched(model)
    with pytest.raises(ValueError, match=r"model\.base_model\.model is already patched"):
        patch_model(wrapper)
    with pytest.raises(ValueError, match=r"but model\.base_model\.model is: call unpatch_model\(model\.base_model"):
        unpatch_model(wrapper)
    unpatch_model(model)
    with torch.no_grad():
        assert torch.equal(wrapper(ids).logits, before)


def test_the_model_inside_a_patched_wrapper_says_where_the_patch_is() -> None:
    model = build("llama")
    wrapper = _Forwarding(_Forwarding(model, "model"), "base_model")
    patch_model(wrapper)
    assert not is_patched(model)
    with pytest.raises(ValueError, match=r"model\.model\.rotary_emb is posenc's rotary embedding: model is part of"):
        unpatch_model(model)
    unpatch_model(wrapper)
    assert not isinstance(model.model.rotary_emb, PosencRotaryEmbedding)


def test_a_patched_model_refuses_pickling_and_copies_as_patched() -> None:
    """Pickle stores the per-instance attention forwards by name: a torch.save'd patched model loaded with the
    class's own forward beside posenc's rotary module, said it was patched, and failed in a shape mismatch at its
    first call. Pickling is refused with the way out; copy.deepcopy (which keeps the forwards) and copy.copy work,
    and a model pickled after unpatching loads as the original."""
    import io
    import pickle

    model = build("llama")
    ids = tokens()
    with torch.no_grad():
        before = model(ids).logits
        patch_model(model)
        patched = model(ids).logits
    saves = [lambda: torch.save(model, io.BytesIO()), lambda: pickle.dumps(model)]
    saves += [lambda: pickle.dumps(model.model), lambda: pickle.dumps(model.model.layers[0].self_attn)]  # its parts
    for save in saves:
        with pytest.raises(TypeError, match=r"cannot be pickled.*call patch_model again where it is loaded"):
            save()
    twin, shallow = copy.deepcopy(model), copy.copy(model)
    assert is_patched(twin) and is_patched(shallow)
    with torch.no_grad():
        assert torch.equal(twin(ids).logits, patched)
        unpatch_model(twin)
        assert torch.equal(twin(ids).logits, before)
    unpatch_model(model)
    pickle.dumps(model.model.layers[0].self_attn)
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    with torch.no_grad():
        assert torch.equal(torch.load(buffer, weights_only=False)(ids).logits, before)


@contextlib.contextmanager
def _without_the_cycle_collector() -> Iterator[None]:
    """Only reference counting frees objects inside: what a reference cycle holds stays alive."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


@pytest.mark.parametrize("mode", ["hf", "consistent"])
def test_a_patched_model_dropped_frees_its_attention_weights_without_the_cycle_collector(mode: str) -> None:
    """Each patched attention module held its forward as a bound method (module -> forward -> module), a reference
    cycle: a patched model dropped without unpatch_model kept every layer's q/k/v/o projections alive until Python's
    cyclic collector ran, where an unpatched model's are freed at ``del`` (a server swapping models, or a
    ``del model; torch.cuda.empty_cache()``, kept the weights on the GPU). A deep copy's forwards stay its own."""
    import inspect
    import weakref

    model = build("llama", "dynamic")
    patch_model(model, mode=mode)
    twin = copy.deepcopy(model)
    attention = twin.model.layers[0].self_attn
    assert attention.forward.__self__ is attention  # bound to the copy, not to the model it was copied from
    unbound = inspect.signature(type(attention).forward).parameters
    assert list(inspect.signature(attention.forward).parameters) == list(unbound)[1:]  # as a bound method's
    ids = tokens()
    with torch.no_grad():
        torch.testing.assert_close(twin(ids).logits, model(ids).logits, **FP32)
    weights = [weakref.ref(layer.self_attn.q_proj.weight) for layer in model.model.layers]
    with _without_the_cycle_collector():
        del model
        assert all(weight() is None for weight in weights)
    with torch.no_grad():
        twin(ids)  # the copy runs on, unaffected


def test_a_patched_attention_module_keeps_its_class_name_signature_and_calls_itself_from_a_copy() -> None:
    """A patched attention module gets a subclass of its class, under the same name, whose forward is a bound method
    with the class forward's signature. Its forward held the module it was made for (weakly), so a copy that shares
    the module's __dict__ (a DataParallel replica, which copies it) ran the original module, its weights and device;
    the copy's own weights now run (here: a zero output projection gives zeros)."""
    import inspect
    import types

    mod = modeling("llama")
    model = build("llama")
    attention = model.model.layers[0].self_attn
    expected = inspect.signature(attention.forward)
    patch_model(model)
    replica = attention._replicate_for_data_parallel()
    replica.o_proj = torch.nn.Linear(64, 64, bias=False)
    torch.nn.init.zeros_(replica.o_proj.weight)
    hidden, positions = torch.randn(1, 5, 64), torch.arange(5)[None]
    with torch.no_grad():
        cos_sin = model.model.rotary_emb(hidden, positions)
        assert not attention(hidden, cos_sin, attention_mask=None)[0].eq(0).all()
        assert replica(hidden, cos_sin, attention_mask=None)[0].eq(0).all()
    assert isinstance(attention, mod.LlamaAttention) and type(attention) is not mod.LlamaAttention
    assert (type(attention).__name__, type(attention).__qualname__) == ("LlamaAttention", "LlamaAttention")
    assert type(attention.forward) is types.MethodType and attention.forward.__self__ is attention
    assert inspect.signature(attention.forward) == expected
    assert copy.copy(attention.forward) == attention.forward
    unpatch_model(model)
    assert type(attention) is mod.LlamaAttention and "_posenc_forward" not in attention.__dict__
    with torch.no_grad():
        before = model(tokens()).logits
        patch_model(model)
        # A subclass of the patched class, as FSDP2's fully_shard makes: unpatched, it runs the class's forward.
        attention.__class__ = type("FSDPLlamaAttention", (type(attention),), {})
        unpatch_model(model)
        assert torch.equal(model(tokens()).logits, before)


class _Sharded:
    """FSDP2's FSDPModule, emulated: ``_shard`` puts it first among a module's bases, as ``fully_shard`` does. A
    sharded module pickles as the class it wraps (FSDP2's own are not found by name: pickle refuses them)."""

    def unshard(self) -> str:
        return "unshard"

    def __reduce__(self) -> Any:
        return _unsharded, (type(self).__mro__[2], self.__dict__)


def _unsharded(cls: type, state: dict[str, Any]) -> Any:
    module = cls.__new__(cls)
    module.__dict__.update(state)
    return module


def _no_deepcopy(*args: Any) -> Any:
    raise AssertionError("FSDP does not support deepcopy")


_SHARDED: dict[type, type] = {}


def _shard(module: torch.nn.Module) -> None:
    """What FSDP2's fully_shard does to a module's class (torch.distributed.fsdp's _apply_to_module): one subclass
    per class, the mixin first."""
    cls = type(module)
    if cls not in _SHARDED:
        _SHARDED[cls] = type(f"FSDP{cls.__name__}", (_Sharded, cls), {"__deepcopy__": _no_deepcopy})
    module.__class__ = _SHARDED[cls]


def test_attention_sharded_as_fsdp2_does_unpatches_to_the_sharded_original_class_and_patches_again() -> None:
    """FSDP2's fully_shard gives a module a subclass of its class (FSDP<name>, FSDPModule first). Made of posenc's
    patched class, it stayed when the model was unpatched: the numbers were the original's, but pickling was refused
    as patched, and patch_model again failed with "no module ... rotates by calling a module-level
    apply_rotary_pos_emb* function". Now such a module is unpatched to the same subclass made of the original class
    (one for all its modules, the wrapper's methods kept); a model sharded before patching unpatches to its sharded
    class. A subclass whose method calls super() cannot be made again: it runs the original forward."""
    import pickle

    llama_attention = modeling("llama").LlamaAttention
    model = build("llama")
    attention = [layer.self_attn for layer in model.model.layers]
    ids = tokens()
    with torch.no_grad():
        before = model(ids).logits
        patch_model(model)
        patched = model(ids).logits
        for module in attention:
            _shard(module)
        unpatch_model(model)
        assert torch.equal(model(ids).logits, before)
        sharded = type(attention[0])
        assert all(type(module) is sharded for module in attention)
        assert sharded.__mro__[1:3] == (_Sharded, llama_attention) and sharded.__name__ == "FSDPLlamaAttention"
        assert vars(sharded)["__deepcopy__"] is _no_deepcopy and attention[0].unshard() == "unshard"
        assert torch.equal(pickle.loads(pickle.dumps(model))(ids).logits, before)
        patch_model(model)
        assert torch.equal(model(ids).logits, patched)
        unpatch_model(model)
        assert all(type(module) is sharded for module in attention)

        other = build("llama")
        for layer in other.model.layers:
            _shard(layer.self_attn)
        patch_model(other)
        assert torch.equal(other(ids).logits, patched)
        unpatch_model(other)
        assert all(type(layer.self_attn) is _SHARDED[llama_attention] for layer in other.model.layers)
        assert torch.equal(other(ids).logits, before)

        patch_model(other)
        first = other.model.layers[0].self_attn

        class Wrapped(type(first)):  # type: ignore[misc]
            def forward(self, *args: Any, **kwargs: Any) -> Any:
                return super().forward(*args, **kwargs)

        first.__class__ = Wrapped
        unpatch_model(other)
        assert type(first) is Wrapped and patch_module._unpatched_class(Wrapped, _SHARDED[llama_attention]) is None
        assert torch.equal(other(ids).logits, before)
        # ... and patching it again says so, where it said no module rotates by a known function.
        with pytest.raises(ValueError, match=r"is of class .*Wrapped, made from posenc's patched .*give the module a"):
            patch_model(other)


def _calls_super_through(kind: str, patched: type) -> type:
    """A subclass of ``patched`` made after patching, one attribute of which (of ``kind``) calls super()."""
    if kind == "property":

        class Made(patched):  # type: ignore[misc,valid-type]
            @property
            def heads(self) -> bool:
                return super().forward is not None

    else:

        class Made(patched):  # type: ignore[misc,valid-type,no-redef]
            @classmethod
            def heads(cls) -> bool:
                return super().forward is not None

    return Made


@pytest.mark.parametrize("kind", ["property", "classmethod"])
def test_a_class_made_of_a_patched_one_whose_property_or_classmethod_calls_super_keeps_its_class(kind: str) -> None:
    """Made again on the original class, a property's or classmethod's super() (bound to the class made after
    patching, which the remade class is not) would raise TypeError; such a class is kept, running the original
    forward."""
    model = build("llama")
    ids = tokens()
    with torch.no_grad():
        before = model(ids).logits
        patch_model(model)
        first = model.model.layers[0].self_attn
        made = _calls_super_through(kind, type(first))
        first.__class__ = made
        unpatch_model(model)
        assert type(first) is made
        assert (first.heads if kind == "property" else first.heads()) is True  # its super() finds its class
        assert torch.equal(model(ids).logits, before)


def test_classes_made_of_a_patched_one_are_made_again_on_the_original_under_their_own_names() -> None:
    """A subclass of a subclass of the patched class: both are made again on the original (not the outer one on
    the patched inner one, which kept the patched forward), each with its name, qualname, module and attributes."""
    llama_attention = modeling("llama").LlamaAttention
    model = build("llama")
    ids = tokens()
    with torch.no_grad():
        before = model(ids).logits
        patch_model(model)
        first = model.model.layers[0].self_attn

        class Tagged(type(first)):  # type: ignore[misc]
            tag = "mine"

        class Outer(Tagged):
            pass

        first.__class__ = Outer
        unpatch_model(model)
        assert torch.equal(model(ids).logits, before)
    outer = type(first)
    (inner,) = outer.__bases__
    assert inner.__bases__ == (llama_attention,) and outer.tag == "mine"
    for made, was in ((outer, Outer), (inner, Tagged)):
        assert made is not was
        assert (made.__name__, made.__qualname__, made.__module__) == (was.__name__, was.__qualname__, __name__)


def test_a_patched_attention_module_put_into_another_model_is_refused() -> None:
    """A copy of a patched model's attention module put into another model: patch_model patched that model's other
    layers and left the copy running the first model's patch, reporting one attention module fewer."""
    import copy

    model = build("llama")
    patch_model(model)
    other = build("llama")
    other.model.layers[0].self_attn = copy.deepcopy(model.model.layers[0].self_attn)
    with pytest.raises(ValueError, match=r"model.model.layers.0.self_attn is an attention module of a model that"):
        patch_model(other)


def test_two_attention_classes_of_one_module_each_keep_their_own_patched_forward() -> None:
    """The patched forwards are kept per attention class: a second class with a forward of its own in the same
    modeling module (the same globals, the same rotations) gets a copy of its own forward, not the first class's."""
    modeling_llama = modeling("llama")
    llama_attention = modeling_llama.LlamaAttention
    source = textwrap.dedent(inspect.getsource(llama_attention.forward))
    source = "\n".join(line for line in source.splitlines() if not line.startswith("@"))
    assert source.count("attn_output = self.o_proj(attn_output)") == 1
    source = source.replace("attn_output = self.o_proj(attn_output)", "attn_output = 2 * self.o_proj(attn_output)")
    made: dict[str, Any] = {}
    exec(compile(source, modeling_llama.__file__, "exec"), modeling_llama.__dict__, made)  # its globals: the module's
    doubled = type("LlamaAttention", (llama_attention,), {"forward": made["forward"]})
    patch_model(build("llama"))  # LlamaAttention's patched forward made first
    model = build("llama")
    for layer in model.model.layers:
        layer.self_attn.__class__ = doubled
    with torch.no_grad():
        expected = model(tokens()).logits
        patch_model(model)
        torch.testing.assert_close(model(tokens()).logits, expected, **FP32)


@pytest.mark.parametrize(("mode", "rope_type"), [("hf", "default"), ("consistent", "dynamic")])
def test_an_attention_class_made_again_is_freed_with_its_models(mode: str, rope_type: str) -> None:
    """posenc kept what it made of each attention class it patched (the patched subclass, the patched forwards, whose
    globals copy the modeling module's) in dicts of its own keyed by the class: a class made again and again (a
    trust_remote_code model loaded again) stayed alive for good, with its modeling module. Now that lives on the
    class, which is freed with the models that used it, patched or unpatched."""
    import weakref

    llama_attention = modeling("llama").LlamaAttention
    classes = []
    for unpatch in (False, True, False, True):
        model = build("llama", rope_type)
        cls = type("LlamaAttention", (llama_attention,), {})  # made again, as a reloaded module makes it
        for attention in [layer.self_attn for layer in model.model.layers]:
            attention.__class__ = cls
        patch_model(model, mode=mode)
        if unpatch:
            unpatch_model(model)
        classes.append(weakref.ref(cls))
        del model, cls, attention
    gc.collect()
    assert [cls() for cls in classes] == [None] * 4


def test_a_patched_base_model_dropped_frees_its_weights_and_its_copy_unpatches_itself() -> None:
    """A base model (``AutoModel``: LlamaModel, as embedding servers load it) holds its rotary module itself, and
    the patch's state, kept on the model, held that parent: model -> state -> model, a cycle that kept the whole
    model alive past ``del`` until Python's cyclic collector ran. A deep copy unpatched restores its own modules."""
    import weakref

    model = build("llama").model
    ids = tokens()
    with torch.no_grad():
        before = model(ids).last_hidden_state
        patch_model(model)
        patched = model(ids).last_hidden_state
        twin = copy.deepcopy(model)
        unpatch_model(twin)
        assert torch.equal(twin(ids).last_hidden_state, before)
        assert torch.equal(model(ids).last_hidden_state, patched) and is_patched(model)
    assert isinstance(model.rotary_emb, PosencRotaryEmbedding) and not isinstance(
        twin.rotary_emb, PosencRotaryEmbedding
    )
    weights = [weakref.ref(model), weakref.ref(model.embed_tokens.weight)]
    with _without_the_cycle_collector():
        del model
        assert all(weight() is None for weight in weights)


def test_a_shallow_copy_unpatched_leaves_the_model_it_shares_modules_with_unpatched_and_saying_so() -> None:
    """copy.copy of a patched model shares its modules (and the patch's state): unpatching the copy unpatched both,
    but the original still said it was patched, patch_model refused it as "already patched", and unpatch_model
    failed inside torch (AttributeError: 'LlamaRotaryEmbedding' object has no attribute 'device')."""
    model = build("llama")
    ids = tokens()
    with torch.no_grad():
        before = model(ids).logits
        patch_model(model)
        shallow = copy.copy(model)
        unpatch_model(shallow)
        assert not is_patched(model) and not is_patched(shallow)
        assert torch.equal(model(ids).logits, before)
        with pytest.raises(ValueError, match=r"not patched by posenc.*copy\.copy that shares its modules"):
            unpatch_model(model)
        patch_model(model)  # and patched again as any unpatched model
        assert is_patched(model)
        unpatch_model(model)
        assert torch.equal(model(ids).logits, before)


def test_unpatch_after_a_dtype_cast_gives_the_model_that_cast_would_have_given() -> None:
    """The original rotary module was outside the model while patched, so model.to(bf16) did not cast its inv_freq;
    unpatching casts it as the cast would have (logits differed by 0.004 from the never-patched model)."""
    patched, plain = build("llama"), build("llama")
    patch_model(patched)
    patched.to(torch.bfloat16)
    unpatch_model(patched)
    plain.to(torch.bfloat16)
    assert patched.model.rotary_emb.inv_freq.dtype == plain.model.rotary_emb.inv_freq.dtype == torch.bfloat16
    with torch.no_grad():
        assert torch.equal(patched(tokens()).logits, plain(tokens()).logits)


def test_a_llama3_band_whose_float32_weight_carries_the_wavelength_error_is_patched() -> None:
    """Found by fuzzing against transformers: factor 54 with a band from 2.0 to 3.0 puts transformers' float32 buffer
    3.8e-5 from the exact frequencies (its smoothing weight is computed from the float32 wavelength), past the bound
    patch_model allowed then; posenc computes them exactly, and the model is patched with the same logits."""
    params = {
        "rope_type": "llama3",
        "rope_theta": 166987.17831486475,
        "partial_rotary_factor": 0.78,
        "factor": 54.262220249815925,
        "low_freq_factor": 2.006988697254886,
        "high_freq_factor": 3.0,
        "original_max_position_embeddings": 8192,
    }
    config = transformers.PhiConfig(  # Phi rotates the first 78 of its 100 channels, as the config says
        hidden_size=200,
        num_attention_heads=2,
        num_key_value_heads=2,
        intermediate_size=64,
        num_hidden_layers=1,
        vocab_size=128,
        max_position_embeddings=8192 * 54,
        rope_parameters=params,
    )
    torch.manual_seed(0)
    model = transformers.PhiForCausalLM(config).eval()
    ours = RoPE(100, rope_parameters=dict(params), max_position_embeddings=8192 * 54).frequencies()[0]
    assert ours.numel() == 39
    theirs = model.model.rotary_emb.inv_freq.double()
    assert ((ours - theirs).abs() / ours).max() > 3e-5  # the case: far past the pow's (ln(base) + 8) * 2^-24
    patched = copy.deepcopy(model)
    patch_model(patched)
    with torch.no_grad():
        torch.testing.assert_close(patched(tokens()).logits, model(tokens()).logits, **FP32)


def test_frequencies_stay_float64_through_dtype_casts() -> None:
    model = build("llama")
    patch_model(model)
    model.to(torch.bfloat16)
    assert model.model.rotary_emb.inv_freq.dtype == torch.float64
    assert model.model.embed_tokens.weight.dtype == torch.bfloat16


def test_a_float64_model_gets_float64_cos_sin_from_float64_angles() -> None:
    """Far from 0 (position 4093), float32 cos/sin would be off by ~1e-4; a float64 model gets the exact values."""
    model = build("llama").double()
    patch_model(model)
    positions = torch.tensor([[0, 1000, 4093]])
    cos, sin = model.model.rotary_emb(torch.zeros(1, 3, 8, dtype=torch.float64), positions)
    angles = positions[..., None].double() * model.model.rotary_emb.inv_freq  # (1, 3, r/2): one per pair
    assert cos.dtype == sin.dtype == torch.float64
    torch.testing.assert_close(cos, angles.cos(), rtol=0, atol=1e-12)
    torch.testing.assert_close(sin, angles.sin(), rtol=0, atol=1e-12)


NEW_SCALINGS = [
    ("llama", {"rope_type": "yarn", "factor": 4.0}),
    ("llama", {"rope_type": "dynamic", "factor": 2.0}),
    ("llama", {"rope_type": "linear", "factor": 2.0, "rope_theta": 50000.0}),
    ("llama", {"rope_type": "ntk", "factor": 4.0}),  # posenc-only: written as default with a larger rope_theta
    # The legacy spelling of rope_type; beta_fast moves the ramp only where the original length is well past 2 pi 32.
    ("qwen2", {"type": "yarn", "factor": 4.0, "beta_fast": 16.0, "original_max_position_embeddings": 4096}),
    ("gpt_neox", {"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0}),
    ("phi3", rope_case("phi3", "longrope")["rope_parameters"] | {"original_max_position_embeddings": 8}),
]


# The qwen2 case's original length is past the tiny model's 16 positions: the mismatch warning is expected there.
@pytest.mark.filterwarnings(r"ignore:rope_parameters\['factor'\]=.* differs from max_position_embeddings")
@pytest.mark.parametrize(("arch", "rope_parameters"), NEW_SCALINGS)
def test_new_scaling_survives_save_and_plain_reload(arch: str, rope_parameters: dict, tmp_path: Path) -> None:
    model = build(arch)
    ids = tokens()
    with torch.no_grad():
        original = model(ids).logits
        report = patch_model(model, rope_parameters=rope_parameters)
        patched = model(ids).logits
        model.save_pretrained(tmp_path)
        reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
        plain = reloaded(ids).logits
    assert report.config_changed
    written = json.loads((tmp_path / "config.json").read_text())["rope_parameters"]
    asked = rope_parameters.get("rope_type", rope_parameters.get("type"))
    expected_type = "default" if asked == "ntk" else asked
    assert written["rope_type"] == expected_type and report.rope_parameters["rope_type"] == expected_type
    assert type(reloaded.get_decoder().rotary_emb) is type(build(arch).get_decoder().rotary_emb)
    assert (patched - original).abs().max() > 1e-2  # the scaling changed the model
    torch.testing.assert_close(patched, plain, **FP32)


def test_new_longrope_factors_keep_phi3s_top_level_original_length() -> None:
    """Phi-3-128k keeps original_max_position_embeddings at the top level, which its config class copies over the
    rope dict's. New LongRoPE factors given without it were scaled from max_position_embeddings (64, not 16), and the
    patch refused as 'a rope_type Phi-3 does not take': they now switch at the model's original length, as the same
    config in transformers does."""
    model = build("phi3", "longrope")  # max_position_embeddings 64, original 16
    pairs = ROTARY_PAIRS.get("phi3", 8)
    report = patch_model(
        model, rope_parameters={"rope_type": "longrope", "short_factor": [1.0] * pairs, "long_factor": [4.0] * pairs}
    )
    assert report.rope_parameters["original_max_position_embeddings"] == 16
    assert model.config.original_max_position_embeddings == 16
    fresh = transformers.AutoModelForCausalLM.from_config(copy.deepcopy(model.config)).eval()
    fresh.load_state_dict(model.state_dict())
    ids = tokens()  # 28 tokens: the long factors
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, fresh(ids).logits, **FP32)
        torch.testing.assert_close(model(ids[:, :12]).logits, fresh(ids[:, :12]).logits, **FP32)


def test_ntk_is_written_as_default_with_the_equivalent_theta() -> None:
    model = build("llama")
    patch_model(model, rope_parameters={"rope_type": "ntk", "factor": 4.0})
    assert model.config.rope_parameters["rope_type"] == "default"
    assert model.config.rope_parameters["rope_theta"] == pytest.approx(10000.0 * 4.0 ** (16 / 14), rel=1e-12)


def test_a_posenc_only_type_without_a_translation_is_refused_before_the_model_is_touched(monkeypatch) -> None:
    # A scaling type added to posenc alone reached transformers' rotary class, a bare KeyError from its
    # ROPE_INIT_FUNCTIONS lookup.
    from posenc.rope import frequencies, parameters

    monkeypatch.setitem(frequencies.SCALINGS, "brand_new", frequencies.linear)
    monkeypatch.setitem(parameters.REQUIRED_KEYS, "brand_new", frozenset({"factor"}))
    monkeypatch.setitem(parameters.OPTIONAL_KEYS, "brand_new", frozenset())
    model = build("llama")
    before = copy.deepcopy(model.config.rope_parameters)
    with pytest.raises(ValueError, match=r"rope_type 'brand_new' is posenc's own: .*_hf_rope_parameters"):
        patch_model(model, rope_parameters={"rope_type": "brand_new", "factor": 2.0})
    assert not is_patched(model) and model.config.rope_parameters == before


def test_keeps_model_theta_and_partial_factor_unless_given() -> None:
    model = build("gpt_neox")
    report = patch_model(model, rope_parameters={"rope_type": "linear", "factor": 2.0})
    assert report.rotary_dim == 8 and model.config.rope_parameters["partial_rotary_factor"] == 0.5
    assert model.config.rope_parameters["rope_theta"] == 10000.0


@pytest.mark.parametrize(("rope_type", "left_pad"), [("dynamic", 0), ("longrope", 0), ("dynamic", 3)])
def test_consistent_mode_makes_cached_decoding_equal_full_forwards(rope_type: str, left_pad: int) -> None:
    # One layer: with more, the deeper layers' cached keys and values come from hidden states computed under the
    # frequencies of earlier steps, which no re-rotation can change (see the module docstring). left_pad: the
    # second prompt starts with that many pad tokens, so the rows' positions differ.
    reference = build("llama", rope_type, num_hidden_layers=1)
    prompt = tokens(length=10)
    mask = torch.ones_like(prompt)
    prompt[1, :left_pad], mask[1, :left_pad] = 0, 0
    generate = dict(GENERATE, attention_mask=mask)
    logits = {}
    for mode in ("hf", "consistent"):
        model = copy.deepcopy(reference)
        patch_model(model, mode=mode)
        with torch.no_grad():
            for use_cache in (True, False):
                steps = model.generate(prompt, use_cache=use_cache, **generate).logits
                logits[mode, use_cache] = torch.stack(steps)
    with torch.no_grad():
        transformers_full = torch.stack(reference.generate(prompt, use_cache=False, **generate).logits)
    # Without a cache every step is a full forward, where both modes compute transformers' numbers ...
    torch.testing.assert_close(logits["consistent", False], transformers_full, **FP32)
    torch.testing.assert_close(logits["hf", False], transformers_full, **FP32)
    # ... and with one, only 'consistent' still does; 'hf' keeps keys rotated with older frequencies.
    torch.testing.assert_close(logits["consistent", True], transformers_full, **FP32)
    assert (logits["hf", True] - transformers_full).abs().max() > 1e-2


@pytest.mark.parametrize("rope_type", ["dynamic", "longrope"])
def test_consistent_mode_refuses_a_static_cache(rope_type: str) -> None:
    # A StaticCache hands the attention its whole max_cache_len buffer, so counting the keys' positions back from
    # the new tokens puts every slot at a wrong position (logits off by ~10, other tokens): an error instead.
    model = build("llama", rope_type, num_hidden_layers=1)
    patch_model(model, mode="consistent")
    prompt = tokens(length=10)
    with torch.no_grad():
        with pytest.raises(TypeError, match=r"got a StaticCache with StaticLayer layers.*DynamicCache.*mode='hf'"):
            model.generate(prompt, cache_implementation="static", **GENERATE)
        model.generate(prompt, **GENERATE)  # the default DynamicCache still works


def test_consistent_mode_refuses_a_cache_of_keys_rotated_before() -> None:
    """'consistent' keeps cached keys unrotated and rotates them at read: a cache filled before patching (or by an
    'hf' patch) holds rotated keys, which it rotated again (logits off by up to 8, no error)."""
    reference = build("llama", "dynamic")
    ids = tokens(length=14)
    with torch.no_grad():
        ours = copy.deepcopy(reference)
        patch_model(ours, mode="consistent")
        cache = transformers.DynamicCache(config=reference.config)
        ours(ids[:, :10], cache=cache)
        twin = copy.deepcopy(ours)  # a copy of the patched model, and of its cache (beam search), are the same patch
        expected = ours(ids[:, 10:], cache=copy.deepcopy(cache)).logits
        torch.testing.assert_close(twin(ids[:, 10:], cache=cache).logits, expected, **FP32)
        for fill_with in ("unpatched", "hf", "consistent with a fixed type"):
            other = copy.deepcopy(reference)
            if fill_with == "hf":
                patch_model(other, mode="hf")
            elif fill_with != "unpatched":  # yarn's frequencies do not change with the length: keys rotated at write
                patch_model(other, mode="consistent", rope_parameters={"rope_type": "yarn", "factor": 2.0})
            foreign = transformers.DynamicCache(config=reference.config)
            other(ids[:, :10], cache=foreign)
            with pytest.raises(ValueError, match=r"holds 10 keys for layer 0 that posenc's mode='consistent' did not"):
                ours(ids[:, 10:], cache=foreign)
        ours(ids[:, 10:], cache=transformers.DynamicCache(config=reference.config))  # a new one is fine


def consistent_filled_cache() -> tuple[Any, torch.Tensor, Any]:
    """(a model patched in 'consistent' mode and unpatched since, 20 tokens, a DynamicCache it filled with the first
    12 while patched, unrotated): one layer with dynamic NTK, so that cached decoding equals a full forward and the
    8 new tokens take the scaling length past the trained 16."""
    model = build("llama", "dynamic", num_hidden_layers=1)
    ids = tokens(length=20)
    patch_model(model, mode="consistent")
    cache = transformers.DynamicCache(config=model.config)
    with torch.no_grad():
        model(ids[:, :12], cache=cache)
    unpatch_model(model)
    return model, ids, cache


@pytest.mark.parametrize("rope_parameters", [None, {"rope_type": "dynamic", "factor": 4.0}])
def test_consistent_mode_continues_a_cache_that_another_consistent_patch_filled(
    rope_parameters: dict[str, Any] | None,
) -> None:
    """The keys a consistent patch caches hold no rotation, so the model patched again continues them, with its
    frequencies whatever they are (it was refused, with advice to patch with mode='hf', which misread them)."""
    import pickle

    model, ids, cache = consistent_filled_cache()
    patch_model(model, mode="consistent", rope_parameters=rope_parameters)
    loaded = pickle.loads(pickle.dumps(cache))  # its marks are new instances: still the marks
    with torch.no_grad():
        torch.testing.assert_close(model(ids[:, 12:], cache=cache).logits, model(ids).logits[:, 12:], **FP32)
        torch.testing.assert_close(model(ids[:, 12:], cache=loaded).logits, model(ids).logits[:, 12:], **FP32)


@pytest.mark.parametrize(
    ("mode", "rope_parameters"), [("hf", None), ("consistent", {"rope_type": "yarn", "factor": 2.0})]
)
def test_a_model_that_caches_rotated_keys_refuses_a_cache_that_consistent_filled(
    mode: str, rope_parameters: dict[str, Any] | None
) -> None:
    """'hf' mode, and 'consistent' with a type whose frequencies do not change with the length, rotate keys when
    they cache them: they attended to a consistent patch's unrotated keys as they were (logits off by ~9, no
    error)."""
    model, ids, cache = consistent_filled_cache()
    patch_model(model, mode=mode, rope_parameters=rope_parameters)
    refused = r"holds 12 keys for layer 0 that posenc's mode='consistent' cached unrotated"
    with torch.no_grad(), pytest.raises(ValueError, match=refused):
        model(ids[:, 12:], cache=cache)


def test_an_emptied_cache_holds_the_keys_of_whatever_fills_it_next() -> None:
    """cache.reset() leaves a consistent patch's marks: an 'hf' patch that fills the emptied cache with rotated keys
    drops them, so the consistent patch refuses those keys (it took them as its own and rotated them twice)."""
    reference = build("llama", "dynamic", num_hidden_layers=1)
    ids = tokens(length=20)
    consistent, hf = copy.deepcopy(reference), copy.deepcopy(reference)
    patch_model(consistent, mode="consistent")
    patch_model(hf, mode="hf")
    cache = transformers.DynamicCache(config=reference.config)
    with torch.no_grad():
        consistent(ids[:, :12], cache=cache)
        cache.reset()
        hf(ids[:, :12], cache=cache)
        with pytest.raises(ValueError, match=r"holds 12 keys for layer 0 that posenc's mode='consistent' did not"):
            consistent(ids[:, 12:], cache=cache)


@pytest.mark.parametrize("rope_type", ["dynamic", "longrope"])
def test_hf_mode_with_a_static_cache_matches_transformers(rope_type: str) -> None:
    # What the consistent-mode error advises: 'hf' mode with a StaticCache gives transformers' numbers.
    reference = build("llama", rope_type, num_hidden_layers=1)
    patched = copy.deepcopy(reference)
    patch_model(patched)
    prompt = tokens(length=10)
    with torch.no_grad():
        expected = reference.generate(prompt, cache_implementation="static", **GENERATE)
        got = patched.generate(prompt, cache_implementation="static", **GENERATE)
    assert torch.equal(got.sequences, expected.sequences)
    torch.testing.assert_close(torch.stack(got.logits), torch.stack(expected.logits), **FP32)


def test_hf_mode_continues_the_dynamic_state_of_the_model() -> None:
    reference = build("llama", "dynamic")
    ids = tokens()
    with torch.no_grad():
        reference(ids)  # transformers now scales every call shorter than 28 but longer than 16 for 28
        model = copy.deepcopy(reference)
        patch_model(model)
        torch.testing.assert_close(model(ids[:, :20]).logits, reference(ids[:, :20]).logits, **FP32)


def test_consistent_mode_equals_hf_mode_for_fixed_types() -> None:
    hf_model = build("llama", "yarn")
    consistent = copy.deepcopy(hf_model)
    patch_model(hf_model, mode="hf")
    patch_model(consistent, mode="consistent")
    with torch.no_grad():
        assert torch.equal(consistent(tokens()).logits, hf_model(tokens()).logits)


def test_compiles_without_graph_breaks(monkeypatch: pytest.MonkeyPatch) -> None:
    mod = modeling("llama")

    def refuse(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("transformers' rotary code was called")

    model = build("llama")
    patch_model(model)
    monkeypatch.setattr(mod, "apply_rotary_pos_emb", refuse)
    ids = tokens()
    torch._dynamo.reset()
    try:
        with torch.no_grad():
            eager = model(ids).logits
            compiled = torch.compile(model, backend="eager", fullgraph=True)(ids).logits
    finally:
        torch._dynamo.reset()
    torch.testing.assert_close(compiled, eager, **FP32)


@pytest.mark.parametrize(
    ("mode", "rope_type"),
    [("hf", "default"), ("consistent", "default"), ("consistent", "dynamic"), ("consistent", "longrope")],
)
def test_patched_models_of_one_class_share_their_compiled_graphs(mode: str, rope_type: str) -> None:
    """Each patched attention module held its forward as an instance attribute that was no bound method, which
    torch.compile guards by identity: every patched model compiled again, as no unpatched one does (with 2 layers the
    8 recompiles allowed ran out at the 9th model, sooner with graph breaks: an error with fullgraph=True, else the
    model ran uncompiled). Four models compile with fullgraph=True into the graphs the first has (unscaled: as many
    as an unpatched model has), each with its eager logits (the scaled ones through generate too); a fifth, patched
    with another scaling, gets its own numbers, not the shared graph's. 'consistent' with dynamic NTK / LongRoPE
    (keys rotated at read) compiled each model again until its copy of the forward read the RoPEs from the
    attention module instead of its globals: the 8th model was an error. generate's 10 + 12 tokens cross the trained
    length: LongRoPE's cached keys rotated at read with the factors chosen on the device compile with fullgraph=True
    and decode as uncompiled (an error asking to compile without it before; its own test until 2026-12-06)."""
    graphs = []

    def counting(gm: torch.fx.GraphModule, inputs: Any) -> Any:
        graphs.append(gm)
        return gm.forward

    def compiled_and_eager(model: Any, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        with torch.no_grad():
            return torch.compile(model, backend=counting, fullgraph=True)(ids).logits, model(ids).logits

    def generated(model: Any, prompt: torch.Tensor) -> Any:
        options = dict(max_new_tokens=12, do_sample=False, output_logits=True, return_dict_in_generate=True)
        with torch.no_grad():
            return model.generate(prompt, **options)

    ids, prompt = tokens(length=TRAINED + 4), tokens(batch=1, length=10)
    reference = build("llama", rope_type)
    torch._dynamo.reset()
    try:
        if rope_type == "default":  # an unpatched model, whose graphs the unscaled ones are compared with below
            compiled_and_eager(build("llama"), ids)
            unpatched = len(graphs)
            graphs.clear()

        def compiled_as_eager(model: Any) -> None:
            compiled, eager = compiled_and_eager(model, ids)
            torch.testing.assert_close(compiled, eager, atol=0.0, rtol=0.0)
            if rope_type != "default":  # cached keys rotated at read past the trained length, in the graph
                expected = generated(model, prompt)
                model.forward = torch.compile(model.forward, backend=counting, fullgraph=True)
                out = generated(model, prompt)
                assert torch.equal(out.sequences, expected.sequences)
                torch.testing.assert_close(torch.stack(out.logits), torch.stack(expected.logits), **FP32)

        counts = []
        for _ in range(4):
            model = copy.deepcopy(reference)
            patch_model(model, mode=mode)
            compiled_as_eager(model)
            counts.append(len(graphs))
        assert counts[1:] == counts[:1] * 3, f"graphs after each of 4 patched models: {counts}"
        if rope_type == "default":  # as many as an unpatched model
            assert counts[0] == unpatched, f"{counts[0]} graphs for 4 patched models, {unpatched} for an unpatched one"
        other = copy.deepcopy(reference)
        scaling = {"rope_type": "dynamic" if rope_type in ("dynamic", "longrope") else "linear", "factor": 8.0}
        patch_model(other, mode=mode, rope_parameters=scaling)
        compiled, eager = compiled_and_eager(other, ids)
        torch.testing.assert_close(compiled, eager, atol=0.0, rtol=0.0)
        assert not torch.allclose(eager, model(ids).logits, **FP32)  # a scaling that changes the numbers
        if rope_type == "dynamic":
            # The cached keys are rotated at read in every attention layer for the step's length, read on the host
            # until 2026-11: in a graph break there Dynamo compiled each layer's attention forward as a frame of its
            # own, guarded on its layer_idx and cache layer, 3 x num_hidden_layers times (38 with 12 layers, past the
            # recompile limit of 8). Now the length is read in an op: a 1-layer model, from the same fresh state,
            # compiles as many graphs as the first 2-layer one (its own test until 2026-12-06, without fullgraph,
            # where such a break showed as 3 compiles more a layer; here it is an error).
            torch._dynamo.reset()
            before = len(graphs)
            one_layer = build("llama", "dynamic", num_hidden_layers=1)
            patch_model(one_layer, mode=mode)
            compiled_as_eager(one_layer)
            assert len(graphs) - before == counts[0], f"{len(graphs) - before} graphs for 1 layer, {counts[0]} for 2"
    finally:
        torch._dynamo.reset()


def test_patched_models_compiled_layer_by_layer_each_rotate_with_their_own_patch() -> None:
    """A patched attention's copy of the class forward holds the patch's rotation in its globals, which Dynamo guards
    through the globals dict it traced first, not through the function: once patched models of one class shared a
    class and a forward's code, a model compiled layer by layer (``layer.compile()``: the rotary embedding outside the
    graph) after another reused the first patch's graph, its keys rotated with the first model's RoPE (logits 10.7
    from its eager ones for a 'consistent' dynamic NTK of factor 8 after one of 2), or with its backend. Each gets
    its own numbers; patches alike still share one graph (a third model patched as the first)."""
    graphs = []

    def counting(gm: torch.fx.GraphModule, inputs: Any) -> Any:
        graphs.append(gm)
        return gm.forward

    ids = tokens(length=TRAINED + 8)
    reference = build("llama")
    patches = [
        dict(mode="consistent", rope_parameters={"rope_type": "dynamic", "factor": 2.0}),
        dict(mode="consistent", rope_parameters={"rope_type": "dynamic", "factor": 8.0}),
        dict(mode="hf", backend="torch"),
        dict(mode="hf", backend="auto"),
        dict(mode="hf", backend="torch"),
    ]
    before = 0
    torch._dynamo.reset()
    try:
        for patch in patches:
            model = copy.deepcopy(reference)
            patch_model(model, **patch)
            with torch.no_grad():
                eager = model(ids).logits
                for layer in model.model.layers:
                    layer.compile(backend=counting)
                compiled = model(ids).logits
            torch.testing.assert_close(compiled, eager, **FP32)
            if patch is patches[3]:  # the backends agree to ~1e-5: that it ran its own shows as a graph of its own
                assert len(graphs) > before, "the model patched with backend='auto' ran the 'torch' one's graph"
            if patch is patches[4]:
                assert len(graphs) == before, "a model patched as the third compiled again"
            before = len(graphs)
    finally:
        torch._dynamo.reset()


def test_a_deepcopy_of_a_consistent_model_rotates_its_keys_with_its_own_ropes(monkeypatch: pytest.MonkeyPatch) -> None:
    """'consistent' dynamic NTK rotates the cached keys at read with the model's RoPE, which the patched forward's
    globals held, and deepcopy does not copy functions: a copy of the model rotated its keys with the original's RoPE
    objects. Each attention module holds its RoPEs now, copied with it: the copy, cast to float64, gives the float64
    logits of a model patched directly and reads nothing of the original's RoPE; the original is unchanged, and
    unpatching the copy leaves it patched."""
    ids = tokens(length=TRAINED + 8)
    reference = build("llama", "dynamic")
    original = copy.deepcopy(reference)
    patch_model(original, mode="consistent")
    with torch.no_grad():
        before = original(ids).logits
    twin = copy.deepcopy(original).double()
    direct = copy.deepcopy(reference).double()
    patch_model(direct, mode="consistent")
    read = []
    rope = original.model.rotary_emb.rope
    monkeypatch.setattr(
        rope, "cos_sin", lambda *args, **kwargs: read.append(1) or type(rope).cos_sin(rope, *args, **kwargs)
    )
    with torch.no_grad():
        logits = twin(ids).logits
    assert not read, f"the copy read the original's RoPE {len(read)} times"
    assert logits.dtype == torch.float64
    with torch.no_grad():
        torch.testing.assert_close(logits, direct(ids).logits, atol=0.0, rtol=0.0)
        unpatch_model(twin)
        torch.testing.assert_close(original(ids).logits, before, atol=0.0, rtol=0.0)
    assert is_patched(original) and not any(hasattr(module, consistent_module.ROPES_ATTR) for module in twin.modules())


def test_a_consistent_model_patched_after_the_attention_registry_changed_attends_with_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """'consistent' models patched alike share one copy of the forward, whose stand-in for the modeling module's
    ALL_ATTENTION_FUNCTIONS wraps the registry the module had when the copy was made: one patched after the registry
    was replaced attends with the new one."""
    mod = modeling("llama")
    first, second = build("llama", "dynamic"), build("llama", "dynamic")
    patch_model(first, mode="consistent")
    registry, calls = mod.ALL_ATTENTION_FUNCTIONS, []

    class Counting:
        def get_interface(self, implementation: str, default: Any) -> Any:
            attend = registry.get_interface(implementation, default)
            return lambda *args, **kwargs: calls.append(1) or attend(*args, **kwargs)

    monkeypatch.setattr(mod, "ALL_ATTENTION_FUNCTIONS", Counting())
    patch_model(second, mode="consistent")
    with torch.no_grad():
        second(tokens())
    assert len(calls) == second.config.num_hidden_layers


def test_a_model_patched_after_its_modeling_module_changed_runs_the_module_as_it_is(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Models patched alike share one copy of the class forward, whose globals are the modeling module's as they
    were when it was made: one patched after a function of the module was replaced (liger-kernel's way) runs it."""
    mod = modeling("llama")
    first, second = build("llama"), build("llama")
    for model in (first, second):
        model.config._attn_implementation = "eager"
    patch_model(first)
    calls = []

    def counted(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        return real(*args, **kwargs)

    real = mod.eager_attention_forward
    monkeypatch.setattr(mod, "eager_attention_forward", counted)
    patch_model(second)
    with torch.no_grad():
        second(tokens())
    assert len(calls) == second.config.num_hidden_layers


def test_a_patched_forward_reads_a_global_of_a_lambda_as_its_module_has_it_now(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Classes patched alike share a copy of the class forward while the module globals it reads are unchanged,
    those read inside a lambda or generator expression of the forward included: a patch made after such a global
    changed runs the new value, and the copy made before keeps the old."""
    import types

    module = types.ModuleType("posenc_test_modeling")
    exec(
        "import torch\nSCALE = 2\n\n\nclass Attention(torch.nn.Module):\n"
        "    def forward(self, values):\n        return list(map(lambda value: SCALE * value, values))\n",
        module.__dict__,
    )
    rope = RoPE(16)
    before = patch_module._patched_forward(module.Attention, (), rope, keys_at_read=False)
    monkeypatch.setattr(module, "SCALE", 3)
    after = patch_module._patched_forward(module.Attention, (), rope, keys_at_read=False)
    attention = module.Attention()
    assert before(attention, [1, 2]) == [2, 4] and after(attention, [1, 2]) == [3, 6]


def test_a_patched_forward_reads_a_global_replaced_by_an_equal_object_as_the_module_has_it_now(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A module global replaced by an equal object (a new table of the same values) is another object, which the
    module changes later: a patch made after the replacement reads the new one, not a copy sharing the old."""
    import types

    module = types.ModuleType("posenc_test_modeling")
    exec(
        "import torch\nTABLE = [2]\n\n\nclass Attention(torch.nn.Module):\n"
        "    def forward(self, value):\n        return TABLE[0] * value\n",
        module.__dict__,
    )
    rope = RoPE(16)
    patch_module._patched_forward(module.Attention, (), rope, keys_at_read=False)
    monkeypatch.setattr(module, "TABLE", [2])
    after = patch_module._patched_forward(module.Attention, (), rope, keys_at_read=False)
    module.TABLE[0] = 3
    assert after(module.Attention(), 1) == 3


def test_length_dependent_types_compile_as_the_unpatched_model_does() -> None:
    """Dynamic NTK reads the call's length on the host: transformers breaks the graph there, and so does posenc now
    (a ValueError asking for seq_len=, which the model cannot pass, before). A prompt below the trained length, then a
    cached step past it, compiled, against the unpatched model. 'consistent' mode, which keeps no such state, does
    the same with fullgraph=True against itself uncompiled: test_dynamic_ntk_under_fullgraph."""
    model = build("llama", "dynamic", num_hidden_layers=1)  # the breaks are in the rotary embedding, not per layer
    patched = copy.deepcopy(model)
    patch_model(patched, mode="hf")
    ids = tokens(length=TRAINED + 4)
    prompt, step = ids[:, : TRAINED - 4], ids[:, TRAINED - 4 :]
    torch._dynamo.reset()
    try:
        with torch.no_grad():
            compiled = torch.compile(patched, backend="eager")
            ours = compiled(prompt, use_cache=True)
            ours = compiled(step, cache=ours.cache).logits
    finally:
        torch._dynamo.reset()
    with torch.no_grad():
        theirs = model(step, cache=model(prompt, use_cache=True).cache).logits
    torch.testing.assert_close(ours, theirs, **FP32)


def test_consistent_mode_refuses_the_paged_cache_of_continuous_batching() -> None:
    """generate_batch packs several requests' keys into one row of a paged cache (no transformers Cache, so the
    cache check never saw it) and hands the attention block_table / read_index: the keys' positions, counted back
    from the first new token, were wrong, and two of three requests decoded other tokens without a word. A decode
    step as the paged cache hands it (two requests, 13 keys) is refused; run whole, generate_batch logs the error
    and fails the requests."""
    rope = RoPE(
        16, rope_parameters={"rope_type": "dynamic", "factor": 2.0}, max_position_embeddings=8, mode="consistent"
    )
    module = torch.nn.Module()  # a patched attention module holds its RoPEs by layer type
    setattr(module, consistent_module.ROPES_ATTR, {"": rope})
    query, key = torch.randn(1, 4, 2, 16), torch.randn(1, 2, 13, 16)
    paged = {"position_ids": torch.tensor([[3, 8]]), "block_table": None, "read_index": [torch.arange(13)]}
    with pytest.raises(
        TypeError, match=r"cannot serve a paged KV cache .* block_table, read_index\), .*; patch with mode='hf'"
    ):
        consistent_module._attend_with_rotated_keys(lambda *a, **k: None, module, query, key, key, None, **paged)
    # A step with no cached keys (the requests' prefill: as many keys as new tokens) has no positions to count back:
    # attended, its keys rotated at their own positions.
    prefill = {**paged, "position_ids": torch.arange(13)[None]}
    new_key = torch.randn(1, 2, 13, 16)
    attended = consistent_module._attend_with_rotated_keys(
        lambda module, q, k, *a, **kw: k, module, torch.randn(1, 4, 13, 16), new_key, new_key, None, **prefill
    )
    torch.testing.assert_close(attended, rope.rotate(new_key, prefill["position_ids"], seq_len=13), atol=0, rtol=0)


@pytest.mark.parametrize("rope_type", ["dynamic", "longrope"])
def test_consistent_mode_computes_the_keys_cos_sin_once_per_forward(
    rope_type: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every attention layer rotated all its cached keys with cos/sin it computed itself, the same in every layer
    (a host read of the step's length and of the positions' extent each, and the float64 angles of every key):
    L + 1 computations per forward with L layers. Now the first layer's are shared by the others: 2 (the new
    tokens', the keys'), whatever the layer count, and the logits are those of the per-layer computation, bit for
    bit."""
    model = build("llama", rope_type, num_hidden_layers=4)
    patch_model(model, mode="consistent")
    ids = tokens(length=TRAINED + 4)
    computed: list[int] = []
    cos_sin = RoPE.cos_sin

    def counted(self: RoPE, positions: torch.Tensor, **kwargs: Any) -> Any:
        computed.append(positions.shape[-1])
        return cos_sin(self, positions, **kwargs)

    monkeypatch.setattr(RoPE, "cos_sin", counted)
    shared = _decode(model, ids, TRAINED - 2)
    steps = 1 + ids.shape[1] - (TRAINED - 2)
    assert len(computed) == 2 * steps, computed
    monkeypatch.setattr(consistent_module, "_keys_cos_sin", consistent_module._step_keys_cos_sin)
    for ours, per_layer in zip(shared, _decode(model, ids, TRAINED - 2), strict=True):
        assert torch.equal(ours, per_layer)


def test_shared_keys_cos_sin_follow_position_ids_changed_in_place() -> None:
    """The keys' cos/sin are shared by the position_ids they were made for: an inference tensor reused for the next
    call and changed in place (no version counter shows it) gets them anew, as does a tensor whose version moved."""
    model = build("llama", "dynamic", num_hidden_layers=2)
    patch_model(model, mode="consistent")
    ids = tokens(batch=1, length=TRAINED + 4)
    for inference in (True, False):
        with torch.inference_mode(inference), torch.no_grad():
            cache = transformers.DynamicCache(config=model.config)
            model(ids[:, : TRAINED + 2], cache=cache)
            positions = torch.tensor([[TRAINED + 2]])
            first = copy.deepcopy(cache)
            model(ids[:, TRAINED + 2 : TRAINED + 3], cache=first, position_ids=positions)
            positions += 1  # the same tensor, and a cache of the same length: another step's cos/sin
            second = copy.deepcopy(cache)
            ours = model(ids[:, TRAINED + 3 :], cache=cache, position_ids=positions).logits
            expected = model(ids[:, TRAINED + 3 :], cache=second, position_ids=positions.clone()).logits
        assert torch.equal(ours, expected)


def test_consistent_mode_refuses_a_lazily_built_cache_of_fixed_size_layers() -> None:
    """A cache with no layers yet is judged by the class of the layers it will add (layer_class_to_replicate); a
    kind of DynamicLayer (sliding) grows as it does. Caches are found among positional arguments too."""
    from transformers.cache_utils import Cache, DynamicLayer, DynamicSlidingWindowLayer, StaticLayer

    for growing in (DynamicLayer, DynamicSlidingWindowLayer):
        consistent_module._require_growing_cache(Cache(layer_class_to_replicate=growing), DynamicLayer)
    first, second = Cache(layer_class_to_replicate=DynamicLayer), Cache(layer_class_to_replicate=DynamicLayer)
    assert consistent_module._caches_in(Cache, (None, first), {"cache": second, "x": 1}) == [first, second]
    with pytest.raises(TypeError, match=r"got a Cache with StaticLayer layers"):
        consistent_module._require_growing_cache(Cache(layer_class_to_replicate=StaticLayer), DynamicLayer)


@pytest.mark.parametrize("mode", ["hf", "consistent"])
def test_dynamic_ntk_under_fullgraph(mode: str) -> None:
    """'hf' dynamic NTK keeps transformers' state (the longest length seen), read and advanced on the host in the
    rotary embedding: fullgraph=True's error says to compile without it. 'consistent' keeps none: the rotary
    embedding, like the attention layers, reads the step's length in an op of the graph, so the whole model
    compiles as one graph, a cached step included, with eager's logits (a break, with fullgraph an error, before)."""
    model = build("llama", "dynamic")
    patch_model(model, mode=mode)
    torch._dynamo.reset()
    try:
        compiled = torch.compile(model, backend="eager", fullgraph=True)
        ids = tokens(length=TRAINED + 4)
        with torch.no_grad():
            if mode == "hf":
                with pytest.raises(Exception, match=r"patched transformers models cannot: compile them"):
                    compiled(ids[:, :4])
                return
            for run in (compiled, model):  # the second layer's cached keys differ from a full forward's by design
                prompt = run(ids[:, :10], use_cache=True)
                step = run(ids[:, 10:], cache=prompt.cache)  # past the trained length
                if run is compiled:
                    got = prompt.logits, step.logits
            torch.testing.assert_close(got, (prompt.logits, step.logits), **FP32)
    finally:
        torch._dynamo.reset()


def _decode(model: Any, ids: torch.Tensor, prompt: int) -> list[torch.Tensor]:
    """Logits of a prompt of ``prompt`` tokens and then of one cached step per remaining token of ``ids``."""
    with torch.no_grad():
        out = model(ids[:, :prompt], use_cache=True)
        logits = [out.logits]
        for i in range(prompt, ids.shape[1]):
            out = model(ids[:, i : i + 1], cache=out.cache)
            logits.append(out.logits)
    return logits


def test_a_longrope_model_patched_compiles_into_one_graph_as_unpatched() -> None:
    """transformers chooses LongRoPE's short or long factors with torch.where, inside the graph, so the unpatched
    model compiles with fullgraph=True; the patched one broke its graph at the length read (an error there)."""
    model = build("llama", "longrope")
    patched = copy.deepcopy(model)
    patch_model(patched)
    torch._dynamo.reset()
    try:
        with torch.no_grad():
            compiled = torch.compile(patched, backend="eager", fullgraph=True)
            for length in (TRAINED - 4, TRAINED + 8):  # the short factors, then the long ones
                ids = tokens(length=length)
                torch.testing.assert_close(compiled(ids).logits, model(ids).logits, **FP32)
    finally:
        torch._dynamo.reset()


def test_report_describes_the_patch() -> None:
    model = build("gpt_neox")
    report = patch_model(model, backend="torch")
    text = str(report)
    assert report.architecture == "gpt_neox" and report.rotary_modules == ("gpt_neox.rotary_emb",)
    assert (report.head_dim, report.rotary_dim, report.interleaved) == (16, 8, False)
    assert report.rotations == {"apply_rotary_pos_emb": "split-half"}
    assert "gpt_neox" in text and "backend='torch'" in text


# --- partial_rotary_factor as each model's own code reads it ---------------------------------------------------


def build_partial(arch: str, rope_type: str = "default", **params: Any) -> Any:
    """A tiny model whose config says partial_rotary_factor=0.5 (GPT-NeoX: rotary_pct too)."""
    rope = {"rope_type": rope_type, "rope_theta": 10000.0, "partial_rotary_factor": 0.5, **params}
    config = transformers.AutoConfig.for_model(arch, **{**SIZES, **ARCH_SIZES[arch], "rope_parameters": rope})
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(config).eval()


# transformers' default RoPE for Llama, Mistral, Qwen2/3 and Gemma ignores the factor and rotates all 16 channels;
# GPT-NeoX and Phi-3 rotate the first 8.
PARTIAL_ROTARY_DIMS = {"llama": 16, "mistral": 16, "qwen2": 16, "qwen3": 16, "gemma": 16, "gpt_neox": 8, "phi3": 8}


@pytest.mark.parametrize(("arch", "rotary_dim"), PARTIAL_ROTARY_DIMS.items())
def test_partial_rotary_factor_is_read_as_the_model_reads_it(arch: str, rotary_dim: int) -> None:
    reference = build_partial(arch)
    patched = copy.deepcopy(reference)
    report = patch_model(patched)
    assert report.rotary_dim == rotary_dim
    ids = tokens()
    positions = torch.arange(28)[None]
    hf_cos, hf_sin = reference.get_decoder().rotary_emb(torch.zeros(1, 28, 64), positions)  # (1, s, r), halves equal
    cos, sin = rope_from_config(reference.config).cos_sin(positions)  # (1, s, r/2)
    with torch.no_grad():
        torch.testing.assert_close(patched(ids).logits, reference(ids).logits, **FP32)
    torch.testing.assert_close(cos, hf_cos[..., : rotary_dim // 2], atol=1e-6, rtol=0)
    torch.testing.assert_close(sin, hf_sin[..., : rotary_dim // 2], atol=1e-6, rtol=0)


def test_whole_head_architectures_are_the_ones_whose_attention_cannot_rotate_part() -> None:
    # _WHOLE_HEAD_ATTENTION against the installed transformers: their apply_rotary_pos_emb fails on cos/sin that
    # cover half the head, the others rotate that half and pass the rest through.
    q = torch.randn(1, 2, 3, 16)
    cos, sin = torch.ones(1, 3, 8), torch.zeros(1, 3, 8)
    for arch in SUPPORTED_ARCHITECTURES:
        if arch in _WHOLE_HEAD_ATTENTION:
            with pytest.raises(RuntimeError, match="size of tensor"):
                modeling(arch).apply_rotary_pos_emb(q, q, cos, sin)
        else:
            assert torch.equal(modeling(arch).apply_rotary_pos_emb(q, q, cos, sin)[0], q)


@pytest.mark.parametrize(
    "rope_parameters",
    [
        {"rope_type": "default", "partial_rotary_factor": 0.5},  # transformers would rotate the whole head
        {"rope_type": "linear", "factor": 2.0, "partial_rotary_factor": 0.5},  # LlamaAttention would crash
    ],
)
def test_new_partial_rotary_on_a_whole_head_architecture_is_refused(rope_parameters: dict) -> None:
    model = build("llama")
    with pytest.raises(ValueError, match=r"rotates all 16 channels.*Drop partial_rotary_factor"):
        patch_model(model, rope_parameters=rope_parameters)
    assert not is_patched(model) and model.config.rope_parameters["rope_type"] == "default"


# Every whole-head architecture with one scaled type, and the other scaled types with one: the check is on the
# rotary fraction, whatever scales the frequencies, and each of these builds half of them.
LOADED_PARTIAL = [(arch, "linear", {"factor": 2.0}) for arch in sorted(_WHOLE_HEAD_ATTENTION)] + [
    ("llama", "dynamic", {"factor": 2.0}),
    ("llama", "yarn", {"factor": 4.0, "original_max_position_embeddings": 16}),
    (
        "llama",
        "llama3",
        {"factor": 8.0, "original_max_position_embeddings": 16, "low_freq_factor": 1.0, "high_freq_factor": 4.0},
    ),
]


@pytest.mark.parametrize(("arch", "rope_type", "params"), LOADED_PARTIAL)
def test_a_loaded_config_with_partial_rotary_on_a_whole_head_architecture_is_refused(
    arch: str, rope_type: str, params: dict
) -> None:
    """transformers honours partial_rotary_factor for the scaled types and builds half the frequencies, which these
    architectures' attention cannot apply: the unpatched model fails. patch_model used to patch it without a word
    into a model that rotated half of each head, which no transformers model of that config does."""
    model = build_partial(arch, rope_type, **params)
    with pytest.raises(RuntimeError, match="size of tensor"):
        model(tokens())
    with pytest.raises(ValueError, match=r"rotates all 16 channels.*fails on it too.*Drop partial_rotary_factor"):
        patch_model(model)
    assert not is_patched(model)


def test_a_rope_that_rotates_fewer_channels_than_the_model_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    # The safety net under rope_kwargs_from_config: simulate it reading a factor the model ignores (the old bug).
    read = patch_module.rope_kwargs_from_config

    def misread(config: Any, **options: Any) -> dict[str, Any]:
        kwargs = read(config, **options)
        kwargs["rope_parameters"]["partial_rotary_factor"] = 0.5
        return kwargs

    monkeypatch.setattr(patch_module, "rope_kwargs_from_config", misread)
    model = build("llama")
    original = model.model.rotary_emb
    with pytest.raises(ValueError, match=r"LlamaRotaryEmbedding \(model.rotary_emb\) does: it has 8 frequencies"):
        patch_model(model)
    assert not is_patched(model) and model.model.rotary_emb is original


def test_a_rope_with_another_attention_scaling_than_the_model_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    model = build("llama", "yarn")
    monkeypatch.setattr(model.model.rotary_emb, "attention_scaling", 2.0)
    with pytest.raises(ValueError, match=r"attention scaling is 2.0, posenc's 1.13"):
        patch_model(model)
    assert not is_patched(model)


def test_frequencies_a_hair_off_the_models_are_refused() -> None:
    # 1e-4 relative is far past the float32 buffer's rounding (~1e-6) and what a wrong scaling factor near 1 (linear
    # at 1.0001) gives; a tolerance loose enough to take it would take such a config too.
    model = build("llama", "default")
    rotary = model.model.rotary_emb
    for name in ("inv_freq", "original_inv_freq"):
        getattr(rotary, name).mul_(1 + 1e-4)
    with pytest.raises(ValueError, match=r"inv_freq differs by up to 0.0001 relative \(allowed 1e-05\)"):
        patch_model(model)
    assert not is_patched(model)


def _phimoe(short_mscale: float, long_mscale: float) -> Any:
    """A tiny PhiMoE with LongRoPE (original length 16, trained 64) whose forward scales cos/sin by the mscales."""
    rope_parameters = {
        "rope_type": "longrope",
        "rope_theta": 10000.0,
        "original_max_position_embeddings": 16,
        "short_factor": [1 + i / 8 for i in range(8)],
        "long_factor": [2.0 + 3 * i for i in range(8)],
        "short_mscale": short_mscale,
        "long_mscale": long_mscale,
    }
    config = transformers.PhimoeConfig(
        **{**SIZES, "num_key_value_heads": 2, "num_local_experts": 4, "max_position_embeddings": 64},
        rope_parameters=rope_parameters,
    )
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(config).eval()


def test_phimoe_longrope_rotates_as_its_rotary_embedding_does() -> None:
    """PhiMoE's forward takes LongRoPE's short factors at every length and scales cos/sin by the config's mscale,
    not LongRoPE's own factor (transformers 5.25). posenc built the generic LongRoPE: patched logits were off by 10.8
    past the original length (with Phi-3.5-MoE's mscale 1.2432, refused as "matches neither pair layout"), and
    rope_from_config's cos at position 0 was 1.2247 where the model's is 1.2432."""
    model = _phimoe(1.2432, 1.2432)
    assert rope_from_config(model.config).cos_sin(torch.tensor([0]))[0][0, 0].item() == pytest.approx(1.2432)
    patched = copy.deepcopy(model)
    patch_model(patched)
    ids = torch.randint(3, 128, (1, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        for n in (16, 17, 40):  # up to the original length, one past it, and far past it
            torch.testing.assert_close(patched(ids[:, :n]).logits, model(ids[:, :n]).logits, rtol=0, atol=1e-4)


def test_phimoe_with_two_mscales_is_refused_saying_why() -> None:
    model = _phimoe(1.2, 1.3)
    with pytest.raises(
        ValueError, match=r"short_mscale=1.2 up to original_max_position_embeddings and long_mscale=1.3"
    ):
        patch_model(model)
    assert not is_patched(model)


def tiny_mistral_large4() -> Any:
    """A tiny Mistral Large 4 text model, whose LeRoPE turns by inv_freq * exp(alpha), alpha learned (init 0)."""
    modeling = pytest.importorskip("transformers.models.mistral_large4.modeling_mistral_large4")
    config = transformers.models.mistral_large4.configuration_mistral_large4.MistralLarge4TextConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        moe_intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        n_routed_experts=4,
        num_experts_per_tok=2,
        kv_lora_rank=32,
        qk_rope_head_dim=16,
        v_head_dim=16,
        qk_nope_head_dim=16,
        head_dim=16,
        index_topk=8,
        index_head_dim=16,
        index_n_heads=2,
        max_position_embeddings=64,
        initializer_range=0.3,
    )
    torch.manual_seed(0)
    return modeling.MistralLarge4TextModel(config).eval()


def test_a_rotary_forward_that_departs_from_its_buffers_past_the_probe_is_refused() -> None:
    """Mistral Large 4's LeRoPE turns by inv_freq * exp(alpha), alpha learned, where its inv_freq buffer holds the
    plain frequencies. Nonzero only on slow pairs, alpha stayed below the probe's tolerance at positions < 16 and the
    patch went through, hidden states off by 2.98 at 2000 tokens. The far positions see it. (alpha a buffer here: as
    a parameter it is refused before the probe, see the next test.)"""
    model = tiny_mistral_large4()
    del model.rotary_emb.alpha
    model.rotary_emb.register_buffer("alpha", torch.tensor([0, 0, 0, 0, 0, 0.7, 0.7, 0.7]), persistent=False)
    with pytest.raises(ValueError, match=r"rotates differently .* Its forward computes cos/sin from more than"):
        patch_model(model)
    assert not is_patched(model)


def test_learned_rotary_frequencies_are_refused_not_dropped() -> None:
    # A rotary module with parameters was replaced by posenc's, computed from the config: at alpha's init (0) Mistral
    # Large 4 patched without a word and training it lost alpha (gone from the parameters, its gradient None); so did
    # an inv_freq made an nn.Parameter.
    model = tiny_mistral_large4()
    with pytest.raises(ValueError, match=r"MistralLarge4TextRotaryEmbedding \(rotary_emb\) holds parameters \(alpha\)"):
        patch_model(model)
    assert not is_patched(model) and isinstance(model.rotary_emb.alpha, torch.nn.Parameter)
    llama = build("llama")
    rotary = llama.get_decoder().rotary_emb
    rotary.inv_freq = torch.nn.Parameter(rotary.inv_freq.clone())
    with pytest.raises(ValueError, match=r"LlamaRotaryEmbedding \(model\.rotary_emb\) holds parameters \(inv_freq\)"):
        patch_model(llama)
    assert not is_patched(llama)


# --- errors -------------------------------------------------------------------------------------------------


def test_a_model_without_rope_is_refused_saying_why() -> None:
    config = transformers.GPT2Config(n_embd=32, n_layer=1, n_head=2, vocab_size=64, n_positions=32)
    model = transformers.GPT2LMHeadModel(config)
    with pytest.raises(ValueError, match=r"gpt2 model \(GPT2LMHeadModel\): model_type 'gpt2' has no rotary embedding"):
        patch_model(model)
    assert not is_patched(model)
    # Falcon with ALiBi keeps a rotary embedding it never calls: patching it was reported as done.
    config = transformers.FalconConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, alibi=True)
    model = transformers.FalconForCausalLM(config)
    with pytest.raises(ValueError, match=r"falcon model \(FalconForCausalLM\): the config says alibi=True"):
        patch_model(model)
    assert not is_patched(model)


def test_not_a_model() -> None:
    with pytest.raises(TypeError, match="transformers model"):
        patch_model(torch.nn.Linear(2, 2))


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"mode": "fast"}, ValueError, "mode must be 'hf'"),
        ({"backend": "cuda"}, ValueError, "backend must be one of"),
        ({"rope_parameters": [("rope_type", "yarn")]}, TypeError, "rope_parameters must be a dict"),
        ({"rope_parameters": {"rope_type": "su-per"}}, ValueError, "unknown rope_type"),
        ({"rope_parameters": {"rope_type": "yarn", "factor": 0.5}}, ValueError, "factor"),
    ],
)
def test_bad_arguments(kwargs: dict, error: type[Exception], match: str) -> None:
    model = build("llama")
    with pytest.raises(error, match=match):
        patch_model(model, **kwargs)
    assert not is_patched(model) and model.config.rope_parameters["rope_type"] == "default"


def test_scaling_the_architecture_config_cannot_hold_is_refused() -> None:
    model = build("phi3")  # Phi3Config reads every rope_type but default / longrope as something else
    with pytest.raises(ValueError, match=r"Phi3Config.*would not reproduce"):
        patch_model(model, rope_parameters={"rope_type": "yarn", "factor": 4.0})
    assert not is_patched(model) and model.config.rope_parameters["rope_type"] == "default"


def test_unpatch_leaves_the_dynamic_ntk_state_the_patched_model_reached() -> None:
    """transformers' dynamic NTK keeps the longest length seen; posenc continues it while patched, and now hands it
    back: the restored module kept the state of patch time, and its logits then differed by up to 4.9."""
    model = build("llama", "dynamic")
    patched = copy.deepcopy(model)
    ids = tokens(length=TRAINED + 12)
    # growth past the trained length; a shorter call that still scales for the longest; a reset below it
    for lengths in ((TRAINED + 8,), (TRAINED + 8, TRAINED + 2), (TRAINED + 8, TRAINED - 4)):
        with torch.no_grad():
            for length in lengths:
                patch_model(patched)
                model(ids[:, :length]), patched(ids[:, :length])
                unpatch_model(patched)
            restored, original = patched.model.rotary_emb, model.model.rotary_emb
            assert restored.max_seq_len_cached == original.max_seq_len_cached, lengths
            assert torch.equal(restored.inv_freq, original.inv_freq), lengths
            for length in (TRAINED + 4, TRAINED + 12, TRAINED - 2):  # and it goes on as transformers does
                torch.testing.assert_close(patched(ids[:, :length]).logits, model(ids[:, :length]).logits, **FP32)
            assert torch.equal(restored.inv_freq, original.inv_freq), lengths


def test_patch_twice_and_unpatch_twice() -> None:
    model = build("llama")
    patch_model(model)
    with pytest.raises(ValueError, match="already patched"):
        patch_model(model, rope_parameters={"rope_type": "linear", "factor": 2.0})
    unpatch_model(model)
    with pytest.raises(ValueError, match="not patched"):
        unpatch_model(model)


def test_patch_of_a_model_with_a_part_patched_says_so() -> None:
    """patch_model(model.model), then patch_model(model) (or the reverse order): the error said only that posenc's
    rotary embedding "has no inv_freq or attention_scaling to check posenc's RoPE against"."""
    model = build("llama")
    patch_model(model.model)
    with pytest.raises(ValueError, match=r"model\.model is already patched by posenc.*unpatch_model\(model\.model\)"):
        patch_model(model)
    unpatch_model(model.model)
    patch_model(model)
    with pytest.raises(ValueError, match="part of a model that posenc has patched"):
        patch_model(model.model)
    assert is_patched(model) and not is_patched(model.model)


def test_config_edited_after_the_model_was_built_is_named_in_the_error() -> None:
    """The model's rotary module keeps the frequencies it was built with (transformers does not read the config
    again); the refusal blamed only a gap in posenc, not the edited config, for which the fix is the user's."""
    model = build("llama")
    model.config.rope_parameters = {
        **model.config.rope_parameters,
        "rope_theta": 2 * model.config.rope_parameters["rope_theta"],
    }
    with pytest.raises(ValueError, match="config was changed after the model was built"):
        patch_model(model)
    assert not is_patched(model)


# --- tiny_model_from_config (the lab's HF-architecture model) -------------------------------------------------


def test_tiny_model_from_a_real_config_keeps_its_rope_base() -> None:
    model = tiny_model_from_config(CONFIGS / "llama-3.1-8b.json", max_position_embeddings=32)
    config = model.config
    assert (config.hidden_size, config.num_hidden_layers, config.num_attention_heads, config.vocab_size) == (
        64,
        2,
        4,
        256,
    )
    assert config.rope_parameters["rope_theta"] == 500000.0 and config.rope_parameters["rope_type"] == "default"
    assert config.max_position_embeddings == 32
    with torch.no_grad():
        assert model(torch.zeros(1, 5, dtype=torch.long)).logits.shape == (1, 5, 256)
    report = patch_model(model, rope_parameters={"rope_type": "yarn", "factor": 4.0})
    assert report.rope_parameters["original_max_position_embeddings"] == 32


def test_tiny_model_keeps_partial_rotary_and_optionally_the_scaling() -> None:
    neox = tiny_model_from_config(CONFIGS / "gpt-neox-20b.json", max_position_embeddings=32)
    assert patch_model(neox).rotary_dim == 4  # rotary_pct 0.25 of head_dim 16
    llama = tiny_model_from_config(CONFIGS / "llama-3.1-8b.json", keep_scaling=True)
    assert llama.config.rope_parameters["rope_type"] == "llama3"
    assert llama.config.rope_parameters["original_max_position_embeddings"] == 8192
    # A kept LongRoPE whose factor lists fit the real head, not the tiny one: posenc's message, not transformers'
    # "size of tensor a (48) must match" from inside its rotary class.
    longrope = {"rope_type": "longrope", "short_factor": [1.0] * 48, "long_factor": [2.0] * 48}
    source = {"model_type": "llama", "hidden_size": 3072, "num_attention_heads": 32, "max_position_embeddings": 8192}
    source["rope_scaling"] = {**longrope, "original_max_position_embeddings": 4096}
    with pytest.raises(ValueError, match=r"does not fit this tiny model \(head_dim=16\): .*short_factor'\] must hold"):
        tiny_model_from_config(source, keep_scaling=True)
    fits = tiny_model_from_config(source, keep_scaling=True, hidden_size=384, head_dim=96)
    assert fits.config.rope_parameters["short_factor"] == [1.0] * 48
    # A config with no scaling to keep builds as it does without keep_scaling (an odd rotary size included).
    odd = tiny_model_from_config(CONFIGS / "gpt-neox-20b.json", keep_scaling=True, hidden_size=48, num_heads=4)
    assert odd.config.rope_parameters["rope_type"] == "default"


def test_tiny_model_is_reproducible_and_seeded() -> None:
    source = json.loads((CONFIGS / "qwen2.5-7b-instruct-yarn.json").read_text())
    a, b = tiny_model_from_config(source, seed=3), tiny_model_from_config(source, seed=3)
    c = tiny_model_from_config(source, seed=4)
    assert torch.equal(a.lm_head.weight, b.lm_head.weight) and not torch.equal(a.lm_head.weight, c.lm_head.weight)


@pytest.mark.parametrize(
    ("config", "kwargs", "match"),
    [
        ({"model_type": "gpt2"}, {}, "not supported"),
        ({"model_type": "llama"}, {"num_heads": 0}, "num_heads must be a positive integer"),
        ({"model_type": "llama"}, {"num_kv_heads": 3}, "num_kv_heads must be a positive divisor"),
        ({"model_type": "llama"}, {"hidden_size": 66}, "divisible by num_heads"),
        ({"model_type": "gpt_neox"}, {"head_dim": 32}, "GPT-NeoX ties head_dim"),
        ({"model_type": "gpt_neox"}, {"num_kv_heads": 2}, "no grouped-query attention"),
        ({"model_type": "llama"}, {"max_position_embeddings": 0}, "max_position_embeddings must be a positive"),
    ],
)
def test_tiny_model_bad_arguments(config: dict, kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        tiny_model_from_config(config, **kwargs)


def test_tiny_model_missing_file_or_wrong_type(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=r"config\.json"):
        tiny_model_from_config(tmp_path)
    with pytest.raises(TypeError, match=r"path to a config\.json or a dict"):
        tiny_model_from_config(42)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "rope_parameters",
    [
        {"rope_type": "linear", "factor": 4.0},
        {"rope_type": "ntk", "factor": 4.0},
        {"rope_type": "dynamic", "factor": 2.0},
        {"rope_type": "yarn", "factor": 4.0, "beta_fast": 32.0, "beta_slow": 1.0},
        {"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0},
    ],
)
def test_lab_extensions_apply_to_a_tiny_model(rope_parameters: dict) -> None:
    # The lab's training-free study: train at 32 tokens, then evaluate at 4x with each extension. The patched model
    # gives the logits of transformers' own model built from the config the patch wrote, with the same weights.
    model = tiny_model_from_config(CONFIGS / "llama-3.1-8b.json", max_position_embeddings=32)
    with torch.no_grad():  # attention peaked enough for the positions to matter in a random model
        for name, parameter in model.named_parameters():
            if name.endswith(("q_proj.weight", "k_proj.weight")):
                parameter.mul_(8)
    unscaled = copy.deepcopy(model)
    patch_model(model, rope_parameters=rope_parameters)
    plain = transformers.AutoModelForCausalLM.from_config(copy.deepcopy(model.config)).eval()
    plain.load_state_dict(unscaled.state_dict())
    ids = torch.randint(0, 256, (2, 128), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits, theirs, before = model(ids).logits, plain(ids).logits, unscaled(ids).logits
    assert logits.shape == (2, 128, 256)
    torch.testing.assert_close(logits, theirs, **FP32)
    assert (logits - before).abs().max() > 1e-2  # the extension changed the model


def test_training_through_the_patch_gives_transformers_gradients() -> None:
    reference = build("qwen3", "yarn")
    patched = copy.deepcopy(reference)
    patch_model(patched)
    ids = tokens()
    for model in (reference, patched):
        model(ids, labels=ids).loss.backward()
    for (name, ours), theirs in zip(patched.named_parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(ours.grad, theirs.grad, atol=1e-5, rtol=1e-4, msg=name)


def test_a_deep_copy_of_a_patched_model_is_patched_on_its_own() -> None:
    model = build("llama")
    ids = tokens()
    with torch.no_grad():
        original = model(ids).logits
        patch_model(model, rope_parameters={"rope_type": "linear", "factor": 2.0})
        scaled = model(ids).logits
        twin = copy.deepcopy(model)
        assert torch.equal(twin(ids).logits, scaled)
        unpatch_model(twin)
        assert torch.equal(twin(ids).logits, original)
        assert is_patched(model) and torch.equal(model(ids).logits, scaled)


@pytest.mark.parametrize(
    "rope_parameters",
    [
        # YaRN without truncation at a large factor, and a narrow Llama 3 band: transformers' float32 blend weight
        # puts its inv_freq 1.3e-5 and 1.9e-5 (relative) away from the exact one here, past the pow's tolerance.
        # The patched model still gives the same logits, and must not be refused as a gap in posenc.
        {
            "rope_type": "yarn",
            "rope_theta": 1e4,
            "factor": 256.0,
            "original_max_position_embeddings": 4096,
            "truncate": False,
        },
        {
            "rope_type": "llama3",
            "rope_theta": 5e5,
            "factor": 40.0,
            "low_freq_factor": 0.9428,
            "high_freq_factor": 1.0628,
            "original_max_position_embeddings": 2048,
        },
    ],
)
def test_float32_blend_error_of_transformers_is_not_taken_for_a_different_rotation(rope_parameters: dict) -> None:
    config = transformers.AutoConfig.for_model(
        "llama", **{**SIZES, "head_dim": 128, "num_attention_heads": 2, "num_key_value_heads": 2}
    )
    config.rope_parameters = rope_parameters
    config.max_position_embeddings = 4096 * 256
    torch.manual_seed(0)
    reference = transformers.AutoModelForCausalLM.from_config(config).eval()
    patched = copy.deepcopy(reference)
    patch_model(patched)
    ids = tokens()
    with torch.no_grad():
        torch.testing.assert_close(patched(ids).logits, reference(ids).logits, **FP32)


def test_tiny_model_from_config_without_transformers_says_how_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "transformers", None)
    with pytest.raises(ModuleNotFoundError, match=r"tiny_model_from_config .* pip install transformers"):
        tiny_model_from_config({"model_type": "llama", "hidden_size": 32, "num_attention_heads": 2})


def test_phi3s_top_level_original_length_fills_in_only_what_the_dict_leaves_out() -> None:
    """The top-level original length of a Phi-3-128k config is the default for the types that read one: a length given
    in the dict stays (8, not the model's 16), and 'default', which reads none, is not handed it (it was refused as a
    key that 'default' does not use)."""
    pairs = ROTARY_PAIRS.get("phi3", 8)
    longrope = {"rope_type": "longrope", "short_factor": [1.0] * pairs, "long_factor": [4.0] * pairs}
    for given, original in (({**longrope, "original_max_position_embeddings": 8}, 8), ({"rope_type": "default"}, None)):
        model = build("phi3", "longrope")  # max_position_embeddings 64, original 16
        report = patch_model(model, rope_parameters=given)
        assert report.rope_parameters.get("original_max_position_embeddings") == original
        fresh = transformers.AutoModelForCausalLM.from_config(copy.deepcopy(model.config)).eval()
        fresh.load_state_dict(model.state_dict())
        with torch.no_grad():
            torch.testing.assert_close(model(tokens()).logits, fresh(tokens()).logits, **FP32)
