"""Fused rotary kernels: Triton for CUDA tensors, a compiled C++ loop for CPU tensors, and FlexAttention score
biases. ``posenc.apply_rotary(..., backend=...)`` is the way in; this package holds the kernels, their
``torch.library`` ops and the backend choice. Triton is imported only when the Triton backend is used."""

from posenc.kernels.backend import BACKENDS, choose_backend, triton_available
from posenc.kernels.cpu_rope import cpu_available

__all__ = ["BACKENDS", "choose_backend", "cpu_available", "triton_available"]
