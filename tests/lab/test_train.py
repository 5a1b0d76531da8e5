"""The training loop: schedule, determinism, and that it learns."""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
import types

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from posenc.lab import store
from posenc.lab import train as train_module
from posenc.lab.model import ByteLM, ModelSpec
from posenc.lab.train import LOSS_POINTS, TrainState, lr_at, make_optimizer, train

SPEC = ModelSpec(dim=16, layers=1, heads=2, max_positions=8)
TEXT = torch.tensor(list(b"abcdefgh" * 200), dtype=torch.uint8)


@given(steps=st.integers(1, 500), warmup=st.floats(0.0, 0.9), floor=st.floats(0.0, 0.99))
def test_schedule_warms_up_linearly_then_decays_to_the_floor(steps, warmup, floor):
    rates = [lr_at(s, steps=steps, lr=2.0, warmup_fraction=warmup, min_lr_fraction=floor) for s in range(steps)]
    n_warm = math.ceil(warmup * steps)
    for s in range(n_warm):
        assert rates[s] == pytest.approx(2.0 * (s + 1) / n_warm)
    decay = rates[n_warm:]
    assert all(a >= b - 1e-12 for a, b in itertools.pairwise(decay))
    assert all(2.0 * floor - 1e-12 <= r <= 2.0 + 1e-12 for r in decay)
    if len(decay) > 1:
        assert decay[0] == pytest.approx(2.0) and decay[-1] == pytest.approx(2.0 * floor)
    # A cosine between those ends, as docs/lab.md says: a linear decay has the same ends and falls monotonically too.
    for i, rate in enumerate(decay):
        cosine = 0.5 * (1 + math.cos(math.pi * i / max(1, len(decay) - 1)))
        assert rate == pytest.approx(2.0 * (floor + (1 - floor) * cosine))


def test_constant_after_warmup_when_the_floor_is_one():
    rates = [lr_at(s, steps=20, lr=1.0, warmup_fraction=0.1, min_lr_fraction=1.0) for s in range(20)]
    assert rates[:2] == [0.5, 1.0] and all(r == pytest.approx(1.0) for r in rates[2:])


def run(seed: int, encoding: str = "rope") -> tuple[ByteLM, float]:
    torch.manual_seed(seed)
    model = ByteLM(SPEC, encoding)
    result = train(model, TEXT, seq_len=8, batch_size=8, steps=40, lr=1e-2, seed=seed, progress=False)
    return model, result.final_loss


def test_same_seed_same_weights_other_seed_other_weights():
    a, loss_a = run(0)
    b, loss_b = run(0)
    c, _ = run(1)
    assert loss_a == loss_b
    for (name, x), y in zip(a.state_dict().items(), b.state_dict().values(), strict=True):
        assert torch.equal(x, y), name
    assert any(not torch.equal(x, z) for x, z in zip(a.state_dict().values(), c.state_dict().values(), strict=True))


def test_the_bar_shows_the_loss_in_bits_per_byte(monkeypatch):
    """As the run's summary line and every table do; it showed nats, so the loss seemed to rise when the bar closed."""
    shown = []

    class Bar(train_module.tqdm):
        def set_postfix(self, ordered_dict=None, refresh=True, **kwargs):
            shown.append({**(ordered_dict or {}), **kwargs})
            super().set_postfix(ordered_dict, refresh, **kwargs)

    monkeypatch.setattr(train_module, "tqdm", Bar)
    torch.manual_seed(0)
    result = train(ByteLM(SPEC, "rope"), TEXT, seq_len=8, batch_size=8, steps=21, lr=1e-2, seed=0, progress=True)
    expected = [{"bits/byte": f"{result.losses[step] / math.log(2):.3f}"} for step in (0, 20)]
    assert shown == expected


@pytest.mark.parametrize("encoding", ["rope", "t5", "learned"])
def test_it_learns_a_periodic_text(encoding):
    torch.manual_seed(0)
    model = ByteLM(SPEC, encoding)
    result = train(model, TEXT, seq_len=8, batch_size=8, steps=60, lr=1e-2, seed=0, progress=False)
    assert result.loss_curve[0][1] > 5.0  # ~ln(256) at the start
    assert result.final_loss < 1.0  # "abcdefgh" repeats: each byte follows from the one before
    assert result.tokens == 60 * 8 * 8 and len(result.loss_curve) == min(LOSS_POINTS, 60)
    assert result.loss_curve[-1][0] == 60 and not model.training


