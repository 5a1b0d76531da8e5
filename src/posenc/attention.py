"""One reference causal attention that takes any encoding, with grouped-query heads and a KV cache.

It reads only the encoding's ``acts_on`` declaration: QK encodings rotate q and k before they enter the cache,
score-bias encodings add ``score_bias(q_positions, k_positions)`` to the logits, and input encodings are applied
to the embeddings by ``add_input_encoding`` (the model's job, not attention's). Packed documents given as
``document_ids`` attend each within itself: the mask is causal and block-diagonal, on every path. Shape key: b
batch, s new tokens, t cached + new tokens, h query heads, g key/value heads, d head dim.
"""

from __future__ import annotations

import copy
import dataclasses
import itertools
import math
import sys
import warnings
import weakref
from typing import Any, Literal, overload

import torch
import torch.nn.functional as F
from torch import nn

from posenc._checks import (
    assert_without_sync,
    attention_inputs,
    autocast_off,
    autocast_on,
    encoding_heads,
    fake_mode_active,
    flag,
    float_tensor,
    host_min_max,
    int_tensor,
    integer,
    is_dtensor,
    positive_int,
    refuse_jit_trace,
    replicated_like,
    replicated_values,
    same_device,
    size_in,
    values_readable,
    vmapped,
)
from posenc.encoding import ActsOn
from posenc.kernels.flex_bias import FlexFallback, attend_flex, use_flex
from posenc.positions import (
    positions_continuing,
    positions_from_document_ids,
    resolve_document_ids,
    resolve_positions,
)


