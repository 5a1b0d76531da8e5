"""Checkpoints mid-unit: which saved states are resumed, what is said of those that are not, and the record of the
settings a resumed unit trained with. Resuming end to end (bit for bit, interrupts) is in test_runner.py."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from posenc.lab import checkpoint, store
from posenc.lab import train as train_module
from posenc.lab.checkpoint import load_checkpoint
from posenc.lab.runner import Lab


def test_a_checkpoint_that_cannot_be_read_is_said_and_not_resumed(tiny_config, tmp_path):
    # Written atomically by the lab, so only something else cuts it short: it costs the time it saved, not the run.
    path = tmp_path / "checkpoint.safetensors"
    path.write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{")
    lines = []
    lab = Lab(tiny_config(), tmp_path / "run", echo=lines.append)
    assert load_checkpoint(path, {"unit": "rope"}, lab._build("rope"), echo=lines.append) is None
    assert len(lines) == 1 and f"{path} cannot be read (" in lines[0] and "training from step 0" in lines[0]


@pytest.mark.parametrize("saved_for", ["t5", "rope with wider layers"])
def test_a_checkpoint_of_another_model_under_the_same_identity_is_said_and_not_resumed(
    tiny_config, tmp_path, saved_for
):
    """A posenc that changed the model without a new FORMAT_VERSION: its parameters' names or shapes differ, and
    the resume failed inside load_state_dict on every rerun."""
    lab = Lab(tiny_config(), tmp_path / "run", echo=(lines := []).append)
    other = lab._build("t5") if saved_for == "t5" else Lab(tiny_config(dim=24), tmp_path / "b")._build("rope")
    optimizer = train_module.make_optimizer(other, lr=1e-3, weight_decay=0.1)
    other(torch.zeros(1, 4, dtype=torch.long))[0].sum().backward()
    optimizer.step()
    state = train_module.TrainState(
        1,
        0.5,
        torch.zeros(1),
        {k: v.clone() for k, v in other.state_dict().items()},
        dict(optimizer.state_dict()["state"]),
    )
    path = tmp_path / "checkpoint.safetensors"
    store.save_tensors(path, *state.to_tensors({"unit": "rope"}))
    assert load_checkpoint(path, {"unit": "rope"}, lab._build("rope"), echo=lines.append) is None
    assert lines == [f"  {path} was saved by another configuration or posenc, not resumed: training from step 0"]
    own = lab._build("rope")
    optimizer = train_module.make_optimizer(own, lr=1e-3, weight_decay=0.1)
    own(torch.zeros(1, 4, dtype=torch.long))[0].sum().backward()
    optimizer.step()
    state = train_module.TrainState(
        1, 0.5, torch.zeros(1), dict(own.state_dict()), dict(optimizer.state_dict()["state"])
    )
    store.save_tensors(path, *state.to_tensors({"unit": "rope"}))
    # Its own model's: resumed.
    assert load_checkpoint(path, {"unit": "rope"}, lab._build("rope"), echo=lines.append).step == 1
    del state.optimizer[0]  # a parameter without its moments would resume silently with others' weights
    store.save_tensors(path, *state.to_tensors({"unit": "rope"}))
    assert load_checkpoint(path, {"unit": "rope"}, lab._build("rope"), echo=lines.append) is None


def test_a_checkpoint_whose_parts_do_not_fit_the_model_is_not_resumed(tiny_config, tmp_path):
    """Each part _fits checks, spoiled one at a time in a state of the model's own parameters: any one of them would
    fail inside train() or resume AdamW with moments that are not the parameters' own."""
    lab = Lab(tiny_config(), tmp_path / "run", echo=(lines := []).append)
    model = lab._build("rope")
    optimizer = train_module.make_optimizer(model, lr=1e-3, weight_decay=0.1)
    model(torch.zeros(1, 4, dtype=torch.long))[0].sum().backward()
    optimizer.step()
    moments = optimizer.state_dict()["state"]
    good = train_module.TrainState(1, 0.5, torch.zeros(1), dict(model.state_dict()), dict(moments))
    path = tmp_path / "checkpoint.safetensors"
    # None saved: nothing to say.
    assert load_checkpoint(path, {"unit": "rope"}, model, echo=lines.append) is None and lines == []
    name = next(iter(good.model))
    # Two parameters' moments of different shapes, exchanged: the optimizer's order of parameters changed.
    other = next(i for i in moments if moments[i]["exp_avg"].shape != moments[0]["exp_avg"].shape)
    last = max(moments)
    spoiled = {
        "losses of another step count": dataclasses.replace(good, losses=torch.zeros(2)),
        "a parameter in float64": dataclasses.replace(good, model={**good.model, name: good.model[name].double()}),
        # Its moments still of the parameter's shape: only the model's own shapes tell this file from the model.
        "a parameter of another shape": dataclasses.replace(
            good, model={**good.model, name: good.model[name].flatten()[:-1].clone()}
        ),
        "the last parameter's moments under the next index": dataclasses.replace(
            good, optimizer={**{i: m for i, m in moments.items() if i != last}, last + 1: moments[last]}
        ),
        "no exp_avg_sq": dataclasses.replace(
            good, optimizer={**moments, 0: {k: v for k, v in moments[0].items() if k != "exp_avg_sq"}}
        ),
        "another parameter's moments": dataclasses.replace(
            good, optimizer={**moments, 0: moments[other], other: moments[0]}
        ),
        "another parameter's exp_avg_sq": dataclasses.replace(
            good, optimizer={**moments, 0: {**moments[0], "exp_avg_sq": moments[other]["exp_avg_sq"].clone()}}
        ),
    }
    store.save_tensors(path, *good.to_tensors({"unit": "rope"}))
    assert load_checkpoint(path, {"unit": "rope"}, model, echo=lines.append).step == 1
    for what, state in spoiled.items():
        store.save_tensors(path, *state.to_tensors({"unit": "rope"}))
        assert load_checkpoint(path, {"unit": "rope"}, model, echo=lines.append) is None, what


def test_trained_with_and_its_description_of_checkpoints_that_record_no_settings():
    here = {"torch_threads": 2, "device": "cpu", "processes": 1}
    # A checkpoint of a posenc before trained_with (None), or one whose list is empty: its steps' settings are unknown.
    for earlier in (None, []):
        parts = checkpoint._trained_with(earlier, 21, here)
        assert parts == [{"from_step": 0}, {"from_step": 21, **here}]
        assert checkpoint._described(parts[0]) == "settings the checkpoint does not record"
    assert checkpoint._described(parts[1]) == "2 torch thread(s) on cpu in 1 process(es)"
    assert checkpoint._trained_with([{"from_step": 0, **here}], 21, here) == [{"from_step": 0, **here}]
