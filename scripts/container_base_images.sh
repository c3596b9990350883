#!/usr/bin/env bash
# Stand-ins for the two public base images the Dockerfile and docker-compose.yml name, built from
# Debian packages when no image registry answers (these machines reach only package registries):
#   python:3.11-slim  a Debian bookworm root (debootstrap) with bookworm's python3.11, linked
#                     into /usr/local/bin like the official image
#   postgres:16       Debian's PostgreSQL 15 behind an entrypoint that honours POSTGRES_USER,
#                     POSTGRES_PASSWORD and POSTGRES_DB like the official image
# An image already in the local store (pulled or built before) is left alone: the tags are the
# cache. Needs root (debootstrap, chroot) and a running Docker engine.
set -euo pipefail

SUITE=bookworm
MIRROR=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
WORK=$(mktemp -d /var/tmp/modelprep-base.XXXXXX)
trap 'rm -rf "$WORK"' EXIT

have() { docker image inspect "$1" >/dev/null 2>&1; }

rootfs() {  # rootfs DIR PACKAGES...: a minimal bookworm with PACKAGES, no apt lists or caches
    local dir=$1; shift
    debootstrap --variant=minbase "$SUITE" "$dir" "$MIRROR" >"$dir.log" 2>&1 \
        || { tail -20 "$dir.log"; return 1; }
    # no daemon starts inside the chroot while packages install
    printf '#!/bin/sh\nexit 101\n' >"$dir/usr/sbin/policy-rc.d"
    chmod +x "$dir/usr/sbin/policy-rc.d"
    mkdir -p "$dir/etc/postgresql-common"
    echo "create_main_cluster = false" >"$dir/etc/postgresql-common/createcluster.conf"
    chroot "$dir" env DEBIAN_FRONTEND=noninteractive apt-get install -y -q \
        --no-install-recommends "$@" >>"$dir.log" 2>&1 || { tail -20 "$dir.log"; return 1; }
    chroot "$dir" apt-get clean
    rm -rf "$dir"/var/lib/apt/lists/* "$dir/usr/sbin/policy-rc.d"
}

import() {  # import DIR TAG CHANGES...
    local dir=$1 tag=$2; shift 2
    local changes=()
    for c in "$@"; do changes+=(--change "$c"); done
    tar -C "$dir" -c . | docker import "${changes[@]}" - "$tag" >/dev/null
    echo "built $tag from Debian $SUITE packages"
}

build_python() {
    local dir=$WORK/python
    rootfs "$dir" python3.11 python3.11-venv python3-venv ca-certificates
    ln -sf /usr/bin/python3.11 "$dir/usr/local/bin/python3.11"
    ln -sf python3.11 "$dir/usr/local/bin/python3"
    ln -sf python3.11 "$dir/usr/local/bin/python"
    import "$dir" python:3.11-slim \
        'ENV PATH=/usr/local/bin:/usr/local/sbin:/usr/sbin:/usr/bin:/sbin:/bin' \
        'ENV LANG=C.UTF-8' 'CMD ["python3"]'
}

build_postgres() {
    local dir=$WORK/postgres
    rootfs "$dir" postgresql-15
    cat >"$dir/usr/local/bin/docker-entrypoint.sh" <<'EOF'
#!/bin/sh
# The official image's contract: a first start initialises PGDATA with POSTGRES_USER (password
# POSTGRES_PASSWORD) and POSTGRES_DB, listening on every address; then runs the command as postgres.
set -eu
: "${POSTGRES_USER:=postgres}" "${POSTGRES_DB:=$POSTGRES_USER}"
: "${PGDATA:=/var/lib/postgresql/data}"
export PGDATA
as_postgres() { setpriv --reuid=postgres --regid=postgres --init-groups "$@"; }
mkdir -p "$PGDATA" /var/run/postgresql
chown -R postgres:postgres "$PGDATA" /var/run/postgresql
chmod 700 "$PGDATA"
if [ "${1:-postgres}" = postgres ] && [ ! -s "$PGDATA/PG_VERSION" ]; then
    pwfile=$(mktemp)
    printf '%s\n' "${POSTGRES_PASSWORD:?POSTGRES_PASSWORD is required}" >"$pwfile"
    chown postgres "$pwfile"
    as_postgres initdb -D "$PGDATA" -U "$POSTGRES_USER" --pwfile="$pwfile" -E UTF8 --locale=C.UTF-8 \
        --auth-local=trust --auth-host=scram-sha-256 >/dev/null
    rm -f "$pwfile"
    echo "listen_addresses = '*'" >>"$PGDATA/postgresql.conf"
    echo "host all all all scram-sha-256" >>"$PGDATA/pg_hba.conf"
    if [ "$POSTGRES_DB" != postgres ]; then
        as_postgres postgres --single -D "$PGDATA" postgres >/dev/null <<SQL
CREATE DATABASE "$POSTGRES_DB" OWNER "$POSTGRES_USER";
SQL
    fi
fi
if [ "${1:-postgres}" = postgres ]; then
    shift || true
    exec setpriv --reuid=postgres --regid=postgres --init-groups postgres "$@"
fi
exec "$@"
EOF
    chmod +x "$dir/usr/local/bin/docker-entrypoint.sh"
    import "$dir" postgres:16 \
        'ENV PATH=/usr/lib/postgresql/15/bin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
        'ENV PGDATA=/var/lib/postgresql/data' 'EXPOSE 5432' \
        'ENTRYPOINT ["docker-entrypoint.sh"]' 'CMD ["postgres"]'
}

have python:3.11-slim || build_python
have postgres:16 || build_postgres
