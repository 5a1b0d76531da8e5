from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import posenc
from posenc.testing import t5_bucket_reference

CONFIGS = [(32, 128), (32, 64), (16, 32), (8, 20), (64, 256), (4, 3)]


@pytest.mark.parametrize("bidirectional", [False, True])
@pytest.mark.parametrize(("num_buckets", "max_distance"), CONFIGS)
def test_buckets_match_hugging_face_t5_and_reference(bidirectional, num_buckets, max_distance):
    from transformers.models.t5.modeling_t5 import T5Attention

    if bidirectional and num_buckets < 4:
        pytest.skip("bidirectional needs num_buckets >= 4")
    relative = torch.arange(-3000, 3001)
    ours = posenc.t5_relative_bucket(
        relative, bidirectional=bidirectional, num_buckets=num_buckets, max_distance=max_distance
    )
    hf = T5Attention._relative_position_bucket(
        relative, bidirectional=bidirectional, num_buckets=num_buckets, max_distance=max_distance
    )
    assert torch.equal(ours, hf)
    reference = torch.tensor(
        [
            t5_bucket_reference(r, bidirectional=bidirectional, num_buckets=num_buckets, max_distance=max_distance)
            for r in relative.tolist()
        ]
    )
    # The exact reference and T5's float32 logarithm agree everywhere on this range (no edge falls between).
    assert torch.equal(ours, reference)


@pytest.mark.parametrize(
    ("num_buckets", "max_distance", "bidirectional", "relative"),
    [(32, 939, False, -728), (64, 939, True, 728), (64, 1878, False, -1456)],
)
def test_buckets_take_t5s_float32_logarithm_where_float64_differs(num_buckets, max_distance, bidirectional, relative):
    """CONFIGS have no bucket edge between T5's float32 logarithm and exact arithmetic; these do (a model built for
    939 or 1878 tokens gets them as max_distance): there T5's float32 logarithm puts ``relative`` one bucket above
    the exact reference, and posenc must follow T5."""
    from transformers.models.t5.modeling_t5 import T5Attention

    kwargs = dict(bidirectional=bidirectional, num_buckets=num_buckets, max_distance=max_distance)
    assert (
        t5_bucket_reference(relative, **kwargs) + 1
        == T5Attention._relative_position_bucket(torch.tensor([relative]), **kwargs).item()
    )  # the edge is still there
    relatives = torch.arange(-3000, 3001)
    ours = posenc.t5_relative_bucket(relatives, **kwargs)
    assert torch.equal(ours, T5Attention._relative_position_bucket(relatives, **kwargs))


@pytest.mark.parametrize(
    ("relative", "num_buckets", "max_distance", "bucket"),
    [(-8, 9, 128, 5), (-16, 9, 128, 6), (-64, 9, 128, 8), (-16, 9, 4096, 5), (-1024, 9, 4096, 8), (-18, 17, 27, 14)],
)
def test_reference_is_exact_at_edges_where_a_logarithm_lands_on_a_whole_number(
    relative, num_buckets, max_distance, bucket
):
    """log(8 / 4) / log(128 / 4) * 5 is exactly 1, but 0.999... in float64: the reference, which took it in floats,
    put -8 a bucket low, where T5 and posenc (and exact arithmetic) put it. (17, 27, 18): T5's float32 logarithm
    is the one a bucket low, log(18 / 8) / log(27 / 8) * 9 being exactly 6."""
    from transformers.models.t5.modeling_t5 import T5Attention

    kwargs = dict(bidirectional=False, num_buckets=num_buckets, max_distance=max_distance)
    assert t5_bucket_reference(relative, **kwargs) == bucket
    hf = T5Attention._relative_position_bucket(torch.tensor([relative]), **kwargs).item()
    assert posenc.t5_relative_bucket(torch.tensor([relative]), **kwargs).item() == hf
    assert hf == bucket - (num_buckets == 17)


@settings(max_examples=50, deadline=None)
@given(
    config=st.sampled_from(CONFIGS),
    bidirectional=st.booleans(),
    a=st.integers(0, 10_000),
    b=st.integers(0, 10_000),
)
def test_buckets_monotone_in_distance(config, bidirectional, a, b):
    num_buckets, max_distance = config
    near, far = sorted((a, b))
    kwargs = dict(bidirectional=bidirectional, num_buckets=num_buckets, max_distance=max_distance)
    # Attending back (negative relative position) and, when bidirectional, forward.
    for sign in (-1, 1) if bidirectional else (-1,):
        bucket_near, bucket_far = posenc.t5_relative_bucket(torch.tensor([sign * near, sign * far]), **kwargs).tolist()
        assert bucket_near <= bucket_far


