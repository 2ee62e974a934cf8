#!/usr/bin/env bash
# The GPU check, as it runs on the lent GPU machine: no network, the machine's own python3 (torch, transformers,
# pyarrow, pandas... from its image), kdflow installed from this working tree and the missing packages from the
# wheels carried in .whl/ (infra/gpu-wheels.sh downloads them here; infra/gpu-wheels.txt lists them), both with
# `pip --no-index` into a folder put first on PYTHONPATH. Then `kdflow bench gpu` (kdflow/bench/gpu.py) within
# what is left of the time limit. Every step, set-up included, is recorded as ok, skipped (with its reason) or
# failed (with its error), and the rest go on; one JSON summary is written to a file and printed last. A check
# stopped at the limit still leaves a summary of every step it finished (and the one it was in, as failed).
#
#   infra/gpu-check.sh                          # on the GPU machine, from the repository root
#   infra/gpu-check.sh --device cpu             # the same at the rehearsal's sizes on a CPU
#   infra/gpu-check.sh --plan                   # only the plan at full size (sizes, memory, what would skip)
#   infra/gpu-check.sh --only teacher_pass_L4_4bit,logits_precision   # those steps and what they need
#   infra/gpu-check.sh --again gpu-check-first.json   # what that summary shows failed or skipped for its budget
#
# Environment: KDFLOW_PYTHON (default python3), KDFLOW_GPU_CHECK_TIMEOUT_S (the whole check, set-up included;
# default 540, under the 600 s one command may run there), KDFLOW_GPU_CHECK_OUT (the summary file, default
# gpu-check.json; $OUT/gpu-check.json where $OUT is a folder, as on the lent machine, which also gets the whole
# stderr as $OUT/gpu-check.log), KDFLOW_GPU_SITE (the install folder, default /tmp/kdflow-gpu-site), WHEEL_DIR
# (default .whl), KDFLOW_GPU_WORK (a folder kept for a second call on the same machine, `--work-dir`: its teachers
# and tuned micro-batch are reused, so `--only` does not build them again). A short table of the steps is printed
# last, on stderr.
# Exit code 0 when no step failed.
set -uo pipefail
cd "$(dirname "$0")/.."
PYTHON="${KDFLOW_PYTHON:-python3}"
LIMIT="${KDFLOW_GPU_CHECK_TIMEOUT_S:-540}"
SUMMARY="${KDFLOW_GPU_CHECK_OUT:-gpu-check.json}"
if [[ -n "${OUT:-}" && -d "$OUT" ]]; then
    # On the lent machine only what is written under $OUT comes back, and of the output only its last 12,000
    # characters, which a full-size summary outgrows: the summary goes there, and a copy of everything on stderr.
    SUMMARY="${KDFLOW_GPU_CHECK_OUT:-$OUT/gpu-check.json}"
    exec 2> >(tee -a "$OUT/gpu-check.log" >&2)
    TEE_PID=$!
fi
SITE="${KDFLOW_GPU_SITE:-/tmp/kdflow-gpu-site}"
WHEELS="${WHEEL_DIR:-.whl}"
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false TRANSFORMERS_VERBOSITY=error
export PYTHONUNBUFFERED=1 PIP_DISABLE_PIP_VERSION_CHECK=1
started=$SECONDS
LOG="$(mktemp)"
trap 'rm -f "$LOG"' EXIT

# record NAME STATUS SECONDS [DETAIL]: one set-up step as a JSON line (status ok | skipped | failed).
record() {
    "$PYTHON" -c 'import json, sys
name, status, seconds, detail = sys.argv[1:5]
key = {"failed": "error", "skipped": "reason"}.get(status, "detail")
print(json.dumps({"name": name, "status": status, "seconds": float(seconds)} | ({key: detail} if detail else {})))' \
        "$1" "$2" "$3" "${4:-}" >>"$LOG"
}

brief() {  # the summary as one short line a step, on stderr, last: what the end of the output shows
    "$PYTHON" -c 'import json, sys
summary = json.load(open(sys.argv[1]))
state, seconds = ("ok" if summary["ok"] else "FAILED"), summary.get("seconds", "?")
profile = summary["steps"].get("profile", {})
if profile.get("status") == "ok":  # where the pass spends its time, by kernel family: above the steps
    basis, layers, rows = profile["time_basis"], profile["layers"], profile["micro_batch"]
    print(f"profile: {layers} layers, micro-batch {rows}, {basis}")
    for family, share in sorted(profile["share"].items(), key=lambda item: -item[1]):
        print(f"  {family:<22} {profile[basis][family] / 1000:>10.2f} ms {share:>7.1%}")
print(f"gpu-check: {state}, {seconds} s; the whole summary: {sys.argv[1]}")
for name, step in summary["steps"].items():
    status, took, why = step["status"], step.get("seconds", "-"), str(step.get("error") or step.get("reason") or "")
    print(f"  {name:<24} {status:<8} {took:>7}  {why[:80]}".rstrip())' "$SUMMARY" >&2 || true
}

