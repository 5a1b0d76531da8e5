"""The lab's training loop: AdamW, linear warmup then cosine decay, gradient clipping, a progress bar.

Deterministic for a given seed on a given machine: the batches come from ``data.train_starts`` (its own seeded
generator) and the loop draws no other random numbers (the model has no dropout).
"""

from __future__ import annotations

import dataclasses
import math
import time

import torch
from tqdm.auto import tqdm

from posenc.lab.data import train_starts, windows_at
from posenc.lab.model import ByteLM, next_byte_loss

# Training losses are kept as this many averages over equal stretches of steps (a curve small enough for JSON).
LOSS_POINTS = 50


@dataclasses.dataclass(frozen=True)
class TrainResult:
    """steps, tokens: what was trained; seconds: wall time of the loop; final_loss: mean loss (nats per byte)
    over the last tenth of the steps; loss_curve: (step, mean loss) over up to LOSS_POINTS equal stretches."""

    steps: int
    tokens: int
    seconds: float
    final_loss: float
    loss_curve: list[tuple[int, float]]

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
) -> TrainResult:
    """Train ``model`` in place on random windows of ``data`` (n,) uint8.

    seq_len: bytes per window the model sees; the batches depend only on (data, seq_len, batch_size, steps, seed).
    Shows a progress bar in tokens/s unless ``progress`` is False.
    """
    starts = train_starts(data, seq_len=seq_len, batch_size=batch_size, steps=steps, seed=seed)
    optimizer = make_optimizer(model, lr=lr, weight_decay=weight_decay)
    device = next(model.parameters()).device
    losses = torch.empty(steps)
    model.train()
    tokens_per_step = batch_size * seq_len
    start = time.perf_counter()
    with tqdm(
        total=steps * tokens_per_step, unit="tok", unit_scale=True, desc=desc, disable=not progress, leave=False
    ) as bar:
        for step in range(steps):
            for group in optimizer.param_groups:
                group["lr"] = lr_at(
                    step, steps=steps, lr=lr, warmup_fraction=warmup_fraction, min_lr_fraction=min_lr_fraction
                )
            batch = windows_at(data, starts[step], seq_len).to(device)
            logits, _ = model(batch[:, :-1])
            loss = next_byte_loss(logits, batch[:, 1:]).mean()
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            if grad_clip > 0:
                torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
            optimizer.step()
            losses[step] = loss.detach()
            bar.update(tokens_per_step)
            if step % 20 == 0 or step == steps - 1:
                bar.set_postfix(loss=f"{losses[step].item():.3f}", refresh=False)
    seconds = time.perf_counter() - start
    model.eval()
    tail = max(1, steps // 10)
    return TrainResult(
        steps=steps,
        tokens=steps * tokens_per_step,
        seconds=seconds,
        final_loss=float(losses[-tail:].mean()),
        loss_curve=_curve(losses),
    )


def _curve(losses: torch.Tensor) -> list[tuple[int, float]]:
    chunks = torch.tensor_split(losses, min(LOSS_POINTS, losses.numel()))
    out, step = [], 0
    for chunk in chunks:
        step += chunk.numel()
        out.append((step, round(float(chunk.mean()), 5)))
    return out
