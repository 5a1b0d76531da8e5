"""The corpus: file order, hash, split, the stdlib walk, and deterministic batches and eval windows."""

from __future__ import annotations

import hashlib

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from posenc.lab import data
from posenc.lab.data import (
    FILE_SEPARATOR,
    corpus_files,
    eval_text_needed,
    eval_window_ends,
    load_corpus,
    train_starts,
    windows_at,
    windows_ending,
)


def test_directory_corpus_is_sorted_joined_hashed_and_split(corpus_dir):
    files = corpus_files(corpus_dir)
    relative = [f.relative_to(corpus_dir).as_posix() for f in files]
    assert relative == sorted(relative) and "pkg/module_1.py" in relative
    joined = FILE_SEPARATOR.join(f.read_bytes() for f in files)
    corpus = load_corpus(corpus_dir, val_fraction=0.25)
    assert corpus.sha256 == hashlib.sha256(joined).hexdigest()
    assert corpus.files == len(files) and corpus.size == len(joined)
    assert corpus.val.numel() == int(len(joined) * 0.25)
    assert bytes(torch.cat((corpus.train, corpus.val)).tolist()) == joined
    assert load_corpus(corpus_dir, val_fraction=0.25).sha256 == corpus.sha256


def test_single_file_corpus_and_max_bytes(tmp_path):
    path = tmp_path / "notes.txt"
    path.write_bytes(b"abcdefghij" * 100)
    corpus = load_corpus(path, max_bytes=300)
    assert corpus.files == 1 and corpus.size == 300
    assert corpus.sha256 == hashlib.sha256(b"abcdefghij" * 30).hexdigest()


def test_stdlib_walk_skips_third_party_and_test_suites(tmp_path):
    for name in ("os.py", "json/__init__.py", "site-packages/numpy/core.py", "test/test_os.py", "data.txt"):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text("x = 1\n")
    found = [f.relative_to(tmp_path).as_posix() for f in corpus_files(tmp_path, stdlib=True)]
    assert found == ["json/__init__.py", "os.py"]
    assert "data.txt" in [f.name for f in corpus_files(tmp_path)]
    # A corpus of one's own keeps its test folders (only the stdlib walk leaves them out), not installed packages.
    own = [f.relative_to(tmp_path).as_posix() for f in corpus_files(tmp_path)]
    assert "test/test_os.py" in own and not any("site-packages" in name for name in own)


def test_a_folder_corpus_reads_text_suffixes_in_any_case_and_skips_lab_runs(tmp_path):
    """`posenc lab --corpus .` writes lab-runs/ inside its corpus: a run folder (its config.json names a
    configuration and a corpus) is never read as text, or the corpus would change with every run."""
    files = {
        "a.txt": "a",
        "NOTES.TXT": "b",
        "Setup.Py": "c",
        "image.png": "d",
        "NOTES": "e",  # no suffix: not read
        "lab-runs/quick/config.json": '{"config_id": "x", "corpus_sha256": "y", "results_key": {}}',
        "lab-runs/quick/report.md": "f",
        "lab-runs/quick/runs/rope/seed0/metrics.json": "{}",
        "data/config.json": '{"vocab": 3}',  # a config.json of one's own stays text
        # a run folder whose config.json was deleted: its finished units still mark it
        "old-run/runs/nope/seed0/metrics.json": '{"config_id": "x"}',
        "old-run/report.md": "g",
    }
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    found = [f.relative_to(tmp_path).as_posix() for f in corpus_files(tmp_path)]
    assert found == ["NOTES.TXT", "Setup.Py", "a.txt", "data/config.json"]


def test_files_are_ordered_by_their_relative_path_as_text_not_by_path_parts(tmp_path):
    # The order sets the corpus's bytes and hash (config_id): by the posix string "a-b/x.py" < "a.py" < "a/b.py"
    # ('-' < '.' < '/'), where comparing Paths part by part puts "a/b.py" first.
    for name in ("a/b.py", "a.py", "a-b/x.py"):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(name)
    found = [f.relative_to(tmp_path).as_posix() for f in corpus_files(tmp_path)]
    assert found == ["a-b/x.py", "a.py", "a/b.py"]


