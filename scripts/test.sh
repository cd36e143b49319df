#!/usr/bin/env bash
# Set up (if needed) and run the whole test suite. CUDA tests skip themselves without a GPU.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh
. .venv/bin/activate
exec python -m pytest -q "$@"
