"""Atomic writes: a failed or interrupted write leaves the old file and no temporary file."""

from __future__ import annotations

import os
import uuid
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from torch import nn

from posenc import _atomic
from posenc.lab import store
from posenc.lab.model import ByteLM, ModelSpec


@pytest.mark.parametrize("error", [RuntimeError, KeyboardInterrupt])
def test_a_failed_write_keeps_the_old_file_and_leaves_no_temporary(tmp_path, error):
    path = tmp_path / "metrics.json"
    store.write_json(path, {"done": 1})
    with pytest.raises(error), _atomic.atomic_path(path) as tmp:
        tmp.write_text('{"done": ')  # half written
        raise error()
    assert store.read_json(path) == {"done": 1}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["metrics.json"]


@pytest.mark.parametrize("own_folder", [False, True])
def test_a_temporary_name_that_exists_is_refused_and_left_to_its_writer(tmp_path, monkeypatch, own_folder):
    """Two writers handed one temporary name must not share one file: the second is refused, and the first's file
    is not removed under it."""
    fixed = uuid.UUID(int=7)
    monkeypatch.setattr(_atomic.uuid, "uuid4", lambda: fixed)
    path = tmp_path / "metrics.json"
    with _atomic.atomic_path(path, own_folder=own_folder) as first:
        first.write_text("first")
        with pytest.raises(FileExistsError), _atomic.atomic_path(path, own_folder=own_folder) as second:
            second.write_text("second")
        assert first.read_text() == "first"
        _atomic.remove_stale_temporaries(tmp_path)  # still the first writer's: kept
        assert first.read_text() == "first"
    assert path.read_text() == "first"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["metrics.json"]


