#!/usr/bin/env bash
# Sets up the environment if needed, then runs the whole test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# pytest's own script, not `python -m pytest`: -m puts the working directory on sys.path, and
# there the top-level kernels/ (the source of spin_batch.kernels) would shadow the PyPI package
# `kernels` that recent transformers imports. For the same reason tests/ is not a package.
exec "${SPIN_BATCH_VENV:-.venv}/bin/pytest" -q "$@"
