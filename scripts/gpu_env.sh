# Sourced by the GPU scripts (gpu_check.sh, gpu_placement.sh): the GPU present (unless a dry run), then PY, a
# Python fit to run them, with the packages they import; the project used from this checkout (PYTHONPATH).
# Reads DRY (1: a dry run, anywhere: any torch, no GPU); exits the sourcing script where no Python is fit.
#
# The Python: $PYTHON if set; else python3 when it already has a CUDA torch (GPU images: their torch is
# never replaced, and no venv is made on top of it: a venv made from a venv's python would not see that
# venv's packages); else .venv-gpu, made here with PyPI's default (CUDA) torch wheel. Nothing is installed
# on an offline machine unless a package is missing; wheels for those can be carried in .whl/ (installed
# with --no-index).
ME=$(basename "$0" .sh)
# The GPU machine has no network: never let transformers or huggingface_hub try to reach the hub.
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
# Module names. gguf: the engine's weights package imports it (GGUF constants); the GPU image lacks it
# and has no network, so its wheel (pure Python; numpy, yaml and tqdm it finds there) is committed in .whl/.
NEEDED="torch transformers accelerate safetensors tokenizers tqdm jinja2 huggingface_hub pytest gguf yaml numpy"
# Where carried wheels are installed (a test points it at its own folder)
SITE=${GPU_CHECK_SITE:-/tmp/gpu_check_site}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

if [ "$DRY" -eq 0 ]; then
  if ! ls /dev/nvidia0 >/dev/null 2>&1 && ! nvidia-smi -L >/dev/null 2>&1; then
    echo "$ME: no NVIDIA GPU visible here (/dev/nvidia0, nvidia-smi); nothing to check" >&2
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
        || { echo "$ME: python3 has no CUDA torch and none could be installed" >&2; exit 1; }
    fi
    PY=$VENV/bin/python
  fi
fi

missing() { "$PY" - "$@" <<'PYEOF'
import importlib.util, sys
def found(m):
    try:
        return importlib.util.find_spec(m) is not None
    except ImportError:
        return False
print(" ".join(m for m in sys.argv[1:] if not found(m)))
PYEOF
}
fit "$PY" || { echo "$ME: $PY has no torch" >&2; exit 1; }
need=$(missing $NEEDED)
# The carried wheels are installed by a dry run too, so CI proves they are enough; only the network
# install is left to the GPU machine.
if [ -n "$need" ] && { [ "$DRY" -eq 0 ] || ls .whl/*.whl >/dev/null 2>&1; }; then
  echo "$ME: $PY lacks: $need; installing"
  if ls .whl/*.whl >/dev/null 2>&1; then
    "$PY" -m pip install -q --no-index --no-deps --target "$SITE" .whl/*.whl
    export PYTHONPATH="$PYTHONPATH:$SITE"
  else
    # pip names are the module names here, but for huggingface_hub; a short timeout when offline.
    "$PY" -m pip install -q --timeout 20 --retries 1 $(echo "$need" | sed 's/huggingface_hub/huggingface-hub/')
  fi
  need=$(missing $NEEDED)
fi
[ -z "$need" ] || { echo "$ME: $PY lacks: $need (carry their wheels in .whl/)" >&2; exit 1; }
"$PY" - "$DRY" "$ME" <<'PYEOF' || exit 1
import sys, torch
if sys.argv[1] == "1":
    print(f"torch {torch.__version__} at {sys.executable} (dry run: no GPU needed)")
else:
    assert torch.cuda.is_available(), f"{sys.argv[2]}: torch sees no CUDA device"
    print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, {torch.cuda.get_device_name()} at {sys.executable}")
PYEOF
