"""Files that survive Ctrl-C: every write goes to a temporary file in the same folder and is renamed over the
target with ``os.replace``, which is atomic on POSIX and Windows. A reader therefore sees the old file, the new
file, or no file, never half of one; a killed writer leaves at most a ``*.tmp`` file, which readers ignore."""

from __future__ import annotations

import contextlib
import json
import os
import re
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from safetensors import safe_open
from safetensors.torch import load_file, load_model, save_model
from torch import nn


@contextlib.contextmanager
def atomic_path(path: Path) -> Iterator[Path]:
    """Yields a temporary path beside ``path``; on success it replaces ``path``, on any error it is removed."""
    path.parent.mkdir(parents=True, exist_ok=True)
    # A fresh name that the writer creates (not mkstemp's file, whose 0600 mode would survive the rename).
    tmp = path.parent / f".{path.name}.{os.getpid()}.{uuid.uuid4().hex[:12]}.tmp"
    try:
        yield Path(tmp)
        os.replace(tmp, path)
    except BaseException:
        # BaseException: a Ctrl-C in the middle of a write must not leave the temporary file behind either.
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


_TEMPORARY = re.compile(r"\..+\.(\d+)\.[0-9a-f]{12}\.tmp")


def remove_stale_temporaries(folder: Path) -> list[Path]:
    """Delete the temporary files that ``atomic_path`` writers killed by SIGKILL (or power loss) left in ``folder``
    and below, and return them. Readers never see them, but they pile up across resumes, a weights file each at
    larger presets. A file whose writer process still runs on this machine is left alone."""
    removed = []
    for path in folder.rglob(".*.tmp"):
        match = _TEMPORARY.fullmatch(path.name)
        if match is None or not path.is_file() or _alive(int(match[1])):
            continue
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
            removed.append(path)
    return removed


def _alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # it exists, under another user
        return True
    return True


def write_text(path: Path, text: str) -> None:
    with atomic_path(path) as tmp:
        tmp.write_text(text, encoding="utf-8")


def write_bytes(path: Path, data: bytes) -> None:
    with atomic_path(path) as tmp:
        tmp.write_bytes(data)


def write_json(path: Path, obj: Any) -> None:
    write_text(path, json.dumps(obj, indent=1, sort_keys=True) + "\n")


def read_json(path: Path) -> Any:
    return json.loads(path.read_text(encoding="utf-8"))


def save_weights(model: nn.Module, path: Path, metadata: dict[str, str] | None = None) -> None:
    """Weights in safetensors. ``save_model`` (not ``save_file``) because the shared encoding appears under
    every layer, and safetensors refuses tensors that share memory unless it deduplicates them itself."""
    with atomic_path(path) as tmp:
        save_model(model, str(tmp), metadata=metadata)


# Until 2026-12-01 every ByteLM layer held the model's encoding, input encodings too, so save_model kept a learned
# table under the first layer's name; now only the model holds it.
_LAYER_HELD_INPUT_ENCODING = re.compile(r"blocks\.\d+\.attn\.(encoding\..+)")


def load_weights(model: nn.Module, path: Path) -> None:
    """Load weights saved by ``save_weights`` into a model of the same shape (strict), those of earlier versions
    too: a run interrupted before an upgrade resumes."""
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
