"""Sliding-window evaluation at several context lengths, as in the ALiBi paper's Tables 13-15.

Every length L scores the same final ``score_len`` bytes of windows that end at the same offsets, so a longer
context never gets credit for scoring bytes that had little context: each scored byte has at least
L - score_len bytes before it. Reported: bits per byte on those bytes, the loss at every position of the window,
the attention entropy of the scored queries by layer, and optionally exact-match accuracy on a copy or passkey
task. Shape key: k windows, L context length, S scored bytes, l layers, h heads.
"""

from __future__ import annotations

import dataclasses
import math
import time

import torch
from tqdm.auto import tqdm

from posenc.absolute import LearnedAbsolute
from posenc.lab.data import windows_ending
from posenc.lab.model import ByteLM, next_byte_loss

# Loss by position is kept as at most this many equal bins per length (curves small enough for JSON).
POSITION_BINS = 64


def _bin_edges(length: int, bins: int) -> list[int]:
    """The inner edges of ``bins`` bins of length / bins positions each, rounded down: bin i covers
    floor(i * length / bins) up to floor((i + 1) * length / bins), so the bins' centres are where the report's
    plot puts them, (i + 0.5) * length / bins, to within half a position."""
    return [i * length // bins for i in range(1, bins)]


@dataclasses.dataclass(frozen=True)
class LengthResult:
    """One model at one context length.

    applicable False means the model cannot run at this length at all (``reason`` says why) and every number is
    None. bits_per_byte: mean over the k * S scored bytes, all distinct (the windows end at least S apart), and
    scored_bytes = k * S; loss_by_position: bits per byte averaged over windows at each position 0..L-1, in up to
    POSITION_BINS bins of ``position_bin`` positions (L / bins: a fraction where the bins of a length that is no
    multiple of them hold one position more or less); entropy_by_layer: mean attention entropy (nats) of the scored
    queries, over heads and windows, per layer; task_accuracy: fraction of task samples answered exactly,
    task_byte_accuracy: fraction of their answer bytes predicted (None when no task ran).
    """

    eval_len: int
    applicable: bool
    reason: str = ""
    bits_per_byte: float | None = None
    scored_bytes: int = 0
    loss_by_position: list[float] | None = None
    position_bin: float = 1
    entropy_by_layer: list[float] | None = None
    task_accuracy: float | None = None
    task_byte_accuracy: float | None = None
    seconds: float = 0.0


def attention_entropy(probs: torch.Tensor, last: int) -> torch.Tensor:
    """probs: (k, h, L, L) rows summing to 1. Returns (k,) the entropy in nats of the last ``last`` query rows,
    averaged over heads and those rows; masked entries (p = 0) contribute 0."""
    rows = probs[:, :, -last:].double()
    entropy = -(rows * rows.clamp_min(1e-300).log()).sum(-1)  # (k, h, last)
    return entropy.mean(dim=(1, 2))


@torch.no_grad()
def evaluate_length(
    model: ByteLM,
    val: torch.Tensor,
    ends: torch.Tensor,
    length: int,
    *,
    score_len: int,
    batch_size: int = 16,
    bar: tqdm | None = None,
) -> LengthResult:
    """Score ``model`` with windows of ``length`` bytes of context ending at ``ends`` (k,) in ``val`` (n,) uint8.

    ``ends`` must be at least ``score_len`` apart (a ValueError otherwise), so that no byte is scored twice. A
    learned absolute table shorter than ``length`` is reported not applicable with the table's own error, never
    clamped. Any other error propagates.
    """
    if not 0 < score_len <= length:
        raise ValueError(f"score_len must be in [1, length={length}], got {score_len}")
    gap = int(ends.sort().values.diff().min()) if ends.numel() > 1 else score_len
    if gap < score_len:
        # Overlapping scored bytes would count some bytes several times in bits_per_byte and scored_bytes.
        raise ValueError(
            f"two of the {ends.numel()} ends are {gap} bytes apart, so with score_len={score_len} some bytes would "
            "be scored more than once: ends must be at least score_len apart (eval_window_ends spreads them so on "
            "text of eval_text_needed(...) bytes); use fewer windows, a shorter score_len or more text"
        )
    start = time.perf_counter()
    device = next(model.parameters()).device
    position_loss = torch.zeros(length, dtype=torch.float64)
    entropy = torch.zeros(model.spec.layers, dtype=torch.float64)
    scored_sum = 0.0
    model.eval()
    for first in range(0, ends.numel(), batch_size):
        batch = windows_ending(val, ends[first : first + batch_size], length).to(device)
        try:
            logits, attentions = model(batch[:, :-1], return_attention=True)
        except ValueError as error:
            if _past_learned_table(model, length):
                return LengthResult(eval_len=length, applicable=False, reason=str(error))
            raise
        losses = next_byte_loss(logits, batch[:, 1:]).double()  # (k, L) nats
        position_loss += losses.sum(0).cpu()
        scored_sum += float(losses[:, -score_len:].sum())
        for layer, probs in enumerate(attentions):
            entropy[layer] += attention_entropy(probs, score_len).sum().cpu()
        if bar is not None:
            bar.update(batch.shape[0] * length)
    count = ends.numel()
    bins = min(POSITION_BINS, length)
    per_position = position_loss / count / math.log(2)
    return LengthResult(
        eval_len=length,
        applicable=True,
        bits_per_byte=scored_sum / (count * score_len) / math.log(2),
        scored_bytes=count * score_len,
        loss_by_position=[round(float(x.mean()), 5) for x in per_position.tensor_split(_bin_edges(length, bins))],
        # positions per bin: bin i covers i * position_bin up to (i + 1) * position_bin, rounded down
        position_bin=length // bins if length % bins == 0 else length / bins,
        entropy_by_layer=[round(float(x), 5) for x in entropy / count],
        seconds=time.perf_counter() - start,
    )


def _past_learned_table(model: ByteLM, length: int) -> bool:
    # The one case where a model cannot run at a length: a learned table has no rows past its size.
    encoding = model.encoding
    return isinstance(encoding, LearnedAbsolute) and length > encoding.max_positions


# A uniform guess's per-byte accuracy on each task's answers.
TASK_CHANCE = {"passkey": "1/10, a digit", "copy": "1/26, a lowercase letter"}


@dataclasses.dataclass(frozen=True)
class TaskSamples:
    """Inputs (k, L) int64 with a needle near the start; answer_positions (A,): the input positions whose
    next-byte predictions must equal answers (k, A)."""

    inputs: torch.Tensor
    answer_positions: torch.Tensor
    answers: torch.Tensor


def task_samples(kind: str, filler: torch.Tensor, *, seed: int) -> TaskSamples:
    """Build ``copy`` or ``passkey`` samples from filler windows (k, L) of validation text.

    passkey: ``passkey = "NNNNN"`` is written at the start, and the window ends with ``passkey = "`` followed by
    the five digits, which must be predicted exactly. copy: 24 random lowercase letters at the start, and the
    window ends with them again; given the first 8, the other 16 must be predicted exactly. Either way the model
    must retrieve bytes from about L positions back.
    """
    k, length = filler.shape
    generator = torch.Generator().manual_seed(seed)
    if kind == "passkey":
        digits = torch.randint(ord("0"), ord("9") + 1, (k, 5), generator=generator)
        cue, close = _bytes('\npasskey = "', k), _bytes('"\n', k)
        needle = torch.cat((cue, digits, close), dim=1)
        query, answers = cue, digits
    elif kind == "copy":
        letters = torch.randint(ord("a"), ord("z") + 1, (k, 24), generator=generator)
        needle = torch.cat((_bytes("\n", k), letters, _bytes("\n", k)), dim=1)
        query, answers = torch.cat((_bytes("\n", k), letters[:, :8]), dim=1), letters[:, 8:]
    else:
        raise ValueError(f"unknown task {kind!r}; known tasks: copy, passkey")
    tail = torch.cat((query, answers), dim=1)
    if needle.shape[1] + tail.shape[1] > length:
        raise ValueError(
            f"the {kind} task needs windows of {needle.shape[1] + tail.shape[1] - 1} bytes of context, more than "
            f"{length - 1}; evaluate at longer lengths (--eval-lengths, --train-len) or run no task"
        )
    window = filler.clone()
    window[:, : needle.shape[1]] = needle
    window[:, -tail.shape[1] :] = tail
    # The prediction of answer byte j is made at the position just before it.
    answer_positions = torch.arange(length - answers.shape[1] - 1, length - 1)
    return TaskSamples(inputs=window[:, :-1], answer_positions=answer_positions, answers=answers)


def _bytes(text: str, k: int) -> torch.Tensor:
    return torch.tensor(list(text.encode()), dtype=torch.long).expand(k, -1)


@dataclasses.dataclass(frozen=True)
class TaskScore:
    """exact: fraction of samples whose every answer byte is predicted; per_byte: fraction of answer bytes predicted.
    per_byte tells partial retrieval from none where exact is 0 for both (chance: ``TASK_CHANCE``)."""

    exact: float
    per_byte: float


@torch.no_grad()
def task_accuracy(model: ByteLM, samples: TaskSamples, *, batch_size: int = 16) -> TaskScore:
    """How many answer bytes are the model's argmax prediction (teacher-forced), by sample and by byte."""
    device = next(model.parameters()).device
    exact = per_byte = 0
    for first in range(0, samples.inputs.shape[0], batch_size):
        inputs = samples.inputs[first : first + batch_size].to(device)
        logits, _ = model(inputs)
        right = logits[:, samples.answer_positions].argmax(-1).cpu() == samples.answers[first : first + batch_size]
        exact += int(right.all(dim=1).sum())
        per_byte += int(right.sum())
    return TaskScore(exact / samples.inputs.shape[0], per_byte / samples.answers.numel())