finish() {  # finish CODE: the table last, then (with $OUT) wait until tee has written everything, and exit
    brief
    if [[ -n "${TEE_PID:-}" ]]; then
        exec 2>&-
        wait "$TEE_PID" 2>/dev/null || true
    fi
    exit "$1"
}

step() {  # step NAME COMMAND...: run it, record ok or failed with its last line of output
    local name=$1 t0=$SECONDS out
    shift
    if out=$("$@" 2>&1); then
        record "$name" ok $((SECONDS - t0))
    else
        record "$name" failed $((SECONDS - t0)) "$(printf '%s\n' "$out" | grep -v '^\s*$' | tail -1)"
        printf '%s\n' "$out" >&2
        return 1
    fi
}

rm -rf "$SITE" && mkdir -p "$SITE"
rm -f "$SUMMARY"
shopt -s nullglob
wheels=("$WHEELS"/*.whl)
if ((${#wheels[@]})); then
    step setup_wheels "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$SITE" \
        "${wheels[@]}"
else
    record setup_wheels skipped 0 "no wheels in $WHEELS (infra/gpu-wheels.sh downloads them)"
fi
export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
# Run from the repository root, yet import kdflow from $SITE: without this, Python puts the working directory
# first on sys.path, and the tree's kdflow/ (whose subpackages live in schemas/, tasks/, flows/ and are mapped
# only by an install) shadows the installed one. Children inherit it. Python 3.11 and newer.
export PYTHONSAFEPATH=1
# The check times compiled Triton kernels: an interpreter left switched on (TRITON_INTERPRET=1) would time numpy.
unset TRITON_INTERPRET
# kdflow itself, from this tree (its dependencies are the image's and the wheels: --no-deps).
step setup_kdflow "$PYTHON" -m pip install -q --no-index --no-deps --no-build-isolation --no-compile \
    --no-cache-dir --target "$SITE" . || true
step setup_import "$PYTHON" -c "import sys, kdflow.bench.gpu, kdflow.schemas.config, torch, transformers
if not kdflow.__file__.startswith(sys.argv[1]): sys.exit(f'kdflow imported from {kdflow.__file__}, not {sys.argv[1]}')
" "$SITE" || true
if [[ " $* " == *" --plan "* ]]; then
    cat "$LOG" >&2
    exec "$PYTHON" -m kdflow bench gpu "$@"
fi

left=$((LIMIT - (SECONDS - started)))
budget=$((left - 30))  # the check's own steps stop starting this long before the limit, for the summary
PROGRESS="$(mktemp)"
trap 'rm -f "$LOG" "$PROGRESS"' EXIT
work=()
[[ -n "${KDFLOW_GPU_WORK:-}" ]] && work=(--work-dir "$KDFLOW_GPU_WORK")
timeout --kill-after=10 "$left" "$PYTHON" -m kdflow bench gpu --budget-s "$budget" --setup-log "$LOG" \
    --progress-log "$PROGRESS" --out "$SUMMARY" "${work[@]}" "$@"
code=$?
if ((code == 124 || code == 137)) || [[ ! -s "$SUMMARY" ]]; then
    # The check did not write its summary (killed at the limit, or it could not start): write one from the set-up
    # and from each step it finished (its progress log); the step it was in is failed, as stopped.
    record check failed $((SECONDS - started)) "kdflow bench gpu exited $code (limit ${LIMIT} s)"
    "$PYTHON" -c 'import json, sys
steps = [json.loads(line) for path in sys.argv[1:3] for line in open(path) if line.strip()]
results = {s.pop("name"): s for s in steps}  # a step'"'"'s last line wins: running, then its outcome
for result in results.values():
    if result["status"] == "running":
        result.update(status="failed", error="still running when the check was stopped")
failed = [n for n, s in results.items() if s["status"] == "failed"]
text = json.dumps({"bench": "gpu_check", "ok": False, "failed": failed, "steps": results})
open(sys.argv[3], "w").write(text + "\n")
print(text)' "$LOG" "$PROGRESS" "$SUMMARY"
    finish 1
fi
finish "$code"
