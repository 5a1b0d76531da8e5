"""posenc under torch's FakeTensorMode: the shape inference that memory and FLOP estimators run a model through,
with tensors that have shapes, dtypes and devices but no values."""

import subprocess
import sys
import textwrap

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

import posenc

# In a process of its own: the fused CPU kernel wrote through a FakeTensor's data pointer, a segmentation fault.
FUSED = textwrap.dedent(
    """
    import torch, posenc
    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
    for backend in ("cpu", "auto"):
        with FakeTensorMode():
            x = torch.randn(2, 3, 5, 8, dtype=torch.bfloat16)
            cos, sin = torch.ones(16, 4), torch.zeros(16, 4)
            outs = [
                posenc.apply_rotary(x, cos[:5], sin[:5], backend=backend),
                posenc.apply_rotary(x, cos, sin, positions=torch.arange(5), backend=backend),
                posenc.apply_rotary_(x, cos, sin, offset=3, backend=backend),
                posenc.RoPE(8, backend=backend)(x, x[:, :1], positions=torch.arange(5))[1],
            ]
            leaf = torch.randn(2, 3, 5, 8, requires_grad=True)
            posenc.apply_rotary(leaf, cos, sin, offset=0, backend=backend).sum().backward()
            outs.append(leaf.grad)
        for out in outs:
            assert isinstance(out, FakeTensor), type(out)
            assert out.shape[-2:] == (5, 8) and out.dtype in (torch.bfloat16, torch.float32), (out.shape, out.dtype)
    mode = FakeTensorMode()  # its FakeTensors used after it closed: no mode on the dispatch stack
    x, cos, sin = (mode.from_tensor(t) for t in (torch.randn(2, 3, 5, 8), torch.ones(16, 4), torch.zeros(16, 4)))
    for backend in ("cpu", "auto"):
        for out in (
            posenc.apply_rotary(x, cos[:5], sin[:5], backend=backend),
            posenc.apply_rotary_(x, cos, sin, offset=3, backend=backend),
        ):
            assert isinstance(out, FakeTensor) and out.shape == (2, 3, 5, 8), (type(out), out.shape)
    print("ok")
    """
)


def test_fused_backends_give_shapes_under_fake_tensor_mode():
    done = subprocess.run([sys.executable, "-c", FUSED], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.strip() == "ok", (done.returncode, done.stderr[-2000:])


def test_rotations_with_position_tensors_need_no_values_under_fake_tensor_mode():
    # Position ids and per-sequence offsets were read on the host for their range: torch's
    # DataDependentOutputException. As on the meta device, there are no values to check.
    with FakeTensorMode():
        x = torch.randn(2, 3, 5, 8)
        cos, sin = torch.ones(16, 4), torch.zeros(16, 4)
        by_ids = posenc.apply_rotary(x, cos, sin, positions=torch.tensor([[0, 1, 2, 0, 1]] * 2), backend="torch")
        by_offsets = posenc.apply_rotary(x, cos, sin, offset=torch.tensor([0, 7]), backend="torch")
        packed = posenc.apply_rotary(x[0].transpose(0, 1), cos, sin, cu_seqlens=torch.tensor([0, 2, 5]))
    assert by_ids.shape == by_offsets.shape == (2, 3, 5, 8) and packed.shape == (5, 3, 8)


@pytest.mark.parametrize("offset", [3, torch.tensor([3]), 1 << 17], ids=["int", "tensor", "past the table"])
@pytest.mark.parametrize("real_first", [False, True])
def test_a_rope_serves_real_calls_and_fake_ones_in_either_order(real_first, offset):
    # Its cos/sin table made under the mode was kept, fake: the next real call failed on it (a segmentation fault in
    # the fused CPU kernel); a real table kept from before was read there, which the mode refuses (with a tensor
    # offset, by the branch for a CUDA graph capture, where no value may be read either).
    rope = posenc.RoPE(8, backend="torch")
    q, k = torch.randn(1, 2, 6, 8), torch.randn(1, 1, 6, 8)
    expected = posenc.RoPE(8, backend="torch")(q, k, offset=offset)
    if real_first:
        rope(q, k, offset=offset)
    with FakeTensorMode() as mode:
        fake_offset = offset if isinstance(offset, int) else mode.from_tensor(offset)
        fake_q, fake_k = rope(mode.from_tensor(q), mode.from_tensor(k), offset=fake_offset)
    assert isinstance(fake_q, FakeTensor) and fake_q.shape == q.shape and fake_k.shape == k.shape
    for got, want in zip(rope(q, k, offset=offset), expected, strict=True):
        assert not isinstance(got, FakeTensor)
        torch.testing.assert_close(got, want, rtol=0, atol=0)


@pytest.mark.parametrize("mode", ["hf", "consistent"])
@pytest.mark.parametrize(
    "parameters",
    [
        {"rope_type": "dynamic", "factor": 2.0},
        {"rope_type": "longrope", "short_factor": [1.0] * 4, "long_factor": [2.0] * 4},
    ],
)
def test_a_model_built_and_decoded_under_fake_tensor_mode(parameters, mode):
    # Building a RoPE checked its frequencies' values (DataDependentOutputException); the length-dependent types read
    # max(positions) + 1, and a 'consistent' cache compared frequencies. There are shapes only, as on meta.
    with FakeTensorMode():
        rope = posenc.RoPE(8, rope_parameters=parameters, max_position_embeddings=4, mode=mode)
        attention = posenc.CausalSelfAttention(24, 3, encoding=rope)
        cache = posenc.KVCache()
        attention(torch.randn(2, 5, 24), cache=cache)
        step = attention(torch.randn(2, 1, 24), cache=cache)
    assert isinstance(step, FakeTensor) and step.shape == (2, 1, 24)


def test_a_length_dependent_cos_sin_needs_no_values_under_fake_tensor_mode():
    # cos_sin reads max(positions) + 1 to check seq_len against: there are no values, and no seq_len is asked for.
    rope = posenc.RoPE(8, rope_parameters={"rope_type": "dynamic", "factor": 2.0}, max_position_embeddings=4)
    with FakeTensorMode():
        cos, sin = rope.cos_sin(torch.arange(6))
    assert isinstance(cos, FakeTensor) and cos.shape == sin.shape == (6, 4)


def test_a_bad_config_is_refused_under_fake_tensor_mode_too():
    with FakeTensorMode(), pytest.raises(ValueError, match="0 or infinite in float32"):
        posenc.RoPE(8, rope_parameters={"rope_type": "linear", "factor": 1e50})
