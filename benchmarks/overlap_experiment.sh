#!/usr/bin/env bash
# Where does the ring lose time against its own no-transfer schedule, and does NCCL's CTA use
# matter? One device call on P GPUs (default 4; P=2 on a 2-GPU machine); outputs go to $OUT:
#   env.log  ring_gpu.log  bench.log  variants.txt  variants.json  part_*.json
# 1. tests/test_ring_gpu.py on NCCL (the runtime as it is now);
# 2. the single-GPU cuDNN baseline (16K and 64K tokens per GPU of the p-GPU cells; MHA fwd+bwd;
#    causal and not);
# 3. one p = P phase per setting (ring-zigzag at 16K and 64K tokens per GPU): the default (with
#    the no-transfer schedule, whole heads, profiles at 16K/GPU),
#    NCCL_CTA_POLICY=1 (efficiency), NCCL_MAX_CTAS=2, NCCL_MIN_CTAS=NCCL_MAX_CTAS=32, and a
#    1300 MiB ring workspace budget (4 heads per chunk at 64K/GPU);
# 4. compare_variants.py: one table, every row against the default's.
set -u
cd "$(dirname "$0")/.."
OUT="${OUT:-$PWD/overlap_out}"
W=/tmp/ringcc_variants
mkdir -p "$OUT" "$W"
# shellcheck disable=SC1091
source benchmarks/gpu_env.sh >"$OUT/env.log" 2>&1
export RINGCC_CUDA_KERNEL=cudnn
LOG="$OUT/bench.log"
P="${P:-4}"
LENGTHS="$((16384 * P)),$((65536 * P))"

timeout 150 python3 -m pytest -p no:cacheprovider tests/test_ring_gpu.py -q -rf --tb=short 2>&1 \
  | tee "$OUT/ring_gpu.log" | tail -3

COMMON=(phase --attn mha --modes fwdbwd --lengths "$LENGTHS" --causal both --reps 5 --target-seconds 1.5
        --max-iter-seconds 8 --nccl-timeout 120)
run_phase() {  # label nproc seconds [env assignments...] -- [bench args...]
  local label=$1 nproc=$2 secs=$3; shift 3
  local envs=()
  while [ "$1" != "--" ]; do envs+=("$1"); shift; done
  shift
  echo "=== $label (${envs[*]:-default}) ===" | tee -a "$LOG"
  env ${envs[@]+"${envs[@]}"} timeout "$secs" torchrun --standalone --nproc-per-node "$nproc" benchmarks/bench_attention.py \
    "${COMMON[@]}" --part "$W/part_$label.json" --max-minutes "$(python3 -c "print(($secs - 25) / 60)")" "$@" \
    >>"$LOG" 2>&1 || echo "$label: exit $?" | tee -a "$LOG"
}

run_phase p1 1 110 -- --methods sdpa-cudnn
run_phase default "$P" 170 -- --methods ring-zigzag,ring-zigzag-nocomm,ring-zigzag-whole \
  --profile ring-zigzag@$((16384 * P)),ring-zigzag-nocomm@$((16384 * P))
run_phase cta-efficiency "$P" 70 NCCL_CTA_POLICY=1 -- --methods ring-zigzag
run_phase max-ctas-2 "$P" 70 NCCL_MAX_CTAS=2 NCCL_MIN_CTAS=1 -- --methods ring-zigzag
run_phase ctas-32 "$P" 70 NCCL_MIN_CTAS=32 NCCL_MAX_CTAS=32 -- --methods ring-zigzag
run_phase ws-1300 "$P" 70 RINGCC_RING_WORKSPACE_MIB=1300 -- --methods ring-zigzag

python3 benchmarks/compare_variants.py --baseline "$W/part_p1.json" default="$W/part_default.json" \
  cta-efficiency="$W/part_cta-efficiency.json" max-ctas-2="$W/part_max-ctas-2.json" ctas-32="$W/part_ctas-32.json" \
  ws-1300="$W/part_ws-1300.json" --json "$OUT/variants.json" 2>&1 | tee "$OUT/variants.txt"
python3 benchmarks/bench_attention.py report "$W/part_p1.json" "$W/part_default.json" --out "$W/report" \
  >>"$LOG" 2>&1 && cp "$W/report/table.txt" "$OUT/default_table.txt"
cp "$W"/part_p1.json "$W"/part_default.json "$OUT"/ 2>/dev/null
grep -E "Targets" "$LOG" | tail -20
