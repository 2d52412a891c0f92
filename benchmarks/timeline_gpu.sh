#!/usr/bin/env bash
# ring_timeline.py on every GPU of the machine (P = its count), outputs to $OUT:
#   env.log  gpu_tests.log  timeline.txt  timeline.json
# 0. tests/test_ring_gpu.py and tests/test_dilated_gpu.py on NCCL (GPU_TESTS=0 skips them);
# 1. causal zigzag and non-causal at 16K tokens per GPU, causal and non-causal at 64K per GPU:
#    default head chunks ("auto") and whole heads ("0", not at 64K non-causal), each with and
#    without transfers; gqafull64k: GQA 32/8 non-causal at 64K per GPU.
# TRANSPORTS (default copy-engine,nccl): the ring transports each setting runs with.
# GPU_TEST_FILES (default both files above), GPU_TEST_TIMEOUT (s, default 240);
# TL_BUDGETS: the workspace budgets of the 16K and causal 64K settings (default auto,0);
# TL_EXTRA: more ring_timeline.py options for every setting (e.g. "--host-breakdown 5 --baseline").
# PREV_TREE=path: a checkout of an earlier commit (e.g. a git worktree passed with the device
# tool's carry); each setting then also runs on it, in the same run on the same machine (A/B).
set -u
cd "$(dirname "$0")/.."
OUT="${OUT:-$PWD/timeline_out}"
TMP=/tmp/ringcc_timeline
mkdir -p "$OUT" "$TMP"
# shellcheck disable=SC1091
source benchmarks/gpu_env.sh >"$OUT/env.log" 2>&1
P="${P:-$(nvidia-smi -L | wc -l)}"
export RINGCC_CUDA_KERNEL=cudnn
if [ -n "${PREV_TREE:-}" ]; then
  mkdir -p /tmp/ringcc_prev_site/ringcc
  for f in "$PREV_TREE"/ringcc/*; do ln -sf "$(realpath "$f")" /tmp/ringcc_prev_site/ringcc/; done
  ln -sfn "$(realpath "$PREV_TREE/passes")" /tmp/ringcc_prev_site/ringcc/passes
  ln -sfn "$(realpath "$PREV_TREE/runtime")" /tmp/ringcc_prev_site/ringcc/runtime
  (cd /tmp && PYTHONPATH=/tmp/ringcc_prev_site python3 -c "import ringcc.runtime.ring as r; print('prev ring from', r.__file__)") >>"$OUT/env.log" 2>&1
fi
if [ "${GPU_TESTS:-1}" = 1 ]; then
  # shellcheck disable=SC2086
  timeout "${GPU_TEST_TIMEOUT:-240}" python3 -m pytest -p no:cacheprovider ${GPU_TEST_FILES:-tests/test_ring_gpu.py tests/test_dilated_gpu.py} -q -rf --tb=short \
    2>&1 | tee "$OUT/gpu_tests.log" | tail -3
fi
tl() {  # name args...
  local name=$1; shift
  local trees=(cur)
  [ -n "${PREV_TREE:-}" ] && trees=(prev cur)
  for tree in "${trees[@]}"; do
    echo "--- $name ($tree)" | tee -a "$OUT/timeline.txt"
    local pp="${PYTHONPATH:-}"
    [ "$tree" = prev ] && pp="/tmp/ringcc_prev_site${pp:+:$pp}"
    PYTHONPATH="$pp" timeout 150 torchrun --standalone --nproc-per-node "$P" benchmarks/ring_timeline.py \
      --json "$TMP/${name}_$tree.json" --transports "${TRANSPORTS:-copy-engine,nccl}" ${TL_EXTRA:-} "$@" 2>&1 | grep -v -E "^W[0-9]|\*\*\*\*|OMP_NUM_THREADS|Warning|warn|return func" \
      | tee -a "$OUT/timeline.txt"
  done
}
SETS="${SETS:-causal16k full16k causal64k}"  # which of the settings below to run
for set in $SETS; do
  case $set in
    causal16k) tl causal16k --n-local 16384 --causal 1 --budgets "${TL_BUDGETS:-auto,0}" --no-comm ;;
    full16k) tl full16k --n-local 16384 --causal 0 --budgets "${TL_BUDGETS:-auto,0}" --no-comm ;;
    causal64k) tl causal64k --n-local 65536 --causal 1 --budgets "${TL_BUDGETS:-auto,0}" --no-comm --iters 3 ;;
    full64k) tl full64k --n-local 65536 --causal 0 --layout contiguous --budgets auto --no-comm --iters 3 ;;
    gqafull64k) tl gqafull64k --n-local 65536 --heads 32 --kv-heads 8 --causal 0 --layout contiguous --budgets auto --no-comm --iters 3 ;;
    *) echo "unknown setting $set (causal16k, full16k, causal64k, full64k, gqafull64k)"; exit 2 ;;
  esac
done
python3 - "$TMP" "$OUT/timeline.json" <<'PY'
import json, pathlib, sys
parts = {p.stem: json.loads(p.read_text()) for p in sorted(pathlib.Path(sys.argv[1]).glob("*.json"))}
pathlib.Path(sys.argv[2]).write_text(json.dumps(parts, indent=1))
PY
