"""posenc.rope.register_scaling: a scaling type of one's own, in RoPE (both modes), the KV cache, torch.compile,
the figures and the lab, against float64 reference formulas; and the registrations it refuses."""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Any

import pytest
import torch

import posenc
import posenc.rope.frequencies as fr
import posenc.rope.parameters as pa
from posenc.analysis.frequencies import EXAMPLE_ROPE_PARAMETERS, frequency_table
from posenc.lab.config import EXTENSIONS, extension_rope_parameters, make_config
from posenc.rope import register_scaling
from posenc.rope.scaling import WITHOUT_EXAMPLE

HEAD_DIM, MAX_POS, BASE = 8, 16, 10000.0


@pytest.fixture(autouse=True)
def restore_tables():
    """Every table register_scaling writes, as it was: the other tests hold SCALINGS to their own lists."""
    dicts = [fr.SCALINGS, pa.REQUIRED_KEYS, pa.OPTIONAL_KEYS, EXAMPLE_ROPE_PARAMETERS, EXTENSIONS]
    sets = [fr.SEQ_LEN_DEPENDENT, WITHOUT_EXAMPLE]
    saved = [dict(d) for d in dicts], [set(s) for s in sets]
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()
    for d, before in zip(dicts, saved[0], strict=True):
        d.clear()
        d.update(before)
    for s, before_set in zip(sets, saved[1], strict=True):
        s.clear()
        s.update(before_set)


