"""Graphs recorded for deployment that cannot hold posenc's fused kernels: torch.jit.trace (and the TorchScript-based
``torch.onnx.export(..., dynamo=False)``), and ``torch.onnx.export(..., dynamo=True)``.

torch.jit.trace records dispatched ops only: the fused kernels write through raw pointers, so a trace of
``apply_rotary`` on the CPU returned the empty output's memory at every replay, without an error; the torch path's
``autograd.Function`` became an opaque ``prim::PythonOp``, whose writes into the output's slices the TorchScript
ONNX exporter dropped (an ONNX model off by ~3.6). RoPE, CausalSelfAttention and add_input_encoding failed deep
inside (sizes are tensors under the tracer). ONNX has no function for ``posenc::rotary``: a model built with the
default backend failed at ONNX translation with no word of backend="torch". These tests need no onnx package: the
ONNX exporter's flag is emulated by ``torch.onnx.is_in_onnx_export``, which it sets for the whole export.
"""

from __future__ import annotations

import io
import warnings

import pytest
import torch
import torch.onnx

import posenc
from posenc.testing import random_qk

HEAD_DIM = 16


def _cos_sin(seq: int, offset: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    return posenc.RoPE(HEAD_DIM).cos_sin(torch.arange(seq) + offset)


def _trace(fn, *args):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", torch.jit.TracerWarning)
        # torch.jit is deprecated, but the TorchScript ONNX exporter still traces with it. The message, not the
        # category: torch 2.13 says so in a DeprecationWarning, 2.15 in a FutureWarning.
        warnings.filterwarnings("ignore", message=r"`torch\.jit\.\w+` is deprecated")
        return torch.jit.trace(fn, args, check_trace=False)


@pytest.mark.parametrize("backend", ["auto", "torch"])
def test_a_traced_apply_rotary_equals_eager_at_other_lengths(backend):
    def rotate(x, cos, sin):
        return posenc.apply_rotary(x, cos, sin, backend=backend)

    traced = _trace(rotate, torch.randn(1, 2, 8, HEAD_DIM), *_cos_sin(8))
    # No Python op: the TorchScript ONNX exporter cannot translate one, and torch.jit.save cannot store it.
    assert "prim::PythonOp" not in {node.kind() for node in traced.graph.nodes()}
    for seq, offset in ((8, 0), (13, 20)):
        x, (cos, sin) = torch.randn(1, 2, seq, HEAD_DIM), _cos_sin(seq, offset)
        torch.testing.assert_close(traced(x, cos, sin), rotate(x, cos, sin), rtol=2.5e-7, atol=2e-7)


@pytest.mark.parametrize("kind", ["offset", "positions"])
def test_a_traced_table_call_reads_its_rows_at_the_values_it_is_given(kind):
    """A tensor offset failed while tracing with torch's "Unsupported value kind: UInt" (the host check of the
    offsets' range compared a traced value with 2**63). Traced, the rows are read at each call's values; a trace
    records no check of them (README.md says so)."""
    cos, sin = posenc.RoPE(HEAD_DIM).cos_sin(torch.arange(64))

    def rotate(x, index):
        return posenc.apply_rotary(x, cos, sin, **{kind: index})

    example = torch.tensor([3]) if kind == "offset" else torch.arange(8)
    traced = _trace(rotate, torch.randn(1, 2, 8, HEAD_DIM), example)
    x = torch.randn(1, 2, 8, HEAD_DIM)
    for index in (torch.tensor([20]), torch.tensor([0])) if kind == "offset" else (torch.arange(8).flip(0) + 9,):
        torch.testing.assert_close(traced(x, index), rotate(x, index), rtol=2.5e-7, atol=2e-7)


def test_a_traced_apply_rotary_qk_equals_eager():
    """Its check that q and k share a head dim compared the tracer's size tensors by identity: refused as
    "got tensor(16), tensor(16)" (a patched transformers model failed there too)."""

    def rotate(q, k, cos, sin):
        return posenc.apply_rotary_qk(q, k, cos, sin)

    traced = _trace(rotate, *random_qk(1, 4, 2, 8, HEAD_DIM), *_cos_sin(8))
    q, k = random_qk(1, 4, 2, 13, HEAD_DIM)
    for got, want in zip(traced(q, k, *_cos_sin(13)), rotate(q, k, *_cos_sin(13)), strict=True):
        torch.testing.assert_close(got, want, rtol=2.5e-7, atol=2e-7)


def test_a_fused_backend_asked_for_under_trace_is_refused():
    x, (cos, sin) = torch.randn(1, 2, 8, HEAD_DIM), _cos_sin(8)
    with pytest.raises(ValueError, match=r"torch\.jit\.trace records no call of the fused kernels.*backend='torch'"):
        _trace(lambda x, cos, sin: posenc.apply_rotary(x, cos, sin, backend="cpu"), x, cos, sin)


class _Attention(torch.nn.Module):
    def __init__(self, encoding: torch.nn.Module | None) -> None:
        super().__init__()
        self.attention = posenc.CausalSelfAttention(32, 4, encoding=encoding)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.attention(x)


class _Input(torch.nn.Module):
    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return posenc.add_input_encoding(x, posenc.Sinusoidal(32), positions)


@pytest.mark.parametrize(
    ("what", "module", "args"),
    [
        ("RoPE", posenc.RoPE(HEAD_DIM), random_qk(1, 2, 2, 8, HEAD_DIM)),
        ("MRoPE", posenc.MRoPE(HEAD_DIM, mrope_section=[2, 3, 3]), random_qk(1, 2, 2, 8, HEAD_DIM)),
        ("CausalSelfAttention", _Attention(posenc.ALiBi(4)), (torch.randn(1, 8, 32),)),
        ("CausalSelfAttention", _Attention(None), (torch.randn(1, 8, 32),)),
        ("add_input_encoding", _Input(), (torch.randn(1, 8, 32), torch.arange(8))),
        ("RoPE.cos_sin", lambda positions: posenc.RoPE(HEAD_DIM).cos_sin(positions), (torch.arange(8),)),
        (
            "MRoPE.cos_sin",
            lambda positions: posenc.MRoPE(HEAD_DIM, mrope_section=[2, 3, 3]).cos_sin(positions),
            (torch.zeros(3, 1, 8, dtype=torch.long),),
        ),
        (
            "MRoPE",
            lambda q, k, positions: posenc.MRoPE(HEAD_DIM, mrope_section=[2, 3, 3])(q, k, positions=positions),
            (*random_qk(1, 2, 2, 8, HEAD_DIM), torch.zeros(3, 1, 8, dtype=torch.long)),
        ),
    ],
)
def test_modules_that_cannot_be_traced_say_what_to_use(what, module, args):
    """They failed deep inside: AttributeError "'Tensor' object has no attribute 'bit_length'" (RoPE), RuntimeError
    "Unsupported value kind: UInt" (attention, add_input_encoding)."""
    with pytest.raises(RuntimeError, match=rf"{what} cannot be recorded by torch\.jit\.trace.*torch\.export\.export"):
        _trace(module, *args)


class _Rope(torch.nn.Module):
    def __init__(self, backend: str) -> None:
        super().__init__()
        self.rope = posenc.RoPE(HEAD_DIM, backend=backend)

    def forward(self, q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.rope(q, k, positions=positions)


@pytest.fixture
def onnx_exporting(monkeypatch):
    """What torch.onnx.export(..., dynamo=True) sets while it runs torch.export."""
    monkeypatch.setattr(torch.onnx, "is_in_onnx_export", lambda: True)


def test_exported_for_onnx_the_auto_backend_holds_no_posenc_op(onnx_exporting):
    seq = torch.export.Dim("s", min=2, max=1024)
    q, k = random_qk(1, 2, 2, 8, HEAD_DIM)
    program = torch.export.export(_Rope("auto"), (q, k, torch.arange(8)), dynamic_shapes=({2: seq}, {2: seq}, {0: seq}))
    targets = [str(node.target) for node in program.graph.nodes if node.op == "call_function"]
    assert not [t for t in targets if "posenc" in t], targets
    q, k = random_qk(1, 2, 2, 13, HEAD_DIM)
    positions = torch.arange(13) + 20
    for got, want in zip(program.module()(q, k, positions), _Rope("auto")(q, k, positions), strict=True):
        torch.testing.assert_close(got, want, rtol=2.5e-7, atol=2e-7)  # a float32 ulp or two


@pytest.mark.parametrize("strict", [False, True])  # torch.onnx.export tries non-strict, then strict (Dynamo)
def test_exported_for_onnx_an_explicit_fused_backend_is_refused_naming_the_fix(onnx_exporting, strict):
    # Strict: Dynamo's Unsupported (a RuntimeError) carries the ValueError's message.
    with pytest.raises((ValueError, RuntimeError), match=r"torch\.onnx\.export has no ONNX function.*backend='torch'"):
        torch.export.export(_Rope("cpu"), (*random_qk(1, 2, 2, 8, HEAD_DIM), torch.arange(8)), strict=strict)


def test_exported_outside_onnx_the_fused_kernel_stays():
    """README: a package built with the fused backends holds posenc's ops (AOTInductor runs them at their speed)."""
    program = torch.export.export(_Rope("cpu"), (*random_qk(1, 2, 2, 8, HEAD_DIM), torch.arange(8)))
    assert "posenc.rotary.default" in [str(node.target) for node in program.graph.nodes]


@pytest.mark.parametrize("rotary_dim", [HEAD_DIM, HEAD_DIM // 2], ids=["whole head", "partial"])
def test_a_traced_apply_rotary_inplace_writes_x_only_as_the_onnx_exporter_keeps(rotary_dim):
    """The torch path rotated x in place with out= writes into its slices (and a copy_ into a narrow() view),
    which torch.jit.trace records but the TorchScript ONNX exporter (dynamo=False) drops: its model returned x
    unrotated, ~4 off, without an error (checked with onnxruntime). Traced, x is now written by copy_ into a slice,
    which the exporter keeps, and the trace still equals eager at other lengths."""

    def rotate(x, cos, sin):
        y = x * 1.0
        posenc.apply_rotary_(y, cos, sin)
        return y

    pairs = rotary_dim // 2
    cos, sin = (t[:, :pairs] for t in _cos_sin(8))
    traced = _trace(rotate, torch.randn(1, 2, 8, HEAD_DIM), cos, sin)
    writes = [(node.kind(), next(node.inputs()).node().kind()) for node in traced.graph.nodes() if _mutates(node)]
    assert writes == [("aten::copy_", "aten::slice")]
    x, (cos, sin) = torch.randn(1, 2, 13, HEAD_DIM), (t[:, :pairs] for t in _cos_sin(13, 20))
    torch.testing.assert_close(traced(x, cos, sin), rotate(x, cos, sin), rtol=2.5e-7, atol=2e-7)


def _mutates(node: torch._C.Node) -> bool:
    """Whether a TorchScript node writes one of its inputs (an in-place op, or an out= variant)."""
    try:
        return "(a!)" in node.schema()
    except RuntimeError:  # prim:: nodes have no schema
        return False


@pytest.mark.parametrize("rotary_dim", [16, 8])
def test_the_torchscript_onnx_export_of_apply_rotary_inplace_keeps_its_write(monkeypatch, rotary_dim):
    """Written through a slice bound to a name first, apply_rotary_'s copy_ was dropped by the TorchScript ONNX
    exporter: its model held one Identity (x unrotated). onnx is not installed here: the exporter's last step, which
    needs it, is skipped; the model's proto is built before it."""
    proto_utils = pytest.importorskip("torch.onnx._internal.torchscript_exporter.onnx_proto_utils")
    exporter_utils = pytest.importorskip("torch.onnx._internal.torchscript_exporter.utils")
    for module in (proto_utils, exporter_utils):
        if hasattr(module, "_add_onnxscript_fn"):
            monkeypatch.setattr(module, "_add_onnxscript_fn", lambda model_bytes, custom_opsets: model_bytes)

    class Rotate(torch.nn.Module):
        def forward(self, x, cos, sin):
            return posenc.apply_rotary_(x * 1.0, cos, sin)

    cos, sin = _cos_sin(8)
    written = io.BytesIO()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(
            Rotate(),
            (torch.randn(1, 2, 8, HEAD_DIM), cos[..., : rotary_dim // 2], sin[..., : rotary_dim // 2]),
            written,
            dynamo=False,
            opset_version=17,
        )
    assert b"ScatterND" in written.getvalue() and b"Identity" not in written.getvalue()
