"""ByteLM: every encoding through the same code, one shared encoding instance, causality, and extensions
loading the trained rope weights."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch._subclasses.fake_tensor import FakeTensorMode

import posenc
from posenc.lab.config import EXTENSIONS, extension_rope_parameters
from posenc.lab.model import ByteLM, ModelSpec, encoding_for, next_byte_loss

SPEC = ModelSpec(dim=16, layers=2, heads=2, max_positions=8)


@pytest.mark.parametrize("encoding", posenc.available())
def test_every_encoding_runs_with_one_shared_instance(encoding):
    torch.manual_seed(0)
    model = ByteLM(SPEC, encoding)
    inside = None if model.encoding.acts_on is posenc.ActsOn.INPUT else model.encoding  # input: added once
    assert all(block.attn.encoding is inside for block in model.blocks)
    tokens = torch.randint(0, 256, (3, 8))
    logits, attentions = model(tokens, return_attention=True)
    assert logits.shape == (3, 8, 256) and len(attentions) == SPEC.layers
    for probs in attentions:
        assert probs.shape == (3, 2, 8, 8)
        torch.testing.assert_close(probs.sum(-1), torch.ones(3, 2, 8))
        assert bool((probs.triu(diagonal=1) == 0).all())  # causal
    plain, none = model(tokens)
    assert none == [] and torch.allclose(plain, logits, atol=1e-5)


@settings(max_examples=10, deadline=None)
@given(encoding=st.sampled_from(posenc.available()), cut=st.integers(1, 7))
def test_changing_later_bytes_never_changes_earlier_logits(encoding, cut):
    torch.manual_seed(1)
    model = ByteLM(SPEC, encoding)
    tokens = torch.randint(0, 256, (2, 8), generator=torch.Generator().manual_seed(cut))
    changed = tokens.clone()
    changed[:, cut:] = (changed[:, cut:] + 1) % 256
    with torch.no_grad():
        a, _ = model(tokens)
        b, _ = model(changed)
    torch.testing.assert_close(a[:, :cut], b[:, :cut], rtol=1e-5, atol=1e-5)


def test_every_encoding_starts_from_the_same_shared_weights():
    """For a seed, the weights every model has (embedding, projections, norms) are the same whatever the encoding,
    so that encodings are compared in pairs; learned and t5 draw their tables from a stream of their own (they
    used to shift every weight drawn after them). The caller's generator moves as it does for rope."""
    shared = {}
    for encoding in posenc.available():
        torch.manual_seed(0)
        model = ByteLM(SPEC, encoding)
        after = torch.rand(1)
        # The encoding's own tables (registered by the model and again by each attention layer) set aside.
        state = {k: v for k, v in model.state_dict().items() if not k.startswith("encoding.") and ".encoding." not in k}
        shared[encoding] = (state, after)
    reference, after = shared["rope"]
    for encoding, (state, drawn) in shared.items():
        assert state.keys() == reference.keys(), encoding
        assert all(torch.equal(state[k], reference[k]) for k in state), encoding
        assert torch.equal(drawn, after), encoding
    torch.manual_seed(0)
    first = ByteLM(SPEC, "t5").encoding.table.weight
    torch.manual_seed(1)
    assert not torch.equal(first, ByteLM(SPEC, "t5").encoding.table.weight)  # the seed still sets the tables


@pytest.mark.parametrize("encoding", ["learned", "t5", "alibi"])
def test_a_model_builds_on_the_meta_device_and_under_a_fake_tensor_mode(encoding):
    """The encoding's seed was drawn in the ambient device context and read with int(): on the meta device that read
    raised torch's "Tensor.item() cannot be called on meta tensors", and under a FakeTensorMode its
    DataDependentOutputException, so the lab model could not be built for shape inference or for to_empty. Now
    the seed is the CPU generator's draw, the same one an ordinary build makes."""
    torch.manual_seed(0)
    eager = ByteLM(SPEC, encoding)
    tokens = torch.randint(0, 256, (2, 8))
    with torch.device("meta"):
        torch.manual_seed(0)
        meta = ByteLM(SPEC, encoding)
    assert meta(tokens.to("meta"))[0].shape == (2, 8, 256)
    meta.to_empty(device="cpu")
    meta.load_state_dict(eager.state_dict())
    torch.testing.assert_close(meta(tokens)[0], eager(tokens)[0], rtol=0, atol=0)
    with FakeTensorMode():
        fake = ByteLM(SPEC, encoding)
        assert fake(torch.randint(0, 256, (2, 8)))[0].shape == (2, 8, 256)