def reference_inv_freq(rotary_dim: int, base: float) -> list[float]:
    return [base ** (-2 * i / rotary_dim) for i in range(rotary_dim // 2)]


def band(*, rotary_dim: int, base: float, factor: float, keep: int = 1, **_: Any) -> tuple[torch.Tensor, float]:
    """A toy length-independent type: the first ``keep`` pairs kept, the rest divided by ``factor``; attention 1.1."""
    inv_freq = fr.default_inv_freq(rotary_dim, base)
    scale = torch.ones_like(inv_freq)
    scale[keep:] = factor
    return inv_freq / scale, 1.1


def band_reference(length: int | None, factor: float, keep: int = 1) -> tuple[list[float], float]:
    inv = reference_inv_freq(HEAD_DIM, BASE)
    return [f if i < keep else f / factor for i, f in enumerate(inv)], 1.1


def toy_dynamic(
    *, rotary_dim: int, base: float, seq_len: int | None, max_position_embeddings: int, **_: Any
) -> tuple[torch.Tensor, float]:
    """A toy length-dependent type: every frequency times max / L, L = max(seq_len, max) (position interpolation
    that stretches to whatever length it is called for)."""
    length = max_position_embeddings if seq_len is None else max(seq_len, max_position_embeddings)
    return fr.default_inv_freq(rotary_dim, base) * (max_position_embeddings / length), 1.0


def toy_dynamic_reference(length: int | None, *_: Any) -> tuple[list[float], float]:
    stretch = MAX_POS / max(length or MAX_POS, MAX_POS)
    return [f * stretch for f in reference_inv_freq(HEAD_DIM, BASE)], 1.0


def register_band() -> dict[str, Any]:
    register_scaling(
        "band",
        band,
        required=("factor",),
        optional=("keep",),
        example=lambda r, length, factor: {"factor": factor},
    )
    return {"rope_type": "band", "factor": 4.0, "rope_theta": BASE}


def register_toy_dynamic() -> dict[str, Any]:
    register_scaling("toy_dynamic", toy_dynamic, example=lambda r, length, factor: {}, seq_len_dependent=True)
    return {"rope_type": "toy_dynamic", "rope_theta": BASE}


def rotate_reference(x: torch.Tensor, positions: list[int], inv_freq: list[float], attention: float) -> torch.Tensor:
    """Split-half rotation of x (b, h, s, d) in float64, one position per token, angles in Python floats."""
    half = HEAD_DIM // 2
    out = torch.empty_like(x)
    for t, p in enumerate(positions):
        cos = torch.tensor([math.cos(p * f) * attention for f in inv_freq], dtype=torch.float64)
        sin = torch.tensor([math.sin(p * f) * attention for f in inv_freq], dtype=torch.float64)
        x1, x2 = x[:, :, t, :half], x[:, :, t, half:]
        out[:, :, t, :half] = x1 * cos - x2 * sin
        out[:, :, t, half:] = x2 * cos + x1 * sin
    return out


CASES = {"band": (register_band, band_reference), "toy_dynamic": (register_toy_dynamic, toy_dynamic_reference)}


@pytest.mark.parametrize("mode", ["hf", "consistent"])
@pytest.mark.parametrize("name", list(CASES))
def test_a_registered_type_rotates_by_its_reference_formula(name, mode):
    register, reference = CASES[name]
    params = register()
    rope = posenc.RoPE(HEAD_DIM, rope_parameters=params, max_position_embeddings=MAX_POS, mode=mode)
    for length in (5, MAX_POS, 3 * MAX_POS):  # below, at and past the trained length
        q = torch.randn(1, 2, length, HEAD_DIM, dtype=torch.float64, generator=torch.Generator().manual_seed(length))
        inv_freq, attention = reference(length, 4.0)
        want = rotate_reference(q, list(range(length)), inv_freq, attention)
        got_q, got_k = rope(q, q)
        torch.testing.assert_close(got_q, want, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(got_k, want, rtol=1e-12, atol=1e-12)
        exact, factor = rope.frequencies(length)
        torch.testing.assert_close(exact, torch.tensor(inv_freq, dtype=torch.float64), rtol=1e-15, atol=0)
        assert factor == attention


def test_the_function_of_a_length_dependent_type_is_called_with_each_calls_length():
    """The brief's reproducer: SEQ_LEN_DEPENDENT was a frozenset that RoPE imported by name, so a type added by hand
    was tabulated once and its function always called with seq_len=None (here a stretch it never applied)."""
    seen = []

    def grow(**kwargs: Any) -> tuple[torch.Tensor, float]:
        seen.append(kwargs["seq_len"])
        return toy_dynamic(**kwargs)

    register_scaling("grow", grow, seq_len_dependent=True)
    rope = posenc.RoPE(HEAD_DIM, rope_parameters={"rope_type": "grow"}, max_position_embeddings=MAX_POS)
    q = torch.randn(1, 2, 2 * MAX_POS, HEAD_DIM, dtype=torch.float64)
    seen.clear()
    got, _ = rope(q, q)
    assert seen == [2 * MAX_POS]
    inv_freq, _ = toy_dynamic_reference(2 * MAX_POS)
    torch.testing.assert_close(got, rotate_reference(q, list(range(2 * MAX_POS)), inv_freq, 1.0))
    assert (
        rope.rotates_cached_keys is False
        and posenc.RoPE(
            HEAD_DIM, rope_parameters={"rope_type": "grow"}, max_position_embeddings=MAX_POS, mode="consistent"
        ).rotates_cached_keys
    )


def test_consistent_decoding_of_a_registered_length_dependent_type_equals_a_full_forward():
    params = register_toy_dynamic()
    torch.manual_seed(0)
    rope = posenc.RoPE(HEAD_DIM, rope_parameters=params, max_position_embeddings=MAX_POS, mode="consistent")
    attention = posenc.CausalSelfAttention(4 * HEAD_DIM, 4, num_kv_heads=2, encoding=rope).double()
    x = torch.randn(2, 2 * MAX_POS + 3, 4 * HEAD_DIM, dtype=torch.float64)
    cache = posenc.KVCache()
    steps = [attention(x[:, :10], cache=cache)]
    steps += [attention(x[:, t : t + 1], cache=cache) for t in range(10, x.shape[1])]
    stepped = torch.cat(steps, dim=1)
    for t in range(x.shape[1]):
        torch.testing.assert_close(stepped[:, t], attention(x[:, : t + 1])[:, -1], rtol=1e-12, atol=1e-12)


def test_consistent_decoding_follows_a_temperature_that_changes_with_the_length_alone():
    """A length-dependent type whose frequencies stay fixed while its attention factor grows with the length (a
    temperature): the cache re-rotated its keys only when the frequencies changed, so the keys cached before the
    trained length kept the old factor (6.9e-3 off once past it). docs/scaling.md promises a full forward's."""

    def warm(*, rotary_dim: int, base: float, seq_len: int | None, max_position_embeddings: int, **_: Any):
        length = max_position_embeddings if seq_len is None else max(seq_len, max_position_embeddings)
        return fr.default_inv_freq(rotary_dim, base), 1 + 0.1 * math.log(length / max_position_embeddings)

    register_scaling("warm", warm, seq_len_dependent=True)
    torch.manual_seed(0)
    rope = posenc.RoPE(
        HEAD_DIM, rope_parameters={"rope_type": "warm"}, max_position_embeddings=MAX_POS, mode="consistent"
    )
    attention = posenc.CausalSelfAttention(4 * HEAD_DIM, 4, encoding=rope).double()
    x = torch.randn(1, MAX_POS + 6, 4 * HEAD_DIM, dtype=torch.float64)
    cache = posenc.KVCache()
    attention(x[:, :6], cache=cache)
    for t in range(6, x.shape[1]):
        step = attention(x[:, t : t + 1], cache=cache)
        torch.testing.assert_close(step, attention(x[:, : t + 1])[:, -1:], rtol=1e-12, atol=1e-12)


def test_a_registered_type_compiles_as_a_built_in_of_its_kind():
    """A fixed type in one graph with fullgraph=True; a length-dependent one with seq_len= under fullgraph, and in
    'consistent' mode's cache (which cannot pass seq_len=) through a graph break: before, the latter raised
    "has no in-graph length rule"."""
    fixed = posenc.RoPE(HEAD_DIM, rope_parameters=register_band(), max_position_embeddings=MAX_POS)
    q = torch.randn(1, 2, 3 * MAX_POS, HEAD_DIM)
    compiled = torch.compile(lambda q, k: fixed(q, k), fullgraph=True, backend="aot_eager")
    torch.testing.assert_close(compiled(q, q), fixed(q, q), rtol=1e-6, atol=1e-6)

    params = register_toy_dynamic()
    rope = posenc.RoPE(HEAD_DIM, rope_parameters=params, max_position_embeddings=MAX_POS, mode="consistent")
    with_length = torch.compile(lambda q, k, n: rope(q, k, seq_len=n), fullgraph=True, backend="aot_eager")
    torch.testing.assert_close(with_length(q, q, 3 * MAX_POS), rope(q, q), rtol=1e-6, atol=1e-6)

    from torch.fx.experimental.proxy_tensor import make_fx  # no graph breaks there: the length is asked for

    with pytest.raises(ValueError, match="pass seq_len="):
        make_fx(lambda q, k: rope(q, k))(q, q)
    traced = make_fx(lambda q, k: rope(q, k, seq_len=3 * MAX_POS))(q, q)
    torch.testing.assert_close(traced(q, q), rope(q, q), rtol=1e-6, atol=1e-6)

    attention = posenc.CausalSelfAttention(4 * HEAD_DIM, 4, encoding=rope)
    x = torch.randn(1, MAX_POS + 2, 4 * HEAD_DIM, generator=torch.Generator().manual_seed(0))
    hf = posenc.CausalSelfAttention(
        4 * HEAD_DIM, 4, encoding=posenc.RoPE(HEAD_DIM, rope_parameters=params, max_position_embeddings=MAX_POS)
    )
    hf.load_state_dict(attention.state_dict())
    with pytest.raises(Exception, match="register_scaling"):  # its own reason, not dynamic NTK's
        torch.compile(hf, fullgraph=True, backend="aot_eager")(x)
    torch._dynamo.reset()
    torch.testing.assert_close(torch.compile(hf, backend="eager")(x), attention(x), rtol=1e-6, atol=1e-6)
    with pytest.raises(Exception, match="register_scaling"):
        torch.compile(lambda x, c: attention(x, cache=c), fullgraph=True, backend="aot_eager")(
            x[:, :5], posenc.KVCache()
        )
    torch._dynamo.reset()
    compiled_step = torch.compile(lambda x, c: attention(x, cache=c), backend="eager")
    eager_cache, compiled_cache = posenc.KVCache(), posenc.KVCache()
    for chunk in (slice(0, MAX_POS), slice(MAX_POS, MAX_POS + 1), slice(MAX_POS + 1, MAX_POS + 2)):
        want = attention(x[:, chunk], cache=eager_cache)
        torch.testing.assert_close(compiled_step(x[:, chunk], compiled_cache), want, rtol=1e-6, atol=1e-6)


def test_the_figures_and_the_lab_take_a_registered_type():
    register_band()
    table = frequency_table(HEAD_DIM, train_len=MAX_POS, rope_types=["default", "band"])
    ratio = table.ratio_to_default()[1]
    torch.testing.assert_close(ratio, torch.tensor([1.0, 0.25, 0.25, 0.25], dtype=torch.float64))
    assert "band" in frequency_table(HEAD_DIM, train_len=MAX_POS).rope_types

    assert extension_rope_parameters("band", 4.0, MAX_POS, rotary_dim=HEAD_DIM) == {"rope_type": "band", "factor": 4.0}
    # The config builds each extension's RoPE for the lab's model (its rotary dim passed to the example).
    assert make_config("quick", extensions=["band"]).extensions == ("band",)

    register_scaling("no_example", toy_dynamic, seq_len_dependent=True)  # drawn only where asked for, with parameters
    assert "no_example" not in frequency_table(HEAD_DIM, train_len=MAX_POS).rope_types
    assert "no_example" not in EXTENSIONS
    with pytest.raises(ValueError, match="no example parameters"):
        frequency_table(HEAD_DIM, train_len=MAX_POS, rope_types=["no_example"])


def test_registering_refuses_what_would_fail_later():
    def ok(*, rotary_dim: int, base: float, **_: Any) -> tuple[torch.Tensor, float]:
        return fr.default_inv_freq(rotary_dim, base), 1.0

    with pytest.raises(ValueError, match="rope_type name must be"):
        register_scaling("my+type", ok)
    with pytest.raises(ValueError, match="legacy name"):
        register_scaling("su", ok)
    with pytest.raises(TypeError, match="fn must be a function"):
        register_scaling("mine", "ok")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="cannot take that"):
        register_scaling("mine", lambda rotary_dim, base: (None, 1.0))  # no seq_len / max_position_embeddings
    with pytest.raises(TypeError, match="cannot take that"):
        register_scaling("mine", band)  # needs factor, which it does not list
    with pytest.raises(ValueError, match="registered already"):
        register_scaling("yarn", ok)
    with pytest.raises(ValueError, match="cannot be replaced"):
        register_scaling("dynamic", ok, replace=True)
    with pytest.raises(ValueError, match="which every type has"):
        register_scaling("mine", ok, required=("rope_theta",))
    with pytest.raises(ValueError, match="both required and optional"):
        register_scaling("mine", ok, required=("factor",), optional=("factor",))
    with pytest.raises(ValueError, match=r"rope_parameters\['factor'\] must be >= 1"):
        register_scaling("mine", band, required=("factor",), example=lambda r, length, factor: {"factor": 0.5})
    with pytest.raises(ValueError, match=r"shape \(rotary_dim // 2,\)"):
        register_scaling("mine", lambda **kw: (torch.ones(3, dtype=torch.float64), 1.0), example=lambda *a: {})
    # None of the refused ones is left half registered.
    assert "mine" not in fr.SCALINGS and "mine" not in pa.REQUIRED_KEYS and "mine" not in EXAMPLE_ROPE_PARAMETERS
    assert "mine" not in EXTENSIONS

    register_scaling("mine", ok)
    with pytest.raises(ValueError, match="registered already"):
        register_scaling("mine", ok)
    register_scaling("mine", toy_dynamic, seq_len_dependent=True, replace=True)
    assert fr.is_seq_len_dependent("mine")
    register_scaling("mine", ok, replace=True)
    assert not fr.is_seq_len_dependent("mine")


def test_a_replaced_builtin_is_validated_by_the_keys_registered_for_it():
    """register_scaling(name, fn, replace=True) of a built-in type kept the built-in's own checks and fallbacks in
    _resolve: a 'yarn' taking only 'scale' was refused without a trained length and was handed
    original_max_position_embeddings, factor and the betas it never declared; a 'llama3' taking only 'factor' raised
    a bare KeyError ('low_freq_factor'); a declared beta_fast below 1 was refused by yarn's beta order. Now the
    replacement gets the keys registered for it, and the shared keys' range checks (factor >= 1)."""

    def scaled(*, rotary_dim: int, base: float, scale: float, **_: Any) -> tuple[torch.Tensor, float]:
        return fr.default_inv_freq(rotary_dim, base) / scale, 1.0

    def betas(*, rotary_dim: int, base: float, beta_fast: float = 0.5, **_: Any) -> tuple[torch.Tensor, float]:
        return fr.default_inv_freq(rotary_dim, base) * beta_fast, 1.0

    def divided(*, rotary_dim: int, base: float, factor: float, **_: Any) -> tuple[torch.Tensor, float]:
        return fr.default_inv_freq(rotary_dim, base) / factor, 1.0

    builtin_yarn = (fr.SCALINGS["yarn"], pa.REQUIRED_KEYS["yarn"], pa.OPTIONAL_KEYS["yarn"])
    plain = torch.tensor(reference_inv_freq(HEAD_DIM, BASE), dtype=torch.float64)
    register_scaling("yarn", scaled, required=("scale",), replace=True)
    assert not fr.is_builtin("yarn") and fr.is_builtin("linear")
    for max_pos in (None, MAX_POS):
        rope = posenc.RoPE(
            HEAD_DIM, rope_parameters={"rope_type": "yarn", "scale": 2.0}, max_position_embeddings=max_pos
        )
        assert dict(rope.spec.params) == {"scale": 2.0}
        torch.testing.assert_close(rope.frequencies()[0], plain / 2, rtol=1e-15, atol=0)
    with pytest.raises(ValueError, match=r"rope_type 'yarn' needs the key\(s\) scale"):
        posenc.RoPE(HEAD_DIM, rope_parameters={"rope_type": "yarn", "factor": 2.0}, max_position_embeddings=MAX_POS)

    register_scaling("yarn", betas, optional=("beta_fast",), replace=True)
    rope = posenc.RoPE(HEAD_DIM, rope_parameters={"rope_type": "yarn", "beta_fast": 0.5}, max_position_embeddings=16)
    assert dict(rope.spec.params) == {"beta_fast": 0.5}
    assert dict(posenc.RoPE(HEAD_DIM, rope_parameters={"rope_type": "yarn"}).spec.params) == {}
    with pytest.raises(ValueError, match=r"rope_parameters\['beta_fast'\] must be > 0"):  # a shared key's range
        posenc.RoPE(HEAD_DIM, rope_parameters={"rope_type": "yarn", "beta_fast": 0})

    register_scaling("llama3", divided, required=("factor",), replace=True)
    for max_pos in (None, MAX_POS):
        rope = posenc.RoPE(
            HEAD_DIM, rope_parameters={"rope_type": "llama3", "factor": 4.0}, max_position_embeddings=max_pos
        )
        assert dict(rope.spec.params) == {"factor": 4.0}
        torch.testing.assert_close(rope.frequencies()[0], plain / 4, rtol=1e-15, atol=0)
        assert fr.float32_blend_rtol("llama3", rope.spec.params, BASE) == 0.0  # a KeyError before
    with pytest.raises(ValueError, match=r"rope_parameters\['factor'\] must be >= 1"):
        posenc.RoPE(HEAD_DIM, rope_parameters={"rope_type": "llama3", "factor": 0.5})

    # The built-in function registered again under its name brings its checks back.
    register_scaling("yarn", builtin_yarn[0], required=builtin_yarn[1], optional=builtin_yarn[2], replace=True)
    assert fr.is_builtin("yarn")
    with pytest.raises(ValueError, match="rope_type 'yarn' needs the trained length"):
        posenc.RoPE(HEAD_DIM, rope_parameters={"rope_type": "yarn", "factor": 2.0})


def test_registering_refuses_key_lists_signatures_and_examples_that_would_fail_later():
    """Mutation pass 13's survivors: each of these was a check no test reached (a mutant dropping it passed)."""

    def ok(*, rotary_dim: int, base: float, **_: Any) -> tuple[torch.Tensor, float]:
        return fr.default_inv_freq(rotary_dim, base), 1.0

    # A string of keys is not a list of them: tuple("factor") would register the keys f, a, c, t, o, r.
    with pytest.raises(TypeError, match="required must be a list of rope_parameters key names, got 'factor'"):
        register_scaling("mine", ok, required="factor")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"optional must hold key names that are Python identifiers.*'my-key'"):
        register_scaling("mine", ok, optional=("my-key",))

    def needs_keep(
        *, rotary_dim: int, base: float, seq_len: Any, max_position_embeddings: Any, keep: int
    ) -> tuple[torch.Tensor, float]:
        return fr.default_inv_freq(rotary_dim, base), 1.0

    # Called without an optional key where rope_parameters leave it out: it needs a default.
    with pytest.raises(TypeError, match="cannot take that"):
        register_scaling("mine", needs_keep, optional=("keep",))
    # Called with an optional key where rope_parameters give it: it must take it.
    with pytest.raises(TypeError, match="cannot take that"):
        register_scaling("mine", needs_keep, required=("keep",), optional=("other",))

    with pytest.raises(TypeError, match="example of rope_type 'mine' must return a dict of its rope_parameters, got"):
        register_scaling("mine", ok, example=lambda r, length, factor: [("factor", factor)])

    def short_past_the_trained_length(*, rotary_dim: int, base: float, seq_len: Any, **_: Any):
        inv_freq = fr.default_inv_freq(rotary_dim, base)
        return (inv_freq if seq_len is None else inv_freq[:-1]), 1.0

    # Checked at the lengths the type is called for, not only at seq_len=None.
    with pytest.raises(ValueError, match=r"shape \(rotary_dim // 2,\) .* got \(31,\) \(seq_len=2048\)"):
        register_scaling("mine", short_past_the_trained_length, seq_len_dependent=True, example=lambda *a: {})
    with pytest.raises(TypeError, match="with a float attention_factor"):
        register_scaling("mine", lambda **kw: (fr.default_inv_freq(64, 10000.0), True), example=lambda *a: {})
    assert "mine" not in fr.SCALINGS and "mine" not in fr.SEQ_LEN_DEPENDENT
    # Flags and the example are checked before anything is written.
    with pytest.raises(TypeError, match="seq_len_dependent must be True or False, got 'yes'"):
        register_scaling("mine", ok, seq_len_dependent="yes")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="replace must be True or False, got 1"):
        register_scaling("mine", ok, replace=1)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="example must be a function"):
        register_scaling("mine", ok, example={"factor": 4.0})  # type: ignore[arg-type]
    assert "mine" not in fr.SCALINGS and "mine" not in EXTENSIONS


