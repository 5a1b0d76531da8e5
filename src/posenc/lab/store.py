"""The lab's files, written so that they survive Ctrl-C (``posenc._atomic``): text, JSON and safetensors
checkpoints, each renamed over its target only once it is whole."""

from __future__ import annotations

import contextlib
import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, load_model, save_file
from torch import nn

from posenc import _atomic

# Re-exported for the lab's runner: `as` marks it public.
from posenc._atomic import remove_stale_temporaries as remove_stale_temporaries


class RunFolderError(ValueError):
    """A file in a run folder that the lab cannot use: cut short or changed by something other than the lab (the
    lab's own writes are atomic), e.g. a partial copy, or a unit folder brought from another run."""


def write_text(path: Path, text: str) -> None:
    # A path that is no valid UTF-8 (bytes the OS allows, in --corpus or --out) reaches the text as surrogate
    # escapes, which UTF-8 cannot encode: written as \xNN instead.
    text = text.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")
    with _atomic.atomic_path(path) as tmp:
        tmp.write_text(text, encoding="utf-8")


def write_bytes(path: Path, data: bytes) -> None:
    with _atomic.atomic_path(path) as tmp:
        tmp.write_bytes(data)


def write_json(path: Path, obj: Any) -> None:
    write_text(path, json.dumps(obj, indent=1, sort_keys=True) + "\n")


def read_json(path: Path) -> dict[str, Any]:
    """The JSON object (every file the lab writes holds one) in ``path``; RunFolderError for anything else."""
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise _not_the_labs(path, str(error)) from error
    if not isinstance(value, dict):
        # Valid JSON of another kind ([1, 2]) met the callers' .get() as a bare AttributeError.
        raise _not_the_labs(path, f"it holds a JSON {type(value).__name__}, not an object")
    return value


def _not_the_labs(path: Path, problem: str) -> RunFolderError:
    return RunFolderError(
        f"{path} is not the JSON the lab writes ({problem}); it was cut short or changed since: delete it (a "
        "unit's files are remade by the next run) or pass another --out"
    )


def save_weights(model: nn.Module, path: Path, metadata: dict[str, str] | None = None) -> None:
    """Weights in safetensors, each tensor the model shares under several names (the encoding every layer holds)
    stored once, under the first of its names. safetensors writes ``metadata``'s keys in a random order (a Rust
    HashMap), so with one key the same weights give the same bytes. ``save_model`` is not used: it adds a key per
    shared name (T5's table: one per layer), which made a T5 unit's file differ from run to run, header only."""
    save_tensors(path, _unshared(model.state_dict()), metadata)


def save_tensors(path: Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None = None) -> None:
    """``tensors`` (none sharing memory) and string ``metadata`` in one safetensors file, written atomically."""
    with _atomic.atomic_path(path, own_folder=True) as tmp:  # safetensors makes a temporary file of its own
        save_file(tensors, str(tmp), metadata=metadata)


def load_tensors(path: Path) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """The tensors (on the CPU) and the metadata of a safetensors file. A file that is not whole safetensors, or
    is gone, is a RunFolderError."""
    with _readable(path), safe_open(str(path), framework="pt") as f:
        names = f.keys()
        return {name: f.get_tensor(name) for name in names}, f.metadata() or {}


def _unshared(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``state`` with each tensor that appears under several names kept under the first in sorted order, the name
    ``save_model`` keeps, so that ``load_model`` ties the others to it again."""
    kept: dict[tuple[Any, ...], str] = {}
    for name in sorted(state):
        tensor = state[name]
        storage = tensor.untyped_storage()
        # Empty tensors share the null pointer without sharing anything.
        same = (storage.data_ptr(), tensor.storage_offset(), tensor.shape, tensor.stride(), tensor.dtype)
        kept.setdefault(same if storage.nbytes() else (name,), name)
    return {name: state[name] for name in kept.values()}


# Until 2026-12-01 every ByteLM layer held the model's encoding, input encodings too, so save_model kept a learned
# table under the first layer's name; now only the model holds it.
_LAYER_HELD_INPUT_ENCODING = re.compile(r"blocks\.\d+\.attn\.(encoding\..+)")


def load_weights(model: nn.Module, path: Path) -> None:
    """Load weights saved by ``save_weights`` into a model of the same shape (strict), those of earlier versions
    too: a run interrupted before an upgrade resumes. A file that is not whole safetensors is a RunFolderError."""
    with _readable(path):
        _load_weights(model, path)


@contextlib.contextmanager
def _readable(path: Path) -> Iterator[None]:
    """Reading the safetensors file ``path``: what safetensors or the OS raise for a damaged or missing file
    becomes a RunFolderError that says what to delete."""
    try:
        yield
    except SafetensorError as error:
        raise RunFolderError(
            f"{path} is not a whole safetensors file ({error}); delete it and the unit is trained again"
        ) from error
    except FileNotFoundError as error:  # deleted between the check that it exists and this read
        raise RunFolderError(
            f"{path} is missing; delete the folder {path.parent} and the unit is trained again"
        ) from error


def _load_weights(model: nn.Module, path: Path) -> None:
    expected = model.state_dict().keys()
    with safe_open(str(path), framework="pt") as f:
        stored = set(f.keys())
    renames = {}
    for key in stored - expected:
        match = _LAYER_HELD_INPUT_ENCODING.fullmatch(key)
        if match and match[1] in expected and match[1] not in stored:
            renames[key] = match[1]
    if not renames:
        load_model(model, str(path), strict=True)
        return
    model.load_state_dict({renames.get(key, key): value for key, value in load_file(str(path)).items()}, strict=True)
