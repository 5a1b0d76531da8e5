"""A unit's mid-training checkpoint: read back only if it fits the model, written without ever stopping the
training, and the record of the settings each stretch of the unit's steps ran with (train.json's trained_with).

What a checkpoint holds and its file layout are ``train.TrainState``'s; the runner decides where it lives, how often
it is saved (``runner.CHECKPOINT_SECONDS``) and when it is deleted.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError

from posenc.lab import store
from posenc.lab.model import ByteLM
from posenc.lab.train import TrainState, make_optimizer


def load_checkpoint(
    path: Path, identity: dict[str, Any], model: ByteLM, *, echo: Callable[[str], None]
) -> TrainState | None:
    """The training state saved at ``path`` under ``identity`` for ``model``, or None: none saved, or one that
    cannot be resumed (said, and then overwritten by the next checkpoint; it costs only the time it saved)."""
    if not path.exists():
        return None
    try:
        state = TrainState.from_tensors(*store.load_tensors(path), identity)
    except store.RunFolderError as error:
        echo(f"  {path} cannot be read ({error.__cause__}), not resumed: training from step 0")
        return None
    if state is None or not _fits(state, model):
        # A model of other parameters under the same identity: a posenc that changed the model without a new
        # FORMAT_VERSION. Loading it would fail inside load_state_dict on every rerun.
        echo(f"  {path} was saved by another configuration or posenc, not resumed: training from step 0")
        return None
    return state


def settings_trained_with(
    resume: TrainState | None, here: dict[str, Any], *, steps: int, path: Path, echo: Callable[[str], None]
) -> list[dict[str, Any]]:
    """train.json's trained_with for a unit of ``steps`` that trains with the settings ``here`` from step 0, or from
    ``resume``'s step on after those its checkpoint (at ``path``) recorded: says that it resumed, and with what its
    earlier steps ran where that differs from ``here``."""
    trained_with = [{"from_step": 0, **here}]
    if resume is not None:
        echo(f"  resumed at step {resume.step} of {steps} from a checkpoint ({path})")
        trained_with = _trained_with(resume.notes.get("trained_with"), resume.step, here)
        if len(trained_with) > 1:
            before = ", ".join(_described(part) for part in trained_with[:-1])
            echo(
                f"  note: its earlier steps ran with {before}, these with {_described(trained_with[-1])}: the "
                "unit's numbers differ from either setting's in their last bits (train.json's trained_with)"
            )
    return trained_with


def checkpoint_saver(
    path: Path,
    identity: dict[str, Any],
    trained_with: list[dict[str, Any]],
    *,
    is_main: bool,
    echo: Callable[[str], None],
) -> Callable[[TrainState], None]:
    """train()'s ``save``: writes the state to ``path`` under ``identity``, noting ``trained_with``, on the main rank
    only. A state that cannot be written is said once, and training goes on."""
    unsaved: list[str] = []  # why the last checkpoint could not be written, said once

    def save(state: TrainState) -> None:
        if not is_main:
            return
        noted = dataclasses.replace(state, notes={"trained_with": trained_with})
        try:
            store.save_tensors(path, *noted.to_tensors(identity))
        except (OSError, SafetensorError) as error:
            # A checkpoint only saves time: a full disk or quota must not end a training that would finish (the
            # weights at its end are smaller than a checkpoint, which holds the AdamW moments too).
            if not unsaved:
                echo(f"  could not write a checkpoint to {path} ({error}); training goes on without")
            unsaved.append(str(error))

    return save


def _fits(state: TrainState, model: ByteLM) -> bool:
    """Whether ``state`` holds the parameters and buffers ``model`` has, of the same shapes and dtypes, and AdamW
    moments of each parameter's shape."""
    own = model.state_dict()
    if state.model.keys() != own.keys() or state.losses.shape != (state.step,):
        return False
    if any(
        isinstance(own[name], torch.Tensor)
        and (state.model[name].shape != own[name].shape or state.model[name].dtype != own[name].dtype)
        for name in own
    ):
        return False
    # In the optimizer's order of parameters, which its state's indices follow.
    groups = make_optimizer(model, lr=1.0, weight_decay=0.0).param_groups
    shapes = [p.shape for group in groups for p in group["params"]]
    if sorted(state.optimizer) != list(range(len(shapes))):  # every parameter's moments, none other
        return False
    for index, moments in state.optimizer.items():
        if set(moments) != {"exp_avg", "exp_avg_sq", "step"}:
            return False
        if any(key.startswith("exp_avg") and value.shape != shapes[index] for key, value in moments.items()):
            return False
    return True


def _trained_with(earlier: Any, step: int, here: dict[str, Any]) -> list[dict[str, Any]]:
    """The settings a unit resumed at ``step`` trained with: ``earlier``, a checkpoint's list of {"from_step", and
    the settings from it on} (None from a checkpoint that has none: its steps' settings are unknown), then ``here``
    from ``step`` on unless the last part ran with the same."""
    parts = list(earlier) if isinstance(earlier, list) and earlier else [{"from_step": 0}]
    last = {k: v for k, v in parts[-1].items() if k != "from_step"}
    return parts if last == here else [*parts, {"from_step": step, **here}]


def _described(part: dict[str, Any]) -> str:
    if "torch_threads" not in part:
        return "settings the checkpoint does not record"
    return f"{part['torch_threads']} torch thread(s) on {part['device']} in {part['processes']} process(es)"
