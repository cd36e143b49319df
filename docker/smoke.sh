#!/usr/bin/env bash
# End-to-end check of the Dockerfile without a Docker engine: build a local base image (Debian
# bookworm + Python 3.11 + the CPU torch wheel, see base-image.sh), build the project's Dockerfile
# on it with buildah, then run the image's own entrypoint on loopback and check
#   - the image runs as a non-root user, exposes 8000, has a HEALTHCHECK and the serve entrypoint;
#   - the HEALTHCHECK command fails while the model loads and passes once it is loaded;
#   - /health, and one /v1/completions request with the API key (and a 401 without it);
#   - the kernels the image carries are chosen at start-up, and none is compiled;
#   - SIGTERM stops the server cleanly (what `docker stop` sends).
#
#   docker/smoke.sh        # root, with: apt-get install -y buildah debootstrap curl
#   SMOKE_VARIANT=cpu-index docker/smoke.sh   # base without torch: the Dockerfile installs it
#
# Not part of CI: the first run takes minutes (debootstrap, torch, the pip install); see
# docker/README.md for measured times. Build state lives in $LAYERSTREAM_DOCKER_STATE
# (default /var/tmp/layerstream-docker); `rm -rf` it to start over.
set -euo pipefail
cd "$(dirname "$0")/.."

STATE=${LAYERSTREAM_DOCKER_STATE:-/var/tmp/layerstream-docker}
export LAYERSTREAM_DOCKER_STATE=$STATE
# torch-base: torch comes with the base image (as in the PyTorch images, the default).
# cpu-index: a base without torch; the Dockerfile installs it (the compose file's CPU profile).
VARIANT=${SMOKE_VARIANT:-torch-base}
case $VARIANT in torch-base|cpu-index) ;; *) echo "SMOKE_VARIANT must be torch-base or cpu-index" >&2; exit 2;; esac
IMAGE=${SMOKE_IMAGE:-localhost/layerstream:smoke-$VARIANT}
LOAD_TIMEOUT=${SMOKE_LOAD_TIMEOUT:-180}
API_KEY=smoke-$RANDOM$RANDOM
buildah() { command buildah --root "$STATE/storage" --runroot "$STATE/run" "$@"; }
say() { printf '[smoke %4ss] %s\n' "$SECONDS" "$*"; }
fail() { say "FAIL: $*"; exit 1; }

for tool in buildah debootstrap curl python3; do
  command -v "$tool" >/dev/null || fail "needs $tool (apt-get install -y buildah debootstrap curl)"
done
[ "$(id -u)" = 0 ] || fail "run as root (buildah --isolation chroot and debootstrap need it)"
mkdir -p "$STATE"

server_pid= ctr= index_pid=
cleanup() {
  if [ -n "$index_pid" ]; then kill "$index_pid" 2>/dev/null || true; fi
  if [ -n "$server_pid" ] && kill -0 "$server_pid" 2>/dev/null; then
    kill -KILL -- "-$server_pid" 2>/dev/null || true
    wait "$server_pid" 2>/dev/null || true
  fi
  if [ -n "$ctr" ]; then buildah rm "$ctr" >/dev/null 2>&1 || true; fi
}
trap cleanup EXIT

say "base image (variant $VARIANT)"
build_args=(--build-arg DEFAULT_DEVICE=cpu)
if [ "$VARIANT" = torch-base ]; then
  base=$(docker/base-image.sh 2> >(grep -v 'is ignored: it is neither' >&2) | tail -1)
