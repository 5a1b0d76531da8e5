"""One run per folder: a second run into a folder in use is refused, naming the holder, and the lock goes with the
run, however the run ends."""

from __future__ import annotations

import errno
import json
import os
import socket
import subprocess
import sys
import threading

import pytest

from posenc.lab import lock, runner
from posenc.lab.lock import FolderInUse, FolderLock
from posenc.lab.runner import Lab

pytestmark = pytest.mark.skipif(lock.fcntl is None, reason="flock is POSIX; elsewhere the lab runs unlocked")


def quiet(config, out):
    # figures=False: the report's analysis figures are most of a tiny run's time and nothing here looks at them.
    return Lab(config, out, progress=False, echo=lambda line: None, figures=False)


@pytest.fixture
def other_process(tmp_path, hold_folder):
    """Another process that holds tmp_path / "out"'s lock until killed."""
    out = tmp_path / "out"
    out.mkdir()
    return hold_folder(out), out


def test_a_folder_in_use_by_another_process_is_refused_naming_it(other_process, tiny_config, capsys, monkeypatch):
    proc, out = other_process
    monkeypatch.setattr(lock, "_PROBE_WAIT_SECONDS", 60.0)  # a run's lock is refused at once, not waited on as a probe
    config = tiny_config()
    overrides = {k: getattr(config, k) for k in ("corpus", "dim", "layers", "heads", "train_len", "steps")}
    status = runner.run_command(preset="quick", out=out, overrides=overrides, progress=False)
    assert status == 2
    error = capsys.readouterr().err
    assert f"--out {out} is in use by another posenc lab run (pid {proc.pid} on " in error
    assert "posenc lab --preset quick --out elsewhere" in error and "pass another --out" in error
    assert sorted(p.name for p in out.iterdir()) == [".lock"]  # nothing read or written before the refusal


def test_a_killed_holder_leaves_no_stale_lock(other_process, tiny_config):
    proc, out = other_process
    with pytest.raises(FolderInUse):
        quiet(tiny_config(), out).prepare()
    proc.kill()  # SIGKILL: no handler, no cleanup; the kernel drops the flock with the process
    proc.wait()
    lab = quiet(tiny_config(), out)
    lab.prepare()
    held = json.loads((out / ".lock").read_text())
    assert held["pid"] == os.getpid()
    lab.release()


def test_a_prepared_lab_holds_the_folder_until_it_runs_or_releases(tiny_config, tmp_path):
    out = tmp_path / "out"
    first = quiet(tiny_config(encodings=("nope",), extensions=()), out)
    first.prepare()
    first.prepare()  # again: it does not meet its own lock
    with pytest.raises(FolderInUse, match=r"held by a Lab in this process .* call its release\(\)"):
        quiet(tiny_config(encodings=("nope",), extensions=()), out).prepare()
    first.run()  # gives the lock up when it ends
    second = quiet(tiny_config(encodings=("nope",), extensions=()), out)
    second.prepare()
    second.release()
    holder = FolderLock(out)
    with pytest.raises(FolderInUse):
        second.run()  # released, so run() prepares again and meets the holder, rather than run unlocked
    holder.release()
    quiet(tiny_config(encodings=("nope",), extensions=()), out).run()
    first.run()  # a second run() of one Lab takes the lock again (all units done: nothing trains)