def _interrupted_halfway(real):
    def write(self, data, *args, **kwargs):
        real(self, data[: len(data) // 2], *args, **kwargs)
        raise KeyboardInterrupt

    return write


@pytest.mark.parametrize("writer", ["text", "bytes", "json", "weights"])
def test_every_store_writer_goes_through_a_temporary(tmp_path, monkeypatch, writer):
    """A writer interrupted after half its bytes hit the disk: the old file is whole and no temporary is left (a
    writer that wrote its target directly would leave it half written)."""
    path = tmp_path / "target"
    path.write_bytes(b"old")
    if writer == "weights":  # safetensors writes the file itself
        real = store.save_file

        def half_saved(tensors, filename, **kwargs):
            real(tensors, filename, **kwargs)
            Path(filename).write_bytes(b"half")
            raise KeyboardInterrupt

        monkeypatch.setattr(store, "save_file", half_saved)
        model = ByteLM(ModelSpec(dim=8, layers=1, heads=2, max_positions=4, mlp_ratio=1), "nope")
        write = lambda: store.save_weights(model, path)  # noqa: E731
    else:
        method = "write_bytes" if writer == "bytes" else "write_text"
        monkeypatch.setattr(Path, method, _interrupted_halfway(getattr(Path, method)))
        write = {
            "text": lambda: store.write_text(path, "new text"),
            "bytes": lambda: store.write_bytes(path, b"new bytes"),
            "json": lambda: store.write_json(path, {"new": 1}),
        }[writer]
    with pytest.raises(KeyboardInterrupt):
        write()
    monkeypatch.undo()
    assert path.read_bytes() == b"old"
    assert [p.name for p in tmp_path.iterdir()] == ["target"]


def test_writes_create_folders_and_replace(tmp_path):
    path = tmp_path / "a" / "b" / "report.md"
    store.write_text(path, "one")
    store.write_text(path, "two")
    store.write_bytes(tmp_path / "x.bin", b"\x00\x01")
    assert path.read_text() == "two" and (tmp_path / "x.bin").read_bytes() == b"\x00\x01"
    assert not list(tmp_path.rglob("*.tmp"))
    store.save_weights(nn.Linear(2, 2), tmp_path / "m.safetensors")  # safetensors creates its file 0600
    umask = os.umask(0)
    os.umask(umask)
    for written in (path, tmp_path / "x.bin", tmp_path / "m.safetensors"):
        assert written.stat().st_mode & 0o777 == 0o666 & ~umask, written  # readable like any file the user writes


@pytest.mark.parametrize("encoding", ["t5", "learned", "rope"])
def test_weights_round_trip_with_the_shared_encoding(tmp_path, encoding):
    spec = ModelSpec(dim=16, layers=2, heads=2, max_positions=8)
    torch.manual_seed(0)
    model = ByteLM(spec, encoding)
    store.save_weights(model, tmp_path / "model.safetensors", metadata={"encoding": encoding})
    torch.manual_seed(1)
    other = ByteLM(spec, encoding)
    store.load_weights(other, tmp_path / "model.safetensors")
    for (name, a), b in zip(model.state_dict().items(), other.state_dict().values(), strict=True):
        assert torch.equal(a, b), name
    # The shared table is still one tensor after loading, not one copy per layer.
    if encoding == "t5":
        assert other.blocks[0].attn.encoding.table.weight is other.encoding.table.weight


def test_the_same_weights_give_the_same_bytes_with_a_table_shared_by_the_layers(tmp_path):
    """save_model named every other holder of T5's shared table in the metadata, whose keys safetensors writes in a
    random order: the same weights gave files that differed in their header, from one save to the next."""
    torch.manual_seed(0)
    model = ByteLM(ModelSpec(dim=16, layers=3, heads=2, max_positions=8), "t5")
    written = set()
    for _ in range(12):
        store.save_weights(model, tmp_path / "model.safetensors", metadata={"unit": "t5"})
        written.add((tmp_path / "model.safetensors").read_bytes())
    assert len(written) == 1
    # Stored once, under the name save_model kept (files written before load the same way); the bucket settings
    # are a new tensor under each holder's name, three ints each.
    assert sorted(load_file(tmp_path / "model.safetensors")) == sorted(
        name
        for name in model.state_dict()
        if "encoding" not in name or name.startswith("blocks.0.") or name.endswith("._extra_state")
    )


@pytest.mark.parametrize(("umask", "mode"), [(0o077, 0o600), (0o002, 0o664)])
def test_files_take_the_umask_in_force_when_written(tmp_path, umask, mode):
    # 0o002 (a shared group's umask) tells 0o666 less the umask from a fixed 0o644, which 0o077 and 0o022 cannot.
    before = os.umask(umask)
    try:
        store.write_text(tmp_path / "private.md", "x")
        store.save_weights(nn.Linear(2, 2), tmp_path / "private.safetensors")
    finally:
        os.umask(before)
    for written in ("private.md", "private.safetensors"):
        assert (tmp_path / written).stat().st_mode & 0o777 == mode


@pytest.mark.parametrize("cut", [4, 60, -100])
def test_a_weights_file_cut_short_is_named_with_the_fix(tmp_path, cut):
    path = tmp_path / "model.safetensors"
    store.save_weights(nn.Linear(64, 64), path)
    path.write_bytes(path.read_bytes()[:cut])
    with pytest.raises(store.RunFolderError, match=f"{path} is not a whole safetensors file .* delete it"):
        store.load_weights(nn.Linear(64, 64), path)


@pytest.mark.parametrize(
    "text", ['{"config_id": "ab', "\udcff", "[1, 2]", "null"], ids=["cut", "not-utf8", "a list", "null"]
)
def test_a_json_file_cut_short_is_named_with_the_fix(tmp_path, text):
    path = tmp_path / "metrics.json"
    path.write_bytes(text.encode("utf-8", "surrogateescape"))
    with pytest.raises(store.RunFolderError, match=f"{path} is not the JSON the lab writes .* delete it"):
        store.read_json(path)


def test_loading_into_another_shape_fails(tmp_path):
    spec = ModelSpec(dim=16, layers=1, heads=2, max_positions=8)
    store.save_weights(ByteLM(spec, "rope"), tmp_path / "m.safetensors")
    with pytest.raises(RuntimeError):
        store.load_weights(ByteLM(spec, "learned"), tmp_path / "m.safetensors")


def test_weights_saved_while_the_layers_held_input_encodings_still_load():
    """A learned ByteLM saved at 5579f1a (seed 0), when every layer held the model's encoding and save_model kept
    the table under the first layer's name: a run interrupted then resumes after an upgrade."""
    path = Path(__file__).parents[1] / "fixtures" / "lab_learned_v0.safetensors"
    model = ByteLM(ModelSpec(dim=8, layers=2, heads=2, max_positions=4, mlp_ratio=1), "learned")
    store.load_weights(model, path)
    saved = load_file(str(path))
    assert "blocks.0.attn.encoding.table.weight" in saved and "encoding.table.weight" not in saved
    state = model.state_dict()
    assert torch.equal(state.pop("encoding.table.weight"), saved.pop("blocks.0.attn.encoding.table.weight"))
    assert state.keys() == saved.keys()
    for name, value in state.items():
        assert torch.equal(value, saved[name]), name


def test_t5_weights_saved_before_the_bucket_settings_still_load():
    """A t5 ByteLM saved at e659a41 (seed 0), before T5Bias saved its bucket settings: the one bias is shared by
    every layer, and a buffer for them would have been one tensor under three names, which safetensors' load_model
    refuses in a file that has none of them. A run interrupted then resumes after an upgrade."""
    path = Path(__file__).parents[1] / "fixtures" / "lab_t5_v0.safetensors"
    spec = ModelSpec(dim=8, layers=2, heads=2, max_positions=4, mlp_ratio=1)
    saved = load_file(str(path))
    assert not any(key.endswith("_extra_state") for key in saved)
    model = ByteLM(spec, "t5")
    store.load_weights(model, path)
    assert torch.equal(model.encoding.table.weight, saved["blocks.0.attn.encoding.table.weight"])
    assert model.blocks[1].attn.encoding.table.weight is model.encoding.table.weight
    torch.manual_seed(0)
    assert all(torch.equal(a, b) for a, b in zip(ByteLM(spec, "t5").parameters(), model.parameters(), strict=True))


def test_t5_weights_of_other_bucket_settings_are_refused(tmp_path):
    spec = ModelSpec(dim=8, layers=2, heads=2, max_positions=64, mlp_ratio=1)
    store.save_weights(ByteLM(spec, "t5"), tmp_path / "m.safetensors")
    store.load_weights(ByteLM(spec, "t5"), tmp_path / "m.safetensors")
    # The same table shape, (32, h), reaching 128 instead of 64.
    other = ByteLM(spec, "t5", {"max_distance": 128})
    with pytest.raises(RuntimeError, match=r"saved with num_buckets=32, max_distance=64, .* has .*max_distance=128"):
        store.load_weights(other, tmp_path / "m.safetensors")


@pytest.mark.parametrize("change", ["both names", "a weight missing"])
def test_an_old_weights_file_that_does_not_fit_is_refused(change, tmp_path):
    """The rename path loads strictly too: a file holding both the old and the new name of the table, or lacking a
    layer's weight, does not load."""
    from safetensors.torch import save_file

    saved = load_file(str(Path(__file__).parents[1] / "fixtures" / "lab_learned_v0.safetensors"))
    if change == "both names":
        saved["encoding.table.weight"] = torch.zeros_like(saved["blocks.0.attn.encoding.table.weight"])
    else:
        saved.pop(next(key for key in saved if key.startswith("blocks.1.")))
    save_file(saved, str(tmp_path / "w.safetensors"))
    with pytest.raises(RuntimeError):
        store.load_weights(ByteLM(ModelSpec(dim=8, layers=2, heads=2, max_positions=4, mlp_ratio=1), "learned"),
                           tmp_path / "w.safetensors")  # fmt: skip


def test_temporaries_of_killed_writers_are_removed_and_live_ones_kept(tmp_path):
    """A SIGKILL between a write and its rename leaves .NAME.HOST-PID.ID.tmp behind; the next run removes it,
    also where the new run got the dead one's process id (PID 1 in a container), and keeps what is being written
    and what other machines wrote (a shared folder: their processes cannot be asked)."""
    import subprocess
    import sys

    dead = int(subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True).stdout)
    host = _atomic._HOST
    stale = [
        tmp_path / f".config.json.{host}-{dead}.0123456789ab.tmp",
        tmp_path / "runs" / f".model.safetensors.{host}-{dead}.abcdef012345.tmp",
        tmp_path / f".train.json.{host}-{os.getpid()}.0123456789ab.tmp",  # this id, not written now: a past run's
    ]
    other_host = "0" * 8 if host != "0" * 8 else "1" * 8
    kept = [
        tmp_path / f".m.json.{other_host}-{dead}.0123456789ab.tmp",
        tmp_path / ".notes.tmp",
        tmp_path / f".m.json.{host}-{dead}.0123456789ab.tmp.bak",  # the whole name must be a temporary's
    ]
    for path in (*stale, *kept):
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("partial")
    with _atomic.atomic_path(tmp_path / "metrics.json") as writing:
        writing.write_text("{}")
        assert sorted(store.remove_stale_temporaries(tmp_path)) == sorted(stale)
        assert writing.exists() and all(p.exists() for p in kept) and not any(p.exists() for p in stale)
    assert (tmp_path / "metrics.json").read_text() == "{}"


def test_a_weights_save_killed_inside_safetensors_leaves_nothing_the_next_run_keeps(tmp_path):
    """safetensors writes its own .tmpXXXXXX beside the file it is given and renames it; a SIGKILL there left that
    file (a weights file's size, mode 0600) under a name remove_stale_temporaries did not know, after every resume.
    The save now happens in a temporary folder of the lab's own naming, removed whole."""
    import subprocess
    import sys

    child = f"""
import os, signal, torch
import posenc.lab.store as store
def killed_inside(tensors, filename, metadata=None):  # as safetensors: its temporary beside the target, then a kill
    open(os.path.join(os.path.dirname(filename), ".tmpAbC123"), "wb").write(b"partial")
    os.kill(os.getpid(), signal.SIGKILL)
store.save_file = killed_inside
store.save_weights(torch.nn.Linear(2, 2), store.Path({str(tmp_path / "model.safetensors")!r}))
"""
    assert subprocess.run([sys.executable, "-c", child]).returncode == -9
    left = list(tmp_path.iterdir())
    assert len(left) == 1 and left[0].is_dir()  # the killed save's folder, holding both temporaries
    assert store.remove_stale_temporaries(tmp_path) == left
    assert not list(tmp_path.iterdir())
    store.save_weights(torch.nn.Linear(2, 2), tmp_path / "model.safetensors")
    assert [p.name for p in tmp_path.iterdir()] == ["model.safetensors"]


def test_the_cleanup_leaves_links_and_the_temporaries_of_other_users_live_processes(tmp_path, monkeypatch):
    """atomic_path makes no links, so a link named like a dead writer's temporary is not one of its own: it and what
    it points to stay. A process id that os.kill may not signal (EPERM: another user's process) is alive."""
    import errno
    import subprocess
    import sys

    dead = int(subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True).stdout)
    host = _atomic._HOST
    target = tmp_path / "kept"
    target.mkdir()
    (target / "data.json").write_text("{}")
    link = tmp_path / f".link.json.{host}-{dead}.0123456789ab.tmp"
    link.symlink_to(target, target_is_directory=True)
    other_user = 2**22 + 1  # above any pid_max: no process has it, but os.kill below answers EPERM for it
    others = tmp_path / f".m.json.{host}-{other_user}.abcdef012345.tmp"
    others.write_text("partial")
    real_kill = os.kill

    def kill(pid, signal):
        if pid == other_user:
            raise PermissionError(errno.EPERM, "Operation not permitted")
        return real_kill(pid, signal)

    monkeypatch.setattr(os, "kill", kill)
    assert store.remove_stale_temporaries(tmp_path) == []
    assert link.is_symlink() and (target / "data.json").exists() and others.exists()


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="counts descriptors in /proc/self/fd")
def test_writes_leave_no_descriptor_open_and_no_name_marked_as_being_written(tmp_path):
    """A write closes the descriptors it syncs with and forgets its temporary once done, failed or not (a long run
    writes thousands of files)."""
    store.write_text(tmp_path / "warm.txt", "x")  # whatever the first write opens for good (imports) is open now
    before = sorted(os.listdir("/proc/self/fd"))
    store.write_text(tmp_path / "a.txt", "x")
    store.save_weights(nn.Linear(2, 2), tmp_path / "w.safetensors")
    with pytest.raises(RuntimeError), _atomic.atomic_path(tmp_path / "b.txt") as tmp:
        tmp.write_text("half")
        raise RuntimeError
    assert sorted(os.listdir("/proc/self/fd")) == before
    assert not _atomic._WRITING


