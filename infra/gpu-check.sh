#!/usr/bin/env bash
# The GPU check: every CUDA path of kdflow in a few minutes, with no hub access, ending in one JSON line.
#
#   infra/gpu-check.sh                      # on a CUDA machine, from the repository (after infra/setup.sh)
#   infra/gpu-check.sh --out gpu-check.json # also keep the summary in a file
#   infra/gpu-check.sh --device cpu         # the dry run: the same steps at small sizes on the CPU
#
# It builds a tiny Qwen3-MoE teacher with the reference vocabulary (196,608 ids) and loads it in 4-bit
# through bitsandbytes, runs `kdflow tune precompute` on it, the teacher pass in its worker process,
# `kdflow bench precompute` and `kdflow bench loss` on the device, a few bf16-autocast student steps, and
# a 2-process FSDP step when two GPUs are visible (kdflow/bench/gpu.py). Exit code 0 when every step passed.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${KDFLOW_PYTHON:-.venv/bin/python}"
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false TRANSFORMERS_VERBOSITY=error
exec timeout "${KDFLOW_GPU_CHECK_TIMEOUT_S:-900}" "$PYTHON" -m kdflow bench gpu "$@"
