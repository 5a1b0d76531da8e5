"""The Python examples in README.md and docs/ run as written (on CPU, no downloads): the docs keep up with the API."""

from __future__ import annotations

import re
from pathlib import Path

from posenc.lab import store
from posenc.lab.config import PRESETS
from posenc.lab.model import ByteLM

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
LAB_DOC = ROOT / "docs" / "lab.md"


def python_blocks(path: Path) -> list[str]:
    return re.findall(r"```python\n(.*?)```", path.read_text(), flags=re.S)


def test_readme_python_examples_run_and_do_what_their_comments_say(capsys):
    blocks = python_blocks(README)
    assert blocks, "README.md has no ```python example"
    namespaces: list[dict] = [{} for _ in blocks]
    for block, namespace in zip(blocks, namespaces, strict=True):
        exec(compile(block, str(README), "exec"), namespace)
    first = namespaces[0]  # "A first taste"
    assert capsys.readouterr().out.splitlines()[-1] == "['learned', 'sinusoidal', 't5', 'alibi', 'nope', 'rope']"
    torch = first["torch"]
    assert first["q_rot"].dtype == first["k_rot"].dtype == torch.bfloat16  # bf16 in, bf16 out
    assert first["rope"].cos_sin(torch.arange(3))[0].dtype == torch.float32
    assert torch.equal(first["q1"], first["q_rot"][:, :, -1:]) and torch.equal(first["k1"], first["k_rot"][:, :, -1:])
    assert first["bias"].shape == (12, 4, 16)
    assert first["cache"].length == 11  # positions 0..10
    assert first["padded"].positions[:, -1].tolist() == [3, 5]  # each row's text from 0, its pads apart
    assert first["padded"].document_ids[:, -1].tolist() == [1, 1]


def test_every_docs_python_example_is_run_by_a_test():
    # A block in another page would go untested; give it a test beside these and count it here (porting.md:
    # tests/test_porting_doc.py; scaling.md: tests/rope/test_register_scaling.py).
    counts = {path.name: len(python_blocks(path)) for path in sorted((ROOT / "docs").glob("*.md"))}
    assert {name: n for name, n in counts.items() if n} == {"lab.md": 2, "porting.md": 12, "scaling.md": 1}


def test_lab_doc_yarn_temperature_example_runs(tmp_path, capsys):
    """docs/lab.md's side measurement, on a rope model of the default preset with random weights in place of the
    trained one, and 2 windows instead of 256 (the arithmetic is the same; the numbers are not the doc's)."""
    (block,) = [b for b in python_blocks(LAB_DOC) if "YaRN's own" in b]
    run_dir, windows = 'Path("/tmp/labdef")', "count=config.eval_windows"
    assert run_dir in block and windows in block, "the example no longer reads its run folder or window count so"
    weights = tmp_path / "runs" / "rope" / "seed0" / "model.safetensors"
    weights.parent.mkdir(parents=True)
    store.save_weights(ByteLM(PRESETS["default"].model_spec(), "rope"), weights)
    block = block.replace(run_dir, f"Path({str(tmp_path)!r})").replace(windows, "count=2")
    exec(compile(block, str(LAB_DOC), "exec"), {})
    lines = capsys.readouterr().out.splitlines()
    extension_lengths = PRESETS["default"].extension_lengths
    assert len(lines) == 2 * len(extension_lengths)  # YaRN's own temperature and 1.0, per length
    for line, (n, factor) in zip(lines, [(n, f) for n in extension_lengths for f in ("None", "1.0")], strict=True):
        length, given, bits_per_byte, entropy = line.split()
        assert (int(length), given) == (n, factor)
        assert 0 < float(bits_per_byte) < 16 and float(entropy) > 0


def test_lab_doc_model_of_ones_own_example_runs(capsys):
    """docs/lab.md's loss_by_length example, as written: a hand-written RoPE model scored at the default preset's
    lengths on the lab's held-out text."""
    (block,) = [b for b in python_blocks(LAB_DOC) if "loss_by_length" in b]
    exec(compile(block, str(LAB_DOC), "exec"), {})
    lines = [line.split() for line in capsys.readouterr().out.splitlines()]
    assert [int(n) for n, _, _ in lines] == list(PRESETS["default"].eval_lengths)
    for n, bits, positions in lines:
        assert 7 < float(bits) < 10 and int(positions) == int(n)  # random weights: near log2(256) = 8


def test_the_readme_counts_the_verified_architectures():
    from posenc.interop.patch import VERIFIED_ARCHITECTURES

    (count,) = re.findall(r"(\d+) architectures of transformers", README.read_text())
    assert int(count) == len(VERIFIED_ARCHITECTURES)


