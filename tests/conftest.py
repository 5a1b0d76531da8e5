"""Suite-wide setup.

On machines without a GPU the Triton kernels are tested through Triton's interpreter on CPU tensors. Triton reads
TRITON_INTERPRET when a kernel is decorated, so it must be set before any test module (kernels, interop, lab...)
imports ``posenc.kernels.triton_rope``: this root conftest is loaded before every test module. On a GPU machine
scripts/gpu_check.sh sets POSENC_TRITON_NATIVE=1 to run the same tests compiled for CUDA.
"""

import os

if os.environ.get("POSENC_TRITON_NATIVE") != "1":
    os.environ.setdefault("TRITON_INTERPRET", "1")
