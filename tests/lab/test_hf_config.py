"""posenc lab --hf-config: the rope model built as a Hugging Face architecture (tiny, random init)."""

from __future__ import annotations

import csv
import json
import logging
import re
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

from posenc.analysis.run import run_figure_config
from posenc.cli import main
from posenc.lab.config import EXTENSIONS, extension_rope_parameters, make_config
from posenc.lab.model import ModelSpec

pytest.importorskip("transformers")

CONFIGS = {
    "llama": {"model_type": "llama", "rope_theta": 500000.0, "hidden_act": "silu", "rms_norm_eps": 1e-6},
    # Partial rotary: half of each head's dims rotate. GPT-NeoX's base is rotary_emb_base (its config ignores
    # rope_theta), and not the default, so that the check below shows it was read.
    "gpt_neox": {"model_type": "gpt_neox", "rotary_pct": 0.5, "rotary_emb_base": 20000, "use_parallel_residual": True},
}


def write_config(folder: Path, source: dict) -> str:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "config.json"
    path.write_text(json.dumps(source))
    return str(path)


@pytest.mark.parametrize("model_type", sorted(CONFIGS))
def test_a_lab_run_on_a_hugging_face_architecture(model_type, corpus_dir, tmp_path, capsys):
    path = write_config(tmp_path / "cfg", CONFIGS[model_type])
    out = tmp_path / "run"
    flags = ["--preset", "quick", "--corpus", str(corpus_dir), "--hf-config", path, "--out", str(out)]
    flags += ["--dim", "16", "--heads", "2", "--layers", "1", "--train-len", "8", "--eval-lengths", "8,16"]
    flags += ["--steps", "4", "--eval-windows", "4", "--extensions", "pi,yarn", "--no-progress"]
    assert main(["lab", *flags]) == 0
    results = json.loads((out / "results.json").read_text())
    assert results["architecture"] == model_type
    assert results["config"]["hf_config"] == path
    assert results["config"]["encodings"] == ["rope"]  # restricted automatically
    assert "--hf-config" in results["command"]
    rows = {(r["extension"], r["eval_len"]): r for r in results["rows"]}
    assert set(rows) == {("none", 8), ("none", 16), ("pi", 16), ("yarn", 16)}
    for row in rows.values():
        assert row["architecture"] == model_type and row["applicable"]
        assert 0 < row["bits_per_byte"] < 16 and len(row["entropy_by_layer"]) == 1 and row["entropy"] > 0
    with open(out / "results.csv") as f:
        assert {r["architecture"] for r in csv.DictReader(f)} == {model_type}
    # The report's figures draw the RoPE the model trained with: the file's theta and rotary fraction.
    rotary, theta = {"llama": (8, 500000.0), "gpt_neox": (4, 20000.0)}[model_type]
    assert results["rope"] == {
        "head_dim": 8,
        "rotary_dim": rotary,
        "interleaved": False,
        "rope_parameters": {"rope_type": "default", "rope_theta": theta},
    }
    figures = run_figure_config(out)
    assert (figures.head_dim, figures.spec.rotary_dim, figures.base, figures.train_len) == (8, rotary, theta, 8)
    units = results["timings"]["units"]
    assert units["rope+yarn/seed0"]["rope_parameters"]["16"]["rope_type"] == "yarn"
    assert units["rope+pi/seed0"]["rope_parameters"]["16"]["rope_type"] == "linear"


@pytest.mark.parametrize("model_type", sorted(CONFIGS))
def test_extensions_change_the_hugging_face_model(model_type, tmp_path):
    from posenc.lab.hf_model import HFByteLM

    path = write_config(tmp_path, CONFIGS[model_type])
    spec = ModelSpec(dim=16, layers=2, heads=2, max_positions=8)
    torch.manual_seed(0)
    base = HFByteLM(spec, path)
    assert base.hf.config.max_position_embeddings == 8 and base.hf.config.vocab_size == 256
    assert type(base.hf).__name__.lower().startswith(model_type.replace("_", ""))
    with torch.no_grad():  # sharper attention than the 0.02 init, so positions matter in the logits
        for p in base.parameters():
            if p.dim() >= 2:
                p.mul_(20)
    tokens = torch.randint(0, 256, (2, 16))
    logits, attentions = base(tokens, return_attention=True)
    assert logits.shape == (2, 16, 256) and len(attentions) == 2
    assert attentions[0].shape == (2, 2, 16, 16) and attentions[0].dtype == torch.float32
    torch.testing.assert_close(attentions[0].sum(-1), torch.ones(2, 2, 16))
    for extension in ("pi", "yarn"):
        extended = HFByteLM(spec, path, extension_rope_parameters(extension, 2.0, 8))
        extended.load_state_dict(base.state_dict(), strict=True)
        other, _ = extended(tokens)
        # Positions inside the trained length: PI changes them, YaRN keeps its high frequencies.
        assert (other - logits).abs().max() > 1e-3
    # The same seed gives the same weights; another seed others.
    weights = {}
    for seed in (0, 0, 1):
        torch.manual_seed(seed)
        weights.setdefault(seed, []).append(HFByteLM(spec, path).state_dict())
    for name, value in weights[0][0].items():
        assert torch.equal(value, weights[0][1][name])
    assert any(not torch.equal(value, weights[1][0][name]) for name, value in weights[0][0].items())


