"""The lab's process-group plumbing, in one process: ranks, batch slices, devices, length assignment, and the
errors raised before anything trains. The two-process behaviour is in test_ddp.py."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from hypothesis import given
from hypothesis import strategies as st

from posenc.cli import main
from posenc.lab import runner
from posenc.lab.dist import Ranks, check_device_usable, process_group, resolve_device
from posenc.lab.model import ByteLM, ModelSpec
from posenc.lab.runner import Lab, assign_lengths, check_world_size
from posenc.lab.store import RunFolderError
from posenc.lab.train import train


@given(world=st.integers(1, 8), share=st.integers(1, 16))
def test_batch_slices_of_the_ranks_tile_the_global_batch(world, share):
    rows = [list(range(world * share))[Ranks(r, world).batch_slice(world * share)] for r in range(world)]
    assert [row for part in rows for row in part] == list(range(world * share))
    assert all(len(part) == share for part in rows)


def test_an_uneven_batch_is_refused_with_the_fix():
    with pytest.raises(ValueError, match=r"batch_size=6 is not divisible by the 4 processes.*multiple of 4"):
        Ranks(1, 4).batch_slice(6)


@pytest.mark.parametrize(
    ("rank", "world", "error", "message"),
    [
        (0, 0, ValueError, "world_size must be >= 1"),
        (2, 2, ValueError, r"rank must be in \[0, 2\)"),
        (-1, 2, ValueError, r"rank must be in \[0, 2\)"),
        (0.0, 1, TypeError, "rank must be an int"),
        (0, True, TypeError, "world_size must be an int"),
    ],
)
def test_bad_ranks(rank, world, error, message):
    with pytest.raises(error, match=message):
        Ranks(rank, world)


def test_one_process_collectives_are_identities_and_decide_reraises():
    ranks = Ranks()
    assert ranks.is_main and ranks.broadcast({"a": 1}) == {"a": 1} and ranks.all_gather(3) == [3]
    x = torch.arange(3.0)
    assert ranks.all_reduce_mean(x) is x
    assert ranks.decide(lambda: 5) == 5

    def refuse():
        raise TypeError("no")

    with pytest.raises(TypeError, match="no"):
        ranks.decide(refuse)


@pytest.mark.parametrize(
    ("device", "world", "local_rank", "expected"),
    [
        ("cpu", 1, 0, (torch.device("cpu"), None)),
        ("cuda:1", 1, 0, (torch.device("cuda", 1), None)),
        ("cpu", 2, 1, (torch.device("cpu"), "gloo")),
        ("cuda", 4, 3, (torch.device("cuda", 3), "nccl")),
    ],
)
def test_devices_and_backends(device, world, local_rank, expected, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # a machine with a GPU per process
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    assert resolve_device(device, world_size=world, local_rank=local_rank) == expected


def test_more_processes_than_gpus_is_named_as_such(corpus_dir, tmp_path, monkeypatch, capsys):
    """torchrun --nproc-per-node 2 on a 1-GPU machine: rank 1 was refused 'cuda:1' ('pass one of those, or --device
    cuda', which it had passed) and said nothing, as only rank 0 printed; rank 0 waited for the group until torchrun
    ended it. The rank says why, and what to start instead."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    fewer = r"LOCAL_RANK 1, but this machine has 1 CUDA GPU\(s\) .*\(--nproc-per-node 1\)"
    with pytest.raises(ValueError, match=fewer):
        resolve_device("cuda", world_size=2, local_rank=1)
    for name, value in {"WORLD_SIZE": "2", "RANK": "1", "LOCAL_RANK": "1"}.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(runner, "train", lambda *a, **k: pytest.fail("training started"))
    out = tmp_path / "run"
    status = main(["lab", "--preset", "quick", "--corpus", str(corpus_dir), "--out", str(out), "--device", "cuda"])
    assert status == 2 and not out.exists()
    assert capsys.readouterr().err.startswith(
        "posenc lab: error (rank 1): torchrun started this process as LOCAL_RANK 1"
    )


@pytest.mark.parametrize(
    ("device", "message"),
    [
        ("cuda:0", "names one GPU, but torchrun started 2 processes: pass --device cuda"),
        ("meta", "runs on cpu \\(gloo\\) or cuda \\(nccl\\), not on 'meta'"),
        ("gpu", "is not a torch device"),
    ],
)
def test_bad_devices_under_torchrun(device, message):
    with pytest.raises(ValueError, match=message):
        resolve_device(device, world_size=2, local_rank=0)


def _no_gpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)


