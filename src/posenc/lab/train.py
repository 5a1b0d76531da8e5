"""The lab's training loop: AdamW, linear warmup then cosine decay, gradient clipping, a progress bar.

Deterministic for a given seed on a given machine: the batches come from ``data.train_starts`` (its own seeded
generator) and the loop draws no other random numbers (the model has no dropout).

With several processes (``ranks.world_size > 1``, inside torchrun's process group) every rank draws the same
global batches and takes its equal slice of each; DistributedDataParallel averages the gradients, so each step
is the one-process step up to the order of float additions.
"""

from __future__ import annotations

import dataclasses
import inspect
import json
import math
import time
from collections.abc import Callable
from typing import Any

import torch
from torch.nn.parallel import DistributedDataParallel
from tqdm.auto import tqdm

from posenc.lab.data import train_starts, windows_at
from posenc.lab.dist import Ranks
from posenc.lab.model import ByteLM, next_byte_loss

# Training losses are kept as this many averages over equal stretches of steps (a curve small enough for JSON).
LOSS_POINTS = 50


@dataclasses.dataclass(frozen=True)
class TrainResult:
    """steps, tokens: what was trained (tokens over all ranks); seconds: wall time of the loop; final_loss: mean
    loss (nats per byte) over the last tenth of the steps; loss_curve: (step, mean loss) over up to LOSS_POINTS
    equal stretches; losses: every step's loss on its whole global batch, (steps,) float32 values."""

    steps: int
    tokens: int
    seconds: float
    final_loss: float
    loss_curve: list[tuple[int, float]]
    losses: list[float] = dataclasses.field(default_factory=list)

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else float("nan")


def lr_at(step: int, *, steps: int, lr: float, warmup_fraction: float, min_lr_fraction: float) -> float:
    """Learning rate at ``step`` (0-based): linear warmup over warmup_fraction of steps, then a cosine decay to
    min_lr_fraction * lr at the last step."""
    warmup = math.ceil(warmup_fraction * steps)
    if step < warmup:
        return lr * (step + 1) / warmup
    progress = (step - warmup) / max(1, steps - 1 - warmup)
    return lr * (min_lr_fraction + (1 - min_lr_fraction) * 0.5 * (1 + math.cos(math.pi * progress)))


def make_optimizer(model: ByteLM, *, lr: float, weight_decay: float) -> torch.optim.AdamW:
    """AdamW with weight decay on matrices only (not on norms, biases or the encodings' tables' scale)."""
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.95))


@dataclasses.dataclass(frozen=True)
class TrainState:
    """Training stopped after ``step`` of its steps, all that resuming it needs (the batches and the learning rate
    follow from the step): ``seconds`` of training so far, ``losses`` (step,) float32 on the whole global batch,
    the model's state dict and the optimizer's per-parameter state (AdamW's exp_avg, exp_avg_sq and its step
    count, a float32 tensor), keyed by the parameter's index as in ``Optimizer.state_dict()["state"]``. CPU copies,
    untouched by further training. notes: JSON values the caller keeps with the state, outside its identity (train()
    gives none; the lab's checkpoint module records what the steps so far ran with)."""

    step: int
    seconds: float
    losses: torch.Tensor
    model: dict[str, torch.Tensor]
    optimizer: dict[int, dict[str, torch.Tensor]]
    notes: dict[str, Any] = dataclasses.field(default_factory=dict)

    def to_tensors(self, identity: dict[str, Any]) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
        """The state as safetensors holds it: tensors named ``losses``, ``model.NAME`` and ``optimizer.INDEX.KEY``,
        and one metadata entry (one key: safetensors writes several in a random order) with the step, the seconds
        and ``identity`` (JSON values: what the state belongs to, which ``from_tensors`` must be given again)."""
        tensors = {"losses": self.losses}
        tensors |= {f"model.{name}": tensor for name, tensor in self.model.items()}
        for index, state in self.optimizer.items():
            tensors |= {f"optimizer.{index}.{key}": tensor for key, tensor in state.items()}
        about = {"format": _STATE_FORMAT, "identity": identity, "step": self.step, "seconds": self.seconds}
        if self.notes:
            about["notes"] = self.notes
        return tensors, {_STATE_KEY: json.dumps(about, sort_keys=True)}

    @classmethod
    def from_tensors(
        cls, tensors: dict[str, torch.Tensor], metadata: dict[str, str], identity: dict[str, Any]
    ) -> TrainState | None:
        """The state ``to_tensors`` gave, or None if it was saved under another identity (or is no such state)."""
        try:
            about = json.loads(metadata[_STATE_KEY])
        except (KeyError, json.JSONDecodeError):
            return None
        # Through JSON, so that tuples compare equal to the lists they were stored as.
        if about.get("format") != _STATE_FORMAT or about.get("identity") != json.loads(json.dumps(identity)):
            return None
        model, optimizer = {}, {}
        for name, tensor in tensors.items():
            part, _, rest = name.partition(".")
            if part == "model":
                model[rest] = tensor
            elif part == "optimizer":
                index, _, key = rest.partition(".")
                optimizer.setdefault(int(index), {})[key] = tensor
        if "losses" not in tensors:  # written by something else: nothing to resume
            return None
        return cls(about["step"], about["seconds"], tensors["losses"], model, optimizer, about.get("notes", {}))


