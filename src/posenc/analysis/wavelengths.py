"""Wavelengths of the RoPE frequency pairs against the training context.

Pair i turns by theta_i per position, so it repeats every lambda_i = 2 pi / theta_i = 2 pi base^(2i/r) positions.
Pairs with lambda_i > L never complete a turn within the training length L: the model only saw a fraction of
their circle, which is why NTK-by-parts, YaRN and Llama 3 interpolate those and leave the fast ones alone.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

import torch

from posenc._checks import positive_int
from posenc.rope.module import RoPE
from posenc.rope.parameters import compute_frequencies, trained_length


@dataclasses.dataclass(frozen=True)
class WavelengthResult:
    """Per rotated pair i (shape (r/2,) each): inv_freq theta_i float64 under the configuration; wavelength
    2 pi / theta_i in positions; base_inv_freq / base_wavelength for plain RoPE with the same base and rotary dim;
    train_len L. Derived: rotations (turns within L), partial (True where the pair turns less than once within
    L) and unchanged (True where the scaling left theta_i as plain RoPE has it, to 4 ulp)."""

    inv_freq: torch.Tensor
    wavelength: torch.Tensor
    base_inv_freq: torch.Tensor
    base_wavelength: torch.Tensor
    train_len: int
    rope_type: str
    attention_factor: float

    @property
    def pair(self) -> torch.Tensor:
        """(r/2,) int64: the pair index i, 0 .. r/2 - 1."""
        return torch.arange(self.inv_freq.shape[0])

    @property
    def rotations(self) -> torch.Tensor:
        """(r/2,) float64: L / lambda_i, the turns pair i makes within the training length."""
        return self.train_len / self.wavelength

    @property
    def partial(self) -> torch.Tensor:
        """(r/2,) bool: True where pair i turns less than once within the training length (lambda_i > L)."""
        return self.wavelength > self.train_len

    @property
    def unchanged(self) -> torch.Tensor:
        """(r/2,) bool: True where the scaling left theta_i as plain RoPE has it, to 4 ulp."""
        # Up to rounding: at factor 1, YaRN's ramp and Llama 3's band blend theta / 1 with theta and land an ulp off
        # theta, and a pair the type leaves alone must not look changed for that (a factor 1 + 1e-12 changes it).
        return (self.inv_freq - self.base_inv_freq).abs() <= 4 * torch.finfo(torch.float64).eps * self.base_inv_freq


def wavelengths(
    head_dim: int,
    train_len: int,
    *,
    base: float | None = None,
    rope_parameters: Mapping[str, Any] | None = None,
    seq_len: int | None = None,
) -> WavelengthResult:
    """Wavelength of every frequency pair for one RoPE configuration, and for plain RoPE beside it.

    head_dim: d; train_len: the training context L (RoPE's ``max_position_embeddings``); base / rope_parameters:
    as for ``posenc.RoPE``; seq_len: the length that length-dependent types (dynamic) scale for.
    """
    train_len = positive_int("train_len", train_len)
    if rope_parameters is not None and not isinstance(rope_parameters, Mapping):  # read with .get below
        raise TypeError(
            "rope_parameters must be a dict like {'rope_type': 'default', 'rope_theta': 10000.0}, "
            f"got {type(rope_parameters).__name__}"
        )
    # The counts against L (pairs that turn less than once) must use the length the scaling extends from: a model
    # config's max_position_embeddings (the extended length) beside YaRN's original one counted them at the wrong L.
    original = trained_length((rope_parameters or {}).get("original_max_position_embeddings"))  # 4096.0, numpy's
    if isinstance(original, int) and not isinstance(original, bool) and original != train_len:
        raise ValueError(
            f"train_len={train_len} but rope_parameters say original_max_position_embeddings={original}: both are "
            f"the length the model was trained at; pass train_len={original}"
        )
    rope = RoPE(head_dim, base=base, rope_parameters=rope_parameters, max_position_embeddings=train_len)
    inv_freq, factor = rope.frequencies(seq_len)
    plain = dataclasses.replace(rope.spec, rope_type="default", params={})
    base_inv_freq, _ = compute_frequencies(plain)
    return WavelengthResult(
        inv_freq=inv_freq,
        wavelength=2 * math.pi / inv_freq,
        base_inv_freq=base_inv_freq,
        base_wavelength=2 * math.pi / base_inv_freq,
        train_len=train_len,
        rope_type=rope.rope_type,
        attention_factor=float(factor),
    )
