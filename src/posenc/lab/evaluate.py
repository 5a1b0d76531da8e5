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
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
from torch import nn
from tqdm.auto import tqdm

from posenc._checks import positive_int
from posenc.absolute import LearnedAbsolute
from posenc.lab.data import eval_text_needed, eval_window_ends, windows_ending
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


@dataclasses.dataclass(frozen=True)
class LengthLoss:
    """A language model's loss at one context length, scored as the lab scores its own models.

    bits_per_token: mean next-token cross-entropy in bits over the k * S scored tokens, all distinct, and
    scored_tokens = k * S (bits per byte where the tokens are bytes); loss_by_position: (L,) float64, bits at each
    input position 0..L-1 of the window (position i predicts token i + 1), averaged over the k windows.
    ``dataclasses.asdict`` gives these fields with the tensor; ``as_dict()`` gives plain Python values.
    """

    length: int
    bits_per_token: float
    scored_tokens: int
    loss_by_position: torch.Tensor

    def as_dict(self) -> dict[str, Any]:
        """Every field as plain Python, for ``json.dumps`` or a ``csv.DictWriter`` (one row per length):
        length int, bits_per_token float, scored_tokens int, loss_by_position a list of L floats (the tensor's)."""
        fields = {field.name: getattr(self, field.name) for field in dataclasses.fields(self)}
        return {**fields, "loss_by_position": self.loss_by_position.tolist()}


def _check_scoring(ends: torch.Tensor, length: int, score_len: int) -> None:
    """Refuse a score_len longer than the window, and ends (k,) so close that some token would be scored twice."""
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