def test_weight_decay_only_on_matrices():
    model = ByteLM(SPEC, "t5")
    decay, no_decay = make_optimizer(model, lr=1e-3, weight_decay=0.1).param_groups
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    # betas are in no config (nor its results key): a change would silently mix runs a resume takes as one.
    assert decay["betas"] == no_decay["betas"] == (0.9, 0.95)
    assert all(p.dim() >= 2 for p in decay["params"]) and all(p.dim() < 2 for p in no_decay["params"])
    assert len(decay["params"]) + len(no_decay["params"]) == len(list(model.parameters()))


def test_every_step_loss_is_kept_and_the_summaries_come_from_it():
    torch.manual_seed(0)
    result = train(ByteLM(SPEC, "alibi"), TEXT, seq_len=8, batch_size=8, steps=30, lr=1e-2, seed=0, progress=False)
    losses = torch.tensor(result.losses)
    assert losses.shape == (30,) and losses.dtype == torch.float32
    assert result.final_loss == float(losses[-3:].mean())
    assert result.loss_curve == [(s + 1, round(float(x), 5)) for s, x in enumerate(losses)]


@pytest.mark.parametrize("grad_clip", [0.0, 0.25])
def test_gradients_are_clipped_to_grad_clip_every_step_and_not_at_zero(grad_clip, monkeypatch):
    calls = []
    real = torch.nn.utils.clip_grad_norm_

    def spy(parameters, max_norm, *args, **kwargs):
        calls.append(max_norm)
        return real(parameters, max_norm, *args, **kwargs)

    monkeypatch.setattr(torch.nn.utils, "clip_grad_norm_", spy)
    train(ByteLM(SPEC, "nope"), TEXT, seq_len=8, batch_size=4, steps=3, lr=1e-2, seed=0, grad_clip=grad_clip,
          progress=False)  # fmt: skip
    assert calls == ([grad_clip] * 3 if grad_clip else [])


def through_a_file(state: TrainState, folder, identity) -> TrainState | None:
    """``state`` written to a safetensors file and read back, as the lab's checkpoints are."""
    path = folder / "checkpoint.safetensors"
    store.save_tensors(path, *state.to_tensors(identity))
    return TrainState.from_tensors(*store.load_tensors(path), identity)


@pytest.mark.parametrize("encoding", ["t5", "rope"])  # t5: one table shared by every layer, and an extra state
def test_a_run_resumed_from_a_saved_state_ends_as_the_uninterrupted_one(encoding, tmp_path):
    """Bit for bit: weights, every step's loss, and AdamW's state (its moments and step count) at a later save."""
    spec = ModelSpec(dim=16, layers=2, heads=2, max_positions=8)
    options = {"seq_len": 8, "batch_size": 8, "steps": 45, "lr": 1e-2, "seed": 0, "progress": False}

    def trained(seed, **kwargs):
        torch.manual_seed(seed)
        model = ByteLM(spec, encoding)
        return model, train(model, TEXT, **options, **kwargs)

    reference, expected = trained(0)
    saved: list[TrainState] = []
    _, result = trained(0, save=saved.append, save_every=0.0)
    # At the bar's checks (steps 0, 20, 40), the state after that step; saving changes no number.
    assert [state.step for state in saved] == [1, 21, 41] and result.losses == expected.losses
    assert saved[1].losses.tolist() == expected.losses[:21] and saved[1].seconds > 0
    step_count = saved[1].optimizer[0]["step"]
    assert step_count.dtype == torch.float32 and step_count.device.type == "cpu" and float(step_count) == 21
    state = through_a_file(saved[1], tmp_path, {"unit": encoding})
    assert state is not None
    assert state.optimizer[0]["step"].dtype == torch.float32 and state.optimizer[0]["step"].shape == ()
    later: list[TrainState] = []
    model, resumed = trained(1, resume=state, save=later.append, save_every=0.0)  # other initial weights: replaced
    assert resumed.losses == expected.losses and resumed.loss_curve == expected.loss_curve
    assert resumed.final_loss == expected.final_loss and resumed.seconds > state.seconds
    for (name, x), y in zip(reference.state_dict().items(), model.state_dict().values(), strict=True):
        assert torch.equal(x, y), name
    assert [s.step for s in later] == [41]
    for index, moments in saved[2].optimizer.items():
        for key, value in moments.items():
            assert torch.equal(later[0].optimizer[index][key], value), (index, key)
    # The state given is not changed by training from it: it resumes again to the same end.
    assert trained(2, resume=state)[1].losses == expected.losses


