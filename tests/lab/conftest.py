"""Tiny corpora and configurations for the lab's tests: seconds each, nothing downloaded."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from posenc.lab.config import make_config

WORDS = ["def", "return", "self", "value", "import", "class", "for", "in", "if", "else", "None", "x", "y", "data"]


def write_text_tree(root: Path, files: int = 6, lines: int = 120, seed: int = 0) -> Path:
    """A directory of small Python-like files (deterministic), plus a nested folder."""
    rng = random.Random(seed)
    root.mkdir(parents=True, exist_ok=True)
    for i in range(files):
        folder = root / "pkg" if i % 2 else root
        folder.mkdir(exist_ok=True)
        text = "\n".join(
            "    " * rng.randint(0, 2) + " ".join(rng.choice(WORDS) for _ in range(rng.randint(2, 8)))
            for _ in range(lines)
        )
        (folder / f"module_{i}.py").write_text(text + "\n")
    return root


@pytest.fixture(scope="session")
def corpus_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_text_tree(tmp_path_factory.mktemp("corpus"))


@pytest.fixture
def tiny_config(corpus_dir: Path):
    """The quick preset shrunk further: every unit trains in well under a second."""

    def make(**overrides):
        base = {
            "corpus": str(corpus_dir),
            "dim": 16,
            "layers": 1,
            "heads": 2,
            "train_len": 8,
            "steps": 6,
            "batch_size": 4,
            "eval_windows": 4,
            "eval_batch_size": 4,
            "task_samples": 4,
        }
        return make_config("quick", **{**base, **overrides})

    return make
