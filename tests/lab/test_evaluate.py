"""Sliding-window evaluation: the same scored bytes at every length, bits per byte, entropy, not-applicable
learned tables, the copy / passkey tasks, and loss_by_length's same scoring of any tokens -> logits model."""

from __future__ import annotations

import dataclasses
import json
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from posenc import RoPE
from posenc.lab.data import eval_window_ends, windows_ending
from posenc.lab.evaluate import (
    TaskScore,
    attention_entropy,
    evaluate_length,
    loss_by_length,
    task_accuracy,
    task_samples,
)
from posenc.lab.model import ByteLM, ModelSpec, next_byte_loss

SPEC = ModelSpec(dim=16, layers=2, heads=2, max_positions=8)
TEXT = torch.randint(0, 256, (600,), generator=torch.Generator().manual_seed(0)).to(torch.uint8)


def context_free(model: ByteLM) -> ByteLM:
    """Zero every block's output projections: the logits then depend on the current byte alone."""
    with torch.no_grad():
        for block in model.blocks:
            block.attn.o_proj.weight.zero_()
            block.mlp[2].weight.zero_()
            block.mlp[2].bias.zero_()
    return model


@pytest.mark.parametrize("encoding", ["rope", "alibi", "sinusoidal"])
def test_a_context_free_model_scores_the_same_at_every_length(encoding):
    # If each length scored different bytes, a model that ignores context would score differently.
    torch.manual_seed(0)
    model = context_free(ByteLM(SPEC, encoding))
    if encoding == "sinusoidal":  # the input encoding would still differ by position; take it out
        model.encoding.forward = lambda positions, dtype=torch.float32: torch.zeros(*positions.shape, 16)
    ends = eval_window_ends(TEXT, longest=64, count=9)
    scores = [evaluate_length(model, TEXT, ends, n, score_len=4, batch_size=4).bits_per_byte for n in (8, 16, 64)]
    assert scores[0] == pytest.approx(scores[1], rel=1e-6) and scores[0] == pytest.approx(scores[2], rel=1e-6)


def test_bits_per_byte_is_the_mean_loss_of_the_final_bytes_in_bits():
    torch.manual_seed(0)
    model = ByteLM(SPEC, "rope")
    ends = eval_window_ends(TEXT, longest=32, count=5)
    result = evaluate_length(model, TEXT, ends, 32, score_len=6, batch_size=2)
    batch = windows_ending(TEXT, ends, 32)
    with torch.no_grad():
        losses = next_byte_loss(model(batch[:, :-1])[0], batch[:, 1:]).double()
    assert result.applicable and result.scored_bytes == 30
    # rel 1e-6: evaluation runs the float32 attention that returns probabilities, this check the fused one.
    assert result.bits_per_byte == pytest.approx(float(losses[:, -6:].mean()) / math.log(2), rel=1e-6)
    assert len(result.loss_by_position) == 32 and result.position_bin == 1
    assert result.loss_by_position[-1] == pytest.approx(float(losses[:, -1].mean()) / math.log(2), abs=1e-5)
    with torch.no_grad():
        attentions = model(batch[:, :-1], return_attention=True)[1]
    # Only the scored queries: the early rows see few keys, and counting them lowers the entropy.
    expected = [float(attention_entropy(probs, 6).mean()) for probs in attentions]
    assert result.entropy_by_layer == pytest.approx(expected, abs=1e-5)


def test_score_len_may_be_the_whole_window():
    # A config may set score_len = train_len = an eval length: every byte of each window is then scored.
    torch.manual_seed(0)
    model = ByteLM(SPEC, "rope")
    ends = eval_window_ends(TEXT, longest=8, count=3)
    result = evaluate_length(model, TEXT, ends, 8, score_len=8)
    batch = windows_ending(TEXT, ends, 8)
    with torch.no_grad():
        losses = next_byte_loss(model(batch[:, :-1])[0], batch[:, 1:]).double()
    assert result.scored_bytes == 24
    assert result.bits_per_byte == pytest.approx(float(losses.mean()) / math.log(2), rel=1e-6)