def test_a_device_this_process_cannot_use_is_named(monkeypatch):
    check_device_usable(torch.device("cpu"))
    _no_gpu(monkeypatch)
    with pytest.raises(ValueError, match=r"--device cuda: this torch .* sees no CUDA GPU; pass --device cpu"):
        check_device_usable(torch.device("cuda"))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    check_device_usable(torch.device("cuda", 1))
    with pytest.raises(ValueError, match=r"--device cuda:2: this machine has 2 CUDA GPU\(s\), cuda:0 to cuda:1"):
        check_device_usable(torch.device("cuda", 2))
    if not torch.backends.mps.is_available():  # torch's dispatcher error runs to ~50 lines: its first sentence
        with pytest.raises(ValueError, match=r"--device mps is not usable in this process \([^\n]*\); pass") as caught:
            check_device_usable(torch.device("mps"))
        assert "\n" not in str(caught.value)


def test_lab_on_cuda_without_a_gpu_exits_2_before_anything_is_written(corpus_dir, tmp_path, monkeypatch, capsys):
    """Was: the folder claimed, '[1/11] learned seed 0' printed, then a raw AssertionError (exit 1)."""
    _no_gpu(monkeypatch)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.setattr(runner, "train", lambda *a, **k: pytest.fail("training started"))
    out = tmp_path / "run"
    status = main(["lab", "--preset", "quick", "--corpus", str(corpus_dir), "--out", str(out), "--device", "cuda"])
    assert status == 2
    captured = capsys.readouterr()
    assert captured.err.startswith("posenc lab: error: --device cuda:") and "sees no CUDA GPU" in captured.err
    assert captured.out == "" and not out.exists()