def test_the_lock_goes_with_a_run_that_is_interrupted_or_refused(tiny_config, tmp_path, monkeypatch):
    out = tmp_path / "out"

    def interrupt(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(runner, "train", interrupt)
    interrupted = quiet(tiny_config(encodings=("nope",), extensions=()), out)
    with pytest.raises(KeyboardInterrupt):
        interrupted.run()
    # Progress of the interrupted configuration (a folder of nothing but config.json and .lock is taken by another).
    (out / "runs" / "nope").mkdir(parents=True)
    (out / "runs" / "nope" / "checkpoint.safetensors").write_bytes(b"steps of the interrupted run")
    refused = quiet(tiny_config(encodings=("nope",), extensions=(), dim=8), out)
    with pytest.raises(ValueError, match="different configuration"):
        refused.prepare()
    FolderLock(out).release()  # free, though both Labs are still alive (their __del__ has not released it)
    assert interrupted is not refused


def test_filesystems_without_locks_run_unlocked(tmp_path, monkeypatch):
    def no_locks(fd, operation):
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(lock.fcntl, "flock", no_locks)
    held = FolderLock(tmp_path)
    assert not held.held
    held.release()


def test_release_frees_the_folder_though_a_forked_child_holds_the_descriptor(tmp_path):
    """A DataLoader's workers or a fork Pool, made while a Lab holds its folder, hold a copy of the descriptor."""
    held = FolderLock(tmp_path)
    child_says, child_hears = os.pipe(), os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            os.read(child_hears[0], 1)  # parent released: now end this child's copy as its own end would
            held.release()
            os.write(child_says[1], b"x")
            os.read(child_hears[0], 1)
        finally:
            os._exit(0)
    try:
        held.release()  # the child still holds a copy of the descriptor
        again = FolderLock(tmp_path)  # was FolderInUse until the child ended
        os.write(child_hears[1], b"x")
        assert os.read(child_says[0], 1) == b"x"  # the child's release (not its own lock) left this one held
        with pytest.raises(FolderInUse):
            FolderLock(tmp_path)
        again.release()
    finally:
        os.write(child_hears[1], b"xx")  # enough for both of its reads, however far the test got
        os.waitpid(pid, 0)


def test_a_lock_file_of_another_user_is_locked_read_only(tmp_path, monkeypatch):
    ended = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    description = {"pid": int(ended.stdout), "host": socket.gethostname(), "since": "s", "command": "theirs"}
    (tmp_path / ".lock").write_text(json.dumps(description))

    def not_for_writing(path, mode="r", **kwargs):
        if mode != "r":
            raise PermissionError(errno.EACCES, "Permission denied", str(path))
        return open(path, mode, **kwargs)

    monkeypatch.setattr(lock, "open", not_for_writing, raising=False)
    held = FolderLock(tmp_path, "mine")
    assert held.held and "mine" not in (tmp_path / ".lock").read_text()
    assert lock.holder(tmp_path) is None  # this process's, though the file names an ended run: no note on its report
    with pytest.raises(FolderInUse, match=r"held by a Lab in this process") as refused:
        FolderLock(tmp_path)  # the lock is real and known as this process's; the description, an ended run's, unshown
    assert "theirs" not in str(refused.value)
    held.release()
    (tmp_path / ".lock").unlink()
    with pytest.raises(PermissionError):  # no file to fall back to: the folder's own error
        FolderLock(tmp_path)


@pytest.mark.parametrize("case", ["directory", "io error"])
def test_a_lock_that_cannot_be_taken_names_the_file(tiny_config, tmp_path, monkeypatch, case):
    out = tmp_path / "out"
    if case == "directory":
        (out / ".lock").mkdir(parents=True)
        why = "Is a directory"
    else:

        def io_error(fd, operation):
            raise OSError(errno.EIO, "Input/output error")

        monkeypatch.setattr(lock.fcntl, "flock", io_error)  # not a filesystem without locks: not run unlocked
        why = "Input/output error"
    with pytest.raises(ValueError, match=f"cannot be made the run folder: {out / '.lock'}: {why}"):
        quiet(tiny_config(), out).prepare()


def test_holder_names_another_run_and_not_this_process(other_process, tmp_path):
    proc, out = other_process
    named = lock.holder(out)
    assert named.startswith(f"a posenc lab run (pid {proc.pid} on {socket.gethostname()}, since ")
    assert named.endswith(": posenc lab --preset quick --out elsewhere)")
    (out / ".lock").write_text("")  # as between the holder's flock and its write: held, but by nobody named
    assert lock.holder(out) == "a posenc lab run"
    proc.kill()
    proc.wait()
    assert lock.holder(out) is None  # the file stays; nobody holds it
    own = FolderLock(out)
    assert lock.holder(out) is None  # this process's own run, which writes its own report: not "another run"
    own.release()
    assert lock.holder(tmp_path / "never made") is None


def test_a_run_that_starts_during_a_probe_waits_it_out(tmp_path, monkeypatch):
    """holder() takes a shared lock for microseconds; a run starting in that moment must not be turned away."""
    monkeypatch.setattr(lock, "_PROBE_WAIT_SECONDS", 30.0)  # the probe here lasts 50 ms: no race with a loaded machine
    (tmp_path / ".lock").touch()
    with open(tmp_path / ".lock") as probe:
        lock.fcntl.flock(probe.fileno(), lock.fcntl.LOCK_SH | lock.fcntl.LOCK_NB)
        threading.Timer(0.05, lock.fcntl.flock, (probe.fileno(), lock.fcntl.LOCK_UN)).start()
        held = FolderLock(tmp_path)  # was FolderInUse at once
        assert held.held
    held.release()


def test_a_probe_leaves_the_folder_free_and_sees_other_probes_as_none(tmp_path, monkeypatch):
    monkeypatch.setattr(lock, "_PROBE_WAIT_SECONDS", 0.0)  # a run waits for no probe here
    (tmp_path / ".lock").touch()
    assert lock.holder(tmp_path) is None
    FolderLock(tmp_path).release()  # the probe took nothing with it
    with open(tmp_path / ".lock") as other_probe:
        lock.fcntl.flock(other_probe.fileno(), lock.fcntl.LOCK_SH | lock.fcntl.LOCK_NB)
        assert lock.holder(tmp_path) is None  # two probes at once: neither is a run
        with pytest.raises(FolderInUse, match=r"\.lock has been held shared for 0 s, by a process reading the folder"):
            FolderLock(tmp_path)  # a probe that lasts: the refusal says what holds it, not "another posenc lab run"


def test_holder_of_odd_lock_files(other_process, tmp_path):
    _, out = other_process
    (out / ".lock").write_bytes(b"\xff{")  # undecodable: still a run, unnamed, not an error
    assert lock.holder(out) == "a posenc lab run"
    with pytest.raises(FolderInUse, match="in use by another posenc lab run; wait"):
        FolderLock(out)
    fifo = tmp_path / "fifo"
    fifo.mkdir()
    os.mkfifo(fifo / ".lock")
    assert lock.holder(fifo) is None  # without waiting for a writer
