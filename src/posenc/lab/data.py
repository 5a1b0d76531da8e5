"""The lab's text: a byte corpus, its hash, a deterministic train/validation split, and batches.

The built-in corpus is the CPython standard library's own source, found at run time through ``sysconfig``, so
``posenc lab`` works on a fresh machine with nothing downloaded. Files are read in sorted order and hashed, and
the hash is recorded with every result: two runs on the same Python see the same bytes, and a run on another
Python says so.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import sysconfig
from pathlib import Path

import torch

from posenc._checks import integer

# Directories of installed packages (under the stdlib path on many installs, in a virtual environment inside a
# project) and of bytecode: never a corpus's own text.
_PACKAGE_DIRS = frozenset({"site-packages", "dist-packages", "__pycache__"})
# Distributions strip the standard library's test suites (Debian's libpython3-testsuite): the built-in corpus leaves
# them out too, so that it is the same across installs of one Python version.
_STDLIB_SKIPPED_DIRS = _PACKAGE_DIRS | {"test", "tests", "idle_test"}
# A directory corpus reads the files a text editor would open; binary files would be noise for a byte LM.
_TEXT_SUFFIXES = frozenset({".py", ".txt", ".md", ".rst", ".c", ".h", ".json", ".toml", ".cfg", ".ini", ".html"})
# Files are joined with a separator that cannot occur in UTF-8 text, so no window mistakes two files for one.
FILE_SEPARATOR = b"\n\x00\n"


@dataclasses.dataclass(frozen=True)
class Corpus:
    """Bytes of a corpus split once: ``train`` the first (1 - val_fraction), ``val`` the rest.

    source: where it came from (a path, or "python-stdlib"); sha256: hash of the joined bytes; files: how many
    files the bytes come from (with max_bytes, those before the cut).
    """

    source: str
    sha256: str
    files: int
    train: torch.Tensor  # (n_train,) uint8
    val: torch.Tensor  # (n_val,) uint8

    @property
    def size(self) -> int:
        return self.train.numel() + self.val.numel()


def stdlib_path() -> Path:
    """The running Python's standard-library directory."""
    return Path(sysconfig.get_paths()["stdlib"])


def corpus_files(root: Path, *, stdlib: bool = False) -> list[Path]:
    """Text files under ``root`` in sorted order (by path relative to root); ``root`` itself if it is a file.

    Installed packages are skipped (see above); stdlib: read only ``*.py`` and skip the test suites too, which some
    installs strip (a corpus of one's own keeps its test folders).
    """
    if root.is_file():
        return [root]
    suffixes = {".py"} if stdlib else _TEXT_SUFFIXES
    files = []
    for directory, subdirs, names in os.walk(root):
        # Pruned in place so os.walk never descends into site-packages (often larger than the stdlib itself), nor
        # into a lab run's folder: `posenc lab --corpus .` writes lab-runs/ inside its own corpus, whose bytes would
        # then change with every run and refuse the resume.
        skipped = _STDLIB_SKIPPED_DIRS if stdlib else _PACKAGE_DIRS
        subdirs[:] = [d for d in subdirs if d not in skipped and not is_lab_run(Path(directory, d))]
        # Suffixes in any case: a README.TXT is text too.
        files.extend(Path(directory, n) for n in names if Path(n).suffix.lower() in suffixes)
    return sorted((f for f in files if f.is_file()), key=lambda p: p.relative_to(root).as_posix())


def is_lab_run(folder: Path) -> bool:
    """Whether ``folder`` is a ``posenc lab`` output folder: its config.json names a configuration and a corpus, or
    (that file deleted) a finished unit's metrics.json names its configuration."""
    if _json_with_keys(folder / "config.json", {"config_id", "corpus_sha256"}):
        return True
    return (folder / "runs").is_dir() and any(
        _json_with_keys(metrics, {"config_id"}) for metrics in folder.glob("runs/*/seed*/metrics.json")
    )


def _json_with_keys(path: Path, keys: set[str]) -> bool:
    """Whether ``path`` holds a JSON object with ``keys``; False where it is missing, unreadable or not JSON."""
    try:
        found = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return isinstance(found, dict) and keys <= found.keys()


