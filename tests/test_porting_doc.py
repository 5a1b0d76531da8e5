"""docs/porting.md: each example computes another library's rotation with posenc and asserts it equal to that
library's formula, written out in the example itself; run here, so that neither the mapping nor the page can drift."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

PORTING = Path(__file__).resolve().parents[1] / "docs" / "porting.md"
SECTIONS = (
    "flash-attention",
    "Liger-Kernel",
    "vLLM",
    "M-RoPE in vLLM",
    "TransformerEngine",
    "Megatron-Core",
    "DeepSeek-V2/V3",
    "DeepSeek-V3.2",
    "Meta's Llama reference",
    "xformers",
    "torchtune",
    "GPT-NeoX",
)


def _examples() -> dict[str, str]:
    """Section title -> the section's one ```python block, after blank lines that put it at its line of the page
    (a failure's traceback then points into docs/porting.md where the code is)."""
    text = PORTING.read_text()
    examples = {}
    for match in re.finditer(r"^## ([^\n]*)\n(.*?)(?=^## |\Z)", text, flags=re.M | re.S):
        (block,) = re.finditer(r"```python\n(.*?)```", match.group(2), flags=re.S)
        examples[match.group(1)] = "\n" * text.count("\n", 0, match.start(2) + block.start(1)) + block.group(1)
    return examples


def test_the_porting_page_has_one_example_per_library():
    titles = list(_examples())
    assert len(titles) == len(SECTIONS)
    for title, name in zip(titles, SECTIONS, strict=True):
        assert title.startswith(name), (title, name)


@pytest.mark.parametrize("name", SECTIONS)
def test_porting_example_matches_the_librarys_formula(name):
    (block,) = [block for title, block in _examples().items() if title.startswith(name)]
    assert "assert_close" in block, "an example must check posenc against the library's formula"
    exec(compile(block, str(PORTING), "exec"), {})
