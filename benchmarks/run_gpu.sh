#!/usr/bin/env bash
# The GPU benchmark launcher, one job per call. Run from anywhere on a machine of P GPUs (default 4);
# outputs go to $OUT. The GPU machines have no package registry: every job first makes
# `import ringcc` work for the system python (an editable install, or a symlink tree that
# reproduces the package-dir mapping: passes/ -> ringcc.passes, runtime/ -> ringcc.runtime).
#
#   bash benchmarks/run_gpu.sh attention [ARGS]   bench_attention.py at p = 1 (baselines), 4, 2 under
#       one budget (BENCH_MINUTES, default 9), then the longest-length search; writes results.json,
#       table.txt, tflops.png, memory.png, RESULTS.md and bench.log, and replaces the bench section
#       of benchmarks/RESULTS.md. ARGS go to bench_attention.py (e.g. --methods, --causal).
#   bash benchmarks/run_gpu.sh short               the short-chunk measurements (RESULTS.md, "Short
#       chunks"): the multi-GPU ring tests, one attention layer at 4K / 8K / 16K tokens per GPU
#       against the single-GPU cuDNN kernel, and the compiled 8-layer step at 8K tokens per GPU with
#       its one-GPU step; everything in $OUT/short.tgz.
#         STAGES  which parts run, in order (default "tests attention step")
#         PATCH   a patch file (git apply): the attention and step stages also run on a copy of the
#                 tree with it applied, alternated with the tree (ROUNDS times, default 2), so that
#                 the two compare within one call on one machine
#         SMOKE=1 the same stages on CPU with gloo at tiny sizes (no tests): checks the script
set -u
MODE="${1:-}"
shift || true
if [ -n "${PATCH:-}" ]; then PATCH=$(realpath "$PATCH") || exit 2; fi
cd "$(dirname "$0")/.."
ROOT=$PWD
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0  # NVLink multicast stays off on these machines

use_tree() {  # points `import ringcc` at tree $1, logs where ringcc and torch come from and the GPUs
  (
    cd "$1" || exit 1
    if ! python3 -m pip install -q --no-build-isolation --no-deps --no-index -e . >/tmp/ringcc_pip.log 2>&1; then
      rm -rf /tmp/ringcc_site && mkdir -p /tmp/ringcc_site/ringcc
      for f in "$PWD"/ringcc/*; do ln -sf "$f" /tmp/ringcc_site/ringcc/; done
      ln -sfn "$PWD/passes" /tmp/ringcc_site/ringcc/passes
      ln -sfn "$PWD/runtime" /tmp/ringcc_site/ringcc/runtime
      python3 -c "import site; open(site.getsitepackages()[0] + '/ringcc_tree.pth', 'w').write('/tmp/ringcc_site\n')"
    fi
  )
  (cd / && python3 -c "import ringcc.runtime.ring as r, torch; print('ringcc from', r.__file__, 'torch', torch.__version__, 'cuda', torch.cuda.device_count())")
  nvidia-smi --query-gpu=index,name,memory.total --format=csv 2>&1 || true
}

attention() {
  export RINGCC_CUDA_KERNEL="${RINGCC_CUDA_KERNEL:-cudnn}"
  OUT="${OUT:-$ROOT/bench_out}"
  mkdir -p "$OUT"
  LOG="$OUT/bench.log"
  date -u >>"$LOG"
  use_tree "$ROOT" >>"$LOG" 2>&1
  python3 benchmarks/bench_attention.py --worlds 1,4,2 --out "$OUT" --work-dir /tmp/ringcc_bench \
    --max-minutes "${BENCH_MINUTES:-9}" --results-md benchmarks/RESULTS.md "$@" 2>&1 | tee -a "$LOG"
  rc=${PIPESTATUS[0]}
  ls -la "$OUT" >>"$LOG"
  return "$rc"
}

short() {
  OUT="${OUT:-$ROOT/short_out}"
  W="$OUT/short"
  mkdir -p "$W"
  exec > >(tee -a "$W/log.txt") 2>&1
  P="${P:-4}"
  ROUNDS="${ROUNDS:-2}"
  STAGES="${STAGES:-tests attention step}"
  if [ "${SMOKE:-0}" = 1 ]; then
    SM="--smoke"; LENGTHS=""; P=2; BASE=sdpa-math
    STAGES="${STAGES/tests/}"
  else
    SM=""; BASE=sdpa-cudnn
    LENGTHS="--lengths $((4096 * P)),$((8192 * P)),$((16384 * P)) --attn mha --modes fwdbwd --causal both --reps 5"
  fi
  date -u
  git -C "$ROOT" rev-parse HEAD 2>/dev/null || echo "(no git metadata: the tree as copied)"
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
  use_tree "$ROOT" 2>>"$W/setup.log" | grep "^ringcc from"
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
            [ "${#TREES[@]}" -gt 1 ] && use_tree "${TREES[$i]}" 2>>"$W/setup.log" | grep "^ringcc from"
            part="$W/p${P}_${NAMES[$i]}_$round.json"
            timeout 200 torchrun --nproc-per-node "$P" benchmarks/bench_attention.py phase $SM --part "$part" \
              --max-minutes 3 $LENGTHS --methods ring-zigzag,ring-contiguous 2>&1 | tail -2
            python3 benchmarks/bench_attention.py report "$W/p1.json" "$part" --out "$W/report_${NAMES[$i]}_$round" \
              >/dev/null 2>&1
            echo "== ${NAMES[$i]}, round $round"
            grep -E " ring-(zigzag|contiguous) " "$W/report_${NAMES[$i]}_$round/table.txt"
          done
        done
        use_tree "$ROOT" 2>>"$W/setup.log" | grep "^ringcc from"
        ;;
      step)
        M="benchmarks/bench_model_masked.py $SM --inner inductor --layers 8 --lengths 8192 --cases unmasked --reps 9 --warmup 3"
        for round in $(seq "$ROUNDS"); do
          for i in "${!TREES[@]}"; do
            [ "${#TREES[@]}" -gt 1 ] && use_tree "${TREES[$i]}" 2>>"$W/setup.log" | grep "^ringcc from"
            one=""
            [ "$round" = 1 ] && [ "$i" = 0 ] && one="--one-gpu"
            timeout 240 torchrun --nproc-per-node "$P" $M $one --label "${NAMES[$i]}" \
              --json "$W/step_${NAMES[$i]}_$round.json" 2>&1 | grep -v -i warn | tail -4
          done
        done
        use_tree "$ROOT" 2>>"$W/setup.log" | grep "^ringcc from"
        ;;
      *) echo "unknown stage $stage (allowed: tests attention step)"; exit 2 ;;
    esac
  done
  tar -C "$W" -czf "$OUT/short.tgz" .
  echo "wrote $OUT/short.tgz"
}

case "$MODE" in
  attention) attention "$@" ;;
  short) short ;;
  *) echo "usage: bash benchmarks/run_gpu.sh attention [bench_attention.py arguments] | short (got '${MODE}')"; exit 2 ;;
esac
