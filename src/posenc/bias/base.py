"""What score-bias encodings share: checking the positions ``score_bias`` takes, and the (h, q_len, k_len)
convenience view of it."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from posenc._checks import (
    first_dtensor,
    int64_int,
    int_tensor,
    integer,
    positive_int,
    replicated_like,
    replicated_values,
    size_in,
    to_device,
)
from posenc.encoding import ActsOn


def score_positions(
    q_positions: torch.Tensor, k_positions: torch.Tensor, *, device: torch.device, what: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """q_positions: (sq,) or (b, sq), k_positions: (sk,) or (b, sk) integer. Returns both as (b or 1, n) int64 on
    ``device``, where the encoding's own tensors (``what``, for errors) are.

    Positions are index tensors, moved like RoPE's and the learned table's: CPU ids may serve a CUDA bias, real ids a
    meta one (shape inference); meta ids, which have no values, cannot serve a real one.

    A 1-D tensor is one sequence shared by the whole batch (a batch of 1 that broadcasts), as ``positions=`` of
    ``CausalSelfAttention``. Raises TypeError for non-integer positions (ALiBi and T5 alike: a float position is
    a bug upstream, not a distance), ValueError for other ranks or batch sizes that do not broadcast. int64,
    because the encodings subtract them: in uint8 0 - 5 is 251, and int8/int16 wrap past their range likewise.
    Their differences must fit in int64 too, which ids >= 0 (every posenc layer's) always do; negative ids are taken
    (a bias reads only distances), and a pair 2**63 or more apart wraps, unread (reading ids costs a device sync).
    """
    checked = []
    for name, positions in (("q_positions", q_positions), ("k_positions", k_positions)):
        int_tensor(name, positions)
        if positions.dim() not in (1, 2):
            raise ValueError(
                f"{name} must have shape (n,) or (b, n) (one row of positions per sequence), "
                f"got shape {tuple(positions.shape)}"
            )
        positions = to_device(name, positions, device, what)
        checked.append((positions if positions.dim() == 2 else positions[None]).long())
    q, k = checked
    if q.shape[0] != k.shape[0] and not size_in(1, (q.shape[0], k.shape[0])):
        raise ValueError(
            f"q_positions has batch {q.shape[0]} but k_positions has batch {k.shape[0]}; give both the same batch, "
            "or one of them a batch of 1 (or 1-D) to share it"
        )
    return q, k


def on_ids_mesh(
    score_bias: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    q_positions: torch.Tensor,
    k_positions: torch.Tensor,
) -> torch.Tensor:
    """``score_bias(q_positions, k_positions)`` of plain ids; of DTensor ids (either or both), the bias of their whole
    values as a DTensor replicated on the first one's mesh. Added to DTensor scores sharded on heads (tensor
    parallelism), DTensor's own rules then keep each rank's heads of it without communication. The biases' plain
    slopes and table met the ids' DTensor ("got mixed torch.Tensor and DTensor")."""
    like = first_dtensor(q_positions, k_positions)
    if like is None:
        return score_bias(q_positions, k_positions)
    return replicated_like(score_bias(replicated_values(q_positions), replicated_values(k_positions)), like)


class ScoreBias(nn.Module):
    """Subclasses implement ``score_bias(q_positions (b, sq), k_positions (b, sk)) -> (b, h, sq, sk)``."""

    acts_on = ActsOn.SCORE_BIAS

    def score_bias(self, q_positions: torch.Tensor, k_positions: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def _device(self) -> torch.device:
        return next(iter(self.buffers()), next(iter(self.parameters()), torch.empty(0))).device

    def bias(self, q_len: int, k_len: int, *, offset: int = 0) -> torch.Tensor:
        """Queries at offset..offset+q_len-1, keys at 0..k_len-1. Returns (h, q_len, k_len)."""
        q_len, k_len = positive_int("q_len", q_len), positive_int("k_len", k_len)
        offset = integer(
            "offset", offset, low=0, expected="an int >= 0 (tokens already in the cache)", type_error=TypeError
        )
        int64_int("the last query's position, offset + q_len - 1,", offset + q_len - 1)
        device = self._device()
        # arange(offset, offset + q_len): its end, one past the last query, overflowed int64 where the last fits.
        q = torch.arange(q_len, device=device) + offset
        k = torch.arange(k_len, device=device)
        return self.score_bias(q[None], k[None])[0]
