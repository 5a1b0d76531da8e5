#!/usr/bin/env bash
# On a machine with a CUDA GPU: run the kernel tests with Triton compiled for the GPU (not interpreted), then the
# GPU benchmarks, writing CSVs under docs/results/ and the log to docs/results/gpu_check.log.
#
#   bash scripts/gpu_check.sh            # about 5 minutes on one H100/H200
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p docs/results
log=docs/results/gpu_check.log
python -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 'no CUDA device: this script is for GPU machines')"
{
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  python -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
  # POSENC_TRITON_NATIVE=1: tests/conftest.py leaves TRITON_INTERPRET off and the Triton cases run on CUDA.
  POSENC_TRITON_NATIVE=1 TRITON_INTERPRET=0 python -m pytest -q tests/kernels -p no:cacheprovider
  python benchmarks/rope.py --device cuda --seqs 1024 4096 16384 32768 --dtypes fp32 bf16 --reps 50 \
    --csv docs/results/rope_gpu.csv
  python benchmarks/rope_module.py --device cuda --csv docs/results/rope_module_gpu.csv
  python benchmarks/bias_memory.py --device cuda --seq 8192 --csv docs/results/bias_memory_gpu.csv
} 2>&1 | tee "$log"
