#!/usr/bin/env bash
# The GPU check, on a CUDA machine:
#   1. tests/test_kernels.py and tests/test_cuda_graphs.py with the kernels compiled
#      (TRITON_INTERPRET unset: CUDA tensors),
#   2. kernel timings vs the torch references (decode batch 64 slots x 1 token, context 1024,
#      H=9, KV=3, D=64, bf16; plus verify and prefill batches), with achieved K/V bandwidth,
#   3. the demo bench on the GPU with CUDA graphs on, then again with them off.
# Needs a CUDA build of torch in the venv (scripts/setup.sh installs the CPU wheel) or as python3.
# Extra arguments go to the kernel timings, e.g. scripts/gpu_check.sh --dtype fp32.
# BENCH_ARGS replaces the bench's arguments (default below); BENCH_OUT is where its results go.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${SPIN_BATCH_VENV:-.venv}
if [ -x "$VENV/bin/python" ]; then PY="$VENV/bin/python"; else PY=${PYTHON:-python3}; fi
unset TRITON_INTERPRET
BENCH_ARGS=${BENCH_ARGS:---slots 1,16 --limit 16 --repeat 3 --methods autoregressive,fixed:ngram,fixed:d1x384-k4096,spin}
BENCH_OUT=${BENCH_OUT:-out/gpu_check}

$PY - <<'PYEOF'
import sys
import torch
if not torch.cuda.is_available():
    sys.exit(f"gpu_check: torch {torch.__version__} sees no CUDA device (a CPU-only build, or no GPU)")
import triton
print(f"torch {torch.__version__}, triton {triton.__version__}, {torch.cuda.get_device_name()}")
PYEOF

echo "== kernel and CUDA-graph tests (compiled, CUDA tensors) =="
$PY -m pytest tests/test_kernels.py tests/test_cuda_graphs.py -q -p no:cacheprovider

echo "== kernel timings =="
$PY scripts/bench_kernels.py "$@"

for graphs in on off; do
  echo "== demo bench, CUDA graphs $graphs (SPIN_BATCH_KERNELS=${SPIN_BATCH_KERNELS:-auto}) =="
  # shellcheck disable=SC2086
  SPIN_BATCH_CUDA_GRAPHS=$graphs $PY -m spin_batch.cli bench jobs/demo.yaml $BENCH_ARGS --no-progress \
    --out "$BENCH_OUT/graphs-$graphs"
done
