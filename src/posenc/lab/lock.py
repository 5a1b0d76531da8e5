"""One lab run per folder at a time. Two runs of the same command into one folder would each train every unit they find
unfinished (the same numbers, twice the work), and two runs of different configurations into a new folder could both
find it unclaimed and mix their units. The lock is advisory (``flock``) on ``<out>/.lock``: the kernel drops it when
its holder ends, however it ends (Ctrl-C, SIGKILL), so no run has to clear a stale one (on NFS, where flock is a lock
of lockd's, a crashed client's lock lasts until its server's lock recovery). ``holder`` tells a reader of the folder
(``posenc report``) that a run is writing it now, without holding that run up."""

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
# How long a run waits while only shared locks are in its way: holder() probes (microseconds each; a report stopped
# with Ctrl-Z in the middle of one would hold it longer). A run holds its lock exclusively, and is refused at once.
_PROBE_WAIT_SECONDS = 10.0
# The .lock files this process's FolderLocks hold, by (device, inode), with the pid that took each and since when: how
# holder() and a refusal know this process's own lock where the file cannot say (another user's, locked read-only).
_HELD: dict[tuple[int, int], tuple[int, str]] = {}
# The lock file is read as text whatever it holds: undecodable bytes must not turn a probe or a refusal into an error.
_TEXT: dict[str, Any] = {"encoding": "utf-8", "errors": "replace"}


class FolderInUse(ValueError):
    """Another lab run holds the folder's lock."""


class FolderLock:
    """Holds ``<folder>/.lock`` from construction until ``release()`` (or until the object is collected).

    Raises FolderInUse, naming the holder (pid, host, start time and command, which it writes into the file), when
    another run holds it, this process included (a prepared Lab that has not run yet), and (saying so) where readers'
    shared locks (``holder``) keep it for over _PROBE_WAIT_SECONDS; an OSError (its filename the lock file) where the
    file cannot be opened at all."""

    def __init__(self, folder: Path, command: str = "") -> None:
        self.path = folder / ".lock"
        self._file: IO[str] | None = None
        self._pid = os.getpid()
        if fcntl is None:
            return
        # Kept for release(), which also runs from __del__ at interpreter exit, when modules may be torn down.
        self._unlock = (fcntl.flock, fcntl.LOCK_UN, os.getpid, _HELD)
        try:
            # Opened without truncation: the holder's own description must survive a refused open.
            file, writable = open(self.path, "a+", **_TEXT), True  # noqa: SIM115 (held open for the run)
        except PermissionError:
            if not self.path.is_file():
                raise
            # Another user's .lock in a folder this user may write: flock needs no write access, only the holder's
            # description is not written.
            file, writable = open(self.path, **_TEXT), False  # noqa: SIM115
        try:
            self._key = _key(file)
            _lock_exclusive(file)
        except FolderInUse as refused:
            file.seek(0)
            holder = file.read()
            file.close()
            raise FolderInUse(str(refused) or _in_use(folder, holder, self._key)) from None
        except OSError as error:
            file.close()
            if error.errno in _NO_LOCKS:
                return
            raise OSError(error.errno, error.strerror, str(self.path)) from error
        since = datetime.datetime.now().astimezone().isoformat(timespec="seconds")
        _HELD[self._key] = (self._pid, since)
        if writable:
            file.seek(0)
            file.truncate()
            file.write(
                json.dumps(
                    {
                        "pid": self._pid,
                        "host": socket.gethostname(),
                        "since": since,
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
        flock, unlock, getpid, held = self._unlock  # not the modules': this also runs from __del__ at exit
        # Unlocked, not only closed: a process forked since (a DataLoader's workers, a fork Pool) holds a copy of the
        # descriptor, and the lock lasts while any copy is open. Not in such a child, whose end must not free its
        # parent's folder.
        try:
            if getpid() == self._pid:
                held.pop(self._key, None)
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
    write, or an unreadable description)."""
    path = folder / ".lock"
    if fcntl is None or not path.is_file():  # not a FIFO either, whose open would wait for a writer
        return None
    try:
        file = open(path, **_TEXT)  # noqa: SIM115 (closed below, however the probe ends)
    except OSError:  # gone since, or another user's that this one may not read
        return None
    with file:
        try:
            # Shared and at once: a probe never waits for a run, and a starting run waits out probes (only runs
            # lock exclusively).
            fcntl.flock(file.fileno(), fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            if _held_here(_key(file)) is not None:
                return None
            who = _who(*_described(file.read()))
        except OSError:
            return None  # no locks taken here: nothing can be told
        else:
            fcntl.flock(file.fileno(), fcntl.LOCK_UN)
            return None
    return f"a posenc lab run ({who})" if who else "a posenc lab run"


def _key(file: IO[str]) -> tuple[int, int]:
    status = os.fstat(file.fileno())
    return status.st_dev, status.st_ino


def _held_here(key: tuple[int, int]) -> str | None:
    """Since when this process's own FolderLock holds the lock file ``key``; None where it does not (a forked child
    keeps its parent's record, under the parent's pid)."""
    mine = _HELD.get(key)
    return mine[1] if mine is not None and mine[0] == os.getpid() else None


def _lock_exclusive(file: IO[str]) -> None:
    """LOCK_EX without blocking. Raises FolderInUse (with an empty message: the caller names the holder) where a run
    holds the lock, or (saying so) where shared holders, holder() probes, keep it for _PROBE_WAIT_SECONDS."""
    fd = file.fileno()
    deadline = time.monotonic() + _PROBE_WAIT_SECONDS
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            pass
        try:  # who is in the way: a run (exclusive), or only probes (shared)?
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            raise FolderInUse("") from None
        fcntl.flock(fd, fcntl.LOCK_UN)
        if time.monotonic() >= deadline:
            raise FolderInUse(
                f"{file.name} has been held shared for {_PROBE_WAIT_SECONDS:g} s, by a process reading the folder "
                "(`posenc report`, `posenc plot --run`; one stopped with Ctrl-Z?); let it finish, then run again"
            )
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


def _in_use(folder: Path, holder: str, key: tuple[int, int]) -> str:
    """The refusal, naming the holder as its lock file describes it."""
    since = _held_here(key)
    if since is not None:
        return (
            f"--out {folder} is held by a Lab in this process that prepare() took it for, since {since}: run() it, "
            "call its release(), or pass another --out"
        )
    who = _who(*_described(holder))
    return (
        f"--out {folder} is in use by another posenc lab run{f' ({who})' if who else ''}; wait for it to finish (a "
        "rerun then skips the units it finished), or pass another --out"
    )