def test_loss_by_position_is_binned_for_long_windows():
    model = ByteLM(SPEC, "nope")
    ends = eval_window_ends(TEXT, longest=256, count=2)
    result = evaluate_length(model, TEXT, ends, 256, score_len=4)
    assert len(result.loss_by_position) == 64 and result.position_bin == 4
    # A length that is no multiple of 64: bins of 100 / 64 positions (1 or 2), not 'position_bin 1', which put
    # the plot's curve on positions 0..64 of a 100-byte window.
    result = evaluate_length(model, TEXT, ends[:1], 100, score_len=4)
    assert len(result.loss_by_position) == 64 and result.position_bin == 100 / 64
    batch = windows_ending(TEXT, ends[:1], 100)
    with torch.no_grad():
        losses = next_byte_loss(model(batch[:, :-1])[0], batch[:, 1:]).double()[0] / math.log(2)
    for i in (0, 1, 31, 63):  # bin i: positions floor(i * 100 / 64) up to floor((i + 1) * 100 / 64)
        first, last = i * 100 // 64, (i + 1) * 100 // 64
        assert result.loss_by_position[i] == pytest.approx(float(losses[first:last].mean()), abs=1e-5)


def test_attention_entropy_of_uniform_causal_attention_is_log_of_the_keys_seen():
    length = 6
    allowed = torch.ones(length, length).tril()
    probs = (allowed / allowed.sum(-1, keepdim=True)).expand(2, 3, length, length)
    expected = sum(math.log(i + 1) for i in range(length - 2, length)) / 2  # last two query rows
    torch.testing.assert_close(attention_entropy(probs, 2), torch.full((2,), expected, dtype=torch.float64))
    one_hot = torch.eye(length).expand(1, 1, length, length)
    assert float(attention_entropy(one_hot, length)) == 0.0


def test_learned_past_its_table_is_not_applicable_with_the_reason():
    model = ByteLM(SPEC, "learned")
    ends = eval_window_ends(TEXT, longest=16, count=3)
    inside = evaluate_length(model, TEXT, ends, 8, score_len=4)
    past = evaluate_length(model, TEXT, ends, 16, score_len=4)
    assert inside.applicable and inside.bits_per_byte is not None
    assert not past.applicable and past.bits_per_byte is None
    assert "outside the learned table of max_positions=8" in past.reason


def test_other_errors_are_not_mistaken_for_not_applicable():
    model = ByteLM(SPEC, "rope")

    def broken(*args, **kwargs):
        raise ValueError("something else went wrong")

    model.blocks[0].attn.forward = broken
    ends = eval_window_ends(TEXT, longest=16, count=3)
    with pytest.raises(ValueError, match="something else went wrong"):
        evaluate_length(model, TEXT, ends, 16, score_len=4)
    # A learned table runs at its own size (8): an error there is not "past the table".
    learned = ByteLM(SPEC, "learned")
    learned.blocks[0].attn.forward = broken
    with pytest.raises(ValueError, match="something else went wrong"):
        evaluate_length(learned, TEXT, ends, SPEC.max_positions, score_len=4)
    with pytest.raises(ValueError, match="score_len must be in"):
        evaluate_length(ByteLM(SPEC, "rope"), TEXT, ends, 8, score_len=9)


def test_ends_closer_than_score_len_are_refused():
    # Their scored bytes overlapped: some bytes counted several times in bits_per_byte, and scored_bytes counted
    # each of them again, with nothing said.
    model = ByteLM(SPEC, "rope")
    with pytest.raises(ValueError, match=r"two of the 3 ends are 3 bytes apart, so with score_len=4 some bytes"):
        evaluate_length(model, TEXT, torch.tensor([20, 30, 33]), 8, score_len=4)
    result = evaluate_length(model, TEXT, torch.tensor([20, 30, 34]), 8, score_len=4)  # 4 apart: none scored twice
    assert result.scored_bytes == 12


