#!/usr/bin/env bash
# The speed-only bench at the sizes GPU users run (docs/gpu.md, "The speed-only bench"): random-weight
# Llama-3.2-1B and Llama-3.1-8B shapes in bfloat16 at 1 and 16 slots, the shipped draft shapes, an EAGLE-sized
# draft and n-gram on the device step, acceptance replayed from recorded traces; speed only. scripts/gpu_bench.sh
# runs it after the demo bench (spin-batch installed there); it runs alone too, from the repository root.
# Writes $OUT/speed-<shape>.json and .md (rewritten after each slot count, so a timeout keeps what ran),
# $OUT/speed-<shape>.log, and a line per shape in $OUT/status.txt.
# Time: each shape starts no point after GPU_BENCH_SPEED_S seconds (25) and is stopped at twice that plus 60;
# GPU_BENCH_SPEED_SHAPES picks the shapes (both by default).
# GPU_BENCH_DRY=1: the tiny shape on the CPU, a few steps.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu_out}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
if [ -x "${SPIN_BATCH_VENV:-.venv}/bin/python" ]; then PY="${SPIN_BATCH_VENV:-.venv}/bin/python"; fi
BUDGET=${GPU_BENCH_SPEED_S:-25}
if [ "${GPU_BENCH_DRY:-0}" = 1 ]; then
  export PYTHONPATH="$PWD:$PWD/kernels${PYTHONPATH:+:$PYTHONPATH}"
  SHAPES=tiny
  ARGS=(--device cpu --dtype float32 --slots 1 --steps 2 --accept 0,4)
else
  SHAPES=${GPU_BENCH_SPEED_SHAPES:-llama-3.2-1b llama-3.1-8b}
  ARGS=(--device cuda --dtype bfloat16 --slots 1,16 --steps 16 --gamma 4 --accept 0,2,4)
fi
for shape in $SHAPES; do
  echo "gpu_bench_speed: $shape"
  timeout $((2 * BUDGET + 60)) "$PY" -m spin_batch.cli bench-speed --shape "$shape" "${ARGS[@]}" \
    --budget-s "$BUDGET" --out "$OUT" >"$OUT/speed-$shape.log" 2>&1
  echo "speed-$shape: rc=$?" >>"$OUT/status.txt"
done
