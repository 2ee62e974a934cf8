#!/usr/bin/env bash
# Start Prefect process workers on this machine: one on pool `gpu` per GPU, plus one on pool `cpu`.
#
#   infra/start-workers.sh        # one gpu worker per GPU that nvidia-smi lists
#   infra/start-workers.sh 2      # two gpu workers (GPUs 0 and 1), whatever nvidia-smi says (or KDFLOW_GPU_WORKERS=2)
#
# GPU worker i sees only GPU i (CUDA_VISIBLE_DEVICES=i) and runs one flow run at a time (--limit 1): one
# teacher or student per GPU. On another GPU machine, point PREFECT_API_URL at the server and run this
# script there with KDFLOW_CPU_WORKER=0 if that machine should take GPU work only.
#   KDFLOW_CPU_WORKER=0|1 (1)   KDFLOW_CPU_WORKER_LIMIT (4): concurrent runs on the cpu worker
#   KDFLOW_WORKER_PREFIX (short host name): worker names are PREFIX-gpu-i and PREFIX-cpu, unique per pool
#   KDFLOW_STUDENT_GPUS (unset): e.g. 0,1,2,3 or all. Student training with student.distributed
#     (torchrun, several GPUs) needs a worker that sees those GPUs: this starts PREFIX-student on the gpu
#     pool's `student` queue (where train-student/llmjp goes) and keeps the per-GPU workers on the
#     `default` queue. Unset, the per-GPU workers take every queue and a student trains on one GPU.
# Rerunning starts only the workers that are not running (to change queues: infra/stop-all.sh workers).
# Logs and pid files: $KDFLOW_STATE_DIR/worker-*.
set -euo pipefail
. "$(dirname "$0")/lib.sh"

count_gpus() {
  if command -v nvidia-smi >/dev/null 2>&1; then nvidia-smi -L 2>/dev/null | grep -c '^GPU ' || true; else echo 0; fi
}

GPU_WORKERS=${1:-${KDFLOW_GPU_WORKERS:-$(count_gpus)}}
[[ "$GPU_WORKERS" =~ ^[0-9]+$ ]] || die "the number of GPU workers must be a whole number, got '$GPU_WORKERS'"
CPU_WORKER=${KDFLOW_CPU_WORKER:-1}
CPU_LIMIT=${KDFLOW_CPU_WORKER_LIMIT:-4}
[[ "$CPU_LIMIT" =~ ^[1-9][0-9]*$ ]] || die "KDFLOW_CPU_WORKER_LIMIT must be a positive whole number, got '$CPU_LIMIT'"
PREFIX=${KDFLOW_WORKER_PREFIX:-$(hostname -s)}
STUDENT_GPUS=${KDFLOW_STUDENT_GPUS:-}
[ -z "$STUDENT_GPUS" ] || [ "$STUDENT_GPUS" = all ] || [[ "$STUDENT_GPUS" =~ ^[0-9]+(,[0-9]+)*$ ]] \
  || die "KDFLOW_STUDENT_GPUS must be a comma-separated list of GPU indices or 'all', got '$STUDENT_GPUS'"
PREFECT_API_URL=$(api_url)
export PREFECT_API_URL
PREFECT=$(prefect_bin)
cd "$KDFLOW_REPO"

start_worker() {  # $1: label, $2: pool, $3: limit, $4: queue ("" = every queue), then `env` arguments
  local label=$1 pool=$2 limit=$3 queue=$4
  shift 4
  local pid_file="$STATE_DIR/worker-$label.pid" log_file="$STATE_DIR/worker-$label.log"
  if pid_alive "$pid_file" "worker start"; then
    note "worker $PREFIX-$label already running (pid $(cat "$pid_file"))"
    return 0
  fi
  start_detached "$pid_file" "$log_file" env "$@" "$PREFECT" worker start --pool "$pool" --type process \
    --name "$PREFIX-$label" --limit "$limit" ${queue:+--work-queue "$queue"}
  note "started worker $PREFIX-$label on pool $pool${queue:+ queue $queue} (pid $(cat "$pid_file")), log in $log_file"
}

if [ "$GPU_WORKERS" -eq 0 ] && [ -z "${1:-}${KDFLOW_GPU_WORKERS:-}" ]; then
  note "no GPU workers: nvidia-smi lists no GPU here (give a number to start some anyway)"
fi
GPU_QUEUE=""
if [ -n "$STUDENT_GPUS" ]; then
  GPU_QUEUE=default
  if [ "$STUDENT_GPUS" = all ]; then
    start_worker student gpu 1 student -u CUDA_VISIBLE_DEVICES
  else
    start_worker student gpu 1 student "CUDA_VISIBLE_DEVICES=$STUDENT_GPUS"
  fi
fi
for ((i = 0; i < GPU_WORKERS; i++)); do
  start_worker "gpu-$i" gpu 1 "$GPU_QUEUE" "CUDA_VISIBLE_DEVICES=$i"
done
if [ "$CPU_WORKER" = 1 ]; then
  start_worker cpu cpu "$CPU_LIMIT" "" "CUDA_VISIBLE_DEVICES="
fi
