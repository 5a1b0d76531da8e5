"""T5's relative position bias (Raffel et al., 2020): distances bucketed (exact when small, logarithmic up to
``max_distance``), one learned scalar per bucket and head."""

from __future__ import annotations

import math
from typing import Any

import torch

from posenc._checks import flag, int_tensor, positive_int
from posenc._embedding import SmallInitEmbedding
from posenc.bias.base import ScoreBias, on_ids_mesh, score_positions


def _check_buckets(num_buckets: int, max_distance: int, bidirectional: bool) -> tuple[int, int]:
    """num_buckets and max_distance checked, as plain ints (numpy's integers too)."""
    flag("bidirectional", bidirectional)
    num_buckets, max_distance = positive_int("num_buckets", num_buckets), positive_int("max_distance", max_distance)
    per_direction = num_buckets // 2 if bidirectional else num_buckets
    max_exact = per_direction // 2
    if max_exact < 1:
        raise ValueError(
            f"num_buckets={num_buckets} is too small: need at least {4 if bidirectional else 2} "
            f"({'bidirectional' if bidirectional else 'causal'})"
        )
    if max_distance <= max_exact:
        raise ValueError(
            f"max_distance={max_distance} is too small for num_buckets={num_buckets}: it must be > {max_exact} "
            f"(the exact buckets cover distances 0..{max_exact - 1}; logarithmic ones reach max_distance)"
        )
    return num_buckets, max_distance


def t5_relative_bucket(
    relative_position: torch.Tensor, *, bidirectional: bool, num_buckets: int = 32, max_distance: int = 128
) -> torch.Tensor:
    """Bucket of each relative position (key position - query position), same shape, int64.

    Matches Hugging Face T5's ``_relative_position_bucket`` exactly, including its float32 logarithm, since
    bucket edges are where two implementations can disagree.
    """
    int_tensor("relative_position", relative_position)
    num_buckets, max_distance = _check_buckets(num_buckets, max_distance, bidirectional)
    # -2**63 has no int64 negation nor abs (both gave -2**63: bucket 0, or a negative bucket); one step nearer is
    # as far past max_distance.
    relative_position = relative_position.to(torch.long).clamp(min=-(2**63 - 1))
    buckets = torch.zeros_like(relative_position)
    if bidirectional:
        num_buckets //= 2
        buckets = buckets + (relative_position > 0).to(torch.long) * num_buckets
        distance = relative_position.abs()
    else:
        distance = (-relative_position).clamp(min=0)
    max_exact = num_buckets // 2
    is_small = distance < max_exact
    # distance is >= max_exact wherever this branch is used; clamp keeps log(0) out of the unused lanes.
    large = max_exact + (
        torch.log(distance.clamp(min=1).float() / max_exact)
        / math.log(max_distance / max_exact)
        * (num_buckets - max_exact)
    ).to(torch.long)
    large = large.clamp(max=num_buckets - 1)
    return buckets + torch.where(is_small, distance, large)


# The key nn.Module gives get_extra_state's value under the module's prefix (torch's own name is private).
_EXTRA_STATE_KEY_SUFFIX = "_extra_state"


def _settings_text(num_buckets: int, max_distance: int, bidirectional: bool) -> str:
    return f"num_buckets={num_buckets}, max_distance={max_distance}, bidirectional={bidirectional}"