def test_a_replacement_without_an_example_leaves_the_figures_and_the_lab_and_pi_stays_the_labs():
    """A type re-registered without example parameters is no longer drawn or extended with (its old example's
    entries were left in EXAMPLE_ROPE_PARAMETERS and EXTENSIONS); given one again it is. The lab's extension
    names that are not rope types ('pi') are refused with an example, and left alone without one."""
    register_band()
    register_scaling("band", band, required=("factor",), optional=("keep",), replace=True)
    assert "band" not in EXTENSIONS and "band" not in EXAMPLE_ROPE_PARAMETERS and "band" in WITHOUT_EXAMPLE
    assert "band" not in frequency_table(HEAD_DIM, train_len=MAX_POS).rope_types
    register_scaling(
        "band", band, required=("factor",), example=lambda r, length, factor: {"factor": factor}, replace=True
    )
    assert "band" in EXTENSIONS and "band" in EXAMPLE_ROPE_PARAMETERS and "band" not in WITHOUT_EXAMPLE

    def ok(*, rotary_dim: int, base: float, **_: Any) -> tuple[torch.Tensor, float]:
        return fr.default_inv_freq(rotary_dim, base), 1.0

    labs_pi = EXTENSIONS["pi"]
    with pytest.raises(ValueError, match="'pi' is a lab extension already"):
        register_scaling("pi", ok, example=lambda *a: {})
    assert EXTENSIONS["pi"] is labs_pi and "pi" not in fr.SCALINGS
    register_scaling("pi", ok)  # a rope_type of that name, without example parameters: the lab's pi stays
    assert EXTENSIONS["pi"] is labs_pi and fr.SCALINGS["pi"] is ok


