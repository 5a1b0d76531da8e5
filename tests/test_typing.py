"""What a user's type checker reads from the package (it ships py.typed): the public names resolve to their types."""

from __future__ import annotations

import typing

import torch

import posenc
import posenc.interop


def test_buffers_and_results_documented_as_tensors_are_annotated_as_tensors():
    # A buffer read through nn.Module.__getattr__ types as Tensor | Module without a class annotation.
    assert typing.get_type_hints(posenc.ALiBi)["slopes"] is torch.Tensor
    returns = [typing.get_type_hints(f)["return"] for f in typing.get_overloads(posenc.CausalSelfAttention.forward)]
    assert returns[:2] == [torch.Tensor, tuple[torch.Tensor, torch.Tensor]]


def test_the_report_patch_model_returns_can_be_imported_to_annotate_with():
    assert "PatchReport" in posenc.interop.__all__
    assert typing.get_type_hints(posenc.interop.patch_model)["return"] is posenc.interop.PatchReport
