# A private Docker engine, for machines where none runs (CI's: no systemd, no daemon).
# Sourced by scripts/images.sh; defines engine_start DIR and engine_stop DIR.
#
# The engine keeps everything under DIR: its socket (DIR/docker.sock), data, exec root,
# pid file and log. It runs without a default bridge and without iptables rules: the builds'
# RUN steps use the host's network (SWAP_STATE_BUILD_NETWORK=host), and the scenario's
# containers talk over a Unix socket in a volume, on a per-project network that the scenario
# removes. So nothing of the host's network configuration changes. DIR/engine.env holds what a
# client needs: DOCKER_HOST, the build network, and the memlock limit containers can be given
# (the daemon's own hard limit: a container may not be given more).

ENGINE_WAIT_S=60

# Installs Debian's docker.io (dockerd, containerd, runc, the 20.10 CLI) when root and missing.
engine_install() {
  if command -v dockerd >/dev/null && command -v docker >/dev/null; then
    return 0
  fi
  if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null; then
    echo "dockerd not found, and apt-get as root is not available to install docker.io" >&2
    return 1
  fi
  apt_install docker.io
}

# apt-get install, refreshing the package lists only when the install finds them stale; says
# which packages it installed (the named ones and what they pulled in).
apt_install() {
  local out
  out=$(mktemp)
  if ! DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends "$@" >"$out" 2>&1; then
    DEBIAN_FRONTEND=noninteractive apt-get update -q >/dev/null
    if ! DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends "$@" >"$out" 2>&1; then
      echo "apt-get install $* failed: $(tail -n 3 "$out" | tr '\n' ' ')" >&2
      rm -f "$out"
      return 1
    fi
  fi
  log "installed with apt-get: $* (new packages: $(awk '/NEW packages will be installed/ {on=1; next}
    on && /^  / {printf "%s", $0; next} {on=0}' "$out" | xargs))"
  rm -f "$out"
}

engine_start() {
  local dir=$1 started=$SECONDS
  mkdir -p "$dir"
  engine_install
  ip -o link show | awk -F': ' '{print $2}' | sed 's/@.*//' | sort > "$dir/links.before"
  # What dockerd makes outside DIR (its cgroups, /run/docker): removed at stop if new.
  ls -d /run/docker /sys/fs/cgroup/*/docker 2>/dev/null > "$dir/host-dirs.before" || true
  echo '{}' > "$dir/daemon.json"  # not /etc/docker/daemon.json: this engine is ours alone
  # stdin/stdout/stderr off the caller's: a caller that waits for its pipes to close (pytest's
  # subprocess.run) must not wait for the daemon.
  dockerd --config-file "$dir/daemon.json" --data-root "$dir/data" --exec-root "$dir/exec" \
    --pidfile "$dir/dockerd.pid" --host "unix://$dir/docker.sock" \
    --bridge none --iptables=false --ip6tables=false --ip-masq=false --ip-forward=false \
    </dev/null >"$dir/dockerd.log" 2>&1 &
  echo $! > "$dir/dockerd.launched.pid"
  local deadline=$((SECONDS + ENGINE_WAIT_S))
  until DOCKER_HOST="unix://$dir/docker.sock" timeout 10 docker info >/dev/null 2>&1; do
    if ! kill -0 "$(cat "$dir/dockerd.launched.pid")" 2>/dev/null; then
      echo "dockerd exited at start; its log ends: $(tail -n 3 "$dir/dockerd.log" | tr '\n' ' ')" >&2
      return 1
    fi
    if [ "$SECONDS" -ge "$deadline" ]; then
      echo "dockerd not answering after ${ENGINE_WAIT_S}s; its log ends: $(tail -n 3 "$dir/dockerd.log" | tr '\n' ' ')" >&2
      return 1
    fi
    sleep 0.2
  done
  local memlock
  memlock=$(ulimit -H -l)
  {
    echo "DOCKER_HOST=unix://$dir/docker.sock"
    echo "SWAP_STATE_BUILD_NETWORK=host"
    if [ "$memlock" != unlimited ]; then echo "SWAP_STATE_MEMLOCK=$((memlock * 1024))"; fi
  } > "$dir/engine.env"
  log "engine: dockerd $(dockerd --version | awk '{print $3}' | tr -d ,) (pid $(cat "$dir/dockerd.launched.pid")) on unix://$dir/docker.sock, up in $((SECONDS - started))s"
}

# Stops what engine_start started: the project containers and networks, then dockerd (SIGTERM,
# SIGKILL after 30 s) by its pid, then whatever a killed daemon leaves (mounts, bridges).
engine_stop() {
  local dir=$1
  [ -f "$dir/dockerd.launched.pid" ] || { rm -rf "$dir"; return 0; }
  local pid
  pid=$(cat "$dir/dockerd.launched.pid")
  if kill -0 "$pid" 2>/dev/null; then
    export DOCKER_HOST="unix://$dir/docker.sock"
    local ids
    ids=$(timeout 30 docker ps --all --quiet 2>/dev/null || true)
    if [ -n "$ids" ]; then
      # shellcheck disable=SC2086  # one id per word
      timeout 120 docker rm --force $ids >/dev/null 2>&1 || true
    fi
    timeout 30 docker network prune --force >/dev/null 2>&1 || true
    kill -TERM "$pid"
    local deadline=$((SECONDS + 30))
    while kill -0 "$pid" 2>/dev/null && [ "$SECONDS" -lt "$deadline" ]; do sleep 0.2; done
    if kill -0 "$pid" 2>/dev/null; then
      log "engine: dockerd (pid $pid) still running 30s after SIGTERM: SIGKILL"
      kill -KILL "$pid" 2>/dev/null || true
    fi
  fi
  engine_cleanup "$dir"
  log "engine: stopped dockerd (pid $pid), removed $dir"
}

engine_cleanup() {
  local dir=$1 mount link
  # Deepest first; /proc/mounts spells the paths as mounted.
  awk -v d="$dir" 'index($2, d"/") == 1 {print $2}' /proc/mounts | sort -r | while read -r mount; do
    umount "$mount" 2>/dev/null || umount -l "$mount" 2>/dev/null || true
  done
  # Bridges the engine made and a killed daemon left (the engine makes no other links).
  if [ -f "$dir/links.before" ]; then
    ip -o link show | awk -F': ' '{print $2}' | sed 's/@.*//' | sort \
      | comm -13 "$dir/links.before" - | { grep -E '^(br-|docker|veth)' || true; } | while read -r link; do
        ip link delete "$link" 2>/dev/null || true
      done
  fi
  if [ -f "$dir/host-dirs.before" ]; then
    local made
    for made in /sys/fs/cgroup/*/docker /run/docker; do
      if [ -d "$made" ] && ! grep -qxF "$made" "$dir/host-dirs.before"; then
        if [ "$made" = /run/docker ]; then rm -rf "$made"; else rmdir "$made" 2>/dev/null || true; fi
      fi
    done
  fi
  rm -rf "$dir"
}
