#!/usr/bin/env bash
# Build a local stand-in for the official PyTorch runtime image, without a registry: Debian
# bookworm (debootstrap) + Python 3.11 in a venv on PATH + the CPU torch wheel pip finds on this
# machine. Like pytorch/pytorch images, `python`/`pip` on PATH already have torch, so the project's
# Dockerfile is exercised exactly as it would be on a CUDA base.
#
#   docker/base-image.sh            # builds once, then reuses the image
#   REBUILD_BASE=1 docker/base-image.sh
#   WITH_TORCH=0 docker/base-image.sh   # no torch: exercises the Dockerfile's torch install
#
# Prints the image name on its last line. Everything big (rootfs, wheelhouse, buildah storage)
# lives under $LAYERSTREAM_DOCKER_STATE (default /var/tmp/layerstream-docker), never in the repo.
set -euo pipefail

STATE=${LAYERSTREAM_DOCKER_STATE:-/var/tmp/layerstream-docker}
TORCH_VERSION=${LAYERSTREAM_TORCH_VERSION:-2.13.0}
# WITH_TORCH=0: the same base without torch, like python:3.11-slim (the Dockerfile then installs it).
WITH_TORCH=${WITH_TORCH:-1}
if [ "$WITH_TORCH" = 1 ]; then
  BASE_IMAGE=${LAYERSTREAM_BASE_IMAGE:-localhost/layerstream-base:bookworm-py311-torch${TORCH_VERSION}}
else
  BASE_IMAGE=${LAYERSTREAM_BASE_IMAGE:-localhost/layerstream-base:bookworm-py311-notorch}
fi
MIRROR=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
HOST_CA=${HOST_CA_BUNDLE:-/etc/ssl/certs/ca-certificates.crt}
buildah() { command buildah --root "$STATE/storage" --runroot "$STATE/run" "$@"; }
say() { echo "[base-image] $*" >&2; }

mkdir -p "$STATE"
if [ -z "${REBUILD_BASE:-}" ] && buildah inspect --type image "$BASE_IMAGE" >/dev/null 2>&1; then
  say "reusing $BASE_IMAGE"
  echo "$BASE_IMAGE"
  exit 0
fi
for tool in buildah debootstrap; do
  command -v "$tool" >/dev/null || { say "needs $tool: apt-get install -y buildah debootstrap"; exit 1; }
done

# The torch wheel and its dependencies, resolved by the host's pip (same CPython 3.11 ABI as
# bookworm's python3.11), so the image build needs no index for torch.
wheels="$STATE/wheelhouse"
if ! ls "$wheels"/torch-"$TORCH_VERSION"*-cp311-*.whl >/dev/null 2>&1; then
  say "collecting torch==$TORCH_VERSION and its dependencies into $wheels"
  "${PYTHON:-python3}" -m pip download -q --only-binary=:all: -d "$wheels" "torch==$TORCH_VERSION"
fi
ls "$wheels"/torch-"$TORCH_VERSION"*-cp311-*.whl >/dev/null

rootfs="$STATE/rootfs"
if [ ! -f "$rootfs.tar" ]; then  # rm it to debootstrap again
  say "debootstrap bookworm into $rootfs"
  rm -rf "$rootfs"
  # passwd: useradd for the Dockerfile's non-root user (the Ubuntu-based PyTorch images have it).
  debootstrap --variant=minbase --include=python3,python3-venv,ca-certificates,passwd \
    bookworm "$rootfs" "$MIRROR" >"$STATE/debootstrap.log" 2>&1 \
    || { tail -20 "$STATE/debootstrap.log" >&2; exit 1; }
  rm -rf "$rootfs"/var/cache/apt/archives/*.deb "$rootfs"/var/lib/apt/lists/*
  tar -C "$rootfs" --numeric-owner -cf "$rootfs.tar.tmp" .
  mv "$rootfs.tar.tmp" "$rootfs.tar"
  rm -rf "$rootfs"
fi

say "importing the rootfs$([ "$WITH_TORCH" = 1 ] && echo " and installing torch")"
ctr=$(buildah from scratch)
trap 'buildah rm "$ctr" >/dev/null 2>&1 || true' EXIT
buildah add "$ctr" "$rootfs.tar" / >/dev/null
run() { buildah run --isolation chroot "$@"; }
run "$ctr" -- python3 -m venv /opt/venv
if [ "$WITH_TORCH" = 1 ]; then
  run -v "$wheels:/wheels:ro" "$ctr" -- /opt/venv/bin/pip install -q --no-cache-dir --no-index \
    --find-links /wheels "torch==$TORCH_VERSION"
fi
# Trust what this machine trusts: where HTTPS goes through an inspecting proxy, its CA is in the
# host bundle, and pip (which otherwise uses its own certifi copy) needs it to reach the index
# when the project's Dockerfile installs its dependencies. This belongs to the stand-in base,
# not to the project's Dockerfile.
if [ -f "$HOST_CA" ]; then
  buildah copy "$ctr" "$HOST_CA" /etc/ssl/certs/ca-certificates.crt >/dev/null
  printf '[global]\ncert = /etc/ssl/certs/ca-certificates.crt\n' >"$STATE/pip.conf"
  buildah copy "$ctr" "$STATE/pip.conf" /etc/pip.conf >/dev/null
fi
if [ "$WITH_TORCH" = 1 ]; then
  run "$ctr" -- /opt/venv/bin/python -c "import torch; print('[base-image] torch', torch.__version__)" >&2
fi
buildah config --env PATH=/opt/venv/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
  --env LANG=C.UTF-8 --cmd /bin/bash --label org.opencontainers.image.description="layerstream smoke-test base: bookworm + python3.11 (torch: $WITH_TORCH)" \
  "$ctr"
buildah commit -q --rm "$ctr" "$BASE_IMAGE" >/dev/null
trap - EXIT
say "built $BASE_IMAGE"
echo "$BASE_IMAGE"