def _signature_text(function, *, skip_self: bool = True) -> str:
    """`name(a, /, *, b=None, c="x", **kwargs)` as the README writes a signature: strings in double quotes."""
    import inspect
    import json

    words, star = [], False
    parameters = list(inspect.signature(function).parameters.values())[int(skip_self) :]
    for i, parameter in enumerate(parameters):
        if parameter.kind is parameter.VAR_POSITIONAL:
            words.append(f"*{parameter.name}")
            star = True
        elif parameter.kind is parameter.VAR_KEYWORD:
            words.append(f"**{parameter.name}")
        else:
            if parameter.kind is parameter.KEYWORD_ONLY and not star:
                words.append("*")
                star = True
            if parameter.default is parameter.empty:
                words.append(parameter.name)
            else:
                default = parameter.default
                words.append(f"{parameter.name}={json.dumps(default) if isinstance(default, str) else default}")
        if parameter.kind is parameter.POSITIONAL_ONLY and (
            i + 1 == len(parameters) or parameters[i + 1].kind is not parameter.POSITIONAL_ONLY
        ):
            words.append("/")
    return f"{function.__name__}({', '.join(words)})"


def test_the_readme_gives_ropes_cos_sin_accessors_and_says_which_follows_forward():
    # It gave cos_sin alone: the Hugging Face pattern (cos/sin once per step, then apply_rotary) built on it differed
    # from forward on a decode step after a longer prefill ('hf' dynamic NTK), unsaid.
    from posenc import RoPE

    text = " ".join(README.read_text().split())  # the bullet's line breaks fall anywhere
    for method in (RoPE.forward, RoPE.cos_sin, RoPE.call_cos_sin):
        assert f"`{_signature_text(method)}" in text, method.__name__
    (bullet,) = re.findall(r"`cos_sin\(positions.*?One instance is meant", text)
    assert "reads and advances no state" in bullet
    assert "the cos/sin that `forward` with no `seq_len` rotates by" in bullet
    assert "`call_cos_sin(positions, *, dtype=torch.float32) -> (cos, sin)` is the per-step accessor" in bullet


def test_the_readme_gives_the_public_signatures_as_the_code_has_them():
    # It named parameters the code does not have (rope_from_config's `config_or_dict_or_path`, shard_packed_positions'
    # `cu_seqlens_padded`, positions_from_document_ids' `ids`, build_for_model's `**options`): a call by those names
    # is a TypeError. And shard_packed_positions' `load_balance`, which the text goes on to use, was left out.
    import posenc
    from posenc import distributed, interop

    text = " ".join(README.read_text().split())
    functions = [
        (posenc, ["build", "build_for_model", "rope_frequencies", "apply_rotary", "t5_relative_bucket"]),
        (posenc, ["add_input_encoding", "positions_from_document_ids", "document_ids_from_positions"]),
        (posenc, ["document_ids_from_cu_seqlens", "register", "register_scaling"]),
        (interop, ["patch_model", "rope_from_config"]),
        (distributed, ["shard_positions", "shard_packed_positions"]),
    ]
    for module, names in functions:
        for name in names:
            signature = _signature_text(getattr(module, name), skip_self=False)
            assert f"`{module.__name__}.{signature}" in text, signature
    classes = (posenc.RoPE, posenc.ALiBi, posenc.T5Bias, posenc.Sinusoidal, posenc.LearnedAbsolute)
    for cls in (*classes, posenc.CausalSelfAttention):
        signature = _signature_text(cls.__init__).replace("__init__", cls.__name__, 1)
        assert f"`posenc.{signature}" in text, signature


def test_the_docs_refer_to_sections_that_exist():
    # README's apply_rotary bullet sent the reader to "Fused kernels" below, a section it does not have ("Fast RoPE").
    pages = [README, *sorted((ROOT / "docs").glob("*.md"))]
    headings = {page.name: re.findall(r"^#+ (.*)$", page.read_text(), flags=re.M) for page in pages}
    references = []
    for page in pages:
        text = " ".join(page.read_text().split())  # a quoted title may be cut by a line break
        for below, seen in re.findall(r'"([A-Z][^"]{2,60})" (?:below|above)|[Ss]ee "([^"]+)"', text):
            references.append((page.name, page.name, below or seen))
        for other, title in re.findall(r'(\w+\.md)\)?`?, "([^"]+)"', text):
            references.append((page.name, other, title))
    assert len(references) >= 8, references  # the patterns still find the pages' references
    for page, target, title in references:
        assert any(heading.startswith(title) for heading in headings[target]), (page, target, title)
