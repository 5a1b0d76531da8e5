"""Rewrite tests/fixtures/rope_snapshots.json: whole inv_freq vectors for a few real configs.

Each case stores posenc's float64 vector (as written by repr, so it round-trips exactly) and, when transformers is
installed, transformers' float32 vector beside it, so a reviewer can see both. Run from the repository root:

    python scripts/regen_rope_snapshots.py
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from posenc.rope.parameters import compute_frequencies, parse_rope_parameters

OUT = Path(__file__).parents[1] / "tests" / "fixtures" / "rope_snapshots.json"

CASES = [
    {"name": "llama2-default", "head_dim": 128, "max_position_embeddings": 4096, "seq_len": None,
     "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}},
    {"name": "llama3.1-llama3", "head_dim": 128, "max_position_embeddings": 131072, "seq_len": None,
     "rope_parameters": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}},
    {"name": "qwen2.5-yarn", "head_dim": 128, "max_position_embeddings": 32768, "seq_len": None,
     "rope_parameters": {"rope_type": "yarn", "rope_theta": 1000000.0, "factor": 4.0,
                         "original_max_position_embeddings": 32768}},
    {"name": "deepseek-v3-yarn-mscale", "head_dim": 64, "max_position_embeddings": 163840, "seq_len": None,
     "rope_parameters": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40, "beta_fast": 32, "beta_slow": 1,
                         "mscale": 1.0, "mscale_all_dim": 1.0, "original_max_position_embeddings": 4096}},
    {"name": "linear-4", "head_dim": 64, "max_position_embeddings": 2048, "seq_len": None,
     "rope_parameters": {"rope_type": "linear", "factor": 4.0}},
    {"name": "dynamic-past-max", "head_dim": 64, "max_position_embeddings": 2048, "seq_len": 5000,
     "rope_parameters": {"rope_type": "dynamic", "factor": 2.0}},
    {"name": "neox-partial-quarter", "head_dim": 128, "max_position_embeddings": 2048, "seq_len": None,
     "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25}},
    {"name": "proportional-quarter", "head_dim": 64, "max_position_embeddings": 2048, "seq_len": None,
     "rope_parameters": {"rope_type": "proportional", "rope_theta": 1000000.0, "partial_rotary_factor": 0.25}},
]  # fmt: skip


def transformers_inv_freq(case: dict) -> list[float] | None:
    try:
        from transformers import LlamaConfig
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
        from transformers.models.gpt_neox.modeling_gpt_neox import GPTNeoXRotaryEmbedding
    except ImportError:
        return None
    head_dim = case["head_dim"]
    config = LlamaConfig(
        hidden_size=2 * head_dim,
        num_attention_heads=2,
        head_dim=head_dim,
        max_position_embeddings=case["max_position_embeddings"],
        rope_parameters=dict(case["rope_parameters"]),
    )
    rope_type = config.rope_parameters["rope_type"]
    if rope_type == "default":
        inv, _ = GPTNeoXRotaryEmbedding.compute_default_rope_parameters(config)
    else:
        inv, _ = ROPE_INIT_FUNCTIONS[rope_type](config, None, seq_len=case["seq_len"])
    return [float(x) for x in inv]


def main() -> None:
    # No options: parsed so that --help (or a typo) prints this and stops, where it ran the whole script.
    argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()
    out = []
    for case in CASES:
        spec = parse_rope_parameters(
            case["head_dim"], case["rope_parameters"], max_position_embeddings=case["max_position_embeddings"]
        )
        inv, factor = compute_frequencies(spec, seq_len=case["seq_len"])
        out.append(
            {
                **case,
                "inv_freq": [float(x) for x in inv],
                "attention_factor": factor,
                "transformers_inv_freq": transformers_inv_freq(case),
            }
        )
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps({"generator": "scripts/regen_rope_snapshots.py", "cases": out}, indent=1) + "\n")
    print(f"wrote {len(out)} cases to {OUT}")


if __name__ == "__main__":
    main()
