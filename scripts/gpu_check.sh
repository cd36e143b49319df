#!/usr/bin/env bash
# The GPU check, one script, under 5 minutes: find a Python with a CUDA torch, then
#   1. a ~20 s probe (layerstream.bench.gpu_probe): versions, host memory, the SDPA kernel our attention runs and
#      its first-call vs repeat time, whether cudaHostRegister works, host->device GB/s;
#   2. the `cuda` tests that exercise the copy stream (overlap, stress matrix, OOM, host register,
#      pinned cache, attention kernel), in their own pytest call so nothing can starve them;
#   3. the reference comparisons against transformers (trimmed matrix);
#   4. the benchmark (host->device GB/s, bytes streamed per token, decode time per token vs the
#      bandwidth limit, and transformers + accelerate offload on the same budget).
# Each stage's time limit is the smaller of its own cap and what is left of LIMIT seconds.
# Results land in bench_out/ (and in $OUT when set). Exit status: non-zero if a test failed.
#
#   scripts/gpu_check.sh            on a machine with an NVIDIA GPU
#   scripts/gpu_check.sh --dry-run  anywhere: pick the Python, check its packages, run the probe on
#                                   the CPU, collect the cuda tests in both calls and load the
#                                   benchmark, with no GPU (CI runs this, so the script stays
#                                   runnable as is)
#
# The Python: $PYTHON if set; else python3 when it already has a CUDA torch (GPU images: their torch is
# never replaced, and no venv is made on top of it: a venv made from a venv's python would not see that
# venv's packages); else .venv-gpu, made here with PyPI's default (CUDA) torch wheel. The project is
# used from this checkout through PYTHONPATH, so nothing is installed on an offline machine unless a
# package is missing; wheels for those can be carried in .whl/ (installed with --no-index).
set -uo pipefail
cd "$(dirname "$0")/.."
start=$SECONDS
LIMIT=${GPU_CHECK_LIMIT:-285}  # seconds for all stages together; the machine allows 5 minutes a run
# The GPU machine has no network: never let transformers or huggingface_hub try to reach the hub.
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
# min(cap, seconds left of LIMIT), at least 1
left() { local r=$((LIMIT - (SECONDS - start))); [ "$r" -lt "$1" ] || r=$1; [ "$r" -ge 1 ] || r=1; echo "$r"; }
DRY=0
[ "${1:-}" = "--dry-run" ] && DRY=1
# A dry run has no device time to save, and CI machines are shared: wider limits there.
[ "$DRY" -eq 1 ] && LIMIT=${GPU_CHECK_LIMIT:-900}
# Module names. gguf: the engine's weights package imports it (GGUF constants); the GPU image lacks it
# and has no network, so its wheel (pure Python; numpy, yaml and tqdm it finds there) is committed in .whl/.
NEEDED="torch transformers accelerate safetensors tokenizers tqdm jinja2 huggingface_hub pytest gguf yaml numpy"
# Where carried wheels are installed (a test points it at its own folder)
SITE=${GPU_CHECK_SITE:-/tmp/gpu_check_site}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

if [ "$DRY" -eq 0 ]; then
  if ! ls /dev/nvidia0 >/dev/null 2>&1 && ! nvidia-smi -L >/dev/null 2>&1; then
    echo "gpu_check: no NVIDIA GPU visible here (/dev/nvidia0, nvidia-smi); nothing to check" >&2
    exit 1
  fi
  nvidia-smi --query-gpu=name,memory.total,pcie.link.gen.current,pcie.link.width.current --format=csv 2>/dev/null
fi

# A Python fit to run the check: a CUDA torch (any torch for a dry run).
fit() { "$1" -c "import sys, torch; sys.exit(0 if $DRY or torch.cuda.is_available() else 1)" 2>/dev/null; }

PY=${PYTHON:-}
if [ -z "$PY" ] && [ "$DRY" -eq 1 ]; then
  PY=python3
  fit .venv/bin/python && PY=.venv/bin/python  # the project's CPU environment (scripts/setup.sh)
elif [ -z "$PY" ]; then
  if fit python3; then
    PY=python3
  else
    VENV=.venv-gpu
    if ! fit "$VENV/bin/python"; then
      rm -rf "$VENV"
      python3 -m venv "$VENV" && "$VENV/bin/python" -m pip install -q --timeout 20 "torch>=2.5" \
        || { echo "gpu_check: python3 has no CUDA torch and none could be installed" >&2; exit 1; }
    fi
    PY=$VENV/bin/python
  fi
