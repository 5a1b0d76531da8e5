"""The ``transformers`` model types that ``patch_model`` and ``tiny_model_from_config`` know by name: those whose
scaling ``rope_parameters=`` may change and that ``tiny_model_from_config`` builds (``SUPPORTED_ARCHITECTURES``),
those whose attention rotates every channel of a head, and those whose patched logits the tests compare
(``VERIFIED_ARCHITECTURES``)."""

from __future__ import annotations

# The model types whose code reads the rope dict only in the rotary embedding, so that rope_parameters= may change
# it in place (saved and reloaded with every rope type in tests/interop/test_patch.py), whose attention hands keys
# to the attention function with the rotated channels first ('consistent' mode), and that tiny_model_from_config
# builds.
SUPPORTED_ARCHITECTURES: tuple[str, ...] = ("gemma", "gpt_neox", "llama", "mistral", "phi3", "qwen2", "qwen3")
# Model types with a rope dict per layer type whose attention rotates q, then k (unless the layer reuses another
# layer's keys), each in a call of apply_rotary_pos_emb(x, cos, sin, unsqueeze_dim) on the whole head, and hands the
# keys, cached or shared, to the attention function as they came from it: 'consistent' mode leaves the second call's
# tensor unrotated and rotates the keys at read with the layer type's RoPE (transformers 5.25; the order of the calls
# is read from the forward's source when patching).
_QUERIES_THEN_KEYS_ATTENTION = frozenset({"gemma3n_text", "gemma4_text"})
# Architectures whose apply_rotary_pos_emb rotates all head_dim channels (no pass-through part): a rotary dim below
# head_dim crashes their unpatched forward, so a saved config asking for one would not load into a working model.
_WHOLE_HEAD_ATTENTION = frozenset({"gemma", "llama", "mistral", "qwen2", "qwen3"})
# The model types whose patched tiny models give the unpatched logits, full forward and cached decoding, in
# tests/interop/test_patch_architectures.py and test_patch_multimodal.py (transformers 5.25; `python
# scripts/patch_coverage.py` lists the first). Others that pass patch_model's checks are patched with a warning.
VERIFIED_ARCHITECTURES: frozenset[str] = frozenset(
    {
        *("afmoe", "apertus", "apertus1p5_text", "arcee", "aria_text", "axk1", "axk2", "bailing_hybrid", "bamba"),
        *("bitnet", "cohere", "cohere2", "cohere2_moe", "cwm", "deepseek_v3", "deepseek_v32", "diffllama", "doge"),
        *("beam", "dory", "dots1", "dots3_note_text", "ergo", "ernie4_5", "ernie4_5_moe", "exaone4", "exaone_moe"),
        *("falcon", "flex_olmo", "flint"),
        *("gemma", "gemma2", "gemma3_text", "gemma3n_text", "gemma4_text", "gemma4_unified_text", "glm", "glm4"),
        *("glm4_moe", "glm4_moe_lite", "glm_moe_dsa", "gpt_neox"),
        *("gpt_neox_japanese", "gpt_oss", "granite", "granite_swa", "granitemoe", "granitemoe_swa", "granitemoeshared"),
        *("granitemoehybrid", "helium", "hrm_text", "hunyuan_v1_dense", "hunyuan_v1_moe", "hy_v3", "hy_v4"),
        *("hyperclovax", "jais2", "jetmoe", "kolibri1", "kolibri1_1", "laguna", "lara_mini", "lfm2", "lfm3", "llama"),
        *("mellum", "mimo_v2_flash", "minicpm3"),
        *("minicpm5_moe", "minimax", "minimax_m2", "ministral", "ministral3", "mistral", "mixtral"),
        *("modernbert-decoder", "moshi", "nemotron", "olmo", "olmo2", "olmo3", "olmo_hybrid", "olmoe", "persimmon"),
        *("phi", "phi3", "phimoe", "qwen2", "qwen2_moe", "qwen3", "qwen3_5_moe_text", "qwen3_5_text", "qwen3_moe"),
        *("qwen3_next", "seed_oss", "smollm3", "solar_open", "stablelm", "starcoder2", "vaultgemma", "youtu", "zaya"),
        *("dbrx", "falcon_h1", "lfm2_moe", "longcat_flash", "recurrent_gemma", "zamba2"),
        # vision-language models, their text model's M-RoPE (tests/interop/test_patch_multimodal.py)
        *("ernie4_5_vl_moe", "glm4v", "glm4v_moe", "glm_ocr", "paddleocr_vl", "qwen2_5_omni_thinker", "qwen2_5_vl"),
        *("qwen2_vl", "qwen3_vl", "qwen3_vl_moe"),
    }
)
