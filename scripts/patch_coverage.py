"""Which causal-LM architectures of the installed transformers posenc.interop.patch_model patches, refuses, or could
not be tried on here (no tiny model builds or runs), as the markdown list in docs/scaling.md.

    python scripts/patch_coverage.py

Runs the scan of tests/interop/test_patch_architectures.py (tiny random models, ~20 s on 2 cores); each patched
model's logits are compared with the unpatched model's as the test does, and a mismatch is printed as one.
"""

from __future__ import annotations

import argparse
import copy
import importlib.util
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import transformers

from posenc.interop.patch import patch_model


def main() -> None:
    # No options: parsed so that --help (or a typo) prints this and stops, where it ran the whole script.
    argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()
    path = Path(__file__).parents[1] / "tests" / "interop" / "test_patch_architectures.py"
    spec = importlib.util.spec_from_file_location("patch_scan", path)
    scan = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(scan)
    transformers.logging.set_verbosity_error()
    torch.set_num_threads(1)
    patched, refused, untried, mismatched = [], [], [], []
    for model_type in scan.CANDIDATES:
        try:
            model = scan.tiny(model_type)
        except pytest.skip.Exception as reason:
            untried.append(f"{model_type} ({str(reason).split(': ', 1)[-1].split(' (')[0]})")
            continue
        copy_ = copy.deepcopy(model)
        try:
            report = patch_model(copy_)
        except ValueError as error:
            reason = str(error).split(": ", 1)[-1]
            refused.append(f"{model_type} ({textwrap.shorten(reason, 90, placeholder=' ...')})")  # at a word
            continue
        ids = scan.tokens()
        ok = all(
            torch.allclose(a, b, **scan.FP32)
            for a, b in zip(scan.logits(copy_, ids), scan.logits(model, ids), strict=True)
        )
        layouts = sorted(set(report.rotations.values()))
        (patched if ok else mismatched).append(f"{model_type} ({', '.join(layouts)})")
    print(
        f"transformers {transformers.__version__}: {len(patched)} patched, {len(refused)} refused, {len(untried)} "
        f"not tried here, {len(mismatched)} mismatched\n"
    )
    for title, items in (
        ("Patched", patched),
        ("Refused", refused),
        ("Not tried here", untried),
        ("MISMATCHED", mismatched),
    ):
        if items:
            print(f"**{title}**: " + "; ".join(items) + "\n")
    sys.exit(1 if mismatched else 0)


if __name__ == "__main__":
    main()
