"""patch_model across every causal-LM architecture of the installed transformers whose modeling code has an
``apply_rotary_pos_emb*`` function: each is patched, with logits equal to the unpatched model's (a full forward and
a cached decoding step), or refused for the reason listed in REFUSED. Never a silently different model.

The tiny models come from each config class's defaults with small sizes (no download), initializer_range 0.3 so
that attention is peaked enough for the rotation to matter; each patched model also shows that it does: with its
rotation replaced by the identity its logits move by SENSITIVE or more.
"""

from __future__ import annotations

import copy
import importlib
import re
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

from posenc.interop import patch as patch_module
from posenc.interop._discover import ROTATION_PREFIX, innermost, rotation_signature
from posenc.interop.hf import rope_kwargs_from_config, rope_layer_types
from posenc.interop.patch import VERIFIED_ARCHITECTURES, is_patched, patch_model
from posenc.testing import TINY_HF_SIZES, torch_threads

transformers = pytest.importorskip("transformers")
from transformers.models.auto.configuration_auto import model_type_to_module_name  # noqa: E402
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES  # noqa: E402

SIZES: dict[str, Any] = dict(
    **TINY_HF_SIZES,
    vocab_size=128,
    max_position_embeddings=64,
    # mixtures of experts
    moe_intermediate_size=32,
    num_experts=4,
    n_routed_experts=4,
    num_local_experts=4,
    num_experts_per_tok=2,
    n_shared_experts=1,
    shared_expert_intermediate_size=64,
    first_k_dense_replace=1,
    n_group=1,
    topk_group=1,
    # multi-head latent attention: its rope part is qk_rope_head_dim channels
    kv_lora_rank=16,
    q_lora_rank=16,
    qk_rope_head_dim=8,
    qk_nope_head_dim=8,
    v_head_dim=16,
    rotary_dim=8,  # GPT-J, CodeGen: in channels
    # sparse-attention indexers (DeepSeek-V3.2, GLM-MoE-DSA, dots.llm3, ...) keep 4 of the 12 tokens, so that which
    # ones, and so their own rotation, moves the logits (their default, 2048, keeps every token)
    index_topk=4,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
)
OVERRIDES: dict[str, dict[str, Any]] = {
    "flint": dict(num_hidden_layers=4),  # its first two layers have no attention
    "mimo_v2_flash": dict(head_dim=24),  # partial_rotary_factor 0.334 of 24 channels: 8 rotate
    # HRM runs its layers 12 times over: at 0.3 a change of 1e-7 in the weights moves its logits by 2e-2, so
    # transformers' float32 cos/sin against posenc's float64-derived ones differ by 8e-3 there.
    "hrm_text": dict(initializer_range=0.1),
    "zaya": dict(num_experts_per_tok=1),
    # Per-layer inputs; Gemma 4's full-attention layers take global_head_dim (per_layer_config), and Gemma 3n's
    # default shares the caches of its last layers, which two layers cannot.
    **{
        model_type: dict(global_head_dim=32, hidden_size_per_layer_input=8, vocab_size_per_layer_input=128)
        for model_type in ("gemma4_text", "gemma4_unified_text")
    },
    "gemma3n_text": dict(num_kv_shared_layers=0, hidden_size_per_layer_input=8, vocab_size_per_layer_input=128),
    "minimax_m3_vl_text": dict(layer_types=["minimax_m3_sparse"] * 2, index_head_dim=8),  # with its indexer
    # Its rope dict names only the layer types of its own pattern; one layer in each of its input, looped (twice)
    # and output sections, which its defaults size for 36 layers (a cached step then fails in transformers).
    "dory": dict(layer_types=None, num_hidden_layers=3, n_input_layers=1, n_recurrent_layers=1, n_output_layers=1),
    # M-RoPE hybrids: enough layers for an attention one, and a section that fits 8 pairs (a quarter of 64
    # channels), cycled t, h, w
    **{
        model_type: dict(
            num_hidden_layers=4,
            head_dim=64,
            rope_parameters=dict(rope_theta=1e4, partial_rotary_factor=0.25, mrope_section=[3, 3, 2]),
        )
        for model_type in ("qwen3_5_text", "qwen3_5_moe_text")
    },
    # hybrids whose first layers are linear attention or state space: enough layers to reach an attention one
    **{model_type: dict(num_hidden_layers=4) for model_type in ("bailing_hybrid", "lfm3", "qwen3_next")},
    # with Mamba 2 mixers of 8 heads (128 of 64 channels by default: 2 s a model here)
    "nemotron_h": dict(num_hidden_layers=4, mamba_num_heads=8, mamba_head_dim=16, ssm_state_size=16, chunk_size=16),
    # an attention layer first: transformers' cache reads the decoded length from layer 0, a recurrent one's is 0
    "recurrent_gemma": dict(block_types=["attention", "recurrent"]),
    "zamba": dict(num_hidden_layers=4),  # two hybrid layers, the second tied to the first
    "zamba2": dict(num_hidden_layers=4, use_mem_rope=True),  # its RoPE is off by default
    "jamba": dict(attn_layer_period=2, attn_layer_offset=1),  # its second layer attends (without RoPE)
    # Mamba 2 layers at sizes of their own: the defaults (128 heads, a state of 256, chunks of 256 that the 12
    # tokens are padded to) took 12 s a model on the CPU in transformers' reference scan; RoPE is the attention's
    # alone, which these sizes leave as they were. Falcon H1 runs a mamba mixer beside the attention in every layer.
    "falcon_h1": dict(mamba_d_ssm=64, mamba_n_heads=8, mamba_d_head=8, mamba_d_state=16, mamba_chunk_size=16),
    "granitemoehybrid": dict(
        layer_types=["linear_attention", "full_attention"],
        position_embedding_type="rope",
        mamba_n_heads=8,
        mamba_d_head=16,
        mamba_d_state=16,
        mamba_chunk_size=16,
    ),
    # its attention layers need the QSA indexer (refused: see REFUSED), the fields of which default to None; with
    # Qwen 3.5's M-RoPE sizes above, so that the refusal is the indexer's, not a section that does not fit
    "qwen4_exp_text": dict(
        head_dim=64,
        rope_parameters=dict(rope_theta=1e4, partial_rotary_factor=0.25, mrope_section=[3, 3, 2]),
        **dict(indexer_n_heads=2, indexer_kv_heads=1, indexer_head_dim=16, indexer_budget=8, indexer_compress_ratio=2),
    ),
    # its default rope dict is empty: one per layer type, interleaved M-RoPE sections that fit 8 pairs
    "cohere_compass_text": dict(
        rope_parameters=dict(full_attention=dict(rope_type="default", rope_theta=1e4, mrope_section=[4, 2, 2]))
    ),
    # Its attention reads rope_theta (unused) from the attention sub-config, which has no such field, and clamps
    # q, k, v to clip_qkv, which fails at its default None (DBRX's own config.json: 8); its experts' hidden size
    # is copied from d_model before the alias hidden_size is applied.
    "dbrx": dict(
        d_model=64,
        attn_config=dict(kv_n_heads=2, rope_theta=1e4, clip_qkv=8.0),
        ffn_config=dict(ffn_hidden_size=64),
    ),
    "lfm2_moe": dict(layer_types=["conv", "full_attention"]),  # its default is None, which its layers index
    # its rotary embedding is head_dim wide (64 by default), its rotation qk_rope_head_dim: both 64 in LongCat's own
    "longcat_flash": dict(qk_rope_head_dim=64),
    "kolibri1_1": dict(index_num_heads=2),  # its validator: at most the query heads per key head
    # attention layers alone: its cache reads the mask sizes from layer 0 (a mamba layer's it cannot), and its
    # mamba layers take 20 s a test here on the CPU, where RoPE is the attention's alone
    "bamba": dict(attn_layer_indices=[0, 1]),
    # MLA with a key head per query head (its validator), an indexed layer and a sliding one; the sliding layer's
    # sizes are its own (per_layer_config), 64 heads of 256 channels by default
    "dots3_note_text": dict(
        num_key_value_heads=4,
        head_dim=16,  # qk_nope_head_dim + qk_rope_head_dim: partial_rotary_factor 0.5, 8 channels rotate
        index_head_dim=16,
        index_n_heads=2,
        per_layer_config={
            1: dict(
                num_attention_heads=4,
                num_key_value_heads=4,
                q_lora_rank=16,
                kv_lora_rank=16,
                head_dim=16,
                qk_nope_head_dim=8,
                qk_rope_head_dim=8,
                v_head_dim=16,
            )
        },
    ),
    # one rotary embedding per rope_theta, each with a config of its own, and a layer without RoPE (theta 0)
    **{
        model_type: dict(num_hidden_layers=3, layer_rope_theta=[1e4, 500.0, 0.0])
        for model_type in ("granite_swa", "granitemoe_swa")
    },
}
# Model types whose model numbers the positions from 0 in every call unless given position_ids, cache or not
# (BambaModel, transformers 5.25; generate passes them): their cached step is given its positions.
POSITIONS_NOT_FROM_THE_CACHE = frozenset({"bamba"})
# Patched with the same logits, but the rotation hardly moves a tiny model's logits, so that it matters is not shown.
INSENSITIVE = {"zaya": "its CCA projections and q/k norms: without the rotation its logits move by 3e-5"}
MAX_PARAMETERS = 8_000_000  # composite models whose vision tower keeps its full size are left out
FP32 = dict(atol=1e-4, rtol=1e-4)  # float32 logits of magnitude ~10: observed <= 5e-5
SENSITIVE = 1e-3

