"""patch_model(mode="consistent") for Gemma 3n and Gemma 4, whose attention rotates q and k in separate calls of one
function, keeps a rope dict per layer type, and has layers that reuse another layer's keys (refused until
2026-12-05: "more than one rope dict", then "rotates q and k in separate calls").

The tiny models have four layers: sliding then full attention, each caching its keys, then one of each that reuses
them (Gemma 4's in generate with the queries of the last token only). The sliding layers keep a fixed RoPE and the
full ones scale with the length, so every key a layer caches comes from hidden states that no step's scaling
touched, and consistent mode must give the logits of a full forward however the text is cut into calls.
"""

from __future__ import annotations

import copy
import warnings
from typing import Any

import pytest
import torch

from posenc.interop import patch as patch_module
from posenc.interop import patch_model

transformers = pytest.importorskip("transformers")

TRAINED = 8  # the 14 tokens cross it
FP32 = dict(atol=1e-4, rtol=1e-4)  # float32 logits of magnitude ~10: observed <= 2e-6


def full_attention_rope(rope_type: str, pairs: int) -> dict[str, Any]:
    if rope_type == "dynamic":
        return {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4}
    return {
        "rope_type": "longrope",
        "rope_theta": 1e4,
        "short_factor": [1.0 + i / 8 for i in range(pairs)],
        "long_factor": [2.0 + 3 * i for i in range(pairs)],
        "original_max_position_embeddings": TRAINED,
    }


