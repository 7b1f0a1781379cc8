#!/usr/bin/env bash
# A private PostgreSQL for tests and benchmarks: a fresh cluster in DIR, reachable only through
# a Unix socket in DIR/sock (no TCP), trusting local connections, as user `agentd`.
#
#   scripts/pg-test-server.sh start DIR   prints the connection URL on stdout once it accepts
#   scripts/pg-test-server.sh stop DIR    stops it and deletes DIR
#   scripts/pg-test-server.sh restart DIR stops it (fast) and starts it again on the same data
#
# PG_LISTEN=ADDR also listens on TCP at ADDR (port 5432), trusting clients of PG_HBA_CIDR
# (default: the subnets of the machine's interfaces); PG_SERVER_OPTS adds server options
# ("-c tcp_keepalives_idle=1 ..."). The partition tests use both (a runner in a network namespace).
#
# Binaries: $PG_BIN, else the directory of `pg_ctl` on the PATH, else the newest
# /usr/lib/postgresql/<v>/bin. Exits 3 when none is found (the caller says why it skips).
# PostgreSQL refuses to run as root: as root the cluster belongs to the `postgres` user (or
# `nobody` when there is none) and its commands run through runuser.
set -euo pipefail

cmd=${1:-}
dir=${2:-}
if [ -z "$cmd" ] || [ -z "$dir" ]; then
  echo "usage: $0 start|stop|restart DIR" >&2
  exit 2
fi

find_bin() {
  if [ -n "${PG_BIN:-}" ] && [ -x "$PG_BIN/pg_ctl" ]; then echo "$PG_BIN"; return; fi
  if command -v pg_ctl >/dev/null 2>&1 && command -v initdb >/dev/null 2>&1; then
    dirname "$(readlink -f "$(command -v pg_ctl)")"
    return
  fi
  local best
  best=$(ls -d /usr/lib/postgresql/*/bin 2>/dev/null | sort -V | tail -n 1 || true)
  if [ -n "$best" ] && [ -x "$best/pg_ctl" ]; then echo "$best"; return; fi
}

bin=$(find_bin || true)
if [ -z "$bin" ]; then
  echo "no PostgreSQL binaries found (set PG_BIN, or install initdb/pg_ctl/postgres)" >&2
  exit 3
fi

owner=""
if [ "$(id -u)" = "0" ]; then
  if id postgres >/dev/null 2>&1; then owner=postgres; else owner=nobody; fi
fi
as_owner() {
  if [ -n "$owner" ]; then runuser -u "$owner" -- "$@"; else "$@"; fi
}

port=5432
data="$dir/data"
sock="$dir/sock"

start_server() {
  # -w waits until it accepts connections; the log stays in DIR for a failed start.
  if ! as_owner "$bin/pg_ctl" -D "$data" -l "$dir/server.log" -w -t 60 \
    -o "-k $sock -p $port -c listen_addresses=${PG_LISTEN:-} -c max_connections=200 ${PG_SERVER_OPTS:-}" start >/dev/null; then
    echo "PostgreSQL did not start; its log:" >&2
    cat "$dir/server.log" >&2 || true
    exit 1
  fi
}

case "$cmd" in
  start)
    mkdir -p "$dir"
    if [ -e "$data" ]; then
      echo "$data exists already: stop that server first" >&2
      exit 2
    fi
    mkdir -p "$sock"
    chmod 0700 "$dir"
    if [ -n "$owner" ]; then chown -R "$owner" "$dir"; fi
    # The owner must be able to reach DIR: a parent made by `mktemp -d` as root is 0700, so it
    # gets search permission (o+x, nothing listable); other parents are checked, not changed.
    if [ -n "$owner" ] && ! as_owner test -w "$dir"; then chmod o+x "$(dirname "$dir")"; fi
    if ! as_owner test -w "$dir"; then
      echo "$dir is not writable by $owner (a parent directory is not searchable)" >&2
      exit 1
    fi
    # initdb takes seconds; its result is the same every time: made once per user and version
    # into a template (atomically: a temp dir renamed) and copied, unless PG_TEMPLATE=0.
    version=$("$bin/postgres" --version | awk '{print $3}')
    template="${TMPDIR:-/tmp}/agentd-pg-template-$(id -u)-$version"
    if [ "${PG_TEMPLATE:-1}" != "0" ] && [ ! -d "$template" ]; then
      staging=$(mktemp -d "${TMPDIR:-/tmp}/agentd-pg-template.XXXXXX")
      chmod 0711 "$staging"
      if [ -n "$owner" ]; then chown "$owner" "$staging"; fi
      if as_owner "$bin/initdb" -D "$staging/data" -U agentd --auth=trust -E UTF8 --locale=C --no-sync >"$dir/initdb.log" 2>&1; then
        mv -T "$staging" "$template" 2>/dev/null || rm -rf "$staging"
      else
        rm -rf "$staging"
      fi
    fi
    if [ "${PG_TEMPLATE:-1}" != "0" ] && [ -d "$template/data" ]; then
      cp -a "$template/data" "$data"
    else
      as_owner "$bin/initdb" -D "$data" -U agentd --auth=trust -E UTF8 --locale=C --no-sync >"$dir/initdb.log" 2>&1 || {
        cat "$dir/initdb.log" >&2
        exit 1
      }
    fi
    if [ -n "${PG_LISTEN:-}" ]; then
      echo "host all all ${PG_HBA_CIDR:-samenet} trust" >>"$data/pg_hba.conf"
    fi
    start_server
    echo "postgresql://agentd@localhost:$port/postgres?host=$sock"
    ;;
  restart)
    as_owner "$bin/pg_ctl" -D "$data" -m fast -w stop >/dev/null
    start_server
    ;;
  stop)
    if [ -e "$data/postmaster.pid" ]; then
      as_owner "$bin/pg_ctl" -D "$data" -m immediate -w stop >/dev/null 2>&1 || true
    fi
    rm -rf "$dir"
    ;;
  *)
    echo "unknown command $cmd" >&2
    exit 2
    ;;
esac