def test_the_cleanup_does_not_look_inside_a_live_writers_temporary_folder(tmp_path):
    """rglob descended into temporary folders, so a live writer removing its own folder while the walk passed it
    raised FileNotFoundError at the start of a run; the walk now treats such a folder as one entry."""
    import subprocess
    import sys

    dead = int(subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True).stdout)
    host = _atomic._HOST
    live = tmp_path / "runs" / f".model.safetensors.{host}-{os.getppid()}.0123456789ab.tmp"  # pytest's parent: alive
    inside = live / f".model.safetensors.{host}-{dead}.abcdef012345.tmp"  # would be stale, were it not inside
    inside.parent.mkdir(parents=True)
    inside.write_text("partial")
    assert store.remove_stale_temporaries(tmp_path) == []
    assert inside.exists()


def test_text_with_a_path_that_is_no_utf8_is_written_escaped(tmp_path):
    # A --corpus path with a Latin-1 byte reached report.md as a surrogate escape: UnicodeEncodeError, no report.
    odd = os.fsdecode(b"/data/lat\xe9")
    store.write_text(tmp_path / "report.md", f"corpus: {odd}\n")
    assert (tmp_path / "report.md").read_text(encoding="utf-8") == "corpus: /data/lat\\xe9\n"


def test_json_is_written_with_sorted_keys(tmp_path):
    """Sorted at every level, so that two runs' results.json differ only where their values do."""
    path = tmp_path / "r.json"
    store.write_json(path, {"zeta": 1, "alpha": {"y": 2, "b": 3}})
    text = path.read_text()
    assert text.index('"alpha"') < text.index('"zeta"') and text.index('"b"') < text.index('"y"')