# The metadata key of a saved TrainState, and its layout's version: a state of another layout is not resumed.
_STATE_KEY = "posenc_train_state"
_STATE_FORMAT = 1


class TrainingDiverged(ValueError):
    """The loss became nan or inf: the weights are lost and the unit cannot finish (a lower lr can)."""


def train(
    model: ByteLM,
    data: torch.Tensor,
    *,
    seq_len: int,
    batch_size: int,
    steps: int,
    lr: float,
    seed: int,
    warmup_fraction: float = 0.05,
    min_lr_fraction: float = 0.1,
    weight_decay: float = 0.1,
    grad_clip: float = 1.0,
    desc: str = "train",
    progress: bool = True,
    ranks: Ranks | None = None,
    resume: TrainState | None = None,
    save: Callable[[TrainState], None] | None = None,
    save_every: float = 60.0,
) -> TrainResult:
    """Train ``model`` in place on random windows of ``data`` (n,) uint8.

    seq_len: bytes per window the model sees; the batches depend only on (data, seq_len, batch_size, steps, seed).
    batch_size: the global batch; with ``ranks`` of several processes (in an initialised process group) each
    takes rows ``ranks.batch_slice(batch_size)`` of it, and batch_size must divide evenly. Every rank ends with
    the same weights and returns the same losses (nats per byte). Shows a progress bar in tokens/s, with the latest
    loss in bits per byte, unless ``progress`` is False.

    resume: a state that ``save`` was given by a call with the same arguments: training goes on from its step and
    ends with the weights and losses the uninterrupted call gives, bit for bit on the same machine (its seconds are
    the sum of both calls'). save: called on every rank with the state about every ``save_every`` seconds, at the
    bar's checks (every 20 steps) and never after the last step; rank 0's clock decides, so every rank saves at the
    same step. Saving draws no random numbers and changes no number.
    """
    ranks = ranks or Ranks()
    rows = ranks.batch_slice(batch_size)
    starts = train_starts(data, seq_len=seq_len, batch_size=batch_size, steps=steps, seed=seed)[:, rows]
    optimizer = make_optimizer(model, lr=lr, weight_decay=weight_decay)
    device = next(model.parameters()).device
    losses = torch.empty(steps)  # this rank's own, but the first `first`: restored, already means over the ranks
    first, seconds_before = 0, 0.0
    if resume is not None:
        if not 0 < resume.step < steps or resume.losses.shape != (resume.step,):
            raise ValueError(
                f"resume holds the state after step {resume.step} with {resume.losses.numel()} losses, which a call "
                f"of {steps} steps cannot have saved: pass a state saved by a call with these arguments"
            )
        # Before DDP wraps the model, which broadcasts rank 0's weights: every rank resumes the same state anyway.
        model.load_state_dict(resume.model)
        # Optimizer.load_state_dict keeps AdamW's step count where it was (a CPU tensor unless capturable or fused)
        # and puts the rest on the parameters' device; copies, since it holds them and updates them in place.
        saved = {
            index: {key: value.clone() for key, value in state.items()} for index, state in resume.optimizer.items()
        }
        optimizer.load_state_dict({"state": saved, "param_groups": optimizer.state_dict()["param_groups"]})
        first, seconds_before = resume.step, resume.seconds
        losses[:first] = resume.losses
    forward = _data_parallel(model, device) if ranks.world_size > 1 else model
    model.train()
    tokens_per_step = batch_size * seq_len  # over all ranks: the bar shows the run's throughput

    def global_losses(upto: int) -> torch.Tensor:
        """Steps [0, upto)'s losses on the whole global batch: each rank's loss is a mean over the same number of
        tokens, so their mean is the global batch's mean loss. Restored ones are such means already."""
        return torch.cat([losses[:first], ranks.all_reduce_mean(losses[first:upto].to(device)).cpu()])

    start = saved_at = time.perf_counter()
    with tqdm(
        total=steps * tokens_per_step,
        initial=first * tokens_per_step,
        unit="tok",
        unit_scale=True,
        desc=desc,
        disable=not progress,
        leave=False,
    ) as bar:
        for step in range(first, steps):
            for group in optimizer.param_groups:
                group["lr"] = lr_at(
                    step, steps=steps, lr=lr, warmup_fraction=warmup_fraction, min_lr_fraction=min_lr_fraction
                )
            batch = windows_at(data, starts[step], seq_len).to(device)
            logits, _ = forward(batch[:, :-1])
            loss = next_byte_loss(logits, batch[:, 1:]).mean()
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            if grad_clip > 0:
                torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
            optimizer.step()
            losses[step] = loss.detach()
            bar.update(tokens_per_step)
            if step % 20 == 0 or step == steps - 1:
                # The mean over ranks, which every rank then holds: a rank whose own share alone turned inf must not
                # stop while the others wait for it in the next gradient all-reduce.
                shown = ranks.all_reduce_mean(losses[step : step + 1].to(device)).item()
                if not math.isfinite(shown):
                    raise TrainingDiverged(
                        f"training diverged: the loss is {shown} at step {step + 1} of {steps} with peak lr {lr:g}; "
                        "lower the learning rate (--lr)"
                    )
                # In bits per byte, the unit of everything else the lab reports (the loss itself is in nats).
                bar.set_postfix({"bits/byte": f"{shown / math.log(2):.3f}"}, refresh=False)
                # Rank 0's clock, told to all: the losses' reduction below is a collective, which every rank must join.
                if (
                    save is not None
                    and step < steps - 1
                    and ranks.broadcast(time.perf_counter() - saved_at >= save_every)
                ):
                    save(
                        TrainState(
                            step + 1,
                            seconds_before + time.perf_counter() - start,
                            global_losses(step + 1),
                            _cpu_copy(model.state_dict()),
                            {i: _cpu_copy(state) for i, state in optimizer.state_dict()["state"].items()},
                        )
                    )
                    saved_at = time.perf_counter()
    seconds = seconds_before + time.perf_counter() - start
    model.eval()
    # One reduction after the loop, not one per step: the loss never feeds back into training.
    losses = global_losses(steps)
    tail = max(1, steps // 10)
    return TrainResult(
        steps=steps,
        tokens=steps * tokens_per_step,
        seconds=seconds,
        final_loss=float(losses[-tail:].mean()),
        loss_curve=_curve(losses),
        losses=losses.tolist(),
    )


def _data_parallel(model: ByteLM, device: torch.device) -> DistributedDataParallel:
    """``model`` wrapped to average its gradients over the default process group during backward."""
    # No buffer sync before each forward: the encodings' buffers (slopes, cos/sin tables) are computed identically
    # on every rank from the config, and RoPE's table grows lazily, so broadcasting them would only cost time.
    # torch 2.13 renamed the option; torch >= 2.8 (our floor) has the old name.
    renamed = "forward_sync_buffers" in inspect.signature(DistributedDataParallel).parameters
    options = {"forward_sync_buffers": False} if renamed else {"broadcast_buffers": False}
    return DistributedDataParallel(model, device_ids=[device] if device.type == "cuda" else None, **options)


def _cpu_copy(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    # Copies even on the CPU: the originals change with the next step, and tied weights must not share memory in
    # safetensors.
    return {name: tensor.detach().to("cpu", copy=True) for name, tensor in tensors.items()}


def _curve(losses: torch.Tensor) -> list[tuple[int, float]]:
    chunks = torch.tensor_split(losses, min(LOSS_POINTS, losses.numel()))
    out, step = [], 0
    for chunk in chunks:
        step += chunk.numel()
        out.append((step, round(float(chunk.mean()), 5)))
    return out
