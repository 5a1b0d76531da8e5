"""``tiny_model_from_config``: a small randomly initialised ``transformers`` causal LM of the architecture in a
``config.json``, with its RoPE (the lab's Hugging Face model, and the interop tests')."""

from __future__ import annotations

import os
import warnings
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from posenc._checks import integer, positive_int
from posenc.interop.architectures import SUPPORTED_ARCHITECTURES
from posenc.interop.hf import read_config_json, rope_from_config, rope_kwargs_from_config


def tiny_model_from_config(
    config: str | os.PathLike[str] | Mapping[str, Any],
    *,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int | None = None,
    head_dim: int | None = None,
    vocab_size: int = 256,
    max_position_embeddings: int | None = None,
    keep_scaling: bool = False,
    seed: int = 0,
    attn_implementation: str = "sdpa",
) -> nn.Module:
    """A small randomly initialised causal LM of the architecture in a ``config.json``, with its RoPE.

    config: a path to a config.json (or its folder) or the dict it holds; its ``model_type`` must be in
    ``SUPPORTED_ARCHITECTURES``. The architecture's code, ``rope_theta``, rotary fraction and pair layout come from
    it; the sizes from the arguments (head_dim defaults to hidden_size // num_heads; num_kv_heads to num_heads).
    max_position_embeddings: the model's (default: the config's), the trained length the scaling types extend from
    unless a kept scaling gives ``original_max_position_embeddings``, which then wins, as in transformers.
    keep_scaling: keep the config's rope scaling (LongRoPE factor lists must then fit the head dim: a ValueError
    says so); by default the model gets plain RoPE, to which ``patch_model(model, rope_parameters=...)`` applies
    an extension later.
    seed: the initial weights' (the global generator is left as it was); attn_implementation: transformers'
    ("sdpa", "eager", ...).
    Returns an unpatched ``transformers`` ``*ForCausalLM`` in float32, eval mode; ``model(input_ids).logits`` is
    (b, s, vocab_size).
    """
    try:
        from transformers import AutoConfig, AutoModelForCausalLM
    except ModuleNotFoundError as error:
        if error.name != "transformers":  # a module transformers needs: its own message says which
            raise
        raise ModuleNotFoundError(
            f"tiny_model_from_config builds a transformers model and needs the package ({error}); "
            "pip install transformers"
        ) from error

    if isinstance(config, (str, os.PathLike)):
        source = read_config_json(config)
    elif isinstance(config, Mapping):
        source = dict(config)
    else:
        raise TypeError(f"config must be a path to a config.json or a dict, got {type(config).__name__}")
    model_type = source.get("model_type")
    if model_type not in SUPPORTED_ARCHITECTURES:
        raise ValueError(
            f"config's model_type {model_type!r} is not supported; supported architectures: "
            f"{', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    # Plain ints (numpy's integers too), as the transformers config that holds them is written to JSON.
    hidden_size, num_layers = positive_int("hidden_size", hidden_size), positive_int("num_layers", num_layers)
    num_heads, vocab_size = positive_int("num_heads", num_heads), positive_int("vocab_size", vocab_size)
    divisor = f"a positive divisor of num_heads={num_heads}"
    kv_heads = num_heads if num_kv_heads is None else integer("num_kv_heads", num_kv_heads, low=1, expected=divisor)
    if num_heads % kv_heads:
        raise ValueError(f"num_kv_heads must be {divisor}, got {num_kv_heads!r}")
    if head_dim is not None:
        head_dim = positive_int("head_dim", head_dim)
    if head_dim is None:
        if hidden_size % num_heads:
            raise ValueError(f"hidden_size={hidden_size} must be divisible by num_heads={num_heads}, or give head_dim")
        head_dim = hidden_size // num_heads
    if model_type == "gpt_neox" and head_dim * num_heads != hidden_size:
        raise ValueError(
            f"GPT-NeoX ties head_dim to hidden_size / num_heads = {hidden_size / num_heads}; drop head_dim"
        )
    if model_type == "gpt_neox" and kv_heads != num_heads:
        raise ValueError("GPT-NeoX has no grouped-query attention; leave num_kv_heads unset")
    if max_position_embeddings is not None:
        max_position_embeddings = positive_int("max_position_embeddings", max_position_embeddings)

    rope = rope_kwargs_from_config(source)
    params = dict(rope["rope_parameters"])
    if not keep_scaling:
        params = {key: params[key] for key in ("rope_theta", "partial_rotary_factor") if key in params}
        params["rope_type"] = "default"
    trained = max_position_embeddings if max_position_embeddings is not None else rope["max_position_embeddings"]
    sizes: dict[str, Any] = {
        "hidden_size": hidden_size,
        "num_hidden_layers": num_layers,
        "num_attention_heads": num_heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "intermediate_size": 4 * hidden_size,
        "vocab_size": vocab_size,
        "max_position_embeddings": trained,
        "rope_parameters": params,
        "pad_token_id": None,
        "bos_token_id": None,
        "eos_token_id": None,
    }
    if model_type == "gpt_neox":
        del sizes["num_key_value_heads"], sizes["head_dim"]
    kept = {key: value for key, value in source.items() if key in _KEPT_KEYS}
    if not keep_scaling:
        kept.pop("original_max_position_embeddings", None)
    if keep_scaling and params.get("rope_type", "default") != "default":
        # The kept scaling on the tiny head, checked by posenc, naming the key: transformers failed deep in its
        # rotary class ("size of tensor a (48) must match ... (8)") or in its config validator.
        try:
            with warnings.catch_warnings():  # the source's were given above; the tiny copy's would repeat them
                warnings.simplefilter("ignore")
                rope_from_config({**source, **kept, **sizes, "model_type": model_type})
        except ValueError as error:
            raise ValueError(
                f"keep_scaling=True keeps the config's rope scaling, which does not fit this tiny model (head_dim="
                f"{head_dim}): {error}; give the config's head_dim, or leave keep_scaling False"
            ) from None
    hf_config = AutoConfig.for_model(model_type, **kept, **sizes)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(
            hf_config, dtype=torch.float32, attn_implementation=attn_implementation
        )
    return model.eval()


# config.json keys that describe the architecture's behaviour (kept from the source); sizes and token ids are not.
_KEPT_KEYS = frozenset(
    {
        "hidden_act",
        "rms_norm_eps",
        "layer_norm_eps",
        "attention_bias",
        "mlp_bias",
        "use_parallel_residual",
        "sliding_window",
        "use_sliding_window",
        "original_max_position_embeddings",
        "rope_interleave",
    }
)