def _logits_of(output: Any, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The logits (b, s, v) in what a model returned for inputs (b, s): a tensor, a Hugging Face ModelOutput's
    ``.logits``, or the first item of a tuple (``ByteLM``'s (logits, attentions), transformers' return_dict=False).
    Raises naming what came back, since cross_entropy's own errors name neither the model nor the fix."""
    logits = getattr(output, "logits", None)
    if logits is None and isinstance(output, (tuple, list)) and output:
        logits = output[0]
    if logits is None and isinstance(output, torch.Tensor):
        logits = output
    if not isinstance(logits, torch.Tensor):
        raise TypeError(
            f"logits_fn must return logits (b, s, vocab) for tokens (b, s), or a tuple or ModelOutput whose logits "
            f"come first or as .logits; got {type(output).__name__}"
        )
    if logits.dim() != 3 or logits.shape[:2] != inputs.shape or not logits.dtype.is_floating_point:
        raise ValueError(
            f"logits_fn must return float logits (b, s, vocab) = ({inputs.shape[0]}, {inputs.shape[1]}, vocab) for "
            f"tokens of shape {tuple(inputs.shape)}: one row of scores per input token, every position predicting "
            f"the next token; got {logits.dtype} logits of shape {tuple(logits.shape)}"
        )
    top = int(targets.max())
    if top >= logits.shape[-1]:
        raise ValueError(
            f"logits_fn returned logits over a vocabulary of {logits.shape[-1]}, but the tokens it is scored on hold "
            f"id {top}: pass tokens of the model's own tokenizer (ids below {logits.shape[-1]})"
        )
    return logits


def _length_loss(
    logits_fn: Callable[[torch.Tensor], Any],
    data: torch.Tensor,
    ends: torch.Tensor,
    length: int,
    *,
    score_len: int,
    batch_size: int,
    device: torch.device | str,
    bar: tqdm | None = None,
) -> LengthLoss:
    """Score windows of ``length`` tokens of context ending at ``ends`` (k,) in ``data`` (n,): every token of each
    window is predicted from the ones before it in the window, and the final ``score_len`` are scored. The one
    scoring of ``evaluate_length`` and ``loss_by_length``; ``logits_fn`` is called once per batch of windows."""
    position_loss = torch.zeros(length, dtype=torch.float64)
    scored_sum = 0.0
    for first in range(0, ends.numel(), batch_size):
        batch = windows_ending(data, ends[first : first + batch_size], length).to(device)
        inputs, targets = batch[:, :-1], batch[:, 1:]
        losses = next_byte_loss(_logits_of(logits_fn(inputs), inputs, targets), targets).double()  # (k, L) nats
        position_loss += losses.sum(0).cpu()
        scored_sum += float(losses[:, -score_len:].sum())
        if bar is not None:
            bar.update(batch.shape[0] * length)
    count = ends.numel()
    return LengthLoss(
        length=length,
        bits_per_token=scored_sum / (count * score_len) / math.log(2),
        scored_tokens=count * score_len,
        loss_by_position=position_loss / count / math.log(2),
    )


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
    clamped. Any other error propagates. A model of one's own (any tokens -> logits callable) is scored the same
    way by ``loss_by_length``.
    """
    _check_scoring(ends, length, score_len)
    start = time.perf_counter()
    device = next(model.parameters()).device
    entropy = torch.zeros(model.spec.layers, dtype=torch.float64)

    def logits_and_entropy(inputs: torch.Tensor) -> torch.Tensor:
        # One forward pass gives both: the attention entropy of the scored queries is summed on the way.
        logits, attentions = model(inputs, return_attention=True)
        for layer, probs in enumerate(attentions):
            entropy[layer] += attention_entropy(probs, score_len).sum().cpu()
        return logits

    model.eval()
    try:
        scored = _length_loss(
            logits_and_entropy, val, ends, length, score_len=score_len, batch_size=batch_size, device=device, bar=bar
        )
    except ValueError as error:
        if _past_learned_table(model, length):
            return LengthResult(eval_len=length, applicable=False, reason=str(error))
        raise
    count = ends.numel()
    bins = min(POSITION_BINS, length)
    return LengthResult(
        eval_len=length,
        applicable=True,
        bits_per_byte=scored.bits_per_token,
        scored_bytes=scored.scored_tokens,
        loss_by_position=[
            round(float(x.mean()), 5) for x in scored.loss_by_position.tensor_split(_bin_edges(length, bins))
        ],
        # positions per bin: bin i covers i * position_bin up to (i + 1) * position_bin, rounded down
        position_bin=length // bins if length % bins == 0 else length / bins,
        entropy_by_layer=[round(float(x), 5) for x in entropy / count],
        seconds=time.perf_counter() - start,
    )


@torch.no_grad()
def loss_by_length(
    logits_fn: Callable[[torch.Tensor], Any],
    tokens: torch.Tensor,
    lengths: Sequence[int],
    *,
    score_len: int,
    windows: int = 256,
    batch_size: int = 16,
    device: torch.device | str | None = None,
) -> list[LengthLoss]:
    """The lab's length curves for any language model: bits per token and loss by position at each context length.

    logits_fn: tokens (b, s) int64 -> logits (b, s, vocab), or a tuple / Hugging Face ModelOutput holding them
    (first, or as ``.logits``): an ``nn.Module`` such as a transformers causal LM, or a function of one's own. The
    vocabulary is read from the logits. tokens: (n,) integer ids of held-out text, one stream (bytes for bits per
    byte). lengths: context lengths L (a list, or a 1-D tensor or array), each >= score_len.

    As ``posenc lab`` does: ``windows`` windows end at the same offsets at every length, spread evenly over
    ``tokens`` with room for the longest (``posenc.lab.data.eval_window_ends``), and only their final ``score_len``
    tokens are scored, so every length is judged on the same tokens and each has at least L - score_len tokens of
    context. The ends depend on max(lengths): a length scored in one call with longer ones is scored on other
    tokens than in a call of its own. With the lab's eval_lengths, eval_windows, score_len, eval_batch_size and
    validation text, and the lab's forward (``lambda t: model(t, return_attention=True)``), the numbers are the lab's
    bit for bit: its ``evaluate_length`` runs this scoring. tokens must hold max(lengths) + 1 + (windows - 1) *
    score_len ids, so that no token is scored twice. An ``nn.Module`` runs in eval mode (its modes are restored
    after) on its parameters' device, unless ``device`` is given (other callables: tokens' device). Returns one
    ``LengthLoss`` per length, in the order given.
    """
    if not isinstance(tokens, torch.Tensor) or tokens.dim() != 1:
        shape = tuple(tokens.shape) if isinstance(tokens, torch.Tensor) else type(tokens).__name__
        raise ValueError(f"tokens must be one (n,) stream of token ids (join documents into one), got {shape}")
    if tokens.dtype.is_floating_point or tokens.dtype.is_complex or tokens.dtype == torch.bool:
        raise TypeError(f"tokens must be an integer tensor of token ids, got {tokens.dtype}")
    # A tensor or array of lengths (np.geomspace(...).astype(int)) has no truth value: "ambiguous" from bool() before.
    given = lengths.tolist() if hasattr(lengths, "tolist") else lengths  # a tensor's or array's, as Python ints
    if isinstance(given, (int, str, bytes)) or not isinstance(given, Iterable) or not (given := list(given)):
        raise ValueError(f"lengths must be a non-empty sequence of context lengths, got {lengths!r}")
    lengths = [positive_int("each of lengths", n) for n in given]
    score_len = positive_int("score_len", score_len)
    windows, batch_size = positive_int("windows", windows), positive_int("batch_size", batch_size)
    if score_len > min(lengths):
        raise ValueError(f"score_len={score_len} must be <= every length, but lengths hold {min(lengths)}")
    if tokens.numel() and int(tokens.min()) < 0:
        raise ValueError(f"tokens must be ids >= 0, got {int(tokens.min())}")
    longest, needed = max(lengths), eval_text_needed(longest=max(lengths), count=windows, score_len=score_len)
    if tokens.numel() < needed:
        fit = max(0, (tokens.numel() - longest - 1) // score_len + 1)
        raise ValueError(
            f"tokens hold {tokens.numel()} ids, but {windows} windows of the longest length {longest} (+1 for the "
            f"last target), each scoring {score_len} tokens none of the others score, need {needed}: pass more "
            f"text, shorter lengths, a shorter score_len or windows <= {fit}"
            if fit
            else f"tokens hold {tokens.numel()} ids, fewer than one window of the longest length {longest} needs "
            f"({longest + 1}, the last target included): pass more text or shorter lengths"
        )
    ends = eval_window_ends(tokens, longest=longest, count=windows)
    if device is None:
        parameter = next(logits_fn.parameters(), None) if isinstance(logits_fn, nn.Module) else None
        device = tokens.device if parameter is None else parameter.device
    modes = {m: m.training for m in logits_fn.modules()} if isinstance(logits_fn, nn.Module) else {}
    try:
        if isinstance(logits_fn, nn.Module):
            logits_fn.eval()  # dropout would make the numbers random
        return [
            _length_loss(logits_fn, tokens, ends, n, score_len=score_len, batch_size=batch_size, device=device)
            for n in lengths
        ]
    finally:
        for module, training in modes.items():
            module.training = training


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