def test_data_reaches_the_disk_before_the_rename_and_the_rename_after(tmp_path, monkeypatch):
    """A power loss after an unflushed rename may leave the target empty on ext4 and XFS: a finished result lost."""
    events = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(descriptor):
        events.append(("fsync", os.readlink(f"/proc/self/fd/{descriptor}")))
        real_fsync(descriptor)

    def replace(source, target):
        events.append(("replace", str(target)))
        real_replace(source, target)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    store.write_text(tmp_path / "r.txt", "done\n")
    assert [kind for kind, _ in events] == ["fsync", "replace", "fsync"]
    assert events[0][1].endswith(".tmp") and events[2][1] == str(tmp_path)
    assert (tmp_path / "r.txt").read_text() == "done\n"


@pytest.mark.parametrize("code", ["EINVAL", "ENOTSUP", "EBADF"])
def test_a_folder_that_cannot_be_synced_still_gets_the_file(tmp_path, monkeypatch, code):
    """Some FUSE and network filesystems answer a folder's fsync with EINVAL (or ENOTSUP, or EBADF) after the rename
    has happened."""
    import errno

    real_fsync = os.fsync

    def fsync(descriptor):
        if os.path.isdir(os.readlink(f"/proc/self/fd/{descriptor}")):
            raise OSError(getattr(errno, code), os.strerror(getattr(errno, code)))
        real_fsync(descriptor)

    monkeypatch.setattr(os, "fsync", fsync)
    store.write_text(tmp_path / "r.txt", "done\n")
    assert (tmp_path / "r.txt").read_text() == "done\n"


def test_an_io_error_on_sync_fails_the_write_and_keeps_the_old_file(tmp_path, monkeypatch):
    """EIO from fsync means the data may never reach the disk: only the filesystems that cannot sync at all are let
    be, and a failed write leaves the previous file and no temporary."""
    import errno

    path = tmp_path / "r.txt"
    store.write_text(path, "old\n")

    def fsync(descriptor):
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(os, "fsync", fsync)
    with pytest.raises(OSError, match="Input/output error"):
        store.write_text(path, "new\n")
    assert path.read_text() == "old\n" and sorted(p.name for p in tmp_path.iterdir()) == ["r.txt"]


def test_a_weights_file_gone_before_its_read_names_the_folder_to_delete(tmp_path):
    path = tmp_path / "seed0" / "model.safetensors"
    with pytest.raises(store.RunFolderError, match=f"{path} is missing; delete the folder {path.parent}"):
        store.load_tensors(path)
    with pytest.raises(store.RunFolderError, match="is missing"):
        store.load_weights(torch.nn.Linear(2, 2), path)
