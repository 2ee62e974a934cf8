#!/usr/bin/env bash
# Start a PostgreSQL cluster for the Prefect server, on 127.0.0.1 only; create it on first use.
#
#   KDFLOW_PG_PASSWORD=... infra/start-postgres.sh
#
# Creates the cluster in $KDFLOW_PGDATA (infra/.pgdata), starts it on $KDFLOW_PG_PORT (5433), creates the
# database user and database (prefect/prefect) and prints the connection URL with the password left out.
# Rerunning is safe: a running cluster is left alone and the user's password is set to the current value.
# As root (CI, containers) the cluster belongs to the `postgres` system user, because initdb refuses root.
set -euo pipefail
. "$(dirname "$0")/lib.sh"

: "${KDFLOW_PG_PASSWORD:?set KDFLOW_PG_PASSWORD to the password for the database user (read from the environment only)}"
check_port "$PG_PORT"
check_identifier KDFLOW_PG_USER "$PG_USER"
check_identifier KDFLOW_PG_DB "$PG_DB"
for tool in initdb pg_ctl psql; do
  command -v "$tool" >/dev/null || die "$tool not found: install PostgreSQL (e.g. apt-get install postgresql) or use infra/compose.yaml"
done
SUPERUSER=$(pg_superuser)

mkdir -p "$PGDATA_DIR"
if [ "$(id -u)" -eq 0 ]; then chown postgres:postgres "$PGDATA_DIR"; fi
chmod 700 "$PGDATA_DIR"
as_pg_owner test -w "$PGDATA_DIR" \
  || die "user $SUPERUSER cannot write $PGDATA_DIR (a parent folder is closed to it); set KDFLOW_PGDATA to another folder"

if [ ! -f "$PGDATA_DIR/PG_VERSION" ]; then
  note "creating a PostgreSQL cluster in $PGDATA_DIR"
  # Local socket: only the cluster's owner (peer). TCP: password (scram) for everyone, loopback only.
  as_pg_owner initdb -D "$PGDATA_DIR" -U "$SUPERUSER" --encoding=UTF8 --locale=C.UTF-8 \
    --auth-local=peer --auth-host=scram-sha-256 >"$STATE_DIR/initdb.log" 2>&1 \
    || die "initdb failed; see $STATE_DIR/initdb.log"
fi

running_port() { sed -n 4p "$PGDATA_DIR/postmaster.pid" 2>/dev/null || true; }

if as_pg_owner pg_ctl -D "$PGDATA_DIR" status >/dev/null 2>&1; then
  [ "$(running_port)" = "$PG_PORT" ] \
    || die "the cluster in $PGDATA_DIR already runs on port $(running_port); set KDFLOW_PG_PORT=$(running_port) or stop it (infra/stop-all.sh)"
  note "PostgreSQL already running on $LOOPBACK:$PG_PORT"
else
  port_in_use "$PG_PORT" && die "port $PG_PORT is taken by another program; set KDFLOW_PG_PORT"
  # The socket lives in the cluster folder, so nothing outside it (like /var/run/postgresql) is needed.
  as_pg_owner pg_ctl -D "$PGDATA_DIR" -l "$PGDATA_DIR/server.log" -w -t 60 \
    -o "-c listen_addresses=$LOOPBACK -p $PG_PORT -k $PGDATA_DIR" start >/dev/null \
    || die "PostgreSQL did not start; see $PGDATA_DIR/server.log"
  note "PostgreSQL started on $LOOPBACK:$PG_PORT"
fi

# The password travels through the environment (\getenv), never through a command line or a file.
as_pg_owner psql -h "$PGDATA_DIR" -p "$PG_PORT" -U "$SUPERUSER" -d postgres -X -q -v ON_ERROR_STOP=1 \
  -v user="$PG_USER" -v db="$PG_DB" >/dev/null <<'SQL'
\getenv password KDFLOW_PG_PASSWORD
SELECT NOT EXISTS (SELECT 1 FROM pg_roles WHERE rolname = :'user') AS create_role \gset
\if :create_role
CREATE ROLE :"user" LOGIN PASSWORD :'password';
\else
ALTER ROLE :"user" LOGIN PASSWORD :'password';
\endif
SELECT NOT EXISTS (SELECT 1 FROM pg_database WHERE datname = :'db') AS create_db \gset
\if :create_db
CREATE DATABASE :"db" OWNER :"user";
\endif
\connect :"db"
SET client_min_messages = warning;
-- Prefect's migrations index names with trigrams; create the extension as the superuser up front.
CREATE EXTENSION IF NOT EXISTS pg_trgm;
SQL

echo "postgresql+asyncpg://$PG_USER:\${KDFLOW_PG_PASSWORD}@$LOOPBACK:$PG_PORT/$PG_DB"
