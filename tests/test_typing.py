"""What a user's type checker reads from the package (it ships py.typed): the public names resolve to their types."""

from __future__ import annotations

import importlib
import inspect
import typing
from typing import Any

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


PUBLIC_MODULES = (
    "posenc",
    "posenc.absolute",
    "posenc.analysis",
    "posenc.bias",
    "posenc.distributed",
    "posenc.interop",
    "posenc.kernels",
    "posenc.lab",
    "posenc.rope",
    "posenc.testing",
)


def _public_callables() -> dict[str, Any]:
    """Every function, class, and public method or property of a class, named in a public module's ``__all__``."""
    found: dict[str, Any] = {}
    for module_name in PUBLIC_MODULES:
        module = importlib.import_module(module_name)
        for name in module.__all__:
            obj = getattr(module, name)
            if not (inspect.isfunction(obj) or inspect.isclass(obj)):
                continue  # constants
            found[f"{module_name}.{name}"] = obj
            if not inspect.isclass(obj):
                continue
            for attr, value in vars(obj).items():
                if attr.startswith("_") and attr != "__init__":
                    continue
                value = value.__func__ if isinstance(value, (staticmethod, classmethod)) else value
                if isinstance(value, property) or inspect.isfunction(value):
                    found[f"{module_name}.{name}.{attr}"] = value
    return found


def test_every_public_function_method_and_property_has_a_docstring() -> None:
    """What help() and an editor show: the shapes and meaning of what a public name takes and returns."""
    # inspect.getdoc falls back to the base class's docstring for an override (T5Bias.get_extra_state, nn.Module's).
    missing = [
        qualified
        for qualified, obj in _public_callables().items()
        if not qualified.endswith(".__init__") and not (inspect.getdoc(obj) or "").strip()
    ]
    assert not missing, f"no docstring: {missing}"


def test_every_public_function_and_method_has_type_hints() -> None:
    """posenc ships py.typed: a parameter or return left unannotated is Any to a user's type checker."""
    missing = []
    for qualified, obj in _public_callables().items():
        function = obj.fget if isinstance(obj, property) else obj
        if not inspect.isfunction(function):
            continue
        signature = inspect.signature(function)
        for parameter in signature.parameters.values():
            if parameter.annotation is inspect.Parameter.empty and parameter.name not in ("self", "cls"):
                missing.append(f"{qualified}({parameter.name})")
        if signature.return_annotation is inspect.Signature.empty and not qualified.endswith(".__init__"):
            missing.append(f"{qualified} -> ?")
    assert not missing, f"not annotated: {missing}"