def test_without_torchrun_no_group_is_joined(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    with process_group("cpu") as (ranks, device):
        assert ranks == Ranks() and device == torch.device("cpu")
        assert not (dist.is_available() and dist.is_initialized())


def test_a_bad_world_size_variable_is_named(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "two")
    with pytest.raises(ValueError, match="WORLD_SIZE='two' must be an integer"), process_group("cpu"):
        pass


@given(lengths=st.lists(st.integers(1, 4096), min_size=1, max_size=8, unique=True), world=st.integers(1, 6))
def test_lengths_are_dealt_out_once_each_in_their_order(lengths, world):
    parts = assign_lengths(lengths, world)
    assert len(parts) == world and sorted(n for part in parts for n in part) == sorted(lengths)
    for part in parts:
        assert part == [n for n in lengths if n in part]
    assert assign_lengths(lengths, 1) == [lengths]
    # Longest first to the least loaded: no rank carries more than the average plus one length.
    loads = [sum(part) for part in parts]
    assert max(loads) <= sum(lengths) / world + max(lengths)


def test_fine_tune_batches_must_split_too(tiny_config):
    config = tiny_config(batch_size=4, encodings=("rope",), extensions=("pi", "ntk"), finetune_steps=2)
    with pytest.raises(ValueError, match=r"fine-tune at length 32 uses a global batch of 1 windows.*2 processes"):
        check_world_size(config, 2)
    check_world_size(tiny_config(batch_size=4, extensions=("ntk",), finetune_steps=2), 2)  # ntk is not fine-tuned
    check_world_size(config, 1)


def test_an_uneven_split_fails_before_anything_trains(tiny_config, tmp_path, monkeypatch):
    monkeypatch.setattr(runner, "train", lambda *a, **k: pytest.fail("training started"))
    lab = Lab(tiny_config(batch_size=6), tmp_path / "out", progress=False, ranks=Ranks(0, 4))
    with pytest.raises(ValueError, match="batch_size=6 is not divisible by the 4 processes"):
        lab.prepare()
    assert not (tmp_path / "out").exists()


def test_train_refuses_an_uneven_split_before_touching_the_model():
    model = ByteLM(ModelSpec(dim=16, layers=1, heads=2, max_positions=8), "rope")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    text = torch.tensor(list(b"abcdefgh" * 50), dtype=torch.uint8)
    with pytest.raises(ValueError, match="batch_size=8 is not divisible by the 3 processes"):
        train(model, text, seq_len=8, batch_size=8, steps=2, lr=1e-2, seed=0, progress=False, ranks=Ranks(0, 3))
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


def test_other_ranks_are_silent(tiny_config, tmp_path):
    lines = []
    lab = Lab(tiny_config(), tmp_path, progress=True, echo=lines.append, ranks=Ranks(1, 2))
    lab.echo("hello")
    assert lines == [] and lab.progress is False
    main = Lab(tiny_config(), tmp_path, progress=True, echo=lines.append, ranks=Ranks(0, 2))
    main.echo("hello")
    assert lines == ["hello"] and main.progress is True


def test_an_existing_group_is_used_and_left_to_its_owner(monkeypatch, tmp_path):
    """A process already in a group (a notebook, a caller's own torchrun setup) runs the lab in it; the lab neither
    initialises another nor destroys the caller's."""
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_RANK", "0")
    dist.init_process_group("gloo", init_method=(tmp_path / "rendezvous").as_uri(), rank=0, world_size=1)
    try:
        with process_group("cpu") as (ranks, device):
            assert ranks.world_size == 1 and device == torch.device("cpu")
        assert dist.is_initialized()
    finally:
        dist.destroy_process_group()


def test_a_decision_that_fails_on_rank_0_raises_its_own_type_there(monkeypatch):
    monkeypatch.setattr(Ranks, "broadcast", lambda self, obj: obj)  # rank 0 of 2, without a group

    def decision():
        raise TypeError("bad type")

    with pytest.raises(TypeError, match="bad type"):
        Ranks(0, 2).decide(decision)

    def damaged():
        raise RunFolderError("metrics.json is not the JSON the lab writes")

    # run_command says it in one line only if it keeps its type (it became a plain ValueError under torchrun).
    with pytest.raises(RunFolderError, match="not the JSON"):
        Ranks(0, 2).decide(damaged)


def test_a_rank_whose_imports_registered_other_types_is_named(tiny_config, tmp_path, monkeypatch):
    """Every torchrun rank runs --import itself; the ranks compared only their corpora, so a rank whose module
    registered other rope types or encodings (another file on its machine, or an import list of its own) trained
    other models under the same names, unnoticed. Now what each rank registered is compared too (by name and the
    function's or class's qualified name, not by the import's path, which may differ between machines)."""
    lab = Lab(tiny_config(), tmp_path / "out", progress=False, ranks=Ranks(0, 2), imports=["mytypes.py"])
    lab.corpus = type("Corpus", (), {"sha256": "ab" * 32})()

    def gather_with(rank_1):
        monkeypatch.setattr(
            Ranks, "all_gather", lambda self, obj: [obj, rank_1(obj) if isinstance(obj, tuple) else obj]
        )

    gather_with(lambda seen: seen)
    lab._check_ranks_agree()
    gather_with(lambda seen: (seen[0], tuple(r for r in seen[1] if r[1] != "yarn"), []))
    with pytest.raises(
        ValueError,
        match=r"rank\(s\) 1 registered other .* differ in rope_type 'yarn'; --import by rank: "
        r"0: mytypes.py, 1: none\): every rank must import the same modules",
    ):
        lab._check_ranks_agree()
    gather_with(lambda seen: (seen[0], tuple((*r[:2], "other") if r[1] == "alibi" else r for r in seen[1]), seen[2]))
    with pytest.raises(ValueError, match=r"differ in encoding 'alibi';"):
        lab._check_ranks_agree()
