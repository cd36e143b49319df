#!/usr/bin/env bash
# Set up (if needed) and start the OpenAI-compatible server; with no --model it serves the
# built-in demo model. Extra arguments go to `layerstream serve`.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh
. .venv/bin/activate
exec layerstream serve "$@"
