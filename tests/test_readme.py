"""The README's Python example runs as written (on CPU, no downloads): the docs keep up with the API."""

from __future__ import annotations

import re
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"


def test_readme_python_examples_run(capsys):
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
    assert blocks, "README.md has no ```python example"
    for block in blocks:
        exec(compile(block, str(README), "exec"), {})
    assert "rope" in capsys.readouterr().out
