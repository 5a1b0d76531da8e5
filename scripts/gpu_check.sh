#!/usr/bin/env bash
# On a machine with a CUDA GPU: the kernel tests with Triton compiled for the GPU (not interpreted), then the GPU
# benchmarks, the issue's goal first (s = 16k, bf16 and fp32), then the kernel's configurations at that size. Each
# step runs under its own time limit and a failing step is logged without stopping the next, so one slow or broken
# step cannot cost the measurements. It writes eight files, the device tool's limit.
# Needs torch with CUDA, triton, pytest, hypothesis and transformers; posenc itself is read from src/.
# Liger and flash-attention join the comparison when importable: scripts/gpu_prepare.sh puts them in .gpu/site.
#
#   bash scripts/gpu_check.sh                     # 6-8 minutes on one H200 (estimated); results in docs/results/
#   RESULTS=$OUT bash scripts/gpu_check.sh        # through the device tool: run(carry=[".gpu"], timeout_s=570)
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
RESULTS=${RESULTS:-docs/results}
export PYTHONPATH="$PWD/src:$PWD/.gpu/site${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
mkdir -p "$RESULTS"
$PY -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 'no CUDA device: this script is for GPU machines')" ||
  exit 1

failed=0
step() { # step SECONDS NAME COMMAND...
  local limit=$1 name=$2 status
  shift 2
  echo "=== $name (limit ${limit} s) $(date -u +%H:%M:%S)"
  timeout "$limit" "$@"
  status=$?
  if [ "$status" -ne 0 ]; then
    echo "=== $name FAILED (exit $status)"
    failed=1
  fi
}

{
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  $PY -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
  # POSENC_TRITON_NATIVE=1: tests/conftest.py leaves TRITON_INTERPRET off and the Triton cases run on CUDA. Most of
  # the step is compiling kernels: 8 workers where pytest-xdist is installed (the H200 image has it).
  workers=$($PY -c "import xdist" 2>/dev/null && echo "-n 8")
  step 150 "kernel tests, Triton compiled for the GPU" env POSENC_TRITON_NATIVE=1 TRITON_INTERPRET=0 \
    $PY -m pytest -q $workers tests/kernels -p no:cacheprovider --ignore=tests/kernels/test_rope_fuzz.py
  # The GPU's clock (events; host work hidden), then the host's around each synchronized call (overhead included).
  step 120 "RoPE forward at 16k, the goal" $PY benchmarks/rope.py --device cuda --seqs 16384 --dtypes bf16 fp32 \
    --modes fwd --reps 50 --csv "$RESULTS/rope_gpu_16k.csv"
  step 120 "Triton configurations at 16k" $PY benchmarks/triton_tune.py --seq 16384 --dtypes bf16 fp32 \
    --layouts bhsd bshd --block-s 8 16 32 64 --warps 2 4 8 --heads 1 2 4 8 --reps 30 --csv "$RESULTS/rope_gpu_tune.csv"
  step 45 "RoPE forward at 16k, host clock" $PY benchmarks/rope.py --device cuda --seqs 16384 --dtypes bf16 \
    --modes fwd --reps 50 --clock host --providers posenc-triton posenc-torch hf-eager liger flash-attn \
    --csv "$RESULTS/rope_gpu_16k_host.csv"
  step 120 "RoPE sweep" $PY benchmarks/rope.py --device cuda --seqs 1024 4096 16384 32768 --dtypes bf16 fp32 \
    --reps 30 --csv "$RESULTS/rope_gpu.csv"
  step 45 "RoPE module" $PY benchmarks/rope_module.py --device cuda --csv "$RESULTS/rope_module_gpu.csv"
  step 45 "bias memory" $PY benchmarks/bias_memory.py --device cuda --seq 8192 --paths materialized flex --csv "$RESULTS/bias_memory_gpu.csv"
  # Adjacent pairs (GPT-J, Cohere, GLM, Llama 4): there HEADS >= 2 takes 124-128 registers in fp32 (sm_90).
  step 60 "Triton configurations at 16k, adjacent pairs" $PY benchmarks/triton_tune.py --seq 16384 --dtypes bf16 fp32 \
    --layouts bhsd --pairs adjacent --block-s 8 16 32 --warps 4 8 --heads 1 2 --reps 20 \
    --csv "$RESULTS/rope_gpu_tune_adjacent.csv"
  # Last: random calls compile a kernel each (about 30 compiles), and the measurements above matter more.
  step 60 "fuzz, Triton compiled for the GPU" env POSENC_TRITON_NATIVE=1 TRITON_INTERPRET=0 \
    $PY -m pytest -q tests/kernels/test_rope_fuzz.py -p no:cacheprovider -k triton
  # The verdict last, so that it is in the tail the device tool returns.
  step 30 "the goal's verdict" $PY scripts/gpu_goal.py "$RESULTS/rope_gpu_16k.csv"
  echo "=== done $(date -u +%H:%M:%S); a step failed: $failed"
} 2>&1 | tee "$RESULTS/gpu_check.log"
