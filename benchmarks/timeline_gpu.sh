#!/usr/bin/env bash
# ring_timeline.py on every GPU of the machine (P = its count), outputs to $OUT:
#   env.log  timeline.txt  timeline_*.json
# causal zigzag and non-causal at 16K tokens per GPU, causal at 64K per GPU; default head
# chunks ("auto") vs whole heads ("0"), each with and without transfers.
set -u
cd "$(dirname "$0")/.."
OUT="${OUT:-$PWD/timeline_out}"
mkdir -p "$OUT"
# shellcheck disable=SC1091
source benchmarks/gpu_env.sh >"$OUT/env.log" 2>&1
nvidia-smi --query-gpu=index,name,memory.total --format=csv >>"$OUT/env.log" 2>&1
P="${P:-$(nvidia-smi -L | wc -l)}"
export RINGCC_CUDA_KERNEL=cudnn
tl() {  # name args...
  local name=$1; shift
  timeout 150 torchrun --standalone --nproc-per-node "$P" benchmarks/ring_timeline.py --no-comm \
    --json "$OUT/timeline_$name.json" "$@" 2>&1 | grep -v -E "^W[0-9]|\*\*\*\*|OMP_NUM_THREADS" | tee -a "$OUT/timeline.txt"
}
tl causal16k --n-local 16384 --causal 1 --budgets auto,0
tl full16k --n-local 16384 --causal 0 --budgets auto,0
tl causal64k --n-local 65536 --causal 1 --budgets auto,0 --iters 3
