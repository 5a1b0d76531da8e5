"""ALiBi (Press et al., 2022): a per-head linear penalty on the query-key distance, no position embeddings."""

from __future__ import annotations

import math
from typing import Any

import torch

from posenc._checks import flag, float_dtype, float_tensor, is_dtensor, laid_out_as, positive_int, replicated_values
from posenc.bias.base import ScoreBias, on_ids_mesh, score_positions


def alibi_head_count(num_heads: int) -> int:
    """``num_heads`` checked as ALiBi's slopes take it: a positive int, at most 2**24. The slopes are built in a
    Python list (here and in ``posenc.testing``'s reference): 2**62 heads ran without end instead of failing."""
    num_heads = positive_int("num_heads", num_heads)
    if num_heads > 2**24:
        raise ValueError(f"num_heads must be at most 2**24 (one slope a head), got {num_heads}")
    return num_heads


def _geometric_slopes(n: int) -> list[float]:
    # For a power of two n the slopes are 2^(-8/n), 2^(-16/n), ..., 2^(-8).
    start = 2.0 ** (-8.0 / n)
    return [start ** (i + 1) for i in range(n)]


def alibi_slopes(num_heads: int, *, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Per-head slopes, (h,) in ``dtype`` (float32 by default), computed in float64.

    For h not a power of two, the published rule: the slopes of the closest lower power of two p, then every other
    slope of 2p (the odd powers) for the remaining h - p heads, as in the paper's code and BLOOM.
    """
    num_heads = alibi_head_count(num_heads)
    closest = 2 ** math.floor(math.log2(num_heads))
    slopes = _geometric_slopes(closest)
    if closest != num_heads:
        slopes += _geometric_slopes(2 * closest)[0::2][: num_heads - closest]
    float_dtype("dtype", dtype)
    return torch.tensor(slopes, dtype=torch.float64).to(dtype)


def alibi_bias(
    slopes: torch.Tensor, q_positions: torch.Tensor, k_positions: torch.Tensor, *, causal: bool = True
) -> torch.Tensor:
    """-slope * |m - n| for query position m and key position n.

    slopes: (h,); q_positions: (b, sq) or (sq,); k_positions: (b, sk) or (sk,) integer, moved to the slopes'
    device if elsewhere. Returns (b, h, sq, sk) float32, or float64 for float64 slopes (b = 1 for 1-D positions):
    never 16 bits, whose 8 or 11 bits of mantissa cannot hold slope * distance (a bf16 slope 2^-0.5 is off by 8e-5:
    0.6 at distance 8192). With ``causal`` the future (n > m) is -inf, so the bias alone is a full mask: that is
    only right where positions are token indices, not for packed documents whose ids restart.
    ``ALiBi.score_bias`` passes ``causal=False``: attention masks by token order itself.
    """
    float_tensor("slopes", slopes)
    flag("causal", causal)
    if slopes.dim() != 1:
        raise ValueError(f"slopes must be (h,), one per head, got shape {tuple(slopes.shape)}")
    q_positions, k_positions = score_positions(q_positions, k_positions, device=slopes.device, what="the ALiBi slopes")
    dtype = torch.float64 if slopes.dtype == torch.float64 else torch.float32
    distance = (q_positions[:, :, None] - k_positions[:, None, :]).to(dtype)  # (b, sq, sk)
    bias = -slopes.to(dtype)[None, :, None, None] * distance.abs()[:, None]
    if causal:
        bias = bias.masked_fill((distance < 0)[:, None], float("-inf"))
    return bias


def _standard(slopes: torch.Tensor, num_heads: int) -> bool:
    """Whether ``slopes`` are ``alibi_slopes(num_heads)`` in their own dtype (on the meta device, with no values
    to read: assumed so, as ``ALiBi`` builds them)."""
    if slopes.is_meta:
        return True
    slopes = replicated_values(slopes)  # a DTensor's whole values: torch.equal refused it beside a plain tensor
    return torch.equal(slopes, alibi_slopes(num_heads, dtype=slopes.dtype).to(slopes.device))


class ALiBi(ScoreBias):
    """num_heads: h; causal: the ``bias`` view is -inf on keys after the query (False: symmetric, for encoders).

    ``score_bias`` is -slope * |m - n| for any positions, never -inf, whatever ``causal`` says: which keys a query
    may see is decided by token order (``CausalSelfAttention``'s causal mask, FlexAttention's block mask), not by
    position ids. With packed documents whose ids restart, a key of an earlier document can have a larger id than
    the query and must still get its distance penalty rather than be hidden; both attention paths agree on that.
    To keep packed documents apart, give the attention ``document_ids``.
    """

    # (h,) float32, a buffer: the head count's own are not saved (recomputed from num_heads); assigned ones are, as
    # "slopes" (_save_to_state_dict).
    slopes: torch.Tensor

    def __init__(self, num_heads: int, *, causal: bool = True) -> None:
        super().__init__()
        self.num_heads = positive_int("num_heads", num_heads)
        self.causal = flag("causal", causal)
        self.register_buffer("slopes", alibi_slopes(num_heads), persistent=False)

    @classmethod
    def from_model_dims(cls, *, dim: int, num_heads: int, head_dim: int, max_positions: int, **options: Any) -> ALiBi:
        """``ALiBi(num_heads, **options)`` (``build_for_model``'s hook): one slope a head; dim, head_dim and
        max_positions are not read (the bias is defined at any length)."""
        return cls(num_heads, **options)

    def _apply(self, fn, recurse: bool = True) -> ALiBi:  # type: ignore[no-untyped-def]
        # A cast of the module decides the bias dtype, float64 or float32, but the slopes are recomputed from the
        # head count rather than cast: model.to(bfloat16) would round 2^-0.5 to 0.70703125, and .double() would
        # keep float32's rounding of it. Slopes that are not the head count's (learned ones, a Parameter, or
        # assigned ones) keep their values: recomputed, every .to() and .float() reset them without a word.
        before = self.slopes.detach()  # its own view: a Parameter's .data is swapped by the cast
        super()._apply(fn, recurse)
        slopes = self.slopes
        target = alibi_slopes(self.num_heads, dtype=torch.float64) if _standard(before, self.num_heads) else before
        if slopes.dtype in (torch.float32, torch.float64):
            # In place, so that what fn did to the storage (share_memory_, a device) stays done. A move or cast
            # that changes nothing hands back the buffer itself, which is an inference tensor where the module was
            # built or cast inside torch.inference_mode: writing to one is refused outside it, so write inside it.
            # no_grad inside: inference_mode(False) turns grad mode back on, and a Parameter refuses the write.
            with torch.inference_mode(slopes.is_inference() or torch.is_inference_mode_enabled()), torch.no_grad():
                slopes.copy_(target)
        elif "slopes" in self._buffers:  # a Parameter stays the tensor its optimizer holds, cast as any other
            self._buffers["slopes"] = target.to(device=slopes.device, dtype=torch.float32)
        return self

    def _save_to_state_dict(self, destination: dict[str, Any], prefix: str, keep_vars: bool) -> None:
        # Assigned slopes (a tensor-parallel rank's heads of the whole model) are saved under "slopes", the key a
        # learned Parameter has: unsaved, a model reloaded from its state dict attended with the slopes of a model
        # of num_heads heads, without a word. The head count's own stay out, as they always were (recomputed).
        super()._save_to_state_dict(destination, prefix, keep_vars)
        slopes = self._buffers.get("slopes")
        if slopes is not None and not _standard(slopes.detach(), self.num_heads):
            # A copy of their own: assigned as alibi_slopes(h)[i:j] they are a view of part of a storage, which
            # safetensors' save_model refuses to write.
            destination[prefix + "slopes"] = slopes if keep_vars else slopes.detach().clone()

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
        super()._load_from_state_dict(
            state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs
        )
        key, slopes = prefix + "slopes", self._buffers.get("slopes")
        if key not in state_dict or slopes is None:
            return  # none saved: the head count's (or a Parameter's, loaded above); assigned ones stay as they are
        if key in unexpected_keys:
            unexpected_keys.remove(key)
        saved = state_dict[key]
        if not isinstance(saved, torch.Tensor) or saved.shape != (self.num_heads,):
            got = tuple(saved.shape) if isinstance(saved, torch.Tensor) else type(saved).__name__
            error_msgs.append(
                f"size mismatch for {key}: ALiBi slopes saved with shape {got}, but this ALiBi has "
                f"num_heads={self.num_heads}; build it with the saved model's head count"
            )
            return
        # A tensor of the module's own, in the buffer's dtype and device (as a cast keeps them): written into, the
        # assigned tensor was the caller's (the whole alibi_slopes(h) of the README's recipe), and a replacement
        # taken as it came shared the source model's. Written in place where the buffer is shared memory (other
        # processes read it: share_memory() stays done) or a DTensor (its layout stays). With assign=True, the
        # saved tensor itself, as torch assigns.
        if local_metadata.get("assign_to_params_buffers", False):
            self._buffers["slopes"] = saved
            return
        if is_dtensor(slopes):
            # distribute_module's slopes: the saved values laid out as they are.
            self._buffers["slopes"] = laid_out_as(saved.detach().to(slopes.dtype), slopes)
            return
        own = saved.detach().to(device=slopes.device, dtype=slopes.dtype, copy=True)
        if slopes.is_shared() and slopes.shape == own.shape:
            with torch.inference_mode(slopes.is_inference()), torch.no_grad():
                slopes.copy_(own)
        else:
            self._buffers["slopes"] = own

    def score_bias(self, q_positions: torch.Tensor, k_positions: torch.Tensor) -> torch.Tensor:
        """q_positions: (b, sq) or (sq,), k_positions: (b, sk) or (sk,) integer, on any device (moved to the
        slopes'; meta ids cannot serve real slopes). Returns (b, h, sq, sk) float32 (float64 once the module is cast
        to float64), finite everywhere (the caller's attention mask decides what is future).

        DTensor ids (either or both; tensor parallelism): the bias of their whole values, a DTensor replicated on
        their mesh, which DTensor adds to scores sharded on heads without communication (each rank keeps its
        heads)."""
        return on_ids_mesh(lambda q, k: alibi_bias(self.head_slopes(), q, k, causal=False), q_positions, k_positions)

    def head_slopes(self) -> torch.Tensor:
        """``slopes``, (num_heads,), after checking that assigned ones still have one per head."""
        if self.slopes.shape != (self.num_heads,):
            raise ValueError(
                f"ALiBi.slopes has shape {tuple(self.slopes.shape)}, but this ALiBi has num_heads={self.num_heads}: "
                "assign one slope per head (a tensor-parallel rank holding heads i..j-1 of h: ALiBi(j - i) with "
                "slopes posenc.alibi_slopes(h)[i:j])"
            )
        return self.slopes

    def bias(self, q_len: int, k_len: int, *, offset: int = 0) -> torch.Tensor:
        """Queries at offset..offset+q_len-1, keys at 0..k_len-1. Returns (h, q_len, k_len) in ``score_bias``'s dtype;
        with ``causal`` keys after their query are -inf (here positions are token indices, so that is the causal
        mask)."""
        bias = super().bias(q_len, k_len, offset=offset)
        if not self.causal:
            return bias
        # Key n is after query m = offset + i exactly where n - i > offset; none is past k_len - 1 (and offset + 1
        # overflowed triu's int64 at the last position).
        future = torch.ones(q_len, k_len, dtype=torch.bool, device=bias.device).triu(diagonal=min(offset + 1, k_len))
        return bias.masked_fill(future, float("-inf"))

    def extra_repr(self) -> str:
        return f"num_heads={self.num_heads}, causal={self.causal}"
