from __future__ import annotations

import subprocess
import sys

import pytest
import torch

import posenc
from posenc.cli import main
from posenc.encoding import ActsOn


def test_registry_lists_six_families_with_declarations():
    assert posenc.available() == ["learned", "sinusoidal", "t5", "alibi", "nope", "rope"]
    expected = {
        "learned": ActsOn.INPUT,
        "sinusoidal": ActsOn.INPUT,
        "t5": ActsOn.SCORE_BIAS,
        "alibi": ActsOn.SCORE_BIAS,
        "nope": ActsOn.NONE,
        "rope": ActsOn.QK,
    }
    for name, where in expected.items():
        enc = posenc.build_for_model(name, dim=16, num_heads=2, head_dim=8, max_positions=32)
        assert enc.acts_on is where


def test_build_passes_family_arguments():
    rope = posenc.build("rope", 16, base=500000.0, interleaved=True)
    assert isinstance(rope, posenc.RoPE) and rope.base == 500000.0 and rope.interleaved
    t5 = posenc.build_for_model("t5", dim=16, num_heads=2, head_dim=8, max_positions=32, num_buckets=16)
    assert t5.num_buckets == 16


def test_import_has_no_side_effects():
    code = (
        "import torch; n = torch.get_num_threads(); import posenc; assert torch.get_num_threads() == n; "
        "import sys; assert 'matplotlib' not in sys.modules and 'transformers' not in sys.modules"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_cli_info(capsys):
    assert main(["info"]) == 0
    out = capsys.readouterr().out
    for name in posenc.available():
        assert name in out
    assert "rope types:" in out and "backends:" in out


@pytest.mark.parametrize("module", ["posenc", "posenc.cli"])  # the README's torchrun line runs -m posenc.cli
def test_python_dash_m_posenc_is_the_posenc_command(module):
    done = subprocess.run([sys.executable, "-m", module, "info"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and "rope types:" in done.stdout, done.stderr


def test_cli_unknown_command_exits_with_usage():
    with pytest.raises(SystemExit) as err:
        main(["nonsense"])
    assert err.value.code == 2


def test_subpackages_are_reachable_from_a_plain_import_and_load_on_first_use():
    """`posenc.interop.patch_model` and `posenc.cli.main` after `import posenc` alone, as the README writes them,
    without the import itself paying for matplotlib or the lab."""
    code = (
        "import sys, posenc\n"
        "assert not {'matplotlib', 'posenc.lab', 'posenc.analysis'} & set(sys.modules), sys.modules.keys()\n"
        "assert callable(posenc.interop.patch_model) and callable(posenc.testing.rope_reference)\n"
        "assert callable(posenc.analysis.bias_matrix) and callable(posenc.distributed.shard_positions)\n"
        "assert posenc.lab.__name__ == 'posenc.lab'\n"
        # README and docs/lab.md run a registered family's lab as posenc.cli.main([...]): an AttributeError before.
        "assert 'posenc.cli' not in sys.modules and callable(posenc.cli.main)\n"
        "try:\n    posenc.no_such_thing\nexcept AttributeError as e:\n    assert 'no_such_thing' in str(e)\n"
        "else:\n    raise SystemExit('no AttributeError')\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.parametrize("name", ["learned", "t5"])
def test_learned_tables_keep_their_small_init_when_materialised_from_meta(name):
    """to_empty, then every module's reset_parameters (FSDP's materialisation): the inner nn.Embedding reset the
    table to N(0, 1), 50 times the N(0, 0.02^2) of a module built on the CPU."""
    kwargs = dict(dim=32, num_heads=4, head_dim=8, max_positions=64)
    with torch.device("meta"):
        encoding = posenc.build_for_model(name, **kwargs)
    encoding.to_empty(device="cpu")
    for module in encoding.modules():
        if hasattr(module, "reset_parameters"):
            module.reset_parameters()
    (weight,) = encoding.parameters()
    assert 0.01 < weight.std().item() < 0.04
    # The same draws as before (nn.Embedding's fill, then the 0.02 one), so seeded models are what they were.
    torch.manual_seed(0)
    built = next(posenc.build_for_model(name, **kwargs).parameters())
    torch.manual_seed(0)
    plain = torch.nn.Embedding(*built.shape)
    torch.nn.init.normal_(plain.weight, std=0.02)
    assert torch.equal(built, plain.weight)


@pytest.mark.parametrize(
    "rope_parameters",
    [
        None,
        {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16},
        {
            "rope_type": "longrope",
            "short_factor": [1.0] * 4,
            "long_factor": [2.0] * 4,
            "factor": 4.0,
            "original_max_position_embeddings": 16,
        },
    ],
)
def test_a_rope_run_under_a_meta_device_context_works_once_materialised(rope_parameters):
    """Shape inference under torch.device("meta") ran RoPE there, and its kept frequencies were meta tensors: after
    to_empty() the layer failed inside torch ("Cannot copy out of meta tensor"). Frequencies are made on the CPU."""
    with torch.device("meta"):
        layer = posenc.CausalSelfAttention(32, 4, encoding=posenc.RoPE(8, rope_parameters=rope_parameters))
        assert layer(torch.randn(1, 20, 32)).shape == (1, 20, 32)
    assert layer.encoding.frequencies(20)[0].device.type == "cpu"
    reference = posenc.CausalSelfAttention(32, 4, encoding=posenc.RoPE(8, rope_parameters=rope_parameters))
    layer.to_empty(device="cpu")
    layer.load_state_dict(reference.state_dict())
    x = torch.randn(1, 20, 32)
    torch.testing.assert_close(layer(x), reference(x), atol=0, rtol=0)


@pytest.mark.parametrize("name", ["learned", "sinusoidal", "t5", "alibi", "rope"])
def test_an_unknown_option_error_lists_options_not_the_sizes(name):
    # The sizes are build_for_model's own arguments: listing them as options would invite passing them twice.
    from posenc.registry import build_for_model

    with pytest.raises(TypeError, match="takes no option 'bogus'") as refused:
        build_for_model(name, dim=8, num_heads=2, head_dim=4, max_positions=8, bogus=1)
    options = str(refused.value).split("its options: ")[1].split(" (its sizes")[0]
    assert not {"dim", "num_heads", "head_dim", "max_positions"} & set(options.split(", ")), options


class _LogDistanceBias(torch.nn.Module):
    """A user's family: -log(1 + |m - n|) on every head's scores."""

    acts_on = ActsOn.SCORE_BIAS

    def __init__(self, num_heads: int) -> None:
        super().__init__()
        self.num_heads = num_heads

    @classmethod
    def from_model_dims(cls, *, dim, num_heads, head_dim, max_positions):
        return cls(num_heads)

    def score_bias(self, q_positions, k_positions):
        distance = (q_positions[..., :, None] - k_positions[..., None, :]).abs().float()
        return -torch.log1p(distance).expand(1, self.num_heads, *distance.shape[-2:])


@pytest.fixture
def registry():
    """The registry itself (the lab holds it by reference), restored after the test."""
    encodings = posenc.registry.ENCODINGS
    before = dict(encodings)
    yield encodings
    encodings.clear()
    encodings.update(before)


def test_register_adds_a_family_that_the_lab_builds_by_name(registry):
    from posenc.lab.config import make_config

    posenc.register("logdist", _LogDistanceBias)
    assert posenc.available()[-1] == "logdist"
    built = posenc.build_for_model("logdist", dim=16, num_heads=2, head_dim=8, max_positions=32)
    assert isinstance(built, _LogDistanceBias) and built.num_heads == 2
    assert make_config("quick", encodings=("logdist", "alibi"), extensions=()).encodings == ("logdist", "alibi")


def test_register_names_what_a_family_lacks(registry):
    class NoDeclaration(torch.nn.Module):
        pass

    class NoSizes(torch.nn.Module):
        acts_on = ActsOn.NONE

    with pytest.raises(TypeError, match=r"acts_on = posenc\.ActsOn"):
        posenc.register("x", NoDeclaration)
    with pytest.raises(TypeError, match=r"classmethod from_model_dims"):
        posenc.register("x", NoSizes)
    with pytest.raises(TypeError, match="the class, not an instance"):
        posenc.register("x", _LogDistanceBias(2))
    with pytest.raises(ValueError, match="registered already"):
        posenc.register("alibi", _LogDistanceBias)
    for name in ("a,b", "rope+x", "runs/x", "", ".hidden"):
        with pytest.raises(ValueError, match="encoding name must be"):
            posenc.register(name, _LogDistanceBias)
    assert "x" not in registry
    posenc.register("alibi", _LogDistanceBias, replace=True)
    assert registry["alibi"] is _LogDistanceBias


def test_register_refuses_a_class_that_is_not_a_module_or_declares_acts_on_by_a_string(registry):
    """Mutation pass 13's survivors: a class that is not an nn.Module (its instance has no parameters, no .to()) and
    an acts_on spelled as a string (CausalSelfAttention compares it with ActsOn members) were accepted."""

    class NotAModule:
        acts_on = ActsOn.SCORE_BIAS

        @classmethod
        def from_model_dims(cls, *, dim, num_heads, head_dim, max_positions):
            return cls()

    class ActsOnAString(_LogDistanceBias):
        acts_on = "score_bias"  # type: ignore[assignment]

    with pytest.raises(TypeError, match=r"family must be an nn\.Module subclass"):
        posenc.register("x", NotAModule)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"needs a class attribute acts_on = posenc\.ActsOn.*got 'score_bias'"):
        posenc.register("x", ActsOnAString)
    with pytest.raises(ValueError, match="encoding name must be"):
        posenc.register("-x", _LogDistanceBias)  # a leading '-' reads as an option on the command line
    assert "x" not in registry and "-x" not in registry


def test_a_family_put_in_the_registry_without_from_model_dims_is_a_type_error_naming_it(registry):
    """Put into ENCODINGS by hand, such a class failed with Python's AttributeError from inside build_for_model, and
    `posenc lab` (whose config check catches ValueError and TypeError) with a traceback."""
    from posenc.lab.config import make_config

    class NoSizes(torch.nn.Module):
        acts_on = ActsOn.NONE

    registry["nosizes"] = NoSizes
    with pytest.raises(TypeError, match=r"'nosizes' \(NoSizes\) cannot be built from a model's sizes"):
        posenc.build_for_model("nosizes", dim=16, num_heads=2, head_dim=8, max_positions=32)
    with pytest.raises(ValueError, match="encoding nosizes cannot be built for the lab's model"):
        make_config("quick", encodings=("nosizes",), extensions=())


class _Scaled(_LogDistanceBias):
    """A family whose option is positional-or-keyword with a default, passed on by from_model_dims' **options."""

    def __init__(self, num_heads: int, scale: float = 1.0) -> None:
        super().__init__(num_heads)
        self.scale = scale

    @classmethod
    def from_model_dims(cls, *, dim, num_heads, head_dim, max_positions, per_head=False, **options):
        return cls(num_heads, **options)


class _AnyOption(_LogDistanceBias):
    def __init__(self, num_heads: int, **options) -> None:
        super().__init__(num_heads)
        self.options = options

    @classmethod
    def from_model_dims(cls, *, dim, num_heads, head_dim, max_positions, **options):
        return cls(num_heads, **options)


def test_build_for_model_takes_the_options_a_registered_family_takes(registry):
    """Only keyword-only constructor arguments counted as options, so build_for_model refused what build took: an
    `__init__(self, num_heads, scale=1.0)`, one taking **options, and from_model_dims' own keyword."""
    sizes = dict(dim=16, num_heads=2, head_dim=8, max_positions=32)
    posenc.register("scaled", _Scaled)
    posenc.register("any", _AnyOption)
    assert posenc.build_for_model("scaled", **sizes, scale=2.0).scale == 2.0
    assert posenc.build_for_model("scaled", **sizes, per_head=True).scale == 1.0
    with pytest.raises(TypeError, match=r"takes no option 'num_head'; its options: per_head, scale \("):
        posenc.build_for_model("scaled", **sizes, num_head=3)
    assert posenc.build_for_model("any", **sizes, anything=1).options == {"anything": 1}


class _OwnOptions(_LogDistanceBias):
    """from_model_dims with its options positional-or-keyword (no *) and one required, the constructor's
    keyword-only: what build_for_model took before 2026-12-07 must still be taken."""

    def __init__(self, num_heads: int, *, scale: float = 1.0, kernel: str = "log") -> None:
        super().__init__(num_heads)
        self.scale, self.kernel = scale, kernel

    @classmethod
    def from_model_dims(cls, dim, num_heads, head_dim, max_positions, kernel, scale=1.0):
        return cls(num_heads, scale=scale, kernel=kernel)


def test_build_for_model_takes_options_from_model_dims_names_and_those_it_requires(registry):
    sizes = dict(dim=16, num_heads=2, head_dim=8, max_positions=32)
    posenc.register("own", _OwnOptions)
    built = posenc.build_for_model("own", **sizes, kernel="power", scale=2.0)
    assert (built.scale, built.kernel) == (2.0, "power")


def test_register_refuses_a_from_model_dims_that_build_for_model_cannot_call(registry):
    """A from_model_dims without @classmethod was accepted and failed at the first build_for_model with Python's
    "missing 1 required positional argument: 'self'"; so did one missing a size."""

    class Method(_LogDistanceBias):
        def from_model_dims(self, *, dim, num_heads, head_dim, max_positions):
            return self

    class FewerSizes(_LogDistanceBias):
        @classmethod
        def from_model_dims(cls, *, dim, num_heads):
            return cls(num_heads)

    with pytest.raises(TypeError, match=r"Method\.from_model_dims is a method of instances \(it takes self first\)"):
        posenc.register("method", Method)

    class PlainFunction(_LogDistanceBias):  # no decorator and no self: called on the class as it is
        def from_model_dims(*, dim, num_heads, head_dim, max_positions):
            return PlainFunction(num_heads)

    class Lambda(_LogDistanceBias):
        from_model_dims = lambda **sizes: Lambda(sizes["num_heads"])  # noqa: E731

    posenc.register("plain", PlainFunction)
    posenc.register("lambda", Lambda)
    assert posenc.build_for_model("plain", dim=8, num_heads=2, head_dim=4, max_positions=8).num_heads == 2
    with pytest.raises(TypeError, match=r"FewerSizes\.from_model_dims does not take head_dim, max_positions"):
        posenc.register("fewer", FewerSizes)
    assert "method" not in registry and "fewer" not in registry
