#!/usr/bin/env bash
# The one GPU benchmark run (4 GPUs): single-GPU baselines (p = 1), then p = 4, then p = 2, one
# torchrun each, then the report. Run from anywhere; outputs go to $OUT:
#   results.json  table.txt  tflops.png  memory.png  RESULTS.md  bench.log
# BENCH_MINUTES (default 9) is the budget of the benchmark itself; setup adds ~30 s. Cells that
# do not fit are skipped and listed. Extra arguments go to bench_attention.py (e.g. --methods).
set -u
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
export NCCL_NVLS_ENABLE=0  # NVLink multicast stays off on these machines
export RINGCC_CUDA_KERNEL="${RINGCC_CUDA_KERNEL:-cudnn}"
OUT="${OUT:-$PWD/bench_out}"
mkdir -p "$OUT"
LOG="$OUT/bench.log"

date -u >>"$LOG"
# shellcheck disable=SC1091
source benchmarks/gpu_env.sh >>"$LOG" 2>&1  # makes `import ringcc` work without a registry; logs the GPUs

python3 benchmarks/bench_attention.py --worlds 1,4,2 --out "$OUT" --work-dir /tmp/ringcc_bench \
  --max-minutes "${BENCH_MINUTES:-9}" --results-md benchmarks/RESULTS.md "$@" 2>&1 | tee -a "$LOG"
rc=${PIPESTATUS[0]}
ls -la "$OUT" >>"$LOG"
exit "$rc"
