#!/usr/bin/env bash
# Issue #38's GPU run, one command within ~8 minutes: `layerstream bench-placement` on an 8B-shaped model
# (random bf16 weights, built once under $LAYERSTREAM_BENCH_DIR, its random numbers drawn on the GPU) at a
# device budget of 25% of its weights (raised, and said so, to the least percent at which every policy places
# tensor groups), --cpu-offload-policy stream, cpu and auto side by side: prefill, decode at batch 1 and 16,
# each against its floor, llama.cpp -ngl where it can run, and a verdict per target.
# Results land in bench_out/placement.{txt,json,png} (and in $OUT when set). Exit status: the benchmark's.
#
#   scripts/gpu_placement.sh            on a machine with an NVIDIA GPU
#   scripts/gpu_placement.sh --dry-run  anywhere: the same Python and package checks (scripts/gpu_env.sh, as
#                                       gpu_check.sh), then the tiny shape on the simulated link (CI runs it:
#                                       tests/deploy/test_gpu_placement.py)
set -uo pipefail
cd "$(dirname "$0")/.."
DRY=0
[ "${1:-}" = "--dry-run" ] && DRY=1
# Seconds for the benchmark: the machine allows 10 minutes a command; what is left covers start-up and set-up.
LIMIT=${GPU_PLACEMENT_LIMIT:-500}
. scripts/gpu_env.sh  # PY; exits here when no Python is fit

if [ "$DRY" -eq 1 ]; then
  # one thread: a shared CI machine's other work stalls two threads' barriers at every product
  ARGS=(--device cpu --shape tiny --prompt-tokens 64 --batch 4 --batch-prompt-tokens 8 --decode-tokens 4 --threads 1)
else
  ARGS=(--device cuda --shape 8b --timeout 150)
fi
mkdir -p bench_out
echo "== bench-placement ${ARGS[*]}"
PYTHONUNBUFFERED=1 timeout "$LIMIT" "$PY" -m layerstream.bench.placement "${ARGS[@]}" \
  --json bench_out/placement.json --png bench_out/placement.png 2>&1 | grep -v '^USDT' | tee bench_out/placement.txt
rc=${PIPESTATUS[0]}
if [ -n "${OUT:-}" ]; then
  cp bench_out/placement.txt bench_out/placement.json bench_out/placement.png "$OUT"/ 2>/dev/null
fi
echo "== bench-placement rc=$rc"
exit "$rc"
