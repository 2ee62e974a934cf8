# Shared settings and helpers for the infra scripts. Sourced, never run.
#
# Every setting comes from the environment, with a default for one machine:
#   KDFLOW_STATE_DIR     pid files, logs, the API URL            (infra/.state)
#   KDFLOW_PGDATA        the PostgreSQL cluster folder           (infra/.pgdata)
#   KDFLOW_PG_PORT       PostgreSQL port on 127.0.0.1            (5433, beside a system server on 5432)
#   KDFLOW_PG_USER / KDFLOW_PG_DB   database user and database   (prefect / prefect)
#   KDFLOW_PG_PASSWORD   that user's password: read from the environment only, never written anywhere
#   KDFLOW_PREFECT_PORT  Prefect server port on 127.0.0.1        (4200)
#   KDFLOW_PYTHON        the Python whose `prefect` to run        (active venv, else .venv, else PATH)
# Everything listens on loopback only; see docs/operations.md for more machines.

KDFLOW_REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
STATE_DIR=${KDFLOW_STATE_DIR:-$KDFLOW_REPO/infra/.state}
PGDATA_DIR=${KDFLOW_PGDATA:-$KDFLOW_REPO/infra/.pgdata}
PG_PORT=${KDFLOW_PG_PORT:-5433}
PG_USER=${KDFLOW_PG_USER:-prefect}
PG_DB=${KDFLOW_PG_DB:-prefect}
PREFECT_PORT=${KDFLOW_PREFECT_PORT:-4200}
LOOPBACK=127.0.0.1

die() { echo "error: $*" >&2; exit 1; }
note() { echo "[kdflow infra] $*" >&2; }

# Python: $KDFLOW_PYTHON, else the active virtual environment, else the project's .venv, else PATH.
# `prefect` is the one installed beside that Python.
python_bin() {
  if [ -n "${KDFLOW_PYTHON:-}" ]; then echo "$KDFLOW_PYTHON"
  elif [ -n "${VIRTUAL_ENV:-}" ] && [ -x "$VIRTUAL_ENV/bin/python" ]; then echo "$VIRTUAL_ENV/bin/python"
  elif [ -x "$KDFLOW_REPO/.venv/bin/python" ]; then echo "$KDFLOW_REPO/.venv/bin/python"
  else command -v python3 || die "python3 not found"; fi
}
prefect_bin() {
  local beside
  beside="$(dirname "$(python_bin)")/prefect"
  if [ -x "$beside" ]; then echo "$beside"
  else command -v prefect || die "prefect not found: run infra/setup.sh or activate the virtual environment"; fi
}

# PREFECT_API_URL from the environment, else the one start-server.sh recorded (a URL, no secret).
api_url() {
  if [ -n "${PREFECT_API_URL:-}" ]; then echo "$PREFECT_API_URL"
  elif [ -f "$STATE_DIR/api-url" ]; then cat "$STATE_DIR/api-url"
  else die "PREFECT_API_URL is not set and no server was started here (run infra/start-server.sh)"; fi
}

http_ok() {  # $1: URL; true when it answers 2xx
  if command -v curl >/dev/null; then curl -sf -o /dev/null --max-time 5 "$1"
  else "$(python_bin)" -c 'import sys, urllib.request; urllib.request.urlopen(sys.argv[1], timeout=5)' "$1" 2>/dev/null; fi
}

port_in_use() { (exec 3<>"/dev/tcp/$LOOPBACK/$1") 2>/dev/null; }

check_port() {
  [[ "$1" =~ ^[0-9]+$ ]] && [ "$1" -ge 1 ] && [ "$1" -le 65535 ] || die "port must be a number in 1..65535, got '$1'"
}

check_identifier() {  # $1: setting name, $2: value (a PostgreSQL identifier we splice into SQL)
  [[ "$2" =~ ^[a-z_][a-z0-9_]{0,62}$ ]] || die "$1 must be a lower-case SQL identifier ([a-z_][a-z0-9_]*), got '$2'"
}

# A pid file names a live process of ours only if the process exists and its command line mentions $2;
# after a reboot the number may belong to someone else.
pid_alive() {  # $1: pid file, $2: word expected in the command line
  local pid
  [ -f "$1" ] || return 1
  pid=$(cat "$1")
  [[ "$pid" =~ ^[0-9]+$ ]] && [ -r "/proc/$pid/cmdline" ] || return 1
  tr '\0' ' ' <"/proc/$pid/cmdline" | grep -q -- "$2"
}

# Start a command in its own session (so its whole process group can be stopped), output to a log file.
start_detached() {  # $1: pid file, $2: log file, then the command
  local pid_file=$1 log_file=$2
  shift 2
  setsid "$@" >>"$log_file" 2>&1 </dev/null &
  echo $! >"$pid_file"
}

# Stopping the process group a pid file names, in two halves so that several can stop in parallel:
# term_pidfile sends TERM; reap_pidfile waits up to $4 seconds (10), then sends KILL. Quiet if it is gone.
# (A Prefect worker's graceful shutdown on TERM can hang; flow runs it started live in their own sessions
# and are not touched either way.)
term_pidfile() {  # $1: pid file, $2: word expected in the command line
  pid_alive "$1" "$2" || return 0
  kill -TERM -- "-$(cat "$1")" 2>/dev/null || kill -TERM "$(cat "$1")" 2>/dev/null || true
}
reap_pidfile() {  # $1: pid file, $2: word expected in the command line, $3: label, $4: grace seconds
  local pid
  if ! pid_alive "$1" "$2"; then rm -f "$1"; return 0; fi
  pid=$(cat "$1")
  for _ in $(seq 1 $((${4:-10} * 5))); do
    kill -0 "$pid" 2>/dev/null || break
    sleep 0.2
  done
  if kill -0 "$pid" 2>/dev/null; then kill -KILL -- "-$pid" 2>/dev/null || kill -KILL "$pid" 2>/dev/null || true; fi
  rm -f "$1"
  note "stopped $3 (pid $pid)"
}
stop_pidfile() { term_pidfile "$1" "$2"; reap_pidfile "$@"; }

# PostgreSQL refuses to run as root: as root, run its tools as the `postgres` user, from a folder it can read.
pg_superuser() { if [ "$(id -u)" -eq 0 ]; then echo postgres; else id -un; fi; }
as_pg_owner() {
  if [ "$(id -u)" -eq 0 ]; then
    id postgres >/dev/null 2>&1 || die "running as root needs the 'postgres' system user (initdb refuses root)"
    (cd / && runuser -u postgres -- "$@")
  else
    "$@"
  fi
}

mkdir -p "$STATE_DIR"
chmod 700 "$STATE_DIR"
