#!/usr/bin/env bash
# On a machine with a CUDA GPU: the issue's goal (RoPE forward at s = 16k, bf16 and fp32) first, then the kernel
# tests with Triton compiled for the GPU (not interpreted), the kernel's configurations at 16k, the other GPU
# benchmarks and the fuzz. Each step runs under its own time limit and a failing step is logged without stopping the
# next, so one slow or broken step cannot cost the measurements; the limits add up to 560 s, inside one call of the
# device tool with room for the machine's start in a 15-minute lease (6 min 17 s on the H200, 2026-12-04). A step
# that ignores SIGINT is killed 10 s after its limit, so every limit is also cut to what is left of the script's
# GPU_CHECK_SECONDS (575; 30 s of it kept for the verdict, the last step): nine such kills no longer overrun the
# call's timeout_s=595. It writes six files under $RESULTS: five CSVs and
# gpu_check.log. The exit status is 1 where any step failed (every step still runs, and its files stay).
# Needs torch with CUDA, triton, pytest, hypothesis and transformers; posenc itself is read from src/.
# Liger and flash-attention join the comparison when importable: scripts/gpu_prepare.sh puts them in .gpu/site.
#
#   bash scripts/gpu_check.sh                     # at most 9.5 minutes (the steps' limits); results in docs/results/
#   RESULTS=$OUT bash scripts/gpu_check.sh        # through the device tool: run(carry=[".gpu"], timeout_s=595)
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
RESULTS=${RESULTS:-docs/results}
export PYTHONPATH="$PWD/src:$PWD/.gpu/site${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
# A cache of its own: the kernels the goal's step compiles are read back from it below.
export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-$(mktemp -d)}
mkdir -p "$RESULTS"
$PY -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 'no CUDA device: this script is for GPU machines')" ||
  exit 1

failed=0
deadline=$(($(date +%s) + ${GPU_CHECK_SECONDS:-575}))
reserve=30 # seconds kept for the verdict; 0 for the verdict itself
step() { # step SECONDS NAME COMMAND...
  local limit=$1 name=$2 status left
  shift 2
  left=$((deadline - reserve - 10 - $(date +%s))) # 10: the kill's grace after SIGINT
  if [ "$left" -lt "$limit" ]; then
    limit=$left
  fi
  if [ "$limit" -le 0 ]; then
    echo "=== $name SKIPPED: the script's ${GPU_CHECK_SECONDS:-575} s are spent"
    failed=1
    return
  fi
  echo "=== $name (limit ${limit} s) $(date -u +%H:%M:%S)"
  timeout -s INT -k 10 "$limit" "$@"
  status=$?
  if [ "$status" -ne 0 ]; then
    echo "=== $name FAILED (exit $status)"
    failed=1
  fi
}

{
  nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.mem --format=csv
  $PY -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
  # The goal first: whatever else runs out of time, this measurement comes back. The GPU's clock (events; L2 flushed
  # and host work hidden before each call).
  step 90 "RoPE forward at 16k, the goal" $PY benchmarks/rope.py --device cuda --seqs 16384 --dtypes bf16 fp32 \
    --modes fwd --reps 50 --csv "$RESULTS/rope_gpu_16k.csv"
  # The global loads and stores of the rotary kernels just compiled, per kernel: 16 bytes a thread is the aim
  # (ld/st.global.v4.b32), as posenc.kernels.triton_targets checks on CPU-only machines.
  step 10 "the rotary kernels' global accesses" bash -c 'for f in $(find "$TRITON_CACHE_DIR" -name "_rope_kernel.ptx");
    do echo "$(grep -oE "(ld|st)\.global(\.[a-z0-9]+)*" "$f" | sort | uniq -c | tr -s " \n" " ")"; done'
  # POSENC_TRITON_NATIVE=1: tests/conftest.py leaves TRITON_INTERPRET off and the Triton cases run on CUDA, with
  # the CUDA-only ones (CUDA graph capture). The other backends' cases are CPU work that CI does: all of
  # tests/kernels did not finish in 150 s on the H200, the Triton ones took 56 s. Most of the step is compiling
  # kernels: 12 workers where pytest-xdist is installed (the H200 image has it, and 16 cores). SIGINT at the limit,
  # so that pytest still prints which tests failed.
  workers=$($PY -c "import xdist" 2>/dev/null && echo "-n 12")
  step 100 "kernel tests, Triton compiled for the GPU" env POSENC_TRITON_NATIVE=1 TRITON_INTERPRET=0 \
    $PY -m pytest -q $workers tests/kernels -k "triton or cuda" -rf --tb=short -p no:cacheprovider \
    --ignore=tests/kernels/test_rope_fuzz.py
  # The grid's order too: runs of 16 .. 1024 token blocks a head group (1024 at BLOCK_S=16 is all of them, the order
  # of before 2026-12-04), against head groups fastest (1). On (b, h, s, d) memory Liger's kernel was 5-7% faster
  # in bf16; 96 configurations took 49 s in run 3 on the H200.
  step 80 "Triton configurations at 16k" $PY benchmarks/triton_tune.py --seq 16384 --dtypes bf16 fp32 \
    --layouts bhsd bshd --block-s 8 16 32 --warps 4 --heads 1 2 --superblocks 1 16 128 1024 --reps 20 \
    --csv "$RESULTS/rope_gpu_tune.csv"
  step 90 "RoPE sweep" $PY benchmarks/rope.py --device cuda --seqs 1024 4096 32768 --dtypes bf16 fp32 \
    --reps 20 --csv "$RESULTS/rope_gpu.csv"
  # Four cases, each in a process of its own (CUDA's start, and flex's compile): run 1's first two took most of its
  # 40 s. The CSV is rewritten after each case, so a cut keeps the cases done.
  step 90 "bias memory" $PY benchmarks/bias_memory.py --device cuda --seq 8192 --paths materialized flex \
    --csv "$RESULTS/bias_memory_gpu.csv"
  # Host time per call, with a Triton call taken apart (posenc's Python, the launcher, the device context): run 1
  # found a decode step at 0.31 ms against 0.23 ms for HF's eager formula. bf16 alone and 1000 decode reps: run 1's
  # step (both dtypes, 2000) printed its rows and then met its 30 s limit.
  step 40 "RoPE module" $PY benchmarks/rope_module.py --device cuda --dtypes bf16 --reps 30 1000 \
    --csv "$RESULTS/rope_module_gpu.csv"
  # Last: random calls compile a kernel each (about 30 compiles), and the measurements above matter more.
  step 40 "fuzz, Triton compiled for the GPU" env POSENC_TRITON_NATIVE=1 TRITON_INTERPRET=0 \
    $PY -m pytest -q tests/kernels/test_rope_fuzz.py -p no:cacheprovider -k triton -rf
  # The verdict last, so that it is in the tail the device tool returns.
  reserve=0
  step 20 "the goal's verdict" $PY scripts/gpu_goal.py "$RESULTS/rope_gpu_16k.csv"
  echo "=== done $(date -u +%H:%M:%S); a step failed: $failed"
  exit "$failed" # the block's status, and with pipefail the script's: tee's would be 0
} 2>&1 | tee "$RESULTS/gpu_check.log"