def test_extended_hugging_face_models_warn_nothing_and_rotate_as_before(tmp_path):
    """Every --hf-config run with llama3 printed transformers' "original_max_position_embeddings field must be less
    than max_position_embeddings, got 8 and max_position_embeddings=8": the extended model's config claimed the
    trained length. It now holds the length a yarn or llama3 extension reaches, which changes no number."""
    from posenc.interop import patch_model
    from posenc.lab.hf_model import HFByteLM

    path = write_config(tmp_path, CONFIGS["llama"])
    spec = ModelSpec(dim=16, layers=1, heads=2, max_positions=8)
    torch.manual_seed(0)
    weights = HFByteLM(spec, path).state_dict()
    tokens = torch.randint(0, 256, (2, 16))
    expected = {}
    for extension in EXTENSIONS:  # as the lab built them before: the trained length's model, patched
        before = HFByteLM(spec, path)
        before.load_state_dict(weights)
        patch_model(before.hf, rope_parameters=extension_rope_parameters(extension, 2.0, 8))
        expected[extension] = before(tokens)[0]
    records: list[logging.LogRecord] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = records.append  # type: ignore[method-assign]
    logger = logging.getLogger("transformers")  # its loggers do not propagate to the root, so caplog sees nothing
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.WARNING)
    try:
        extended = {e: HFByteLM(spec, path, extension_rope_parameters(e, 2.0, 8)) for e in EXTENSIONS}
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
    assert [record.getMessage() for record in records] == []
    for extension, model in extended.items():
        model.load_state_dict(weights)
        assert torch.equal(model(tokens)[0], expected[extension]), extension
        target = 16 if extension in ("yarn", "llama3") else 8  # dynamic NTK scales past the trained length
        assert model.hf.config.max_position_embeddings == target, extension


@pytest.mark.parametrize(
    ("setup", "message"),
    [
        (lambda tmp: str(tmp / "missing.json"), "is not a config.json"),
        (lambda tmp: write_config(tmp, {"model_type": "bert"}), "model_type 'bert'"),
        (lambda tmp: write_config(tmp, {"rope_theta": 1.0}), "model_type None"),
    ],
)
def test_bad_hf_config_fails_before_training(setup, message, tmp_path, corpus_dir):
    with pytest.raises(ValueError, match=message):
        make_config("quick", corpus=str(corpus_dir), hf_config=setup(tmp_path))


