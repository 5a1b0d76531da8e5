"""posenc.testing.assert_close means the same at every activation scale: a correct rotation passes however large the
activations, and a wrong one fails however small (the fixed atol=1e-6 failed correct float32 results at |x| ~ 32,
where an output near zero carries the rounding of products of size |x|, and passed any rotation at |x| ~ 1e-7)."""

from __future__ import annotations

import math

import pytest
import torch

import posenc
from posenc.testing import (
    alibi_bias_reference,
    alibi_slopes_reference,
    assert_close,
    attention_reference,
    random_qk,
    rope_inv_freq_reference,
    rope_reference,
    sinusoidal_reference,
    torch_threads,
)

POSITIONS = torch.arange(128) + 1000


def activations(scale: float, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    gen = torch.Generator().manual_seed(0)
    return (torch.randn(1, 4, 128, 128, generator=gen, dtype=torch.float64) * scale).to(dtype)


def swapped_cos_sin(x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Half-split RoPE with cos and sin exchanged, in float64."""
    x = x.double()
    half = x.shape[-1] // 2
    angle = positions[:, None].double() * 10000.0 ** (-torch.arange(half, dtype=torch.float64) / half)
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat((x1 * angle.sin() - x2 * angle.cos(), x2 * angle.sin() + x1 * angle.cos()), dim=-1)


@pytest.mark.parametrize("backend", ["torch", "cpu"])
@pytest.mark.parametrize(("dtype", "scale"), [(torch.float32, 32.0), (torch.float32, 1e3), (torch.float16, 1e3)])
def test_correct_rotations_of_large_activations_pass(backend, dtype, scale):
    x = activations(scale, dtype)
    out, _ = posenc.RoPE(128, backend=backend)(x, x, offset=1000)
    assert_close(out, rope_reference(x, POSITIONS))


@pytest.mark.parametrize("scale", [1e-8, 1e-7, 1e-6, 1e-4, 1.0, 1e3])
@pytest.mark.parametrize(
    "wrong",
    [
        lambda x: rope_reference(x, -POSITIONS),  # sin's sign flipped
        lambda x: rope_reference(x, POSITIONS, interleaved=True),  # the other pair layout
        lambda x: rope_reference(x, POSITIONS + 1),  # off by one position
        lambda x: swapped_cos_sin(x, POSITIONS),
        lambda x: rope_reference(x, POSITIONS) * (1 + 2.0**-8),  # one bfloat16 unit of drift
        lambda x: x,  # not rotated
    ],
    ids=["sin-sign", "layout", "off-by-one", "cos-sin-swapped", "bf16-drift", "unrotated"],
)
def test_wrong_float32_rotations_fail_at_every_scale(wrong, scale):
    x = activations(scale)
    reference = rope_reference(x, POSITIONS)
    assert_close(rope_reference(x, POSITIONS).float(), reference)  # the correct result, rounded once, passes
    with pytest.raises(AssertionError):
        assert_close(wrong(x).float(), reference)


def test_the_verdict_does_not_depend_on_the_scale():
    """Scaling both tensors by a power of two scales every error and every allowance alike."""
    x = activations(1.0)
    reference = rope_reference(x, POSITIONS)
    nearly = reference + 3e-7 * torch.sign(reference) * reference.abs().amax(-1, keepdim=True)
    assert_close(nearly.float(), reference)
    beyond = reference + 2e-6 * reference.abs().amax(-1, keepdim=True)
    for power in (-30, -10, 0, 10, 30):
        assert_close((nearly * 2.0**power).float(), reference * 2.0**power)
        with pytest.raises(AssertionError):
            assert_close((beyond * 2.0**power).float(), reference * 2.0**power)


def test_scale_gives_the_operands_size_where_the_result_is_smaller():
    """An attention output averages values of both signs; its rounding is that of the values, not of the output."""
    reference = torch.tensor([[1e-3, -2e-3]], dtype=torch.float64)
    actual = (reference + 1e-6).float()  # rounding of values of size 10
    with pytest.raises(AssertionError, match="allowed"):
        assert_close(actual, reference)
    assert_close(actual, reference, scale=10.0)
    assert_close(actual, reference, scale=torch.tensor([[10.0, 10.0]]))
    with pytest.raises(ValueError, match="scale must be finite and >= 0"):
        assert_close(actual, reference, scale=-1.0)
    with pytest.raises(ValueError, match=r"scale must be .* broadcastable to the reference's shape \(1, 2\)"):
        assert_close(actual, reference, scale=torch.ones(3))


@pytest.mark.parametrize(
    ("actual", "reference"),
    [
        (torch.arange(3), torch.arange(3)),  # integers compare exactly, before the scale was looked at
        (torch.ones(0, 2), torch.ones(0, 2, dtype=torch.float64)),  # nothing to compare, ditto
        (torch.ones(2, 2), torch.ones(2, 2, dtype=torch.float64)),
    ],
)
def test_a_bad_scale_is_refused_whatever_the_operands(actual, reference):
    """A negative, misshapen or boolean scale passed silently where the operands were integers or empty, and failed
    only once a test's operands became floats or non-empty."""
    with pytest.raises(ValueError, match="scale must be finite and >= 0"):
        assert_close(actual, reference, scale=-1.0)
    with pytest.raises(ValueError, match=r"scale must be .* broadcastable to the reference's shape"):
        assert_close(actual, reference, scale=torch.ones(7))
    with pytest.raises(TypeError, match="scale must be a float or a float tensor"):
        assert_close(actual, reference, scale=True)
    with pytest.raises(TypeError, match="scale must be a float or a float tensor"):
        assert_close(actual, reference, scale=torch.tensor(True))  # read as 1.0 too


@pytest.mark.parametrize("name", ["actual", "reference"])
def test_operands_that_are_not_tensors_are_named(name):
    """An AttributeError ("'list' object has no attribute 'is_floating_point'") before."""
    operands = {"actual": torch.ones(2), "reference": torch.ones(2, dtype=torch.float64)}
    operands[name] = [1.0, 1.0]
    with pytest.raises(TypeError, match=f"{name} must be a torch.Tensor, got list"):
        assert_close(operands["actual"], operands["reference"])


def test_non_finite_values_match_exactly_and_do_not_widen_their_row():
    reference = torch.tensor([[math.inf, 1.0], [-math.inf, 0.5]], dtype=torch.float64)
    assert_close(reference.float(), reference)
    with pytest.raises(AssertionError, match=r"index \(0, 1\)"):
        assert_close(torch.tensor([[math.inf, 1.5], [-math.inf, 0.5]]), reference)
    with pytest.raises(AssertionError, match=r"index \(1, 0\)"):
        assert_close(torch.tensor([[math.inf, 1.0], [math.nan, 0.5]]), reference)


def test_float16_subnormal_results_pass():
    """Below float16's smallest normal (6.1e-5) results are rounded to steps of 2^-24: the floor of the tolerance."""
    x = activations(1e-6, torch.float16)
    out, _ = posenc.RoPE(128, backend="torch")(x, x, offset=1000)
    assert_close(out, rope_reference(x, POSITIONS))


def test_msg_comes_first_and_shapes_still_must_match():
    with pytest.raises(AssertionError, match=r"^q rows: 1 of 2 elements are off by more than atol 1e-06 x scale"):
        assert_close(torch.tensor([1.0, 3.0]), torch.tensor([1.0, 2.0], dtype=torch.float64), msg="q rows")
    with pytest.raises(AssertionError, match="shape"):
        assert_close(torch.ones(2), torch.ones(3, dtype=torch.float64))


def test_a_bias_table_with_scale_of_its_own_entries_catches_drift_near_the_diagonal() -> None:
    """The row's largest |value| would let entries near the diagonal of a bias table drift; the docstring's
    scale=reference.abs() compares each entry by its own size."""
    from posenc.testing import alibi_bias_reference

    n = 256
    reference = alibi_bias_reference(4, list(range(n)), list(range(n))).double()
    reference = torch.where(torch.isfinite(reference), reference, 0.0)
    distance = torch.arange(n)[:, None] - torch.arange(n)[None]
    slopes = torch.tensor([1 / 4, 1 / 16, 1 / 64, 1 / 256])
    drifted = reference.float() - slopes[:, None, None] * 1e-4 * (distance == 1)  # distance 1 read as 1.0001
    assert_close(reference.float(), reference, scale=reference.abs())
    with pytest.raises(AssertionError, match="elements are off"):
        assert_close(drifted, reference, scale=reference.abs())


def test_every_public_name_the_module_defines_is_in_its_all() -> None:
    """A helper named as public but left out of ``__all__`` is neither documented nor private: each one the module
    defines is one or the other."""
    import posenc.testing

    defined = {
        name
        for name, value in vars(posenc.testing).items()
        if not name.startswith("_") and getattr(value, "__module__", None) == posenc.testing.__name__
    }
    assert defined <= set(posenc.testing.__all__), sorted(defined - set(posenc.testing.__all__))


def test_each_row_is_judged_by_its_own_size_not_the_largest_in_the_tensor():
    """A row of small activations next to a row of large ones: its wrong value fails, as it would on its own."""
    reference = torch.tensor([[1e3, 1.0], [1e-3, 2e-3]], dtype=torch.float64)
    assert_close(reference.float(), reference)
    wrong = reference.clone()
    wrong[1, 1] += 1e-4  # 5% off in the small row; 1e-7 of the large row's size
    with pytest.raises(AssertionError, match=r"index \(1, 1\)"):
        assert_close(wrong.float(), reference)


def test_a_scale_that_would_allow_anything_or_widen_the_comparison_is_refused():
    reference = torch.tensor([[1.0, 2.0]], dtype=torch.float64)
    actual = torch.tensor([[5.0, -7.0]])
    for scale in (math.inf, math.nan, torch.tensor([[1.0, math.inf]])):
        with pytest.raises(ValueError, match="scale must be finite and >= 0"):
            assert_close(actual, reference, scale=scale)
    # (2, 1, 2) broadcasts with (1, 2), but to a larger shape than the reference's
    with pytest.raises(ValueError, match=r"broadcastable to the reference's shape \(1, 2\), got shape \(2, 1, 2\)"):
        assert_close(reference.float(), reference, scale=torch.ones(2, 1, 2))


@pytest.mark.parametrize("scale", [1e-6, 1e-5])
def test_wrong_float16_rotations_of_subnormal_activations_fail(scale):
    """The floor is one subnormal step of float16 (2^-24), not its smallest normal (6.1e-5), which would pass any
    result of activations below it."""
    x = activations(scale, torch.float16)
    reference = rope_reference(x, POSITIONS)
    assert_close(reference.half(), reference)
    with pytest.raises(AssertionError):
        assert_close(x, reference)  # not rotated
    with pytest.raises(AssertionError):
        assert_close(rope_reference(x, -POSITIONS).half(), reference)  # sin's sign flipped


def test_torch_threads_sets_the_count_inside_and_restores_it_after_an_error_too():
    before = torch.get_num_threads()
    other = 1 if before != 1 else 2
    with pytest.raises(KeyError), torch_threads(other):
        assert torch.get_num_threads() == other
        raise KeyError("inside")
    assert torch.get_num_threads() == before
    with torch_threads():  # code inside that sets its own
        assert torch.get_num_threads() == before
        torch.set_num_threads(other)
    assert torch.get_num_threads() == before
    with pytest.raises(ValueError, match="count must be a positive int"), torch_threads(0):
        pass


@pytest.mark.parametrize("actual", [torch.tensor([1.0, 2.0]), torch.tensor([1, 2])])
def test_a_complex_reference_is_refused_not_cast_to_its_real_part(actual):
    """Cast to float64, a complex reference lost its imaginary part: [1, 2] passed against [1+5j, 2]."""
    with pytest.raises(TypeError, match=r"reference is complex; compare torch\.view_as_real of both"):
        assert_close(actual, torch.tensor([1 + 5j, 2]))


ONES, META = torch.ones(1, 1, 2, 4), torch.ones(1, 1, 2, 4, device="meta")


@pytest.mark.parametrize(
    ("call", "error", "match"),
    [
        (lambda: rope_inv_freq_reference(8, -1.0), ValueError, "base must be a finite number > 1"),
        (lambda: rope_inv_freq_reference(0, 10000.0), ValueError, "rotary_dim"),
        (lambda: rope_inv_freq_reference(-4, 10000.0), ValueError, "rotary_dim"),
        (lambda: rope_reference(torch.ones(2, 4, dtype=torch.complex64), torch.arange(2)), TypeError, "x"),
        (lambda: rope_reference(torch.ones(2, 4), torch.arange(2), base=-1.0), ValueError, "base"),
        (lambda: rope_reference(torch.ones(2, 4), [0, 1]), TypeError, "positions must be a torch.Tensor"),
        (lambda: sinusoidal_reference(torch.arange(3), 4, base=0.0), ValueError, "base"),
        (lambda: alibi_slopes_reference(0), ValueError, "num_heads must be a positive integer"),
        (lambda: alibi_slopes_reference(2**62), ValueError, r"num_heads must be at most 2\*\*24"),
        (lambda: alibi_bias_reference(2, [0.5, 1], [0, 1]), TypeError, "q_positions must be a sequence of integer"),
        (lambda: sinusoidal_reference(torch.arange(3), 5), ValueError, "dim must be"),
        (lambda: attention_reference(META, ONES, ONES), ValueError, "q is on meta but k is on cpu"),
        (lambda: attention_reference(ONES[0], ONES[0], ONES[0]), ValueError, "q must"),
        (lambda: random_qk(True, 1, 1, 2, 4), ValueError, "batch must be a positive integer"),
        (lambda: random_qk(1, 1, 1, -1, 4), ValueError, "seq must be"),
        (lambda: random_qk(1, 1, 1, 2, 4, seed=2**32), ValueError, r"seed must be an int in \[0, 2\*\*32\)"),
    ],
)
def test_references_refuse_what_would_make_them_a_wrong_oracle(call, error, match):
    """The float64 references took anything: complex frequencies from a negative base, none from rotary_dim 0, a
    complex x cast to its real part, float ALiBi positions, meta q beside CPU k (a CPU result of no values), and
    random_qk seeds past 32 bits that drew what seed 0 draws."""
    with pytest.raises(error, match=match):
        call()


def test_references_take_numpy_integers_and_read_iterables_once():
    """The checks read a generator of positions before the reference did (an empty bias, no error), and refused
    numpy's integers, which every other integer argument takes."""
    import numpy as np

    want = alibi_bias_reference(4, [0, 1, 2], [0, 1, 2])
    assert torch.equal(alibi_bias_reference(4, (i for i in range(3)), map(int, [0, 1, 2])), want)
    assert torch.equal(alibi_bias_reference(4, list(np.arange(3)), list(np.arange(3))), want)
    assert torch.equal(sinusoidal_reference(torch.arange(3), np.int64(4)), sinusoidal_reference(torch.arange(3), 4))
    assert all(map(torch.equal, random_qk(np.int64(1), 1, 1, 2, 4, seed=np.int64(3)), random_qk(1, 1, 1, 2, 4, seed=3)))