def test_bias_uses_table_and_offset():
    t5 = posenc.T5Bias(3, num_buckets=8, max_distance=16)
    bias = t5.bias(2, 6, offset=4)  # queries at 4, 5; keys 0..5
    assert bias.shape == (3, 2, 6)
    for qi, qpos in enumerate((4, 5)):
        for kpos in range(6):
            bucket = t5_bucket_reference(kpos - qpos, bidirectional=False, num_buckets=8, max_distance=16)
            torch.testing.assert_close(bias[:, qi, kpos], t5.table.weight[bucket])


def test_causal_future_shares_bucket_zero():
    # In a causal T5 every future key maps to bucket 0, like distance 0 (the mask hides it anyway).
    buckets = posenc.t5_relative_bucket(torch.tensor([0, 1, 50]), bidirectional=False)
    assert buckets.tolist() == [0, 0, 0]


def _for_model(max_positions: int, **options) -> posenc.T5Bias:
    return posenc.build_for_model("t5", dim=8, num_heads=2, head_dim=4, max_positions=max_positions, **options)


@pytest.mark.parametrize("bidirectional", [False, True])
@pytest.mark.parametrize("train_len", [*range(2, 70), 128, 300, 512])
def test_buckets_built_from_a_model_are_all_reached_in_training(train_len, bidirectional):
    """Every distance of a window 8x the training length (both directions for an encoder) falls in a bucket that a
    distance below the training length also falls in: T5's own max_distance of 128 left the far buckets of a model
    trained on 64 tokens at their initial values, and they were read at every longer distance."""
    t5 = _for_model(train_len, bidirectional=bidirectional)
    last = 8 * train_len - 1
    relative = torch.arange(-last, last + 1) if bidirectional else -torch.arange(last + 1)
    buckets = posenc.t5_relative_bucket(
        relative, bidirectional=bidirectional, num_buckets=t5.num_buckets, max_distance=t5.max_distance
    )
    seen = relative.abs() < train_len
    assert set(buckets.tolist()) <= set(buckets[seen].tolist())
    assert len(set(buckets[seen].tolist())) >= min(train_len, 17)  # and the exact buckets and one more stay in use


@pytest.mark.parametrize(
    ("max_positions", "bidirectional", "sizes"),
    [
        (64, False, (32, 64)),
        (64, True, (32, 64)),
        (8, False, (8, 8)),
        (8, True, (16, 8)),
        (1, False, (2, 2)),
        (512, False, (32, 512)),
        (512, True, (32, 512)),
    ],
)
def test_a_model_built_t5_is_sized_by_the_training_length(max_positions, bidirectional, sizes):
    t5 = _for_model(max_positions, bidirectional=bidirectional)
    assert (t5.num_buckets, t5.max_distance) == sizes


def test_bad_sizes_given_to_a_model_built_t5_are_named():
    with pytest.raises(ValueError, match="num_buckets must be a positive integer, got '32'"):
        _for_model(64, num_buckets="32")
    with pytest.raises(TypeError, match="bidirectional must be True or False"):
        _for_model(64, bidirectional="yes")


def test_options_given_to_a_model_built_t5_are_kept():
    assert (_for_model(64, num_buckets=8).num_buckets, _for_model(64, num_buckets=8).max_distance) == (8, 64)
    assert _for_model(64, num_buckets=np.int64(8)).max_distance == 64  # numpy's integers are sizes too
    assert _for_model(4, num_buckets=32).max_distance == 17  # above its 16 exact buckets, not the invalid 4
    assert _for_model(1).num_buckets == 2  # the fewest T5 takes; a model of one position sees only distance 0
    t5 = _for_model(64, num_buckets=32, max_distance=128)
    assert (t5.num_buckets, t5.max_distance) == (32, 128)  # T5's own, when asked for


@pytest.mark.parametrize(
    "other", [{"max_distance": 1024}, {"bidirectional": True}, {"num_buckets": 16}], ids=lambda o: next(iter(o))
)
def test_a_table_saved_with_other_bucket_settings_is_refused(other):
    """The state dict held only the (num_buckets, h) table: one learned at max_distance 512 loaded into a T5Bias
    reaching 1024 (or into an encoder's), and its values were read at other distances (0.068 apart at 600 tokens)."""
    saved = _for_model(512)
    settings = {"num_buckets": 32, "max_distance": 512, "bidirectional": False}
    target = posenc.T5Bias(2, **{**settings, **other})
    before = target.table.weight.clone()
    with pytest.raises(
        RuntimeError,
        match=r"saved with num_buckets=32, max_distance=512, bidirectional=False, but this T5Bias has .*"
        r"Build the T5Bias with num_buckets=32, max_distance=512, bidirectional=False to load it",
    ):
        target.load_state_dict(saved.state_dict(), strict=False)  # settings are values: refused however loaded
    assert torch.equal(target.table.weight, before)  # refused before the table is copied in
    same = posenc.T5Bias(2, **settings)
    same.load_state_dict(saved.state_dict())
    positions = torch.arange(600)
    assert torch.equal(same.score_bias(positions, positions), saved.score_bias(positions, positions))