def test_a_scaled_hf_config_is_told_that_the_lab_drops_its_scaling(tmp_path):
    from posenc.lab.hf_model import read_hf_config

    scaled = CONFIGS["llama"] | {"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}
    with pytest.warns(UserWarning, match=r"scales its RoPE \(yarn\); the lab drops that scaling"):
        read_hf_config(write_config(tmp_path / "scaled", scaled), warn=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        plain = CONFIGS["llama"] | {"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}}
        read_hf_config(write_config(tmp_path / "plain", plain), warn=True)
        # Read again for each unit's model: said once, where the lab's config is checked.
        read_hf_config(write_config(tmp_path / "scaled", scaled))


def test_extensions_an_architecture_cannot_hold_are_named_with_the_ones_it_can(tmp_path, corpus_dir, capsys):
    # Phi-3's config class takes only 'default' and 'longrope': the default extensions failed with transformers'
    # validation error, and no advice.
    path = write_config(tmp_path, {"model_type": "phi3", "rope_theta": 10000.0, "hidden_act": "silu"})
    flags = ["--preset", "quick", "--corpus", str(corpus_dir), "--hf-config", path, "--out", str(tmp_path / "run")]
    flags += ["--dim", "16", "--heads", "2", "--layers", "1", "--train-len", "8", "--eval-lengths", "8,16"]
    assert main(["lab", *flags, "--no-progress"]) == 2
    error = capsys.readouterr().err
    assert "this phi3 model cannot take the extension(s) pi, dynamic, yarn, llama3" in error
    assert error.rstrip().endswith("pass --extensions ntk (the ones it takes)")
    assert not (tmp_path / "run").exists()


def test_other_encodings_with_hf_config_are_refused(tmp_path, corpus_dir, capsys):
    path = write_config(tmp_path, CONFIGS["llama"])
    with pytest.raises(ValueError, match="--encodings rope"):
        make_config("quick", hf_config=path, encodings=("rope", "alibi"))
    status = main(["lab", "--preset", "quick", "--hf-config", path, "--encodings", "alibi", "--out", str(tmp_path)])
    assert status == 2 and "--encodings rope" in capsys.readouterr().err


def test_importing_the_lab_does_not_import_transformers():
    code = "import sys, posenc.lab, posenc.lab.hf_model; assert 'transformers' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_missing_transformers_is_a_clear_error(tmp_path, monkeypatch):
    import importlib.util

    path = write_config(tmp_path, CONFIGS["llama"])
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "transformers" else real(name, *a)
    )
    with pytest.raises(ValueError, match="pip install transformers"):
        make_config("quick", hf_config=path)


def test_the_config_files_contents_key_the_results(tmp_path):
    path = write_config(tmp_path, CONFIGS["llama"])
    plain = make_config("quick").results_key()
    assert "hf_config" not in plain  # runs made without --hf-config keep their config_id
    first = make_config("quick", hf_config=path).results_key()
    write_config(tmp_path, {**CONFIGS["llama"], "rope_theta": 20000.0})
    assert make_config("quick", hf_config=path).results_key() != first


@pytest.mark.parametrize(
    ("source", "message"),
    [
        ({"model_type": "llama", "rope_theta": "abc"}, "rope_theta must be a number, got .abc."),
        ({"model_type": "llama", "hidden_act": "bogus"}, "KeyError: 'bogus'"),
        # it trained a "rope" model that rotates nothing, reported as rope
        ({"model_type": "gpt_neox", "rotary_pct": 0}, "partial_rotary_factor must be in"),
        ({"model_type": "llama", "rope_theta": -5}, "rope_theta'\\] must be a finite number > 1"),
    ],
)
def test_values_the_model_cannot_be_built_from_fail_before_anything_is_written(
    source, message, tmp_path, corpus_dir, capsys
):
    """The file's values are checked by building the model, plain and with each extension, at prepare: they used to
    fail at the first unit with a traceback (after config.json was written), or after training."""
    path = write_config(tmp_path / "cfg", source)
    out = tmp_path / "out"
    status = main(["lab", "--preset", "quick", "--corpus", str(corpus_dir), "--hf-config", path, "--out", str(out)])
    assert status == 2 and not out.exists()
    assert re.search(f"hf_config \\(--hf-config\\) .*cannot be built from it: .*{message}", capsys.readouterr().err)


def test_the_hugging_face_models_seed_is_the_draw_its_lab_numbers_were_made_with(tmp_path, monkeypatch):
    """HFByteLM seeds transformers' init with a draw from the caller's seeded CPU generator in [0, 2**31 - 1): the
    draw (torch.randint(0, 2**31 - 1, ())) that the --hf-config lab numbers were made with. Another range draws
    another seed, so the same --seed gave other weights and other published numbers."""
    import posenc.interop.patch as patch_module
    from posenc.lab.hf_model import HFByteLM

    path = write_config(tmp_path, CONFIGS["llama"])
    spec = ModelSpec(dim=16, layers=1, heads=2, max_positions=8)
    real, seeds = patch_module.tiny_model_from_config, []

    def recorded(*args, seed, **kwargs):
        seeds.append(seed)
        return real(*args, seed=seed, **kwargs)

    monkeypatch.setattr(patch_module, "tiny_model_from_config", recorded)
    for seed in (0, 1, 2):
        torch.manual_seed(seed)
        HFByteLM(spec, path)
    expected = [int(torch.randint(0, 2**31 - 1, (), generator=torch.Generator().manual_seed(s))) for s in (0, 1, 2)]
    assert seeds == expected


@pytest.mark.parametrize("extension", [None, "yarn"])
def test_the_hugging_face_model_builds_on_the_meta_device(extension, tmp_path):
    """Its seed was drawn in the ambient device context and read with .item(): on the meta device that raised torch's
    "Tensor.item() cannot be called on meta tensors", so the model could not be built for to_empty. Now the seed is
    the CPU generator's draw (the same one an ordinary build makes: the same weights for a seed), and a meta build,
    materialized, equals an ordinary one."""
    from posenc.lab.hf_model import HFByteLM

    path = write_config(tmp_path, CONFIGS["llama"])
    spec = ModelSpec(dim=16, layers=2, heads=2, max_positions=8)
    rope_parameters = None if extension is None else extension_rope_parameters(extension, 2.0, 8)
    torch.manual_seed(0)
    eager = HFByteLM(spec, path, rope_parameters)
    with torch.device("meta"):
        torch.manual_seed(0)
        meta = HFByteLM(spec, path, rope_parameters)
    assert all(p.is_meta for p in meta.parameters())
    meta.to_empty(device="cpu")
    meta.hf.init_weights()  # transformers' own rotary embedding keeps its inv_freq out of the state dict
    meta.load_state_dict(eager.state_dict())
    tokens = torch.randint(0, 256, (2, 12))
    torch.testing.assert_close(meta(tokens)[0], eager(tokens)[0], rtol=0, atol=0)
    torch.manual_seed(0)  # the draw moved the CPU generator as an ordinary build's does
    again = HFByteLM(spec, path, rope_parameters)
    assert all(torch.equal(v, eager.state_dict()[k]) for k, v in again.state_dict().items())


@pytest.mark.parametrize("model_type", sorted(CONFIGS))
def test_the_hugging_face_model_packs_documents_as_byte_lm_does(model_type, tmp_path):
    """document_ids as ByteLM takes them: each document's logits as when it is the whole input (a TypeError before:
    the keyword was ByteLM's alone), with a yarn extension patched in too."""
    from posenc.lab.hf_model import HFByteLM

    path = write_config(tmp_path, CONFIGS[model_type])
    spec = ModelSpec(dim=16, layers=2, heads=2, max_positions=8)
    for rope_parameters in (None, extension_rope_parameters("yarn", 2.0, 8)):
        torch.manual_seed(0)
        model = HFByteLM(spec, path, rope_parameters).double()
        with torch.no_grad():  # sharper attention than the 0.02 init, so positions matter in the logits
            for p in model.parameters():
                if p.dim() >= 2:
                    p.mul_(20)
        rows = [[5, 1, 6], [4, 8]]
        tokens = torch.randint(0, 256, (2, 12))
        ids = torch.stack([torch.repeat_interleave(torch.arange(len(row)), torch.tensor(row)) for row in rows])
        packed, _ = model(tokens, document_ids=ids)
        for b, row in enumerate(rows):
            alone = torch.cat([model(part)[0] for part in tokens[b : b + 1].split(row, dim=1)], dim=1)
            # transformers' eager attention takes its softmax in float32 even in a float64 model, and a packed row
            # sums more (masked) keys than the part alone: where the vector width splits the row differently the
            # float32 sum rounds differently (1.5e-7 on an AVX2 host, bit-identical on AVX-512 ones).
            torch.testing.assert_close(packed[b : b + 1], alone, atol=1e-5, rtol=1e-5)
        unpacked, _ = model(tokens)
        assert (unpacked - packed).abs().max() > 1e-3  # the documents really were kept apart
        shared, _ = model(tokens[:1], document_ids=ids[0])  # (s,) ids, as ByteLM takes them
        torch.testing.assert_close(shared, packed[:1], atol=1e-12, rtol=1e-12)
    with pytest.raises(ValueError, match=r"document_ids must have shape \(12,\) or \(2, 12\)"):
        model(tokens, document_ids=ids[:, :5])
    with pytest.raises(ValueError, match=r"tokens must be a \(b, s\) tensor of byte ids, got \(12,\)"):
        model(tokens[0], document_ids=ids[0])  # one row without its batch axis: not taken as 12 rows of one byte
    # Checked as ByteLM checks them, with or without document_ids (transformers' embedding would raise a bare
    # IndexError for an id past the table, and take a 1-D row as 12 rows of one byte).
    with pytest.raises(ValueError, match=r"tokens must be byte ids in 0\.\.255, got ids from 0 to 300"):
        model(torch.tensor([[0, 300]]))
    with pytest.raises(ValueError, match=r"tokens must be a \(b, s\) tensor of byte ids, got \(12,\)"):
        model(tokens[0])
    with pytest.raises(TypeError, match=r"tokens must be an integer tensor of byte ids .* got torch.float32"):
        model(tokens.float())
    torch.testing.assert_close(model(tokens.to(torch.uint8))[0], model(tokens)[0], atol=0, rtol=0)