class Oracle(nn.Module):
    """Predicts ``targets`` (k, L) for the k known input rows (a stand-in for a perfect model)."""

    def __init__(self, inputs: torch.Tensor, targets: torch.Tensor) -> None:
        super().__init__()
        self.inputs, self.targets = inputs, targets
        self.anchor = nn.Parameter(torch.zeros(1))

    def forward(self, tokens):
        rows = [int((self.inputs == t).all(1).nonzero()[0]) for t in tokens]
        return nn.functional.one_hot(self.targets[rows], 256).float(), []


@pytest.mark.parametrize("kind", ["passkey", "copy"])
def test_task_layout_and_exact_match(kind):
    filler = windows_ending(TEXT, eval_window_ends(TEXT, longest=64, count=4), 64)
    samples = task_samples(kind, filler, seed=1)
    assert samples.inputs.shape == (4, 64)
    full = torch.cat((samples.inputs, samples.answers[:, -1:]), dim=1)
    # The answer is written near the start (the needle) and predicted at the end.
    answer = bytes(samples.answers[0].tolist())
    assert answer in bytes(full[0, :40].tolist()) and bytes(full[0, -len(answer) :].tolist()) == answer
    if kind == "passkey":
        assert answer.isdigit() and len(answer) == 5
    targets = full[:, 1:]
    assert task_accuracy(Oracle(samples.inputs, targets), samples, batch_size=3) == TaskScore(1.0, 1.0)
    answer_bytes = samples.answers.numel()  # 4 samples of 5 digits or 16 letters
    wrong = targets.clone()
    wrong[1, -2] = (wrong[1, -2] + 1) % 256  # one wrong answer byte for sample 1
    wrong[3, -3:] = (wrong[3, -3:] + 1) % 256  # and three for sample 3, the last batch of 3 samples
    assert task_accuracy(Oracle(samples.inputs, wrong), samples, batch_size=3) == TaskScore(
        0.5, (answer_bytes - 4) / answer_bytes
    )
    wrong_filler = targets.clone()
    wrong_filler[2, 5] = (wrong_filler[2, 5] + 1) % 256  # a wrong prediction outside the answer does not count
    assert task_accuracy(Oracle(samples.inputs, wrong_filler), samples) == TaskScore(1.0, 1.0)
    assert torch.equal(task_samples(kind, filler, seed=1).answers, samples.answers)


def test_task_needle_and_tail_byte_by_byte():
    filler = windows_ending(TEXT, eval_window_ends(TEXT, longest=64, count=300), 64)
    before = filler.clone()
    for kind in ("passkey", "copy"):
        samples = task_samples(kind, filler, seed=2)
        assert torch.equal(filler, before), "the filler windows were written over"
        full = torch.cat((samples.inputs, samples.answers[:, -1:]), dim=1)
        assert torch.equal(full[:, 40:-30], filler[:, 40:-30])  # filler between needle and tail
        for row, answer in zip(full.tolist(), samples.answers.tolist(), strict=True):
            text = bytes(row)
            if kind == "passkey":
                key = bytes(answer)
                assert text.startswith(b'\npasskey = "' + key + b'"\n') and text.endswith(b'\npasskey = "' + key)
            else:
                letters = text[1:25]  # 24 letters between newlines; the first 8 cue the other 16
                assert text[0:1] == text[25:26] == b"\n" and letters.isalpha() and letters.islower()
                assert bytes(answer) == letters[8:] and text.endswith(b"\n" + letters)
        # Uniform over the whole alphabet: every digit / letter is drawn.
        assert len(set(samples.answers.flatten().tolist())) == (10 if kind == "passkey" else 26), kind


