# Builds swap-state-server:local and swap-state-trainer:local from docker/compose.yaml, also
# where no container registry and no PyTorch index is reachable (CI reaches only PyPI and
# Debian). Sourced by scripts/images.sh; defines images_build. Needs: DOCKER_HOST (or the
# default socket) reaching an engine, $PYTHON (python3 with PyYAML), $WORK (a temp folder).
#
# What it does where the defaults cannot be reached; each is a setting of compose.yaml that a
# caller's own value overrides:
# - base images (SWAP_STATE_PYTHON_IMAGE, SWAP_STATE_BASE_IMAGE): where the engine neither has
#   nor can pull python:3.11-slim, a Debian bookworm image made here with mmdebstrap from
#   Debian's archive (python3 3.11, venv, pip, ca-certificates), with this host's CA bundle;
# - torch (SWAP_STATE_TORCH_INDEX_URL): where the PyTorch CPU index is unreachable, the wheels
#   of torch==TORCH_VERSION and its requirements, as pip finds them on this host (its own
#   configured indexes and wheel folders), served as a simple index on 127.0.0.1 to builds
#   that use the host's network (SWAP_STATE_BUILD_NETWORK=host).

# The Dockerfiles' defaults (tests/container/test_static.py keeps them equal).
DEFAULT_PYTHON_IMAGE=python:3.11-slim
DEFAULT_TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
TORCH_VERSION=${SWAP_STATE_TORCH_VERSION:-2.13.0}
LOCAL_BASE_IMAGE=swap-state-base:bookworm
# The local base's python (bookworm's), for which the torch wheels are chosen.
LOCAL_BASE_PYTHON=3.11
DEBIAN_SUITE=bookworm
PULL_TIMEOUT_S=120
INDEX_WAIT_S=20

images_build() {
  local started=$SECONDS
  ensure_base_images
  ensure_torch_index
  if docker compose version >/dev/null 2>&1; then
    log "build: docker compose build"
    timeout 1500 docker compose -f docker/compose.yaml build
  else
    # No compose v2 here: compose.yaml's build sections run as `docker build` (see there why).
    "$PYTHON" tests/container/compose_run.py build
  fi
  stop_torch_index
  log "build: both images in $((SECONDS - started))s"
}

ensure_base_images() {
  if [ -n "${SWAP_STATE_PYTHON_IMAGE:-}" ]; then
    return 0
  fi
  if docker image inspect "$DEFAULT_PYTHON_IMAGE" >/dev/null 2>&1; then
    return 0
  fi
  local pulled
  if pulled=$(timeout "$PULL_TIMEOUT_S" docker pull --quiet "$DEFAULT_PYTHON_IMAGE" 2>&1); then
    return 0
  fi
  log "base: cannot pull $DEFAULT_PYTHON_IMAGE ($(echo "$pulled" | tail -n 1)): using $LOCAL_BASE_IMAGE"
  if ! docker image inspect "$LOCAL_BASE_IMAGE" >/dev/null 2>&1; then
    make_local_base
  fi
  export SWAP_STATE_PYTHON_IMAGE=$LOCAL_BASE_IMAGE
  export SWAP_STATE_BASE_IMAGE=${SWAP_STATE_BASE_IMAGE:-$LOCAL_BASE_IMAGE}
}

make_local_base() {
  local started=$SECONDS
  command -v mmdebstrap >/dev/null || apt_install mmdebstrap
  # mmdebstrap, not debootstrap: apt's parallel downloads and one dpkg run make it the faster
  # of the two, and it writes the tar docker import reads, with no rootfs on disk.
  # python-is-python3: the images call `python`, as python:3.11-slim has it. An image's python
  # belongs to its application, as in python:3.11-slim: pip may install into it (PEP 668's
  # marker guards a host's system python). Outbound TLS may be re-signed by this network's
  # proxy: the image trusts what the host trusts.
  if ! mmdebstrap --variant=minbase --include=python3,python3-venv,python3-pip,python-is-python3,ca-certificates \
      --dpkgopt='path-exclude=/usr/share/doc/*' --dpkgopt='path-exclude=/usr/share/man/*' \
      --customize-hook='rm -f "$1"/usr/lib/python3*/EXTERNALLY-MANAGED' \
      --customize-hook='copy-in /etc/ssl/certs/ca-certificates.crt /etc/ssl/certs' \
      "$DEBIAN_SUITE" - 2>"$WORK/mmdebstrap.log" \
      | docker import --change 'ENV LANG=C.UTF-8' --change 'CMD ["python3"]' - "$LOCAL_BASE_IMAGE" >/dev/null; then
    echo "making $LOCAL_BASE_IMAGE failed; mmdebstrap's log ends:" >&2
    tail -n 20 "$WORK/mmdebstrap.log" >&2
    return 1
  fi
  log "base: $LOCAL_BASE_IMAGE made with mmdebstrap ($DEBIAN_SUITE, Debian's archive) in $((SECONDS - started))s"
}

ensure_torch_index() {
  if [ -n "${SWAP_STATE_TORCH_INDEX_URL:-}" ]; then
    return 0
  fi
  if "$PYTHON" -c "import urllib.request, sys; urllib.request.urlopen(sys.argv[1], timeout=15)" \
      "$DEFAULT_TORCH_INDEX_URL/torch/" >/dev/null 2>&1; then
    return 0
  fi
  local started=$SECONDS wheels=$WORK/wheels
  log "torch: $DEFAULT_TORCH_INDEX_URL unreachable: serving torch==$TORCH_VERSION as pip finds it here"
  # pip warns once per package about this machine's unused local index folders: noise, dropped.
  "$PYTHON" -m pip download --quiet --disable-pip-version-check --dest "$wheels" --only-binary=:all: \
    --python-version "$LOCAL_BASE_PYTHON" "torch==$TORCH_VERSION" 2>&1 \
    | { grep -v "is ignored: it is neither a file nor a directory" || true; }
  "$PYTHON" scripts/images/wheel_index.py "$wheels" "$WORK/index.port" >"$WORK/index.log" 2>&1 &
  INDEX_PID=$!
  local deadline=$((SECONDS + INDEX_WAIT_S))
  until [ -s "$WORK/index.port" ]; do
    if ! kill -0 "$INDEX_PID" 2>/dev/null || [ "$SECONDS" -ge "$deadline" ]; then
      echo "the local wheel index did not start: $(cat "$WORK/index.log")" >&2
      return 1
    fi
    sleep 0.1
  done
  export SWAP_STATE_TORCH_INDEX_URL="http://127.0.0.1:$(cat "$WORK/index.port")/simple"
  export SWAP_STATE_BUILD_NETWORK=host
  log "torch: $(ls "$wheels" | wc -l) wheels served at $SWAP_STATE_TORCH_INDEX_URL (pid $INDEX_PID), in $((SECONDS - started))s"
}

stop_torch_index() {
  if [ -n "${INDEX_PID:-}" ]; then
    kill -TERM "$INDEX_PID" 2>/dev/null || true
    wait "$INDEX_PID" 2>/dev/null || true
    INDEX_PID=
  fi
}
