#!/usr/bin/env bash
# GPU power and SM clock while the ring runs, per setting (one device call; outputs to $OUT):
#   env.log  smi.csv (nvidia-smi every 50 ms)  marks.txt  timeline.txt  power.txt (the table)
# Each setting is one ring_timeline.py run on every GPU of the machine (P = its count): with
# copy-engine transfers, and with the transfers skipped; then the 1-GPU cuDNN kernel on the
# whole length (--baseline, rank 0). Question: are the kernels power-limited, and do the
# copies beside them lower the SM clock?
# POWER_ARGS (default: 64K tokens per GPU, non-causal, contiguous): ring_timeline.py options.
# POWER_HALF_GRADS=1 adds a run whose copy-engine ring sends half of each dK/dV accumulator
# (RINGCC_SKIP_COMM=half-grads, a third fewer backward bytes; timing only).
set -u
cd "$(dirname "$0")/.."
OUT="${OUT:-$PWD/power_out}"
mkdir -p "$OUT"
# shellcheck disable=SC1091
source benchmarks/gpu_env.sh >"$OUT/env.log" 2>&1
P="${P:-$(nvidia-smi -L | wc -l)}"
export RINGCC_CUDA_KERNEL=cudnn
ARGS="${POWER_ARGS:---n-local 65536 --causal 0 --layout contiguous --budgets auto --iters 6 --host-ahead-ms 0}"
Q=timestamp,index,power.draw,power.limit,clocks.sm,clocks.max.sm,temperature.gpu
REASONS=clocks_event_reasons.active  # older drivers: clocks_throttle_reasons.active
nvidia-smi --query-gpu=$REASONS --format=csv >/dev/null 2>&1 || REASONS=clocks_throttle_reasons.active
nvidia-smi --query-gpu=$Q,$REASONS --format=csv,noheader,nounits -lms 50 >"$OUT/smi.csv" 2>&1 &
SMI=$!
run() {  # name, ring_timeline options
  local name=$1; shift
  echo "$(date +%s.%N) start $name" >>"$OUT/marks.txt"
  # shellcheck disable=SC2086
  (cd benchmarks && timeout 200 torchrun --standalone --nproc-per-node "$P" ring_timeline.py $ARGS "$@") 2>&1 \
    | grep -v -E "^W[0-9]|\*\*\*\*|OMP_NUM|warn|return func|UserWarn" >>"$OUT/timeline.txt"
  echo "$(date +%s.%N) end $name" >>"$OUT/marks.txt"
}
run transfers --transports copy-engine
if [ "${POWER_HALF_GRADS:-0}" = 1 ]; then  # the backward's dK/dV with half their bytes (timing only)
  run half-grads --transports none --half-grads
fi
run no-transfers --transports none --no-comm
run transfers-again --transports copy-engine
(cd benchmarks && timeout 200 torchrun --standalone --nproc-per-node "$P" ring_timeline.py $ARGS --transports none --baseline \
  2>&1 | grep -E "1-GPU" >>"$OUT/timeline.txt") &
echo "$(date +%s.%N) start baseline" >>"$OUT/marks.txt"
wait $!
echo "$(date +%s.%N) end baseline" >>"$OUT/marks.txt"
kill "$SMI"
python3 - "$OUT" <<'PY' | tee "$OUT/power.txt"
import datetime, statistics, sys, pathlib
out = pathlib.Path(sys.argv[1])
marks = {}
for line in (out / "marks.txt").read_text().split("\n"):
    if line.strip():
        t, what, name = line.split()
        marks.setdefault(name, {})[what] = float(t)
rows = []
for line in (out / "smi.csv").read_text().split("\n"):
    f = [x.strip() for x in line.split(",")]
    if len(f) < 8:
        continue
    try:
        t = datetime.datetime.strptime(f[0], "%Y/%m/%d %H:%M:%S.%f").timestamp()
        rows.append((t, int(f[1]), float(f[2]), float(f[3]), float(f[4]), float(f[5]), float(f[6]), f[7]))
    except ValueError:
        continue
print(f"{'setting':<16} {'gpu':>3} {'samples':>7} {'power W (median)':>16} {'limit W':>8} {'SM MHz (median)':>15} {'max MHz':>8} {'temp C':>6}  busiest clock-event reasons")
for name, m in marks.items():
    # the busy part: samples drawing over half the limit (the kernels, not the start-up)
    for gpu in sorted({r[1] for r in rows}):
        s = [r for r in rows if r[1] == gpu and m["start"] <= r[0] <= m.get("end", 1e30) and r[2] > 0.5 * r[3]]
        if not s:
            continue
        reasons = statistics.mode(r[7] for r in s)
        print(f"{name:<16} {gpu:>3} {len(s):>7} {statistics.median(r[2] for r in s):>16.0f} {s[0][3]:>8.0f} "
              f"{statistics.median(r[4] for r in s):>15.0f} {s[0][5]:>8.0f} {statistics.median(r[6] for r in s):>6.0f}  {reasons}")
PY