@pytest.mark.parametrize(("kind", "room"), [("passkey", 35), ("copy", 50)])
def test_a_task_fits_a_window_exactly_its_needle_and_tail_long(kind, room):
    # room: bytes of context the task needs (needle + tail - 1); one byte less is refused.
    fits = task_samples(kind, windows_ending(TEXT, torch.tensor([100, 200]), room), seed=0)
    assert fits.inputs.shape == (2, room)
    full = torch.cat((fits.inputs, fits.answers[:, -1:]), dim=1)
    answer = bytes(fits.answers[0].tolist())
    assert answer in bytes(full[0, : room - len(answer)].tolist()) and bytes(full[0].tolist()).endswith(answer)
    with pytest.raises(ValueError, match=f"needs windows of {room} bytes of context, more than {room - 1}"):
        task_samples(kind, windows_ending(TEXT, torch.tensor([100, 200]), room - 1), seed=0)


def test_task_needs_room_and_a_known_kind():
    filler = windows_ending(TEXT, eval_window_ends(TEXT, longest=16, count=2), 16)
    with pytest.raises(ValueError, match="the passkey task needs windows of 35 bytes of context, more than 16"):
        task_samples("passkey", filler, seed=0)
    with pytest.raises(ValueError, match="unknown task 'needle'"):
        task_samples("needle", filler, seed=0)


def test_evaluation_runs_the_model_in_eval_mode():
    # A freshly built model (the runner's extensions) is in training mode: a dropout, as an --hf-config model's
    # attention_dropout, must not act while it is scored.
    torch.manual_seed(0)
    model = ByteLM(SPEC, "rope")
    model.blocks[0].mlp.append(nn.Dropout(0.5))
    ends = eval_window_ends(TEXT, longest=16, count=3)
    scores = {evaluate_length(model.train(), TEXT, ends, 16, score_len=4).bits_per_byte for _ in range(2)}
    assert len(scores) == 1 and not model.training


# --- loss_by_length: the same scoring for a model the lab did not build ---