fi

missing() { "$PY" - "$@" <<'EOF'
import importlib.util, sys
def found(m):
    try:
        return importlib.util.find_spec(m) is not None
    except ImportError:
        return False
print(" ".join(m for m in sys.argv[1:] if not found(m)))
EOF
}
fit "$PY" || { echo "gpu_check: $PY has no torch" >&2; exit 1; }
need=$(missing $NEEDED)
# The carried wheels are installed by a dry run too, so CI proves they are enough; only the network
# install is left to the GPU machine.
if [ -n "$need" ] && { [ "$DRY" -eq 0 ] || ls .whl/*.whl >/dev/null 2>&1; }; then
  echo "gpu_check: $PY lacks: $need; installing"
  if ls .whl/*.whl >/dev/null 2>&1; then
    "$PY" -m pip install -q --no-index --no-deps --target "$SITE" .whl/*.whl
    export PYTHONPATH="$PYTHONPATH:$SITE"
  else
    # pip names are the module names here, but for huggingface_hub; a short timeout when offline.
    "$PY" -m pip install -q --timeout 20 --retries 1 $(echo "$need" | sed 's/huggingface_hub/huggingface-hub/')
  fi
  need=$(missing $NEEDED)
fi
[ -z "$need" ] || { echo "gpu_check: $PY lacks: $need (carry their wheels in .whl/)" >&2; exit 1; }
"$PY" - "$DRY" <<'EOF' || exit 1
import sys, torch
if sys.argv[1] == "1":
    print(f"torch {torch.__version__} at {sys.executable} (dry run: no GPU needed)")
else:
    assert torch.cuda.is_available(), "gpu_check: torch sees no CUDA device"
    print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, {torch.cuda.get_device_name()} at {sys.executable}")
EOF

mkdir -p bench_out
echo "== probe ($((SECONDS - start)) s)"
probe_dev=()
[ "$DRY" -eq 1 ] && probe_dev=(--device cpu)
PYTHONUNBUFFERED=1 timeout "$(left $((DRY ? 150 : 45)))" "$PY" -m layerstream.bench.gpu_probe ${probe_dev[@]+"${probe_dev[@]}"} 2>&1 | grep -v '^USDT' \
  | tee bench_out/gpu_probe.txt
probe_rc=${PIPESTATUS[0]}

# -v: one line per test as it ends, so a run cut short by the time limit still says which passed.
PYTEST=(-m pytest -v -m cuda tests/weights/test_cuda.py -p no:cacheprovider --durations=8)
echo "== cuda tests: copy stream ($((SECONDS - start)) s)"
timeout "$(left 110)" "$PY" "${PYTEST[@]}" -k "not test_matches_transformers_on_gpu" 2>&1 | tee bench_out/gpu_tests.txt
copy_rc=${PIPESTATUS[0]}
echo "== cuda tests: against transformers ($((SECONDS - start)) s)"
timeout "$(left 70)" "$PY" "${PYTEST[@]}" -k "test_matches_transformers_on_gpu" 2>&1 | tee -a bench_out/gpu_tests.txt
ref_rc=${PIPESTATUS[0]}
tests_rc=$((copy_rc != 0 || ref_rc != 0 || probe_rc != 0))

echo "== benchmark ($((SECONDS - start)) s)"
if [ "$DRY" -eq 1 ]; then
  "$PY" -m layerstream.bench.gpu --help >/dev/null && echo "layerstream.bench.gpu loads"
  bench_rc=$?
else
  PYTHONUNBUFFERED=1 timeout "$(left 100)" "$PY" -m layerstream.bench.gpu --json bench_out/gpu.json --png bench_out/gpu.png 2>&1 \
    | tee bench_out/gpu_bench.txt
  bench_rc=${PIPESTATUS[0]}
fi

if [ -n "${OUT:-}" ]; then
  cp bench_out/gpu_probe.txt bench_out/gpu_tests.txt bench_out/gpu_bench.txt bench_out/gpu.json bench_out/gpu.png "$OUT"/ 2>/dev/null
fi
echo "== done in $((SECONDS - start)) s: probe rc=$probe_rc, copy-stream tests rc=$copy_rc, reference tests rc=$ref_rc"
echo "== tests rc=$tests_rc, benchmark rc=$bench_rc"
[ "$tests_rc" -eq 0 ] && [ "$bench_rc" -eq 0 ]
