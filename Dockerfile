# layerstream: an OpenAI-compatible server that streams transformer blocks from mmap'd checkpoints,
# so a model larger than the GPU runs on a small one. See docker/README.md for run commands.
#
#   docker build -t layerstream .
#   docker run --gpus all -p 8000:8000 -v /srv/models:/models:ro -v hf-cache:/cache \
#     -e LAYERSTREAM_MODEL=/models/Qwen2.5-7B-Instruct -e LAYERSTREAM_MAX_DEVICE_MEMORY=6GiB layerstream
#
# Stages: base (torch, pinned) -> wheel (built from the build context) -> runtime (dependencies, then
# the wheel) -> kernels (a compiler builds the C++ kernels; the runtime image has none) -> the image
# (runtime + the built kernels + a non-root user). The base must provide `python`; with torch (the
# official PyTorch images) it is kept exactly as it is.
ARG BASE_IMAGE=pytorch/pytorch:2.9.0-cuda12.8-cudnn9-runtime

FROM ${BASE_IMAGE} AS base
# Only for a base without torch (e.g. python:3.11-slim for a small CPU image): where torch comes from.
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1
# The constraint file holds the exact torch the base ships (e.g. 2.9.0+cu128): every later pip must
# keep it, and the build fails if anything changed it anyway. It stays in the image for anyone
# extending it: pip install -c /opt/torch-constraint.txt ...
RUN set -eu; \
    if ! python -c "import torch" 2>/dev/null; then \
      python -m pip install --index-url "$TORCH_INDEX_URL" torch; \
    fi; \
    python -c "import importlib.metadata as m; print('torch==' + m.version('torch'))" > /opt/torch-constraint.txt

# The wheel, built from the whole build context: .dockerignore lets in exactly what pyproject.toml
# packages (tests/deploy/test_install.py builds the same wheel from the same context), so no package is
# left behind by a hand-kept COPY list.
FROM base AS wheel
# Optional extras of the project, e.g. EXTRAS=ray for the image the KubeRay RayService runs (deploy/).
ARG EXTRAS=""
WORKDIR /src
COPY . .
RUN set -eu; \
    python -m pip wheel --no-deps -w /wheels .; \
    python docker/requirements.py /wheels/layerstream-*.whl "$EXTRAS" > /wheels/requirements.txt

FROM base AS runtime
# Dependencies first, in a layer that a source change leaves cached (requirements.txt only changes
# with pyproject.toml's dependencies), then the project itself without them.
COPY --from=wheel /wheels/requirements.txt /tmp/requirements.txt
RUN python -m pip install --constraint /opt/torch-constraint.txt -r /tmp/requirements.txt && rm /tmp/requirements.txt
COPY --from=wheel /wheels/ /tmp/wheels/
RUN set -eu; \
    python -m pip install --no-deps --constraint /opt/torch-constraint.txt /tmp/wheels/layerstream-*.whl; \
    rm -rf /tmp/wheels; \
    python -c "import importlib.metadata as m, sys; want = open('/opt/torch-constraint.txt').read().split('==')[1].strip(); \
have = m.version('torch'); sys.exit(f'torch changed: {want} -> {have}' if have != want else 0)"; \
    echo "layerstream installed on the base image's torch $(python -c 'import torch; print(torch.__version__)')"

# The C++ CPU kernels, compiled here so that no container waits for (or needs) a compiler: every
# kernel, whatever CPU builds the image, since each is built for explicit instruction sets and checks
# the CPU it runs on when the server chooses it. Their cache key is the source, the flags, torch and
# Python, which the image below shares with this stage.
FROM runtime AS kernels
RUN set -eu; \
    apt-get update; \
    apt-get install -y --no-install-recommends g++; \
    python -c "import os, sys, sysconfig; sys.exit(not os.path.exists(os.path.join(sysconfig.get_paths()['include'], 'Python.h')))" \
      || apt-get install -y --no-install-recommends python3-dev; \
    rm -rf /var/lib/apt/lists/*
RUN LAYERSTREAM_CACHE=/opt/layerstream/cache layerstream build-kernels --all

FROM runtime
# Device used when LAYERSTREAM_DEVICE is not given at run time (cpu for a CPU-only build).
ARG DEFAULT_DEVICE=cuda
ARG LAYERSTREAM_UID=10001
COPY docker/healthcheck.py /opt/layerstream/healthcheck.py

# /models: model folders, mounted read-only. /cache: Hugging Face downloads, on a volume (a named
# volume starts out owned by the user below, because the image's /cache is).
RUN useradd --uid "$LAYERSTREAM_UID" --user-group --create-home --shell /usr/sbin/nologin layerstream \
 && mkdir -p /models /cache/huggingface /opt/layerstream/cache \
 && chown -R layerstream:layerstream /cache /opt/layerstream/cache
COPY --from=kernels --chown=layerstream:layerstream /opt/layerstream/cache/kernels /opt/layerstream/cache/kernels

# Every `layerstream serve` flag reads LAYERSTREAM_<FLAG> (LAYERSTREAM_MODEL, LAYERSTREAM_DEVICE,
# LAYERSTREAM_MAX_DEVICE_MEMORY, LAYERSTREAM_API_KEY, LAYERSTREAM_MAX_NUM_SEQS, ...).
ENV LAYERSTREAM_HOST=0.0.0.0 \
    LAYERSTREAM_PORT=8000 \
    LAYERSTREAM_MODEL=demo \
    LAYERSTREAM_DEVICE=${DEFAULT_DEVICE} \
    LAYERSTREAM_CACHE=/opt/layerstream/cache \
    HF_HOME=/cache/huggingface

USER layerstream
WORKDIR /home/layerstream
# The built-in demo model (random weights, a few MB) is built now, so a container with no model
# mounted starts without writing anywhere.
RUN python -c "from engine.demo import demo_model_path; print('demo model in', demo_model_path())"

VOLUME ["/cache"]
EXPOSE 8000
# /health answers 503 while the model loads and 200 once it serves: unhealthy -> healthy.
HEALTHCHECK --interval=10s --timeout=5s --start-period=20s --retries=3 \
    CMD ["python", "/opt/layerstream/healthcheck.py"]
ENTRYPOINT ["layerstream", "serve"]
CMD []
