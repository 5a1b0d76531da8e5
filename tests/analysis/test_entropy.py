"""attention_entropy from tensors and from models, against uniform attention worked by hand."""

from __future__ import annotations

import math

import pytest
import torch

import posenc
from posenc.analysis import attention_entropy, read_entropy_csv, write_entropy_csv
from posenc.lab.model import ByteLM, ModelSpec


def uniform_causal(length: int) -> float:
    """Row m spreads over m + 1 keys: entropy log(m + 1); the mean over rows 0..L-1."""
    return sum(math.log(m + 1) for m in range(length)) / length


def test_uniform_scores_by_hand():
    scores = torch.zeros(2, 3, 16, 16)  # (b, h, s, s): equal logits, causal mask applied inside
    result = attention_entropy(scores, [1, 4, 16], values="scores")
    assert result.entropy.shape == (3, 1, 3) and result.source == "scores"
    for i, length in enumerate((1, 4, 16)):
        torch.testing.assert_close(result.entropy[i], torch.full((1, 3), uniform_causal(length), dtype=torch.float64))


def test_one_hot_probabilities_have_zero_entropy():
    probs = torch.eye(8).expand(2, 1, 2, 8, 8)  # (l, b, h, s, s): each query looks at itself only
    result = attention_entropy(probs, [2, 8], values="probs")
    assert torch.equal(result.entropy, torch.zeros(2, 2, 2, dtype=torch.float64))


def test_zero_weight_attention_is_uniform():
    # q and k projections of zero give equal scores: the model's own attention is uniform over the causal prefix.
    attention = posenc.CausalSelfAttention(16, 2, encoding=posenc.RoPE(8))
    torch.nn.init.zeros_(attention.q_proj.weight)
    result = attention_entropy(attention, [5, 12])
    expected = torch.tensor([uniform_causal(5), uniform_causal(12)], dtype=torch.float64)
    torch.testing.assert_close(result.entropy[:, 0, :], expected[:, None].expand(2, 2))


def test_model_entropy_matches_the_models_own_probabilities():
    torch.manual_seed(0)
    model = ByteLM(ModelSpec(dim=32, layers=2, heads=4, max_positions=64), "alibi")
    tokens = torch.randint(0, 256, (2, 40))
    before = model(tokens)[0]
    result = attention_entropy(model, [10, 40], inputs=tokens)
    assert result.entropy.shape == (2, 2, 4)
    for i, length in enumerate((10, 40)):
        _, probs = model(tokens[:, :length], return_attention=True)
        from_tensor = attention_entropy(torch.stack(probs), [length], values="probs")
        torch.testing.assert_close(result.entropy[i], from_tensor.entropy[0])
    # The hooks are gone and the model computes what it did before.
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in model.modules())
    assert torch.equal(model(tokens)[0], before)


def test_csv_round_trip(tmp_path):
    results = {
        ("rope", "none"): attention_entropy(torch.rand(2, 1, 3, 8, 8), [4, 8], values="scores"),
        ("rope", "yarn"): attention_entropy(torch.rand(2, 1, 3, 8, 8), [4, 8], values="scores"),
    }
    path = write_entropy_csv(tmp_path / "entropy.csv", results)
    read = read_entropy_csv(path)
    assert list(read) == ["rope", "rope+yarn"]
    for label, key in (("rope", ("rope", "none")), ("rope+yarn", ("rope", "yarn"))):
        assert torch.equal(read[label].lengths, results[key].lengths)
        assert torch.equal(read[label].entropy, results[key].entropy)


def test_bad_input_is_a_clear_error(tmp_path):
    scores = torch.zeros(1, 1, 4, 4)
    with pytest.raises(ValueError, match="values must be 'probs' or 'scores'"):
        attention_entropy(scores, [4])
    with pytest.raises(ValueError, match="values is for a tensor"):
        attention_entropy(posenc.CausalSelfAttention(8, 2), [4], values="probs")
    with pytest.raises(ValueError, match="lengths go up to 5 but the tensor holds only s=4"):
        attention_entropy(scores, [5], values="scores")
    with pytest.raises(ValueError, match="lengths is empty"):
        attention_entropy(scores, [], values="scores")
    with pytest.raises(ValueError, match="must be >= 0 and sum to 1"):
        attention_entropy(scores, [4], values="probs")
    # Rows that sum to 1 through a negative weight: xlogy of it is NaN, an entropy no figure should show.
    negative = torch.tensor([[1.0, 0.0], [-0.5, 1.5]]).expand(1, 1, 2, 2)
    with pytest.raises(ValueError, match="must be >= 0 and sum to 1"):
        attention_entropy(negative, [2], values="probs")
    with pytest.raises(ValueError, match="weight on future keys"):
        attention_entropy(torch.full((1, 1, 4, 4), 0.25), [4], values="probs")
    with pytest.raises(ValueError, match=r"\(b, h, s, s\) or \(l, b, h, s, s\)"):
        attention_entropy(torch.zeros(4, 5), [4], values="scores")
    with pytest.raises(TypeError, match=r"holds no posenc\.attention\.CausalSelfAttention"):
        attention_entropy(torch.nn.Linear(2, 2), [4])
    with pytest.raises(ValueError, match=r"pass inputs=\.\.\. for a ByteLM"):
        attention_entropy(ByteLM(ModelSpec(dim=16, layers=1, heads=2, max_positions=8), "nope"), [4])
    with pytest.raises(TypeError, match=r"nn\.Module or a tensor"):
        attention_entropy([[0.0]], [1])
    bad = tmp_path / "entropy.csv"
    bad.write_text("encoding,length\nrope,4\n")
    with pytest.raises(ValueError, match="lacks the column"):
        read_entropy_csv(bad)
    # A layer of -1 wrote over the last layer's value; a length of 'abc' was int()'s message, naming no file.
    header = "encoding,extension,length,layer,head,entropy\n"
    for row, column in (("rope,,16,-1,0,5.0", "layer"), ("rope,,abc,0,0,1.0", "length"), ("rope,,0,0,0,1.0", "length")):
        bad.write_text(header + "rope,,16,0,0,1.0\n" + row + "\n")
        with pytest.raises(ValueError, match=rf"entropy\.csv: {column} '.*' is not an integer >= [01]"):
            read_entropy_csv(bad)


@pytest.mark.parametrize("training", [True, False])
def test_the_model_is_handed_back_in_the_mode_it_came_in(training):
    # Measured in eval mode (no dropout), then put back: a training loop that measures entropy keeps training.
    model = ByteLM(ModelSpec(dim=32, layers=1, heads=2, max_positions=16), "rope").train(training)
    attention_entropy(model, [4, 8], inputs=torch.randint(0, 256, (1, 8)))
    assert model.training is training
    assert all(m.training is training for m in model.modules())