def test_a_state_saved_under_another_identity_is_not_resumed(tmp_path):
    torch.manual_seed(0)
    saved: list[TrainState] = []
    train(ByteLM(SPEC, "alibi"), TEXT, seq_len=8, batch_size=4, steps=3, lr=1e-2, seed=0, save=saved.append,
          save_every=0.0, progress=False)  # fmt: skip
    # Only at step 0: never after the last step, whose weights the caller saves.
    assert [state.step for state in saved] == [1]
    identity = {"unit": "alibi", "lengths": (8, 16)}
    assert through_a_file(saved[0], tmp_path, identity) is not None  # a tuple stored as a list is the same identity
    tensors, metadata = saved[0].to_tensors(identity)
    assert TrainState.from_tensors(tensors, metadata, {**identity, "unit": "rope"}) is None
    assert TrainState.from_tensors(tensors, {}, identity) is None  # no state: a plain weights file
    # Another layout of the state, or one without its losses (written by something else): not resumed.
    about = json.loads(metadata["posenc_train_state"])
    other_format = {"posenc_train_state": json.dumps({**about, "format": about["format"] + 1})}
    assert TrainState.from_tensors(tensors, other_format, identity) is None
    assert TrainState.from_tensors({k: v for k, v in tensors.items() if k != "losses"}, metadata, identity) is None


@pytest.mark.parametrize("step, losses", [(3, 3), (1, 2), (0, 0)])
def test_a_state_no_call_of_these_steps_saved_is_refused(step, losses):
    torch.manual_seed(0)
    state = TrainState(step, 1.0, torch.zeros(losses), ByteLM(SPEC, "nope").state_dict(), {})
    with pytest.raises(ValueError, match=f"resume holds the state after step {step} with {losses} losses"):
        train(ByteLM(SPEC, "nope"), TEXT, seq_len=8, batch_size=4, steps=3, lr=1e-2, seed=0, resume=state,
              progress=False)  # fmt: skip


def test_saves_come_save_every_seconds_apart_and_count_the_resumed_state_s_seconds(monkeypatch):
    """On a clock that advances one second per step: with save_every=30, of the checks after steps 1, 21, 41 and
    61 only 41's saves (61 is 20 s after it); a resumed state's seconds are added to every later one's."""
    clock = [0.0]
    real_windows_at = train_module.windows_at

    def one_second_per_step(*args, **kwargs):
        clock[0] += 1.0
        return real_windows_at(*args, **kwargs)

    monkeypatch.setattr(train_module, "windows_at", one_second_per_step)
    monkeypatch.setattr(train_module, "time", types.SimpleNamespace(perf_counter=lambda: clock[0]))
    options = {"seq_len": 8, "batch_size": 2, "steps": 65, "lr": 1e-2, "seed": 0, "progress": False}
    saved: list[TrainState] = []
    train(ByteLM(SPEC, "nope"), TEXT, **options, save=saved.append, save_every=30.0)
    assert [(state.step, state.seconds) for state in saved] == [(41, 41.0)]
    clock[0], later = 0.0, []
    earlier = dataclasses.replace(saved[0], seconds=1000.0)
    result = train(ByteLM(SPEC, "nope"), TEXT, **options, resume=earlier, save=later.append, save_every=0.0)
    assert [(state.step, state.seconds) for state in later] == [(61, 1020.0)] and result.seconds == 1024.0


def test_the_bar_of_a_resumed_run_starts_at_its_step(monkeypatch):
    started = []

    class Bar(train_module.tqdm):
        def __init__(self, *args, **kwargs):
            started.append(kwargs.get("initial", 0))
            super().__init__(*args, **kwargs)

    monkeypatch.setattr(train_module, "tqdm", Bar)
    saved: list[TrainState] = []
    options = {"seq_len": 8, "batch_size": 8, "steps": 25, "lr": 1e-2, "seed": 0, "progress": True}
    train(ByteLM(SPEC, "rope"), TEXT, **options, save=saved.append, save_every=0.0)
    train(ByteLM(SPEC, "rope"), TEXT, **options, resume=saved[-1])
    assert [state.step for state in saved] == [1, 21] and started == [0, 21 * 8 * 8]