def tiny(model_type: str, rope_type: str) -> Any:
    # Gemma 4's full-attention layers take global_head_dim; transformers 5.25's longrope validation reads the
    # config's head_dim, which a global_head_dim of its own makes ambiguous (an error), so longrope keeps it equal.
    full_head_dim = 32 if model_type == "gemma4_text" and rope_type == "dynamic" else 16
    sizes = dict(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        num_hidden_layers=4,
        num_kv_shared_layers=2,
        layer_types=["sliding_attention", "full_attention"] * 2,
        sliding_window=4,
        max_position_embeddings=TRAINED if rope_type == "dynamic" else 4 * TRAINED,
        hidden_size_per_layer_input=8,
        vocab_size_per_layer_input=128,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        rope_parameters={
            "full_attention": full_attention_rope(rope_type, full_head_dim // 2),
            "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
        },
    )
    if model_type == "gemma4_text":
        sizes["global_head_dim"] = full_head_dim
    config = transformers.AutoConfig.for_model(model_type, **sizes)
    assert config.kv_sharing_modes == ["store", "store", "reuse", "reuse"]
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()


def tiny_assistant(target: Any) -> Any:
    """A Gemma 4 assistant (gemma4_assistant) for ``target``: two layers, sliding then full, that reuse the target's
    shared_kv_states, at the target's head dims."""
    text = {**target.config.to_dict(), "hidden_size_per_layer_input": 0, "vocab_size_per_layer_input": 0}
    full_head_dim = target.model.layers[1].self_attn.head_dim
    text.update(
        global_head_dim=full_head_dim, num_hidden_layers=2, num_kv_shared_layers=2, layer_types=text["layer_types"][:2]
    )
    for derived in ("kv_sharing_modes", "per_layer_config", "model_type", "transformers_version", "architectures"):
        text.pop(derived, None)
    config = transformers.AutoConfig.for_model(
        "gemma4_assistant",
        text_config=transformers.AutoConfig.for_model("gemma4_text", **text).to_dict(),
        backbone_hidden_size=target.config.hidden_size,
    )
    torch.manual_seed(1)
    return transformers.AutoModelForCausalLM.from_config(config).eval()


def cut_into_calls(model: Any, ids: torch.Tensor, lengths: list[int]) -> float:
    """The largest difference between each call's logits, continuing one DynamicCache, and a full forward's over the
    text up to that call's end."""
    cache, start, worst = transformers.DynamicCache(config=model.config), 0, 0.0
    for length in lengths:
        end = start + length
        got = model(ids[:, start:end], cache=cache, use_cache=True).logits
        worst = max(worst, (got - model(ids[:, :end]).logits[:, start:]).abs().max().item())
        start = end
    return worst


@pytest.mark.parametrize("rope_type", ["dynamic", "longrope"])
@pytest.mark.parametrize("model_type", ["gemma4_text", "gemma3n_text"])
def test_consistent_mode_gives_one_scaling_however_the_text_is_cut(model_type: str, rope_type: str) -> None:
    reference = tiny(model_type, rope_type)
    model = copy.deepcopy(reference)
    report = patch_model(model, mode="consistent")
    assert (
        report.mode == "consistent" and report.rope_type == f"full_attention: {rope_type}, sliding_attention: default"
    )
    ids = torch.randint(3, 128, (2, 14), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        # A full forward is transformers' own ...
        torch.testing.assert_close(model(ids).logits, reference(ids).logits, **FP32)
        # ... and so is every call that continues a cache, which the unpatched model's are not.
        for lengths in ([5, 9], [3, 4, 1, 6], [1] * 14):
            assert cut_into_calls(model, ids, lengths) < FP32["atol"]
        assert cut_into_calls(reference, ids, [1] * 14) > 1e-2
        # generate, a left-padded row: the same tokens and logits with the cache as without it.
        mask = torch.ones_like(ids[:, :6])
        mask[1, :2] = 0
        options = dict(
            attention_mask=mask, max_new_tokens=8, do_sample=False, return_dict_in_generate=True, output_logits=True
        )
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # past max_position_embeddings, which the scaling is for
            cached = model.generate(ids[:, :6], **options)
            uncached = model.generate(ids[:, :6], use_cache=False, **options)
    assert torch.equal(cached.sequences, uncached.sequences)
    torch.testing.assert_close(torch.stack(cached.logits), torch.stack(uncached.logits), **FP32)


def test_the_order_of_the_rotation_calls_is_read_before_consistent_mode_relies_on_it() -> None:
    """consistent mode leaves the second call's tensor unrotated: a forward that rotates k first, or q only in a
    branch, would get its queries unrotated and its keys rotated twice. Refused when patching."""

    def apply_rotary_pos_emb(x: torch.Tensor, *args: Any) -> torch.Tensor:
        return x

    class KeysFirst(torch.nn.Module):
        def forward(self, query_states: torch.Tensor, key_states: torch.Tensor) -> Any:
            key_states = apply_rotary_pos_emb(key_states)
            query_states = apply_rotary_pos_emb(query_states)
            return query_states, key_states

    class QueriesInABranch(torch.nn.Module):
        def forward(self, query_states: torch.Tensor, key_states: torch.Tensor, flag: bool = True) -> Any:
            if flag:
                query_states = apply_rotary_pos_emb(query_states)
            key_states = apply_rotary_pos_emb(key_states)
            return query_states, key_states

    with pytest.raises(ValueError, match=r"rotates key_states, then query_states\. Patch it with mode='hf'"):
        patch_module._require_queries_then_keys(KeysFirst, "apply_rotary_pos_emb")
    with pytest.raises(ValueError, match=r"query_states, then key_states \(the first conditionally\)"):
        patch_module._require_queries_then_keys(QueriesInABranch, "apply_rotary_pos_emb")
    for model_type in ("gemma3n", "gemma4"):
        modeling = __import__(f"transformers.models.{model_type}.modeling_{model_type}", fromlist=["_"])
        attention = getattr(modeling, f"{model_type.capitalize()}TextAttention")
        patch_module._require_queries_then_keys(attention, "apply_rotary_pos_emb")  # transformers' own: q, then k


def test_a_model_whose_layers_reuse_keys_it_never_caches_is_refused() -> None:
    """Gemma 4's assistant (the drafter of generate(assistant_model=...)) is a gemma4_text model whose every layer
    reuses keys: its target model's shared_kv_states, of tokens before the assistant's own, which are not cached
    behind its new tokens. Rotated at read from its positions, they took the wrong ones (its draft logits off by
    ~0.5, and keys the unpatched target had rotated were rotated twice), with no error."""
    assistant = tiny_assistant(tiny("gemma4_text", "dynamic"))
    assert assistant.config.text_config.kv_sharing_modes == ["reuse", "reuse"]
    with pytest.raises(ValueError, match=r"full_attention, sliding_attention reuse keys that no layer of this"):
        patch_model(assistant.model, mode="consistent")
    patch_model(assistant.model, mode="hf")  # transformers' numbers: keys rotated as the target cached them


def test_a_composite_gemma4_is_refused_naming_its_text_model_which_patches_alone() -> None:
    """Gemma 4's composite model (gemma4, which 'consistent' mode does not take) is refused naming the call that
    patches its gemma4_text text model alone, which keeps the consistent property inside the composite."""
    text = tiny("gemma4_text", "dynamic").config
    config = transformers.AutoConfig.for_model("gemma4", text_config=text.to_dict())
    torch.manual_seed(0)
    model = transformers.AutoModelForImageTextToText.from_config(config).eval()
    reference = copy.deepcopy(model)
    hint = r"patch its gemma4_text text model alone: patch_model\(model\.get_submodule\('model\.language_model'\)"
    with pytest.raises(ValueError, match="more than one rope dict.*" + hint):
        patch_model(copy.deepcopy(model), mode="consistent")
    patch_model(model.get_submodule("model.language_model"), mode="consistent")
    ids = torch.randint(3, 128, (1, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        full = model(input_ids=ids).logits
        torch.testing.assert_close(full, reference(input_ids=ids).logits, atol=1e-4, rtol=1e-4)
        cache = transformers.DynamicCache(config=model.config.text_config)
        model(input_ids=ids[:, :11], past_key_values=cache, use_cache=True)
        step = model(input_ids=ids[:, 11:], past_key_values=cache, use_cache=True).logits[:, -1]
    torch.testing.assert_close(step, full[:, -1], atol=1e-4, rtol=1e-4)


# Each architecture (its attention's rotation calls, counted in the graph) and each length-dependent type (the
# length read in an op) once: Dynamo traces this 4-layer model in 5-8 s a graph here, three graphs a case. Gemma 4
# takes dynamic NTK, whose full-attention layers have a head dim of their own (global_head_dim 32; longrope keeps
# 16); the eager test above runs all four pairs.
# A prefill from an empty cache (graph 1), a chunk that continues the cache (graph 2: the cache's sizes are new), then
# single tokens (graph 3, the cache's length now dynamic) that cross TRAINED inside that one graph, where a length
# read on the host would recompile and a scaling chosen on the host would stay the short one. A chunk after the
# crossing (until 2026-12-06) made a fourth graph, its length against the tokens' 1, for a chunk graph 2 checks.
STEPS = ((0, 3), (3, 6), (6, 7), (7, 8), (8, 9), (9, 10))


@pytest.mark.parametrize(("model_type", "rope_type"), [("gemma4_text", "dynamic"), ("gemma3n_text", "longrope")])
def test_consistent_gemma_compiles_as_one_graph_and_keeps_one_scaling(model_type: str, rope_type: str) -> None:
    """Under torch.compile the cached keys are rotated in the graph (RoPE.step_cos_sin_in_graph; Gemma's sliding
    layers keep the default type beside the scaled full-attention ones, which that method refused), the rotation
    calls are counted in traced code (a host count broke the graph in every attention layer: 14-19 graphs for 10
    calls of a 4-layer model, past the recompile limit) and dynamic NTK's rotary embedding reads the length in an
    op: with fullgraph=True (one frame, so no per-layer frames), a graph per new shape Dynamo sees before it marks
    the sizes dynamic, each step equal to a full forward over the text so far. A second model patched alike runs
    those graphs: each patch held its RoPEs in its forward's globals until 2026-12-05, and compiled again."""
    torch._dynamo.reset()  # a compiled forward of another tiny Gemma: Dynamo's state of it broke this one's frames
    model = tiny(model_type, rope_type)
    twin = copy.deepcopy(model)
    patch_model(model, mode="consistent")
    patch_model(twin, mode="consistent")
    ids = torch.randint(3, 128, (1, 14), generator=torch.Generator().manual_seed(0))
    graphs = []

    def counting(graph: torch.fx.GraphModule, example_inputs: list) -> Any:
        graphs.append(graph)
        return graph.forward

    try:
        with torch.no_grad():
            forward = torch.compile(model.forward, backend=counting, fullgraph=True)
            cache = transformers.DynamicCache(config=model.config)
            for start, end in STEPS:
                step = forward(input_ids=ids[:, start:end], past_key_values=cache, use_cache=True).logits
                torch.testing.assert_close(step, model(input_ids=ids[:, :end]).logits[:, start:], **FP32)
            compiled = len(graphs)
            forward = torch.compile(twin.forward, backend=counting, fullgraph=True)
            cache = transformers.DynamicCache(config=twin.config)
            for start, end in STEPS:
                step = forward(input_ids=ids[:, start:end], past_key_values=cache, use_cache=True).logits
            torch.testing.assert_close(step, model(input_ids=ids[:, :end]).logits[:, start:], **FP32)
        assert compiled <= 3
        assert len(graphs) == compiled, f"{len(graphs) - compiled} graph(s) more for a second model patched alike"
    finally:
        torch._dynamo.reset()


def test_an_order_that_is_not_q_then_k_is_refused_when_patching() -> None:
    """A forward that rotates only its queries would leave them unrotated ('consistent' mode's second call is k)."""

    def apply_rotary_pos_emb(x: torch.Tensor, *args: Any) -> torch.Tensor:
        return x

    class QueriesOnly(torch.nn.Module):
        def forward(self, query_states: torch.Tensor, key_states: torch.Tensor) -> Any:
            query_states = apply_rotary_pos_emb(query_states)
            return query_states, key_states

    with pytest.raises(ValueError, match=r"this transformers version's forward rotates query_states\. Patch it"):
        patch_module._require_queries_then_keys(QueriesOnly, "apply_rotary_pos_emb")


def test_a_third_rotation_call_in_one_forward_is_an_error_at_that_call() -> None:
    from posenc.interop.rotary import _QueriesThenKeys

    calls, x = _QueriesThenKeys(lambda x, cos, sin: 2 * x), torch.ones(2)
    calls.begin()
    assert torch.equal(calls(x, x, x), 2 * x) and calls(x, x, x) is x  # q rotated, k left for the read
    with pytest.raises(RuntimeError, match=r"at most two rotation calls \(q, then k\) .*, got 3"):
        calls(x, x, x)


@pytest.mark.parametrize("model_type", ["gemma4_text", "gemma3n_text"])
def test_an_attention_whose_layer_type_has_no_rope_is_refused_when_patching(model_type: str) -> None:
    """Its keys are rotated at read with its layer type's RoPE: without one, a KeyError came from the first forward."""
    model = tiny(model_type, "dynamic")
    attention = next(m for m in model.modules() if type(m).__name__.endswith("TextAttention"))
    attention.layer_type = "chunked_attention"
    with pytest.raises(ValueError, match=r"TextAttention has no layer_type among the config's rope dicts \("):
        patch_model(model, mode="consistent")


def test_a_layer_the_cache_has_not_built_holds_no_keys() -> None:
    """A cache built without a config adds its layers lazily: the next layer's count is 0, not an IndexError."""
    from posenc.interop.consistent import _held_keys

    cache = transformers.DynamicCache()
    assert _held_keys(cache, len(cache.layers)) == 0


def test_a_rotation_in_the_top_level_return_is_not_called_conditional() -> None:
    """The refusal of a forward that rotates only q names what it found; a call in the top-level return statement
    always runs, and was labelled "(the first conditionally)"."""

    def apply_rotary_pos_emb(x: torch.Tensor, *args: Any) -> torch.Tensor:
        return x

    class ReturnsRotatedQueries(torch.nn.Module):
        def forward(self, query_states: torch.Tensor, key_states: torch.Tensor) -> Any:
            return apply_rotary_pos_emb(query_states), key_states

    with pytest.raises(ValueError, match=r"rotates query_states\. Patch it with mode='hf'"):
        patch_module._require_queries_then_keys(ReturnsRotatedQueries, "apply_rotary_pos_emb")


def shared_kv_states_after(model: Any, ids: torch.Tensor, lengths: list[int]) -> tuple[Any, float]:
    """The output of the last of calls that continue one DynamicCache over ``ids``, each asked for shared_kv_states
    (as generate(assistant_model=...) asks), and the largest difference of that call's logits from a full forward's."""
    cache, start = transformers.DynamicCache(config=model.config), 0
    for length in lengths:
        options = dict(cache=cache, use_cache=True, return_shared_kv_states=True, output_hidden_states=True)
        out = model(ids[:, start : start + length], **options)
        start += length
    worst = (out.logits - model(ids[:, :start]).logits[:, start - lengths[-1] :]).abs().max().item()
    return out, worst


def draft_logits(assistant: Any, target: Any, ids: torch.Tensor, out: Any) -> torch.Tensor:
    """The assistant's logits for the token after ``ids`` from the target's output over them, as generate's Gemma 4
    candidate generator computes them."""
    embedding = target.get_input_embeddings()(ids[:, -1:])
    inputs = torch.cat((embedding, out.hidden_states[-1][:, -1:]), dim=-1)
    position_ids = torch.tensor([[ids.shape[1] - 1]])
    return assistant(
        inputs_embeds=inputs, position_ids=position_ids, shared_kv_states=dict(out.shared_kv_states)
    ).logits


@pytest.mark.parametrize("rope_type", ["dynamic", "longrope"])
def test_a_consistent_target_hands_its_assistant_the_rotated_keys(rope_type: str) -> None:
    """Gemma 4's target returns shared_kv_states (each layer type's keys and values) to generate(assistant_model=...)'s
    assistant, which attends to the keys as rotated. A consistent target caches keys unrotated and returned them so:
    the assistant's draft logits were off by ~0.5 from an hf target's (tokens exact, as the target checks every
    draft, but fewer drafts accepted)."""
    reference = tiny("gemma4_text", rope_type)
    hf, consistent = copy.deepcopy(reference), copy.deepcopy(reference)
    patch_model(hf, mode="hf")
    patch_model(consistent, mode="consistent")
    assistant = tiny_assistant(reference)
    ids = torch.randint(3, 128, (1, 14), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        # Within the trained length (7 of 8 tokens): an hf target's keys and values, in one call or continuing a cache.
        for lengths in ([7], [5, 2], [4, 1, 1, 1]):
            got, _ = shared_kv_states_after(consistent, ids, lengths)
            want, _ = shared_kv_states_after(hf, ids, lengths)
            assert set(got.shared_kv_states) == {"sliding_attention", "full_attention"}
            for layer_type, (keys, values) in want.shared_kv_states.items():
                torch.testing.assert_close(got.shared_kv_states[layer_type][0], keys, atol=1e-5, rtol=1e-5)
                torch.testing.assert_close(got.shared_kv_states[layer_type][1], values, atol=1e-5, rtol=1e-5)
            drafted = draft_logits(assistant, consistent, ids[:, :7], got)
            torch.testing.assert_close(drafted, draft_logits(assistant, hf, ids[:, :7], want), **FP32)
        # generate(assistant_model=...): the assistant drafts from the prompt's keys as it does with an hf target.
        drafts: dict[str, list[torch.Tensor]] = {"hf": [], "consistent": []}
        assistant.generation_config.num_assistant_tokens = 3  # a published assistant's generation_config sets it
        for name, target in (("hf", hf), ("consistent", consistent)):
            hook = assistant.register_forward_hook(lambda module, args, out, name=name: drafts[name].append(out.logits))
            tokens = target.generate(ids[:, :5], assistant_model=assistant, max_new_tokens=3, do_sample=False)
            hook.remove()
            assert tokens.shape[1] > 5 and len(drafts[name]) > 0
        torch.testing.assert_close(torch.cat(drafts["consistent"], 1), torch.cat(drafts["hf"], 1), **FP32)
        # Past it, every key rotated for the current length, as the target attended to them: a full forward's keys.
        got, worst = shared_kv_states_after(consistent, ids, [5, 9])
        assert worst < FP32["atol"]  # the cache still holds its keys unrotated: the second call is a full forward's
        full = reference(ids, return_shared_kv_states=True).shared_kv_states
        for layer_type, (keys, _) in got.shared_kv_states.items():
            torch.testing.assert_close(keys, full[layer_type][0][:, :, -keys.shape[-2] :], atol=1e-5, rtol=1e-5)


def test_rotated_shared_keys_are_not_rotated_again_when_gradient_checkpointing_recomputes() -> None:
    """A consistent Gemma 4 asked to return_shared_kv_states rotates the keys in that dict at its last layer. Gradient
    checkpointing recomputes the layers that reuse those keys during the backward, reading them from the same dict:
    they rotated the handed-out keys a second time, and the gradients were silently wrong (off by up to 1.7). They
    are now those of the same forward without return_shared_kv_states, which hands out the rotated keys."""
    ids = torch.randint(3, 128, (1, 14), generator=torch.Generator().manual_seed(0))
    reference = tiny("gemma4_text", "dynamic")
    with torch.no_grad():
        full = reference(ids, return_shared_kv_states=True).shared_kv_states
    patch_model(reference.train(), mode="consistent")
    grads = []
    for checkpointed in (False, True):
        model = copy.deepcopy(reference)
        if checkpointed:
            model.activation_checkpointing_enable({"use_reentrant": False})
        out = model(ids, labels=ids, use_cache=False, return_shared_kv_states=checkpointed)
        if checkpointed:
            for layer_type, (keys, _) in out.shared_kv_states.items():
                torch.testing.assert_close(keys.detach(), full[layer_type][0], atol=1e-5, rtol=1e-5)
        out.loss.backward()
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None]))
    torch.testing.assert_close(grads[1], grads[0], atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("mode", ["hf", "consistent"])
def test_each_layer_type_refuses_transformers_cos_sin_of_its_own_width(mode: str) -> None:
    """The check of a patched layer's cos/sin width held the pair counts of every layer type: a sliding layer given
    transformers' sliding cos/sin (16 wide here, 256 in the real Gemma 4) matched the full layers' 16 pairs and went
    on to fail inside the rotation, with a message that did not say why. Each layer now checks its own type's."""
    model = tiny("gemma4_text", "dynamic")
    theirs = copy.deepcopy(model.model.rotary_emb)
    patch_model(model, mode=mode)
    h, ids = torch.randn(1, 6, 64), torch.arange(6)[None]
    for layer in model.model.layers[:2]:
        attention, layer_type = layer.self_attn, layer.self_attn.layer_type
        ours, given = model.model.rotary_emb(h, ids, layer_type), theirs(h, ids, layer_type)
        assert given[0].shape[-1] == 2 * ours[0].shape[-1] == (16 if layer_type == "sliding_attention" else 32)
        with torch.no_grad():
            with pytest.raises(ValueError, match=rf"width {given[0].shape[-1]}, but posenc's rotation takes one value"):
                attention(h, given, None, {}, position_ids=ids)
            attention(h, ours, None, {}, position_ids=ids)