@pytest.mark.parametrize("train_len", [*range(2, 70), 128, 300, 512])
def test_the_lab_t5_keeps_the_bucket_sizes_its_runs_were_made_with(train_len):
    """The sizes the lab gave T5 itself from format 2 on, now build_for_model's (tests/bias/test_t5.py checks that
    training reaches every bucket they use): other sizes would change a run's T5 numbers under the same config_id."""
    t5 = encoding_for(ModelSpec(dim=16, layers=1, heads=2, max_positions=train_len), "t5")
    assert (t5.num_buckets, t5.max_distance, t5.bidirectional) == (min(32, train_len), train_len, False)


def test_learned_table_refuses_to_run_past_its_size():
    model = ByteLM(SPEC, "learned")
    with pytest.raises(ValueError, match="outside the learned table of max_positions=8"):
        model(torch.zeros(1, 9, dtype=torch.long))


@pytest.mark.parametrize("extension", list(EXTENSIONS))
def test_extended_model_takes_the_trained_rope_weights(extension):
    torch.manual_seed(0)
    trained = ByteLM(SPEC, "rope")
    params = extension_rope_parameters(extension, 4.0, SPEC.max_positions)
    extended = ByteLM(SPEC, "rope", {"rope_parameters": params})
    extended.load_state_dict(trained.state_dict(), strict=True)
    assert extended.encoding.rope_type == params["rope_type"]
    assert extended.encoding.max_position_embeddings == SPEC.max_positions
    tokens = torch.randint(0, 256, (1, 32))
    with torch.no_grad():
        differs = not torch.allclose(trained(tokens)[0], extended(tokens)[0])
    assert differs  # the rebuilt RoPE really rotates differently at 4x the trained length


def test_unknown_options_are_errors_not_ignored():
    with pytest.raises(TypeError):
        ByteLM(SPEC, "alibi", {"base": 500.0})
    with pytest.raises(ValueError, match="unknown encoding 'xpos'"):
        ByteLM(SPEC, "xpos")


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"dim": 0}, "ModelSpec.dim must be a positive integer"),
        ({"dim": 18, "heads": 4}, "divisible by heads=4"),
    ],
)
def test_model_spec_validation(kwargs, message):
    base = {"dim": 16, "layers": 1, "heads": 2, "max_positions": 8}
    with pytest.raises(ValueError, match=message):
        ModelSpec(**{**base, **kwargs})


@pytest.mark.parametrize("encoding", ["nope", "alibi", "t5", "learned"])
def test_odd_head_dims_train_every_encoding_but_rope(encoding):
    """Only RoPE rotates pairs of a head's channels; the others take heads of 3 channels."""
    spec = ModelSpec(dim=12, layers=1, heads=4, max_positions=8)
    logits, _ = ByteLM(spec, encoding)(torch.randint(0, 256, (2, 8)))
    assert logits.shape == (2, 8, 256)
    with pytest.raises(ValueError, match=r"head_dim=3 is odd and RoPE rotates channels in pairs: pass rotary_dim=2"):
        ByteLM(spec, "rope")


def test_next_byte_loss_is_cross_entropy_per_position():
    logits = torch.randn(2, 5, 256, dtype=torch.float64)
    targets = torch.randint(0, 256, (2, 5))
    expected = -logits.log_softmax(-1).gather(-1, targets[..., None])[..., 0]
    torch.testing.assert_close(next_byte_loss(logits, targets), expected.float())


def test_tokens_of_another_shape_are_a_clear_error():
    model = ByteLM(ModelSpec(dim=16, layers=1, heads=2, max_positions=8), "rope")
    with pytest.raises(ValueError, match=r"tokens must be a \(b, s\) tensor of byte ids, got \(5,\)"):
        model(torch.zeros(5, dtype=torch.long))


def test_byte_ids_up_to_255_run_and_256_is_named():
    model = ByteLM(ModelSpec(dim=16, layers=1, heads=2, max_positions=8), "rope")
    assert model(torch.tensor([[0, 255]]))[0].shape == (1, 2, 256)
    with pytest.raises(ValueError, match=r"tokens must be byte ids in 0..255, got ids from 0 to 256"):
        model(torch.tensor([[0, 256]]))


def test_bytes_enter_the_first_block_at_unit_scale():
    # The embedding is drawn N(0, 1/dim) and scaled by sqrt(dim): the first block sees bytes of RMS about 1, as large
    # as a sinusoidal encoding's values, not 1/sqrt(dim) of them.
    torch.manual_seed(0)
    model = ByteLM(ModelSpec(dim=64, layers=1, heads=2, max_positions=256), "nope")
    seen = []
    model.blocks[0].register_forward_pre_hook(lambda module, args, kwargs: seen.append(args[0]), with_kwargs=True)
    with torch.no_grad():
        model(torch.arange(256)[None])
    rms = float(seen[0].pow(2).mean().sqrt())
    assert 0.9 < rms < 1.1, rms
