"""posenc's torch.compile marks (``torch.compiler.disable`` with posenc's reasons, ``assume_constant_result``) are
applied when Dynamo loads, not when posenc does, so that ``import posenc`` does not import Dynamo (1.9 s). Each
order of import runs in a fresh process: this one has long had Dynamo loaded."""

from __future__ import annotations

import subprocess
import sys

import pytest

# A dynamic-NTK RoPE compiled with fullgraph: its error must be the disable's reason ("read on the host"), not the
# ValueError that tracing into the plain function meets ("pass seq_len=" without it); then every marked function.
_CHECK = """
import sys
import torch
{before}
import posenc
import posenc.interop.consistent, posenc.kernels.flex_bias, posenc.rope.module
from posenc import _compile_marks
from posenc.kernels import backend

print("dynamo after import posenc:", "torch._dynamo" in sys.modules)
sites = [(posenc.rope.module, "_call_cos_sin_eagerly"), (posenc.rope.module, "_call_longrope_cos_sin_eagerly"),
         (posenc.rope.module, "_scaling_length_eagerly"), (posenc.kernels.flex_bias, "_flex_in_own_graph")]
rope = posenc.RoPE(16, rope_parameters={{"rope_type": "dynamic", "factor": 2.0}}, max_position_embeddings=8)
q = torch.randn(1, 2, 12, 16)
compiled = torch.compile(lambda q: rope(q, q)[0], fullgraph=True, backend="eager")
try:
    compiled(q)
except Exception as error:
    assert "read on the host; for fullgraph=True pass seq_len=" in str(error), str(error)[-2000:]
else:
    raise AssertionError("fullgraph compiled a host read")
assert not _compile_marks._pending and not any(
    isinstance(f, _compile_marks._DynamoImportHook) for f in sys.meta_path
)
# What Dynamo reads (torch 2.13's attributes): the wrapper now stands under the name its module's callers look up.
for module, name in sites:
    assert getattr(getattr(module, name), "_torchdynamo_disable", False), name
for fn in (backend.triton_available, backend._triton_imports, backend._cpu_built):
    assert getattr(fn, "_dynamo_marked_constant", False), fn.__name__
# Without fullgraph the same call breaks the graph there and gives eager's result.
torch.testing.assert_close(torch.compile(lambda q: rope(q, q)[0], backend="eager")(q), rope(q, q)[0])
print("ok")
"""


@pytest.mark.parametrize("before", ["", "import torch._dynamo"], ids=["dynamo-after-posenc", "dynamo-before-posenc"])
def test_compile_marks_apply_whichever_is_imported_first(before):
    done = subprocess.run(
        [sys.executable, "-c", _CHECK.format(before=before)], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0 and done.stdout.endswith("ok\n"), done.stdout + done.stderr[-3000:]
    assert f"dynamo after import posenc: {bool(before)}" in done.stdout


def test_a_mark_that_fails_is_a_warning_and_the_others_still_apply():
    """A mark that cannot be applied must not make ``import torch._dynamo`` fail (nor leave later marks unapplied):
    it is a warning, and that function runs unmarked."""
    code = """
import sys, warnings
import posenc
from posenc import _compile_marks
from posenc.kernels import backend
assert "torch._dynamo" not in sys.modules
_compile_marks._when_dynamo_loads(lambda: 1 / 0)
_compile_marks._pending.insert(0, _compile_marks._pending.pop())  # before posenc's own
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    import torch._dynamo
assert any("could not mark a function" in str(w.message) and "ZeroDivisionError" in str(w.message) for w in caught)
assert getattr(backend.triton_available, "_dynamo_marked_constant", False)
assert getattr(posenc.rope.module._call_cos_sin_eagerly, "_torchdynamo_disable", False)
print("ok")
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.endswith("ok\n"), done.stdout + done.stderr[-3000:]
