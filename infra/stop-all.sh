#!/usr/bin/env bash
# Stop what the infra scripts started on this machine: workers, the Prefect server, PostgreSQL.
# First the flow runs in progress that were started on this machine are cancelled, while their workers can still
# stop them (infra/stop_flow_runs.py; a process worker starts each run in its own session, so a run would outlive
# its worker and go on holding its GPU). Their committed work stays: a rerun resumes. Data stays (the cluster in
# $KDFLOW_PGDATA, logs in $KDFLOW_STATE_DIR); rerunning this script is safe.
#
#   infra/stop-all.sh             # everything
#   infra/stop-all.sh workers     # only the workers (e.g. before restarting them with other settings)
#   KDFLOW_STOP_GRACE_S (30): how long the workers get to stop their runs; a run still going then is ended here
set -euo pipefail
. "$(dirname "$0")/lib.sh"

WHAT=${1:-all}
case "$WHAT" in all | workers) ;; *) die "usage: infra/stop-all.sh [all|workers], got '$WHAT'" ;; esac
GRACE_S=${KDFLOW_STOP_GRACE_S:-30}
[[ "$GRACE_S" =~ ^[0-9]+$ ]] || die "KDFLOW_STOP_GRACE_S must be a whole number of seconds, got '$GRACE_S'"

shopt -s nullglob
if API=$(api_url 2>/dev/null); then
  if http_ok "$API/health"; then
    PREFECT_API_URL=$API "$(python_bin)" "$KDFLOW_REPO/infra/stop_flow_runs.py" --grace-s "$GRACE_S" || true
  else
    note "no Prefect server answers at $API: flow runs started here, if any, were not cancelled"
  fi
fi
workers=("$STATE_DIR"/worker-*.pid)
for pid_file in "${workers[@]}"; do term_pidfile "$pid_file" "worker start"; done
# A worker's graceful shutdown may hang: give them all 5 s together, then KILL whatever is left.
for _ in $(seq 1 25); do
  alive=0
  for pid_file in "${workers[@]}"; do pid_alive "$pid_file" "worker start" && alive=1; done
  [ "$alive" = 0 ] && break
  sleep 0.2
done
for pid_file in "${workers[@]}"; do reap_pidfile "$pid_file" "worker start" "$(basename "$pid_file" .pid)" 0; done
[ "$WHAT" = workers ] && exit 0

stop_pidfile "$STATE_DIR/server.pid" "server start" "Prefect server"

if [ -f "$PGDATA_DIR/postmaster.pid" ] && as_pg_owner pg_ctl -D "$PGDATA_DIR" status >/dev/null 2>&1; then
  as_pg_owner pg_ctl -D "$PGDATA_DIR" -m fast -w stop >/dev/null
  note "stopped PostgreSQL ($PGDATA_DIR)"
fi
