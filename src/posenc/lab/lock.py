"""One lab run per folder at a time. Two runs of the same command into one folder would each train every unit they
find unfinished (the same numbers, twice the work), and a run in a folder that another one is adopting could read
its half-rewritten units. The lock is advisory (``flock``) on ``<out>/.lock``: the kernel drops it when its holder
ends, however it ends (Ctrl-C, SIGKILL), so no run has to clear a stale one (on NFS, where flock is a lock of lockd's,
a crashed client's lock lasts until its server's lock recovery). ``holder`` tells a reader of the folder (``posenc
report``) that a run is writing it now, without holding that run up."""

from __future__ import annotations

import datetime
import errno
import json
import os
import socket
import time
from pathlib import Path
from typing import IO, Any

from posenc._atomic import _alive

try:
    import fcntl
except ImportError:  # Windows: no flock; the lab runs unlocked there, as before the lock existed
    fcntl = None  # type: ignore[assignment]

# Filesystems that take no locks (some FUSE mounts, NFS without lockd; EBADF: NFS's emulated flock on a file opened
# read-only): the run goes on unlocked rather than fail.
_NO_LOCKS = {errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL, errno.EBADF}
# How long a run waits for the lock before it is refused: long enough to outlast a holder() probe (microseconds), so
# that a run which starts while a report looks at its folder is not turned away; short against any real run.
_WAIT_SECONDS = 0.25


class FolderInUse(ValueError):
    """Another lab run holds the folder's lock."""


class FolderLock:
    """Holds ``<folder>/.lock`` from construction until ``release()`` (or until the object is collected).

    Raises FolderInUse, naming the holder (pid, host, start time and command, which it writes into the file), when
    another run holds it, this process included (a prepared Lab that has not run yet); an OSError (its filename the
    lock file) where the file cannot be opened at all."""

    def __init__(self, folder: Path, command: str = "") -> None:
        self.path = folder / ".lock"
        self._file: IO[str] | None = None
        self._pid = os.getpid()
        if fcntl is None:
            return
        # Kept for release(), which also runs from __del__ at interpreter exit, when modules may be torn down.
        self._unlock = (fcntl.flock, fcntl.LOCK_UN, os.getpid)
        try:
            # Opened without truncation: the holder's own description must survive a refused open.
            file, writable = open(self.path, "a+", encoding="utf-8"), True  # noqa: SIM115 (held open for the run)
        except PermissionError:
            if not self.path.is_file():
                raise
            # Another user's .lock in a folder this user may write: flock needs no write access, only the holder's
            # description is not written.
            file, writable = open(self.path, encoding="utf-8"), False  # noqa: SIM115
        try:
            _lock_exclusive(file.fileno())
        except BlockingIOError:
            file.seek(0)
            holder = file.read()
            file.close()
            raise FolderInUse(_in_use(folder, holder)) from None
        except OSError as error:
            file.close()
            if error.errno in _NO_LOCKS:
                return
            raise OSError(error.errno, error.strerror, str(self.path)) from error
        if writable:
            file.seek(0)
            file.truncate()
            file.write(
                json.dumps(
                    {
                        "pid": self._pid,
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
        if file is None:
            return
        flock, unlock, getpid = self._unlock  # not the modules': this also runs from __del__ at interpreter exit
        # Unlocked, not only closed: a process forked since (a DataLoader's workers, a fork Pool) holds a copy of the
        # descriptor, and the lock lasts while any copy is open. Not in such a child, whose end must not free its
        # parent's folder.
        try:
            if getpid() == self._pid:
                flock(file.fileno(), unlock)
        except OSError:
            pass  # the close below drops it too, where no child holds a copy
        finally:
            file.close()

    def __del__(self) -> None:
        self.release()


def holder(folder: Path) -> str | None:
    """Who is running in ``folder`` now, for readers that must not take it for a finished or stopped run (``posenc
    report``, ``posenc plot --run``). None where no other lab run holds its lock: none does, the holder is this
    process (a run writing its own report), or the platform or filesystem takes no locks. Else the holder as its
    lock file describes it, e.g. ``"a posenc lab run (pid 42 on vm, since 2026-12-04T09:06:18+00:00: posenc lab
    --preset quick --out runs)"``, or ``"a posenc lab run"`` where it cannot say (between the holder's flock and its
    write)."""
    if fcntl is None:
        return None
    try:
        file = open(folder / ".lock", encoding="utf-8")  # noqa: SIM115 (closed below, however the probe ends)
    except OSError:  # no lock file (no run has taken the folder) or none this user may read
        return None
    with file:
        try:
            # Shared and at once: a probe never waits for a run, and never holds one up (FolderLock waits it out).
            fcntl.flock(file.fileno(), fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            pid, host, since, command = _described(file.read())
        except OSError:
            return None  # no locks taken here: nothing can be told
        else:
            fcntl.flock(file.fileno(), fcntl.LOCK_UN)
            return None
    if pid == os.getpid() and host == socket.gethostname():
        return None
    who = _who(pid, host, since, command)
    return f"a posenc lab run ({who})" if who else "a posenc lab run"


def _lock_exclusive(fd: int) -> None:
    """LOCK_EX without blocking, tried again for _WAIT_SECONDS; raises BlockingIOError if it is still held then."""
    deadline = time.monotonic() + _WAIT_SECONDS
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            if time.monotonic() >= deadline:
                raise
            time.sleep(0.01)


def _described(text: str) -> tuple[int | None, str | None, str | None, str | None]:
    """(pid, host, since, command) from the text of a held lock file; pid None where it names no live process: the
    holder has not written its own description yet, or cannot (another user's file, locked read-only)."""
    try:
        info: Any = json.loads(text)
        pid, host, since, command = info["pid"], info["host"], info["since"], info["command"]
    except (ValueError, TypeError, KeyError):
        return None, None, None, None  # between its flock and its write
    if host == socket.gethostname() and not (isinstance(pid, int) and _alive(pid)):  # this process stays named
        pid = None
    return pid, host, since, command


def _who(pid: int | None, host: str | None, since: str | None, command: str | None) -> str:
    return "" if pid is None else f"pid {pid} on {host}, since {since}{': ' + command if command else ''}"


def _in_use(folder: Path, holder: str) -> str:
    """The refusal, naming the holder as its lock file describes it."""
    pid, host, since, command = _described(holder)
    if pid == os.getpid() and host == socket.gethostname():
        return (
            f"--out {folder} is held by a Lab in this process that prepare() took it for, since {since}: run() it, "
            "call its release(), or pass another --out"
        )
    who = _who(pid, host, since, command)
    return (
        f"--out {folder} is in use by another posenc lab run{f' ({who})' if who else ''}; wait for it to finish (a "
        "rerun then skips the units it finished), or pass another --out"
    )