@dataclasses.dataclass(eq=False)  # compared and hashed by identity: a set of caches, a WeakKeyDictionary
class KVCache:
    """Keys (b, g, t, d) as they enter attention (rotated, for RoPE), values, and key positions (b or 1, t).

    For a RoPE in 'consistent' mode whose frequencies change with the length (dynamic NTK, LongRoPE) it also keeps
    ``unrotated_k`` and the ``inv_freq`` that ``k`` was rotated with: ``k`` is extended while the frequencies stay
    the same and rebuilt from ``unrotated_k`` (never re-rotated, so no rounding accumulates) when they (or the
    attention factor) change.

    Filled with ``document_ids`` it keeps the keys' ids too, (b or 1, t), as it keeps their positions: a step that
    gives none continues each row's last document, so a left-padded batch (pads one id, each row's text another:
    transformers' ``attention_mask`` is such ids) decodes without attending to its padding. None where the first
    step gave no ids (then every cached key is seen, as before).

    One cache per attention layer: the first ``CausalSelfAttention`` that fills it owns it, and another layer
    handed it while it holds keys raises ValueError. Another sequence starts with a new ``KVCache()``.
    """

    k: torch.Tensor | None = None
    v: torch.Tensor | None = None
    positions: torch.Tensor | None = None
    unrotated_k: torch.Tensor | None = None
    rotated_with: torch.Tensor | None = None
    document_ids: torch.Tensor | None = None
    # The attention factor k was rotated with, beside rotated_with's frequencies (None: unknown, re-rotate): a
    # registered length-dependent type may change it while its frequencies stay.
    _rotated_factor: float | None = dataclasses.field(default=None, init=False, repr=False, compare=False)
    # A weak reference, so that a cache kept around does not keep its layer's weights alive.
    _owner: weakref.ref[nn.Module] | None = dataclasses.field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        # A cache is normally started empty and filled by the attention; one built with tensors must be one the
        # attention could have built.
        named = {"k": self.k, "v": self.v, "positions": self.positions}
        others = (
            ("unrotated_k", self.unrotated_k),
            ("rotated_with", self.rotated_with),
            ("document_ids", self.document_ids),
        )
        for name, value in (*named.items(), *others):
            if value is not None and not isinstance(value, torch.Tensor):
                raise TypeError(
                    f"KVCache.{name} must be a torch.Tensor or None, got {type(value).__name__}; start with KVCache() "
                    "and let the attention fill it"
                )
        if len({value is None for value in named.values()}) > 1:
            given = ", ".join(name for name, value in named.items() if value is not None)
            raise ValueError(f"KVCache needs k, v and positions together (or none of them), got only {given}")
        if self.k is not None:
            self._check_new(self.k, self.v, None, self.positions, read_any_device=True)
        self._check_rotation_state()
        if self.document_ids is not None:
            if self.k is None:
                raise ValueError("KVCache.document_ids are the cached keys' ids: give them with k, v and positions")
            # A copy, as update keeps: the caller's tensor, refilled in place, changed the cached ids.
            self.document_ids = resolve_document_ids(
                self.document_ids, batch=self.k.shape[0], seq_len=self.k.shape[2], device=self.k.device
            ).clone()

    def _check_rotation_state(self) -> None:
        """Raise unless unrotated_k and rotated_with are what a 'consistent' RoPE's update_rotating keeps beside k:
        the same keys before rotation (k's shape, dtype and device) and the (r/2,) frequencies they were rotated
        with. A cache built otherwise failed at its first step with an empty AssertionError (unrotated_k without
        k), an error about the rotation's shapes (fewer unrotated keys than keys), or kept integer keys."""
        for name, value in (("unrotated_k", self.unrotated_k), ("rotated_with", self.rotated_with)):
            if value is not None and self.k is None:
                raise ValueError(
                    f"KVCache.{name} belongs to the cached keys k (a 'consistent' RoPE keeps it beside them): give "
                    "it with k, v and positions, or start with KVCache() and let the attention fill it"
                )
        if self.unrotated_k is not None:
            assert self.k is not None
            float_tensor("KVCache.unrotated_k", self.unrotated_k)
            held = (self.unrotated_k.shape, self.unrotated_k.dtype, self.unrotated_k.device)
            if held != (self.k.shape, self.k.dtype, self.k.device):
                raise ValueError(
                    f"KVCache.unrotated_k must be the keys k before rotation, of k's shape {tuple(self.k.shape)}, "
                    f"dtype {self.k.dtype} and device {self.k.device}; got {tuple(held[0])}, {held[1]}, {held[2]}"
                )
        if self.rotated_with is not None:
            float_tensor("KVCache.rotated_with", self.rotated_with)
            if self.rotated_with.dim() != 1:
                raise ValueError(
                    "KVCache.rotated_with must be the (r/2,) frequencies the keys were rotated with, got shape "
                    f"{tuple(self.rotated_with.shape)}"
                )

    @property
    def length(self) -> int:
        """The tokens cached so far: k's and v's sequence dimension, (b, g, length, d); 0 before the first call."""
        return 0 if self.k is None else self.k.shape[2]

    def __getstate__(self) -> dict[str, Any]:
        # A weak reference cannot be pickled, and a layer's identity means nothing in another process: a cache
        # saved and loaded again belongs to the first layer that uses it, as a new one does.
        state = dict(self.__dict__)
        state.pop("_owner", None)
        return state

    def __copy__(self) -> KVCache:
        # In this process a copy (a beam or a speculative branch) still holds its layer's keys: it keeps the owner.
        clone = type(self).__new__(type(self))
        clone.__dict__.update(self.__dict__)
        return clone

    def __deepcopy__(self, memo: dict[int, Any]) -> KVCache:
        clone = type(self).__new__(type(self))
        memo[id(self)] = clone
        for key, value in self.__dict__.items():
            if key == "_owner":
                # Copied with its layer (deepcopy((model, caches))): the copy belongs to the layer's copy. Copied
                # alone (a beam), or before the layer, it keeps the layer it holds the keys of.
                owner = value() if value is not None else None
                copied = memo.get(id(owner)) if owner is not None else None
                clone.__dict__[key] = weakref.ref(copied) if isinstance(copied, nn.Module) else value
            elif isinstance(value, torch.Tensor) and (value.grad_fn is not None or not value.requires_grad):
                # Filled with grad enabled: torch cannot deepcopy a tensor with history; a clone keeps the history.
                # A clone for the others too: after crop they are views, whose whole storage torch's deepcopy
                # copies (a cache of 4096 tokens cropped to 16 gave each copy 4096 tokens' keys and values).
                clone.__dict__[key] = memo.setdefault(id(value), value.clone())
            else:
                clone.__dict__[key] = copy.deepcopy(value, memo)
        return clone

    def _claim(self, layer: nn.Module) -> None:
        """Make this cache ``layer``'s; raise ValueError if it holds the keys of another layer."""
        owner = self._owner() if self._owner is not None else None
        if self.k is not None and self._owner is not None and owner is not layer:
            # Two layers appending to one cache each attend to the other's keys, with no shape to tell.
            which = "a layer that no longer exists" if owner is None else f"another layer ({_describe(owner)})"
            raise ValueError(
                f"one KVCache per layer: this KVCache holds the keys of {which}, not of this one "
                f"({_describe(layer)}); give each attention layer its own posenc.KVCache(), e.g. "
                "caches = [posenc.KVCache() for _ in layers]"
            )
        if owner is not layer:
            self._owner = weakref.ref(layer)

    def check_batch(self, batch: int, *, what: str = "x") -> None:
        """Raise ValueError unless ``batch`` sequences continue the ones this cache holds (any batch if empty)."""
        if self.k is not None and self.k.shape[0] != batch:
            held = self.k.shape[0]
            raise ValueError(
                f"this KVCache holds a batch of {held} sequences but {what} has a batch of {batch}; feed every "
                f"cached sequence together (batch {held}), or start a new KVCache() for another batch"
            )

    def next_positions(
        self, seq_len: int, *, device: torch.device | str | None = None, document_ids: torch.Tensor | None = None
    ) -> torch.Tensor:
        """(b or 1, seq_len) int64: the positions after the last cached one, per sequence; 0..seq_len-1 (on
        ``device``) while the cache is empty.

        Continues the cached positions, not ``length``: after a prefill at explicit positions (e.g. 100..105) the
        next token is at 106, wherever the ids started. With the new tokens' ``document_ids`` (s,) or (b, s), each
        token's index within its document instead: a token of the row's last cached document continues its
        positions, one of another document starts at 0 (as ``positions_from_document_ids`` counts a whole row). What
        ``CausalSelfAttention`` uses when given no positions, and what ``add_input_encoding`` needs in a decoding loop.
        Not read on the host (a decode step's cost): past 2**63 - 1 they wrap negative, which every posenc consumer
        refuses (with CPU positions the attention's error says they wrapped).
        """
        seq_len = integer("seq_len", seq_len, low=0, expected="an int >= 0 (the number of new tokens)", symbolic=True)
        if document_ids is not None:
            int_tensor("document_ids", document_ids, what="document ids")
            held = self.k.shape[0] if self.k is not None else None
            batch = held if held is not None else (document_ids.shape[0] if document_ids.dim() == 2 else 1)
            docs = resolve_document_ids(document_ids, batch=batch, seq_len=seq_len, device=device)
            self._check_ids_kept(docs)
            if self.positions is None or self.positions.shape[1] == 0:
                return positions_from_document_ids(docs)
            assert self.document_ids is not None
            return positions_continuing(
                self.document_ids[:, -1:], self.positions[:, -1:], docs.to(self.positions.device)
            )
        if self.positions is None or self.positions.shape[1] == 0:
            return torch.arange(seq_len, device=device)[None]
        steps = torch.arange(1, seq_len + 1, dtype=torch.long, device=self.positions.device)
        return self.positions[:, -1:] + steps

    def _wrap_hint(self, positions: torch.Tensor) -> str:
        """For the error on negative positions: where the cache's last position is within their count of 2**63 - 1,
        that they may have wrapped past it (an error path: the read's cost does not matter)."""
        held = self.positions
        if held is None or not held.numel() or held.device.type == "meta":
            return ""
        if host_min_max(held[:, -1:])[1] <= 2**63 - 1 - positions.shape[1]:
            return ""
        return "; positions after the last cached one, at the int64 limit, wrap negative past 2**63 - 1"

    def crop(self, length: int) -> None:
        """Keep the first ``length`` cached tokens and drop the rest: a rejected speculative draft, a beam cut back.
        A negative length drops that many from the end, and one at or past ``self.length`` changes nothing, as in
        transformers' ``DynamicCache.crop``. Decoding then goes on after the last kept position (``next_positions``);
        a 'consistent' RoPE's kept keys stay rotated with the frequencies they had, and the next step rotates
        them again only if its length's frequencies (or attention factor) differ."""
        length = integer(
            "length", length, expected="an int (the number of cached tokens to keep)", type_error=TypeError
        )
        held = self.length
        keep = held + length if length < 0 else min(length, held)
        if keep < 0 and held == 0:
            raise ValueError(f"length={length} drops tokens from an empty KVCache, which holds none to drop")
        if keep < 0:
            raise ValueError(
                f"length={length} drops more tokens than this KVCache holds ({held}); pass 0..{held} to keep that "
                f"many, or -{held}..-1 to drop that many from the end"
            )
        if keep == 0:
            self.k = self.v = self.positions = self.unrotated_k = self.rotated_with = self.document_ids = None
            self._rotated_factor = None
            return
        assert self.k is not None and self.v is not None and self.positions is not None
        self.k, self.v, self.positions = self.k[:, :, :keep], self.v[:, :, :keep], self.positions[:, :keep]
        if self.unrotated_k is not None:
            self.unrotated_k = self.unrotated_k[:, :, :keep]
        if self.document_ids is not None:
            self.document_ids = self.document_ids[:, :keep]

    def update(
        self, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor, *, document_ids: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """k, v: (b, g, s, d); positions: (b or 1, s); document_ids: (b or 1, s) or None (see the class). Append the
        new tokens; returns everything cached so far (the ids of every key are then ``self.document_ids``). New
        tokens that cannot continue the cache (batch, dtype, device, heads, head dim) raise and change nothing."""
        self._check_new(k, v, self.k, positions, document_ids)
        return self._update(k, v, positions, self._checked_key_document_ids(document_ids, k.shape[2]))

    def _update(
        self, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor, ids: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``update`` of checked new tokens, with ``ids`` the document ids of every key after it (from
        ``_checked_key_document_ids``): CausalSelfAttention checks before its encoding call, whose dynamic 'hf'
        state a refusal after it had advanced."""
        self.k, self.v, self.positions = self._appended(self.k, k, v, positions)
        self.document_ids = ids
        return self.k, self.v, self.positions

    def update_rotating(
        self,
        k: torch.Tensor,
        v: torch.Tensor,
        positions: torch.Tensor,
        encoding: nn.Module,
        *,
        document_ids: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
        """Append unrotated keys k: (b, g, s, d) and rotate every cached key with the frequencies of the whole
        sequence, max(positions) + 1, re-rotating the old keys only when those frequencies (or the attention
        factor) changed.

        Returns (rotated keys (b, g, t, d), values, key positions (b or 1, t), the seq_len used). The cache changes
        only once everything is computed. document_ids: as for ``update``.
        """
        if not callable(getattr(encoding, "call_scaling_length", None)):
            # AttributeError: 'ALiBi' object has no attribute 'call_scaling_length', from below.
            raise TypeError(
                f"update_rotating rotates keys with a RoPE (what a 'consistent' RoPE's layer calls), got encoding of "
                f"type {type(encoding).__name__}; use update for other encodings"
            )
        if self.unrotated_k is None and self.k is not None:
            raise ValueError("this KVCache holds keys rotated by another encoding; start a new KVCache()")
        self._check_new(k, v, self.unrotated_k, positions, document_ids)
        ids = self._checked_key_document_ids(document_ids, k.shape[2])
        unrotated, all_v, k_pos = self._appended(self.unrotated_k, k, v, positions)
        # Read as a forward call without a cache reads it: in a graph break under torch.compile, 1 on the meta
        # device (shapes only), posenc's error where no value may be read (a CUDA graph capture).
        seq_len = encoding.call_scaling_length(k_pos)
        inv_freq, factor = encoding.frequencies(seq_len)
        # Under a FakeTensorMode the frequencies have no values to compare: every key is rotated (the same shapes).
        same = self.k is not None and self.rotated_with is not None and not fake_mode_active()
        if same and torch.equal(inv_freq, self.rotated_with) and factor == self._rotated_factor:
            rotated = torch.cat((self.k, encoding.rotate(k, positions, seq_len=seq_len)), dim=2)
        else:
            rotated = encoding.rotate(unrotated, k_pos, seq_len=seq_len)
        self.k, self.v, self.positions, self.unrotated_k, self.rotated_with = rotated, all_v, k_pos, unrotated, inv_freq
        self._rotated_factor = factor
        self.document_ids = ids
        return self.k, all_v, k_pos, seq_len

    def _checked_key_document_ids(self, document_ids: torch.Tensor | None, seq_len: int) -> torch.Tensor | None:
        """``key_document_ids``, checked to give each document one run of tokens across the cache (an id that came
        back would rejoin a document left behind), before the cache changes."""
        ids = self.key_document_ids(document_ids, seq_len)
        if document_ids is not None and ids is not None:
            resolve_document_ids(ids, batch=ids.shape[0], seq_len=ids.shape[1], device=ids.device)
        return ids

    def key_document_ids(self, document_ids: torch.Tensor | None, seq_len: int) -> torch.Tensor | None:
        """The document ids of the cached keys and ``seq_len`` new ones, (b or 1, t), computed without changing the
        cache: the new ones as given, document_ids (b or 1, s), or else each row's last cached id; None where
        neither the cache nor the step has ids. Ids that break a document into two runs are not checked here."""
        if document_ids is None:
            if self.document_ids is None:
                return None
            return torch.cat((self.document_ids, self.document_ids[:, -1:].expand(-1, seq_len)), dim=1)
        self._check_ids_kept(document_ids)
        if self.document_ids is None:
            # A copy: the caller's own tensor, kept, changed with its buffer (a mask refilled in place).
            return document_ids.to(torch.long, copy=True)
        document_ids = document_ids.long()
        batch = max(self.document_ids.shape[0], document_ids.shape[0])
        held = self.document_ids.expand(batch, -1)
        return torch.cat((held, document_ids.to(held.device).expand(batch, -1)), dim=1)

    def _check_ids_kept(self, document_ids: torch.Tensor) -> None:
        """Raise unless this cache knows the document ids of its keys, or holds none, so that new ids can follow."""
        if self.document_ids is None and self.k is not None:
            # Which documents the cached keys belong to is unknown: guessing would attend to padding or hide text.
            raise ValueError(
                f"this KVCache holds {self.length} tokens filled without document_ids, so new tokens' document_ids "
                "have no ids to follow; pass document_ids from the first step on (for left padding: one id for the "
                "pads, another for each row's text, e.g. transformers' attention_mask), or start a new KVCache()"
            )

    def _check_new(
        self,
        k: torch.Tensor,
        v: torch.Tensor,
        held: torch.Tensor | None,
        positions: torch.Tensor,
        document_ids: torch.Tensor | None = None,
        *,
        read_any_device: bool = False,
    ) -> None:
        """Raise unless new keys k, values v, their positions and document ids (or None) belong together and
        continue ``held``, the keys as cached (before any rotation). Positions are checked >= 0 where reading them
        costs no device sync (on the CPU), or on any device with ``read_any_device`` (a cache built with tensors,
        once); on CUDA a step's positions are the attention's, which it checks itself."""
        float_tensor("k", k)
        float_tensor("v", v)
        int_tensor("positions", positions)
        if document_ids is not None:
            int_tensor("document_ids", document_ids, what="document ids")
            if (
                document_ids.dim() != 2
                or document_ids.shape[1] != k.shape[2]
                or not size_in(document_ids.shape[0], (1, k.shape[0]))
            ):
                raise ValueError(
                    f"document_ids must be (b or 1, s) = ({k.shape[0]} or 1, {k.shape[2]}) for keys of shape "
                    f"{tuple(k.shape)}, got {tuple(document_ids.shape)}"
                )
        if k.dim() != 4 or v.dim() != 4 or k.shape[:3] != v.shape[:3]:
            raise ValueError(
                f"k and v must be (b, g, s, d) with the same b, g and s, got {tuple(k.shape)} and {tuple(v.shape)}"
            )
        if positions.dim() != 2 or positions.shape[1] != k.shape[2] or not size_in(positions.shape[0], (1, k.shape[0])):
            raise ValueError(
                f"positions must be (b or 1, s) = ({k.shape[0]} or 1, {k.shape[2]}) for keys of shape "
                f"{tuple(k.shape)}, got {tuple(positions.shape)}"
            )
        if positions.device != k.device or v.device != k.device:
            raise ValueError(
                f"k, v and positions must be on one device, got {k.device}, {v.device} and {positions.device}"
            )
        if document_ids is not None and document_ids.device != k.device:
            # Stored as given, they failed at the next step (meta: "Cannot copy out of meta tensor").
            raise ValueError(f"document_ids must be on the keys' device {k.device}, got {document_ids.device}")
        # A negative position was cached and served as the keys' position (next_positions continued from it, score
        # biases read it); the attention refused it only when a forward call resolved its own positions.
        readable = (read_any_device or positions.device.type == "cpu") and values_readable(positions.device)
        if readable and positions.numel() and host_min_max(positions)[0] < 0:
            raise ValueError(
                "positions must be >= 0 (the cached keys' token positions), got a negative entry; number the tokens "
                "from 0 (posenc.positions_from_document_ids for packed documents)" + self._wrap_hint(positions)
            )
        self.check_batch(k.shape[0], what="k")
        if held is None:
            return
        assert self.v is not None
        if k.dtype != held.dtype or v.dtype != self.v.dtype:
            raise TypeError(
                f"this KVCache holds {held.dtype} keys and {self.v.dtype} values but the new ones are {k.dtype} and "
                f"{v.dtype}; run every step in one dtype, or start a new KVCache()"
            )
        if k.device != held.device or v.device != self.v.device:
            raise ValueError(f"this KVCache is on {held.device} but the new keys are on {k.device}; use one device")
        for name, new, cached in (("keys", k, held), ("values", v, self.v)):
            if new.shape[1] != cached.shape[1] or new.shape[3] != cached.shape[3]:
                raise ValueError(
                    f"this KVCache holds {name} of {cached.shape[1]} heads x {cached.shape[3]} channels but the new "
                    f"{name} have {new.shape[1]} x {new.shape[3]}; give each attention layer its own KVCache"
                )

    def _appended(
        self, held: torch.Tensor | None, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(held keys + k, cached values + v, cached positions + positions), computed without changing the cache."""
        if held is None:
            return k, v, positions
        assert self.v is not None and self.positions is not None
        batch = max(self.positions.shape[0], positions.shape[0])
        all_positions = torch.cat((self.positions.expand(batch, -1), positions.expand(batch, -1)), dim=1)
        return torch.cat((held, k), dim=2), torch.cat((self.v, v), dim=2), all_positions


def _describe(layer: nn.Module) -> str:
    encoding = getattr(layer, "encoding", None)
    return f"{type(layer).__name__} with " + ("no encoding" if encoding is None else type(encoding).__name__)


def _check_encoding(encoding: object) -> None:
    """encoding: an nn.Module that declares where it acts, or None."""
    if encoding is not None and not isinstance(encoding, nn.Module):
        hint = (
            f"; build one by name with posenc.build_for_model({encoding!r}, dim=..., num_heads=..., head_dim=..., "
            "max_positions=...)"
            if isinstance(encoding, str)
            else ""
        )
        raise TypeError(f"encoding must be an nn.Module or None, got {type(encoding).__name__}{hint}")
    if encoding is not None and not isinstance(getattr(encoding, "acts_on", None), ActsOn):
        # acts_on is all that is read of an encoding first; without it a forward would fail far from here.
        raise TypeError(
            f"encoding {type(encoding).__name__} does not declare where it acts: an encoding needs a class "
            "attribute acts_on = posenc.ActsOn.QK, SCORE_BIAS, INPUT or NONE (see posenc.encoding); for no "
            "encoding pass encoding=None or posenc.NoPE()"
        )


def add_input_encoding(x: torch.Tensor, encoding: nn.Module | None, positions: torch.Tensor) -> torch.Tensor:
    """x: (b, s, dim); positions: (s,) or (b or 1, s). Adds the encoding if it acts on the input, else returns x.

    positions has no default: torch.arange(s) for whole sequences, ``cache.next_positions(s)`` when decoding (a
    default of 0..s-1 would put every decoded token at position 0), ``positions_from_document_ids(document_ids)`` for
    packed rows. Call it before the layers add this step to the cache."""
    if positions is None:
        raise TypeError(
            "add_input_encoding needs positions: torch.arange(s) for whole sequences, cache.next_positions(s) "
            "(the positions after the cached ones) when decoding with a KVCache, or "
            "posenc.positions_from_document_ids(document_ids) for packed documents"
        )
    refuse_jit_trace("add_input_encoding")
    _check_encoding(encoding)
    if encoding is None or encoding.acts_on is not ActsOn.INPUT:
        return x
    float_tensor("x", x)
    if x.dim() != 3:
        raise ValueError(f"x must be (b, s, dim), got shape {tuple(x.shape)}")
    held = _encoding_device(encoding)
    if held is not None and held != x.device:
        raise ValueError(
            f"the encoding {type(encoding).__name__} is on {held} but x is on {x.device}; move it with "
            "encoding.to(x.device)"
        )
    # Through resolve_positions, as the attention's own positions: other shapes would broadcast, handing every token
    # the encoding of one position or growing the batch.
    positions = resolve_positions(x.shape[1], batch=x.shape[0], positions=positions, device=x.device)
    # In float32 at least (bf16 activations add it rounded once), in float64 for a float64 model.
    encoded = encoding(positions, dtype=torch.promote_types(x.dtype, torch.float32))
    if encoded.shape[-1] != x.shape[-1]:
        raise ValueError(
            f"the encoding {type(encoding).__name__} has dim={encoded.shape[-1]} but x's last dim (the model width) "
            f"is {x.shape[-1]}; build the encoding with dim={x.shape[-1]}"
        )
    # The sum in the encoding's precision, then one rounding to x's dtype: adding a rounded encoding rounds twice.
    return (x.to(encoded.dtype) + encoded).to(x.dtype)


def _encoding_device(encoding: nn.Module) -> torch.device | None:
    """Where an encoding's first parameter or buffer lies; None for one that holds no tensor (RoPE, NoPE)."""
    held = next(itertools.chain(encoding.parameters(), encoding.buffers()), None)
    return None if held is None else held.device


def causal_mask(q_len: int, k_len: int, device: torch.device, document_ids: torch.Tensor | None = None) -> torch.Tensor:
    """(q_len, k_len) bool, True where attention is allowed: the last q_len of k_len tokens are the queries
    (q_len <= k_len, so that every query has a key: itself).

    With document_ids (k_len,) or (b or 1, k_len) integer, of the keys, (b or 1, 1, q_len, k_len): also False
    between documents."""
    if torch.jit.is_tracing():  # sizes are 0-d tensors there, which the checks below would refuse
        return _causal_mask(q_len, k_len, device, document_ids)
    q_len = integer("q_len", q_len, low=0, symbolic=True)
    k_len = integer("k_len", k_len, low=0, symbolic=True)
    if q_len > k_len:
        # Unchecked, the first queries had no key: attend gave them zeros, or NaN with need_probs.
        raise ValueError(f"q_len={q_len} must be <= k_len={k_len}: the queries are the last q_len of the keys")
    if document_ids is not None:
        int_tensor("document_ids", document_ids, what="document ids")
        if document_ids.dim() not in (1, 2) or document_ids.shape[-1] != k_len:
            raise ValueError(
                f"document_ids must be (k_len,) or (b or 1, k_len) with k_len={k_len}, one id per key, got "
                f"{tuple(document_ids.shape)}"
            )
    return _causal_mask(q_len, k_len, device, document_ids)


def _causal_mask(q_len: int, k_len: int, device: torch.device, document_ids: torch.Tensor | None) -> torch.Tensor:
    """``causal_mask`` without its checks, for CausalSelfAttention's own resolved ids."""
    allowed = torch.ones(q_len, k_len, dtype=torch.bool, device=device).tril(diagonal=k_len - q_len)
    if document_ids is None:
        return allowed
    if document_ids.dim() == 1:
        document_ids = document_ids[None]
    same = document_ids[:, k_len - q_len :, None] == document_ids[:, None, :]
    return (allowed & same)[:, None]


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention with grouped-query heads.

    dim: model width; num_heads: h; num_kv_heads: g (divides h; default h); encoding: any registered encoding
    (or None). The encoding may be shared by every layer of a model. bias: whether the q, k, v and output
    projections have biases (default False, as in Llama).
    """

    def __init__(
        self,
        dim: int,
        num_heads: int,
        *,
        num_kv_heads: int | None = None,
        encoding: nn.Module | None = None,
        bias: bool = False,
    ) -> None:
        super().__init__()
        dim, num_heads = positive_int("dim", dim), positive_int("num_heads", num_heads)
        flag("bias", bias)
        num_kv_heads = num_heads if num_kv_heads is None else positive_int("num_kv_heads", num_kv_heads)
        if dim % num_heads:
            raise ValueError(f"dim={dim} must be divisible by num_heads={num_heads}")
        if num_heads % num_kv_heads:
            raise ValueError(f"num_heads={num_heads} must be a multiple of num_kv_heads={num_kv_heads}")
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, dim // num_heads
        self.q_proj = nn.Linear(dim, num_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(dim, num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(dim, num_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(num_heads * self.head_dim, dim, bias=bias)
        self.encoding = encoding  # checked by __setattr__ (and add_module), as an encoding assigned later is

    def __setattr__(self, name: str, value: Any) -> None:
        if name == "encoding":
            self._check_layer_encoding(value)
        super().__setattr__(name, value)

    def add_module(self, name: str, module: nn.Module | None) -> None:  # register_module's way in too
        if name == "encoding":
            self._check_layer_encoding(module)
        super().add_module(name, module)

    def _check_layer_encoding(self, encoding: object) -> None:
        """Refuses an encoding this layer cannot use, at construction and when one is assigned later
        (``layer.encoding = ...``): forward attends unchecked (``_attend``), its q, k, v, mask and bias being its
        own."""
        _check_encoding(encoding)
        if encoding is not None and getattr(encoding, "acts_on", None) is ActsOn.INPUT:
            # The layer cannot add it (it goes into the residual stream once, before the first layer) and would
            # run as if it had no encoding at all, past a learned table too.
            raise ValueError(
                f"encoding {type(encoding).__name__} acts on the input, not in attention: add it to the embeddings "
                "once with posenc.add_input_encoding(x, encoding, positions) before the layers, and build "
                "CausalSelfAttention with encoding=None"
            )
        encoding_heads(encoding, self.num_heads, f"the attention has num_heads={self.num_heads}")
        # Likewise a rotary encoding of another head size: refused here, not at the first forward.
        rotated = getattr(encoding, "head_dim", None) if getattr(encoding, "acts_on", None) is ActsOn.QK else None
        if rotated is not None and rotated != self.head_dim:
            raise ValueError(
                f"encoding {type(encoding).__name__} has head_dim={rotated} but the attention's heads have "
                f"dim / num_heads = {self.num_heads * self.head_dim} / {self.num_heads} = {self.head_dim} channels; "
                f"build the encoding with head_dim={self.head_dim}"
            )

    @overload
    def forward(
        self,
        x: torch.Tensor,
        *,
        positions: torch.Tensor | None = ...,
        document_ids: torch.Tensor | None = ...,
        cache: KVCache | None = ...,
        return_attention: Literal[False] = ...,
    ) -> torch.Tensor: ...

    @overload
    def forward(
        self,
        x: torch.Tensor,
        *,
        positions: torch.Tensor | None = ...,
        document_ids: torch.Tensor | None = ...,
        cache: KVCache | None = ...,
        return_attention: Literal[True],
    ) -> tuple[torch.Tensor, torch.Tensor]: ...

    @overload
    def forward(
        self,
        x: torch.Tensor,
        *,
        positions: torch.Tensor | None = ...,
        document_ids: torch.Tensor | None = ...,
        cache: KVCache | None = ...,
        return_attention: bool,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]: ...

    def forward(
        self,
        x: torch.Tensor,
        *,
        positions: torch.Tensor | None = None,
        document_ids: torch.Tensor | None = None,
        cache: KVCache | None = None,
        return_attention: bool = False,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """x: (b, s, dim). positions: (s,) or (b, s) ids (default: with a cache, one past its last position in
        each sequence; else, with document_ids, each token's index within its document; else 0..s-1).
        cache: a ``KVCache`` this layer fills and reads (one per layer): prefill, then decode steps continue it.
        document_ids: (s,) or (b, s) integers, one run of tokens per id, for documents packed into a row: a token
        attends only to earlier tokens of its own document. ``posenc.document_ids_from_positions`` and
        ``posenc.document_ids_from_cu_seqlens`` build them. With a cache they are the new tokens' ids, kept for
        later steps, which continue each row's last document where they give none (positions then continue it
        too, or restart at 0 for a new id): a left-padded batch decodes as each row alone with ids 0 for the pads
        and 1 for the text (transformers' ``attention_mask``) at the prefill. RoPE types that scale by length
        (``dynamic``, ``longrope``) scale for the largest position, the pads' too: give them positions with the pads
        at 0, ``(ids.cumsum(-1) - 1).clamp(min=0)``. A cache filled without ids takes none.

        Returns (b, s, dim); with ``return_attention`` also the probabilities (b, h, s, t) in float32 (float64
        for float64 inputs). Under tensor parallelism (projections parallelized so that q is a DTensor sharded on
        heads, or the batch) both are DTensors: the probabilities laid out as q, each rank holding its own heads'
        (b, h / n, s, t), or its own rows, with no communication (``.full_tensor()`` gathers them all).
        """
        refuse_jit_trace("CausalSelfAttention")
        float_tensor("x", x)
        flag("return_attention", return_attention)
        dim = getattr(self.q_proj, "in_features", None)
        if x.dim() != 3 or (dim is not None and x.shape[2] != dim):
            raise ValueError(f"x must be (b, s, dim={dim}), got shape {tuple(x.shape)}")
        # Only a plain Linear's weight says what it takes: quantized, offloaded or sharded projections hold other
        # dtypes (or none yet) by design, and so does autocast.
        if type(self.q_proj) is nn.Linear:
            weight = self.q_proj.weight
            if x.device != weight.device:
                raise ValueError(
                    f"x is on {x.device} but the layer's weights are on {weight.device}; move one to the other "
                    f"(layer.to({str(x.device)!r}), or layer.to_empty(device=...) for a layer built on the meta device)"
                )
            if x.dtype != weight.dtype and not autocast_on(x.device):
                raise TypeError(
                    f"x is {x.dtype} but the layer's weights are {weight.dtype}; move one to the other "
                    "(layer.to(x.dtype) or x.to(...))"
                )
        if isinstance(self.encoding, nn.Module):
            # A buffer that load_state_dict(assign=True) does not fill (ALiBi's own slopes are not saved) stays
            # where the layer was built: the meta device.
            held = _encoding_device(self.encoding)
            if held is not None and held != x.device:
                raise ValueError(
                    f"the layer's encoding {type(self.encoding).__name__} is on {held} but x is on {x.device}; "
                    f"move it with layer.to({str(x.device)!r}) (from the meta device: layer.to_empty(device=...), "
                    "which recomputes ALiBi's slopes, then load the weights)"
                )
        b, s, _ = x.shape
        if cache is not None and not isinstance(cache, KVCache):
            raise TypeError(f"cache must be a posenc.KVCache or None, got {type(cache).__name__}")
        if cache is not None:
            if s == 0 and cache.length == 0:
                # An empty first step would leave the cache holding no position to continue from.
                raise ValueError(
                    f"x has no new tokens (shape {tuple(x.shape)}); the first step into a KV cache must add at "
                    "least one token: skip the call for an empty step"
                )
            cache._claim(self)
            cache.check_batch(b)
        if isinstance(positions, torch.Tensor) and positions.dim() == 3:
            raise ValueError(
                f"positions must be (s,) or (b, s) ids, got shape {tuple(positions.shape)}; three-axis (3, b, s) "
                "M-RoPE ids are taken by posenc.MRoPE called directly (text-only ids work here)"
            )
        if isinstance(positions, torch.Tensor):
            # DTensor ids: their whole values, as the document ids are taken, beside plain x and beside DTensor x (heads
            # sharded) alike. Kept a DTensor, they met the plain tensors of ALiBi's and T5's biases and, cached, the
            # next step's plain ids or arange ("got mixed torch.Tensor and DTensor", eager and compiled); beside
            # DTensor x that was every encoding, RoPE too, until 2026-12-06.
            positions = replicated_values(positions)
        # docs: the ids of every key (b or 1, t), or None (with a cache, the cache's after the update); step_docs:
        # the new tokens' as given.
        docs = step_docs = None
        if document_ids is not None:
            docs = step_docs = resolve_document_ids(document_ids, batch=b, seq_len=s, device=x.device)
        acts_on = self.encoding.acts_on if self.encoding is not None else ActsOn.NONE
        rotating = acts_on is ActsOn.QK and cache is not None and getattr(self.encoding, "rotates_cached_keys", False)
        key_ids = None
        if cache is not None and not rotating:
            # The ids of every key after this step, with one run per id across the cache (the step's alone were
            # checked above), checked before anything changes: the encoding call below advances a dynamic 'hf'
            # RoPE's state. update_rotating checks before it changes anything.
            key_ids = (cache._checked_key_document_ids if cache.length else cache.key_document_ids)(step_docs, s)
        if cache is not None and positions is None:
            pos = cache.next_positions(s, device=x.device, document_ids=step_docs)
        else:
            if step_docs is not None and positions is None:
                positions = positions_from_document_ids(step_docs)
            pos = resolve_positions(s, batch=b, positions=positions, device=x.device)
        q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        for name, t, heads in (("q", q, self.num_heads), ("k", k, self.num_kv_heads), ("v", v, self.num_kv_heads)):
            if t.shape[-1] != heads * self.head_dim:
                # A projection parallelized by ColwiseParallel (use_local_output=True, its default) gives its rank's
                # heads alone, which view() refused with "shape ... is invalid for input of size ...".
                raise ValueError(
                    f"{name}_proj gave {t.shape[-1]} features where the layer's {heads} heads of {self.head_dim} "
                    f"take {heads * self.head_dim}: a projection sharded by tensor parallelism returns its rank's "
                    "heads alone; parallelize it with ColwiseParallel(use_local_output=False), which keeps every "
                    "head as a DTensor, or give the layer whole projections"
                )
            _check_heads_split(name, t, heads, self.head_dim)
        q = q.view(b, s, self.num_heads, self.head_dim).transpose(1, 2)
        k = k.view(b, s, self.num_kv_heads, self.head_dim).transpose(1, 2)
        v = v.view(b, s, self.num_kv_heads, self.head_dim).transpose(1, 2)

        k_pos = pos
        if rotating:
            assert cache is not None
            k, v, k_pos, seq_len = cache.update_rotating(k, v, pos, self.encoding, document_ids=step_docs)
            q = self.encoding.rotate(q, pos, seq_len=seq_len)
        else:
            if cache is not None:
                # Before the encoding call, whose dynamic 'hf' state a refusal after it (another dtype) advanced.
                cache._check_new(k, v, cache.k, pos, step_docs)
            if acts_on is ActsOn.QK:
                q, k = self.encoding(q, k, positions=pos)
            if cache is not None:
                k, v, k_pos = cache._update(k, v, pos, key_ids)
        if cache is not None:
            docs = cache.document_ids
        t = k.shape[2]
        if self.num_kv_heads != self.num_heads:
            k = k.repeat_interleave(self.num_heads // self.num_kv_heads, dim=1)
            v = v.repeat_interleave(self.num_heads // self.num_kv_heads, dim=1)

        out = None
        # Not for a DTensor q (tensor parallelism): attend cuts the bias to each rank's heads.
        if (
            acts_on is ActsOn.SCORE_BIAS
            and not is_dtensor(q)
            and use_flex(self.encoding, q, k, v, need_probs=return_attention)
        ):
            # FlexAttention computes the bias inside the kernel: no (b, h, s, t) mask is built.
            try:
                out, probs = attend_flex(q, k, v, self.encoding, pos, k_pos, document_ids=docs), None
            except FlexFallback as error:
                warnings.warn(f"{error}; the bias is materialized instead (same result, more memory)", stacklevel=2)
        if out is None:
            bias = self.encoding.score_bias(pos, k_pos) if acts_on is ActsOn.SCORE_BIAS else None
            allowed = _causal_mask(s, t, x.device, docs)
            out, probs = _attend(q, k, v, allowed, bias, need_probs=return_attention, causal=docs is None)
        out = self.o_proj(out.transpose(1, 2).reshape(b, s, self.num_heads * self.head_dim))
        return (out, probs) if return_attention else out


def _check_heads_split(name: str, t: torch.Tensor, heads: int, head_dim: int) -> None:
    """Raise ValueError where t, a projection's (b, s, heads * head_dim) output, is a DTensor whose features are
    sharded across n ranks (every mesh dim that shards them, together) in a way that DTensor's view(b, s, heads,
    head_dim) cannot keep: it takes whole heads per rank (heads divisible by n), or one head's channels split (the
    rotation then takes them whole). Its own errors said only "Cannot unflatten unevenly sharded tensor", or named
    a shape."""
    if not is_dtensor(t):
        return
    n = math.prod(
        t.device_mesh.size(mesh_dim)
        for mesh_dim, placement in enumerate(t.placements)
        if placement.is_shard() and placement.dim in (-1, t.dim() - 1)
    )
    if heads % n and heads > 1:
        role = "num_heads" if name == "q" else "num_kv_heads"
        raise ValueError(
            f"{name}_proj's output is sharded across {n} ranks, but {role}={heads} heads of {head_dim} channels do "
            f"not split evenly among them: tensor parallelism needs {role} divisible by the {n} ranks (or a single "
            f"head); use another mesh size, or leave {name}_proj unsharded (replicated)"
        )


def _attend_sharded(q, k, v, allowed: torch.Tensor, bias: torch.Tensor | None, need_probs: bool, causal: bool):
    """``attend`` of a DTensor q (tensor parallelism: heads, or the batch, sharded across the ranks; k, v DTensors or
    plain), on each rank's own heads and rows, returned laid out as q. Heads and sequences attend alone, so no rank
    needs another's; k and v are laid out as q (no communication from replicated ones), the whole mask and bias are
    cut as q is (rank r holds heads r * h / n.. of ALiBi's slopes and T5's table; a (b, h, s, t) bias of every head
    met the shard with "got mixed torch.Tensor and DTensor"). DTensor has no sharding strategy for CPU's fused
    attention (``aten._scaled_dot_product_flash_attention_for_cpu``). Refused for q sharded along the sequence or
    channels, whose keys live on other ranks."""
    module = sys.modules["torch.distributed.tensor"]
    mesh, placements = q.device_mesh, q.placements
    if any(not p.is_replicate() and not (p.is_shard() and p.dim in (0, 1)) for p in placements):
        raise ValueError(
            f"CausalSelfAttention takes DTensor queries sharded on heads or the batch (Shard(1) or Shard(0) of "
            f"(b, h, s, d)), got placements {tuple(placements)}; redistribute them to one of those (tensor "
            "parallelism shards q, k, v on heads: ColwiseParallel), or pass q.full_tensor()"
        )
    b, h, s, _ = q.shape
    t = k.shape[2]

    def local(x: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
        """Rank's rows of x (whole, broadcast to shape), laid out as q."""
        return replicated_like(replicated_values(x).expand(shape), q).redistribute(mesh, placements).to_local()

    def laid_out(x: torch.Tensor) -> torch.Tensor:
        if not is_dtensor(x):
            return local(x, tuple(x.shape))
        return x.redistribute(mesh, placements).to_local()

    q_local, k_local, v_local = q.to_local(), laid_out(k), laid_out(v)
    if allowed.dim() > 2:  # one of the batch or heads: cut as q is (an (s, t) mask serves every rank whole)
        allowed = local(allowed, (b, h, s, t))
    bias = None if bias is None else local(bias, (b, h, s, t))
    out, probs = _attend(q_local, k_local, v_local, allowed, bias, need_probs=need_probs, causal=causal)

    def back(x: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
        """The rank's (contiguous) rows of a whole tensor of shape ``shape``, as a DTensor laid out as q."""
        stride = tuple(math.prod(shape[i + 1 :]) for i in range(len(shape)))
        return module.DTensor.from_local(x, mesh, placements, run_check=False, shape=torch.Size(shape), stride=stride)

    return back(out, (b, h, s, v.shape[-1])), None if probs is None else back(probs, (b, h, s, t))


def _broadcasts(shape: torch.Size, target: tuple) -> bool:
    """Whether a tensor of ``shape`` broadcasts to ``target`` (each of its last dims 1 or the target's)."""
    lead = len(target) - len(shape)
    return lead >= 0 and all(size_in(n, (1, target[lead + i])) for i, n in enumerate(shape))


def _check_attend(q: Any, k: Any, v: Any, allowed: Any, bias: Any) -> None:
    """attend's arguments, by shape, dtype and device (no values read). Unchecked, a wrong one met torch deep
    inside: "The size of tensor a (5) must match the size of tensor b (3)" for a bias of other heads, "~
    (operator.invert) is only implemented on integer and Boolean-type tensors" for a float mask, or an integer bias
    added silently."""
    attention_inputs(q, k, v)
    b, h, s, _ = q.shape
    target = (b, h, s, k.shape[2])
    if not isinstance(allowed, torch.Tensor) or allowed.dtype != torch.bool:
        got = allowed.dtype if isinstance(allowed, torch.Tensor) else type(allowed).__name__
        raise TypeError(
            f"allowed must be a bool tensor, True where a query may attend a key (causal_mask(s, t, device) gives "
            f"it), got {got}"
        )
    same_device(("q", "allowed"), q, allowed)
    if not _broadcasts(allowed.shape, target):
        raise ValueError(
            f"allowed must broadcast to (b, h, s, t) = {target}, as (s, t) or (b or 1, 1 or h, s, t) do, got "
            f"{tuple(allowed.shape)}"
        )
    if bias is not None:
        float_tensor("bias", bias)
        same_device(("q", "bias"), q, bias)
        if not _broadcasts(bias.shape, target):
            raise ValueError(
                f"bias must broadcast to (b, h, s, t) = {target}, as an encoding's score_bias(q_positions, "
                f"k_positions) (b or 1, h, s, t) and bias(s, t, offset) (h, s, t) do, got {tuple(bias.shape)}"
            )
    _check_keys_per_query(allowed, s, k.shape[2])


def _check_keys_per_query(allowed: torch.Tensor, s: int, t: int) -> None:
    """Every query may attend at least one key. A row of ``allowed`` with none has no softmax: SDPA gave it zeros,
    need_probs (and a bias) NaN, so the answer hung on an option; refused instead. Read on the host in eager (one
    sync); checked with the computation where values may not be read."""
    message = (
        "allowed leaves a query with no key to attend (a row that is False for every key), whose attention is "
        "undefined (zeros or NaN); let every query see at least one key, a padding query too (itself: "
        "causal_mask(s, t, device, document_ids) with s <= t does, padding given its own document id)"
    )
    if s == 0:
        return
    if t == 0:
        raise ValueError(message)
    if vmapped(allowed):
        # A mask batched by torch.func.vmap has no values to read, nor a batching rule for the assert: unchecked, as
        # it was before, rather than torch's "data-dependent control flow" error. (Under grad alone it is read.)
        return
    if values_readable(allowed.device):
        if not bool(replicated_values(allowed).any(-1).all()):
            raise ValueError(message)
    else:
        assert_without_sync(allowed.any(-1), message)


def attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    allowed: torch.Tensor,
    bias: torch.Tensor | None,
    *,
    need_probs: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """q: (b, h, s, d); k, v: (b, h, t, d) (grouped-query heads repeated to h); allowed: bool, True where a query
    may attend a key, of any shape that broadcasts to (b, h, s, t) with at least one key per query: causal_mask's
    (s, t), or its (b or 1, 1, s, t) with document ids; bias: floating, broadcasting to (b, h, s, t) (an encoding's
    score_bias (b or 1, h, s, t), or its bias (h, s, t)), or None. Others are errors that name the argument, and so is
    a query that ``allowed`` lets see no key (read on the host: one device sync).

    A score bias is added in float32 (ALiBi's slope * 8192 has no exact bf16 value), so low-precision inputs
    are attended in float32 when a bias is present; so are the probabilities of ``need_probs``, under autocast too
    (which is disabled for them). float64 stays float64 either way. Returns ((b, h, s, d) in q's dtype, probs
    (b, h, s, t) in that wider dtype, or None). A DTensor q (tensor parallelism) is attended on each rank's own heads
    (``_attend_sharded``); the output and probabilities are then DTensors laid out as q.
    """
    _check_attend(q, k, v, allowed, bias)
    # Not causal=True: SDPA's is_causal would ignore a caller's (s, t) mask that is not causal_mask's.
    return _attend(q, k, v, allowed, bias, need_probs=need_probs)


def _attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    allowed: torch.Tensor,
    bias: torch.Tensor | None,
    *,
    need_probs: bool = False,
    causal: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``attend`` without its checks (~5 us a call): for CausalSelfAttention, whose q, k, v, mask and bias are its
    own, with an encoding checked when it was assigned. causal: ``allowed`` is causal_mask(s, t) (no document ids),
    which SDPA's is_causal computes itself where s == t."""
    if is_dtensor(q):
        return _attend_sharded(q, k, v, allowed, bias, need_probs, causal)
    dtype = torch.promote_types(q.dtype, torch.float32)
    if bias is None and not need_probs:
        if causal and q.shape[2] == k.shape[2]:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True), None
        return F.scaled_dot_product_attention(q, k, v, attn_mask=allowed), None
    # Autocast would cast these float32 matmuls and SDPA, its attn_mask (the bias) included, back to bf16/fp16:
    # probabilities off by ~4e-3 and a bias rounded to 8 bits, where the float32 ones are meant.
    with autocast_off(q.device):
        if need_probs:
            scores = q.to(dtype) @ k.to(dtype).transpose(-1, -2) / math.sqrt(q.shape[-1])
            if bias is not None:
                scores = scores + bias.to(dtype)
            probs = scores.masked_fill(~allowed, float("-inf")).softmax(dim=-1)
            return (probs @ v.to(dtype)).to(q.dtype), probs
        mask = bias.to(dtype).masked_fill(~allowed, float("-inf"))
        out = F.scaled_dot_product_attention(q.to(dtype), k.to(dtype), v.to(dtype), attn_mask=mask)
        return out.to(q.dtype), None