def test_a_refused_replacement_puts_back_whether_the_type_reads_the_length_and_has_an_example():
    """The rollback covers the two sets too: a refused replacement left a length-dependent type tabulated once
    (dropped from SEQ_LEN_DEPENDENT) and one without example parameters listed as having some."""

    def failing(rotary_dim: int, train_len: int, factor: float) -> dict[str, Any]:
        raise RuntimeError("the example fails")

    register_scaling("mine", toy_dynamic, seq_len_dependent=True)  # no example
    with pytest.raises(RuntimeError, match="the example fails"):
        register_scaling("mine", band, required=("factor",), example=failing, replace=True)
    assert fr.is_seq_len_dependent("mine") and "mine" in WITHOUT_EXAMPLE
    assert fr.SCALINGS["mine"] is toy_dynamic and "mine" not in EXTENSIONS
    with pytest.raises(RuntimeError, match="the example fails"):
        register_scaling("new", toy_dynamic, seq_len_dependent=True, example=failing)
    assert "new" not in fr.SEQ_LEN_DEPENDENT and "new" not in WITHOUT_EXAMPLE and "new" not in fr.SCALINGS

    def interrupted(rotary_dim: int, train_len: int, factor: float) -> dict[str, Any]:
        raise KeyboardInterrupt  # Ctrl-C while the example runs: not left half registered either

    with pytest.raises(KeyboardInterrupt):
        register_scaling("new", toy_dynamic, example=interrupted)
    assert "new" not in fr.SCALINGS and "new" not in EXTENSIONS and "new" not in EXAMPLE_ROPE_PARAMETERS