class RopeLM(nn.Module):
    """A model of one's own: one causal attention layer with posenc.RoPE over a vocabulary of ``vocab`` tokens.
    tokens (b, s) -> logits (b, s, vocab), in the dtype of its weights."""

    def __init__(self, vocab: int, dim: int = 16, heads: int = 2) -> None:
        super().__init__()
        self.heads = heads
        self.embed = nn.Embedding(vocab, dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.rope = RoPE(dim // heads)
        self.out = nn.Linear(dim, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        b, s = tokens.shape
        x = self.embed(tokens)
        q, k, v = self.qkv(x).view(b, s, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        q, k = self.rope(q, k)
        attended = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out(x + attended.transpose(1, 2).reshape(b, s, -1))


TOKENS = torch.randint(0, 50, (400,), generator=torch.Generator().manual_seed(1))  # a tokenizer's ids, vocab 50


def test_loss_by_length_gives_the_labs_numbers_on_a_bytelm():
    # The lab's own forward (the attention that returns probabilities) gives its numbers bit for bit: one scoring.
    torch.manual_seed(0)
    model = ByteLM(SPEC, "rope")
    lengths, ends = (8, 16, 32), eval_window_ends(TEXT, longest=32, count=9)
    ours = loss_by_length(
        lambda t: model(t, return_attention=True), TEXT, lengths, score_len=4, windows=9, batch_size=4
    )
    for n, result in zip(lengths, ours, strict=True):
        lab = evaluate_length(model, TEXT, ends, n, score_len=4, batch_size=4)
        assert (result.length, result.bits_per_token, result.scored_tokens) == (n, lab.bits_per_byte, 36)
        assert [round(float(x), 5) for x in result.loss_by_position] == lab.loss_by_position  # one bin a position
    # The model itself, called plainly (its fused attention), to float32's rounding.
    plain = loss_by_length(model, TEXT, lengths, score_len=4, windows=9, batch_size=4)
    for result, lab_result in zip(plain, ours, strict=True):
        assert result.bits_per_token == pytest.approx(lab_result.bits_per_token, rel=1e-6)


def test_loss_by_length_matches_a_float64_reference_on_one_window():
    torch.manual_seed(0)
    model = RopeLM(vocab=50)
    (result,) = loss_by_length(model, TOKENS, [24], score_len=6, windows=1)
    # One window ends where the longest fits first: it is TOKENS[0:25], inputs [0:24], targets [1:25].
    with torch.no_grad():
        logits = model.double()(TOKENS[None, :24])[0]
    nats = torch.logsumexp(logits, -1) - logits[torch.arange(24), TOKENS[1:25]]
    bits = nats / math.log(2)
    assert result.scored_tokens == 6 and result.loss_by_position.dtype == torch.float64
    assert result.bits_per_token == pytest.approx(float(bits[-6:].mean()), rel=1e-6)
    torch.testing.assert_close(result.loss_by_position, bits, rtol=1e-6, atol=1e-6)


def test_loss_by_length_results_turn_into_plain_data():
    """LengthLoss had no way to plain data but dataclasses.asdict, whose loss_by_position stays a tensor that
    json.dumps refuses; as_dict() gives every field as Python numbers, one row per length."""
    table = torch.randn(50, 50, generator=torch.Generator().manual_seed(3))
    results = loss_by_length(lambda t: table[t], TOKENS, [8, 16], score_len=4, windows=3)
    rows = json.loads(json.dumps([result.as_dict() for result in results]))
    for row, result in zip(rows, results, strict=True):
        assert row == {
            "length": result.length,
            "bits_per_token": result.bits_per_token,
            "scored_tokens": 12,
            "loss_by_position": result.loss_by_position.tolist(),
        }
        assert len(row["loss_by_position"]) == result.length and set(row) == set(dataclasses.asdict(result))


def test_loss_by_length_scores_the_same_tokens_at_every_length():
    # A model that reads only the current token scores the same at every length only if every length scores the
    # same tokens: the lab's windows, ending at the same offsets.
    table = torch.randn(50, 50, generator=torch.Generator().manual_seed(2))
    results = loss_by_length(lambda t: table[t], TOKENS, [8, 16, 64], score_len=5, windows=20, batch_size=20)
    assert len({r.bits_per_token for r in results}) == 1
    ends = eval_window_ends(TOKENS, longest=64, count=20)
    scored = TOKENS[ends[:, None] - 5 + torch.arange(5)]  # the final 5 targets of each window
    inputs = TOKENS[ends[:, None] - 6 + torch.arange(5)]
    expected = F.cross_entropy(table[inputs].flatten(0, 1), scored.flatten()).double() / math.log(2)
    assert results[0].bits_per_token == pytest.approx(float(expected), rel=1e-6)


def test_loss_by_length_takes_a_transformers_causal_lm():
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        vocab_size=50,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=32,
        attention_dropout=0.5,  # must not act: the model runs in eval mode, and its mode is given back
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).train()
    results = loss_by_length(model, TOKENS, [16, 32], score_len=8, windows=4)  # returns a ModelOutput: .logits
    assert model.training and all(m.training for m in model.modules())
    ends = eval_window_ends(TOKENS, longest=32, count=4)
    model.eval()
    for n, result in zip((16, 32), results, strict=True):
        batch = windows_ending(TOKENS, ends, n)
        with torch.no_grad():
            losses = next_byte_loss(model(batch[:, :-1]).logits, batch[:, 1:]).double() / math.log(2)
        assert result.bits_per_token == pytest.approx(float(losses[:, -8:].mean()), rel=1e-6)
        torch.testing.assert_close(result.loss_by_position, losses.mean(0))
    # return_dict=False: a tuple, logits first (and a cache).
    as_tuple = loss_by_length(lambda t: model(t, return_dict=False), TOKENS, [16, 32], score_len=8, windows=4)
    assert [r.bits_per_token for r in as_tuple] == [r.bits_per_token for r in results]


def test_loss_by_length_says_what_is_wrong():
    table = torch.randn(50, 50)
    with pytest.raises(ValueError, match=r"must return float logits \(b, s, vocab\) = \(3, 8, vocab\) for tokens of "):
        loss_by_length(lambda t: table[t][:, 1:], TOKENS, [8], score_len=4, windows=3)
    with pytest.raises(ValueError, match=r"got torch.int64 logits of shape \(3, 8\)"):
        loss_by_length(lambda t: t, TOKENS, [8], score_len=4, windows=3)
    with pytest.raises(TypeError, match=r"logits_fn must return logits .* got dict"):
        loss_by_length(lambda t: {"scores": table[t]}, TOKENS, [8], score_len=4, windows=3)
    # cross_entropy's own: "IndexError: Target 47 is out of bounds." (an assert on CUDA).
    with pytest.raises(ValueError, match=r"vocabulary of 40, but the tokens it is scored on hold id 4\d"):
        loss_by_length(lambda t: table[t, :40], TOKENS, [8], score_len=4, windows=3)
    with pytest.raises(ValueError, match="tokens hold 400 ids, fewer than one window of the longest length 512"):
        loss_by_length(lambda t: table[t], TOKENS, [8, 512], score_len=4)
    with pytest.raises(ValueError, match=r"256 windows .* need 1085: .* or windows <= 84"):
        loss_by_length(lambda t: table[t], TOKENS, [64], score_len=4)
    with pytest.raises(ValueError, match=r"tokens must be one \(n,\) stream of token ids .* got \(2, 200\)"):
        loss_by_length(lambda t: table[t], TOKENS.view(2, 200), [8], score_len=4, windows=3)
    with pytest.raises(TypeError, match="tokens must be an integer tensor"):
        loss_by_length(lambda t: table[t], TOKENS.float(), [8], score_len=4, windows=3)
    with pytest.raises(TypeError, match=r"tokens must be an integer tensor of token ids, got torch\.bool"):
        loss_by_length(lambda t: table[t], TOKENS > 25, [8], score_len=4, windows=3)
    # A negative id indexes from the end (table[-1]); cross_entropy then fails on it naming neither tokens nor fix.
    with pytest.raises(ValueError, match="tokens must be ids >= 0, got -1"):
        loss_by_length(lambda t: table[t], torch.cat((TOKENS[:-1], torch.tensor([-1]))), [8], score_len=4, windows=3)
    with pytest.raises(ValueError, match="score_len=9 must be <= every length, but lengths hold 8"):
        loss_by_length(lambda t: table[t], TOKENS, [16, 8], score_len=9, windows=3)
    with pytest.raises(ValueError, match="lengths must be a non-empty sequence"):
        loss_by_length(lambda t: table[t], TOKENS, 8, score_len=4, windows=3)
    for empty in ([], torch.tensor([], dtype=torch.long), np.array([], dtype=np.int64), torch.tensor(8)):
        with pytest.raises(ValueError, match="lengths must be a non-empty sequence"):
            loss_by_length(lambda t: table[t], TOKENS, empty, score_len=4, windows=3)


@pytest.mark.parametrize("kind", [torch.tensor, np.array, range], ids=["tensor", "array", "range"])
def test_loss_by_length_takes_lengths_as_a_tensor_or_array(kind):
    """bool() of a tensor or array of lengths raised "Boolean value of Tensor with more than one value is
    ambiguous" (numpy's "truth value of an array ... is ambiguous") from loss_by_length's own emptiness check."""
    table = torch.randn(50, 50)
    given = kind(8, 17, 8) if kind is range else kind([8, 16])
    results = loss_by_length(lambda t: table[t], TOKENS, given, score_len=4, windows=3)
    assert [r.length for r in results] == [8, 16]
    listed = loss_by_length(lambda t: table[t], TOKENS, [8, 16], score_len=4, windows=3)
    assert [r.bits_per_token for r in results] == [r.bits_per_token for r in listed]
