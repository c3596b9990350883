#!/usr/bin/env bash
# Make sure a Docker engine answers: install docker.io, docker-compose and debootstrap from Debian
# packages when missing, start dockerd in the background, wait for it with a deadline.
# Exit 0 when `docker info` answers; 1 with one line saying why not.
set -euo pipefail
DEADLINE=${DOCKER_START_DEADLINE:-60}
if docker info >/dev/null 2>&1; then exit 0; fi
if ! command -v dockerd >/dev/null || ! command -v docker-compose >/dev/null \
    || ! command -v debootstrap >/dev/null; then
    if [ "$(id -u)" != 0 ]; then echo "docker-engine: need root to install docker.io" >&2; exit 1; fi
    apt-get update -q >/dev/null
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q docker.io docker-compose debootstrap \
        >/dev/null
fi
if [ "$(id -u)" != 0 ]; then echo "docker-engine: need root to start dockerd" >&2; exit 1; fi
log=${XDG_CACHE_HOME:-$HOME/.cache}/modelprep/dockerd.log
mkdir -p "$(dirname "$log")"
nohup dockerd >"$log" 2>&1 &
for _ in $(seq 1 "$DEADLINE"); do
    if docker info >/dev/null 2>&1; then exit 0; fi
    sleep 1
done
echo "docker-engine: dockerd did not answer within ${DEADLINE}s (see $log)" >&2
exit 1