def test_the_docs_example_registers_a_type_that_stretches_with_the_length():
    """docs/scaling.md's "Adding a scaling type" block, run as written: the frequencies it gives at 4x the trained
    length are the plain ones / 4 (factor 1), in float64."""
    doc = (Path(__file__).resolve().parents[2] / "docs" / "scaling.md").read_text()
    (block,) = re.findall(r"```python\n(.*?)```", doc, flags=re.S)
    namespace: dict[str, Any] = {}
    exec(compile(block, "docs/scaling.md", "exec"), namespace)
    rope = namespace["rope"]
    plain = torch.tensor(reference_inv_freq(64, 10000.0), dtype=torch.float64)
    torch.testing.assert_close(rope.frequencies(4 * 2048)[0], plain / 4, rtol=1e-15, atol=0)
    torch.testing.assert_close(rope.frequencies(100)[0], plain, rtol=1e-15, atol=0)


@pytest.mark.parametrize("seq_len_dependent", [False, True])
def test_a_replacement_reaches_the_ropes_built_before_it(seq_len_dependent):
    """register_scaling(replace=True) left a RoPE built before it serving its kept table, windows and frequencies,
    the old function's numbers, beside the new function's at lengths it had not kept: silently two functions in one
    module. Now every RoPE of the type, a deep copy and an MRoPE too, rotates as one built after the replacement."""
    import copy

    def plain(*, rotary_dim: int, base: float, **_: Any) -> tuple[torch.Tensor, float]:
        return fr.default_inv_freq(rotary_dim, base), 1.0

    def quarter(*, rotary_dim: int, base: float, **_: Any) -> tuple[torch.Tensor, float]:
        return fr.default_inv_freq(rotary_dim, base) / 4, 1.0

    register_scaling("mine", plain, seq_len_dependent=seq_len_dependent)
    params = {"rope_type": "mine", "rope_theta": BASE}
    ropes = [
        posenc.RoPE(HEAD_DIM, rope_parameters=params, max_position_embeddings=MAX_POS, mode=mode)
        for mode in ("hf", "consistent")
    ]
    ropes.append(copy.deepcopy(ropes[0]))
    ropes.append(
        posenc.MRoPE(HEAD_DIM, mrope_section=[2, 1, 1], rope_parameters=params, max_position_embeddings=MAX_POS)
    )
    q = torch.randn(1, 2, 5, HEAD_DIM, generator=torch.Generator().manual_seed(0))
    far = 100_000  # a decode step far out: a window, not the table
    for rope in ropes:  # every cache filled with the old function's numbers
        rope(q, q)
        rope(q[:, :, :1], q[:, :, :1], offset=far)
        rope.frequencies(5)
    register_scaling("mine", quarter, seq_len_dependent=seq_len_dependent, replace=True)
    for rope in ropes:
        torch.testing.assert_close(rope.frequencies(5)[0], fr.default_inv_freq(HEAD_DIM, BASE) / 4, rtol=0, atol=0)
        for offset in (0, far):
            want = rotate_reference(
                q.double(), list(range(offset, offset + 5)), [f / 4 for f in reference_inv_freq(HEAD_DIM, BASE)], 1.0
            )
            if isinstance(rope, posenc.MRoPE):  # text ids: every axis the same position, as plain RoPE
                got, _ = rope(q, q, positions=torch.arange(offset, offset + 5))
            else:
                got, _ = rope(q, q, offset=offset)
            torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)


