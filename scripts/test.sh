#!/usr/bin/env bash
# Sets up the environment if needed, then runs the whole test suite; on x86-64, runs the kernel tests and
# the greedy equality suite a second time against the C kernels built for x86-64-v3 (AVX2 and FMA, no
# AVX-512) with torch's kernels and oneDNN held to AVX2 too: what an AMD Zen 2/3 runs, emulated here.
set -euo pipefail
cd "$(dirname "$0")/.."
# the test extra on top of the set-up script's: pytest, Ray (a local cluster), openai, Triton (its interpreter)
SPIN_BATCH_EXTRAS=plot,humaneval,structured,test bash scripts/setup.sh
# The aarch64 (NEON) build of the C kernels is checked under qemu-user (tests/test_native_builds.py). In CI,
# as root, install the cross compiler and qemu if they are missing; elsewhere that test says what to install.
if [ "${CI:-}" = true ] && [ "$(id -u)" = 0 ] && [ "$(uname -m)" = x86_64 ] && ! command -v qemu-aarch64 >/dev/null; then
  { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq gcc-aarch64-linux-gnu qemu-user; } \
    >/dev/null 2>&1 || echo "test.sh: could not install the aarch64 cross compiler and qemu-user; that check will skip" >&2
fi
PYTEST="${SPIN_BATCH_VENV:-.venv}/bin/pytest"
"$PYTEST" -q "$@"
if [ $# -eq 0 ] && [ "$(uname -m)" = x86_64 ]; then
  echo "== again on the x86-64-v3 build, torch held to AVX2 (a CPU without AVX-512) =="
  SPIN_BATCH_CPU_ARCH=x86-64-v3 ONEDNN_MAX_CPU_ISA=AVX2 ATEN_CPU_CAPABILITY=avx2 "$PYTEST" -q \
    tests/test_cpu_decoder.py tests/test_cpu_plan.py tests/test_llama.py tests/test_spec_equality.py tests/test_distill.py \
    tests/test_tree_attention.py tests/test_tree_loop.py tests/test_quantize.py
fi