def test_max_bytes_cuts_the_joined_text_at_that_byte(tmp_path):
    """The separator after the last file kept was counted: with two 7-byte files, 8, 9 and 10 bytes all gave 7."""
    for name in ("a.txt", "b.txt"):
        (tmp_path / name).write_bytes(b"1234567")
    joined = b"1234567" + FILE_SEPARATOR + b"1234567"
    for max_bytes in range(1, len(joined) + 3):
        corpus = load_corpus(tmp_path, max_bytes=max_bytes, val_fraction=0.5)
        assert bytes(torch.cat((corpus.train, corpus.val)).tolist()) == joined[:max_bytes]
        # The files read: b.txt counts once a byte of it is kept (the quick preset read 49 of the 734 it found).
        assert corpus.files == (1 if max_bytes <= 7 + len(FILE_SEPARATOR) else 2)


def test_builtin_corpus_is_this_pythons_stdlib(monkeypatch, corpus_dir):
    # The real stdlib takes a second to read; the walk and the "python-stdlib" label are what is tested here.
    monkeypatch.setattr(data, "stdlib_path", lambda: corpus_dir)
    corpus = load_corpus(None, max_bytes=2000)
    assert corpus.source == "python-stdlib" and corpus.size == 2000


def test_real_stdlib_path_holds_the_stdlib():
    path = data.stdlib_path()
    assert (path / "os.py").is_file() and (path / "json" / "__init__.py").is_file()


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda tmp: tmp / "missing", "does not exist"),
        (lambda tmp: tmp, "holds no text files"),
    ],
)
def test_bad_corpus_paths(tmp_path, make, message):
    with pytest.raises(ValueError, match=message):
        load_corpus(make(tmp_path))


def test_too_little_text_and_bad_arguments(tmp_path):
    path = tmp_path / "a.txt"
    path.write_text("tiny")
    with pytest.raises(ValueError, match="holds 4 bytes, but this configuration needs at least 100"):
        load_corpus(path, min_bytes=100)
    with pytest.raises(ValueError, match="val_fraction must be in"):
        load_corpus(path, val_fraction=1.0)
    with pytest.raises(ValueError, match="max_bytes must be a positive integer"):
        load_corpus(path, max_bytes=0)


def test_train_starts_depend_on_the_seed_only():
    text = torch.arange(1000, dtype=torch.int64).to(torch.uint8)
    a = train_starts(text, seq_len=16, batch_size=4, steps=5, seed=3)
    assert torch.equal(a, train_starts(text, seq_len=16, batch_size=4, steps=5, seed=3))
    assert not torch.equal(a, train_starts(text, seq_len=16, batch_size=4, steps=5, seed=4))
    assert a.shape == (5, 4) and int(a.max()) + 17 <= 1000
    exact = train_starts(text[:17], seq_len=16, batch_size=4, steps=50, seed=3)  # one window fits: it starts at 0
    assert (exact == 0).all()
    for short in (10, 16):  # 16 bytes: one short of a window (torch's randint refused an empty range)
        with pytest.raises(ValueError, match="fewer than one window of 17"):
            train_starts(text[:short], seq_len=16, batch_size=4, steps=5, seed=3)


def test_windows_at_gives_inputs_and_next_byte_targets():
    text = torch.arange(50, dtype=torch.int64).to(torch.uint8)
    batch = windows_at(text, torch.tensor([0, 10]), 4)
    assert batch.dtype == torch.int64
    assert batch.tolist() == [[0, 1, 2, 3, 4], [10, 11, 12, 13, 14]]