# model_type -> why posenc refuses it (a regex of the error).
REFUSED: dict[str, str] = {
    **dict.fromkeys(("jamba", "nemotron_h", "zamba"), r"one \*RotaryEmbedding class; .* none"),
    **dict.fromkeys(("codegen", "gptj"), r"holds no inv_freq buffer"),
    "deepseek_v4": r"rotates the last qk_rope_head_dim channels",
    "nanochat": r"negative angle",
    "cohere_compass_text": r"multimodal RoPE with one rope dict per layer type, which posenc does not read",
    "minimax_m3_vl_text": r"MiniMaxM3VLIndexer cuts cos/sin itself \(cos\[\.\.\., : self\.head_dim\]\)",
    "qwen4_exp_text": r"QSAIndexer\._select_tokens calls apply_rotary_pos_emb outside forward",
}
# Architectures whose patching this file must see succeed, whatever else the installed transformers holds.
MUST_PATCH = (
    *("llama", "mistral", "mixtral", "qwen2", "qwen2_moe", "qwen3", "qwen3_moe", "gemma", "gemma2", "gemma3_text"),
    *("phi", "phi3", "gpt_neox", "stablelm", "cohere", "cohere2", "glm", "glm4", "deepseek_v3", "olmo2"),
    *("granite", "starcoder2", "falcon", "gpt_oss", "ernie4_5", "minicpm3", "modernbert-decoder"),
)