def test_a_refused_table_is_named_by_where_it_sits():
    model = torch.nn.ModuleDict({"decoder": _for_model(512)})
    other = torch.nn.ModuleDict({"decoder": _for_model(1024)})
    with pytest.raises(RuntimeError, match=r"table \(under 'decoder\.'\) was saved with .*max_distance=512"):
        other.load_state_dict(model.state_dict())
    with pytest.raises(RuntimeError, match=r"must be an integer tensor \[num_buckets, max_distance, bidirectional\]"):
        other.load_state_dict({**model.state_dict(), "decoder._extra_state": torch.tensor([32.0, 512.0, 0.0])})


def test_a_state_dict_saved_before_the_settings_loads_strictly():
    """State dicts saved by earlier posenc hold the table alone: they still load, strict as well."""
    saved = _for_model(512)
    state = saved.state_dict()
    assert state.pop("_extra_state").tolist() == [32, 512, 0]
    target = _for_model(1024)  # nothing to compare the table against but its shape, as before
    result = target.load_state_dict(state, strict=True)
    assert not result.missing_keys and not result.unexpected_keys
    assert torch.equal(target.table.weight, saved.table.weight)


def test_the_settings_round_trip_through_safetensors(tmp_path):
    from safetensors.torch import load_file, save_file

    saved = _for_model(512, bidirectional=True)
    save_file(saved.state_dict(), str(tmp_path / "t5.safetensors"))
    state = load_file(str(tmp_path / "t5.safetensors"))
    assert state["_extra_state"].tolist() == [32, 512, 1]
    loaded = _for_model(512, bidirectional=True)
    loaded.load_state_dict(state)
    assert torch.equal(loaded.table.weight, saved.table.weight)
    with pytest.raises(RuntimeError, match=r"bidirectional=True, but this T5Bias has .*bidirectional=False"):
        _for_model(512).load_state_dict(state)


@pytest.mark.parametrize("cast", [torch.nn.Module.half, lambda m: m.to(torch.bfloat16), torch.nn.Module.double])
def test_a_cast_keeps_the_settings(cast):
    t5 = cast(_for_model(512))
    settings = t5.state_dict()["_extra_state"]
    assert settings.dtype == torch.int64 and settings.tolist() == [32, 512, 0]
    _for_model(512).load_state_dict(t5.state_dict())  # the table is cast back on load, the settings compared
    with pytest.raises(RuntimeError, match="max_distance=512"):
        _for_model(1024).load_state_dict(t5.state_dict())


def test_the_settings_of_a_bias_built_on_the_meta_device_are_real():
    """Built on the meta device and materialised (to_empty): the settings come from the module, not from memory
    that to_empty leaves uninitialised."""
    with torch.device("meta"):
        t5 = _for_model(512)
        assert t5.state_dict()["_extra_state"].tolist() == [32, 512, 0]
    t5.to_empty(device="cpu")
    assert t5.state_dict()["_extra_state"].tolist() == [32, 512, 0]
    t5.load_state_dict(_for_model(512).state_dict())
    with pytest.raises(RuntimeError, match=r"max_distance=1024, .*max_distance=512"):
        t5.load_state_dict(_for_model(1024).state_dict())


def test_a_state_dict_on_the_meta_device_loads_without_values_to_compare():
    """Meta settings (a state dict moved to meta for shape inference, loaded with assign=True) have no values: they
    are let through, as the meta table is, rather than read (which raises "Cannot copy out of meta tensor")."""
    state = {name: value.to("meta") for name, value in _for_model(512).state_dict().items()}
    with torch.device("meta"):
        t5 = _for_model(512)
    t5.load_state_dict(state, assign=True)
    assert t5.table.weight.is_meta


def test_the_farthest_int64_relative_position_is_the_far_bucket():
    """-2**63 has no int64 negation nor abs: causal T5 put it in bucket 0 (the query itself), bidirectional in bucket
    -2**63, which the table's lookup met as a bare IndexError."""
    far = torch.tensor([-(2**63), -(2**63) + 1, 2**63 - 1])
    assert posenc.t5_relative_bucket(far, bidirectional=False).tolist() == [31, 31, 0]
    assert posenc.t5_relative_bucket(far, bidirectional=True).tolist() == [15, 15, 31]
    t5 = posenc.T5Bias(2, bidirectional=True)
    bias = t5.score_bias(torch.tensor([2**63 - 1]), torch.tensor([-1]))  # key - query = -2**63
    assert torch.equal(bias[0, :, 0, 0], t5.table.weight[15])


@pytest.mark.parametrize("max_positions", [-1, 0, True, "x", None])
def test_from_model_dims_checks_max_positions_as_build_for_model_does(max_positions):
    # -1, 0 and True built 2 buckets reaching 2 without a word; 'x' and None met a bare TypeError of '<'.
    with pytest.raises(ValueError, match="max_positions must be a positive integer"):
        posenc.T5Bias.from_model_dims(dim=8, num_heads=2, head_dim=4, max_positions=max_positions)
