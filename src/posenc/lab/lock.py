"""One lab run per folder at a time. Two runs of the same command into one folder would each train every unit they
find unfinished (the same numbers, twice the work), and a run in a folder that another one is adopting could read
its half-rewritten units. The lock is advisory (``flock``) on ``<out>/.lock``: the kernel drops it when its holder
ends, however it ends (Ctrl-C, SIGKILL, a crashed machine's NFS lease), so no run ever has to clear a stale one."""

from __future__ import annotations

import datetime
import errno
import json
import os
import socket
from pathlib import Path
from typing import Any

try:
    import fcntl
except ImportError:  # Windows: no flock; the lab runs unlocked there, as before the lock existed
    fcntl = None  # type: ignore[assignment]

# Filesystems that take no locks (some FUSE mounts, NFS without lockd): the run goes on unlocked rather than fail.
_NO_LOCKS = {errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL}


class FolderInUse(ValueError):
    """Another lab run holds the folder's lock."""


class FolderLock:
    """Holds ``<folder>/.lock`` from construction until ``release()`` (or until the object is collected).

    Raises FolderInUse, naming the holder (pid, host, start time and command, which it writes into the file), when
    another run holds it, this process included (a prepared Lab that has not run yet)."""

    def __init__(self, folder: Path, command: str = "") -> None:
        self.path = folder / ".lock"
        self._file = None
        if fcntl is None:
            return
        # Opened without truncation: the holder's own description must survive a refused open.
        file = open(self.path, "a+", encoding="utf-8")  # noqa: SIM115 (held open for the run)
        try:
            fcntl.flock(file.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            file.seek(0)
            holder = file.read()
            file.close()
            raise FolderInUse(_in_use(folder, holder)) from None
        except OSError as error:
            file.close()
            if error.errno in _NO_LOCKS:
                return
            raise
        file.seek(0)
        file.truncate()
        file.write(
            json.dumps(
                {
                    "pid": os.getpid(),
                    "host": socket.gethostname(),
                    "since": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
                    "command": command,
                }
            )
            + "\n"
        )
        file.flush()
        self._file = file

    @property
    def held(self) -> bool:
        """False where the platform or filesystem takes no locks."""
        return self._file is not None

    def release(self) -> None:
        """Let the next run in. The file stays: removing it would let a waiting run lock a file nobody else sees."""
        file, self._file = self._file, None
        if file is not None:
            # Builtins only: this also runs from __del__ at interpreter exit, when modules may be torn down.
            try:  # noqa: SIM105 (contextlib may be gone at exit)
                file.close()  # closing drops the flock
            except OSError:
                pass

    def __del__(self) -> None:
        self.release()


def _in_use(folder: Path, holder: str) -> str:
    """The refusal, naming the holder as its lock file describes it."""
    try:
        info: Any = json.loads(holder)
        pid, host, since, command = info["pid"], info["host"], info["since"], info["command"]
    except (ValueError, TypeError, KeyError):
        pid = host = since = command = None  # between its flock and its write
    if pid == os.getpid() and host == socket.gethostname():
        return (
            f"--out {folder} is held by a Lab in this process that prepare() took it for, since {since}: run() it, "
            "call its release(), or pass another --out"
        )
    who = "" if pid is None else f" (pid {pid} on {host}, since {since}{': ' + command if command else ''})"
    return (
        f"--out {folder} is in use by another posenc lab run{who}; wait for it to finish (a rerun then skips the "
        "units it finished), or pass another --out"
    )
