# layerstream: an OpenAI-compatible server that streams transformer blocks from mmap'd safetensors,
# so a model larger than the GPU runs on a small one. See docker/README.md for run commands.
#
#   docker build -t layerstream .
#   docker run --gpus all -p 8000:8000 -v /srv/models:/models:ro -v hf-cache:/cache \
#     -e LAYERSTREAM_MODEL=/models/Qwen2.5-7B-Instruct -e LAYERSTREAM_MAX_DEVICE_MEMORY=6GiB layerstream
#
# The base must provide `python` with torch (the official PyTorch images do); the project's
# install pins torch to the version already there, so it is never reinstalled or upgraded.
ARG BASE_IMAGE=pytorch/pytorch:2.9.0-cuda12.8-cudnn9-runtime
FROM ${BASE_IMAGE}

# Device used when LAYERSTREAM_DEVICE is not given at run time (cpu for a CPU-only build).
ARG DEFAULT_DEVICE=cuda
# Only for a base without torch (e.g. python:3.11-slim for a small CPU image): where torch comes from.
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
ARG LAYERSTREAM_UID=10001
# Optional extras of the project, e.g. EXTRAS=ray for the image the KubeRay RayService runs (deploy/).
ARG EXTRAS=""

ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

WORKDIR /tmp/layerstream-src
COPY pyproject.toml ./

# Dependencies first, installed against empty packages, so that a source change rebuilds only
# the short layer below. The constraint file holds the exact torch the base ships (e.g.
# 2.9.0+cu128): pip must keep it, and the build fails if anything changed it anyway. It stays
# in the image for anyone extending it: pip install -c /opt/torch-constraint.txt ...
RUN set -eu; \
    if ! python -c "import torch" 2>/dev/null; then \
      python -m pip install --index-url "$TORCH_INDEX_URL" torch; \
    fi; \
    python -c "import importlib.metadata as m; print('torch==' + m.version('torch'))" > /opt/torch-constraint.txt; \
    mkdir engine server bench && touch README.md engine/__init__.py server/__init__.py bench/__init__.py; \
    python -m pip install --constraint /opt/torch-constraint.txt ".${EXTRAS:+[$EXTRAS]}"; \
    rm -rf engine server bench build

COPY README.md ./
COPY engine ./engine
COPY server ./server
COPY bench ./bench
COPY docker/healthcheck.py /opt/layerstream/healthcheck.py
RUN set -eu; \
    python -m pip install --no-deps --force-reinstall --constraint /opt/torch-constraint.txt .; \
    python -c "import importlib.metadata as m, sys; want = open('/opt/torch-constraint.txt').read().split('==')[1].strip(); \
have = m.version('torch'); sys.exit(f'torch changed: {want} -> {have}' if have != want else 0)"; \
    echo "layerstream installed on the base image's torch $(python -c 'import torch; print(torch.__version__)')"; \
    cd / && rm -rf /tmp/layerstream-src

# /models: model folders, mounted read-only. /cache: Hugging Face downloads, on a volume (a named
# volume starts out owned by the user below, because the image's /cache is).
RUN useradd --uid "$LAYERSTREAM_UID" --user-group --create-home --shell /usr/sbin/nologin layerstream \
 && mkdir -p /models /cache/huggingface /opt/layerstream/cache \
 && chown -R layerstream:layerstream /cache /opt/layerstream/cache

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
