"""What sharing the cached keys' cos/sin across layers saves: a decode step of a tiny Llama patched with 'consistent'.

In a model patched with ``mode="consistent"`` every attention layer rotates all its cached keys for the step's length.
Since commit 5b4ebd1 the first layer of a forward computes their cos/sin and the others read them; before, each layer
computed its own. Both run here in one process, taking turns step by step on the same model and cache: "per-layer"
swaps ``posenc.interop.consistent._keys_cos_sin`` for the per-layer computation it replaced, "shared" is the code as
it is. The logits of the two are checked bit for bit before timing.

Each step feeds one token to a cache of ``--keys`` keys and is then cropped back, so every timed step sees the same
length. The clock is the thread's CPU time (one torch thread), which a shared host's load disturbs less than the wall
clock. Rows are long format, one per type, layer count, key count and provider: min, p20, p50, p80 in ms and
ratio_to_per_layer (this p50 over per-layer's):

    python benchmarks/consistent_model_decode.py --steps 100 --out docs/results/consistent_model_decode.csv

``--nodes`` counts instead the ops (call_function and call_method nodes) of the Dynamo graphs that ``generate`` with
a compiled forward runs for its decode steps once the shapes are dynamic (backend: a counter, nothing compiled
further), ``mode="hf"`` against ``mode="consistent"``, one row per type, layer count and mode: graphs, ops of the
largest, ops in all:

    python benchmarks/consistent_model_decode.py --nodes --layers 12 --out docs/results/consistent_model_nodes.csv
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

from common import commit, device_name, measure_thread_time, percentiles, write_rows

TYPES = ("dynamic", "longrope")
PROVIDERS = ("per-layer", "shared")
TRAINED = 16  # max_position_embeddings of the tiny model, as tests/interop/test_patch.py builds it
FIELDS = ["op", "provider", "mode", "dtype", "shape", "min", "p20", "p50", "p80", "ratio_to_per_layer"]
NODE_FIELDS = ["op", "provider", "mode", "dtype", "shape", "graphs", "ops_largest", "ops_all"]
ENV_FIELDS = ["device", "torch", "transformers", "commit"]


def build(rope_type: str, layers: int):
    """The tiny Llama of tests/interop/test_patch.py (hidden 64, 4 heads, 2 KV heads, trained length 16)."""
    import transformers

    from posenc.testing import TINY_HF_SIZES

    pairs = 8  # head_dim 16
    params: dict = {"rope_type": rope_type, "rope_theta": 10000.0}
    sizes = {"max_position_embeddings": TRAINED}
    if rope_type == "dynamic":
        params["factor"] = 2.0
    else:
        params |= {
            "short_factor": [1.0 + i / 8 for i in range(pairs)],
            "long_factor": [2.0 + 3 * i for i in range(pairs)],
            "factor": 4.0,
            "original_max_position_embeddings": TRAINED,
        }
        sizes = {"max_position_embeddings": 4 * TRAINED}
    config = transformers.LlamaConfig(
        **TINY_HF_SIZES | {"num_hidden_layers": layers},  # head_dim 16 = hidden_size / heads, as before
        vocab_size=128,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=None,
        rope_parameters=params,
        **sizes,
    )
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config).eval()


@contextlib.contextmanager
def keys_cos_sin(provider: str) -> Iterator[None]:
    """The code as it is ("shared"), or each layer computing the keys' cos/sin itself ("per-layer", the code before
    5b4ebd1: the function its memo wraps)."""
    from posenc.interop import consistent

    if provider == "shared":
        yield
        return
    shared = consistent._keys_cos_sin
    consistent._keys_cos_sin = consistent._step_keys_cos_sin
    try:
        yield
    finally:
        consistent._keys_cos_sin = shared


def prefilled(model, keys: int, token_ids: torch.Tensor):
    """The cache after a prompt of ``keys`` tokens."""
    import transformers

    cache = transformers.DynamicCache(config=model.config)
    with torch.no_grad():
        model(token_ids[:, :keys], cache=cache)
    return cache


def step(model, cache, token: torch.Tensor) -> torch.Tensor:
    """One decode step's logits; the cache is cropped back after it (the step's key removed)."""
    with torch.no_grad():
        logits = model(token, cache=cache).logits
    cache.crop(-1)
    return logits


def time_steps(model, cache, token: torch.Tensor, steps: int) -> dict[str, list[float]]:
    """Thread CPU ms per step and provider, taking turns step by step (the order rotating each round)."""
    cases = {name: functools.partial(step, model, cache, token) for name in PROVIDERS}
    around = {name: functools.partial(keys_cos_sin, name) for name in PROVIDERS}
    return measure_thread_time(cases, reps=steps, around=around)


def decode_rows(args: argparse.Namespace, env: dict) -> list[dict]:
    from posenc.interop import patch_model

    rows = []
    token_ids = torch.randint(3, 128, (1, max(args.keys) + 1), generator=torch.Generator().manual_seed(0))
    for rope_type in args.types:
        for layers in args.layers:
            model = build(rope_type, layers)
            patch_model(model, mode="consistent")
            for keys in args.keys:
                cache = prefilled(model, keys, token_ids)
                token = token_ids[:, keys : keys + 1]
                logits = {}
                for name in PROVIDERS:
                    with keys_cos_sin(name):
                        logits[name] = step(model, cache, token)
                if not torch.equal(logits["per-layer"], logits["shared"]):
                    sys.exit(f"{rope_type} layers={layers} keys={keys}: shared and per-layer logits differ")
                times = time_steps(model, cache, token, args.steps)
                base = percentiles(times["per-layer"])[1]
                for name in PROVIDERS:
                    p20, p50, p80 = percentiles(times[name])
                    row = {
                        "op": "decode_step",
                        "provider": name,
                        "mode": f"consistent/{rope_type}",
                        "dtype": "float32",
                        "shape": f"llama hidden64 heads4 kv2 layers{layers} keys{keys}",
                        "min": round(min(times[name]), 4),
                        "p20": round(p20, 4),
                        "p50": round(p50, 4),
                        "p80": round(p80, 4),
                        "ratio_to_per_layer": round(p50 / base, 3),
                        **env,
                    }
                    rows.append(row)
                    print(
                        f"{rope_type:>8} layers {layers:>2} keys {keys:>5} {name:>9}: min {row['min']:.3f} "
                        f"p50 {row['p50']:.3f} ms  ratio_to_per_layer {row['ratio_to_per_layer']:.3f}",
                        flush=True,
                    )
    return rows


def graph_ops(model, keys: int, token_ids: torch.Tensor) -> list[int]:
    """Ops (call_function and call_method nodes) of each Dynamo graph that ``generate`` with a compiled forward makes
    for the decode step later steps reuse: after the prefill of ``keys`` tokens, the first step compiles with static
    shapes and the second again with dynamic ones (Dynamo's automatic dynamic shapes); the third compiles nothing
    more. Backend: a counter, nothing compiled further."""
    made: list[list[int]] = []

    def counting(gm: torch.fx.GraphModule, example_inputs: list) -> Callable:
        made[-1].append(sum(node.op in ("call_function", "call_method") for node in gm.graph.nodes))
        return gm.forward

    torch._dynamo.reset()
    compiled = torch.compile(model.forward, backend=counting)

    @functools.wraps(model.forward)  # generate reads its signature (logits_to_keep)
    def forward(*args: object, **kwargs: object) -> object:
        made.append([])  # the graphs compiled for this call
        return compiled(*args, **kwargs)

    model.forward = forward
    try:
        with torch.no_grad():
            model.generate(token_ids[:, :keys], max_new_tokens=4, do_sample=False)
    finally:
        del model.forward
    if made[3]:
        print(f"note: the third decode step compiled again ({made[3]} ops): the steady state was not reached")
    return made[2]


def node_rows(args: argparse.Namespace, env: dict) -> list[dict]:
    from posenc.interop import patch_model

    rows = []
    keys = args.keys[0]
    token_ids = torch.randint(3, 128, (1, keys), generator=torch.Generator().manual_seed(0))
    for rope_type in args.types:
        for layers in args.layers:
            for mode in ("hf", "consistent"):
                model = build(rope_type, layers)
                patch_model(model, mode=mode)
                graphs = graph_ops(model, keys, token_ids)
                row = {
                    "op": "dynamo_graph",
                    "provider": mode,
                    "mode": rope_type,
                    "dtype": "float32",
                    "shape": f"llama hidden64 heads4 kv2 layers{layers} keys{keys}",
                    "graphs": len(graphs),
                    "ops_largest": max(graphs, default=0),
                    "ops_all": sum(graphs),
                    **env,
                }
                rows.append(row)
                print(
                    f"{rope_type:>8} layers {layers:>2} {mode:>10}: {len(graphs)} graphs, largest "
                    f"{row['ops_largest']} ops, {row['ops_all']} in all",
                    flush=True,
                )
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__
    )
    parser.add_argument("--types", nargs="+", default=list(TYPES), choices=TYPES)
    parser.add_argument("--layers", nargs="+", type=int, default=[2, 6, 12], help="num_hidden_layers (2 6 12)")
    parser.add_argument(
        "--keys",
        nargs="+",
        type=int,
        default=[12, 2000],
        help="cached keys before a step (12 2000; --nodes: the first)",
    )
    parser.add_argument("--steps", type=int, default=100, help="timed steps per provider and setting (100)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (1)")
    parser.add_argument(
        "--nodes", action="store_true", help="count the ops of the Dynamo graphs of a compiled decode step instead"
    )
    parser.add_argument("--out", type=Path, default=None, help="also write the CSV here")
    args = parser.parse_args(argv)
    for flag, values in (("--layers", args.layers), ("--keys", args.keys), ("--steps", [args.steps])):
        if min(values) < 1:
            parser.error(f"{flag} must be at least 1, got {min(values)}")
    if args.threads < 1:
        parser.error(f"--threads must be at least 1, got {args.threads}")
    torch.set_num_threads(args.threads)  # matmuls of 64 x 64: more threads only add synchronisation
    import transformers

    env = {
        "device": device_name("cpu"),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "commit": commit(),
    }
    if args.nodes:
        rows, fields = node_rows(args, env), NODE_FIELDS + ENV_FIELDS
    else:
        rows, fields = decode_rows(args, env), FIELDS + ENV_FIELDS
    if args.out is not None:
        command = " ".join(sys.argv[1:] if argv is None else argv)
        write_rows(rows, args.out, fields, command=f"python benchmarks/consistent_model_decode.py {command}")


if __name__ == "__main__":
    main()
