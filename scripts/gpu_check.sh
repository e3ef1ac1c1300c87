#!/usr/bin/env bash
# The GPU check for the Triton kernels, on a CUDA machine:
#   1. tests/test_kernels.py with the kernels compiled (TRITON_INTERPRET unset: CUDA tensors),
#   2. kernel timings vs the torch references (decode batch 64 slots x 1 token, context 1024,
#      H=9, KV=3, D=64, bf16; plus verify and prefill batches), with achieved K/V bandwidth,
#   3. the demo bench (autoregressive vs fixed:ngram at 1 and 16 slots).
# Needs a CUDA build of torch in the venv (scripts/setup.sh installs the CPU wheel).
# Extra arguments go to the kernel timings, e.g. scripts/gpu_check.sh --dtype fp32.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${SPIN_BATCH_VENV:-.venv}
if [ -x "$VENV/bin/python" ]; then PY="$VENV/bin/python"; else PY=${PYTHON:-python3}; fi
unset TRITON_INTERPRET

"$PY" - <<'EOF'
import sys
import torch
if not torch.cuda.is_available():
    sys.exit(f"gpu_check: torch {torch.__version__} sees no CUDA device (a CPU-only build, or no GPU)")
import triton
print(f"torch {torch.__version__}, triton {triton.__version__}, {torch.cuda.get_device_name()}")
EOF

echo "== kernel tests (compiled, CUDA tensors) =="
"$PY" -m pytest tests/test_kernels.py -q

echo "== kernel timings =="
"$PY" -m spin_batch.kernels.bench_kernels "$@"

echo "== demo bench (SPIN_BATCH_KERNELS=${SPIN_BATCH_KERNELS:-auto}) =="
"$PY" -m spin_batch.cli bench jobs/demo.yaml --slots 1,16 --limit 16 --repeat 3 \
  --methods autoregressive,fixed:ngram