class T5Bias(ScoreBias):
    """num_heads: h; num_buckets, max_distance: as in T5; bidirectional: True for encoders, False for decoders.

    ``table`` is a (num_buckets, h) learned embedding. The state dict also holds the bucket settings
    (``_extra_state``: int64 [num_buckets, max_distance, bidirectional]), and loading refuses a table saved with
    others: its shape alone let a table learned at another max_distance or direction load, and be read at other
    distances. State dicts saved before the settings were (without the key) still load, strictly too.

    As in T5, a decoder's (``bidirectional=False``) relative position n - m > 0 falls in bucket 0, the query's own.
    Attention masks by token order, not by ids, so with packed documents whose ids restart a query also sees the
    earlier documents' keys, and those whose ids exceed its own get bucket 0 too (ALiBi's |m - n| keeps penalising
    them): give ``CausalSelfAttention`` the ``document_ids`` (then no query sees another document), or do not
    restart the ids.
    """

    def __init__(
        self, num_heads: int, *, num_buckets: int = 32, max_distance: int = 128, bidirectional: bool = False
    ) -> None:
        super().__init__()
        self.num_heads = positive_int("num_heads", num_heads)
        self.num_buckets, self.max_distance = _check_buckets(num_buckets, max_distance, bidirectional)
        self.bidirectional = bidirectional
        self.table = SmallInitEmbedding(self.num_buckets, self.num_heads)

    @classmethod
    def from_model_dims(cls, *, dim: int, num_heads: int, head_dim: int, max_positions: int, **options: Any) -> T5Bias:
        """Buckets sized to the training length ``max_positions`` unless given: ``max_distance`` = max_positions and
        at most 32 buckets (16 a direction when bidirectional), so that every bucket some distance falls in, at any
        length, is one that training reaches: longer sequences put their longer distances in the last one. T5's own
        max_distance of 128 came with 512-token training; at a training length of 113 or less, 32 causal buckets
        reaching 128 have buckets that training never reaches and longer sequences read. (Until 2026-12-04 this
        built T5's 32 and 128 at every length.)"""
        # Checked as build_for_model checks it: -1, 0 and True built 2 buckets reaching 2 without a word.
        max_positions = positive_int("max_positions", max_positions)
        bidirectional = flag("bidirectional", options.get("bidirectional", False))
        directions = 2 if bidirectional else 1
        if "num_buckets" in options:
            options["num_buckets"] = positive_int("num_buckets", options["num_buckets"])
        else:
            options["num_buckets"] = directions * max(2, min(32 // directions, max_positions))
        # Above the exact buckets, which a training length below them would otherwise leave max_distance inside.
        options.setdefault("max_distance", max(max_positions, options["num_buckets"] // directions // 2 + 1))
        return cls(num_heads, **options)

    def buckets(self, q_positions: torch.Tensor, k_positions: torch.Tensor) -> torch.Tensor:
        """q_positions: (b, sq) or (sq,), k_positions: (b, sk) or (sk,) integer, on any device (moved to the table's;
        meta ids cannot serve a real table). Returns (b, sq, sk) int64 bucket ids on the table's device (b = 1 for
        1-D positions)."""
        q_positions, k_positions = score_positions(
            q_positions, k_positions, device=self.table.weight.device, what="the T5 bias table"
        )
        relative = k_positions[:, None, :] - q_positions[:, :, None]
        return t5_relative_bucket(
            relative,
            bidirectional=self.bidirectional,
            num_buckets=self.num_buckets,
            max_distance=self.max_distance,
        )

    def score_bias(self, q_positions: torch.Tensor, k_positions: torch.Tensor) -> torch.Tensor:
        """q_positions: (b, sq) or (sq,), k_positions: (b, sk) or (sk,) integer. Returns (b, h, sq, sk) in the
        table's dtype; a causal T5 puts keys after the query in bucket 0 (never -inf): the attention masks them.

        DTensor ids (either or both; tensor parallelism): the bias of their whole values, a DTensor replicated on
        their mesh, which DTensor adds to scores sharded on heads without communication (each rank keeps its
        heads; the table's gradient is gathered from every rank's heads)."""
        return on_ids_mesh(lambda q, k: self.table(self.buckets(q, k)).permute(0, 3, 1, 2), q_positions, k_positions)

    def get_extra_state(self) -> torch.Tensor:
        """(3,) int64 on the CPU, saved in the state dict: num_buckets, max_distance, bidirectional (0 or 1), which
        ``load_state_dict`` checks against this module's (the (num_buckets, h) table's shape shows neither of the
        last two)."""
        # A tensor, which safetensors stores, and a new one on every call: a buffer would be one tensor under every
        # layer that shares the bias, which safetensors' save_model keeps once, and its load_model then refused the
        # files saved before (no such key under any name) for the names it had dropped.
        return torch.tensor([self.num_buckets, self.max_distance, int(self.bidirectional)], device="cpu")

    def set_extra_state(self, state: Any) -> None:
        self._check_saved_settings(state, "")

    def _check_saved_settings(self, state: Any, prefix: str) -> None:
        where = f" (under {prefix!r})" if prefix else ""
        if not isinstance(state, torch.Tensor) or state.shape != (3,) or state.dtype.is_floating_point:
            raise RuntimeError(
                f"the T5 bias settings saved{where} must be an integer tensor [num_buckets, max_distance, "
                f"bidirectional], as T5Bias.state_dict() writes them, got {state!r}"
            )
        if state.is_meta:  # no values to compare: loading meta tensors copies nothing either
            return
        num_buckets, max_distance, bidirectional = (int(v) for v in state.tolist())
        saved = _settings_text(num_buckets, max_distance, bool(bidirectional))
        mine = _settings_text(self.num_buckets, self.max_distance, self.bidirectional)
        if saved != mine:
            raise RuntimeError(
                f"the T5 bias table{where} was saved with {saved}, but this T5Bias has {mine}: its learned values "
                f"belong to other distances. Build the T5Bias with {saved} to load it (from_model_dims and "
                "build_for_model size the buckets by max_positions: pass the saved values as options)"
            )

    def _load_from_state_dict(
        self,
        state_dict: dict[str, Any],
        prefix: str,
        local_metadata: dict[str, Any],
        strict: bool,
        missing_keys: list[str],
        unexpected_keys: list[str],
        error_msgs: list[str],
    ) -> None:
        key = prefix + _EXTRA_STATE_KEY_SUFFIX
        if key in state_dict:  # checked here, before the table (a child module) loads, and named by its prefix
            self._check_saved_settings(state_dict[key], prefix)
        super()._load_from_state_dict(
            state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs
        )
        # Saved before the settings were: the table's shape is all there is to check, as it was.
        if key not in state_dict and key in missing_keys:
            missing_keys.remove(key)

    def extra_repr(self) -> str:
        return (
            f"num_heads={self.num_heads}, num_buckets={self.num_buckets}, "
            f"max_distance={self.max_distance}, bidirectional={self.bidirectional}"
        )
