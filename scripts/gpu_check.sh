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
# The Python and its packages: scripts/gpu_env.sh, shared with gpu_placement.sh.
set -uo pipefail
cd "$(dirname "$0")/.."
start=$SECONDS
LIMIT=${GPU_CHECK_LIMIT:-285}  # seconds for all stages together; the machine allows 5 minutes a run
# min(cap, seconds left of LIMIT), at least 1
left() { local r=$((LIMIT - (SECONDS - start))); [ "$r" -lt "$1" ] || r=$1; [ "$r" -ge 1 ] || r=1; echo "$r"; }
DRY=0
[ "${1:-}" = "--dry-run" ] && DRY=1
# A dry run has no device time to save, and CI machines are shared: wider limits there.
[ "$DRY" -eq 1 ] && LIMIT=${GPU_CHECK_LIMIT:-900}
. scripts/gpu_env.sh  # PY; exits here when no Python is fit

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