def test_windows_at_keeps_every_byte_value():
    # Bytes 128..255 (UTF-8 continuations, the separator's neighbours) reach the model as they are.
    text = torch.arange(256, dtype=torch.int64).to(torch.uint8)
    assert windows_at(text, torch.tensor([0, 250]), 5).tolist() == [list(range(6)), list(range(250, 256))]


@settings(max_examples=30, deadline=None)
@given(
    size=st.integers(80, 400),
    count=st.integers(1, 20),
    lengths=st.lists(st.integers(1, 64), min_size=1, max_size=4, unique=True),
)
def test_every_length_ends_on_the_same_bytes(size, count, lengths):
    text = torch.randint(0, 256, (size,), generator=torch.Generator().manual_seed(size)).to(torch.uint8)
    longest = max(lengths)
    if count > size - longest:
        with pytest.raises(ValueError, match="too few"):
            eval_window_ends(text, longest=longest, count=count)
        return
    ends = eval_window_ends(text, longest=longest, count=count)
    assert ends.shape == (count,) and int(ends.min()) >= longest + 1 and int(ends.max()) <= size
    shortest = min(lengths)
    tails = [windows_ending(text, ends, n)[:, -(shortest + 1) :] for n in lengths]
    for tail in tails[1:]:
        assert torch.equal(tail, tails[0])
    for n in lengths:
        assert windows_ending(text, ends, n).shape == (count, n + 1)


def test_eval_window_ends_are_spread_evenly_from_the_first_room_to_the_end():
    # 21 bytes, windows of 5: ends from 5 to 21, at 0, 16/3, 32/3 and 16 bytes past the first, rounded down.
    text = torch.zeros(21, dtype=torch.uint8)
    assert eval_window_ends(text, longest=4, count=4).tolist() == [5, 10, 15, 21]
    assert eval_window_ends(text, longest=4, count=17).tolist() == list(range(5, 22))
    assert eval_window_ends(text, longest=4, count=1).tolist() == [5]


def test_the_even_spread_keeps_scored_bytes_apart_whenever_the_text_allows():
    # Ends at least score_len apart score no byte twice; eval_text_needed is the least text on which any spread
    # of the ends can do so, and the even spread does on all of it (the lab refuses less).
    for score_len in (1, 3, 8):
        for count in (2, 5, 17):
            needed = eval_text_needed(longest=20, count=count, score_len=score_len)
            for size in range(needed, needed + 3 * count):
                ends = eval_window_ends(torch.zeros(size, dtype=torch.uint8), longest=20, count=count)
                assert int(ends.diff().min()) >= score_len, (score_len, count, size)
            # One byte less: the ends span at most size - 21 bytes, fewer than (count - 1) * score_len.
            assert needed - 1 - 21 < (count - 1) * score_len


def test_an_empty_corpus_says_so(tmp_path):
    (tmp_path / "empty.txt").write_text("")
    with pytest.raises(ValueError, match=r"is empty \(0 bytes of text\)"):
        load_corpus(tmp_path / "empty.txt")


def test_eval_window_ends_take_as_many_windows_as_there_are_distinct_ends():
    # 20 bytes hold windows of 17 ending at 17..20: four distinct ends, and a fifth would repeat one of them.
    text = torch.zeros(20, dtype=torch.uint8)
    assert eval_window_ends(text, longest=16, count=4).tolist() == [17, 18, 19, 20]
    with pytest.raises(ValueError, match="too few for 5 windows of 17"):
        eval_window_ends(text, longest=16, count=5)


def test_a_config_json_naming_a_configuration_but_no_corpus_stays_text(tmp_path):
    # A lab run's config.json names both; another tool's config.json with a config_id is a file of the corpus.
    (tmp_path / "tool").mkdir()
    (tmp_path / "tool" / "config.json").write_text('{"config_id": "mine"}')
    assert [f.relative_to(tmp_path).as_posix() for f in corpus_files(tmp_path)] == ["tool/config.json"]
