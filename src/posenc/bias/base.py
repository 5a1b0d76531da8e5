"""What score-bias encodings share: the (h, q_len, k_len) convenience view of ``score_bias``."""

from __future__ import annotations

import torch
from torch import nn

from posenc._checks import positive_int
from posenc.encoding import ActsOn


class ScoreBias(nn.Module):
    """Subclasses implement ``score_bias(q_positions (b, sq), k_positions (b, sk)) -> (b, h, sq, sk)``."""

    acts_on = ActsOn.SCORE_BIAS

    def score_bias(self, q_positions: torch.Tensor, k_positions: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def _device(self) -> torch.device:
        return next(iter(self.buffers()), next(iter(self.parameters()), torch.empty(0))).device

    def bias(self, q_len: int, k_len: int, *, offset: int = 0) -> torch.Tensor:
        """Queries at offset..offset+q_len-1, keys at 0..k_len-1. Returns (h, q_len, k_len)."""
        positive_int("q_len", q_len)
        positive_int("k_len", k_len)
        if isinstance(offset, bool) or not isinstance(offset, int) or offset < 0:
            raise ValueError(f"offset must be an int >= 0 (tokens already in the cache), got {offset!r}")
        device = self._device()
        q = torch.arange(offset, offset + q_len, device=device)
        k = torch.arange(k_len, device=device)
        return self.score_bias(q[None], k[None])[0]