def test_a_rope_unpickled_where_its_type_is_not_registered_says_to_register_it():
    """A pickle carries the type's name, not its function: a RoPE loaded in a process that did not register the type
    (torch.load, a spawned worker) failed at its first call with a bare KeyError from compute_frequencies."""
    import pickle

    params = register_band()
    blob = pickle.dumps(posenc.RoPE(HEAD_DIM, rope_parameters=params, max_position_embeddings=MAX_POS))
    for table in (fr.SCALINGS, pa.REQUIRED_KEYS, pa.OPTIONAL_KEYS):  # as in a process that never registered it
        del table["band"]
    rope = pickle.loads(blob)
    q = torch.randn(1, 2, 3, HEAD_DIM)
    with pytest.raises(ValueError, match=r"'band' is not registered in this process: call posenc.register_scaling"):
        rope(q, q)


class _NoClear(dict):
    def clear(self) -> None:
        raise AssertionError("a table was emptied: other threads calling a built-in type found it missing meanwhile")


def test_a_refused_replacement_puts_back_only_its_own_entry_and_drops_what_it_served(monkeypatch):
    """A replacement whose example fails is rolled back by its own entries (emptying each table to refill it left
    the built-in types out of it meanwhile), and a RoPE called while the rejected function was in place (here by
    the example) forgets what it kept of it."""

    def ok(*, rotary_dim: int, base: float, **_: Any) -> tuple[torch.Tensor, float]:
        return fr.default_inv_freq(rotary_dim, base), 1.0

    def halved(*, rotary_dim: int, base: float, **_: Any) -> tuple[torch.Tensor, float]:
        return fr.default_inv_freq(rotary_dim, base) / 2, 1.0

    register_scaling("mine", ok)
    rope = posenc.RoPE(8, rope_parameters={"rope_type": "mine"}, max_position_embeddings=16)  # nothing kept yet
    expected = ok(rotary_dim=8, base=rope.base)[0]

    def example(rotary_dim: int, train_len: int, factor: float) -> dict[str, Any]:
        rope.frequencies()  # kept from the rejected function
        raise RuntimeError("the example fails")

    scalings = _NoClear(fr.SCALINGS)  # one object where register_scaling writes and where RoPE reads
    monkeypatch.setattr(fr, "SCALINGS", scalings)
    monkeypatch.setattr(pa, "SCALINGS", scalings)
    for table in ("REQUIRED_KEYS", "OPTIONAL_KEYS"):
        monkeypatch.setattr(pa, table, _NoClear(getattr(pa, table)))
    with pytest.raises(RuntimeError, match="the example fails"):
        register_scaling("mine", halved, example=example, replace=True)
    assert fr.SCALINGS["mine"] is ok and "yarn" in fr.SCALINGS
    torch.testing.assert_close(rope.frequencies()[0], expected, rtol=0, atol=0)


