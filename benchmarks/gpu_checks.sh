#!/usr/bin/env bash
# GPU correctness and planner checks in one device call (4 GPUs); outputs go to $OUT:
#   env.log  gpu_tests.log  planner.log  planner.json  planner_chunked.log  planner_chunked.json
# 1. the GPU test files (tests/test_ring_gpu.py, tests/test_dilated_gpu.py: NCCL, bf16, p = 2 and 4);
# 2. the planner's predicted peak vs the allocator at p = 1, 2, 4 (bench_planner_gpu.py);
# 3. the same at p = 4 with a 64 MiB ring workspace budget, so the ring runs per head chunk.
# Time limits: the tests took 153 s on 4 x H100 (session 6), 186 s on 2 x H200 (session 15: the
# masked blocks' flex kernels compile on first use, 5-20 s per variant), 301 s on 4 x H200
# (session 16) and 389 s there with the compiled masked-model tests (session 17), hence 500 s; the planner
# run over p = 1, 2, 4 did not finish in 240 s there (it stopped after p = 2's attention cells),
# hence 290 s.
set -u
cd "$(dirname "$0")/.."
OUT="${OUT:-$PWD/gpu_checks_out}"
mkdir -p "$OUT"
# shellcheck disable=SC1091
source benchmarks/gpu_env.sh >"$OUT/env.log" 2>&1
set -o pipefail
timeout 500 python3 -m pytest -p no:cacheprovider -m gpu tests/test_ring_gpu.py tests/test_dilated_gpu.py -q -rf \
  --tb=short 2>&1 | tee "$OUT/gpu_tests.log" | tail -4
timeout 290 torchrun --standalone --nproc-per-node 4 benchmarks/bench_planner_gpu.py --json "$OUT/planner.json" 2>&1 \
  | tee "$OUT/planner.log" | grep -E "n=|max \|" 
RINGCC_RING_WORKSPACE_MIB=64 timeout 90 torchrun --standalone --nproc-per-node 4 benchmarks/bench_planner_gpu.py \
  --worlds 4 --json "$OUT/planner_chunked.json" 2>&1 | tee "$OUT/planner_chunked.log" | grep -E "n=|max \|"
