"""Atomic files: every write goes to a temporary file in the same folder and is renamed over the target with
``os.replace``, which is atomic on POSIX and Windows. A reader therefore sees the old file, the new file, or no
file, never half of one; a killed writer leaves at most a ``*.tmp`` file, which readers ignore and
``remove_stale_temporaries`` deletes. The data is flushed to disk before the rename and the rename after it, so that
a power loss, too, leaves the old file or the new one (without the flush, ext4 and XFS may keep a renamed file whose
blocks were never written: empty, where a finished result was). Used by the lab's results and checkpoints, and by
the figures and the report."""

from __future__ import annotations

import contextlib
import errno
import hashlib
import os
import re
import shutil
import socket
import uuid
from collections.abc import Iterator
from pathlib import Path


@contextlib.contextmanager
def atomic_path(path: Path, *, own_folder: bool = False) -> Iterator[Path]:
    """Yields a temporary path beside ``path``; on success it replaces ``path``, on any error it is removed.

    own_folder: the temporary file lies in a temporary folder of its own, for writers that make temporaries of
    their own beside the file they are given (safetensors writes ``.tmpXXXXXX`` and renames it): a killed writer
    then leaves one folder that ``remove_stale_temporaries`` recognizes, not a file with a name nobody owns."""
    path.parent.mkdir(parents=True, exist_ok=True)
    # A fresh name; the host and process in it let remove_stale_temporaries tell a dead writer's file from a live
    # one's.
    name = path.parent / f".{path.name}.{_HOST}-{os.getpid()}.{uuid.uuid4().hex[:12]}.tmp"
    _WRITING.add(name.resolve())
    made = False  # a name that is another writer's (exclusive creation failed) is left to it
    try:
        if own_folder:
            name.mkdir()
            made = True
        tmp = name / path.name if own_folder else name
        # Made here as open() makes a file (0666 less the umask), so that its mode can be given back to it after a
        # writer that creates its files 0600 (safetensors does, as mkstemp would): the rename keeps the mode.
        # Exclusive: two writers handed one name must not write one file.
        os.close(os.open(tmp, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o666))
        made = True
        mode = os.stat(tmp).st_mode & 0o777
        yield Path(tmp)
        os.chmod(tmp, mode)
        _flush(tmp)
        os.replace(tmp, path)
        _flush(path.parent, folder=True)
    except BaseException:
        # BaseException: a Ctrl-C in the middle of a write must not leave the temporary file behind either.
        if made:
            _remove(name)
        raise
    else:
        _remove(name)
    finally:
        if made:  # else the name is another writer's, still writing
            _WRITING.discard(name.resolve())


def _remove(path: Path) -> None:
    """Delete a temporary file, or a temporary folder with what its writer left in it."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)


def _flush(path: Path, *, folder: bool = False) -> None:
    """fsync a file's data (opened for writing: Windows flushes only such handles), or a folder's entries, which
    only POSIX can open. Filesystems that cannot sync (EINVAL, ENOTSUP on some FUSE and network mounts) are let be:
    the write itself has happened."""
    try:
        descriptor = os.open(path, os.O_RDONLY if folder else os.O_RDWR)
    except OSError:
        if folder:
            return
        raise
    try:
        os.fsync(descriptor)
    except OSError as error:
        if error.errno not in (errno.EINVAL, errno.ENOTSUP, errno.EBADF):
            raise
    finally:
        os.close(descriptor)


# This machine, in temporary names: a process id means something only on the machine that gave it out.
_HOST = hashlib.sha256(socket.gethostname().encode()).hexdigest()[:8]
_TEMPORARY = re.compile(r"\..+\.([0-9a-f]{8})-(\d+)\.[0-9a-f]{12}\.tmp")
# The temporaries this process is writing now.
_WRITING: set[Path] = set()


def remove_stale_temporaries(folder: Path) -> list[Path]:
    """Delete the temporary files (and folders) that ``atomic_path`` writers killed by SIGKILL (or power loss) left
    in ``folder`` and below, and return them. Readers never see them, but they pile up across resumes, a weights
    file each at larger presets. Left alone: those being written now, by this process or by another one alive on
    this machine, and those of other machines (a shared folder), whose writers cannot be asked."""
    removed = []
    # os.walk, not rglob: it does not descend into the temporary folders, and a folder that another writer removes
    # while the walk passes is skipped rather than an error.
    for root, folders, files in os.walk(folder):
        for name in (*folders, *files):
            path = Path(root) / name
            match = _TEMPORARY.fullmatch(name)
            if match is None or match[1] != _HOST or path.is_symlink() or path.resolve() in _WRITING:
                continue
            pid = int(match[2])
            if pid != os.getpid() and _alive(pid):  # this process's id on a file it is not writing: its past self's
                continue
            if path.exists():
                _remove(path)
                removed.append(path)
        folders[:] = [name for name in folders if _TEMPORARY.fullmatch(name) is None]
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # it exists, under another user
        return True
    return True
