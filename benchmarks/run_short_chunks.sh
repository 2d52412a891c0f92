#!/usr/bin/env bash
# The short-chunk measurements (RESULTS.md, "Short chunks"), as one GPU call: the multi-GPU ring
# tests, one attention layer at 4K / 8K / 16K tokens per GPU against the single-GPU cuDNN kernel,
# and the compiled 8-layer step at 8K tokens per GPU with its one-GPU step. Run from anywhere on
# a machine of P GPUs (default 4); everything goes to $OUT/short.tgz (log, part files, tables,
# JSON records).
#
#   STAGES   which parts run, in order (default "tests attention step")
#   PATCH    a patch file (git apply): the attention and step stages then also run on a copy of
#            the tree with it applied, alternated with the tree itself (ROUNDS times, default 2),
#            so that the two compare within one call on one machine
#   SMOKE=1  the same stages on CPU with gloo at tiny sizes (no tests): checks the script
#
#   OUT=/tmp/o bash benchmarks/run_short_chunks.sh
#   OUT=/tmp/o STAGES=attention PATCH=benchmarks/results/2026-11-28_own_block_head_split.patch \
#       bash benchmarks/run_short_chunks.sh
set -u
if [ -n "${PATCH:-}" ]; then PATCH=$(realpath "$PATCH") || exit 2; fi
cd "$(dirname "$0")/.."
ROOT=$PWD
OUT="${OUT:-$ROOT/short_out}"
W="$OUT/short"
mkdir -p "$W"
exec > >(tee -a "$W/log.txt") 2>&1
P="${P:-4}"
ROUNDS="${ROUNDS:-2}"
STAGES="${STAGES:-tests attention step}"
SMOKE="${SMOKE:-0}"
if [ "$SMOKE" = 1 ]; then
  SM="--smoke"; LENGTHS=""; P=2; BASE=sdpa-math
  STAGES="${STAGES/tests/}"
else
  SM=""; BASE=sdpa-cudnn
  LENGTHS="--lengths $((4096 * P)),$((8192 * P)),$((16384 * P)) --attn mha --modes fwdbwd --causal both --reps 5"
fi
date -u
git -C "$ROOT" rev-parse HEAD 2>/dev/null || echo "(no git metadata: the tree as copied)"

use_tree() {  # points `import ringcc` at a tree (an editable install; gpu_env.sh's fallback otherwise)
  # shellcheck disable=SC1091
  (cd "$1" && source benchmarks/gpu_env.sh >>"$W/setup.log" 2>&1)
  (cd / && python3 -c "import ringcc.runtime.ring as r; print('ringcc from', r.__file__)")
}

TREES=("$ROOT")
NAMES=("tree")
if [ -n "${PATCH:-}" ]; then
  rm -rf /tmp/ringcc_patched && mkdir -p /tmp/ringcc_patched
  tar -C "$ROOT" --exclude=.git --exclude=.venv -cf - . | tar -C /tmp/ringcc_patched -xf -
  (cd /tmp/ringcc_patched && git apply "$PATCH" 2>/dev/null || patch -p1 <"$PATCH") || exit 1
  TREES+=(/tmp/ringcc_patched)
  NAMES+=("patched")
  echo "patch: $PATCH"
else
  ROUNDS=1
fi
use_tree "$ROOT"

for stage in $STAGES; do
  case $stage in
    tests)
      timeout 300 python3 -m pytest -q -x tests/test_ring_gpu.py -k "nccl or copy_engine or graphs or masked_model" \
        2>&1 | tail -5
      ;;
    attention)
      # the single-GPU baseline once (it does not run ringcc), then the ring per tree and round
      timeout 150 torchrun --nproc-per-node 1 benchmarks/bench_attention.py phase $SM --part "$W/p1.json" \
        --max-minutes 2 $LENGTHS --methods "$BASE" 2>&1 | tail -2
      for round in $(seq "$ROUNDS"); do
        for i in "${!TREES[@]}"; do
          [ "${#TREES[@]}" -gt 1 ] && use_tree "${TREES[$i]}"
          part="$W/p${P}_${NAMES[$i]}_$round.json"
          timeout 200 torchrun --nproc-per-node "$P" benchmarks/bench_attention.py phase $SM --part "$part" \
            --max-minutes 3 $LENGTHS --methods ring-zigzag,ring-contiguous 2>&1 | tail -2
          python3 benchmarks/bench_attention.py report "$W/p1.json" "$part" --out "$W/report_${NAMES[$i]}_$round" \
            >/dev/null 2>&1
          echo "== ${NAMES[$i]}, round $round"
          grep -E " ring-(zigzag|contiguous) " "$W/report_${NAMES[$i]}_$round/table.txt"
        done
      done
      use_tree "$ROOT"
      ;;
    step)
      M="benchmarks/bench_model_masked.py $SM --inner inductor --layers 8 --lengths 8192 --cases unmasked --reps 9 --warmup 3"
      for round in $(seq "$ROUNDS"); do
        for i in "${!TREES[@]}"; do
          [ "${#TREES[@]}" -gt 1 ] && use_tree "${TREES[$i]}"
          one=""
          [ "$round" = 1 ] && [ "$i" = 0 ] && one="--one-gpu"
          timeout 240 torchrun --nproc-per-node "$P" $M $one --label "${NAMES[$i]}" \
            --json "$W/step_${NAMES[$i]}_$round.json" 2>&1 | grep -v -i warn | tail -4
        done
      done
      use_tree "$ROOT"
      ;;
    *) echo "unknown stage $stage (allowed: tests attention step)"; exit 2 ;;
  esac
done
tar -C "$W" -czf "$OUT/short.tgz" .
echo "wrote $OUT/short.tgz"
