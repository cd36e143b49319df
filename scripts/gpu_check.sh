#!/usr/bin/env bash
# The GPU check, one script, under 5 minutes: set up an environment with a CUDA torch, run the tests
# marked `cuda`, then the benchmark (host->device GB/s, bytes streamed per token, decode time per
# token vs the bandwidth limit, and transformers + accelerate offload on the same budget).
# Results land in bench_out/ (and in $OUT when set). Exit status: non-zero if a test failed.
set -uo pipefail
cd "$(dirname "$0")/.."
start=$SECONDS
PY=${PYTHON:-python3}
VENV=.venv-gpu

if ! ls /dev/nvidia0 >/dev/null 2>&1 && ! nvidia-smi -L >/dev/null 2>&1; then
  echo "gpu_check: no NVIDIA GPU visible here (/dev/nvidia0, nvidia-smi); nothing to check" >&2
  exit 1
fi
nvidia-smi --query-gpu=name,memory.total,pcie.link.gen.current,pcie.link.width.current --format=csv 2>/dev/null

has_cuda_torch() { "$1" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; }

if [ ! -x "$VENV/bin/python" ] || ! has_cuda_torch "$VENV/bin/python"; then
  rm -rf "$VENV"
  if has_cuda_torch "$PY"; then
    # A GPU image already has a CUDA torch: build on top of it and never replace it.
    "$PY" -m venv --system-site-packages "$VENV"
  else
    "$PY" -m venv "$VENV"
    # PyPI's default Linux wheel of torch is the CUDA build (the CPU wheel of .venv would not do).
    "$VENV/bin/python" -m pip install -q "torch>=2.5" || { echo "gpu_check: cannot install a CUDA torch" >&2; exit 1; }
  fi
fi
. "$VENV/bin/activate"
if ! python -c "import engine, transformers, accelerate, pytest, safetensors" 2>/dev/null; then
  # Offline boxes: fall back to what is installed if the index is unreachable.
  python -m pip install -q -e ".[test,bench]" || python -m pip install -q --no-deps -e . || true
fi
python - <<'EOF' || exit 1
import torch
assert torch.cuda.is_available(), "gpu_check: torch sees no CUDA device"
print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, {torch.cuda.get_device_name()}")
EOF

mkdir -p bench_out
echo "== cuda tests ($((SECONDS - start)) s)"
timeout 170 python -m pytest -q -m cuda tests/test_cuda.py -p no:cacheprovider 2>&1 | tee bench_out/gpu_tests.txt
tests_rc=${PIPESTATUS[0]}

echo "== benchmark ($((SECONDS - start)) s)"
timeout 100 python -m bench.gpu --json bench_out/gpu.json 2>&1 | tee bench_out/gpu_bench.txt
bench_rc=${PIPESTATUS[0]}

if [ -n "${OUT:-}" ]; then
  cp bench_out/gpu_tests.txt bench_out/gpu_bench.txt "$OUT"/ 2>/dev/null
  cp bench_out/gpu.json "$OUT"/ 2>/dev/null
fi
echo "== done in $((SECONDS - start)) s: tests rc=$tests_rc, benchmark rc=$bench_rc"
[ "$tests_rc" -eq 0 ] && [ "$bench_rc" -eq 0 ]
