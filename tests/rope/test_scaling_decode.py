"""Decoding across the dynamic-NTK / LongRoPE switch with a KV cache, in both modes.

'consistent': token-by-token decoding equals a full forward pass of the same prefix (every score of a step uses
the frequencies of the whole sequence). 'hf': equals transformers' LlamaAttention + LlamaRotaryEmbedding +
DynamicCache step by step, including dynamic NTK's stateful growth and reset.
"""

from __future__ import annotations

import contextlib
import pickle
import threading
from collections.abc import Iterator
from typing import Any
from unittest import mock

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import posenc.rope.apply as apply_module
import posenc.rope.module as module
from posenc import CausalSelfAttention, KVCache, RoPE, apply_rotary

HEAD_DIM, HEADS, KV_HEADS, MAX_POS, PREFILL, TOTAL = 16, 4, 2, 16, 10, 40
TYPES: dict[str, dict[str, Any]] = {
    "dynamic": {"rope_type": "dynamic", "factor": 4.0, "rope_theta": 10000.0},
    "longrope": {
        "rope_type": "longrope",
        "rope_theta": 10000.0,
        "short_factor": [1.0 + 0.05 * i for i in range(HEAD_DIM // 2)],
        "long_factor": [1.0 + 0.9 * i for i in range(HEAD_DIM // 2)],
        "factor": 4.0,
        "original_max_position_embeddings": MAX_POS,
    },
}


def decode(attn: CausalSelfAttention, x: torch.Tensor) -> torch.Tensor:
    """Prefill PREFILL tokens, then one token at a time; returns (b, TOTAL, dim)."""
    cache = KVCache()
    outs = [attn(x[:, :PREFILL], cache=cache)]
    outs += [attn(x[:, t : t + 1], cache=cache) for t in range(PREFILL, x.shape[1])]
    return torch.cat(outs, dim=1)


def make(rope_type: str, mode: str) -> tuple[CausalSelfAttention, torch.Tensor]:
    torch.manual_seed(0)
    rope = RoPE(HEAD_DIM, rope_parameters=TYPES[rope_type], max_position_embeddings=MAX_POS, mode=mode)
    attn = CausalSelfAttention(HEADS * HEAD_DIM, HEADS, num_kv_heads=KV_HEADS, encoding=rope).double()
    return attn, torch.randn(2, TOTAL, HEADS * HEAD_DIM, dtype=torch.float64)


@pytest.mark.parametrize("rope_type", list(TYPES))
def test_consistent_decoding_equals_full_forward(rope_type: str) -> None:
    attn, x = make(rope_type, "consistent")
    stepped = decode(attn, x)
    for t in range(TOTAL):
        full = attn(x[:, : t + 1])[:, -1]  # a fresh full forward of the prefix, final frequencies for all
        torch.testing.assert_close(stepped[:, t], full, rtol=1e-12, atol=1e-12, msg=f"step {t}")


@pytest.mark.parametrize("rope_type", list(TYPES))
def test_hf_decoding_differs_from_full_forward_past_the_switch(rope_type: str) -> None:
    attn, x = make(rope_type, "hf")
    full_before = attn(x[:, :MAX_POS])[:, -1]  # first: 'hf' dynamic NTK keeps the longest length it has seen
    stepped = decode(attn, x)
    before = (stepped[:, MAX_POS - 1] - full_before).abs().max()
    after = (stepped[:, -1] - attn(x)[:, -1]).abs().max()
    assert before < 1e-12 < 1e-3 < after  # stale keys: the documented Hugging Face behaviour


def test_consistent_cache_rerotates_only_when_frequencies_change(monkeypatch: pytest.MonkeyPatch) -> None:
    attn, x = make("longrope", "consistent")
    rope = attn.encoding
    rotated_lengths: list[int] = []
    original = rope.rotate

    def counting(t: torch.Tensor, positions: torch.Tensor, **kw: Any) -> torch.Tensor:
        rotated_lengths.append(t.shape[2])
        return original(t, positions, **kw)

    monkeypatch.setattr(rope, "rotate", counting)
    decode(attn, x)
    # per call: keys then the query. Prefill rotates 10 keys; steps rotate 1 key, except the step that crosses
    # the original length (position 16, seq_len 17), which rebuilds all 17 keys from the unrotated copy.
    keys = rotated_lengths[0::2]
    assert keys[0] == PREFILL
    assert keys[1:] == [MAX_POS + 1 if t == MAX_POS else 1 for t in range(PREFILL, TOTAL)]


def _hf_attention(rope_type: str) -> tuple[Any, Any, Any]:
    transformers = pytest.importorskip("transformers")
    from transformers.cache_utils import DynamicCache
    from transformers.models.llama.modeling_llama import LlamaAttention, LlamaRotaryEmbedding

    config = transformers.LlamaConfig(
        hidden_size=HEADS * HEAD_DIM,
        num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS,
        head_dim=HEAD_DIM,
        max_position_embeddings=MAX_POS,
        rope_parameters=dict(TYPES[rope_type]),
        attn_implementation="sdpa",
    )
    return LlamaAttention(config, layer_idx=0).double(), LlamaRotaryEmbedding(config), DynamicCache(config=config)


@pytest.mark.parametrize("rope_type", list(TYPES))
def test_hf_mode_decodes_like_transformers(rope_type: str) -> None:
    attn, x = make(rope_type, "hf")
    hf_attn, hf_rotary, hf_cache = _hf_attention(rope_type)
    hf_attn.load_state_dict(attn.state_dict())

    def hf_step(chunk: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        cos_sin = hf_rotary(chunk, positions[None].expand(chunk.shape[0], -1))
        return hf_attn(chunk, position_embeddings=cos_sin, attention_mask=None, cache=hf_cache)[0]

    with torch.no_grad():
        theirs = [hf_step(x[:, :PREFILL], torch.arange(PREFILL))]
        theirs += [hf_step(x[:, t : t + 1], torch.tensor([t])) for t in range(PREFILL, TOTAL)]
        ours = decode(attn, x)
    # transformers builds cos/sin in float32 (angle error <= 40 * 1e-6 here); the rest is float64
    torch.testing.assert_close(ours, torch.cat(theirs, dim=1), rtol=0.0, atol=2e-5)


def test_hf_dynamic_state_grows_and_resets_like_transformers() -> None:
    """The call sequence long -> shorter but past the max -> below the max -> long again."""
    _, hf_rotary, _ = _hf_attention("dynamic")
    rope = RoPE(HEAD_DIM, rope_parameters=TYPES["dynamic"], max_position_embeddings=MAX_POS)
    half = HEAD_DIM // 2
    for length in (8, 40, 20, 17, 12, 30, 64, 16):
        positions = torch.arange(length)[None]
        hf_cos, hf_sin = hf_rotary(torch.zeros(1), positions)
        # x1 = 1, x2 = 0 in every pair: the rotated pair is (cos, sin), so forward shows the frequencies it used
        unit = torch.cat((torch.ones(half), torch.zeros(half))).double().expand(1, 1, length, HEAD_DIM)
        rotated, _ = rope(unit, unit, positions=positions)
        torch.testing.assert_close(rotated[0, 0, :, :half], hf_cos[0, :, :half].double(), rtol=0.0, atol=1e-5)
        torch.testing.assert_close(rotated[0, 0, :, half:], hf_sin[0, :, :half].double(), rtol=0.0, atol=1e-5)
        assert rope.hf_scaled_len == int(hf_rotary.max_seq_len_cached), length


@pytest.mark.parametrize("mode", ["hf", "consistent"])
@pytest.mark.parametrize("rope_type", list(TYPES))
def test_call_cos_sin_is_the_per_step_accessor_that_rotates_as_forward_does(rope_type: str, mode: str) -> None:
    """cos/sin once per step, then apply_rotary (the Hugging Face pattern): call_cos_sin gives what forward rotates
    by, advancing 'hf' dynamic NTK's state as forward does; cos_sin reads no state and scales for its positions."""
    by_forward, by_accessor = (
        RoPE(HEAD_DIM, rope_parameters=TYPES[rope_type], max_position_embeddings=MAX_POS, mode=mode) for _ in range(2)
    )
    torch.manual_seed(0)
    # A long prefill, decode steps at shorter lengths past the max (the prefill's scaling holds in 'hf'), a step that
    # grows it, a call below the max (dynamic's reset), one step after it.
    steps = [torch.arange(30), torch.tensor([20]), torch.tensor([21]), torch.arange(22, 40), torch.arange(10)]
    steps.append(torch.tensor([10]))
    stale = False  # whether some step shows cos_sin scaling for less than forward did
    for positions in steps:
        q = torch.randn(2, HEADS, positions.numel(), HEAD_DIM)
        rotated, _ = by_forward(q, q, positions=positions)
        cos, sin = by_accessor.call_cos_sin(positions)
        torch.testing.assert_close(apply_rotary(q, cos, sin), rotated, rtol=0.0, atol=0.0)
        stateless = apply_rotary(q, *by_accessor.cos_sin(positions))
        stale |= not torch.equal(stateless, rotated)
        if mode == "consistent" or rope_type != "dynamic":
            torch.testing.assert_close(stateless, rotated, rtol=0.0, atol=0.0)
    assert by_forward.hf_scaled_len == by_accessor.hf_scaled_len
    assert stale == (mode == "hf" and rope_type == "dynamic")


def test_call_cos_sin_of_batched_positions_rotates_as_forward_with_the_head_axis_its_docstring_names() -> None:
    """(b, s) positions give (b, s, r/2) cos/sin: with b equal to h, passed to apply_rotary without a head axis they
    broadcast over the heads (head i turned by row i's positions) and no shape check can tell; the docstring's
    recipe, cos[:, None] for (b, h, s, d) and cos[:, :, None] for (b, s, h, d), rotates as forward does."""
    rope = RoPE(HEAD_DIM)
    torch.manual_seed(0)
    positions = torch.stack((torch.arange(5), torch.arange(5) + 7))  # b = 2 rows that differ
    q = torch.randn(2, 2, 5, HEAD_DIM)  # h = b = 2
    rotated, _ = rope(q, q, positions=positions)
    cos, sin = rope.call_cos_sin(positions)
    torch.testing.assert_close(apply_rotary(q, cos[:, None], sin[:, None]), rotated, rtol=0.0, atol=0.0)
    bshd = apply_rotary(q.transpose(1, 2), cos[:, :, None], sin[:, :, None]).transpose(1, 2)
    torch.testing.assert_close(bshd, rotated, rtol=0.0, atol=0.0)
    assert not torch.allclose(apply_rotary(q, cos, sin), rotated)  # the trap: no error, other angles


def test_frequencies_are_computed_once_per_recent_length_and_handed_out_as_copies(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    rope = RoPE(HEAD_DIM, rope_parameters=TYPES["dynamic"], max_position_embeddings=MAX_POS)
    computed: list[int | None] = []
    compute = module.compute_frequencies

    def counting(spec: Any, *, seq_len: int | None = None) -> tuple[torch.Tensor, float]:
        computed.append(seq_len)
        return compute(spec, seq_len=seq_len)

    monkeypatch.setattr(module, "compute_frequencies", counting)
    first, _ = rope.frequencies(40)
    first.zero_()  # a caller writing to its copy changes nothing kept
    again, _ = rope.frequencies(40)
    torch.testing.assert_close(again, compute(rope.spec, seq_len=40)[0], rtol=0, atol=0)
    assert not torch.equal(rope.frequencies(41)[0], again)  # another length, other frequencies
    assert computed == [40, 41]
    for length in range(42, 60):  # only the last few lengths are kept
        rope.frequencies(length)
    rope.frequencies(40)
    assert computed[-1] == 40 and len(computed) == 21
    with pytest.raises(ValueError, match="seq_len must be a positive integer"):
        rope.frequencies(0)


class _Interleaved(RoPE):
    """A RoPE on which another request's call runs right after a call writes the 'hf' dynamic state, as a thread
    sharing the module can: the interleaving that a switch interval of 1 us hit about once in 10^4 calls."""

    other: torch.Tensor | None = None

    def __setattr__(self, name: str, value: Any) -> None:
        super().__setattr__(name, value)
        other = self.__dict__.get("other")
        if name == "hf_scaled_len" and other is not None:
            self.__dict__["other"] = None
            self.scaling_length(other)


@pytest.mark.parametrize(("length", "other", "expected"), [(40, 10, 40), (10, 40, MAX_POS)])
def test_hf_dynamic_call_scales_for_the_state_it_read_when_another_call_changes_it_meanwhile(
    length: int, other: int, expected: int
) -> None:
    """A long call's length read back after a short call's reset scaled it for max_position_embeddings, short of
    its positions (forward raised "seq_len is shorter than the positions"); a short call's read back after a long
    call's growth gave it scaled frequencies where plain ones were due, silently."""
    rope = _Interleaved(HEAD_DIM, rope_parameters=TYPES["dynamic"], max_position_embeddings=MAX_POS)
    rope.scaling_length(torch.arange(30))  # a longer call before: the short call resets, the long one grows
    rope.other = torch.arange(other)
    assert rope.scaling_length(torch.arange(length)) == expected
    plain = RoPE(HEAD_DIM, rope_parameters=TYPES["dynamic"], max_position_embeddings=MAX_POS)
    q = torch.randn(1, HEADS, length, HEAD_DIM)
    rope.scaling_length(torch.arange(30))
    rope.other = torch.arange(other)
    rotated, _ = rope(q, q)
    expected_rotated, _ = plain(q, q, seq_len=expected)
    torch.testing.assert_close(rotated, expected_rotated, rtol=0.0, atol=0.0)


def test_tables_leave_with_a_move_and_stay_out_of_pickles() -> None:
    # Derived caches, rebuilt on use: a move drops the tables of other devices (their memory), and a pickle (a
    # spawned process, deepcopy, torch.save of a model) carries none.
    rope = RoPE(16)
    q = torch.randn(1, 1, 300, 16)
    rope(q, q)
    rope(q.double(), q.double())
    rope(q[:, :, :1], q[:, :, :1], offset=1 << 16)  # past the table: a window
    assert len(rope._tables) == 2 and len(rope._windows) == 1
    twin = pickle.loads(pickle.dumps(rope))
    assert twin._tables == twin._windows == twin._frequencies == {} and len(rope._tables) == 2
    assert torch.equal(twin(q, q)[0], rope(q, q)[0])
    rope.to("meta")
    assert rope._tables == rope._windows == {}


@pytest.mark.parametrize("backend", ["torch", "auto"])
def test_a_negative_offset_is_refused_even_where_the_positions_lift_every_row_above_zero(backend: str) -> None:
    # The table path read the offsets' minimum and went on when offset + positions stayed >= 0.
    q = torch.randn(2, 1, 5, 16)
    with pytest.raises(ValueError, match=r"offset must be >= 0 \(it counts tokens already in the cache\)"):
        RoPE(16, backend=backend)(q, q, offset=torch.tensor([-1, 0]), positions=torch.arange(1, 6))


def test_a_new_length_dependent_type_is_scaled_for_every_length(monkeypatch) -> None:
    """Every length-dependent type but dynamic got its seq_len=None frequencies up to max_position_embeddings (the
    cache key assumed dynamic's plain RoPE there), so a type added to SEQ_LEN_DEPENDENT rotated silently unscaled."""
    from posenc.rope import frequencies, parameters

    def shrinking(*, rotary_dim: int, base: float, seq_len: int | None = None, **_: object):
        return frequencies.default_inv_freq(rotary_dim, base) / (1 + (seq_len or 0) / 100), 1.0

    monkeypatch.setitem(frequencies.SCALINGS, "shrinking", shrinking)
    monkeypatch.setitem(parameters.REQUIRED_KEYS, "shrinking", frozenset())
    monkeypatch.setitem(parameters.OPTIONAL_KEYS, "shrinking", frozenset())
    monkeypatch.setattr(frequencies, "SEQ_LEN_DEPENDENT", frequencies.SEQ_LEN_DEPENDENT | {"shrinking"})
    rope = RoPE(HEAD_DIM, rope_parameters={"rope_type": "shrinking"}, max_position_embeddings=64)
    for length in (10, 64, 100):
        expected = shrinking(rotary_dim=HEAD_DIM, base=10000.0, seq_len=length)[0]
        torch.testing.assert_close(rope.frequencies(length)[0], expected, rtol=0.0, atol=0.0)
        cos, _ = rope.cos_sin(torch.arange(length), dtype=torch.float64)
        torch.testing.assert_close(cos[-1], torch.cos((length - 1) * expected), rtol=1e-15, atol=1e-15)


class _TrackedLock:
    """Stands in for the lock that guards the 'hf' dynamic state, counting how deep the calling thread holds it:
    while it is held, no other thread's change of the state can run."""

    def __init__(self) -> None:
        self.lock, self.depth = threading.RLock(), 0

    def __enter__(self) -> None:
        self.lock.acquire()
        self.depth += 1

    def __exit__(self, *exc: object) -> None:
        self.depth -= 1
        self.lock.release()


class _ReadInterleaved(RoPE):
    """A RoPE on which another request's call runs right after a call's ``at``-th reading of the 'hf' dynamic state
    made outside the lock, as a thread sharing the module can (a switch interval of 1 us, four threads growing it at
    once, lost one update in about 700 rounds). The readings are counted, not recognised by their source text, so
    the test holds whatever way ``scaling_length`` reads and writes the state."""

    other: torch.Tensor | None = None
    at = 0
    lock: _TrackedLock

    @property  # type: ignore[override]
    def hf_scaled_len(self) -> int:
        value = self.__dict__["_state"]
        if self.__dict__.get("other") is not None and not self.lock.depth:
            self.__dict__["at"] -= 1
            if self.__dict__["at"] == 0:
                other, self.__dict__["other"] = self.__dict__["other"], None
                self.scaling_length(other)
        return value

    @hf_scaled_len.setter
    def hf_scaled_len(self, value: int) -> None:
        self.__dict__["_state"] = value


def test_hf_dynamic_state_keeps_the_longest_length_when_two_calls_grow_it_at_once(monkeypatch) -> None:
    """Two growing calls that both read the old state: the shorter one wrote last, so the state fell below the
    longest length seen and a later call scaled for 30 where any one-at-a-time order of the calls scales for 40.
    The other call runs after each unlocked reading in turn, until a call makes fewer readings than that."""
    lock = _TrackedLock()
    # raising=False: the code before the lock had no such name (and fails here for the lost update).
    monkeypatch.setattr("posenc.rope.module._HF_DYNAMIC_LOCK", lock, raising=False)
    q = torch.randn(1, HEADS, 20, HEAD_DIM)
    plain = RoPE(HEAD_DIM, rope_parameters=TYPES["dynamic"], max_position_embeddings=MAX_POS)
    expected, _ = plain(q, q, seq_len=40)
    at = 0
    while True:
        at += 1
        rope = _ReadInterleaved(HEAD_DIM, rope_parameters=TYPES["dynamic"], max_position_embeddings=MAX_POS)
        rope.lock, rope.at, rope.other = lock, at, torch.arange(40)
        assert rope.scaling_length(torch.arange(30)) in (30, 40), at  # either order of the two calls
        if rope.other is not None:  # the call read the state fewer than `at` times: every reading has been tried
            break
        assert rope.hf_scaled_len == 40, f"state {rope.hf_scaled_len} after the other call ran at reading {at}"
        rotated, _ = rope(q, q)
        torch.testing.assert_close(rotated, expected, rtol=0.0, atol=0.0)
    assert at > 1  # the other call did run, after at least one reading


class _GrownWhileWriting(RoPE):
    """A RoPE on which another thread's growing call starts right after a call's ``at``-th reading of the 'hf'
    dynamic state, and is given half a second to finish: where this call holds the lock (its reading again before
    it writes), the other call must wait for this one's write, not write first and be overwritten by it. The
    readings are counted, not recognised by their source text."""

    other: torch.Tensor | None = None
    at = 0
    thread: threading.Thread | None = None

    @property  # type: ignore[override]
    def hf_scaled_len(self) -> int:
        value = self.__dict__["_state"]
        if self.__dict__.get("other") is not None:
            self.__dict__["at"] -= 1
            if self.__dict__["at"] == 0:
                other, self.__dict__["other"] = self.__dict__["other"], None
                thread = self.__dict__["thread"] = threading.Thread(target=self.scaling_length, args=(other,))
                thread.start()
                thread.join(timeout=0.5)  # where this call holds the lock, the other waits for this call's write
        return value

    @hf_scaled_len.setter
    def hf_scaled_len(self, value: int) -> None:
        self.__dict__["_state"] = value


def test_hf_dynamic_state_change_is_held_until_written() -> None:
    """Without the lock, a call growing the state to 40 between this call's last reading (16) and its write (30)
    was overwritten: the state fell to 30, below the longest length seen. The other call starts after each reading
    in turn, until a call makes fewer readings than that."""
    at = 0
    while True:
        at += 1
        rope = _GrownWhileWriting(HEAD_DIM, rope_parameters=TYPES["dynamic"], max_position_embeddings=MAX_POS)
        rope.at, rope.other = at, torch.arange(40)
        assert rope.scaling_length(torch.arange(30)) in (30, 40), at
        if rope.thread is None:  # the call read the state fewer than `at` times: every reading has been tried
            break
        rope.thread.join()
        assert rope.hf_scaled_len == 40, f"state {rope.hf_scaled_len} after the other call started at reading {at}"
    assert at > 2  # the other call started after a reading made again under the lock too


@contextlib.contextmanager
def _per_call_paths() -> Iterator[None]:
    """Inside: LongRoPE's and dynamic NTK's cos/sin computed for each call (the path every length-dependent type took
    before their tables), and the functions' plans left out."""
    tabled = module._tabled
    with (
        mock.patch.object(module, "_tabled", lambda rope_type: rope_type not in TYPES and tabled(rope_type)),
        mock.patch.object(apply_module, "_PLANS", apply_module.Plans(0)),
    ):
        yield


def _computed_per_call(rope: RoPE, *args: Any, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """``rope``'s call with its cos/sin computed for the call (``_per_call_paths``), no plan kept or replayed: a fresh
    copy of the module. The copy's 'hf' state after the call is left in ``rope.per_call_state``."""
    fresh = pickle.loads(pickle.dumps(rope))  # no tables, no plans; 'hf' state as it stands
    with _per_call_paths():
        out = fresh(*args, **kwargs)
    rope.__dict__["per_call_state"] = fresh.hf_scaled_len
    return out


@settings(max_examples=120, deadline=None)
@given(
    rope_type=st.sampled_from(list(TYPES)),
    rows=st.sampled_from(["offset", "offset tensor", "positions", "positions + offset", "positions + offset tensor"]),
    start=st.integers(0, 40),
    s=st.integers(1, 6),
    b=st.integers(1, 2),
    dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float64]),
    backend=st.sampled_from(["auto", "torch"]),
    layout=st.sampled_from(["bhsd", "bshd"]),
    mode=st.sampled_from(["hf", "consistent"]),
    seq_len=st.sampled_from([None, 0, 30]),  # 0: seq_len = the longest position + 1
    seen=st.sampled_from([0, 30]),  # a call of that length before ('hf' dynamic NTK's state grown to it)
    interleaved=st.booleans(),
)
def test_length_dependent_types_read_the_table_of_their_frequencies_bit_for_bit(
    rope_type, rows, start, s, b, dtype, backend, layout, mode, seq_len, seen, interleaved
) -> None:
    """LongRoPE's two sets of frequencies (its short factors up to its original length, its long ones past it) each
    have a kept table, and dynamic NTK's unscaled ones (up to max_position_embeddings, 16 here), read as the fixed
    types' are (a slice at an int offset, rows at ids, replayed decode steps): every call gives the bits of cos/sin
    computed for it, on either side of the switch and across it, by ids, by int or per-sequence offsets, with
    seq_len given or not, and leaves 'hf' dynamic NTK's state where the call computed per call leaves it (grown,
    kept, or reset after a longer call)."""
    limit = 64 if rope_type == "longrope" else MAX_POS
    rope = RoPE(HEAD_DIM, rope_parameters=TYPES[rope_type], max_position_embeddings=limit, mode=mode)
    rope.backend, rope.interleaved = backend, interleaved
    if seen:
        rope.scaling_length(torch.arange(seen))
    generator = torch.Generator().manual_seed(start)
    shape = (b, HEADS, s, HEAD_DIM) if layout == "bhsd" else (b, s, HEADS, HEAD_DIM)
    q, k = (torch.randn(shape, generator=generator, dtype=torch.float64).to(dtype) for _ in range(2))
    ids = (torch.arange(s) * 3 + start) % 40  # not consecutive, on either side of the original length (16)
    per_sequence = torch.arange(b) * 7 + start
    kwargs: dict[str, Any] = {
        "offset": {"offset": start},
        "offset tensor": {"offset": per_sequence},
        "positions": {"positions": ids},
        "positions + offset": {"positions": ids, "offset": start},
        # Rows of their own ids: the sum of the largest offset and the largest id need not be reached.
        "positions + offset tensor": {"positions": torch.stack([ids, ids % 3])[:b], "offset": per_sequence},
    }[rows]
    if seq_len is not None:
        highest = {"offset": start + s - 1, "offset tensor": int(per_sequence.max()) + s - 1}.get(rows)
        if highest is None:
            highest = int(ids.max()) + (start if rows == "positions + offset" else 0)
            if rows == "positions + offset tensor":
                highest = int((kwargs["positions"] + per_sequence[:, None]).max())
        kwargs["seq_len"] = max(seq_len, highest + 1)
    for step in range(2):  # the second replays where the first kept a plan
        want = _computed_per_call(rope, q, k, layout=layout, **kwargs)
        got = rope(q, k, layout=layout, **kwargs)
        for g, w in zip(got, want, strict=True):
            assert g.dtype == w.dtype and torch.equal(g, w), (rows, step)
        assert rope.hf_scaled_len == rope.per_call_state, step


def test_longrope_decode_steps_replay_on_each_side_of_the_switch() -> None:
    """Decode steps with an int offset replay the table of their set of frequencies: across the original length
    (16) one full call takes the long set's table, then the steps replay again; each equals cos/sin computed for it."""
    rope = RoPE(HEAD_DIM, rope_parameters=TYPES["longrope"], max_position_embeddings=64)
    q, k = torch.randn(1, HEADS, 1, HEAD_DIM), torch.randn(1, KV_HEADS, 1, HEAD_DIM)
    with mock.patch.object(module, "rotate_tensors", wraps=module.rotate_tensors) as full:
        got = [rope(q, k, offset=step) for step in range(10, 22)]
    assert full.call_count == 2  # step 10 (short factors) and step 16, whose length 17 is past the original
    assert len({key for key in rope._tables}) == 2
    for step, pair in zip(range(10, 22), got, strict=True):
        for g, w in zip(pair, _computed_per_call(rope, q, k, offset=step), strict=True):
            assert torch.equal(g, w), step


def test_longrope_windows_far_out_hold_the_set_of_frequencies_of_their_call() -> None:
    """Past the table's limit (2**16 rows) calls read windows of rows, kept per set of frequencies as the tables are:
    with an original length past the limit, one window's positions serve the short factors (a call's own length)
    and the long ones (seq_len past the original) in turn, each the bits computed for the call."""
    params = dict(TYPES["longrope"], original_max_position_embeddings=100_000)
    rope = RoPE(HEAD_DIM, rope_parameters=params, max_position_embeddings=400_000)
    q, k = torch.randn(1, HEADS, 2, HEAD_DIM), torch.randn(1, KV_HEADS, 2, HEAD_DIM)
    for kwargs in ({"offset": 70_000}, {"offset": 70_000, "seq_len": 200_000}, {"offset": 70_001}):
        for g, w in zip(rope(q, k, **kwargs), _computed_per_call(rope, q, k, **kwargs), strict=True):
            assert torch.equal(g, w), kwargs
    assert {len(key) for key in rope._windows} == {3, 4}  # the short factors' window and the long ones'


def test_a_captured_longrope_call_without_seq_len_is_refused_not_read_from_a_table() -> None:
    """Where positions cannot be read (a CUDA graph capture, mocked here: a CPU machine captures nothing), the fixed
    types read the table kept before the capture; LongRoPE cannot know which of its sets the call needs, so it
    asks for seq_len as before, rather than read the short factors' table for positions past the original length."""
    rope = RoPE(HEAD_DIM, rope_parameters=TYPES["longrope"], max_position_embeddings=64)
    q, k = torch.randn(1, HEADS, 1, HEAD_DIM), torch.randn(1, KV_HEADS, 1, HEAD_DIM)
    rope(q, k, offset=3)  # keeps the short factors' table
    with mock.patch.object(module, "values_readable", return_value=False), pytest.raises(ValueError, match="seq_len"):
        rope(q, k, positions=torch.tensor([[40]]))


def test_longrope_ids_beside_per_sequence_offsets_scale_for_the_largest_position_reached() -> None:
    """Ids (b, s) beside per-sequence offsets: the length is the largest id + offset of one row (here 10 + 0 and
    2 + 7: 11, the short factors), not the largest offset plus the largest id (17, past the original 16)."""
    rope = RoPE(HEAD_DIM, rope_parameters=TYPES["longrope"], max_position_embeddings=64)
    q, k = torch.randn(2, HEADS, 2, HEAD_DIM), torch.randn(2, KV_HEADS, 2, HEAD_DIM)
    kwargs = {"positions": torch.tensor([[4, 10], [1, 2]]), "offset": torch.tensor([0, 7])}
    for g, w in zip(rope(q, k, **kwargs), _computed_per_call(rope, q, k, **kwargs), strict=True):
        assert torch.equal(g, w)


@pytest.mark.parametrize("seq_len", [None, "s + 3"])
def test_longrope_traced_by_make_fx_with_a_symbolic_length_chooses_its_set_in_the_graph(seq_len) -> None:
    """make_fx(tracing_mode="symbolic") with an int offset: the length (offset + s, or a seq_len made of s) is a
    torch.SymInt, not a compile (compiling() is False). Compared with the original length on the host, the example's
    set of frequencies was baked into the graph, which then gave the short factors past the switch, silently."""
    from torch.fx.experimental.proxy_tensor import make_fx

    rope = RoPE(HEAD_DIM, rope_parameters=TYPES["longrope"], max_position_embeddings=64)
    original = int(TYPES["longrope"]["original_max_position_embeddings"])

    def call(q, k):
        return rope(q, k, offset=3, seq_len=None if seq_len is None else q.shape[2] + 3)

    graph = make_fx(call, tracing_mode="symbolic")(*(torch.randn(1, HEADS, 4, HEAD_DIM) for _ in range(2)))
    for s in (4, original - 3, original - 2, original + 5):  # offset 3 + s: either side of the switch
        q, k = torch.randn(1, HEADS, s, HEAD_DIM), torch.randn(1, KV_HEADS, s, HEAD_DIM)
        for got, want in zip(graph(q, k), call(q, k), strict=True):
            torch.testing.assert_close(got, want, rtol=2.5e-7, atol=2e-7, msg=f"s={s}")


@pytest.mark.parametrize("case", ["layout unknown", "q 2-D"])
def test_longrope_int_offset_calls_with_arguments_refused_get_the_full_paths_error(case) -> None:
    """LongRoPE's replay key reads q's sequence axis by the layout for the set offset + s selects: a layout it does
    not know, or a q without that axis, leave the key to the full path, whose checks say what is wrong (a KeyError
    or an IndexError came from reading the axis)."""
    rope = RoPE(HEAD_DIM, rope_parameters=TYPES["longrope"], max_position_embeddings=64)
    q, k = torch.randn(1, HEADS, 1, HEAD_DIM), torch.randn(1, KV_HEADS, 1, HEAD_DIM)
    layout = "sbhd" if case == "layout unknown" else "bhsd"
    if case == "q 2-D":
        q, k = q[0, 0], k[0, 0]
    message = "layout must be" if case == "layout unknown" else "q must be 4-D"
    with pytest.raises(ValueError, match=message):
        rope(q, k, offset=20, layout=layout)


def test_dynamic_ntk_decode_steps_replay_up_to_the_limit_and_follow_the_hf_state() -> None:
    """Dynamic NTK is plain RoPE up to max_position_embeddings (16): decode steps with an int offset read the
    unscaled table, and replay. In mode 'hf' a call that grows or resets the state, or that scales for a longer
    length seen before (no reset at the limit itself), takes the full path, past the limit reading a window of its
    own rows at the frequencies of its length, and a call of no tokens advances nothing. Each call equals the call
    computed per call, and leaves the state where that one does."""
    rope = RoPE(HEAD_DIM, rope_parameters=TYPES["dynamic"], max_position_embeddings=MAX_POS)
    step = torch.randn(1, HEADS, 1, HEAD_DIM), torch.randn(1, KV_HEADS, 1, HEAD_DIM)
    prefill = torch.randn(1, HEADS, 30, HEAD_DIM), torch.randn(1, KV_HEADS, 30, HEAD_DIM)
    empty = torch.randn(1, HEADS, 0, HEAD_DIM), torch.randn(1, KV_HEADS, 0, HEAD_DIM)
    calls = [  # (q, k, offset, the path taken, the state after it)
        *[(*step, offset, "table" if offset == 5 else "replay", MAX_POS) for offset in range(5, 9)],
        (*prefill, 0, "window", 30),  # grows the state: scaled for 30
        (*empty, 5, "per call", 30),  # no positions: no reset
        (*step, 15, "window", 30),  # length 16, the limit itself: no reset, scaled for 30
        (*step, 9, "table", MAX_POS),  # length 10: reset, unscaled
        (*step, 15, "replay", MAX_POS),
        (*step, 14, "replay", MAX_POS),
        (*step, 16, "window", 17),  # length 17: grows the state, scaled
    ]
    for q, k, offset, path, state in calls:
        with (
            mock.patch.object(module, "rotate_tensors", wraps=module.rotate_tensors) as table,
            mock.patch.object(module, "apply_rotary_qk", wraps=module.apply_rotary_qk) as per_call,
            mock.patch.object(RoPE, "_window", autospec=True, side_effect=RoPE._window) as window,
        ):
            got = rope(q, k, offset=offset)
        called = {"window": window, "table": table, "per call": per_call}
        taken = next((path for path, spy in called.items() if spy.call_count), "replay")
        assert (taken, rope.hf_scaled_len) == (path, state), offset
        want = _computed_per_call(pickle.loads(pickle.dumps(rope)), q, k, offset=offset)
        for g, w in zip(got, want, strict=True):
            assert torch.equal(g, w), offset
    assert list(rope._tables) == [(torch.device("cpu"), torch.float32)]  # no table of scaled frequencies


@pytest.mark.parametrize("mode", ["hf", "consistent"])
@pytest.mark.parametrize("rows", ["offset", "offset tensor", "positions"])
@pytest.mark.parametrize("backend", ["auto", "torch"])
def test_dynamic_ntk_past_its_limit_computes_a_steps_rows_once_for_all_layers(mode, rows, backend) -> None:
    """Past max_position_embeddings every length has frequencies of its own, so no table from row 0 serves a decode
    step: its first layer computes the cos/sin of the step's positions at the step's length, kept as a window of
    exactly those rows, and the step's other layers read them, replayed where they can be (until 2026-12-07 each
    layer computed them again: ~48 against ~11 us a layer, one token of 32 + 8 heads). Every call equals the call
    computed per call, bit for bit, with the same 'hf' state; a decode loop keeps the latest few windows."""
    rope = RoPE(HEAD_DIM, rope_parameters=TYPES["dynamic"], max_position_embeddings=MAX_POS, mode=mode, backend=backend)
    b, layers = 2, 4
    for t in range(MAX_POS, MAX_POS + 12):  # a decode loop: every step a new length past the limit
        kwargs: dict[str, Any] = {
            "offset": {"offset": t},
            "offset tensor": {"offset": torch.tensor([t, t - 3])},
            "positions": {"positions": torch.tensor([[t], [t - 3]])},
        }[rows]
        qks = [(torch.randn(b, HEADS, 1, HEAD_DIM), torch.randn(b, KV_HEADS, 1, HEAD_DIM)) for _ in range(layers)]
        wants = [_computed_per_call(rope, q, k, **kwargs) for q, k in qks]  # from the state before the step
        with (
            mock.patch.object(module, "angles_to_cos_sin", wraps=module.angles_to_cos_sin) as computed,
            mock.patch.object(module, "rotate_tensors", wraps=module.rotate_tensors) as full,
        ):
            for (q, k), want in zip(qks, wants, strict=True):
                got = rope(q, k, **kwargs)
                assert rope.hf_scaled_len == rope.per_call_state, t
                for g, w in zip(got, want, strict=True):
                    assert torch.equal(g, w), t
        assert computed.call_count == 1, t  # once a step, not once a layer
        # The fused kernel's int-offset calls replay the plan of the step's window (posenc.kernels.replay) that the
        # first layer's full path kept (in mode 'hf' the call that advances the state, which a replay would not);
        # ids and offset tensors, and the torch backend (no launch to replay), take the full path at every layer,
        # reading the window.
        replayed = backend == "auto" and rows == "offset"
        assert full.call_count == (1 if replayed else layers), t
        spread = 1 if rows == "offset" else 4  # per-sequence positions t - 3 and t: the rows between them too
        window = rope._windows[next(reversed(rope._windows))]
        assert window[0].shape == (spread, HEAD_DIM // 2), t
    assert len(rope._windows) == module._WINDOWS_KEPT
    assert list(rope._tables) == []  # no table of scaled frequencies


@pytest.mark.parametrize("rope_type", ["longrope", "dynamic"])
@pytest.mark.parametrize("rows", ["positions", "offsets"])
@pytest.mark.parametrize("mode", ["hf", "consistent"])
def test_decode_steps_given_ids_or_offset_tensors_replay_on_their_lengths_table(rope_type, rows, mode) -> None:
    """Decode steps given position ids (as posenc's attention gives them) or per-sequence offsets: the length they
    scale for, max(ids) + 1 or max(offsets) + s, read on the host, picks the table, and later calls of that table
    replay the plan of the first (each layer of a step took the full path before, ~62 against ~14 us a call with one
    token of 32 + 8 heads on 2026-12-07). Past dynamic NTK's limit a window is read through ids moved back (a copy):
    the full path at every call. Every call equals the call computed per call, with the same 'hf' state."""
    rope = RoPE(HEAD_DIM, rope_parameters=TYPES[rope_type], max_position_embeddings=MAX_POS, mode=mode)
    full_paths = 0
    for t in range(MAX_POS - 6, MAX_POS + 4):  # lengths MAX_POS - 5 .. MAX_POS + 4: across the switch
        kwargs = (
            {"positions": torch.tensor([[t], [t - 2]])} if rows == "positions" else {"offset": torch.tensor([t, t - 2])}
        )
        for layer in range(3):
            q, k = torch.randn(2, HEADS, 1, HEAD_DIM), torch.randn(2, KV_HEADS, 1, HEAD_DIM)
            want = _computed_per_call(rope, q, k, **kwargs)
            with mock.patch.object(module, "rotate_tensors", wraps=module.rotate_tensors) as full:
                got = rope(q, k, **kwargs)
            full_paths += full.call_count
            assert rope.hf_scaled_len == rope.per_call_state, (t, layer)
            for g, w in zip(got, want, strict=True):
                assert torch.equal(g, w), (t, layer)
    # LongRoPE: the first call of each set of factors. Dynamic NTK: the first call up to the limit, and every call of
    # the four steps past it.
    assert full_paths == (2 if rope_type == "longrope" else 1 + 4 * 3)


@pytest.mark.parametrize("race", ["after the state advanced", "before the call read it"])
def test_a_plan_is_kept_only_under_the_length_its_call_read(race) -> None:
    """Another thread's call moves 'hf' dynamic NTK's state while this one runs (simulated: the state set from inside
    ``_advance_hf_state``). A plan was kept under the key of the state as read at the key's making, not of the
    length whose window the call read: the call that advanced the state to 21 kept its window under 30's key, and
    a call keyed at 16 that scaled for 30 kept that window under the unscaled key; later calls at those states
    replayed the other length's frequencies (max error 0.49 and 1.6; found by a helper's hunt). Every call equals
    the call computed per call."""
    rope = RoPE(HEAD_DIM, rope_parameters=TYPES["dynamic"], max_position_embeddings=MAX_POS)
    q, k = torch.randn(1, HEADS, 1, HEAD_DIM), torch.randn(1, KV_HEADS, 1, HEAD_DIM)
    advance = module.RoPE._advance_hf_state
    offset = 20 if race == "after the state advanced" else MAX_POS - 1

    def racing(self, length):
        if race == "before the call read it":
            self.hf_scaled_len = 30  # another call of length 30, just before this one reads the state
        scaled = advance(self, length)
        if race == "after the state advanced":
            self.hf_scaled_len = 30  # another call of length 30, just after this one's advance
        return scaled

    with mock.patch.object(module.RoPE, "_advance_hf_state", racing):
        rope(q, k, offset=offset)
    if race == "before the call read it":
        q2, k2 = torch.randn(2, HEADS, 1, HEAD_DIM), torch.randn(2, KV_HEADS, 1, HEAD_DIM)
        rope(q2, k2, offset=0)  # another request resets the state to the limit
    for _ in range(2):
        want = _computed_per_call(rope, q, k, offset=offset)
        got = rope(q, k, offset=offset)
        assert rope.hf_scaled_len == rope.per_call_state
        for g, w in zip(got, want, strict=True):
            assert torch.equal(g, w)


def test_dynamic_ntk_steps_past_its_limit_leave_the_windows_far_out_in_their_place() -> None:
    """A limit past the largest table (2**16 rows): a request below it reads a 4096-row window of unscaled rows far
    out, and decode steps past the limit each keep a window of their own rows. The two kinds are kept apart, the
    latest 8 of each: the steps' windows took the far window's place (found by a helper's review)."""
    limit = 70_000
    rope = RoPE(HEAD_DIM, rope_parameters=TYPES["dynamic"], max_position_embeddings=limit, mode="consistent")
    q, k = torch.randn(1, HEADS, 1, HEAD_DIM), torch.randn(1, KV_HEADS, 1, HEAD_DIM)
    rope(q, k, offset=66_000)  # unscaled, past the table: the window of rows 65536..69631
    far = (torch.device("cpu"), torch.float32, 65_536)
    for t in range(limit, limit + 12):  # steps past the limit
        rope(q, k, offset=t)
    assert far in rope._windows
    assert sum(module._exact(key) for key in rope._windows) == module._WINDOWS_KEPT
    want = _computed_per_call(rope, q, k, offset=66_001)
    with mock.patch.object(module.RoPE, "_rows", autospec=True, side_effect=module.RoPE._rows) as built:
        got = rope(q, k, offset=66_001)
    assert built.call_count == 0  # read from the kept window
    assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True))


@settings(max_examples=60, deadline=None)
@given(
    rope_type=st.sampled_from(list(TYPES)),
    ids=st.lists(st.integers(0, 40), min_size=1, max_size=8),
    seq_len=st.sampled_from([None, 41, 60]),
    seen=st.sampled_from([0, 30]),
    dtype=st.sampled_from([torch.float32, torch.float64]),
    step=st.booleans(),
)
def test_length_dependent_cos_sin_read_the_tables_of_their_frequencies_bit_for_bit(
    rope_type, ids, seq_len, seen, dtype, step
) -> None:
    """``cos_sin`` (and ``call_cos_sin``, what a patched transformers model asks for each step) reads LongRoPE's and
    dynamic NTK's tables as forward does: the bits of cos/sin computed for the call, and the same 'hf' state."""
    limit = 64 if rope_type == "longrope" else MAX_POS
    rope = RoPE(HEAD_DIM, rope_parameters=TYPES[rope_type], max_position_embeddings=limit)
    if seen:
        rope.scaling_length(torch.arange(seen))
    positions = torch.tensor([ids])
    fresh = pickle.loads(pickle.dumps(rope))
    if step:  # the per-step accessor, advancing 'hf' dynamic NTK's state
        with _per_call_paths():
            want = fresh.call_cos_sin(positions)
        got = rope.call_cos_sin(positions)
        assert rope.hf_scaled_len == fresh.hf_scaled_len
    else:
        with _per_call_paths():
            want = fresh.cos_sin(positions, seq_len=seq_len, dtype=dtype)
        got = rope.cos_sin(positions, seq_len=seq_len, dtype=dtype)
    for g, w in zip(got, want, strict=True):
        assert g.dtype == w.dtype and torch.equal(g, w)


@pytest.mark.parametrize("tracing_mode", ["real", "fake"])
def test_hf_dynamic_ntk_traced_by_make_fx_or_called_under_fake_tensors_advances_no_state(tracing_mode) -> None:
    """A make_fx trace cannot advance 'hf' dynamic NTK's state at each call of its graph: without seq_len it is
    refused (as before the unscaled table), not read from the table with the state advanced once, at trace time.
    Under a FakeTensorMode there are shapes only: the state stays, as scaling_length leaves it there."""
    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
    from torch.fx.experimental.proxy_tensor import make_fx

    rope = RoPE(HEAD_DIM, rope_parameters=TYPES["dynamic"], max_position_embeddings=MAX_POS)
    q = torch.randn(1, HEADS, 2, HEAD_DIM)
    with pytest.raises(ValueError, match="pass seq_len="):
        make_fx(lambda q, k: rope(q, k, offset=3), tracing_mode=tracing_mode)(q, q)
    with FakeTensorMode():
        fake = torch.randn(1, HEADS, 2, HEAD_DIM)
        rotated, _ = rope(fake, fake, offset=40)
    assert isinstance(rotated, FakeTensor) and rotated.shape == fake.shape
    assert rope.hf_scaled_len == MAX_POS


@pytest.mark.parametrize(
    "case",
    [
        "negative id",
        "negative id, no batch",
        "ids of another length",
        "ids of another batch",
        "ids of 3 dims",
        "offset past int64",
        "ids + offset past int64",
        "no batch, per-sequence offsets",
    ],
)
@pytest.mark.parametrize("mode", ["hf", "consistent"])
@pytest.mark.parametrize("rope_type", list(TYPES))
def test_length_dependent_arguments_refused_raise_the_full_paths_error_and_leave_the_hf_state(
    case, mode, rope_type
) -> None:
    """A call the full path refuses (resolve_positions' errors) raises its error, and advances no 'hf' state before
    raising: reading the unscaled table, the state was advanced from the bounds first (a reset after a longer call,
    or a growth past the ids' own length), then another check raised, with another message (or none, for no batch).
    A call of no positions (a batch of none with per-sequence offsets) advances nothing, as before. LongRoPE's
    tables (stop 60) had given the fixed types' table messages for such ids; it gives the per-call path's again."""
    rope = RoPE(HEAD_DIM, rope_parameters=TYPES[rope_type], max_position_embeddings=MAX_POS, mode=mode)
    rope.scaling_length(torch.arange(40))  # 'hf' dynamic NTK: the state at 40, which a call of length < 16 resets
    state = rope.hf_scaled_len

    def qk(b: int, s: int) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.randn(b, HEADS, s, HEAD_DIM), torch.randn(b, KV_HEADS, s, HEAD_DIM)

    calls = {  # (q, k, kwargs, the full path's message; None: no error)
        "negative id": (*qk(1, 2), {"positions": torch.tensor([-1, 0])}, r"got a negative entry$"),
        "negative id, no batch": (*qk(0, 2), {"positions": torch.tensor([-1, 0])}, r"got a negative entry$"),
        "ids of another length": (*qk(1, 4), {"positions": torch.arange(2)}, r"to match the sequence, got \(2,\)$"),
        "ids of another batch": (*qk(2, 2), {"positions": torch.zeros(3, 2, dtype=torch.long)}, "got \\(3, 2\\)$"),
        "ids of 3 dims": (*qk(1, 2), {"positions": torch.zeros(1, 1, 2, dtype=torch.long)}, "got \\(1, 1, 2\\)$"),
        "offset past int64": (*qk(1, 2), {"offset": 2**63 - 1}, "must fit in int64"),
        "ids + offset past int64": (*qk(1, 2), {"positions": torch.tensor([2**62, 0]), "offset": 2**62}, "int64"),
        "no batch, per-sequence offsets": (*qk(0, 50), {"offset": torch.zeros(0, dtype=torch.long)}, None),
    }
    q, k, kwargs, message = calls[case]
    if message is None:
        rope(q, k, **kwargs)
    else:
        with pytest.raises(ValueError, match=message):
            rope(q, k, **kwargs)
    assert rope.hf_scaled_len == state


def test_hf_dynamic_forward_past_the_limit_advances_the_state_once() -> None:
    """A forward call past max_position_embeddings advances the 'hf' state once, where it decides its length (from
    the bounds), and rotates by that length: its cos/sin are not asked of call_cos_sin, which advanced the state a
    second time, undoing the reset another call (a thread) had written in between."""
    rope = _Interleaved(HEAD_DIM, rope_parameters=TYPES["dynamic"], max_position_embeddings=MAX_POS)
    rope.scaling_length(torch.arange(30))
    rope.other = torch.arange(10)  # resets the state right after this call's growth to 40
    q = torch.randn(1, HEADS, 40, HEAD_DIM)
    rotated, _ = rope(q, q)
    plain = RoPE(HEAD_DIM, rope_parameters=TYPES["dynamic"], max_position_embeddings=MAX_POS)
    torch.testing.assert_close(rotated, plain(q, q, seq_len=40)[0], rtol=0.0, atol=0.0)
    assert rope.hf_scaled_len == MAX_POS  # the other call's reset, written last


@pytest.mark.parametrize("mode", ["hf", "consistent"])
@pytest.mark.parametrize("offset", [3, 30])
def test_a_captured_dynamic_ntk_call_without_seq_len_is_refused_and_advances_no_state(mode, offset) -> None:
    """In a CUDA graph capture (mocked: a stream that captures, no value to read) a call with an int offset knows its
    length on the host, but its graph replays with no state advanced: 'hf' dynamic NTK advanced the state once, at
    capture, and the graph kept the frequencies (unscaled, or scaled for that state) of that moment. As before the
    unscaled table (and as make_fx's trace), the call asks for seq_len and leaves the state."""
    rope = RoPE(HEAD_DIM, rope_parameters=TYPES["dynamic"], max_position_embeddings=MAX_POS, mode=mode)
    q, k = torch.randn(1, HEADS, 1, HEAD_DIM), torch.randn(1, KV_HEADS, 1, HEAD_DIM)
    rope(q, k, offset=2)  # the warm-up: the unscaled table
    rope.scaling_length(torch.arange(40))
    state = rope.hf_scaled_len
    with (
        mock.patch.object(module, "_capturing", return_value=True),
        mock.patch.object(module, "values_readable", return_value=False),
        pytest.raises(ValueError, match="pass seq_len="),
    ):
        rope(q, k, offset=offset)
    assert rope.hf_scaled_len == state