# A module-level apply_rotary_pos_emb* function, defined or imported (one name in a parenthesised import list too).
_ROTATION_SOURCE = re.compile(
    rf"^(?:def {ROTATION_PREFIX}|{ROTATION_PREFIX}\w* =|from [\w.]+ import (?:\([^)]*?|[^\n]*?)\b{ROTATION_PREFIX})",
    re.MULTILINE,
)


def _candidates() -> list[str]:
    """The causal-LM types whose modeling source has a rotation function, read as text: importing the ~190 modules
    took 6 s of every test worker's collection. test_the_source_scan_finds_what_importing_finds checks the two agree."""
    models = Path(transformers.__file__).parent / "models"
    found = []
    for model_type in sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES):
        name = model_type_to_module_name(model_type)
        source = models / name / f"modeling_{name}.py"
        if source.is_file() and _ROTATION_SOURCE.search(source.read_text(encoding="utf-8")):
            found.append(model_type)
    return found


CANDIDATES = _candidates()


def tiny(model_type: str, rope_type: str | None = None) -> Any:
    """A tiny float32 model of the type in eval mode, or pytest.skip saying why it cannot be built or run here.

    rope_type: "dynamic" gives it dynamic NTK (factor 2) over a trained length of 8, which the 12 tokens cross."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            defaults = transformers.AutoConfig.for_model(model_type)
            sizes = {**SIZES, **OVERRIDES.get(model_type, {})}
            if hasattr(defaults, "qk_rope_head_dim"):  # MLA: head_dim follows qk_rope_head_dim, one kv head per head
                for key in ("head_dim", "num_key_value_heads"):
                    if key not in OVERRIDES.get(model_type, {}):
                        sizes.pop(key)
            kwargs = {
                key: value for key, value in sizes.items() if _has(defaults, key) and not _read_only(defaults, key)
            }
            if rope_type is not None:
                base = kwargs.get("rope_parameters") or defaults.rope_parameters or {}
                kept = {
                    key: base[key] for key in ("rope_theta", "partial_rotary_factor", "mrope_section") if key in base
                }
                if "llama_4_scaling_beta" in base:
                    # Ministral 3's attention scales q by log(1 + position // original) and fails without both keys;
                    # an original length unlike max_position_embeddings, which dynamic NTK scales from, either way.
                    kept.update(llama_4_scaling_beta=base["llama_4_scaling_beta"], original_max_position_embeddings=4)
                kwargs.update(
                    max_position_embeddings=8, rope_parameters={"rope_type": rope_type, "factor": 2.0, **kept}
                )
            default_types = getattr(defaults, "layer_types", None)
            if (
                isinstance(default_types, list)
                and not _read_only(defaults, "layer_types")
                and "layer_types" not in kwargs
            ):
                # Every kind of layer the default stack has, in turn (Gemma 3 has five sliding layers first), given
                # to the config rather than set on it: Zamba's validator checks their number against the layers'.
                # Under the field's own name: Zamba 2 derives hybrid_layer_ids from it before an alias is applied.
                kinds = list(dict.fromkeys(default_types))
                layers = kwargs.get("num_hidden_layers", defaults.num_hidden_layers)
                name = getattr(type(defaults), "attribute_map", {}).get("layer_types", "layer_types")
                kwargs[name] = [kinds[i % len(kinds)] for i in range(layers)]
            config = transformers.AutoConfig.for_model(model_type, **kwargs)
            with torch.device("meta"):
                parameters = sum(p.numel() for p in transformers.AutoModelForCausalLM.from_config(config).parameters())
            if parameters > MAX_PARAMETERS:
                pytest.skip(f"{model_type}: {parameters / 1e6:.0f}M parameters at these sizes (sub-configs)")
            torch.manual_seed(0)
            model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
            logits(model, tokens())
        except pytest.skip.Exception:
            raise
        except Exception as error:  # config classes that need more than sizes, optional packages, ...
            pytest.skip(f"{model_type}: no tiny model runs here ({type(error).__name__}: {str(error)[:120]})")
    return model


def _has(config: Any, key: str) -> bool:
    """hasattr, for heterogeneous configs too: Gemma 4's refuses to read head_dim globally, since it is per layer."""
    try:
        getattr(config, key)
    except AttributeError:
        return False
    except Exception:  # transformers' AmbiguousGlobalPerLayerAttributeError: the attribute is there, per layer
        return True
    return True