else
  # A base without torch, as the compose file's CPU profile uses (python:3.11-slim): the
  # Dockerfile installs torch from TORCH_INDEX_URL, here the base script's wheelhouse served as
  # a PEP 503 index on loopback (pip accepts plain http from 127.0.0.1).
  base=$(WITH_TORCH=0 docker/base-image.sh 2> >(grep -v 'is ignored: it is neither' >&2) | tail -1)
  rm -rf "$STATE/index" && mkdir -p "$STATE/index/simple"
  for whl in "$STATE"/wheelhouse/*.whl; do
    name=$(basename "$whl" | cut -d- -f1 | tr 'A-Z_.' 'a-z--')
    mkdir -p "$STATE/index/simple/$name" && ln "$whl" "$STATE/index/simple/$name/"
  done
  iport=$(python3 -c "import socket; s=socket.socket(); s.bind(('127.0.0.1', 0)); print(s.getsockname()[1])")
  python3 -m http.server --bind 127.0.0.1 --directory "$STATE/index" "$iport" >"$STATE/index.log" 2>&1 &
  index_pid=$!
  build_args+=(--build-arg TORCH_INDEX_URL="http://127.0.0.1:$iport/simple/")
fi
t_base=$SECONDS

say "building the Dockerfile on $base"
buildah bud --isolation chroot --ulimit nofile=20000:20000 --format docker --layers --force-rm -q \
  --build-arg BASE_IMAGE="$base" "${build_args[@]}" -t "$IMAGE" . >"$STATE/build.log" 2>&1 \
  || { tail -30 "$STATE/build.log"; fail "image build failed (log: $STATE/build.log)"; }
t_build=$SECONDS
say "image $IMAGE: $(buildah images --format '{{.Size}}' "$IMAGE" | head -1)"
if [ -n "$index_pid" ]; then kill "$index_pid"; wait "$index_pid" 2>/dev/null || true; index_pid=; fi

# The image's own configuration, as Docker would read it.
config=$(buildah inspect --type image "$IMAGE")
field() { python3 -c "import json,sys; c=json.load(sys.stdin)['Docker']['config']; print(json.dumps(c.get('$1')))" <<<"$config"; }
user=$(field User); healthcheck=$(field Healthcheck); entrypoint=$(field Entrypoint); cmd=$(field Cmd)
say "config: User=$user Entrypoint=$entrypoint ExposedPorts=$(field ExposedPorts)"
say "config: Healthcheck=$healthcheck"
[[ $(field ExposedPorts) == *'"8000/tcp"'* ]] || fail "port 8000 not exposed"
[[ $entrypoint == '["layerstream", "serve"]' ]] || fail "entrypoint is $entrypoint"
mapfile -t probe < <(python3 -c "
import json,sys; t=json.loads(sys.argv[1])['Test']
assert t[0] in ('CMD', 'CMD-SHELL'), t
print('\n'.join(t[1:] if t[0] == 'CMD' else ['/bin/sh', '-c', t[1]]))" "$healthcheck") \
  || fail "no HEALTHCHECK in the image"
mapfile -t serve < <(python3 -c "import json,sys; print('\n'.join(json.loads(sys.argv[1]) + (json.loads(sys.argv[2]) or [])))" "$entrypoint" "$cmd")

port=$(python3 -c "import socket; s=socket.socket(); s.bind(('127.0.0.1', 0)); print(s.getsockname()[1])")
ctr=$(buildah from --name "layerstream-smoke-$$" "$IMAGE")
# Loopback only: chroot isolation shares the host's network, so the container's 0.0.0.0 default
# would listen on every host interface.
# The empty ones are what docker/compose.yaml passes when those variables are unset.
env_args=(--env LAYERSTREAM_HOST=127.0.0.1 --env LAYERSTREAM_PORT="$port" --env LAYERSTREAM_API_KEY="$API_KEY"
          --env LAYERSTREAM_MAX_DEVICE_MEMORY= --env LAYERSTREAM_MAX_HOST_MEMORY= --env LAYERSTREAM_SERVED_MODEL_NAME=
          --env LAYERSTREAM_DTYPE=auto --env HF_TOKEN=)
crun() { buildah run --isolation chroot "${env_args[@]}" "$ctr" -- "$@"; }

uid=$(crun id -u)
[ "$uid" != 0 ] || fail "the container runs as root"
say "container runs as uid $uid ($(crun id -un)); torch $(crun python -c 'import torch; print(torch.__version__)' 2>/dev/null)"

say "starting: ${serve[*]} on 127.0.0.1:$port"
t_start=$SECONDS
setsid bash -c 'exec "$@"' _ buildah --root "$STATE/storage" --runroot "$STATE/run" \
  run --isolation chroot "${env_args[@]}" "$ctr" -- "${serve[@]}" >"$STATE/server.log" 2>&1 &
server_pid=$!

# Docker would run the HEALTHCHECK every --interval; here it runs every second until it passes.
unhealthy=0; last=
while :; do
  if out=$(crun "${probe[@]}" 2>&1); then
    say "healthcheck: healthy   ($out)"
    break
  fi
  unhealthy=$((unhealthy + 1))
  out=$(head -1 <<<"$out")
  if [ "$out" != "$last" ]; then say "healthcheck: unhealthy ($out)"; last=$out; fi
  kill -0 "$server_pid" 2>/dev/null || { tail -20 "$STATE/server.log"; fail "server exited while loading"; }
  [ $((SECONDS - t_start)) -lt "$LOAD_TIMEOUT" ] || { tail -20 "$STATE/server.log"; fail "not healthy after ${LOAD_TIMEOUT}s"; }
  sleep 1
done
t_ready=$SECONDS
[ $unhealthy -gt 0 ] || fail "healthcheck passed on its first probe: the unhealthy -> healthy flip was not seen"
say "healthcheck flipped unhealthy -> healthy after $unhealthy failing probes, $((t_ready - t_start))s after start"

url=http://127.0.0.1:$port
health=$(curl -sS -w ' %{http_code}' "$url/health")
[[ $health == *' 200' ]] || fail "/health: $health"
say "GET /health -> $health"

code=$(curl -sS -o /dev/null -w '%{http_code}' "$url/v1/completions" -H 'Content-Type: application/json' \
  -d '{"model": "demo", "prompt": "Hello", "max_tokens": 4}')
[ "$code" = 401 ] || fail "/v1/completions without the API key answered $code, not 401"
say "POST /v1/completions without the key -> 401"

body=$(curl -sS -w '\n%{http_code}' "$url/v1/completions" -H "Authorization: Bearer $API_KEY" \
  -H 'Content-Type: application/json' \
  -d '{"model": "demo", "prompt": "Once upon a time", "max_tokens": 16, "temperature": 0}')
code=${body##*$'\n'}; body=${body%$'\n'*}
[ "$code" = 200 ] || fail "/v1/completions answered $code: $body"
python3 -c "
import json,sys; r=json.loads(sys.argv[1]); c=r['choices'][0]; u=r['usage']
assert r['object'] == 'text_completion' and u['completion_tokens'] >= 1 and c['finish_reason'] in ('length', 'stop'), r
print(f\"[smoke {sys.argv[2]:>4}s] POST /v1/completions -> 200: {u['prompt_tokens']} prompt + {u['completion_tokens']} completion tokens, finish_reason {c['finish_reason']}, text {c['text']!r}\")
" "$body" "$SECONDS" || fail "unexpected completion: $body"
t_answer=$SECONDS
# The image carries its kernels: the server chose them at start-up and compiled nothing.
grep -q "kernels in use:" "$STATE/server.log" || { tail -20 "$STATE/server.log"; fail "no kernel choice in the log"; }
if grep -q "compiling the" "$STATE/server.log"; then grep "compiling the" "$STATE/server.log"; fail "the server compiled a kernel"; fi
say "$(grep -o 'kernels in use:.*' "$STATE/server.log" | head -1)"

# `docker stop` sends SIGTERM to PID 1, the server process itself.
descendants() { local p; for p in $(pgrep -P "$1"); do echo "$p"; descendants "$p"; done; }
pypid=
for p in $(descendants "$server_pid"); do
  if [[ $(ps -o uid=,args= -p "$p") =~ ^\ *$uid\ [^\ ]*python ]]; then pypid=$p; fi
done
[ -n "$pypid" ] || fail "server process not found"
kill -TERM "$pypid"
for _ in $(seq 1 20); do kill -0 "$server_pid" 2>/dev/null || break; sleep 0.5; done
kill -0 "$server_pid" 2>/dev/null && fail "server still running 10s after SIGTERM"
rc=0; wait "$server_pid" || rc=$?
server_pid=
# uvicorn re-raises SIGTERM once it has shut down (Docker then reports 143), which buildah turns
# into status 1; the log line says whether the shutdown was the graceful one.
grep -q "Application shutdown complete" "$STATE/server.log" \
  || { tail -5 "$STATE/server.log"; fail "no graceful shutdown after SIGTERM (status $rc)"; }
say "SIGTERM: graceful shutdown, stopped within 10s"

say "PASS in ${SECONDS}s (base image ${t_base}s, Dockerfile build $((t_build - t_base))s, model ready $((t_ready - t_start))s after start, first answer $((t_answer - t_start))s after start)"