def load_corpus(
    path: str | Path | None = None, *, val_fraction: float = 0.1, max_bytes: int | None = None, min_bytes: int = 1
) -> Corpus:
    """Read a corpus and split it: the first (1 - val_fraction) of the bytes train, the rest validate.

    path: a text file or a directory of text files; None for the built-in CPython standard library.
    max_bytes: keep only the first ``max_bytes`` bytes (after joining; the hash covers what is kept).
    min_bytes: raise a ValueError naming the corpus if it holds fewer bytes than this.
    The validation part is one contiguous tail, so long evaluation windows never cross into training text.
    """
    if not 0.0 < val_fraction < 1.0:
        raise ValueError(f"val_fraction must be in (0, 1), got {val_fraction!r}")
    if max_bytes is not None:
        max_bytes = integer("max_bytes", max_bytes, low=1, expected="a positive integer or None")
    if path is None:
        root, source, stdlib = stdlib_path(), "python-stdlib", True
        if not root.is_dir():
            raise ValueError(f"the Python standard library was not found at {root}; pass --corpus PATH")
    else:
        root, stdlib = Path(path).expanduser(), False
        source = str(root)
        if not root.exists():
            raise ValueError(f"corpus path {str(root)!r} does not exist; pass a text file or a directory of text files")
    files = corpus_files(root, stdlib=stdlib)
    if not files:
        raise ValueError(
            f"corpus directory {source!r} holds no text files (looked for {', '.join(sorted(_TEXT_SUFFIXES))})"
        )
    data, read = _join(files, max_bytes)
    if not data:
        raise ValueError(f"corpus {source!r} is empty (0 bytes of text); pass a text file or a folder of text files")
    if len(data) < min_bytes:
        raise ValueError(
            f"corpus {source!r} holds {len(data)} bytes, but this configuration needs at least {min_bytes} "
            "(training windows plus validation windows at the longest eval length); use a larger corpus or "
            "shorter lengths / fewer eval windows"
        )
    tensor = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    split = len(data) - int(len(data) * val_fraction)
    return Corpus(
        source=source,
        sha256=hashlib.sha256(data).hexdigest(),
        files=read,
        train=tensor[:split],
        val=tensor[split:],
    )


def _join(files: list[Path], max_bytes: int | None) -> tuple[bytes, int]:
    """The files' bytes joined and cut at ``max_bytes``, and how many files that text holds, whole or cut (an empty
    file counts where it falls inside it; one whose first byte falls past the cut does not)."""
    parts, total = [], -len(FILE_SEPARATOR)  # the separators go between files, not after the last
    for f in files:
        chunk = f.read_bytes()
        parts.append(chunk)
        total += len(FILE_SEPARATOR) + len(chunk)
        if max_bytes is not None and total >= max_bytes:
            break
    data = FILE_SEPARATOR.join(parts)
    if max_bytes is None or len(data) <= max_bytes:
        return data, len(parts)
    # The cut may fall in the separator before the last file read: that file then gives no byte.
    last_start = len(data) - len(parts[-1])
    return data[:max_bytes], len(parts) - (last_start >= max_bytes)


def train_starts(data: torch.Tensor, *, seq_len: int, batch_size: int, steps: int, seed: int) -> torch.Tensor:
    """Random window starts into ``data`` (n,), the same for the same seed on every machine.

    Returns (steps, batch_size) int64; ``windows_at(data, starts[i], seq_len)`` is step i's batch.
    """
    if data.numel() < seq_len + 1:
        raise ValueError(f"training text has {data.numel()} bytes, fewer than one window of {seq_len + 1}")
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, data.numel() - seq_len, (steps, batch_size), generator=generator)


def windows_at(data: torch.Tensor, starts: torch.Tensor, length: int) -> torch.Tensor:
    """Windows of ``length + 1`` bytes starting at ``starts`` (k,). Returns (k, length + 1) int64: inputs are
    [:, :-1], next-byte targets [:, 1:]."""
    return data[starts[:, None] + torch.arange(length + 1)].long()


def eval_text_needed(*, longest: int, count: int, score_len: int) -> int:
    """Bytes of text that ``count`` windows of ``longest + 1`` need for their final ``score_len`` bytes never to
    overlap: the first window whole, then ``score_len`` more per window."""
    return longest + 1 + (count - 1) * score_len


def eval_window_ends(data: torch.Tensor, *, longest: int, count: int) -> torch.Tensor:
    """``count`` end offsets into ``data`` (n,), evenly spread, each with room for a window of ``longest + 1``.

    A window of any length L <= longest ending at the same end scores the same final bytes, so every length is
    judged on identical targets. Consecutive ends are at least floor((n - longest - 1) / (count - 1)) apart, so the
    final S bytes of the windows never overlap where n >= ``eval_text_needed(longest, count, S)``: no spread of
    ``count`` ends keeps them apart on less text. Returns (count,) int64: exclusive ends.
    """
    room = data.numel() - (longest + 1)
    if room < 0 or count > room + 1:
        raise ValueError(
            f"validation text has {data.numel()} bytes: too few for {count} windows of {longest + 1}; "
            "use a larger corpus, fewer eval windows, or shorter eval lengths"
        )
    return (longest + 1 + torch.linspace(0, room, count, dtype=torch.float64).floor()).long()


def windows_ending(data: torch.Tensor, ends: torch.Tensor, length: int) -> torch.Tensor:
    """Windows of ``length + 1`` bytes ending (exclusive) at ``ends`` (k,). Returns (k, length + 1) int64."""
    return windows_at(data, ends - (length + 1), length)