def _read_only(config: Any, key: str) -> bool:
    """A property of the config class without a setter (Falcon's head_dim, Bamba's layer_types): derived, not
    given."""
    key = getattr(type(config), "attribute_map", {}).get(key, key)  # Bamba's layer_types is its layers_block_type
    attribute = getattr(type(config), key, None)
    return isinstance(attribute, property) and attribute.fset is None


def tokens() -> torch.Tensor:
    return torch.randint(3, 128, (2, 12), generator=torch.Generator().manual_seed(0))


def logits(model: Any, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(logits of a full forward, logits of the last 4 tokens decoded after an 8-token prefill with the cache)."""
    with torch.no_grad():
        full = model(ids).logits
        prefill = model(ids[:, :8], use_cache=True)
        if "cache" in prefill:
            given = {}
            if model.config.model_type in POSITIONS_NOT_FROM_THE_CACHE:
                given["position_ids"] = torch.arange(8, ids.shape[1]).expand(ids.shape[0], -1)
            cached = model(ids[:, 8:], cache=prefill.cache, **given).logits
        else:  # RecurrentGemma returns no cache (its recurrent state is in its modules) and decodes a token a call
            cache = transformers.DynamicCache(config=model.config)
            model(ids[:, :8], use_cache=True, cache=cache)
            steps = [model(ids[:, i : i + 1], use_cache=True, cache=cache).logits for i in range(8, ids.shape[1])]
            cached = torch.cat(steps, dim=1)
    return full, cached


@pytest.fixture(autouse=True, scope="module")
def _quiet_and_one_thread():
    verbosity = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_error()
    with torch_threads(1):
        yield
    transformers.logging.set_verbosity(verbosity)


def test_the_source_scan_finds_what_importing_finds() -> None:
    imported, unimportable = [], []
    for model_type in sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES):
        name = model_type_to_module_name(model_type)
        try:
            modeling = importlib.import_module(f"transformers.models.{name}.modeling_{name}")
        except Exception:  # an optional package the modeling module needs is not installed: tiny() skips it, saying so
            unimportable.append(model_type)
            continue
        if any(attr.startswith(ROTATION_PREFIX) and callable(value) for attr, value in vars(modeling).items()):
            imported.append(model_type)
    assert [model_type for model_type in CANDIDATES if model_type not in unimportable] == imported


def test_the_scan_sees_the_architectures_it_must_patch() -> None:
    missing = [model_type for model_type in MUST_PATCH if model_type not in CANDIDATES]
    assert not missing, f"not found in the installed transformers: {missing}"


@pytest.mark.parametrize("model_type", CANDIDATES)
def test_patched_with_the_same_logits_or_refused(model_type: str) -> None:
    try:
        model = tiny(model_type)
    except pytest.skip.Exception as reason:
        listed = model_type in VERIFIED_ARCHITECTURES or model_type in REFUSED or model_type in MUST_PATCH
        if listed:  # what the lists say must be shown here, not skipped
            pytest.fail(f"{model_type} is listed, but {reason}")
        raise
    patched = copy.deepcopy(model)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            report = patch_model(patched)
    except ValueError as error:
        assert model_type in REFUSED, f"{model_type} was refused: {error}"
        assert model_type not in MUST_PATCH
        assert re.search(REFUSED[model_type], str(error)), str(error)
        assert not is_patched(patched) and model_type not in VERIFIED_ARCHITECTURES
        torch.testing.assert_close(logits(patched, tokens()), logits(model, tokens()), atol=0, rtol=0)
        return
    assert model_type not in REFUSED, f"{model_type} was patched, but REFUSED says it is not: {report}"
    assert model_type in VERIFIED_ARCHITECTURES, f"{model_type} is patched: add it to VERIFIED_ARCHITECTURES"
    assert not [w for w in caught if "have not compared" in str(w.message)]
    ids = tokens()
    expected, expected_cached = logits(model, ids)
    # The cached step is a check only where the cache is used: one dropped (an argument the model does not read)
    # gives the logits of the 4 tokens alone, off by 0.1 or more.
    torch.testing.assert_close(expected_cached, expected[:, 8:], **FP32)
    full, cached = logits(patched, ids)
    torch.testing.assert_close(full, expected, **FP32)
    torch.testing.assert_close(cached, expected_cached, **FP32)

    # The rotation is on the path: without it the logits move.
    kinds: dict[str, int] = {}
    replaced: list[tuple[dict[str, Any], str, Any]] = []
    for module in patched.modules():
        function = module.__dict__.get(patch_module._FORWARD_ATTR)  # the patched copy of its class's forward
        if function is not None:
            namespace = innermost(function).__globals__
            for name in report.rotations:
                if name not in kinds:  # the first namespace holds posenc's rotation, not yet the stand-in below
                    kinds[name] = _tensors(namespace[name], name)
                replaced.append((namespace, name, namespace[name]))
                if kinds[name] == 1:  # (x, cos, sin): Gemma 3n, Gemma 4
                    namespace[name] = lambda x, *args, **kwargs: x
                else:
                    namespace[name] = lambda q, k, *args, **kwargs: (q, k)
    try:
        with torch.no_grad():
            unrotated = patched(ids).logits
    finally:  # models patched alike later share this copy of the forward
        for namespace, name, original in reversed(replaced):
            namespace[name] = original
    assert ((unrotated - full).abs().max() > SENSITIVE) != (model_type in INSENSITIVE)


def _tensors(function: Any, name: str) -> int:
    """How many tensors a rotation function takes: posenc's replacement (a partial) or transformers' own."""
    replaced = getattr(function, "func", None)
    if replaced is not None:
        return 1 if replaced.__name__ == "_rotate_one" else 2
    return rotation_signature(function, name)[2]


# Verified types that cannot take dynamic NTK, and why (checked below): their cases skipped on every machine.
NO_DYNAMIC = {
    "phi3": r"type field must be one of \['longrope'\]",  # transformers' Phi3Config refuses other types
    "phimoe": r"model_type 'phimoe' with rope_type 'dynamic' is not supported",  # posenc maps its longrope only
    "recurrent_gemma": r"does not support RoPE types other than `default`",  # its rotary embedding refuses it
}
# Verified types whose default config has a rope dict per layer type, which dynamic NTK is not tried on. Listed, not
# read from ~120 configs while collecting (5 s in every test worker): test_the_layer_typed_list_is_the_configs checks.
LAYER_TYPED = frozenset(
    {"beam", "dory", "dots3_note_text", "ergo", "gemma3_text", "gemma3n_text", "gemma4_text", "gemma4_unified_text"}
    | {"laguna", "lfm3", "mellum", "mimo_v2_flash", "modernbert-decoder", "olmo3", "zaya"}
)
DYNAMIC = sorted((VERIFIED_ARCHITECTURES & set(CANDIDATES)) - LAYER_TYPED - NO_DYNAMIC.keys())


def test_the_layer_typed_list_is_the_configs() -> None:
    layer_typed = {
        model_type
        for model_type in VERIFIED_ARCHITECTURES & set(CANDIDATES)
        if rope_layer_types(transformers.AutoConfig.for_model(model_type))
    }
    assert layer_typed == LAYER_TYPED


def test_the_types_left_out_of_dynamic_cannot_take_it() -> None:
    dynamic = {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4}
    with pytest.raises(Exception, match=NO_DYNAMIC["phi3"]):  # huggingface_hub's validation error wraps it
        transformers.AutoConfig.for_model("phi3", rope_parameters=dynamic)
    # PhiMoE's config takes it given the mscales its rotary embedding multiplies cos/sin by; posenc refuses it.
    mscales = {"short_mscale": 1.0, "long_mscale": 1.0}
    config = transformers.AutoConfig.for_model("phimoe", rope_parameters={**dynamic, **mscales})
    with pytest.raises(ValueError, match=NO_DYNAMIC["phimoe"]):
        rope_kwargs_from_config(config)
    config = transformers.AutoConfig.for_model("recurrent_gemma", rope_parameters=dynamic)
    with pytest.raises(ValueError, match=NO_DYNAMIC["recurrent_gemma"]), torch.device("meta"):
        transformers.AutoModelForCausalLM.from_config(config)


@pytest.mark.parametrize("model_type", DYNAMIC)
def test_dynamic_ntk_gives_the_same_logits(model_type: str) -> None:
    # The frequencies change with the length: posenc's rotary embedding follows transformers' dynamic state through
    # a full forward past the trained length and a cached decoding step.
    model = tiny(model_type, rope_type="dynamic")
    if model.config.rope_parameters.get("rope_type") != "dynamic":
        pytest.skip(f"{model_type}'s config does not keep rope_type 'dynamic'")
    patched = copy.deepcopy(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        report = patch_model(patched)
    assert report.rope_type == "dynamic"
    ids = tokens()
    for got, expected in zip(logits(patched, ids), logits(model, ids), strict=True):
        torch.testing.assert_close(got, expected, **FP32)


# One of each kind the scan adds beyond SUPPORTED_ARCHITECTURES: evens-then-odds (DeepSeek-V3), adjacent pairs from
# repeat_interleave'd cos/sin (Cohere), one rope per layer type (Gemma 3), partial and adjacent (GLM), q and k
# rotated in separate calls, with a head_dim per layer type (Gemma 4).
BEYOND = ("deepseek_v3", "cohere", "gemma3_text", "glm", "gemma4_text")


@pytest.mark.parametrize("model_type", BEYOND)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_errs_no_more_than_transformers(model_type: str, dtype: torch.dtype) -> None:
    # Against the float32 model: posenc's bf16/fp16 logits err no more than transformers' own, on the mean (a max
    # bound is flaky for mixtures of experts, whose routing flips with rounding either way).
    model = tiny(model_type)
    ids = torch.randint(3, 128, (2, 28), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        exact = model(ids).logits.double()
        theirs = copy.deepcopy(model).to(dtype)(ids).logits.double()
        patched = copy.deepcopy(model).to(dtype)
        patch_model(patched)
        ours = patched(ids).logits.double()
    assert (ours - exact).abs().mean() <= 1.1 * (theirs - exact).abs().mean()


@pytest.mark.parametrize("model_type", BEYOND)
def test_greedy_generation_with_left_padding_gives_the_same_tokens(model_type: str) -> None:
    model = tiny(model_type)
    patched = copy.deepcopy(model)
    patch_model(patched)
    ids = torch.randint(3, 128, (2, 10), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    ids[0, :4], mask[0, :4] = 0, 0  # the first row is 4 tokens shorter, padded on the left
    options = dict(attention_mask=mask, max_new_tokens=8, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        expected = model.generate(ids, **options)
        for use_cache in (True, False):
            assert torch.equal(patched.generate(ids, use_cache=use_cache, **options), expected)