def test_a_replaced_proportional_reads_partial_rotary_factor_as_every_type_does() -> None:
    """posenc's 'proportional' reads partial_rotary_factor as the fraction of a whole head's pairs that turn, and
    the figures, the frequency table and the run's figure config treated that name so. A function registered in
    its place reads the key as any type does (RoPE already did, by is_builtin): the analysis code, keyed on the
    name, left it out of partial-rotation tables, refused it beside other types, and let an odd head through
    without the hint to rotate part of it."""
    from posenc.analysis.config import _check_odd_head_dim

    register_scaling(
        "proportional", band, required=("factor",), example=lambda r, length, factor: {"factor": factor}, replace=True
    )
    assert not fr.turns_fraction_of_pairs("proportional")
    table = frequency_table(16, base=BASE, partial_rotary_factor=0.5, rope_types=["default", "proportional"])
    expected, _ = band(rotary_dim=8, base=BASE, factor=4.0)
    torch.testing.assert_close(table.inv_freq[1], expected, rtol=1e-12, atol=0)
    assert table.parameters[1]["partial_rotary_factor"] == 0.5  # the table's channels, as for every other type
    assert "proportional" in frequency_table(16, base=BASE, partial_rotary_factor=0.5).rope_types
    with pytest.raises(ValueError, match=r"partial_rotary_factor=0\.992063"):
        _check_odd_head_dim(63, {"rope_type": "proportional", "factor": 2.0})
    # posenc's own again: a whole head's pairs, refused beside a table that rotates part of the head.
    register_scaling("proportional", fr.BUILTIN_SCALINGS["proportional"], optional=("factor",), replace=True)
    assert fr.turns_fraction_of_pairs("proportional")
    with pytest.raises(ValueError, match="cannot share a table"):
        frequency_table(16, base=BASE, partial_rotary_factor=0.5, rope_types=["default", "proportional"])
    _check_odd_head_dim(63, {"rope_type": "proportional"})  # its own error (all channels in pairs) comes later
