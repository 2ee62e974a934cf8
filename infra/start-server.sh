#!/usr/bin/env bash
# Start a Prefect server on 127.0.0.1, backed by the PostgreSQL of infra/start-postgres.sh.
#
#   KDFLOW_PG_PASSWORD=... infra/start-server.sh     # prints: export PREFECT_API_URL=http://127.0.0.1:4200/api
#
# The database URL is built from KDFLOW_PG_* (see infra/lib.sh), or taken as given from
# PREFECT_SERVER_DATABASE_CONNECTION_URL; either way it reaches the server through its environment only.
# Waits until /api/health answers (KDFLOW_SERVER_TIMEOUT seconds, 180). Rerunning with a healthy server
# just prints its URL. State: $KDFLOW_STATE_DIR/server.{pid,log}, prefect-home/, api-url.
set -euo pipefail
. "$(dirname "$0")/lib.sh"

check_port "$PREFECT_PORT"
API_URL="http://$LOOPBACK:$PREFECT_PORT/api"
PID_FILE="$STATE_DIR/server.pid"
LOG_FILE="$STATE_DIR/server.log"
TIMEOUT=${KDFLOW_SERVER_TIMEOUT:-180}

report() {
  echo "$API_URL" >"$STATE_DIR/api-url"
  note "Prefect server healthy; UI at http://$LOOPBACK:$PREFECT_PORT"
  echo "export PREFECT_API_URL=$API_URL"
}

if pid_alive "$PID_FILE" "server start"; then
  http_ok "$API_URL/health" || die "a server started here (pid $(cat "$PID_FILE")) is not healthy; see $LOG_FILE or run infra/stop-all.sh"
  report
  exit 0
fi
port_in_use "$PREFECT_PORT" && die "port $PREFECT_PORT is taken by another program; set KDFLOW_PREFECT_PORT"

if [ -z "${PREFECT_SERVER_DATABASE_CONNECTION_URL:-}" ]; then
  : "${KDFLOW_PG_PASSWORD:?set KDFLOW_PG_PASSWORD (or PREFECT_SERVER_DATABASE_CONNECTION_URL) for the server database}"
  check_identifier KDFLOW_PG_USER "$PG_USER"
  check_identifier KDFLOW_PG_DB "$PG_DB"
  check_port "$PG_PORT"
  # Percent-encode the password for the URL; it stays in this shell's memory and the server's environment.
  ENCODED=$("$(python_bin)" -c 'import os, urllib.parse; print(urllib.parse.quote(os.environ["KDFLOW_PG_PASSWORD"], safe=""))')
  export PREFECT_SERVER_DATABASE_CONNECTION_URL="postgresql+asyncpg://$PG_USER:$ENCODED@$LOOPBACK:$PG_PORT/$PG_DB"
  unset ENCODED
fi
case "$PREFECT_SERVER_DATABASE_CONNECTION_URL" in
  postgresql+asyncpg://*) ;;
  *) die "PREFECT_SERVER_DATABASE_CONNECTION_URL must start with postgresql+asyncpg:// (Prefect talks to PostgreSQL through asyncpg)" ;;
esac
"$(python_bin)" -c 'import asyncpg' 2>/dev/null || die "the Python package asyncpg is missing: pip install -e '.[postgres]'"

mkdir -p "$STATE_DIR/prefect-home"
: >"$LOG_FILE"
export PREFECT_HOME="$STATE_DIR/prefect-home" PREFECT_SERVER_ANALYTICS_ENABLED=false
start_detached "$PID_FILE" "$LOG_FILE" "$(prefect_bin)" server start --host "$LOOPBACK" --port "$PREFECT_PORT"
note "starting the Prefect server (pid $(cat "$PID_FILE")), log in $LOG_FILE"

deadline=$((SECONDS + TIMEOUT))
until http_ok "$API_URL/health"; do
  if ! pid_alive "$PID_FILE" "server start"; then
    tail -n 20 "$LOG_FILE" >&2
    die "the Prefect server exited during start-up; see $LOG_FILE"
  fi
  [ "$SECONDS" -lt "$deadline" ] || die "the Prefect server was not healthy after ${TIMEOUT}s; see $LOG_FILE"
  sleep 0.5
done
report
